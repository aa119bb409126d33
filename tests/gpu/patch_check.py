"""The check every patched-model GPU test makes: the output of the unpatched model, then difuse.patch, the same
inputs twice (the first call verifies each signature, the second runs fused only) with the same bits, every listed
site fused with no fallback and nothing disabled (block gates too), then unpatch and the original bits again."""
import torch

import difuse
from difuse.gate import count_mismatches


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


def assert_patched_matches(model, inputs, sites):
    ref = run(model, inputs)
    difuse.patch(model)
    try:
        assert count_mismatches(run(model, inputs), ref) == 0  # verifying call
        assert count_mismatches(run(model, inputs), ref) == 0  # fused only
        rep = difuse.report(model)
        text = difuse.format_report(rep)
        for name in sites:
            s = rep["sites"][name]
            assert s["fused"] > 0 and s["fallback"] == 0 and not s["disabled"], "%s\n%s" % (name, text)
        assert not any(c["disabled"] for c in rep["blocks"].values()), text
    finally:
        difuse.unpatch(model)
    assert count_mismatches(run(model, inputs), ref) == 0  # unpatch restores the original
