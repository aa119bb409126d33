// Makes a CUDA device current for a scope and restores the previous one (checked calls); a device's SM count, read
// once per device (or the benchmarks' SM partition's), and its DRAM bytes per SM cycle.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "core/error.h"
#include "core/tensor.h"

namespace difuse::detail {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    DIFUSE_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) {
      DIFUSE_CUDA_CHECK(cudaSetDevice(device));
      switched_ = true;
    }
  }
  ~DeviceGuard() {
    if (switched_) (void)cudaSetDevice(previous_);  // best effort: destructors do not throw
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
  bool switched_ = false;
};

// The per-device caches (SM counts, kernel attributes, shared-memory budgets, counter pools) hold devices 0..63:
// `device` as their index, or an INVALID_ARGUMENT failure for one outside (it would alias another device's entry).
inline int device_slot(int device) {
  if (device < 0 || device >= kMaxDevices)
    throw Failure(DIFUSE_ERR_INVALID_ARGUMENT,
                  "CUDA device " + std::to_string(device) + " is outside the devices 0..63 difuse supports");
  return device;
}

// The SM count launchers size their grids for on `device` instead of the device's own, 0 for none: set only by the
// benchmarks' SM partition (probe/sm_partition.h, `bench ops --sms N`), whose kernels run on that many SMs.
inline std::atomic<int>& launch_sm_override(int device) {
  static std::atomic<int> counts[kMaxDevices];
  return counts[device_slot(device)];
}

// The SM count of the device itself, read with one checked runtime call the first time each device asks. Devices
// 0..63; racing first calls read the same value.
inline int device_sm_count(int device) {
  static std::atomic<int> cached[kMaxDevices];  // 0: not read yet
  const int d = device_slot(device);
  int sms = cached[d].load(std::memory_order_acquire);
  if (sms == 0) {
    DIFUSE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    cached[d].store(sms, std::memory_order_release);
  }
  return sms;
}

// The SM count launchers that size a grid to the GPU use (they call this on every launch): the benchmarks' override
// above where set, else the device's own.
inline int sm_count(int device) {
  const int partition = launch_sm_override(device).load(std::memory_order_acquire);
  return partition > 0 ? partition : device_sm_count(device);
}

// Peak DRAM bytes per cycle of the whole chip's SM clock: (memory clock x 2, double data rate) x bus width / 8 over
// the SM clock, both in kHz as the runtime reports them. An H100 SXM (2,619 MHz x 5,120 bits, 1,980 MHz) moves 1,693
// bytes a cycle, 12.8 per SM of its 132. Host arithmetic only (CPU-tested).
inline double dram_bytes_per_cycle(int64_t memory_clock_khz, int64_t bus_width_bits, int64_t sm_clock_khz) {
  return sm_clock_khz <= 0 || memory_clock_khz <= 0 || bus_width_bits <= 0 ? 0.0
                           : static_cast<double>(memory_clock_khz) * 2.0 * static_cast<double>(bus_width_bits) / 8.0 /
                                 static_cast<double>(sm_clock_khz);
}

// Whether DRAM outpaces the SMs' arithmetic on a device moving `dram_bytes_per_sm_cycle` (dram_bytes_per_sm_cycle
// below): the one rule behind the defaults that were chosen on the H200 and lose on a whole H100 SXM, gelu_tanh's
// table (gelu_table_pays), rms_norm's streamed rows (rms_norm_streamed_by_default) and the plain LayerNorms' streamed
// rows wider than 4096 (plain_layernorm_streamed_by_default). At or above 15.5: the H200 (18.42 read) and 94
// of an H100's SMs (18.01 as read); below: a whole H100 SXM (12.83 as read), where the table kernel was 9 % slower
// than eager's gelu (a07f842), rms_norm's streamed rows 6 % slower than aten's layout (485a376) and the LayerNorms'
// at 1x32760x5120 5-9 % slower than their staged kernels (bf84066). 0 (the runtime reported no clocks) counts as
// outpacing: the choices made before the rule.
constexpr double kDramOutpacesSmsBytesPerSmCycle = 15.5;
inline bool dram_outpaces_sms(double dram_bytes_per_sm_cycle) {
  return dram_bytes_per_sm_cycle <= 0.0 || dram_bytes_per_sm_cycle >= kDramOutpacesSmsBytesPerSmCycle;
}

// How many bytes DRAM can move per SM per SM cycle on `device` at its peak clocks: the arithmetic a memory-bound
// kernel may spend per byte before its SMs, not DRAM, set the pace. The chip's bytes per cycle are read once per
// device (three checked runtime calls); the SM count is sm_count()'s, so the benchmarks' SM partition counts as the
// smaller device it stands in for (94 of an H100's SMs: 18.01 as read on an H100 at 67b5eeb, the whole H100 12.83;
// the H200 18.42 as read at fd5c83b). 0 where the runtime reports no
// clock or bus width (callers then keep their earlier choice).
inline double dram_bytes_per_sm_cycle(int device) {
  static std::atomic<double> cached[kMaxDevices];  // 0: not read yet; -1: read, unknown
  const int d = device_slot(device);
  double per_cycle = cached[d].load(std::memory_order_acquire);
  if (per_cycle == 0.0) {
    int mem_khz = 0, bus_bits = 0, sm_khz = 0;
    DIFUSE_CUDA_CHECK(cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, device));
    DIFUSE_CUDA_CHECK(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device));
    DIFUSE_CUDA_CHECK(cudaDeviceGetAttribute(&sm_khz, cudaDevAttrClockRate, device));
    per_cycle = dram_bytes_per_cycle(mem_khz, bus_bits, sm_khz);
    if (!(per_cycle > 0.0)) per_cycle = -1.0;
    cached[d].store(per_cycle, std::memory_order_release);
  }
  return per_cycle > 0.0 ? per_cycle / sm_count(device) : 0.0;
}

}  // namespace difuse::detail
