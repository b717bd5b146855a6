"""The conversion engine: detect the source, validate it, write into a temp dir, rename at the end.

Guarantees:
  * options (sizes, counts) are checked before anything is read, and nothing is written before the
    source validated -- by its format's one validating reader (``converters/formats``), the same
    for both paths: files, headers and metadata, config sizes against the tensors present, every
    rank file present, shapes consistent, no tensor missing or unused -- and the target layout
    checked against the model;
  * a conversion without a dtype change to HF, Megatron (legacy, torch_dist) or vLLM takes the copy path
    (``converters/copy_path``: byte ranges moved by system calls, no torch, memory bounded by the copy
    buffers), MoE models and the Gated DeltaNet hybrids in every direction included (grouped-GEMM experts
    transposed in bounded blocks: ``copy_path.grouped_moe`` / ``megatron_moe``; vLLM ``sharded_state``
    written and read as byte ranges: ``copy_path.vllm`` / ``vllm_source``); the rest the torch path
    (``converters/torch_path``): Megatron-Bridge targets, dtype changes, mixed-dtype sources, what a
    planner answers ``Unsupported`` for, and ``--quantize`` (the copy path moves bytes, it cannot quantize).
    ``PMZ_COPY_PATH=0`` forces the torch path (tests compare the two);
  * a quantized source (``quantization_config``, FP8 tensors) is refused, never dequantized or
    passed through (``converters/formats/quantized``); ``--quantize fp8`` writes HF and vLLM
    targets by ``models/common/export/fp8.py``'s rule, the one ``save_pretrained`` follows;
  * output goes to a locked temp dir beside the destination and is renamed into place when complete
    (``converters/runtime/staging``): on any error, Ctrl-C or SIGTERM nothing is left at the
    destination, an existing one (``--overwrite``) is kept, and the exception propagates (CLI: one
    line, exit 1 / 130 / 143); a failed write names the file as it would be in the destination;
  * work is split into tasks (byte ranges of HF files, Megatron rank files, torch_dist data files)
    run by worker threads (copy path) or processes (torch path, each rebuilding its own reader);
    the bytes depend only on the plan, never on timing or the number of workers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from converters.formats import detect_format  # noqa: F401 (part of this module's API)
from converters.formats.locate import locate_source
from converters.formats.quantized import check_unquantized_config
from converters.runtime.staging import Staging, check_destination, remove_stale_temp_dirs  # noqa: F401
from converters.torch_path import open_reader  # noqa: F401 (part of this module's API)
from models.common.errors import CheckpointError
from models.common.sizes import parse_size  # noqa: F401 (part of this module's API)

if TYPE_CHECKING:
    import torch

TARGETS = ("hf", "megatron", "megatron-dist", "megatron-bridge", "vllm")
MEGATRON_TARGETS = ("megatron", "megatron-dist", "megatron-bridge")
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


def check_options(*, tp: Any = None, pp: Any = None, vpp: Any = None, ep: Any = None, workers: Any = None,
                  vocab_size: Any = None, make_vocab_size_divisible_by: Any = 128, max_shard_size: Any = "5GB",
                  first_stage_layers: Any = None, last_stage_layers: Any = None) -> int:
    """ValueError naming the option unless every count is a positive integer (None: not given) and
    ``max_shard_size`` a positive size; returns the shard size in bytes. Reads and writes nothing."""
    counts = {"--tp": tp, "--pp": pp, "--vpp": vpp, "--ep": ep, "--workers": workers, "--vocab-size": vocab_size,
              "--make-vocab-size-divisible-by": make_vocab_size_divisible_by,
              "--decoder-first-pipeline-num-layers": first_stage_layers,
              "--decoder-last-pipeline-num-layers": last_stage_layers}
    for option, value in counts.items():
        if value is None and option != "--make-vocab-size-divisible-by":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{option} must be a positive integer, got {value!r}")
    try:
        shard_bytes = parse_size(max_shard_size)
    except (ValueError, OverflowError, TypeError, AttributeError) as exc:
        raise ValueError(f"--max-shard-size: cannot read size {max_shard_size!r} (use e.g. 5GB, 500MB)") from exc
    if shard_bytes <= 0:
        raise ValueError(f"--max-shard-size must be a positive size, got {max_shard_size!r}")
    return shard_bytes


def check_quantization_target(to: str, quantization: Any) -> None:
    """ValueError when ``--quantize`` is asked for a Megatron target (the CLI reports it as a bad
    argument, exit 2, before anything is read). The name itself is checked by ``fp8.check_quantization``
    (the CLI's ``--quantize`` choices)."""
    if quantization is not None and to in MEGATRON_TARGETS:
        raise ValueError(f"--quantize {quantization}: --to {to} holds training weights, which are not quantized "
                         f"(FP8 is written for inference: --to hf or --to vllm)")


def check_hf_target_layout(to: str, **layout: Any) -> None:
    """ValueError when a parallel layout is given for an HF target (the CLI reports it as a bad
    argument, exit 2, before anything is read)."""
    given = [f"--{k} {v}" for k, v in layout.items() if v is not None]
    if to == "hf" and given:
        raise ValueError(f"{' '.join(given)}: an HF checkpoint has no parallel layout (--tp/--pp/--vpp/--ep apply "
                         f"to Megatron and vLLM targets)")


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, to: str, tp: int | None = None, pp: int | None = None,
            vpp: int | None = None, ep: int | None = None, first_stage_layers: int | None = None,
            last_stage_layers: int | None = None, moe_grouped_gemm: bool | None = None,
            hf_config: str | None = None, arch: str | None = None,
            vocab_size: int | None = None, dtype: str | torch.dtype | None = None, overwrite: bool = False,
            workers: int | None = None, max_shard_size: str | int = "5GB", make_vocab_size_divisible_by: int = 128,
            progress: bool = False, quantization: str | None = None, written: dict | None = None) -> Path:
    """Convert ``src`` (format detected) to ``to`` in ``dst``; returns the destination path.
    ``written``: a dict filled with the layout written (``tp``, ``pp``, ``vpp``, ``ep``, ``first``,
    ``last`` where the format has them: ``converters.layout.stages.checkpoint_layout`` takes them).

    to: "hf", "megatron" (legacy torch, at tp/pp/vpp), "megatron-dist" (torch_dist; tp/pp/vpp
    are recorded in its args), "megatron-bridge" (Megatron-Bridge's save layout: torch_dist with
    run_config.yaml, for the text models Bridge has bridges for and the vision-language ones; tp/pp/vpp
    recorded there) or "vllm" (vLLM
    ``sharded_state`` for an engine with TP ``tp`` and PP ``pp``). tp/pp/vpp left at None: a
    Megatron target keeps a Megatron source's layout (tp alone; pp with vpp and uneven first/last
    stages), else 1; an HF target takes none of them.
    ep: expert parallelism of a Megatron target (MoE models; default: a Megatron source's, else 1).
    moe_grouped_gemm: legacy experts as megatron-core's grouped-GEMM ``GroupedMLP`` (``weight1``/``weight2``)
    instead of ``SequentialMLP`` (recorded as the ``moe_grouped_gemm`` arg; default: a Megatron source's
    GroupedMLP layout, else False; see ``converters/layout/experts``).
    quantization: "fp8" writes an HF or vLLM target's linear weights as block-wise FP8 with
    ``<name>_scale_inv`` and ``quantization_config`` in config.json (``models/common/export/fp8.py``;
    ``dtype`` is then the kept tensors'); refused for Megatron targets, and for a vLLM ``tp`` whose
    shard boundaries cut a 128x128 block (the numbers named), before anything is written.
    first_stage_layers / last_stage_layers: an uneven pipeline split of a Megatron target (Megatron's
    ``decoder_first/last_pipeline_num_layers``; with ``pp``, vpp 1); without them a source's uneven
    split is kept when ``pp`` is not given.
    MoE models, grouped-GEMM experts and the Gated DeltaNet hybrids (MTP block and vision tower included)
    take the copy path to HF, Megatron and vLLM targets.
    Missing parent directories of ``dst`` are created. Raises CheckpointError/ValueError with
    nothing left at ``dst`` (nor any directory created for it).
    """
    if to not in TARGETS:
        raise ValueError(f"unknown target format {to!r} (choose {', '.join(TARGETS)})")
    shard_bytes = check_options(tp=tp, pp=pp, vpp=vpp, ep=ep, workers=workers, vocab_size=vocab_size,
                                make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                                max_shard_size=max_shard_size, first_stage_layers=first_stage_layers,
                                last_stage_layers=last_stage_layers)
    uneven = first_stage_layers is not None or last_stage_layers is not None
    if uneven and (to not in MEGATRON_TARGETS or pp is None):
        raise ValueError("--decoder-first/last-pipeline-num-layers split a Megatron target's stages unevenly: give "
                         "them with --to megatron, megatron-dist or megatron-bridge and --pp")
    if to == "megatron-bridge" and ep not in (None, 1):
        raise ValueError(f"--ep {ep}: --to megatron-bridge writes global torch_dist tensors; expert parallelism "
                         f"is chosen when Megatron-Bridge loads them (give no --ep)")
    if moe_grouped_gemm and to not in ("megatron", "megatron-dist"):
        raise ValueError(f"--moe-grouped-gemm: a layout of Megatron experts; --to {to} has none")
    if to == "vllm" and ep not in (None, 1):
        raise ValueError(f"--ep {ep}: vLLM targets take no expert-parallel layout")
    check_hf_target_layout(to, tp=tp, pp=pp, vpp=vpp, ep=ep)
    if to == "vllm" and vpp not in (None, 1):
        raise ValueError(f"vLLM has no virtual pipeline stages (got --vpp {vpp})")
    if quantization is not None:  # loads torch: a quantized conversion takes the torch path anyway
        from models.common.export import fp8

        fp8.check_quantization(quantization)
    check_quantization_target(to, quantization)
    wanted_dtype = dtype_name(dtype)
    dst_path = Path(dst).resolve()
    src_path = Path(src).resolve()
    if src_path == dst_path or dst_path in src_path.parents:
        raise CheckpointError(f"{dst_path}: destination is the source or contains it ({src_path})")
    check_destination(dst_path, overwrite)
    workers = workers or min(4, os.cpu_count() or 1)
    # verl actor folders, Megatron-Bridge iterations...: the folder holding the tensors, and the HF
    # config found beside it (tokenizer files come from there too) unless --hf-config is given
    location = locate_source(src, hf_config)
    check_unquantized_config(location, hf_config)  # before the copy path, whose readers would not say why
    src, hf_config = location.path, hf_config or location.hf_config_dir
    # Megatron-Bridge's layout (run_config.yaml, its names) is written by the torch path
    by_copy = quantization is None and to != "megatron-bridge"  # and FP8: the copy path moves bytes
    if by_copy and _without_cyclic_gc(
            _convert_by_copy, src, dst_path, to=to, overwrite=overwrite, hf_config=hf_config, arch=arch,
            vocab_size=vocab_size, dtype=wanted_dtype, shard_bytes=shard_bytes, workers=workers, progress=progress,
            tp=tp, pp=pp, vpp=vpp, ep=ep, grouped_gemm=moe_grouped_gemm, divisible_by=make_vocab_size_divisible_by,
            first=first_stage_layers, last=last_stage_layers, written=written):
        return dst_path
    out_dtype = parse_dtype(wanted_dtype)
    reader = open_reader(src, arch=arch, hf_config=hf_config, vocab_size=vocab_size)
    reader.validate()
    if out_dtype is None and getattr(reader.info, "mixed", None):  # never narrow a value silently
        raise CheckpointError(f"{src}: tensors in several dtypes, {reader.info.mixed} (or --dtype bf16/fp16 to "
                              f"round them on purpose); pmz does not narrow values without being asked")
    out_dtype = out_dtype or reader.info.dtype
    # config.json plus tokenizer files: from --hf-config, else from an HF source's own directory
    files_from = hf_config or (str(src_path) if reader.info.format == "hf" else None)
    if to == "vllm":
        from converters.torch_path.hf import write_hf_config
        from converters.torch_path.vllm import write_vllm
        from models.common.vllm_format import check_layout

        tp, pp = tp or 1, pp or 1
        check_layout(reader.cfg, tp, pp)
        _record(written, tp=tp, pp=pp)
        if quantization:
            from converters.torch_path.hf_fp8 import check_fp8_target, write_quantization_config

            check_fp8_target(reader, tp)
        with Staging(dst_path, overwrite) as tmp:
            write_vllm(reader, str(tmp), tp=tp, pp=pp, dtype=out_dtype, max_shard_bytes=shard_bytes,
                       workers=workers, progress=progress, quantization=quantization)
            write_hf_config(reader, str(tmp), out_dtype, files_from)
            if quantization:
                write_quantization_config(str(tmp), reader)
        return dst_path
    if to == "hf":
        from converters.torch_path.hf import write_hf

        if quantization:
            from converters.torch_path.hf_fp8 import check_fp8_target, write_hf_fp8

            check_fp8_target(reader)
            with Staging(dst_path, overwrite) as tmp:
                write_hf_fp8(reader, str(tmp), out_dtype, max_shard_bytes=shard_bytes, workers=workers,
                             progress=progress, files_from=files_from)
            return dst_path
        with Staging(dst_path, overwrite) as tmp:
            write_hf(reader, str(tmp), out_dtype, max_shard_bytes=shard_bytes, workers=workers, progress=progress,
                     files_from=files_from)
        return dst_path
    from converters.torch_path.megatron import plan_megatron_target, write_megatron

    layout = source_layout(reader)
    first, last = first_stage_layers, last_stage_layers
    if pp is None:  # the source's stages: pp with its virtual chunks and uneven first/last stage sizes
        pp, vpp, first, last = layout["pp"], vpp or layout["vpp"], layout["first"], layout["last"]
    if to == "megatron-bridge":
        from converters.layout.model import require_megatron_layout
        from converters.torch_path.megatron_bridge import plan_bridge_target, write_bridge

        require_megatron_layout(reader.cfg, str(src), bridge=True)  # a model without a Megatron layout: one line

        target = plan_bridge_target(reader, tp=tp or layout["tp"], pp=pp, vpp=vpp or 1, dtype=out_dtype,
                                    first=first, last=last)
        _record(written, tp=target.tp, pp=target.pp, vpp=target.vpp, ep=1, first=first, last=last)
        with Staging(dst_path, overwrite) as tmp:
            write_bridge(reader, target, str(tmp), workers=workers, progress=progress)
        return dst_path
    target = plan_megatron_target(reader, tp=tp or layout["tp"], pp=pp, vpp=vpp or 1, dtype=out_dtype,
                                  divisible_by=make_vocab_size_divisible_by, first=first, last=last,
                                  fmt="torch" if to == "megatron" else "torch_dist", ep=ep or layout["ep"],
                                  grouped_gemm=layout["grouped_gemm"] if moe_grouped_gemm is None else moe_grouped_gemm)
    _record(written, tp=target.tp, pp=target.pp, vpp=target.vpp, ep=target.ep, first=first, last=last)
    with Staging(dst_path, overwrite) as tmp:
        write_megatron(reader, target, str(tmp), fmt=to, workers=workers, progress=progress,
                       hf_config_dir=hf_config)
    return dst_path


def _record(written: dict | None, **layout: Any) -> None:
    if written is not None:
        written.update(layout)


def source_layout(reader: Any) -> dict[str, Any]:
    """tp/pp/vpp (and uneven first/last stage sizes) a checkpoint was saved with: legacy readers say
    ``tp``/``pp``/``vpp`` in ``info.layout``, torch_dist ones ``saved_with_tp``/...; HF is 1/1/1."""
    layout = reader.info.layout if reader.info.format in ("megatron", "megatron-dist") else {}

    def count(key: str) -> int:
        value = layout.get(key, layout.get(f"saved_with_{key}"))
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1

    out: dict[str, Any] = {"tp": count("tp"), "pp": count("pp"), "vpp": count("vpp"), "ep": count("ep"),
                           "first": None, "last": None, "grouped_gemm": False}
    args = getattr(reader, "args", None)
    if reader.info.format in ("megatron", "megatron-dist") and args is not None:
        from converters.formats.megatron_args import args_layout
        from converters.layout.experts import source_grouped_gemm

        uneven = args_layout(args)
        out["first"], out["last"] = uneven["first"], uneven["last"]
        out["grouped_gemm"] = reader.cfg.moe is not None and source_grouped_gemm(
            args, getattr(getattr(reader, "ckpt", None), "expert_layout", None))
    return out


def _without_cyclic_gc(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with Python's cyclic garbage collector paused (its state restored after).
    The copy path makes no reference cycles worth collecting (plans are trees of small objects freed by
    reference counting; memory stays bounded by the per-thread buffers), but it allocates enough of them
    (ops, row buffers, planned tensors) to set off 60-130 young-generation collections per 1 GB MoE
    conversion, 45-90 ms by ``gc.callbacks`` (load 8-13), each holding the GIL while both worker threads
    wait for it. The torch path is not run under this (it holds models; its cycles must be collected)."""
    import gc

    paused = gc.isenabled()
    gc.disable()
    try:
        return fn(*args, **kwargs)
    finally:
        if paused:
            gc.enable()


def _convert_by_copy(src, dst_path: Path, *, to: str, overwrite: bool, hf_config, arch, vocab_size,
                     dtype: str | None, shard_bytes: int, workers: int, progress: bool, tp: int | None = None,
                     pp: int | None = None, vpp: int | None = None, ep: int | None = None,
                     grouped_gemm: bool | None = None, divisible_by: int = 128,
                     first: int | None = None, last: int | None = None, written: dict | None = None) -> bool:
    """The copy path (no torch, byte ranges moved by system calls: ``converters/copy_path/hf.py`` for
    HF targets, ``converters/copy_path/megatron.py`` for Megatron ones) when the source allows it and
    no dtype change is asked for; False when the torch path must do the conversion."""
    from converters.copy_path.hf import write_hf_by_copy
    from converters.copy_path.sources import Unsupported, open_raw_source
    from converters.formats.tensors import TAG_TO_TORCH_NAME

    if os.environ.get("PMZ_COPY_PATH", "1") == "0":
        return False
    try:
        source = open_raw_source(str(src), arch=arch, hf_config=hf_config, vocab_size=vocab_size)
        tag = source.dtype()
    except Unsupported:
        return False
    if dtype is not None and dtype != TAG_TO_TORCH_NAME[tag]:
        return False
    if to == "hf":
        source.say_notes()
        with Staging(dst_path, overwrite) as tmp:
            write_hf_by_copy(source, str(tmp), max_shard_bytes=shard_bytes, workers=workers, progress=progress)
        return True
    if to == "vllm":
        from converters.copy_path.vllm import plan_vllm_target, write_vllm_by_copy

        try:
            vtarget = plan_vllm_target(source, tp=tp or 1, pp=pp or 1)
        except Unsupported:
            return False
        _record(written, tp=vtarget.tp, pp=vtarget.pp)
        source.say_notes()
        with Staging(dst_path, overwrite) as tmp:
            write_vllm_by_copy(source, vtarget, str(tmp), max_shard_bytes=shard_bytes, workers=workers,
                               progress=progress, files_from=hf_config or (str(src) if source.format == "hf" else None))
        return True
    from converters.copy_path.megatron import plan_copy_target, write_megatron_by_copy

    # the source's layout when none is asked for, as the torch path (source_layout) does
    layout = source.layout or {}
    if pp is None:
        pp, vpp = layout.get("pp", 1), vpp or layout.get("vpp", 1)
        first, last = layout.get("first"), layout.get("last")
    try:
        target = plan_copy_target(source, fmt=to, tp=tp or layout.get("tp", 1), pp=pp, vpp=vpp or 1,
                                  divisible_by=divisible_by, first=first, last=last, ep=ep or layout.get("ep", 1),
                                  grouped_gemm=layout.get("grouped_gemm", False) if grouped_gemm is None
                                  else grouped_gemm)
    except Unsupported:  # a layout the copy path does not write: the torch path does
        return False
    _record(written, tp=target.tp, pp=target.pp, vpp=target.vpp, ep=getattr(target, "ep", 1), first=first,
            last=last)
    source.say_notes()
    with Staging(dst_path, overwrite) as tmp:
        write_megatron_by_copy(source, target, str(tmp), workers=workers, progress=progress,
                               hf_config_dir=hf_config)
    return True
