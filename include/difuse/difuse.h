/* difuse.h — the C ABI of libdifuse: fused, bit-exact kernels for diffusion transformers.
 *
 * Every function returns a difuse_status. On anything but DIFUSE_OK, difuse_last_error() returns the
 * reason as text (per thread, valid until the next difuse call on that thread). An unsupported input
 * yields DIFUSE_ERR_UNSUPPORTED and a message listing EVERY violated precondition, one per line
 * ("  - ..."), never just the first. Nothing is written to an output on failure.
 *
 * Tensors are passed as difuse_tensor_view: a data pointer, a dtype, a rank, sizes and strides counted
 * in elements, and a device (-1 = host memory, >= 0 = CUDA device ordinal). No ownership is taken.
 * Launchers enqueue on the given CUDA stream (NULL = the legacy default stream) and never synchronize.
 */
#ifndef DIFUSE_DIFUSE_H_
#define DIFUSE_DIFUSE_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define DIFUSE_API __declspec(dllexport)
#else
#define DIFUSE_API __attribute__((visibility("default")))
#endif

#define DIFUSE_VERSION_MAJOR 0
#define DIFUSE_VERSION_MINOR 1
#define DIFUSE_VERSION_PATCH 0
#define DIFUSE_MAX_RANK 8

typedef enum difuse_status {
  DIFUSE_OK = 0,
  DIFUSE_ERR_UNSUPPORTED = 1,      /* input outside the op's contract: the predicate's reasons */
  DIFUSE_ERR_INVALID_ARGUMENT = 2, /* malformed call: NULL view, rank > DIFUSE_MAX_RANK, a negative size, more
                                      than 2^63 elements, data off its element alignment, a launch given a view
                                      with elements and a NULL data pointer, bad handle */
  DIFUSE_ERR_CUDA = 3,             /* a CUDA runtime call failed: the message names the call */
  DIFUSE_ERR_INTERNAL = 4,
  DIFUSE_ERR_NOT_FOUND = 5         /* registry lookup found nothing */
} difuse_status;

typedef enum difuse_dtype {
  DIFUSE_BF16 = 0,
  DIFUSE_F16 = 1,
  DIFUSE_F32 = 2,
  DIFUSE_F8E4M3 = 3,
  DIFUSE_I32 = 4,
  DIFUSE_I64 = 5
} difuse_dtype;

typedef struct difuse_tensor_view {
  void* data;
  int32_t dtype; /* difuse_dtype */
  int32_t rank;  /* 0..DIFUSE_MAX_RANK */
  int64_t sizes[DIFUSE_MAX_RANK];
  int64_t strides[DIFUSE_MAX_RANK]; /* in elements */
  int32_t device;                   /* -1: host; >= 0: CUDA device ordinal */
} difuse_tensor_view;

DIFUSE_API const char* difuse_last_error(void);
DIFUSE_API const char* difuse_version(void);
DIFUSE_API const char* difuse_status_name(difuse_status s);
DIFUSE_API const char* difuse_dtype_name(int32_t dtype);

/* ---- registry (metadata only: no CUDA context, no allocation) ---------------------------------- */
typedef struct difuse_kernel_info {
  const char* op;          /* "layernorm_modulate" */
  const char* backend;     /* "cuda" */
  const char* contract;    /* "bit_exact" | "approximate" | "model_native" */
  const char* reference;   /* the eager chain it reproduces */
  const char* platform;    /* where the contract was verified */
  int32_t min_sm;          /* capability range, e.g. 90..90 */
  int32_t max_sm;
  const char* description; /* one line */
} difuse_kernel_info;

DIFUSE_API int32_t difuse_registry_count(void);
DIFUSE_API difuse_status difuse_registry_get(int32_t index, difuse_kernel_info* out);
/* backend may be NULL (any); the first registered match wins. */
DIFUSE_API difuse_status difuse_registry_select(const char* op, const char* backend, difuse_kernel_info* out);

/* ---- BitExactGate ------------------------------------------------------------------------------- */
typedef struct difuse_gate difuse_gate;
typedef enum difuse_gate_mode { DIFUSE_GATE_ONCE = 0, DIFUSE_GATE_PER_SIGNATURE = 1 } difuse_gate_mode;
typedef enum difuse_gate_decision {
  DIFUSE_GATE_RUN_FUSED = 0, /* verified: run the fused op */
  DIFUSE_GATE_VERIFY = 1,    /* unverified: call difuse_gate_begin_verify */
  DIFUSE_GATE_FALLBACK = 2   /* disabled, or unverified while capturing/tracing: run the reference */
} difuse_gate_decision;
typedef enum difuse_gate_fallback_reason {
  DIFUSE_FALLBACK_DISABLED = 0,
  DIFUSE_FALLBACK_CAPTURING = 1,   /* first sight during CUDA-graph capture or compile tracing */
  DIFUSE_FALLBACK_UNSUPPORTED = 2, /* the predicate refused (counted by the caller) */
  DIFUSE_FALLBACK_MISMATCH = 3,    /* the verification that disabled the gate */
  DIFUSE_FALLBACK_HOST_ERROR = 4,  /* the fused op raised on the host */
  DIFUSE_FALLBACK_REASON_COUNT = 5
} difuse_gate_fallback_reason;

typedef struct difuse_gate_counters {
  int64_t verified_signatures;
  int64_t verifications; /* comparisons run */
  int64_t fused_calls;
  int64_t fallbacks;
  int64_t fallback_reasons[DIFUSE_FALLBACK_REASON_COUNT];
  int32_t disabled;
} difuse_gate_counters;

/* op: the op name used in log lines. Gates are independent objects; state is kept per device. */
DIFUSE_API difuse_status difuse_gate_create(const char* op, int32_t mode, difuse_gate** out);
DIFUSE_API void difuse_gate_destroy(difuse_gate* gate);
/* Lock-free. capturing: the caller's knowledge (compile tracing); the gate additionally asks its
 * capture probe about `stream` (cudaStreamIsCapturing unless a probe was injected). */
DIFUSE_API difuse_status difuse_gate_decide(difuse_gate* gate, int32_t device, const char* signature,
                                            int32_t capturing, void* stream, int32_t* decision);
/* Takes the gate's lock. *proceed = 1: compare now, then call difuse_gate_end_verify (same thread).
 * *proceed = 0: another thread settled it meanwhile (lock already released); decide again. */
DIFUSE_API difuse_status difuse_gate_begin_verify(difuse_gate* gate, int32_t device, const char* signature,
                                                  int32_t* proceed);
/* Releases the lock. mismatches == 0 marks the signature verified; > 0 disables the gate on this device
 * for good and logs one line (op, signature, differing elements, detail, platform); < 0 means a host
 * error (detail says which) and disables likewise. */
DIFUSE_API difuse_status difuse_gate_end_verify(difuse_gate* gate, int32_t device, const char* signature,
                                                int64_t mismatches, const char* detail);
DIFUSE_API difuse_status difuse_gate_note_fallback(difuse_gate* gate, int32_t device, int32_t reason);
DIFUSE_API difuse_status difuse_gate_note_fused(difuse_gate* gate, int32_t device);
DIFUSE_API difuse_status difuse_gate_disable(difuse_gate* gate, int32_t device, const char* reason);
DIFUSE_API difuse_status difuse_gate_reset(difuse_gate* gate);
DIFUSE_API difuse_status difuse_gate_counters_get(difuse_gate* gate, int32_t device, difuse_gate_counters* out);
DIFUSE_API difuse_status difuse_gate_is_verified(difuse_gate* gate, int32_t device, const char* signature,
                                                 int32_t* verified);
/* The platform text appended to disable log lines: the caller's part (e.g. "torch 2.11.0+cu130"), to
 * which the gate adds CUDA runtime/driver versions and the GPU name. */
DIFUSE_API difuse_status difuse_set_platform_note(const char* note);
/* Where gate log lines go: NULL restores stderr. The callback receives one line without newline. */
typedef void (*difuse_log_fn)(const char* line, void* user);
DIFUSE_API difuse_status difuse_set_log_sink(difuse_log_fn fn, void* user);

/* ---- probes (benchmarks only; not ops) ------------------------------------------------------------ */

/* The streaming ceiling `bench ops` measures each op against: dst[0, nbytes) = src[0, nbytes) with copy-kernel
 * variant `variant` in [0, difuse_probe_stream_copy_variants()) on `stream` (the current device). Pointers 16-byte
 * aligned, nbytes a positive multiple of 16, no overlap; every violation is reported (DIFUSE_ERR_INVALID_ARGUMENT).
 * difuse_probe_stream_copy_variant_name: e.g. "u4_t256_onepass_default", NULL outside the range. */
DIFUSE_API int32_t difuse_probe_stream_copy_variants(void);
DIFUSE_API const char* difuse_probe_stream_copy_variant_name(int32_t variant);
DIFUSE_API difuse_status difuse_probe_stream_copy(void* dst, const void* src, int64_t nbytes, int32_t variant,
                                                  void* stream);

/* An H200 proxy on a GPU with fewer bytes in flight to cover (src/probe/sm_partition.h; `bench ops --sms N`): a
 * stream of `device` whose kernels run on at least `sms` of its SMs (a CUDA green context that lives until the
 * process exits). *stream_out: the stream (a cudaStream_t); *sms_out: the SMs the driver gave it. Needs a CUDA 12.5
 * driver (DIFUSE_ERR_UNSUPPORTED otherwise); NULL outputs, a device outside 0..63 or sms outside [1, the device's
 * SMs] are DIFUSE_ERR_INVALID_ARGUMENT. */
DIFUSE_API difuse_status difuse_probe_sm_partition_stream(int32_t device, int32_t sms, void** stream_out,
                                                          int32_t* sms_out);
/* From now on the launchers of `device` size their grids for `sms` SMs (the partition's count); 0 restores the
 * device's own. A negative count or one above the device's SMs is DIFUSE_ERR_INVALID_ARGUMENT. */
DIFUSE_API difuse_status difuse_probe_set_launch_sm_count(int32_t device, int32_t sms);
/* *out: the bytes DRAM can move per SM per SM cycle on `device` at its peak clocks (memory clock x 2 x bus width / 8
 * over the SM clock, per SM of the count its launchers size grids for: the partition's where set). gelu_tanh's
 * table kernel, rms_norm's streamed rows and the plain LayerNorms' streamed rows wider than 4096 are defaults at 15.5
 * and above (the H200 18.42), not below (a whole H100 SXM, 12.83); bench ops prints and records it. 0 where the
 * runtime reports no clock or bus width (all three then keep their H200 defaults).
 * NULL out or a device outside 0..63 is DIFUSE_ERR_INVALID_ARGUMENT. */
DIFUSE_API difuse_status difuse_device_dram_bytes_per_sm_cycle(int32_t device, double* out);

/* ---- ops ---------------------------------------------------------------------------------------- */

/* out = bf16 chain of F.layer_norm(x, (H,), eps=eps) * (1 + scale[:, None]) + shift[:, None]
 * x, out: [B, L, H] bf16 contiguous; scale, shift: [B, H] bf16, last dim contiguous, any row stride.
 * eps is used as (float)eps, as aten does. */
DIFUSE_API difuse_status difuse_can_use_layernorm_modulate(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                                           const difuse_tensor_view* scale,
                                                           const difuse_tensor_view* shift, double eps);
DIFUSE_API difuse_status difuse_layernorm_modulate(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                                   const difuse_tensor_view* scale, const difuse_tensor_view* shift,
                                                   double eps, void* stream);

/* out = bf16 chain of h + gate[:, None] * a (gate [B, H]) or h + gate * a (gate [B, L, H]).
 * h, a, out: [B, L, H] bf16 contiguous; gate: last dim contiguous, any non-negative strides.
 * out may be h itself (in place). */
DIFUSE_API difuse_status difuse_can_use_gated_residual(const difuse_tensor_view* out, const difuse_tensor_view* h,
                                                       const difuse_tensor_view* a, const difuse_tensor_view* gate);
DIFUSE_API difuse_status difuse_gated_residual(const difuse_tensor_view* out, const difuse_tensor_view* h,
                                               const difuse_tensor_view* a, const difuse_tensor_view* gate,
                                               void* stream);

/* out = F.rms_norm(x, (N,), weight, eps) in bf16 (torch.nn.RMSNorm). x: rank 1-4, last dim contiguous, any
 * non-negative leading strides; weight: NULL or a contiguous bf16 [N]; out: contiguous, shape of x. */
DIFUSE_API difuse_status difuse_can_use_rms_norm(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                                 const difuse_tensor_view* weight, double eps);
DIFUSE_API difuse_status difuse_rms_norm(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                         const difuse_tensor_view* weight, double eps, void* stream);

/* out = F.gelu(x, approximate="tanh") in bf16. x, out: same sizes, rank 1-4, last dim contiguous, leading dims
 * collapsing into one row stride each (out may be a column slice of a larger buffer, or x itself). */
DIFUSE_API difuse_status difuse_can_use_gelu_tanh(const difuse_tensor_view* out, const difuse_tensor_view* x);
DIFUSE_API difuse_status difuse_gelu_tanh(const difuse_tensor_view* out, const difuse_tensor_view* x, void* stream);

/* out = act(a) * b in bf16 (a gated FFN: ERNIE-Image up * F.gelu(gate), FLUX.2 silu(x1) * x2), with act given as
 * table[p] = act(p) for every bf16 bit pattern p (bf16 [65536], built by the eager activation itself). a, b: the
 * same sizes, rank 1-4, last dim contiguous, leading dims collapsing into one row stride each; out: contiguous or
 * rows at one row stride >= their width (a column slice of a wider buffer), a or b itself or overlapping no input. */
DIFUSE_API difuse_status difuse_can_use_activation_mul(const difuse_tensor_view* out, const difuse_tensor_view* a,
                                                       const difuse_tensor_view* b, const difuse_tensor_view* table);
DIFUSE_API difuse_status difuse_activation_mul(const difuse_tensor_view* out, const difuse_tensor_view* a,
                                               const difuse_tensor_view* b, const difuse_tensor_view* table,
                                               void* stream);

/* out = ERNIE-Image's rotate-half RoPE (diffusers 0.42.1 ErnieImageSingleStreamAttnProcessor's apply_rotary_emb):
 * cat(x * cos + cat(-x2, x1) * sin, x[..., R:]) in bf16 with a rounding after each op. x: bf16 [B, S, heads, D],
 * last dim contiguous; cos, sin: bf16 [B or 1, S, 1, R] (torch.cos(freqs).to(bf16)), same strides, R even <= D;
 * out: contiguous bf16 [B, S, heads, D], x itself or not overlapping any input. */
DIFUSE_API difuse_status difuse_can_use_rope_rotate_half(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                                         const difuse_tensor_view* cos, const difuse_tensor_view* sin);
DIFUSE_API difuse_status difuse_rope_rotate_half(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                                 const difuse_tensor_view* cos, const difuse_tensor_view* sin,
                                                 void* stream);

/* out = rope_rotate_half(F.rms_norm(x, (128,), weight, eps), cos, sin): ERNIE-Image's per-head QK norm and RoPE in
 * one pass. x: bf16 [B, S, heads, 128] with 8-byte aligned rows; weight NULL or bf16 [128]; cos, sin: bf16
 * [B or 1, S, 1, 128], same strides; out: contiguous bf16 of x's shape overlapping no input. */
DIFUSE_API difuse_status difuse_can_use_rms_norm_rope_rotate_half(const difuse_tensor_view* out,
                                                                  const difuse_tensor_view* x,
                                                                  const difuse_tensor_view* weight,
                                                                  const difuse_tensor_view* cos,
                                                                  const difuse_tensor_view* sin, double eps);
DIFUSE_API difuse_status difuse_rms_norm_rope_rotate_half(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                                          const difuse_tensor_view* weight,
                                                          const difuse_tensor_view* cos, const difuse_tensor_view* sin,
                                                          double eps, void* stream);

/* out = the diffusers RMSNorm chain: bf16(bf16(x * rsqrt(mean(f32(x)^2, -1) + eps)) * weight), weight NULL
 * or a contiguous bf16 [N]. Only the configurations whose mean reduction is replayed are accepted. */
DIFUSE_API difuse_status difuse_can_use_rms_norm_diffusers(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                                           const difuse_tensor_view* weight, double eps);
DIFUSE_API difuse_status difuse_rms_norm_diffusers(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                                   const difuse_tensor_view* weight, double eps, void* stream);

/* RMSNorm-based adaLN (diffusers ERNIE-Image, LTX-2): n = the diffusers RMSNorm chain of rms_norm_diffusers
 * (weight NULL or a contiguous bf16 [N]), then
 *   fp32_modulate = 0 (LTX-2):       out = n * (1 + scale) + shift, a bf16 rounding after every op;
 *   fp32_modulate = 1 (ERNIE-Image): out = (n.float() * (1 + scale.float()) + shift.float()).to(bf16).
 * x, out: contiguous bf16, rank 1-4; scale, shift: bf16 views broadcastable to x under torch's rules (right-
 * aligned: [B, H] against [S, B, H], [B, 1, H] or [B, L, H] against [B, L, H]) with a contiguous last dim. Only
 * the configurations whose mean reduction is replayed are accepted (rows >= 16, 32 <= N <= 8160). */
DIFUSE_API difuse_status difuse_can_use_rms_norm_modulate(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                                          const difuse_tensor_view* weight,
                                                          const difuse_tensor_view* scale,
                                                          const difuse_tensor_view* shift, double eps,
                                                          int32_t fp32_modulate);
DIFUSE_API difuse_status difuse_rms_norm_modulate(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                                  const difuse_tensor_view* weight, const difuse_tensor_view* scale,
                                                  const difuse_tensor_view* shift, double eps, int32_t fp32_modulate,
                                                  void* stream);

/* The same after a gated residual: residual = h + gate * a (gate broadcast like scale; both eager roundings),
 * out = rms_norm_modulate(residual). residual may be h itself (in place). */
DIFUSE_API difuse_status difuse_can_use_gated_residual_rms_norm_modulate(
    const difuse_tensor_view* out, const difuse_tensor_view* residual, const difuse_tensor_view* h,
    const difuse_tensor_view* a, const difuse_tensor_view* gate, const difuse_tensor_view* weight,
    const difuse_tensor_view* scale, const difuse_tensor_view* shift, double eps, int32_t fp32_modulate);
DIFUSE_API difuse_status difuse_gated_residual_rms_norm_modulate(
    const difuse_tensor_view* out, const difuse_tensor_view* residual, const difuse_tensor_view* h,
    const difuse_tensor_view* a, const difuse_tensor_view* gate, const difuse_tensor_view* weight,
    const difuse_tensor_view* scale, const difuse_tensor_view* shift, double eps, int32_t fp32_modulate,
    void* stream);

/* The pre-FF site in one pass: residual = h + gate[:, None] * a (gate [B, H] or [B, L, H]), then
 * out = F.layer_norm(residual) * (1 + scale[:, None]) + shift[:, None], every eager rounding kept.
 * residual may be h itself (in place). */
DIFUSE_API difuse_status difuse_can_use_gated_residual_layernorm_modulate(
    const difuse_tensor_view* out, const difuse_tensor_view* residual, const difuse_tensor_view* h,
    const difuse_tensor_view* a, const difuse_tensor_view* gate, const difuse_tensor_view* scale,
    const difuse_tensor_view* shift, double eps);
DIFUSE_API difuse_status difuse_gated_residual_layernorm_modulate(
    const difuse_tensor_view* out, const difuse_tensor_view* residual, const difuse_tensor_view* h,
    const difuse_tensor_view* a, const difuse_tensor_view* gate, const difuse_tensor_view* scale,
    const difuse_tensor_view* shift, double eps, void* stream);

/* Wan's fp32 chains (one bf16 rounding at the end, fp32 modulation rows [B, H], [B, 1, H] or [B, L, H]):
 *   layernorm_modulate_fp32: out = (F.layer_norm(x.float(), (H,), eps) * (1 + scale) + shift).type_as(x)
 *   gated_residual_fp32:     out = (h.float() + a * gate).type_as(h)                                       */
DIFUSE_API difuse_status difuse_can_use_layernorm_modulate_fp32(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                                                const difuse_tensor_view* scale,
                                                                const difuse_tensor_view* shift, double eps);
DIFUSE_API difuse_status difuse_layernorm_modulate_fp32(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                                        const difuse_tensor_view* scale, const difuse_tensor_view* shift,
                                                        double eps, void* stream);
DIFUSE_API difuse_status difuse_can_use_gated_residual_fp32(const difuse_tensor_view* out, const difuse_tensor_view* h,
                                                            const difuse_tensor_view* a, const difuse_tensor_view* gate);
DIFUSE_API difuse_status difuse_gated_residual_fp32(const difuse_tensor_view* out, const difuse_tensor_view* h,
                                                    const difuse_tensor_view* a, const difuse_tensor_view* gate,
                                                    void* stream);

/* Wan's norm2: out = F.layer_norm(x.float(), (H,), weight, bias, eps).type_as(x), weight and bias fp32 [H]. */
DIFUSE_API difuse_status difuse_can_use_layernorm_affine_fp32(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                                              const difuse_tensor_view* weight,
                                                              const difuse_tensor_view* bias, double eps);
DIFUSE_API difuse_status difuse_layernorm_affine_fp32(const difuse_tensor_view* out, const difuse_tensor_view* x,
                                                      const difuse_tensor_view* weight, const difuse_tensor_view* bias,
                                                      double eps, void* stream);

/* FLUX.1's attention prologue: per-head torch.nn.RMSNorm of q and k (weights per stream and role), the joint
 * concat [first, second] along the sequence and apply_rotary_emb (real, interleaved pairs, fp32 tables), all
 * exactly as eager. Inputs are [B, S, heads, head_dim] bf16 views (strided chunks of a fused projection are
 * fine); a pointer may be NULL (absent): the first (text) stream (single blocks have none), v / v_first / v_out
 * (v is then not touched), any norm weight, cos and sin together (no RoPE). Outputs are contiguous
 * [B, S_first + S_second, heads, head_dim]. */
typedef struct difuse_qk_norm_rope_args {
  const difuse_tensor_view* q_out;
  const difuse_tensor_view* k_out;
  const difuse_tensor_view* v_out;
  const difuse_tensor_view* q;  /* second (image) stream */
  const difuse_tensor_view* k;
  const difuse_tensor_view* v;
  const difuse_tensor_view* q_weight;
  const difuse_tensor_view* k_weight;
  const difuse_tensor_view* q_first;  /* first (text) stream */
  const difuse_tensor_view* k_first;
  const difuse_tensor_view* v_first;
  const difuse_tensor_view* q_first_weight;
  const difuse_tensor_view* k_first_weight;
  const difuse_tensor_view* cos; /* fp32 [S_first + S_second, head_dim] */
  const difuse_tensor_view* sin;
  double eps;
} difuse_qk_norm_rope_args;
DIFUSE_API difuse_status difuse_can_use_qk_norm_rope(const difuse_qk_norm_rope_args* args);
DIFUSE_API difuse_status difuse_qk_norm_rope(const difuse_qk_norm_rope_args* args, void* stream);

/* Wan 2.x's self-attention prologue (diffusers WanAttnProcessor): q = norm_q(q), k = norm_k(k) with
 * torch.nn.RMSNorm across all heads (one bf16 rounding), unflatten(2, (heads, -1)), then Wan's apply_rotary_emb
 * (pairs (2i, 2i+1); freqs_cos[..., 0::2], freqs_sin[..., 1::2]; fp32 mul, mul, sub / add; one bf16 rounding),
 * all exactly as eager. q, k are [B, S, heads * head_dim] bf16 row views (the to_q / to_k outputs, or strided
 * chunks of a fused to_qkv output); a weight may be NULL (no affine). Outputs are contiguous
 * [B, S, heads, head_dim]. v is not an operand (the processor only unflattens it). */
typedef struct difuse_qk_norm_rope_wan_args {
  const difuse_tensor_view* q_out;
  const difuse_tensor_view* k_out;
  const difuse_tensor_view* q;
  const difuse_tensor_view* k;
  const difuse_tensor_view* q_weight;  /* norm_q.weight, bf16 [heads * head_dim], or NULL */
  const difuse_tensor_view* k_weight;
  const difuse_tensor_view* freqs_cos; /* fp32 [1, S, 1, head_dim], as WanRotaryPosEmbed returns it */
  const difuse_tensor_view* freqs_sin;
  int64_t heads;
  double eps;
} difuse_qk_norm_rope_wan_args;
DIFUSE_API difuse_status difuse_can_use_qk_norm_rope_wan(const difuse_qk_norm_rope_wan_args* args);
DIFUSE_API difuse_status difuse_qk_norm_rope_wan(const difuse_qk_norm_rope_wan_args* args, void* stream);

/* Qwen-Image's attention prologue (diffusers QwenDoubleStreamAttnProcessor2_0), exactly as eager: the diffusers
 * RMSNorm class (two bf16 roundings) per head on q and k of each stream with its own weight (norm_q, norm_k on the
 * image stream; norm_added_q, norm_added_k on the text stream), apply_rotary_emb_qwen per stream (complex64 freqs;
 * PyTorch's contracted complex multiply), then cat([text, image], 1) of q, k and v. Inputs are [B, S, heads,
 * head_dim] bf16 views (the unflattened projections, or strided chunks of a fused one); a weight may be NULL (no
 * affine); freqs and freqs_txt both NULL (no RoPE) or the complex64 tables [S, head_dim / 2] viewed as fp32
 * (re, im) pairs [S, head_dim] (contiguous pairs, any even row stride). Outputs are contiguous
 * [B, S_txt + S_img, heads, head_dim]. Only the shapes whose mean reduction is replayed are accepted
 * (32 <= head_dim <= 128; each stream's B * S * heads is at least 16). */
typedef struct difuse_qk_norm_rope_qwen_args {
  const difuse_tensor_view* q_out;
  const difuse_tensor_view* k_out;
  const difuse_tensor_view* v_out;
  const difuse_tensor_view* q; /* image stream */
  const difuse_tensor_view* k;
  const difuse_tensor_view* v;
  const difuse_tensor_view* q_weight; /* norm_q.weight, bf16 [head_dim], or NULL */
  const difuse_tensor_view* k_weight;
  const difuse_tensor_view* q_txt; /* text stream */
  const difuse_tensor_view* k_txt;
  const difuse_tensor_view* v_txt;
  const difuse_tensor_view* q_txt_weight; /* norm_added_q.weight */
  const difuse_tensor_view* k_txt_weight;
  const difuse_tensor_view* freqs;     /* img_freqs as fp32 pairs [S_img, head_dim], or NULL */
  const difuse_tensor_view* freqs_txt; /* txt_freqs as fp32 pairs [S_txt, head_dim], or NULL */
  double eps;
} difuse_qk_norm_rope_qwen_args;
DIFUSE_API difuse_status difuse_can_use_qk_norm_rope_qwen(const difuse_qk_norm_rope_qwen_args* args);
DIFUSE_API difuse_status difuse_qk_norm_rope_qwen(const difuse_qk_norm_rope_qwen_args* args, void* stream);

/* SD3.5's joint-attention QK path (diffusers JointAttnProcessor2_0), exactly as eager: the diffusers RMSNorm class
 * per head (norm_q, norm_k on the image stream; norm_added_q, norm_added_k on the context stream) on the
 * transposed [B, heads, S, head_dim] views, then cat([image, context], 2) of q, k and v: the contiguous
 * [B, heads, S_img + S_ctx, head_dim] tensors the processor hands to F.scaled_dot_product_attention. No RoPE.
 * A weight may be NULL. Only the shapes whose mean reduction is replayed are accepted (32 <= head_dim <= 128;
 * each stream's B * heads * S is at least 16). */
typedef struct difuse_qk_norm_sd35_args {
  const difuse_tensor_view* q_out;
  const difuse_tensor_view* k_out;
  const difuse_tensor_view* v_out;
  const difuse_tensor_view* q; /* image stream, [B, heads, S_img, head_dim] views */
  const difuse_tensor_view* k;
  const difuse_tensor_view* v;
  const difuse_tensor_view* q_weight; /* norm_q.weight, bf16 [head_dim], or NULL */
  const difuse_tensor_view* k_weight;
  const difuse_tensor_view* q_ctx; /* context stream, [B, heads, S_ctx, head_dim] views */
  const difuse_tensor_view* k_ctx;
  const difuse_tensor_view* v_ctx;
  const difuse_tensor_view* q_ctx_weight; /* norm_added_q.weight */
  const difuse_tensor_view* k_ctx_weight;
  double eps;
} difuse_qk_norm_sd35_args;
DIFUSE_API difuse_status difuse_can_use_qk_norm_sd35(const difuse_qk_norm_sd35_args* args);
DIFUSE_API difuse_status difuse_qk_norm_sd35(const difuse_qk_norm_sd35_args* args, void* stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* DIFUSE_DIFUSE_H_ */
