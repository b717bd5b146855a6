"""The conversion engine: detect the source, validate it, write into a temp dir, rename at the end.

Guarantees:
  * nothing is written before the source validated (every rank file present, shapes consistent,
    no tensor missing or unused) and the target layout checked against the model;
  * output goes to ``.<dst>.tmp-<pid>`` beside the destination and is renamed into place only when
    complete; on any error the temp dir is removed and the exception propagates (CLI: exit 1);
  * an existing destination is refused unless ``overwrite=True``;
  * work is split into tasks (byte ranges of HF files, Megatron rank files, torch_dist data files)
    run by a pool of worker processes, each rebuilding its own reader; the bytes depend only on the
    plan, never on timing or the number of workers.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from converters.checkpoint import reopen
from converters.formats import detect_format, open_reader  # noqa: F401 (part of this module's API)
from converters.tasks import run_tasks
from models.common.errors import CheckpointError
from models.common.sizes import parse_size  # noqa: F401 (part of this module's API)

if TYPE_CHECKING:
    import torch

TARGETS = ("hf", "megatron", "megatron-dist", "vllm")
DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
               "fp16": "float16", "float16": "float16"}


def dtype_name(name: Any) -> str | None:
    """'float32' / 'bfloat16' / 'float16' for a dtype name or torch dtype (None stays None)."""
    if name is None:
        return None
    if not isinstance(name, str):
        name = str(name).removeprefix("torch.")
    if name.lower() not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r} (choose fp32, bf16 or fp16)")
    return DTYPE_NAMES[name.lower()]


def parse_dtype(name: Any) -> torch.dtype | None:
    """The torch dtype of a name ('bf16', 'float32', ...) or torch dtype (loads torch)."""
    import torch

    canonical = dtype_name(name)
    return None if canonical is None else getattr(torch, canonical)


class _Staging:
    """Temp dir beside ``dst``, renamed over it on success, removed on failure."""

    def __init__(self, dst: Path, overwrite: bool) -> None:
        self.dst = dst
        if dst.exists() and not overwrite:
            raise CheckpointError(f"{dst}: destination exists (pass --overwrite to replace it)")
        if not dst.parent.exists():
            raise CheckpointError(f"{dst.parent}: parent directory of the destination does not exist")
        self.tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"

    def __enter__(self) -> Path:
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir()
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        old = None
        if self.dst.exists():
            old = self.dst.parent / f".{self.dst.name}.old-{os.getpid()}"
            os.rename(self.dst, old)
        os.rename(self.tmp, self.dst)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, to: str, tp: int = 1, pp: int = 1, vpp: int = 1,
            hf_config: str | None = None, arch: str | None = None, vocab_size: int | None = None,
            dtype: str | torch.dtype | None = None, overwrite: bool = False, workers: int | None = None,
            max_shard_size: str | int = "5GB", make_vocab_size_divisible_by: int = 128,
            progress: bool = False) -> Path:
    """Convert ``src`` (format detected) to ``to`` in ``dst``; returns the destination path.

    to: "hf", "megatron" (legacy torch, at tp/pp/vpp), "megatron-dist" (torch_dist; tp/pp/vpp
    are recorded in its args) or "vllm" (vLLM ``sharded_state`` for an engine with TP ``tp`` and
    PP ``pp``). Raises CheckpointError/ValueError with nothing left at ``dst``.
    """
    if to not in TARGETS:
        raise ValueError(f"unknown target format {to!r} (choose {', '.join(TARGETS)})")
    wanted_dtype = dtype_name(dtype)
    shard_bytes = parse_size(max_shard_size)
    dst_path = Path(dst).resolve()
    src_path = Path(src).resolve()
    if src_path == dst_path or dst_path in src_path.parents:
        raise CheckpointError(f"{dst_path}: destination is the source or contains it ({src_path})")
    workers = workers or min(4, os.cpu_count() or 1)
    if to == "hf" and _convert_by_copy(src, dst_path, overwrite=overwrite, hf_config=hf_config, arch=arch,
                                       vocab_size=vocab_size, dtype=wanted_dtype, shard_bytes=shard_bytes,
                                       workers=workers, progress=progress):
        return dst_path
    out_dtype = parse_dtype(wanted_dtype)
    reader = open_reader(src, arch=arch, hf_config=hf_config, vocab_size=vocab_size)
    reader.validate()
    out_dtype = out_dtype or reader.info.dtype
    if to == "vllm":
        from converters.hf import write_hf_config
        from converters.vllm import write_vllm
        from models.common.vllm_format import check_layout

        if vpp != 1:
            raise ValueError(f"vLLM has no virtual pipeline stages (got --vpp {vpp})")
        check_layout(reader.cfg, tp, pp)
        with _Staging(dst_path, overwrite) as tmp:
            write_vllm(reader, str(tmp), tp=tp, pp=pp, dtype=out_dtype, max_shard_bytes=shard_bytes,
                       workers=workers, progress=progress)
            # config.json plus tokenizer files: from --hf-config, else from an HF source's own directory
            files_from = hf_config or (str(src_path) if reader.info.format == "hf" else None)
            write_hf_config(reader, str(tmp), out_dtype, files_from)
        return dst_path
    if to == "hf":
        from converters.hf import create_shard_file, hf_plan, split_file_plan, write_hf_config, write_index

        plan = hf_plan(reader, out_dtype, shard_bytes)
        with _Staging(dst_path, overwrite) as tmp:
            # Files are laid out up front; tasks fill byte ranges of them (a big file is split between
            # workers). The layout comes from the plan alone, so the bytes never depend on workers.
            tasks = []
            for f in plan:
                create_shard_file(f, str(tmp), out_dtype)
                parts = max(1, min(workers, len(f.tensors)) * 2 // max(1, len(plan)))
                tasks += [(_write_hf_range, (reader.reopen_args(), f, str(tmp), out_dtype, lo, hi))
                          for lo, hi in split_file_plan(f, parts)]
            run_tasks(tasks, workers, "writing HF shards", progress)
            write_index(plan, str(tmp), out_dtype)
            # tokenizer/generation files: from --hf-config, else from an HF source's own directory
            write_hf_config(reader, str(tmp), out_dtype, hf_config or (str(src_path) if reader.info.format == "hf"
                                                                       else None))
        return dst_path
    from converters.megatron_write import plan_megatron_target, write_megatron

    target = plan_megatron_target(reader, tp=tp, pp=pp, vpp=vpp, dtype=out_dtype,
                                  divisible_by=make_vocab_size_divisible_by)
    with _Staging(dst_path, overwrite) as tmp:
        write_megatron(reader, target, str(tmp), fmt=to, workers=workers, progress=progress,
                       hf_config_dir=hf_config)
    return dst_path


def _convert_by_copy(src, dst_path: Path, *, overwrite: bool, hf_config, arch, vocab_size, dtype: str | None,
                     shard_bytes: int, workers: int, progress: bool) -> bool:
    """The copy path (``converters/copy_plan.py``: no torch, ``copy_file_range``) when the source
    allows it and no dtype change is asked for; False when the torch path must do the conversion."""
    from converters.copy_plan import Unsupported, open_raw_source, write_hf_by_copy
    from converters.raw_files import TAG_TO_TORCH_NAME

    if os.environ.get("PMZ_COPY_PATH", "1") == "0":
        return False
    try:
        source = open_raw_source(str(src), arch=arch, hf_config=hf_config, vocab_size=vocab_size)
        tag = source.dtype()
    except Unsupported:
        return False
    if dtype is not None and dtype != TAG_TO_TORCH_NAME[tag]:
        return False
    with _Staging(dst_path, overwrite) as tmp:
        write_hf_by_copy(source, str(tmp), max_shard_bytes=shard_bytes, workers=workers, progress=progress)
    return True


def _write_hf_range(reopen_args: tuple, plan, directory: str, dtype: torch.dtype, lo: int, hi: int) -> int:
    from converters.hf import write_shard_range

    reader = reopen(reopen_args)
    try:
        return write_shard_range(plan, directory, dtype, lo, hi, reader.read_unit_pieces)
    finally:
        reader.close()
