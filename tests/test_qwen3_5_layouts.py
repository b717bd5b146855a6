"""Qwen3.5 (dense, text) in the training layouts, against transformers fp32 (and peft for LoRA), all in
one 2-rank gloo group (tests/workers_qwen3_5_layouts.py): PP2 (1F1B, tied embeddings split over the
stages) and PP2 x VPP2 (interleaved 1F1B), FSDP2 over dp2, ``recompute="full"`` at TP2+SP, each with two
SGD steps of ``forward_backward`` and forward-only log-probs; the fused head at TP2+SP (no logits, the
materialised head's loss and gradients); ``compile=True`` at TP2 (one step); LoRA at TP2+SP on every linear
projection (Gated DeltaNet ``in_proj_qkv``/``in_proj_z``/``in_proj_b``/``in_proj_a``/``out_proj``, the
gated attention's ``q_proj`` ... ``o_proj``, the MLP) against peft; ``iter_export("hf")`` after training
and ``save_pretrained`` bitwise (vLLM export: tests/test_vllm_hybrid.py).

Bounds: step 0 at the fp32 tolerances of the other models' layout tests. After an SGD step this
randomized hybrid amplifies fp32 rounding (transformers itself moves its gradients by 1e-3 relative
between weights 7e-6 apart), so steps use lr 0.02 and step-1 gradients / log-probs after two steps are
held at 1e-4 (measured <= 6.6e-5, at TP2+SP with recompute).
"""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.workers_qwen3_5 import configs, write_model
from tests.workers_qwen3_5_layouts import LORA_TARGETS, layouts_suite

BOUNDS = {
    "loss_step0": 1e-5, "loss_step1": 1e-5, "grads_step0": 1e-4, "grads_step1": 1e-4, "logprobs": 1e-4,
    "tied_copies_differ": 0.0, "export_after_steps": 1e-5,
    "fused_logits_returned": 0.0, "fused_loss": 1e-5, "fused_grads": 1e-4, "fused_vs_plain_loss": 1e-6,
    "fused_vs_plain_grads": 1e-5,
    "loss_vs_eager_step0": 1e-6, "compiled_no_graphs": 0.0,
    "logits_vs_peft": 2e-5, "lora_grads_vs_peft": 1e-4, "base_params_with_grad": 0.0, "lora_grads_count_mismatch": 0.0,
    "saved_adapter_logits": 2e-5, "saved_config_differs": 0.0, "merged_vs_peft": 1e-6, "merged_export_vs_saved": 0.0,
    "saved_vs_exported_not_bitwise": 0.0, "saved_logprobs_vs_ours": 1e-5, "bf16_saved_not_cast": 0.0,
    "bf16_saved_config_wrong": 0.0, "names_mismatch": 0.0, "vs_transformers": 1e-5, "oversize_buckets": 0.0,
    "ranks_differ": 0.0, "bf16_not_cast": 0.0, "bf16_dtype": 0.0,
}
INFORMATIONAL = {"buckets", "saved_files"}
LAYOUTS = {"(tp=1 pp=2 sp=off) 1f1b", "(tp=1 pp=2 vpp=2 sp=off) interleaved_1f1b", "(tp=1 pp=1 sp=off fsdp)",
           "(tp=2 pp=1 sp=on recompute=full)", "(tp=2 pp=1 sp=on) fused head", "(tp=2 pp=1 sp=off) compile",
           "(tp=2 pp=1 sp=on) lora", "(tp=2 pp=1 sp=off) export"}


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    from tests.workers_lora import make_adapter

    root = tmp_path_factory.mktemp("qwen3_5_layouts")
    dirs = {name: write_model(root, name, cfg, seed=i) for i, (name, cfg) in enumerate(configs().items())}
    make_adapter(dirs["mixed"], str(root / "adapter"), LORA_TARGETS)
    ranks = run_distributed(2, layouts_suite, dirs, str(root / "adapter"), str(root))
    return [r for rank in ranks for r in rank]


def test_qwen3_5_layouts_match_transformers(records):
    assert {r[1] for r in records} == LAYOUTS, sorted({r[1] for r in records})
    unknown = {r[2] for r in records} - set(BOUNDS) - INFORMATIONAL
    assert not unknown, unknown
    bad = [f"{name} {layout} {metric}={value:.3g} (max {BOUNDS[metric]})"
           for name, layout, metric, value in records if metric in BOUNDS and not value <= BOUNDS[metric]]
    assert not bad, "\n".join(bad)
