// aten's intra-warp tree of its fused RMSNorm (vectorized_layer_norm_kernel<bf16, float, true>: offsets 16, 8, 4,
// 2, 1; s = RN(s + s_in)) on one of layernorm_schedule.h's thread maps: the sums rms_norm's staged and streamed rows
// and the Wan attention prologue (rope/qk_norm_rope_wan.cu) reduce. Device code only.
#pragma once

#include "norm/layernorm_schedule.h"

namespace difuse::norm {

// A shuffle where the partner aten thread is in another lane, an in-thread combine where the map holds both (the
// paired map's offset 1). s: the thread's Map::kSlots partial sums, one per aten thread it holds.
template <class Map>
__device__ __forceinline__ void rms_map_tree(float (&s)[Map::kSlots]) {
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) {
    const int delta = Map::lane_delta(o);
    if (delta > 0) {
#pragma unroll
      for (int j = 0; j < Map::kSlots; ++j) s[j] = rms_combine(s[j], __shfl_down_sync(0xffffffffu, s[j], delta));
    } else {
#pragma unroll
      for (int j = 0; j < Map::kSlots; ++j)
        if (Map::receives(o, j)) s[j] = rms_combine(s[j], s[Map::partner_slot(o, j)]);
    }
  }
}

}  // namespace difuse::norm
