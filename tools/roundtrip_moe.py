r"""Round trips of a Qwen3-30B-A3B-shaped MoE checkpoint at full width (issue 40's size target): HF ->
vLLM ``sharded_state`` TP4, HF -> Megatron legacy TP2 x EP4 and HF -> Megatron torch_dist TP2 x EP4, each
converted back to HF by ``pmz convert`` (the whole CLI process, as users run it), every tensor of the
result compared **bitwise** with the source, and the peak RSS of every conversion recorded with
``cp -r`` of the source timed in the same run as the speed baseline.

The checkpoint: Qwen3-30B-A3B's layer shape (hidden 2048, 32/4 heads of 128 with q/k norms, 128 experts
of width 768, top-8, vocab 151936, untied, bf16, experts per expert as released), 48 layers cut to
``--layers`` (default 6: 8.7 GB). It is written by ``tools/bench_convert.py``'s set-up child (random
values, one layer per file). Peak RSS = ``ru_maxrss`` of the conversion process (``os.wait4``).

    .venv/bin/python tools/roundtrip_moe.py                      # 8.7 GB, three round trips (~10 min)
    .venv/bin/python tools/roundtrip_moe.py --layers 2 --workdir /tmp   # 3.7 GB, for a quick look

Disk: the source plus one target and its HF copy at a time (~3x the checkpoint); all deleted at the
end (``--keep`` keeps them). The last line is machine-readable:
``roundtrip <target> to=<s> (<ratio of cp>x) back=<s> (<ratio>x) rss=<MiB>/<MiB> bitwise=yes|no ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TARGETS = {  # name: pmz convert arguments of the forward conversion
    "vllm-tp4": ["--to", "vllm", "--tp", "4"],
    "legacy-tp2-ep4": ["--to", "megatron", "--tp", "2", "--ep", "4"],
    "dist-tp2-ep4": ["--to", "megatron-dist", "--tp", "2", "--ep", "4"],
}


def run(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of ``cmd`` (raises with its stderr on failure)."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    err = proc.stderr.read()
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{' '.join(cmd)} failed: {err.strip().splitlines()[-1:] or 'no output'}")
    return wall, usage.ru_maxrss / 1024


def compare(source: Path, result: Path) -> tuple[int, list[str]]:
    """Tensors compared and the names that differ (missing, extra, dtype, shape or bytes), reading both
    sides through safetensors' memory maps one tensor at a time (no copy of the model in memory)."""
    from safetensors import safe_open

    def index(path: Path) -> dict[str, Path]:
        out = {}
        for f in sorted(path.glob("*.safetensors")):
            with safe_open(f, "pt") as sf:
                out.update((k, f) for k in sf.keys())
        return out

    a, b = index(source), index(result)
    bad = sorted(set(a) ^ set(b))
    for name in sorted(set(a) & set(b)):
        with safe_open(a[name], "pt") as fa, safe_open(b[name], "pt") as fb:
            x, y = fa.get_tensor(name), fb.get_tensor(name)
            if x.dtype != y.dtype or x.shape != y.shape or not x.view(-1).view(x.dtype).equal(y.view(-1).view(y.dtype)):
                bad.append(name)
    return len(set(a) & set(b)), bad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=6, help="decoder layers of the 48 (default 6: ~8.7 GB)")
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma list of {', '.join(TARGETS)}")
    p.add_argument("--workdir", default=None, help="temp data goes in a new dir under this one (default /tmp)")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--_compare", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._compare:
        print(json.dumps(compare(*(Path(x) for x in args._compare))))
        return 0
    work = Path(tempfile.mkdtemp(prefix="roundtrip_moe_", dir=args.workdir))
    pmz = [sys.executable, "-m", "converters.cli", "convert"]
    lines = []
    try:
        src = work / "hf"
        shape = ["--model", "qwen3-moe", "--_layers", str(args.layers)]
        t = time.perf_counter()
        out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_convert.py"), *shape, "--_setup_moe",
                              str(src), "-", "-"], cwd=ROOT, check=True, capture_output=True, text=True).stdout
        size = json.loads(out.strip().splitlines()[-1])["hf_bytes"]
        print(f"source: {args.layers} layers of Qwen3-30B-A3B's shape, {size / 1e9:.2f} GB "
              f"(written in {time.perf_counter() - t:.0f} s)", flush=True)
        os.sync()
        cp_s, _ = run(["cp", "-r", str(src), str(work / "cp")])
        shutil.rmtree(work / "cp")
        print(f"cp -r: {cp_s:.1f} s ({size / 1e9 / cp_s:.2f} GB/s)", flush=True)
        for name in args.targets.split(","):
            mid, back = work / name, work / f"{name}_hf"
            os.sync()
            to_s, to_rss = run(pmz + [str(src), str(mid), *TARGETS[name], "--quiet"])
            os.sync()
            back_s, back_rss = run(pmz + [str(mid), str(back), "--to", "hf", "--quiet"])
            # in a child: pages this process touched would count in every later child's ru_maxrss (a fork
            # copies them before exec)
            verdict = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--_compare", str(src), str(back)],
                                     cwd=ROOT, check=True, capture_output=True, text=True).stdout
            count, bad = json.loads(verdict.strip().splitlines()[-1])
            line = (f"roundtrip {name} to={to_s:.1f}s ({cp_s / to_s:.2f}x cp) back={back_s:.1f}s "
                    f"({cp_s / back_s:.2f}x cp) rss={to_rss:.0f}/{back_rss:.0f}MiB tensors={count} "
                    f"bitwise={'yes' if not bad else 'no'}" + (f" differ={bad[:5]}" if bad else ""))
            print(line, flush=True)
            lines.append(line)
            if not args.keep:
                shutil.rmtree(mid)
                shutil.rmtree(back)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    ok = lines and all("bitwise=yes" in ln for ln in lines)
    print(f"size={size / 1e9:.2f}GB all_bitwise={'yes' if ok else 'no'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
