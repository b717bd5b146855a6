"""Train a model (a tiny random Qwen2, or any supported HF directory) on synthetic data with any
TP/PP/VPP/CP/Ulysses/DP layout (torchrun-ready).

    torchrun --standalone --nproc-per-node 4 tools/train.py --tp 2 --pp 2 --steps 20
    python tools/train.py --pp 2 --vpp 2 --dp 1          # spawns tp*ulysses*cp*pp*dp gloo processes itself
    python tools/train.py --cp 2 --ulysses 2 --fsdp --dp 1 --recompute full
    python tools/train.py --tp 2 --loss-log runs/tp2.log # also write the per-step loss to a file
    python tools/train.py --init-from /path/to/hf_dir --tp 2 --steps 10 --save runs/trained  # HF in, HF out

Each step: the global batch (``--batch`` samples of random lengths, a learnable synthetic task:
the next token is (token * 3 + 1) mod vocab) is split over DP ranks, ``forward_backward`` runs it
in ``--microbatches`` balanced micro-batches with ``--schedule``, AdamW steps. Rank 0 reports each
step's loss and tokens/s (and MFU on a known CUDA GPU): a progress bar on a terminal, one line per
step otherwise. At the end every replica evaluates a held-out batch (``eval loss``, the token mean
of the next-token loss, printed with 8 decimals so it can be compared with transformers on the
saved weights). ``--init-from HF_DIR`` starts from a checkpoint of any supported architecture
(its ``model_type`` picks the model); ``--save DIR`` writes what was trained as an HF checkpoint
transformers loads (collective, atomic). No other file is written unless ``--loss-log PATH`` is
given: then rank 0 writes one ``step loss`` line per step there (``runs/`` is gitignored for such
files).

Arguments, the model config and the layout are checked once, before any process group exists:
a bad value ends every rank with exit code 1 and one line from rank 0 (under torchrun too, where
``--help`` also prints once). Under torchrun the world size comes from torchrun (``--dp`` is
derived); option names are never abbreviated, so none of them can be taken for one of torchrun's
own (torchrun prefix-matches, e.g. a ``--log`` after the script name fails as ambiguous with its
``--log-dir`` / ``--logs-specs``). torchrun itself always follows a rank's non-zero exit with its
own report (a traceback of its launcher and a per-rank summary): each rank hands torchrun the
reason, so the summary's ``traceback :`` fields repeat the one line instead of a link; launched as
``python tools/train.py`` (it spawns its own ranks) the line is all there is. A checkpoint that
fails to load (``--init-from``) ends the same way, one line and exit 1; any other exception after
the process group exists is a bug: its traceback is printed and recorded for torchrun's summary.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' own bars off (read at its import)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel import ParallelConfig  # noqa: E402
from parallel.launch import run_distributed  # noqa: E402
from parallel.pipeline import (  # noqa: E402
    MULTI_STAGE,
    SCHEDULES,
    check_schedule,
    microbatch_minimum,
    microbatch_multiple,
    resolve_schedule,
)

# dense bf16 peak of the GPUs whose name contains the key (TFLOP/s, without sparsity), for MFU
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "GH200": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 70.0}


class UsageError(Exception):
    """A bad argument or a config the layout cannot run: one line, exit code 1, on every rank."""


def synthetic_batch(step: int, batch: int, max_len: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed samples of random lengths following a deterministic rule the model can learn."""
    gen = torch.Generator().manual_seed(seed * 100003 + step)
    lengths = torch.randint(max_len // 2, max_len + 1, (batch,), generator=gen)
    samples = []
    for n in lengths.tolist():
        x = torch.empty(n, dtype=torch.long)
        x[0] = torch.randint(0, vocab, (1,), generator=gen)
        for t in range(1, n):
            x[t] = (x[t - 1] * 3 + 1) % vocab
        samples.append(x)
    cu = torch.tensor([0, *lengths.tolist()]).cumsum(0)
    return torch.cat(samples), cu


def hf_config_of(args: argparse.Namespace) -> Any:
    """The transformers config to train: ``--init-from``'s, or the tiny random Qwen2 of the flags."""
    if args.init_from:
        from models.common.builder import load_hf_config

        return load_hf_config(args.init_from)
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
                       num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=1024, tie_word_embeddings=True)


def parallel_config(args: argparse.Namespace) -> ParallelConfig:
    return ParallelConfig(tp=args.tp, pp=args.pp, vpp=args.vpp, sequence_parallel=args.tp > 1, cp=args.cp,
                          ulysses=args.ulysses, cp_comm=args.cp_comm, fsdp=args.fsdp, recompute=args.recompute)


def validate(args: argparse.Namespace, world_size: int) -> tuple[Any, Any]:
    """Everything that can be checked without a process group, identically on every rank:
    (the transformers config, the model's architecture). Raises UsageError (one line)."""
    from converters.layout.model import architecture_for
    from models.common.errors import CheckpointError

    for name in ("tp", "pp", "vpp", "cp", "ulysses", "dp", "microbatches", "batch", "seq", "layers", "hidden",
                 "vocab"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}={getattr(args, name)} must be positive")
    if args.steps < 0:
        raise UsageError(f"--steps={args.steps} must be >= 0")
    if args.lr <= 0:
        raise UsageError(f"--lr={args.lr} must be positive")
    if args.seq < 4:
        raise UsageError(f"--seq={args.seq}: samples are seq/2..seq tokens long and need at least 2")
    try:
        hf_config = hf_config_of(args)
        arch = architecture_for(getattr(hf_config, "model_type", None), args.init_from or "the synthetic model")
        cfg = arch.model_config(hf_config)
        pconfig = parallel_config(args)
        pconfig.validate(cfg, world_size=world_size)
    except (CheckpointError, ValueError) as exc:  # UnsupportedConfigError, ParallelConfigError are ValueErrors
        raise UsageError(str(exc)) from None
    dp = pconfig.dp_for(world_size)
    if args.batch % dp:
        raise UsageError(f"--batch={args.batch} samples do not split evenly over dp={dp} replicas")
    per_replica = args.batch // dp
    try:
        schedule, runs = microbatches_run(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if per_replica < runs:
        raise UsageError(f"{runs} micro-batches (--microbatches {args.microbatches}, schedule {schedule!r} with "
                         f"pp={args.pp}) need at least {runs} samples per replica, --batch {args.batch} / dp {dp} "
                         f"gives {per_replica}")
    shortest = args.seq // 2
    if shortest < 2 * args.cp:
        raise UsageError(f"--seq={args.seq}: the shortest sample ({shortest} tokens) cannot give each of the 2*cp = "
                         f"{2 * args.cp} context-parallel chunks a token")
    if args.save and Path(args.save).exists():
        raise UsageError(f"--save {args.save}: already exists (choose a new directory)")
    return hf_config, arch


def microbatches_run(args: argparse.Namespace) -> tuple[str, int]:
    """The schedule ``forward_backward`` resolves and the micro-batch count it runs for
    ``--microbatches`` (at least one per stage for 1F1B, a multiple of pp for the interleaved
    schedules; each micro-batch needs a sample). ValueError for a schedule the layout cannot run."""
    schedule = resolve_schedule(args.schedule, args.vpp)
    check_schedule(schedule, args.vpp, microbatch_multiple(schedule, args.pp), args.pp)
    runs = args.microbatches
    if args.pp > 1:
        multiple = microbatch_multiple(schedule, args.pp)
        runs = -(-max(runs, microbatch_minimum(schedule, args.pp)) // multiple) * multiple
    return schedule, runs


def model_flops_per_token(cfg: Any, seq: float) -> float:
    """Training FLOPs per token: 6 x the matmul parameters (embedding lookup excluded, LM head included)
    plus causal attention's score and value products, forward and backward (3 x 2 x 2 x layers x q-width x
    seq / 2)."""
    q_width = cfg.num_attention_heads * cfg.head_dim
    kv_width = cfg.num_key_value_heads * cfg.head_dim
    per_layer = cfg.hidden_size * (q_width + 2 * kv_width) + q_width * cfg.hidden_size
    if cfg.moe is not None:
        per_layer += 3 * cfg.hidden_size * cfg.moe.moe_intermediate_size * cfg.moe.top_k
    else:
        per_layer += 3 * cfg.hidden_size * cfg.intermediate_size
    params = cfg.num_hidden_layers * per_layer + cfg.hidden_size * cfg.vocab_size
    return 6.0 * params + 6.0 * cfg.num_hidden_layers * q_width * seq


def peak_flops(device: torch.device | None) -> float | None:
    if device is None or device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None


def eval_loss(model, args: argparse.Namespace, vocab: int, device) -> float:
    """Token mean of -log p(next token) on a held-out batch (every replica the same whole batch)."""
    samples = microbatches_run(args)[1]  # one per micro-batch the schedule runs
    flat, cu = synthetic_batch(10**6, samples, args.seq, vocab, args.seed + 1)
    if device is not None:
        flat = flat.to(device)
    with torch.no_grad():
        logprobs = model.forward_backward(flat, flat, cu_seqlens=cu, num_microbatches=args.microbatches,
                                          schedule=args.schedule, forward_only=True)
    predicted = flat.numel() - (cu.numel() - 1)  # every token but each sample's first
    return -logprobs.double().sum().item() / predicted


def train(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    hf_config, arch = validate(args, dist.get_world_size())  # cheap, and the spawned ranks get the objects
    build_parallel_model = importlib.import_module(f"models.{arch.name}").build_parallel_model
    pconfig = parallel_config(args)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else None
    source = args.init_from or hf_config
    model = build_parallel_model(source, pconfig, seed=args.seed, device=device)
    vocab = model.config.vocab_size
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    groups = model.groups
    peak = peak_flops(device)
    flops_per_token = model_flops_per_token(model.config, 0.75 * args.seq)  # mean sample length
    bar = None
    tty = sys.stdout.isatty()
    if rank == 0:
        what = f"{arch.name} from {args.init_from}" if args.init_from else "a tiny random qwen2"
        print(f"training {what}, {pconfig.describe()} dp={groups.dp_size}, {args.steps} steps", flush=True)
        if tty:
            from tqdm import tqdm

            bar = tqdm(total=args.steps, desc="train", unit="step")
    log = None
    if rank == 0 and args.loss_log:
        Path(args.loss_log).parent.mkdir(parents=True, exist_ok=True)
        log = open(args.loss_log, "w")
    start = time.perf_counter()
    loss = None
    for step in range(args.steps):
        step_start = time.perf_counter()
        flat, cu = synthetic_batch(step, args.batch, args.seq, vocab, args.seed)
        # this DP rank's share of the samples
        per = args.batch // groups.dp_size
        lo, hi = groups.dp_rank * per, (groups.dp_rank + 1) * per
        ids = flat[cu[lo]:cu[hi]]
        local_cu = cu[lo:hi + 1] - cu[lo]
        if device is not None:
            ids = ids.to(device)
        opt.zero_grad()
        loss = model.forward_backward(ids, ids, cu_seqlens=local_cu, num_microbatches=args.microbatches,
                                      schedule=args.schedule)
        opt.step()
        if device is not None:
            torch.cuda.synchronize(device)
        tokens_per_s = flat.numel() / (time.perf_counter() - step_start)  # the global batch, all replicas
        if rank == 0:
            mfu = ""
            if peak:
                mfu = f" MFU {flops_per_token * tokens_per_s / (peak * dist.get_world_size()):.1%}"
            if bar is not None:
                bar.set_postfix_str(f"loss {loss.item():.4f} {tokens_per_s:,.0f} tok/s{mfu}")
                bar.update(1)
            else:
                print(f"step {step + 1}/{args.steps} loss {loss.item():.6f} {tokens_per_s:,.0f} tokens/s{mfu}",
                      flush=True)
            if log:
                log.write(f"{step} {loss.item():.6f}\n")
                log.flush()
    if log:
        log.close()
    if bar is not None:
        bar.close()
    held_out = eval_loss(model, args, vocab, device)
    if rank == 0:
        last = f"final loss {loss.item():.4f} after " if loss is not None else ""
        print(f"{last}{args.steps} steps in {time.perf_counter() - start:.1f}s; eval loss {held_out:.8f}", flush=True)
    if args.save:
        model.save_pretrained(args.save)
        if rank == 0:
            print(f"saved to {args.save} (HF layout)", flush=True)


def train_or_error(args: argparse.Namespace) -> str | None:
    """``train``; a checkpoint that cannot be loaded (the same verdict on every rank) is returned as
    its one line, for ``fail`` (exit 1) rather than a traceback per rank."""
    from models.common.errors import CheckpointError

    try:
        train(args)
    except CheckpointError as exc:
        return str(exc)
    return None


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the empty ones of switches and optional paths; the description (the
    module docstring's opening sentence and its examples) keeps its lines."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """Under torchrun only rank 0 prints (``--help`` once); a bad argument is one line and exit 1."""

    def _print_message(self, message: str, file: Any = None) -> None:
        if os.environ.get("RANK", "0") == "0":
            super()._print_message(message, file)

    def error(self, message: str) -> None:
        raise UsageError(message)


def fail(message: str) -> None:
    """One line from rank 0 (every rank reaches the same verdict), exit 1 on every rank."""
    line = f"train.py: error: {message}"
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)
    tell_torchrun(line)
    raise SystemExit(1)


def tell_torchrun(line: str) -> None:
    """Under torchrun (which names a file per rank in ``TORCHELASTIC_ERROR_FILE``): the reason for its
    failure summary, in the format its error handler writes, so the summary's ``traceback :`` field
    shows this line rather than a link to its docs. torchrun prints its own report after any
    non-zero exit whatever a rank does; this only makes the report say why."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    report = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(report, f)
    except OSError:
        pass  # the summary then shows torchrun's link: nothing the user needs is lost


def help_description() -> str:
    """``--help``'s description: the docstring's whole first sentence and its example commands."""
    paragraphs = __doc__.split("\n\n")
    return f"{paragraphs[0].strip()}\n\nexamples:\n{paragraphs[1].rstrip()}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(description=help_description(), allow_abbrev=False, formatter_class=_HelpFormatter)
    layout = p.add_argument_group("parallel layout (world size = tp * ulysses * cp * pp * dp)")
    layout.add_argument("--tp", type=int, default=1, help="tensor-parallel size (sequence parallelism on when > 1)")
    layout.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (stages)")
    layout.add_argument("--vpp", type=int, default=1,
                        help="virtual pipeline chunks per stage (> 1 needs an interleaved --schedule)")
    layout.add_argument("--cp", type=int, default=1, help="context-parallel size (ring attention)")
    layout.add_argument("--cp-comm", default="ring", choices=["ring", "allgather"],
                        help="how context-parallel ranks exchange keys/values")
    layout.add_argument("--ulysses", type=int, default=1, help="Ulysses sequence-parallel size")
    layout.add_argument("--fsdp", action="store_true", help="FSDP2 over the dp x cp x ulysses ranks")
    layout.add_argument("--recompute", default="none", choices=["none", "full"],
                        help="activation recomputation: full checkpoints every decoder layer")
    layout.add_argument("--dp", type=int, default=1,
                        help="data-parallel size when this script spawns the processes (under torchrun: "
                             "derived from the world size, this flag is ignored)")
    run = p.add_argument_group("training")
    run.add_argument("--schedule", default="1f1b", choices=SCHEDULES,
                     help=f"pipeline schedule; with --vpp > 1 one of {', '.join(MULTI_STAGE)}")
    run.add_argument("--microbatches", type=int, default=4, help="micro-batches per step")
    run.add_argument("--steps", type=int, default=30, help="optimizer steps")
    run.add_argument("--batch", type=int, default=8, help="global batch (samples), split over DP")
    run.add_argument("--seq", type=int, default=32, help="max sample length (tokens; samples are max/2..max)")
    run.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    run.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the synthetic data")
    run.add_argument("--loss-log", metavar="PATH", default=None,
                     help="write one 'step loss' line per step to this file (rank 0); without it no file is written")
    model = p.add_argument_group("model (a tiny random Qwen2: 4 heads, 2 KV heads, tied embeddings)")
    model.add_argument("--layers", type=int, default=4, help="decoder layers")
    model.add_argument("--hidden", type=int, default=64, help="hidden size (the MLP is twice as wide)")
    model.add_argument("--vocab", type=int, default=128, help="vocabulary size")
    model.add_argument("--init-from", metavar="HF_DIR", default=None,
                       help="start from this HF checkpoint (any supported architecture; its config replaces "
                            "--layers/--hidden/--vocab)")
    model.add_argument("--save", metavar="DIR", default=None,
                       help="write the trained model here as an HF checkpoint (a new directory)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    try:
        args = parse_args(argv)
        if "RANK" in os.environ:  # torchrun: every rank checks the same things before any group exists
            world = int(os.environ.get("WORLD_SIZE", "1"))
        else:
            world = args.tp * args.ulysses * args.cp * args.pp * args.dp
        validate(args, world)
    except UsageError as exc:
        fail(str(exc))
    if "RANK" in os.environ:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        try:
            error = record(train_or_error)(args)  # a bug's traceback goes to torchrun's summary too
            if error:
                fail(error)
        finally:
            dist.destroy_process_group()
        return
    errors = [e for e in run_distributed(world, train_or_error, args) if e]
    if errors:
        fail(errors[0])


if __name__ == "__main__":
    main()
