// layernorm_modulate — adaLN LayerNorm + modulate in one pass, bit-exact against eager PyTorch.
//
// Eager chain reproduced (diffusers AdaLayerNormZero / AdaLayerNormZeroSingle / AdaLayerNormContinuous,
// SD3 / Sana equivalents), bf16 throughout:
//     out = F.layer_norm(x, (H,), eps=eps) * (1 + scale[:, None]) + shift[:, None]     (scale, shift [B, H])
//     out = F.layer_norm(x, (H,), eps=eps) * (1 + scale) + shift                       (per token: [B, L, H],
//           Qwen-Image zero_cond_t, Wan 2.2 TI2V)
// four eager kernels, each rounding to bf16:  n = LN(x);  a = 1 + scale;  u = n * a;  out = u + shift.
//
// Replays: torch 2.11.0+cu130, sm_90 — at::native::vectorized_layer_norm_kernel<c10::BFloat16, float,
// false> (128 threads per row, Welford push with the correctly rounded reciprocal of the count, FFMA
// updates, cuWelfordCombine tree 16..1 then warps (0,2),(1,3),(0,1), var = sigma2 / N, rstd =
// rsqrtf(var + eps), output bf16(RN(rstd * RN(x - mean)))), then CUDAFunctorOnSelf_add<bf16> (1 + scale),
// the broadcast mul and add (fp32 opmath, bf16 store each). Details: shared/reference/torch-2.11-numerics.md
// §1.1-1.2 and §4; the schedule mapping in layernorm_schedule.h.
//
// Guards (can_use_layernorm_modulate; every violation is reported): x and out [B, L, H] bf16 contiguous on
// one CUDA device, 8-byte aligned (aten's vectorized path: H % 4 == 0, H <= 2^24, aligned X); scale and
// shift [B, H] or [B, L, H] bf16, last dim contiguous, any non-negative strides; B * L <= 2^31 - 1 (aten's grid
// limit); out overlaps no input. Inputs aten sends down its two-kernel path (H % 4 != 0, misaligned x) are
// refused: that path rounds differently. The fp32 variants (can_use_layernorm_modulate_fp32 / _affine_fp32): the
// same shape rules with fp32 rows, 4-byte aligned (since the thirty-third session), H <= 24576, out overlapping none.
//
// Schedules: H <= 3584 two warps per row (4 rows per block; up to 6144 with DIFUSE_LNMOD_THREADS_PER_ROW=64), H <=
// 24576 four warps (1 row); few rows four warps and many rows at H <= 1536 one warp (8 rows per block; the
// *_rows_config functions below; GRLN's many rows at H <= 1536 take two warps on the 32-register kernel instead),
// each staging its row (and, for multi-row blocks, the batch's scale and shift rows) in shared memory with cp.async
// (one read, one write); DIFUSE_LNMOD_THREADS_PER_ROW=32|64|128 forces a schedule everywhere; H > 24576 a
// 128-thread two-pass kernel (second read mostly from L2). 16-byte accesses when H % 8 == 0 and x, out
// are 16-byte aligned, else 8-byte; modulation rows are read as words when 8-byte aligned, else as bf16.
// The fp32 variants read their fp32 rows as float4 when every row is 16-byte aligned
// (layernorm_fp32_rows_vec4), else as scalars (before, always four scalar loads per tensor and vector:
// layernorm_modulate_fp32 measured 448.7 us at 1x32760x5120 against 208.4 for the bf16 kernel on the
// same rows (ops.json, 710ef68), 35 % of the floor. Each warp-wide scalar load spans 512 bytes (4 L1 wavefronts),
// 8 of them per 4 elements: ~10M wavefronts per call, ~190 us of L1 time at 1.7 GHz, about the gap. float4 loads
// need a quarter of that: predicted ~260-300 us; measured 258.1 us at 5fde96b, 258.0 at 6408223, still 1.3x the
// 198 us target: ncu at 8b01de3 shows 53 % DRAM and 78 % L1 throughput, the fp32 rows now the L1 traffic).
//
// The same kernel also serves, as compile-time variations of the epilogue/prologue: per-token [B, L, H]
// modulation, gated_residual_layernorm_modulate (h1 = h + gate * a first) and Wan's fp32 chains
// (layernorm_modulate_fp32, layernorm_affine_fp32).
//
// Verification status: bit-exact on the H200 at 5f8295d (torch 2.11.0+cu130, sm_90; first at 66f5a3b):
// tests/gpu/test_layernorm_modulate.py (342 cases, [B, H] and per-token modulation, the forced 32/128-thread
// schedules), test_gated_residual_layernorm_modulate.py (219) and test_wan_fp32.py (273, incl. the float4 fp32 row
// loads, the block fp32 epilogue (the default) and the per-row one through DIFUSE_LNMOD_F32_ROW_EPILOGUE=1), 0
// failed, 0 skipped (bench/results/h200/tests.json). layernorm_modulate_fp32 1x32760x5120: 448.7 us with 4-byte
// fp32 loads, 258.1 with float4 (5fde96b), 228.2 with the block epilogue (3e989f7; target 198).
// DIFUSE_LNMOD_PREFETCH_A=1 (gated_residual_layernorm_modulate: each row's a prefetched into L2 with one
// bulk-prefetch instruction while its h is copied; the residual kernels' PTX gains that untaken branch by default,
// the others only a larger Params; test_prefetched_a_variant): exact on the H200 at 132f46f (tests.json, 3,225
// passed), no faster (knob-sweeps/: 1x4096x3072 45.3 vs 43.5 us).
// DIFUSE_LNMOD_STAGE_ALL=1 (fifty-fourth session, for measurement; SALL at the kernel: GRLN's four-warp rows with
// 8-byte gate and modulation rows, H <= 7372, copy h, a, gate, scale and shift into shared memory in one burst):
// NOT YET RUN ON A GPU; test_staged_all_variant and sanitizer part 3's two runs are written for it. The defaults'
// kernels compile to the same SASS text as before it (scripts/sass-ops-diff.sh with SASS_OPS_TEXT=1).
// Four warps per row above H = 3584 (7 sweeps) since eb1307d, where they were faster in two sweeps (5f8295d and
// 132f46f; see layernorm_modulate_config): exact there in this file's tests, GRLN's and test_wan_fp32.py (836 cases,
// the two-warp schedule at 3588-6144 through DIFUSE_LNMOD_THREADS_PER_ROW=64, gpu-tests-eb1307d.json);
// layernorm_modulate 1x32760x5120 195.8 us, layernorm_modulate_fp32 212.4 (230.4 with two warps in the same run;
// target 198: not met) in bench-partial-eb1307d.log and knob-sweeps/eb1307d/.
// gated_residual_layernorm_modulate since 2cecf55: four warps per row for at most 1024 rows at H in (2560, 3584]
// (gated_residual_layernorm_modulate_config): 1x512x3072 12.0 us vs 12.8 on two warps in the same run, 2x300x3072
// 12.2 vs 14.4 (DIFUSE_LNMOD_THREADS_PER_ROW=64, knob-sweeps/2cecf55/); exact there (GRLN's tests incl.
// test_two_warp_schedule_for_few_rows, gpu-tests-2cecf55.json); since the fifty-second session (2048, 3584]: SD3.5-large's
// 2x333x2432 12.5 us vs 14.1-14.4 on an H100 at 94 SMs (bench/results/h100/stage-all-a4fd151/; the four-warp kernel at
// 2432 ran 0 mismatches in the bench; its default has not run on a GPU). Since 0385466 its residual pass issues 2-3 sweeps' a
// and gate loads before their stores (residual_sweep_batch; before, SASS showed each vector's loads waiting on the
// previous vector's stores: 12 DRAM round trips in turn per lane at 3072): 1x4096x3072 39.6-39.8 us vs 42.8
// (predicted 33-36; target 30: not met); 64 registers on two warps, 4 blocks per SM instead of 5. Exact at 0385466
// (this file's, GRLN's and LN's tests, 946 passed, gpu-tests-0385466.json), smoke memcheck / initcheck / racecheck
// clean (sanitizer-0385466.txt). The 32-register variant (DIFUSE_LNMOD_BLOCKS_PER_SM=8) keeps the one-vector loop
// and ran 42.7 at 4096 rows but 10.6 at 512 (knob-sweeps/0385466/). Since the twelfth session those four-warp rows
// (<= 1024 rows) load 4 sweeps' modulation before their stores (EPB, epilogue_batched): 1x512x3072 9.5 us vs 11.1,
// 2x300x3072 10.2 vs 11.3 through DIFUSE_LNMOD_EPILOGUE_BATCH=1 at 94cceb5, where it ran exact
// (gpu-tests-94cceb5.json: this file's, LN's, Wan fp32's and rms_norm's tests, 1,111 passed).
// The many-narrow-rows defaults (one warp per row, GRLN's 32-register kernel; >= 8192 rows at H <= 1536) since
// 196d420 / be1cdc5: exact in this file's, GRLN's and Wan fp32's tests at d3185fc (861 passed,
// gpu-tests-d3185fc.json) and in the whole suite at d12a190 (3,281 passed, tests.json); the full sanitizer stage
// clean there (sanitizer-d12a190.txt).
// Since 26d5552: GRLN reads its gate rows as 8-byte words where they are 8-byte aligned (load_gate_words; an
// unaligned gate takes the MODVEC = false kernel), and the staged kernels except the 32-register one push without the
// count's add and set the count after (kCountAfter; CPU test Welford.UncountedPushesWithTheCountSetAfterwardAreTheSameBits).
// SASS of GRLN's two-warp row: residual loop 164 -> 140 instructions, Welford loop 153 -> 138, 64 -> 56 registers
// (still 4 blocks per SM). Exact at 26d5552 (this file's, GRLN's and Wan fp32's tests, 864 passed with the probe's,
// gpu-tests-26d5552.json); GRLN 1x4096x3072 38.7 us (39.6 at d3185fc; predicted ~37), 2x4096x1536 40.0 (42.0),
// layernorm_modulate_fp32 1x32760x5120 212.2 (213.7), the rest within 1 % (ops.json at 26d5552).
// Twenty-first session (846df26): the streamed kernels' ring has two `full` mbarriers per slot (norm/stream_rows.cuh:
// one let a consumer read a slot early where the slots are not a multiple of the groups, e.g. about 36 slots for 24
// one-warp groups at H = 3072, and the probe's 37-slot ring hung); their arithmetic is unchanged, and they ran exact
// with it in the whole suite at 97817d7 (tests.json: 3,384 passed, 0 failed, 0 skipped); one per slot where each
// group owns its slots, with the plain LayerNorms' ring up to 48 slots, only under DIFUSE_STREAM_FULL_BARRIERS=1
// (twenty-fourth session; GPU tests pass at 5d3eadf, no faster at aa41dda; kStreamLnMaxSlots). DIFUSE_STREAM_PRODUCER_LANES
// (knob) since fc63727; its lanes wait on every fill of their step since 45a2975 (racecheck clean there with lanes =
// 4, racecheck-knobs-45a2975.log; stream_produce_rows). With 4 lanes GRLN is no faster (knob-sweeps/9a34777/: 34.2 vs
// 33.7 us at 1x4096x3072, 32.9 vs 32.2 at 2x4096x1536, 51.2 vs 50.1 at 2x4096x2432).
// Since the seventeenth session, gated_residual_layernorm_modulate's many rows (>= 4096, H <= 3584, h, a, out and the
// residual 16-byte aligned, H % 8 == 0, [B, H] gate, scale and shift rows of 8-byte words, B <= 2) take the streamed
// kernel (grln_streamed_rows: one block per SM, a producer
// warp bulk-copying each row's h and a into a ring of shared-memory slots while 12 two-warp groups compute with the
// staged row's arithmetic; the [B, H] modulation rows staged once per block; aten's tree with host-computed weights
// where every combine has equal counts, H % 512 == 0). H200 at ab67215 (knob-sweeps/ab67215/, against
// DIFUSE_LNMOD_STREAMED=0 in the same run): 1x4096x3072 33.8 us vs 39.0 staged, 2x4096x1536 34.7 vs 40.5, 2x4096x2432
// 50.4 vs 58.4 (target 30 at 3072: not met; 33.3 in ops.json at faab412). Exact as the default in the whole suite at
// ab67215 (tests.json: GRLN's tests passed; the one failure was a test script's, fixed and passed at faab412 with the
// knob, site-shape and CUDA-graph tests, gpu-tests-faab412.json); memcheck and racecheck clean under the knob at
// ab67215 (sanitizer-streamed-ab67215.txt). DIFUSE_LNMOD_STREAMED=0 keeps the staged kernels. After those runs its
// producer loop, row statistics and epilogue moved into helpers it shares with layernorm_streamed_rows and
// norm/stream_rows.cuh (6ad6888, 2fbdd3e): `scripts/sass-ops-diff.sh faab412 src/norm/layernorm_modulate.cu
// grln_streamed` finds the same floating-point, shuffle, barrier and memory instructions per kernel as the verified
// code (two LDC of kernel parameters became one LDC.64 in <true, true>; only integer index arithmetic and moves
// differ); the refactored kernel ran exact at e831f9c (GRLN's tests, gpu-tests-e831f9c.json).
// Since the eighteenth session the plain LayerNorms (layernorm_modulate, layernorm_modulate_fp32,
// layernorm_affine_fp32) take the streamed schedule too (layernorm_streamed_rows) for >= 4096 rows of H <= 24576
// (its Welford reciprocals come from c_rcp's 48 sweeps; wider rows read past it until the thirty-second session, now
// they take the two-pass kernel) with x and out 16-byte aligned, H % 8 == 0 and staged modulation rows ([B, H], B <= 2, bf16 8-byte words or fp32 16-byte vectors;
// the affine weight and bias): exact through DIFUSE_LNMOD_STREAMED at e831f9c (this file's and Wan fp32's tests, 1250
// passed, gpu-tests-e831f9c.json) and as the default at a140ba1 (gpu-tests-a140ba1.json; the default-choice and
// knob-off tests at 83f6b5f, gpu-tests-83f6b5f.json), memcheck and racecheck clean (sanitizer-streamed-a140ba1.txt),
// FLUX, Wan, Qwen-Image and SD3.5 md5 identical at every step (e2e-*-83f6b5f.json); layernorm_modulate 1x4608x3072 23.9 us vs 26.3, 1x32760x1536 65.4 vs 80.4,
// layernorm_modulate_fp32 1x32760x5120 181.8 vs 209.8 (knob-sweeps/e831f9c/; see plain_streamed_by_default_or_knob).
// Since the forty-fourth session rows wider than 4096 take them by default only where DRAM outpaces the SMs
// (plain_layernorm_streamed_by_default): a whole H100 runs 1x32760x5120 5-9 % faster in the staged kernels (host
// dispatch only: both kernels are the ones verified above; test_streamed_by_default_for_many_rows follows the rule).
// On a whole H100 at 7f96462 this file's and Wan fp32's tests passed with it (684, 0 failed, 0 skipped) and the
// default ran 236.9-237.2 us at layernorm_modulate_fp32 1x32760x5120 against 259.1-259.7 streamed; at 94 SMs it kept
// the streamed rows (bench/results/h100/plain-ln-by-device-7f96462/). On the H200 at fd5c83b (18.42 bytes per SM
// cycle) the default-choice tests passed with the streamed rows at 5120 (gpu-tests-fd5c83b-default-choice.json).
// Since the nineteenth session the streamed rows run on one-warp consumer groups (G = 32: 24 groups, four slots per
// thread on the same paired map) up to H = 4096 for the plain LayerNorms and up to 1536 for GRLN
// (stream_one_warp_groups; DIFUSE_LNMOD_STREAM_WARP=1|0 everywhere or nowhere): exact through the knob at e7993bf
// (gpu-tests-e7993bf.json, 51 passed; memcheck and racecheck clean, sanitizer-streamed-knobs-e7993bf.txt) and as the
// default in the whole suite at 79a9492 (tests.json at 79a9492, 3,355 passed; the one failure was an rms_norm_modulate
// test's expectation, fixed at 5fc3ade) with all four models md5 identical (e2e-*-5fc3ade.json); layernorm_modulate
// 1x4096x3072 19.2 us vs 22.2, layernorm_modulate_fp32 1x32760x1536 70.3 vs 80.9, GRLN 2x4096x1536 33.1 vs 34.5
// (knob-sweeps/e7993bf/).
// Since cd4f7c8 (thirty-ninth session) the streamed rows' warp trees take the equal-count combine also where only each
// aten warp's counts are equal (V % 32 == 0, V >= 128, V % 128 != 0: SD3.5-large's 2432, 1152, 640, 4224;
// kTreeWarpEqual) and the one-warp rows' cross-warp combines with equal sides skip the reciprocal (RootCombines):
// exact on an H100 (H100 80GB HBM3; no H200 came that session) at cd4f7c8 in this file's, GRLN's and test_wan_fp32.py's
// tests (939 passed, 0 failed, 0 skipped) and the SD3 / FLUX / Qwen-Image / Wan patch tests (27), memcheck, racecheck
// and initcheck clean (scripts/sanitizer-ln-warp-tree.py, sanitizer part 1a; bench/results/h100/
// warp-tree-landed-cd4f7c8/); at 94 SMs layernorm_modulate 2x4096x2432 36.2 vs 40.3 us, GRLN 2x4096x2432 70.4 vs
// 71.7 against efcee13 (the knobs DIFUSE_LNMOD_WARP_TREE=0 / DIFUSE_LNMOD_EQUAL_ROOTS=0 restore the general combines).
// Since 13fa12b (fortieth session) GRLN's two-warp streamed rows push each slot's Welford state in the residual pass,
// as its h1 vectors are formed (kPushInResidual; the same operations on the same values in the same order as
// stream_row_stats' second pass, which the one-warp rows keep): exact on an H100 at 13fa12b in this file's, GRLN's and
// test_wan_fp32.py's tests (939 passed, 0 failed, 0 skipped), the native smoke test (61 passed) and, under memcheck,
// racecheck and initcheck, the smoke test on streamed knobs and scripts/sanitizer-ln-warp-tree.py: clean
// (bench/results/h100/push-in-residual-landed-13fa12b/); at 94 SMs GRLN 1x4096x3072 44.5 vs 45.9 us, 2x4096x2432
// 69.1 vs 70.9, 2x4096x1536 44.9 vs 45.1 against e8e1fb9.
// Since the forty-fifth session the one-warp streamed rows (G = 32, the plain LayerNorms up to 4096 and GRLN up to
// 1536) hold their aten threads on the warp-local map (StreamRowMap = layernorm_schedule.h's AtenWarpLocalMap: a
// lane's four aten threads all in one aten warp, lanes 2m, 2m + 1, 2m + 16, 2m + 17), so aten's offset-16 and
// offset-1 steps are in-thread and only three steps shuffle, two slots each: per row 6 state shuffles and 9 combines a
// lane instead of 16 and 18 (~90 instructions fewer a row on the equal-count tree). Static SASS, all three tree forms:
// `scripts/sass-ops-diff.sh b591df4 src/norm/layernorm_modulate.cu` has layernorm_streamed_rows<true, true, true, 32>
// (Wan's fp32 rows, staged) with 140 SHFL.DOWN, 159 FMUL, 113 FADD, 112 FFMA and 9 MUFU.RCP fewer and 15 LDC more; by
// a count of cuobjdump's output (not a repo script) 4456 -> 3368 instructions in all, every one-warp kernel ~1,100
// fewer; the two-warp kernels 8-24 fewer (their general
// tree's counts are now set per pair of slots: t and V are even, so t + 1 holds t's count). The same combines on the
// same operands (tests/cpu: the schedules' emulation, "32 warp-local" and its warp-equal form; the map test now also
// checks that every combine the root needs is made). Predicted from ~1,170 instructions a row at fp32 1x32760x1536
// (~8 % fewer): 68.7 -> ~65 us on the H200, GRLN 2x4096x1536 32.5 -> ~31. First run on a GPU in the forty-seventh
// session, an H100 at 94 SMs (bench/results/h100/full-sweeps-e945489/, with the full sweeps off): fp32 1x32760x1536
// 92.6 -> 90.1 us (-2.7 %), layernorm_modulate 1x32760x1536 86.9 -> 84.7, GRLN 2x4096x1536 unchanged (45.0 / 45.2);
// exact there (this file's, GRLN's and test_wan_fp32.py's GPU tests at e945489). Not yet on an H200.
// Since the forty-sixth session the streamed rows with staged modulation rows at H = 1536 and 3072 (V = 384 and 768:
// three and six full sweeps of aten's 128 threads) run kernels compiled for that sweep count (full_sweeps_for:
// layernorm_streamed_rows<..., 32, 3 | 6> for the plain LayerNorms' one-warp rows, fp32 and bf16;
// grln_streamed_rows<true, true, 32, 3> for GRLN's one-warp rows at 1536 and <true, true, 64, 6> for its two-warp rows
// at 3072): no vector is tested against V, the Welford and residual loops unroll (reciprocals at constant offsets),
// the epilogue loops run a constant trip count. The same operations in the same order per slot; the 75 kernels with
// SW = 0 compile to the same SASS as before, instruction for instruction (`SASS_OPS_TEXT=1 SASS_OPS_RENAME='ELi0EEEv=EEEv'
// scripts/sass-ops-diff.sh bf8a09f src/norm/layernorm_modulate.cu`: 75 same, 6 only now). scripts/sass-loops.sh: Wan's
// fp32 row at 1536 (layernorm_streamed_rows<true, true, true, 32, SW>) had a Welford loop of 221 instructions per two
// sweeps and an epilogue loop of 132 per two sweeps, every vector tested; at SW = 3 the Welford part is straight-line
// and the epilogue loop 61 per sweep, the row loop 1294 static instructions against 2032; estimated from these, ~175
// fewer a row of ~1,080 (~16 %). GRLN's two-warp row at 3072: its residual loop (207 per two sweeps, three times) is
// straight-line at SW = 6.
// Predicted on the H200: fp32 1x32760x1536 ~65 (the warp-local map) -> ~60 us, GRLN 2x4096x1536 ~31 -> ~29.5,
// GRLN 1x4096x3072 33.3 -> ~31.5. DIFUSE_LNMOD_FULL_SWEEPS=0 keeps the SW = 0 kernels. First run in the
// forty-seventh session, on an H100 at 94 SMs (bench/results/h100/full-sweeps-e945489/, against the same build with
// DIFUSE_LNMOD_FULL_SWEEPS=0): fp32 1x32760x1536 90.1 -> 85.2 us (-5.4 %), layernorm_modulate 1x32760x1536 84.7 ->
// 82.3, GRLN 2x4096x1536 45.2 -> 43.8, GRLN 1x4096x3072 44.3 -> 42.9; exact there (each file's
// test_run_time_sweeps_variant and the default-choice tests with their SW check, in the four norm files' 1,359
// passing cases at e945489). Not yet on an H200. GRLN's one-warp rows at 3072 (DIFUSE_LNMOD_STREAM_WARP=1, for
// measurement: two-warp groups are the default there) take SW = 6 too since the forty-seventh session
// (grln_streamed_rows<true, true, 32, 6>: 64 registers, no spill), to compare the two group widths each at full sweeps.
// And the bf16 LayerNorm's two-warp rows at H = 5120 with staged rows (Wan 14B's shape, V = 1280: ten full sweeps)
// take layernorm_streamed_rows<false, true, true, 64, 10> since the forty-seventh session (48 registers against 64;
// no spill; the Welford loop straight-line). Measured in the forty-eighth session on an H100 at 94 SMs
// (bench/results/h100/full-sweeps-5120-4096-4e080ff/, against 9e37db8, two alternated rounds, and a knob sweep in one
// build): layernorm_modulate 1x32760x5120 265.2 -> 253.9 us (-4.3 %; knob 0: 265.5); exact there (this file's and
// test_layernorm_modulate.py's tests, 1,360 passed at 4e080ff). The fp32 kernel of the same form (62 registers
// against 72) was slower: layernorm_modulate_fp32 1x32760x5120 247.5 -> 268.3 us (+8.4 %; knob 0: 252.1), so since
// the forty-eighth session Wan's fp32 rows at 5120 keep the run-time-sweep kernel (SW = 0) and the fp32 SW = 10
// kernel is no longer compiled (test_wan_fp32.py's test_two_warp_run_time_sweeps_forced_streamed checks which ran).
// Partial last sweep (forty-eighth session): GRLN's two-warp rows with staged rows at SD3.5-large's H = 2432 (V = 608:
// four full sweeps and 96 vectors of a fifth; 2x4096x2432 ran 49.7 us against a site bound of 46.8 on the H200 at
// fd5c83b) take grln_streamed_rows<true, true, 64, 4, 96> (partial_sweeps_2432): the template's PV, the vectors of a
// partial last sweep after SW full ones, makes V and the trip counts constants; the four full sweeps go untested, the
// fifth keeps the run-time kernel's `vi < V` test (`(SW > 0 && (PV == 0 || k < SW)) || vi < V`, which is the old
// `SW > 0 || vi < V` at PV = 0). The same operations in the same order per slot. 60 registers (as the run-time
// kernel), no spill; the row's two inner loops, the residual one (207 SASS instructions per two sweeps) and the
// epilogue (124), each run three times a row, become straight line: the row loop 1150 static instructions (inner
// loops once) -> 1447 with none (scripts/sass-loops.sh), estimated ~1,810 -> ~1,450 instructions a row (-20 %). The other 84 kernels' SASS unchanged
// (`SASS_OPS_TEXT=1 SASS_OPS_RENAME='(grln_streamed_rowsILb[01]ELb[01]ELi[0-9]+ELi[0-9]+E)Li0EEEv=\1EEv'
// scripts/sass-ops-diff.sh 726ca12 src/norm/layernorm_modulate.cu`: every GRLN kernel's name gains PV = 0). Predicted
// from the 3072 kernel's -4 % on the H100: GRLN 2x4096x2432 67.6 -> ~65.5 us there at 94 SMs, 49.7 -> ~48 on the
// H200 (the bound, 46.8, still out of reach). DIFUSE_LNMOD_FULL_SWEEPS=0 keeps the run-time kernel. Measured on an
// H100 at 94 SMs at b4d4d1b (bench/results/h100/grln-partial-sweeps-b4d4d1b/, against the knob in the same build, two
// alternated rounds): 68.1 -> 64.8 us (-4.8 %; scaled to the H200, 49.7 -> ~47.3); exact there
// (test_gated_residual_layernorm_modulate.py, 261 passed: test_streamed_group_width_by_default checks SW = 4 and
// PV = 96 at 2432, test_run_time_sweeps_variant the knob, test_adversarial the values at 2x4096x2432,
// test_streamed_variant's 2x37x2432 the ring under the streamed knobs). Not yet on an H200.

#include "norm/layernorm_modulate.h"

#include "modulate/gated_residual_pair.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "core/bulk_copy.cuh"
#include "core/device.h"
#include "core/env_knob.h"
#include "core/fast_div.h"
#include "core/registry.h"
#include "core/tensor.h"
#include "norm/layernorm_schedule.h"
#include "norm/row_staging.cuh"
#include "norm/stream_rows.cuh"

namespace difuse::norm {

namespace {

using num::VecWelford;

const detail::KernelRegistration kF32Registration{{
    "layernorm_modulate_fp32", "cuda", "bit_exact",
    "(F.layer_norm(x.float(), (H,), eps=eps) * (1 + scale) + shift).type_as(x)  (Wan: fp32 scale/shift rows)",
    "verified bit-exact on H200 at eb1307d (torch 2.11.0+cu130, sm_90)", 90, 90,
    "Wan's fp32 adaLN: fp32 LayerNorm and modulation, one bf16 rounding at the end"}};

const detail::KernelRegistration kAffineRegistration{{
    "layernorm_affine_fp32", "cuda", "bit_exact",
    "F.layer_norm(x.float(), (H,), weight, bias, eps).type_as(x)  (Wan's norm2: fp32 weight and bias)",
    "verified bit-exact on H200 at eb1307d (torch 2.11.0+cu130, sm_90)", 90, 90,
    "affine FP32LayerNorm over bf16 input, one bf16 rounding at the end"}};

const detail::KernelRegistration kResidualRegistration{{
    "gated_residual_layernorm_modulate", "cuda", "bit_exact",
    "h1 = h + gate[:, None] * a;  F.layer_norm(h1, (H,), eps=eps) * (1 + scale[:, None]) + shift[:, None]  (bf16)",
    "verified bit-exact on H200 at ab67215 / faab412 (torch 2.11.0+cu130, sm_90)", 90, 90,
    "the pre-FF site: gated residual, then adaLN LayerNorm + modulate of the new residual, one pass"}};

const detail::KernelRegistration kRegistration{{
    "layernorm_modulate", "cuda", "bit_exact",
    "F.layer_norm(x, (H,), eps=eps) * (1 + scale[:, None]) + shift[:, None]  (bf16; x [B,L,H], scale/shift [B,H])",
    "verified bit-exact on H200 at 0319d48 (torch 2.11.0+cu130, sm_90)", 90, 90,
    "adaLN LayerNorm + modulate in one pass; replays aten's vectorized LayerNorm Welford tree"}};

struct Params {
  const uint16_t* __restrict__ x;
  uint16_t* __restrict__ out;
  const uint16_t* __restrict__ scale;
  const uint16_t* __restrict__ shift;
  int64_t rows;
  int64_t seq;
  detail::IndexDiv seq_div;  // row -> batch without a 64-bit division
  int64_t scale_stride;
  int64_t shift_stride;
  int64_t scale_stride_l;  // per-token modulation ([B, L, H]); 0 for [B, H] rows
  int64_t shift_stride_l;
  // layernorm_modulate_fp32 only: fp32 modulation rows (same strides fields as scale/shift); with
  // affine32, the fp32 weight and bias of an affine FP32LayerNorm instead (strides 0).
  const float* scale32;
  const float* shift32;
  bool affine32;
  // gated_residual_layernorm_modulate only: x is h, the row normalised is residual = h + gate * a.
  const uint16_t* a;
  const uint16_t* gate;
  uint16_t* residual;
  int64_t gate_stride, gate_stride_l;
  int h;
  int v;  // H / 4
  float eps;
  bool mod_vec;  // scale/shift rows 8-byte aligned: 4 values per load (GRLN: the gate rows too)
  // layernorm_modulate_fp32 with one fp32 modulation row per batch (the default; DIFUSE_LNMOD_F32_ROW_EPILOGUE=1
  // for measurement turns it off): the block's threads write all of its rows column by column, each fp32 scale/shift vector
  // loaded once per block instead of once per row (the fp32 rows were most of the L1 traffic: ncu at 8b01de3,
  // 78 % L1 against 53 % DRAM at 1x32760x5120).
  bool f32_block_epilogue;
  // gated_residual_layernorm_modulate with DIFUSE_LNMOD_PREFETCH_A=1 (for measurement; a 16-byte aligned, H % 8 ==
  // 0): each row's a is prefetched into L2 while its h is copied, so the residual step's loads of a hit L2.
  bool prefetch_a;
};

__device__ __forceinline__ VecWelford shfl_down_state(VecWelford s, int delta) {
  VecWelford r;
  r.mean = __shfl_down_sync(0xffffffffu, s.mean, delta);
  r.sigma2 = __shfl_down_sync(0xffffffffu, s.sigma2, delta);
  r.count = __shfl_down_sync(0xffffffffu, s.count, delta);
  return r;
}

// Four bf16 of a modulation row at any 2-byte alignment, as two words.
__device__ __forceinline__ uint2 load_mod_words(const uint16_t* s) {
  return make_uint2(s[0] | (uint32_t{s[1]} << 16), s[2] | (uint32_t{s[3]} << 16));
}

// Four bf16 of a gate row (gated_residual_layernorm_modulate): one 8-byte load where the kernel's MODVEC says the
// gate rows are 8-byte aligned too (Params::mod_vec), else load_mod_words. Before (always load_mod_words), the
// residual pass issued 16 LDG.U16 and 8 PRMT per 16 elements for the gate (SASS at cf12c4f: 164 instructions per
// two-sweep iteration of the two-warp row at 3072); the values, and so every bit, are the same either way.
template <bool WORDS>
__device__ __forceinline__ uint2 load_gate_words(const uint16_t* g) {
  if constexpr (WORDS) return *reinterpret_cast<const uint2*>(g);
  return load_mod_words(g);
}

// 4 bf16 of x (two words) -> 4 bf16 outputs (two words); modulation rows of any alignment.
__device__ __forceinline__ uint2 modulate4_any(const Params& p, int64_t b, int64_t l, int c, uint2 w, RowStats st) {
  const uint2 sc = load_mod_words(p.scale + b * p.scale_stride + l * p.scale_stride_l + c);
  const uint2 sh = load_mod_words(p.shift + b * p.shift_stride + l * p.shift_stride_l + c);
  return make_uint2(layernorm_modulate_pair(w.x, st, sc.x, sh.x), layernorm_modulate_pair(w.y, st, sc.y, sh.y));
}

__device__ __forceinline__ VecWelford push4(VecWelford s, int k, uint2 w) {
  return push_vec4(s, k, num::bf16_lo(w.x), num::bf16_hi(w.x), num::bf16_lo(w.y), num::bf16_hi(w.y));
}

// Wan's fp32 modulation (or affine) values for the 4 elements of vector c / 4: one float4 each when the rows are
// 16-byte aligned (VEC4), else scalars.
template <bool VEC4>
__device__ __forceinline__ void load_f32_rows4(const float* s32, const float* h32, int c, float (&sc)[4],
                                               float (&sh)[4]) {
  if constexpr (VEC4) {
    const float4 s4 = *reinterpret_cast<const float4*>(s32 + c);
    const float4 h4 = *reinterpret_cast<const float4*>(h32 + c);
    sc[0] = s4.x, sc[1] = s4.y, sc[2] = s4.z, sc[3] = s4.w;
    sh[0] = h4.x, sh[1] = h4.y, sh[2] = h4.z, sh[3] = h4.w;
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) sc[e] = s32[c + e], sh[e] = h32[c + e];
  }
}

// 4 bf16 of x (two words) -> 4 bf16 outputs of the fp32 chain (modulate or affine), one rounding each.
__device__ __forceinline__ uint2 f32_chain4(uint2 w, RowStats st, const float (&sc)[4], const float (&sh)[4],
                                           bool affine) {
  const float xs[4] = {num::bf16_lo(w.x), num::bf16_hi(w.x), num::bf16_lo(w.y), num::bf16_hi(w.y)};
  float ys[4];
#pragma unroll
  for (int e = 0; e < 4; ++e)
    ys[e] = affine ? layernorm_affine_f32_value(xs[e], st, sc[e], sh[e])
                   : layernorm_modulate_f32_value(xs[e], st, sc[e], sh[e]);
  return make_uint2(num::pack_bf16x2(ys[0], ys[1]), num::pack_bf16x2(ys[2], ys[3]));
}

// f32_chain4 with the chain fixed at compile time: AFFINE the
// affine chain, else the modulation, with A_FORMED where sc holds RN(1 + scale) already (the streamed kernel's staged
// rows): the same operations on the same values, without the other chain's predicated instructions.
template <bool AFFINE, bool A_FORMED>
__device__ __forceinline__ uint2 f32_chain4_t(uint2 w, RowStats st, const float (&sc)[4], const float (&sh)[4]) {
  const float xs[4] = {num::bf16_lo(w.x), num::bf16_hi(w.x), num::bf16_lo(w.y), num::bf16_hi(w.y)};
  float ys[4];
#pragma unroll
  for (int e = 0; e < 4; ++e)
    ys[e] = AFFINE     ? layernorm_affine_f32_value(xs[e], st, sc[e], sh[e])
            : A_FORMED ? layernorm_modulate_f32_value_a(xs[e], st, sc[e], sh[e])
                       : layernorm_modulate_f32_value(xs[e], st, sc[e], sh[e]);
  return make_uint2(num::pack_bf16x2(ys[0], ys[1]), num::pack_bf16x2(ys[2], ys[3]));
}

// Correctly rounded reciprocals of the counts a thread reaches (aten: `1.f / count`), folded at compile time.
constexpr int kMaxStagedSweeps = 48;  // H <= 48 * 512 = 24576 takes the staged kernels
struct RcpCounts {
  float v[4 * kMaxStagedSweeps + 1];
};
constexpr RcpCounts make_rcp_counts() {
  RcpCounts t{};
  for (int k = 1; k <= 4 * kMaxStagedSweeps; ++k) t.v[k] = num::rcp_of_count(k);
  return t;
}
__constant__ RcpCounts c_rcp = make_rcp_counts();

// The four uncounted pushes of one bf16 vector w (two words) at sweep k's reciprocals r (c_rcp.v + 4 k).
__device__ __forceinline__ VecWelford push4_uncounted(VecWelford s, const float* r, uint2 w) {
  s = num::vec_welford_push_uncounted(s, num::bf16_lo(w.x), r[1]);
  s = num::vec_welford_push_uncounted(s, num::bf16_hi(w.x), r[2]);
  s = num::vec_welford_push_uncounted(s, num::bf16_lo(w.y), r[3]);
  return num::vec_welford_push_uncounted(s, num::bf16_hi(w.y), r[4]);
}

// Staged rows: ROWS rows per block, G threads per row. Each thread copies its own aten threads' vectors
// into shared memory (cp.async, all in flight at once), replays their Welford pushes, the tree, and the
// epilogue from there. A thread only ever reads the vectors it copied, so no barrier guards the staging.
// Loops stay loops: a fully unrolled row overflowed the instruction cache.
// MINB: blocks per SM the registers must allow. 8 (DIFUSE_LNMOD_BLOCKS_PER_SM=8, for measurement) caps a thread
// at 32 registers and skips the modulation-row staging, so 8 blocks of 4 rows fit an SM's registers and shared
// memory: 4096 FLUX rows in one wave of 4224 row slots instead of 1.29 waves of 3168 (ncu at 8b01de3: "Waves
// Per SM 1.29", 58 % achieved occupancy). The same arithmetic; the modulation rows come from global memory.
// Also for gated_residual_layernorm_modulate (the residual prologue fits the 32 registers too). Exact on the H200
// (tests/gpu/test_layernorm_modulate.py::test_eight_blocks_per_sm_variant, tests.json at 132f46f).
// 5 (DIFUSE_LNMOD_BLOCKS_PER_SM=5, for measurement; two warps per row): 48 registers, everything else as by default
// (modulation rows staged, the residual loads batched 2 sweeps at a time; sass-loops.sh: the same loops, 185
// instructions instead of 164 in the first). Aimed at GRLN 1x4096x3072 (39.7 us; ncu at edec152: 64 registers, 4
// blocks per SM, 50 % theoretical occupancy, latency-bound): 5 blocks per SM. Predicted ~35-37 us if the kernel's
// throughput follows its resident rows; layernorm_modulate's two-warp rows are at 48 already (no change expected).
// Measured at 9c75d86 (knob-sweeps/9c75d86/, against the same run's ops.json): slower, GRLN 1x4096x3072 42.2 us vs
// 39.2, 2x4096x1536 45.7 vs 43.6; layernorm_modulate unchanged (24.3 vs 24.0). Exact there
// (test_eight_blocks_per_sm_variant[5], gpu-tests-9c75d86.json). A measurement knob only: the resident rows were not
// what bounds GRLN.
// Sweeps whose residual loads (a, gate) gated_residual_layernorm_modulate issues together (see the residual loop):
// 3 on four warps per row (1 slot per lane: 6 vectors in two batches at H = 3072, 46 registers), 2 on two warps
// (2 slots: 3 batches of 4 vectors at 3072, 64 registers: 4 blocks per SM instead of 5); 0 in the 32-register
// variant (DIFUSE_LNMOD_BLOCKS_PER_SM=8): one vector at a time as before, since even one sweep's batch spills there.
template <int G, int MINB>
constexpr int residual_sweep_batch() {
  return MINB >= 8 ? 0 : G == 128 ? 3 : 2;
}

// EPB (four warps per row only; the default for GRLN's rows at <= 1024 rows since the twelfth session,
// epilogue_batched below; DIFUSE_LNMOD_EPILOGUE_BATCH=1 everywhere, =0 nowhere): the epilogue that reads its
// modulation rows from global memory (every four-warp row: one-row blocks stage no modulation; Wan's fp32 rows
// always) issues EPB sweeps' loads (x from shared memory, scale and shift) before any of their stores. With EPB = 1
// each sweep's loads wait for the previous sweep's store (sass-loops.sh: 1-3 global load batches behind a store per
// loop, 10 sweeps at H = 5120). Registers 37-52 -> 53-64, no spills. Exact on the H200 at 94cceb5
// (test_batched_epilogue_variant, gpu-tests-94cceb5.json). With EPB = 1 and SA = false every kernel's PTX is the one
// that ran at 0385466 (scripts/ptx-diff.sh 0385466: 34 of 34 same).
// SA (DIFUSE_LNMOD_STAGE_A=1, for measurement; gated_residual_layernorm_modulate on two or four warps per row, where
// the block's rows fit kMaxStagedBytes twice): each row's a is copied into shared memory with its h, every copy in
// flight at once, so the residual pass reads no a from global memory (by default it loads a in batches of 4
// vectors per lane, 3 DRAM round trips in turn at H = 3072). Costs a second row of shared memory per row: at 3072,
// 60 KB per two-warp block, 3 blocks per SM instead of 4. Exact on the H200 at 94cceb5 (test_staged_a_variant),
// slower: 1x4096x3072 48.5 us vs 39.5 (predicted ~34 or no better: the lost block per SM cost more than the
// round trips saved), 1x512x3072 11.0 vs 11.1 (knob-sweeps/94cceb5/).
// EA (DIFUSE_LNMOD_EARLY_A=1, 215f468, removed): the residual pass's first batch of a and gate loads issued before
// the wait for h's copies (three DRAM round trips in turn per row at 3072 instead of four). Exact on the H200 at
// d3185fc (861 tests of this family), no faster: 1x4096x3072 39.7 vs 39.6 us (predicted 36-37: wrong), 2x4096x1536
// 41.3 vs 42.0, within the noise (knob-sweeps/d3185fc/). The wait for h is not what a row waits on.
// SALL (DIFUSE_LNMOD_STAGE_ALL=1, for measurement; fifty-fourth session; gated_residual_layernorm_modulate on four
// warps per row with 8-byte gate and modulation rows (MODVEC), where the five rows fit kMaxStagedBytes: H <= 7372):
// each row's h, a, gate, scale and shift rows are copied into shared memory in one burst (the same vectors per thread
// as h's), and the residual pass and the epilogue read them from there. Why: rms_norm_modulate's STAGE_ALL rows,
// which do the same, ran 17-26 % faster at 252 rows on an H100 (bench/results/h100/stage-all-a4fd151/), while SA
// alone did nothing here (1x512x3072 11.0 vs 11.1 us): SA's rows still wait on the gate's loads in each residual
// batch (2 at 3072) and on scale and shift in each epilogue batch (2), from L2; with SALL a row waits on one burst.
// The same words and the same operations per thread; only where they are read from changes.
// The block's shared-memory rows under SALL: h (0), a (1), then the gate, scale and shift rows.
constexpr int kStageAllGateRow = 2, kStageAllRows = 5;
// SALL's staged row k (0 gate, 1 scale, 2 shift) as bf16 elements: the same element offsets as the global row's.
__device__ __forceinline__ const uint16_t* stage_all_row(const uint2* staged, int v, int k) {
  return reinterpret_cast<const uint16_t*>(staged + static_cast<int64_t>(kStageAllGateRow + k) * v);
}
template <int G, bool PAIRED, bool MODVEC, bool RESIDUAL, bool F32MOD = false, int MINB = 1, int EPB = 1,
          bool SA = false, bool SALL = false>
__global__ void __launch_bounds__(256, MINB) layernorm_modulate_rows(const Params p) {
  static_assert(!SALL || (G == 128 && MODVEC && RESIDUAL && !F32MOD && MINB < 8),
                "SALL: GRLN's four-warp rows with 8-byte gate and modulation rows");
  using Map = AtenThreadMap<G, PAIRED>;
  constexpr int A = Map::kSlots;
  constexpr int ROWS = G == 128 ? 1 : 256 / G;
  constexpr int STEP = PAIRED ? 2 : 1;
  extern __shared__ uint2 staged[];  // ROWS x V vectors of 4 bf16
  __shared__ VecWelford roots[ROWS][4];
  __shared__ RowStats stats[ROWS];

  const int i = static_cast<int>(threadIdx.x) % G;
  const int rb = static_cast<int>(threadIdx.x) / G;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * ROWS + rb;
  const bool active = row < p.rows;
  // Multi-row blocks with aligned modulation rows also stage the scale and shift rows of the block's first
  // batch once (rows of another batch, at a batch boundary, read them from global memory).
  constexpr bool STAGE_MOD = ROWS > 1 && MODVEC && !F32MOD && MINB < 8;  // and, at run time, one row per batch
  const bool stage_mod = STAGE_MOD && p.scale_stride_l == 0 && p.shift_stride_l == 0;
  if constexpr (G == 32 && !STAGE_MOD) {
    if (!active) return;  // whole warp: no shuffle or barrier is left half-populated
  }
  const int V = p.v;
  const int sweeps = (V + kAtenThreads - 1) / kAtenThreads;
  uint2* sx = staged + static_cast<int64_t>(rb) * V;
  const uint2* gx = reinterpret_cast<const uint2*>(p.x + row * p.h);
  const int64_t b0 = p.seq_div.div(static_cast<int64_t>(blockIdx.x) * ROWS);
  uint2* s_scale = staged + static_cast<int64_t>(ROWS) * V;
  uint2* s_shift = s_scale + V;
  if (stage_mod) {
    const uint2* gs = reinterpret_cast<const uint2*>(p.scale + b0 * p.scale_stride);
    const uint2* gh = reinterpret_cast<const uint2*>(p.shift + b0 * p.shift_stride);
    for (int t = static_cast<int>(threadIdx.x); t < V; t += G * ROWS) {
      cp_async(s_scale + t, gs + t, 0);
      cp_async(s_shift + t, gh + t, 0);
    }
  }

  if (active) {
    for (int k = 0; k < sweeps; ++k) {
#pragma unroll
      for (int j = 0; j < A; j += STEP) {
        const int vi = Map::aten_thread(i, j) + kAtenThreads * k;
        if (vi < V) cp_async(sx + vi, gx + vi, PAIRED);
      }
    }
    if constexpr (RESIDUAL && MINB < 8) {  // (not in the 32-register variant: it would spill)
      if (p.prefetch_a && i == 0) prefetch_l2(p.a + row * p.h, static_cast<uint32_t>(p.h) * 2u);
    }
    if constexpr (RESIDUAL && (SA || SALL)) {  // a's row after the modulation rows' region: the same vectors as h's
      uint2* sa = staged + static_cast<int64_t>(ROWS + (STAGE_MOD ? 2 : 0) + rb) * V;
      const uint2* ga = reinterpret_cast<const uint2*>(p.a + row * p.h);
      for (int k = 0; k < sweeps; ++k) {
#pragma unroll
        for (int j = 0; j < A; ++j) {
          const int vi = Map::aten_thread(i, j) + kAtenThreads * k;
          if (vi < V) cp_async(sa + vi, ga + vi, false);  // 8 bytes: a need not be 16-byte aligned
        }
      }
    }
    if constexpr (SALL) {  // then the gate, scale and shift rows (rows 2-4 of the one-row block), 8-byte words
      const int64_t bb = p.seq_div.div(row), ll = row - bb * p.seq;
      const uint16_t* const src[3] = {p.gate + bb * p.gate_stride + ll * p.gate_stride_l,
                                      p.scale + bb * p.scale_stride + ll * p.scale_stride_l,
                                      p.shift + bb * p.shift_stride + ll * p.shift_stride_l};
#pragma unroll
      for (int q = 0; q < 3; ++q) {
        uint2* const dst = staged + static_cast<int64_t>(kStageAllGateRow + q) * V;
        const uint2* const g = reinterpret_cast<const uint2*>(src[q]);
        for (int k = 0; k < sweeps; ++k) {
          const int vi = Map::aten_thread(i, 0) + kAtenThreads * k;
          if (vi < V) cp_async(dst + vi, g + vi, false);
        }
      }
    }
  }
  cp_async_wait_all();
  if constexpr (STAGE_MOD) __syncthreads();  // the modulation rows were copied by the whole block

  if constexpr (RESIDUAL) {  // h1 = h + gate * a, rounded as eager, written out and normalised from here on
    if (active) {
      const int64_t bb = p.seq_div.div(row), ll = row - bb * p.seq;
      const uint16_t* grow = SALL ? stage_all_row(staged, V, 0) : p.gate + bb * p.gate_stride + ll * p.gate_stride_l;
      const uint2* ar = SA || SALL ? staged + static_cast<int64_t>(ROWS + (STAGE_MOD ? 2 : 0) + rb) * V
                                   : reinterpret_cast<const uint2*>(p.a + row * p.h);  // this thread's own copies
      uint2* rr = reinterpret_cast<uint2*>(p.residual + row * p.h);
      // KB sweeps' a and gate loads are issued before any of their stores. One vector at a time (before), each
      // load waited for the previous vector's store (the compiler does not move a load above a store that may
      // alias it): sweeps x A = 12 round trips to DRAM per lane at H = 3072, one after the other (SASS). The
      // arithmetic per element is unchanged.
      constexpr int KB = residual_sweep_batch<G, MINB>();
      if constexpr (KB == 0) {
        for (int k = 0; k < sweeps; ++k) {
#pragma unroll
          for (int j = 0; j < A; ++j) {
            const int vi = Map::aten_thread(i, j) + kAtenThreads * k;
            if (vi < V) {
              const uint2 h1 = modulate::gated_residual_vec4(sx[vi], ar[vi], load_gate_words<MODVEC>(grow + kVecElems * vi));
              sx[vi] = h1;
              rr[vi] = h1;
            }
          }
        }
      } else {
        for (int k0 = 0; k0 < sweeps; k0 += KB) {
          uint2 aw[KB][A], gw[KB][A];
#pragma unroll
          for (int kk = 0; kk < KB; ++kk) {
#pragma unroll
            for (int j = 0; j < A; ++j) {
              const int vi = Map::aten_thread(i, j) + kAtenThreads * (k0 + kk);
              const bool in = k0 + kk < sweeps && vi < V;
              aw[kk][j] = in ? ar[vi] : make_uint2(0, 0);
              gw[kk][j] = in ? load_gate_words<MODVEC>(grow + kVecElems * vi) : make_uint2(0, 0);
            }
          }
#pragma unroll
          for (int kk = 0; kk < KB; ++kk) {
#pragma unroll
            for (int j = 0; j < A; ++j) {
              const int vi = Map::aten_thread(i, j) + kAtenThreads * (k0 + kk);
              if (k0 + kk < sweeps && vi < V) {
                const uint2 h1 = modulate::gated_residual_vec4(sx[vi], aw[kk][j], gw[kk][j]);
                sx[vi] = h1;
                rr[vi] = h1;
              }
            }
          }
        }
      }
    }
  }

  // kCountAfter: the pushes skip the count's add and the count is set once after them (the same bits:
  // vec_welford_push_uncounted). Before, each push also added 1: 16 of the 153 instructions of a two-sweep iteration
  // of GRLN's two-warp row (SASS at cf12c4f). Not in the 32-register kernel (MINB = 8), where it spilled.
  constexpr bool kCountAfter = MINB < 8;
  VecWelford st[A];
  if (active) {
    // All of a sweep's shared-memory reads are issued before its pushes (the pushes are a dependent chain
    // per slot; the reads are not).
#pragma unroll 2
    for (int k = 0; k < sweeps; ++k) {
      const float* r = c_rcp.v + 4 * k;
      uint2 w[A];
      bool valid[A];
#pragma unroll
      for (int j = 0; j < A; ++j) {
        const int vi = Map::aten_thread(i, j) + kAtenThreads * k;
        valid[j] = vi < V;
        w[j] = valid[j] ? sx[vi] : make_uint2(0, 0);
      }
#pragma unroll
      for (int j = 0; j < A; ++j) {
        if (valid[j]) {
          if constexpr (kCountAfter) {
            st[j] = push4_uncounted(st[j], r, w[j]);
          } else {
            st[j] = num::vec_welford_push(st[j], num::bf16_lo(w[j].x), r[1]);
            st[j] = num::vec_welford_push(st[j], num::bf16_hi(w[j].x), r[2]);
            st[j] = num::vec_welford_push(st[j], num::bf16_lo(w[j].y), r[3]);
            st[j] = num::vec_welford_push(st[j], num::bf16_hi(w[j].y), r[4]);
          }
        }
      }
    }
    if constexpr (kCountAfter) {
      // The count each slot's pushes would have added one by one (its valid sweeps are a prefix: 4 per vector).
#pragma unroll
      for (int j = 0; j < A; ++j) {
        const int t = Map::aten_thread(i, j);
        const int n = t < V ? min(sweeps, (V - t + kAtenThreads - 1) / kAtenThreads) : 0;
        st[j].count = static_cast<float>(4 * n);
      }
    }
  }

  // aten's intra-warp tree: offsets 16, 8, 4, 2, 1; own = combine(own, shfl_down(own, o)).
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) {
    const int delta = Map::lane_delta(o);
    if (delta > 0) {
#pragma unroll
      for (int j = 0; j < A; ++j) {
        const VecWelford in = shfl_down_state(st[j], delta);
        st[j] = num::vec_welford_combine(st[j], in);
      }
    } else {
#pragma unroll
      for (int j = 0; j < A; ++j)
        if (Map::receives(o, j)) st[j] = num::vec_welford_combine(st[j], st[Map::partner_slot(o, j)]);
    }
  }
#pragma unroll
  for (int j = 0; j < A; ++j) {
    const int t = Map::aten_thread(i, j);
    if (t % kAtenWarp == 0) roots[rb][t / kAtenWarp] = st[j];
  }
  row_sync<G>();
  if (i == 0) stats[rb] = finalize_roots(roots[rb], p.h, p.eps);
  row_sync<G>();
  if constexpr (F32MOD && G == 64) {
    const int64_t r0 = static_cast<int64_t>(blockIdx.x) * ROWS;
    const int nrows = static_cast<int>(p.rows - r0 < ROWS ? p.rows - r0 : ROWS);
    const int64_t bf = p.f32_block_epilogue ? p.seq_div.div(r0) : -1;
    if (bf >= 0 && p.seq_div.div(r0 + nrows - 1) == bf) {  // uniform: the block's rows share a batch
      // every row's stats are visible: row_sync<64> is a block barrier
      const float* s32 = p.scale32 + bf * p.scale_stride;
      const float* h32 = p.shift32 + bf * p.shift_stride;
      for (int vi = static_cast<int>(threadIdx.x); vi < V; vi += G * ROWS) {
        float sc[4], sh[4];
        load_f32_rows4<MODVEC>(s32, h32, kVecElems * vi, sc, sh);
        for (int q = 0; q < nrows; ++q)
          reinterpret_cast<uint2*>(p.out + (r0 + q) * p.h)[vi] =
              f32_chain4(staged[static_cast<int64_t>(q) * V + vi], stats[q], sc, sh, p.affine32);
      }
      return;
    }
  }
  if (!active) return;  // G > 32: no barrier follows
  const RowStats rs = stats[rb];

  const int64_t b = p.seq_div.div(row), l = row - b * p.seq;
  if constexpr (F32MOD) {  // Wan: fp32 rows, one bf16 rounding at the end
    const float* s32 = p.scale32 + b * p.scale_stride + l * p.scale_stride_l;
    const float* h32 = p.shift32 + b * p.shift_stride + l * p.shift_stride_l;
    uint2* o32 = reinterpret_cast<uint2*>(p.out + row * p.h);
    if constexpr (EPB > 1 && A == 1) {  // EPB sweeps' fp32 rows loaded before their stores
      for (int k0 = 0; k0 < sweeps; k0 += EPB) {
        float sc[EPB][4], sh[EPB][4];
#pragma unroll
        for (int kk = 0; kk < EPB; ++kk) {
          const int vi = Map::aten_thread(i, 0) + kAtenThreads * (k0 + kk);
          if (k0 + kk < sweeps && vi < V) load_f32_rows4<MODVEC>(s32, h32, kVecElems * vi, sc[kk], sh[kk]);
        }
#pragma unroll
        for (int kk = 0; kk < EPB; ++kk) {
          const int vi = Map::aten_thread(i, 0) + kAtenThreads * (k0 + kk);
          if (k0 + kk < sweeps && vi < V) o32[vi] = f32_chain4(sx[vi], rs, sc[kk], sh[kk], p.affine32);
        }
      }
    } else {
      for (int k = 0; k < sweeps; ++k) {
#pragma unroll
        for (int j = 0; j < A; ++j) {
          const int vi = Map::aten_thread(i, j) + kAtenThreads * k;
          if (vi < V) {
            float sc[4], sh[4];
            load_f32_rows4<MODVEC>(s32, h32, kVecElems * vi, sc, sh);  // MODVEC: fp32 rows 16-byte aligned
            o32[vi] = f32_chain4(sx[vi], rs, sc, sh, p.affine32);
          }
        }
      }
    }
    return;
  }
  // SALL: this thread's own copies, at the same element offsets as in the global rows
  const uint16_t* srow = SALL ? stage_all_row(staged, V, 1) : p.scale + b * p.scale_stride + l * p.scale_stride_l;
  const uint16_t* hrow = SALL ? stage_all_row(staged, V, 2) : p.shift + b * p.shift_stride + l * p.shift_stride_l;
  uint2* orow = reinterpret_cast<uint2*>(p.out + row * p.h);
  if (stage_mod && b == b0) {
#pragma unroll 2
    for (int k = 0; k < sweeps; ++k) {
      uint2 w[A], sc[A], sh[A];
#pragma unroll
      for (int j = 0; j < A; ++j) {
        const int vi = Map::aten_thread(i, j) + kAtenThreads * k;
        if (vi < V) w[j] = sx[vi], sc[j] = s_scale[vi], sh[j] = s_shift[vi];
      }
#pragma unroll
      for (int j = 0; j < A; j += STEP) {
        const int vi = Map::aten_thread(i, j) + kAtenThreads * k;
        if (vi < V) {
          const uint2 o0 = make_uint2(layernorm_modulate_pair(w[j].x, rs, sc[j].x, sh[j].x),
                                      layernorm_modulate_pair(w[j].y, rs, sc[j].y, sh[j].y));
          if constexpr (PAIRED) {
            const uint2 o1 = make_uint2(layernorm_modulate_pair(w[j + 1].x, rs, sc[j + 1].x, sh[j + 1].x),
                                        layernorm_modulate_pair(w[j + 1].y, rs, sc[j + 1].y, sh[j + 1].y));
            *reinterpret_cast<uint4*>(orow + vi) = make_uint4(o0.x, o0.y, o1.x, o1.y);
          } else {
            orow[vi] = o0;
          }
        }
      }
    }
    return;
  }
  if constexpr (EPB > 1 && A == 1 && !PAIRED) {  // EPB sweeps' modulation words loaded before their stores
    for (int k0 = 0; k0 < sweeps; k0 += EPB) {
      uint2 w[EPB], sc[EPB], sh[EPB];
#pragma unroll
      for (int kk = 0; kk < EPB; ++kk) {
        const int vi = Map::aten_thread(i, 0) + kAtenThreads * (k0 + kk);
        const bool in = k0 + kk < sweeps && vi < V;
        w[kk] = in ? sx[vi] : make_uint2(0, 0);
        sc[kk] = !in     ? make_uint2(0, 0)
                 : MODVEC ? *reinterpret_cast<const uint2*>(srow + kVecElems * vi)
                          : load_mod_words(srow + kVecElems * vi);
        sh[kk] = !in     ? make_uint2(0, 0)
                 : MODVEC ? *reinterpret_cast<const uint2*>(hrow + kVecElems * vi)
                          : load_mod_words(hrow + kVecElems * vi);
      }
#pragma unroll
      for (int kk = 0; kk < EPB; ++kk) {
        const int vi = Map::aten_thread(i, 0) + kAtenThreads * (k0 + kk);
        if (k0 + kk < sweeps && vi < V)
          orow[vi] = make_uint2(layernorm_modulate_pair(w[kk].x, rs, sc[kk].x, sh[kk].x),
                                layernorm_modulate_pair(w[kk].y, rs, sc[kk].y, sh[kk].y));
      }
    }
  } else {
    for (int k = 0; k < sweeps; ++k) {
  #pragma unroll
      for (int j = 0; j < A; j += STEP) {
        const int vi = Map::aten_thread(i, j) + kAtenThreads * k;
        if (vi < V) {
          if constexpr (PAIRED) {
            const uint4 w = *reinterpret_cast<const uint4*>(sx + vi);
            uint4 sc, sh;
            if constexpr (MODVEC) {  // rows are 8-byte aligned: two word pairs
              const uint2 s0 = *reinterpret_cast<const uint2*>(srow + kVecElems * vi);
              const uint2 s1 = *reinterpret_cast<const uint2*>(srow + kVecElems * vi + 4);
              const uint2 h0 = *reinterpret_cast<const uint2*>(hrow + kVecElems * vi);
              const uint2 h1 = *reinterpret_cast<const uint2*>(hrow + kVecElems * vi + 4);
              sc = make_uint4(s0.x, s0.y, s1.x, s1.y);
              sh = make_uint4(h0.x, h0.y, h1.x, h1.y);
            } else {
              const uint2 s0 = load_mod_words(srow + kVecElems * vi), s1 = load_mod_words(srow + kVecElems * vi + 4);
              const uint2 h0 = load_mod_words(hrow + kVecElems * vi), h1 = load_mod_words(hrow + kVecElems * vi + 4);
              sc = make_uint4(s0.x, s0.y, s1.x, s1.y);
              sh = make_uint4(h0.x, h0.y, h1.x, h1.y);
            }
            *reinterpret_cast<uint4*>(orow + vi) =
                make_uint4(layernorm_modulate_pair(w.x, rs, sc.x, sh.x), layernorm_modulate_pair(w.y, rs, sc.y, sh.y),
                           layernorm_modulate_pair(w.z, rs, sc.z, sh.z), layernorm_modulate_pair(w.w, rs, sc.w, sh.w));
          } else {
            const uint2 w = sx[vi];
            const uint2 sc = MODVEC ? *reinterpret_cast<const uint2*>(srow + kVecElems * vi)
                                    : load_mod_words(srow + kVecElems * vi);
            const uint2 sh = MODVEC ? *reinterpret_cast<const uint2*>(hrow + kVecElems * vi)
                                    : load_mod_words(hrow + kVecElems * vi);
            orow[vi] = make_uint2(layernorm_modulate_pair(w.x, rs, sc.x, sh.x), layernorm_modulate_pair(w.y, rs, sc.y, sh.y));
          }
        }
      }
    }
  }
}

// Rows wider than 16384: aten's own layout (128 threads, 8-byte vectors), statistics in a first pass,
// the output in a second pass over x.
__global__ void __launch_bounds__(128) layernorm_modulate_stream(const Params p) {
  __shared__ VecWelford roots[4];
  __shared__ RowStats stats;
  const int t = static_cast<int>(threadIdx.x);
  const int64_t row = blockIdx.x;
  const uint16_t* xr = p.x + row * p.h;
  uint16_t* orow = p.out + row * p.h;

  VecWelford st;
  constexpr int U = 4;
  for (int k0 = 0; k0 * kAtenThreads < p.v; k0 += U) {
    uint2 w[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int vi = t + kAtenThreads * (k0 + u);
      if (vi < p.v) w[u] = *reinterpret_cast<const uint2*>(xr + kVecElems * vi);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int vi = t + kAtenThreads * (k0 + u);
      if (vi < p.v) st = push4(st, k0 + u, w[u]);
    }
  }
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) st = num::vec_welford_combine(st, shfl_down_state(st, o));
  if (t % kAtenWarp == 0) roots[t / kAtenWarp] = st;
  __syncthreads();
  if (t == 0) stats = finalize_roots(roots, p.h, p.eps);
  __syncthreads();
  const RowStats rs = stats;
  const int64_t b = p.seq_div.div(row), l = row - b * p.seq;
  for (int vi = t; vi < p.v; vi += kAtenThreads) {
    const int c = kVecElems * vi;
    *reinterpret_cast<uint2*>(orow + c) = modulate4_any(p, b, l, c, *reinterpret_cast<const uint2*>(xr + c), rs);
  }
}

// Streamed rows (DIFUSE_LNMOD_STREAMED=G, for measurement): gated_residual_layernorm_modulate on one block per SM
// that keeps loading while it computes. Why: the staged kernel's rows run in phase (ncu at cf12c4f and 64bd832,
// 1x4096x3072: DRAM 44 %, issue 0.49, 1.94 waves of 4 blocks per SM): every row of a wave loads, then computes,
// then stores at the same time, so DRAM idles while the SMs compute (a wave ~18 us against ~7 of loads and ~8.5 of
// issue). Here one producer warp streams each row's h and a into a ring of shared-memory slots with two bulk copies
// (sm_90's copy engine, completing on the slot's `full` mbarrier) while G consumer row groups of two warps each
// compute the rows that have landed and free their slots (`empty`). The block's rows are row = blockIdx.x + k *
// gridDim.x; row k takes slot k % slots and consumer group k % G. A consumer's arithmetic is the two-warp staged
// row's (the paired map, the residual pass with a from shared memory as SA, the Welford pushes with the count set
// after, aten's tree, the epilogue), with its own named barrier (1 + its group) where the staged kernel has a block
// barrier. Needs h, a, out and residual 16-byte aligned and H % 8 == 0 (bulk copies of whole rows; the paired map).
constexpr int kStreamMaxGroups = 14;  // named barriers 1..14; 32 + 64 x 14 = 928 threads
constexpr int kStreamMaxSlots = 32;

__device__ __forceinline__ void group_sync(int id) { asm volatile("bar.sync %0, 64;" ::"r"(id) : "memory"); }

// SMOD (MODVEC, [B, H] gate, scale and shift rows, B <= kStreamMaxModBatches): every batch's three modulation rows
// are copied into shared memory once per block, ahead of the ring, so a consumer's row reads no global memory. Without
// it (the first run at 82cc1bf) each row's gate and modulation loads went to L2 in 3 + 3 batches in turn: 44.2 us at
// 1x4096x3072 on 8 groups, 56.9 on 4, 41.7 on 12, against 39.0 for the staged kernel (knob-sweeps/82cc1bf/): the
// consumers waited on those round trips, not on the ring.
constexpr int kStreamMaxModBatches = 2;

// Rows whose width is a multiple of 512 (V % 128 == 0): every aten thread pushes `sweeps` vectors, so the two sides
// of each combine in aten's intra-warp tree hold equal counts (4 sweeps x 2^level) and its weights are the same in
// every thread: the host computes them once (num::equal_combine_weights) and the tree runs
// num::vec_welford_combine_equal without the reciprocal, the counts' arithmetic and the count's shuffle (the same
// bits: tests/cpu/test_numerics.cpp, Welford.EqualCountCombineIsTheSameBits). `uniform` = 0: the general combine.
// Since the thirty-ninth session (measured in the thirty-eighth) also where every aten warp's threads push the same number of vectors (V % 32 == 0,
// V >= 128: layernorm_schedule.h's warp_equal_counts, e.g. SD3.5's 2432, Sana's 1152): each warp's tree runs the equal
// combine with its own weights (`level` for warps below long_warps, `short_level` for the others, one vector fewer),
// and only finalize_roots' cross-warp combines stay general. kTreeWarpEqual; DIFUSE_LNMOD_WARP_TREE=0 keeps the
// general combine there (for measurement).
constexpr int kTreeGeneral = 0, kTreeEqual = 1, kTreeWarpEqual = 2;
struct StreamTree {
  int uniform;  // kTreeGeneral, kTreeEqual (V % 128 == 0) or kTreeWarpEqual
  num::EqualCombineWeights level[5];  // offsets 16, 8, 4, 2, 1
  num::EqualCombineWeights short_level[5];  // kTreeWarpEqual: the warps from long_warps on
  int long_warps;
  RootCombines roots;  // finalize_roots' equal-sided combines (none under kTreeGeneral)
  int read_fence;  // layernorm_streamed_rows' proxy fence before each release (stream_read_fence_knob; GRLN: always)
  int producer_lanes;  // stream_produce's lanes (DIFUSE_STREAM_PRODUCER_LANES through stream_producer_lanes; 1 default)
  int full_barriers;   // `full` mbarriers per slot (stream_full_barriers_for: 2; 1 under its knob where owned)
};

// The streamed rows' thread map: two-warp groups (G = 64) the paired map; one-warp groups (G = 32) the warp-local
// map (layernorm_schedule.h's AtenWarpLocalMap: aten's offset-16 and offset-1 steps in-thread, three shuffle steps of
// two slots), since the forty-fifth session; before it the paired map, whose tree shuffled all four slots at four
// offsets. Both load 16-byte pairs of vectors; only which pairs a lane holds differs.
template <int G>
using StreamRowMap = std::conditional_t<G == 32, AtenWarpLocalMap, AtenThreadMap<G, true>>;

// aten's intra-warp tree (offsets 16 .. 1) on states whose two sides are equal at every level (tree.uniform != 0):
// num::vec_welford_combine_equal with the host's weights, no reciprocal, no count arithmetic, no count shuffle.
// PER_WARP (kTreeWarpEqual): each slot takes its aten warp's weights (tree.level below tree.long_warps, else
// tree.short_level); otherwise every slot tree.level (kTreeEqual, the form verified since the seventeenth session).
template <class Map, bool PER_WARP, int A>
__device__ __forceinline__ void stream_equal_tree(VecWelford (&st)[A], int i, const StreamTree& tree) {
  auto weights = [&](int j, int lv) -> num::EqualCombineWeights {
    if constexpr (PER_WARP)
      return Map::aten_thread(i, j) / kAtenWarp < tree.long_warps ? tree.level[lv] : tree.short_level[lv];
    else
      return tree.level[lv];
  };
#pragma unroll
  for (int j = 0; j < A; ++j) st[j].count = weights(j, 0).count;
#pragma unroll
  for (int o = 16, lv = 0; o >= 1; o /= 2, ++lv) {
    const int delta = Map::lane_delta(o);
    if (delta > 0) {
#pragma unroll
      for (int j = 0; j < A; ++j) {
        if (!Map::receives(o, j)) continue;  // AtenWarpLocalMap's slots 2, 3 after offset 16
        const num::EqualCombineWeights w = weights(j, lv);
        VecWelford in;
        in.mean = __shfl_down_sync(0xffffffffu, st[j].mean, delta);
        in.sigma2 = __shfl_down_sync(0xffffffffu, st[j].sigma2, delta);
        in.count = w.count;
        st[j] = num::vec_welford_combine_equal(st[j], in, w);
      }
    } else {
#pragma unroll
      for (int j = 0; j < A; ++j)
        if (Map::receives(o, j))
          st[j] = num::vec_welford_combine_equal(st[j], st[Map::partner_slot(o, j)], weights(j, lv));
    }
  }
}

// A streamed row's statistics from its slots' pushed states st (counts not set): aten's warp tree (equal-count or
// general), the warp roots, the group's finalize, its broadcast.
template <int G = 64>
__device__ __forceinline__ RowStats stream_row_reduce(VecWelford (&st)[StreamRowMap<G>::kSlots], int i, int V,
                                                      int sweeps, const StreamTree tree, VecWelford (&roots)[4],
                                                      RowStats& stats, int bar_id, int h, float eps) {
  using Map = StreamRowMap<G>;
  constexpr int A = Map::kSlots;
  if (tree.uniform == kTreeEqual) {
    stream_equal_tree<Map, false>(st, i, tree);
  } else if (tree.uniform == kTreeWarpEqual) {
    stream_equal_tree<Map, true>(st, i, tree);
  } else {
#pragma unroll
    for (int jp = 0; jp < A; jp += 2) {  // slot jp + 1 is aten thread t + 1, with t's count (t and V are even)
      const int t = Map::aten_thread(i, jp);
      const int n = t < V ? min(sweeps, (V - t + kAtenThreads - 1) / kAtenThreads) : 0;
      st[jp].count = st[jp + 1].count = static_cast<float>(4 * n);
    }
#pragma unroll
    for (int o = 16; o >= 1; o /= 2) {
      const int delta = Map::lane_delta(o);
      if (delta > 0) {
#pragma unroll
        for (int j = 0; j < A; ++j)
          if (Map::receives(o, j)) st[j] = num::vec_welford_combine(st[j], shfl_down_state(st[j], delta));
      } else {
#pragma unroll
        for (int j = 0; j < A; ++j)
          if (Map::receives(o, j)) st[j] = num::vec_welford_combine(st[j], st[Map::partner_slot(o, j)]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < A; ++j) {
    const int t = Map::aten_thread(i, j);
    if (t % kAtenWarp == 0) roots[t / kAtenWarp] = st[j];
  }
  if constexpr (G == 64) group_sync(bar_id); else __syncwarp();
  if (i == 0) {
    if constexpr (G == 32)  // one-warp groups: the equal-sided cross-warp combines without a reciprocal
      stats = finalize_roots(roots, h, eps, tree.roots);
    else  // two-warp groups: the general form (with tree.roots, layernorm_streamed_rows<true, true, true, 64> spilled)
      stats = finalize_roots(roots, h, eps);
  }
  if constexpr (G == 64) group_sync(bar_id); else __syncwarp();
  return stats;
}

// The compile-time row shape of the full-sweep kernels (SW > 0): SW full sweeps of kAtenThreads vectors, then (PV > 0)
// one partial sweep of PV vectors (GRLN at 2432: SW = 4, PV = 96). SW = 0: the run-time kernels (V and sweeps from p).
template <int SW, int PV>
constexpr int kSweepRowV = SW * kAtenThreads + PV;
template <int SW, int PV>
constexpr int kSweepCount = SW + (PV > 0 ? 1 : 0);
// The kernels' vector tests stay written out, `(SW > 0 && (PV == 0 || k < SW)) || vi < V` (the old `SW > 0 || vi < V`
// at PV = 0): the same expression as a __forceinline__ helper changed the SASS of the run-time GRLN kernels too
// (scripts/sass-ops-diff.sh, forty-eighth session), kernels verified on GPUs in their present form.

// A streamed consumer group's row statistics from its slot sx (V vectors of 4 bf16; two warps, the paired map): the
// Welford pushes with the count set after them (the staged kernel's kCountAfter loop), then stream_row_reduce:
// aten's tree (equal-count weights from the host where tree.uniform), the warp roots in `roots` and one thread's
// finalize into `stats`, between the group's named barriers `bar_id`.
// G = 32 (one-warp groups): four slots per thread on the warp-local map (StreamRowMap: two pairs of adjacent aten
// threads, 16 apart in one aten warp), __syncwarp instead of the named barrier.
template <int G = 64, int SW = 0, int PV = 0>
__device__ __forceinline__ RowStats stream_row_stats(const uint2* sx, int i, int V, int sweeps, const StreamTree tree,
                                                     VecWelford (&roots)[4], RowStats& stats, int bar_id, int h,
                                                     float eps) {
  using Map = StreamRowMap<G>;
  constexpr int A = Map::kSlots;
  // full sweeps: every vector of the SW sweeps exists; PV > 0: then one partial sweep of PV vectors (tested)
  if constexpr (SW > 0) V = kSweepRowV<SW, PV>, sweeps = kSweepCount<SW, PV>;
  VecWelford st[A];
#pragma unroll (SW > 0 ? kSweepCount<SW, PV> : 2)
  for (int k = 0; k < sweeps; ++k) {
    const float* r = c_rcp.v + 4 * k;
    const int vi = Map::aten_thread(i, 0) + kAtenThreads * k;
    if ((SW > 0 && (PV == 0 || k < SW)) || vi < V) {  // slots 0, 1 (SW: every vector of the SW sweeps exists): aten threads t, t + 1, vectors vi, vi + 1
      const uint4 w4 = *reinterpret_cast<const uint4*>(sx + vi);
      const uint2 w[2] = {make_uint2(w4.x, w4.y), make_uint2(w4.z, w4.w)};
#pragma unroll
      for (int j = 0; j < 2; ++j) st[j] = push4_uncounted(st[j], r, w[j]);
    }
    if constexpr (A == 4) {  // G = 32: slots 2, 3, aten threads t + 16, t + 17 (AtenWarpLocalMap)
      const int vj = Map::aten_thread(i, 2) + kAtenThreads * k;
      if ((SW > 0 && (PV == 0 || k < SW)) || vj < V) {
        const uint4 w4 = *reinterpret_cast<const uint4*>(sx + vj);
        const uint2 w[2] = {make_uint2(w4.x, w4.y), make_uint2(w4.z, w4.w)};
#pragma unroll
        for (int j = 0; j < 2; ++j) st[2 + j] = push4_uncounted(st[2 + j], r, w[j]);
      }
    }
  }
  return stream_row_reduce<G>(st, i, V, sweeps, tree, roots, stats, bar_id, h, eps);
}

// A streamed consumer's bf16 epilogue for its row: out = LN(x) * (1 + scale) + shift from the slot sx, KB = 2 sweeps'
// modulation loaded before their stores. SMOD: the block's staged rows, sa = bf16(1 + scale)'s row and shift's after
// it (layernorm_modulate_pair_a); else scale and shift from global memory at srow, hrow (MODVEC: 8-byte words).
// FILL: the out-of-row vectors' registers zeroed (GRLN: without
// it ptxas spills 8-24 bytes there, and in the plain LayerNorms without SMOD); the plain LayerNorms with SMOD leave them
// unset (each is read only under the same test),
// 12 CS2R fewer per loop iteration.
template <bool MODVEC, bool SMOD, int G = 64, bool FILL = true, int SW = 0, int PV = 0>
__device__ __forceinline__ void stream_bf16_epilogue(const uint2* sx, int i, int V, int sweeps, RowStats rs,
                                                     const uint2* sa, const uint16_t* srow, const uint16_t* hrow,
                                                     uint2* orow) {
  using Map = StreamRowMap<G>;
  constexpr int KB = 2;
  // full sweeps: no vector test; PV > 0: then one partial sweep of PV vectors, tested
  if constexpr (SW > 0) V = kSweepRowV<SW, PV>, sweeps = kSweepCount<SW, PV>;
  auto pair_epilogue = [&](const int jp) {  // slots jp, jp + 1 (G = 32: 0 and 2)
    for (int k0 = 0; k0 < sweeps; k0 += KB) {
      uint4 w[KB], sc[KB], sh[KB];
  #pragma unroll
      for (int kk = 0; kk < KB; ++kk) {
        const int vi = Map::aten_thread(i, jp) + kAtenThreads * (k0 + kk);
        if (k0 + kk < sweeps && ((SW > 0 && (PV == 0 || k0 + kk < SW)) || vi < V)) {
          const int e = kVecElems * vi;
          w[kk] = *reinterpret_cast<const uint4*>(sx + vi);
          uint2 s0, s1, h0, h1;
          if constexpr (SMOD) {
            s0 = sa[vi], s1 = sa[vi + 1], h0 = sa[V + vi], h1 = sa[V + vi + 1];
          } else if constexpr (MODVEC) {
            s0 = *reinterpret_cast<const uint2*>(srow + e), s1 = *reinterpret_cast<const uint2*>(srow + e + 4);
            h0 = *reinterpret_cast<const uint2*>(hrow + e), h1 = *reinterpret_cast<const uint2*>(hrow + e + 4);
          } else {
            s0 = load_mod_words(srow + e), s1 = load_mod_words(srow + e + 4);
            h0 = load_mod_words(hrow + e), h1 = load_mod_words(hrow + e + 4);
          }
          sc[kk] = make_uint4(s0.x, s0.y, s1.x, s1.y);
          sh[kk] = make_uint4(h0.x, h0.y, h1.x, h1.y);
        } else if constexpr (FILL) {
          w[kk] = sc[kk] = sh[kk] = make_uint4(0, 0, 0, 0);
        }
      }
  #pragma unroll
      for (int kk = 0; kk < KB; ++kk) {
        const int vi = Map::aten_thread(i, jp) + kAtenThreads * (k0 + kk);
        if (k0 + kk < sweeps && ((SW > 0 && (PV == 0 || k0 + kk < SW)) || vi < V)) {
          if constexpr (SMOD)  // sc holds bf16(1 + scale) already (staged)
            *reinterpret_cast<uint4*>(orow + vi) = make_uint4(
                layernorm_modulate_pair_a(w[kk].x, rs, sc[kk].x, sh[kk].x),
                layernorm_modulate_pair_a(w[kk].y, rs, sc[kk].y, sh[kk].y),
                layernorm_modulate_pair_a(w[kk].z, rs, sc[kk].z, sh[kk].z),
                layernorm_modulate_pair_a(w[kk].w, rs, sc[kk].w, sh[kk].w));
          else
            *reinterpret_cast<uint4*>(orow + vi) = make_uint4(
                layernorm_modulate_pair(w[kk].x, rs, sc[kk].x, sh[kk].x), layernorm_modulate_pair(w[kk].y, rs, sc[kk].y, sh[kk].y),
                layernorm_modulate_pair(w[kk].z, rs, sc[kk].z, sh[kk].z), layernorm_modulate_pair(w[kk].w, rs, sc[kk].w, sh[kk].w));
        }
      }
    }
  };
  pair_epilogue(0);
  if constexpr (G == 32) pair_epilogue(2);
}

// The streamed consumers' (`consumers` threads) copy of the block's bf16 modulation rows into shared memory (SMOD):
// ROLES rows per staged batch, row (b, role) starting at src(b, role), copied as 8-byte words (MODVEC's alignment); the words of role
// SCALE_ROLE become bf16(1 + scale), the epilogue's a (the same add as layernorm_modulate_pair's), each by the thread
// that copied it; then the consumers' named barrier 15 (count 64 per group).
template <int ROLES, int SCALE_ROLE, class Src>
__device__ __forceinline__ void stage_bf16_mod_rows(uint2* mod, int64_t batches, int V, int t0, int consumers,
                                                    Src src) {
  const int n = static_cast<int>(ROLES * batches * V);
  for (int t = t0; t < n; t += consumers) {
    const int rowi = t / V, vi = t - rowi * V, b = rowi / ROLES, role = rowi - ROLES * b;
    cp_async(mod + t, src(b, role) + kVecElems * vi, false);
  }
  cp_async_wait_all();
  for (int t = t0; t < n; t += consumers) {
    if ((t / V) % ROLES == SCALE_ROLE) {
      const uint2 w = mod[t];
      mod[t] = make_uint2(num::bf16x2_add_rn(w.x, num::kBf16x2One), num::bf16x2_add_rn(w.y, num::kBf16x2One));
    }
  }
  asm volatile("bar.sync 15, %0;" ::"r"(consumers) : "memory");
}

// G = 32 (eighteenth session; GRLN's default up to H = 1536 since the nineteenth, stream_one_warp_groups): one-warp
// groups (four slots per thread: two 16-byte vectors per sweep), as layernorm_streamed_rows<..., 32>; for GRLN's
// narrow rows (2x4096x1536 33.8 us against a 27.4 ceiling at 83f6b5f, site bound 29.5; 33.1 vs 34.5 at e7993bf, 32.4
// as the default in ops.json at 79a9492). Exact on the H200 at e7993bf (test_streamed_variant, its =1 cases).
template <bool MODVEC, bool SMOD, int G = 64, int SW = 0, int PV = 0>
__global__ void __launch_bounds__(32 + 64 * kStreamMaxGroups, 1) grln_streamed_rows(const Params p, int slots, const StreamTree tree) {
  using Map = StreamRowMap<G>;
  constexpr int A = Map::kSlots;  // 2 (G = 64: one 16-byte vector per sweep and thread) or 4
  constexpr int KB = G == 64 ? 2 : 1;  // sweeps whose global loads are issued before their stores
  constexpr int kGroups = 64 * kStreamMaxGroups / G;
  // SMOD: batch b's gate, scale and shift rows at 3 b V vectors of 4 bf16; then the ring: slot s holds h's row at
  // 2 s V vectors past its start, a's row after it.
  extern __shared__ __align__(128) uint4 ring_smem[];  // 128-byte aligned: see kStreamRingAlign
  __shared__ uint64_t full[2 * kStreamMaxSlots], empty[kStreamMaxSlots];
  __shared__ VecWelford roots[kGroups][4];
  __shared__ RowStats stats[kGroups];

  const int tid = static_cast<int>(threadIdx.x);
  const int V = SW > 0 ? kSweepRowV<SW, PV> : p.v;  // SW (and PV): the launcher's p.v, as a constant
  const int sweeps = SW > 0 ? kSweepCount<SW, PV> : (V + kAtenThreads - 1) / kAtenThreads;
  const uint32_t row_bytes = static_cast<uint32_t>(p.h) * 2u;
  uint2* const mod = reinterpret_cast<uint2*>(ring_smem);
  const int64_t batches = SMOD ? p.rows / p.seq : 0;
  uint2* const ring = mod + 3 * batches * V;
  const int64_t stride = gridDim.x;
  stream_init_barriers(full, empty, slots, G);  // the only block barrier: then each role runs on its own

  if (tid < 32) {  // the producer warp: lane 0 (or tree.producer_lanes lanes) issues each row's two copies
    if (tid < tree.producer_lanes)
      stream_produce(
          p.rows, slots, full, empty, tree.full_barriers,
          [&](int64_t row, int s, uint64_t* bar) {
            uint2* const dst = ring + 2 * static_cast<int64_t>(s) * V;
            detail::mbar_arrive_expect_tx(bar, 2u * row_bytes);
            detail::bulk_load(dst, p.x + row * p.h, row_bytes, bar);
            detail::bulk_load(dst + V, p.a + row * p.h, row_bytes, bar);
          },
          tree.producer_lanes);
    return;
  }

  constexpr int kLog2G = G == 64 ? 6 : 5;
  const int c = (tid - 32) >> kLog2G;  // consumer group
  const int i = (tid - 32) & (G - 1);  // thread of the row
  const int groups = (static_cast<int>(blockDim.x) - 32) >> kLog2G;
  if constexpr (SMOD) {  // the consumers copy the modulation rows (8-byte words: MODVEC's alignment) while the
                         // producer's first copies are in flight, then wait for each other (named barrier 15)
    stage_bf16_mod_rows<3, 1>(mod, batches, V, tid - 32, G * groups, [&](int64_t b, int role) {
      return role == 0 ? p.gate + b * p.gate_stride : role == 1 ? p.scale + b * p.scale_stride : p.shift + b * p.shift_stride;
    });
  }
  int s = c % slots;
  uint32_t use = static_cast<uint32_t>(c / slots);
  for (int64_t row = blockIdx.x + c * stride; row < p.rows; row += groups * stride) {
    stream_wait_full(full, s, use, tree.full_barriers);
    uint2* const sx = ring + 2 * static_cast<int64_t>(s) * V;
    const uint2* const sa = sx + V;

    // h1 = h + gate * a (gated_residual_vec4, as the staged kernel), into the slot and out to `residual`.
    const int64_t bb = p.seq_div.div(row), ll = row - bb * p.seq;
    const uint16_t* grow = p.gate + bb * p.gate_stride + ll * p.gate_stride_l;
    const uint2* const sgate = mod + 3 * bb * V;  // SMOD: this batch's rows
    uint2* const rr = reinterpret_cast<uint2*>(p.residual + row * p.h);
    // kPushInResidual: each slot's Welford state is pushed as its h1 vectors are formed (stream_row_stats' order and
    // operations on the same values, so the same bits), not in a second pass over the slot: the two-warp rows' loops
    // 111 + 112 -> 208 SASS instructions per two sweeps (whole kernel <true, true, 64> 2584 -> 2471). The one-warp
    // rows keep the second pass: fused, their loop saved one instruction and the epilogue's grew by 9-12.
    constexpr bool kPushInResidual = G == 64;
    VecWelford st[A];
    for (int k0 = 0; k0 < sweeps; k0 += KB) {
      uint2 gw[KB][A];
#pragma unroll
      for (int kk = 0; kk < KB; ++kk) {
#pragma unroll
        for (int j = 0; j < A; ++j) {
          const int vi = Map::aten_thread(i, j) + kAtenThreads * (k0 + kk);
          const bool in = k0 + kk < sweeps && ((SW > 0 && (PV == 0 || k0 + kk < SW)) || vi < V);
          gw[kk][j] = !in ? make_uint2(0, 0) : SMOD ? sgate[vi] : load_gate_words<MODVEC>(grow + kVecElems * vi);
        }
      }
#pragma unroll
      for (int kk = 0; kk < KB; ++kk) {
#pragma unroll
        for (int jp = 0; jp < A; jp += 2) {
          const int vi = Map::aten_thread(i, jp) + kAtenThreads * (k0 + kk);  // slot jp + 1 is vi + 1 (V is even)
          if (k0 + kk < sweeps && ((SW > 0 && (PV == 0 || k0 + kk < SW)) || vi < V)) {
            const uint4 h = *reinterpret_cast<const uint4*>(sx + vi);
            const uint4 a = *reinterpret_cast<const uint4*>(sa + vi);
            const uint2 h0 = modulate::gated_residual_vec4(make_uint2(h.x, h.y), make_uint2(a.x, a.y), gw[kk][jp]);
            const uint2 h1 =
                modulate::gated_residual_vec4(make_uint2(h.z, h.w), make_uint2(a.z, a.w), gw[kk][jp + 1]);
            const uint4 o = make_uint4(h0.x, h0.y, h1.x, h1.y);
            *reinterpret_cast<uint4*>(sx + vi) = o;
            *reinterpret_cast<uint4*>(rr + vi) = o;
            if constexpr (kPushInResidual) {
              const float* r = c_rcp.v + 4 * (k0 + kk);
              st[jp] = push4_uncounted(st[jp], r, h0);
              st[jp + 1] = push4_uncounted(st[jp + 1], r, h1);
            }
          }
        }
      }
    }

    const RowStats rs = kPushInResidual
                            ? stream_row_reduce<G>(st, i, V, sweeps, tree, roots[c], stats[c], 1 + c, p.h, p.eps)
                            : stream_row_stats<G, SW, PV>(sx, i, V, sweeps, tree, roots[c], stats[c], 1 + c, p.h, p.eps);

    // The epilogue (SMOD: the staged bf16(1 + scale) and shift rows after the gate's).
    stream_bf16_epilogue<MODVEC, SMOD, G, true, SW, PV>(sx, i, V, sweeps, rs, sgate + V, p.scale + bb * p.scale_stride + ll * p.scale_stride_l,
                                       p.shift + bb * p.shift_stride + ll * p.shift_stride_l,
                                       reinterpret_cast<uint2*>(p.out + row * p.h));
    stream_release(empty, s, use, groups, slots);  // every read and write of the slot by this thread is done
  }
}

// Streamed rows for the plain LayerNorms (layernorm_modulate in bf16, Wan's layernorm_modulate_fp32 and
// layernorm_affine_fp32; the default for many rows since the eighteenth session, plain_streamed_by_default_or_knob). The schedule of grln_streamed_rows for a row without the residual: the
// producer bulk-copies each row's x into a ring slot, G two-warp groups run the staged row's statistics (the paired
// map) and the epilogue (GRLN's bf16 one, or Wan's fp32 f32_chain4); with SMOD the [B, H] modulation rows (B <=
// kStreamMaxModBatches, or the affine weight and bias: one row each) are staged in shared memory once per block (bf16
// scale words as bf16(1 + scale)). Why: at 1x32760x5120 the fp32 four-warp staged rows run 211 us against a streaming
// ceiling of 160 (ops.json at faab412; target 198), at 1x32760x1536 the one-warp rows 88.8 against 50.5, and FLUX's
// single-stream layernorm_modulate (1x4608x3072, 38 calls a step) 26 us against ~17.6, where GRLN's streamed kernel
// went from 1.41x to 1.22x the ceiling. Predicted ~190-195, ~60-65 and ~21 us; measured at e831f9c 181.8, 65.4 and
// 23.9 (the fp32 epilogue kept up better than predicted; FLUX's rows have 8 rows per group per block at most). It shares grln_streamed_rows'
// producer loop, row statistics and bf16 epilogue (stream_produce, stream_row_stats, stream_bf16_epilogue above).
// The number of scale / shift row pairs the streamed LayerNorm kernel stages (SMOD): one where they have no batch
// stride (the affine weight and bias, or one batch), else one per batch.
__host__ __device__ inline int64_t staged_mod_batches(const Params& p) {
  return p.scale_stride == 0 && p.shift_stride == 0 ? 1 : p.rows / p.seq;
}

// The plain LayerNorms' ring under DIFUSE_STREAM_FULL_BARRIERS=1 (owned_stream_rings): at most 48 slots instead of
// kStreamMaxSlots' 32, so that at Wan 1.3B's 1536 the 24 one-warp groups own two slots each (one `full` barrier per
// slot, stream_full_barriers) and 24 slots stay free for copies in flight while the groups compute. H200 at c254364
// (rev-bench/9e826cd/, experiment patches), layernorm_modulate 1x32760x1536: 32 slots on two barriers 73.1 / 73.2
// us, 48 on two 72.3 / 72.4, 48 on one 67.7 / 67.5 (two rounds each; 1 us less at 2x4096x1536, the same elsewhere).
// But at aa41dda (rev-bench/aa41dda/) the knob gains nothing: the defaults (32 slots, two barriers) take 69.7 / 69.6
// us there and the knob 69.7 (fulls1/); 9e826cd's kernels 73.1 / 72.9 and aa41dda with two barriers in two arrays
// (bench/experiments/full-barriers-split.patch, not taken by default: a compare and a select more) 73.2 / 73.0. The
// 5-6 us of c254364's experiments were the code's form (its instruction schedule), not the barrier count.
constexpr int kStreamLnMaxSlots = 48;

// The LayerNorms' and GRLN's dynamic shared memory (the staged modulation rows, then the ring) starts on a 128-byte
// line (`extern __shared__ __align__(128)`). With the extern array's default 16-byte alignment it followed the static
// variables 16-64 B past a line (ptxas' static smem 1552-2496 B, scripts/kernel-resources.sh), and so did every slot
// (slot and staged-row sizes are multiples of 128 B), so every bulk copy into a slot straddled lines; rms_norm's,
// rms_norm_modulate's and the probe's rings (static 1152 / 1536 B) were already aligned. ptxas counts the padding
// in the static size the budget subtracts; kStreamRingAlign more bytes are left free, as in the form measured.
// H200, rev-bench/aa41dda/ (two rounds; aa41dda with bench/experiments/ln-ring-align-128.patch against aa41dda):
// layernorm_modulate 1x32760x5120 184.2 / 184.6 -> 179.8 / 179.5 us, 2x4096x3072 34.3 / 34.6 -> 33.6 / 33.8,
// 1x32760x1536 69.7 / 69.6 -> 69.9 / 69.8, 2x4096x1536 22.8 / 22.9 -> 22.8 / 22.8; 0 mismatches.
constexpr int kStreamRingAlign = 128;
constexpr int kStreamLnMaxGroups = 12;  // 800 threads: 80 registers (at 14 groups' 64 the fp32 epilogue spilled)

// F32: Wan's fp32 chains (VEC: the fp32 rows are 16-byte aligned, float4 loads); else layernorm_modulate in bf16
// (VEC: the modulation rows are 8-byte aligned words, MODVEC), whose staged scale words hold bf16(1 + scale).
// A streamed consumer's fp32 epilogue (Wan's chain, f32_chain4) for the vectors t + 128 k and t + 1 + 128 k of its
// row (t = aten thread `t`, the first of a pair of adjacent slots), KB sweeps' fp32 rows loaded before their stores.
template <bool VEC4, int KB, bool AFFINE, bool A_FORMED, int SW>
__device__ __forceinline__ void stream_f32_epilogue_batch(const uint2* sx, int t, int k0, int V, int sweeps,
                                                          RowStats rs, const float* s32, const float* h32,
                                                          uint2* orow) {
  uint4 w[KB];
  float sc[KB][2][4], sh[KB][2][4];
#pragma unroll
  for (int kk = 0; kk < KB; ++kk) {
    const int vi = t + kAtenThreads * (k0 + kk);  // and vi + 1 (V is even)
    if (k0 + kk < sweeps && (SW > 0 || vi < V)) {
      w[kk] = *reinterpret_cast<const uint4*>(sx + vi);
      load_f32_rows4<VEC4>(s32, h32, kVecElems * vi, sc[kk][0], sh[kk][0]);
      load_f32_rows4<VEC4>(s32, h32, kVecElems * (vi + 1), sc[kk][1], sh[kk][1]);
    }
  }
#pragma unroll
  for (int kk = 0; kk < KB; ++kk) {
    const int vi = t + kAtenThreads * (k0 + kk);
    if (k0 + kk < sweeps && (SW > 0 || vi < V)) {
      const uint2 o0 = f32_chain4_t<AFFINE, A_FORMED>(make_uint2(w[kk].x, w[kk].y), rs, sc[kk][0], sh[kk][0]);
      const uint2 o1 = f32_chain4_t<AFFINE, A_FORMED>(make_uint2(w[kk].z, w[kk].w), rs, sc[kk][1], sh[kk][1]);
      *reinterpret_cast<uint4*>(orow + vi) = make_uint4(o0.x, o0.y, o1.x, o1.y);
    }
  }
}

// SW > 0 (the full-sweep kernels, full_sweeps_for): V = SW x kAtenThreads, every vector of the SW sweeps exists, no
// vector is tested; the loop is kept rolled (unrolled, layernorm_streamed_rows<true, true, true, 32, 3> spilled 4 B).
template <bool VEC4, int KB, bool AFFINE, bool A_FORMED, int SW = 0>
__device__ __forceinline__ void stream_f32_epilogue(const uint2* sx, int t, int V, int sweeps, RowStats rs,
                                                    const float* s32, const float* h32, uint2* orow) {
  if constexpr (SW > 0) {
#pragma unroll 1
    for (int k0 = 0; k0 < SW; k0 += KB)
      stream_f32_epilogue_batch<VEC4, KB, AFFINE, A_FORMED, SW>(sx, t, k0, SW * kAtenThreads, SW, rs, s32, h32, orow);
  } else {
    for (int k0 = 0; k0 < sweeps; k0 += KB)
      stream_f32_epilogue_batch<VEC4, KB, AFFINE, A_FORMED, 0>(sx, t, k0, V, sweeps, rs, s32, h32, orow);
  }
}

// G = 32 (eighteenth session; the plain LayerNorms' default up to H = 4096 since the nineteenth,
// stream_one_warp_groups; exact on the H200 at e7993bf and, as the default, in the whole suite at 79a9492): one-warp
// groups on the same paired map (four slots per thread, stream_row_stats<32>), twice as many groups for the same threads.
// Why: narrow rows are the two-warp groups' weak spot (1x32760x1536 65.5 us against a 50.9 ceiling, 2x4096x1536
// 24.1 against 16.3, at 83f6b5f), where a row's fixed cost (two named-barrier waits, the finalize, the release)
// weighs most, and the staged kernels' one-warp rows beat their two-warp rows there (80.2 vs 87.3 us at 132f46f).
// Predicted ~58 and ~21 us.
template <bool F32, bool VEC, bool SMOD, int G = 64, int SW = 0>
__global__ void __launch_bounds__(32 + 64 * kStreamLnMaxGroups, 1)
    layernorm_streamed_rows(const Params p, int slots, const StreamTree tree) {
  using Map = StreamRowMap<G>;
  constexpr int kGroups = G == 64 ? kStreamMaxGroups : 64 * kStreamLnMaxGroups / G;  // G = 64: the verified layout
  // sweeps whose rows are read before their stores (2 spilled: fp32 from global memory; and at G = 32, 72 bytes)
  constexpr int KB = (SMOD || !F32) && G == 64 ? 2 : 1;
  // SMOD: staged batch b's scale row, then its shift row (F32: H floats each; bf16: V words of 4); then the ring.
  extern __shared__ __align__(128) uint4 ring_smem[];  // 128-byte aligned: see kStreamRingAlign
  __shared__ uint64_t full[2 * kStreamLnMaxSlots], empty[kStreamLnMaxSlots];
  __shared__ VecWelford roots[kGroups][4];
  __shared__ RowStats stats[kGroups];

  const int tid = static_cast<int>(threadIdx.x);
  const int V = SW > 0 ? SW * kAtenThreads : p.v;  // SW: the launcher's p.v, as a constant
  const int sweeps = SW > 0 ? SW : (V + kAtenThreads - 1) / kAtenThreads;
  const uint32_t row_bytes = static_cast<uint32_t>(p.h) * 2u;
  float* const mod32 = reinterpret_cast<float*>(ring_smem);
  uint2* const mod16 = reinterpret_cast<uint2*>(ring_smem);
  const int64_t nb = SMOD ? staged_mod_batches(p) : 0;
  uint2* const ring = F32 ? reinterpret_cast<uint2*>(mod32 + 2 * nb * p.h) : mod16 + 2 * nb * V;
  const int64_t stride = gridDim.x;
  stream_init_barriers(full, empty, slots, G);  // the only block barrier

  if (tid < 32) {  // the producer warp: lane 0 copies each row's x once its slot is free
    if (tid < tree.producer_lanes)
      stream_produce(
          p.rows, slots, full, empty, tree.full_barriers,
          [&](int64_t row, int s, uint64_t* bar) {
            detail::mbar_arrive_expect_tx(bar, row_bytes);
            detail::bulk_load(ring + static_cast<int64_t>(s) * V, p.x + row * p.h, row_bytes, bar);
          },
          tree.producer_lanes);
    return;
  }

  constexpr int kLog2G = G == 64 ? 6 : 5;
  const int c = (tid - 32) >> kLog2G;
  const int i = (tid - 32) & (G - 1);
  const int groups = (static_cast<int>(blockDim.x) - 32) >> kLog2G;
  if constexpr (SMOD && F32) {  // the consumers copy the fp32 rows (16-byte pieces: VEC), then wait for each other
    const int q = p.h / 4;  // float4 pieces per row
    const int n = static_cast<int>(2 * nb * q);
    for (int t = tid - 32; t < n; t += G * groups) {
      const int rowi = t / q, e = 4 * (t - rowi * q), b = rowi / 2;
      const float* src = (rowi % 2 == 0 ? p.scale32 + b * p.scale_stride : p.shift32 + b * p.shift_stride) + e;
      cp_async(mod32 + 4 * static_cast<int64_t>(t), src, true);
    }
    cp_async_wait_all();
    if (G == 32 && !p.affine32)  // this thread's own pieces of the scale rows become RN(1 + scale), the chain's
                                 // first add (the one-warp epilogue's A_FORMED chain; the two-warp loop adds it)
      for (int t = tid - 32; t < n; t += G * groups)
        if ((t / q) % 2 == 0) {
          float4* const v = reinterpret_cast<float4*>(mod32) + t;
          *v = make_float4(num::add_rn(v->x, 1.0f), num::add_rn(v->y, 1.0f), num::add_rn(v->z, 1.0f),
                           num::add_rn(v->w, 1.0f));
        }
    asm volatile("bar.sync 15, %0;" ::"r"(G * groups) : "memory");
  } else if constexpr (SMOD) {  // bf16 rows as 8-byte words (VEC); scale's become bf16(1 + scale), as in GRLN's
    stage_bf16_mod_rows<2, 0>(mod16, nb, V, tid - 32, G * groups, [&](int64_t b, int role) {
      return role == 0 ? p.scale + b * p.scale_stride : p.shift + b * p.shift_stride;
    });
  }
  int s = c % slots;
  uint32_t use = static_cast<uint32_t>(c / slots);
  for (int64_t row = blockIdx.x + c * stride; row < p.rows; row += groups * stride) {
    stream_wait_full(full, s, use, tree.full_barriers);
    const uint2* const sx = ring + static_cast<int64_t>(s) * V;
    const RowStats rs = stream_row_stats<G, SW>(sx, i, V, sweeps, tree, roots[c], stats[c], 1 + c, p.h, p.eps);
    const int64_t b = p.seq_div.div(row), l = row - b * p.seq;
    uint2* const orow = reinterpret_cast<uint2*>(p.out + row * p.h);
    if constexpr (!F32)  // bf16 (SMOD: this batch's staged bf16(1 + scale) and shift rows)
      stream_bf16_epilogue<VEC, SMOD, G, !SMOD, SW>(sx, i, V, sweeps, rs, mod16 + 2 * (nb == 1 ? 0 : b) * V,
                                      p.scale + b * p.scale_stride + l * p.scale_stride_l,
                                      p.shift + b * p.shift_stride + l * p.shift_stride_l, orow);
    if constexpr (F32) {  // Wan's fp32 epilogue
      const float* const s32 = SMOD ? mod32 + 2 * (nb == 1 ? 0 : b) * p.h
                                    : p.scale32 + b * p.scale_stride + l * p.scale_stride_l;
      const float* const h32 = SMOD ? s32 + p.h : p.shift32 + b * p.shift_stride + l * p.shift_stride_l;
      if constexpr (G == 32) {  // two pairs of slots; the chain chosen once per row
        if (p.affine32) {
          stream_f32_epilogue<VEC || SMOD, KB, true, false, SW>(sx, Map::aten_thread(i, 0), V, sweeps, rs, s32, h32, orow);
          stream_f32_epilogue<VEC || SMOD, KB, true, false, SW>(sx, Map::aten_thread(i, 2), V, sweeps, rs, s32, h32, orow);
        } else {
          stream_f32_epilogue<VEC || SMOD, KB, false, SMOD, SW>(sx, Map::aten_thread(i, 0), V, sweeps, rs, s32, h32, orow);
          stream_f32_epilogue<VEC || SMOD, KB, false, SMOD, SW>(sx, Map::aten_thread(i, 2), V, sweeps, rs, s32, h32, orow);
        }
      } else {  // the verified two-warp kernel's loop, kept inline (as a call its SASS changed and spilled 8 bytes)
        for (int k0 = 0; k0 < sweeps; k0 += KB) {
          uint4 w[KB];
          float sc[KB][2][4], sh[KB][2][4];
#pragma unroll
          for (int kk = 0; kk < KB; ++kk) {
            const int vi = Map::aten_thread(i, 0) + kAtenThreads * (k0 + kk);  // and vi + 1 (V is even)
            if (k0 + kk < sweeps && vi < V) {
              w[kk] = *reinterpret_cast<const uint4*>(sx + vi);
              load_f32_rows4<VEC || SMOD>(s32, h32, kVecElems * vi, sc[kk][0], sh[kk][0]);
              load_f32_rows4<VEC || SMOD>(s32, h32, kVecElems * (vi + 1), sc[kk][1], sh[kk][1]);
            }
          }
#pragma unroll
          for (int kk = 0; kk < KB; ++kk) {
            const int vi = Map::aten_thread(i, 0) + kAtenThreads * (k0 + kk);
            if (k0 + kk < sweeps && vi < V) {
              const uint2 o0 = f32_chain4(make_uint2(w[kk].x, w[kk].y), rs, sc[kk][0], sh[kk][0], p.affine32);
              const uint2 o1 = f32_chain4(make_uint2(w[kk].z, w[kk].w), rs, sc[kk][1], sh[kk][1], p.affine32);
              *reinterpret_cast<uint4*>(orow + vi) = make_uint4(o0.x, o0.y, o1.x, o1.y);
            }
          }
        }
      }
    }
    stream_release(empty, s, use, groups, slots, tree.read_fence != 0);  // the slot was only read
  }
}

// DIFUSE_LNMOD_STREAMED=G (read once; for measurement): the streamed kernel wherever it can run, with G consumer
// groups (1: kStreamDefaultGroups; at most the kernel's launch bound, kStreamMaxGroups for GRLN and
// kStreamLnMaxGroups for the plain LayerNorms, and no more than the ring's slots); =0: never (the
// staged kernels); unset: the default rules (streamed_by_default_or_knob for GRLN,
// plain_streamed_by_default_or_knob for the plain LayerNorms). DIFUSE_LNMOD_STREAMED_BLOCKS=N
// caps the grid at N blocks (tests and the sanitizer: many rows per block, every slot refilled, at small shapes).
// 12 groups: H200 at 0bdc6e6 (knob-sweeps/0bdc6e6/) 1x4096x3072 34.2 us on 12, 35.6 on 8, 38.6 on 6; 2x4096x1536
// 38.0, 40.6, 45.9.
constexpr int kStreamDefaultGroups = 12;
int streamed_groups_knob() {
  static const int v = detail::env_knob_or("DIFUSE_LNMOD_STREAMED", -1);
  return v;
}

// What a streamed kernel's launcher sets or reads once per device: the dynamic shared memory a block may take (the
// opt-in maximum per block less the kernel's static shared memory), the opt-in and the carveout.
struct StreamLaunchOnce {
  std::atomic<int> budgets[detail::kMaxDevices];  // 0: not read yet
  std::atomic<uint64_t> opted_in{0}, carveout_set{0};
};

// DIFUSE_LNMOD_WARP_TREE (read once; for measurement): 1 or unset, the streamed LayerNorms' warp trees run the equal
// combine wherever each aten warp's counts are equal (kTreeWarpEqual); 0, the general combine where the counts differ
// between warps (the form before the thirty-eighth session).
inline bool warp_equal_tree_knob() {
  static const int v = detail::env_knob_or("DIFUSE_LNMOD_WARP_TREE", 1);
  return v != 0;
}

// DIFUSE_LNMOD_EQUAL_ROOTS (read once; for measurement): 1 or unset, the one-warp streamed rows' finalize runs its
// equal-sided cross-warp combines without a reciprocal (tree.roots, thirty-eighth session); 0, every one general.
inline bool equal_root_combines_knob() {
  static const int v = detail::env_knob_or("DIFUSE_LNMOD_EQUAL_ROOTS", 1);
  return v != 0;
}

// Launches a streamed kernel (grln_streamed_rows or layernorm_streamed_rows) with the most slots of slot_bytes that fit
// beside mod_bytes of staged modulation rows (at most max_slots) and DIFUSE_LNMOD_STREAMED's groups (at most
// max_groups, its launch bound, and the slots), where the ring holds at least two rows; false (nothing launched)
// otherwise. One block per SM (DIFUSE_LNMOD_STREAMED_BLOCKS=N caps the grid); the tree's weights where H % 512 == 0.
template <class Kernel>
bool launch_stream(Kernel kernel, StreamLaunchOnce& once, int max_slots, int max_groups, int64_t slot_bytes,
                   int64_t mod_bytes, const Params& p, int device, cudaStream_t stream, int group_threads = 64) {
  const int budget = stream_smem_budget(kernel, device, once.budgets) - kStreamRingAlign;  // room for the alignment
  const int slots = static_cast<int>(std::min<int64_t>(max_slots, (budget - mod_bytes) / slot_bytes));
  const int knob = streamed_groups_knob();
  const int default_groups = kStreamDefaultGroups * 64 / group_threads;  // the same consumer warps
  const int groups = std::min(std::min(knob <= 1 ? default_groups : knob, max_groups), slots);
  if (slots < 2 || groups < 1) return false;
  opt_in_shared_memory(kernel, device, budget, once.opted_in);
  prefer_max_shared_carveout(kernel, device, once.carveout_set);
  static const int max_blocks = detail::positive_env_knob("DIFUSE_LNMOD_STREAMED_BLOCKS");
  int64_t blocks = std::min<int64_t>(detail::sm_count(device), p.rows);
  if (max_blocks > 0) blocks = std::min<int64_t>(blocks, max_blocks);
  StreamTree tree{};
  tree.uniform = p.v % kAtenThreads == 0                         ? kTreeEqual
                 : warp_equal_counts(p.v) && warp_equal_tree_knob() ? kTreeWarpEqual
                                                                    : kTreeGeneral;
  tree.read_fence = stream_read_fence_knob() ? 1 : 0;
  tree.producer_lanes = stream_producer_lanes(stream_producer_lanes_knob(), slots, groups);
  tree.full_barriers = stream_full_barriers_for(slots, groups);
  const int sweeps = (p.v + kAtenThreads - 1) / kAtenThreads;
  const WarpEqualCounts counts = warp_equal_counts_of(p.v);
  tree.long_warps = counts.long_warps;
  if (tree.uniform != kTreeGeneral && equal_root_combines_knob())
    tree.roots = root_combines(counts);  // else every cross-warp combine general (eq* = 0)
  for (int lv = 0; lv < 5; ++lv) {
    tree.level[lv] = num::equal_combine_weights(static_cast<float>((4 * sweeps) << lv));
    if (tree.uniform == kTreeWarpEqual)  // sweeps >= 2 there (V >= 128 and V % 128 != 0)
      tree.short_level[lv] = num::equal_combine_weights(static_cast<float>(warp_leaf_count(counts, 3) << lv));
  }
  kernel<<<static_cast<unsigned>(blocks), 32 + group_threads * groups,
           static_cast<size_t>(slots * slot_bytes + mod_bytes), stream>>>(p, slots, tree);
  return true;
}

// GRLN's streamed kernel: slots of h's and a's rows; SMOD: 3 bf16 rows per batch.
template <bool MODVEC, bool SMOD, int G = 64, int SW = 0, int PV = 0>
bool launch_streamed(const Params& p, int device, cudaStream_t stream) {
  static StreamLaunchOnce once;
  return launch_stream(grln_streamed_rows<MODVEC, SMOD, G, SW, PV>, once, kStreamMaxSlots, 64 * kStreamMaxGroups / G,
                       int64_t{4} * p.h,
                       SMOD ? 3 * (p.rows / p.seq) * int64_t{2} * p.h : 0, p, device, stream, G);
}

// The plain LayerNorms' streamed kernel: slots of x's rows; SMOD: 2 rows per staged batch (fp32 or bf16).
template <bool F32, bool VEC, bool SMOD, int G = 64, int SW = 0>
bool launch_streamed_ln(const Params& p, int device, cudaStream_t stream) {
  // stream_row_stats takes its Welford reciprocals from c_rcp, which covers kMaxStagedSweeps sweeps (H <= 24576):
  // wider rows (the plain LayerNorm's predicate takes them) go to the two-pass kernel of launch<>
  if ((p.v + kAtenThreads - 1) / kAtenThreads > kMaxStagedSweeps) return false;
  static StreamLaunchOnce once;
  return launch_stream(layernorm_streamed_rows<F32, VEC, SMOD, G, SW>, once,
                       owned_stream_rings() ? kStreamLnMaxSlots : kStreamMaxSlots,
                       64 * kStreamLnMaxGroups / G, int64_t{2} * p.h, SMOD ? 2 * staged_mod_batches(p) * int64_t{F32 ? 4 : 2} * p.h : 0, p, device,
                       stream, G);
}

// One-warp consumer groups (G = 32: 24 groups, GRLN up to 28, four slots per thread; the warp-local map since the
// forty-fifth session, StreamRowMap) instead of 12 two-warp groups, by width (stream_one_warp_groups, the default since the nineteenth session). H200 at e7993bf
// (knob-sweeps/e7993bf/, DIFUSE_LNMOD_STREAM_WARP=1 against the default of the same run, both streamed):
// layernorm_modulate 1x4096x3072 19.2 us vs 22.2, 1x4608x3072 22.1 vs 24.1, 2x4096x1536 22.5 vs 24.1, 2x4096x3072
// 36.1 vs 36.7, 1x4096x4096 27.0 vs 27.4, 1x32760x1536 64.9 vs 65.2, but 1x32760x5120 183.6 vs 181.2;
// layernorm_modulate_fp32 1x32760x1536 70.3 vs 80.9, but 1x32760x5120 186.6 vs 181.8 (predicted ~58 and ~21 us at
// 32760x1536 and 2x4096x1536: the per-row fixed cost halves; it did at 3072, not as much at 1536 in bf16). GRLN,
// whose rows carry h, a and three modulation rows: 2x4096x1536 33.1 vs 34.5, but 1x4096x3072 34.5 vs 33.6 and
// 2x4096x2432 52.4 vs 50.5. The affine fp32 LayerNorm shares the plain kernel and takes the plain rule (unmeasured
// apart). DIFUSE_LNMOD_STREAM_WARP=1 (read once; for measurement) everywhere, =0 nowhere.
constexpr int64_t kStreamWarpMaxWidth = 4096;
constexpr int64_t kGrlnStreamWarpMaxWidth = 1536;
int stream_warp_knob() {
  static const int v = detail::env_knob_or("DIFUSE_LNMOD_STREAM_WARP", -1);
  return v;
}

// Full sweeps at compile time (forty-sixth session): the streamed kernels with staged modulation rows at H = 1536
// and 3072 (V = 384 and 768: three and six full sweeps of aten's 128 threads; Wan 2.1 1.3B's LayerNorms, fp32 and
// bf16, and GRLN's one-warp rows at 1536; FLUX's and Qwen-Image's 3072, the plain LayerNorms' one-warp rows and GRLN's
// two-warp rows) are instantiated with SW = 3 and 6, so their Welford and epilogue loops run constant trip counts
// (unrolled where registers allow), their reciprocals come from constant offsets and no vector is tested against V
// (each exists). The same operations in the same order per slot; only the tests and the loop and index arithmetic
// go. DIFUSE_LNMOD_FULL_SWEEPS=0 (read once; for measurement) keeps the run-time kernels (SW = 0) everywhere.
inline bool full_sweeps_knob() {
  static const int v = detail::env_knob_or("DIFUSE_LNMOD_FULL_SWEEPS", 1);
  return v != 0;
}

// The full-sweep count SW of the kernel for rows of V vectors with staged modulation rows (smod), 0 for the run-time
// kernel: 3 at V = 384, 6 at V = 768, 10 at V = 1280 (the bf16 LayerNorm's two-warp rows only; elsewhere the callers
// take the run-time kernel), unless DIFUSE_LNMOD_FULL_SWEEPS=0.
inline int full_sweeps_for(int64_t v, bool smod) {
  if (!smod || !full_sweeps_knob()) return 0;
  return v == 3 * kAtenThreads ? 3 : v == 6 * kAtenThreads ? 6 : v == 10 * kAtenThreads ? 10 : 0;
}

// Whether GRLN's two-warp rows of V vectors with staged modulation rows take the kernel of four full sweeps and a
// partial fifth of 96 vectors (grln_streamed_rows<true, true, 64, 4, 96>): SD3.5-large's H = 2432, V = 608 (forty-eighth
// session), unless DIFUSE_LNMOD_FULL_SWEEPS=0. The first four sweeps untested, the fifth tested as in the run-time
// kernel; the same operations in the same order per slot.
inline bool partial_sweeps_2432(int64_t v) { return v == kSweepRowV<4, 96> && full_sweeps_knob(); }

// f(std::integral_constant<int, SW>{}) for SW = 0, 3 or 6 (any other count: 0): the run-time count becomes the
// kernel's template argument (the one-warp rows').
template <class F>
decltype(auto) with_full_sweeps(int sw, F&& f) {
  switch (sw) {
    case 3: return f(std::integral_constant<int, 3>{});
    case 6: return f(std::integral_constant<int, 6>{});
    default: return f(std::integral_constant<int, 0>{});
  }
}

// The plain LayerNorms' streamed kernel for these rows: smod (the staged rows) or vec (8-byte bf16 words / 16-byte
// fp32 vectors) or neither, on two-warp groups or (stream_one_warp_groups) one-warp ones.
template <bool F32>
bool launch_streamed_ln_rows(const Params& p, bool smod, bool vec, int device, cudaStream_t stream) {
  if (stream_one_warp_groups(false, p.h, stream_warp_knob()))
    return smod  ? with_full_sweeps(full_sweeps_for(p.v, true), [&](auto sw) {
                     return launch_streamed_ln<F32, true, true, 32, decltype(sw)::value>(p, device, stream);
                   })
           : vec ? launch_streamed_ln<F32, true, false, 32>(p, device, stream)
                 : launch_streamed_ln<F32, false, false, 32>(p, device, stream);
  // SW = 10 (5120) for bf16 only: the fp32 kernel was slower (H100 at 94 SMs, forty-eighth session: 1x32760x5120
  // 268.5 us against 247.9 before it and 252.1 under DIFUSE_LNMOD_FULL_SWEEPS=0), so fp32 rows take SW = 0 there.
  if constexpr (!F32) {
    if (smod && full_sweeps_for(p.v, true) == 10) return launch_streamed_ln<false, true, true, 64, 10>(p, device, stream);
  }
  return smod  ? launch_streamed_ln<F32, true, true>(p, device, stream)
         : vec ? launch_streamed_ln<F32, true, false>(p, device, stream)
               : launch_streamed_ln<F32, false, false>(p, device, stream);
}

constexpr size_t kMaxStagedBytes = 72 * 1024;  // dynamic staging per block: (8+2) x 6 KB, (4+2) x 12 KB, 1 x 48 KB

template <int G, bool PAIRED, bool MODVEC, bool RESIDUAL, int MINB = 1, int EPB = 1, bool SA = false,
          bool SALL = false>
void launch_rows(const Params& p, int device, cudaStream_t stream) {
  constexpr int ROWS = G == 128 ? 1 : 256 / G;
  auto kernel = layernorm_modulate_rows<G, PAIRED, MODVEC, RESIDUAL, false, MINB, EPB, SA, SALL>;
  // 48 KB of dynamic shared memory plus the kernel's static part needs the opt-in, once per device.
  static std::atomic<uint64_t> opted_in{0};
  opt_in_shared_memory(kernel, device, static_cast<int>(kMaxStagedBytes), opted_in);
  const int64_t blocks = (p.rows + ROWS - 1) / ROWS;
  // x rows, then (staging kernels) the scale and shift rows and (SA) a's rows; SALL's one row each of h, a, gate,
  // scale and shift
  const int staged_rows = SALL ? kStageAllRows : ROWS + (ROWS > 1 && MODVEC && MINB < 8 ? 2 : 0) + (SA ? ROWS : 0);
  const size_t smem = static_cast<size_t>(staged_rows) * p.v * sizeof(uint2);
  kernel<<<static_cast<unsigned>(blocks), G * ROWS, smem, stream>>>(p);
}

// VEC4: the fp32 modulation (or affine) rows are 16-byte aligned and read as float4 (MODVEC of the kernel).
template <int G, bool PAIRED, bool VEC4, int EPB = 1>
void launch_rows_f32(const Params& p, int device, cudaStream_t stream) {
  constexpr int ROWS = G == 128 ? 1 : 256 / G;
  auto kernel = layernorm_modulate_rows<G, PAIRED, VEC4, false, true, 1, EPB>;
  static std::atomic<uint64_t> opted_in{0};
  opt_in_shared_memory(kernel, device, static_cast<int>(kMaxStagedBytes), opted_in);
  const int64_t blocks = (p.rows + ROWS - 1) / ROWS;
  kernel<<<static_cast<unsigned>(blocks), G * ROWS, static_cast<size_t>(ROWS) * p.v * sizeof(uint2), stream>>>(p);
}

// The epilogue batch (EPB above) for four-warp rows, the default since the twelfth session at <= kFourWarpMaxRows
// rows (GRLN's and layernorm_modulate's few-row schedules below), where one wave holds every row: H200 at 94cceb5
// (knob-sweeps/94cceb5/, DIFUSE_LNMOD_EPILOGUE_BATCH=1 against ops.json of the same run) GRLN 1x512x3072 9.5 us vs
// 11.1, 2x300x3072 10.2 vs 11.3 (predicted ~10.5; 10.0 / 10.7 vs 10.6 / 10.9 through =0 at edec152). Not for many
// rows, where the 53-64 registers cost blocks per SM: layernorm_modulate 1x32760x5120 204.9 vs 195.6,
// layernorm_modulate_fp32 1x32760x5120 223.6 vs 213.8 (the fp32 rows keep EPB = 1 unless forced).
// DIFUSE_LNMOD_EPILOGUE_BATCH=1 (for measurement) batches every four-warp row, =0 none. Read once.
constexpr int kEpilogueBatch = 4;
constexpr int64_t kFourWarpMaxRows = 1024;
int epilogue_batch_knob() {
  static const int v = detail::env_knob_or("DIFUSE_LNMOD_EPILOGUE_BATCH", -1);
  return v;
}
bool epilogue_batched(const LayernormModulateConfig& cfg, int64_t rows) {
  if (cfg.threads_per_row != 128) return false;
  const int knob = epilogue_batch_knob();
  return knob == 1 || (knob != 0 && rows <= kFourWarpMaxRows);
}

template <bool VEC4>
void dispatch_rows_f32(const LayernormModulateConfig& cfg, const Params& p, int d, cudaStream_t s) {
  if (cfg.threads_per_row == 128 && epilogue_batch_knob() == 1)
    return launch_rows_f32<128, false, VEC4, kEpilogueBatch>(p, d, s);
  switch (cfg.threads_per_row * 2 + (cfg.paired ? 1 : 0)) {
    case 65: return launch_rows_f32<32, true, VEC4>(p, d, s);
    case 64: return launch_rows_f32<32, false, VEC4>(p, d, s);
    case 129: return launch_rows_f32<64, true, VEC4>(p, d, s);
    case 128: return launch_rows_f32<64, false, VEC4>(p, d, s);
    case 256: return launch_rows_f32<128, false, VEC4>(p, d, s);
    default: break;
  }
  throw detail::Failure(DIFUSE_ERR_INTERNAL, "layernorm_modulate_fp32: no staged kernel for this width");
}

// DIFUSE_LNMOD_STAGE_A=1 (for measurement; SA above): GRLN on two or four warps per row, when the block's h rows,
// modulation rows and a rows fit kMaxStagedBytes (two warps: H <= 3584 with staged modulation rows; four: H <=
// 18432). Read once.
bool stage_a_fits(const LayernormModulateConfig& cfg, bool modvec, int v) {
  static const int knob = detail::positive_env_knob("DIFUSE_LNMOD_STAGE_A");
  static const int dense = detail::positive_env_knob("DIFUSE_LNMOD_BLOCKS_PER_SM");
  if (knob != 1 || dense == 8 || (cfg.threads_per_row != 64 && cfg.threads_per_row != 128)) return false;
  const int rows = cfg.threads_per_row == 128 ? 1 : 256 / cfg.threads_per_row;
  const int staged_rows = 2 * rows + (rows > 1 && modvec ? 2 : 0);
  return static_cast<size_t>(staged_rows) * v * sizeof(uint2) <= kMaxStagedBytes;
}

// DIFUSE_LNMOD_STAGE_ALL=1 (for measurement; SALL above): GRLN on four warps per row with 8-byte gate and modulation
// rows, when the row's h, a, gate, scale and shift fit kMaxStagedBytes (H <= 7372). Before DIFUSE_LNMOD_STAGE_A.
// Read once.
bool stage_all_fits(const LayernormModulateConfig& cfg, bool modvec, int v) {
  static const int knob = detail::positive_env_knob("DIFUSE_LNMOD_STAGE_ALL");
  static const int dense = detail::positive_env_knob("DIFUSE_LNMOD_BLOCKS_PER_SM");
  return knob == 1 && dense != 8 && modvec && cfg.threads_per_row == 128 &&
         static_cast<size_t>(kStageAllRows) * v * sizeof(uint2) <= kMaxStagedBytes;
}

template <bool MODVEC, bool RESIDUAL>
void launch_staged(const LayernormModulateConfig& cfg, const Params& p, int d, cudaStream_t s) {
  static const int dense = detail::positive_env_knob("DIFUSE_LNMOD_BLOCKS_PER_SM");
  // the unpaired map: the paired one needs more than 32 registers with modulation words from global memory
  if (dense == 8 && cfg.threads_per_row == 64) return launch_rows<64, false, MODVEC, RESIDUAL, 8>(p, d, s);
  if (dense == 5 && cfg.threads_per_row == 64)
    return cfg.paired ? launch_rows<64, true, MODVEC, RESIDUAL, 5>(p, d, s)
                      : launch_rows<64, false, MODVEC, RESIDUAL, 5>(p, d, s);
  const bool epb = epilogue_batched(cfg, p.rows);
  if constexpr (RESIDUAL && MODVEC) {
    if (stage_all_fits(cfg, MODVEC, p.v))
      return epb ? launch_rows<128, false, true, true, 1, kEpilogueBatch, false, true>(p, d, s)
                 : launch_rows<128, false, true, true, 1, 1, false, true>(p, d, s);
  }
  if constexpr (RESIDUAL) {
    if (stage_a_fits(cfg, MODVEC, p.v)) {
      switch (cfg.threads_per_row * 2 + (cfg.paired ? 1 : 0)) {
        case 129: return launch_rows<64, true, MODVEC, true, 1, 1, true>(p, d, s);
        case 128: return launch_rows<64, false, MODVEC, true, 1, 1, true>(p, d, s);
        case 256:
          return epb ? launch_rows<128, false, MODVEC, true, 1, kEpilogueBatch, true>(p, d, s)
                     : launch_rows<128, false, MODVEC, true, 1, 1, true>(p, d, s);
        default: break;
      }
    }
  }
  if constexpr (RESIDUAL) {  // many narrow rows, after the measurement knobs: the 32-register kernel (cfg.dense)
    if (cfg.dense) return launch_rows<64, false, MODVEC, true, 8>(p, d, s);
  }
  if (epb) return launch_rows<128, false, MODVEC, RESIDUAL, 1, kEpilogueBatch>(p, d, s);
  switch (cfg.threads_per_row * 2 + (cfg.paired ? 1 : 0)) {
    case 65: return launch_rows<32, true, MODVEC, RESIDUAL>(p, d, s);
    case 64: return launch_rows<32, false, MODVEC, RESIDUAL>(p, d, s);
    case 129: return launch_rows<64, true, MODVEC, RESIDUAL>(p, d, s);
    case 128: return launch_rows<64, false, MODVEC, RESIDUAL>(p, d, s);
    case 256: return launch_rows<128, false, MODVEC, RESIDUAL>(p, d, s);
    default: break;
  }
  throw detail::Failure(DIFUSE_ERR_INTERNAL, "layernorm_modulate: no kernel for threads_per_row=" +
                                                 std::to_string(cfg.threads_per_row) + (cfg.paired ? " paired" : ""));
}

void require_bf16_view(detail::Support& s, const difuse_tensor_view& v, const char* name) {
  DIFUSE_REQUIRE(s, v.dtype == DIFUSE_BF16, std::string(name) + " must be bf16, got " + difuse_dtype_name(v.dtype));
  detail::require_cuda_device(s, v, name);
}

}  // namespace

namespace {
// Measurement knob: DIFUSE_LNMOD_THREADS_PER_ROW=32|64|128 forces a schedule where the row fits it (the bits
// do not change: every schedule replays the same tree). Read once.
int forced_threads_per_row() {
  static const int v = detail::positive_env_knob("DIFUSE_LNMOD_THREADS_PER_ROW");
  return v;
}
}  // namespace

LayernormModulateConfig layernorm_modulate_config(int64_t h, bool aligned16) {
  const int64_t sweeps = (h / kVecElems + kAtenThreads - 1) / kAtenThreads;
  const bool paired = aligned16 && h % 8 == 0;
  const int ns = static_cast<int>(sweeps);
  // Shared memory per block: (8+2) rows x 3072, (4+2) rows x 6144, 1 row x 24576 elements.
  const int forced = forced_threads_per_row();
  if (forced == 32 && sweeps <= 6) return {32, paired, ns};
  if (forced == 64 && sweeps <= 12) return {64, paired, ns};
  if (forced == 128 && sweeps <= kMaxStagedSweeps) return {128, false, ns};
  // Measured on the H200 (bench/results/h200/NOTES.md): two warps per row beat one for H <= 6144, and four beat two
  // above 7 sweeps (H > 3584; 5f8295d and 132f46f sweeps, knob-sweeps/: layernorm_modulate 1x4096x4096 27.6 vs 28.8
  // us, 1x32760x5120 196.6 vs 202.8, layernorm_modulate_fp32 1x32760x5120 214.4 vs 228.6); at 3072 and below the
  // two-warp schedule stays (mixed there, and slower at 1536).
  if (sweeps <= 7) return {64, paired, ns};
  if (sweeps <= kMaxStagedSweeps) return {128, false, ns};
  return {0, false, ns};
}

namespace {
// The width's schedule, or four warps per row (one row per block) where it takes two, the row has at least
// min_sweeps sweeps and there are at most kFourWarpMaxRows rows (unless DIFUSE_LNMOD_THREADS_PER_ROW forces one).
LayernormModulateConfig four_warps_for_few_rows(int64_t h, bool aligned16, int64_t rows, int min_sweeps) {
  const LayernormModulateConfig c = layernorm_modulate_config(h, aligned16);
  if (forced_threads_per_row() == 0 && c.threads_per_row == 64 && c.sweeps >= min_sweeps && rows <= kFourWarpMaxRows)
    return {128, false, c.sweeps};
  return c;
}

// One warp per row (8 rows per block) where the width takes two warps, the row has at most 3 sweeps (H <= 1536) and
// there are at least kOneWarpMinRows rows (unless DIFUSE_LNMOD_THREADS_PER_ROW forces a schedule). H200 at 132f46f
// (knob-sweeps/, DIFUSE_LNMOD_THREADS_PER_ROW=32 against ops.json of the same run): layernorm_modulate 1x32760x1536
// 80.2 us vs 87.3 on two warps, 2x4096x1536 26.6 vs 27.8, layernorm_modulate_fp32 1x32760x1536 89.4 vs 92.6; few rows
// lose (2x333x1536 9.6 vs 8.0) and wider rows do not gain (1x32760x5120 203.2 vs 202.8, 2x1024x2240 13.9 vs 13.2).
// Those one-warp kernels' PTX is 132f46f's (scripts/ptx-diff.sh 132f46f), and they ran exact in the whole suite at
// 5ee73e2 (tests.json: the forced one-warp schedules of test_layernorm_modulate.py and test_wan_fp32.py). The default
// since 196d420; timed as the default at d3185fc (ops.json against DIFUSE_LNMOD_THREADS_PER_ROW=64 in the same run,
// knob-sweeps/d3185fc/): 1x32760x1536 80.3 vs 86.8, 2x4096x1536 27.3 vs 28.5, fp32 1x32760x1536 90.0 vs 93.0; its
// tests passed there (gpu-tests-d3185fc.json).
// The 8192 is the smallest measured win; 4096 rows at 1536 were not measured and keep two warps.
constexpr int64_t kOneWarpMinRows = 8192;
// Two warps by the width's rule, at most 3 sweeps, at least kOneWarpMinRows rows, no forced schedule: where
// layernorm_modulate and the fp32 norms take one warp and GRLN its 32-register kernel.
bool many_narrow_rows(const LayernormModulateConfig& c, int64_t rows) {
  return forced_threads_per_row() == 0 && c.threads_per_row == 64 && c.sweeps <= 3 && rows >= kOneWarpMinRows;
}
LayernormModulateConfig one_warp_for_many_narrow_rows(const LayernormModulateConfig& c, int64_t rows) {
  return many_narrow_rows(c, rows) ? LayernormModulateConfig{32, c.paired, c.sweeps} : c;
}
}  // namespace

LayernormModulateConfig layernorm_fp32_rows_config(int64_t h, bool aligned16, int64_t rows) {
  return one_warp_for_many_narrow_rows(layernorm_modulate_config(h, aligned16), rows);
}

LayernormModulateConfig gated_residual_layernorm_modulate_config(int64_t h, bool aligned16, int64_t rows) {
  // Few rows at 5-7 sweeps (H in (2048, 3584]; 6-7 before the fifty-second session): four warps per row, one row per
  // block. Two warps take 4 rows per
  // block, so 512 rows fill 128 blocks, one per SM, 8 warps each; four warps give 512 blocks, ~16 warps per SM.
  // H200 at 5d35cbc (knob-sweeps/5d35cbc/, DIFUSE_LNMOD_THREADS_PER_ROW=128 against ops.json in the same run):
  // 1x512x3072 11.8 vs 13.3 us, 2x300x3072 12.0 vs 14.8; but 1x4096x3072 44.0 vs 43.1 and 2x4096x1536 46.6 vs
  // 44.7, so many rows keep two warps. Plain layernorm_modulate does not gain (1x512x3072 9.4 us on four warps at
  // 132f46f vs 8.7 on two at 5d35cbc). The bits do not change (every schedule replays the same tree). 5 sweeps since
  // the fifty-second session: SD3.5-large's 2x333x2432 on an H100 at 94 SMs (bench/results/h100/stage-all-a4fd151/,
  // DIFUSE_LNMOD_THREADS_PER_ROW=128 against the default of the same build, alternated twice) 12.5 us vs 14.1-14.4,
  // 0 mismatches; 3-4 sweeps (H <= 2048) not measured, they keep two warps.
  // Many narrow rows (>= kOneWarpMinRows at <= 3 sweeps): two warps on the 32-register kernel, 8 blocks per SM
  // (MINB = 8: modulation rows and a from global memory, one vector at a time, the unpaired map). H200, forced by
  // DIFUSE_LNMOD_BLOCKS_PER_SM=8 against ops.json of the same run: 2x4096x1536 41.8 us vs 45.1 at 132f46f
  // (knob-sweeps/), 42.6 vs 44.2 at 0385466 (knob-sweeps/0385466/); at 3072 it loses (42.7 vs 39.7 at 0385466), so
  // only H <= 1536. The kernel's PTX is 0385466's (scripts/ptx-diff.sh 0385466), exact in the whole suite at 5ee73e2
  // (test_eight_blocks_per_sm_variant[8]). The default since be1cdc5; timed as the default at d3185fc: 2x4096x1536
  // 42.0 vs 44.7 (knob-sweeps/d3185fc/), its tests passed there (gpu-tests-d3185fc.json).
  // DIFUSE_LNMOD_THREADS_PER_ROW=64 keeps the MINB = 1 two-warp kernel.
  LayernormModulateConfig c = four_warps_for_few_rows(h, aligned16, rows, 5);
  if (many_narrow_rows(c, rows)) {
    c.dense = true;
    c.paired = false;
  }
  return c;
}

LayernormModulateConfig layernorm_modulate_rows_config(int64_t h, bool aligned16, int64_t rows) {
  // Few rows at 3-7 sweeps (H in (1024, 3584]): four warps per row with the batched epilogue (EPB; four warps alone
  // were slower: 1x512x3072 9.4 us at 132f46f vs 8.7 on two). H200 at edec152 (knob-sweeps/edec152/,
  // DIFUSE_LNMOD_THREADS_PER_ROW=128 with DIFUSE_LNMOD_EPILOGUE_BATCH=1 against ops.json of the same run): 1x512x3072
  // 8.0 vs 8.9 us, 2x300x3072 8.4 vs 9.8, 2x333x1536 7.6 vs 8.5; more rows lose (2x1024x2240 13.6 vs 12.9,
  // 1x4096x3072 24.8 vs 24.1), so they keep two warps. Many narrow rows: one warp (one_warp_for_many_narrow_rows).
  return one_warp_for_many_narrow_rows(four_warps_for_few_rows(h, aligned16, rows, 3), rows);
}

detail::Support can_use_layernorm_modulate(const difuse_tensor_view& out, const difuse_tensor_view& x,
                                           const difuse_tensor_view& scale, const difuse_tensor_view& shift,
                                           double eps) {
  (void)eps;  // any eps: aten uses (float)eps, and so do we
  detail::Support s;
  require_bf16_view(s, x, "x");
  require_bf16_view(s, scale, "scale");
  require_bf16_view(s, shift, "shift");
  require_bf16_view(s, out, "out");
  const bool x3 = x.rank == 3;
  DIFUSE_REQUIRE(s, x3, "x must have rank 3 [B, L, H], got " + detail::describe(x));
  if (!x3) return s;
  const int64_t B = x.sizes[0], L = x.sizes[1], H = x.sizes[2];
  const bool empty = B == 0 || L == 0 || H == 0;
  DIFUSE_REQUIRE(s, detail::is_contiguous(x), "x must be contiguous, got " + detail::describe(x));
  DIFUSE_REQUIRE(s, H % 4 == 0, "H must be a multiple of 4 (aten's vectorized LayerNorm), got H = " + std::to_string(H));
  DIFUSE_REQUIRE(s, H <= (int64_t{1} << 24), "H must be at most 2^24 (aten keeps counts in fp32), got H = " + std::to_string(H));
  DIFUSE_REQUIRE(s, B * L <= int64_t{2147483647}, "B * L must be at most 2^31 - 1 (aten's grid limit), got " + std::to_string(B * L));
  if (!empty)
    DIFUSE_REQUIRE(s, detail::aligned(x.data, 8),
              "x must be 8-byte aligned (a misaligned view takes aten's two-kernel LayerNorm, which rounds differently)");
  for (const auto* m : {&scale, &shift}) {
    const char* name = m == &scale ? "scale" : "shift";
    if (m->rank != 2 && m->rank != 3) {
      DIFUSE_REQUIRE(s, false, std::string(name) + " must have rank 2 [B, H] or 3 [B, L, H], got " + detail::describe(*m));
      continue;
    }
    const bool shape_ok = m->rank == 2 ? (m->sizes[0] == B && m->sizes[1] == H)
                                       : (m->sizes[0] == B && m->sizes[1] == L && m->sizes[2] == H);
    DIFUSE_REQUIRE(s, shape_ok, std::string(name) + " must have shape [" + std::to_string(B) + ", " + std::to_string(H) +
                                    "] or [" + std::to_string(B) + ", " + std::to_string(L) + ", " + std::to_string(H) +
                                    "], got " + detail::describe(*m));
    DIFUSE_REQUIRE(s, m->strides[m->rank - 1] == 1 || H <= 1,
              std::string(name) + " must have a contiguous last dim (stride 1), got " + detail::describe(*m));
    bool nonneg = true;
    for (int d = 0; d + 1 < m->rank; ++d) nonneg = nonneg && m->strides[d] >= 0;
    DIFUSE_REQUIRE(s, nonneg, std::string(name) + " must have non-negative strides, got " + detail::describe(*m));
    DIFUSE_REQUIRE(s, m->device == x.device, std::string(name) + " must be on the device of x (cuda:" + std::to_string(x.device) +
                                         "), got " + detail::describe(*m));
    if (!empty) DIFUSE_REQUIRE(s, m->data != nullptr, std::string(name) + " has a null data pointer");
  }
  const bool out3 = out.rank == 3 && out.sizes[0] == B && out.sizes[1] == L && out.sizes[2] == H;
  DIFUSE_REQUIRE(s, out3, "out must have the shape of x [" + std::to_string(B) + ", " + std::to_string(L) + ", " +
                      std::to_string(H) + "], got " + detail::describe(out));
  DIFUSE_REQUIRE(s, detail::is_contiguous(out), "out must be contiguous, got " + detail::describe(out));
  DIFUSE_REQUIRE(s, out.device == x.device, "out must be on the device of x, got " + detail::describe(out));
  if (!empty) {
    DIFUSE_REQUIRE(s, x.data != nullptr && out.data != nullptr, "x and out must have non-null data pointers");
    DIFUSE_REQUIRE(s, detail::aligned(out.data, 8), "out must be 8-byte aligned");
    DIFUSE_REQUIRE(s, !detail::overlaps(out, x) && !detail::overlaps(out, scale) && !detail::overlaps(out, shift),
              "out must not overlap x, scale or shift");
  }
  return s;
}

namespace {

// The streamed kernels' default needs at least kStreamMinRows rows: few rows lose (GRLN at 0bdc6e6: 1x512x3072 10.6 us
// vs 9.5 staged, 2x300x3072 11.8 vs 10.2; layernorm_modulate at e831f9c: 1x512x3072 8.9 vs 8.0, 2x1024x2240 15.0 vs
// 12.7: one row or none per group, nothing to overlap), and no measurement knob forcing a staged variant.
constexpr int64_t kStreamMinRows = 4096;
bool staged_variant_knob() {
  static const bool v = forced_threads_per_row() != 0 || detail::positive_env_knob("DIFUSE_LNMOD_BLOCKS_PER_SM") != 0 ||
                        detail::positive_env_knob("DIFUSE_LNMOD_STAGE_A") != 0 ||
                        detail::positive_env_knob("DIFUSE_LNMOD_STAGE_ALL") != 0 ||
                        detail::positive_env_knob("DIFUSE_LNMOD_PREFETCH_A") != 0;
  return v;
}

// The plain LayerNorms (layernorm_modulate in bf16, Wan's layernorm_modulate_fp32 and layernorm_affine_fp32) take the
// streamed kernel (layernorm_streamed_rows) by default for at least kStreamMinRows rows where it stages the
// modulation rows (smod: [B, H] rows of 8-byte bf16 words or 16-byte fp32 vectors, B <= kStreamMaxModBatches, or the
// affine weight and bias); DIFUSE_LNMOD_STREAMED=G everywhere it can run, =0 nowhere. H200 at e831f9c
// (knob-sweeps/e831f9c/, 12 groups against the default of the same run, then the staged kernels): layernorm_modulate
// 1x4608x3072 23.9 us vs 26.3, 1x4096x3072 22.1 vs 23.9, 2x4096x1536 23.9 vs 27.4, 1x4096x4096 27.2 vs 28.3,
// 2x4096x3072 36.6 vs 39.6, 1x32760x5120 182.4 vs 191.6, 1x32760x1536 65.4 vs 80.4; layernorm_modulate_fp32
// 1x32760x5120 181.8 vs 209.8, 1x32760x1536 81.5 vs 88.6. Per-token modulation rows (each row loading its own from
// L2, as GRLN's first version did) were not measured: they keep the staged kernels. staged_epilogue: a knob forcing a
// staged kernel's epilogue variant (DIFUSE_LNMOD_F32_ROW_EPILOGUE for the fp32 norms).
//
// By the device (forty-fourth session): rows wider than kStreamWarpMaxWidth (the two-warp groups) only where DRAM
// outpaces the SMs (plain_layernorm_streamed_by_default, detail::dram_outpaces_sms). A whole H100 SXM (12.83 bytes per
// SM cycle) at bf84066, two alternated rounds, default against DIFUSE_LNMOD_STREAMED=0 (bench/results/h100/
// streamed-norms-bf84066/): 1x32760x5120 layernorm_modulate_fp32 260.0-261.8 us vs 237.5-238.0, layernorm_affine_fp32
// 259.2-259.4 vs 236.4-236.5, layernorm_modulate 246.4-247.0 vs 233.1-234.0, where the H200 runs the streamed rows
// 13 % (fp32) and 5 % (bf16) faster; up to 4096 the streamed rows won or tied there too (1x32760x1536: the fp32
// norms 79.3-80.5 vs 95.4-96.1, bf16 83.1-83.7 vs 83.5-84.4; 1x4096x3072 23.2 vs 28.0-28.4; 2x4096x3072 43.4-43.9 vs
// 44.7-44.8; 1x4096x4096 31.1-31.5 vs 31.4-31.6; 1x27280x3072's per-token rows staged either way), so they keep them.
bool plain_streamed_by_default_or_knob(int64_t rows, int64_t h, int device, bool smod, bool staged_epilogue = false) {
  const int knob = streamed_groups_knob();
  if (knob >= 0) return knob > 0;
  return !staged_variant_knob() && !staged_epilogue &&
         plain_layernorm_streamed_by_default(rows, h, smod, detail::dram_bytes_per_sm_cycle(device));
}

Params make_params(const difuse_tensor_view& out, const difuse_tensor_view& x, const difuse_tensor_view& scale,
                   const difuse_tensor_view& shift, double eps) {
  Params p{};
  p.x = static_cast<const uint16_t*>(x.data);
  p.out = static_cast<uint16_t*>(out.data);
  p.scale = static_cast<const uint16_t*>(scale.data);
  p.shift = static_cast<const uint16_t*>(shift.data);
  p.rows = x.sizes[0] * x.sizes[1];
  p.seq = x.sizes[1];
  p.seq_div = detail::IndexDiv(p.seq, p.rows);
  p.scale_stride = scale.strides[0];
  p.shift_stride = shift.strides[0];
  p.scale_stride_l = scale.rank == 3 ? scale.strides[1] : 0;
  p.shift_stride_l = shift.rank == 3 ? shift.strides[1] : 0;
  p.h = static_cast<int>(x.sizes[2]);
  p.v = p.h / 4;
  p.eps = static_cast<float>(eps);
  p.mod_vec = detail::aligned(scale.data, 8) && detail::aligned(shift.data, 8) && scale.strides[0] % 4 == 0 &&
              shift.strides[0] % 4 == 0 && p.scale_stride_l % 4 == 0 && p.shift_stride_l % 4 == 0;
  return p;
}

template <bool RESIDUAL>
void launch(const Params& p, const difuse_tensor_view& x, const difuse_tensor_view& out, cudaStream_t stream) {
  const detail::DeviceGuard device_guard(x.device);
  const bool aligned16 = detail::aligned(x.data, 16) && detail::aligned(out.data, 16);
  const LayernormModulateConfig cfg = RESIDUAL ? gated_residual_layernorm_modulate_config(p.h, aligned16, p.rows)
                                               : layernorm_modulate_rows_config(p.h, aligned16, p.rows);
  if (cfg.threads_per_row == 0) {
    if constexpr (RESIDUAL) throw detail::Failure(DIFUSE_ERR_INTERNAL, "residual rows wider than 24576 reached the launcher");
    layernorm_modulate_stream<<<static_cast<unsigned>(p.rows), 128, 0, stream>>>(p);
  } else if (p.mod_vec) {
    launch_staged<true, RESIDUAL>(cfg, p, x.device, stream);
  } else {
    launch_staged<false, RESIDUAL>(cfg, p, x.device, stream);
  }
  DIFUSE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void layernorm_modulate(const difuse_tensor_view& out, const difuse_tensor_view& x, const difuse_tensor_view& scale,
                        const difuse_tensor_view& shift, double eps, cudaStream_t stream) {
  const detail::Support s = can_use_layernorm_modulate(out, x, scale, shift, eps);
  if (!s.ok()) throw detail::Failure(DIFUSE_ERR_UNSUPPORTED, s.message("layernorm_modulate"));
  if (detail::numel(x) == 0) return;
  const Params p = make_params(out, x, scale, shift, eps);
  const bool smod = p.mod_vec && p.scale_stride_l == 0 && p.shift_stride_l == 0 &&
                    staged_mod_batches(p) <= kStreamMaxModBatches;
  if (plain_streamed_by_default_or_knob(p.rows, p.h, x.device, smod) && p.h % 8 == 0 && detail::aligned(x.data, 16) &&
      detail::aligned(out.data, 16)) {
    const detail::DeviceGuard device_guard(x.device);
    if (launch_streamed_ln_rows<false>(p, smod, p.mod_vec, x.device, stream)) {
      DIFUSE_CUDA_CHECK(cudaGetLastError());
      return;
    }
  }
  launch<false>(p, x, out, stream);
}

namespace {
// An fp32 modulation row view as the bf16 predicate sees its shape: [B, 1, H] becomes [B, H].
difuse_tensor_view as_bf16_rows(const difuse_tensor_view& m) {
  difuse_tensor_view r = m;
  if (r.rank == 3 && r.sizes[1] == 1) {
    r.rank = 2;
    r.sizes[1] = m.sizes[2];
    r.strides[1] = m.strides[2];
  }
  r.dtype = DIFUSE_BF16;
  return r;
}
}  // namespace

detail::Support can_use_layernorm_modulate_fp32(const difuse_tensor_view& out, const difuse_tensor_view& x,
                                                const difuse_tensor_view& scale, const difuse_tensor_view& shift,
                                                double eps) {
  detail::Support s = can_use_layernorm_modulate(out, x, as_bf16_rows(scale), as_bf16_rows(shift), eps);
  DIFUSE_REQUIRE(s, scale.dtype == DIFUSE_F32, std::string("scale must be fp32, got ") + difuse_dtype_name(scale.dtype));
  DIFUSE_REQUIRE(s, shift.dtype == DIFUSE_F32, std::string("shift must be fp32, got ") + difuse_dtype_name(shift.dtype));
  // The bf16 rules above hold the rows to 2-byte elements; fp32 loads need the pointer 4-byte aligned (strides count
  // fp32 elements).
  DIFUSE_REQUIRE(s, detail::aligned(scale.data, 4), "scale must be 4-byte aligned (fp32 elements)");
  DIFUSE_REQUIRE(s, detail::aligned(shift.data, 4), "shift must be 4-byte aligned (fp32 elements)");
  if (x.rank == 3) {
    DIFUSE_REQUIRE(s, x.sizes[2] <= int64_t{4} * kAtenThreads * kMaxStagedSweeps,
                   "H must be at most 24576 for the fp32 variant (it stages rows), got H = " + std::to_string(x.sizes[2]));
    if (detail::numel(x) > 0)
      DIFUSE_REQUIRE(s, !detail::overlaps(out, scale) && !detail::overlaps(out, shift), "out must not overlap scale or shift");
  }
  return s;
}

bool layernorm_fp32_rows_vec4(const difuse_tensor_view& scale, const difuse_tensor_view& shift) {
  for (const difuse_tensor_view* m : {&scale, &shift}) {
    if (m->rank < 1 || m->strides[m->rank - 1] != 1 || !detail::aligned(m->data, 16)) return false;
    for (int d = 0; d + 1 < m->rank; ++d)
      if (m->strides[d] % 4 != 0) return false;
  }
  return true;
}

bool stream_one_warp_groups(bool grln, int64_t h, int knob) {
  if (knob >= 0) return knob == 1;
  return h <= (grln ? kGrlnStreamWarpMaxWidth : kStreamWarpMaxWidth);
}

bool plain_layernorm_streamed_by_default(int64_t rows, int64_t h, bool smod, double dram_bytes_per_sm_cycle) {
  return smod && rows >= kStreamMinRows &&
         (h <= kStreamWarpMaxWidth || detail::dram_outpaces_sms(dram_bytes_per_sm_cycle));
}

namespace {
void layernorm_modulate_fp32_impl(const difuse_tensor_view& out, const difuse_tensor_view& x,
                                  const difuse_tensor_view& scale, const difuse_tensor_view& shift, double eps,
                                  bool affine, cudaStream_t stream);
}  // namespace

void layernorm_modulate_fp32(const difuse_tensor_view& out, const difuse_tensor_view& x, const difuse_tensor_view& scale,
                             const difuse_tensor_view& shift, double eps, cudaStream_t stream) {
  const detail::Support s = can_use_layernorm_modulate_fp32(out, x, scale, shift, eps);
  if (!s.ok()) throw detail::Failure(DIFUSE_ERR_UNSUPPORTED, s.message("layernorm_modulate_fp32"));
  if (detail::numel(x) == 0) return;
  layernorm_modulate_fp32_impl(out, x, scale, shift, eps, false, stream);
}

namespace {
void layernorm_modulate_fp32_impl(const difuse_tensor_view& out, const difuse_tensor_view& x,
                                  const difuse_tensor_view& scale, const difuse_tensor_view& shift, double eps,
                                  bool affine, cudaStream_t stream) {
  const difuse_tensor_view sc = as_bf16_rows(scale), sh = as_bf16_rows(shift);
  Params p = make_params(out, x, sc, sh, eps);
  p.scale = nullptr;
  p.shift = nullptr;
  p.scale32 = static_cast<const float*>(scale.data);
  p.shift32 = static_cast<const float*>(shift.data);
  p.affine32 = affine;
  // One fp32 modulation row per batch: the block's epilogue by default. H200 at 5fa0c2a (knob-sweeps/):
  // 1x32760x5120 229.1 us vs 258.6 per row, 1x32760x1536 93.7 vs 93.0. DIFUSE_LNMOD_F32_ROW_EPILOGUE=1 (for
  // measurement) keeps the per-row epilogue.
  static const int row_epilogue = detail::positive_env_knob("DIFUSE_LNMOD_F32_ROW_EPILOGUE");
  p.f32_block_epilogue = row_epilogue != 1 && p.scale_stride_l == 0 && p.shift_stride_l == 0;
  const detail::DeviceGuard device_guard(x.device);
  const bool aligned16 = detail::aligned(x.data, 16) && detail::aligned(out.data, 16);
  const bool vec4 = layernorm_fp32_rows_vec4(scale, shift);
  const bool smod = vec4 && p.scale_stride_l == 0 && p.shift_stride_l == 0 &&
                    staged_mod_batches(p) <= kStreamMaxModBatches;
  if (plain_streamed_by_default_or_knob(p.rows, p.h, x.device, smod, row_epilogue == 1) && aligned16 && p.h % 8 == 0) {
    if (launch_streamed_ln_rows<true>(p, smod, vec4, x.device, stream)) {
      DIFUSE_CUDA_CHECK(cudaGetLastError());
      return;
    }
  }
  const LayernormModulateConfig cfg = layernorm_fp32_rows_config(p.h, aligned16, p.rows);
  if (layernorm_fp32_rows_vec4(scale, shift))
    dispatch_rows_f32<true>(cfg, p, x.device, stream);
  else
    dispatch_rows_f32<false>(cfg, p, x.device, stream);
  DIFUSE_CUDA_CHECK(cudaGetLastError());
}
}  // namespace

detail::Support can_use_layernorm_affine_fp32(const difuse_tensor_view& out, const difuse_tensor_view& x,
                                              const difuse_tensor_view& weight, const difuse_tensor_view& bias,
                                              double eps) {
  // The fp32 modulation predicate with [H] rows seen as [B, H] rows of stride 0.
  auto as_rows = [&](const difuse_tensor_view& v) {
    difuse_tensor_view r = v;
    if (v.rank == 1 && x.rank == 3) {
      r.rank = 2;
      r.sizes[0] = x.sizes[0];
      r.strides[0] = 0;
      r.sizes[1] = v.sizes[0];
      r.strides[1] = v.strides[0];
    }
    return r;
  };
  detail::Support s = can_use_layernorm_modulate_fp32(out, x, as_rows(weight), as_rows(bias), eps);
  s.rename("scale", "weight");  // the modulation predicate's names for them
  s.rename("shift", "bias");
  DIFUSE_REQUIRE(s, weight.rank == 1 && bias.rank == 1, "weight and bias must be [H] vectors");
  return s;
}

void layernorm_affine_fp32(const difuse_tensor_view& out, const difuse_tensor_view& x, const difuse_tensor_view& weight,
                           const difuse_tensor_view& bias, double eps, cudaStream_t stream) {
  const detail::Support s = can_use_layernorm_affine_fp32(out, x, weight, bias, eps);
  if (!s.ok()) throw detail::Failure(DIFUSE_ERR_UNSUPPORTED, s.message("layernorm_affine_fp32"));
  if (detail::numel(x) == 0) return;
  difuse_tensor_view w = weight, b = bias;
  for (auto* v : {&w, &b}) {
    v->rank = 2;
    v->sizes[1] = v->sizes[0];
    v->strides[1] = v->strides[0];
    v->sizes[0] = x.sizes[0];
    v->strides[0] = 0;
  }
  layernorm_modulate_fp32_impl(out, x, w, b, eps, /*affine=*/true, stream);
}

detail::Support can_use_gated_residual_layernorm_modulate(const difuse_tensor_view& out, const difuse_tensor_view& residual,
                                                          const difuse_tensor_view& h, const difuse_tensor_view& a,
                                                          const difuse_tensor_view& gate, const difuse_tensor_view& scale,
                                                          const difuse_tensor_view& shift, double eps) {
  detail::Support s = can_use_layernorm_modulate(out, h, scale, shift, eps);  // h in the place of x
  s.rename("x", "h");
  if (h.rank != 3) return s;
  const int64_t B = h.sizes[0], L = h.sizes[1], H = h.sizes[2];
  const bool empty = detail::numel(h) == 0;
  DIFUSE_REQUIRE(s, H <= int64_t{4} * kAtenThreads * kMaxStagedSweeps,
                 "H must be at most 24576 for the residual variant (it stages rows), got H = " + std::to_string(H));
  for (const auto* t : {&a, &residual}) {
    const char* name = t == &a ? "a" : "residual";
    DIFUSE_REQUIRE(s, t->dtype == DIFUSE_BF16, std::string(name) + " must be bf16, got " + difuse_dtype_name(t->dtype));
    DIFUSE_REQUIRE(s, t->device == h.device, std::string(name) + " must be on the device of h, got " + detail::describe(*t));
    DIFUSE_REQUIRE(s, t->rank == 3 && t->sizes[0] == B && t->sizes[1] == L && t->sizes[2] == H,
                   std::string(name) + " must have the shape of h, got " + detail::describe(*t));
    DIFUSE_REQUIRE(s, detail::is_contiguous(*t), std::string(name) + " must be contiguous, got " + detail::describe(*t));
    if (!empty) DIFUSE_REQUIRE(s, t->data && detail::aligned(t->data, 8), std::string(name) + " must be 8-byte aligned");
  }
  DIFUSE_REQUIRE(s, gate.dtype == DIFUSE_BF16, std::string("gate must be bf16, got ") + difuse_dtype_name(gate.dtype));
  DIFUSE_REQUIRE(s, gate.device == h.device, "gate must be on the device of h, got " + detail::describe(gate));
  if (!empty) DIFUSE_REQUIRE(s, gate.data != nullptr, "gate has a null data pointer");
  const bool g2 = gate.rank == 2 && gate.sizes[0] == B && gate.sizes[1] == H;
  const bool g3 = gate.rank == 3 && gate.sizes[0] == B && gate.sizes[1] == L && gate.sizes[2] == H;
  DIFUSE_REQUIRE(s, g2 || g3, "gate must be [B, H] or [B, L, H], got " + detail::describe(gate));
  if (g2 || g3) {
    bool ok = gate.strides[gate.rank - 1] == 1 || H <= 1;
    for (int d = 0; d + 1 < gate.rank; ++d) ok = ok && gate.strides[d] >= 0;
    DIFUSE_REQUIRE(s, ok, "gate must have a contiguous last dim and non-negative strides, got " + detail::describe(gate));
  }
  if (!empty) {
    DIFUSE_REQUIRE(s, residual.data == h.data || !detail::overlaps(residual, h),
                   "residual must be h itself (in place) or not overlap it");
    DIFUSE_REQUIRE(s, !detail::overlaps(residual, a) && !detail::overlaps(residual, gate) &&
                          !detail::overlaps(residual, scale) && !detail::overlaps(residual, shift) &&
                          !detail::overlaps(residual, out),
                   "residual must not overlap a, gate, scale, shift or out");
    DIFUSE_REQUIRE(s, !detail::overlaps(out, a) && !detail::overlaps(out, gate), "out must not overlap a or gate");
  }
  return s;
}

namespace {
// The streamed kernel (grln_streamed_rows) by default for at least kStreamMinRows rows where the staged schedule
// would take two warps per row (H <= 3584, incl. the many-narrow-rows kernel) and the [B, H] modulation rows are
// staged (B <= 2, 8-byte words; since 2fbdd3e: before, per-token and B > 2 rows took it too, unmeasured there), no
// measurement knob forcing a staged variant; DIFUSE_LNMOD_STREAMED=G everywhere it can run, =0 nowhere. The launcher also needs h, a, out and the
// residual 16-byte aligned and H % 8 == 0, and falls back to the staged kernels where the ring would hold fewer than
// two rows. H200 at 0bdc6e6 (knob-sweeps/0bdc6e6/, 12 groups against DIFUSE_LNMOD_STREAMED=0 in the same run):
// 1x4096x3072 34.2 us vs 39.2, 2x4096x1536 38.0 vs 40.7; few rows lose (1x512x3072 10.6 vs 9.5, 2x300x3072 11.8 vs
// 10.2: one row or none per group, nothing to overlap), so they keep the staged kernels.
bool streamed_by_default_or_knob(const Params& p, const void* h_data) {
  const int knob = streamed_groups_knob();
  if (knob >= 0) return knob > 0;
  if (staged_variant_knob() || p.rows < kStreamMinRows) return false;
  // Only where the kernel stages the modulation rows (SMOD): with a per-token gate or modulation, more than
  // kStreamMaxModBatches batches or rows that are not 8-byte words, each row would load them from L2, as the first
  // version did at 82cc1bf (41.7 us vs 39.0 staged on 12 groups): those keep the staged kernels.
  const bool smod = p.mod_vec && p.gate_stride_l == 0 && p.scale_stride_l == 0 && p.shift_stride_l == 0 &&
                    p.rows / p.seq <= kStreamMaxModBatches;
  return smod &&
         gated_residual_layernorm_modulate_config(p.h, detail::aligned(h_data, 16), p.rows).threads_per_row == 64;
}
}  // namespace

void gated_residual_layernorm_modulate(const difuse_tensor_view& out, const difuse_tensor_view& residual,
                                       const difuse_tensor_view& h, const difuse_tensor_view& a,
                                       const difuse_tensor_view& gate, const difuse_tensor_view& scale,
                                       const difuse_tensor_view& shift, double eps, cudaStream_t stream) {
  const detail::Support s = can_use_gated_residual_layernorm_modulate(out, residual, h, a, gate, scale, shift, eps);
  if (!s.ok()) throw detail::Failure(DIFUSE_ERR_UNSUPPORTED, s.message("gated_residual_layernorm_modulate"));
  if (detail::numel(h) == 0) return;
  Params p = make_params(out, h, scale, shift, eps);
  p.a = static_cast<const uint16_t*>(a.data);
  p.gate = static_cast<const uint16_t*>(gate.data);
  p.residual = static_cast<uint16_t*>(residual.data);
  p.gate_stride = gate.strides[0];
  p.gate_stride_l = gate.rank == 3 ? gate.strides[1] : 0;
  // The MODVEC kernels read the gate as words too: a gate row that is not 8-byte aligned takes the bf16-load kernel
  // (its scale and shift then also load as bf16; the same values, the same bits).
  p.mod_vec = p.mod_vec && detail::aligned(gate.data, 8) && p.gate_stride % 4 == 0 && p.gate_stride_l % 4 == 0;
  static const int prefetch_a = detail::positive_env_knob("DIFUSE_LNMOD_PREFETCH_A");
  p.prefetch_a = prefetch_a == 1 && detail::aligned(a.data, 16) && p.h % 8 == 0;
  if (streamed_by_default_or_knob(p, h.data) && p.h % 8 == 0 && detail::aligned(h.data, 16) &&
      detail::aligned(a.data, 16) && detail::aligned(out.data, 16) && detail::aligned(residual.data, 16)) {
    const detail::DeviceGuard device_guard(h.device);
    const bool smod = p.mod_vec && p.gate_stride_l == 0 && p.scale_stride_l == 0 && p.shift_stride_l == 0 &&
                      p.rows / p.seq <= kStreamMaxModBatches;
    // the full-sweep kernels: SW = 3 on one-warp groups (1536), 6 on two-warp groups (3072; on one-warp groups too,
    // DIFUSE_LNMOD_STREAM_WARP=1, for measurement)
    const int sw = full_sweeps_for(p.v, smod);
    const bool launched =
        !stream_one_warp_groups(true, p.h, stream_warp_knob())
            ? smod ? (sw == 6                    ? launch_streamed<true, true, 64, 6>(p, h.device, stream)
                      : partial_sweeps_2432(p.v) ? launch_streamed<true, true, 64, 4, 96>(p, h.device, stream)
                                                 : launch_streamed<true, true>(p, h.device, stream))
              : p.mod_vec ? launch_streamed<true, false>(p, h.device, stream)
                          : launch_streamed<false, false>(p, h.device, stream)
        : smod ? with_full_sweeps(sw, [&](auto k) {
                   return launch_streamed<true, true, 32, decltype(k)::value>(p, h.device, stream);
                 })
        : p.mod_vec ? launch_streamed<true, false, 32>(p, h.device, stream)
                    : launch_streamed<false, false, 32>(p, h.device, stream);
    if (launched) {
      DIFUSE_CUDA_CHECK(cudaGetLastError());
      return;
    }
  }
  launch<true>(p, h, out, stream);
}

}  // namespace difuse::norm
