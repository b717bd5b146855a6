"""Block-wise FP8 HF directories read back, dequantized: for ``pmz inspect`` and ``pmz verify`` only.

``pmz convert`` refuses quantized sources (``converters/formats/quantized.py``): it converts
training weights. But a user who wrote ``out/hf-fp8`` with ``--quantize fp8`` (or holds a release
in the same format: DeepSeek-V3's, Qwen's ``*-FP8``) wants ``pmz inspect out/hf-fp8`` to describe
it and ``pmz verify SRC out/hf-fp8`` to say whether it is SRC quantized. This reader gives both:

* accepted: config.json's ``quantization_config`` with ``quant_method`` "fp8", ``fmt`` "e4m3" and
  ``weight_block_size`` [128, 128] (``models/common/export/fp8.py``'s format); every ``F8_E4M3``
  tensor with an fp32 ``<name>_scale_inv`` of ``fp8.scale_shape`` beside it and every scale with
  its weight; the weights themselves under the model's names and shapes, checked as
  ``converters.formats.hf.HFCheckpoint`` checks an unquantized directory (same shared checks);
* garbage refused, naming the file and the tensor (``pmz inspect``/``verify`` exit 1): a block
  ``scale_inv`` that is not a positive finite number (NaN, inf, 0, negative: the writer stores 1
  for an all-zero block, so no quantizer output holds one; the scales are 1/16384 of the weight
  bytes and are read by the constructor) and, when ``read_unit`` reads an F8 weight, any e4m3 NaN
  encoding (``0x7f``/``0xff``; e4m3fn has no infinities, and ``fp8.quantize`` clamps to +-448);
* ``read_unit``: every tensor as fp32 ``fp8.dequantize(fp8, scale_inv)`` for FP8 tensors, as
  stored for the rest (experts stored fused, Qwen3-VL-MoE: each expert's gate, up and down rows of the fused
  FP8 tensor with the block rows of its ``_scale_inv`` that ``fp8.scale_offset`` places them at, as
  ``torch_path/hf_fp8.py`` writes them; a transposed release layout is not read); ``scales`` then holds, per
  FP8 tensor of that unit, each element's block ``scale_inv`` (the tensor's shape). ``rounding_bound``
  turns them and the unquantized weights into the largest error round-to-nearest e4m3 allows each
  element: the distance to the nearest e4m3 point of ``w / scale_inv`` (torch's own round-to-nearest-even
  cast), times ``scale_inv``, plus fp32 rounding (16 ulps). ``pmz verify`` holds an FP8 tensor against its
  unquantized counterpart by it, element by element: it passes exactly when every element is the nearest
  e4m3 value under its block's scale.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Callable

import torch

from converters.formats.hf_config import check_block_count, check_config_against_tensors, read_hf_config
from converters.layout.model import Unit, architecture_for, checkpoint_weight_map, unit_entries
from converters.torch_path.reader import TORCH_DTYPES, CheckpointReader, ReaderInfo
from models.common.errors import CheckpointError
from models.common.export import fp8
from models.common.hf_files import SafetensorsFiles, canonical_names, check_tensors, per_expert_views
from models.common.sources import SafetensorsSource
from models.common.weight_map import hf_shapes
from parallel.sharding import Piece

FORMAT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [fp8.BLOCK, fp8.BLOCK]}
FP32_SLACK = 2.0 ** -20  # relative, 16 fp32 ulps: w / scale_inv (or w * (448 / amax)) and fp8 * scale_inv
# computed in fp32 move a value by an ulp or two: enough to pick the other neighbour of a near-tie


def rounding_bound(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per element, the largest ``|fp8 * scale_inv - weight|`` a nearest-e4m3 quantization under the
    block scale ``scale`` (expanded to ``weight``'s shape) gives: the distance of the nearest e4m3
    point ``q = e4m3(clamp(weight / scale, +-448))`` (round to nearest, ties to even: torch's cast),
    plus fp32 slack, float64. So a dequantized element passes ``|d - w| <= bound`` exactly when it is
    a nearest e4m3 point of ``w`` (up to the slack: the other point of a near-tie), never a farther
    one -- also just above a power of two, where the neighbour below is one (smaller) step away.
    NaN where ``scale`` is not a positive finite number, so that no comparison with it passes."""
    w, s = weight.double(), scale.double()
    q = (w / s).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(torch.float32).to(fp8.FP8_DTYPE).double()
    bound = (q * s - w).abs() + (w.abs() + (q * s).abs()) * FP32_SLACK
    return torch.where((s > 0) & torch.isfinite(s), bound, torch.full_like(bound, math.nan))


def check_scales(scale: torch.Tensor, name: str, file: Callable[[], str]) -> None:
    """CheckpointError naming ``file()`` and the scale tensor unless every block ``scale_inv`` is a
    positive finite number (NaN, +-inf, 0 and negatives dequantize to garbage or to zeros)."""
    if bool(((scale > 0) & (scale < math.inf)).all()):  # NaN compares False
        return
    bad = ~(torch.isfinite(scale) & (scale > 0))
    if bool(bad.any()):
        first = tuple(int(i) for i in torch.nonzero(bad)[0])
        count = int(bad.sum())
        raise CheckpointError(f"{file()}: {name} block {first} is {float(scale[first])!r}"
                              f"{f' ({count} blocks are not positive finite numbers)' if count > 1 else ''}: "
                              f"an FP8 block scale must be a positive finite number (quantizers store 1 for an "
                              f"all-zero block); the weights it scales are garbage")


def check_no_nan_encodings(weight: torch.Tensor, name: str, file: Callable[[], str]) -> None:
    """CheckpointError naming ``file()`` and ``name`` when the F8_E4M3 ``weight`` holds NaN encodings
    (``0x7f``/``0xff``: e4m3fn's only non-finite values; a quantizer clamps to +-448)."""
    nan = (weight.view(torch.uint8) & 0x7F) == 0x7F
    if bool(nan.any()):
        first = tuple(int(i) for i in torch.nonzero(nan)[0])
        raise CheckpointError(f"{file()}: {name} holds {int(nan.sum())} e4m3 NaN encoding(s) (0x7f/0xff), the first "
                              f"at {first}: not weights a quantizer writes")


class FP8HFReader(CheckpointReader):
    """An HF directory in the block-wise FP8 format, validated once, read dequantized (module docstring)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)
        self._remember_args(self.path)
        config = read_hf_config(path)
        qconfig = config.quantization_config
        if not isinstance(qconfig, dict) or any(qconfig.get(k) != v for k, v in FORMAT.items()):
            wanted = ", ".join(f"{k} {v!r}" for k, v in FORMAT.items())
            raise CheckpointError(f"{Path(path) / 'config.json'}: quantization_config {qconfig!r} is not the "
                                  f"block-wise FP8 pmz reads back ({wanted})")
        files = SafetensorsFiles(path)
        stored = files.tensors
        scales = {n for n in stored if n.endswith(fp8.SCALE_SUFFIX) and n.removesuffix(fp8.SCALE_SUFFIX) in stored}
        weights = {n: t for n, t in stored.items() if n not in scales}
        for name, t in sorted(weights.items()):
            if t.dtype != "F8_E4M3":
                continue
            scale = stored.get(fp8.scale_name(name))
            want = fp8.scale_shape(t.shape)
            if scale is None or scale.dtype != "F32" or tuple(scale.shape) != want:
                found = "absent" if scale is None else f"{scale.dtype} {tuple(scale.shape)}"
                raise CheckpointError(f"{self.path}: {name} is F8_E4M3 {tuple(t.shape)}, its {fp8.scale_name(name)} "
                                      f"should be F32 {want}, found {found} (in {files.file_of(name)})")
        stray = sorted(n for n in scales if stored[n.removesuffix(fp8.SCALE_SUFFIX)].dtype != "F8_E4M3")
        if stray:
            raise CheckpointError(f"{self.path}: {stray[0]} scales {stray[0].removesuffix(fp8.SCALE_SUFFIX)}, which "
                                  f"is not F8_E4M3 but {stored[stray[0].removesuffix(fp8.SCALE_SUFFIX)].dtype}")
        arch = architecture_for(config.model_type, self.path)
        cfg = arch.model_config(config)
        # the unquantized directory's checks (converters/formats/hf.py, HFCheckpoint) on the weights
        stored_as = canonical_names(weights, arch.canonical_name, self.path)
        # experts stored fused (Qwen3-VL-MoE, transformers' FP8Experts layout): a view per expert, in
        # transformers' layout only (a transposed release's FP8 blocks are not this writer's), its scales the block
        # rows fp8.scale_offset places it at in the fused tensor's
        # per-expert name -> (fused tensor, element offset there, its shape)
        self.within: dict[str, tuple[str, int, tuple[int, ...]]] = {}
        if arch.weight_map(cfg, cfg.vocab_size).fused_experts:
            views, origin = per_expert_views(self.path, stored_as, weights, cfg, False)
            self.within = {name: (origin[name], (v.offset - weights[origin[name]].offset) * math.prod(v.shape)
                                  // v.nbytes, tuple(v.shape)) for name, v in views.items() if name not in stored_as}
            stored_as = {name: origin[name] for name in views}
        shapes = {name: self.within[name][2] if name in self.within else weights[s].shape
                  for name, s in stored_as.items()}
        where = {name: files.file_of(s) for name, s in stored_as.items()}
        config_path = Path(path) / "config.json"
        for field, count, prefix in arch.counted_blocks(cfg) if arch.counted_blocks else ():
            check_block_count(config_path, field, count, prefix, shapes)
        wmap = checkpoint_weight_map(arch, cfg, shapes, self.path)  # a hybrid's MTP block when it has one
        check_config_against_tensors(config_path, cfg, wmap, shapes, where)
        allowed = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
        check_tensors(shapes, hf_shapes(cfg, wmap), self.path, allowed_extra=allowed, files=where)
        self.hf_config, self.arch, self.cfg, self.wmap = config, arch, cfg, wmap
        self.stored_as = stored_as
        self.quantized = {name for name, s in stored_as.items() if weights[s].dtype == "F8_E4M3"}
        kept = sorted({weights[s].dtype for name, s in stored_as.items() if name not in self.quantized})
        if not self.quantized:  # a plain checkpoint under an FP8 config: loaders would expect FP8 weights
            raise CheckpointError(f"{config_path}: quantization_config says block-wise FP8, but no tensor is stored "
                                  f"as F8_E4M3: the files hold {' and '.join(kept) or 'no weights'} (an unquantized "
                                  f"checkpoint under a quantized config; without quantization_config pmz reads it "
                                  f"as one, as convert does)")
        self.kept_dtypes = [str(TORCH_DTYPES.get(k, k)).removeprefix("torch.") for k in kept]
        dtype = TORCH_DTYPES.get(kept[0], torch.float32) if len(kept) == 1 else torch.float32
        self.info = ReaderInfo("hf", arch.name, {"tp": 1, "pp": 1}, len(files.files), dtype)
        self.files = files
        self.source = SafetensorsSource(path, files)
        self.scales: dict[str, torch.Tensor] = {}
        for scale in sorted({fp8.scale_name(stored_as[name]) for name in self.quantized}):
            check_scales(self.source.read(scale, Piece(None)), scale, lambda s=scale: self._file(s))

    def _file(self, stored: str) -> str:
        return str(Path(self.path) / self.files.file_of(stored))

    def validate(self) -> None:
        """Nothing left to check: the constructor checked files, names, shapes, dtypes and scales."""

    def read_unit(self, unit: Unit) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        self.scales = {}
        read: dict[str, torch.Tensor] = {}  # stored tensors of this unit (a fused one once for all its experts)
        for entry in unit_entries(self.wmap, unit):
            for name in entry.hf:
                stored = self.stored_as[name]
                if stored not in read:
                    read[stored] = self.source.read(stored, Piece(None))
                tensor = read[stored]
                if name in self.quantized:
                    scale_name = fp8.scale_name(stored)
                    if scale_name not in read:
                        check_no_nan_encodings(tensor, stored, lambda s=stored: self._file(s))
                        read[scale_name] = self.source.read(scale_name, Piece(None))
                        check_scales(read[scale_name], scale_name, lambda s=scale_name: self._file(s))
                    scale = read[scale_name]
                    if name in self.within:  # one expert's rows of a fused tensor and their block rows
                        tensor, scale = _expert_rows(tensor, scale, *self.within[name][1:])
                    tensor = fp8.dequantize(tensor, scale, torch.float32)
                    self.scales[name] = fp8.dequantize(torch.ones(tensor.shape, dtype=fp8.FP8_DTYPE), scale)
                elif name in self.within:
                    tensor = _expert_rows(tensor, None, *self.within[name][1:])[0]
                out[name] = tensor
        return out

    def close(self) -> None:
        self.source.close()

    def describe(self) -> str:
        """The quantization line of ``pmz inspect``."""
        return (f"fp8 (e4m3, {fp8.BLOCK}x{fp8.BLOCK} blocks): {len(self.quantized)} tensors as float8_e4m3fn with "
                f"fp32 <name>{fp8.SCALE_SUFFIX}, the rest {' and '.join(self.kept_dtypes)}")


def _expert_rows(fused: torch.Tensor, scale: torch.Tensor | None, offset: int, shape: tuple[int, ...]
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``shape`` tensor at element ``offset`` of ``fused`` (one expert's gate, up or down rows) and, for an FP8
    one, its scales: the block rows ``fp8.scale_offset`` places it at in ``scale`` (fused tensors' scales)."""
    rows = fused.reshape(-1)[offset:offset + math.prod(shape)].view(shape)
    if scale is None:
        return rows, None
    at, want = fp8.scale_offset(fused.shape, offset), fp8.scale_shape(shape)
    return rows, scale.reshape(-1)[at:at + math.prod(want)].view(want)
