"""The copy path's HF writer: safetensors files laid out by ``converters/formats/hf`` (the layout the
torch path writes too, so both write identical files) and filled from the source's planned byte
ranges by worker threads (``converters/copy_path/io.fill_file``), plus index, config and tokenizer.

An HF target is few files (one per 5 GB): its writes serialize on each file's inode lock, so the
cost of writing one file bounds the conversion (issue 40). Each file is created at its final size
and preallocated (``io.preallocate``: ext4 / XFS) before the copy, which takes the per-block
delayed-allocation work out of every write (~30% of the writing CPU on ext4).
"""

from __future__ import annotations

from pathlib import Path

from converters.copy_path.io import DEFAULT_BUFFER, fill_file, preallocate, thread_buffer
from converters.copy_path.raw_source import RawSource
from converters.formats.hf import FilePlan, header, nbytes, plan_shards, split_file_plan, tensor_offsets, write_index
from converters.formats.hf_config import read_hf_config, write_config_dir
from converters.formats.tensors import TAG_TO_TORCH_NAME
from converters.runtime.tasks import run_tasks


def plan_hf_files(source: RawSource, max_shard_bytes: int) -> tuple[str, list[FilePlan]]:
    tag = source.dtype()
    units = [(unit, [(n, source.planned[n].shape) for e in entries for n in e.hf]) for unit, entries in source.units()]
    # a fused_experts map (Qwen3-VL-MoE): each layer's experts laid out in their fused tensors, as the torch path does
    return tag, plan_shards(units, tag, max_shard_bytes, source.wmap.fused_experts)


def hf_tasks(source: RawSource, files: list[FilePlan], tag: str, directory: str, workers: int,
             buffer_bytes: int) -> list[tuple]:
    """Create the output files (headers, final sizes) and cut the copying into tasks of about equal bytes."""
    tasks = []
    for f in files:
        head = header(f, tag)
        size = len(head) + sum(nbytes(shape, tag) for _, shape in f.tensors)
        path = str(Path(directory) / f.name)
        with open(path, "wb") as out:
            out.write(head)
            out.truncate(size)
            preallocate(out.fileno(), size)  # blocks allocated now: the copy fills them (io.preallocate)
        offsets = tensor_offsets(f, tag)
        parts = max(1, min(workers, len(f.tensors)) * 2 // max(1, len(files)))
        for lo, hi in split_file_plan(f, parts):
            work = [(offsets[name], source.planned[name].ops) for name, _ in f.tensors[lo:hi]]
            tasks.append((fill_file, (path, work, buffer_bytes)))
    return tasks


def write_hf_by_copy(source: RawSource, directory: str, *, max_shard_bytes: int, workers: int, progress: bool,
                     buffer_bytes: int = DEFAULT_BUFFER) -> None:
    """The HF checkpoint of ``source`` in ``directory`` (safetensors files + index + config + tokenizer)."""
    tag, files = plan_hf_files(source, max_shard_bytes)
    tasks = hf_tasks(source, files, tag, directory, workers, thread_buffer(buffer_bytes, workers))
    run_tasks(tasks, workers, "copying HF shards", progress, threads=True)
    write_index(files, directory, tag)
    config = source.hf_config
    if source.hf_config_dir and source.format != "hf":
        config = read_hf_config(source.hf_config_dir)
    write_config_dir(config, directory, TAG_TO_TORCH_NAME[tag])  # config, generation config, tokenizer files
