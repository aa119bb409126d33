// The C ABI: every entry point catches everything, returns a status and leaves the reason in
// difuse_last_error() for this thread.
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "activation/activation_mul.h"
#include "activation/gelu_tanh.h"
#include "rope/rms_norm_rope_rotate_half.h"
#include "rope/rope_rotate_half.h"
#include "core/device.h"
#include "core/error.h"
#include "core/gate.h"
#include "core/tensor.h"
#include "core/registry.h"
#include "difuse/difuse.h"
#include "modulate/gated_residual.h"
#include "norm/layernorm_modulate.h"
#include "norm/rms_norm.h"
#include "norm/rms_norm_diffusers.h"
#include "norm/rms_norm_modulate.h"
#include "probe/sm_partition.h"
#include "probe/stream_copy.h"
#include "rope/qk_norm_rope.h"
#include "rope/qk_norm_rope_qwen.h"
#include "rope/qk_norm_sd35.h"
#include "rope/qk_norm_rope_wan.h"

namespace difuse::detail {
const std::string& last_error();
}

using difuse::detail::Failure;

namespace {

template <class F>
difuse_status guarded(F&& f) {
  try {
    difuse::detail::clear_last_error();
    f();
    return DIFUSE_OK;
  } catch (const Failure& e) {
    difuse::detail::set_last_error(e.what());
    return e.status();
  } catch (const std::bad_alloc&) {
    difuse::detail::set_last_error("out of host memory");
    return DIFUSE_ERR_INTERNAL;
  } catch (const std::exception& e) {
    difuse::detail::set_last_error(std::string("internal error: ") + e.what());
    return DIFUSE_ERR_INTERNAL;
  } catch (...) {
    difuse::detail::set_last_error("internal error: unknown exception");
    return DIFUSE_ERR_INTERNAL;
  }
}

void require(bool cond, const char* what) {
  if (!cond) throw Failure(DIFUSE_ERR_INVALID_ARGUMENT, what);
}

// Who asks for a view: a predicate (difuse_can_use_*), which must answer for meta and fake tensors too, or a launcher,
// which reads and writes the memory.
enum class Use { predicate, launch };

const difuse_tensor_view& view(const difuse_tensor_view* v, const char* name, Use use = Use::predicate) {
  if (v == nullptr) throw Failure(DIFUSE_ERR_INVALID_ARGUMENT, std::string(name) + " is a NULL difuse_tensor_view");
  if (v->rank < 0 || v->rank > DIFUSE_MAX_RANK)
    throw Failure(DIFUSE_ERR_INVALID_ARGUMENT, std::string(name) + " has rank " + std::to_string(v->rank) +
                                                   " outside [0, " + std::to_string(DIFUSE_MAX_RANK) + "]");
  int64_t elements = 1;
  for (int d = 0; d < v->rank; ++d) {
    if (v->sizes[d] < 0)
      throw Failure(DIFUSE_ERR_INVALID_ARGUMENT, std::string(name) + " has a negative size " +
                                                     std::to_string(v->sizes[d]) + " in dim " + std::to_string(d));
    if (__builtin_mul_overflow(elements, v->sizes[d], &elements))
      throw Failure(DIFUSE_ERR_INVALID_ARGUMENT, std::string(name) + " has more than 2^63 elements");
  }
  // No tensor's data sits off its element alignment (a bf16 pointer 1 byte off would pass the predicates of the ops
  // with 2-byte fallback accesses, which then fault). A NULL pointer is left to the predicates: meta and fake
  // tensors (torch.compile's tracing) come here without data and must get the predicates' reasons, not an error.
  // A launch is different: elements behind a NULL pointer are no tensor it can read or write (some predicates take
  // such a view as absent, e.g. a NULL cos skips qk_norm_rope's RoPE, so the launcher must not see one).
  if (use == Use::launch && elements > 0 && v->data == nullptr)
    throw Failure(DIFUSE_ERR_INVALID_ARGUMENT, std::string(name) + " has " + std::to_string(elements) +
                                                   " elements and a NULL data pointer");
  const int64_t esize = difuse::detail::dtype_size(v->dtype);
  if (v->data != nullptr && esize > 1 && reinterpret_cast<uintptr_t>(v->data) % static_cast<uintptr_t>(esize) != 0)
    throw Failure(DIFUSE_ERR_INVALID_ARGUMENT, std::string(name) + "'s data pointer is not aligned to its " +
                                                   std::to_string(esize) + "-byte elements");
  return *v;
}

const difuse_tensor_view& launch_view(const difuse_tensor_view* v, const char* name) {
  return view(v, name, Use::launch);
}

// An optional view of an args struct: absent (NULL) becomes the empty view the predicates treat as "not given".
difuse_tensor_view optional_view(const difuse_tensor_view* v, const char* name, Use use) {
  return v == nullptr ? difuse_tensor_view{} : view(v, name, use);
}
// r.field = the optional view a->field (inside the args converters below, which name their struct r, input a and
// asker use)
#define DIFUSE_OPTIONAL_VIEW(field) r.field = optional_view(a->field, #field, use)

void fill(const difuse::detail::KernelInfo& k, difuse_kernel_info* out) {
  out->op = k.op.c_str();
  out->backend = k.backend.c_str();
  out->contract = k.contract.c_str();
  out->reference = k.reference.c_str();
  out->platform = k.platform.c_str();
  out->min_sm = k.min_sm;
  out->max_sm = k.max_sm;
  out->description = k.description.c_str();
}

difuse::detail::BitExactGate& gate_ref(difuse_gate* g) {
  require(g != nullptr, "NULL difuse_gate handle");
  return *reinterpret_cast<difuse::detail::BitExactGate*>(g);
}

const char* sig_or_empty(const char* s) { return s ? s : ""; }

// The fields the joint prologues' args share (FLUX, Qwen-Image, SD3.5): the three outputs and the main stream's
// q, k, v and norm weights.
template <class R, class A>
void joint_outputs_and_main_stream(R& r, const A* a, Use use) {
  DIFUSE_OPTIONAL_VIEW(q_out);
  DIFUSE_OPTIONAL_VIEW(k_out);
  DIFUSE_OPTIONAL_VIEW(v_out);
  DIFUSE_OPTIONAL_VIEW(q);
  DIFUSE_OPTIONAL_VIEW(k);
  DIFUSE_OPTIONAL_VIEW(v);
  DIFUSE_OPTIONAL_VIEW(q_weight);
  DIFUSE_OPTIONAL_VIEW(k_weight);
}

difuse::rope::QkNormRopeArgs qk_norm_rope_args(const difuse_qk_norm_rope_args* a, Use use) {
  if (a == nullptr) throw Failure(DIFUSE_ERR_INVALID_ARGUMENT, "qk_norm_rope: args is NULL");
  difuse::rope::QkNormRopeArgs r;
  joint_outputs_and_main_stream(r, a, use);
  DIFUSE_OPTIONAL_VIEW(q_first);
  DIFUSE_OPTIONAL_VIEW(k_first);
  DIFUSE_OPTIONAL_VIEW(v_first);
  DIFUSE_OPTIONAL_VIEW(q_first_weight);
  DIFUSE_OPTIONAL_VIEW(k_first_weight);
  DIFUSE_OPTIONAL_VIEW(cos);
  DIFUSE_OPTIONAL_VIEW(sin);
  r.eps = a->eps;
  return r;
}

difuse::rope::QkNormRopeWanArgs qk_norm_rope_wan_args(const difuse_qk_norm_rope_wan_args* a, Use use) {
  if (a == nullptr) throw Failure(DIFUSE_ERR_INVALID_ARGUMENT, "qk_norm_rope_wan: args is NULL");
  difuse::rope::QkNormRopeWanArgs r;
  DIFUSE_OPTIONAL_VIEW(q_out);
  DIFUSE_OPTIONAL_VIEW(k_out);
  DIFUSE_OPTIONAL_VIEW(q);
  DIFUSE_OPTIONAL_VIEW(k);
  DIFUSE_OPTIONAL_VIEW(q_weight);
  DIFUSE_OPTIONAL_VIEW(k_weight);
  DIFUSE_OPTIONAL_VIEW(freqs_cos);
  DIFUSE_OPTIONAL_VIEW(freqs_sin);
  r.heads = a->heads;
  r.eps = a->eps;
  return r;
}

difuse::rope::QkNormRopeQwenArgs qk_norm_rope_qwen_args(const difuse_qk_norm_rope_qwen_args* a, Use use) {
  if (a == nullptr) throw Failure(DIFUSE_ERR_INVALID_ARGUMENT, "qk_norm_rope_qwen: args is NULL");
  difuse::rope::QkNormRopeQwenArgs r;
  joint_outputs_and_main_stream(r, a, use);
  DIFUSE_OPTIONAL_VIEW(q_txt);
  DIFUSE_OPTIONAL_VIEW(k_txt);
  DIFUSE_OPTIONAL_VIEW(v_txt);
  DIFUSE_OPTIONAL_VIEW(q_txt_weight);
  DIFUSE_OPTIONAL_VIEW(k_txt_weight);
  DIFUSE_OPTIONAL_VIEW(freqs);
  DIFUSE_OPTIONAL_VIEW(freqs_txt);
  r.eps = a->eps;
  return r;
}

difuse::rope::QkNormSd35Args qk_norm_sd35_args(const difuse_qk_norm_sd35_args* a, Use use) {
  if (a == nullptr) throw Failure(DIFUSE_ERR_INVALID_ARGUMENT, "qk_norm_sd35: args is NULL");
  difuse::rope::QkNormSd35Args r;
  joint_outputs_and_main_stream(r, a, use);
  DIFUSE_OPTIONAL_VIEW(q_ctx);
  DIFUSE_OPTIONAL_VIEW(k_ctx);
  DIFUSE_OPTIONAL_VIEW(v_ctx);
  DIFUSE_OPTIONAL_VIEW(q_ctx_weight);
  DIFUSE_OPTIONAL_VIEW(k_ctx_weight);
  r.eps = a->eps;
  return r;
}
#undef DIFUSE_OPTIONAL_VIEW

}  // namespace

extern "C" {

const char* difuse_last_error(void) { return difuse::detail::last_error().c_str(); }

const char* difuse_version(void) { return "0.1.0"; }

const char* difuse_status_name(difuse_status s) {
  switch (s) {
    case DIFUSE_OK: return "ok";
    case DIFUSE_ERR_UNSUPPORTED: return "unsupported";
    case DIFUSE_ERR_INVALID_ARGUMENT: return "invalid_argument";
    case DIFUSE_ERR_CUDA: return "cuda_error";
    case DIFUSE_ERR_INTERNAL: return "internal_error";
    case DIFUSE_ERR_NOT_FOUND: return "not_found";
  }
  return "unknown_status";
}

const char* difuse_dtype_name(int32_t dtype) {
  switch (dtype) {
    case DIFUSE_BF16: return "bf16";
    case DIFUSE_F16: return "fp16";
    case DIFUSE_F32: return "fp32";
    case DIFUSE_F8E4M3: return "fp8_e4m3";
    case DIFUSE_I32: return "int32";
    case DIFUSE_I64: return "int64";
  }
  return "unknown_dtype";
}

int32_t difuse_registry_count(void) {
  return static_cast<int32_t>(difuse::detail::registered_kernels().size());
}

difuse_status difuse_registry_get(int32_t index, difuse_kernel_info* out) {
  return guarded([&] {
    require(out != nullptr, "NULL difuse_kernel_info");
    const auto& ks = difuse::detail::registered_kernels();
    if (index < 0 || static_cast<size_t>(index) >= ks.size())
      throw Failure(DIFUSE_ERR_NOT_FOUND, "registry index " + std::to_string(index) + " outside [0, " +
                                              std::to_string(ks.size()) + ")");
    fill(ks[static_cast<size_t>(index)], out);
  });
}

difuse_status difuse_registry_select(const char* op, const char* backend, difuse_kernel_info* out) {
  return guarded([&] {
    require(op != nullptr && out != nullptr, "difuse_registry_select needs an op name and an output");
    const auto* k = difuse::detail::select_kernel(op, backend);
    if (!k)
      throw Failure(DIFUSE_ERR_NOT_FOUND, std::string("no kernel registered for op '") + op + "'" +
                                              (backend ? std::string(" with backend '") + backend + "'" : ""));
    fill(*k, out);
  });
}

difuse_status difuse_gate_create(const char* op, int32_t mode, difuse_gate** out) {
  return guarded([&] {
    require(op != nullptr && out != nullptr, "difuse_gate_create needs an op name and an output");
    require(mode == DIFUSE_GATE_ONCE || mode == DIFUSE_GATE_PER_SIGNATURE, "gate mode must be ONCE or PER_SIGNATURE");
    *out = reinterpret_cast<difuse_gate*>(
        new difuse::detail::BitExactGate(op, static_cast<difuse::detail::GateMode>(mode)));
  });
}

void difuse_gate_destroy(difuse_gate* gate) { delete reinterpret_cast<difuse::detail::BitExactGate*>(gate); }

difuse_status difuse_gate_decide(difuse_gate* gate, int32_t device, const char* signature, int32_t capturing,
                                 void* stream, int32_t* decision) {
  return guarded([&] {
    require(decision != nullptr, "NULL decision output");
    *decision = static_cast<int32_t>(gate_ref(gate).decide(device, sig_or_empty(signature), capturing != 0, stream));
  });
}

difuse_status difuse_gate_begin_verify(difuse_gate* gate, int32_t device, const char* signature, int32_t* proceed) {
  return guarded([&] {
    require(proceed != nullptr, "NULL proceed output");
    *proceed = gate_ref(gate).begin_verify(device, sig_or_empty(signature)) ? 1 : 0;
  });
}

difuse_status difuse_gate_end_verify(difuse_gate* gate, int32_t device, const char* signature, int64_t mismatches,
                                     const char* detail) {
  return guarded([&] { gate_ref(gate).end_verify(device, sig_or_empty(signature), mismatches, sig_or_empty(detail)); });
}

difuse_status difuse_gate_note_fallback(difuse_gate* gate, int32_t device, int32_t reason) {
  return guarded([&] { gate_ref(gate).note_fallback(device, reason); });
}

difuse_status difuse_gate_note_fused(difuse_gate* gate, int32_t device) {
  return guarded([&] { gate_ref(gate).note_fused(device); });
}

difuse_status difuse_gate_disable(difuse_gate* gate, int32_t device, const char* reason) {
  return guarded([&] { gate_ref(gate).disable(device, sig_or_empty(reason)); });
}

difuse_status difuse_gate_reset(difuse_gate* gate) {
  return guarded([&] { gate_ref(gate).reset(); });
}

difuse_status difuse_gate_counters_get(difuse_gate* gate, int32_t device, difuse_gate_counters* out) {
  return guarded([&] {
    require(out != nullptr, "NULL counters output");
    *out = gate_ref(gate).counters(device);
  });
}

difuse_status difuse_gate_is_verified(difuse_gate* gate, int32_t device, const char* signature, int32_t* verified) {
  return guarded([&] {
    require(verified != nullptr, "NULL verified output");
    *verified = gate_ref(gate).is_verified(device, sig_or_empty(signature)) ? 1 : 0;
  });
}

difuse_status difuse_set_platform_note(const char* note) {
  return guarded([&] { difuse::detail::BitExactGate::set_platform_note(sig_or_empty(note)); });
}

difuse_status difuse_set_log_sink(difuse_log_fn fn, void* user) {
  return guarded([&] { difuse::detail::BitExactGate::set_log_sink(fn, user); });
}

difuse_status difuse_can_use_layernorm_modulate(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                                const difuse_tensor_view* scale, const difuse_tensor_view* shift,
                                                double eps) {
  return guarded([&] {
    const auto s = difuse::norm::can_use_layernorm_modulate(view(out, "out"), view(x, "x"), view(scale, "scale"),
                                                            view(shift, "shift"), eps);
    if (!s.ok()) throw Failure(DIFUSE_ERR_UNSUPPORTED, s.message("layernorm_modulate"));
  });
}

difuse_status difuse_layernorm_modulate(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                        const difuse_tensor_view* scale, const difuse_tensor_view* shift, double eps,
                                        void* stream) {
  return guarded([&] {
    difuse::norm::layernorm_modulate(launch_view(out, "out"), launch_view(x, "x"), launch_view(scale, "scale"),
                                     launch_view(shift, "shift"), eps, static_cast<cudaStream_t>(stream));
  });
}

difuse_status difuse_can_use_gated_residual(const difuse_tensor_view* out, const difuse_tensor_view* h,
                                            const difuse_tensor_view* a, const difuse_tensor_view* gate) {
  return guarded([&] {
    const auto s = difuse::modulate::can_use_gated_residual(view(out, "out"), view(h, "h"), view(a, "a"),
                                                            view(gate, "gate"));
    if (!s.ok()) throw Failure(DIFUSE_ERR_UNSUPPORTED, s.message("gated_residual"));
  });
}

difuse_status difuse_gated_residual(const difuse_tensor_view* out, const difuse_tensor_view* h,
                                    const difuse_tensor_view* a, const difuse_tensor_view* gate, void* stream) {
  return guarded([&] {
    difuse::modulate::gated_residual(launch_view(out, "out"), launch_view(h, "h"), launch_view(a, "a"),
                                     launch_view(gate, "gate"), static_cast<cudaStream_t>(stream));
  });
}

difuse_status difuse_can_use_rms_norm(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                      const difuse_tensor_view* weight, double eps) {
  return guarded([&] {
    const difuse_tensor_view none{};
    const auto s =
        difuse::norm::can_use_rms_norm(view(out, "out"), view(x, "x"), weight ? view(weight, "weight") : none, eps);
    if (!s.ok()) throw Failure(DIFUSE_ERR_UNSUPPORTED, s.message("rms_norm"));
  });
}

difuse_status difuse_rms_norm(const difuse_tensor_view* out, const difuse_tensor_view* x,
                              const difuse_tensor_view* weight, double eps, void* stream) {
  return guarded([&] {
    const difuse_tensor_view none{};
    difuse::norm::rms_norm(launch_view(out, "out"), launch_view(x, "x"), weight ? launch_view(weight, "weight") : none,
                           eps, static_cast<cudaStream_t>(stream));
  });
}

difuse_status difuse_can_use_gelu_tanh(const difuse_tensor_view* out, const difuse_tensor_view* x) {
  return guarded([&] {
    const auto s = difuse::activation::can_use_gelu_tanh(view(out, "out"), view(x, "x"));
    if (!s.ok()) throw Failure(DIFUSE_ERR_UNSUPPORTED, s.message("gelu_tanh"));
  });
}

difuse_status difuse_gelu_tanh(const difuse_tensor_view* out, const difuse_tensor_view* x, void* stream) {
  return guarded([&] {
    difuse::activation::gelu_tanh(launch_view(out, "out"), launch_view(x, "x"), static_cast<cudaStream_t>(stream));
  });
}

difuse_status difuse_can_use_activation_mul(const difuse_tensor_view* out, const difuse_tensor_view* a,
                                            const difuse_tensor_view* b, const difuse_tensor_view* table) {
  return guarded([&] {
    const auto s = difuse::activation::can_use_activation_mul(view(out, "out"), view(a, "a"), view(b, "b"),
                                                              view(table, "table"));
    if (!s.ok()) throw Failure(DIFUSE_ERR_UNSUPPORTED, s.message("activation_mul"));
  });
}

difuse_status difuse_activation_mul(const difuse_tensor_view* out, const difuse_tensor_view* a,
                                    const difuse_tensor_view* b, const difuse_tensor_view* table, void* stream) {
  return guarded([&] {
    difuse::activation::activation_mul(launch_view(out, "out"), launch_view(a, "a"), launch_view(b, "b"),
                                       launch_view(table, "table"), static_cast<cudaStream_t>(stream));
  });
}

difuse_status difuse_can_use_rope_rotate_half(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                              const difuse_tensor_view* cos, const difuse_tensor_view* sin) {
  return guarded([&] {
    const auto s = difuse::rope::can_use_rope_rotate_half(view(out, "out"), view(x, "x"), view(cos, "cos"),
                                                          view(sin, "sin"));
    if (!s.ok()) throw Failure(DIFUSE_ERR_UNSUPPORTED, s.message("rope_rotate_half"));
  });
}

difuse_status difuse_rope_rotate_half(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                      const difuse_tensor_view* cos, const difuse_tensor_view* sin, void* stream) {
  return guarded([&] {
    difuse::rope::rope_rotate_half(launch_view(out, "out"), launch_view(x, "x"), launch_view(cos, "cos"),
                                   launch_view(sin, "sin"), static_cast<cudaStream_t>(stream));
  });
}

difuse_status difuse_can_use_rms_norm_rope_rotate_half(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                                       const difuse_tensor_view* weight, const difuse_tensor_view* cos,
                                                       const difuse_tensor_view* sin, double eps) {
  return guarded([&] {
    const difuse_tensor_view none{};
    const auto s = difuse::rope::can_use_rms_norm_rope_rotate_half(
        view(out, "out"), view(x, "x"), weight ? view(weight, "weight") : none, view(cos, "cos"), view(sin, "sin"),
        eps);
    if (!s.ok()) throw Failure(DIFUSE_ERR_UNSUPPORTED, s.message("rms_norm_rope_rotate_half"));
  });
}

difuse_status difuse_rms_norm_rope_rotate_half(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                               const difuse_tensor_view* weight, const difuse_tensor_view* cos,
                                               const difuse_tensor_view* sin, double eps, void* stream) {
  return guarded([&] {
    const difuse_tensor_view none{};
    difuse::rope::rms_norm_rope_rotate_half(launch_view(out, "out"), launch_view(x, "x"),
                                            weight ? launch_view(weight, "weight") : none, launch_view(cos, "cos"),
                                            launch_view(sin, "sin"), eps, static_cast<cudaStream_t>(stream));
  });
}

difuse_status difuse_can_use_rms_norm_diffusers(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                                const difuse_tensor_view* weight, double eps) {
  return guarded([&] {
    const difuse_tensor_view none{};
    const auto s = difuse::norm::can_use_rms_norm_diffusers(view(out, "out"), view(x, "x"),
                                                            weight ? view(weight, "weight") : none, eps);
    if (!s.ok()) throw Failure(DIFUSE_ERR_UNSUPPORTED, s.message("rms_norm_diffusers"));
  });
}

difuse_status difuse_rms_norm_diffusers(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                        const difuse_tensor_view* weight, double eps, void* stream) {
  return guarded([&] {
    const difuse_tensor_view none{};
    difuse::norm::rms_norm_diffusers(launch_view(out, "out"), launch_view(x, "x"),
                                     weight ? launch_view(weight, "weight") : none, eps,
                                     static_cast<cudaStream_t>(stream));
  });
}

difuse_status difuse_can_use_rms_norm_modulate(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                               const difuse_tensor_view* weight, const difuse_tensor_view* scale,
                                               const difuse_tensor_view* shift, double eps, int32_t fp32_modulate) {
  return guarded([&] {
    const difuse_tensor_view none{};
    const auto s = difuse::norm::can_use_rms_norm_modulate(view(out, "out"), view(x, "x"),
                                                           weight ? view(weight, "weight") : none,
                                                           view(scale, "scale"), view(shift, "shift"), eps,
                                                           fp32_modulate);
    if (!s.ok()) throw Failure(DIFUSE_ERR_UNSUPPORTED, s.message("rms_norm_modulate"));
  });
}

difuse_status difuse_rms_norm_modulate(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                       const difuse_tensor_view* weight, const difuse_tensor_view* scale,
                                       const difuse_tensor_view* shift, double eps, int32_t fp32_modulate,
                                       void* stream) {
  return guarded([&] {
    const difuse_tensor_view none{};
    difuse::norm::rms_norm_modulate(launch_view(out, "out"), launch_view(x, "x"),
                                    weight ? launch_view(weight, "weight") : none, launch_view(scale, "scale"),
                                    launch_view(shift, "shift"), eps, fp32_modulate, static_cast<cudaStream_t>(stream));
  });
}

difuse_status difuse_can_use_gated_residual_rms_norm_modulate(
    const difuse_tensor_view* out, const difuse_tensor_view* residual, const difuse_tensor_view* h,
    const difuse_tensor_view* a, const difuse_tensor_view* gate, const difuse_tensor_view* weight,
    const difuse_tensor_view* scale, const difuse_tensor_view* shift, double eps, int32_t fp32_modulate) {
  return guarded([&] {
    const difuse_tensor_view none{};
    const auto s = difuse::norm::can_use_gated_residual_rms_norm_modulate(
        view(out, "out"), view(residual, "residual"), view(h, "h"), view(a, "a"), view(gate, "gate"),
        weight ? view(weight, "weight") : none, view(scale, "scale"), view(shift, "shift"), eps, fp32_modulate);
    if (!s.ok()) throw Failure(DIFUSE_ERR_UNSUPPORTED, s.message("gated_residual_rms_norm_modulate"));
  });
}

difuse_status difuse_gated_residual_rms_norm_modulate(
    const difuse_tensor_view* out, const difuse_tensor_view* residual, const difuse_tensor_view* h,
    const difuse_tensor_view* a, const difuse_tensor_view* gate, const difuse_tensor_view* weight,
    const difuse_tensor_view* scale, const difuse_tensor_view* shift, double eps, int32_t fp32_modulate,
    void* stream) {
  return guarded([&] {
    const difuse_tensor_view none{};
    difuse::norm::gated_residual_rms_norm_modulate(
        launch_view(out, "out"), launch_view(residual, "residual"), launch_view(h, "h"), launch_view(a, "a"),
        launch_view(gate, "gate"), weight ? launch_view(weight, "weight") : none, launch_view(scale, "scale"),
        launch_view(shift, "shift"), eps, fp32_modulate, static_cast<cudaStream_t>(stream));
  });
}

difuse_status difuse_can_use_gated_residual_layernorm_modulate(
    const difuse_tensor_view* out, const difuse_tensor_view* residual, const difuse_tensor_view* h,
    const difuse_tensor_view* a, const difuse_tensor_view* gate, const difuse_tensor_view* scale,
    const difuse_tensor_view* shift, double eps) {
  return guarded([&] {
    const auto s = difuse::norm::can_use_gated_residual_layernorm_modulate(
        view(out, "out"), view(residual, "residual"), view(h, "h"), view(a, "a"), view(gate, "gate"),
        view(scale, "scale"), view(shift, "shift"), eps);
    if (!s.ok()) throw Failure(DIFUSE_ERR_UNSUPPORTED, s.message("gated_residual_layernorm_modulate"));
  });
}

difuse_status difuse_gated_residual_layernorm_modulate(const difuse_tensor_view* out,
                                                       const difuse_tensor_view* residual, const difuse_tensor_view* h,
                                                       const difuse_tensor_view* a, const difuse_tensor_view* gate,
                                                       const difuse_tensor_view* scale, const difuse_tensor_view* shift,
                                                       double eps, void* stream) {
  return guarded([&] {
    difuse::norm::gated_residual_layernorm_modulate(launch_view(out, "out"), launch_view(residual, "residual"),
                                                    launch_view(h, "h"), launch_view(a, "a"), launch_view(gate, "gate"),
                                                    launch_view(scale, "scale"), launch_view(shift, "shift"), eps,
                                                    static_cast<cudaStream_t>(stream));
  });
}

difuse_status difuse_can_use_layernorm_modulate_fp32(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                                     const difuse_tensor_view* scale, const difuse_tensor_view* shift,
                                                     double eps) {
  return guarded([&] {
    const auto s = difuse::norm::can_use_layernorm_modulate_fp32(view(out, "out"), view(x, "x"), view(scale, "scale"),
                                                                 view(shift, "shift"), eps);
    if (!s.ok()) throw Failure(DIFUSE_ERR_UNSUPPORTED, s.message("layernorm_modulate_fp32"));
  });
}

difuse_status difuse_layernorm_modulate_fp32(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                             const difuse_tensor_view* scale, const difuse_tensor_view* shift,
                                             double eps, void* stream) {
  return guarded([&] {
    difuse::norm::layernorm_modulate_fp32(launch_view(out, "out"), launch_view(x, "x"), launch_view(scale, "scale"),
                                          launch_view(shift, "shift"), eps, static_cast<cudaStream_t>(stream));
  });
}

difuse_status difuse_can_use_gated_residual_fp32(const difuse_tensor_view* out, const difuse_tensor_view* h,
                                                 const difuse_tensor_view* a, const difuse_tensor_view* gate) {
  return guarded([&] {
    const auto s = difuse::modulate::can_use_gated_residual_fp32(view(out, "out"), view(h, "h"), view(a, "a"),
                                                                 view(gate, "gate"));
    if (!s.ok()) throw Failure(DIFUSE_ERR_UNSUPPORTED, s.message("gated_residual_fp32"));
  });
}

difuse_status difuse_gated_residual_fp32(const difuse_tensor_view* out, const difuse_tensor_view* h,
                                         const difuse_tensor_view* a, const difuse_tensor_view* gate, void* stream) {
  return guarded([&] {
    difuse::modulate::gated_residual_fp32(launch_view(out, "out"), launch_view(h, "h"), launch_view(a, "a"),
                                          launch_view(gate, "gate"), static_cast<cudaStream_t>(stream));
  });
}

difuse_status difuse_can_use_layernorm_affine_fp32(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                                   const difuse_tensor_view* weight, const difuse_tensor_view* bias,
                                                   double eps) {
  return guarded([&] {
    const auto s = difuse::norm::can_use_layernorm_affine_fp32(view(out, "out"), view(x, "x"), view(weight, "weight"),
                                                               view(bias, "bias"), eps);
    if (!s.ok()) throw Failure(DIFUSE_ERR_UNSUPPORTED, s.message("layernorm_affine_fp32"));
  });
}

difuse_status difuse_layernorm_affine_fp32(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                           const difuse_tensor_view* weight, const difuse_tensor_view* bias, double eps,
                                           void* stream) {
  return guarded([&] {
    difuse::norm::layernorm_affine_fp32(launch_view(out, "out"), launch_view(x, "x"), launch_view(weight, "weight"),
                                        launch_view(bias, "bias"), eps, static_cast<cudaStream_t>(stream));
  });
}

difuse_status difuse_can_use_qk_norm_rope(const difuse_qk_norm_rope_args* args) {
  return guarded([&] {
    const auto s = difuse::rope::can_use_qk_norm_rope(qk_norm_rope_args(args, Use::predicate));
    if (!s.ok()) throw Failure(DIFUSE_ERR_UNSUPPORTED, s.message("qk_norm_rope"));
  });
}

difuse_status difuse_qk_norm_rope(const difuse_qk_norm_rope_args* args, void* stream) {
  return guarded(
      [&] { difuse::rope::qk_norm_rope(qk_norm_rope_args(args, Use::launch), static_cast<cudaStream_t>(stream)); });
}

difuse_status difuse_can_use_qk_norm_rope_wan(const difuse_qk_norm_rope_wan_args* args) {
  return guarded([&] {
    const auto s = difuse::rope::can_use_qk_norm_rope_wan(qk_norm_rope_wan_args(args, Use::predicate));
    if (!s.ok()) throw Failure(DIFUSE_ERR_UNSUPPORTED, s.message("qk_norm_rope_wan"));
  });
}

difuse_status difuse_qk_norm_rope_wan(const difuse_qk_norm_rope_wan_args* args, void* stream) {
  return guarded([&] {
    difuse::rope::qk_norm_rope_wan(qk_norm_rope_wan_args(args, Use::launch), static_cast<cudaStream_t>(stream));
  });
}

difuse_status difuse_can_use_qk_norm_rope_qwen(const difuse_qk_norm_rope_qwen_args* args) {
  return guarded([&] {
    const auto s = difuse::rope::can_use_qk_norm_rope_qwen(qk_norm_rope_qwen_args(args, Use::predicate));
    if (!s.ok()) throw Failure(DIFUSE_ERR_UNSUPPORTED, s.message("qk_norm_rope_qwen"));
  });
}

difuse_status difuse_qk_norm_rope_qwen(const difuse_qk_norm_rope_qwen_args* args, void* stream) {
  return guarded([&] {
    difuse::rope::qk_norm_rope_qwen(qk_norm_rope_qwen_args(args, Use::launch), static_cast<cudaStream_t>(stream));
  });
}

difuse_status difuse_can_use_qk_norm_sd35(const difuse_qk_norm_sd35_args* args) {
  return guarded([&] {
    const auto s = difuse::rope::can_use_qk_norm_sd35(qk_norm_sd35_args(args, Use::predicate));
    if (!s.ok()) throw Failure(DIFUSE_ERR_UNSUPPORTED, s.message("qk_norm_sd35"));
  });
}

difuse_status difuse_qk_norm_sd35(const difuse_qk_norm_sd35_args* args, void* stream) {
  return guarded(
      [&] { difuse::rope::qk_norm_sd35(qk_norm_sd35_args(args, Use::launch), static_cast<cudaStream_t>(stream)); });
}

// ---- probes --------------------------------------------------------------------------------------

int32_t difuse_probe_stream_copy_variants(void) { return difuse::probe::stream_copy_variant_count(); }

const char* difuse_probe_stream_copy_variant_name(int32_t variant) {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v;
    for (int i = 0; i < difuse::probe::stream_copy_variant_count(); ++i)
      v.push_back(difuse::probe::stream_copy_variant_name(i));
    return v;
  }();
  return variant >= 0 && variant < static_cast<int32_t>(names.size()) ? names[variant].c_str() : nullptr;
}

difuse_status difuse_probe_stream_copy(void* dst, const void* src, int64_t nbytes, int32_t variant, void* stream) {
  return guarded([&] {
    difuse::probe::stream_copy(dst, src, nbytes, variant, static_cast<cudaStream_t>(stream));
  });
}

difuse_status difuse_probe_sm_partition_stream(int32_t device, int32_t sms, void** stream_out, int32_t* sms_out) {
  return guarded([&] {
    if (stream_out == nullptr || sms_out == nullptr)
      throw Failure(DIFUSE_ERR_INVALID_ARGUMENT,
                    std::string("difuse_probe_sm_partition_stream:") + (stream_out ? "" : " stream_out is NULL;") +
                        (sms_out ? "" : " sms_out is NULL;"));
    const auto made = difuse::probe::create_sm_partition_stream(device, sms);
    *stream_out = made.stream;
    *sms_out = made.sms;
  });
}

difuse_status difuse_probe_set_launch_sm_count(int32_t device, int32_t sms) {
  return guarded([&] { difuse::probe::set_launch_sm_count(device, sms); });
}

difuse_status difuse_device_dram_bytes_per_sm_cycle(int32_t device, double* out) {
  return guarded([&] {
    if (!out) throw Failure(DIFUSE_ERR_INVALID_ARGUMENT, "difuse_device_dram_bytes_per_sm_cycle: out is NULL");
    *out = difuse::detail::dram_bytes_per_sm_cycle(device);
  });
}

}  // extern "C"

