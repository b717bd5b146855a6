"""Mixture-of-experts facts for the Megatron converters (Qwen2-MoE): args both ways, expert keys.

Torch-free. What megatron-core 0.16 writes (read back from its files by tests/megatron_moe_oracle.py):

* legacy ``torch``: one folder per (tp, pp, ep) rank, ``mp_rank_TT[_PPP][_EEE]``; every file holds
  the whole non-expert part of its (tp, pp) stage (duplicated over EP ranks) plus its local experts
  ``decoder.layers.{l}.mlp.experts.local_experts.{i}.linear_fc{1,2}.weight``, global expert id
  ``ep_rank * E/ep + i``. Experts are split over the expert-TP group like a dense MLP (fc1
  ``[gate_r; up_r]``, fc2 on dim 1); Megatron-LM's default ``expert_tensor_parallel_size`` is the
  TP size, which is what we write and the only expert TP we read (ETP != TP puts rank files at
  (tp, ep) pairs that depend on the rank order: refused with a one-line reason).
* ``torch_dist``: experts stacked per layer and per global expert,
  ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` ``[L, E, 2F, H]`` (``[gate; up]``) and
  ``...linear_fc2.weight`` ``[L, E, H, F]``; with dense layers between MoE ones (``moe_layer_freq``)
  megatron-core does not stack and keys carry the global layer number
  (``decoder.layers.{g}.mlp.experts.experts.linear_fc1.weight`` ``[E, 2F, H]``).

Router semantics: Qwen2-MoE is softmax over all experts, then top-k, renormalised only with
``norm_topk_prob``. megatron-core's ``moe_router_pre_softmax=True`` is exactly that with
``norm_topk_prob=False``; its default (top-k of the logits, then softmax over the k) equals
``norm_topk_prob=True``. Every other router option that changes the forward is refused.
"""

from __future__ import annotations

from typing import Any

from models.common.config import UnsupportedConfigError

LOCAL_EXPERTS = ".mlp.experts.local_experts.{e}."
DIST_EXPERTS = ".mlp.experts.experts."


def arg_value(args: Any, name: str, default: Any = None) -> Any:
    """A Megatron argument, ``default`` when absent or None (Megatron-LM stores unset options as None)."""
    value = getattr(args, name, default)
    return default if value is None else value


def num_experts_of(args: Any) -> int | None:
    """Megatron-LM calls it ``num_experts``, TransformerConfig ``num_moe_experts``."""
    value = arg_value(args, "num_experts") or arg_value(args, "num_moe_experts")
    return int(value) if value else None


def moe_layer_pattern(args: Any, num_layers: int, where: str) -> list[int]:
    """``moe_layer_freq`` as megatron-core expands it: an int k makes layer i MoE iff ``i % k == 0``;
    a list gives 1 (MoE) or 0 (dense) per layer."""
    freq = arg_value(args, "moe_layer_freq", 1)
    if isinstance(freq, bool) or not isinstance(freq, (int, list, tuple)):
        raise UnsupportedConfigError(f"{where}: moe_layer_freq={freq!r}: expected an integer or a 0/1 list per layer")
    if isinstance(freq, int):
        if freq < 1:
            raise UnsupportedConfigError(f"{where}: moe_layer_freq={freq} must be positive")
        return [1 if i % freq == 0 else 0 for i in range(num_layers)]
    pattern = [int(x) for x in freq]
    if len(pattern) != num_layers or set(pattern) - {0, 1}:
        raise UnsupportedConfigError(f"{where}: moe_layer_freq {pattern} needs one 0/1 entry per layer "
                                     f"(num_layers={num_layers})")
    return pattern


def check_router(args: Any, where: str, arch: str = "qwen2_moe") -> None:
    """UnsupportedConfigError (one line, the first reason) for Megatron MoE options that make the
    model something other than Qwen2-MoE / Qwen3-MoE (``arch``; the same router, Qwen3-MoE without
    a shared expert): converting them would silently change the model."""
    reasons = []
    if arch == "qwen3_moe" and arg_value(args, "moe_shared_expert_intermediate_size"):
        reasons.append(f"moe_shared_expert_intermediate_size={arg_value(args, 'moe_shared_expert_intermediate_size')} "
                       f"(Qwen3-MoE has no shared expert)")
    score = arg_value(args, "moe_router_score_function", "softmax")
    if score != "softmax":
        reasons.append(f"moe_router_score_function={score!r} (Qwen2-MoE scores experts with a softmax)")
    scaling = arg_value(args, "moe_router_topk_scaling_factor")
    if scaling not in (None, 1, 1.0):
        reasons.append(f"moe_router_topk_scaling_factor={scaling} (Qwen2-MoE does not scale the routing weights)")
    if arg_value(args, "moe_router_num_groups") or arg_value(args, "moe_router_group_topk"):
        reasons.append(f"group-limited routing (moe_router_num_groups={arg_value(args, 'moe_router_num_groups')}, "
                       f"moe_router_group_topk={arg_value(args, 'moe_router_group_topk')}; "
                       f"Qwen2-MoE picks from all experts)")
    if arg_value(args, "moe_router_enable_expert_bias", False):
        reasons.append("moe_router_enable_expert_bias=True (an expert bias steers the selection; Qwen2-MoE has none)")
    balancing = arg_value(args, "moe_router_load_balancing_type", "aux_loss")
    if balancing == "sinkhorn":
        reasons.append("moe_router_load_balancing_type='sinkhorn' (another routing algorithm)")
    if arg_value(args, "moe_expert_capacity_factor") is not None:
        reasons.append(f"moe_expert_capacity_factor={arg_value(args, 'moe_expert_capacity_factor')} (token dropping; "
                       f"Qwen2-MoE is drop-less)")
    if arg_value(args, "moe_apply_probs_on_input", False):
        reasons.append("moe_apply_probs_on_input=True (Qwen2-MoE weights the expert outputs)")
    if arg_value(args, "moe_latent_size"):
        reasons.append(f"moe_latent_size={arg_value(args, 'moe_latent_size')} (latent experts)")
    if arg_value(args, "add_bias_linear", False):
        reasons.append("add_bias_linear=True (router and expert biases; Qwen2-MoE has none)")
    shared = arg_value(args, "moe_shared_expert_intermediate_size")
    if shared and not arg_value(args, "moe_shared_expert_gate", False):
        reasons.append("a shared expert without moe_shared_expert_gate (Qwen2-MoE gates it with a sigmoid)")
    if reasons:
        name = {"qwen3_moe": "Qwen3-MoE"}.get(arch, "Qwen2-MoE")
        raise UnsupportedConfigError(f"{where}: not a {name} model: {reasons[0]}"
                                     + (f" (and {len(reasons) - 1} more)" if len(reasons) > 1 else ""))


def moe_hf_fields(args: Any, num_layers: int, ffn_hidden_size: int, where: str,
                  arch: str = "qwen2_moe") -> dict[str, Any]:
    """The Qwen2-MoE (or Qwen3-MoE: no shared expert, no qkv bias) config.json fields of Megatron MoE
    args (router checked first)."""
    check_router(args, where, arch)
    experts = num_experts_of(args)
    topk = int(arg_value(args, "moe_router_topk", 2))
    pattern = moe_layer_pattern(args, num_layers, where)
    fields = dict(
        num_experts=experts,
        num_experts_per_tok=topk,
        moe_intermediate_size=int(arg_value(args, "moe_ffn_hidden_size", ffn_hidden_size)),
        shared_expert_intermediate_size=int(arg_value(args, "moe_shared_expert_intermediate_size", 0) or 0),
        # pre_softmax: softmax over all experts then top-k, unnormalised; megatron's default
        # (top-k, then softmax over the k) is the renormalised form
        norm_topk_prob=not bool(arg_value(args, "moe_router_pre_softmax", False)),
        decoder_sparse_step=1,
        mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe],
        router_aux_loss_coef=float(arg_value(args, "moe_aux_loss_coeff", 0.0) or 0.0),
        output_router_logits=False,
        qkv_bias=True,
    )
    if arch == "qwen3_moe":
        del fields["shared_expert_intermediate_size"], fields["qkv_bias"]
    return fields


def check_hf_against_args(config: Any, args: Any, where: str, hf_dir: str, arch: str = "qwen2_moe") -> list[str]:
    """Mismatches between an HF Qwen2-MoE / Qwen3-MoE config and the MoE args of the checkpoint."""
    fields = moe_hf_fields(args, int(args.num_layers), int(arg_value(args, "ffn_hidden_size", 0)), where, arch)
    bad = []
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                 "norm_topk_prob"):
        ours = getattr(config, name, None)
        if name == "num_experts" and ours is None:  # transformers 5's name for it (Qwen3-VL-MoE's text config)
            ours = getattr(config, "num_local_experts", None)
        if name == "norm_topk_prob":  # Qwen3-VL-MoE always renormalises (its config has no such field)
            ours = True if getattr(config, "model_type", None) == "qwen3_vl_moe_text" else bool(ours)
        if ours is not None and name in fields and ours != fields[name]:
            bad.append(f"{name}={ours} vs args' {fields[name]}")
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    only = set(getattr(config, "mlp_only_layers", None) or ())
    hf_dense = [i for i in range(int(args.num_layers)) if i in only or (i + 1) % step]
    if hf_dense != fields["mlp_only_layers"]:
        bad.append(f"dense layers {hf_dense} vs moe_layer_freq's {fields['mlp_only_layers']}")
    return bad


def moe_arg_fields(cfg: Any, *, tp: int, ep: int, grouped_gemm: bool = False) -> dict[str, Any]:
    """Megatron-LM args that make megatron-core build the Qwen2-MoE / Qwen3-MoE model ``cfg`` (ModelConfig);
    ``grouped_gemm``: experts as one ``GroupedMLP`` per layer (``moe_grouped_gemm``, see
    ``converters/layout/experts``) instead of a ``SequentialMLP``."""
    moe = cfg.moe
    pattern = [1 if moe.is_sparse(i) else 0 for i in range(cfg.num_hidden_layers)]
    shared = moe.shared_expert_intermediate_size
    return dict(
        num_experts=moe.num_experts, moe_router_topk=moe.top_k, moe_ffn_hidden_size=moe.moe_intermediate_size,
        moe_shared_expert_intermediate_size=shared or None, moe_shared_expert_gate=bool(shared),
        moe_router_pre_softmax=not moe.norm_topk_prob, moe_router_score_function="softmax",
        moe_router_topk_scaling_factor=None, moe_router_enable_expert_bias=False, moe_router_num_groups=None,
        moe_router_group_topk=None, moe_expert_capacity_factor=None,
        moe_layer_freq=1 if all(pattern) else pattern,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=moe.router_aux_loss_coef,
        moe_grouped_gemm=bool(grouped_gemm), moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=ep, expert_tensor_parallel_size=tp,
    )


def check_ep_target(cfg: Any, tp: int, ep: int, grouped_gemm: bool = False) -> None:
    """ValueError naming the numbers when ``cfg`` cannot be written at this expert layout."""
    moe = cfg.moe
    if moe is None and grouped_gemm:
        raise ValueError(f"--moe-grouped-gemm: grouped-GEMM experts need a mixture-of-experts model "
                         f"({cfg.architecture} has no experts)")
    if moe is None:
        if ep > 1:
            raise ValueError(f"--ep {ep}: expert parallelism needs a mixture-of-experts model "
                             f"({cfg.architecture} has no experts)")
        return
    problems = []
    if moe.num_experts % ep:
        problems.append(f"num_experts={moe.num_experts} is not divisible by --ep {ep}")
    if moe.moe_intermediate_size % tp:
        problems.append(f"moe_intermediate_size={moe.moe_intermediate_size} is not divisible by --tp {tp} "
                        f"(experts are split over TP: expert_tensor_parallel_size = tp)")
    if moe.shared_expert_intermediate_size % tp:
        problems.append(f"shared_expert_intermediate_size={moe.shared_expert_intermediate_size} is not divisible "
                        f"by --tp {tp}")
    if problems:
        raise ValueError("; ".join(problems))


def is_expert_key(megatron_template: str | None) -> bool:
    return bool(megatron_template) and LOCAL_EXPERTS in megatron_template


def legacy_expert_key(template: str, local_layer: int, local_expert: int) -> str:
    return template.replace("{i}", str(local_layer)).replace("{e}", str(local_expert))


def dist_expert_key(template: str, layer: int, expert: int, tensors: dict) -> tuple[str, tuple[int, ...]]:
    """(torch_dist key, index into it) of expert ``expert`` of global layer ``layer``: the per-layer
    key when the checkpoint holds one (mixed dense/MoE layers), else the stacked one."""
    per_layer = template.replace("{i}", str(layer)).replace(LOCAL_EXPERTS, DIST_EXPERTS)
    if per_layer in tensors:
        return per_layer, (expert,)
    return template.replace("layers.{i}.", "layers.").replace(LOCAL_EXPERTS, DIST_EXPERTS), (layer, expert)
