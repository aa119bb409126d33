// Host emulation of layernorm_modulate's device schedules, built from the same schedule and numerics code
// the kernels use. Each (threads per row, load layout) is run lane by lane in lockstep (shuffles with
// __shfl_down_sync semantics, warp roots through "shared memory") and must equal, bit for bit, the
// emulation with aten's own layout (128 threads, strided). All are deterministic and close to a
// double-precision LayerNorm + modulate. (rsqrt is the host approximation here, so these are not GPU bits;
// the GPU tests compare the kernel with torch itself.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "norm/layernorm_schedule.h"

using namespace difuse;
using namespace difuse::norm;
using num::VecWelford;

namespace {

struct Row {
  std::vector<uint16_t> x, scale, shift;
};

// WARP_EQUAL: the streamed kernels' tree where every aten warp's counts are equal (warp_equal_counts): each slot's
// leaf count set from its aten warp (warp_leaf_count) and num::vec_welford_combine_equal with that warp's weights at
// every level, as stream_equal_tree<Map, true> runs it; else the general combine.
template <class Map, bool WARP_EQUAL = false>
std::vector<uint16_t> emulate_map(const Row& r, float eps) {
  constexpr int G = Map::kThreads;
  constexpr int A = Map::kSlots;
  const int H = static_cast<int>(r.x.size()), V = H / kVecElems;
  const int NS = (V + kAtenThreads - 1) / kAtenThreads;
  std::vector<std::array<VecWelford, A>> st(G);
  auto xf = [&](int idx) { return num::bf16_to_float(r.x[idx]); };
  for (int i = 0; i < G; ++i)
    for (int k = 0; k < NS; ++k)
      for (int j = 0; j < A; ++j) {
        const int vi = Map::aten_thread(i, j) + kAtenThreads * k;
        if (vi < V) {
          const int c = kVecElems * vi;
          st[i][j] = push_vec4(st[i][j], k, xf(c), xf(c + 1), xf(c + 2), xf(c + 3));
        }
      }
  const WarpEqualCounts counts = warp_equal_counts_of(V);
  auto leaf = [&](int i, int j) { return warp_leaf_count(counts, Map::aten_thread(i, j) / kAtenWarp); };
  if (WARP_EQUAL) {
    EXPECT_TRUE(warp_equal_counts(V)) << V;
    for (int i = 0; i < G; ++i)
      for (int j = 0; j < A; ++j) {
        EXPECT_EQ(st[i][j].count, static_cast<float>(leaf(i, j))) << V;  // the pushes' own count
        st[i][j].count = static_cast<float>(leaf(i, j));
      }
  }
  auto combine = [&](int i, int j, int lv, VecWelford own, VecWelford in) {
    if (!WARP_EQUAL) return num::vec_welford_combine(own, in);
    const num::EqualCombineWeights w = num::equal_combine_weights(static_cast<float>(leaf(i, j) << lv));
    in.count = w.count;  // what the kernel's shuffle leaves out
    return num::vec_welford_combine_equal(own, in, w);
  };
  for (int o = 16, lv = 0; o >= 1; o /= 2, ++lv) {
    const int delta = Map::lane_delta(o);
    if (delta > 0) {
      const auto snap = st;
      for (int i = 0; i < G; ++i)
        for (int j = 0; j < A; ++j) {
          const int src = (i % 32) + delta < 32 ? i + delta : i;  // shfl_down: out of range -> own value
          if (Map::receives(o, j)) st[i][j] = combine(i, j, lv, st[i][j], snap[src][j]);
        }
    } else {
      for (int i = 0; i < G; ++i)
        for (int j = 0; j < A; ++j)
          if (Map::receives(o, j)) st[i][j] = combine(i, j, lv, st[i][j], st[i][Map::partner_slot(o, j)]);
    }
  }
  VecWelford roots[4];
  int written = 0;
  for (int i = 0; i < G; ++i)
    for (int j = 0; j < A; ++j) {
      const int t = Map::aten_thread(i, j);
      if (t % kAtenWarp == 0) roots[t / kAtenWarp] = st[i][j], ++written;
    }
  EXPECT_EQ(written, 4);
  const RowStats rs = WARP_EQUAL ? finalize_roots(roots, H, eps, root_combines(counts)) : finalize_roots(roots, H, eps);
  std::vector<uint16_t> out(H);
  for (int c = 0; c < H; ++c)
    out[c] = num::float_to_bf16_rne(layernorm_modulate_value(xf(c), rs, num::bf16_to_float(r.scale[c]),
                                                             num::bf16_to_float(r.shift[c])));
  return out;
}

template <int G, bool PAIRED, bool WARP_EQUAL = false>
std::vector<uint16_t> emulate(const Row& r, float eps) {
  return emulate_map<AtenThreadMap<G, PAIRED>, WARP_EQUAL>(r, eps);
}

uint16_t bf(float f) { return num::float_to_bf16_rne(f); }

Row random_row(int H, std::mt19937& rng, float mu = 0.f, float sigma = 1.f) {
  std::normal_distribution<float> nd(mu, sigma), sd(0.f, 0.5f);
  Row r;
  for (int c = 0; c < H; ++c) {
    r.x.push_back(bf(nd(rng)));
    r.scale.push_back(bf(sd(rng)));
    r.shift.push_back(bf(sd(rng)));
  }
  return r;
}

void expect_all_schedules_equal_aten(const Row& r, float eps, const char* what) {
  const auto aten = emulate<128, false>(r, eps);
  const int H = static_cast<int>(r.x.size());
  // The packed epilogue the kernels run equals the scalar eager chain element by element.
  {
    VecWelford st;
    for (auto v : r.x) st = num::vec_welford_push(st, num::bf16_to_float(v));
    const RowStats rs{st.mean, num::rsqrt_cuda(num::add_rn(num::div_rn(st.sigma2, static_cast<float>(H)), eps))};
    int64_t diff = 0;
    for (int c = 0; c < H; c += 2) {
      auto w = [](uint16_t lo, uint16_t hi) { return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16); };
      const uint32_t o = layernorm_modulate_pair(w(r.x[c], r.x[c + 1]), rs, w(r.scale[c], r.scale[c + 1]),
                                                 w(r.shift[c], r.shift[c + 1]));
      for (int e = 0; e < 2; ++e) {
        const uint16_t want = num::float_to_bf16_rne(layernorm_modulate_value(
            num::bf16_to_float(r.x[c + e]), rs, num::bf16_to_float(r.scale[c + e]), num::bf16_to_float(r.shift[c + e])));
        diff += static_cast<uint16_t>(o >> (16 * e)) != want;
      }
    }
    EXPECT_EQ(diff, 0) << what << " H=" << H << " packed epilogue";
  }
  auto same = [&](const std::vector<uint16_t>& o, const char* name) {
    int64_t diff = 0;
    for (int c = 0; c < H; ++c) diff += o[c] != aten[c];
    EXPECT_EQ(diff, 0) << what << " H=" << H << " schedule " << name;
  };
  same(emulate<32, false>(r, eps), "32 strided");
  same(emulate<64, false>(r, eps), "64 strided");
  if (H % 8 == 0) {
    same(emulate<32, true>(r, eps), "32 paired");
    same(emulate_map<AtenWarpLocalMap>(r, eps), "32 warp-local");
    same(emulate<64, true>(r, eps), "64 paired");
  }
  same(emulate<128, false>(r, eps), "128 strided (determinism)");
  if (H % 8 == 0 && warp_equal_counts(H / kVecElems)) {  // the streamed kernels' paired maps with warp-equal trees
    same(emulate<32, true, true>(r, eps), "32 paired, warp-equal tree");
    same(emulate_map<AtenWarpLocalMap, true>(r, eps), "32 warp-local, warp-equal tree");
    same(emulate<64, true, true>(r, eps), "64 paired, warp-equal tree");
  }
}

const int kWidths[] = {4, 8, 12, 60, 64, 128, 132, 256, 500, 512, 516, 640, 1000, 1152, 1536, 2240, 2432, 3072, 3076,
                       4096, 4224, 5120, 6144, 6272, 7000, 8192, 12288, 16384};

}  // namespace

TEST(LayernormModulateSchedule, ThreadMapsCoverAtenExactlyOnce) {
  auto check = [](auto map_tag) {
    using Map = decltype(map_tag);
    std::vector<int> seen(kAtenThreads, 0);
    for (int i = 0; i < Map::kThreads; ++i)
      for (int j = 0; j < Map::kSlots; ++j) seen[Map::aten_thread(i, j)]++;
    for (int t = 0; t < kAtenThreads; ++t) EXPECT_EQ(seen[t], 1) << t;
    // Every aten shuffle the root depends on (aten lane < offset) is a combine of ours (its slot receives) and finds
    // its partner in the same warp of ours.
    for (int o = 16; o >= 1; o /= 2)
      for (int i = 0; i < Map::kThreads; ++i)
        for (int j = 0; j < Map::kSlots; ++j) {
          const int t = Map::aten_thread(i, j);
          if (t % kAtenWarp >= o) continue;
          EXPECT_TRUE(Map::receives(o, j)) << "offset " << o << " aten thread " << t;
          const int d = Map::lane_delta(o);
          const int pi = i + d, pj = Map::partner_slot(o, j);
          EXPECT_EQ(pi / 32, i / 32);
          EXPECT_EQ(Map::aten_thread(pi, pj), t + o);
        }
  };
  check(AtenThreadMap<32, false>{});
  check(AtenThreadMap<32, true>{});
  check(AtenThreadMap<64, false>{});
  check(AtenThreadMap<64, true>{});
  check(AtenThreadMap<128, false>{});
  check(AtenWarpLocalMap{});
}

TEST(LayernormModulateSchedule, EverySchedulesMatchesAtenLayoutOnRandomRows) {
  std::mt19937 rng(1234);
  for (int H : kWidths) expect_all_schedules_equal_aten(random_row(H, rng), 1e-6f, "random");
  for (int H : kWidths) expect_all_schedules_equal_aten(random_row(H, rng, 40.f, 0.01f), 1e-5f, "offset");
}

// warp_equal_counts(V) holds exactly where every aten warp's 32 threads push the same, non-zero number of vectors, and
// warp_leaf_count is 4 x that number: brute force over every thread of every width up to 24576 (V <= 6144).
TEST(LayernormModulateSchedule, WarpEqualCountsAreEachWarpsPushes) {
  int equal_widths = 0;
  for (int V = 1; V <= 6144; ++V) {
    bool every_warp_equal = true;
    for (int w = 0; w < kAtenThreads / kAtenWarp; ++w)
      for (int t = w * kAtenWarp; t < (w + 1) * kAtenWarp; ++t) {
        const int pushes = t < V ? (V - t + kAtenThreads - 1) / kAtenThreads : 0;
        const int first = w * kAtenWarp < V ? (V - w * kAtenWarp + kAtenThreads - 1) / kAtenThreads : 0;
        every_warp_equal = every_warp_equal && pushes == first && pushes > 0;
        if (warp_equal_counts(V)) {
          ASSERT_EQ(warp_leaf_count(warp_equal_counts_of(V), w), kVecElems * pushes) << V << " " << t;
        }
      }
    ASSERT_EQ(warp_equal_counts(V), every_warp_equal) << V;
    equal_widths += warp_equal_counts(V);
  }
  EXPECT_EQ(equal_widths, 6144 / 32 - 3);  // V = 32, 64, 96 leave warps empty
}

TEST(LayernormModulateSchedule, AdversarialRows) {
  std::mt19937 rng(99);
  for (int H : {4, 64, 520, 2432, 3072, 4224, 5120}) {
    Row r = random_row(H, rng);
    Row constant = r;
    for (auto& v : constant.x) v = bf(3.25f);  // zero variance
    expect_all_schedules_equal_aten(constant, 1e-6f, "constant");
    Row huge = r;
    for (auto& v : huge.x) v = bf((rng() % 2 ? 3e38f : -3e38f) * 0.9f);
    expect_all_schedules_equal_aten(huge, 1e-6f, "huge");
    Row tiny = r;
    for (auto& v : tiny.x) v = bf(static_cast<float>(rng() % 7) * 1e-39f);
    expect_all_schedules_equal_aten(tiny, 1e-6f, "tiny");
    Row outlier = r;
    outlier.x[H / 3] = bf(1e4f);
    for (auto& v : outlier.scale) v = bf(-1.f);
    expect_all_schedules_equal_aten(outlier, 1e-6f, "outlier, scale -1");
    Row nonfinite = r;
    nonfinite.x[1] = bf(INFINITY);
    expect_all_schedules_equal_aten(nonfinite, 1e-6f, "inf");
    nonfinite.x[2] = bf(NAN);
    expect_all_schedules_equal_aten(nonfinite, 1e-6f, "nan");
  }
}

TEST(LayernormModulateSchedule, CloseToDoublePrecision) {
  std::mt19937 rng(77);
  for (int H : kWidths) {
    const Row r = random_row(H, rng, 0.5f, 2.f);
    const auto out = emulate<32, false>(r, 1e-6f);
    double mean = 0, var = 0;
    for (auto v : r.x) mean += num::bf16_to_float(v);
    mean /= H;
    for (auto v : r.x) var += std::pow(num::bf16_to_float(v) - mean, 2);
    var /= H;
    const double rstd = 1.0 / std::sqrt(var + 1e-6);
    for (int c = 0; c < H; ++c) {
      const double n = (num::bf16_to_float(r.x[c]) - mean) * rstd;
      const double a = 1.0 + num::bf16_to_float(r.scale[c]);
      const double sh = num::bf16_to_float(r.shift[c]);
      const double ref = n * a + sh;
      const double tol = std::ldexp(std::fabs(n * a) + std::fabs(sh), -6) + 1e-6;
      ASSERT_NEAR(num::bf16_to_float(out[c]), ref, tol) << "H=" << H << " c=" << c;
    }
  }
}

// ---- the RMS policy of the same aten kernel (rms_norm) --------------------------------------------------------
namespace {

template <int G, bool PAIRED>
std::vector<uint16_t> emulate_rms(const std::vector<uint16_t>& x, const std::vector<uint16_t>* w, float eps) {
  using Map = AtenThreadMap<G, PAIRED>;
  constexpr int A = Map::kSlots;
  const int H = static_cast<int>(x.size()), V = H / kVecElems;
  const int NS = (V + kAtenThreads - 1) / kAtenThreads;
  std::vector<std::array<float, A>> s(G);
  for (auto& t : s) t.fill(0.f);
  auto xf = [&](int idx) { return num::bf16_to_float(x[idx]); };
  for (int i = 0; i < G; ++i)
    for (int k = 0; k < NS; ++k)
      for (int j = 0; j < A; ++j) {
        const int vi = Map::aten_thread(i, j) + kAtenThreads * k;
        if (vi < V) s[i][j] = rms_push_vec4(s[i][j], xf(4 * vi), xf(4 * vi + 1), xf(4 * vi + 2), xf(4 * vi + 3));
      }
  for (int o = 16; o >= 1; o /= 2) {
    const int delta = Map::lane_delta(o);
    if (delta > 0) {
      const auto snap = s;
      for (int i = 0; i < G; ++i)
        for (int j = 0; j < A; ++j) s[i][j] = rms_combine(s[i][j], snap[(i % 32) + delta < 32 ? i + delta : i][j]);
    } else {
      for (int i = 0; i < G; ++i)
        for (int j = 0; j < A; ++j)
          if (Map::receives(o, j)) s[i][j] = rms_combine(s[i][j], s[i][Map::partner_slot(o, j)]);
    }
  }
  float roots[4] = {0, 0, 0, 0};
  for (int i = 0; i < G; ++i)
    for (int j = 0; j < A; ++j)
      if (Map::aten_thread(i, j) % kAtenWarp == 0) roots[Map::aten_thread(i, j) / kAtenWarp] = s[i][j];
  const float rstd = rms_finalize_roots(roots, H, eps);
  std::vector<uint16_t> out(H);
  for (int c = 0; c < H; c += 2) {
    const uint32_t x2 = x[c] | (static_cast<uint32_t>(x[c + 1]) << 16);
    const uint32_t w2 = w ? ((*w)[c] | (static_cast<uint32_t>((*w)[c + 1]) << 16)) : 0;
    const uint32_t o = rms_norm_pair(x2, rstd, w != nullptr, w2);
    out[c] = static_cast<uint16_t>(o), out[c + 1] = static_cast<uint16_t>(o >> 16);
  }
  return out;
}

}  // namespace

TEST(RmsNormSchedule, EveryScheduleMatchesAtenLayoutAndDoublePrecision) {
  std::mt19937 rng(4242);
  for (int H : {4, 8, 64, 128, 132, 1536, 3072, 3076, 5120, 6144, 12288, 16384}) {
    const Row r = random_row(H, rng, 0.3f, 3.f);
    for (const std::vector<uint16_t>* w : {static_cast<const std::vector<uint16_t>*>(nullptr), &r.scale}) {
      const auto aten = emulate_rms<128, false>(r.x, w, 1e-6f);
      auto same = [&](const std::vector<uint16_t>& o, const char* name) {
        int64_t diff = 0;
        for (int c = 0; c < H; ++c) diff += o[c] != aten[c];
        EXPECT_EQ(diff, 0) << "H=" << H << " " << name << (w ? " weight" : "");
      };
      same(emulate_rms<32, false>(r.x, w, 1e-6f), "32 strided");
      same(emulate_rms<64, false>(r.x, w, 1e-6f), "64 strided");
      if (H % 8 == 0) {
        same(emulate_rms<32, true>(r.x, w, 1e-6f), "32 paired");
        same(emulate_rms<64, true>(r.x, w, 1e-6f), "64 paired");
      }
      double ss = 0;
      for (auto v : r.x) ss += std::pow(num::bf16_to_float(v), 2);
      const double rstd = 1.0 / std::sqrt(ss / H + 1e-6);
      for (int c = 0; c < H; ++c) {
        const double ref = num::bf16_to_float(r.x[c]) * rstd * (w ? num::bf16_to_float((*w)[c]) : 1.0);
        ASSERT_NEAR(num::bf16_to_float(aten[c]), ref, std::ldexp(std::fabs(ref), -7) + 1e-6) << "H=" << H << " c=" << c;
      }
    }
  }
}

// rms_norm's per-head kernel: one warp of 32 lanes = aten's warp 0 (lanes >= V hold +0), warps 1..3 as +0
// roots. Must equal aten's full 128-thread layout for every width up to 128.
TEST(RmsNormSchedule, PerHeadWarpEqualsAtenLayout) {
  std::mt19937 rng(99);
  for (int H = 4; H <= 128; H += 4) {
    const Row r = random_row(H, rng, 0.f, 2.f);
    const int V = H / 4;
    float lane_s[32];
    for (int l = 0; l < 32; ++l) {
      auto xf = [&](int c) { return num::bf16_to_float(r.x[c]); };
      lane_s[l] = l < V ? rms_push_vec4(0.f, xf(4 * l), xf(4 * l + 1), xf(4 * l + 2), xf(4 * l + 3)) : 0.f;
    }
    for (int o = 16; o >= 1; o /= 2) {
      float snap[32];
      std::copy(lane_s, lane_s + 32, snap);
      for (int l = 0; l < 32; ++l) lane_s[l] = rms_combine(lane_s[l], snap[l + o < 32 ? l + o : l]);
    }
    const float roots[4] = {lane_s[0], 0.f, 0.f, 0.f};
    const float rstd = rms_finalize_roots(roots, H, 1e-6f);
    const auto aten = emulate_rms<128, false>(r.x, &r.scale, 1e-6f);
    int64_t diff = 0;
    for (int c = 0; c < H; c += 2) {
      const uint32_t o = rms_norm_pair(r.x[c] | (static_cast<uint32_t>(r.x[c + 1]) << 16), rstd, true,
                                       r.scale[c] | (static_cast<uint32_t>(r.scale[c + 1]) << 16));
      diff += static_cast<uint16_t>(o) != aten[c];
      diff += static_cast<uint16_t>(o >> 16) != aten[c + 1];
    }
    EXPECT_EQ(diff, 0) << "H=" << H;
  }
}

// Wan's fp32 chain with RN(1 + scale) formed ahead (the one-warp streamed kernel's staged scale rows): the same bits
// as the chain that adds it per element, for random, adversarial and non-finite operands.
TEST(LayernormModulateSchedule, F32ChainWithScalePlusOneFormedIsTheSameBits) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-4.f, 4.f);
  const float special[] = {0.f, -0.f, -1.f, 1e-45f, -1e-38f, 3e38f, -3e38f, INFINITY, -INFINITY, NAN, 1.f, 0.5f};
  auto pick = [&](int k) { return k < 12 ? special[k] : u(rng) * std::pow(2.f, static_cast<float>(rng() % 40) - 20.f); };
  auto bits = [](float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; };
  for (int n = 0; n < 200000; ++n) {
    const float x = pick(rng() % 24), s = pick(rng() % 24), h = pick(rng() % 24);
    const RowStats st{pick(rng() % 24), std::fabs(pick(rng() % 24))};
    const float want = layernorm_modulate_f32_value(x, st, s, h);
    const float got = layernorm_modulate_f32_value_a(x, st, num::add_rn(s, 1.0f), h);
    ASSERT_EQ(bits(want), bits(got)) << "x " << x << " scale " << s << " shift " << h;
  }
}
