// gelu_tanh — F.gelu(x, approximate="tanh") in bf16, bit-exact against eager PyTorch, into any row layout.
//
// Eager op reproduced (FLUX.1 FeedForward and the single block's act_mlp, SD3, Wan FFN), bf16:
//     out = F.gelu(x, approximate="tanh")          one aten kernel: bf16(gelu_fp32(f(x)))
// Replays: torch 2.11.0+cu130 GeluCUDAKernelImpl (numerics/activation.h has the formula and constants).
// The output may be a column slice of a larger buffer (the single block writes the MLP half of its
// [attention, mlp] concat directly), so rows of x and out each have their own stride.
// Two paths, the same bits: on devices where DRAM outpaces the SMs' arithmetic (gelu_table_pays: the H200, not a
// whole H100), tensors of >= 2^16 eight-element vectors with 16-byte-aligned rows read a 128 KB table of all
// 65,536 results (built once per device by the computing kernel's own arithmetic, kept in shared memory, one
// 1024-thread block per SM); other devices, smaller or misaligned tensors, and calls captured before the table
// exists, run the computing kernel (dense 16-byte-aligned tensors flat, two vectors per thread; otherwise 8/4/2/1
// elements per access by alignment, 128-thread blocks).
//
// Guards (can_use_gelu_tanh; every violation is reported): x and out bf16 on one CUDA device, same sizes,
// rank 1-4, last dim contiguous, leading dims that collapse into one row stride each (any row stride of x; out's
// at least the width, so its rows do not overlap); out overlaps x only if it is x itself (in place: the same
// pointer and strides). Any alignment (16/8/4/2-byte accesses by alignment).
//
// Verification status: bit-exact on the H200 at 66f5a3b (torch 2.11.0+cu130, sm_90; first at 710ef68):
// tests/gpu/test_gelu_tanh.py (219 cases: all 65,536 inputs through both the computing kernel and the table path,
// site shapes, column slices, in place, random shapes, compile, graphs), 0 failed, 0 skipped
// (bench/results/h200/tests.json), incl. the table kernel's division-free addressing (FastDivU32 only for
// row-strided tensors) and the first batch's loads overlapping the table copy: 68.0 us at 1x4608x12288 (68.8 at
// 6408223; target 67, eager 66.3). All 219 passed again at 5f8295d (tests.json; 67.6 us there, eager 66.3).
// The table kernel with its next batch's loads issued before the current batch's stores (PIPE): exact through its
// knob at 132f46f (tests.json: 220 passed) and faster at every shape (knob-sweeps/: 1x4608x12288 67.6 vs 68.1 us,
// 1x512x12288 11.5 vs 12.2), the default since eb1307d, where this file's 221 tests passed with it
// (gpu-tests-eb1307d.json; DIFUSE_GELU_PIPELINED=0 keeps the other kernel, test_pipelined_table_variant[0]); 67.3 vs
// 68.5 us at 1x4608x12288 in one run (knob-sweeps/eb1307d/; target 67, eager 67.5: not met then); 66.5 us at
// f7a86a5 (bench-f7a86a5.log) and 66.8 at f1e1d95 (ops.json): target met. The native smoke test reaches the table
// kernel (256 x 3072): compute-sanitizer clean at eb1307d and f1e1d95 (sanitizer.log). Since 5d35cbc the launcher
// reads the SM count once per device (detail::sm_count), host code only; 65.8-67.6 us at 1x4608x12288 in the
// 5d35cbc, 2cecf55 and 0385466 runs (ops.json): at the 67 us target, within run-to-run spread.
// ncu at ad58f05 (ncu/ad58f05/): 57.5 us, DRAM 73 %, issue 0.26, MIO-queue stalls a third of the cycles between
// issues: the table lookups, not DRAM, hold it. DIFUSE_GELU_COMPUTED_WORDS=1|2 (CW below; 64 registers, no spills):
// exact on the H200 at d823c00 (test_computed_words_variant: every bf16 pattern at every place of a vector, a column
// slice, in place, the site shapes; gpu-tests-d823c00.json) and, with one word, faster at every shape
// (knob-sweeps/d823c00/: 1x4608x12288 64.9 vs 66.7 us, 1x4096x12288 58.1 vs 60.1, 1x512x12288 10.9 vs 11.2, into the
// concat slice 64.5 vs 66.4; predicted ~61-63; two words 67.8). One computed word is the default since then (dispatch
// only: the kernel that ran exact there; as the default not yet run in this file's tests on the H200);
// DIFUSE_GELU_COMPUTED_WORDS=0 keeps the table-only kernel.
// The table by the device (since 0f6077d): the table kernel only where DRAM moves at least 15.5 bytes per SM cycle
// (gelu_table_pays in gelu_tanh.h, detail::dram_outpaces_sms; the H200 18.42, 94 of an H100's SMs 18.01), the
// computing kernel at every size
// below (a whole H100 SXM, 12.8): there eager's computing kernel runs at copy speed (70.4 us at 1x4096x12288, a1823fb)
// and the table kernel took 76.8 (bench/results/h100/gelu-whole-gpu-a1823fb/). Predicted on a whole H100 ~70.5 us at
// 1x4096x12288 and ~79 at 1x4608x12288 and FLUX.1's concat slice; measured at a07f842 (bench/results/h100/
// gelu-table-by-device-a07f842/, two rounds): 72.5 vs 76.8-77.0 with the table (eager 71.0), 80.3-80.7 vs 86.2-86.3,
// the concat slice 81.2 vs 86.8-87.0; this file's 226 tests passed there with the new default (gpu-tests.json). The
// H200 read 18.42 at fd5c83b and kept the table (ops.json there: 0 mismatches, 58.8 us at 1x4096x12288); the device
// rule and 67b5eeb's computing kernel have run this file's tests on H100s only (the last whole suite on an H200:
// 0319d48). DIFUSE_GELU_TABLE=1|0 forces the table or the computing kernel (test_table_forced_variant; the table
// kernels' tests force the table).
// The computing kernel with dense tensors flat, two 16-byte vectors per thread, 128-thread blocks (since 67b5eeb;
// measured first as gelu-two-vectors.patch, now beside its records): on a whole H100 at b556bfc 71.4-71.5 us at 1x4096x12288
// vs 72.2-72.6 (eager 70.3-70.6), 79.2-79.4 vs 80.1-80.6 at 1x4608x12288, the concat slice 80.6 vs 80.9-81.3 (three
// rounds, bench/results/h100/gelu-two-vectors-b556bfc/); the patch's tree passed this file's tests there (229 with
// test_sm_partition.py, gpu-tests.json) and compute-sanitizer memcheck + racecheck of the smoke test under
// DIFUSE_GELU_TABLE=0 (sanitizer-knobs.log). Still ~1 us slower than eager's on a whole H100.
#include "activation/gelu_tanh.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <string>

#include "core/device.h"
#include "core/elementwise.cuh"
#include "core/env_knob.h"
#include "core/fast_div.h"
#include "core/registry.h"
#include "core/tensor.h"
#include "difuse/numerics/activation.h"
#include "difuse/numerics/bf16.h"

namespace difuse::activation {

namespace {

const detail::KernelRegistration kRegistration{{
    "gelu_tanh", "cuda", "bit_exact", "F.gelu(x, approximate=\"tanh\")  (bf16; out may be a column slice)",
    "verified bit-exact on H200 at eb1307d (torch 2.11.0+cu130, sm_90)", 90, 90,
    "GELU (tanh) with libdevice tanhf, written into any row layout"}};

struct Params {
  const uint16_t* x;
  uint16_t* out;
  int64_t rows, cols, x_rs, out_rs;
};

__device__ __forceinline__ uint32_t gelu2(uint32_t w) {
  return num::pack_bf16x2(num::gelu_tanh(num::bf16_lo(w)), num::gelu_tanh(num::bf16_hi(w)));
}

// The computing kernel's block: 128 threads (eager's GeluCUDAKernelImpl launches 128-thread blocks; with the dense
// kernel below, measured on a whole H100 at b556bfc against 256: bench/results/h100/gelu-two-vectors-b556bfc/).
constexpr int kComputeThreads = 128;

template <int VEC>
__global__ void __launch_bounds__(kComputeThreads) gelu_tanh_kernel(const Params p) {
  const int64_t nvec = p.cols / VEC;
  for (int64_t r = blockIdx.y; r < p.rows; r += gridDim.y) {
    const uint16_t* xr = p.x + r * p.x_rs;
    uint16_t* orow = p.out + r * p.out_rs;
    for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < nvec;
         v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      if constexpr (VEC == 1) {
        orow[v] = num::float_to_bf16_rne(num::gelu_tanh(num::bf16_to_float(xr[v])));
      } else {
        using T = typename detail::Bf16Access<VEC>::T;
        T w = *reinterpret_cast<const T*>(xr + v * VEC);
        uint32_t* words = reinterpret_cast<uint32_t*>(&w);
#pragma unroll
        for (int k = 0; k < VEC / 2; ++k) words[k] = gelu2(words[k]);
        *reinterpret_cast<T*>(orow + v * VEC) = w;
      }
    }
  }
}

// Dense tensors (one row, or both row strides equal to the width) as one flat run of 16-byte vectors: each
// thread loads vectors v and v + 128 of its block's 256 before mapping either (two loads in flight per thread where
// gelu_tanh_kernel has one), then stores both. Data movement only: gelu2's arithmetic per word, as above.
// Measured on a whole H100 at b556bfc (three alternated rounds, bench/results/h100/gelu-two-vectors-b556bfc/):
// 1x4096x12288 71.4-71.5 us vs 72.2-72.6 (the 2-D kernel, 256-thread blocks; eager 70.3-70.6), 1x4608x12288
// 79.2-79.4 vs 80.1-80.6, 1x512x12288 13.5-13.8 vs 13.7-13.9; predicted ~70.5-71 at 1x4096x12288.
constexpr int kDenseVectorsPerBlock = 2 * kComputeThreads;

__global__ void __launch_bounds__(kComputeThreads) gelu_tanh_dense_kernel(const uint16_t* x, uint16_t* out,
                                                                           int64_t nvec) {
  const int64_t v0 = static_cast<int64_t>(blockIdx.x) * kDenseVectorsPerBlock + threadIdx.x;
  const int64_t v1 = v0 + kComputeThreads;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  uint4* ov = reinterpret_cast<uint4*>(out);
  uint4 a = make_uint4(0, 0, 0, 0), b = make_uint4(0, 0, 0, 0);
  if (v0 < nvec) a = xv[v0];
  if (v1 < nvec) b = xv[v1];
  if (v0 < nvec) ov[v0] = make_uint4(gelu2(a.x), gelu2(a.y), gelu2(a.z), gelu2(a.w));
  if (v1 < nvec) ov[v1] = make_uint4(gelu2(b.x), gelu2(b.y), gelu2(b.z), gelu2(b.w));
}

// ---- the table path --------------------------------------------------------------------------------------------
// A bf16 input has 65,536 bit patterns, so the exact result of every one of them (computed once per device by
// gelu2's own arithmetic above: the same bits by construction) fits a 128 KB table. The streaming kernel keeps
// the table in shared memory (one 1024-thread block per SM) and replaces ~40 instructions per element (tanhf)
// by one shared-memory load: the op becomes memory-bound.
constexpr int kTableEntries = 1 << 16;
constexpr int kTableThreads = 1024;
constexpr int kTableUnroll = 4;

__global__ void build_gelu_table(uint16_t* table) {
  const int i = static_cast<int>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < kTableEntries / 2) {
    const uint32_t pair = (static_cast<uint32_t>(2 * i + 1) << 16) | static_cast<uint32_t>(2 * i);
    reinterpret_cast<uint32_t*>(table)[i] = gelu2(pair);
  }
}

// Vector v (8 elements) of the rows sits at row v / nvec, column vector v % nvec: one multiply-high
// (detail::FastDivU32; total < 2^31) instead of a 32-bit division sequence per vector, and none when both tensors
// are dense (row strides equal to the width: offset 8 v). The first batch's loads are issued before the table is
// copied into shared memory (128 KB per block, one block per SM) so the two overlap.
// PIPE (the default; DIFUSE_GELU_PIPELINED=0 turns it off): the next batch's loads are issued before the current batch
// is mapped and stored, so a thread always has a batch of loads in flight, where the other kernel issues them after
// its stores (one block of 32 warps per SM holds ~64 KB of loads in flight only between
// a batch's issue and its use). Data movement only: the same table lookups.
// CW (1 by default since d823c00's measurement; DIFUSE_GELU_COMPUTED_WORDS=0|2): the first CW of each vector's four words are
// mapped by gelu2's arithmetic (the computing kernel's, so the same bits as the table) and only the other words
// through the table. ncu at ad58f05 found the table kernel MIO-bound (10.8 of 30.5 cycles between issues waiting for
// a full MIO queue, 8 LDS per vector) with its ALUs idle (issue 0.26): CW = 1 takes a quarter of the lookups off the
// MIO queue for ~80 ALU instructions per vector.
template <bool PIPE, int CW = 0>
__global__ void __launch_bounds__(kTableThreads, 1) gelu_tanh_table_kernel(const Params p, const uint16_t* table,
                                                                           detail::FastDivU32 nvec, unsigned total,
                                                                           bool dense) {
  static_assert(CW >= 0 && CW <= 2, "at most half of a vector's words computed");
  extern __shared__ uint4 lut_words[];
  const uint16_t* lut = reinterpret_cast<const uint16_t*>(lut_words);
  const unsigned stride = gridDim.x * kTableThreads;
  uint4 w[kTableUnroll];
  int64_t oo[kTableUnroll];  // element offsets in out of this batch's vectors
  const auto load_batch = [&](unsigned v0) {
#pragma unroll
    for (int u = 0; u < kTableUnroll; ++u) {
      const unsigned v = v0 + u * stride;
      int64_t xo;
      if (dense) {
        xo = oo[u] = static_cast<int64_t>(v) * 8;
      } else {
        uint32_t col;
        const int64_t r = nvec.divmod(v, col);
        xo = r * p.x_rs + col * 8;
        oo[u] = r * p.out_rs + col * 8;
      }
      if (v < total) w[u] = *reinterpret_cast<const uint4*>(p.x + xo);
    }
  };
  unsigned v0 = blockIdx.x * kTableThreads + threadIdx.x;
  load_batch(v0);  // the first batch's loads are in flight while the table is copied
  for (int i = static_cast<int>(threadIdx.x); i < kTableEntries / 8; i += kTableThreads)
    lut_words[i] = reinterpret_cast<const uint4*>(table)[i];
  __syncthreads();
  const auto lookup = [&](uint32_t x) {
    return static_cast<uint32_t>(lut[x & 0xffffu]) | (static_cast<uint32_t>(lut[x >> 16]) << 16);
  };
  const auto map4 = [&](uint4 v) {  // words 0 .. CW - 1 computed, the rest looked up
    return make_uint4(CW >= 1 ? gelu2(v.x) : lookup(v.x), CW >= 2 ? gelu2(v.y) : lookup(v.y), lookup(v.z),
                      lookup(v.w));
  };
  if constexpr (PIPE) {
    while (v0 < total) {
      uint4 cur[kTableUnroll];
      int64_t co[kTableUnroll];
#pragma unroll
      for (int u = 0; u < kTableUnroll; ++u) {
        cur[u] = w[u];
        co[u] = oo[u];
      }
      const unsigned next = v0 + stride * kTableUnroll;
      if (next < total) load_batch(next);  // in flight while this batch is mapped and stored
#pragma unroll
      for (int u = 0; u < kTableUnroll; ++u)
        if (v0 + u * stride < total)
          *reinterpret_cast<uint4*>(p.out + co[u]) = map4(cur[u]);
      v0 = next;
    }
  } else {
    while (v0 < total) {
#pragma unroll
      for (int u = 0; u < kTableUnroll; ++u)
        if (v0 + u * stride < total)
          *reinterpret_cast<uint4*>(p.out + oo[u]) = map4(w[u]);
      v0 += stride * kTableUnroll;
      if (v0 < total) load_batch(v0);
    }
  }
}

// The device's table, built on first use outside stream capture (nullptr while capturing before that: the
// caller then runs the computing kernel, which gives the same bits).
const uint16_t* gelu_table(int device, cudaStream_t stream) {
  static std::mutex mu;
  static uint16_t* tables[detail::kMaxDevices] = {};
  static std::atomic<uint64_t> ready{0};
  const uint64_t bit = uint64_t{1} << (device & 63);
  if (device < detail::kMaxDevices && (ready.load(std::memory_order_acquire) & bit)) return tables[device];
  if (device >= detail::kMaxDevices) return nullptr;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  DIFUSE_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return nullptr;
  const std::lock_guard<std::mutex> lock(mu);
  if (!(ready.load(std::memory_order_acquire) & bit)) {
    uint16_t* t = nullptr;
    DIFUSE_CUDA_CHECK(cudaMalloc(&t, kTableEntries * sizeof(uint16_t)));  // kept for the process's lifetime
    build_gelu_table<<<kTableEntries / 2 / 256, 256, 0, stream>>>(t);
    DIFUSE_CUDA_CHECK(cudaGetLastError());
    DIFUSE_CUDA_CHECK(cudaStreamSynchronize(stream));
    for (auto kernel : {gelu_tanh_table_kernel<false>, gelu_tanh_table_kernel<true>, gelu_tanh_table_kernel<true, 1>,
                        gelu_tanh_table_kernel<true, 2>})
      DIFUSE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             kTableEntries * static_cast<int>(sizeof(uint16_t))));
    tables[device] = t;
    ready.fetch_or(bit, std::memory_order_acq_rel);
  }
  return tables[device];
}

template <int VEC>
void launch(const Params& p, cudaStream_t stream) {
  gelu_tanh_kernel<VEC><<<detail::elementwise_grid(p.rows, p.cols, VEC, kComputeThreads), kComputeThreads, 0, stream>>>(
      p);
}


}  // namespace

detail::Support can_use_gelu_tanh(const difuse_tensor_view& out, const difuse_tensor_view& x) {
  detail::Support s;
  for (const auto* t : {&x, &out}) {
    const char* name = t == &x ? "x" : "out";
    DIFUSE_REQUIRE(s, t->dtype == DIFUSE_BF16, std::string(name) + " must be bf16, got " + difuse_dtype_name(t->dtype));
    detail::require_cuda_device(s, *t, name);
    if (t->rank < 1 || t->rank > 4) {
      DIFUSE_REQUIRE(s, false, std::string(name) + " must have rank 1 to 4, got " + detail::describe(*t));
      continue;
    }
    DIFUSE_REQUIRE(s, t->strides[t->rank - 1] == 1 || t->sizes[t->rank - 1] <= 1,
                   std::string(name) + " must have a contiguous last dim, got " + detail::describe(*t));
    DIFUSE_REQUIRE(s, detail::collapsed_row_stride(*t) >= 0,
                   std::string(name) + "'s leading dims must collapse into one row stride, got " + detail::describe(*t));
  }
  bool same = x.rank == out.rank;
  for (int d = 0; same && d < x.rank; ++d) same = x.sizes[d] == out.sizes[d];
  DIFUSE_REQUIRE(s, same, "out must have the sizes of x, got " + detail::describe(out) + " for " + detail::describe(x));
  DIFUSE_REQUIRE(s, out.device == x.device, "out must be on the device of x, got " + detail::describe(out));
  // out's rows must not overlap one another (a row stride of at least the width; several threads would write one
  // element otherwise)
  const int64_t cols = out.rank >= 1 ? out.sizes[out.rank - 1] : 0;
  const int64_t out_rs = out.rank >= 1 && out.rank <= 4 ? detail::collapsed_row_stride(out) : -1;
  DIFUSE_REQUIRE(s, cols == 0 || detail::numel(out) / cols <= 1 || out_rs >= cols,
                 "out's rows must not overlap (a row stride of at least the width), got " + detail::describe(out));
  if (detail::numel(x) > 0 && same) {
    DIFUSE_REQUIRE(s, x.data != nullptr && out.data != nullptr, "x and out must have non-null data pointers");
    // in place only as x itself: the same pointer and the same strides (dims of size 1 aside)
    bool in_place = out.data == x.data;
    for (int d = 0; in_place && d < x.rank; ++d) in_place = x.sizes[d] <= 1 || x.strides[d] == out.strides[d];
    DIFUSE_REQUIRE(s, in_place || !detail::overlaps(out, x), "out must be x itself (in place) or not overlap it");
  }
  return s;
}

void gelu_tanh(const difuse_tensor_view& out, const difuse_tensor_view& x, cudaStream_t stream) {
  const detail::Support s = can_use_gelu_tanh(out, x);
  if (!s.ok()) throw detail::Failure(DIFUSE_ERR_UNSUPPORTED, s.message("gelu_tanh"));
  if (detail::numel(x) == 0) return;
  Params p{};
  p.x = static_cast<const uint16_t*>(x.data);
  p.out = static_cast<uint16_t*>(out.data);
  p.cols = x.sizes[x.rank - 1];
  p.rows = detail::numel(x) / p.cols;
  p.x_rs = detail::collapsed_row_stride(x);
  p.out_rs = detail::collapsed_row_stride(out);
  const detail::DeviceGuard device_guard(x.device);
  auto fits = [&](int vec) {
    return p.cols % vec == 0 && detail::aligned(x.data, 2 * vec) && detail::aligned(out.data, 2 * vec) &&
           (p.rows == 1 || (p.x_rs % vec == 0 && p.out_rs % vec == 0));
  };
  const int64_t total = p.rows * (p.cols / 8);
  const bool dense = p.rows == 1 || (p.x_rs == p.cols && p.out_rs == p.cols);
  // The table only where it pays on this device (gelu_table_pays in gelu_tanh.h: DRAM's bytes per SM cycle, or
  // DIFUSE_GELU_TABLE=1|0 to force either kernel for measurement); the same bits either way.
  static const int table_knob = detail::env_knob_or("DIFUSE_GELU_TABLE", -1);
  if (fits(8) && total >= (int64_t{1} << 16) && total < (int64_t{1} << 31) &&
      gelu_table_pays(detail::dram_bytes_per_sm_cycle(x.device), table_knob)) {
    if (const uint16_t* table = gelu_table(x.device, stream)) {
      const int sms = detail::sm_count(x.device);  // one runtime call per device, not per launch
      // The pipelined table kernel by default (H200 at 132f46f, knob-sweeps/: 1x4608x12288 67.6 us vs 68.1,
      // 1x512x12288 11.5 vs 12.2, faster at every shape); DIFUSE_GELU_PIPELINED=0 (for measurement) keeps the other.
      static const int pipelined = detail::env_knob_or("DIFUSE_GELU_PIPELINED", 1);
      // One computed word per vector by default (CW above; H200 at d823c00, knob-sweeps/d823c00/: 1x4608x12288 64.9 us
      // vs 66.7 table-only, faster at all four shapes; two words 67.8). DIFUSE_GELU_COMPUTED_WORDS=0|2 (for
      // measurement, with the pipelined kernel) picks the table-only or the two-word kernel.
      static const int computed = detail::env_knob_or("DIFUSE_GELU_COMPUTED_WORDS", 1);
      auto kernel = pipelined == 0     ? gelu_tanh_table_kernel<false>
                    : computed >= 2    ? gelu_tanh_table_kernel<true, 2>
                    : computed == 1    ? gelu_tanh_table_kernel<true, 1>
                                       : gelu_tanh_table_kernel<true>;
      kernel<<<static_cast<unsigned>(sms), kTableThreads, kTableEntries * sizeof(uint16_t), stream>>>(
          p, table, detail::FastDivU32(static_cast<uint32_t>(p.cols / 8)), static_cast<unsigned>(total), dense);
      DIFUSE_CUDA_CHECK(cudaGetLastError());
      return;
    }
  }
  const int64_t dense_blocks = (total + kDenseVectorsPerBlock - 1) / kDenseVectorsPerBlock;
  if (fits(8) && dense && dense_blocks <= 0x7fffffff)
    gelu_tanh_dense_kernel<<<static_cast<unsigned>(dense_blocks), kComputeThreads, 0, stream>>>(p.x, p.out, total);
  else if (fits(8))
    launch<8>(p, stream);
  else if (fits(4))
    launch<4>(p, stream);
  else if (fits(2))
    launch<2>(p, stream);
  else
    launch<1>(p, stream);
  DIFUSE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace difuse::activation
