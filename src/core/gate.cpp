#include "core/gate.h"

#include <cuda_runtime_api.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace difuse::detail {

namespace {

bool default_capture_probe(void* stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status);
  if (err == cudaErrorStreamCaptureImplicit || err == cudaErrorStreamCaptureUnsupported) {
    (void)cudaGetLastError();
    return true;  // another stream captures in global mode: a legacy-stream sync would break it
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return false;  // no usable device: nothing is being captured
  }
  return status != cudaStreamCaptureStatusNone;
}

std::atomic<CaptureProbe> g_probe{&default_capture_probe};
std::mutex g_settings_mu;
LogSink g_sink = nullptr;
void* g_sink_user = nullptr;
std::string g_platform_note;

}  // namespace

BitExactGate::Table::Table(size_t cap) : capacity(cap), slots(new std::atomic<const std::string*>[cap]) {
  for (size_t i = 0; i < cap; ++i) slots[i].store(nullptr, std::memory_order_relaxed);
}

bool BitExactGate::Table::contains(std::string_view sig) const {
  if (capacity == 0) return false;
  const size_t mask = capacity - 1;
  for (size_t i = std::hash<std::string_view>{}(sig) & mask;; i = (i + 1) & mask) {
    const std::string* s = slots[i].load(std::memory_order_acquire);
    if (s == nullptr) return false;  // at most half full: an empty slot ends every probe
    if (*s == sig) return true;
  }
}

void BitExactGate::Table::insert(const std::string* sig) {
  const size_t mask = capacity - 1;
  size_t i = std::hash<std::string_view>{}(*sig) & mask;
  while (slots[i].load(std::memory_order_relaxed) != nullptr) i = (i + 1) & mask;
  slots[i].store(sig, std::memory_order_release);
  count.fetch_add(1, std::memory_order_release);
}

BitExactGate::BitExactGate(std::string op, GateMode mode) : op_(std::move(op)), mode_(mode) {
  std::lock_guard<std::mutex> lock(mu_);
  tables_.push_back(std::make_unique<Table>(0));
  for (auto& d : devices_) d.verified.store(tables_.front().get(), std::memory_order_release);
}

size_t BitExactGate::slots_held() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& t : tables_) n += t->capacity;
  return n;
}

BitExactGate::~BitExactGate() = default;

BitExactGate::Device& BitExactGate::dev(int device) {
  if (device < 0 || device >= kMaxDevices)
    throw Failure(DIFUSE_ERR_INVALID_ARGUMENT,
                  "BitExactGate(" + op_ + "): device " + std::to_string(device) + " outside [0, " +
                      std::to_string(kMaxDevices) + ")");
  return devices_[static_cast<size_t>(device)];
}
const BitExactGate::Device& BitExactGate::dev(int device) const { return const_cast<BitExactGate*>(this)->dev(device); }

bool BitExactGate::verified_in(const Device& d, std::string_view sig) const {
  return mode_ == GateMode::Once ? d.any.load(std::memory_order_acquire)
                                 : d.verified.load(std::memory_order_acquire)->contains(sig);
}

GateDecision BitExactGate::decide(int device, std::string_view sig, bool capturing, void* stream) {
  Device& d = dev(device);
  if (d.disabled.load(std::memory_order_acquire)) {
    note_fallback(device, DIFUSE_FALLBACK_DISABLED);
    return GateDecision::Fallback;
  }
  if (verified_in(d, sig)) {
    d.fused_calls.fetch_add(1, std::memory_order_relaxed);
    return GateDecision::RunFused;
  }
  if (capturing || g_probe.load(std::memory_order_acquire)(stream)) {
    note_fallback(device, DIFUSE_FALLBACK_CAPTURING);
    return GateDecision::Fallback;
  }
  return GateDecision::Verify;
}

bool BitExactGate::begin_verify(int device, std::string_view sig) {
  Device& d = dev(device);
  mu_.lock();
  if (d.disabled.load(std::memory_order_acquire) || verified_in(d, sig)) {
    mu_.unlock();
    return false;
  }
  pending_device_ = device;
  pending_sig_.assign(sig.data(), sig.size());
  owner_.store(std::this_thread::get_id(), std::memory_order_release);
  return true;
}

void BitExactGate::check_owner(const char* what) const {
  if (owner_.load(std::memory_order_acquire) != std::this_thread::get_id())
    throw Failure(DIFUSE_ERR_INVALID_ARGUMENT,
                  std::string("BitExactGate(") + op_ + ")." + what + " without a matching begin_verify on this thread");
}

void BitExactGate::end_verify(int device, std::string_view sig, int64_t mismatches, std::string_view detail) {
  check_owner("end_verify");
  // this thread holds mu_ since its begin_verify: adopt it before anything can throw, so every exit releases it
  owner_.store(std::thread::id(), std::memory_order_release);
  std::unique_lock<std::mutex> lock(mu_, std::adopt_lock);
  if (device != pending_device_ || sig != pending_sig_)
    throw Failure(DIFUSE_ERR_INVALID_ARGUMENT,
                  "BitExactGate(" + op_ + ").end_verify(cuda:" + std::to_string(device) + ", " + std::string(sig) +
                      ") does not end what begin_verify started (cuda:" + std::to_string(pending_device_) + ", " +
                      pending_sig_ + "): nothing recorded");
  Device& d = dev(device);
  d.verifications.fetch_add(1, std::memory_order_relaxed);
  if (mismatches == 0) {
    // A Once gate records the signature too (counters() reports it); its readers ask `any` alone.
    Table* t = d.verified.load(std::memory_order_acquire);
    if (!t->contains(sig)) {
      owned_.emplace_back(sig);
      const int64_t n = t->count.load(std::memory_order_relaxed);
      if (static_cast<size_t>(n + 1) * 2 > t->capacity) {  // publish a table twice the size (16 at first)
        auto bigger = std::make_unique<Table>(t->capacity ? 2 * t->capacity : 16);
        for (size_t i = 0; i < t->capacity; ++i)
          if (const std::string* s = t->slots[i].load(std::memory_order_relaxed)) bigger->insert(s);
        bigger->insert(&owned_.back());
        d.verified.store(bigger.get(), std::memory_order_release);
        tables_.push_back(std::move(bigger));
      } else {
        t->insert(&owned_.back());  // one slot from nullptr to the string: readers see it or not
      }
    }
    d.any.store(true, std::memory_order_release);
    d.fused_calls.fetch_add(1, std::memory_order_relaxed);  // the verified fused output is the one returned
    return;
  }
  std::ostringstream os;
  os << "difuse: " << op_ << " disabled for good on cuda:" << device << ": ";
  if (mismatches > 0) {
    os << mismatches << " elements differ from the eager reference";
    note_fallback(device, DIFUSE_FALLBACK_MISMATCH);
  } else {
    os << "the fused op failed on the host";
    note_fallback(device, DIFUSE_FALLBACK_HOST_ERROR);
  }
  os << " for signature " << sig;
  if (!detail.empty()) os << " (" << detail << ")";
  os << "; the eager chain runs from now on; platform: " << platform_description(device);
  disable_locked(device, os.str());
}

void BitExactGate::disable(int device, std::string_view reason) {
  std::lock_guard<std::mutex> lock(mu_);
  std::ostringstream os;
  os << "difuse: " << op_ << " disabled for good on cuda:" << device << ": " << reason
     << "; the eager chain runs from now on; platform: " << platform_description(device);
  disable_locked(device, os.str());
}

void BitExactGate::disable_locked(int device, const std::string& line) {
  Device& d = dev(device);
  if (!d.disabled.exchange(true, std::memory_order_acq_rel)) log_line(line);
}

void BitExactGate::note_fallback(int device, int reason) {
  Device& d = dev(device);
  if (reason < 0 || reason >= DIFUSE_FALLBACK_REASON_COUNT)
    throw Failure(DIFUSE_ERR_INVALID_ARGUMENT, "unknown fallback reason " + std::to_string(reason));
  d.fallbacks.fetch_add(1, std::memory_order_relaxed);
  d.reasons[static_cast<size_t>(reason)].fetch_add(1, std::memory_order_relaxed);
}

void BitExactGate::note_fused(int device) { dev(device).fused_calls.fetch_add(1, std::memory_order_relaxed); }

void BitExactGate::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& d : devices_) {
    d.verified.store(tables_.front().get(), std::memory_order_release);
    d.any.store(false, std::memory_order_release);
    d.disabled.store(false, std::memory_order_release);
    d.verifications.store(0);
    d.fused_calls.store(0);
    d.fallbacks.store(0);
    for (auto& r : d.reasons) r.store(0);
  }
}

bool BitExactGate::is_verified(int device, std::string_view sig) const {
  const Device& d = dev(device);
  return verified_in(d, sig);
}

difuse_gate_counters BitExactGate::counters(int device) const {
  const Device& d = dev(device);
  difuse_gate_counters c{};
  c.verified_signatures = d.verified.load(std::memory_order_acquire)->count.load(std::memory_order_acquire);
  c.verifications = d.verifications.load();
  c.fused_calls = d.fused_calls.load();
  c.fallbacks = d.fallbacks.load();
  for (size_t i = 0; i < d.reasons.size(); ++i) c.fallback_reasons[i] = d.reasons[i].load();
  c.disabled = d.disabled.load() ? 1 : 0;
  return c;
}

void BitExactGate::set_capture_probe(CaptureProbe probe) {
  g_probe.store(probe ? probe : &default_capture_probe, std::memory_order_release);
}

void BitExactGate::set_log_sink(LogSink sink, void* user) {
  std::lock_guard<std::mutex> lock(g_settings_mu);
  g_sink = sink;
  g_sink_user = user;
}

void BitExactGate::set_platform_note(std::string note) {
  std::lock_guard<std::mutex> lock(g_settings_mu);
  g_platform_note = std::move(note);
}

std::string BitExactGate::driver_version_from_proc_line(std::string_view line) {
  const auto pos = line.find("Kernel Module");
  if (pos == std::string_view::npos) return {};
  std::istringstream rest{std::string(line.substr(pos + 13))};
  std::string token;
  while (rest >> token)  // "Kernel Module  580.…" (proprietary) or "Open Kernel Module for x86_64  580.…"
    if (token[0] >= '0' && token[0] <= '9') return token;
  return {};
}

std::string BitExactGate::platform_description(int device) {
  std::ostringstream os;
  {
    std::lock_guard<std::mutex> lock(g_settings_mu);
    if (!g_platform_note.empty()) os << g_platform_note << ", ";
  }
  int rt = 0, drv = 0;
  if (cudaRuntimeGetVersion(&rt) == cudaSuccess) os << "CUDA runtime " << rt / 1000 << "." << (rt % 1000) / 10;
  if (cudaDriverGetVersion(&drv) == cudaSuccess) os << ", driver API " << drv / 1000 << "." << (drv % 1000) / 10;
  {
    std::ifstream f("/proc/driver/nvidia/version");  // "NVRM version: NVIDIA UNIX ... Kernel Module  580.159.04 ..."
    std::string line;
    if (f && std::getline(f, line)) {
      const std::string ver = driver_version_from_proc_line(line);
      if (!ver.empty()) os << " (NVIDIA driver " << ver << ")";
    }
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) == cudaSuccess)
    os << ", GPU " << prop.name << " (sm_" << prop.major << prop.minor << ")";
  else
    os << ", GPU unavailable";
  (void)cudaGetLastError();
  return os.str();
}

void BitExactGate::log_line(const std::string& line) {
  LogSink sink;
  void* user;
  {
    std::lock_guard<std::mutex> lock(g_settings_mu);
    sink = g_sink;
    user = g_sink_user;
  }
  if (sink)
    sink(line.c_str(), user);
  else
    std::fprintf(stderr, "%s\n", line.c_str());
}

}  // namespace difuse::detail
