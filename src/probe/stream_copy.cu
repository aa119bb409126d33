// stream_copy — the streaming ceiling the benchmarks measure each op against (not an op; no eager chain, no gate).
//
// What it is: dst = src in 16-byte vectors, each thread loading `U` vectors (coalesced: vector u of a block's chunk
// at u * blockDim + threadIdx) before it stores them, over a one-pass grid (a block per chunk of U * blockDim
// vectors) or the resident blocks striding over the chunks, with the default cache policy or evict-first
// (ld/st.global.cs). 64 variants; `bench ops` times all of them at each record's byte count (rotating buffers like
// the op's inputs, the same CUDA-event harness), re-times the fastest and records it as stream_us: what a kernel
// that does nothing but move those bytes needs at that size in this harness.
//
// Guards (every violation reported): non-NULL 16-byte aligned pointers, nbytes > 0 and % 16 == 0, no overlap,
// variant in range. Verified on the H200 at 26d5552: tests/gpu/test_stream_copy.py (every variant, sizes with partial
// chunks, the bytes after the end untouched; gpu-tests-26d5552.json) and the native smoke test's probe case under
// memcheck, racecheck and initcheck (sanitizer-26d5552.txt). First stream_us column: ops.json at 26d5552.
#include "probe/stream_copy.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "core/error.h"

namespace difuse::probe {

namespace {

constexpr int kUnrolls[] = {1, 2, 4, 8};
constexpr int kThreads[] = {128, 256, 512, 1024};
constexpr int kVariants = 4 * 4 * 2 * 2;

template <int U, bool CS>
__global__ void __launch_bounds__(1024) stream_copy_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                                           int64_t n) {
  const int64_t chunk = int64_t(U) * blockDim.x;
  for (int64_t base = int64_t(blockIdx.x) * chunk; base < n; base += int64_t(gridDim.x) * chunk) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = base + int64_t(u) * blockDim.x + threadIdx.x;
      if (i < n) v[u] = CS ? __ldcs(src + i) : src[i];
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = base + int64_t(u) * blockDim.x + threadIdx.x;
      if (i < n) {
        if (CS)
          __stcs(dst + i, v[u]);
        else
          dst[i] = v[u];
      }
    }
  }
}

using Kernel = void (*)(const uint4*, uint4*, int64_t);

template <int U>
Kernel pick_policy(bool evict_first) {
  return evict_first ? stream_copy_kernel<U, true> : stream_copy_kernel<U, false>;
}

Kernel pick(const StreamCopyVariant& v) {
  switch (v.vectors_per_thread) {
    case 1: return pick_policy<1>(v.evict_first);
    case 2: return pick_policy<2>(v.evict_first);
    case 4: return pick_policy<4>(v.evict_first);
    default: return pick_policy<8>(v.evict_first);
  }
}

}  // namespace

int stream_copy_variant_count() { return kVariants; }

StreamCopyVariant stream_copy_variant(int index) {
  if (index < 0 || index >= kVariants)
    throw detail::Failure(DIFUSE_ERR_INVALID_ARGUMENT, "stream_copy: variant " + std::to_string(index) +
                                                           " outside [0, " + std::to_string(kVariants) + ")");
  return {kUnrolls[index % 4], kThreads[(index / 4) % 4], (index / 16) % 2 == 1, index / 32 == 1};
}

std::string stream_copy_variant_name(int index) {
  const StreamCopyVariant v = stream_copy_variant(index);
  return "u" + std::to_string(v.vectors_per_thread) + "_t" + std::to_string(v.threads_per_block) +
         (v.resident_grid ? "_resident" : "_onepass") + (v.evict_first ? "_evict_first" : "_default");
}

void stream_copy(void* dst, const void* src, int64_t nbytes, int index, cudaStream_t stream) {
  detail::Support s;
  const auto d = reinterpret_cast<uintptr_t>(dst), a = reinterpret_cast<uintptr_t>(src);
  if (dst == nullptr) s.violations.push_back("dst is NULL");
  if (src == nullptr) s.violations.push_back("src is NULL");
  if (d % 16 != 0) s.violations.push_back("dst is not 16-byte aligned");
  if (a % 16 != 0) s.violations.push_back("src is not 16-byte aligned");
  if (nbytes <= 0 || nbytes % 16 != 0)
    s.violations.push_back("nbytes = " + std::to_string(nbytes) + " is not a positive multiple of 16");
  if (nbytes > 0 && d < a + uint64_t(nbytes) && a < d + uint64_t(nbytes))
    s.violations.push_back("dst and src overlap");
  if (index < 0 || index >= kVariants)
    s.violations.push_back("variant " + std::to_string(index) + " outside [0, " + std::to_string(kVariants) + ")");
  if (!s.ok()) throw detail::Failure(DIFUSE_ERR_INVALID_ARGUMENT, s.message("stream_copy"));

  const StreamCopyVariant v = stream_copy_variant(index);
  const Kernel kernel = pick(v);
  const int64_t n = nbytes / 16, chunk = int64_t(v.vectors_per_thread) * v.threads_per_block;
  int64_t grid = (n + chunk - 1) / chunk;
  if (v.resident_grid) {
    int device = 0, sms = 0, per_sm = 0;
    DIFUSE_CUDA_CHECK(cudaGetDevice(&device));
    DIFUSE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    DIFUSE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, v.threads_per_block, 0));
    grid = std::min<int64_t>(grid, int64_t(sms) * std::max(per_sm, 1));
  }
  grid = std::min<int64_t>(grid, 0x7fffffff);
  kernel<<<static_cast<unsigned>(grid), v.threads_per_block, 0, stream>>>(static_cast<const uint4*>(src),
                                                                          static_cast<uint4*>(dst), n);
  DIFUSE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace difuse::probe
