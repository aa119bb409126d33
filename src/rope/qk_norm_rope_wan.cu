// qk_norm_rope_wan — Wan 2.x's self-attention prologue in one launch, bit-exact against eager PyTorch.
//
// Eager chain reproduced (diffusers 0.42.1 WanAttnProcessor, self-attention: attn1), bf16 activations:
//     query = attn.norm_q(query)                torch.nn.RMSNorm(heads * head_dim) ACROSS heads, before the
//     key   = attn.norm_k(key)                  head split: aten's fused kernel, one bf16 rounding
//     query = query.unflatten(2, (attn.heads, -1)); key likewise          views
//     query = apply_rotary_emb(query, freqs_cos, freqs_sin)   Wan's own (inside the processor), per pair:
//         x1, x2 = x[..., 0::2], x[..., 1::2];  c = freqs_cos[..., 0::2];  s = freqs_sin[..., 1::2]
//         out[..., 0::2] = x1 * c - x2 * s;  out[..., 1::2] = x1 * s + x2 * c   (bf16 x fp32 -> fp32 ops, each
//         rounded: mul, mul, sub / add, no FMA; one bf16 rounding in the strided copy into `out`;
//         .type_as(x) is then a no-op)  — numerics/rope.h rope_wan_pair
// freqs_cos / freqs_sin are what WanRotaryPosEmbed returns: fp32 [1, S, 1, head_dim] (built in float64,
// repeat-interleaved, .float()). v is not touched (the processor only unflattens it).
//
// Replays: torch 2.11.0+cu130, sm_90 — the norm is rms_norm.cu's replay of
// at::native::vectorized_layer_norm_kernel<c10::BFloat16, float, rms_norm=true> (torch-2.11-numerics.md §2):
// aten thread t of 128 owns the 4-element vectors t, t + 128, ...; s = fma(v, v, s) per element in order; a
// shuffle-down tree 16..1 per warp; warp roots (0,2), (1,3), (0,1); rstd = rsqrtf(RN(div(s, N) + eps));
// y = bf16(RN(w * RN(rstd * x))). The same layernorm_schedule.h pieces (AtenThreadMap<64, PAIRED>,
// rms_push_vec4, rms_combine, rms_finalize_roots, rms_norm_pair) as rms_norm.cu's 64-thread row kernel, so the
// reduction order is aten's; RoPE is three fp32 TensorIterator kernels per half and a bf16 copy.
// One block per token: 64 threads normalize its q row, 64 its k row, each row held in registers (N <= 8192);
// the rotation runs on the normalized bf16 pairs in the epilogue (a 4-element vector never straddles a head:
// head_dim % 4 == 0; since head_dim divides 512, a thread's table columns are the same in every sweep, so it
// reads them once). Outputs are contiguous [B, S, heads, head_dim], exactly the tensors the processor hands
// to attention. Aligned rows of two or three sweeps (widths 513-1536, Wan 1.3B's 1536) run the same token body
// compiled for 16 or 12 resident blocks per SM (qk_norm_rope_wan_occupied below; the default since the thirty-seventh
// session, DIFUSE_QK_WAN_OCCUPANCY=0 restores the 10-block kernels).
//
// Guards (can_use_qk_norm_rope_wan; every violation is reported): q, k bf16 [B, S, N] on one CUDA device, last
// dim contiguous, non-negative strides; a contiguous q / k 8-byte aligned (a misaligned one takes aten's
// two-kernel RMSNorm, which rounds differently), a strided one (to_qkv chunks) with 8-byte aligned rows;
// heads divides N, head_dim = N / heads a power of two in [4, 512], N <= 8192; weights absent or bf16 [N]
// contiguous 8-byte aligned; freqs_cos and freqs_sin fp32 [1 or B, S, 1, head_dim] with a contiguous last dim
// and 16-byte aligned rows; outputs contiguous bf16 [B, S, heads, head_dim], 8-byte aligned, overlapping no
// input nor each other.
//
// Verification status: bit-exact on the H200 at 66f5a3b and again at 5f8295d (torch 2.11.0+cu130, sm_90; first at
// c8d8874):
// tests/gpu/test_qk_norm_rope_wan.py (255 cases, incl. the real WanAttention + WanAttnProcessor at 1536 and 5120), 0
// failed, 0 skipped (bench/results/h200/tests.json).
// The thirty-fifth session made the token body a device function called by the default kernels (their sm_90 SASS
// identical to f59b89a's: `scripts/sass-diff.sh f59b89a . src/rope/qk_norm_rope_wan.cu`, 18 of 18 the same) and by
// the occupancy variant, whose PTX has the same multiset of floating-point operations (every one an explicitly
// rounded .rn or fma.rn) in another order of basic blocks (a one-off comparison, not a script in the repo).
// H100 at 05542dc (the thirty-sixth session; no H200 came): the whole suite passed, test_qk_norm_rope_wan.py's 256
// cases with test_occupancy_variant among them (bench/results/h100/tests-05542dc.json, and at f7695c6); the smoke
// test's Wan cases clean under memcheck and racecheck in every sanitizer part, the occupancy kernels' in part 3
// (sanitizer-05542dc-part3.log). Not yet re-run on the H200 since the refactor.
// H100 at 451dfc5 (the 12/16-block kernels the default): test_qk_norm_rope_wan.py with
// test_occupancy_kernels_and_the_knob_off for both settings, 257 passed, 0 failed
// (bench/results/h100/sm-partition/451dfc5/gpu-tests-wan-sm-partition.json; test_patch_wan.py too in the records
// whose git_sha is spliced, see that folder's README).
#include "rope/qk_norm_rope_wan.h"

#include <cuda_runtime.h>

#include <string>

#include "core/device.h"
#include "core/env_knob.h"
#include "core/registry.h"
#include "core/tensor.h"
#include "difuse/numerics/bf16.h"
#include "difuse/numerics/rope.h"
#include "norm/layernorm_schedule.h"
#include "norm/rms_map_tree.cuh"

namespace difuse::rope {

namespace {

const detail::KernelRegistration kRegistration{{
    "qk_norm_rope_wan", "cuda", "bit_exact",
    "Wan 2.x attention prologue: norm_q(q), norm_k(k) (torch.nn.RMSNorm across heads), unflatten(2, (heads, -1)), "
    "WanAttnProcessor's apply_rotary_emb (interleaved pairs, fp32 freqs)",
    "verified bit-exact on H200 at 132f46f (torch 2.11.0+cu130, sm_90)", 90, 90,
    "QK RMSNorm across heads + head split + Wan RoPE in one launch (fused to_qkv chunks or separate projections)"}};

constexpr int kRowThreads = 64;               // our threads per row: each holds two of aten's 128 threads
constexpr int kThreads = 2 * kRowThreads;     // one block: the token's q row, then its k row
constexpr int kMaxWidth = 8192;               // sweeps of 128 vectors held in registers: at most 16

struct Params {
  const uint16_t* x[2] = {nullptr, nullptr};  // q, k rows
  int64_t xb[2] = {0, 0}, xs[2] = {0, 0};     // batch and token strides, elements
  const uint16_t* w[2] = {nullptr, nullptr};  // norm weights (nullptr: none)
  uint16_t* out[2] = {nullptr, nullptr};      // contiguous [B, S, heads, head_dim]
  const float* cos = nullptr;
  const float* sin = nullptr;
  int64_t tb[2] = {0, 0}, ts[2] = {0, 0};     // cos, sin: batch stride (0: one table for the batch), token stride
  int64_t S = 0;
  int n = 0, v = 0, d = 0;                    // row width, its 4-element vectors, head_dim
  float eps = 1e-6f;
};

// Slot j of thread i in sweep k is aten vector Map::aten_thread(i, j) + 128 k; a paired thread's two slots are
// adjacent vectors (one 16-byte access), a strided thread's are 64 vectors apart (two 8-byte accesses). One block's
// token (the kernels below differ only in their launch bounds).
template <int SW, bool PAIRED>
__device__ __forceinline__ void wan_token(const Params& p) {
  using Map = norm::AtenThreadMap<kRowThreads, PAIRED>;
  constexpr int A = Map::kSlots;
  static_assert(A == 2, "two aten threads per thread");
  __shared__ float roots[2][4];
  __shared__ float rstd_s[2];

  const int role = static_cast<int>(threadIdx.x) / kRowThreads;  // 0: q, 1: k
  const int i = static_cast<int>(threadIdx.x) % kRowThreads;
  const unsigned S = static_cast<unsigned>(p.S);  // B * S < 2^31 (predicate)
  const int64_t b = blockIdx.x / S;
  const int64_t s = blockIdx.x % S;
  const int V = p.v;
  const uint16_t* row = p.x[role] + b * p.xb[role] + s * p.xs[role];

  uint2 x[SW][A];
#pragma unroll
  for (int k = 0; k < SW; ++k) {
    if constexpr (PAIRED) {
      const int vi = Map::aten_thread(i, 0) + norm::kAtenThreads * k;  // even; V even, so vi + 1 < V too
      if (vi < V) {
        const uint4 t = *reinterpret_cast<const uint4*>(row + 4 * static_cast<int64_t>(vi));
        x[k][0] = make_uint2(t.x, t.y);
        x[k][1] = make_uint2(t.z, t.w);
      } else {
        x[k][0] = x[k][1] = make_uint2(0, 0);
      }
    } else {
#pragma unroll
      for (int j = 0; j < A; ++j) {
        const int vi = Map::aten_thread(i, j) + norm::kAtenThreads * k;
        x[k][j] = vi < V ? *reinterpret_cast<const uint2*>(row + 4 * static_cast<int64_t>(vi)) : make_uint2(0, 0);
      }
    }
  }
  // The token's table columns of each slot: (4 * vector) % head_dim, the same in every sweep (512 % d == 0).
  const float* crow = p.cos + b * p.tb[0] + s * p.ts[0];
  const float* srow = p.sin + b * p.tb[1] + s * p.ts[1];
  float4 c4[A], s4[A];
#pragma unroll
  for (int j = 0; j < A; ++j) {
    const int col = (4 * Map::aten_thread(i, j)) % p.d;
    c4[j] = *reinterpret_cast<const float4*>(crow + col);
    s4[j] = *reinterpret_cast<const float4*>(srow + col);
  }

  float acc[A];
#pragma unroll
  for (int j = 0; j < A; ++j) acc[j] = 0.f;
#pragma unroll
  for (int k = 0; k < SW; ++k) {
#pragma unroll
    for (int j = 0; j < A; ++j) {
      const int vi = Map::aten_thread(i, j) + norm::kAtenThreads * k;
      if (vi < V)
        acc[j] = norm::rms_push_vec4(acc[j], num::bf16_lo(x[k][j].x), num::bf16_hi(x[k][j].x),
                                     num::bf16_lo(x[k][j].y), num::bf16_hi(x[k][j].y));
    }
  }
  norm::rms_map_tree<Map>(acc);
#pragma unroll
  for (int j = 0; j < A; ++j) {
    const int t = Map::aten_thread(i, j);
    if (t % norm::kAtenWarp == 0) roots[role][t / norm::kAtenWarp] = acc[j];
  }
  __syncthreads();
  if (i == 0) rstd_s[role] = norm::rms_finalize_roots(roots[role], p.n, p.eps);
  __syncthreads();
  const float rstd = rstd_s[role];

  const uint16_t* w = p.w[role];
  const bool has_w = w != nullptr;
  uint16_t* orow = p.out[role] + (b * static_cast<int64_t>(S) + s) * p.n;
#pragma unroll
  for (int k = 0; k < SW; ++k) {
    uint2 ww[A], y[A];
    const int v0 = Map::aten_thread(i, 0) + norm::kAtenThreads * k;
    if constexpr (PAIRED) {
      if (v0 >= V) continue;
      const uint4 t = has_w ? *reinterpret_cast<const uint4*>(w + 4 * v0) : make_uint4(0, 0, 0, 0);
      ww[0] = make_uint2(t.x, t.y);
      ww[1] = make_uint2(t.z, t.w);
    } else {
#pragma unroll
      for (int j = 0; j < A; ++j) {
        const int vi = Map::aten_thread(i, j) + norm::kAtenThreads * k;
        ww[j] = (has_w && vi < V) ? *reinterpret_cast<const uint2*>(w + 4 * vi) : make_uint2(0, 0);
      }
    }
#pragma unroll
    for (int j = 0; j < A; ++j) {
      const uint32_t y0 = norm::rms_norm_pair(x[k][j].x, rstd, has_w, ww[j].x);  // elements 4v, 4v+1
      const uint32_t y1 = norm::rms_norm_pair(x[k][j].y, rstd, has_w, ww[j].y);  // elements 4v+2, 4v+3
      // pair (4v, 4v+1) takes cos[col], sin[col + 1]; pair (4v+2, 4v+3) takes cos[col + 2], sin[col + 3]
      y[j] = make_uint2(num::rope_wan_bf16x2(y0, c4[j].x, s4[j].y), num::rope_wan_bf16x2(y1, c4[j].z, s4[j].w));
    }
    if constexpr (PAIRED) {
      *reinterpret_cast<uint4*>(orow + 4 * v0) = make_uint4(y[0].x, y[0].y, y[1].x, y[1].y);
    } else {
#pragma unroll
      for (int j = 0; j < A; ++j) {
        const int vi = Map::aten_thread(i, j) + norm::kAtenThreads * k;
        if (vi < V) *reinterpret_cast<uint2*>(orow + 4 * vi) = y[j];
      }
    }
  }
}

template <int SW, bool PAIRED>
__global__ void __launch_bounds__(kThreads) qk_norm_rope_wan_kernel(const Params p) {
  wan_token<SW, PAIRED>(p);
}

// The paired kernel of two and three sweeps (N in (512, 1536]: Wan 1.3B's 1536) compiled for MINB resident blocks
// per SM, the same token body with fewer registers; DIFUSE_QK_WAN_OCCUPANCY=0 (read once) launches the 10-block
// kernels instead. Why: the 10-block kernel's 44 registers at three sweeps leave room for 10 blocks of 128 threads
// per SM; each block has its token's loads in flight only until its reduction, so ~40 KB per SM are in flight where
// 4.26 TB/s needs ~64 KB at ~2 us of loaded latency. Wan 1.3B's 12 heads took 124.8 us against a 122.8 bound (stream
// 104.8) on the H200 at f59b89a, Wan 14B's 40 heads 1.16 x the streaming probe. ptxas (sm_90,
// scripts/kernel-resources.sh): 40 registers for 12 blocks at three sweeps, 32 for 16 at two, no spills. Scratch
// builds with other bounds (not kept): 16 blocks at three sweeps spill 28 B, and at four or more sweeps every bound
// that would add a block spills.
// Measured on an H100 only (no H200 came in the thirty-fifth to thirty-seventh sessions), 1x32760x12x128:
//   - the whole GPU: 149.3 vs 149.5 us for the 10-block kernel (05542dc, knob-sweeps/05542dc/), both at the
//     streaming probe's speed there;
//   - on SM partitions (`bench ops --sms N`, probe/sm_partition.h: each SM carries more of the bandwidth, as an H200
//     SM does; bench/results/h100/sm-partition/): 94 SMs 151.4 vs 154.2 us, 66 SMs 185.3 vs 194.8 (c0ad790); 80 SMs
//     159.8 / 159.8 vs 171.3 / 171.5 (f84317e) and 159.4 vs 171.1 as the default (451dfc5). At 80 SMs the 10-block
//     kernel runs at 1.17 x the probe, its H200 ratio (1.19); this one at 1.09.
// Predicted on the H200: 124.8 x 159.8 / 171.4 = ~116 us (bound 122.8). The H200's own sweep is owed; exact on the
// H100 (test_occupancy_kernels_and_the_knob_off), memcheck and racecheck clean there (sanitizer part 3, 05542dc).
template <int SW, int MINB>
__global__ void __launch_bounds__(kThreads, MINB) qk_norm_rope_wan_occupied(const Params p) {
  wan_token<SW, true>(p);
}

bool occupancy_kernels() {
  static const bool on = detail::env_knob_or("DIFUSE_QK_WAN_OCCUPANCY", 1) != 0;
  return on;
}

bool present(const difuse_tensor_view& v) { return v.data != nullptr || v.rank != 0; }

// Leading dims of a view (all but the last) hold `bytes`-aligned rows: the pointer and every stride of a dim of
// size > 1 (counted in elements of `elem` bytes).
bool rows_aligned(const difuse_tensor_view& x, int64_t elem, uintptr_t bytes) {
  if (!detail::aligned(x.data, bytes)) return false;
  for (int d = 0; d + 1 < x.rank; ++d)
    if (x.sizes[d] > 1 && (x.strides[d] * elem) % static_cast<int64_t>(bytes) != 0) return false;
  return true;
}

// q or k: a bf16 [B, S, N] row view; false when its rank is wrong (the caller then skips shape comparisons).
bool require_rows(detail::Support& s, const difuse_tensor_view& x, const char* name) {
  const std::string n(name);
  if (!detail::require_bf16_row_view(s, x, name)) return false;
  if (x.rank != 3) {
    DIFUSE_REQUIRE(s, false, n + " must be [B, S, heads * head_dim] (the projection, before the head split), got " +
                                 detail::describe(x));
    return false;
  }
  if (detail::numel(x) > 0) {
    if (detail::is_contiguous(x))
      DIFUSE_REQUIRE(s, detail::aligned(x.data, 8),
                     "a contiguous " + n + " must be 8-byte aligned (a misaligned one takes aten's two-kernel "
                     "RMSNorm, which rounds differently), got " + detail::describe(x));
    else
      DIFUSE_REQUIRE(s, rows_aligned(x, 2, 8),
                     n + " rows must be 8-byte aligned (pointer and leading strides multiples of 4 elements), got " +
                         detail::describe(x));
  }
  return true;
}

void require_weight(detail::Support& s, const difuse_tensor_view& w, const char* name, int64_t N, int device) {
  if (!present(w)) return;
  const std::string n(name);
  DIFUSE_REQUIRE(s, w.dtype == DIFUSE_BF16,
                 n + " must be bf16 like q (another dtype takes aten's composite RMSNorm), got " +
                     difuse_dtype_name(w.dtype));
  DIFUSE_REQUIRE(s, w.rank == 1 && w.sizes[0] == N && w.strides[0] == 1,
                 n + " must be a contiguous [" + std::to_string(N) + "], got " + detail::describe(w));
  DIFUSE_REQUIRE(s, w.device == device, n + " must be on the device of q, got " + detail::describe(w));
  DIFUSE_REQUIRE(s, w.data != nullptr && detail::aligned(w.data, 8), n + " must be 8-byte aligned");
}

// D < 0: head_dim unknown (heads invalid), the last dim is then not compared.
void require_table(detail::Support& s, const difuse_tensor_view& t, const char* name, int64_t B, int64_t S,
                   int64_t D, int device) {
  const std::string n(name);
  DIFUSE_REQUIRE(s, t.dtype == DIFUSE_F32,
                 n + " must be fp32 (as WanRotaryPosEmbed returns it; another dtype is another rounding chain), got " +
                     difuse_dtype_name(t.dtype));
  const bool shape = t.rank == 4 && (t.sizes[0] == 1 || t.sizes[0] == B) && t.sizes[1] == S && t.sizes[2] == 1 &&
                     (D < 0 || t.sizes[3] == D);
  DIFUSE_REQUIRE(s, shape, n + " must be [1, " + std::to_string(S) + ", 1, " +
                               (D < 0 ? std::string("head_dim") : std::to_string(D)) +
                               "] (or [B, S, 1, head_dim]) as WanRotaryPosEmbed returns it, got " + detail::describe(t));
  if (t.rank == 4) {
    bool nonneg = true;
    for (int d = 0; d < 4; ++d) nonneg = nonneg && t.strides[d] >= 0;
    DIFUSE_REQUIRE(s, nonneg && (t.strides[3] == 1 || t.sizes[3] <= 1),
                   n + " must have a contiguous last dim and non-negative strides, got " + detail::describe(t));
    DIFUSE_REQUIRE(s, t.data != nullptr && rows_aligned(t, 4, 16),
                   n + " rows must be 16-byte aligned (pointer and leading strides multiples of 4 elements), got " +
                       detail::describe(t));
  }
  DIFUSE_REQUIRE(s, t.device == device, n + " must be on the device of q, got " + detail::describe(t));
}

void require_output(detail::Support& s, const difuse_tensor_view& out, const char* name, int64_t B, int64_t S,
                    int64_t H, int64_t D, int device, std::initializer_list<const difuse_tensor_view*> inputs) {
  const std::string n(name);
  if (!present(out)) {
    DIFUSE_REQUIRE(s, false, n + " is required");
    return;
  }
  DIFUSE_REQUIRE(s, out.dtype == DIFUSE_BF16, n + " must be bf16, got " + difuse_dtype_name(out.dtype));
  const bool shape = out.rank == 4 && out.sizes[0] == B && out.sizes[1] == S && (D < 0 || (out.sizes[2] == H &&
                                                                                           out.sizes[3] == D));
  DIFUSE_REQUIRE(s, shape && detail::is_contiguous(out),
                 n + " must be a contiguous [" + std::to_string(B) + ", " + std::to_string(S) + ", " +
                     std::to_string(H) + ", " + (D < 0 ? std::string("head_dim") : std::to_string(D)) + "], got " +
                     detail::describe(out));
  DIFUSE_REQUIRE(s, out.device == device, n + " must be on the device of q, got " + detail::describe(out));
  if (detail::numel(out) == 0) return;
  DIFUSE_REQUIRE(s, out.data != nullptr && detail::aligned(out.data, 8), n + " must be 8-byte aligned");
  for (const difuse_tensor_view* in : inputs)
    if (present(*in) && in->data != nullptr)
      DIFUSE_REQUIRE(s, !detail::overlaps(out, *in), n + " overlaps an input");
}

template <int SW>
void launch(const Params& p, bool paired, unsigned blocks, cudaStream_t stream) {
  if constexpr (SW == 2 || SW == 3) {
    if (paired && occupancy_kernels()) {
      qk_norm_rope_wan_occupied<SW, SW == 2 ? 16 : 12><<<blocks, kThreads, 0, stream>>>(p);
      return;
    }
  }
  if (paired)
    qk_norm_rope_wan_kernel<SW, true><<<blocks, kThreads, 0, stream>>>(p);
  else
    qk_norm_rope_wan_kernel<SW, false><<<blocks, kThreads, 0, stream>>>(p);
}

}  // namespace

detail::Support can_use_qk_norm_rope_wan(const QkNormRopeWanArgs& a) {
  detail::Support s;
  if (!present(a.freqs_cos) || !present(a.freqs_sin))
    DIFUSE_REQUIRE(s, false, "freqs_cos and freqs_sin are required (WanRotaryPosEmbed's output)");
  if (!present(a.q) || !present(a.k)) {  // every other check is relative to q's shape; missing tables are not
    DIFUSE_REQUIRE(s, false, "q and k are required");
    return s;
  }
  bool shapes = require_rows(s, a.q, "q");
  shapes = require_rows(s, a.k, "k") && shapes;
  if (!shapes) return s;

  const int64_t B = a.q.sizes[0], S = a.q.sizes[1], N = a.q.sizes[2], H = a.heads;
  const int dev = a.q.device;
  DIFUSE_REQUIRE(s, a.k.sizes[0] == B && a.k.sizes[1] == S && a.k.sizes[2] == N && a.k.device == dev,
                 "k must have q's shape and device " + detail::describe(a.q) + ", got " + detail::describe(a.k));
  const bool heads_ok = H >= 1 && N % H == 0;
  DIFUSE_REQUIRE(s, heads_ok, "heads must be positive and divide q's width " + std::to_string(N) + ", got " +
                                  std::to_string(H));
  const int64_t D = heads_ok ? N / H : -1;
  if (heads_ok)
    DIFUSE_REQUIRE(s, D >= 4 && D <= 512 && (D & (D - 1)) == 0,
                   "head_dim = width / heads must be a power of two in [4, 512] (a thread's RoPE columns stay fixed "
                   "across its sweeps of 512 elements), got " + std::to_string(D));
  DIFUSE_REQUIRE(s, N % 4 == 0, "the width heads * head_dim must be a multiple of 4 (aten's vectorized RMSNorm), got " +
                                    std::to_string(N));
  DIFUSE_REQUIRE(s, N <= kMaxWidth, "the width heads * head_dim must be at most " + std::to_string(kMaxWidth) +
                                        " (rows are held in registers), got " + std::to_string(N));
  DIFUSE_REQUIRE(s, B * S <= int64_t{2147483647}, "at most 2^31 - 1 tokens in the batch");
  require_weight(s, a.q_weight, "q_weight", N, dev);
  require_weight(s, a.k_weight, "k_weight", N, dev);
  if (present(a.freqs_cos)) require_table(s, a.freqs_cos, "freqs_cos", B, S, D, dev);
  if (present(a.freqs_sin)) require_table(s, a.freqs_sin, "freqs_sin", B, S, D, dev);
  const std::initializer_list<const difuse_tensor_view*> inputs = {&a.q, &a.k, &a.q_weight, &a.k_weight,
                                                                   &a.freqs_cos, &a.freqs_sin};
  require_output(s, a.q_out, "q_out", B, S, H, D, dev, inputs);
  require_output(s, a.k_out, "k_out", B, S, H, D, dev, inputs);
  if (present(a.q_out) && present(a.k_out))
    DIFUSE_REQUIRE(s, !detail::overlaps(a.q_out, a.k_out), "q_out and k_out overlap");
  return s;
}

void qk_norm_rope_wan(const QkNormRopeWanArgs& a, cudaStream_t stream) {
  const detail::Support s = can_use_qk_norm_rope_wan(a);
  if (!s.ok()) throw detail::Failure(DIFUSE_ERR_UNSUPPORTED, s.message("qk_norm_rope_wan"));
  const int64_t blocks = a.q.sizes[0] * a.q.sizes[1];
  if (blocks == 0) return;
  Params p{};
  const difuse_tensor_view* in[2] = {&a.q, &a.k};
  const difuse_tensor_view* w[2] = {&a.q_weight, &a.k_weight};
  const difuse_tensor_view* out[2] = {&a.q_out, &a.k_out};
  for (int r = 0; r < 2; ++r) {
    p.x[r] = static_cast<const uint16_t*>(in[r]->data);
    p.xb[r] = in[r]->strides[0];
    p.xs[r] = in[r]->strides[1];
    p.w[r] = present(*w[r]) ? static_cast<const uint16_t*>(w[r]->data) : nullptr;
    p.out[r] = static_cast<uint16_t*>(out[r]->data);
  }
  p.cos = static_cast<const float*>(a.freqs_cos.data);
  p.sin = static_cast<const float*>(a.freqs_sin.data);
  const difuse_tensor_view* table[2] = {&a.freqs_cos, &a.freqs_sin};
  for (int r = 0; r < 2; ++r) {
    p.tb[r] = table[r]->sizes[0] > 1 ? table[r]->strides[0] : 0;  // [1, S, 1, D]: one table for every batch row
    p.ts[r] = table[r]->strides[1];
  }
  p.S = a.q.sizes[1];
  p.n = static_cast<int>(a.q.sizes[2]);
  p.v = p.n / 4;
  p.d = static_cast<int>(p.n / a.heads);
  p.eps = static_cast<float>(a.eps);
  const detail::DeviceGuard device_guard(a.q.device);
  bool paired = p.n % 8 == 0 && rows_aligned(a.q, 2, 16) && rows_aligned(a.k, 2, 16) &&
                detail::aligned(a.q_out.data, 16) && detail::aligned(a.k_out.data, 16);
  for (int r = 0; r < 2; ++r) paired = paired && (p.w[r] == nullptr || detail::aligned(p.w[r], 16));
  const int sweeps = (p.v + norm::kAtenThreads - 1) / norm::kAtenThreads;
  const unsigned grid = static_cast<unsigned>(blocks);
  if (sweeps <= 1)
    launch<1>(p, paired, grid, stream);
  else if (sweeps <= 2)
    launch<2>(p, paired, grid, stream);
  else if (sweeps <= 3)
    launch<3>(p, paired, grid, stream);  // Wan 1.3B: 1536
  else if (sweeps <= 4)
    launch<4>(p, paired, grid, stream);
  else if (sweeps <= 6)
    launch<6>(p, paired, grid, stream);  // TI2V-5B: 3072
  else if (sweeps <= 8)
    launch<8>(p, paired, grid, stream);
  else if (sweeps <= 10)
    launch<10>(p, paired, grid, stream);  // 14B: 5120
  else if (sweeps <= 12)
    launch<12>(p, paired, grid, stream);
  else
    launch<16>(p, paired, grid, stream);
  DIFUSE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace difuse::rope
