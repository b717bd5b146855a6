"""The direction tables and targets of ``tools/bench_convert.py`` (name: (source directory key, ``pmz convert``
arguments)): the dense models', the Gated DeltaNet hybrids', Qwen3-MoE's (Qwen3-VL's: ``bench_convert_vl``), and
issue 40's ratio and memory targets."""

from __future__ import annotations

COPY_TARGET = 0.8  # cp seconds / pmz seconds, whole process: dense models (issues 8, 40)
COPY_TARGET_MOE_VLLM = 0.7  # issue 40: MoE models, and vLLM targets of every model
RSS_LIMIT_MIB = 64  # issue 40: peak RSS of every direction, flat from the small to the large size


DIRECTIONS = {  # name: (source dir key, pmz convert arguments)
    "legacy->hf": ("legacy", ["--to", "hf"]),
    "dist->hf": ("dist", ["--to", "hf"]),
    "hf->legacy": ("hf", ["--to", "megatron", "--tp", "2", "--pp", "2"]),
    "hf->dist": ("hf", ["--to", "megatron-dist", "--tp", "2", "--pp", "2"]),
    "legacy->legacy": ("legacy", ["--to", "megatron", "--tp", "1", "--pp", "2"]),
    "dist->legacy": ("dist", ["--to", "megatron", "--tp", "4", "--pp", "1"]),
    "hf->vllm": ("hf", ["--to", "vllm", "--tp", "2"]),  # issue 40: vLLM sharded_state on the copy path
    "vllm->hf": ("vllm", ["--to", "hf"]),
    "hf->hf": ("hf", ["--to", "hf"]),  # issue 40: the HF writer alone (12 source shards -> one 5 GB shard)
}
HYBRID_DIRECTIONS = {  # --model qwen3.5 / qwen3.5-moe: every direction by the copy path (issue 40)
    "hf->hf": ("hf", ["--to", "hf"]),
    "hf->legacy": ("hf", ["--to", "megatron", "--tp", "2"]),
    "hf->dist": ("hf", ["--to", "megatron-dist", "--tp", "2"]),
    "legacy->hf": ("legacy", ["--to", "hf"]),
    "dist->hf": ("dist", ["--to", "hf"]),
    "hf->vllm": ("hf", ["--to", "vllm", "--tp", "2"]),
    "vllm->hf": ("vllm", ["--to", "hf"]),
}
MOE_DIRECTIONS = {  # --model qwen3-moe: Megatron sources and targets are EP2 x TP2 (all on the copy path)
    "legacy->hf": ("legacy", ["--to", "hf"]),
    "dist->hf": ("dist", ["--to", "hf"]),
    "hf->legacy": ("hf", ["--to", "megatron", "--tp", "2", "--ep", "2"]),
    "hf->dist": ("hf", ["--to", "megatron-dist", "--tp", "2", "--ep", "2"]),
    "hf->grouped": ("hf", ["--to", "megatron", "--tp", "2", "--ep", "2", "--moe-grouped-gemm"]),
    "grouped->hf": ("grouped", ["--to", "hf"]),  # a legacy GroupedMLP EP2 x TP2 source (experts transposed back)
    "hf->vllm": ("hf", ["--to", "vllm", "--tp", "2"]),
    "vllm->hf": ("vllm", ["--to", "hf"]),
    "hf->hf": ("hf", ["--to", "hf"]),
}


def speed_target(model: str, direction: str) -> float:
    """Issue 40's ratio target for a direction: 0.8x cp for dense models, 0.7x for MoE models and vLLM targets."""
    return COPY_TARGET_MOE_VLLM if "moe" in model or direction.endswith("->vllm") else COPY_TARGET
