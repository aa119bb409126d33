// BitExactGate: proves a fused path against the live eager chain before trusting it.
//
// State machine, per (gate, device):
//   unverified --verify(0 mismatches)--> verified (per signature, or for the whole device in Once mode)
//   any        --verify(>0 mismatches) or host error or disable()--> disabled for good (one log line)
//   reset() returns every device to unverified with zeroed counters (tests, changed platforms).
// decide() is the hot path: two atomic loads and one hash lookup, no lock. Verification runs under the
// gate's mutex (begin_verify .. end_verify, same thread), so concurrent first calls verify once.
// The verified signatures of a device sit in an open-addressing table of string pointers that readers probe without
// a lock: a verification fills one empty slot (an atomic store), or, at half load, publishes a table twice the size.
// Replaced tables and the strings are kept until the gate goes (a reader may still probe them): memory grows with
// the signatures, not with their square (the earlier copy-per-verification snapshots did).
// A first verification is refused while the stream is being captured into a CUDA graph (the probe) or
// while the caller says it is tracing (torch.compile): the caller then runs the reference.
#pragma once

#include <array>
#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "core/tensor.h"
#include "difuse/difuse.h"

namespace difuse::detail {

enum class GateMode { Once = DIFUSE_GATE_ONCE, PerSignature = DIFUSE_GATE_PER_SIGNATURE };
enum class GateDecision { RunFused = DIFUSE_GATE_RUN_FUSED, Verify = DIFUSE_GATE_VERIFY, Fallback = DIFUSE_GATE_FALLBACK };

using CaptureProbe = bool (*)(void* stream);  // true while `stream` is capturing
using LogSink = void (*)(const char* line, void* user);

class BitExactGate {
 public:
  static constexpr int kMaxDevices = detail::kMaxDevices;

  BitExactGate(std::string op, GateMode mode);
  ~BitExactGate();
  BitExactGate(const BitExactGate&) = delete;
  BitExactGate& operator=(const BitExactGate&) = delete;

  const std::string& op() const { return op_; }
  GateMode mode() const { return mode_; }

  GateDecision decide(int device, std::string_view sig, bool capturing, void* stream);
  bool begin_verify(int device, std::string_view sig);  // true: lock held, compare now
  void end_verify(int device, std::string_view sig, int64_t mismatches, std::string_view detail);
  void note_fallback(int device, int reason);
  void note_fused(int device);
  void disable(int device, std::string_view reason);
  void reset();
  bool is_verified(int device, std::string_view sig) const;
  difuse_gate_counters counters(int device) const;
  // Slots held in every table this gate has made, replaced ones included (the memory bound's test).
  size_t slots_held() const;

  // Process-wide settings.
  static void set_capture_probe(CaptureProbe probe);  // nullptr: cudaStreamIsCapturing
  static void set_log_sink(LogSink sink, void* user);  // nullptr: stderr
  static void set_platform_note(std::string note);
  static std::string platform_description(int device);  // note + CUDA runtime/driver + GPU name
  // The kernel module's version in the first line of /proc/driver/nvidia/version: the first token after
  // "Kernel Module" that starts with a digit ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64
  // 580.159.04 ..." gives "580.159.04"); "" when there is none.
  static std::string driver_version_from_proc_line(std::string_view line);
  static void log_line(const std::string& line);

 private:
  // A fixed-capacity set of signatures (a power of two, at most half full; 0 for the shared empty table). Slots go
  // from nullptr to a string in owned_ once, under mu_.
  struct Table {
    explicit Table(size_t capacity);
    bool contains(std::string_view sig) const;
    void insert(const std::string* sig);  // under mu_; the caller has made room
    const size_t capacity;
    std::unique_ptr<std::atomic<const std::string*>[]> slots;
    std::atomic<int64_t> count{0};
  };
  struct Device {
    std::atomic<Table*> verified{nullptr};  // changed under mu_ only
    std::atomic<bool> any{false};  // Once mode: a signature has been verified
    std::atomic<bool> disabled{false};
    std::atomic<int64_t> verifications{0}, fused_calls{0}, fallbacks{0};
    std::array<std::atomic<int64_t>, DIFUSE_FALLBACK_REASON_COUNT> reasons{};
  };

  Device& dev(int device);
  const Device& dev(int device) const;
  bool verified_in(const Device& d, std::string_view sig) const;
  void check_owner(const char* what) const;
  void disable_locked(int device, const std::string& line);

  const std::string op_;
  const GateMode mode_;
  std::array<Device, kMaxDevices> devices_;
  mutable std::mutex mu_;
  std::atomic<std::thread::id> owner_{};
  int pending_device_ = -1;   // what the owner's begin_verify started (under mu_): end_verify must name the same
  std::string pending_sig_;
  // Tables and signature strings are retired, never freed before the gate: readers hold no lock. tables_[0] is the
  // empty table every device starts from (and returns to at reset()).
  std::vector<std::unique_ptr<Table>> tables_;
  std::deque<std::string> owned_;
};

}  // namespace difuse::detail
