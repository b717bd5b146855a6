"""Tiny models and rank bodies for the FP8 export tests (tests/test_fp8_export.py).

``fp8_configs`` sizes every architecture so that most linear weights have partial edge blocks
(hidden 160, intermediate 200: neither a multiple of 128); ``write_model`` saves a random model with
transformers' own ``save_pretrained`` after zeroing whole 128x128 blocks (full and partial) of the
gate/up and down projections, so all-zero blocks are exported too. ``aligned_configs`` are sized for
vLLM's FP8 rules at TP 2 (every shard and packing boundary on a 128 block); ``loader_configs`` for
transformers' FP8 dequantization (each dimension at most 128 or a multiple of 128, see
docs/formats.md).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist

ARCH_MODULES = {"llama": "models.llama", "qwen2": "models.qwen2", "qwen2_moe": "models.qwen2_moe",
                "qwen3": "models.qwen3", "qwen3_moe": "models.qwen3_moe", "qwen2_vl": "models.qwen2_vl",
                "qwen2_5_vl": "models.qwen2_5_vl"}


def _vl(kind: str, *, text: dict, vision: dict, tied: bool):
    from tests.vl_cases import VL25_CASES, VL_CASES, vl_config

    kwargs = copy.deepcopy(VL25_CASES["v25_untied"] if kind == "qwen2_5_vl" else VL_CASES["untied"])
    kwargs["text_config"].update(text)
    kwargs["vision_config"].update(vision)
    kwargs["tie_word_embeddings"] = tied
    return vl_config(kwargs)


def fp8_configs() -> dict:
    """One config per architecture, partial edge blocks everywhere (160 / 200 / 136 wide)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    base = dict(vocab_size=100, hidden_size=160, intermediate_size=200, num_hidden_layers=2,
                max_position_embeddings=64)
    text_vl = {"hidden_size": 160, "intermediate_size": 200, "num_attention_heads": 4, "num_key_value_heads": 2,
               "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 8, 8]}}
    return {
        "llama": LlamaConfig(**base, num_attention_heads=5, num_key_value_heads=1, attention_bias=True, mlp_bias=True,
                             tie_word_embeddings=False),
        "qwen2": Qwen2Config(**base, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
        "qwen2_moe": Qwen2MoeConfig(**base, num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=136,
                                    shared_expert_intermediate_size=200, num_experts=4, num_experts_per_tok=2,
                                    mlp_only_layers=[1], tie_word_embeddings=False),
        "qwen3": Qwen3Config(**base, num_attention_heads=4, num_key_value_heads=2, head_dim=40,
                             tie_word_embeddings=False),
        "qwen3_moe": Qwen3MoeConfig(**base, num_attention_heads=4, num_key_value_heads=2, head_dim=40,
                                    moe_intermediate_size=136, num_experts=4, num_experts_per_tok=2,
                                    mlp_only_layers=[1], tie_word_embeddings=True),
        "qwen2_vl": _vl("qwen2_vl", text=text_vl, vision={"embed_dim": 160, "hidden_size": 160, "mlp_ratio": 2},
                        tied=False),
        "qwen2_5_vl": _vl("qwen2_5_vl", text=text_vl, vision={"hidden_size": 160, "intermediate_size": 200,
                                                              "out_hidden_size": 160}, tied=True),
    }


def aligned_configs() -> dict:
    """vLLM-loadable FP8 at TP 1 and 2: 128-wide heads (one KV head, replicated at TP 2), MLP and
    expert widths of 256 (128 per rank). TP 4 cuts the query rows (256 / 4 = 64): refused."""
    from transformers import Qwen2Config, Qwen2MoeConfig

    base = dict(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=128, max_position_embeddings=64)
    return {"qwen2": Qwen2Config(**base, tie_word_embeddings=False),
            "qwen2_moe": Qwen2MoeConfig(**base, moe_intermediate_size=256, shared_expert_intermediate_size=256,
                                        num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)}


def loader_configs() -> dict:
    """Sizes transformers' FP8 dequantization reads right (each dimension <= 128 or a multiple of 128;
    96-wide tensors are single partial blocks)."""
    from transformers import Qwen2Config, Qwen3MoeConfig

    text_vl = {"hidden_size": 96, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
               "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 5, 5]}}
    return {
        "qwen2": Qwen2Config(vocab_size=100, hidden_size=96, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                             max_position_embeddings=64),
        "qwen3_moe": Qwen3MoeConfig(vocab_size=100, hidden_size=96, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                    moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                                    max_position_embeddings=64, tie_word_embeddings=False),
        "qwen2_vl": _vl("qwen2_vl", text=text_vl, vision={"embed_dim": 128, "hidden_size": 96, "mlp_ratio": 2},
                        tied=False),
    }


def _zero_blocks(name: str, p: torch.Tensor) -> None:
    """All-zero blocks: the first full block of every gate projection, the partial corner block of
    every down projection / vision fc2 (when it has one), and the same in two experts."""
    if p.dim() == 2 and name.endswith(("gate_proj.weight", "fc1.weight")) and min(p.shape) >= 128:
        p[:128, :128] = 0
    elif p.dim() == 2 and name.endswith(("down_proj.weight", "fc2.weight")) and min(p.shape) > 128:
        p[128:, 128:] = 0
    elif p.dim() == 3 and name.endswith("experts.gate_up_proj") and min(p.shape[1:]) >= 128:
        p[0, :128, :128] = 0
    elif p.dim() == 3 and name.endswith("experts.down_proj") and min(p.shape[1:]) > 128:
        p[1, 128:, 128:] = 0


def write_model(root, name: str, config, seed: int = 0) -> str:
    """A random transformers model of ``config`` (norms near 1, the rest normal(0, 0.05)) with zeroed
    blocks, saved with transformers' ``save_pretrained`` under ``root/name``."""
    from transformers import (
        AutoModelForCausalLM,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )

    torch.manual_seed(seed)
    if isinstance(config, Qwen2_5_VLConfig):
        model = Qwen2_5_VLForConditionalGeneration(config)
    elif isinstance(config, Qwen2VLConfig):
        model = Qwen2VLForConditionalGeneration(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if ("norm" in pname or ".ln_q." in pname) and pname.endswith(".weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.05)
            _zero_blocks(pname, p)
    path = Path(root) / name
    model.save_pretrained(path)
    return str(path)


def build(arch: str, source, **parallel):
    import importlib

    from parallel import ParallelConfig

    return importlib.import_module(ARCH_MODULES[arch]).build_parallel_model(source, ParallelConfig(**parallel))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bits, for bitwise comparisons (fp8 has no ``torch.equal`` on every build)."""
    return t.contiguous().view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


# ------------------------------------------------------------------ rank bodies (world 2)
def layout_case(arch: str, path: str, parallel: dict, out_dir: str, vllm_tp: int | None) -> dict:
    """FP8 exports of a model built at ``parallel`` under ``out_dir``: the HF buckets (small, so several;
    ``exported.safetensors``), the save_pretrained directory ``hf`` and, with ``vllm_tp``, the vLLM
    sharded_state ``vllm``; returns whether the ranks' buckets differ."""
    model = build(arch, path, **parallel)
    if dist.get_rank() == 0:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    exported = {n: t.clone() for b in model.iter_export("hf", bucket_bytes=40_000, quantization="fp8")
                for n, t in b.tensors()}
    checksum = torch.tensor([float(sum(int(t.contiguous().view(torch.uint8).long().sum()) for t in exported.values()))],
                            dtype=torch.float64)
    sums = [torch.zeros_like(checksum) for _ in range(dist.get_world_size())]
    dist.all_gather(sums, checksum)
    shm_differs = None
    if not model.weight_map.has_experts:  # shared memory carries the source bucket; FP8 is made from it alike
        shm = {n: t.clone() for b in model.iter_export("hf", bucket_bytes=40_000, quantization="fp8", transport="shm")
               for n, t in b.tensors()}
        shm_differs = set(shm) != set(exported) or any(not torch.equal(as_bytes(shm[n]), as_bytes(t))
                                                       for n, t in exported.items())
    model.save_pretrained(f"{out_dir}/hf", quantization="fp8", max_shard_size=60_000)
    if vllm_tp:
        model.save_vllm_sharded_state(f"{out_dir}/vllm", tp=vllm_tp, quantization="fp8")
    if dist.get_rank() == 0:  # tensors travel through a file (the result queue takes plain data)
        from safetensors.torch import save_file

        save_file(exported, f"{out_dir}/exported.safetensors")
    return {"ranks_differ": len({s.item() for s in sums}) > 1, "shm_differs": shm_differs}


def bad_name_case(path: str, out_dir: str) -> list[str]:
    """Every rank asks for a quantization we do not write: the messages each call raises."""
    from models.common.export import ExportError

    model = build("qwen2", path, tp=2)
    messages = []
    for call in (lambda: model.save_pretrained(f"{out_dir}/bad", quantization="fp4"),
                 lambda: next(iter(model.iter_export("hf", quantization="int8"))),
                 lambda: model.save_vllm_sharded_state(f"{out_dir}/badv", tp=2, quantization="FP8")):
        try:
            call()
            messages.append("no error")
        except ExportError as exc:
            messages.append(str(exc))
    return messages


def fp8_suite(cases: list[tuple], bad_path: str, out_root: str) -> dict:
    results = {}
    for n, (arch, path, parallel, vllm_tp) in enumerate(cases):
        results[n] = layout_case(arch, path, parallel, f"{out_root}/case{n}", vllm_tp)
    results["bad"] = bad_name_case(bad_path, out_root)
    return results
