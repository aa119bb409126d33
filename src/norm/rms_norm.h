// rms_norm: torch.nn.RMSNorm / F.rms_norm (aten's fused kernel), bit-exact (contract in rms_norm.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/device.h"
#include "core/error.h"
#include "difuse/difuse.h"

namespace difuse::norm {

// weight may be a view with data == nullptr (no weight).
detail::Support can_use_rms_norm(const difuse_tensor_view& out, const difuse_tensor_view& x,
                                 const difuse_tensor_view& weight, double eps);
void rms_norm(const difuse_tensor_view& out, const difuse_tensor_view& x, const difuse_tensor_view& weight, double eps,
              cudaStream_t stream);

// Whether rows of n > 128 elements, `rows` of them, go to the streamed rows (rms_norm_streamed; the launcher also
// needs n % 8 == 0 and 16-byte aligned rows and out): knob is DIFUSE_RMS_STREAMED (> 0 always, 0 never, < 0 unset:
// the default, 129..2048 elements and at least 8192 rows on a device where DRAM outpaces the SMs
// (detail::dram_outpaces_sms on detail::dram_bytes_per_sm_cycle: 15.5 bytes per SM cycle; 0, unknown, keeps the
// streamed rows, the choice before this rule); contract in rms_norm.cu, STREAMED_DEFAULT).
// The H200 (18.42 read) ran 1x32760x1536 in 57.2 us streamed against 63.0 in aten's layout (b9178f7); a whole
// H100 SXM (12.83 as read) in 81.2 / 81.3 streamed against 76.4 / 76.4 (eager 77.2; 485a376,
// bench/results/h100/rms-norm-streamed-485a376/): the ring pays only where each SM has more bytes to keep in flight.
bool rms_norm_streamed_by_default(int64_t n, int64_t rows, int knob, double dram_bytes_per_sm_cycle);

}  // namespace difuse::norm
