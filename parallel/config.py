"""ParallelConfig: the parallel layout of a job, validated before any process group exists.

The layout follows Megatron's conventions so that checkpoints and rank numbering line up:
ranks are laid out with tensor-parallel fastest, then context-parallel, then data-parallel,
then pipeline-parallel (Megatron's default order ``tp-cp-dp-pp``). ``dp`` is not set by the
caller: it is whatever the world size leaves after ``tp * cp * pp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ParallelConfigError(ValueError):
    """A parallel layout that cannot work for this world size or model (raised before any collective)."""


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

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "vpp", "cp", "ep", "vocab_padding_multiple"):
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

    @property
    def model_parallel_size(self) -> int:
        """Ranks that together hold one full replica of the model: ``tp * cp * pp``."""
        return self.tp * self.cp * self.pp

    def dp_for(self, world_size: int) -> int:
        """Data-parallel size implied by ``world_size``; raises if the world does not divide."""
        if world_size % self.model_parallel_size != 0:
            raise ParallelConfigError(
                f"world size {world_size} is not divisible by tp*cp*pp = "
                f"{self.tp}*{self.cp}*{self.pp} = {self.model_parallel_size}"
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
        num_experts = _attr(model_config, "num_experts", "num_local_experts", "num_moe_experts")
        if self.ep > 1:
            if not num_experts:
                problems.append(f"ep={self.ep} needs an MoE model, but the config has no experts")
            elif num_experts % self.ep:
                problems.append(f"num_experts={num_experts} is not divisible by ep={self.ep}")
        if self.sequence_parallel and tp == 1:
            problems.append("sequence_parallel=True needs tp > 1 (it shards activations over the TP group)")
        if layers is not None:
            try:
                from parallel.pipeline_layout import stage_layer_ranges

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
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        parts.append(f"sp={'on' if self.sequence_parallel else 'off'}")
        return "(" + " ".join(parts) + ")"
