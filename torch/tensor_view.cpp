#include "tensor_view.h"

#include <c10/util/Exception.h>

namespace difuse::torch_binding {

namespace {
int32_t to_dtype(c10::ScalarType s) {
  switch (s) {
    case c10::ScalarType::BFloat16: return DIFUSE_BF16;
    case c10::ScalarType::Half: return DIFUSE_F16;
    case c10::ScalarType::Float: return DIFUSE_F32;
    case c10::ScalarType::Float8_e4m3fn: return DIFUSE_F8E4M3;
    case c10::ScalarType::Int: return DIFUSE_I32;
    case c10::ScalarType::Long: return DIFUSE_I64;
    default: return -1;  // reported by the op's predicate as an unsupported dtype
  }
}
}  // namespace

difuse_tensor_view to_view(const at::Tensor& t) {
  difuse_tensor_view v{};
  TORCH_CHECK_VALUE(t.dim() <= DIFUSE_MAX_RANK, "difuse: tensors of rank > 8 are not supported, got rank ", t.dim());
  v.data = t.numel() ? const_cast<void*>(t.const_data_ptr()) : nullptr;
  v.dtype = to_dtype(t.scalar_type());
  v.rank = static_cast<int32_t>(t.dim());
  for (int64_t i = 0; i < t.dim(); ++i) {
    v.sizes[i] = t.size(i);
    v.strides[i] = t.stride(i);
  }
  v.device = t.is_cuda() ? t.get_device() : -1;
  return v;
}

void check_status(difuse_status s, const char* op) {
  if (s == DIFUSE_OK) return;
  if (s == DIFUSE_ERR_UNSUPPORTED) TORCH_CHECK_VALUE(false, difuse_last_error());
  TORCH_CHECK(false, "difuse::", op, " failed (", difuse_status_name(s), "): ", difuse_last_error());
}

}  // namespace difuse::torch_binding
