"""``pmz verify``: compare two checkpoints of any supported formats, tensor by tensor in HF names.

Units are read one at a time from both sides (memory stays at two units). Optionally both are
run through transformers on a fixed prompt (``--logits``); Megatron sides are converted to a
temporary HF copy for that.

An HF directory in the block-wise FP8 format (``pmz convert --quantize fp8``'s output) is read
dequantized (``converters/torch_path/hf_fp8_reader``). Against an unquantized checkpoint each FP8
tensor passes when every element is the nearest e4m3 value of the other side's under its block's
``scale_inv`` (``rounding_bound``: half an e4m3 step at that magnitude, plus fp32 rounding), whatever
``--atol``/``--rtol`` say: what quantizing the other side gives, and nothing looser. The kept tensors
compare as usual (exact by default); two FP8 sides compare their dequantized values as usual.
``--logits`` is refused for FP8 sides in one line.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from converters.engine import convert
from converters.formats import detect_format
from converters.torch_path import open_reader
from models.common.errors import CheckpointError


@dataclass
class VerifyReport:
    rows: list[tuple[str, float, float]] = field(default_factory=list)  # (name, max abs, max rel)
    mismatched: list[str] = field(default_factory=list)
    logits_diff: float | None = None
    fp8: list[str] = field(default_factory=list)  # tensors held to the FP8 rounding bound of one side

    @property
    def ok(self) -> bool:
        return not self.mismatched

    def worst(self) -> tuple[str, float, float] | None:
        """The row with the largest absolute difference (then relative), None when nothing was compared."""
        return max(self.rows, key=lambda r: (r[1], r[2]), default=None)


def _diffs(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    a64, b64 = a.double(), b.double()
    absd = (a64 - b64).abs()
    max_abs = absd.max().item() if absd.numel() else 0.0
    scale = b64.abs().max().item() if b64.numel() else 0.0
    return max_abs, (max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf")))


def verify(a: str, b: str, *, atol: float = 0.0, rtol: float = 0.0, logits: bool = False, logits_atol: float = 1e-4,
           vocab_size: int | None = None, hf_config: str | None = None, progress: bool = False) -> VerifyReport:
    """Compare every HF tensor of ``a`` and ``b``; ``--logits`` also compares transformers' logits.
    ``progress``: a bar over the units on stderr (shown on a terminal only)."""
    ra = open_reader(a, vocab_size=vocab_size, hf_config=hf_config, fp8=True)
    rb = open_reader(b, vocab_size=vocab_size, hf_config=hf_config, fp8=True)
    quantized = [path for path, r in ((a, ra), (b, rb)) if hasattr(r, "scales")]
    if logits and quantized:
        raise ValueError(f"--logits: {quantized[0]} is an FP8 checkpoint, whose logits pmz does not compute (CPU "
                         f"transformers only dequantizes FP8, misreading partial edge blocks: docs/formats.md); "
                         f"without --logits its tensors are checked block by block")
    if ra.cfg != rb.cfg:
        fields = [f for f in ra.cfg.__dataclass_fields__ if getattr(ra.cfg, f) != getattr(rb.cfg, f)]
        raise CheckpointError(f"{a} and {b} hold different models: " +
                              ", ".join(f"{f}={getattr(ra.cfg, f)} vs {getattr(rb.cfg, f)}" for f in fields))
    ra.validate()
    rb.validate()
    report = VerifyReport()
    units = ra.units()
    bar = None
    if progress:
        import sys

        from tqdm import tqdm

        bar = tqdm(total=len(units), desc="comparing", unit="unit", file=sys.stderr, leave=False, disable=None)
    for unit in units:
        if bar is not None:
            bar.update(1)
        ta, tb = ra.read_unit(unit), rb.read_unit(unit)
        scales_a, scales_b = getattr(ra, "scales", {}), getattr(rb, "scales", {})
        for name in ta:
            if ta[name].shape != tb[name].shape:
                report.rows.append((name, float("inf"), float("inf")))
                report.mismatched.append(f"{name}: shape {tuple(ta[name].shape)} vs {tuple(tb[name].shape)}")
                continue
            max_abs, max_rel = _diffs(ta[name], tb[name])
            report.rows.append((name, max_abs, max_rel))
            if (name in scales_a) != (name in scales_b):  # FP8 against unquantized: e4m3 rounding, element-wise
                from converters.torch_path.hf_fp8_reader import rounding_bound

                scale, weight = (scales_a[name], tb[name]) if name in scales_a else (scales_b[name], ta[name])
                report.fp8.append(name)
                over = int(((ta[name].double() - tb[name].double()).abs() > rounding_bound(weight, scale)).sum())
                if over:
                    report.mismatched.append(f"{name}: {over} element(s) not the nearest e4m3 value under their "
                                             f"block's scale_inv (max abs {max_abs:.3g})")
            elif not (max_abs <= atol or max_rel <= rtol):
                report.mismatched.append(f"{name}: max abs {max_abs:.3g}, max rel {max_rel:.3g}")
    if bar is not None:
        bar.close()
    if logits:
        report.logits_diff = _logits_diff(a, b, ra.cfg, vocab_size, hf_config)
        if not report.logits_diff <= logits_atol:  # NaN logits fail too
            report.mismatched.append(f"logits: max abs diff {report.logits_diff:.3g} > {logits_atol}")
    return report


def _prompt(cfg) -> dict:
    """The fixed inputs both sides run: random token ids; for a vision-language model (``cfg.vision``)
    one random image too, in the processor's layout (vision start, one placeholder per merged patch,
    vision end), so the vision tower's weights reach the logits."""
    gen = torch.Generator().manual_seed(0)
    vis = cfg.vision
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
    if vis is None:
        return {"input_ids": ids}
    special = [vis.image_token_id, vis.video_token_id]
    ids = ids.masked_fill(torch.isin(ids, torch.tensor(special)), 0)  # placeholders only where the image is
    m = vis.spatial_merge_size
    grid = torch.tensor([[1, 2 * m, 2 * m]])
    placeholders = torch.full((2, 4), vis.image_token_id)
    ids = torch.cat([ids[:, :4], placeholders, ids[:, 4:]], dim=1)
    ids[1] = ids[0]  # both rows carry the image (one image per row: two images in all)
    patch = vis.in_channels * vis.temporal_patch_size * vis.patch_size ** 2
    pixels = torch.randn(2 * int(grid.prod()), patch, generator=gen)
    return {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": grid.repeat(2, 1),
            "mm_token_type_ids": (ids == vis.image_token_id).long()}  # 1 = image token, as the processor marks it


def _logits_diff(a: str, b: str, cfg, vocab_size: int | None, hf_config: str | None) -> float:
    if cfg.vision is None:
        from transformers import AutoModelForCausalLM as model_class
    else:
        from transformers import AutoModelForImageTextToText as model_class

    inputs = _prompt(cfg)
    with tempfile.TemporaryDirectory(prefix="pmz-verify-") as tmp:
        outs = []
        for i, path in enumerate((a, b)):
            hf_dir = path
            if detect_format(path) != "hf":
                hf_dir = str(Path(tmp) / f"side{i}")
                convert(path, hf_dir, to="hf", dtype="fp32", vocab_size=vocab_size, hf_config=hf_config, workers=1)
            model = model_class.from_pretrained(hf_dir, dtype=torch.float32).eval()
            with torch.no_grad():
                outs.append(model(**inputs).logits)
            del model
    return (outs[0] - outs[1]).abs().max().item()
