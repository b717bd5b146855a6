"""The ``pmz`` command.

Every failure ends in one line on stderr: errors users can cause (a bad checkpoint, an impossible
layout, an unwritable destination: CheckpointError, ParallelConfigError, UnsupportedConfigError,
other ValueErrors, OSError) exit 1; a bad argument exits 2 (argparse's convention, before anything
is read); Ctrl-C exits 130 and SIGTERM 143, after the conversion removed its temp dir. A closed
stdout (``pmz inspect X | head -1``) ends the command quietly.

Module-level imports stay torch-free: ``pmz --version``, ``--help`` and argument errors never load
torch (the converters import it only where a conversion needs it).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' own bars (read at its import) off

from models.common.config import UnsupportedConfigError  # these three modules are plain Python (no torch)
from models.common.errors import CheckpointError
from parallel.config import ParallelConfigError

TARGETS = ["hf", "megatron", "megatron-dist", "megatron-bridge", "vllm"]
# models/common/export/fp8.QUANTIZATIONS, spelled out here so that a bad --quantize never loads torch
# (tests/test_convert_fp8.py checks the two agree)
QUANTIZATIONS = ["fp8"]


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread so that conversions clean up as they do for Ctrl-C."""


def _on_sigterm(signum, frame) -> None:
    raise _Terminated()


def _cmd_inspect(args: argparse.Namespace) -> int:
    from converters.inspect import inspect_checkpoint

    info = inspect_checkpoint(args.path, vocab_size=args.vocab_size, hf_config=args.hf_config)
    width = max(len(k) for k in info)
    for key, value in info.items():
        if key == "parameters":
            value = f"{value:,}"
        elif key == "bytes":
            value = f"{value:,} ({value / 2**20:.1f} MiB)"
        print(f"{key:<{width}}  {value}")
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from converters.engine import convert
    from converters.layout.stages import checkpoint_layout

    written: dict = {}
    dst = convert(args.src, args.dst, to=args.to, tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep,
                  moe_grouped_gemm=args.moe_grouped_gemm,
                  first_stage_layers=args.decoder_first_pipeline_num_layers,
                  last_stage_layers=args.decoder_last_pipeline_num_layers,
                  hf_config=args.hf_config,
                  arch=args.arch, vocab_size=args.vocab_size, dtype=args.dtype, overwrite=args.overwrite,
                  workers=args.workers, max_shard_size=args.max_shard_size,
                  make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, progress=not args.quiet,
                  quantization=args.quantize, written=written)
    layout = checkpoint_layout(args.to, **written)
    if args.to == "hf":
        files = len(list(dst.glob("*.safetensors")))
        layout += f", {files} file{'s' if files != 1 else ''}"
    print(f"wrote {args.to} checkpoint ({f'{args.quantize}, ' if args.quantize else ''}{layout}) to {dst}")
    note = _derived_config_note(args)
    if note:
        print(f"pmz convert: note: {note}", file=sys.stderr)
    return 0


def _derived_config_note(args: argparse.Namespace) -> str | None:
    """When an HF target's config.json had to be rebuilt from Megatron args (no ``--hf-config``, no
    ``hf_config/`` sidecar, no HF config beside a verl/Bridge checkpoint): say what that loses."""
    if args.to not in ("hf", "vllm") or args.hf_config:
        return None
    from converters.formats.locate import locate_source

    location = locate_source(args.src)
    if location.format not in ("megatron", "megatron-dist") or location.hf_config_dir:
        return None
    from converters.formats.megatron_args import sidecar_config_dir

    if sidecar_config_dir(location.path):
        return None
    return ("config.json was rebuilt from the Megatron args with transformers' defaults for the rest; token ids, "
            "RoPE details, generation config and tokenizer files are not in a Megatron checkpoint: pass "
            "--hf-config DIR (the original HF model directory) to get them exactly")


def _cmd_verify(args: argparse.Namespace) -> int:
    from converters.verify import verify

    report = verify(args.a, args.b, atol=args.atol, rtol=args.rtol, logits=args.logits, logits_atol=args.logits_atol,
                    vocab_size=args.vocab_size, hf_config=args.hf_config, progress=not args.quiet)
    if args.verbose:
        width = max((len(r[0]) for r in report.rows), default=10)
        print(f"{'tensor':<{width}}  {'max abs diff':>12}  {'max rel diff':>12}")
        for name, max_abs, max_rel in report.rows:
            print(f"{name:<{width}}  {max_abs:>12.3g}  {max_rel:>12.3g}")
    worst = report.worst()
    if worst is not None and worst[1] == 0:
        print(f"compared {len(report.rows)} tensors: all bitwise equal")
    elif worst is not None:
        print(f"compared {len(report.rows)} tensors; largest difference: {worst[0]} (max abs {worst[1]:.3g}, "
              f"max rel {worst[2]:.3g})")
    if report.fp8:
        print(f"{len(report.fp8)} FP8 tensors compared dequantized: each element must be the nearest e4m3 value "
              f"under its 128x128 block's scale_inv; the other tensors by --atol/--rtol")
    if report.logits_diff is not None:
        print(f"logits (transformers, fixed prompt): max abs diff {report.logits_diff:.3g}")
    if report.ok:
        print(f"OK: {len(report.rows)} tensors match")
        return 0
    print(f"MISMATCH: {len(report.mismatched)} difference(s): " + "; ".join(report.mismatched[:5]), file=sys.stderr)
    return 1


# ---------------------------------------------------------------------------------------------- arguments


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not (value >= 0 and value != float("inf")):  # also rejects nan: a bound that is not finite bounds nothing
        raise argparse.ArgumentTypeError(f"must be a finite non-negative number, got {text}")
    return value


def _size(text: str) -> str:
    from models.common.sizes import parse_size  # plain Python, no torch

    try:
        value = parse_size(text)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"cannot read size {text!r} (use e.g. 5GB, 500MB, 512MiB)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive size, got {text!r}")
    return text


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("parallel-model-zoo")
    except PackageNotFoundError:
        return "unknown"


class _VersionAction(argparse.Action):
    """``--version``: the installed distribution's version, looked up only when asked for."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"pmz {_version()}")
        parser.exit()


class _Parser(argparse.ArgumentParser):
    """Argument errors in one line (usage is one ``--help`` away), exit status 2."""

    def error(self, message: str) -> None:
        message = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pmz", description="Parallel model zoo checkpoint tools (CPU only).")
    parser.add_argument("--version", action=_VersionAction, help="print the version of pmz and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def source_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--hf-config", metavar="DIR",
                       help="HF directory whose config (and tokenizer files) describe the model")
        p.add_argument("--vocab-size", type=_positive_int, metavar="N",
                       help="real vocabulary size when a Megatron checkpoint records only the padded one")

    p = sub.add_parser("convert", help="convert between hf, megatron (legacy torch), megatron-dist (torch_dist), "
                                       "megatron-bridge (Megatron-Bridge's layout, run_config.yaml) and vllm "
                                       "(sharded_state)",
                       description="Convert a checkpoint (format detected) to another format and parallel layout. "
                                   "Output is written to a temp dir beside DST and renamed into place when complete.")
    p.add_argument("src", help="source checkpoint: an HF directory, a Megatron checkpoint (legacy or torch_dist; "
                               "verl, Megatron-Bridge) or a vLLM sharded_state directory")
    p.add_argument("dst", help="destination directory (must not exist unless --overwrite; missing parent "
                               "directories are created)")
    p.add_argument("--to", required=True, choices=TARGETS,
                   help="target format (megatron-bridge: torch_dist as Megatron-Bridge saves a model, iter_N/ with "
                        "run_config.yaml: Llama, Qwen2, Qwen3, Qwen3-MoE, Qwen3.5, Qwen3.5-MoE (text and "
                        "conditional-generation checkpoints), Qwen3-Next, Qwen2-VL, Qwen2.5-VL)")
    p.add_argument("--tp", type=_positive_int, metavar="N",
                   help="target tensor-parallel size (Megatron and vLLM targets; default: a Megatron source's, else 1)")
    p.add_argument("--pp", type=_positive_int, metavar="N",
                   help="target pipeline-parallel size (Megatron and vLLM targets; default: a Megatron source's "
                        "stages, else 1)")
    p.add_argument("--vpp", type=_positive_int, metavar="N",
                   help="target virtual pipeline chunks per stage (Megatron targets; default: a Megatron source's "
                        "when --pp is not given, else 1)")
    p.add_argument("--decoder-first-pipeline-num-layers", type=_positive_int, metavar="N",
                   help="layers of the first pipeline stage of a Megatron target, for an uneven split (Megatron's "
                        "flag of the same name; with --pp, vpp 1; the other stages share the rest evenly)")
    p.add_argument("--decoder-last-pipeline-num-layers", type=_positive_int, metavar="N",
                   help="layers of the last pipeline stage of a Megatron target (as above)")
    p.add_argument("--ep", type=_positive_int, metavar="N",
                   help="target expert-parallel size (Megatron targets of a MoE model; experts are also split over "
                        "--tp, Megatron-LM's default expert TP; default: a Megatron source's, else 1)")
    p.add_argument("--moe-grouped-gemm", action=argparse.BooleanOptionalAction, default=None,
                   help="legacy Megatron target of a MoE model: experts as megatron-core's grouped-GEMM GroupedMLP "
                        "(mlp.experts.weight1/weight2; Megatron's --moe-grouped-gemm) instead of SequentialMLP "
                        "(default: a Megatron source's layout, else SequentialMLP; torch_dist stores both alike)")
    p.add_argument("--arch", choices=["llama", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"],
                   help="architecture of a Megatron source (default: from its args)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="output dtype (default: the source's; "
                                                                       "with --quantize: of the tensors kept)")
    p.add_argument("--quantize", choices=QUANTIZATIONS,
                   help="HF and vLLM targets: linear weights as block-wise FP8 (float8_e4m3fn, one fp32 "
                        "<name>_scale_inv per 128x128 block, quantization_config in config.json); embeddings, "
                        "norms, LM head, MoE router and vision merger kept (docs/formats.md, FP8 rollout weights)")
    p.add_argument("--max-shard-size", default="5GB", type=_size, metavar="SIZE",
                   help="largest HF safetensors file / vLLM part, e.g. 5GB, 500MB, 512MiB (default 5GB)")
    p.add_argument("--make-vocab-size-divisible-by", type=_positive_int, default=128, metavar="N",
                   help="Megatron vocab padding unit (multiplied by tp), default 128")
    p.add_argument("--workers", type=_positive_int, metavar="N", help="worker processes (default min(4, cores))")
    p.add_argument("--overwrite", action="store_true", help="replace an existing destination (atomically)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (the final 'wrote ...' line still prints)")
    source_options(p)
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("inspect", help="format, architecture, parallel layout, parameter count, dtypes, size",
                       description="Describe a checkpoint from its headers and metadata (tensor data is not read).")
    p.add_argument("path", help="checkpoint directory: HF, Megatron legacy or torch_dist, vLLM sharded_state")
    source_options(p)
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("verify", help="tensor-by-tensor comparison of two checkpoints (any formats)",
                       description="Compare two checkpoints tensor by tensor in HF names; exit 1 on a mismatch.")
    p.add_argument("a", help="first checkpoint (any supported format)")
    p.add_argument("b", help="second checkpoint (any supported format)")
    p.add_argument("--atol", type=_non_negative_float, default=0.0,
                   help="max abs difference allowed per tensor (default 0: exact)")
    p.add_argument("--rtol", type=_non_negative_float, default=0.0,
                   help="max relative difference allowed per tensor (default 0)")
    p.add_argument("--logits", action="store_true", help="also compare transformers' logits on a fixed prompt")
    p.add_argument("--logits-atol", type=_non_negative_float, default=1e-4,
                   help="max abs difference allowed between the logits with --logits (default 1e-4)")
    p.add_argument("--verbose", action="store_true", help="one line per tensor (default: a summary)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    source_options(p)
    p.set_defaults(func=_cmd_verify)
    return parser


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())  # one line, even when a library's message spans several


def _silence_stdout() -> None:
    """After EPIPE: point stdout at /dev/null so the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (captured in tests)
        pass


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "convert":  # a layout for an HF target, --quantize for a Megatron one: bad arguments (exit 2)
        from converters.engine import check_hf_target_layout, check_quantization_target

        try:
            check_hf_target_layout(args.to, **{k: getattr(args, k) for k in ("tp", "pp", "vpp", "ep")})
            check_quantization_target(args.to, args.quantize)
        except ValueError as exc:
            print(f"pmz convert: error: {exc} (see pmz convert --help)", file=sys.stderr)
            return 2
    previous = None
    try:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread: SIGTERM keeps its current handling
        pass
    try:
        rc = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handlers below
        return rc
    except BrokenPipeError:
        _silence_stdout()
        return 1
    except KeyboardInterrupt:
        print(f"pmz {args.command}: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print(f"pmz {args.command}: terminated (SIGTERM)", file=sys.stderr)
        return 143
    except (CheckpointError, ParallelConfigError, UnsupportedConfigError, ValueError, OSError) as exc:
        # OSError: PermissionError, a vanished file, ... (write failures arrive as CheckpointError)
        print(f"pmz {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
