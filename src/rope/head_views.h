// Predicate pieces shared by the per-head diffusers-RMSNorm attention prologues (qk_norm_rope_qwen, qk_norm_sd35):
// each adds every violation it finds to the Support.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "core/error.h"
#include "core/tensor.h"
#include "difuse/difuse.h"

namespace difuse::rope::heads {

inline bool present(const difuse_tensor_view& v) { return v.data != nullptr || v.rank != 0; }

// A required rank-4 bf16 head view (`layout` names its dims in the messages); false when it is absent or its rank
// is wrong (the caller then skips shape comparisons).
inline bool require_view(detail::Support& s, const difuse_tensor_view& x, const char* name, const char* layout) {
  if (!present(x)) {
    DIFUSE_REQUIRE(s, false, std::string(name) + " is required");
    return false;
  }
  if (!detail::require_bf16_row_view(s, x, name)) return false;
  if (x.rank != 4) {
    DIFUSE_REQUIRE(s, false, std::string(name) + " must be " + layout + ", got " + detail::describe(x));
    return false;
  }
  return true;
}

// The runs a lane loads: E elements at element offsets that are multiples of E (pointer and the three leading
// strides).
inline void require_runs_aligned(detail::Support& s, const difuse_tensor_view& x, const char* name, int E) {
  if (detail::numel(x) == 0) return;
  bool ok = detail::aligned(x.data, static_cast<uintptr_t>(2 * E));
  for (int d = 0; d < 3; ++d) ok = ok && (x.sizes[d] <= 1 || x.strides[d] % E == 0);
  DIFUSE_REQUIRE(s, ok, std::string(name) + " rows must be " + std::to_string(2 * E) +
                            "-byte aligned (pointer and strides; " + std::to_string(E) +
                            " elements per lane at this head_dim), got " + detail::describe(x));
}

// The q, k, v views of one stream: each of sizes `want` on `device` (`group` names the rule in the message), each
// with its lanes' runs aligned for E elements.
inline void require_stream(detail::Support& s,
                           std::initializer_list<std::pair<const difuse_tensor_view*, const char*>> views,
                           const int64_t (&want)[4], int device, const std::string& group, int E) {
  for (const auto& [v, name] : views) {
    bool same = v->device == device;
    for (int d = 0; d < 4; ++d) same = same && v->sizes[d] == want[d];
    DIFUSE_REQUIRE(s, same, group + ", got " + detail::describe(*v));
    require_runs_aligned(s, *v, name, E);
  }
}

// head_dim: aten's mean runs its (32, 16) block with one warp per row from 32 elements; the kernels hold a row in
// one warp (<= 128) in runs of 2 (<= 64) or 4 elements.
inline void require_head_dim(detail::Support& s, int64_t D) {
  DIFUSE_REQUIRE(s, D >= 32 && D <= 128 && D % 2 == 0 && (D <= 64 || D % 4 == 0),
                 "head_dim must be in [32, 128], even, and a multiple of 4 above 64 (aten's mean runs one warp per "
                 "row from 32 elements; one warp holds a head), got " + std::to_string(D));
}

// The rows one norm normalises (that norm's input tensor), and the mean configuration they select.
inline void require_norm_rows(detail::Support& s, const char* stream, int64_t rows, int64_t D) {
  DIFUSE_REQUIRE(s, rows >= 16,
                 std::string("the ") + stream + " stream's norms see " + std::to_string(rows) +
                     " rows (batch * tokens * heads); aten's mean needs at least 16 for its (32, 16) block (fewer "
                     "change the block shape, not replayed)");
  DIFUSE_REQUIRE(s, rows * D <= (int64_t{1} << 29),
                 std::string("the ") + stream + " stream has more than 2^29 elements per tensor (aten splits the "
                 "fp32 mean's iterator past 2^31 bytes; not replayed)");
}

inline void require_weight(detail::Support& s, const difuse_tensor_view& w, const char* name, int64_t D, int device) {
  if (!present(w)) return;
  const std::string n(name);
  DIFUSE_REQUIRE(s, w.dtype == DIFUSE_BF16,
                 n + " must be bf16 like q (an fp32 weight multiplies in fp32: another chain), got " +
                     difuse_dtype_name(w.dtype));
  DIFUSE_REQUIRE(s, w.rank == 1 && w.sizes[0] == D && w.strides[0] == 1,
                 n + " must be a contiguous [" + std::to_string(D) + "], got " + detail::describe(w));
  DIFUSE_REQUIRE(s, w.device == device, n + " must be on the device of q, got " + detail::describe(w));
  DIFUSE_REQUIRE(s, w.data != nullptr && detail::aligned(w.data, 8), n + " must be 8-byte aligned");
}

// A joint output: bf16, contiguous, sizes {a, b, c, d}, on the device, 8-byte aligned, overlapping no input.
inline void require_output(detail::Support& s, const difuse_tensor_view& out, const char* name,
                           const int64_t (&sizes)[4], int device,
                           std::initializer_list<const difuse_tensor_view*> inputs) {
  const std::string n(name);
  if (!present(out)) {
    DIFUSE_REQUIRE(s, false, n + " is required");
    return;
  }
  const std::string want = "[" + std::to_string(sizes[0]) + ", " + std::to_string(sizes[1]) + ", " +
                           std::to_string(sizes[2]) + ", " + std::to_string(sizes[3]) + "]";
  DIFUSE_REQUIRE(s, out.dtype == DIFUSE_BF16, n + " must be bf16, got " + difuse_dtype_name(out.dtype));
  bool same = out.rank == 4;
  for (int d = 0; same && d < 4; ++d) same = out.sizes[d] == sizes[d];
  DIFUSE_REQUIRE(s, same && detail::is_contiguous(out),
                 n + " must be a contiguous " + want + ", got " + detail::describe(out));
  DIFUSE_REQUIRE(s, out.device == device, n + " must be on the device of q, got " + detail::describe(out));
  DIFUSE_REQUIRE(s, detail::numel(out) == 0 || (out.data != nullptr && detail::aligned(out.data, 8)),
                 n + " must be 8-byte aligned");
  for (const difuse_tensor_view* in : inputs)
    if (present(*in) && in->data != nullptr)
      DIFUSE_REQUIRE(s, !detail::overlaps(out, *in), n + " overlaps an input");
}

// The joint q, k, v outputs: each as require_output has it, and no two overlapping.
inline void require_joint_outputs(detail::Support& s, const difuse_tensor_view& q_out, const difuse_tensor_view& k_out,
                                  const difuse_tensor_view& v_out, const int64_t (&sizes)[4], int device,
                                  std::initializer_list<const difuse_tensor_view*> inputs) {
  require_output(s, q_out, "q_out", sizes, device, inputs);
  require_output(s, k_out, "k_out", sizes, device, inputs);
  require_output(s, v_out, "v_out", sizes, device, inputs);
  DIFUSE_REQUIRE(s, !detail::overlaps(q_out, k_out) && !detail::overlaps(q_out, v_out) &&
                        !detail::overlaps(k_out, v_out),
                 "q_out, k_out and v_out overlap");
}

}  // namespace difuse::rope::heads
