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
* ``read_unit``: every tensor as fp32 ``fp8.dequantize(fp8, scale_inv)`` for FP8 tensors, as
  stored for the rest; ``scales`` then holds, per FP8 tensor of that unit, each element's block
  ``scale_inv`` (the tensor's shape). ``rounding_bound`` turns them and the unquantized weights into
  the largest error round-to-nearest e4m3 allows each element: half of e4m3's spacing at
  ``|w| / scale_inv`` (3 mantissa bits; subnormal spacing below 2^-6), times ``scale_inv``, plus fp32
  rounding. ``pmz verify`` holds an FP8 tensor against its unquantized counterpart by it, element
  by element: it passes exactly when every element is the nearest e4m3 value under its block's scale.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from converters.formats.hf_config import check_block_count, check_config_against_tensors, read_hf_config
from converters.layout.model import Unit, architecture_for, conversion_weight_map, unit_entries
from converters.torch_path.reader import TORCH_DTYPES, CheckpointReader, ReaderInfo
from models.common.errors import CheckpointError
from models.common.export import fp8
from models.common.hf_files import SafetensorsFiles, canonical_names, check_tensors
from models.common.sources import SafetensorsSource
from models.common.weight_map import hf_shapes
from parallel.sharding import Piece

FORMAT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [fp8.BLOCK, fp8.BLOCK]}
MANTISSA_BITS = 3  # e4m3: spacing 2^(e-3) in the binade [2^e, 2^(e+1))
MIN_NORMAL_EXPONENT = -6  # below 2^-6 the spacing stays 2^-9 (subnormals)
FP32_SLACK = 1e-5  # relative: fp32 rounding of w / scale_inv and of fp8 * scale_inv


def rounding_bound(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per element, the largest ``|fp8 * scale_inv - weight|`` round-to-nearest e4m3 gives under the
    block scale ``scale`` (expanded to ``weight``'s shape), with fp32 slack; float64."""
    s = scale.double()
    m = (weight.double().abs() / s).clamp(min=2.0 ** MIN_NORMAL_EXPONENT)
    exponent = torch.floor(torch.log2(m)).clamp(min=MIN_NORMAL_EXPONENT)
    half_step = torch.exp2(exponent - MANTISSA_BITS - 1)
    return half_step * s * (1 + FP32_SLACK) + weight.double().abs() * FP32_SLACK


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
        shapes = {name: weights[s].shape for name, s in stored_as.items()}
        where = {name: files.file_of(s) for name, s in stored_as.items()}
        config_path = Path(path) / "config.json"
        for field, count, prefix in arch.counted_blocks(cfg) if arch.counted_blocks else ():
            check_block_count(config_path, field, count, prefix, shapes)
        wmap = conversion_weight_map(arch, cfg)
        check_config_against_tensors(config_path, cfg, wmap, shapes, where)
        allowed = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
        check_tensors(shapes, hf_shapes(cfg, wmap), self.path, allowed_extra=allowed, files=where)
        self.hf_config, self.arch, self.cfg, self.wmap = config, arch, cfg, wmap
        self.stored_as = stored_as
        self.quantized = {name for name, s in stored_as.items() if weights[s].dtype == "F8_E4M3"}
        kept = sorted({weights[s].dtype for name, s in stored_as.items() if name not in self.quantized})
        self.kept_dtypes = [str(TORCH_DTYPES.get(k, k)).removeprefix("torch.") for k in kept]
        dtype = TORCH_DTYPES.get(kept[0], torch.float32) if len(kept) == 1 else torch.float32
        self.info = ReaderInfo("hf", arch.name, {"tp": 1, "pp": 1}, len(files.files), dtype)
        self.source = SafetensorsSource(path, files)
        self.scales: dict[str, torch.Tensor] = {}

    def validate(self) -> None:
        """Nothing left to check: the constructor checked files, names, shapes, dtypes and scales."""

    def read_unit(self, unit: Unit) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        self.scales = {}
        for entry in unit_entries(self.wmap, unit):
            for name in entry.hf:
                stored = self.stored_as[name]
                tensor = self.source.read(stored, Piece(None))
                if name in self.quantized:
                    scale = self.source.read(fp8.scale_name(stored), Piece(None))
                    tensor = fp8.dequantize(tensor, scale, torch.float32)
                    self.scales[name] = fp8.dequantize(torch.ones(tensor.shape, dtype=fp8.FP8_DTYPE), scale)
                out[name] = tensor
        return out

    def close(self) -> None:
        self.source.close()

    def describe(self) -> str:
        """The quantization line of ``pmz inspect``."""
        return (f"fp8 (e4m3, {fp8.BLOCK}x{fp8.BLOCK} blocks): {len(self.quantized)} tensors as float8_e4m3fn with "
                f"fp32 <name>{fp8.SCALE_SUFFIX}, the rest {' and '.join(self.kept_dtypes)}")
