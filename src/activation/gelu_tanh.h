// gelu_tanh: F.gelu(x, approximate="tanh") in bf16, bit-exact (contract in gelu_tanh.cu).
#pragma once

#include <cuda_runtime_api.h>

#include "core/device.h"
#include "core/error.h"
#include "difuse/difuse.h"

namespace difuse::activation {

// Whether the table kernel (lookups in shared memory instead of ~40 instructions of tanhf per element) pays on a
// device moving `dram_bytes_per_sm_cycle` (detail::dram_bytes_per_sm_cycle): only where DRAM outpaces the SMs
// (detail::dram_outpaces_sms, 15.5 bytes per SM cycle); where DRAM feeds each SM fewer bytes a cycle, the computing
// kernel keeps up with memory and the lookups only add MIO traffic. knob is DIFUSE_GELU_TABLE:
// 1 the table, 0 the computing kernel, anything else (the default, -1) by the device; a device whose clocks the runtime
// does not report (0) keeps the table, the choice before this policy (0f6077d). Both give the same bits.
// On a whole H100 SXM (12.8 bytes per SM cycle) eager's computing kernel runs at copy speed, 70.4 us at 1x4096x12288,
// and the table kernel took 76.8 (bench/results/h100/gelu-whole-gpu-a1823fb/); on the H200 (18.42) eager's is
// ALU-bound, 59.6 us against a 50.5 us stream, and the table kernel faster, 59.2 (f59b89a). On the whole H100 the
// computing kernel then ran 72.5 us against the table's 76.8-77.0 (a07f842, bench/results/h100/gelu-table-by-device-a07f842/).
// The H100's ratios were first arithmetic on its clocks and bus width (2,619 MHz memory, 1,980 MHz SM, 5,120 bits);
// the runtime returned them on H100s at b556bfc and 67b5eeb: 12.83 on the whole GPU (bench's platform line and
// records), 18.01 at 94 SMs (the sweep records in bench/results/h100/grrms-streamed-67b5eeb/), and
// test_sm_partition.py's test_dram_bytes_per_sm_cycle_follows_the_launch_sm_count passed. The H200 read 18.42 at
// fd5c83b (bench/results/h200/bench-fd5c83b.log's platform line and ops.json's records; estimated 18.8 from 6,144 bits
// at 3,201 MHz and a 1,980 MHz SM clock before): the table stays its default.
inline bool gelu_table_pays(double dram_bytes_per_sm_cycle, int knob) {
  return knob == 1 || (knob != 0 && detail::dram_outpaces_sms(dram_bytes_per_sm_cycle));
}

detail::Support can_use_gelu_tanh(const difuse_tensor_view& out, const difuse_tensor_view& x);
void gelu_tanh(const difuse_tensor_view& out, const difuse_tensor_view& x, cudaStream_t stream);

}  // namespace difuse::activation
