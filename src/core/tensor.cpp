#include "core/tensor.h"

#include <sstream>

namespace difuse::detail {

int64_t dtype_size(int32_t dtype) {
  switch (dtype) {
    case DIFUSE_BF16:
    case DIFUSE_F16:
      return 2;
    case DIFUSE_F32:
    case DIFUSE_I32:
      return 4;
    case DIFUSE_F8E4M3:
      return 1;
    case DIFUSE_I64:
      return 8;
    default:
      return 0;
  }
}

int64_t numel(const difuse_tensor_view& v) {
  int64_t n = 1;
  for (int i = 0; i < v.rank; ++i) n *= v.sizes[i];
  return n;
}

bool is_contiguous(const difuse_tensor_view& v) {
  if (numel(v) == 0) return true;  // as torch: an empty tensor is contiguous whatever its strides
  int64_t expected = 1;
  for (int i = v.rank - 1; i >= 0; --i) {
    if (v.sizes[i] != 1 && v.strides[i] != expected) return false;
    expected *= v.sizes[i];
  }
  return true;
}

int64_t extent_bytes(const difuse_tensor_view& v) {
  if (numel(v) == 0) return 0;
  int64_t last = 0;
  for (int i = 0; i < v.rank; ++i) last += (v.sizes[i] - 1) * (v.strides[i] < 0 ? 0 : v.strides[i]);
  return (last + 1) * dtype_size(v.dtype);
}

bool overlaps(const difuse_tensor_view& a, const difuse_tensor_view& b) {
  if (a.data == nullptr || b.data == nullptr || a.device != b.device) return false;
  const uintptr_t a0 = address(a), a1 = a0 + static_cast<uintptr_t>(extent_bytes(a));
  const uintptr_t b0 = address(b), b1 = b0 + static_cast<uintptr_t>(extent_bytes(b));
  return a0 < b1 && b0 < a1;
}

std::string describe(const difuse_tensor_view& v) {
  std::ostringstream os;
  os << difuse_dtype_name(v.dtype) << "[";
  for (int i = 0; i < v.rank; ++i) os << (i ? ", " : "") << v.sizes[i];
  os << "] strides [";
  for (int i = 0; i < v.rank; ++i) os << (i ? ", " : "") << v.strides[i];
  os << "] on " << (v.device < 0 ? std::string("host") : "cuda:" + std::to_string(v.device));
  return os.str();
}

}  // namespace difuse::detail
