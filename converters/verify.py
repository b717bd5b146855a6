"""``pmz verify``: compare two checkpoints of any supported formats, tensor by tensor in HF names.

Units are read one at a time from both sides (memory stays at two units). Optionally both are
run through transformers on a fixed prompt (``--logits``); Megatron sides are converted to a
temporary HF copy for that.

An HF directory in the block-wise FP8 format (``pmz convert --quantize fp8``'s output) is read
dequantized (``converters/torch_path/hf_fp8_reader``). Against an unquantized checkpoint each FP8
tensor passes when every element is the nearest e4m3 value of the other side's under its block's
``scale_inv`` (``rounding_bound``: the distance to the nearest e4m3 point, plus fp32 rounding), whatever
``--atol``/``--rtol`` say: what quantizing the other side gives, and nothing looser. The kept tensors
compare as usual (exact by default); two FP8 sides compare their dequantized values as usual.
``--logits`` is refused for FP8 sides in one line.

NaN and inf never pass: every comparison is written so that a NaN fails it (``not (diff <= bound)``),
a bound that is not finite fails (an FP8 block scale that is NaN, inf, 0 or negative; the FP8 reader
refuses those first, naming the file), any non-finite value in a compared tensor is a mismatch
(also two identical infinities: no checkpoint worth comparing holds one), ``--atol``/``--rtol``
must be finite, and ``VerifyReport.ok`` is False while any figure of the report is NaN or inf.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from converters.engine import convert
from converters.formats import detect_format
from converters.runtime.tasks import progress_bar
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
        """No mismatch, and no figure (differences, logits) that is NaN or inf."""
        figures = [x for row in self.rows for x in row[1:]]
        if self.logits_diff is not None:
            figures.append(self.logits_diff)
        return not self.mismatched and all(math.isfinite(x) for x in figures)

    def worst(self) -> tuple[str, float, float] | None:
        """The row with the largest absolute difference (then relative), NaN counted as the largest;
        None when nothing was compared."""
        def key(row: tuple[str, float, float]) -> tuple[float, float]:
            return tuple(math.inf if math.isnan(x) else x for x in row[1:])  # type: ignore[return-value]

        return max(self.rows, key=key, default=None)


def _diffs(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """``(max abs difference, that / the largest magnitude of either side)``; NaN when any element
    is NaN (torch's max propagates it), finite whenever both sides are."""
    a64, b64 = a.double(), b.double()
    absd = (a64 - b64).abs()
    max_abs = absd.max().item() if absd.numel() else 0.0
    scale = max(a64.abs().max().item(), b64.abs().max().item()) if b64.numel() else 0.0
    if math.isnan(scale):
        return max_abs, math.nan
    return max_abs, (max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.nan))


def _non_finite(t: torch.Tensor, max_abs: float) -> int:
    """Non-finite elements of ``t`` (none to count when the difference ``max_abs`` is finite: an inf
    or NaN on either side makes it NaN or inf)."""
    if math.isfinite(max_abs) or not t.is_floating_point():
        return 0
    return int((~torch.isfinite(t)).sum())


def fp8_elements_off(fp8_side: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> int:
    """How many elements of the dequantized ``fp8_side`` are not the nearest e4m3 value of ``weight``
    under their block's ``scale`` (``rounding_bound``): NaN differences and non-finite bounds count."""
    from converters.torch_path.hf_fp8_reader import rounding_bound

    diff = (fp8_side.double() - weight.double()).abs()
    bound = rounding_bound(weight, scale)
    within = (diff <= bound) & torch.isfinite(bound)
    return int(within.numel() - within.sum())


def verify(a: str, b: str, *, atol: float = 0.0, rtol: float = 0.0, logits: bool = False, logits_atol: float = 1e-4,
           vocab_size: int | None = None, hf_config: str | None = None, progress: bool = False) -> VerifyReport:
    """Compare every HF tensor of ``a`` and ``b``; ``--logits`` also compares transformers' logits.
    ``progress``: a bar over the units on stderr (shown on a terminal only)."""
    for flag, value in (("--atol", atol), ("--rtol", rtol), ("--logits-atol", logits_atol)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{flag} {value}: a tolerance must be a finite non-negative number")
    ra = open_reader(a, vocab_size=vocab_size, hf_config=hf_config, fp8=True)
    rb = open_reader(b, vocab_size=vocab_size, hf_config=hf_config, fp8=True)
    quantized = [path for path, r in ((a, ra), (b, rb)) if hasattr(r, "scales")]
    if logits and quantized:
        raise ValueError(f"--logits: {quantized[0]} is an FP8 checkpoint, whose logits pmz does not compute (CPU "
                         f"transformers only dequantizes FP8, misreading partial edge blocks: docs/formats.md); "
                         f"without --logits its tensors are checked block by block")
    if ra.cfg != rb.cfg:
        raise CheckpointError(f"{a} and {b} hold different models: " + "; ".join(config_differences(ra.cfg, rb.cfg)))
    ra.validate()
    rb.validate()
    report = VerifyReport()
    units = ra.units()
    bar = progress_bar(len(units), "comparing", "unit") if progress else None
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
            bad = [(path, n) for path, n in ((a, _non_finite(ta[name], max_abs)), (b, _non_finite(tb[name], max_abs)))
                   if n]
            if (name in scales_a) != (name in scales_b):
                report.fp8.append(name)
            if bad:  # NaN or inf: never "within" anything
                report.mismatched.append(f"{name}: " + ", ".join(f"{n} non-finite value(s) (NaN/inf) in {path}"
                                                                  for path, n in bad))
            elif (name in scales_a) != (name in scales_b):  # FP8 against unquantized: e4m3 rounding, element-wise
                scale, weight = (scales_a[name], tb[name]) if name in scales_a else (scales_b[name], ta[name])
                fp8_side = ta[name] if name in scales_a else tb[name]
                over = fp8_elements_off(fp8_side, weight, scale)
                if over:
                    report.mismatched.append(f"{name}: {over} element(s) not the nearest e4m3 value under their "
                                             f"block's scale_inv (max abs {max_abs:.3g})")
            elif not (max_abs <= atol or max_rel <= rtol):  # NaN fails both
                report.mismatched.append(f"{name}: max abs {max_abs:.3g}, max rel {max_rel:.3g}")
            elif not (math.isfinite(max_abs) and math.isfinite(max_rel)):
                report.mismatched.append(f"{name}: max abs {max_abs:.3g}, max rel {max_rel:.3g} (not finite)")
    if bar is not None:
        bar.close()
    if logits:
        report.logits_diff = _logits_diff(a, b, ra.cfg, vocab_size, hf_config)
        if not report.logits_diff <= logits_atol:  # NaN logits fail too
            report.mismatched.append(f"logits: max abs diff {report.logits_diff:.3g} > {logits_atol}")
    return report


def config_differences(a, b, prefix: str = "") -> list[str]:
    """The fields in which two model configs (dataclasses, nested ones field by field) differ, readably:
    ``num_hidden_layers 2 vs 4``, ``moe: 4 experts x ffn 64, top-2 vs none (dense)``."""
    out = []
    for f in a.__dataclass_fields__:
        x, y = getattr(a, f), getattr(b, f)
        if x == y:
            continue
        if hasattr(x, "__dataclass_fields__") and hasattr(y, "__dataclass_fields__") and type(x) is type(y):
            out.extend(config_differences(x, y, f"{prefix}{f}."))
        else:
            out.append(f"{prefix}{f} {_readable(f, x)} vs {_readable(f, y)}")
    return out


def _readable(field: str, value) -> str:
    """A config value in a message: nested configs by their main sizes, not their repr."""
    if value is None:
        return {"moe": "none (dense)", "vision": "none (text only)"}.get(field, "none")
    if field == "moe" and hasattr(value, "num_experts"):
        shared = value.shared_expert_intermediate_size
        return (f"{value.num_experts} experts x ffn {value.moe_intermediate_size}, top-{value.top_k}"
                f"{f', shared expert {shared}' if shared else ''}")
    if hasattr(value, "__dataclass_fields__"):
        sizes = [f"{k} {getattr(value, k)}" for k in ("depth", "hidden_size", "embed_dim", "num_heads")
                 if hasattr(value, k)]
        return f"{type(value).__name__}({', '.join(sizes)})" if sizes else type(value).__name__
    return repr(value) if isinstance(value, str) else str(value)


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

    from transformers.utils import logging as hf_logging

    inputs = _prompt(cfg)
    # transformers' notices about its own kernels (e.g. "falling back to its reference PyTorch
    # implementation" for Gated DeltaNet on CPU) say nothing about the checkpoints: not passed through
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return _max_logits_diff(a, b, model_class, inputs, vocab_size, hf_config)
    finally:
        hf_logging.set_verbosity(verbosity)


def _max_logits_diff(a: str, b: str, model_class, inputs: dict, vocab_size: int | None, hf_config: str | None) -> float:
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
