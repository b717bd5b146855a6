"""ParallelConfig: the parallel layout of a job, validated before any process group exists.

The layout follows Megatron's conventions so that checkpoints and rank numbering line up:
ranks are laid out with tensor-parallel fastest, then Ulysses, then context-parallel, then
data-parallel, then pipeline-parallel (Megatron's default order ``tp-cp-dp-pp`` with the Ulysses
axis, which Megatron does not have, next to TP so its all-to-alls stay on the fastest links).
``dp`` is not set by the caller: it is whatever the world size leaves after
``tp * ulysses * cp * pp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from parallel.errors import ParallelConfigError
from parallel.pipeline_layout import stage_layer_ranges

CP_COMM = ("ring", "allgather")
MOE_DISPATCHERS = ("alltoall", "allgather")  # parallel/experts.py
RECOMPUTE = ("none", "full")


def _attr(model_config: Any, *names: str, default: Any = None) -> Any:
    """First present attribute of ``model_config`` among ``names`` (HF and our own configs differ)."""
    for name in names:
        value = getattr(model_config, name, None)
        if value is not None:
            return value
    return default


@dataclass(frozen=True)
class ParallelConfig:
    """How a model is split over ranks.

    tp: tensor-parallel size (heads, FFN columns and vocab are split over it).
    pp: pipeline-parallel size (layers are split over it).
    vpp: virtual pipeline chunks per pipeline rank (interleaved schedule); 1 = no interleaving.
    cp: context-parallel size (the sequence is split over it inside attention).
    ep: expert-parallel size (MoE experts are split over it; carved out of ``dp * cp``).
    sequence_parallel: Megatron sequence parallelism: activations outside attention/MLP matmuls
        are sharded along the sequence over the TP group (needs tp > 1 to mean anything).
    num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage: uneven pipeline
        splits (Megatron's flags of the same names); None = even split.
    vocab_padding_multiple: the vocabulary is padded to a multiple of this (vLLM uses 64) and
        then, if needed, further so that every TP rank holds an equal slice.
    ulysses: Ulysses (DeepSpeed) sequence-parallel size: the sequence is split over it everywhere
        except inside attention, where an all-to-all trades the sequence split for a head split.
    cp_comm: how context-parallel attention moves keys/values: "ring" (P2P ring, each step's
        transfer overlapped with the previous block's compute) or "allgather" (one all-gather of
        K/V, gradients returned with one all-to-all).
    fsdp: shard parameters, gradients and optimizer state over the data-parallel ranks (and the
        cp/ulysses ranks, which hold the same parameters) with ``torch.distributed.fsdp.fully_shard``.
    recompute: activation recomputation: "none", or "full" (each decoder layer keeps only its
        input and reruns its forward in backward; ``torch.utils.checkpoint``).
    moe_dispatcher: how MoE tokens reach experts on other EP ranks: "alltoall" (variable-size
        all-to-all of the routed tokens) or "allgather" (all-gather the EP group's tokens,
        reduce-scatter the outputs); see ``parallel/experts.py``.
    tp_reduce_in_fp32: at tp > 1, every row-parallel layer (attention ``o_proj``, MLP ``down_proj``, the
        shared expert's, Gated DeltaNet's ``out_proj``, the vision tower's and the merger's, LoRA's row-parallel
        ``A x``) computes its partial product with fp32 output, sums the partials over TP in fp32 (all-reduce,
        or the sequence-parallel reduce-scatter), adds the bias in fp32 and rounds once to the activation
        dtype: the one rounding of a single GEMM, so bf16 models give transformers' single-process bf16
        numbers (bitwise on the development CPU) instead of rounding each rank's partial, the sum and the bias
        separately (the default; Megatron's and vLLM's numerics). Cost: those reductions move fp32, twice the
        bytes of the default's all-reduce / reduce-scatter (forward only: the backward is the default's, which
        has no partial sums), and on CPU the local weight is upcast per call (CUDA: ``torch.mm(out_dtype=
        torch.float32)``). A no-op for fp32 models and at tp=1 (one GEMM already rounds once); see
        ``parallel/layers.py`` ``row_parallel_linear``.
    """

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None
    vocab_padding_multiple: int = 64
    ulysses: int = 1
    cp_comm: str = "ring"
    fsdp: bool = False
    recompute: str = "none"
    moe_dispatcher: str = "alltoall"
    tp_reduce_in_fp32: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "vpp", "cp", "ep", "vocab_padding_multiple", "ulysses"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ParallelConfigError(f"ParallelConfig.{name} must be a positive integer, got {value!r}")
        if self.vpp > 1 and self.pp == 1:
            raise ParallelConfigError(f"vpp={self.vpp} needs pipeline parallelism (pp > 1), got pp=1")
        for name in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
            value = getattr(self, name)
            if value is not None and (self.pp == 1 or value < 1):
                raise ParallelConfigError(
                    f"ParallelConfig.{name}={value} needs pp > 1 and a positive layer count (pp={self.pp})"
                )
        if self.cp_comm not in CP_COMM:
            raise ParallelConfigError(f"ParallelConfig.cp_comm={self.cp_comm!r}: choose one of {', '.join(CP_COMM)}")
        if self.recompute not in RECOMPUTE:
            raise ParallelConfigError(f"ParallelConfig.recompute={self.recompute!r}: "
                                      f"choose one of {', '.join(RECOMPUTE)}")
        if self.moe_dispatcher not in MOE_DISPATCHERS:
            raise ParallelConfigError(f"ParallelConfig.moe_dispatcher={self.moe_dispatcher!r}: "
                                      f"choose one of {', '.join(MOE_DISPATCHERS)}")
        for name in ("fsdp", "tp_reduce_in_fp32"):
            if not isinstance(getattr(self, name), bool):
                raise ParallelConfigError(f"ParallelConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.fsdp and self.pp > 1:
            raise ParallelConfigError(f"fsdp=True with pp={self.pp} is not supported (FSDP2 here shards "
                                      f"whole-model replicas; use pp=1, or pp without fsdp)")
        if self.ep > 1 and self.ulysses > 1:
            raise ParallelConfigError(f"ep={self.ep} with ulysses={self.ulysses} is not supported "
                                      f"(expert groups are carved from dp*cp)")

    @property
    def model_parallel_size(self) -> int:
        """Ranks that together hold one model replica's work: ``tp * ulysses * cp * pp``."""
        return self.tp * self.ulysses * self.cp * self.pp

    @property
    def sequence_split(self) -> int:
        """Ranks the sequence is split over outside TP: ``cp * ulysses`` (1 = whole sequences per rank)."""
        return self.cp * self.ulysses

    def dp_for(self, world_size: int) -> int:
        """Data-parallel size implied by ``world_size``; raises if the world does not divide."""
        if world_size % self.model_parallel_size != 0:
            raise ParallelConfigError(
                f"world size {world_size} is not divisible by tp*ulysses*cp*pp = "
                f"{self.tp}*{self.ulysses}*{self.cp}*{self.pp} = {self.model_parallel_size}"
            )
        return world_size // self.model_parallel_size

    def padded_vocab_size(self, vocab_size: int) -> int:
        """Vocabulary size after padding: a multiple of ``vocab_padding_multiple`` and of ``tp``.

        Equals vLLM's ``ceil(V/64)*64`` whenever that is divisible by ``tp`` (the usual case), so
        that the embedding shards of a TP rank here and in vLLM hold the same rows.
        """
        multiple = self.vocab_padding_multiple
        padded = -(-vocab_size // multiple) * multiple
        while padded % self.tp:
            padded += multiple
        return padded

    def validate(self, model_config: Any, world_size: int | None = None) -> None:
        """Check that this layout fits ``model_config`` (our ModelConfig or a transformers config).

        Raises ParallelConfigError (a ValueError) naming the numbers involved. Call it before any
        process group is created or collective entered: every rank reaches the same verdict.
        """
        problems: list[str] = []
        heads = _attr(model_config, "num_attention_heads", "num_heads")
        kv_heads = _attr(model_config, "num_key_value_heads", "num_kv_heads", default=heads)
        layers = _attr(model_config, "num_hidden_layers", "num_layers")
        vocab = _attr(model_config, "vocab_size")
        ffn = _attr(model_config, "intermediate_size", "ffn_hidden_size")
        tp = self.tp
        if heads is not None and heads % tp:
            problems.append(f"num_attention_heads={heads} is not divisible by tp={tp}")
        if heads is not None and kv_heads is not None and heads % kv_heads:
            problems.append(f"num_attention_heads={heads} is not divisible by num_key_value_heads={kv_heads}")
        if kv_heads is not None and kv_heads % tp and tp % kv_heads:
            problems.append(
                f"num_key_value_heads={kv_heads} and tp={tp}: one must divide the other "
                f"(KV heads are split over TP, or each is replicated tp/kv_heads times)"
            )
        if ffn is not None and ffn % tp:
            problems.append(f"intermediate_size={ffn} is not divisible by tp={tp}")
        if vocab is not None and vocab < 1:
            problems.append(f"vocab_size={vocab} must be positive")
        moe = getattr(model_config, "moe", None)  # our ModelConfig keeps the MoE sizes in .moe
        num_experts = _attr(moe or model_config, "num_experts", "num_local_experts", "num_moe_experts")
        shared = _attr(moe or model_config, "shared_expert_intermediate_size", default=0)
        if num_experts and shared % tp:
            problems.append(f"shared_expert_intermediate_size={shared} is not divisible by tp={tp}")
        if self.ep > 1:
            if not num_experts:
                problems.append(f"ep={self.ep} needs an MoE model, but the config has no experts")
            elif num_experts % self.ep:
                problems.append(f"num_experts={num_experts} is not divisible by ep={self.ep}")
        if self.ulysses > 1 and heads is not None and kv_heads is not None and not heads % tp:
            local_heads, local_kv = heads // tp, max(1, kv_heads // tp)
            if local_heads % self.ulysses:
                problems.append(
                    f"ulysses={self.ulysses} needs the attention heads per TP rank (num_attention_heads={heads} "
                    f"/ tp={tp} = {local_heads}) to be divisible by it")
            if local_kv % self.ulysses and self.ulysses % local_kv:
                problems.append(
                    f"ulysses={self.ulysses} and {local_kv} KV heads per TP rank (num_key_value_heads={kv_heads}, "
                    f"tp={tp}): one must divide the other (KV heads are split, or repeated "
                    f"ulysses/kv_heads times)")
        if "linear_attention" in (getattr(model_config, "layer_types", None) or ()):  # Gated DeltaNet layers
            linear_k = _attr(model_config, "linear_num_key_heads")
            if linear_k is not None and linear_k % tp:
                problems.append(f"linear_num_key_heads={linear_k} is not divisible by tp={tp} (linear-attention "
                                f"heads are split by key-head group; replicating them is not implemented)")
            if linear_k is not None and not linear_k % tp and (linear_k // tp) % self.ulysses:
                problems.append(f"ulysses={self.ulysses} needs the linear-attention key heads per TP rank "
                                f"(linear_num_key_heads={linear_k} / tp={tp} = {linear_k // tp}) to be divisible by it")
        if self.sequence_parallel and tp == 1:
            problems.append("sequence_parallel=True needs tp > 1 (it shards activations over the TP group)")
        if layers is not None:
            try:
                stage_layer_ranges(layers, self)
            except ParallelConfigError as exc:
                problems.append(str(exc))
        if world_size is not None:
            try:
                dp = self.dp_for(world_size)
                if self.ep > 1 and (dp * self.cp) % self.ep:
                    problems.append(f"ep={self.ep} does not divide dp*cp = {dp}*{self.cp} for world size {world_size}")
            except ParallelConfigError as exc:
                problems.append(str(exc))
        if problems:
            raise ParallelConfigError("invalid parallel layout " + self.describe() + ": " + "; ".join(problems))

    def describe(self) -> str:
        """Short human form, e.g. ``tp=2 pp=1 cp=1 sp=on``."""
        parts = [f"tp={self.tp}", f"pp={self.pp}"]
        if self.vpp > 1:
            parts.append(f"vpp={self.vpp}")
        if self.cp > 1:
            parts.append(f"cp={self.cp}")
            if self.cp_comm != "ring":
                parts.append(f"cp_comm={self.cp_comm}")
        if self.ulysses > 1:
            parts.append(f"ulysses={self.ulysses}")
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
            if self.moe_dispatcher != "alltoall":
                parts.append(f"moe_dispatcher={self.moe_dispatcher}")
        parts.append(f"sp={'on' if self.sequence_parallel else 'off'}")
        if self.tp_reduce_in_fp32:
            parts.append("tp_reduce=fp32")
        if self.fsdp:
            parts.append("fsdp")
        if self.recompute != "none":
            parts.append(f"recompute={self.recompute}")
        return "(" + " ".join(parts) + ")"
