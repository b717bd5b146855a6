"""Qwen3.5 (dense, text: ``Qwen3_5ForCausalLM``) against transformers, fp32 (tests/workers_qwen3_5.py):
Gated DeltaNet and gated full-attention layers mixed by ``layer_types``, at TP1 (this process) and
TP2 without and with SP (one 2-rank gloo group): padded batch (right and left padding) and packed
batch against each sequence run alone in transformers — logits, loss, gradients of every HF tensor.
Logits are bounded in units of transformers' own fp32 error against transformers in fp64 (both
are different, equally valid summation orders; absolute differences reach ~1.5e-5 on logits of
size ~3), and absolutely at 5e-5. ``forward_backward`` (micro-batches, fused head) and ``save_pretrained``
at TP1. Bad configs, layouts and checkpoints: tests/test_hybrid_bad_input.py.
"""

from __future__ import annotations

import pytest

from tests.checkpoint_cache import cached
from tests.distributed import run_distributed
from tests.workers_qwen3_5 import case, configs, suite, write_model

BOUNDS = {
    "padded_logits": 5e-5, "packed_logits": 5e-5,
    "padded_logits_ratio": 4.0, "packed_logits_ratio": 4.0,  # x transformers' own fp32 error (measured <= 1.4)
    "padded_loss": 1e-5, "packed_loss": 1e-5,
    "padded_grads": 1e-4, "packed_grads": 1e-4,  # relative to each tensor's largest gradient
}
PLAN = [("mixed", False), ("mixed", True), ("tied_kv1", False), ("tied_kv1", True)]


@pytest.fixture(scope="module")
def dirs():
    """Read-only, from the session's checkpoint cache (the same configs and seeds as tests/test_qwen3_5_layouts.py;
    "mixed" at seed 0 as tests/test_qwen3_5_context.py)."""
    return {name: cached(write_model, name, cfg, seed=i) for i, (name, cfg) in enumerate(configs().items())}


@pytest.fixture(scope="module")
def records(dirs):
    single = [r for name in dirs for r in case(name, dirs[name], 1, False)]
    distributed = [r for rank in run_distributed(2, suite, dirs, PLAN) for r in rank]
    return single + distributed


def test_qwen3_5_matches_transformers(records):
    layouts = {(r[0], r[1]) for r in records}
    assert len(layouts) == len(PLAN) + 2, sorted(layouts)  # every case at tp1, tp2 and tp2+sp
    bad = [f"{name} {layout} {metric}={value:.3g} (max {BOUNDS[metric]})"
           for name, layout, metric, value in records if metric in BOUNDS and not value <= BOUNDS[metric]]
    assert not bad, "\n".join(bad)
    assert all(v > 1.0 for _, _, m, v in records if m == "packed_loss_value")  # a real loss was compared


def test_config():
    from models.qwen3_5.config import model_config

    cfg = model_config(configs()["mixed"])
    assert cfg.rotary_dim == 4 and cfg.linear_layers() == frozenset({0, 1, 3})


def test_forward_backward_and_save_pretrained(dirs, tmp_path):
    """``forward_backward`` (2 micro-batches, the fused head) equals transformers' loss and gradients on a
    padded batch; ``save_pretrained`` writes a checkpoint transformers loads bitwise."""
    import torch
    from transformers import AutoModelForCausalLM

    from models.qwen3_5 import build_parallel_model

    path = dirs["mixed"]
    model, hf = build_parallel_model(path), AutoModelForCausalLM.from_pretrained(path).eval()
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 101, (3, 40), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    loss = model.forward_backward(ids, labels, attention_mask=mask, num_microbatches=2)
    ref = hf(input_ids=ids, attention_mask=mask, labels=labels)
    ref.loss.backward()
    assert abs(float(loss) - ref.loss.item()) < 1e-5
    ours = dict(model.iter_hf_weights({n: p.grad for n, p in model.named_parameters()}))
    worst = max(((ours[n] - p.grad).abs().max() / p.grad.abs().max()).item() for n, p in hf.named_parameters())
    assert worst < 1e-4
    model.save_pretrained(str(tmp_path / "saved"))
    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))
    assert all(torch.equal(a, b) for a, b in zip(hf.state_dict().values(), saved.state_dict().values()))
