"""The set-ups of tools/bench_gpu.py: model shapes, FLOP counts and one step of each variant (ours,
ours compiled, transformers, megatron-core) for training and for the RL forward-only log-prob step.

Set-ups (``SETUPS``; ``--smoke`` swaps every shape for a tiny one of the same family):
  * ``qwen2-1.5b``: Qwen2-1.5B shape (hidden 1536, 28 layers, 12 / 2 heads, MLP 8960), training.
  * ``qwen3-8b-cut``: Qwen3-8B shape (hidden 4096, 32 / 8 heads of 128, MLP 12288, q/k norms) cut to
    8 of its 36 layers so it trains on one GPU with AdamW (the printout says so).
  * ``qwen3-moe``: Qwen3-30B-A3B shape (hidden 2048, 32 / 4 heads of 128, 128 experts, top-8, expert
    MLP 768) cut to 4 of its 48 layers, training; transformers with ``experts_implementation=
    "grouped_mm"`` (its fastest built-in one in 5.24; it falls back to "eager" only where
    grouped_mm cannot run, and the result line says which ran).
  * ``rl-logprob``: the Qwen2-1.5B shape, forward only: per-token log-probs of the labels (ours
    ``forward_backward(..., forward_only=True)``; transformers logits -> log_softmax -> gather;
    megatron-core not run: its GPTModel has no log-prob output of its own).
"""

from __future__ import annotations

import importlib.util
import os

QWEN2_1_5B = dict(family="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, head_dim=128, vocab_size=151936)
QWEN3_8B_CUT = dict(family="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=8,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                    note="8 of Qwen3-8B's 36 layers")
QWEN3_MOE = dict(family="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                 num_experts=128, num_experts_per_tok=8, num_hidden_layers=4, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128, vocab_size=151936, note="4 of Qwen3-30B-A3B's 48 layers")
SETUPS = {"qwen2-1.5b": QWEN2_1_5B, "qwen3-8b-cut": QWEN3_8B_CUT, "qwen3-moe": QWEN3_MOE, "rl-logprob": QWEN2_1_5B}
FORWARD_ONLY = {"rl-logprob"}
_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=512)


def shape_of(setup: str, smoke: bool) -> dict:
    shape = dict(SETUPS[setup])
    if smoke:
        shape.update(_TINY, note="tiny smoke shape")
        if shape["family"] == "qwen3_moe":
            shape.update(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    return shape


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn_2_cuda") is not None


def model_flops_per_token(shape: dict, seq_len: int, forward_only: bool = False) -> float:
    """6 (training) or 2 (forward) x the parameters of every matrix multiply a token goes through
    (attention projections, the MLP or the top-k experts and router, the LM head) plus attention's
    own 3 (1) x 4 x layers x heads x head_dim x the mean causal context."""
    h, L, d = shape["hidden_size"], shape["num_hidden_layers"], shape["head_dim"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    if shape["family"] == "qwen3_moe":
        mlp = shape["num_experts_per_tok"] * 3 * h * shape["moe_intermediate_size"] + h * shape["num_experts"]
    else:
        mlp = 3 * h * shape["intermediate_size"]
    linear = L * (h * (heads + 2 * kv) * d + heads * d * h + mlp) + h * shape["vocab_size"]
    attention = 4 * L * heads * d * (seq_len + 1) / 2
    return (2 if forward_only else 6) * linear + (1 if forward_only else 3) * attention


def hf_config(shape: dict, seq_len: int):
    from transformers import AutoConfig

    kw = {k: v for k, v in shape.items() if k not in ("family", "note")}
    if shape["family"] == "qwen2":
        kw.pop("head_dim")
    return AutoConfig.for_model(shape["family"], **kw, max_position_embeddings=seq_len, tie_word_embeddings=False)


def hf_attention() -> str:
    """transformers' fastest attention here: flash_attention_2 where flash-attn is installed, else sdpa."""
    return "flash_attention_2" if flash_attn_installed() else "sdpa"


def build(variant: str, setup: str, shape: dict, seqs: int, seq_len: int, device, dtype):
    """(model, run, info): ``run()`` is one step's forward - a loss to backpropagate (training) or the
    per-token log-probs (forward-only set-ups, called under no_grad by the caller)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab_size"], (seqs, seq_len), generator=gen).to(device)
    forward_only = setup in FORWARD_ONLY
    info = {}
    if variant.startswith("ours"):
        import importlib

        builder = importlib.import_module(f"models.{shape['family']}").build_parallel_model
        model = builder(hf_config(shape, seq_len), dtype=dtype, device=device, compile=variant == "ours-compiled")
        if forward_only:
            def run():
                return model.forward_backward(ids, ids, forward_only=True)
        else:
            flat = ids.reshape(-1)
            cu = torch.arange(seqs + 1, dtype=torch.int32, device=device) * seq_len

            def run():
                return model(flat, cu_seqlens=cu, labels=flat, return_logits=False).loss
        from parallel.varlen_kernels import flash_kernel

        probe = torch.zeros(1, 1, shape["head_dim"], device=device, dtype=dtype)
        info["attention_kernel"] = flash_kernel(probe, equal_lengths=True) or "exact (sdpa/reference)"
    elif variant in ("hf", "hf-liger"):
        from transformers import AutoModelForCausalLM

        if variant == "hf-liger":
            info["liger"] = apply_liger(shape["family"], device)
        impl = hf_attention()
        moe_on_gpu = shape["family"] == "qwen3_moe" and device.type == "cuda"
        kw = {"experts_implementation": "grouped_mm"} if moe_on_gpu else {}
        model = AutoModelForCausalLM.from_config(hf_config(shape, seq_len), attn_implementation=impl, dtype=dtype,
                                                 **kw).to(device)
        info["attention_kernel"] = impl
        if kw:
            info["experts_implementation"] = getattr(model.config, "_experts_implementation", "?")
        if forward_only:
            def run():
                logits = model(input_ids=ids).logits[:, :-1].float()
                return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        elif impl == "flash_attention_2":  # packed: one row, positions restart per sequence
            flat = ids.reshape(1, -1)
            pos = torch.arange(seq_len, device=device).repeat(seqs)[None]

            def run():
                return model(input_ids=flat, position_ids=pos, labels=flat).loss
        else:
            def run():
                return model(input_ids=ids, labels=ids).loss
    elif variant == "megatron":
        model, run, info = megatron(shape, seq_len, device, dtype, ids)
    else:
        raise SystemExit(f"unknown variant {variant!r}")
    return model, run, info


def apply_liger(family: str, device) -> str:
    """Liger-Kernel's patch of transformers' modeling module for ``family`` (what users apply instead of
    a parallel model: fused RMSNorm, RoPE, SwiGLU and the fused linear cross-entropy that never
    materialises the logits), applied before the model is built. Its kernels are Triton: CUDA only."""
    if device.type != "cuda":
        raise SystemExit("Liger-Kernel's Triton kernels need CUDA (not run in --smoke)")
    try:
        import liger_kernel.transformers as liger
    except ImportError as e:
        raise SystemExit(f"liger-kernel is not installed ({e})") from None
    name = f"apply_liger_kernel_to_{family}"
    getattr(liger, name)()
    return name


def _kernel_present(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def megatron(shape: dict, seq_len: int, device, dtype, ids):
    """megatron-core GPTModel, local (non-TE) spec, one rank, on a plain install: every fusion that
    needs Apex/Transformer Engine kernels off unless they are importable (``masked_softmax_fusion``
    needs ``scaled_masked_softmax_cuda`` - it failed without it on the H200, DESIGN.md). Its local
    spec's attention is megatron-core's own DotProductAttention (scores materialised): flash attention
    needs Transformer Engine's spec, which a plain install lacks."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    if shape["family"] == "qwen3_moe":
        raise SystemExit("megatron-core MoE is not benchmarked here (its grouped experts need TE/grouped_gemm)")
    if device.type == "cpu":  # --smoke: megatron-core's CUDA-only calls replaced, as the test oracle does
        from tests.megatron_oracle import apply_cpu_shims

        apply_cpu_shims()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    if device.type == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
    cuda = device.type == "cuda"
    fusions = dict(masked_softmax_fusion=cuda and _kernel_present("scaled_masked_softmax_cuda"),
                   bias_dropout_fusion=False,  # a torch.jit function of its own; off for the plain baseline
                   apply_rope_fusion=cuda and _kernel_present("transformer_engine"),
                   gradient_accumulation_fusion=cuda and _kernel_present("fused_weight_gradient_mlp_cuda"))
    qwen3 = shape["family"] == "qwen3"
    cfg = TransformerConfig(num_layers=shape["num_hidden_layers"], hidden_size=shape["hidden_size"],
                            ffn_hidden_size=shape["intermediate_size"],
                            num_attention_heads=shape["num_attention_heads"], kv_channels=shape["head_dim"],
                            num_query_groups=shape["num_key_value_heads"], normalization="RMSNorm",
                            gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
                            add_qkv_bias=not qwen3, qk_layernorm=qwen3, bf16=dtype == torch.bfloat16,
                            params_dtype=dtype, use_cpu_initialization=not cuda, hidden_dropout=0.0,
                            attention_dropout=0.0, **fusions)
    model = GPTModel(cfg, get_gpt_layer_local_spec(qk_layernorm=qwen3), vocab_size=shape["vocab_size"],
                     max_sequence_length=seq_len, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False).to(device)
    pos = torch.arange(seq_len, device=device)[None].expand_as(ids)
    labels = torch.roll(ids, -1, dims=1)

    def run():
        return model(ids, pos, None, labels=labels).float().mean()

    info = {"attention_kernel": "megatron local DotProductAttention",
            "fusions": ",".join(k for k, v in fusions.items() if v) or "none"}
    return model, run, info
