// difuse.hpp — header-only C++17 wrapper over the C ABI in difuse.h.
//
// Errors become exceptions: difuse::Unsupported (every violated precondition in reasons()) for inputs
// outside an op's contract, difuse::Error for the rest (CUDA failures, bad arguments).
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "difuse/difuse.h"

namespace difuse {

enum class DType : int32_t {
  BF16 = DIFUSE_BF16,
  F16 = DIFUSE_F16,
  F32 = DIFUSE_F32,
  F8E4M3 = DIFUSE_F8E4M3,
  I32 = DIFUSE_I32,
  I64 = DIFUSE_I64
};

class Error : public std::runtime_error {
 public:
  Error(difuse_status status, const std::string& msg) : std::runtime_error(msg), status_(status) {}
  difuse_status status() const noexcept { return status_; }

 private:
  difuse_status status_;
};

namespace detail {
inline std::vector<std::string> split_reasons(const std::string& msg) {
  std::vector<std::string> out;
  const std::string mark = "\n  - ";
  size_t pos = msg.find(mark);
  while (pos != std::string::npos) {
    const size_t start = pos + mark.size();
    const size_t next = msg.find(mark, start);
    out.push_back(msg.substr(start, next == std::string::npos ? std::string::npos : next - start));
    pos = next;
  }
  return out;
}
}  // namespace detail

class Unsupported : public Error {
 public:
  explicit Unsupported(const std::string& msg)
      : Error(DIFUSE_ERR_UNSUPPORTED, msg), reasons_(detail::split_reasons(msg)) {}
  const std::vector<std::string>& reasons() const noexcept { return reasons_; }

 private:
  std::vector<std::string> reasons_;
};

inline void check(difuse_status s) {
  if (s == DIFUSE_OK) return;
  const std::string msg = difuse_last_error();
  if (s == DIFUSE_ERR_UNSUPPORTED) throw Unsupported(msg);
  throw Error(s, std::string(difuse_status_name(s)) + ": " + msg);
}

// A non-owning view: data pointer, dtype, sizes, strides in elements, device (-1 host, >= 0 CUDA ordinal).
struct TensorView : difuse_tensor_view {
  TensorView() : difuse_tensor_view{} {}
  TensorView(void* ptr, DType dt, std::initializer_list<int64_t> sz, std::initializer_list<int64_t> st, int dev)
      : difuse_tensor_view{} {
    if (sz.size() != st.size() || sz.size() > DIFUSE_MAX_RANK)
      throw Error(DIFUSE_ERR_INVALID_ARGUMENT, "TensorView: sizes and strides must have the same rank <= 8");
    data = ptr;
    dtype = static_cast<int32_t>(dt);
    rank = static_cast<int32_t>(sz.size());
    int i = 0;
    for (int64_t s : sz) sizes[i++] = s;
    i = 0;
    for (int64_t s : st) strides[i++] = s;
    device = dev;
  }
  // Row-major contiguous strides for the given sizes.
  static TensorView contiguous(void* ptr, DType dt, std::initializer_list<int64_t> sz, int dev) {
    if (sz.size() > DIFUSE_MAX_RANK) throw Error(DIFUSE_ERR_INVALID_ARGUMENT, "TensorView: rank must be <= 8");
    std::vector<int64_t> st(sz.size());
    int64_t acc = 1;
    std::vector<int64_t> s(sz);
    for (size_t i = s.size(); i-- > 0;) {
      st[i] = acc;
      acc *= s[i];
    }
    TensorView v;
    v.data = ptr;
    v.dtype = static_cast<int32_t>(dt);
    v.rank = static_cast<int32_t>(s.size());
    for (size_t i = 0; i < s.size(); ++i) v.sizes[i] = s[i], v.strides[i] = st[i];
    v.device = dev;
    return v;
  }
};

struct Support {
  bool ok = true;
  std::vector<std::string> reasons;
  explicit operator bool() const noexcept { return ok; }
};

inline Support support_from(difuse_status s) {
  if (s == DIFUSE_OK) return {};
  if (s == DIFUSE_ERR_UNSUPPORTED) return {false, detail::split_reasons(difuse_last_error())};
  check(s);
  return {};
}

// ---- ops ----------------------------------------------------------------------------------------------
inline Support can_use_layernorm_modulate(const TensorView& out, const TensorView& x, const TensorView& scale,
                                          const TensorView& shift, double eps) {
  return support_from(difuse_can_use_layernorm_modulate(&out, &x, &scale, &shift, eps));
}
inline void layernorm_modulate(const TensorView& out, const TensorView& x, const TensorView& scale,
                               const TensorView& shift, double eps, void* stream = nullptr) {
  check(difuse_layernorm_modulate(&out, &x, &scale, &shift, eps, stream));
}

inline Support can_use_gated_residual(const TensorView& out, const TensorView& h, const TensorView& a,
                                      const TensorView& gate) {
  return support_from(difuse_can_use_gated_residual(&out, &h, &a, &gate));
}
inline void gated_residual(const TensorView& out, const TensorView& h, const TensorView& a, const TensorView& gate,
                           void* stream = nullptr) {
  check(difuse_gated_residual(&out, &h, &a, &gate, stream));
}

// weight: nullptr for none.
inline Support can_use_rms_norm(const TensorView& out, const TensorView& x, const TensorView* weight, double eps) {
  return support_from(difuse_can_use_rms_norm(&out, &x, weight, eps));
}
inline void rms_norm(const TensorView& out, const TensorView& x, const TensorView* weight, double eps,
                     void* stream = nullptr) {
  check(difuse_rms_norm(&out, &x, weight, eps, stream));
}

inline Support can_use_gelu_tanh(const TensorView& out, const TensorView& x) {
  return support_from(difuse_can_use_gelu_tanh(&out, &x));
}
inline void gelu_tanh(const TensorView& out, const TensorView& x, void* stream = nullptr) {
  check(difuse_gelu_tanh(&out, &x, stream));
}

inline Support can_use_activation_mul(const TensorView& out, const TensorView& a, const TensorView& b,
                                      const TensorView& table) {
  return support_from(difuse_can_use_activation_mul(&out, &a, &b, &table));
}
inline void activation_mul(const TensorView& out, const TensorView& a, const TensorView& b, const TensorView& table,
                           void* stream = nullptr) {
  check(difuse_activation_mul(&out, &a, &b, &table, stream));
}

inline Support can_use_rope_rotate_half(const TensorView& out, const TensorView& x, const TensorView& cos,
                                        const TensorView& sin) {
  return support_from(difuse_can_use_rope_rotate_half(&out, &x, &cos, &sin));
}
inline void rope_rotate_half(const TensorView& out, const TensorView& x, const TensorView& cos, const TensorView& sin,
                             void* stream = nullptr) {
  check(difuse_rope_rotate_half(&out, &x, &cos, &sin, stream));
}

inline Support can_use_rms_norm_rope_rotate_half(const TensorView& out, const TensorView& x, const TensorView* weight,
                                                 const TensorView& cos, const TensorView& sin, double eps) {
  return support_from(difuse_can_use_rms_norm_rope_rotate_half(&out, &x, weight, &cos, &sin, eps));
}
inline void rms_norm_rope_rotate_half(const TensorView& out, const TensorView& x, const TensorView* weight,
                                      const TensorView& cos, const TensorView& sin, double eps,
                                      void* stream = nullptr) {
  check(difuse_rms_norm_rope_rotate_half(&out, &x, weight, &cos, &sin, eps, stream));
}

inline Support can_use_rms_norm_diffusers(const TensorView& out, const TensorView& x, const TensorView* weight,
                                          double eps) {
  return support_from(difuse_can_use_rms_norm_diffusers(&out, &x, weight, eps));
}
inline void rms_norm_diffusers(const TensorView& out, const TensorView& x, const TensorView* weight, double eps,
                               void* stream = nullptr) {
  check(difuse_rms_norm_diffusers(&out, &x, weight, eps, stream));
}

// weight: nullptr for none; fp32_modulate: false = LTX-2's bf16 chain, true = ERNIE-Image's fp32 modulate.
inline Support can_use_rms_norm_modulate(const TensorView& out, const TensorView& x, const TensorView* weight,
                                         const TensorView& scale, const TensorView& shift, double eps,
                                         bool fp32_modulate) {
  return support_from(difuse_can_use_rms_norm_modulate(&out, &x, weight, &scale, &shift, eps, fp32_modulate ? 1 : 0));
}
inline void rms_norm_modulate(const TensorView& out, const TensorView& x, const TensorView* weight,
                              const TensorView& scale, const TensorView& shift, double eps, bool fp32_modulate,
                              void* stream = nullptr) {
  check(difuse_rms_norm_modulate(&out, &x, weight, &scale, &shift, eps, fp32_modulate ? 1 : 0, stream));
}

inline Support can_use_gated_residual_rms_norm_modulate(const TensorView& out, const TensorView& residual,
                                                        const TensorView& h, const TensorView& a, const TensorView& gate,
                                                        const TensorView* weight, const TensorView& scale,
                                                        const TensorView& shift, double eps, bool fp32_modulate) {
  return support_from(difuse_can_use_gated_residual_rms_norm_modulate(&out, &residual, &h, &a, &gate, weight, &scale,
                                                                      &shift, eps, fp32_modulate ? 1 : 0));
}
inline void gated_residual_rms_norm_modulate(const TensorView& out, const TensorView& residual, const TensorView& h,
                                             const TensorView& a, const TensorView& gate, const TensorView* weight,
                                             const TensorView& scale, const TensorView& shift, double eps,
                                             bool fp32_modulate, void* stream = nullptr) {
  check(difuse_gated_residual_rms_norm_modulate(&out, &residual, &h, &a, &gate, weight, &scale, &shift, eps,
                                                fp32_modulate ? 1 : 0, stream));
}

inline Support can_use_gated_residual_layernorm_modulate(const TensorView& out, const TensorView& residual,
                                                         const TensorView& h, const TensorView& a, const TensorView& gate,
                                                         const TensorView& scale, const TensorView& shift, double eps) {
  return support_from(
      difuse_can_use_gated_residual_layernorm_modulate(&out, &residual, &h, &a, &gate, &scale, &shift, eps));
}
inline void gated_residual_layernorm_modulate(const TensorView& out, const TensorView& residual, const TensorView& h,
                                              const TensorView& a, const TensorView& gate, const TensorView& scale,
                                              const TensorView& shift, double eps, void* stream = nullptr) {
  check(difuse_gated_residual_layernorm_modulate(&out, &residual, &h, &a, &gate, &scale, &shift, eps, stream));
}

// Wan's fp32 chains: fp32 modulation rows (or the affine norm's fp32 weight and bias), one bf16 rounding at the end.
inline Support can_use_layernorm_modulate_fp32(const TensorView& out, const TensorView& x, const TensorView& scale,
                                               const TensorView& shift, double eps) {
  return support_from(difuse_can_use_layernorm_modulate_fp32(&out, &x, &scale, &shift, eps));
}
inline void layernorm_modulate_fp32(const TensorView& out, const TensorView& x, const TensorView& scale,
                                    const TensorView& shift, double eps, void* stream = nullptr) {
  check(difuse_layernorm_modulate_fp32(&out, &x, &scale, &shift, eps, stream));
}
inline Support can_use_layernorm_affine_fp32(const TensorView& out, const TensorView& x, const TensorView& weight,
                                             const TensorView& bias, double eps) {
  return support_from(difuse_can_use_layernorm_affine_fp32(&out, &x, &weight, &bias, eps));
}
inline void layernorm_affine_fp32(const TensorView& out, const TensorView& x, const TensorView& weight,
                                  const TensorView& bias, double eps, void* stream = nullptr) {
  check(difuse_layernorm_affine_fp32(&out, &x, &weight, &bias, eps, stream));
}
inline Support can_use_gated_residual_fp32(const TensorView& out, const TensorView& h, const TensorView& a,
                                           const TensorView& gate) {
  return support_from(difuse_can_use_gated_residual_fp32(&out, &h, &a, &gate));
}
inline void gated_residual_fp32(const TensorView& out, const TensorView& h, const TensorView& a, const TensorView& gate,
                                void* stream = nullptr) {
  check(difuse_gated_residual_fp32(&out, &h, &a, &gate, stream));
}

// FLUX.1's attention prologue; absent tensors are NULL pointers in args (see difuse_qk_norm_rope_args).
inline Support can_use_qk_norm_rope(const difuse_qk_norm_rope_args& args) {
  return support_from(difuse_can_use_qk_norm_rope(&args));
}
inline void qk_norm_rope(const difuse_qk_norm_rope_args& args, void* stream = nullptr) {
  check(difuse_qk_norm_rope(&args, stream));
}

// Qwen-Image's attention prologue; absent tensors are NULL pointers in args (see difuse_qk_norm_rope_qwen_args).
inline Support can_use_qk_norm_rope_qwen(const difuse_qk_norm_rope_qwen_args& args) {
  return support_from(difuse_can_use_qk_norm_rope_qwen(&args));
}
inline void qk_norm_rope_qwen(const difuse_qk_norm_rope_qwen_args& args, void* stream = nullptr) {
  check(difuse_qk_norm_rope_qwen(&args, stream));
}

// SD3.5's joint-attention QK path (see difuse_qk_norm_sd35_args).
inline Support can_use_qk_norm_sd35(const difuse_qk_norm_sd35_args& args) {
  return support_from(difuse_can_use_qk_norm_sd35(&args));
}
inline void qk_norm_sd35(const difuse_qk_norm_sd35_args& args, void* stream = nullptr) {
  check(difuse_qk_norm_sd35(&args, stream));
}

// Wan 2.x's attention prologue; a NULL weight is no affine (see difuse_qk_norm_rope_wan_args).
inline Support can_use_qk_norm_rope_wan(const difuse_qk_norm_rope_wan_args& args) {
  return support_from(difuse_can_use_qk_norm_rope_wan(&args));
}
inline void qk_norm_rope_wan(const difuse_qk_norm_rope_wan_args& args, void* stream = nullptr) {
  check(difuse_qk_norm_rope_wan(&args, stream));
}

// ---- registry -----------------------------------------------------------------------------------------
struct KernelInfo {
  std::string op, backend, contract, reference, platform, description;
  int min_sm = 0, max_sm = 0;
};
inline KernelInfo to_info(const difuse_kernel_info& k) {
  return {k.op, k.backend, k.contract, k.reference, k.platform, k.description, k.min_sm, k.max_sm};
}
inline std::vector<KernelInfo> registered_kernels() {
  std::vector<KernelInfo> out;
  for (int32_t i = 0, n = difuse_registry_count(); i < n; ++i) {
    difuse_kernel_info k{};
    check(difuse_registry_get(i, &k));
    out.push_back(to_info(k));
  }
  return out;
}
inline KernelInfo select_kernel(const std::string& op, const char* backend = nullptr) {
  difuse_kernel_info k{};
  check(difuse_registry_select(op.c_str(), backend, &k));
  return to_info(k);
}

// ---- BitExactGate -------------------------------------------------------------------------------------
enum class GateMode { Once = DIFUSE_GATE_ONCE, PerSignature = DIFUSE_GATE_PER_SIGNATURE };

class BitExactGate {
 public:
  BitExactGate(const std::string& op, GateMode mode) { check(difuse_gate_create(op.c_str(), static_cast<int32_t>(mode), &g_)); }
  ~BitExactGate() { difuse_gate_destroy(g_); }
  BitExactGate(const BitExactGate&) = delete;
  BitExactGate& operator=(const BitExactGate&) = delete;

  difuse_gate_decision decide(int device, const std::string& sig, bool capturing = false, void* stream = nullptr) {
    int32_t d = 0;
    check(difuse_gate_decide(g_, device, sig.c_str(), capturing ? 1 : 0, stream, &d));
    return static_cast<difuse_gate_decision>(d);
  }

  // The whole protocol: predicate already passed by the caller. `fused` writes the fused result,
  // `reference` the eager one, `compare` counts differing bit patterns between them (run only on first
  // sight). Returns true when the fused result is the one to use.
  bool run(int device, const std::string& sig, const std::function<void()>& fused,
           const std::function<void()>& reference, const std::function<int64_t()>& compare, bool capturing = false,
           void* stream = nullptr) {
    for (;;) {
      switch (decide(device, sig, capturing, stream)) {
        case DIFUSE_GATE_RUN_FUSED:
          fused();
          return true;
        case DIFUSE_GATE_FALLBACK:
          reference();
          return false;
        case DIFUSE_GATE_VERIFY:
          break;
      }
      int32_t proceed = 0;
      check(difuse_gate_begin_verify(g_, device, sig.c_str(), &proceed));
      if (!proceed) continue;  // settled by another thread meanwhile
      int64_t mismatches = -1;
      std::string detail;
      try {
        fused();
        reference();
        mismatches = compare();
      } catch (const std::exception& e) {
        detail = e.what();
      } catch (...) {  // anything else: end the verification (it holds the gate's lock), then let it go on
        difuse_gate_end_verify(g_, device, sig.c_str(), -1, "verification interrupted");
        throw;
      }
      check(difuse_gate_end_verify(g_, device, sig.c_str(), mismatches, detail.c_str()));
      if (mismatches == 0) return true;
      if (mismatches < 0) reference();  // the host failure may have come before the reference ran
      return false;
    }
  }

  void disable(int device, const std::string& reason) { check(difuse_gate_disable(g_, device, reason.c_str())); }
  void reset() { check(difuse_gate_reset(g_)); }
  bool is_verified(int device, const std::string& sig) const {
    int32_t v = 0;
    check(difuse_gate_is_verified(g_, device, sig.c_str(), &v));
    return v != 0;
  }
  difuse_gate_counters counters(int device) const {
    difuse_gate_counters c{};
    check(difuse_gate_counters_get(g_, device, &c));
    return c;
  }
  difuse_gate* handle() const noexcept { return g_; }

 private:
  difuse_gate* g_ = nullptr;
};

}  // namespace difuse
