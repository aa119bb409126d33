// BitExactGate state machine: modes, signatures, devices, disable, reset, capture refusal (injected
// probe), counters, the one-line log, and 16 threads verifying and reading at once.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/gate.h"
#include "difuse/difuse.hpp"

using difuse::detail::BitExactGate;
using difuse::detail::GateDecision;
using difuse::detail::GateMode;

namespace {

std::mutex g_log_mu;
std::vector<std::string> g_log;
void capture_log(const char* line, void*) {
  std::lock_guard<std::mutex> lock(g_log_mu);
  g_log.emplace_back(line);
}

std::atomic<bool> g_capturing{false};
bool fake_probe(void*) { return g_capturing.load(); }

class GateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    {
      std::lock_guard<std::mutex> lock(g_log_mu);
      g_log.clear();
    }
    ASSERT_EQ(difuse_set_log_sink(&capture_log, nullptr), DIFUSE_OK);
    ASSERT_EQ(difuse_set_platform_note("torch 2.11.0+cu130 (test)"), DIFUSE_OK);
    BitExactGate::set_capture_probe(&fake_probe);
    g_capturing = false;
  }
  void TearDown() override {
    BitExactGate::set_capture_probe(nullptr);
    difuse_set_log_sink(nullptr, nullptr);
    difuse_set_platform_note("");
  }
  static std::vector<std::string> log() {
    std::lock_guard<std::mutex> lock(g_log_mu);
    return g_log;
  }
  static void verify(BitExactGate& g, int dev, const std::string& sig, int64_t mismatches) {
    ASSERT_EQ(g.decide(dev, sig, false, nullptr), GateDecision::Verify);
    ASSERT_TRUE(g.begin_verify(dev, sig));
    g.end_verify(dev, sig, mismatches, "");
  }
};

}  // namespace

TEST_F(GateTest, PerSignatureVerifiesEachSignature) {
  BitExactGate g("op", GateMode::PerSignature);
  verify(g, 0, "a", 0);
  EXPECT_EQ(g.decide(0, "a", false, nullptr), GateDecision::RunFused);
  EXPECT_TRUE(g.is_verified(0, "a"));
  EXPECT_FALSE(g.is_verified(0, "b"));
  EXPECT_EQ(g.decide(0, "b", false, nullptr), GateDecision::Verify);
  verify(g, 0, "b", 0);
  const auto c = g.counters(0);
  EXPECT_EQ(c.verified_signatures, 2);
  EXPECT_EQ(c.verifications, 2);
  EXPECT_EQ(c.fused_calls, 3);  // two verified outputs + one verified run
  EXPECT_EQ(c.disabled, 0);
  EXPECT_TRUE(log().empty());  // success logs nothing
}

TEST_F(GateTest, OnceModeEnablesEverySignatureAfterOneSuccess) {
  BitExactGate g("op", GateMode::Once);
  EXPECT_EQ(g.decide(0, "a", false, nullptr), GateDecision::Verify);
  verify(g, 0, "a", 0);
  EXPECT_EQ(g.decide(0, "anything", false, nullptr), GateDecision::RunFused);
  EXPECT_TRUE(g.is_verified(0, "other"));
}

TEST_F(GateTest, MismatchDisablesForGoodWithOneLogLine) {
  BitExactGate g("layernorm_modulate", GateMode::PerSignature);
  verify(g, 0, "good", 0);
  verify(g, 0, "bad[1,7,3072]", 42);
  EXPECT_EQ(g.decide(0, "bad[1,7,3072]", false, nullptr), GateDecision::Fallback);
  EXPECT_EQ(g.decide(0, "good", false, nullptr), GateDecision::Fallback);  // disabled for every signature
  EXPECT_FALSE(g.begin_verify(0, "new"));
  g.disable(0, "again");  // already disabled: no second line
  const auto lines = log();
  ASSERT_EQ(lines.size(), 1u);
  const std::string& l = lines[0];
  EXPECT_NE(l.find("layernorm_modulate"), std::string::npos);
  EXPECT_NE(l.find("bad[1,7,3072]"), std::string::npos);
  EXPECT_NE(l.find("42 elements differ"), std::string::npos);
  EXPECT_NE(l.find("torch 2.11.0+cu130 (test)"), std::string::npos);
  EXPECT_NE(l.find("CUDA runtime"), std::string::npos);
  EXPECT_NE(l.find("GPU"), std::string::npos);
  EXPECT_EQ(l.find('\n'), std::string::npos);
  const auto c = g.counters(0);
  EXPECT_EQ(c.disabled, 1);
  EXPECT_EQ(c.fallback_reasons[DIFUSE_FALLBACK_MISMATCH], 1);
  EXPECT_EQ(c.fallback_reasons[DIFUSE_FALLBACK_DISABLED], 2);
  EXPECT_EQ(c.fallbacks, 3);
}

TEST_F(GateTest, HostErrorDisablesAndNamesTheError) {
  BitExactGate g("op", GateMode::PerSignature);
  ASSERT_EQ(g.decide(0, "s", false, nullptr), GateDecision::Verify);
  ASSERT_TRUE(g.begin_verify(0, "s"));
  g.end_verify(0, "s", -1, "launch failed: boom");
  EXPECT_EQ(g.decide(0, "s", false, nullptr), GateDecision::Fallback);
  const auto lines = log();
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("failed on the host"), std::string::npos);
  EXPECT_NE(lines[0].find("boom"), std::string::npos);
  EXPECT_EQ(g.counters(0).fallback_reasons[DIFUSE_FALLBACK_HOST_ERROR], 1);
}

TEST_F(GateTest, StateIsPerDevice) {
  BitExactGate g("op", GateMode::PerSignature);
  verify(g, 0, "s", 0);
  EXPECT_EQ(g.decide(1, "s", false, nullptr), GateDecision::Verify);
  g.disable(1, "test");
  EXPECT_EQ(g.decide(1, "s", false, nullptr), GateDecision::Fallback);
  EXPECT_EQ(g.decide(0, "s", false, nullptr), GateDecision::RunFused);
  EXPECT_THROW(g.decide(64, "s", false, nullptr), difuse::detail::Failure);
  EXPECT_THROW(g.decide(-1, "s", false, nullptr), difuse::detail::Failure);
}

TEST_F(GateTest, ResetReturnsToUnverified) {
  BitExactGate g("op", GateMode::PerSignature);
  verify(g, 0, "a", 0);
  verify(g, 0, "b", 3);
  g.reset();
  const auto c = g.counters(0);
  EXPECT_EQ(c.disabled, 0);
  EXPECT_EQ(c.verified_signatures, 0);
  EXPECT_EQ(c.fused_calls, 0);
  EXPECT_EQ(c.fallbacks, 0);
  EXPECT_EQ(g.decide(0, "a", false, nullptr), GateDecision::Verify);
  verify(g, 0, "a", 0);
  EXPECT_EQ(g.decide(0, "a", false, nullptr), GateDecision::RunFused);
}

TEST_F(GateTest, ManySignaturesStayFoundPerDeviceInMemoryLinearInTheirNumber) {
  // Each verification used to copy the whole verified set into a new snapshot (memory quadratic in the signatures:
  // ~28 MB at 1,000). Tables now double at half load: the slots of every table made stay under 8 per signature.
  BitExactGate g("op", GateMode::PerSignature);
  const int n = 5000;
  for (int i = 0; i < n; ++i) verify(g, 0, "sig" + std::to_string(i), 0);
  verify(g, 1, "sig7", 0);
  EXPECT_EQ(g.counters(0).verified_signatures, n);
  EXPECT_EQ(g.counters(1).verified_signatures, 1);
  for (int i = 0; i < n; ++i) ASSERT_TRUE(g.is_verified(0, "sig" + std::to_string(i))) << i;
  EXPECT_FALSE(g.is_verified(0, "sig5000"));
  EXPECT_FALSE(g.is_verified(0, "sig"));
  EXPECT_TRUE(g.is_verified(1, "sig7"));
  EXPECT_FALSE(g.is_verified(1, "sig8"));
  EXPECT_LE(g.slots_held(), size_t{8} * (n + 1) + 16);
  g.reset();
  EXPECT_FALSE(g.is_verified(0, "sig1"));
  EXPECT_EQ(g.counters(0).verified_signatures, 0);
  verify(g, 0, "sig1", 0);
  EXPECT_TRUE(g.is_verified(0, "sig1"));
  EXPECT_FALSE(g.is_verified(1, "sig7"));
}

TEST_F(GateTest, NoFirstVerificationWhileCapturingOrTracing) {
  BitExactGate g("op", GateMode::PerSignature);
  verify(g, 0, "known", 0);
  g_capturing = true;
  EXPECT_EQ(g.decide(0, "new", false, nullptr), GateDecision::Fallback);
  EXPECT_EQ(g.decide(0, "known", false, nullptr), GateDecision::RunFused);  // verified paths replay in graphs
  g_capturing = false;
  EXPECT_EQ(g.decide(0, "new", true, nullptr), GateDecision::Fallback);  // caller says: compile tracing
  EXPECT_FALSE(g.is_verified(0, "new"));
  EXPECT_EQ(g.counters(0).fallback_reasons[DIFUSE_FALLBACK_CAPTURING], 2);
  EXPECT_EQ(g.decide(0, "new", false, nullptr), GateDecision::Verify);
}

TEST_F(GateTest, EndWithoutBeginIsRejected) {
  BitExactGate g("op", GateMode::PerSignature);
  EXPECT_THROW(g.end_verify(0, "s", 0, ""), difuse::detail::Failure);
  EXPECT_FALSE(g.is_verified(0, "s"));
}

TEST_F(GateTest, EndMustNameWhatBeginStartedAndAlwaysReleasesTheLock) {
  BitExactGate g("op", GateMode::PerSignature);
  for (const auto& [dev, sig] : {std::pair<int, std::string>{1, "A"}, {0, "B"}, {64, "A"}}) {
    ASSERT_TRUE(g.begin_verify(0, "A"));
    EXPECT_THROW(g.end_verify(dev, sig, 0, ""), difuse::detail::Failure) << dev << " " << sig;
    EXPECT_FALSE(g.is_verified(0, "A"));
    EXPECT_FALSE(g.is_verified(0, "B"));
    // the lock is free again: another thread can start and end a verification
    std::thread other([&] {
      ASSERT_TRUE(g.begin_verify(0, "C"));
      g.end_verify(0, "C", 0, "");
    });
    other.join();
    EXPECT_TRUE(g.is_verified(0, "C"));
    g.reset();
  }
}

TEST_F(GateTest, TheWrapperEndsAVerificationAnyExceptionInterrupts) {
  difuse::BitExactGate g("wrapped", difuse::GateMode::PerSignature);
  EXPECT_THROW(g.run(0, "s", [] { throw 7; }, [] {}, [] { return int64_t{0}; }), int);
  // not left holding the gate's lock: another thread's call returns (with the eager answer: the interrupted
  // verification counted as a host failure, which disables the gate on that device)
  std::thread other([&] { EXPECT_FALSE(g.run(0, "t", [] {}, [] {}, [] { return int64_t{0}; })); });
  other.join();
  EXPECT_TRUE(g.run(1, "t", [] {}, [] {}, [] { return int64_t{0}; }));  // another device verifies as usual
}

TEST_F(GateTest, BeginVerifyAfterAnotherThreadSettledReturnsFalse) {
  BitExactGate g("op", GateMode::PerSignature);
  verify(g, 0, "s", 0);
  EXPECT_FALSE(g.begin_verify(0, "s"));
}

TEST_F(GateTest, SixteenThreadsVerifyOncePerSignatureWhileReading) {
  BitExactGate g("op", GateMode::PerSignature);
  constexpr int kThreads = 16, kSigs = 8, kIters = 2000;
  std::atomic<int> compared{0};
  std::atomic<int> wrong{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&, t] {
      for (int it = 0; it < kIters; ++it) {
        const std::string sig = "sig" + std::to_string((t + it) % kSigs);
        const GateDecision d = g.decide(0, sig, false, nullptr);
        if (d == GateDecision::Verify) {
          if (g.begin_verify(0, sig)) {
            if (g.is_verified(0, sig)) wrong++;  // must not verify twice
            compared++;
            g.end_verify(0, sig, 0, "");
          }
        } else if (d != GateDecision::RunFused) {
          wrong++;
        }
      }
    });
  }
  for (auto& th : ts) th.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(compared.load(), kSigs);
  const auto c = g.counters(0);
  EXPECT_EQ(c.verified_signatures, kSigs);
  EXPECT_EQ(c.verifications, kSigs);
  EXPECT_EQ(c.fallbacks, 0);
  for (int s = 0; s < kSigs; ++s) EXPECT_EQ(g.decide(0, "sig" + std::to_string(s), false, nullptr), GateDecision::RunFused);
}

TEST_F(GateTest, SixteenThreadsWithOneMismatchDisableOnceAndNeverRunUnverified) {
  BitExactGate g("op", GateMode::PerSignature);
  constexpr int kThreads = 16;
  std::atomic<int> fused_after_disable{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&, t] {
      for (int it = 0; it < 500; ++it) {
        const std::string sig = (t == 3 && it == 250) ? "bad" : "sig" + std::to_string(it % 4);
        const GateDecision d = g.decide(0, sig, false, nullptr);
        if (d == GateDecision::Verify && g.begin_verify(0, sig)) g.end_verify(0, sig, sig == "bad" ? 7 : 0, "");
        if (d == GateDecision::RunFused && sig == "bad") fused_after_disable++;
      }
    });
  }
  for (auto& th : ts) th.join();
  EXPECT_EQ(fused_after_disable.load(), 0);
  EXPECT_EQ(g.counters(0).disabled, 1);
  EXPECT_EQ(log().size(), 1u);
}

TEST_F(GateTest, WrapperRunProtocol) {
  difuse::BitExactGate g("wrapped", difuse::GateMode::PerSignature);
  int fused = 0, ref = 0, cmp = 0;
  auto run = [&](const std::string& sig, int64_t mism) {
    return g.run(0, sig, [&] { fused++; }, [&] { ref++; }, [&] { cmp++; return mism; });
  };
  EXPECT_TRUE(run("a", 0));
  EXPECT_EQ(cmp, 1);
  EXPECT_TRUE(run("a", 99));  // verified: no comparison, no reference
  EXPECT_EQ(cmp, 1);
  EXPECT_EQ(ref, 1);
  EXPECT_EQ(fused, 2);
  EXPECT_FALSE(run("b", 5));  // mismatch: the reference result is the one to use
  EXPECT_FALSE(run("a", 0));  // disabled for good
  EXPECT_EQ(g.counters(0).disabled, 1);
  // A fused op that throws on the host disables the gate and the reference runs.
  difuse::BitExactGate h("throws", difuse::GateMode::Once);
  int href = 0;
  EXPECT_FALSE(h.run(0, "x", [] { throw std::runtime_error("host failure"); }, [&] { href++; }, [] { return int64_t{0}; }));
  EXPECT_EQ(href, 1);
  EXPECT_EQ(h.counters(0).disabled, 1);
}

TEST_F(GateTest, CAbiRejectsBadHandlesAndModes) {
  difuse_gate* g = nullptr;
  EXPECT_EQ(difuse_gate_create("x", 7, &g), DIFUSE_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(difuse_last_error()).find("mode"), std::string::npos);
  int32_t d = 0;
  EXPECT_EQ(difuse_gate_decide(nullptr, 0, "s", 0, nullptr, &d), DIFUSE_ERR_INVALID_ARGUMENT);
  ASSERT_EQ(difuse_gate_create("x", DIFUSE_GATE_ONCE, &g), DIFUSE_OK);
  EXPECT_EQ(difuse_gate_note_fallback(g, 0, 99), DIFUSE_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(difuse_gate_end_verify(g, 0, "s", 0, ""), DIFUSE_ERR_INVALID_ARGUMENT);
  difuse_gate_destroy(g);
}

TEST(GatePlatform, DriverVersionFromProcLine) {
  using difuse::detail::BitExactGate;
  // The proprietary module's line (H200 machines) and the open module's (the H100 machines: "for x86_64"
  // follows "Kernel Module", and a parser that took the next token printed "NVIDIA driver for").
  EXPECT_EQ(BitExactGate::driver_version_from_proc_line(
                "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.03  Thu Oct  2 10:00:00 UTC 2025"),
            "580.159.03");
  EXPECT_EQ(BitExactGate::driver_version_from_proc_line(
                "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build"),
            "580.159.04");
  EXPECT_EQ(BitExactGate::driver_version_from_proc_line("NVRM version: something else"), "");
  EXPECT_EQ(BitExactGate::driver_version_from_proc_line("Kernel Module for x86_64"), "");
}
