"""vLLM 0.32's pipeline stages: which layers each stage builds and on which stages it builds the embedding, the
final norm and the LM head (plain data, no torch; read by ``vllm_format.stage_tensors``, the one listing every
``sharded_state`` writer and reader follows).

Layers: ``vllm.distributed.utils.get_pp_indices`` without ``VLLM_PP_LAYER_PARTITION`` (equal counts, the
remainder given one each to the stages before the last): ``pp_layer_ranges``.

The whole-model tensors depend on the architecture's vLLM class. Most (``llama.py``, ``qwen2.py`` and what builds
on them: Qwen3, Qwen2-VL, Qwen2.5-VL, Qwen3-VL) replace what a stage does not run by ``PPMissingLayer`` (no
parameters): the embedding on the first stage (and on the last too when tied), the final norm and the LM head on
the last. Others build some of them unconditionally, on every stage, and their strict ``ShardedStateLoader``
wants those keys in every stage's files (``EVERY_STAGE``, read from vLLM 0.32's source):

* ``qwen2_moe.py``: ``Qwen2MoeModel.__init__`` builds ``embed_tokens`` and ``norm``, ``Qwen2MoeForCausalLM``
  its ``lm_head``, with no pipeline check (the file has no ``PPMissingLayer``);
* ``qwen3_moe.py``: ``Qwen3MoeModel.__init__`` builds ``embed_tokens`` and ``norm``, ``Qwen3MoeForCausalLM``
  its ``lm_head``, all unconditionally; ``qwen3_vl_moe.py``'s ``Qwen3MoeLLMModel`` / ``Qwen3MoeLLMForCausalLM``
  (Qwen3-VL-MoE's text model) inherit that model and build the same head themselves;
* ``qwen3_next.py``: ``Qwen3NextModel`` builds ``embed_tokens`` on every stage (its ``norm`` on the last only),
  ``Qwen3NextForCausalLM`` its ``lm_head`` on every stage (never tied);
* ``qwen3_5.py`` (Qwen3.5 and Qwen3.5-MoE, either checkpoint kind): ``Qwen3_5Model`` builds ``embed_tokens`` on
  every stage, ``norm`` and ``lm_head`` on the last only.

With tied embeddings on a stage holding both, the head shares the embedding's memory and ``sharded_state`` keeps
the alphabetically smaller key, ``lm_head.weight`` (``vllm_format.TIED_HEAD_KEY``). Every such stage's copy is the
same tensor: the readers take it from the first stage holding it (``VllmShardedCheckpoint.locate``).
"""

from __future__ import annotations

from dataclasses import dataclass

EMBED, NORM, HEAD = "embed", "norm", "head"
EVERY_STAGE: dict[str, frozenset[str]] = {
    "qwen2_moe": frozenset({EMBED, NORM, HEAD}),
    "qwen3_moe": frozenset({EMBED, NORM, HEAD}),
    "qwen3_vl_moe": frozenset({EMBED, NORM, HEAD}),
    "qwen3_next": frozenset({EMBED, HEAD}),
    "qwen3_5": frozenset({EMBED}),
    "qwen3_5_moe": frozenset({EMBED}),
}


@dataclass(frozen=True)
class StageParts:
    """What of the embedding, final norm and LM head vLLM builds on one pipeline stage (tied or not)."""

    embed: bool
    norm: bool
    head: bool


def stage_parts(architecture: str, pp_rank: int, pp: int) -> StageParts:
    """``StageParts`` of stage ``pp_rank`` of ``pp`` for a vLLM model of ``architecture`` (module doc)."""
    every = EVERY_STAGE.get(architecture, frozenset())
    first, last = pp_rank == 0, pp_rank == pp - 1
    return StageParts(first or EMBED in every, last or NORM in every, last or HEAD in every)


def pp_layer_ranges(num_layers: int, pp: int) -> list[range]:
    """Layers of each vLLM pipeline stage (``get_pp_indices``)."""
    sizes = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        sizes[-i] += 1
    starts = [sum(sizes[:p]) for p in range(pp)]
    return [range(s, s + n) for s, n in zip(starts, sizes)]
