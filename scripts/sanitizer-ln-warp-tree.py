"""The streamed LayerNorms at widths whose aten warps push equal counts that differ between warps (2432, 1152, 4224)
under compute-sanitizer: GRLN, layernorm_modulate and layernorm_modulate_fp32, few rows, each output bit for bit
against eager (exit 1 on a mismatch). Written for the warp-equal tree (thirty-eighth session, as
bench/experiments/warp-equal-tree.patch: clean, bench/results/h100/warp-tree-735f5c8/; the default since the
thirty-ninth). Since the thirty-ninth session the native smoke test has 2432- and 1152-wide cases too, which the
sanitizer stage's DIFUSE_LNMOD_STREAMED parts (2a, 2b, 3) run on streamed blocks; this script adds the exact
comparison with eager and 4224. Run
on the GPU machine from the repository root after `scripts/device-check.sh --stage build`, forcing the streamed kernel
on 2 blocks so every slot is refilled:
    export DIFUSE_BUILD_DIR=$PWD/build-device DIFUSE_LIB_DIR=$PWD/build-device PYTHONPATH=$PWD/python \
           DIFUSE_LNMOD_STREAMED=1 DIFUSE_LNMOD_STREAMED_BLOCKS=2
    for t in memcheck racecheck initcheck; do compute-sanitizer --tool $t --error-exitcode 9 \
        python3 scripts/sanitizer-ln-warp-tree.py; done
"""
import torch, difuse
from difuse import ops
from difuse.gate import count_mismatches
g = torch.Generator(device='cuda').manual_seed(7)
bad = 0
for B, L, H in [(2, 37, 2432), (1, 29, 1152), (1, 23, 4224)]:
    rnd = lambda *s: torch.randn(*s, device='cuda', generator=g).to(torch.bfloat16)
    h, a = rnd(B, L, H), rnd(B, L, H)
    e = (rnd(B, 6 * H) * 0.5).chunk(6, dim=1)
    bad += count_mismatches(list(ops.gated_residual_layernorm_modulate(h, a, e[2], e[4], e[3], 1e-6)),
                            list(ops.gated_residual_layernorm_modulate_eager(h, a, e[2], e[4], e[3], 1e-6)))
    bad += count_mismatches(ops.layernorm_modulate(h, e[1], e[0], 1e-6), ops.layernorm_modulate_eager(h, e[1], e[0], 1e-6))
    t6 = torch.randn(B, 6, H, device='cuda', generator=g)
    bad += count_mismatches(ops.layernorm_modulate_fp32(h, t6[:, 1:2], t6[:, 0:1]), ops.layernorm_modulate_fp32_eager(h, t6[:, 1:2], t6[:, 0:1]))
torch.cuda.synchronize()
print('mismatches', bad)
assert bad == 0
