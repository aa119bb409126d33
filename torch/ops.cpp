// TORCH_LIBRARY(difuse): the torch ops over libdifuse's C ABI, each with a CUDA and a Meta (fake)
// implementation so they trace under torch.compile(fullgraph=True) and replay in CUDA graphs (no host
// sync, no allocation but the output, the current stream), plus the ATen reference chain each op
// reproduces (used by `python -m difuse check` and by callers that verify a direct op call).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "difuse/difuse.h"
#include "tensor_view.h"

namespace {

using difuse::torch_binding::check_status;
using difuse::torch_binding::to_view;

// The output an op would allocate for `like`: contiguous, bf16, on its device (host too: a host input is refused
// for itself, not for an output elsewhere), at an address that overlaps nothing (predicates only read metadata and
// addresses).
difuse_tensor_view fresh_output_view(const at::Tensor& like) {
  difuse_tensor_view vo = to_view(like);
  vo.data = like.numel() ? reinterpret_cast<void*>(uintptr_t{1} << 48) : nullptr;
  vo.dtype = DIFUSE_BF16;
  int64_t acc = 1;
  for (int i = vo.rank - 1; i >= 0; --i) vo.strides[i] = acc, acc *= vo.sizes[i];
  return vo;
}

// The device guard of an op's first tensor argument. The dispatcher takes the CUDA kernel when any argument is on a
// CUDA device: a host first argument is refused here as a ValueError (the Python wrappers then list every violated
// precondition) rather than by the guard's own error.
c10::cuda::OptionalCUDAGuard cuda_guard(const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.is_cuda(), "difuse: the first tensor argument must be on a CUDA device like the others, got ",
                    t.device());
  return c10::cuda::OptionalCUDAGuard(t.device());
}

// A Meta impl runs whenever any argument is a meta (or, inside FakeTensorMode's kernel call, fake) tensor: every
// other tensor argument must then be one too, else the impl would hand back an unwritten output on a real device
// where the CUDA impl would have refused the mix. nullptr entries (absent optional arguments) are skipped.
const at::Tensor* opt_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? &*t : nullptr;
}
void check_meta_devices(const char* op, std::initializer_list<const at::Tensor*> ts) {
  const at::Tensor* first = nullptr;
  for (const at::Tensor* t : ts) {
    if (t == nullptr || !t->defined()) continue;
    if (first == nullptr) first = t;
    TORCH_CHECK_VALUE(t->device() == first->device(), "difuse::", op,
                      ": every tensor argument must be on one device (meta with meta), got ", first->device(),
                      " and ", t->device());
  }
}

// Reasons from a C predicate's message ("...:\n  - a\n  - b").
std::vector<std::string> reasons_from_last_error() {
  std::vector<std::string> reasons;
  const std::string msg = difuse_last_error(), mark = "\n  - ";
  for (size_t p = msg.find(mark); p != std::string::npos;) {
    const size_t b = p + mark.size(), n = msg.find(mark, b);
    reasons.push_back(msg.substr(b, n == std::string::npos ? std::string::npos : n - b));
    p = n;
  }
  return reasons;
}


// Shape and dtype rules the Meta impl can check (alignment and strides are the CUDA predicate's job).
void check_layernorm_modulate_meta(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift) {
  TORCH_CHECK_VALUE(x.dim() == 3, "difuse::layernorm_modulate: x must be [B, L, H], got ", x.sizes());
  TORCH_CHECK_VALUE(x.scalar_type() == at::kBFloat16 && scale.scalar_type() == at::kBFloat16 &&
                        shift.scalar_type() == at::kBFloat16,
                    "difuse::layernorm_modulate: x, scale and shift must be bf16");
  const int64_t B = x.size(0), H = x.size(2);
  for (const auto* m : {&scale, &shift}) {
    const bool rows = m->dim() == 2 && m->size(0) == B && m->size(1) == H;
    TORCH_CHECK_VALUE(rows || m->sizes() == x.sizes(), "difuse::layernorm_modulate: ", m == &scale ? "scale" : "shift",
                      " must be [B, H] = [", B, ", ", H, "] or [B, L, H] = ", x.sizes(), ", got ", m->sizes());
  }
}

at::Tensor layernorm_modulate_cuda(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift, double eps) {
  const auto guard = cuda_guard(x);
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const difuse_tensor_view vo = to_view(out), vx = to_view(x), vs = to_view(scale), vh = to_view(shift);
  check_status(difuse_layernorm_modulate(&vo, &vx, &vs, &vh, eps, at::cuda::getCurrentCUDAStream().stream()),
               "layernorm_modulate");
  return out;
}

at::Tensor layernorm_modulate_meta(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift, double) {
  check_meta_devices("layernorm_modulate", {&x, &scale, &shift});
  check_layernorm_modulate_meta(x, scale, shift);
  return at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
}

// The eager chain, op for op: F.layer_norm(x, (H,), eps=eps) * (1 + scale[:, None]) + shift[:, None].
at::Tensor layernorm_modulate_reference(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift,
                                        double eps) {
  const at::Tensor n = at::layer_norm(x, {x.size(-1)}, {}, {}, eps);
  const at::Tensor sc = scale.dim() == 2 ? scale.unsqueeze(1) : scale;
  const at::Tensor sh = shift.dim() == 2 ? shift.unsqueeze(1) : shift;
  return n * (sc + 1) + sh;
}

// Predicate as a list of reasons (empty = supported); works for any tensors, no launch.
std::vector<std::string> layernorm_modulate_unsupported(const at::Tensor& x, const at::Tensor& scale,
                                                        const at::Tensor& shift, double eps) {
  const difuse_tensor_view vo = fresh_output_view(x);
  const difuse_tensor_view vx = to_view(x), vs = to_view(scale), vh = to_view(shift);
  const difuse_status s = difuse_can_use_layernorm_modulate(&vo, &vx, &vs, &vh, eps);
  if (s == DIFUSE_OK) return {};
  if (s != DIFUSE_ERR_UNSUPPORTED) check_status(s, "can_use_layernorm_modulate");
  return reasons_from_last_error();
}

// ---- gated_residual ----------------------------------------------------------------------------------------
void check_gated_residual_meta(const at::Tensor& h, const at::Tensor& a, const at::Tensor& gate) {
  TORCH_CHECK_VALUE(h.dim() == 3, "difuse::gated_residual: h must be [B, L, H], got ", h.sizes());
  TORCH_CHECK_VALUE(h.scalar_type() == at::kBFloat16 && a.scalar_type() == at::kBFloat16 &&
                        gate.scalar_type() == at::kBFloat16,
                    "difuse::gated_residual: h, a and gate must be bf16");
  TORCH_CHECK_VALUE(a.sizes() == h.sizes(), "difuse::gated_residual: a must have the shape of h ", h.sizes(),
                    ", got ", a.sizes());
  const bool g2 = gate.dim() == 2 && gate.size(0) == h.size(0) && gate.size(1) == h.size(2);
  TORCH_CHECK_VALUE(g2 || gate.sizes() == h.sizes(), "difuse::gated_residual: gate must be [B, H] or [B, L, H], got ",
                    gate.sizes());
}

void gated_residual_into(const at::Tensor& out, const at::Tensor& h, const at::Tensor& a, const at::Tensor& gate) {
  const auto guard = cuda_guard(h);
  const difuse_tensor_view vo = to_view(out), vh = to_view(h), va = to_view(a), vg = to_view(gate);
  check_status(difuse_gated_residual(&vo, &vh, &va, &vg, at::cuda::getCurrentCUDAStream().stream()), "gated_residual");
}

at::Tensor gated_residual_cuda(const at::Tensor& h, const at::Tensor& a, const at::Tensor& gate) {
  at::Tensor out = at::empty(h.sizes(), h.options().memory_format(at::MemoryFormat::Contiguous));
  gated_residual_into(out, h, a, gate);
  return out;
}

void gated_residual_inplace_cuda(const at::Tensor& h, const at::Tensor& a, const at::Tensor& gate) {
  gated_residual_into(h, h, a, gate);
}

at::Tensor gated_residual_meta(const at::Tensor& h, const at::Tensor& a, const at::Tensor& gate) {
  check_meta_devices("gated_residual", {&h, &a, &gate});
  check_gated_residual_meta(h, a, gate);
  return at::empty(h.sizes(), h.options().memory_format(at::MemoryFormat::Contiguous));
}

void gated_residual_inplace_meta(const at::Tensor& h, const at::Tensor& a, const at::Tensor& gate) {
  check_meta_devices("gated_residual_", {&h, &a, &gate});
  check_gated_residual_meta(h, a, gate);
}

at::Tensor gated_residual_reference(const at::Tensor& h, const at::Tensor& a, const at::Tensor& gate) {
  return h + (gate.dim() == 2 ? gate.unsqueeze(1) : gate) * a;
}

std::vector<std::string> gated_residual_unsupported(const at::Tensor& h, const at::Tensor& a, const at::Tensor& gate) {
  const difuse_tensor_view vo = fresh_output_view(h);
  const difuse_tensor_view vh = to_view(h), va = to_view(a), vg = to_view(gate);
  const difuse_status s = difuse_can_use_gated_residual(&vo, &vh, &va, &vg);
  if (s == DIFUSE_OK) return {};
  if (s != DIFUSE_ERR_UNSUPPORTED) check_status(s, "can_use_gated_residual");
  return reasons_from_last_error();
}

// ---- rms_norm ------------------------------------------------------------------------------------------
at::Tensor rms_norm_cuda(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  const auto guard = cuda_guard(x);
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const difuse_tensor_view vo = to_view(out), vx = to_view(x);
  difuse_tensor_view vw{};
  if (weight.has_value() && weight->defined()) vw = to_view(*weight);
  check_status(difuse_rms_norm(&vo, &vx, vw.rank || vw.data ? &vw : nullptr, eps,
                               at::cuda::getCurrentCUDAStream().stream()),
               "rms_norm");
  return out;
}

at::Tensor rms_norm_meta(const at::Tensor& x, const std::optional<at::Tensor>& weight, double) {
  check_meta_devices("rms_norm", {&x, opt_ptr(weight)});
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.dim() <= 4, "difuse::rms_norm: x must have rank 1 to 4, got ", x.sizes());
  TORCH_CHECK_VALUE(x.scalar_type() == at::kBFloat16, "difuse::rms_norm: x must be bf16");
  if (weight.has_value() && weight->defined())
    TORCH_CHECK_VALUE(weight->dim() == 1 && weight->size(0) == x.size(-1) && weight->scalar_type() == at::kBFloat16,
                      "difuse::rms_norm: weight must be a bf16 [", x.size(-1), "], got ", weight->sizes());
  return at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
}

at::Tensor rms_norm_reference(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  return at::rms_norm(x, {x.size(-1)}, weight, eps);
}

std::vector<std::string> rms_norm_unsupported(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  const difuse_tensor_view vo = fresh_output_view(x);
  const difuse_tensor_view vx = to_view(x);
  difuse_tensor_view vw{};
  const bool has_w = weight.has_value() && weight->defined();
  if (has_w) vw = to_view(*weight);
  const difuse_status s = difuse_can_use_rms_norm(&vo, &vx, has_w ? &vw : nullptr, eps);
  if (s == DIFUSE_OK) return {};
  if (s != DIFUSE_ERR_UNSUPPORTED) check_status(s, "can_use_rms_norm");
  return reasons_from_last_error();
}

// ---- rms_norm_diffusers ------------------------------------------------------------------------------------
at::Tensor rms_norm_diffusers_cuda(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  const auto guard = cuda_guard(x);
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const difuse_tensor_view vo = to_view(out), vx = to_view(x);
  const bool has_w = weight.has_value() && weight->defined();
  difuse_tensor_view vw{};
  if (has_w) vw = to_view(*weight);
  check_status(difuse_rms_norm_diffusers(&vo, &vx, has_w ? &vw : nullptr, eps, at::cuda::getCurrentCUDAStream().stream()),
               "rms_norm_diffusers");
  return out;
}

// The chain as diffusers' RMSNorm.forward runs it (bf16 weight, no bias).
at::Tensor rms_norm_diffusers_reference(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  const at::Tensor var = x.to(at::kFloat).pow(2).mean(-1, /*keepdim=*/true);
  at::Tensor y = x * at::rsqrt(var + eps);
  if (weight.has_value() && weight->defined()) return y.to(weight->scalar_type()) * *weight;
  return y.to(x.scalar_type());
}

std::vector<std::string> rms_norm_diffusers_unsupported(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                                        double eps) {
  const difuse_tensor_view vo = fresh_output_view(x), vx = to_view(x);
  const bool has_w = weight.has_value() && weight->defined();
  difuse_tensor_view vw{};
  if (has_w) vw = to_view(*weight);
  const difuse_status s = difuse_can_use_rms_norm_diffusers(&vo, &vx, has_w ? &vw : nullptr, eps);
  if (s == DIFUSE_OK) return {};
  if (s != DIFUSE_ERR_UNSUPPORTED) check_status(s, "can_use_rms_norm_diffusers");
  return reasons_from_last_error();
}

// ---- rms_norm_modulate, gated_residual_rms_norm_modulate (ERNIE-Image, LTX-2) -------------------------------------
bool has_tensor(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// Shape and dtype rules the Meta impl can check: x (or h) bf16 of rank 1-4, an optional bf16 [N] weight, and
// modulation rows broadcastable to x under torch's rules (right-aligned, the last dim equal).
void check_rms_norm_modulate_meta(const char* op, const char* xname, const at::Tensor& x,
                                  const std::optional<at::Tensor>& weight,
                                  std::initializer_list<std::pair<const char*, const at::Tensor*>> rows) {
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.dim() <= 4, "difuse::", op, ": ", xname, " must have rank 1 to 4, got ",
                    x.sizes());
  TORCH_CHECK_VALUE(x.scalar_type() == at::kBFloat16, "difuse::", op, ": ", xname, " must be bf16");
  const int64_t N = x.size(-1);
  if (has_tensor(weight))
    TORCH_CHECK_VALUE(weight->dim() == 1 && weight->size(0) == N && weight->scalar_type() == at::kBFloat16,
                      "difuse::", op, ": weight must be a bf16 [", N, "], got ", weight->sizes());
  for (const auto& [name, m] : rows) {
    TORCH_CHECK_VALUE(m->scalar_type() == at::kBFloat16, "difuse::", op, ": ", name, " must be bf16");
    bool ok = m->dim() >= 1 && m->dim() <= x.dim() && m->size(-1) == N;
    for (int64_t d = 1; ok && d < m->dim(); ++d) {
      const int64_t ms = m->size(-1 - d), xs = x.size(-1 - d);
      ok = ms == 1 || ms == xs;
    }
    TORCH_CHECK_VALUE(ok, "difuse::", op, ": ", name, " must broadcast to ", xname, "'s shape ", x.sizes(),
                      " (torch's rules, the last dim equal), got ", m->sizes());
  }
}

at::Tensor rms_norm_modulate_cuda(const at::Tensor& x, const std::optional<at::Tensor>& weight, const at::Tensor& scale,
                                  const at::Tensor& shift, double eps, bool fp32_modulate) {
  const auto guard = cuda_guard(x);
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const difuse_tensor_view vo = to_view(out), vx = to_view(x), vs = to_view(scale), vh = to_view(shift);
  difuse_tensor_view vw{};
  if (has_tensor(weight)) vw = to_view(*weight);
  check_status(difuse_rms_norm_modulate(&vo, &vx, has_tensor(weight) ? &vw : nullptr, &vs, &vh, eps,
                                        fp32_modulate ? 1 : 0, at::cuda::getCurrentCUDAStream().stream()),
               "rms_norm_modulate");
  return out;
}

at::Tensor rms_norm_modulate_meta(const at::Tensor& x, const std::optional<at::Tensor>& weight, const at::Tensor& scale,
                                  const at::Tensor& shift, double, bool) {
  check_meta_devices("rms_norm_modulate", {&x, opt_ptr(weight), &scale, &shift});
  check_rms_norm_modulate_meta("rms_norm_modulate", "x", x, weight, {{"scale", &scale}, {"shift", &shift}});
  return at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
}

// The chains as diffusers writes them: the RMSNorm class, then LTX-2's `n * (1 + scale) + shift` (bf16 ops) or
// ERNIE-Image's `(n.float() * (1 + scale.float()) + shift.float()).to(n.dtype)`.
at::Tensor rms_norm_modulate_reference(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                       const at::Tensor& scale, const at::Tensor& shift, double eps, bool fp32_modulate) {
  const at::Tensor n = rms_norm_diffusers_reference(x, weight, eps);
  if (fp32_modulate)
    return (n.to(at::kFloat) * (scale.to(at::kFloat) + 1) + shift.to(at::kFloat)).to(n.scalar_type());
  return n * (scale + 1) + shift;
}

std::vector<std::string> rms_norm_modulate_unsupported(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                                       const at::Tensor& scale, const at::Tensor& shift, double eps,
                                                       bool fp32_modulate) {
  const difuse_tensor_view vo = fresh_output_view(x), vx = to_view(x), vs = to_view(scale), vh = to_view(shift);
  difuse_tensor_view vw{};
  if (has_tensor(weight)) vw = to_view(*weight);
  const difuse_status s = difuse_can_use_rms_norm_modulate(&vo, &vx, has_tensor(weight) ? &vw : nullptr, &vs, &vh, eps,
                                                           fp32_modulate ? 1 : 0);
  if (s == DIFUSE_OK) return {};
  if (s != DIFUSE_ERR_UNSUPPORTED) check_status(s, "can_use_rms_norm_modulate");
  return reasons_from_last_error();
}

std::tuple<at::Tensor, at::Tensor> gated_residual_rms_norm_modulate_cuda(
    const at::Tensor& h, const at::Tensor& a, const at::Tensor& gate, const std::optional<at::Tensor>& weight,
    const at::Tensor& scale, const at::Tensor& shift, double eps, bool fp32_modulate) {
  const auto guard = cuda_guard(h);
  const auto opts = h.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor residual = at::empty(h.sizes(), opts), out = at::empty(h.sizes(), opts);
  const difuse_tensor_view vo = to_view(out), vr = to_view(residual), vh = to_view(h), va = to_view(a),
                           vg = to_view(gate), vs = to_view(scale), vsh = to_view(shift);
  difuse_tensor_view vw{};
  if (has_tensor(weight)) vw = to_view(*weight);
  check_status(difuse_gated_residual_rms_norm_modulate(&vo, &vr, &vh, &va, &vg, has_tensor(weight) ? &vw : nullptr,
                                                       &vs, &vsh, eps, fp32_modulate ? 1 : 0,
                                                       at::cuda::getCurrentCUDAStream().stream()),
               "gated_residual_rms_norm_modulate");
  return {residual, out};
}

std::tuple<at::Tensor, at::Tensor> gated_residual_rms_norm_modulate_meta(
    const at::Tensor& h, const at::Tensor& a, const at::Tensor& gate, const std::optional<at::Tensor>& weight,
    const at::Tensor& scale, const at::Tensor& shift, double, bool) {
  check_meta_devices("gated_residual_rms_norm_modulate", {&h, &a, &gate, opt_ptr(weight), &scale, &shift});
  check_rms_norm_modulate_meta("gated_residual_rms_norm_modulate", "h", h, weight,
                               {{"gate", &gate}, {"scale", &scale}, {"shift", &shift}});
  TORCH_CHECK_VALUE(a.scalar_type() == at::kBFloat16 && a.sizes() == h.sizes(),
                    "difuse::gated_residual_rms_norm_modulate: a must be bf16 with the shape of h ", h.sizes(),
                    ", got ", a.sizes());
  const auto opts = h.options().memory_format(at::MemoryFormat::Contiguous);
  return {at::empty(h.sizes(), opts), at::empty(h.sizes(), opts)};
}

// ERNIE-Image: h + (gate.float() * a.float()).to(h.dtype); LTX-2: h + a * gate (the same roundings).
std::tuple<at::Tensor, at::Tensor> gated_residual_rms_norm_modulate_reference(
    const at::Tensor& h, const at::Tensor& a, const at::Tensor& gate, const std::optional<at::Tensor>& weight,
    const at::Tensor& scale, const at::Tensor& shift, double eps, bool fp32_modulate) {
  const at::Tensor h1 =
      fp32_modulate ? h + (gate.to(at::kFloat) * a.to(at::kFloat)).to(h.scalar_type()) : h + a * gate;
  return {h1, rms_norm_modulate_reference(h1, weight, scale, shift, eps, fp32_modulate)};
}

std::vector<std::string> gated_residual_rms_norm_modulate_unsupported(
    const at::Tensor& h, const at::Tensor& a, const at::Tensor& gate, const std::optional<at::Tensor>& weight,
    const at::Tensor& scale, const at::Tensor& shift, double eps, bool fp32_modulate) {
  difuse_tensor_view vo = fresh_output_view(h), vr = fresh_output_view(h);
  vr.data = vr.data ? reinterpret_cast<void*>(uintptr_t{1} << 47) : nullptr;  // a second fresh buffer
  const difuse_tensor_view vh = to_view(h), va = to_view(a), vg = to_view(gate), vs = to_view(scale),
                           vsh = to_view(shift);
  difuse_tensor_view vw{};
  if (has_tensor(weight)) vw = to_view(*weight);
  const difuse_status s = difuse_can_use_gated_residual_rms_norm_modulate(
      &vo, &vr, &vh, &va, &vg, has_tensor(weight) ? &vw : nullptr, &vs, &vsh, eps, fp32_modulate ? 1 : 0);
  if (s == DIFUSE_OK) return {};
  if (s != DIFUSE_ERR_UNSUPPORTED) check_status(s, "can_use_gated_residual_rms_norm_modulate");
  return reasons_from_last_error();
}

// ---- gated_residual_layernorm_modulate -----------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor> gated_residual_layernorm_modulate_cuda(const at::Tensor& h, const at::Tensor& a,
                                                                          const at::Tensor& gate, const at::Tensor& scale,
                                                                          const at::Tensor& shift, double eps) {
  const auto guard = cuda_guard(h);
  at::Tensor residual = at::empty(h.sizes(), h.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor out = at::empty(h.sizes(), h.options().memory_format(at::MemoryFormat::Contiguous));
  const difuse_tensor_view vo = to_view(out), vr = to_view(residual), vh = to_view(h), va = to_view(a),
                           vg = to_view(gate), vs = to_view(scale), vsh = to_view(shift);
  check_status(difuse_gated_residual_layernorm_modulate(&vo, &vr, &vh, &va, &vg, &vs, &vsh, eps,
                                                        at::cuda::getCurrentCUDAStream().stream()),
               "gated_residual_layernorm_modulate");
  return {residual, out};
}

std::tuple<at::Tensor, at::Tensor> gated_residual_layernorm_modulate_meta(const at::Tensor& h, const at::Tensor& a,
                                                                          const at::Tensor& gate, const at::Tensor& scale,
                                                                          const at::Tensor& shift, double) {
  check_meta_devices("gated_residual_layernorm_modulate", {&h, &a, &gate, &scale, &shift});
  check_gated_residual_meta(h, a, gate);
  check_layernorm_modulate_meta(h, scale, shift);
  const auto opts = h.options().memory_format(at::MemoryFormat::Contiguous);
  return {at::empty(h.sizes(), opts), at::empty(h.sizes(), opts)};
}

std::tuple<at::Tensor, at::Tensor> gated_residual_layernorm_modulate_reference(
    const at::Tensor& h, const at::Tensor& a, const at::Tensor& gate, const at::Tensor& scale, const at::Tensor& shift,
    double eps) {
  const at::Tensor h1 = gated_residual_reference(h, a, gate);
  return {h1, layernorm_modulate_reference(h1, scale, shift, eps)};
}

std::vector<std::string> gated_residual_layernorm_modulate_unsupported(const at::Tensor& h, const at::Tensor& a,
                                                                       const at::Tensor& gate, const at::Tensor& scale,
                                                                       const at::Tensor& shift, double eps) {
  difuse_tensor_view vo = fresh_output_view(h), vr = fresh_output_view(h);
  vr.data = vr.data ? reinterpret_cast<void*>(uintptr_t{1} << 47) : nullptr;  // a second fresh buffer
  const difuse_tensor_view vh = to_view(h), va = to_view(a), vg = to_view(gate), vs = to_view(scale), vsh = to_view(shift);
  const difuse_status s = difuse_can_use_gated_residual_layernorm_modulate(&vo, &vr, &vh, &va, &vg, &vs, &vsh, eps);
  if (s == DIFUSE_OK) return {};
  if (s != DIFUSE_ERR_UNSUPPORTED) check_status(s, "can_use_gated_residual_layernorm_modulate");
  return reasons_from_last_error();
}

// ---- Wan's fp32 chains -------------------------------------------------------------------------------------
at::Tensor layernorm_modulate_fp32_cuda(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift, double eps) {
  const auto guard = cuda_guard(x);
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const difuse_tensor_view vo = to_view(out), vx = to_view(x), vs = to_view(scale), vh = to_view(shift);
  check_status(difuse_layernorm_modulate_fp32(&vo, &vx, &vs, &vh, eps, at::cuda::getCurrentCUDAStream().stream()),
               "layernorm_modulate_fp32");
  return out;
}

void check_fp32_rows_meta(const char* op, const at::Tensor& like, const at::Tensor& m) {
  TORCH_CHECK_VALUE(m.scalar_type() == at::kFloat, "difuse::", op, ": modulation rows must be fp32");
  const bool rows = m.dim() == 2 && m.size(0) == like.size(0) && m.size(1) == like.size(2);
  const bool bcast = m.dim() == 3 && m.size(0) == like.size(0) && (m.size(1) == 1 || m.size(1) == like.size(1)) &&
                     m.size(2) == like.size(2);
  TORCH_CHECK_VALUE(rows || bcast, "difuse::", op, ": rows must be [B, H], [B, 1, H] or [B, L, H], got ", m.sizes());
}

at::Tensor layernorm_modulate_fp32_meta(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift, double) {
  check_meta_devices("layernorm_modulate_fp32", {&x, &scale, &shift});
  TORCH_CHECK_VALUE(x.dim() == 3 && x.scalar_type() == at::kBFloat16, "difuse::layernorm_modulate_fp32: x must be bf16 [B, L, H]");
  check_fp32_rows_meta("layernorm_modulate_fp32", x, scale);
  check_fp32_rows_meta("layernorm_modulate_fp32", x, shift);
  return at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
}

at::Tensor bcast_rows(const at::Tensor& m) { return m.dim() == 2 ? m.unsqueeze(1) : m; }

at::Tensor layernorm_modulate_fp32_reference(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift,
                                             double eps) {
  const at::Tensor n = at::layer_norm(x.to(at::kFloat), {x.size(-1)}, {}, {}, eps);
  return (n * (bcast_rows(scale) + 1) + bcast_rows(shift)).to(x.scalar_type());
}

std::vector<std::string> layernorm_modulate_fp32_unsupported(const at::Tensor& x, const at::Tensor& scale,
                                                             const at::Tensor& shift, double eps) {
  const difuse_tensor_view vo = fresh_output_view(x), vx = to_view(x), vs = to_view(scale), vh = to_view(shift);
  const difuse_status s = difuse_can_use_layernorm_modulate_fp32(&vo, &vx, &vs, &vh, eps);
  if (s == DIFUSE_OK) return {};
  if (s != DIFUSE_ERR_UNSUPPORTED) check_status(s, "can_use_layernorm_modulate_fp32");
  return reasons_from_last_error();
}

at::Tensor gated_residual_fp32_cuda(const at::Tensor& h, const at::Tensor& a, const at::Tensor& gate) {
  const auto guard = cuda_guard(h);
  at::Tensor out = at::empty(h.sizes(), h.options().memory_format(at::MemoryFormat::Contiguous));
  const difuse_tensor_view vo = to_view(out), vh = to_view(h), va = to_view(a), vg = to_view(gate);
  check_status(difuse_gated_residual_fp32(&vo, &vh, &va, &vg, at::cuda::getCurrentCUDAStream().stream()),
               "gated_residual_fp32");
  return out;
}

at::Tensor gated_residual_fp32_meta(const at::Tensor& h, const at::Tensor& a, const at::Tensor& gate) {
  check_meta_devices("gated_residual_fp32", {&h, &a, &gate});
  TORCH_CHECK_VALUE(h.dim() == 3 && h.scalar_type() == at::kBFloat16 && a.sizes() == h.sizes() &&
                        a.scalar_type() == at::kBFloat16,
                    "difuse::gated_residual_fp32: h and a must be bf16 [B, L, H]");
  check_fp32_rows_meta("gated_residual_fp32", h, gate);
  return at::empty(h.sizes(), h.options().memory_format(at::MemoryFormat::Contiguous));
}

at::Tensor gated_residual_fp32_reference(const at::Tensor& h, const at::Tensor& a, const at::Tensor& gate) {
  return (h.to(at::kFloat) + a * bcast_rows(gate)).to(h.scalar_type());
}

std::vector<std::string> gated_residual_fp32_unsupported(const at::Tensor& h, const at::Tensor& a, const at::Tensor& gate) {
  const difuse_tensor_view vo = fresh_output_view(h), vh = to_view(h), va = to_view(a), vg = to_view(gate);
  const difuse_status s = difuse_can_use_gated_residual_fp32(&vo, &vh, &va, &vg);
  if (s == DIFUSE_OK) return {};
  if (s != DIFUSE_ERR_UNSUPPORTED) check_status(s, "can_use_gated_residual_fp32");
  return reasons_from_last_error();
}

at::Tensor layernorm_affine_fp32_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  const auto guard = cuda_guard(x);
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const difuse_tensor_view vo = to_view(out), vx = to_view(x), vw = to_view(weight), vb = to_view(bias);
  check_status(difuse_layernorm_affine_fp32(&vo, &vx, &vw, &vb, eps, at::cuda::getCurrentCUDAStream().stream()),
               "layernorm_affine_fp32");
  return out;
}

at::Tensor layernorm_affine_fp32_meta(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double) {
  check_meta_devices("layernorm_affine_fp32", {&x, &weight, &bias});
  TORCH_CHECK_VALUE(x.dim() == 3 && x.scalar_type() == at::kBFloat16, "difuse::layernorm_affine_fp32: x must be bf16 [B, L, H]");
  TORCH_CHECK_VALUE(weight.dim() == 1 && bias.dim() == 1 && weight.size(0) == x.size(2) && bias.size(0) == x.size(2) &&
                        weight.scalar_type() == at::kFloat && bias.scalar_type() == at::kFloat,
                    "difuse::layernorm_affine_fp32: weight and bias must be fp32 [H]");
  return at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
}

at::Tensor layernorm_affine_fp32_reference(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                           double eps) {
  return at::layer_norm(x.to(at::kFloat), {x.size(-1)}, weight, bias, eps).to(x.scalar_type());
}

std::vector<std::string> layernorm_affine_fp32_unsupported(const at::Tensor& x, const at::Tensor& weight,
                                                           const at::Tensor& bias, double eps) {
  const difuse_tensor_view vo = fresh_output_view(x), vx = to_view(x), vw = to_view(weight), vb = to_view(bias);
  const difuse_status s = difuse_can_use_layernorm_affine_fp32(&vo, &vx, &vw, &vb, eps);
  if (s == DIFUSE_OK) return {};
  if (s != DIFUSE_ERR_UNSUPPORTED) check_status(s, "can_use_layernorm_affine_fp32");
  return reasons_from_last_error();
}

// ---- gelu_tanh -----------------------------------------------------------------------------------------------
void gelu_tanh_into_cuda(const at::Tensor& x, const at::Tensor& out) {
  const auto guard = cuda_guard(x);
  const difuse_tensor_view vo = to_view(out), vx = to_view(x);
  check_status(difuse_gelu_tanh(&vo, &vx, at::cuda::getCurrentCUDAStream().stream()), "gelu_tanh");
}

at::Tensor gelu_tanh_cuda(const at::Tensor& x) {
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  gelu_tanh_into_cuda(x, out);
  return out;
}

void check_gelu_tanh_meta(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.scalar_type() == at::kBFloat16, "difuse::gelu_tanh: x must be bf16");
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.dim() <= 4, "difuse::gelu_tanh: x must have rank 1 to 4, got ", x.sizes());
}

at::Tensor gelu_tanh_meta(const at::Tensor& x) {
  check_gelu_tanh_meta(x);
  return at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
}

void gelu_tanh_into_meta(const at::Tensor& x, const at::Tensor& out) {
  check_meta_devices("gelu_tanh_into", {&x, &out});
  check_gelu_tanh_meta(x);
  TORCH_CHECK_VALUE(out.sizes() == x.sizes() && out.scalar_type() == at::kBFloat16,
                    "difuse::gelu_tanh: out must be bf16 with the sizes of x ", x.sizes(), ", got ", out.sizes());
}

at::Tensor gelu_tanh_reference(const at::Tensor& x) { return at::gelu(x, "tanh"); }

std::vector<std::string> gelu_tanh_unsupported(const at::Tensor& x) {
  const difuse_tensor_view vo = fresh_output_view(x), vx = to_view(x);
  const difuse_status s = difuse_can_use_gelu_tanh(&vo, &vx);
  if (s == DIFUSE_OK) return {};
  if (s != DIFUSE_ERR_UNSUPPORTED) check_status(s, "can_use_gelu_tanh");
  return reasons_from_last_error();
}

// ---- activation_mul (gated FFNs) ------------------------------------------------------------------------------
// out: a fresh contiguous tensor, or (activation_mul_into) the caller's, e.g. a column slice of a wider buffer.
void activation_mul_into_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& table, const at::Tensor& out) {
  const auto guard = cuda_guard(a);
  const difuse_tensor_view vo = to_view(out), va = to_view(a), vb = to_view(b), vt = to_view(table);
  check_status(difuse_activation_mul(&vo, &va, &vb, &vt, at::cuda::getCurrentCUDAStream().stream()), "activation_mul");
}

at::Tensor activation_mul_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& table) {
  at::Tensor out = at::empty(a.sizes(), a.options().memory_format(at::MemoryFormat::Contiguous));
  activation_mul_into_cuda(a, b, table, out);
  return out;
}

void check_activation_mul_meta(const at::Tensor& a, const at::Tensor& b, const at::Tensor& table) {
  TORCH_CHECK_VALUE(a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16 && a.sizes() == b.sizes(),
                    "difuse::activation_mul: a and b must be bf16 of one size, got ", a.sizes(), " and ", b.sizes());
  TORCH_CHECK_VALUE(a.dim() >= 1 && a.dim() <= 4, "difuse::activation_mul: a must have rank 1 to 4, got ", a.sizes());
  TORCH_CHECK_VALUE(table.dim() == 1 && table.size(0) == 65536 && table.scalar_type() == at::kBFloat16,
                    "difuse::activation_mul: table must be bf16 [65536]");
}

at::Tensor activation_mul_meta(const at::Tensor& a, const at::Tensor& b, const at::Tensor& table) {
  check_meta_devices("activation_mul", {&a, &b, &table});
  check_activation_mul_meta(a, b, table);
  return at::empty(a.sizes(), a.options().memory_format(at::MemoryFormat::Contiguous));
}

void activation_mul_into_meta(const at::Tensor& a, const at::Tensor& b, const at::Tensor& table, const at::Tensor& out) {
  check_meta_devices("activation_mul_into", {&a, &b, &table, &out});
  check_activation_mul_meta(a, b, table);
  TORCH_CHECK_VALUE(out.sizes() == a.sizes() && out.scalar_type() == at::kBFloat16,
                    "difuse::activation_mul: out must be bf16 with the sizes of a ", a.sizes(), ", got ", out.sizes());
}

// The lookup and the eager bf16 product (the table stands for the activation's own kernel).
at::Tensor activation_mul_reference(const at::Tensor& a, const at::Tensor& b, const at::Tensor& table) {
  const at::Tensor codes = a.contiguous().view(at::kShort).to(at::kInt).bitwise_and(0xffff).to(at::kLong);
  return table.index({codes.flatten()}).view(a.sizes()) * b;
}

std::vector<std::string> activation_mul_unsupported(const at::Tensor& a, const at::Tensor& b, const at::Tensor& table) {
  const difuse_tensor_view vo = fresh_output_view(a), va = to_view(a), vb = to_view(b), vt = to_view(table);
  const difuse_status s = difuse_can_use_activation_mul(&vo, &va, &vb, &vt);
  if (s == DIFUSE_OK) return {};
  if (s != DIFUSE_ERR_UNSUPPORTED) check_status(s, "can_use_activation_mul");
  return reasons_from_last_error();
}

// ---- rope_rotate_half (ERNIE-Image) -----------------------------------------------------------------------------
at::Tensor rope_rotate_half_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const auto guard = cuda_guard(x);
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const difuse_tensor_view vo = to_view(out), vx = to_view(x), vc = to_view(cos), vs = to_view(sin);
  check_status(difuse_rope_rotate_half(&vo, &vx, &vc, &vs, at::cuda::getCurrentCUDAStream().stream()),
               "rope_rotate_half");
  return out;
}

at::Tensor rope_rotate_half_meta(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_meta_devices("rope_rotate_half", {&x, &cos, &sin});
  TORCH_CHECK_VALUE(x.dim() == 4 && x.scalar_type() == at::kBFloat16,
                    "difuse::rope_rotate_half: x must be bf16 [B, S, heads, D], got ", x.sizes());
  TORCH_CHECK_VALUE(cos.dim() == 4 && sin.dim() == 4 && cos.sizes() == sin.sizes() &&
                        cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16,
                    "difuse::rope_rotate_half: cos and sin must be bf16 [B or 1, S, 1, R] of one size");
  return at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
}

// The eager chain (ErnieImageSingleStreamAttnProcessor's apply_rotary_emb after its .to(x.dtype) of the tables).
at::Tensor rope_rotate_half_reference(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t R = cos.size(-1), D = x.size(-1);
  const at::Tensor xr = x.narrow(-1, 0, R), pass = x.narrow(-1, R, D - R);
  const auto halves = xr.chunk(2, -1);
  const at::Tensor rotated = at::cat({at::neg(halves[1]), halves[0]}, -1);
  return at::cat({xr * cos + rotated * sin, pass}, -1);
}

// ---- rms_norm_rope_rotate_half (ERNIE-Image's QK norm + RoPE) --------------------------------------------------------
at::Tensor rms_norm_rope_rotate_half_cuda(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                          const at::Tensor& cos, const at::Tensor& sin, double eps) {
  const auto guard = cuda_guard(x);
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const difuse_tensor_view vo = to_view(out), vx = to_view(x), vc = to_view(cos), vs = to_view(sin);
  difuse_tensor_view vw{};
  const bool has_w = weight.has_value() && weight->defined();
  if (has_w) vw = to_view(*weight);
  check_status(difuse_rms_norm_rope_rotate_half(&vo, &vx, has_w ? &vw : nullptr, &vc, &vs, eps,
                                                at::cuda::getCurrentCUDAStream().stream()),
               "rms_norm_rope_rotate_half");
  return out;
}

at::Tensor rms_norm_rope_rotate_half_meta(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                          const at::Tensor& cos, const at::Tensor& sin, double) {
  check_meta_devices("rms_norm_rope_rotate_half", {&x, opt_ptr(weight), &cos, &sin});
  TORCH_CHECK_VALUE(x.dim() == 4 && x.size(3) == 128 && x.scalar_type() == at::kBFloat16,
                    "difuse::rms_norm_rope_rotate_half: x must be bf16 [B, S, heads, 128], got ", x.sizes());
  TORCH_CHECK_VALUE(!(weight.has_value() && weight->defined()) ||
                        (weight->dim() == 1 && weight->size(0) == 128 && weight->scalar_type() == at::kBFloat16),
                    "difuse::rms_norm_rope_rotate_half: weight must be bf16 [128]");
  TORCH_CHECK_VALUE(cos.dim() == 4 && sin.dim() == 4 && cos.sizes() == sin.sizes() && cos.size(3) == 128 &&
                        cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16,
                    "difuse::rms_norm_rope_rotate_half: cos and sin must be bf16 [B or 1, S, 1, 128] of one size");
  return at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
}

// The eager chain: torch.nn.RMSNorm's fused kernel, then apply_rotary_emb.
at::Tensor rms_norm_rope_rotate_half_reference(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                               const at::Tensor& cos, const at::Tensor& sin, double eps) {
  return rope_rotate_half_reference(at::rms_norm(x, {x.size(-1)}, weight, eps), cos, sin);
}

std::vector<std::string> rms_norm_rope_rotate_half_unsupported(const at::Tensor& x,
                                                               const std::optional<at::Tensor>& weight,
                                                               const at::Tensor& cos, const at::Tensor& sin,
                                                               double eps) {
  const difuse_tensor_view vo = fresh_output_view(x), vx = to_view(x), vc = to_view(cos), vs = to_view(sin);
  difuse_tensor_view vw{};
  const bool has_w = weight.has_value() && weight->defined();
  if (has_w) vw = to_view(*weight);
  const difuse_status s = difuse_can_use_rms_norm_rope_rotate_half(&vo, &vx, has_w ? &vw : nullptr, &vc, &vs, eps);
  if (s == DIFUSE_OK) return {};
  if (s != DIFUSE_ERR_UNSUPPORTED) check_status(s, "can_use_rms_norm_rope_rotate_half");
  return reasons_from_last_error();
}

std::vector<std::string> rope_rotate_half_unsupported(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const difuse_tensor_view vo = fresh_output_view(x), vx = to_view(x), vc = to_view(cos), vs = to_view(sin);
  const difuse_status s = difuse_can_use_rope_rotate_half(&vo, &vx, &vc, &vs);
  if (s == DIFUSE_OK) return {};
  if (s != DIFUSE_ERR_UNSUPPORTED) check_status(s, "can_use_rope_rotate_half");
  return reasons_from_last_error();
}

// ---- qk_norm_rope ----------------------------------------------------------------------------------------------
using OptT = std::optional<at::Tensor>;

bool given(const OptT& t) { return t.has_value() && t->defined(); }

struct QkViews {  // the C views of one call (absent tensors stay NULL)
  difuse_tensor_view vq, vk, vv, vwq, vwk, vq1, vk1, vv1, vwq1, vwk1, vc, vs, oq, ok, ov;
  difuse_qk_norm_rope_args args{};
};

void fill_qk_views(QkViews& w, const at::Tensor& q, const at::Tensor& k, const OptT& v, const OptT& wq, const OptT& wk,
                   const OptT& q1, const OptT& k1, const OptT& v1, const OptT& wq1, const OptT& wk1, const OptT& cos,
                   const OptT& sin, double eps) {
  auto& a = w.args;
  w.vq = to_view(q);
  w.vk = to_view(k);
  a.q = &w.vq;
  a.k = &w.vk;
  const auto opt = [](const OptT& t, difuse_tensor_view& slot, const difuse_tensor_view*& field) {
    if (given(t)) {
      slot = to_view(*t);
      field = &slot;
    }
  };
  opt(v, w.vv, a.v);
  opt(wq, w.vwq, a.q_weight);
  opt(wk, w.vwk, a.k_weight);
  opt(q1, w.vq1, a.q_first);
  opt(k1, w.vk1, a.k_first);
  opt(v1, w.vv1, a.v_first);
  opt(wq1, w.vwq1, a.q_first_weight);
  opt(wk1, w.vwk1, a.k_first_weight);
  opt(cos, w.vc, a.cos);
  opt(sin, w.vs, a.sin);
  a.eps = eps;
}

std::vector<int64_t> joint_sizes(const at::Tensor& q, const OptT& q1) {
  std::vector<int64_t> sz = q.sizes().vec();
  if (sz.size() == 4 && given(q1) && q1->dim() == 4) sz[1] += q1->size(1);
  return sz;
}

std::vector<at::Tensor> qk_norm_rope_cuda(const at::Tensor& q, const at::Tensor& k, const OptT& v, const OptT& wq,
                                          const OptT& wk, const OptT& q1, const OptT& k1, const OptT& v1,
                                          const OptT& wq1, const OptT& wk1, const OptT& cos, const OptT& sin,
                                          double eps) {
  const auto guard = cuda_guard(q);
  QkViews w;
  fill_qk_views(w, q, k, v, wq, wk, q1, k1, v1, wq1, wk1, cos, sin, eps);
  const auto sizes = joint_sizes(q, q1);
  const auto opts = q.options().memory_format(at::MemoryFormat::Contiguous);
  std::vector<at::Tensor> outs = {at::empty(sizes, opts), at::empty(sizes, opts)};
  if (given(v)) outs.push_back(at::empty(sizes, opts));
  w.oq = to_view(outs[0]);
  w.ok = to_view(outs[1]);
  w.args.q_out = &w.oq;
  w.args.k_out = &w.ok;
  if (given(v)) {
    w.ov = to_view(outs[2]);
    w.args.v_out = &w.ov;
  }
  check_status(difuse_qk_norm_rope(&w.args, at::cuda::getCurrentCUDAStream().stream()), "qk_norm_rope");
  return outs;
}

std::vector<at::Tensor> qk_norm_rope_meta(const at::Tensor& q, const at::Tensor& k, const OptT& v, const OptT& wq,
                                          const OptT& wk, const OptT& q1, const OptT& k1, const OptT& v1,
                                          const OptT& wq1, const OptT& wk1, const OptT& cos, const OptT& sin, double) {
  check_meta_devices("qk_norm_rope", {&q, &k, opt_ptr(v), opt_ptr(wq), opt_ptr(wk), opt_ptr(q1), opt_ptr(k1),
                                      opt_ptr(v1), opt_ptr(wq1), opt_ptr(wk1), opt_ptr(cos), opt_ptr(sin)});
  TORCH_CHECK_VALUE(q.dim() == 4 && q.scalar_type() == at::kBFloat16,
                    "difuse::qk_norm_rope: q must be bf16 [B, S, heads, head_dim], got ", q.sizes());
  TORCH_CHECK_VALUE(k.sizes() == q.sizes(), "difuse::qk_norm_rope: k must have the shape of q ", q.sizes());
  if (given(v)) TORCH_CHECK_VALUE(v->sizes() == q.sizes(), "difuse::qk_norm_rope: v must have the shape of q");
  if (given(q1)) {
    TORCH_CHECK_VALUE(q1->dim() == 4 && q1->size(0) == q.size(0) && q1->size(2) == q.size(2) && q1->size(3) == q.size(3),
                      "difuse::qk_norm_rope: q_first must be [B, S_first, heads, head_dim] like q, got ", q1->sizes());
    TORCH_CHECK_VALUE(given(k1) && k1->sizes() == q1->sizes(), "difuse::qk_norm_rope: k_first must match q_first");
    TORCH_CHECK_VALUE(given(v1) == given(v), "difuse::qk_norm_rope: v_first must be given exactly when v is");
  }
  const auto sizes = joint_sizes(q, q1);
  if (given(cos))
    TORCH_CHECK_VALUE(cos->dim() == 2 && cos->size(0) == sizes[1] && cos->size(1) == q.size(3),
                      "difuse::qk_norm_rope: cos must be [S_total, head_dim], got ", cos->sizes());
  const auto opts = q.options().memory_format(at::MemoryFormat::Contiguous);
  std::vector<at::Tensor> outs = {at::empty(sizes, opts), at::empty(sizes, opts)};
  if (given(v)) outs.push_back(at::empty(sizes, opts));
  return outs;
}

// diffusers' apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=-1, sequence_dim=1), op for op.
at::Tensor apply_rotary_emb_reference(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  std::vector<int64_t> pairs = x.sizes().vec();
  pairs.back() /= 2;
  pairs.push_back(2);
  const auto parts = x.reshape(pairs).unbind(-1);
  const at::Tensor rotated = at::stack({parts[1].neg(), parts[0]}, -1).flatten(3);
  const at::Tensor c = cos.unsqueeze(0).unsqueeze(2), s = sin.unsqueeze(0).unsqueeze(2);
  return (x.to(at::kFloat) * c + rotated.to(at::kFloat) * s).to(x.scalar_type());
}

std::vector<at::Tensor> qk_norm_rope_reference(const at::Tensor& q, const at::Tensor& k, const OptT& v, const OptT& wq,
                                               const OptT& wk, const OptT& q1, const OptT& k1, const OptT& v1,
                                               const OptT& wq1, const OptT& wk1, const OptT& cos, const OptT& sin,
                                               double eps) {
  const int64_t D = q.size(-1);
  at::Tensor oq = at::rms_norm(q, {D}, wq, eps), ok = at::rms_norm(k, {D}, wk, eps);
  std::vector<at::Tensor> outs;
  at::Tensor ov = given(v) ? *v : at::Tensor();
  if (given(q1)) {
    oq = at::cat({at::rms_norm(*q1, {D}, wq1, eps), oq}, 1);
    ok = at::cat({at::rms_norm(*k1, {D}, wk1, eps), ok}, 1);
    if (given(v)) ov = at::cat({*v1, *v}, 1);
  } else if (given(v)) {
    ov = v->contiguous().clone();
  }
  if (given(cos)) {
    oq = apply_rotary_emb_reference(oq, *cos, *sin);
    ok = apply_rotary_emb_reference(ok, *cos, *sin);
  }
  outs = {oq, ok};
  if (given(v)) outs.push_back(ov);
  return outs;
}

std::vector<std::string> qk_norm_rope_unsupported(const at::Tensor& q, const at::Tensor& k, const OptT& v,
                                                  const OptT& wq, const OptT& wk, const OptT& q1, const OptT& k1,
                                                  const OptT& v1, const OptT& wq1, const OptT& wk1, const OptT& cos,
                                                  const OptT& sin, double eps) {
  QkViews w;
  fill_qk_views(w, q, k, v, wq, wk, q1, k1, v1, wq1, wk1, cos, sin, eps);
  at::Tensor like = at::empty(joint_sizes(q, q1), q.options().device(at::kMeta));
  w.oq = fresh_output_view(like);
  w.oq.device = q.is_cuda() ? q.get_device() : w.oq.device;
  w.ok = w.oq;
  w.ok.data = w.ok.data ? reinterpret_cast<void*>(uintptr_t{1} << 47) : nullptr;
  w.ov = w.oq;
  w.ov.data = w.ov.data ? reinterpret_cast<void*>(uintptr_t{1} << 46) : nullptr;
  w.args.q_out = &w.oq;
  w.args.k_out = &w.ok;
  if (given(v)) w.args.v_out = &w.ov;
  const difuse_status s = difuse_can_use_qk_norm_rope(&w.args);
  if (s == DIFUSE_OK) return {};
  if (s != DIFUSE_ERR_UNSUPPORTED) check_status(s, "can_use_qk_norm_rope");
  return reasons_from_last_error();
}

// ---- qk_norm_rope_wan ------------------------------------------------------------------------------------------
struct QkWanViews {  // the C views of one call (absent weights stay NULL)
  difuse_tensor_view vq, vk, vwq, vwk, vc, vs, oq, ok;
  difuse_qk_norm_rope_wan_args args{};
};

void fill_qk_wan_views(QkWanViews& w, const at::Tensor& q, const at::Tensor& k, const OptT& wq, const OptT& wk,
                       const at::Tensor& cos, const at::Tensor& sin, int64_t heads, double eps) {
  auto& a = w.args;
  w.vq = to_view(q);
  w.vk = to_view(k);
  w.vc = to_view(cos);
  w.vs = to_view(sin);
  a.q = &w.vq;
  a.k = &w.vk;
  a.freqs_cos = &w.vc;
  a.freqs_sin = &w.vs;
  if (given(wq)) {
    w.vwq = to_view(*wq);
    a.q_weight = &w.vwq;
  }
  if (given(wk)) {
    w.vwk = to_view(*wk);
    a.k_weight = &w.vwk;
  }
  a.heads = heads;
  a.eps = eps;
}

// [B, S, heads, head_dim] for q [B, S, heads * head_dim]; a placeholder shape where q or heads is invalid (the
// predicate then reports why).
std::vector<int64_t> wan_head_sizes(const at::Tensor& q, int64_t heads) {
  if (q.dim() != 3) return {1, 1, 1, 1};
  const int64_t N = q.size(2), H = heads > 0 ? heads : 1;
  return {q.size(0), q.size(1), H, N % H == 0 ? N / H : 1};
}

void check_qk_wan_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                       int64_t heads) {
  TORCH_CHECK_VALUE(q.dim() == 3 && q.scalar_type() == at::kBFloat16,
                    "difuse::qk_norm_rope_wan: q must be bf16 [B, S, heads * head_dim], got ", q.sizes());
  TORCH_CHECK_VALUE(k.sizes() == q.sizes() && k.scalar_type() == at::kBFloat16,
                    "difuse::qk_norm_rope_wan: k must be bf16 with the shape of q ", q.sizes(), ", got ", k.sizes());
  TORCH_CHECK_VALUE(heads > 0 && q.size(2) % heads == 0, "difuse::qk_norm_rope_wan: heads (", heads,
                    ") must divide the width of q ", q.size(2));
  const int64_t D = q.size(2) / heads;
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK_VALUE(t->dim() == 4 && (t->size(0) == 1 || t->size(0) == q.size(0)) && t->size(1) == q.size(1) &&
                          t->size(2) == 1 && t->size(3) == D,
                      "difuse::qk_norm_rope_wan: freqs_cos and freqs_sin must be [1, S, 1, head_dim] = [1, ", q.size(1),
                      ", 1, ", D, "], got ", t->sizes());
}

std::tuple<at::Tensor, at::Tensor> qk_norm_rope_wan_cuda(const at::Tensor& q, const at::Tensor& k, const OptT& wq,
                                                         const OptT& wk, const at::Tensor& cos, const at::Tensor& sin,
                                                         int64_t heads, double eps) {
  check_qk_wan_meta(q, k, cos, sin, heads);
  const auto guard = cuda_guard(q);
  QkWanViews w;
  fill_qk_wan_views(w, q, k, wq, wk, cos, sin, heads, eps);
  const auto opts = q.options().memory_format(at::MemoryFormat::Contiguous);
  const auto sizes = wan_head_sizes(q, heads);
  at::Tensor oq = at::empty(sizes, opts), ok = at::empty(sizes, opts);
  w.oq = to_view(oq);
  w.ok = to_view(ok);
  w.args.q_out = &w.oq;
  w.args.k_out = &w.ok;
  check_status(difuse_qk_norm_rope_wan(&w.args, at::cuda::getCurrentCUDAStream().stream()), "qk_norm_rope_wan");
  return {oq, ok};
}

std::tuple<at::Tensor, at::Tensor> qk_norm_rope_wan_meta(const at::Tensor& q, const at::Tensor& k, const OptT& wq,
                                                         const OptT& wk, const at::Tensor& cos, const at::Tensor& sin,
                                                         int64_t heads, double) {
  check_meta_devices("qk_norm_rope_wan", {&q, &k, opt_ptr(wq), opt_ptr(wk), &cos, &sin});
  check_qk_wan_meta(q, k, cos, sin, heads);
  const auto opts = q.options().memory_format(at::MemoryFormat::Contiguous);
  const auto sizes = wan_head_sizes(q, heads);
  return {at::empty(sizes, opts), at::empty(sizes, opts)};
}

// WanAttnProcessor's apply_rotary_emb, op for op: x1 * cos - x2 * sin and x1 * sin + x2 * cos in fp32 (bf16 x fp32
// tensors), each written into the even / odd half of an empty_like(x), then type_as(x).
at::Tensor wan_rotary_emb_reference(const at::Tensor& x, const at::Tensor& freqs_cos, const at::Tensor& freqs_sin) {
  const auto parts = x.unflatten(-1, {-1, 2}).unbind(-1);
  const at::Tensor c = freqs_cos.slice(-1, 0, std::nullopt, 2), s = freqs_sin.slice(-1, 1, std::nullopt, 2);
  at::Tensor out = at::empty_like(x);
  out.slice(-1, 0, std::nullopt, 2).copy_(parts[0] * c - parts[1] * s);
  out.slice(-1, 1, std::nullopt, 2).copy_(parts[0] * s + parts[1] * c);
  return out.to(x.scalar_type());
}

// The processor's prologue: norm_q / norm_k (F.rms_norm over the full width), unflatten(2, (heads, -1)), RoPE.
std::tuple<at::Tensor, at::Tensor> qk_norm_rope_wan_reference(const at::Tensor& q, const at::Tensor& k, const OptT& wq,
                                                              const OptT& wk, const at::Tensor& cos,
                                                              const at::Tensor& sin, int64_t heads, double eps) {
  const int64_t N = q.size(-1);
  const at::Tensor nq = at::rms_norm(q, {N}, wq, eps).unflatten(2, {heads, -1});
  const at::Tensor nk = at::rms_norm(k, {N}, wk, eps).unflatten(2, {heads, -1});
  return {wan_rotary_emb_reference(nq, cos, sin), wan_rotary_emb_reference(nk, cos, sin)};
}

std::vector<std::string> qk_norm_rope_wan_unsupported(const at::Tensor& q, const at::Tensor& k, const OptT& wq,
                                                      const OptT& wk, const at::Tensor& cos, const at::Tensor& sin,
                                                      int64_t heads, double eps) {
  QkWanViews w;
  fill_qk_wan_views(w, q, k, wq, wk, cos, sin, heads, eps);
  at::Tensor like = at::empty(wan_head_sizes(q, heads), q.options().device(at::kMeta));
  w.oq = fresh_output_view(like);
  w.oq.device = q.is_cuda() ? q.get_device() : w.oq.device;
  w.ok = w.oq;
  w.ok.data = w.ok.data ? reinterpret_cast<void*>(uintptr_t{1} << 47) : nullptr;
  w.args.q_out = &w.oq;
  w.args.k_out = &w.ok;
  const difuse_status s = difuse_can_use_qk_norm_rope_wan(&w.args);
  if (s == DIFUSE_OK) return {};
  if (s != DIFUSE_ERR_UNSUPPORTED) check_status(s, "can_use_qk_norm_rope_wan");
  return reasons_from_last_error();
}

// ---- qk_norm_rope_qwen, qk_norm_sd35 (per-head diffusers RMSNorm prologues) ------------------------------------------
using Tensor3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// The C views of one call of either op (absent weights and tables stay NULL), plus what only the torch layer can
// say (a RoPE table that is not complex64).
struct HeadNormViews {
  difuse_tensor_view vq, vk, vv, vwq, vwk, vq2, vk2, vv2, vwq2, vwk2, vf, vf2, oq, ok, ov;
  std::vector<std::string> torch_reasons;
};

void opt_view(const OptT& t, difuse_tensor_view& slot, const difuse_tensor_view*& field) {
  if (given(t)) {
    slot = to_view(*t);
    field = &slot;
  }
}

// A complex64 table [S, D/2] as the fp32 (re, im) pairs [S, D] the C ABI takes (metadata only: view_as_real, the
// last two dims collapsed when the pairs are contiguous; any other pair stride stays for the predicate to refuse).
void qwen_freqs_view(HeadNormViews& w, const OptT& f, const char* name, difuse_tensor_view& slot,
                     const difuse_tensor_view*& field) {
  if (!given(f)) return;
  if (f->scalar_type() != at::kComplexFloat || f->dim() != 2) {
    w.torch_reasons.push_back(std::string(name) + " must be a complex64 [S, head_dim / 2] table (as QwenEmbedRope "
                              "returns it), got " + std::string(c10::toString(f->scalar_type())) + " " +
                              c10::str(f->sizes()));
    slot = to_view(*f);
    if (slot.dtype == DIFUSE_F32) slot.dtype = -1;  // never taken for pairs: the eager chain needs complex64
  } else {
    slot = to_view(at::view_as_real(*f));  // [S, D/2, 2], strides (2 rs, 2 cs, 1)
    slot.rank = 2;
    slot.sizes[1] *= 2;
    slot.strides[1] = slot.strides[1] == 2 ? 1 : slot.strides[1];
    slot.sizes[2] = slot.strides[2] = 0;
  }
  field = &slot;
}

// ---- qk_norm_rope_qwen
void check_qwen_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q1,
                     const at::Tensor& k1, const at::Tensor& v1, const OptT& f, const OptT& f1) {
  TORCH_CHECK_VALUE(q.dim() == 4 && q.scalar_type() == at::kBFloat16,
                    "difuse::qk_norm_rope_qwen: q must be bf16 [B, S_img, heads, head_dim], got ", q.sizes());
  TORCH_CHECK_VALUE(k.sizes() == q.sizes() && v.sizes() == q.sizes(),
                    "difuse::qk_norm_rope_qwen: k and v must have the shape of q ", q.sizes());
  TORCH_CHECK_VALUE(q1.dim() == 4 && q1.size(0) == q.size(0) && q1.size(2) == q.size(2) && q1.size(3) == q.size(3),
                    "difuse::qk_norm_rope_qwen: q_txt must be [B, S_txt, heads, head_dim] like q, got ", q1.sizes());
  TORCH_CHECK_VALUE(k1.sizes() == q1.sizes() && v1.sizes() == q1.sizes(),
                    "difuse::qk_norm_rope_qwen: k_txt and v_txt must have the shape of q_txt ", q1.sizes());
  TORCH_CHECK_VALUE(given(f) == given(f1), "difuse::qk_norm_rope_qwen: freqs and freqs_txt must be given together");
  if (given(f)) {
    TORCH_CHECK_VALUE(f->dim() == 2 && f->size(0) == q.size(1) && 2 * f->size(1) == q.size(3) &&
                          f->scalar_type() == at::kComplexFloat,
                      "difuse::qk_norm_rope_qwen: freqs must be complex64 [S_img, head_dim / 2], got ", f->sizes());
    TORCH_CHECK_VALUE(f1->dim() == 2 && f1->size(0) == q1.size(1) && 2 * f1->size(1) == q.size(3) &&
                          f1->scalar_type() == at::kComplexFloat,
                      "difuse::qk_norm_rope_qwen: freqs_txt must be complex64 [S_txt, head_dim / 2], got ", f1->sizes());
  }
}

std::vector<int64_t> qwen_joint_sizes(const at::Tensor& q, const at::Tensor& q1) {
  if (q.dim() != 4 || q1.dim() != 4) return {1, 1, 1, 1};
  return {q.size(0), q1.size(1) + q.size(1), q.size(2), q.size(3)};
}

void fill_qwen_views(HeadNormViews& w, difuse_qk_norm_rope_qwen_args& a, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const OptT& wq, const OptT& wk, const at::Tensor& q1, const at::Tensor& k1,
                     const at::Tensor& v1, const OptT& wq1, const OptT& wk1, const OptT& f, const OptT& f1,
                     double eps) {
  w.vq = to_view(q), w.vk = to_view(k), w.vv = to_view(v);
  w.vq2 = to_view(q1), w.vk2 = to_view(k1), w.vv2 = to_view(v1);
  a.q = &w.vq, a.k = &w.vk, a.v = &w.vv, a.q_txt = &w.vq2, a.k_txt = &w.vk2, a.v_txt = &w.vv2;
  opt_view(wq, w.vwq, a.q_weight);
  opt_view(wk, w.vwk, a.k_weight);
  opt_view(wq1, w.vwq2, a.q_txt_weight);
  opt_view(wk1, w.vwk2, a.k_txt_weight);
  qwen_freqs_view(w, f, "freqs", w.vf, a.freqs);
  qwen_freqs_view(w, f1, "freqs_txt", w.vf2, a.freqs_txt);
  a.eps = eps;
}

Tensor3 qk_norm_rope_qwen_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptT& wq,
                               const OptT& wk, const at::Tensor& q1, const at::Tensor& k1, const at::Tensor& v1,
                               const OptT& wq1, const OptT& wk1, const OptT& f, const OptT& f1, double eps) {
  check_qwen_meta(q, k, v, q1, k1, v1, f, f1);
  const auto guard = cuda_guard(q);
  HeadNormViews w;
  difuse_qk_norm_rope_qwen_args args{};
  fill_qwen_views(w, args, q, k, v, wq, wk, q1, k1, v1, wq1, wk1, f, f1, eps);
  const auto sizes = qwen_joint_sizes(q, q1);
  const auto opts = q.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor oq = at::empty(sizes, opts), ok = at::empty(sizes, opts), ov = at::empty(sizes, opts);
  w.oq = to_view(oq), w.ok = to_view(ok), w.ov = to_view(ov);
  args.q_out = &w.oq, args.k_out = &w.ok, args.v_out = &w.ov;
  check_status(difuse_qk_norm_rope_qwen(&args, at::cuda::getCurrentCUDAStream().stream()), "qk_norm_rope_qwen");
  return {oq, ok, ov};
}

Tensor3 qk_norm_rope_qwen_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptT& wq,
                               const OptT& wk, const at::Tensor& q1, const at::Tensor& k1, const at::Tensor& v1,
                               const OptT& wq1, const OptT& wk1, const OptT& f, const OptT& f1, double) {
  check_meta_devices("qk_norm_rope_qwen", {&q, &k, &v, opt_ptr(wq), opt_ptr(wk), &q1, &k1, &v1, opt_ptr(wq1),
                                           opt_ptr(wk1), opt_ptr(f), opt_ptr(f1)});
  check_qwen_meta(q, k, v, q1, k1, v1, f, f1);
  const auto sizes = qwen_joint_sizes(q, q1);
  const auto opts = q.options().memory_format(at::MemoryFormat::Contiguous);
  return {at::empty(sizes, opts), at::empty(sizes, opts), at::empty(sizes, opts)};
}

// diffusers' apply_rotary_emb_qwen(x, freqs, use_real=False), op for op.
at::Tensor qwen_rotary_emb_reference(const at::Tensor& x, const at::Tensor& freqs) {
  std::vector<int64_t> pairs = x.sizes().vec();
  pairs.back() /= 2;
  pairs.push_back(2);
  const at::Tensor xc = at::view_as_complex(x.to(at::kFloat).reshape(pairs));
  return at::view_as_real(xc * freqs.unsqueeze(1)).flatten(3).to(x.scalar_type());
}

// QwenDoubleStreamAttnProcessor2_0 up to dispatch_attention_fn: the four norms, RoPE per stream, cat([text, image]).
Tensor3 qk_norm_rope_qwen_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptT& wq,
                                    const OptT& wk, const at::Tensor& q1, const at::Tensor& k1, const at::Tensor& v1,
                                    const OptT& wq1, const OptT& wk1, const OptT& f, const OptT& f1, double eps) {
  at::Tensor iq = rms_norm_diffusers_reference(q, wq, eps), ik = rms_norm_diffusers_reference(k, wk, eps);
  at::Tensor tq = rms_norm_diffusers_reference(q1, wq1, eps), tk = rms_norm_diffusers_reference(k1, wk1, eps);
  if (given(f)) {
    iq = qwen_rotary_emb_reference(iq, *f);
    ik = qwen_rotary_emb_reference(ik, *f);
    tq = qwen_rotary_emb_reference(tq, *f1);
    tk = qwen_rotary_emb_reference(tk, *f1);
  }
  return {at::cat({tq, iq}, 1), at::cat({tk, ik}, 1), at::cat({v1, v}, 1)};
}

// The output views an op call would get: contiguous, `sizes`, on q's device, at three addresses that overlap nothing.
void fresh_outputs(HeadNormViews& w, const at::Tensor& q, const std::vector<int64_t>& sizes) {
  at::Tensor like = at::empty(sizes, q.options().device(at::kMeta));
  w.oq = fresh_output_view(like);
  w.oq.device = q.is_cuda() ? q.get_device() : w.oq.device;
  w.ok = w.oq;
  w.ok.data = w.ok.data ? reinterpret_cast<void*>(uintptr_t{1} << 47) : nullptr;
  w.ov = w.oq;
  w.ov.data = w.ov.data ? reinterpret_cast<void*>(uintptr_t{1} << 46) : nullptr;
}

std::vector<std::string> qk_norm_rope_qwen_unsupported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const OptT& wq, const OptT& wk, const at::Tensor& q1,
                                                       const at::Tensor& k1, const at::Tensor& v1, const OptT& wq1,
                                                       const OptT& wk1, const OptT& f, const OptT& f1, double eps) {
  HeadNormViews w;
  difuse_qk_norm_rope_qwen_args args{};
  fill_qwen_views(w, args, q, k, v, wq, wk, q1, k1, v1, wq1, wk1, f, f1, eps);
  fresh_outputs(w, q, qwen_joint_sizes(q, q1));
  args.q_out = &w.oq, args.k_out = &w.ok, args.v_out = &w.ov;
  std::vector<std::string> reasons = w.torch_reasons;
  const difuse_status s = difuse_can_use_qk_norm_rope_qwen(&args);
  if (s == DIFUSE_OK) return reasons;
  if (s != DIFUSE_ERR_UNSUPPORTED) check_status(s, "can_use_qk_norm_rope_qwen");
  for (auto& r : reasons_from_last_error()) reasons.push_back(std::move(r));
  return reasons;
}

// ---- qk_norm_sd35
void check_sd35_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q1,
                     const at::Tensor& k1, const at::Tensor& v1) {
  TORCH_CHECK_VALUE(q.dim() == 4 && q.scalar_type() == at::kBFloat16,
                    "difuse::qk_norm_sd35: q must be bf16 [B, heads, S_img, head_dim], got ", q.sizes());
  TORCH_CHECK_VALUE(k.sizes() == q.sizes() && v.sizes() == q.sizes(),
                    "difuse::qk_norm_sd35: k and v must have the shape of q ", q.sizes());
  TORCH_CHECK_VALUE(q1.dim() == 4 && q1.size(0) == q.size(0) && q1.size(1) == q.size(1) && q1.size(3) == q.size(3),
                    "difuse::qk_norm_sd35: q_ctx must be [B, heads, S_ctx, head_dim] like q, got ", q1.sizes());
  TORCH_CHECK_VALUE(k1.sizes() == q1.sizes() && v1.sizes() == q1.sizes(),
                    "difuse::qk_norm_sd35: k_ctx and v_ctx must have the shape of q_ctx ", q1.sizes());
}

std::vector<int64_t> sd35_joint_sizes(const at::Tensor& q, const at::Tensor& q1) {
  if (q.dim() != 4 || q1.dim() != 4) return {1, 1, 1, 1};
  return {q.size(0), q.size(1), q.size(2) + q1.size(2), q.size(3)};
}

void fill_sd35_views(HeadNormViews& w, difuse_qk_norm_sd35_args& a, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const OptT& wq, const OptT& wk, const at::Tensor& q1, const at::Tensor& k1,
                     const at::Tensor& v1, const OptT& wq1, const OptT& wk1, double eps) {
  w.vq = to_view(q), w.vk = to_view(k), w.vv = to_view(v);
  w.vq2 = to_view(q1), w.vk2 = to_view(k1), w.vv2 = to_view(v1);
  a.q = &w.vq, a.k = &w.vk, a.v = &w.vv, a.q_ctx = &w.vq2, a.k_ctx = &w.vk2, a.v_ctx = &w.vv2;
  opt_view(wq, w.vwq, a.q_weight);
  opt_view(wk, w.vwk, a.k_weight);
  opt_view(wq1, w.vwq2, a.q_ctx_weight);
  opt_view(wk1, w.vwk2, a.k_ctx_weight);
  a.eps = eps;
}

Tensor3 qk_norm_sd35_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptT& wq, const OptT& wk,
                          const at::Tensor& q1, const at::Tensor& k1, const at::Tensor& v1, const OptT& wq1,
                          const OptT& wk1, double eps) {
  check_sd35_meta(q, k, v, q1, k1, v1);
  const auto guard = cuda_guard(q);
  HeadNormViews w;
  difuse_qk_norm_sd35_args args{};
  fill_sd35_views(w, args, q, k, v, wq, wk, q1, k1, v1, wq1, wk1, eps);
  const auto sizes = sd35_joint_sizes(q, q1);
  const auto opts = q.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor oq = at::empty(sizes, opts), ok = at::empty(sizes, opts), ov = at::empty(sizes, opts);
  w.oq = to_view(oq), w.ok = to_view(ok), w.ov = to_view(ov);
  args.q_out = &w.oq, args.k_out = &w.ok, args.v_out = &w.ov;
  check_status(difuse_qk_norm_sd35(&args, at::cuda::getCurrentCUDAStream().stream()), "qk_norm_sd35");
  return {oq, ok, ov};
}

Tensor3 qk_norm_sd35_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptT& wq,
                          const OptT& wk, const at::Tensor& q1, const at::Tensor& k1, const at::Tensor& v1,
                          const OptT& wq1, const OptT& wk1, double) {
  check_meta_devices("qk_norm_sd35", {&q, &k, &v, opt_ptr(wq), opt_ptr(wk), &q1, &k1, &v1, opt_ptr(wq1), opt_ptr(wk1)});
  check_sd35_meta(q, k, v, q1, k1, v1);
  const auto sizes = sd35_joint_sizes(q, q1);
  const auto opts = q.options().memory_format(at::MemoryFormat::Contiguous);
  return {at::empty(sizes, opts), at::empty(sizes, opts), at::empty(sizes, opts)};
}

// JointAttnProcessor2_0 up to F.scaled_dot_product_attention: the four norms on the BHSD views, cat([image, ctx], 2).
Tensor3 qk_norm_sd35_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptT& wq,
                               const OptT& wk, const at::Tensor& q1, const at::Tensor& k1, const at::Tensor& v1,
                               const OptT& wq1, const OptT& wk1, double eps) {
  return {at::cat({rms_norm_diffusers_reference(q, wq, eps), rms_norm_diffusers_reference(q1, wq1, eps)}, 2),
          at::cat({rms_norm_diffusers_reference(k, wk, eps), rms_norm_diffusers_reference(k1, wk1, eps)}, 2),
          at::cat({v, v1}, 2)};
}

std::vector<std::string> qk_norm_sd35_unsupported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const OptT& wq, const OptT& wk, const at::Tensor& q1,
                                                  const at::Tensor& k1, const at::Tensor& v1, const OptT& wq1,
                                                  const OptT& wk1, double eps) {
  HeadNormViews w;
  difuse_qk_norm_sd35_args args{};
  fill_sd35_views(w, args, q, k, v, wq, wk, q1, k1, v1, wq1, wk1, eps);
  fresh_outputs(w, q, sd35_joint_sizes(q, q1));
  args.q_out = &w.oq, args.k_out = &w.ok, args.v_out = &w.ov;
  const difuse_status s = difuse_can_use_qk_norm_sd35(&args);
  if (s == DIFUSE_OK) return {};
  if (s != DIFUSE_ERR_UNSUPPORTED) check_status(s, "can_use_qk_norm_sd35");
  return reasons_from_last_error();
}

}  // namespace

TORCH_LIBRARY(difuse, m) {
  m.def("layernorm_modulate(Tensor x, Tensor scale, Tensor shift, float eps=1e-06) -> Tensor");
  m.def("layernorm_modulate_reference(Tensor x, Tensor scale, Tensor shift, float eps=1e-06) -> Tensor");
  m.def("layernorm_modulate_unsupported(Tensor x, Tensor scale, Tensor shift, float eps=1e-06) -> str[]");
  m.def("gated_residual(Tensor h, Tensor a, Tensor gate) -> Tensor");
  // Mutating ops return nothing: functionalization (torch.compile) refuses custom ops whose outputs alias inputs.
  m.def("gated_residual_(Tensor(a!) h, Tensor a, Tensor gate) -> ()");
  m.def("gated_residual_reference(Tensor h, Tensor a, Tensor gate) -> Tensor");
  m.def("gated_residual_unsupported(Tensor h, Tensor a, Tensor gate) -> str[]");
  m.def("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor");
  m.def("rms_norm_reference(Tensor x, Tensor? weight, float eps) -> Tensor");
  m.def("rms_norm_unsupported(Tensor x, Tensor? weight, float eps) -> str[]");
  m.def("rms_norm_diffusers(Tensor x, Tensor? weight, float eps) -> Tensor");
  m.def("rms_norm_diffusers_reference(Tensor x, Tensor? weight, float eps) -> Tensor");
  m.def("rms_norm_diffusers_unsupported(Tensor x, Tensor? weight, float eps) -> str[]");
  m.def("rms_norm_modulate(Tensor x, Tensor? weight, Tensor scale, Tensor shift, float eps=1e-06, "
        "bool fp32_modulate=False) -> Tensor");
  m.def("rms_norm_modulate_reference(Tensor x, Tensor? weight, Tensor scale, Tensor shift, float eps=1e-06, "
        "bool fp32_modulate=False) -> Tensor");
  m.def("rms_norm_modulate_unsupported(Tensor x, Tensor? weight, Tensor scale, Tensor shift, float eps=1e-06, "
        "bool fp32_modulate=False) -> str[]");
  m.def("gated_residual_rms_norm_modulate(Tensor h, Tensor a, Tensor gate, Tensor? weight, Tensor scale, "
        "Tensor shift, float eps=1e-06, bool fp32_modulate=False) -> (Tensor, Tensor)");
  m.def("gated_residual_rms_norm_modulate_reference(Tensor h, Tensor a, Tensor gate, Tensor? weight, Tensor scale, "
        "Tensor shift, float eps=1e-06, bool fp32_modulate=False) -> (Tensor, Tensor)");
  m.def("gated_residual_rms_norm_modulate_unsupported(Tensor h, Tensor a, Tensor gate, Tensor? weight, "
        "Tensor scale, Tensor shift, float eps=1e-06, bool fp32_modulate=False) -> str[]");
  m.def("gated_residual_layernorm_modulate(Tensor h, Tensor a, Tensor gate, Tensor scale, Tensor shift, "
        "float eps=1e-06) -> (Tensor, Tensor)");
  m.def("gated_residual_layernorm_modulate_reference(Tensor h, Tensor a, Tensor gate, Tensor scale, Tensor shift, "
        "float eps=1e-06) -> (Tensor, Tensor)");
  m.def("gated_residual_layernorm_modulate_unsupported(Tensor h, Tensor a, Tensor gate, Tensor scale, Tensor shift, "
        "float eps=1e-06) -> str[]");
  m.def("layernorm_modulate_fp32(Tensor x, Tensor scale, Tensor shift, float eps=1e-06) -> Tensor");
  m.def("layernorm_modulate_fp32_reference(Tensor x, Tensor scale, Tensor shift, float eps=1e-06) -> Tensor");
  m.def("layernorm_modulate_fp32_unsupported(Tensor x, Tensor scale, Tensor shift, float eps=1e-06) -> str[]");
  m.def("gated_residual_fp32(Tensor h, Tensor a, Tensor gate) -> Tensor");
  m.def("gated_residual_fp32_reference(Tensor h, Tensor a, Tensor gate) -> Tensor");
  m.def("gated_residual_fp32_unsupported(Tensor h, Tensor a, Tensor gate) -> str[]");
  m.def("layernorm_affine_fp32(Tensor x, Tensor weight, Tensor bias, float eps=1e-06) -> Tensor");
  m.def("layernorm_affine_fp32_reference(Tensor x, Tensor weight, Tensor bias, float eps=1e-06) -> Tensor");
  m.def("layernorm_affine_fp32_unsupported(Tensor x, Tensor weight, Tensor bias, float eps=1e-06) -> str[]");
  m.def("gelu_tanh(Tensor x) -> Tensor");
  m.def("gelu_tanh_into(Tensor x, Tensor(a!) out) -> ()");
  m.def("gelu_tanh_reference(Tensor x) -> Tensor");
  m.def("gelu_tanh_unsupported(Tensor x) -> str[]");
  m.def("activation_mul(Tensor a, Tensor b, Tensor table) -> Tensor");
  m.def("activation_mul_into(Tensor a, Tensor b, Tensor table, Tensor(a!) out) -> ()");
  m.def("activation_mul_reference(Tensor a, Tensor b, Tensor table) -> Tensor");
  m.def("activation_mul_unsupported(Tensor a, Tensor b, Tensor table) -> str[]");
  m.def("rope_rotate_half(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("rope_rotate_half_reference(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("rope_rotate_half_unsupported(Tensor x, Tensor cos, Tensor sin) -> str[]");
  m.def("rms_norm_rope_rotate_half(Tensor x, Tensor? weight, Tensor cos, Tensor sin, float eps) -> Tensor");
  m.def("rms_norm_rope_rotate_half_reference(Tensor x, Tensor? weight, Tensor cos, Tensor sin, float eps) -> Tensor");
  m.def("rms_norm_rope_rotate_half_unsupported(Tensor x, Tensor? weight, Tensor cos, Tensor sin, float eps) -> str[]");
  m.def("qk_norm_rope(Tensor q, Tensor k, Tensor? v, Tensor? q_weight, Tensor? k_weight, Tensor? q_first, Tensor? k_first, "
        "Tensor? v_first, Tensor? q_first_weight, Tensor? k_first_weight, Tensor? cos, Tensor? sin, float eps=1e-06) -> Tensor[]");
  m.def("qk_norm_rope_reference(Tensor q, Tensor k, Tensor? v, Tensor? q_weight, Tensor? k_weight, Tensor? q_first, Tensor? k_first, "
        "Tensor? v_first, Tensor? q_first_weight, Tensor? k_first_weight, Tensor? cos, Tensor? sin, float eps=1e-06) -> Tensor[]");
  m.def("qk_norm_rope_unsupported(Tensor q, Tensor k, Tensor? v, Tensor? q_weight, Tensor? k_weight, Tensor? q_first, Tensor? k_first, "
        "Tensor? v_first, Tensor? q_first_weight, Tensor? k_first_weight, Tensor? cos, Tensor? sin, float eps=1e-06) -> str[]");
  m.def("qk_norm_rope_wan(Tensor q, Tensor k, Tensor? q_weight, Tensor? k_weight, Tensor freqs_cos, Tensor freqs_sin, "
        "int heads, float eps=1e-06) -> (Tensor, Tensor)");
  m.def("qk_norm_rope_wan_reference(Tensor q, Tensor k, Tensor? q_weight, Tensor? k_weight, Tensor freqs_cos, "
        "Tensor freqs_sin, int heads, float eps=1e-06) -> (Tensor, Tensor)");
  m.def("qk_norm_rope_wan_unsupported(Tensor q, Tensor k, Tensor? q_weight, Tensor? k_weight, Tensor freqs_cos, "
        "Tensor freqs_sin, int heads, float eps=1e-06) -> str[]");
  m.def("qk_norm_rope_qwen(Tensor q, Tensor k, Tensor v, Tensor? q_weight, Tensor? k_weight, Tensor q_txt, Tensor k_txt, "
        "Tensor v_txt, Tensor? q_txt_weight, Tensor? k_txt_weight, Tensor? freqs, Tensor? freqs_txt, float eps=1e-06) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("qk_norm_rope_qwen_reference(Tensor q, Tensor k, Tensor v, Tensor? q_weight, Tensor? k_weight, Tensor q_txt, "
        "Tensor k_txt, Tensor v_txt, Tensor? q_txt_weight, Tensor? k_txt_weight, Tensor? freqs, Tensor? freqs_txt, "
        "float eps=1e-06) -> (Tensor, Tensor, Tensor)");
  m.def("qk_norm_rope_qwen_unsupported(Tensor q, Tensor k, Tensor v, Tensor? q_weight, Tensor? k_weight, Tensor q_txt, "
        "Tensor k_txt, Tensor v_txt, Tensor? q_txt_weight, Tensor? k_txt_weight, Tensor? freqs, Tensor? freqs_txt, "
        "float eps=1e-06) -> str[]");
  m.def("qk_norm_sd35(Tensor q, Tensor k, Tensor v, Tensor? q_weight, Tensor? k_weight, Tensor q_ctx, Tensor k_ctx, "
        "Tensor v_ctx, Tensor? q_ctx_weight, Tensor? k_ctx_weight, float eps=1e-06) -> (Tensor, Tensor, Tensor)");
  m.def("qk_norm_sd35_reference(Tensor q, Tensor k, Tensor v, Tensor? q_weight, Tensor? k_weight, Tensor q_ctx, "
        "Tensor k_ctx, Tensor v_ctx, Tensor? q_ctx_weight, Tensor? k_ctx_weight, float eps=1e-06) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("qk_norm_sd35_unsupported(Tensor q, Tensor k, Tensor v, Tensor? q_weight, Tensor? k_weight, Tensor q_ctx, "
        "Tensor k_ctx, Tensor v_ctx, Tensor? q_ctx_weight, Tensor? k_ctx_weight, float eps=1e-06) -> str[]");
}

TORCH_LIBRARY_IMPL(difuse, CUDA, m) {
  m.impl("layernorm_modulate", &layernorm_modulate_cuda);
  m.impl("gated_residual", &gated_residual_cuda);
  m.impl("gated_residual_", &gated_residual_inplace_cuda);
  m.impl("rms_norm", &rms_norm_cuda);
  m.impl("rms_norm_diffusers", &rms_norm_diffusers_cuda);
  m.impl("rms_norm_modulate", &rms_norm_modulate_cuda);
  m.impl("gated_residual_rms_norm_modulate", &gated_residual_rms_norm_modulate_cuda);
  m.impl("gated_residual_layernorm_modulate", &gated_residual_layernorm_modulate_cuda);
  m.impl("layernorm_modulate_fp32", &layernorm_modulate_fp32_cuda);
  m.impl("gated_residual_fp32", &gated_residual_fp32_cuda);
  m.impl("layernorm_affine_fp32", &layernorm_affine_fp32_cuda);
  m.impl("gelu_tanh", &gelu_tanh_cuda);
  m.impl("gelu_tanh_into", &gelu_tanh_into_cuda);
  m.impl("rope_rotate_half", &rope_rotate_half_cuda);
  m.impl("rms_norm_rope_rotate_half", &rms_norm_rope_rotate_half_cuda);
  m.impl("activation_mul", &activation_mul_cuda);
  m.impl("activation_mul_into", &activation_mul_into_cuda);
  m.impl("qk_norm_rope", &qk_norm_rope_cuda);
  m.impl("qk_norm_rope_qwen", &qk_norm_rope_qwen_cuda);
  m.impl("qk_norm_sd35", &qk_norm_sd35_cuda);
  m.impl("qk_norm_rope_wan", &qk_norm_rope_wan_cuda);
}
TORCH_LIBRARY_IMPL(difuse, Meta, m) {
  m.impl("layernorm_modulate", &layernorm_modulate_meta);
  m.impl("gated_residual", &gated_residual_meta);
  m.impl("gated_residual_", &gated_residual_inplace_meta);
  m.impl("rms_norm", &rms_norm_meta);
  m.impl("rms_norm_diffusers", &rms_norm_meta);  // same shape rules as rms_norm
  m.impl("rms_norm_modulate", &rms_norm_modulate_meta);
  m.impl("gated_residual_rms_norm_modulate", &gated_residual_rms_norm_modulate_meta);
  m.impl("gated_residual_layernorm_modulate", &gated_residual_layernorm_modulate_meta);
  m.impl("layernorm_modulate_fp32", &layernorm_modulate_fp32_meta);
  m.impl("gated_residual_fp32", &gated_residual_fp32_meta);
  m.impl("layernorm_affine_fp32", &layernorm_affine_fp32_meta);
  m.impl("gelu_tanh", &gelu_tanh_meta);
  m.impl("gelu_tanh_into", &gelu_tanh_into_meta);
  m.impl("rope_rotate_half", &rope_rotate_half_meta);
  m.impl("rms_norm_rope_rotate_half", &rms_norm_rope_rotate_half_meta);
  m.impl("activation_mul", &activation_mul_meta);
  m.impl("activation_mul_into", &activation_mul_into_meta);
  m.impl("qk_norm_rope", &qk_norm_rope_meta);
  m.impl("qk_norm_rope_qwen", &qk_norm_rope_qwen_meta);
  m.impl("qk_norm_sd35", &qk_norm_sd35_meta);
  m.impl("qk_norm_rope_wan", &qk_norm_rope_wan_meta);
}
TORCH_LIBRARY_IMPL(difuse, CompositeImplicitAutograd, m) {
  m.impl("layernorm_modulate_reference", &layernorm_modulate_reference);
  m.impl("gated_residual_reference", &gated_residual_reference);
  m.impl("rms_norm_reference", &rms_norm_reference);
  m.impl("rms_norm_diffusers_reference", &rms_norm_diffusers_reference);
  m.impl("rms_norm_modulate_reference", &rms_norm_modulate_reference);
  m.impl("gated_residual_rms_norm_modulate_reference", &gated_residual_rms_norm_modulate_reference);
  m.impl("gated_residual_layernorm_modulate_reference", &gated_residual_layernorm_modulate_reference);
  m.impl("layernorm_modulate_fp32_reference", &layernorm_modulate_fp32_reference);
  m.impl("gated_residual_fp32_reference", &gated_residual_fp32_reference);
  m.impl("layernorm_affine_fp32_reference", &layernorm_affine_fp32_reference);
  m.impl("gelu_tanh_reference", &gelu_tanh_reference);
  m.impl("rope_rotate_half_reference", &rope_rotate_half_reference);
  m.impl("rms_norm_rope_rotate_half_reference", &rms_norm_rope_rotate_half_reference);
  m.impl("activation_mul_reference", &activation_mul_reference);
  m.impl("qk_norm_rope_reference", &qk_norm_rope_reference);
  m.impl("qk_norm_rope_qwen_reference", &qk_norm_rope_qwen_reference);
  m.impl("qk_norm_sd35_reference", &qk_norm_sd35_reference);
  m.impl("qk_norm_rope_wan_reference", &qk_norm_rope_wan_reference);
}
TORCH_LIBRARY_IMPL(difuse, CompositeExplicitAutograd, m) {
  m.impl("layernorm_modulate_unsupported", &layernorm_modulate_unsupported);
  m.impl("gated_residual_unsupported", &gated_residual_unsupported);
  m.impl("rms_norm_unsupported", &rms_norm_unsupported);
  m.impl("rms_norm_diffusers_unsupported", &rms_norm_diffusers_unsupported);
  m.impl("rms_norm_modulate_unsupported", &rms_norm_modulate_unsupported);
  m.impl("gated_residual_rms_norm_modulate_unsupported", &gated_residual_rms_norm_modulate_unsupported);
  m.impl("gated_residual_layernorm_modulate_unsupported", &gated_residual_layernorm_modulate_unsupported);
  m.impl("layernorm_modulate_fp32_unsupported", &layernorm_modulate_fp32_unsupported);
  m.impl("gated_residual_fp32_unsupported", &gated_residual_fp32_unsupported);
  m.impl("layernorm_affine_fp32_unsupported", &layernorm_affine_fp32_unsupported);
  m.impl("gelu_tanh_unsupported", &gelu_tanh_unsupported);
  m.impl("rope_rotate_half_unsupported", &rope_rotate_half_unsupported);
  m.impl("rms_norm_rope_rotate_half_unsupported", &rms_norm_rope_rotate_half_unsupported);
  m.impl("activation_mul_unsupported", &activation_mul_unsupported);
  m.impl("qk_norm_rope_unsupported", &qk_norm_rope_unsupported);
  m.impl("qk_norm_rope_qwen_unsupported", &qk_norm_rope_qwen_unsupported);
  m.impl("qk_norm_sd35_unsupported", &qk_norm_sd35_unsupported);
  m.impl("qk_norm_rope_wan_unsupported", &qk_norm_rope_wan_unsupported);
}
