// qk_norm_rope — FLUX.1's attention prologue in one launch, bit-exact against eager PyTorch.
//
// Eager chain reproduced (diffusers 0.42.1 FluxAttnProcessor, double and single blocks), bf16:
//     query = attn.norm_q(query)                  torch.nn.RMSNorm per head (aten's fused kernel, one rounding)
//     key   = attn.norm_k(key)
//     encoder_query = attn.norm_added_q(encoder_query); encoder_key = attn.norm_added_k(encoder_key)
//     query = torch.cat([encoder_query, query], dim=1)   (key and value alike; exact copies)
//     query = apply_rotary_emb(query, (cos, sin), sequence_dim=1)   numerics/rope.h: mul, mul, add, bf16
// The single block has no text stream (no first stream, no v: its value goes to attention untouched).
// Replays: torch 2.11.0+cu130 — the per-head RMSNorm is rms_norm.cu's rows-of-<=128 path (aten's
// vectorized_layer_norm_kernel<BFloat16, float, rms=true>: lane l owns elements 4l..4l+3, s = fma(v, v, s), a
// shuffle-down tree 16..1, rstd = rsqrtf(RN(s / D + eps)), out = bf16(RN(w * RN(rstd * x)))); RoPE is three
// separate fp32 TensorIterator kernels (x.float() * cos, x_rotated.float() * sin, their sum) and .to(bf16).
// One block per joint token: its 2H (3H with v) head rows, each warp loading several rows before reducing any;
// the token's cos and sin rows are read once per lane. A row spans half a warp whose lane u holds aten lanes u and
// u + 16 (see the kernel). By default (128-element heads, rows 16-byte aligned) the block first copies its token's
// rows, tables and weights into shared memory (STAGED, see the kernel; the measured best); with
// DIFUSE_QK_UNSTAGED=1 or DIFUSE_QK_ROWS_PER_WARP (for measurement, and where staging does not apply) each warp
// loads its rows itself, one slot of two rows per warp at a time; with DIFUSE_QK_LANES_PER_ROW=32 (for
// measurement) a row spans a warp (aten's lanes one to one), 3 rows at a time; with DIFUSE_QK_PIPELINED=1 (for
// measurement; slower on the H200) a grid of resident blocks stages each block's next token while it computes
// the current one. Output rows are [B, S_first + S_second, H, D] contiguous, exactly the tensors the eager code
// hands to attention.
//
// Guards (can_use_qk_norm_rope; every violation is reported): q, k (and v) of each stream bf16 [B, S, H, D]
// on one CUDA device, last dim contiguous, non-negative strides, rows 8-byte aligned (strided views: the
// chunks of a fused to_qkv output are fine); 4 <= D <= 128, D % 4 == 0 (aten's vectorized RMSNorm, one warp's
// worth of vectors); the first (text) stream has the second's B, H, D; weights absent or bf16 [D]
// contiguous 8-byte aligned; cos and sin both absent or both fp32 [S_first + S_second, D] contiguous 16-byte
// aligned; outputs contiguous bf16 [B, S_total, H, D], 8-byte aligned, overlapping no input nor one another (v_out
// against q_out and k_out since the thirty-second session); v_out given exactly when v is (and v_first exactly when
// there is a first stream and v).
//
// Verification status: bit-exact on the H200 at 66f5a3b (torch 2.11.0+cu130, sm_90): tests/gpu/test_qk_norm_rope.py
// (249 cases, incl. the q, k, v diffusers' FluxAttnProcessor hands to attention, the half-warp default with 1 and 2
// slots, and the full-warp 2/3/4/6/9-row variants through DIFUSE_QK_LANES_PER_ROW=32), 0 failed, 0 skipped
// (bench/results/h200/tests.json).
// The staged variant ran there at 66f5a3b behind DIFUSE_QK_STAGED=1 (test_staged_rows_variant passed, now
// test_unstaged_rows_variant; bench 0 mismatches, knob-sweeps/); it became the default after that run, and this
// file's tests passed with it at bc88af7 (tests-defaults-bc88af7.json). All of this file's tests passed again at
// 5f8295d (251 cases, tests.json), after the staged kernel was split into stage_token / run_token for the
// pipelined variant (the per-row PTX unchanged; the per-token index code reordered, +21 PTX instructions per
// block, the weights' pointer array no longer in local memory; the other kernels' PTX identical:
// scripts/ptx-diff.sh bc88af7 src/rope/qk_norm_rope.cu), with the pipelined variant itself and the v-copy variant
// (DIFUSE_QK_VCOPY=1; the other kernels' PTX unchanged). Timed there
// (knob-sweeps/ at 5f8295d), both lost to the staged default: 1x4608x24x128 double 54.7 us pipelined, 58.5 with
// v copies, 50.8 staged.
// At 1765206 (after e383706), fewer instructions in the staged kernels, which ncu found issue-bound (0.85 warp
// instructions per scheduler and cycle): the staging copies walk each role's heads by fixed steps
// (staged_token_rows.cuh; ~6 instructions per 16-byte copy, were ~30), and the row loop has head_dim 128 as a constant
// (no bounds predicates, no division branch, the output offset a shift), its output base as one indexed constant load
// (p.out[role], where selects cost ~8 per row) and the weights' presence as a bit mask. SASS of the staged default's
// row loop: 206 -> 164 instructions per slot. Index arithmetic only. On the H200 at 1765206 (the last minutes of device
// time): bench 0 mismatches, 1x4608x24x128 double 50.8 -> 49.0 us (predicted ~46), single 39.8 -> 35.2
// (ops-prologues-1765206.json); 250 of this file's 251 tests passed before the call's time ran out
// (test_pipelined_variant not reached; gpu-tests-partial-1765206.log). After 1765206 every
// kernel finds its token's batch and position by a FastDivU32 made on the host (token_place.h, CPU-tested), where a
// 32-bit division cost ~20 instructions in every warp: the staged default 510 -> 487 SASS instructions in all
// (scripts/sass-loops.sh). And
// where the slot rows are even (FLUX's 24 heads; always for single blocks and the v-copy kernel) the EVEN kernels drop
// the bounds test, zero fill and store guard: row loop 164 -> 153 SASS instructions (scripts/sass-loops.sh). Predicted
// double 49.0 -> ~47 us; measured at 132f46f 48.9 (the time no longer follows the instruction count: the kernel is at
// 84 % of its memory floor). On the H200 at 132f46f this file's 251 tests passed (tests.json) and the bench matched
// (ops.json: double 48.9 us, fused 47.9, single 35.3; target 50: met).
#include "rope/qk_norm_rope.h"
#include "rope/rows_per_warp_knob.h"
#include "rope/staged_token_rows.cuh"
#include "rope/token_rows.cuh"

#include <cuda_runtime.h>

#include <atomic>

#include <string>

#include "core/device.h"
#include "core/env_knob.h"
#include "core/fast_div.h"
#include "core/registry.h"
#include "core/tensor.h"
#include "difuse/numerics/bf16.h"
#include "difuse/numerics/rope.h"
#include "norm/head_rms_span.cuh"
#include "norm/layernorm_schedule.h"

namespace difuse::rope {

namespace {

const detail::KernelRegistration kRegistration{{
    "qk_norm_rope", "cuda", "bit_exact",
    "FLUX.1 attention prologue: RMSNorm(q), RMSNorm(k) per head, cat([text, image]), apply_rotary_emb (real, "
    "interleaved)",
    "verified bit-exact on H200 at 132f46f (torch 2.11.0+cu130, sm_90)", 90, 90,
    "per-head QK RMSNorm + joint concat + RoPE in one launch (fused or separate projections)"}};

constexpr int kWarps = 8;

struct Stream : StreamViews {  // [B, S, H, D] views
  int64_t S = 0;
};

struct Params {
  Stream first, second;
  uint16_t* out[3] = {nullptr, nullptr, nullptr};
  const float* cos = nullptr;
  const float* sin = nullptr;
  int64_t S = 0;  // joint tokens
  int H = 0, D = 0, V = 0, roles = 2;
  float eps = 1e-6f;
  float inv_D = 0.f;        // 1/D when D is a power of two, else 0 (num::div_by_width_rn)
  detail::FastDivU32 heads;  // row -> (role, head) without a division instruction
  detail::FastDivU32 seq;    // token -> (batch, joint position)
};

// SPAN lanes per row (32, or 16 for two rows per warp instruction): lane u of a span holds aten's vectors u,
// u + SPAN, ... and the reduction is norm/head_rms_span.cuh's (aten's bits at either span).
//
// A warp takes R slots at a time (all R loads issued before any reduction, the R shuffle trees interleaved);
// slot i of a token's block holds rows K i .. K i + K - 1 (one per span; row r: role r / H, head r % H), and
// warp w owns slots w, w + 8, ... Rows past the end carry zeros and are not stored. What depends only on the
// token (TokenRows, the output base, the weights, cos and sin) is computed once per block.
//
// STAGED (the default where it applies; head_dim 128, rows 16-byte aligned, the token's rows within 48 KB):
// the block first copies all of its token's rows into shared memory with cp.async (16 bytes per thread and
// copy, every copy in flight at once: 18 KB for a FLUX double-block token, where a warp otherwise has one 512-byte
// slot in flight per round; ncu at 3e989f7: DRAM 60 %, 51 % occupancy), then runs the same per-row arithmetic
// reading its rows from there. Row r of the token sits at r * D elements (r = role * H + head); after the rows come
// the token's cos and sin rows and the q and k weights (192 more 8-byte vectors), also read where used, so the
// kernel holds none of them in registers.

// The rows a block stages and runs through its slots: all of the token's, or with VCOPY only q and k.
template <bool VCOPY>
__device__ __forceinline__ int slot_rows(const Params& p) {
  return (VCOPY ? 2 : p.roles) * p.H;
}

// STAGED layout: issues the copies of token `token`'s rows (row r at 16-byte vector 16 r), then its cos and sin
// rows and its stream's q and k weights (192 8-byte vectors after the rows) into dst. The caller commits or
// waits (cp.async) and synchronises the block. VCOPY: only the q and k rows are staged; the v rows are copied to
// the output here (copy_v_rows).
template <bool VCOPY = false>
__device__ __forceinline__ void stage_token(const Params& p, unsigned token, uint4* dst) {
  const TokenPlace tp = token_place(token, p.seq, p.first.S);
  const Stream& st = tp.in_first ? p.first : p.second;
  const TokenRows tr(st.t[0], st.t[1], st.t[2], tp.b, tp.s);
  const int rows = slot_rows<VCOPY>(p);
  stage_token_rows<16, kWarps * 32>(dst, tr, p.H, VCOPY ? 2 : p.roles);  // 16 copies of 16 bytes per 128-element row
  if (VCOPY && p.roles == 3)  // v out: [B, S_total, H, D] contiguous, head stride D
    copy_v_rows<16, kWarps * 32>(tr.row(2, 0), tr.sh[2], p.out[2] + (tp.b * p.S + tp.sj) * p.H * p.D, p.D, p.H);
  uint2* tab = reinterpret_cast<uint2*>(dst) + rows * 32;
  const int t = static_cast<int>(threadIdx.x);
  if (p.cos != nullptr && t < 64) {  // 32 copies of 16 bytes per table row
    const float* src = (t < 32 ? p.cos : p.sin) + tp.sj * 128 + (t % 32) * 4;
    norm::cp_async(tab + (t < 32 ? 0 : 64) + (t % 32) * 2, src, true);
  } else if (t >= 64 && t < 128 && st.w[(t - 64) / 32] != nullptr) {  // 32 copies of 8 bytes per weight
    const int r = (t - 64) / 32, v = t % 32;
    norm::cp_async(tab + 128 + 32 * r + v, st.w[r] + 4 * v, false);
  }
}

// One token's rows: normalised, rotated and stored by the block's warps (slots as described above). STAGED:
// `staged` holds the token's rows and tables (stage_token's layout), read where used.
// The staged kernels run at head_dim 128 only (the launcher's condition), so there D, the lane vectors' bounds
// and the mean's 1/D are compile-time constants: no per-row bounds predicates, no division branch, the output
// row's offset a shift. A row's output base is p.out[role] (one indexed constant load, where selects among the
// three cost ~8 instructions per row) and its weight's presence a bit of a per-token mask. Index arithmetic only:
// the instructions on the elements are the same.
// EVEN (R == 1, an even number of slot rows): every slot is full, so a row needs no bounds test, zero fill or
// store guard (the VCOPY kernel's 2H rows always; the default's 3H or 2H when H is even, as FLUX's 24 heads).
template <int SPAN, int R, bool STAGED, bool VCOPY = false, bool EVEN = false>
__device__ __forceinline__ void run_token(const Params& p, unsigned token, const uint2* staged) {
  static_assert(SPAN == 32 || SPAN == 16, "a row spans a warp or half of one");
  static_assert(!EVEN || R == 1, "full slots are only guaranteed with one slot per warp and step");
  constexpr int K = 32 / SPAN;  // vectors (and rows per slot) per lane
  constexpr int kD = STAGED ? 128 : 0;  // head_dim when fixed at compile time
  const int D = kD != 0 ? kD : p.D;
  const float inv_D = kD != 0 ? 1.0f / kD : p.inv_D;  // exact: a power of two, as p.inv_D is then
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int u = lane % SPAN;    // this lane's place in its row
  const int seg = lane / SPAN;  // which of the slot's rows
  const TokenPlace tp = token_place(token, p.seq, p.first.S);
  const int64_t b = tp.b, sj = tp.sj;
  bool on[K];  // vector j of this lane (aten lane u + SPAN j) holds data
#pragma unroll
  for (int j = 0; j < K; ++j) on[j] = kD != 0 || u + SPAN * j < p.V;  // kD: 32 vectors, u + SPAN j < 32

  const Stream& st = tp.in_first ? p.first : p.second;
  const TokenRows tr(st.t[0], st.t[1], st.t[2], b, tp.s);
  const uint16_t* wp[2] = {st.w[0], st.w[1]};
  // STAGED: role 0, 1 has a weight (one register; the per-row kernels keep the pointers' test)
  const unsigned w_mask = (wp[0] != nullptr ? 1u : 0u) | (wp[1] != nullptr ? 2u : 0u);

  float4 c[K], sn[K];
  uint2 w[2][K];
#pragma unroll
  for (int j = 0; j < K && !STAGED; ++j) {  // STAGED: read from shared memory where used
    const int v = u + SPAN * j;
    c[j] = sn[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (p.cos != nullptr && on[j]) {
      c[j] = reinterpret_cast<const float4*>(p.cos + sj * p.D)[v];
      sn[j] = reinterpret_cast<const float4*>(p.sin + sj * p.D)[v];
    }
#pragma unroll
    for (int r = 0; r < 2; ++r)
      w[r][j] = (wp[r] != nullptr && on[j]) ? reinterpret_cast<const uint2*>(wp[r])[v] : make_uint2(0, 0);
  }
  const int64_t out_token = (b * p.S + sj) * p.H * D;  // element offset of this token's first output row

  const int rows = slot_rows<VCOPY>(p);
  const uint2* s_tab = staged + rows * 32;  // STAGED: cos (64 vectors), sin (64), q weight (32), k weight (32)
  const int slots = (rows + K - 1) / K;
  for (int base = warp; base < slots; base += kWarps * R) {
    uint2 x[R][K];
    uint32_t role_of[R], head_of[R];
#pragma unroll
    for (int q = 0; q < R; ++q) {
      const int r = (base + q * kWarps) * K + seg;
      role_of[q] = EVEN ? p.heads.divmod(static_cast<uint32_t>(r), head_of[q])
                        : role_and_head(p.heads, r, rows, head_of[q]);
      const uint2* row = STAGED ? staged + r * 32
                                : reinterpret_cast<const uint2*>(tr.row(role_of[q] < 3 ? role_of[q] : 0, head_of[q]));
#pragma unroll
      for (int j = 0; j < K; ++j)
        x[q][j] = ((EVEN || role_of[q] < 3) && on[j]) ? row[u + SPAN * j] : make_uint2(0, 0);
    }
    float sum[R];
#pragma unroll
    for (int q = 0; q < R; ++q) sum[q] = norm::rms_lane_sum<K>(x[q]);
    norm::rms_span_tree<SPAN, R>(sum);
#pragma unroll
    for (int q = 0; q < R; ++q) {
      const uint32_t role = role_of[q];  // 0 q, 1 k, 2 v (copied as is), 3 past the end (not stored)
      // every lane takes part in the broadcast: at SPAN 16 the warp's two rows may have different roles
      const float total = norm::rms_span_total<SPAN>(sum[q]);
      uint2 y[K];
#pragma unroll
      for (int j = 0; j < K; ++j) y[j] = x[q][j];
      if (role < 2) {
        const float rstd = norm::rms_head_rstd(total, D, p.eps, inv_D);
        const bool has_w = STAGED ? (w_mask >> role) & 1u : (role == 0 ? wp[0] : wp[1]) != nullptr;
#pragma unroll
        for (int j = 0; j < K; ++j) {
          const int v = u + SPAN * j;
          const uint2 wr = STAGED ? s_tab[128 + (role == 0 ? 0 : 32) + v] : role == 0 ? w[0][j] : w[1][j];
          y[j] = make_uint2(norm::rms_norm_pair(y[j].x, rstd, has_w, wr.x),
                            norm::rms_norm_pair(y[j].y, rstd, has_w, wr.y));
          if (p.cos != nullptr) {
            const float4 cj = STAGED ? reinterpret_cast<const float4*>(s_tab)[v] : c[j];
            const float4 sj4 = STAGED ? reinterpret_cast<const float4*>(s_tab + 64)[v] : sn[j];
            y[j] = make_uint2(num::rope_interleaved_bf16x2(y[j].x, cj.x, sj4.x, cj.y, sj4.y),
                              num::rope_interleaved_bf16x2(y[j].y, cj.z, sj4.z, cj.w, sj4.w));
          }
        }
      }
      if (EVEN || role < 3) {
        uint2* o = reinterpret_cast<uint2*>(
            (kD != 0 ? p.out[role] : by_role(role, p.out[0], p.out[1], p.out[2])) + out_token +
            static_cast<int64_t>(head_of[q]) * D);
#pragma unroll
        for (int j = 0; j < K; ++j)
          if (on[j]) o[u + SPAN * j] = y[j];
      }
    }
  }
}

// One block per token. VCOPY (with STAGED; DIFUSE_QK_VCOPY=1, for measurement, slower on the H200; v_out
// 16-byte aligned): the v rows are copied global to global beside the staging copies, only q and k staged.
template <int SPAN, int R, int MIN_BLOCKS, bool STAGED = false, bool VCOPY = false, bool EVEN = false>
__global__ void __launch_bounds__(kWarps * 32, MIN_BLOCKS) qk_norm_rope_kernel(const Params p) {
  static_assert(!VCOPY || STAGED, "the v copy rides on the staged kernel's 16-byte aligned rows");
  extern __shared__ uint4 staged16[];  // STAGED: the token's rows and tables (stage_token's layout)
  block_token<STAGED>(
      staged16, [&](unsigned token, uint4* dst) { stage_token<VCOPY>(p, token, dst); },
      [&](unsigned token, const uint4* src) {
        run_token<SPAN, R, STAGED, VCOPY, EVEN>(p, token, reinterpret_cast<const uint2*>(src));
      });
}

// PIPELINED (DIFUSE_QK_PIPELINED=1, for measurement, slower on the H200; where STAGED applies and two tokens'
// buffers fit in 48 KB): a grid of at most the resident blocks (DIFUSE_QK_PIPELINED=N >= 2: at most N, for
// tests), each taking tokens blockIdx.x, + gridDim.x, ... with two buffers of stage_token's layout: the copies of
// its next token are in flight while it computes the current one (cp.async groups), where STAGED copies, waits,
// then computes. The same arithmetic per row (run_token).
template <int SPAN, int MIN_BLOCKS>
__global__ void __launch_bounds__(kWarps * 32, MIN_BLOCKS) qk_norm_rope_pipelined(const Params p, unsigned tokens) {
  extern __shared__ uint4 staged16[];
  pipelined_tokens(
      tokens, p.roles * p.H * 16 + 96, staged16, [&](unsigned token, uint4* dst) { stage_token(p, token, dst); },
      [&](unsigned token, const uint4* src) {
        run_token<SPAN, 1, true>(p, token, reinterpret_cast<const uint2*>(src));
      });
}

using heads::present;

// A [B, S, H, D] bf16 input; false when its rank is wrong (the caller then skips shape comparisons).
bool require_heads_view(detail::Support& s, const difuse_tensor_view& x, const char* name) {
  if (!detail::require_bf16_row_view(s, x, name)) return false;
  if (x.rank != 4) {
    DIFUSE_REQUIRE(s, false, std::string(name) + " must be [B, S, heads, head_dim], got " + detail::describe(x));
    return false;
  }
  if (detail::numel(x) > 0) {
    bool aligned = detail::aligned(x.data, 8);
    for (int d = 0; d < 3; ++d) aligned = aligned && (x.sizes[d] <= 1 || x.strides[d] % 4 == 0);
    DIFUSE_REQUIRE(s, aligned, std::string(name) + " rows must be 8-byte aligned (pointer and strides), got " +
                                   detail::describe(x));
  }
  return true;
}

bool same_bhd(const difuse_tensor_view& a, const difuse_tensor_view& b) {
  return a.sizes[0] == b.sizes[0] && a.sizes[2] == b.sizes[2] && a.sizes[3] == b.sizes[3];
}

void require_weight(detail::Support& s, const difuse_tensor_view& w, const char* name, int64_t D, int device) {
  if (!present(w)) return;
  const std::string n(name);
  DIFUSE_REQUIRE(s, w.dtype == DIFUSE_BF16,
                 n + " must be bf16 like q (another dtype takes aten's composite RMSNorm), got " +
                     difuse_dtype_name(w.dtype));
  DIFUSE_REQUIRE(s, w.rank == 1 && w.sizes[0] == D && w.strides[0] == 1,
                 n + " must be a contiguous [" + std::to_string(D) + "], got " + detail::describe(w));
  DIFUSE_REQUIRE(s, w.device == device, n + " must be on the device of q, got " + detail::describe(w));
  DIFUSE_REQUIRE(s, w.data != nullptr && detail::aligned(w.data, 8), n + " must be 8-byte aligned");
}

void require_table(detail::Support& s, const difuse_tensor_view& t, const char* name, int64_t S, int64_t D,
                   int device) {
  const std::string n(name);
  DIFUSE_REQUIRE(s, t.dtype == DIFUSE_F32, n + " must be fp32 (as FluxPosEmbed builds it), got " +
                                               difuse_dtype_name(t.dtype));
  DIFUSE_REQUIRE(s, t.rank == 2 && t.sizes[0] == S && t.sizes[1] == D && detail::is_contiguous(t),
                 n + " must be a contiguous [" + std::to_string(S) + ", " + std::to_string(D) +
                     "] (joint tokens, head_dim), got " + detail::describe(t));
  DIFUSE_REQUIRE(s, t.device == device, n + " must be on the device of q, got " + detail::describe(t));
  DIFUSE_REQUIRE(s, detail::aligned(t.data, 16), n + " must be 16-byte aligned");
}

void require_output(detail::Support& s, const difuse_tensor_view& out, const char* name, int64_t B, int64_t S,
                    int64_t H, int64_t D, int device, std::initializer_list<const difuse_tensor_view*> inputs) {
  const std::string n(name);
  DIFUSE_REQUIRE(s, out.dtype == DIFUSE_BF16, n + " must be bf16, got " + difuse_dtype_name(out.dtype));
  DIFUSE_REQUIRE(s, out.rank == 4 && out.sizes[0] == B && out.sizes[1] == S && out.sizes[2] == H &&
                        out.sizes[3] == D && detail::is_contiguous(out),
                 n + " must be a contiguous [" + std::to_string(B) + ", " + std::to_string(S) + ", " +
                     std::to_string(H) + ", " + std::to_string(D) + "], got " + detail::describe(out));
  DIFUSE_REQUIRE(s, out.device == device, n + " must be on the device of q, got " + detail::describe(out));
  DIFUSE_REQUIRE(s, detail::aligned(out.data, 8), n + " must be 8-byte aligned");
  for (const difuse_tensor_view* in : inputs)
    if (present(*in) && in->data != nullptr)
      DIFUSE_REQUIRE(s, !detail::overlaps(out, *in), n + " overlaps an input");
}

}  // namespace

detail::Support can_use_qk_norm_rope(const QkNormRopeArgs& a) {
  detail::Support s;
  if (!present(a.q) || !present(a.k)) {
    DIFUSE_REQUIRE(s, false, "q and k are required");
    return s;
  }
  bool shapes = require_heads_view(s, a.q, "q");
  shapes = require_heads_view(s, a.k, "k") && shapes;
  const bool has_v = present(a.v);
  if (has_v) shapes = require_heads_view(s, a.v, "v") && shapes;
  const bool has_first = present(a.q_first) || present(a.k_first) || present(a.v_first);
  if (has_first) {
    DIFUSE_REQUIRE(s, present(a.q_first) && present(a.k_first),
                   "a first (text) stream needs both q_first and k_first");
    DIFUSE_REQUIRE(s, present(a.v_first) == has_v, "v_first must be given exactly when v is (both streams' values are "
                                                  "concatenated, or neither is touched)");
    if (present(a.q_first)) shapes = require_heads_view(s, a.q_first, "q_first") && shapes;
    if (present(a.k_first)) shapes = require_heads_view(s, a.k_first, "k_first") && shapes;
    if (present(a.v_first)) shapes = require_heads_view(s, a.v_first, "v_first") && shapes;
  } else {
    DIFUSE_REQUIRE(s, !present(a.q_first_weight) && !present(a.k_first_weight),
                   "first-stream norm weights were given without a first stream");
  }
  DIFUSE_REQUIRE(s, present(a.v_out) == has_v, "v_out must be given exactly when v is");
  if (!shapes) return s;

  const int64_t B = a.q.sizes[0], S2 = a.q.sizes[1], H = a.q.sizes[2], D = a.q.sizes[3];
  const int dev = a.q.device;
  for (const auto* t : {&a.k, &a.v})
    if (present(*t))
      DIFUSE_REQUIRE(s, t->sizes[0] == B && t->sizes[1] == S2 && t->sizes[2] == H && t->sizes[3] == D && t->device == dev,
                     "k and v must have q's shape and device " + detail::describe(a.q) + ", got " + detail::describe(*t));
  int64_t S1 = 0;
  if (has_first && present(a.q_first)) {
    S1 = a.q_first.sizes[1];
    for (const auto* t : {&a.q_first, &a.k_first, &a.v_first})
      if (present(*t))
        DIFUSE_REQUIRE(s, same_bhd(*t, a.q) && t->sizes[1] == S1 && t->device == dev,
                       "the first stream's q, k, v must be [" + std::to_string(B) + ", S_first, " + std::to_string(H) +
                           ", " + std::to_string(D) + "] alike on q's device, got " + detail::describe(*t));
  }
  DIFUSE_REQUIRE(s, D >= 4 && D <= 128 && D % 4 == 0,
                 "head_dim must be a multiple of 4 in [4, 128] (aten's per-head RMSNorm vectors, one warp), got " +
                     std::to_string(D));
  const int64_t S = S1 + S2;
  DIFUSE_REQUIRE(s, B * S <= int64_t{2147483647}, "at most 2^31 - 1 joint tokens in the batch");
  DIFUSE_REQUIRE(s, H >= 1 && H <= 4096, "heads must be in [1, 4096], got " + std::to_string(H));
  require_weight(s, a.q_weight, "q_weight", D, dev);
  require_weight(s, a.k_weight, "k_weight", D, dev);
  require_weight(s, a.q_first_weight, "q_first_weight", D, dev);
  require_weight(s, a.k_first_weight, "k_first_weight", D, dev);
  DIFUSE_REQUIRE(s, present(a.cos) == present(a.sin), "cos and sin must be given together");
  if (present(a.cos)) require_table(s, a.cos, "cos", S, D, dev);
  if (present(a.sin)) require_table(s, a.sin, "sin", S, D, dev);
  const std::initializer_list<const difuse_tensor_view*> inputs = {
      &a.q, &a.k, &a.v, &a.q_first, &a.k_first, &a.v_first, &a.q_weight, &a.k_weight, &a.q_first_weight,
      &a.k_first_weight, &a.cos, &a.sin};
  require_output(s, a.q_out, "q_out", B, S, H, D, dev, inputs);
  require_output(s, a.k_out, "k_out", B, S, H, D, dev, inputs);
  if (has_v && present(a.v_out)) require_output(s, a.v_out, "v_out", B, S, H, D, dev, inputs);
  if (present(a.q_out) && present(a.k_out))
    DIFUSE_REQUIRE(s, !detail::overlaps(a.q_out, a.k_out), "q_out and k_out overlap");
  if (has_v && present(a.v_out))  // v's rows are copied by other warps than the normalised q and k rows
    for (const auto* o : {&a.q_out, &a.k_out})
      if (present(*o))
        DIFUSE_REQUIRE(s, !detail::overlaps(a.v_out, *o), std::string("v_out and ") + (o == &a.q_out ? "q_out" : "k_out") +
                                                              " overlap");
  return s;
}

void qk_norm_rope(const QkNormRopeArgs& a, cudaStream_t stream) {
  const detail::Support s = can_use_qk_norm_rope(a);
  if (!s.ok()) throw detail::Failure(DIFUSE_ERR_UNSUPPORTED, s.message("qk_norm_rope"));
  Params p{};
  static_cast<StreamViews&>(p.second) = stream_views(a.q, a.k, a.v, a.q_weight, a.k_weight, 1, 2);
  p.second.S = a.q.sizes[1];
  if (present(a.q_first)) {
    static_cast<StreamViews&>(p.first) =
        stream_views(a.q_first, a.k_first, a.v_first, a.q_first_weight, a.k_first_weight, 1, 2);
    p.first.S = a.q_first.sizes[1];
  }
  p.out[0] = static_cast<uint16_t*>(a.q_out.data);
  p.out[1] = static_cast<uint16_t*>(a.k_out.data);
  p.out[2] = present(a.v_out) ? static_cast<uint16_t*>(a.v_out.data) : nullptr;
  p.roles = present(a.v) ? 3 : 2;
  p.cos = present(a.cos) ? static_cast<const float*>(a.cos.data) : nullptr;
  p.sin = present(a.sin) ? static_cast<const float*>(a.sin.data) : nullptr;
  p.S = p.first.S + p.second.S;
  p.H = static_cast<int>(a.q.sizes[2]);
  p.D = static_cast<int>(a.q.sizes[3]);
  p.V = p.D / 4;
  p.eps = static_cast<float>(a.eps);
  p.inv_D = num::inv_pow2_or_zero(p.D);
  p.heads = detail::FastDivU32(static_cast<uint32_t>(p.H));
  p.seq = detail::FastDivU32(static_cast<uint32_t>(p.S));
  const int64_t blocks = a.q.sizes[0] * p.S;
  if (blocks == 0 || p.H == 0) return;
  const detail::DeviceGuard device_guard(a.q.device);
  // Rows a warp loads before reducing: fewer rows keep more warps resident (occupancy), more rows put more
  // loads in flight per warp. DIFUSE_QK_ROWS_PER_WARP=2|3|4|6|9 picks the full-warp kernel (for measurements;
  // every variant is exactness-tested: tests/gpu/test_qk_norm_rope.py::test_more_rows_per_warp_variants).
  const int knob = rows_per_warp_knob();
  // Full warp, H200, 1x4608x24x128 double, 6408223 (bench/results/h200/knob-sweeps/): 2 rows 64.0 us, 3: 62.0,
  // 4: 68.9, 6: 74.2; before 657caa7 (per-row divisions) 2: 90.6, 4: 95.5, 6: 97.1, 9: 99.4.
  const int per_warp = knob > 0 ? knob : 3;
  const dim3 grid(static_cast<unsigned>(blocks)), block(kWarps * 32);
  // Default: half a warp per row, two rows per warp instruction (slots of two rows; the rows-per-warp knob then
  // counts slots: 1 or 2, default 1). H200 at 5fa0c2a (knob-sweeps/), 1x4608x24x128 double: 16 lanes 1 slot
  // 58.5 us, 2 slots 68.3, full warp 3 rows 63.3, 2 rows 65.3; single 43.6 vs 50.0 (fastest at all five shapes).
  // DIFUSE_QK_LANES_PER_ROW=32 (for measurement): a warp per row, DIFUSE_QK_ROWS_PER_WARP rows (default 3).
  static const int lanes_knob = detail::positive_env_knob("DIFUSE_QK_LANES_PER_ROW");
  // Default where it applies: the staged kernel (H200 at 66f5a3b, knob-sweeps/: 1x4608x24x128 double 53.4 us vs
  // 58.8 per-row, single 39.8 vs 44.3, batch 2 98.3 vs 109.9). DIFUSE_QK_UNSTAGED=1, or either knob above, keeps
  // the per-row kernels.
  static const int unstaged_knob = detail::positive_env_knob("DIFUSE_QK_UNSTAGED");
  const size_t staged_bytes = static_cast<size_t>(p.roles) * p.H * p.D * sizeof(uint16_t) + 192 * sizeof(uint2);
  if (lanes_knob != 32 && knob == 0 && unstaged_knob != 1 && p.D == 128 && staged_bytes <= 48 * 1024 &&
      head_rows_aligned16({&p.first, &p.second})) {
    static const int pipelined_knob = detail::positive_env_knob("DIFUSE_QK_PIPELINED");
    static const int vcopy_knob = detail::positive_env_knob("DIFUSE_QK_VCOPY");  // (the pipelined kernel stages v)
    if (pipelined_knob >= 1 && 2 * staged_bytes <= 48 * 1024) {
      // Two buffers per block (~39 KB for FLUX's 72 rows): 5 blocks per SM, each with its next token's copies in
      // flight while it computes; the grid is the resident blocks, so no block waits for a slot. A knob value
      // N >= 2 caps the grid at N blocks (tests: many tokens per block on small shapes, under racecheck too).
      static std::atomic<uint64_t> carveout_set{0};
      launch_pipelined(qk_norm_rope_pipelined<16, 5>, p, blocks, staged_bytes, pipelined_knob, kWarps * 32,
                       a.q.device, stream, carveout_set);
    } else if (vcopy_knob == 1 && p.roles == 3 && detail::aligned(p.out[2], 16)) {
      // the v rows copied, 2H rows staged (even)
      norm::launch_max_shared<qk_norm_rope_kernel<16, 1, 8, true, true, true>>(
          p, grid, block, staged_bytes - static_cast<size_t>(p.H) * p.D * sizeof(uint16_t), a.q.device, stream);
    } else {
      // 32 registers, 8 blocks of 256 threads per SM (ptxas, scripts/kernel-resources.sh): up to 8 tokens' rows
      // in flight per SM, ~156 KB of shared memory, so the carveout is set to the most shared memory once per
      // device.
      if (p.roles * p.H % 2 == 0)  // every slot full (FLUX: 24 heads)
        norm::launch_max_shared<qk_norm_rope_kernel<16, 1, 8, true, false, true>>(p, grid, block, staged_bytes,
                                                                                    a.q.device, stream);
      else
        norm::launch_max_shared<qk_norm_rope_kernel<16, 1, 8, true>>(p, grid, block, staged_bytes, a.q.device,
                                                                      stream);
    }
  } else if (lanes_knob != 32) {
    if (knob >= 2)
      qk_norm_rope_kernel<16, 2, 3><<<grid, block, 0, stream>>>(p);
    else
      qk_norm_rope_kernel<16, 1, 5><<<grid, block, 0, stream>>>(p);
  } else if (per_warp <= 2)
    qk_norm_rope_kernel<32, 2, 6><<<grid, block, 0, stream>>>(p);
  else if (per_warp == 3)
    qk_norm_rope_kernel<32, 3, 5><<<grid, block, 0, stream>>>(p);
  else if (per_warp <= 4)
    qk_norm_rope_kernel<32, 4, 4><<<grid, block, 0, stream>>>(p);
  else if (per_warp <= 6)
    qk_norm_rope_kernel<32, 6, 3><<<grid, block, 0, stream>>>(p);
  else
    qk_norm_rope_kernel<32, 9, 2><<<grid, block, 0, stream>>>(p);
  DIFUSE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace difuse::rope
