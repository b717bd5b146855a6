"""Real megatron-core MoE models on CPU as a test oracle for the Qwen2-MoE converters.

Run inside processes spawned by ``tests/distributed.py`` (gloo initialized), like the dense oracle
(``tests/megatron_oracle.py``, whose CPU shims, pipeline forward and path helpers are reused). The
workers here build megatron-core ``GPTModel`` chunks with MoE layers at a TP/PP/EP(/ETP) layout,
configured as a Qwen2-MoE model (see ``MoeSpec``), write Megatron-LM checkpoints in the legacy
``torch`` layout or the ``torch_dist`` layout, load given checkpoint directories back and return the
logits of the fixed prompt (``megatron_oracle.prompt_ids``).

Weights are layout-independent: after megatron-core builds a chunk, every parameter is overwritten
with a slice of a full tensor drawn from a generator keyed by (seed, global parameter name); the
global name uses the global layer number and the global expert id. So the same ``MoeSpec`` gives
the same model (and logits, to fp32 reduction order) at every layout, no two experts or layers
share values, and norms (N(1, 0.1)), qkv biases, the router and the shared-expert gate are all
non-trivial: a converter that drops, swaps or misnumbers any of them changes the logits.

Qwen2-MoE configuration of megatron-core (``build_moe_chunks``): ``num_moe_experts``,
``moe_router_topk``, ``moe_ffn_hidden_size``, ``moe_shared_expert_intermediate_size`` with
``moe_shared_expert_gate=True`` (or no shared expert), ``moe_router_score_function="softmax"``,
``moe_router_pre_softmax = not norm_topk_prob``, ``moe_router_load_balancing_type="none"`` and
``moe_aux_loss_coeff=0`` (logits parity; the aux loss does not change the forward), the
``allgather`` token dispatcher, ``moe_grouped_gemm=False`` (``SequentialMLP`` experts), the local
layer spec with RMSNorm, SwiGLU, RoPE, qkv bias, untied embeddings. CPU needs two shims beyond the
dense ones: ``moe_utils.te_general_gemm = None`` (router gating without Transformer Engine) and the
allgather dispatcher (the alltoall one creates a CUDA stream).

Router semantics (``megatron.core.transformer.moe.moe_utils.topk_routing_with_score_function``;
checked numerically in tests/test_megatron_moe_oracle.py):

* ``moe_router_pre_softmax=True``: softmax over all experts, then top-k, no renormalisation =
  transformers' Qwen2-MoE with ``norm_topk_prob=False`` (its default).
* ``moe_router_pre_softmax=False`` (megatron's default): top-k of the logits, then softmax over the
  k selected logits. Equal to softmax-then-top-k-then-renormalise (softmax is monotonic and the
  normaliser cancels) = Qwen2-MoE with ``norm_topk_prob=True``; for top-k = 1 too (weight 1).
  The two are different models whenever the unselected experts have non-zero probability.
* Options that make the model something other than Qwen2-MoE (a converter must refuse them; read
  from megatron-core 0.16's source, the self-check shows each changes the routing weights):
  ``moe_router_score_function="sigmoid"`` (sigmoid scores, renormalised over the top-k when k > 1),
  ``moe_router_enable_expert_bias`` (a persistent buffer ``mlp.router.expert_bias`` added to the
  scores for selection only; sigmoid only), ``moe_router_topk_scaling_factor`` (multiplies the
  weights), ``moe_router_num_groups`` / ``moe_router_group_topk`` (group-limited routing: experts
  only from the best groups), ``moe_input_jitter_eps`` (multiplicative noise on the router input in
  training), ``moe_router_load_balancing_type="sinkhorn"`` (another routing algorithm),
  ``add_bias_linear`` (a router bias ``mlp.router.bias``; megatron-core also gives experts biases),
  token dropping (``moe_expert_capacity_factor``), ``moe_apply_probs_on_input``,
  ``moe_latent_size``. ``moe_z_loss_coeff`` and the aux losses change training, not the forward.

Checkpoint layouts (megatron-core 0.16, each statement read back from files this module writes;
``tests/test_megatron_moe_oracle.py`` asserts them):

Legacy ``torch`` (megatron-core has no legacy writer; this mirrors Megatron-LM's
``save_checkpoint`` / ``get_checkpoint_name``)::

    <root>/iter_0000010/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt

``_{pp:03d}`` is present iff PP > 1, ``_{ep:03d}`` iff EP > 1 (so ``mp_rank_00_001`` is TP 0 / EP 1
when PP = 1, but TP 0 / PP 1 in a dense PP=2 checkpoint: read ``args``). ``tp`` is the dense
tensor-parallel rank (``get_tensor_model_parallel_rank``), never the expert-TP rank; ``ep`` is the
expert-model-parallel rank. Writers: ranks with data-parallel rank 0 or expert-data-parallel rank 0
(Megatron-LM's rule; one writer per file). Every file holds the whole non-expert part of its
(tp, pp) stage (embedding, attention, norms, router, shared expert: duplicated on every EP rank)
plus the stage's local experts only::

    decoder.layers.{l}.mlp.router.weight                              [E, H]      (replicated)
    decoder.layers.{l}.mlp.experts.local_experts.{i}.linear_fc1.weight  [2*F/etp, H]
    decoder.layers.{l}.mlp.experts.local_experts.{i}.linear_fc2.weight  [H, F/etp]
    decoder.layers.{l}.mlp.shared_experts.linear_fc1.weight            [2*S/tp, H]
    decoder.layers.{l}.mlp.shared_experts.linear_fc2.weight            [H, S/tp]
    decoder.layers.{l}.mlp.shared_experts.gate_weight                  [1, H]      (replicated)
    decoder.layers.{l}.pre_mlp_layernorm.weight                       [H]  (the post-attention norm)

``l`` is local to the stage, ``i`` is the local expert id: global expert = ``ep_rank *
(E / EP) + i``. Expert tensor parallelism (``expert_tensor_parallel_size``, Megatron-LM's default:
= TP) splits each expert like a dense MLP over the expert-TP group: fc1 rank shard is
``[gate_shard_r; up_shard_r]`` (gate/up interleaved per shard), fc2 split on dim 1. With ETP = TP the
expert-TP rank equals the TP rank. With ETP != TP the file named by the TP rank holds the expert
shard of the writer's expert-TP rank, and only the (tp, ep) pairs some rank occupies exist: TP=2,
ETP=1, EP=2 on 4 ranks puts rank r at tp = r % 2 and ep = r % 2 (megatron's order tp-cp-ep-dp-pp;
``expert_layout``), so the checkpoint is just ``mp_rank_00_000`` and ``mp_rank_01_001``, each with
whole experts (fc1 ``[2*F, H]``) beside its dense TP half; ranks 2 and 3 write nothing.

``torch_dist`` (Megatron-LM ``--ckpt-format torch_dist``: ``dist_checkpointing.save`` of
``{"args", "checkpoint_version", "iteration", "model"}``, the non-tensor entries in ``common.pt``):
uniform layers are stacked over all layers; experts are stacked per layer and per global expert::

    decoder.layers.mlp.router.weight                          [L, E, H]
    decoder.layers.mlp.experts.experts.linear_fc1.weight      [L, E, 2*F, H]   ([gate_full; up_full])
    decoder.layers.mlp.experts.experts.linear_fc2.weight      [L, E, H, F]
    decoder.layers.mlp.shared_experts.linear_fc1.weight       [L, 2*S, H]      ([gate_full; up_full])
    decoder.layers.mlp.shared_experts.linear_fc2.weight       [L, H, S]
    decoder.layers.mlp.shared_experts.gate_weight             [L, 1, H]
    decoder.layers.mlp.linear_fc1.layer_norm_weight           [L, H]  (pre-MLP norm, TE name even
                                                                       though the MLP is MoE)

In ``.metadata`` each expert tensor is stored as chunks of one expert's ETP shard: offsets
``(layer, global expert, row, col)`` with chunk size ``(1, 1, rows/etp, cols)``; gated fc1 is
split by megatron's factory into a gate chunk and an up chunk per ETP rank (rows ``r*F/etp`` and
``F + r*F/etp``). Non-expert tensors are chunked by TP only and replicated over EP (one writer).
With a mixed ``moe_layer_freq`` (dense layers between MoE ones, HF ``mlp_only_layers``) layers are
NOT stacked: keys carry the global layer number, ``decoder.layers.{g}.mlp.experts.experts.
linear_fc1.weight`` ``[E, 2*F, H]``, ``decoder.layers.{g}.mlp.linear_fc1.weight`` for dense ones.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from tests.megatron_oracle import (
    ITERATION,
    _chunk_key,
    _describe_legacy,
    _describe_sharded,
    _load_chunk,
    apply_cpu_shims,
    forward_logits,
    iteration_dir,
    megatron_args,
    prompt_ids,
    read_tracker,
    transformer_config,
)

__all__ = [
    "ITERATION",
    "MoeLayout",
    "MoeSpec",
    "apply_moe_shims",
    "build_moe_chunks",
    "expert_layout",
    "legacy_moe_dir_name",
    "load_moe_checkpoint_logits",
    "moe_fresh_logits",
    "moe_logits",
    "moe_megatron_args",
    "moe_full_weights",
    "prompt_ids",
    "read_legacy_moe",
    "megatron_router",
    "save_moe_checkpoint",
]


# ----------------------------------------------------------------------------------------------
# Model description
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeSpec:
    """A tiny Qwen2-MoE-like decoder as megatron-core builds it.

    Field names the dense oracle's helpers read (``forward_logits``, ``megatron_args``,
    ``prompt_ids``) are kept; ``norm_topk_prob`` maps to ``moe_router_pre_softmax = not
    norm_topk_prob``. ``shared_expert_intermediate_size=None``: no shared expert (and no gate).
    ``moe_layer_freq``: None = every layer MoE, else a 0/1 tuple per layer (0 = dense MLP of
    ``ffn_hidden_size``; HF ``mlp_only_layers``)."""

    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 96  # dense layers only (moe_layer_freq)
    moe_ffn_hidden_size: int = 32
    shared_expert_intermediate_size: int | None = 48
    num_experts: int = 4
    topk: int = 2
    norm_topk_prob: bool = False
    num_attention_heads: int = 4
    num_query_groups: int = 2
    kv_channels: int = 16  # = hidden / heads, as Qwen2-MoE requires
    vocab_size: int = 128
    make_vocab_size_divisible_by: int = 16
    moe_layer_freq: tuple[int, ...] | None = None
    rotary_base: int = 10000
    norm_epsilon: float = 1e-6
    max_position_embeddings: int = 64
    init_method_std: float = 0.05
    router_std: float = 0.3  # decisive routing: no near-ties between megatron and HF
    seed: int = 7
    # Fixed for Qwen2-MoE; read by the dense oracle's helpers.
    tie_embeddings: bool = False
    add_bias_linear: bool = False
    add_qkv_bias: bool = True
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0

    def __post_init__(self) -> None:
        if self.moe_layer_freq is not None and len(self.moe_layer_freq) != self.num_layers:
            raise ValueError(f"moe_layer_freq {self.moe_layer_freq} needs one entry per layer ({self.num_layers})")

    @property
    def pre_softmax(self) -> bool:
        return not self.norm_topk_prob

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size is not None

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe_layer_freq is None or bool(self.moe_layer_freq[layer])

    def padded_vocab_size(self, tp: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class MoeLayout:
    """Parallel layout; ``etp=None`` means Megatron-LM's default, expert TP = TP."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def __str__(self) -> str:
        etp = "" if self.etp is None else f"etp{self.etp}"
        return f"tp{self.tp}pp{self.pp}ep{self.ep}{etp}"


def _moe_fields(spec: MoeSpec, layout: MoeLayout) -> dict:
    """The MoE fields of megatron-core's TransformerConfig, configured as Qwen2-MoE (one list for the
    model built here and the args saved with it)."""
    return dict(
        num_moe_experts=spec.num_experts,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        moe_layer_freq=1 if spec.moe_layer_freq is None else list(spec.moe_layer_freq),
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_topk=spec.topk,
        moe_shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
        moe_shared_expert_gate=spec.has_shared_expert,
        moe_router_pre_softmax=spec.pre_softmax,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
    )


def moe_megatron_args(spec: MoeSpec, layout: MoeLayout, fmt: str):
    """Megatron-LM's ``args`` for the model: the dense subset plus the MoE arguments, named as
    Megatron-LM names them (``num_experts``; the rest are TransformerConfig field names)."""
    args = megatron_args(spec, layout.tp, layout.pp, None, fmt)
    fields = _moe_fields(spec, layout)
    fields["num_experts"] = fields.pop("num_moe_experts")
    args.__dict__.update(
        fields,
        moe_z_loss_coeff=None,
        moe_router_topk_scaling_factor=None,
        moe_router_enable_expert_bias=False,
        moe_router_num_groups=None,
        moe_router_group_topk=None,
        moe_router_dtype=None,
        moe_input_jitter_eps=None,
    )
    return args


def check_moe_layout(spec: MoeSpec, layout: MoeLayout) -> None:
    """Raise ValueError, before any collective, if megatron-core cannot build ``spec`` here."""
    world = dist.get_world_size() if dist.is_initialized() else layout.tp * layout.pp * layout.ep
    tp, pp, ep, etp = layout.tp, layout.pp, layout.ep, layout.expert_tp
    problems = []
    if world % (tp * pp):
        problems.append(f"world size {world} is not a multiple of tp*pp = {tp * pp}")
    elif (world // pp) % (etp * ep):
        problems.append(f"world/pp = {world // pp} is not a multiple of etp*ep = {etp * ep}")
    if spec.num_layers % pp:
        problems.append(f"num_layers {spec.num_layers} is not divisible by pp={pp}")
    if spec.num_experts % ep:
        problems.append(f"num_experts {spec.num_experts} is not divisible by ep={ep}")
    if spec.moe_ffn_hidden_size % etp:
        problems.append(f"moe_ffn_hidden_size {spec.moe_ffn_hidden_size} is not divisible by etp={etp}")
    if spec.has_shared_expert and spec.shared_expert_intermediate_size % tp:
        problems.append(f"shared expert size {spec.shared_expert_intermediate_size} is not divisible by tp={tp}")
    if spec.num_attention_heads % tp or spec.num_query_groups % tp:
        problems.append(f"heads {spec.num_attention_heads} / groups {spec.num_query_groups} do not fit tp={tp}")
    if problems:
        raise ValueError(f"MoE oracle layout {layout} for {spec}: " + "; ".join(problems))


# ----------------------------------------------------------------------------------------------
# Building and running megatron-core MoE models
# ----------------------------------------------------------------------------------------------


def apply_moe_shims() -> None:
    """The dense oracle's CPU shims plus the MoE one: router gating without Transformer Engine."""
    apply_cpu_shims()
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None


def init_moe_parallel(layout: MoeLayout) -> None:
    """(Re)initialize megatron-core's parallel_state on the gloo world (order tp-cp-ep-dp-pp)."""
    from megatron.core import parallel_state as ps

    apply_moe_shims()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
    )


def moe_transformer_config(spec: MoeSpec, layout: MoeLayout):
    """The dense oracle's TransformerConfig plus the MoE fields, configured as Qwen2-MoE."""
    return transformer_config(spec, layout.tp, layout.pp, **_moe_fields(spec, layout))


def build_moe_chunks(spec: MoeSpec, layout: MoeLayout, seed: int | None = None) -> list:
    """This rank's model (a one-chunk list, the shape ``forward_logits`` takes), weights filled
    layout-independently from ``seed`` (default ``spec.seed``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    check_moe_layout(spec, layout)
    init_moe_parallel(layout)
    config = moe_transformer_config(spec, layout)
    if spec.moe_layer_freq is None:
        layer_spec = get_gpt_layer_local_spec(num_experts=spec.num_experts, moe_grouped_gemm=False,
                                              normalization="RMSNorm")
    else:
        layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    torch.manual_seed(0)  # megatron's own init is overwritten below
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=spec.padded_vocab_size(layout.tp),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=spec.rotary_base,
        parallel_output=True,
    ).eval()
    _fill_parameters(model, spec, layout, spec.seed if seed is None else seed)
    return [model]


def _global_name(model, name: str, n_local_experts: int, ep_rank: int) -> str:
    """``decoder.layers.{local}.…local_experts.{i}.…`` -> ``layers.{global}.…experts.{global id}.…``."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        layer = model.decoder.layers[int(parts[2])]
        parts = ["layers", str(layer.layer_number - 1), *parts[3:]]
    if "local_experts" in parts:
        at = parts.index("local_experts")
        parts[at:at + 2] = ["experts", str(ep_rank * n_local_experts + int(parts[at + 1]))]
    return ".".join(parts)


def moe_full_weights(spec: MoeSpec, seed: int | None = None) -> dict:
    """The full (unsharded) weights a ``MoeSpec`` model holds at every layout, by megatron-core's
    TP=1 legacy names with global layer numbers and global expert ids (``decoder.layers.{g}.mlp.
    experts.local_experts.{e}.…``): what a TP=1, PP=1, EP=1 legacy checkpoint would hold, minus the
    vocab padding rows. Computed without megatron (the same draws ``_fill_parameters`` slices)."""
    seed = spec.seed if seed is None else seed
    H, d = spec.hidden_size, spec.kv_channels
    qkv_rows = (spec.num_attention_heads + 2 * spec.num_query_groups) * d
    shapes = {"embedding.word_embeddings.weight": (spec.vocab_size, H), "decoder.final_layernorm.weight": (H,),
              "output_layer.weight": (spec.vocab_size, H)}
    for g in range(spec.num_layers):
        p = f"decoder.layers.{g}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "self_attention.linear_qkv.weight": (qkv_rows, H),
                       p + "self_attention.linear_qkv.bias": (qkv_rows,),
                       p + "self_attention.linear_proj.weight": (H, spec.num_attention_heads * d),
                       p + "pre_mlp_layernorm.weight": (H,)})
        if not spec.is_moe_layer(g):
            shapes.update({p + "mlp.linear_fc1.weight": (2 * spec.ffn_hidden_size, H),
                           p + "mlp.linear_fc2.weight": (H, spec.ffn_hidden_size)})
            continue
        shapes[p + "mlp.router.weight"] = (spec.num_experts, H)
        for e in range(spec.num_experts):
            q = f"{p}mlp.experts.local_experts.{e}."
            shapes.update({q + "linear_fc1.weight": (2 * spec.moe_ffn_hidden_size, H),
                           q + "linear_fc2.weight": (H, spec.moe_ffn_hidden_size)})
        if spec.has_shared_expert:
            s = spec.shared_expert_intermediate_size
            shapes.update({p + "mlp.shared_experts.linear_fc1.weight": (2 * s, H),
                           p + "mlp.shared_experts.linear_fc2.weight": (H, s),
                           p + "mlp.shared_experts.gate_weight": (1, H)})
    return {name: _draw(spec, seed, _global_key(name), shape) for name, shape in shapes.items()}


def _global_key(legacy_name: str) -> str:
    """A TP=1 legacy name with global numbers -> the key ``_draw`` seeds from (``_global_name``)."""
    return legacy_name.replace("decoder.layers.", "layers.", 1).replace(".local_experts.", ".experts.")


def _draw(spec: MoeSpec, seed: int, key: str, shape) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{key}".encode()))
    full = torch.randn(tuple(shape), generator=gen, dtype=torch.float32)
    if key.endswith("norm.weight"):
        return 1.0 + 0.1 * full
    if key.endswith(".bias"):
        return 0.05 * full
    if key.endswith("router.weight"):
        return spec.router_std * full
    if key.endswith("gate_weight"):
        return 0.2 * full
    return spec.init_method_std * full


@torch.no_grad()
def _fill_parameters(model, spec: MoeSpec, layout: MoeLayout, seed: int) -> None:
    """Overwrite every parameter with this rank's slice of the layout-independent full tensor.

    Slicing follows megatron-core's TP conventions: ``partition_dim`` contiguous chunks over the TP
    group (the expert-TP group for expert parameters), gated ``linear_fc1`` as ``[gate_r; up_r]``,
    vocab rows beyond the real vocabulary (padding) drawn separately per padded size.
    """
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    etp, etp_rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()
    n_local = spec.num_experts // layout.ep
    for name, param in model.named_parameters():
        key = _global_name(model, name, n_local, ep_rank)
        is_expert = ".experts." in key
        size, rank = (etp, etp_rank) if is_expert else (tp, tp_rank)
        split = getattr(param, "tensor_model_parallel", False) and size > 1
        dim = getattr(param, "partition_dim", 0)
        full_shape = list(param.shape)
        if split:
            full_shape[dim] *= size
        if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            real = _draw(spec, seed, key, (spec.vocab_size, full_shape[1]))
            pad = _draw(spec, seed, f"{key}/padding/{full_shape[0]}", (full_shape[0] - spec.vocab_size, full_shape[1]))
            full = torch.cat([real, pad])
        else:
            full = _draw(spec, seed, key, full_shape)
        if not split:
            param.copy_(full)
        elif key.endswith("linear_fc1.weight"):  # gated: [gate; up] -> [gate_r; up_r]
            gate, up = full.chunk(2, dim=0)
            param.copy_(torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]]))
        else:
            param.copy_(full.chunk(size, dim=dim)[rank])


def moe_logits(chunks: list, spec: MoeSpec) -> torch.Tensor:
    """The fixed prompt's logits ``[batch, seq, vocab]`` on every rank (the dense oracle's pipeline
    forward; every EP rank feeds the same prompt, so the allgather dispatcher's result on each rank
    is the full model's)."""
    return forward_logits(chunks, spec)


def moe_fresh_logits(spec: MoeSpec, layout: MoeLayout, seed: int | None = None) -> torch.Tensor:
    """Logits of a model built at ``layout`` without loading anything."""
    return moe_logits(build_moe_chunks(spec, layout, seed=seed), spec)


# ----------------------------------------------------------------------------------------------
# Layout facts
# ----------------------------------------------------------------------------------------------


def legacy_moe_dir_name(tp_rank: int, pp_rank: int, ep_rank: int, pp: int, ep: int) -> str:
    """Megatron-LM's ``get_checkpoint_name`` folder: ``mp_rank_TT[_PPP][_EEE]``."""
    name = f"mp_rank_{tp_rank:02d}"
    if pp > 1:
        name += f"_{pp_rank:03d}"
    if ep > 1:
        name += f"_{ep_rank:03d}"
    return name


def expert_layout() -> dict:
    """This rank's position in megatron-core's dense and expert groups (after initialization)."""
    from megatron.core import parallel_state as ps

    return {"rank": dist.get_rank(), "tp": ps.get_tensor_model_parallel_rank(),
            "pp": ps.get_pipeline_model_parallel_rank(), "dp": ps.get_data_parallel_rank(),
            "ep": ps.get_expert_model_parallel_rank(), "etp": ps.get_expert_tensor_parallel_rank(),
            "edp": ps.get_expert_data_parallel_rank()}


# ----------------------------------------------------------------------------------------------
# Workers (run on every rank through tests/distributed.run_distributed)
# ----------------------------------------------------------------------------------------------


def save_moe_checkpoint(out_dir: str, spec: MoeSpec, layout: MoeLayout, fmt: str) -> dict:
    """Build the model at ``layout`` and save it as Megatron-LM would in ``fmt`` ("torch" = legacy,
    "torch_dist") under ``out_dir``.

    Returns ``{"logits": [batch, seq, vocab] (every rank), "keys": description of what this rank
    saved (legacy: {name: (shape, dtype)}; torch_dist: megatron's sharded descriptions),
    "layout": expert_layout(), "file": the legacy file this rank wrote, or None}``.
    """
    from megatron.core import dist_checkpointing

    if fmt not in ("torch", "torch_dist"):
        raise ValueError(f"fmt must be 'torch' or 'torch_dist', got {fmt!r}")
    chunks = build_moe_chunks(spec, layout)
    logits = moe_logits(chunks, spec)
    state = {"args": moe_megatron_args(spec, layout, fmt), "checkpoint_version": 3.0, "iteration": ITERATION}
    if dist.get_rank() == 0:
        os.makedirs(iteration_dir(out_dir), exist_ok=True)
    dist.barrier()
    written = None
    if fmt == "torch":
        state["model"] = chunks[0].state_dict_for_save_checkpoint()
        keys = _describe_legacy(state["model"])
        where = expert_layout()
        # Megatron-LM: every rank with dp rank 0 or expert-dp rank 0 writes its (tp, pp, ep) file.
        if where["dp"] == 0 or where["edp"] == 0:
            written = os.path.join(iteration_dir(out_dir), legacy_moe_dir_name(
                where["tp"], where["pp"], where["ep"], layout.pp, layout.ep), "model_optim_rng.pt")
        names = [None] * dist.get_world_size()
        dist.all_gather_object(names, written)
        taken = [n for n in names if n is not None]
        if len(taken) != len(set(taken)):
            raise RuntimeError(f"two ranks would write the same legacy file: {names}")
        if written is not None:
            os.makedirs(os.path.dirname(written), exist_ok=True)
            torch.save(state, written)
    else:
        state["model"] = chunks[0].sharded_state_dict()
        keys = _describe_sharded(state["model"])
        dist_checkpointing.save(state, iteration_dir(out_dir))
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
    dist.barrier()
    return {"logits": logits, "keys": keys, "layout": expert_layout(), "file": written}


def load_moe_checkpoint_logits(ckpt_dir: str, spec: MoeSpec, layout: MoeLayout, fmt: str,
                               seed: int | None = None) -> torch.Tensor:
    """Build a fresh model at ``layout`` (from another seed, default ``spec.seed + 1000``), load
    ``ckpt_dir`` (a Megatron-LM root with ``latest_checkpointed_iteration.txt``) into it and return
    the fixed prompt's logits ``[batch, seq, vocab]`` on every rank.

    Strict except for ``_extra_state``: legacy loads this rank's ``mp_rank_TT[_PPP][_EEE]`` file
    with ``load_state_dict``; torch_dist uses ``dist_checkpointing.load``, which reshards to this
    layout (other TP / EP / ETP) and raises on a key or shape mismatch.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    if fmt not in ("torch", "torch_dist"):
        raise ValueError(f"fmt must be 'torch' or 'torch_dist', got {fmt!r}")
    iteration = read_tracker(ckpt_dir)
    chunks = build_moe_chunks(spec, layout, seed=spec.seed + 1000 if seed is None else seed)
    if fmt == "torch":
        where = expert_layout()
        path = os.path.join(iteration_dir(ckpt_dir, iteration), legacy_moe_dir_name(
            where["tp"], where["pp"], where["ep"], layout.pp, layout.ep), "model_optim_rng.pt")
        state = torch.load(path, map_location="cpu", weights_only=False)
        if "model" not in state:
            raise KeyError(f"{path}: no 'model' entry (has {sorted(state)})")
        _load_chunk(chunks[0], state["model"], f"{path}[model]")
    else:
        sharded = {_chunk_key(0, 1): chunks[0].sharded_state_dict()}
        state, missing, unexpected = dist_checkpointing.load(
            sharded, iteration_dir(ckpt_dir, iteration), strict=StrictHandling.RETURN_ALL)
        unexpected = {k for k in unexpected if "_extra_state" not in k}
        if missing or unexpected:
            raise KeyError(f"{ckpt_dir}: checkpoint keys the model does not have {sorted(missing)}; "
                           f"model keys the checkpoint lacks {sorted(unexpected)}")
        _load_chunk(chunks[0], state["model"], f"{ckpt_dir}[model]")
    return moe_logits(chunks, spec)


def megatron_router(logits: torch.Tensor, topk: int, pre_softmax: bool, **options) -> tuple:
    """megatron-core's own routing function on ``[tokens, experts]`` logits: ``(probs [tokens,
    experts] with zeros off the top-k, routing_map bool)``. ``options``: the other arguments of
    ``topk_routing_with_score_function`` (score_function, scaling_factor, num_groups, ...)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    return topk_routing_with_score_function(logits, topk, use_pre_softmax=pre_softmax, **options)


# ----------------------------------------------------------------------------------------------
# Reading checkpoints in a plain process
# ----------------------------------------------------------------------------------------------


def read_legacy_moe(root: str) -> dict:
    """``{(tp_rank, pp_rank, ep_rank): the torch.load-ed model_optim_rng.pt}``; the folder name is
    decoded with the file's own ``args`` (PP and EP sizes), as the name alone is ambiguous."""
    it_dir = iteration_dir(root, read_tracker(root))
    out = {}
    for name in sorted(os.listdir(it_dir)):
        if not name.startswith("mp_rank_"):
            continue
        state = torch.load(os.path.join(it_dir, name, "model_optim_rng.pt"), map_location="cpu", weights_only=False)
        args = state["args"]
        numbers = [int(p) for p in name[len("mp_rank_"):].split("_")]
        tp_rank = numbers.pop(0)
        pp_rank = numbers.pop(0) if args.pipeline_model_parallel_size > 1 else 0
        ep_rank = numbers.pop(0) if args.expert_model_parallel_size > 1 else 0
        if numbers or name != legacy_moe_dir_name(tp_rank, pp_rank, ep_rank, args.pipeline_model_parallel_size,
                                                   args.expert_model_parallel_size):
            raise ValueError(f"{name}: does not match the args' layout")
        out[(tp_rank, pp_rank, ep_rank)] = state
    return out
