// Native GPU smoke test for libdifuse's C ABI (no torch): runs layernorm_modulate on every default schedule
// (two, four warps per row; one under DIFUSE_LNMOD_THREADS_PER_ROW=32, 8- and 16-byte accesses, the two-pass kernel), its gated-residual form, Wan's fp32 form, the other
// row ops and the
// attention prologues (FLUX, Qwen-Image, SD3.5, Wan), ERNIE's rope_rotate_half, activation_mul and the benchmarks'
// streaming probe, checks that every output
// element is written, that two launches give identical bits, and that the result is within a few bf16
// ulps of the host emulation (whose rsqrt is approximate: exactness is the torch tests' job). Meant to
// run under compute-sanitizer memcheck and racecheck. Exit code 0 = pass. Arguments: --quick (without the
// 4096-row LayerNorm case), --probe-only (the streaming probe's case alone).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "difuse/difuse.hpp"
#include "difuse/numerics/activation.h"
#include "difuse/numerics/rope.h"
#include "norm/layernorm_schedule.h"

#define CHECK_CUDA(x)                                                                      \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s failed: %s (%s:%d)\n", #x, cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(2);                                                                        \
    }                                                                                      \
  } while (0)

using namespace difuse;

namespace {

// The host's LayerNorm statistics of one bf16 row of H elements in double: {mean, 1 / sqrt(var + 1e-6)}.
struct HostStats {
  double mean, rstd;
};
HostStats host_layernorm_stats(const uint16_t* row, int64_t H) {
  double mean = 0, var = 0;
  for (int64_t c = 0; c < H; ++c) mean += num::bf16_to_float(row[c]);
  mean /= H;
  for (int64_t c = 0; c < H; ++c) var += std::pow(num::bf16_to_float(row[c]) - mean, 2);
  return {mean, 1.0 / std::sqrt(var / H + 1e-6)};
}

int run_case(int64_t B, int64_t L, int64_t H, int64_t chunks, bool misalign16) {
  std::mt19937 rng(static_cast<unsigned>(B * 131 + L * 7 + H));
  std::normal_distribution<float> nd(0.3f, 1.5f), sd(0.f, 0.5f);
  const int64_t n = B * L * H, emb = B * chunks * H;
  const int64_t pad = misalign16 ? 4 : 0;  // 8-byte but not 16-byte aligned x/out
  std::vector<uint16_t> hx(n), hemb(emb);
  for (auto& v : hx) v = num::float_to_bf16_rne(nd(rng));
  for (auto& v : hemb) v = num::float_to_bf16_rne(sd(rng));
  uint16_t *dx, *dout, *demb;
  CHECK_CUDA(cudaMalloc(&dx, (n + pad) * 2));
  CHECK_CUDA(cudaMalloc(&dout, (n + pad) * 2));
  CHECK_CUDA(cudaMalloc(&demb, emb * 2));
  CHECK_CUDA(cudaMemcpy(dx + pad, hx.data(), n * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(demb, hemb.data(), emb * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(dout, 0xFF, (n + pad) * 2));  // poison: 0xFFFF never comes out (NaN is 0x7FFF)

  const auto x = TensorView::contiguous(dx + pad, DType::BF16, {B, L, H}, 0);
  const auto out = TensorView::contiguous(dout + pad, DType::BF16, {B, L, H}, 0);
  const TensorView shift(demb, DType::BF16, {B, H}, {chunks * H, 1}, 0);
  const TensorView scale(demb + H, DType::BF16, {B, H}, {chunks * H, 1}, 0);
  layernorm_modulate(out, x, scale, shift, 1e-6, nullptr);
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<uint16_t> o1(n), o2(n);
  CHECK_CUDA(cudaMemcpy(o1.data(), dout + pad, n * 2, cudaMemcpyDeviceToHost));
  layernorm_modulate(out, x, scale, shift, 1e-6, nullptr);
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(cudaMemcpy(o2.data(), dout + pad, n * 2, cudaMemcpyDeviceToHost));

  int64_t unwritten = 0, nondet = 0, far = 0;
  for (int64_t r = 0; r < B * L; ++r) {
    const int64_t b = r / L;
    const auto [mean, rstd] = host_layernorm_stats(hx.data() + r * H, H);
    for (int64_t c = 0; c < H; ++c) {
      const int64_t i = r * H + c;
      unwritten += o1[i] == 0xFFFF;
      nondet += o1[i] != o2[i];
      const double nrm = (num::bf16_to_float(hx[i]) - mean) * rstd;
      const double a = 1.0 + num::bf16_to_float(hemb[b * chunks * H + H + c]);
      const double sh = num::bf16_to_float(hemb[b * chunks * H + c]);
      const double tol = std::ldexp(std::fabs(nrm * a) + std::fabs(sh), -6) + 1e-6;
      far += std::fabs(num::bf16_to_float(o1[i]) - (nrm * a + sh)) > tol;
    }
  }
  CHECK_CUDA(cudaFree(dx));
  CHECK_CUDA(cudaFree(dout));
  CHECK_CUDA(cudaFree(demb));
  const bool ok = unwritten == 0 && nondet == 0 && far == 0;
  std::printf("%-4s B=%lld L=%lld H=%lld%s: unwritten %lld, nondeterministic %lld, out of tolerance %lld\n",
              ok ? "ok" : "FAIL", (long long)B, (long long)L, (long long)H, misalign16 ? " (8-byte aligned)" : "",
              (long long)unwritten, (long long)nondet, (long long)far);
  return ok ? 0 : 1;
}

// gated_residual_layernorm_modulate (the pre-FF site): residual = h + gate * a, out = LN(residual) * (1 + scale) +
// shift. Both outputs written and deterministic; the residual within one bf16 rounding of the host's (eager
// rounds gate * a first), out close to the host's LayerNorm of the device's residual.
int run_grln_case(int64_t B, int64_t L, int64_t H) {
  std::mt19937 rng(static_cast<unsigned>(B * 17 + L * 5 + H));
  std::normal_distribution<float> nd(0.2f, 1.3f), sd(0.f, 0.5f);
  const int64_t n = B * L * H, chunks = 6, emb = B * chunks * H;
  std::vector<uint16_t> hh(n), ha(n), hemb(emb);
  for (auto* v : {&hh, &ha})
    for (auto& e : *v) e = num::float_to_bf16_rne(nd(rng));
  for (auto& e : hemb) e = num::float_to_bf16_rne(sd(rng));
  uint16_t *dh, *da, *demb, *dres, *dout;
  for (auto** p : {&dh, &da, &dres, &dout}) CHECK_CUDA(cudaMalloc(p, n * 2));
  CHECK_CUDA(cudaMalloc(&demb, emb * 2));
  CHECK_CUDA(cudaMemcpy(dh, hh.data(), n * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(da, ha.data(), n * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(demb, hemb.data(), emb * 2, cudaMemcpyHostToDevice));
  const auto view = [&](uint16_t* d) { return TensorView::contiguous(d, DType::BF16, {B, L, H}, 0); };
  const auto chunk = [&](int k) { return TensorView(demb + k * H, DType::BF16, {B, H}, {chunks * H, 1}, 0); };
  std::vector<uint16_t> r1(n), r2(n), o1(n), o2(n);
  for (int run = 0; run < 2; ++run) {
    CHECK_CUDA(cudaMemset(dres, 0xFF, n * 2));
    CHECK_CUDA(cudaMemset(dout, 0xFF, n * 2));
    gated_residual_layernorm_modulate(view(dout), view(dres), view(dh), view(da), chunk(2), chunk(4), chunk(3), 1e-6,
                                      nullptr);
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaMemcpy((run ? r2 : r1).data(), dres, n * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy((run ? o2 : o1).data(), dout, n * 2, cudaMemcpyDeviceToHost));
  }
  int64_t unwritten = 0, nondet = 0, far = 0;
  for (int64_t r = 0; r < B * L; ++r) {
    const int64_t b = r / L;
    const uint16_t* e = hemb.data() + b * chunks * H;
    const auto [mean, rstd] = host_layernorm_stats(r1.data() + r * H, H);
    for (int64_t c = 0; c < H; ++c) {
      const int64_t i = r * H + c;
      unwritten += (r1[i] == 0xFFFF) + (o1[i] == 0xFFFF);
      nondet += (r1[i] != r2[i]) + (o1[i] != o2[i]);
      const double want_r = num::bf16_to_float(hh[i]) +
          num::round_bf16(num::bf16_to_float(e[2 * H + c]) * num::bf16_to_float(ha[i]));
      far += std::fabs(num::bf16_to_float(r1[i]) - want_r) > std::ldexp(std::fabs(want_r), -7) + 1e-6;
      const double nrm = (num::bf16_to_float(r1[i]) - mean) * rstd;
      const double scaled = nrm * (1.0 + num::bf16_to_float(e[4 * H + c])), sh = num::bf16_to_float(e[3 * H + c]);
      const double tol = std::ldexp(std::fabs(scaled) + std::fabs(sh), -6) + 1e-6;  // as run_case's
      far += std::fabs(num::bf16_to_float(o1[i]) - (scaled + sh)) > tol;
    }
  }
  for (auto* p : {dh, da, demb, dres, dout}) CHECK_CUDA(cudaFree(p));
  const bool ok = unwritten == 0 && nondet == 0 && far == 0;
  std::printf("%-4s gated_residual_layernorm_modulate B=%lld L=%lld H=%lld: unwritten %lld, nondeterministic %lld, "
              "out of tolerance %lld\n", ok ? "ok" : "FAIL", (long long)B, (long long)L, (long long)H,
              (long long)unwritten, (long long)nondet, (long long)far);
  return ok ? 0 : 1;
}
// layernorm_modulate_fp32 (Wan): out = bf16(LN32(x) * (1 + scale) + shift), fp32 [B, 1, H] rows of a [B, 6, H]
// fp32 buffer (16-byte aligned, one per batch: the streamed kernel stages them under DIFUSE_LNMOD_STREAMED). Every
// element written, deterministic, within a bf16 rounding or two of the host's double LayerNorm.
int run_f32_case(int64_t B, int64_t L, int64_t H) {
  std::mt19937 rng(static_cast<unsigned>(B * 29 + L * 3 + H));
  std::normal_distribution<float> nd(-0.4f, 1.7f), sd(0.f, 0.5f);
  const int64_t n = B * L * H, rows6 = B * 6 * H;
  std::vector<uint16_t> hx(n);
  std::vector<float> h6(rows6);
  for (auto& v : hx) v = num::float_to_bf16_rne(nd(rng));
  for (auto& v : h6) v = sd(rng);
  uint16_t *dx, *dout;
  float* d6;
  CHECK_CUDA(cudaMalloc(&dx, n * 2));
  CHECK_CUDA(cudaMalloc(&dout, n * 2));
  CHECK_CUDA(cudaMalloc(&d6, rows6 * 4));
  CHECK_CUDA(cudaMemcpy(dx, hx.data(), n * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d6, h6.data(), rows6 * 4, cudaMemcpyHostToDevice));
  const auto x = TensorView::contiguous(dx, DType::BF16, {B, L, H}, 0);
  const auto out = TensorView::contiguous(dout, DType::BF16, {B, L, H}, 0);
  const TensorView shift(d6, DType::F32, {B, 1, H}, {6 * H, H, 1}, 0);
  const TensorView scale(d6 + H, DType::F32, {B, 1, H}, {6 * H, H, 1}, 0);
  std::vector<uint16_t> o1(n), o2(n);
  for (int run = 0; run < 2; ++run) {
    CHECK_CUDA(cudaMemset(dout, 0xFF, n * 2));
    layernorm_modulate_fp32(out, x, scale, shift, 1e-6, nullptr);
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaMemcpy((run ? o2 : o1).data(), dout, n * 2, cudaMemcpyDeviceToHost));
  }
  int64_t unwritten = 0, nondet = 0, far = 0;
  for (int64_t r = 0; r < B * L; ++r) {
    const float* sh = h6.data() + (r / L) * 6 * H;
    const auto [mean, rstd] = host_layernorm_stats(hx.data() + r * H, H);
    for (int64_t c = 0; c < H; ++c) {
      const int64_t i = r * H + c;
      unwritten += o1[i] == 0xFFFF;
      nondet += o1[i] != o2[i];
      const double want = (num::bf16_to_float(hx[i]) - mean) * rstd * (1.0 + sh[H + c]) + sh[c];
      far += std::fabs(num::bf16_to_float(o1[i]) - want) > std::ldexp(std::fabs(want), -7) + 1e-5;
    }
  }
  for (void* p : {static_cast<void*>(dx), static_cast<void*>(dout), static_cast<void*>(d6)}) CHECK_CUDA(cudaFree(p));
  const bool ok = unwritten == 0 && nondet == 0 && far == 0;
  std::printf("%-4s layernorm_modulate_fp32 B=%lld L=%lld H=%lld: unwritten %lld, nondeterministic %lld, out of "
              "tolerance %lld\n", ok ? "ok" : "FAIL", (long long)B, (long long)L, (long long)H, (long long)unwritten,
              (long long)nondet, (long long)far);
  return ok ? 0 : 1;
}
// 1152 (and GRLN's and layernorm_modulate's 2432): widths whose aten warps push equal counts that differ between
// warps, the streamed rows' warp-equal trees (kTreeWarpEqual), which the sanitizer parts' DIFUSE_LNMOD_STREAMED knobs
// reach on these few rows.
constexpr int kF32Cases = 3;
int run_f32_cases() { return run_f32_case(2, 37, 5120) + run_f32_case(1, 19, 1536) + run_f32_case(1, 29, 1152); }

constexpr int kGrlnCases = 3;
int run_grln_cases() { return run_grln_case(2, 37, 3072) + run_grln_case(1, 19, 1536) + run_grln_case(2, 37, 2432); }

// Elementwise and RMS ops: every element written, deterministic, close to a double-precision reference.
template <class Launch, class Ref>
int run_elementwise(const char* name, int64_t rows, int64_t cols, Launch launch, Ref ref) {
  std::mt19937 rng(static_cast<unsigned>(rows * 31 + cols));
  std::normal_distribution<float> nd(0.f, 2.f);
  const int64_t n = rows * cols;
  std::vector<uint16_t> ha(n), hb(n), hw(cols);
  for (auto& v : ha) v = num::float_to_bf16_rne(nd(rng));
  for (auto& v : hb) v = num::float_to_bf16_rne(nd(rng));
  for (auto& v : hw) v = num::float_to_bf16_rne(nd(rng));
  uint16_t *da, *db, *dw, *dout;
  CHECK_CUDA(cudaMalloc(&da, n * 2));
  CHECK_CUDA(cudaMalloc(&db, n * 2));
  CHECK_CUDA(cudaMalloc(&dw, cols * 2));
  CHECK_CUDA(cudaMalloc(&dout, n * 2));
  CHECK_CUDA(cudaMemcpy(da, ha.data(), n * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(db, hb.data(), n * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dw, hw.data(), cols * 2, cudaMemcpyHostToDevice));
  std::vector<uint16_t> o1(n), o2(n);
  for (auto* o : {&o1, &o2}) {
    CHECK_CUDA(cudaMemset(dout, 0xFF, n * 2));
    launch(dout, da, db, dw);
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaMemcpy(o->data(), dout, n * 2, cudaMemcpyDeviceToHost));
  }
  int64_t unwritten = 0, nondet = 0, far = 0;
  for (int64_t i = 0; i < n; ++i) {
    unwritten += o1[i] == 0xFFFF;
    nondet += o1[i] != o2[i];
    const double want = ref(ha, hb, hw, i / cols, i % cols, cols);
    far += std::fabs(num::bf16_to_float(o1[i]) - want) > std::ldexp(std::fabs(want), -6) + 1e-5;
  }
  for (auto* p : {da, db, dw, dout}) CHECK_CUDA(cudaFree(p));
  const bool ok = unwritten == 0 && nondet == 0 && far == 0;
  std::printf("%-4s %s %lldx%lld: unwritten %lld, nondeterministic %lld, out of tolerance %lld\n", ok ? "ok" : "FAIL",
              name, (long long)rows, (long long)cols, (long long)unwritten, (long long)nondet, (long long)far);
  return ok ? 0 : 1;
}

double f(const std::vector<uint16_t>& v, int64_t i) { return num::bf16_to_float(v[i]); }

int run_other_ops() {
  int fails = 0;
  for (int64_t cols : {3072, 126}) {  // 16-byte and 4-byte accesses
    fails += run_elementwise("gated_residual", 37, cols,
        [&](uint16_t* out, uint16_t* h, uint16_t* a, uint16_t* g) {
          gated_residual(TensorView::contiguous(out, DType::BF16, {1, 37, cols}, 0),
                         TensorView::contiguous(h, DType::BF16, {1, 37, cols}, 0),
                         TensorView::contiguous(a, DType::BF16, {1, 37, cols}, 0),
                         TensorView::contiguous(g, DType::BF16, {1, cols}, 0), nullptr);
        },
        [](auto& h, auto& a, auto& g, int64_t r, int64_t c, int64_t n) {  // eager rounds gate * a to bf16 first
          return f(h, r * n + c) + num::round_bf16(static_cast<float>(f(g, c) * f(a, r * n + c)));
        });
    fails += run_elementwise("gelu_tanh", 37, cols,
        [&](uint16_t* out, uint16_t* x, uint16_t*, uint16_t*) {
          gelu_tanh(TensorView::contiguous(out, DType::BF16, {37, cols}, 0),
                    TensorView::contiguous(x, DType::BF16, {37, cols}, 0), nullptr);
        },
        [](auto& x, auto&, auto&, int64_t r, int64_t c, int64_t n) {
          const double v = f(x, r * n + c);
          return 0.5 * v * (1.0 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
        });
  }
  for (int64_t cols : {128, 3072, 5120, 30000}) {  // per head, staged one/two warps, four warps / two-pass
    fails += run_elementwise("rms_norm", 19, cols,
        [&](uint16_t* out, uint16_t* x, uint16_t*, uint16_t* w) {
          const auto wv = TensorView::contiguous(w, DType::BF16, {cols}, 0);
          rms_norm(TensorView::contiguous(out, DType::BF16, {19, cols}, 0),
                   TensorView::contiguous(x, DType::BF16, {19, cols}, 0), &wv, 1e-6, nullptr);
        },
        [](auto& x, auto&, auto& w, int64_t r, int64_t c, int64_t n) {
          double ss = 0;
          for (int64_t k = 0; k < n; ++k) ss += f(x, r * n + k) * f(x, r * n + k);
          return f(x, r * n + c) / std::sqrt(ss / n + 1e-6) * f(w, c);
        });
  }
  // 256 x 3072: 98,304 vectors of 8, enough for gelu_tanh's shared-memory table kernel (the cases above compute)
  fails += run_elementwise("gelu_tanh (table)", 256, 3072,
      [&](uint16_t* out, uint16_t* x, uint16_t*, uint16_t*) {
        gelu_tanh(TensorView::contiguous(out, DType::BF16, {256, 3072}, 0),
                  TensorView::contiguous(x, DType::BF16, {256, 3072}, 0), nullptr);
      },
      [](auto& x, auto&, auto&, int64_t r, int64_t c, int64_t n) {
        const double v = f(x, r * n + c);
        return 0.5 * v * (1.0 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
      });
  // 64, 128: half-warp rows (staged under DIFUSE_RMSD_STAGED_ROWS=1); 19 rows: a part block. 3584, 8160: a warp per
  // row (staged in shared memory by default, the per-row kernel under DIFUSE_RMSD_WIDE_STAGED=0: 5 blocks of 4 rows, the last with one warp idle at
  // the barrier; 8160: 81.6 KB, above the 48 KB default)
  for (int64_t cols : {64, 128, 3584, 8160}) {
    fails += run_elementwise("rms_norm_diffusers", 19, cols,
        [&](uint16_t* out, uint16_t* x, uint16_t*, uint16_t* w) {
          const auto wv = TensorView::contiguous(w, DType::BF16, {cols}, 0);
          rms_norm_diffusers(TensorView::contiguous(out, DType::BF16, {19, cols}, 0),
                             TensorView::contiguous(x, DType::BF16, {19, cols}, 0), &wv, 1e-6, nullptr);
        },
        [](auto& x, auto&, auto& w, int64_t r, int64_t c, int64_t n) {  // two bf16 roundings: within tolerance
          double ss = 0;
          for (int64_t k = 0; k < n; ++k) ss += f(x, r * n + k) * f(x, r * n + k);
          return f(x, r * n + c) / std::sqrt(ss / n + 1e-6) * f(w, c);
        });
  }
  return fails;
}

// rms_norm_modulate / gated_residual_rms_norm_modulate (rms_norm_modulate.cu): every element written, the
// residual bit-exact (its host twin is exact), the output deterministic and within a few bf16 ulps of a double
// reference of each term (n is rounded to bf16 twice before the modulate). One case per kernel class; a per-token
// gate ([rows, cols], the residual form's quarter-batch kernel) where token_gate; no weight (LTX-2's norm, the chain
// without the weight's multiply) where !weight; where permuted_a (rows even), a is ERNIE-Image's attention output as
// its block hands it: stored [2, rows / 2, cols], read as the [rows / 2, 2, cols] view (row r at (r % 2, r / 2)).
int run_rms_norm_modulate(int64_t rows, int64_t cols, bool residual, bool fp32, bool token_gate = false,
                          bool weight = true, bool permuted_a = false) {
  std::mt19937 rng(static_cast<unsigned>(rows * 17 + cols * 3 + residual));
  std::normal_distribution<float> nd(0.f, 1.5f), sd(0.f, 0.5f);
  const int64_t n = rows * cols;
  std::vector<uint16_t> hx(n), ha(n), hw(cols), hm(3 * cols), hg(n);  // hm: shift, scale, gate rows; hg: per token
  for (auto& v : hx) v = num::float_to_bf16_rne(nd(rng));
  for (auto& v : ha) v = num::float_to_bf16_rne(nd(rng));
  for (auto& v : hw) v = num::float_to_bf16_rne(nd(rng));
  for (auto& v : hm) v = num::float_to_bf16_rne(sd(rng));
  for (auto& v : hg) v = num::float_to_bf16_rne(sd(rng));
  uint16_t *dx, *da, *dw, *dm, *dout, *dres, *dg;
  for (auto* p : {&dx, &da, &dout, &dres, &dg}) CHECK_CUDA(cudaMalloc(p, n * 2));
  CHECK_CUDA(cudaMalloc(&dw, cols * 2));
  CHECK_CUDA(cudaMalloc(&dm, 3 * cols * 2));
  CHECK_CUDA(cudaMemcpy(dx, hx.data(), n * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(da, ha.data(), n * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dw, hw.data(), cols * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dm, hm.data(), 3 * cols * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dg, hg.data(), n * 2, cudaMemcpyHostToDevice));
  const auto x = permuted_a ? TensorView::contiguous(dx, DType::BF16, {rows / 2, 2, cols}, 0)
                            : TensorView::contiguous(dx, DType::BF16, {rows, cols}, 0);
  const int64_t half = rows / 2;
  const auto a = permuted_a ? TensorView(da, DType::BF16, {half, 2, cols}, {cols, half * cols, 1}, 0)
                            : TensorView::contiguous(da, DType::BF16, {rows, cols}, 0);
  auto a_at = [&](int64_t r, int64_t c) { return permuted_a ? ((r % 2) * half + r / 2) * cols + c : r * cols + c; };
  auto like_x = [&](uint16_t* d) {
    return permuted_a ? TensorView::contiguous(d, DType::BF16, {rows / 2, 2, cols}, 0)
                      : TensorView::contiguous(d, DType::BF16, {rows, cols}, 0);
  };
  const auto out = like_x(dout), res = like_x(dres);
  const auto w = TensorView::contiguous(dw, DType::BF16, {cols}, 0);
  const auto shift = TensorView::contiguous(dm, DType::BF16, {cols}, 0);  // one row, broadcast to every row
  const auto scale = TensorView::contiguous(dm + cols, DType::BF16, {cols}, 0);
  const auto gate = token_gate ? TensorView::contiguous(dg, DType::BF16, {rows, cols}, 0)
                               : TensorView::contiguous(dm + 2 * cols, DType::BF16, {cols}, 0);
  std::vector<uint16_t> o1(n), o2(n), r1(n);
  for (auto* o : {&o1, &o2}) {
    CHECK_CUDA(cudaMemset(dout, 0xFF, n * 2));
    CHECK_CUDA(cudaMemset(dres, 0xFF, n * 2));
    if (residual)
      gated_residual_rms_norm_modulate(out, res, x, a, gate, weight ? &w : nullptr, scale, shift, 1e-6, fp32, nullptr);
    else
      rms_norm_modulate(out, x, weight ? &w : nullptr, scale, shift, 1e-6, fp32, nullptr);
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaMemcpy(o->data(), dout, n * 2, cudaMemcpyDeviceToHost));
  }
  CHECK_CUDA(cudaMemcpy(r1.data(), dres, n * 2, cudaMemcpyDeviceToHost));
  int64_t unwritten = 0, nondet = 0, far = 0, residual_bits = 0;
  std::vector<double> h(cols);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = r * cols + c;
      uint16_t hb = hx[i];
      if (residual) {  // exact on the host: bf16(h + bf16(gate * a))
        const uint16_t g = token_gate ? hg[i] : hm[2 * cols + c];
        const float t = num::round_bf16(num::mul_rn(num::bf16_to_float(g), num::bf16_to_float(ha[a_at(r, c)])));
        hb = num::float_to_bf16_rne(num::add_rn(num::bf16_to_float(hx[i]), t));
        residual_bits += r1[i] != hb;
      }
      h[c] = num::bf16_to_float(hb);
      ss += h[c] * h[c];
    }
    const double rstd = 1.0 / std::sqrt(ss / cols + 1e-6);
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = r * cols + c;
      unwritten += o1[i] == 0xFFFF;
      nondet += o1[i] != o2[i];
      const double nm = h[c] * rstd * (weight ? num::bf16_to_float(hw[c]) : 1.0);
      const double t = nm * (1.0 + num::bf16_to_float(hm[cols + c])), sh = num::bf16_to_float(hm[c]);
      far += std::fabs(num::bf16_to_float(o1[i]) - (t + sh)) > std::ldexp(std::fabs(t) + std::fabs(sh), -5) + 1e-5;
    }
  }
  for (auto* p : {dx, da, dw, dm, dout, dres, dg}) CHECK_CUDA(cudaFree(p));
  const bool ok = unwritten == 0 && nondet == 0 && far == 0 && residual_bits == 0;
  std::printf("%-4s %s %lldx%lld%s%s%s%s: unwritten %lld, nondeterministic %lld, out of tolerance %lld, residual bits %lld\n",
              ok ? "ok" : "FAIL", residual ? "gated_residual_rms_norm_modulate" : "rms_norm_modulate", (long long)rows,
              (long long)cols, fp32 ? " (fp32 modulate)" : "", token_gate ? " (per-token gate)" : "",
              weight ? "" : " (no weight)", permuted_a ? " (a permuted)" : "", (long long)unwritten, (long long)nondet, (long long)far,
              (long long)residual_bits);
  return ok ? 0 : 1;
}

constexpr int kRmsModulateCases = 11;
int run_rms_norm_modulate_cases() {  // narrow rows, K = 8, 24, 32, 48 and 64 lane vectors; both forms without weight;
                                     // the residual form with ERNIE's permuted a (staged at 3072, two-pass at 4096)
  return run_rms_norm_modulate(19, 33, false, true) + run_rms_norm_modulate(17, 128, true, false) +
         run_rms_norm_modulate(19, 3072, true, true) + run_rms_norm_modulate(19, 4096, false, false) +
         run_rms_norm_modulate(19, 4100, true, false) + run_rms_norm_modulate(16, 8160, false, true) +
         run_rms_norm_modulate(23, 3072, true, true, true) + run_rms_norm_modulate(19, 3072, false, false, false, false) +
         run_rms_norm_modulate(21, 3072, true, true, false, false) +
         run_rms_norm_modulate(38, 3072, true, true, false, true, true) +
         run_rms_norm_modulate(46, 4096, true, true, false, true, true);
}

// The attention prologues (FLUX qk_norm_rope, Qwen-Image qk_norm_rope_qwen, SD3.5 qk_norm_sd35) on small joint
// shapes: every output element written, deterministic, v copied bit for bit, q and k within a few bf16 ulps of a
// double-precision RMSNorm (and RoPE). Under compute-sanitizer this covers the kernels' loads, including the
// staged (cp.async) kernels, the default; DIFUSE_QK_UNSTAGED=1 covers the per-row ones, DIFUSE_QK_PIPELINED=2 the
// pipelined FLUX and Qwen-Image kernels on a grid of 2 blocks (each block then loops over many tokens, reusing both
// buffers), DIFUSE_QK_VCOPY=1 the staged kernels' v rows copied in 16-byte vectors.
struct DeviceBufs {
  std::vector<void*> ptrs;
  template <class T>
  T* upload(const std::vector<T>& h) {
    void* d = nullptr;
    CHECK_CUDA(cudaMalloc(&d, h.size() * sizeof(T) + 16));
    CHECK_CUDA(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    ptrs.push_back(d);
    return static_cast<T*>(d);
  }
  uint16_t* poisoned(int64_t n) {
    void* d = nullptr;
    CHECK_CUDA(cudaMalloc(&d, n * 2));
    CHECK_CUDA(cudaMemset(d, 0xFF, n * 2));
    ptrs.push_back(d);
    return static_cast<uint16_t*>(d);
  }
  ~DeviceBufs() {
    for (void* p : ptrs) cudaFree(p);
  }
};

std::vector<uint16_t> random_bf16_vec(std::mt19937& rng, int64_t n, float mean, float sd) {
  std::normal_distribution<float> nd(mean, sd);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = num::float_to_bf16_rne(nd(rng));
  return v;
}

// rstd of one row as the eager norm computes it, in double.
double row_rstd(const uint16_t* x, int d, double eps) {
  double ss = 0;
  for (int i = 0; i < d; ++i) ss += static_cast<double>(num::bf16_to_float(x[i])) * num::bf16_to_float(x[i]);
  return 1.0 / std::sqrt(ss / d + eps);
}

// Counts over a prologue's outputs: poisoned (unwritten) and nondeterministic elements, q/k elements out of
// tolerance, v elements whose bits differ from the input.
struct Tally {
  int64_t unwritten = 0, nondet = 0, far = 0, v_bits = 0, outside = 0;  // outside: written before an output
  bool ok() const { return unwritten == 0 && nondet == 0 && far == 0 && v_bits == 0 && outside == 0; }
};

void tally_outputs(Tally& t, const std::vector<uint16_t>& o1, const std::vector<uint16_t>& o2) {
  for (size_t i = 0; i < o1.size(); ++i) {
    t.unwritten += o1[i] == 0xFFFF;
    t.nondet += o1[i] != o2[i];
  }
}

void check_close(Tally& t, uint16_t got, double want, double scale) {
  t.far += std::fabs(num::bf16_to_float(got) - want) > std::ldexp(scale, -5) + 1e-3;
}

std::vector<uint16_t> download(const uint16_t* d, int64_t n) {
  std::vector<uint16_t> h(n);
  CHECK_CUDA(cudaMemcpy(h.data(), d, n * 2, cudaMemcpyDeviceToHost));
  return h;
}

int report_prologue(const char* name, const Tally& t) {
  std::printf("%-4s %s: unwritten %lld, nondeterministic %lld, out of tolerance %lld, v bits differing %lld%s\n",
              t.ok() ? "ok" : "FAIL", name, (long long)t.unwritten, (long long)t.nondet, (long long)t.far,
              (long long)t.v_bits,
              t.outside ? (", written outside the output: " + std::to_string(t.outside)).c_str() : "");
  return t.ok() ? 0 : 1;
}

// FLUX (qk_norm_rope, D = 128, torch.nn.RMSNorm then interleaved RoPE) or Qwen-Image (qk_norm_rope_qwen, diffusers
// RMSNorm then the complex RoPE): streams [B, S, H, D] contiguous, first/text stream first in the joint output.
int run_joint_prologue(bool qwen) {
  const int64_t B = 2, S1 = 6, S2 = 13, H = 3, D = 128, S = S1 + S2;
  const double eps = 1e-6;
  std::mt19937 rng(qwen ? 91 : 90);
  std::vector<uint16_t> hx[2][3], hw[2][2];
  for (int st = 0; st < 2; ++st) {
    for (int r = 0; r < 3; ++r) hx[st][r] = random_bf16_vec(rng, B * (st ? S2 : S1) * H * D, 0.f, 1.f);
    for (int r = 0; r < 2; ++r) hw[st][r] = random_bf16_vec(rng, D, 1.f, 0.2f);
  }
  // FLUX: cos, sin [S, D] fp32 (pairs share an angle); Qwen: (cos, sin) pairs [S_stream, D] per stream
  std::uniform_real_distribution<float> ang(-3.f, 3.f);
  std::vector<float> tab[2];
  for (int k = 0; k < 2; ++k) {
    const int64_t rows = qwen ? (k ? S2 : S1) : S;
    tab[k].resize(rows * D);
    for (int64_t s = 0; s < rows; ++s)
      for (int i = 0; i < D / 2; ++i) {
        const float a = ang(rng);
        if (qwen) {
          tab[k][s * D + 2 * i] = std::cos(a), tab[k][s * D + 2 * i + 1] = std::sin(a);
        } else {
          tab[k][s * D + 2 * i] = tab[k][s * D + 2 * i + 1] = k ? std::sin(a) : std::cos(a);
        }
      }
  }
  DeviceBufs bufs;
  TensorView in[2][3], w[2][2], out[3], t[2];
  for (int st = 0; st < 2; ++st) {
    for (int r = 0; r < 3; ++r)
      in[st][r] = TensorView::contiguous(bufs.upload(hx[st][r]), DType::BF16, {B, st ? S2 : S1, H, D}, 0);
    for (int r = 0; r < 2; ++r) w[st][r] = TensorView::contiguous(bufs.upload(hw[st][r]), DType::BF16, {D}, 0);
  }
  for (int k = 0; k < 2; ++k)
    t[k] = TensorView::contiguous(bufs.upload(tab[k]), DType::F32, {qwen ? (k ? S2 : S1) : S, D}, 0);
  uint16_t* dout[3];
  for (int r = 0; r < 3; ++r) {
    dout[r] = bufs.poisoned(B * S * H * D);
    out[r] = TensorView::contiguous(dout[r], DType::BF16, {B, S, H, D}, 0);
  }
  auto launch = [&] {
    if (qwen) {
      const difuse_qk_norm_rope_qwen_args a{&out[0], &out[1], &out[2], &in[1][0], &in[1][1], &in[1][2], &w[1][0],
                                            &w[1][1], &in[0][0], &in[0][1], &in[0][2], &w[0][0], &w[0][1], &t[1],
                                            &t[0], eps};
      qk_norm_rope_qwen(a);
    } else {
      const difuse_qk_norm_rope_args a{&out[0], &out[1], &out[2], &in[1][0], &in[1][1], &in[1][2], &w[1][0],
                                       &w[1][1], &in[0][0], &in[0][1], &in[0][2], &w[0][0], &w[0][1], &t[0], &t[1],
                                       eps};
      qk_norm_rope(a);
    }
    CHECK_CUDA(cudaDeviceSynchronize());
  };
  launch();
  std::vector<uint16_t> o1[3];
  for (int r = 0; r < 3; ++r) o1[r] = download(dout[r], B * S * H * D);
  launch();
  Tally tl;
  for (int r = 0; r < 3; ++r) tally_outputs(tl, o1[r], download(dout[r], B * S * H * D));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < S; ++j) {
      const int st = j < S1 ? 0 : 1;
      const int64_t s = st ? j - S1 : j, Ss = st ? S2 : S1;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t src = ((b * Ss + s) * H + h) * D, dst = ((b * S + j) * H + h) * D;
        for (int i = 0; i < D; ++i) tl.v_bits += o1[2][dst + i] != hx[st][2][src + i];
        for (int r = 0; r < 2; ++r) {
          const uint16_t* x = hx[st][r].data() + src;
          const double rstd = row_rstd(x, static_cast<int>(D), eps);
          for (int i = 0; i < D; i += 2) {
            const double y0 = num::bf16_to_float(x[i]) * rstd * num::bf16_to_float(hw[st][r][i]);
            const double y1 = num::bf16_to_float(x[i + 1]) * rstd * num::bf16_to_float(hw[st][r][i + 1]);
            double c0, s0, c1, s1;
            if (qwen) {
              c0 = c1 = tab[st][s * D + i], s0 = s1 = tab[st][s * D + i + 1];
            } else {
              c0 = tab[0][j * D + i], c1 = tab[0][j * D + i + 1], s0 = tab[1][j * D + i], s1 = tab[1][j * D + i + 1];
            }
            // FLUX: out[2i] = y0 c - y1 s, out[2i+1] = y1 c + y0 s; Qwen: (y0 + i y1)(c + i s), the same form
            check_close(tl, o1[r][dst + i], y0 * c0 - y1 * s0, std::fabs(y0 * c0) + std::fabs(y1 * s0));
            check_close(tl, o1[r][dst + i + 1], y1 * c1 + y0 * s1, std::fabs(y1 * c1) + std::fabs(y0 * s1));
          }
        }
      }
    }
  return report_prologue(qwen ? "qk_norm_rope_qwen 2x(6+13)x3x128" : "qk_norm_rope 2x(6+13)x3x128", tl);
}

// SD3.5 (qk_norm_sd35, D = 64): [B, H, S, D] views of [B, S, H, D] projections, image first in the joint output.
// q_out_8B: q_out starts 8 bytes into its buffer (its rows 8-byte aligned, not 16: the C ABI allows it). The
// DIFUSE_QK_SD35_OUT_SMEM=1 kernel stored 16 bytes to such rows until the thirty-second session; the sanitizer's
// part 1b runs this case under that knob, and the 4 elements before q_out must stay poisoned.
int run_sd35_prologue(bool q_out_8B = false) {
  const int64_t B = 2, S1 = 13, S2 = 6, H = 3, D = 64, S = S1 + S2;
  const double eps = 1e-6;
  std::mt19937 rng(92);
  std::vector<uint16_t> hx[2][3], hw[2][2];
  for (int st = 0; st < 2; ++st) {
    for (int r = 0; r < 3; ++r) hx[st][r] = random_bf16_vec(rng, B * (st ? S2 : S1) * H * D, 0.f, 1.f);
    for (int r = 0; r < 2; ++r) hw[st][r] = random_bf16_vec(rng, D, 1.f, 0.2f);
  }
  DeviceBufs bufs;
  TensorView in[2][3], w[2][2], out[3];
  for (int st = 0; st < 2; ++st) {
    const int64_t Ss = st ? S2 : S1;
    for (int r = 0; r < 3; ++r)
      in[st][r] = TensorView(bufs.upload(hx[st][r]), DType::BF16, {B, H, Ss, D}, {Ss * H * D, D, H * D, 1}, 0);
    for (int r = 0; r < 2; ++r) w[st][r] = TensorView::contiguous(bufs.upload(hw[st][r]), DType::BF16, {D}, 0);
  }
  uint16_t* dout[3];
  const int64_t lead = q_out_8B ? 4 : 0;  // elements before q_out in its buffer
  for (int r = 0; r < 3; ++r) {
    dout[r] = bufs.poisoned(B * H * S * D + (r == 0 ? lead : 0)) + (r == 0 ? lead : 0);
    out[r] = TensorView::contiguous(dout[r], DType::BF16, {B, H, S, D}, 0);
  }
  const difuse_qk_norm_sd35_args a{&out[0], &out[1], &out[2], &in[0][0], &in[0][1], &in[0][2], &w[0][0], &w[0][1],
                                   &in[1][0], &in[1][1], &in[1][2], &w[1][0], &w[1][1], eps};
  qk_norm_sd35(a);
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<uint16_t> o1[3];
  for (int r = 0; r < 3; ++r) o1[r] = download(dout[r], B * H * S * D);
  qk_norm_sd35(a);
  CHECK_CUDA(cudaDeviceSynchronize());
  Tally tl;
  for (int r = 0; r < 3; ++r) tally_outputs(tl, o1[r], download(dout[r], B * H * S * D));
  if (lead)
    for (uint16_t before : download(dout[0] - lead, lead)) tl.outside += before != 0xFFFF;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = 0; j < S; ++j) {
        const int st = j < S1 ? 0 : 1;
        const int64_t s = st ? j - S1 : j, Ss = st ? S2 : S1;
        const int64_t src = ((b * Ss + s) * H + h) * D, dst = ((b * H + h) * S + j) * D;
        for (int i = 0; i < D; ++i) tl.v_bits += o1[2][dst + i] != hx[st][2][src + i];
        for (int r = 0; r < 2; ++r) {
          const uint16_t* x = hx[st][r].data() + src;
          const double rstd = row_rstd(x, static_cast<int>(D), eps);
          for (int i = 0; i < D; ++i) {
            const double y = num::bf16_to_float(x[i]) * rstd * num::bf16_to_float(hw[st][r][i]);
            check_close(tl, o1[r][dst + i], y, std::fabs(y));
          }
        }
      }
  return report_prologue(q_out_8B ? "qk_norm_sd35 2x3x(13+6)x64, q_out 8-byte aligned" : "qk_norm_sd35 2x3x(13+6)x64",
                         tl);
}

// The benchmarks' streaming probe (src/probe/stream_copy.cu): every variant copies exactly nbytes (a size that
// leaves partial chunks at every unroll and, at 40 MB, strides more than one resident wave) and nothing past it.
int run_stream_copy_probe() {
  int fails = 0;
  const int64_t sizes[] = {16 * 1000 + 16 * 7, 40000016};
  for (const int64_t n : sizes) {
    const int64_t guard = 4096;
    std::vector<uint8_t> host(n);
    std::mt19937 rng(static_cast<unsigned>(n));
    for (auto& b : host) b = static_cast<uint8_t>(rng());
    uint8_t *src = nullptr, *dst = nullptr;
    CHECK_CUDA(cudaMalloc(&src, n));
    CHECK_CUDA(cudaMalloc(&dst, n + guard));
    CHECK_CUDA(cudaMemcpy(src, host.data(), n, cudaMemcpyHostToDevice));
    std::vector<uint8_t> back(n + guard);
    for (int v = 0; v < difuse_probe_stream_copy_variants(); ++v) {
      CHECK_CUDA(cudaMemset(dst, 0xA5, n + guard));
      if (difuse_probe_stream_copy(dst, src, n, v, nullptr) != DIFUSE_OK) {
        std::fprintf(stderr, "stream_copy %s: %s\n", difuse_probe_stream_copy_variant_name(v), difuse_last_error());
        ++fails;
        continue;
      }
      CHECK_CUDA(cudaDeviceSynchronize());
      CHECK_CUDA(cudaMemcpy(back.data(), dst, n + guard, cudaMemcpyDeviceToHost));
      bool ok = std::equal(host.begin(), host.end(), back.begin());
      for (int64_t i = n; i < n + guard; ++i) ok = ok && back[i] == 0xA5;
      if (!ok) {
        std::fprintf(stderr, "stream_copy %s: wrong bytes at nbytes = %lld\n", difuse_probe_stream_copy_variant_name(v),
                     static_cast<long long>(n));
        ++fails;
      }
    }
    CHECK_CUDA(cudaFree(src));
    CHECK_CUDA(cudaFree(dst));
  }
  std::printf("stream_copy probe, %d variants x 2 sizes: %s\n", difuse_probe_stream_copy_variants(),
              fails ? "FAILED" : "ok");
  return fails ? 1 : 0;
}

// rope_rotate_half on x [1, S, H, D] (rows S * H of D columns) with cos and sin [1, S, 1, R] read from the second
// buffer (cos at 0, sin at S * R): the reference is the host twin of the kernel's pair arithmetic
// (numerics/rope.h), so "within tolerance" here means the same bits. R = D = 128: 16-byte vectors; D = 144: copied
// columns too; R = 6 of D = 10: the scalar kernel with copied columns.
constexpr int kRopeHalfCases = 3;
int run_rope_half_case(int64_t S, int64_t H, int64_t D, int64_t R) {
  const auto table = [S, R](uint16_t* base) {
    return TensorView(base, DType::BF16, {1, S, 1, R}, {S * R, R, R, 1}, 0);
  };
  return run_elementwise("rope_rotate_half", S * H, D,
      [&](uint16_t* out, uint16_t* x, uint16_t* t, uint16_t*) {
        rope_rotate_half(TensorView::contiguous(out, DType::BF16, {1, S, H, D}, 0),
                         TensorView::contiguous(x, DType::BF16, {1, S, H, D}, 0), table(t), table(t + S * R), nullptr);
      },
      [S, H, R](auto& x, auto& t, auto&, int64_t r, int64_t c, int64_t n) -> double {
        if (c >= R) return f(x, r * n + c);
        const int64_t s = r / H, h = R / 2, i = c < h ? c : c - h;
        float oa, ob;
        num::rope_rotate_half_pair(f(x, r * n + i), f(x, r * n + i + h), f(t, s * R + i), f(t, S * R + s * R + i),
                                   f(t, s * R + i + h), f(t, S * R + s * R + i + h), oa, ob);
        return num::round_bf16(c < h ? oa : ob);
      });
}
int run_rope_half_cases() {
  return run_rope_half_case(37, 4, 128, 128) + run_rope_half_case(11, 2, 144, 128) + run_rope_half_case(19, 3, 10, 6);
}

// rms_norm_rope_rotate_half on x [1, S, 4, 128] with tables that make the RoPE exact to predict: cos = 1, sin = 0
// (out = the normalized row) and cos = 0, sin = 1 (out = cat(-n2, n1)); the norm within tolerance of a double
// reference (the GPU tests compare its bits with eager's). One table row per token, broadcast over the batch.
constexpr int kRmsRopeHalfCases = 2;
int run_rms_rope_half_case(int64_t S, bool rotate) {
  const int64_t H = 4, D = 128;
  std::vector<uint16_t> one(S * D, num::float_to_bf16_rne(1.f)), zero(S * D, 0);
  uint16_t *dc = nullptr, *ds = nullptr;
  CHECK_CUDA(cudaMalloc(&dc, S * D * 2));
  CHECK_CUDA(cudaMalloc(&ds, S * D * 2));
  CHECK_CUDA(cudaMemcpy(dc, (rotate ? zero : one).data(), S * D * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(ds, (rotate ? one : zero).data(), S * D * 2, cudaMemcpyHostToDevice));
  const int r = run_elementwise(rotate ? "rms_norm_rope_rotate_half (rotation)" : "rms_norm_rope_rotate_half", S * H, D,
      [&](uint16_t* out, uint16_t* x, uint16_t*, uint16_t* w) {
        const auto wv = TensorView::contiguous(w, DType::BF16, {D}, 0);
        rms_norm_rope_rotate_half(TensorView::contiguous(out, DType::BF16, {1, S, H, D}, 0),
                                  TensorView::contiguous(x, DType::BF16, {1, S, H, D}, 0), &wv,
                                  TensorView::contiguous(dc, DType::BF16, {1, S, 1, D}, 0),
                                  TensorView::contiguous(ds, DType::BF16, {1, S, 1, D}, 0), 1e-6, nullptr);
      },
      [rotate](auto& x, auto&, auto& w, int64_t row, int64_t c, int64_t n) {
        double ss = 0;
        for (int64_t k = 0; k < n; ++k) ss += f(x, row * n + k) * f(x, row * n + k);
        const auto norm = [&](int64_t k) { return f(x, row * n + k) / std::sqrt(ss / n + 1e-6) * f(w, k); };
        if (!rotate) return norm(c);
        return c < n / 2 ? -norm(c + n / 2) : norm(c - n / 2);
      });
  CHECK_CUDA(cudaFree(dc));
  CHECK_CUDA(cudaFree(ds));
  return r;
}
int run_rms_rope_half_cases() { return run_rms_rope_half_case(37, false) + run_rms_rope_half_case(11, true); }

// activation_mul with a made-up table (act(p) = p's value halved, NaN patterns kept): its reference is the host twin
// of the product, so the check is of the bits. 300 x 1024: the shared-memory table kernel; 37 x 3072: the L1 kernel
// with 16-byte accesses; 19 x 126: one element per access. Each shape twice: whole rows, then as two launches on the
// column halves (a, b and out all at row stride cols: the output as a column slice, FLUX.2's concat; 300 x 2048
// keeps the table kernel, 19 x 126's halves of 63 the scalar one).
constexpr int kActivationMulCases = 6;
int run_activation_mul_cases() {
  std::vector<uint16_t> table(1 << 16);
  for (uint32_t p = 0; p < table.size(); ++p)
    table[p] = num::float_to_bf16_rne(0.5f * num::bf16_to_float(static_cast<uint16_t>(p)));
  uint16_t* dtable = nullptr;
  CHECK_CUDA(cudaMalloc(&dtable, table.size() * 2));
  CHECK_CUDA(cudaMemcpy(dtable, table.data(), table.size() * 2, cudaMemcpyHostToDevice));
  int fails = 0;
  const std::tuple<int64_t, int64_t, bool> shapes[] = {{300, 1024, false}, {37, 3072, false}, {19, 126, false},
                                                        {300, 2048, true},  {37, 3072, true},  {19, 126, true}};
  for (const auto& [rows, cols, halves] : shapes) {
    fails += run_elementwise(halves ? "activation_mul (column halves)" : "activation_mul", rows, cols,
        [&, rows = rows, cols = cols, halves = halves](uint16_t* out, uint16_t* a, uint16_t* b, uint16_t*) {
          const auto table_view = TensorView::contiguous(dtable, DType::BF16, {1 << 16}, 0);
          if (!halves) {
            activation_mul(TensorView::contiguous(out, DType::BF16, {rows, cols}, 0),
                           TensorView::contiguous(a, DType::BF16, {rows, cols}, 0),
                           TensorView::contiguous(b, DType::BF16, {rows, cols}, 0), table_view, nullptr);
            return;
          }
          const int64_t h = cols / 2;
          const auto half = [&](uint16_t* base, int64_t c0) {
            return TensorView(base + c0, DType::BF16, {rows, h}, {cols, 1}, 0);
          };
          for (int64_t c0 : {int64_t{0}, h}) activation_mul(half(out, c0), half(a, c0), half(b, c0), table_view, nullptr);
        },
        [&](auto& a, auto& b, auto&, int64_t r, int64_t c, int64_t n) -> double {
          const float act = num::bf16_to_float(table[a[r * n + c]]);
          return num::round_bf16(num::gated_product(act, static_cast<float>(f(b, r * n + c))));
        });
  }
  CHECK_CUDA(cudaFree(dtable));
  return fails;
}

// Wan 2.x (qk_norm_rope_wan): torch.nn.RMSNorm across the N = heads * head_dim row, then Wan's RoPE on pairs
// (2i, 2i+1) with cos[2i] and sin[2i+1] of the token's fp32 [1, S, 1, head_dim] tables. fused: q and k are the first
// two chunks of a [B, S, 3N] buffer (row stride 3N). Widths: 1536 (Wan 1.3B: three sweeps, 16-byte paired accesses;
// the 12-block kernel, DIFUSE_QK_WAN_OCCUPANCY=0 the 10-block one), 1024 (two sweeps; the 16-block kernel, the knob
// off the 10-block one) and 12 (N % 8 != 0: 8-byte accesses, the strided map). Before the thirty-fifth session no smoke case reached this kernel.
int run_wan_prologue(int64_t B, int64_t S, int64_t H, int64_t D, bool fused) {
  const int64_t N = H * D, row = fused ? 3 * N : N;
  const double eps = 1e-6;
  std::mt19937 rng(static_cast<unsigned>(93 + N + fused));
  const std::vector<uint16_t> hqk = random_bf16_vec(rng, B * S * row, 0.f, 1.f);
  std::vector<uint16_t> hk;
  if (!fused) hk = random_bf16_vec(rng, B * S * N, 0.f, 1.f);
  const std::vector<uint16_t> hw[2] = {random_bf16_vec(rng, N, 1.f, 0.2f), random_bf16_vec(rng, N, 1.f, 0.2f)};
  std::uniform_real_distribution<float> ang(-3.f, 3.f);
  std::vector<float> tab[2] = {std::vector<float>(S * D), std::vector<float>(S * D)};  // cos, sin
  for (int64_t j = 0; j < S; ++j)
    for (int64_t i = 0; i < D / 2; ++i) {  // WanRotaryPosEmbed repeat-interleaves each angle over its pair
      const float a = ang(rng);
      tab[0][j * D + 2 * i] = tab[0][j * D + 2 * i + 1] = std::cos(a);
      tab[1][j * D + 2 * i] = tab[1][j * D + 2 * i + 1] = std::sin(a);
    }
  DeviceBufs bufs;
  uint16_t* dqk = bufs.upload(hqk);
  uint16_t* dk = fused ? dqk + N : bufs.upload(hk);
  TensorView in[2] = {TensorView(dqk, DType::BF16, {B, S, N}, {S * row, row, 1}, 0),
                      TensorView(dk, DType::BF16, {B, S, N}, {S * row, row, 1}, 0)};
  TensorView w[2], t[2], out[2];
  for (int r = 0; r < 2; ++r) {
    w[r] = TensorView::contiguous(bufs.upload(hw[r]), DType::BF16, {N}, 0);
    t[r] = TensorView::contiguous(bufs.upload(tab[r]), DType::F32, {1, S, 1, D}, 0);
  }
  uint16_t* dout[2];
  for (int r = 0; r < 2; ++r) {
    dout[r] = bufs.poisoned(B * S * N);
    out[r] = TensorView::contiguous(dout[r], DType::BF16, {B, S, H, D}, 0);
  }
  const difuse_qk_norm_rope_wan_args a{&out[0], &out[1], &in[0], &in[1], &w[0], &w[1], &t[0], &t[1], H, eps};
  auto launch = [&] {
    qk_norm_rope_wan(a);
    CHECK_CUDA(cudaDeviceSynchronize());
  };
  launch();
  std::vector<uint16_t> o1[2];
  for (int r = 0; r < 2; ++r) o1[r] = download(dout[r], B * S * N);
  launch();
  Tally tl;
  for (int r = 0; r < 2; ++r) tally_outputs(tl, o1[r], download(dout[r], B * S * N));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < S; ++j)
      for (int r = 0; r < 2; ++r) {
        const uint16_t* x = (r == 0 || fused ? hqk.data() + r * N : hk.data()) + (b * S + j) * row;
        const double rstd = row_rstd(x, static_cast<int>(N), eps);
        for (int64_t e = 0; e < N; e += 2) {
          const int64_t c = e % D;
          const double y0 = num::bf16_to_float(x[e]) * rstd * num::bf16_to_float(hw[r][e]);
          const double y1 = num::bf16_to_float(x[e + 1]) * rstd * num::bf16_to_float(hw[r][e + 1]);
          const double co = tab[0][j * D + c], si = tab[1][j * D + c + 1];
          const int64_t o = (b * S + j) * N + e;
          check_close(tl, o1[r][o], y0 * co - y1 * si, std::fabs(y0 * co) + std::fabs(y1 * si));
          check_close(tl, o1[r][o + 1], y0 * si + y1 * co, std::fabs(y0 * si) + std::fabs(y1 * co));
        }
      }
  const std::string name = "qk_norm_rope_wan " + std::to_string(B) + "x" + std::to_string(S) + "x" +
                           std::to_string(H) + "x" + std::to_string(D) + (fused ? " (to_qkv chunks)" : "");
  return report_prologue(name.c_str(), tl);
}

constexpr int kPrologueCases = 8;
int run_prologues() {
  return run_joint_prologue(false) + run_joint_prologue(true) + run_sd35_prologue() + run_sd35_prologue(true) +
         run_wan_prologue(2, 7, 12, 128, false) + run_wan_prologue(1, 5, 12, 128, true) +
         run_wan_prologue(2, 9, 8, 128, true) + run_wan_prologue(2, 6, 3, 4, false);
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  // --probe-only: the streaming probe's variants alone (a sanitizer check of its rings without the ops' cases)
  if (argc > 1 && std::string(argv[1]) == "--probe-only") {
    try {
      const int f = run_stream_copy_probe();
      std::printf("%d passed, %d failed\n", 1 - f, f);
      return f ? 1 : 0;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "exception: %s\n", e.what());
      return 2;
    }
  }
  int fails = 0;
  try {
    fails += run_case(2, 37, 3072, 6, false);  // few rows: four warps per row, the batched epilogue, 16-byte
    fails += run_case(1, 9, 3072, 6, true);    // the same, 8-byte
    fails += run_case(1, 1100, 3072, 6, true);  // > 1024 rows: two warps per row, 8-byte
    fails += run_case(3, 5, 1000, 3, false);   // partial last sweep
    fails += run_case(1, 5, 4, 2, false);      // H = 4
    fails += run_case(2, 11, 5120, 6, false);  // four warps per row (H > 3584)
    fails += run_case(1, 7, 12288, 3, false);  // four warps per row
    fails += run_case(1, 3, 30000, 2, false);  // two-pass kernel
    fails += run_case(2, 37, 2432, 6, false);  // SD3.5-large's width: warp-equal trees where streamed (knobs)
    fails += run_other_ops();
    fails += run_rms_norm_modulate_cases();
    fails += run_prologues();
    fails += run_rope_half_cases();
    fails += run_rms_rope_half_cases();
    fails += run_activation_mul_cases();
    fails += run_grln_cases();
    fails += run_f32_cases();
    fails += run_stream_copy_probe();
    if (!quick) fails += run_case(1, 4096, 3072, 6, false);
    // rows wider than the streamed kernels' 24576 with rows enough for them (kStreamMinRows): the two-pass kernel
    // (the streamed one read past its reciprocal table here before the thirty-second session)
    if (!quick) fails += run_case(1, 4096, 25600, 2, false);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "exception: %s\n", e.what());
    return 2;
  }
  const int total = (quick ? 9 : 11) + 13 + kRmsModulateCases + kPrologueCases + kRopeHalfCases + kRmsRopeHalfCases + kActivationMulCases + kGrlnCases + kF32Cases + 1;
  std::printf("%d passed, %d failed\n", total - fails, fails);
  return fails ? 1 : 0;
}
