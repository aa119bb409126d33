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

bool require_cuda_device(Support& s, const difuse_tensor_view& v, const std::string& name) {
  DIFUSE_REQUIRE(s, v.device >= 0, name + " must be on a CUDA device, got host memory");
  DIFUSE_REQUIRE(s, v.device < kMaxDevices, name + " is on cuda:" + std::to_string(v.device) +
                                                ", outside the devices 0.." + std::to_string(kMaxDevices - 1) +
                                                " difuse supports");
  return v.device >= 0 && v.device < kMaxDevices;
}

bool require_bf16_row_view(Support& s, const difuse_tensor_view& x, const char* name) {
  const std::string n(name);
  DIFUSE_REQUIRE(s, x.dtype == DIFUSE_BF16, n + " must be bf16, got " + difuse_dtype_name(x.dtype));
  require_cuda_device(s, x, n);
  if (x.rank < 1 || x.rank > 4) {
    DIFUSE_REQUIRE(s, false, n + " must have rank 1 to 4, got " + describe(x));
    return false;
  }
  DIFUSE_REQUIRE(s, x.strides[x.rank - 1] == 1 || x.sizes[x.rank - 1] <= 1,
                 n + " must have a contiguous last dim, got " + describe(x));
  bool nonneg = true;
  for (int d = 0; d < x.rank; ++d) nonneg = nonneg && x.strides[d] >= 0;
  DIFUSE_REQUIRE(s, nonneg, n + " must have non-negative strides, got " + describe(x));
  return true;
}

void require_bf16_output(Support& s, const difuse_tensor_view& out, const difuse_tensor_view& like,
                         const char* like_name, std::initializer_list<const difuse_tensor_view*> inputs) {
  const std::string like_n(like_name);
  DIFUSE_REQUIRE(s, out.dtype == DIFUSE_BF16, std::string("out must be bf16, got ") + difuse_dtype_name(out.dtype));
  bool same = out.rank == like.rank;
  for (int d = 0; same && d < like.rank; ++d) same = out.sizes[d] == like.sizes[d];
  DIFUSE_REQUIRE(s, same, "out must have the shape of " + like_n + ", got " + describe(out));
  DIFUSE_REQUIRE(s, is_contiguous(out), "out must be contiguous, got " + describe(out));
  DIFUSE_REQUIRE(s, out.device == like.device, "out must be on the device of " + like_n + ", got " + describe(out));
  if (numel(like) == 0) return;
  DIFUSE_REQUIRE(s, out.data != nullptr && aligned(out.data, 8), "out must be non-null and 8-byte aligned");
  bool clear = true;
  for (const auto* in : inputs) clear = clear && !overlaps(out, *in);
  DIFUSE_REQUIRE(s, clear, "out must not overlap the inputs");
}

}  // namespace difuse::detail
