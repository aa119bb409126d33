"""The check every patched-model GPU test makes: the output of the unpatched model, then difuse.patch, the same
inputs twice (the first call verifies each signature, the second runs fused only) with the same bits, every listed
site fused with no fallback and nothing disabled (block gates too), then unpatch and the original bits again."""
import torch

import difuse
from difuse.gate import count_mismatches


def randomize_weights_(model, seed, device="cuda", is_norm=lambda name: "norm" in name):
    """Every parameter redrawn from one generator, in named_parameters order: 1-D norm weights (is_norm(name))
    1 + 0.1 N(0, 1), other 1-D parameters 0.02 N(0, 1), the rest N(0, 1) / sqrt(fan-in) (fan-in: p[0].numel()). A
    class's zero-initialised modulation or output projections then compute something."""
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and is_norm(name):
                p.copy_(1 + 0.1 * torch.randn(p.shape, device=device, generator=g))
            elif p.dim() == 1:
                p.copy_(0.02 * torch.randn(p.shape, device=device, generator=g))
            else:
                p.copy_(torch.randn(p.shape, device=device, generator=g) / p[0].numel() ** 0.5)
    return model


def reduced_model(build, seed, device="cuda", is_norm=lambda name: "norm" in name):
    """build() (a model or a block) constructed on the device after seeding torch, in bf16 and eval mode, every
    parameter then redrawn by randomize_weights_."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = build()
    return randomize_weights_(model.to(torch.bfloat16).eval(), seed, device, is_norm)


def run(model, inputs, inference=False):
    """model(**inputs)[0] under no_grad, or under torch.inference_mode() (inference=True)."""
    with torch.inference_mode() if inference else torch.no_grad():
        return model(**inputs)[0]


def assert_patched_matches(model, inputs, sites, absent=(), inference=False):
    """The patched model's output is bit-identical to the unpatched one's (first call verifies, second runs fused);
    each of `sites` fused, none fell back or is disabled; none of `absent` exists; unpatch restores the original.
    inference=True: every call under torch.inference_mode() (a third patched call too: ERNIE's row check)."""
    ref = run(model, inputs, inference)
    difuse.patch(model)
    try:
        for _ in range(3 if inference else 2):  # the first call verifies, the next ones run fused only
            assert count_mismatches(run(model, inputs, inference), ref) == 0
        rep = difuse.report(model)
        text = difuse.format_report(rep)
        for name in sites:
            s = rep["sites"][name]
            assert s["fused"] > 0 and s["fallback"] == 0 and not s["disabled"], "%s\n%s" % (name, text)
        assert not any(c["disabled"] for c in rep["blocks"].values()), text
    finally:
        difuse.unpatch(model)
    assert count_mismatches(run(model, inputs, inference), ref) == 0  # unpatch restores the original


def capture_forward(model, inputs):
    """A CUDA graph of model(**static)[0] under no_grad after one run on a side stream: (graph, static inputs (copies
    of `inputs` the graph reads), its output tensor)."""
    static = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in inputs.items()}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run(model, static)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = model(**static)[0]
    return graph, static, out


def replay_with(graph, static, inputs):
    """Copies `inputs`' tensors into the graph's static inputs and replays it (synchronized)."""
    for k, v in static.items():
        if torch.is_tensor(v):
            v.copy_(inputs[k])
    graph.replay()
    torch.cuda.synchronize()


def assert_replays_match(model, graph, static, out, inputs, ref, other):
    """The captured patched forward replayed on `other` equals the unpatched model on it (this unpatches the model),
    and replayed on `inputs` again equals `ref`, bit for bit."""
    replay_with(graph, static, other)
    difuse.unpatch(model)
    assert count_mismatches(out, run(model, other)) == 0
    replay_with(graph, static, inputs)
    assert count_mismatches(out, ref) == 0
