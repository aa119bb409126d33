// Internal helpers over difuse_tensor_view used by predicates: every check returns a readable reason.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/error.h"
#include "difuse/difuse.h"

namespace difuse::detail {

int64_t dtype_size(int32_t dtype);  // 0 for an unknown dtype
std::string describe(const difuse_tensor_view& v);  // "bf16[1, 4096, 3072] strides [..] cuda:0"
int64_t numel(const difuse_tensor_view& v);
bool is_contiguous(const difuse_tensor_view& v);
// Bytes spanned by the view: [data, data + extent_bytes) holds every element (0 for an empty view).
int64_t extent_bytes(const difuse_tensor_view& v);
bool overlaps(const difuse_tensor_view& a, const difuse_tensor_view& b);
inline uintptr_t address(const difuse_tensor_view& v) { return reinterpret_cast<uintptr_t>(v.data); }
inline bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Every row of a bf16 view starts `bytes`-aligned: the pointer and each leading stride (dims of size 1 aside).
inline bool rows_aligned(const difuse_tensor_view& x, uintptr_t bytes) {
  if (!aligned(x.data, bytes)) return false;
  for (int d = 0; d + 1 < x.rank; ++d)
    if (x.sizes[d] > 1 && (x.strides[d] * 2) % static_cast<int64_t>(bytes) != 0) return false;
  return true;
}

// The one row stride of a view whose leading dims collapse into rows of its last dim, or -1 when they do not
// collapse. Dims of size 1 are skipped whatever their stride (torch gives them any): each leading dim of size > 1
// must step over the rows of the next inner one of size > 1. One row (no leading dim of size > 1): the width, as a
// dense view's; rank 1: its size; rank 0: 1. A negative stride comes back negative (the callers refuse it).
inline int64_t collapsed_row_stride(const difuse_tensor_view& v) {
  if (v.rank <= 1) return v.rank == 1 ? v.sizes[0] : 1;
  bool found = false;
  int64_t stride = 0, next = 0;  // the row stride; the stride the next outer dim of size > 1 must have
  for (int d = v.rank - 2; d >= 0; --d) {
    if (v.sizes[d] <= 1) continue;
    if (!found) {
      found = true;
      stride = v.strides[d];
    } else if (v.strides[d] != next) {
      return -1;
    }
    next = v.strides[d] * v.sizes[d];
  }
  return found ? stride : v.sizes[v.rank - 1];
}

// Shared predicate pieces (each adds every violation it finds to s).
// The devices difuse serves: its per-device caches (device.h) and gates (gate.h) hold ordinals 0..63.
constexpr int kMaxDevices = 64;
// `name` is on a CUDA device difuse serves: not host memory (-1), not an ordinal past kMaxDevices - 1 (whose
// launch the per-device caches refuse). False when it is not.
bool require_cuda_device(Support& s, const difuse_tensor_view& v, const std::string& name);
// A bf16 row view on a CUDA device: rank 1..4, last dim contiguous, non-negative strides. False when the rank
// is out of range (the caller then stops: the other checks index the dims).
bool require_bf16_row_view(Support& s, const difuse_tensor_view& x, const char* name);
// An output the op writes: bf16, contiguous, the shape of `like` (named `like_name` in the reasons), on its device,
// 8-byte aligned, overlapping none of `inputs` (views with a null data pointer are skipped).
void require_bf16_output(Support& s, const difuse_tensor_view& out, const difuse_tensor_view& like,
                         const char* like_name, std::initializer_list<const difuse_tensor_view*> inputs);

}  // namespace difuse::detail
