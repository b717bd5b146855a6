"""FP8 HF checkpoints on the torch path: ``pmz convert SRC DST --to hf --quantize fp8``.

What is stored is ``models/common/export/fp8.py``'s rule, the one ``save_pretrained(quantization=
"fp8")`` follows: per weight-map entry, ``fp8.is_quantized`` says whether its HF tensors become
``float8_e4m3fn`` plus ``<name>_scale_inv`` (fp32, one per 128x128 block), ``fp8.quantize_named``
makes them, ``fp8.stored_layout`` gives names, shapes and dtypes for planning, and
``fp8.quantization_config`` goes into config.json. Everything else keeps the output dtype, a
conditional-generation checkpoint's vision tower included (not in the role map: carried as stored, its
linear modules listed in ``modules_to_not_convert`` by ``fp8.carried_linear_modules``).

Experts stored fused (``WeightMap.fused_experts``, Qwen3-VL-MoE): ``mlp.experts.gate_up_proj [E, 2F, H]`` and
``down_proj [E, H, F]`` are FP8 with ``<name>_scale_inv [E, ceil(2F/128), ceil(H/128)]`` / ``[E, ceil(H/128),
ceil(F/128)]``, each expert's matrix its own block grid: the parameters transformers 5.24's FP8 model
(``FP8Experts``) holds. Each expert's gate, up and down rows are quantized as they stream and written at their rows
and block rows of the fused tensors (``fused_starts``), which needs each to start on a block edge: refused before
anything is written otherwise (``moe_intermediate_size`` not a multiple of 128).

Files are laid out as ``write_hf`` lays them out (``hf_plan``: HF tensors in unit order, split at
``--max-shard-size`` counted on the unquantized bytes, so FP8 files come out smaller), each HF
tensor replaced by what is stored for it; inside a file the widest dtypes come first, so every
tensor starts aligned to its element size (what safetensors' own writer ensures). Headers are
written up front and tasks fill byte ranges, as in ``write_hf``: the bytes depend only on the plan.

Memory: a quantized tensor is read as row pieces (views into the source where the reader allows)
and quantized in slabs of whole 128-row blocks (``SLAB_BYTES`` of fp32 at most, one block row at
least), each slab's FP8 rows and scale rows written where the plan puts them. A block's scale
depends only on its own elements, so the slabs give exactly the whole tensor's quantization.
Kept tensors stream as in ``write_hf``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

import torch

from converters.formats.hf import FilePlan, nbytes, split_file_plan, stored_header, stored_offsets
from converters.layout.model import Unit
from converters.torch_path.hf import (
    SAFETENSORS_DTYPE,
    hf_plan,
    release_mapped,
    tensor_bytes,
    write_hf_config,
    write_shard_range,
)
from converters.torch_path.reader import CheckpointReader, reopen
from models.common.export import fp8

TAGS = {**SAFETENSORS_DTYPE, fp8.FP8_DTYPE: "F8_E4M3"}
SLAB_BYTES = 64 << 20  # fp32 bytes of one quantization slab (whole 128-row blocks; at least one block row)


@dataclass
class StoredFile:
    """One output file: ``plan`` (the HF tensors it stores and the units to read, as ``hf_plan`` made
    them) and ``stored``: what the file holds, ``(name, shape, safetensors dtype tag)`` in file order."""

    plan: FilePlan
    stored: list[tuple[str, tuple[int, ...], str]]

    def header(self) -> bytes:
        """The file's safetensors header, each tensor with its own dtype (``formats.hf.stored_header``)."""
        return stored_header(self.stored)

    def offsets(self) -> dict[str, int]:
        """Absolute file offset of each stored tensor."""
        return stored_offsets(self.stored)

    def create(self, directory: str) -> None:
        """The file with its header, sized to its final length (tasks write the tensor bytes)."""
        head = self.header()
        with open(Path(directory) / self.plan.name, "wb") as f:
            f.write(head)
            f.truncate(len(head) + sum(nbytes(shape, tag) for _, shape, tag in self.stored))


def role_map(reader: CheckpointReader):
    """The weight map whose entries carry the FP8 roles: the model's own (a Gated DeltaNet hybrid's
    ``in_proj_qkvz`` and ``in_proj_ba`` apart, as HF and vLLM hold them; the reader's map may merge them
    into Megatron's one ``in_proj``) with the MTP block the checkpoint holds."""
    wmap = reader.arch.weight_map(reader.cfg, reader.cfg.vocab_size)
    mtp = getattr(reader.wmap, "mtp_layers", 0)
    return replace(wmap, mtp_layers=mtp) if mtp else wmap


def quantized_names(reader: CheckpointReader) -> set[str]:
    """HF names of every tensor stored as FP8 (``fp8.is_quantized`` of its weight-map entry)."""
    return {name for entry in role_map(reader).entries(range(reader.cfg.num_hidden_layers))
            if fp8.is_quantized(entry) for name in entry.hf}


def check_fp8_target(reader: CheckpointReader, tp: int | None = None) -> None:
    """QuantizationError (one line, the numbers named) before anything is written: a weight-map entry
    with no FP8 role, (an HF target) experts stored fused whose per-expert tensors do not start on a block edge
    of their fused matrix (``fused_starts``), or (``tp``: a vLLM target) a TP whose shard boundaries cut a
    128x128 block."""
    quantization_config(reader)  # every entry's role
    quantized = quantized_names(reader)
    if tp is None and reader.wmap.fused_experts:
        fused_starts(reader, quantized)
    if tp is not None:
        from models.common import vllm_format
        from models.common.weight_map import hf_shapes

        vmap = vllm_format.vllm_map(reader.arch, reader.cfg)
        fp8.vllm_block_check(vmap, reader.cfg, hf_shapes(reader.cfg, vmap), tp)


def fused_starts(reader: CheckpointReader, quantized: set[str]) -> dict[str, tuple[str, int, int]]:
    """``fp8.fused_expert_starts`` of the reader's tensors (experts stored fused: where each expert's FP8 rows and
    block rows go), the error naming the target."""
    try:
        return fp8.fused_expert_starts(list(reader.hf_shapes().items()), quantized)
    except fp8.QuantizationError as exc:
        raise fp8.QuantizationError(f"--quantize fp8 --to hf: {reader.arch.name}: {exc}") from None


def plan_fp8(reader: CheckpointReader, dtype: torch.dtype, max_shard_bytes: int) -> list[StoredFile]:
    """The files of the FP8 checkpoint (see the module docstring); a fused expert tensor is FP8 with its scales when
    its experts' tensors are."""
    quantized = quantized_names(reader)
    files = []
    for plan in hf_plan(reader, dtype, max_shard_bytes):
        fused = {plan.within[n][0] for n in plan.within if n in quantized}
        stored = [(n, s, TAGS[dt]) for name, shape in plan.on_disk()
                  for n, s, dt in fp8.stored_layout(name, shape, name in quantized or name in fused, dtype)]
        stored.sort(key=lambda t: -nbytes((), t[2]))  # stable: widest first, every tensor aligned
        files.append(StoredFile(plan, stored))
    return files


def quantization_config(reader: CheckpointReader) -> dict:
    """``fp8.quantization_config`` of the checkpoint: the text model's (and MTP block's) roles, and a
    conditional-generation checkpoint's tower (``cfg.carried``: kept, its linears in ``modules_to_not_convert``)."""
    return fp8.quantization_config(role_map(reader), reader.cfg.num_hidden_layers, getattr(reader.cfg, "carried", ()))


def write_quantization_config(directory: str, reader: CheckpointReader) -> None:
    """Add ``fp8.quantization_config`` to the config.json already written in ``directory``."""
    path = Path(directory) / "config.json"
    data = json.loads(path.read_text())
    data["quantization_config"] = quantization_config(reader)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_hf_fp8(reader: CheckpointReader, directory: str, dtype: torch.dtype, *, max_shard_bytes: int,
                 workers: int, progress: bool, files_from: str | None) -> None:
    """The FP8 HF checkpoint of ``reader`` in ``directory``: shards, index, config.json with
    ``quantization_config`` and the tokenizer files of ``files_from``; ``dtype``: the kept tensors'."""
    from converters.runtime.tasks import run_tasks

    files = plan_fp8(reader, dtype, max_shard_bytes)
    quantized = quantized_names(reader)
    starts = fused_starts(reader, quantized) if reader.wmap.fused_experts else {}
    tasks = []
    for f in files:
        f.create(directory)
        parts = max(1, min(workers, len(f.plan.tensors)) * 2 // max(1, len(files)))
        tasks += [(_write_range, (reader.reopen_args(), f, directory, dtype, lo, hi, quantized, starts))
                  for lo, hi in split_file_plan(f.plan, parts)]
    run_tasks(tasks, workers, "writing FP8 HF shards", progress)
    if len(files) > 1:
        total = sum(nbytes(shape, tag) for f in files for _, shape, tag in f.stored)
        index = {"metadata": {"total_size": total},
                 "weight_map": {name: f.plan.name for f in files for name, _, _ in f.stored}}
        (Path(directory) / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True)
                                                                      + "\n")
    write_hf_config(reader, directory, dtype, files_from)
    write_quantization_config(directory, reader)


def _write_range(reopen_args: tuple, file: StoredFile, directory: str, dtype: torch.dtype, lo: int, hi: int,
                 quantized: set[str], starts: dict[str, tuple[str, int, int]]) -> int:
    reader = reopen(reopen_args)
    try:
        return write_fp8_range(file, directory, dtype, lo, hi, reader.read_unit_pieces, quantized, starts)
    finally:
        reader.close()


def write_fp8_range(file: StoredFile, directory: str, dtype: torch.dtype, lo: int, hi: int,
                    read_unit_pieces: Callable[[Unit], dict[str, list[torch.Tensor]]], quantized: set[str],
                    starts: dict[str, tuple[str, int, int]] | None = None) -> int:
    """Write what is stored for HF tensors ``file.plan.tensors[lo:hi]``, unit by unit; returns the bytes
    (``torch_path.hf.write_shard_range``, quantized tensors written by ``_write_quantized``; a per-expert tensor
    of a fused one at its rows and scale rows there, ``starts`` from ``fused_starts``)."""
    starts = starts or {}

    def quantize(f, name: str, pieces: list[torch.Tensor], offsets: dict[str, int]) -> int | None:
        if name not in quantized:
            return None
        if name in starts:
            fused, at, scale_at = starts[name]  # FP8: one byte an element; scales fp32
            return _write_quantized(f, name, pieces, offsets[fused] + at,
                                    offsets[fp8.scale_name(fused)] + 4 * scale_at)
        return _write_quantized(f, name, pieces, offsets[name], offsets[fp8.scale_name(name)])

    return write_shard_range(file.plan, directory, dtype, lo, hi, read_unit_pieces, offsets=file.offsets(),
                             write_tensor=quantize)


def _write_quantized(f, name: str, pieces: list[torch.Tensor], at: int, scale_at: int) -> int:
    """The FP8 rows and scale rows of one tensor, slab by slab (``row_slabs``), at their offsets."""
    written = 0
    for slab in row_slabs(pieces):
        (_, q), (_, s) = fp8.quantize_named([(name, slab)], True, None)
        for tensor, where in ((q, at), (s, scale_at)):
            f.seek(where)
            written += f.write(tensor_bytes(tensor))
        at, scale_at = at + q.numel() * q.element_size(), scale_at + s.numel() * s.element_size()
    for piece in pieces:
        release_mapped(piece)
    return written


def row_slabs(pieces: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The tensor whose row pieces are ``pieces`` (concatenated along dim 0) as slabs of whole 128-row
    blocks (the last one what is left), each at most ``SLAB_BYTES`` of fp32 but at least one block
    row; a tensor that is not a matrix comes whole."""
    if pieces[0].dim() != 2:
        yield torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        return
    cols = pieces[0].shape[1]
    rows = fp8.BLOCK * max(1, SLAB_BYTES // max(1, fp8.BLOCK * cols * 4))
    held: list[torch.Tensor] = []
    count = 0
    for piece in pieces:
        start = 0
        while start < piece.shape[0]:
            take = min(rows - count, piece.shape[0] - start)
            held.append(piece[start:start + take])
            count, start = count + take, start + take
            if count == rows:
                yield torch.cat(held) if len(held) > 1 else held[0]
                held, count = [], 0
    if held:
        yield torch.cat(held) if len(held) > 1 else held[0]
