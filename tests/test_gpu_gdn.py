"""CUDA-only checks of the Gated DeltaNet kernels' fla dispatch (``parallel/gated_delta_rule.py``):
flash-linear-attention's ``chunk_gated_delta_rule`` and ``causal_conv1d`` against our torch forms on
the same bf16 inputs, forward and backward, padded rows (initial and final states, lengths not a
multiple of 64, grouped value heads) and packed sequences (an empty and a one-token one among them);
the automatic choice and ``PMZ_GDN_KERNEL``; and our Gated DeltaNet block with fla against the same
block on the torch forms. Skipped without CUDA or without the ``fla-core`` package; the CPU side is
tests/test_gated_delta_rule.py.

Bounds (chosen by reading, not yet measured on a GPU): the torch forms take the bf16 inputs and run
in fp32, so they are the near-exact side; fla keeps some chunk intermediates in bf16 (its triangular
solve's output and ``w``/``u`` are in the input dtype), so it may differ by a few bf16 ulps of the
values' scale: max |fla - torch| / max |torch| <= 2e-2 for outputs and states, 5e-2 for gradients."""

from __future__ import annotations

import pytest
import torch

from parallel import gated_delta_rule as gdr

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(gdr._fla_delta_rule() is None, reason="fla-core (flash-linear-attention) is not installed"),
]

OUT_TOL, GRAD_TOL = 2e-2, 5e-2
LENGTHS = [300, 1, 0, 130, 64, 77]


def _inputs(b, t, hk=2, hv=4, dk=128, dv=128, seed=0, n_init=None):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    q, k, v = rnd(b, t, hk, dk).bfloat16(), rnd(b, t, hk, dk).bfloat16(), rnd(b, t, hv, dv).bfloat16()
    g = -torch.rand(b, t, hv, generator=gen, device="cuda") * 0.5  # fp32, as the block computes it
    beta = torch.rand(b, t, hv, generator=gen, device="cuda").bfloat16()
    init = rnd(n_init if n_init is not None else b, hv, dk, dv) * 0.1
    return [q, k, v, g, beta, init]


def _run(kernel, inputs, cu=None):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    o, final = gdr.gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu,
                                    use_qk_l2norm=True, kernel=kernel)
    gen = torch.Generator(device="cuda").manual_seed(1)
    ((o.float() * torch.randn(o.shape, generator=gen, device="cuda")).sum()
     + (final.float() * torch.randn(final.shape, generator=gen, device="cuda")).sum()).backward()
    return [o, final] + [x.grad for x in leaves]


def _compare(got, ref, names):
    for name, a, b in zip(names, got, ref):
        assert a.shape == b.shape, name
        err = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()
        tol = OUT_TOL if name in ("o", "final") else GRAD_TOL
        assert err <= tol, f"{name}: max rel {err:.3e} > {tol:.0e}"


NAMES = ["o", "final", "dq", "dk", "dv", "dg", "dbeta", "dinit"]


def test_fla_delta_rule_matches_torch_padded_rows():
    inputs = _inputs(2, 300)
    _compare(_run("fla", inputs), _run("torch", inputs), NAMES)


def test_fla_delta_rule_matches_torch_packed():
    cu = torch.tensor([0] + LENGTHS, device="cuda").cumsum(0)
    inputs = _inputs(1, int(cu[-1]), seed=2, n_init=len(LENGTHS))
    got, ref = _run("fla", inputs, cu), _run("torch", inputs, cu)
    _compare(got, ref, NAMES)
    assert torch.equal(got[1][2], inputs[5][2]), "an empty sequence keeps its initial state"


def test_automatic_choice_and_override(monkeypatch):
    x = torch.zeros(1, 4, 2, 8, device="cuda", dtype=torch.bfloat16)
    monkeypatch.delenv(gdr.KERNEL_ENV, raising=False)
    assert gdr.delta_rule_kernel(x) == "fla"
    assert gdr.delta_rule_kernel(x.float()) == "torch", "fp32 stays on the exact torch forms"
    monkeypatch.setenv(gdr.KERNEL_ENV, "torch")
    assert gdr.delta_rule_kernel(x) == "torch"
    with pytest.raises(ValueError, match="needs CUDA bf16/fp16"):
        gdr.delta_rule_kernel(x.float(), "fla")


@pytest.mark.skipif(gdr._fla_conv() is None, reason="fla has no sequence-first causal_conv1d")
@pytest.mark.parametrize("packed", [False, True])
def test_fla_conv_matches_torch(packed):
    gen = torch.Generator(device="cuda").manual_seed(3)
    cu = torch.tensor([0] + LENGTHS, device="cuda").cumsum(0) if packed else None
    x = torch.randn(1 if packed else 2, int(cu[-1]) if packed else 300, 96, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(96, 4, generator=gen, device="cuda") * 0.5).bfloat16()
    pos = gdr.positions_in_sequence(cu, x.shape[1]) if packed else None
    results = []
    for kernel in ("fla", "torch"):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = gdr.causal_conv1d(xs, ws, pos, cu_seqlens=cu, kernel=kernel)
        (y.float() * torch.linspace(-1, 1, y.numel(), device="cuda").view_as(y)).sum().backward()
        results.append([y, xs.grad, ws.grad])
    _compare(results[0], results[1], ["o", "dx", "dw"])


def test_block_with_fla_matches_block_on_torch(monkeypatch):
    """Our Gated DeltaNet block (packed batch) with the fla kernels against itself on the torch forms."""
    from transformers import Qwen3_5TextConfig

    from models.common.blocks.gated_deltanet import ParallelGatedDeltaNet
    from models.qwen3_5.config import model_config
    from parallel.groups import ParallelGroups

    hf = Qwen3_5TextConfig(hidden_size=256, num_hidden_layers=1, layer_types=["linear_attention"],
                           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                           linear_value_head_dim=64, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                           intermediate_size=64, vocab_size=32)
    torch.manual_seed(0)
    block = ParallelGatedDeltaNet(model_config(hf), ParallelGroups.single(), torch.bfloat16, torch.device("cuda"))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.05 if p.dim() > 1 else 0.5)
        block.norm.weight.fill_(1.0)
    cu = torch.tensor([0] + LENGTHS, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
    x = torch.randn(int(cu[-1]), 1, 256, device="cuda").bfloat16()
    results = []
    for kernel in ("fla", "torch"):
        monkeypatch.setenv(gdr.KERNEL_ENV, kernel)
        block.zero_grad()
        xs = x.clone().requires_grad_()
        out = block(xs, cu_seqlens=cu)
        out.float().square().mean().backward()
        results.append([out, xs.grad, block.in_proj_qkvz.weight.grad, block.conv1d.weight.grad, block.A_log.grad])
    _compare(results[0], results[1], ["o", "dx", "dqkvz", "dconv", "dA_log"])
