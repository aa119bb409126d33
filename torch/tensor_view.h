// at::Tensor -> difuse_tensor_view (metadata only; no copy, no ownership).
#pragma once

#include <ATen/core/Tensor.h>

#include "difuse/difuse.h"

namespace difuse::torch_binding {

difuse_tensor_view to_view(const at::Tensor& t);
// Raises a Python-visible error carrying difuse_last_error() for a non-OK status.
void check_status(difuse_status s, const char* op);

}  // namespace difuse::torch_binding
