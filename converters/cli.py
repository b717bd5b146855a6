"""The ``pmz`` command. Errors users can cause end in one line on stderr and exit status 1."""

from __future__ import annotations

import argparse
import sys

from models.common.config import UnsupportedConfigError
from models.common.errors import CheckpointError
from parallel.config import ParallelConfigError


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

    dst = convert(args.src, args.dst, to=args.to, tp=args.tp, pp=args.pp, vpp=args.vpp, hf_config=args.hf_config,
                  arch=args.arch, vocab_size=args.vocab_size, dtype=args.dtype, overwrite=args.overwrite,
                  workers=args.workers, max_shard_size=args.max_shard_size,
                  make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, progress=not args.quiet)
    if not args.quiet:
        print(f"wrote {args.to} checkpoint to {dst}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from converters.verify import verify

    report = verify(args.a, args.b, atol=args.atol, rtol=args.rtol, logits=args.logits, logits_atol=args.logits_atol,
                    vocab_size=args.vocab_size, hf_config=args.hf_config)
    width = max((len(r[0]) for r in report.rows), default=10)
    print(f"{'tensor':<{width}}  {'max abs diff':>12}  {'max rel diff':>12}")
    for name, max_abs, max_rel in report.rows:
        print(f"{name:<{width}}  {max_abs:>12.3g}  {max_rel:>12.3g}")
    if report.logits_diff is not None:
        print(f"logits (transformers, fixed prompt): max abs diff {report.logits_diff:.3g}")
    if report.ok:
        print(f"OK: {len(report.rows)} tensors match")
        return 0
    print(f"MISMATCH: {len(report.mismatched)} difference(s): " + "; ".join(report.mismatched[:5]), file=sys.stderr)
    return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pmz", description="Parallel model zoo checkpoint tools (CPU only).")
    sub = parser.add_subparsers(dest="command", required=True)

    def source_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--hf-config", metavar="DIR", help="HF directory whose config (and tokenizer files) describe the model")
        p.add_argument("--vocab-size", type=int, help="real vocabulary size when a Megatron checkpoint records only the padded one")

    p = sub.add_parser("convert", help="convert between hf, megatron (legacy torch) and megatron-dist (torch_dist); "
                                       "write vllm (sharded_state)")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--to", required=True, choices=["hf", "megatron", "megatron-dist", "vllm"])
    p.add_argument("--tp", type=int, default=1, help="target tensor-parallel size (Megatron and vLLM targets)")
    p.add_argument("--pp", type=int, default=1, help="target pipeline-parallel size (Megatron and vLLM targets)")
    p.add_argument("--vpp", type=int, default=1, help="target virtual pipeline chunks per stage (Megatron targets)")
    p.add_argument("--arch", choices=["llama", "qwen2"], help="architecture of a Megatron source (default: from its args)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="output dtype (default: the source's)")
    p.add_argument("--max-shard-size", default="5GB", help="largest HF safetensors file / vLLM part (default 5GB)")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="Megatron vocab padding unit (multiplied by tp), default 128")
    p.add_argument("--workers", type=int, help="worker processes (default min(4, cores))")
    p.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    source_options(p)
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("inspect", help="format, architecture, parallel layout, parameter count, dtypes, size")
    p.add_argument("path")
    source_options(p)
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("verify", help="tensor-by-tensor comparison of two checkpoints (any formats)")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--atol", type=float, default=0.0, help="max abs difference allowed per tensor (default 0: exact)")
    p.add_argument("--rtol", type=float, default=0.0, help="max relative difference allowed per tensor")
    p.add_argument("--logits", action="store_true", help="also compare transformers' logits on a fixed prompt")
    p.add_argument("--logits-atol", type=float, default=1e-4)
    source_options(p)
    p.set_defaults(func=_cmd_verify)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CheckpointError, ParallelConfigError, UnsupportedConfigError, ValueError, FileNotFoundError) as exc:
        message = " ".join(str(exc).split())  # one line, even when a library's message spans several
        print(f"pmz {args.command}: error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
