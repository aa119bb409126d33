// DIFUSE_QK_ROWS_PER_WARP: the measurement knob of the attention-prologue launchers (qk_norm_rope,
// qk_norm_rope_qwen, qk_norm_sd35). Rows a warp loads before reducing; each launcher maps the value onto the
// variants it instantiates and keeps its measured default when the variable is unset or not a positive number.
// Read once per process. The arithmetic of a row is the same in every variant.
#pragma once

#include "core/env_knob.h"

namespace difuse::rope {

inline int rows_per_warp_knob() {
  static const int knob = detail::positive_env_knob("DIFUSE_QK_ROWS_PER_WARP");
  return knob;  // 0: unset
}

}  // namespace difuse::rope
