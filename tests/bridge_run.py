"""One call into real Megatron-Bridge for the tests: write the jobs, run an oracle script under ``.venv-bridge``'s
Python (one subprocess for all jobs), check it is Megatron-Bridge 0.6.2 and hand back its per-job results.

The oracles (``tests/bridge_oracle.py`` for the text and VL models, ``tests/bridge_gdn_oracle.py`` for the Gated
DeltaNet hybrids) read a ``jobs.json`` list and write ``result.json`` = ``{"versions": ..., "results": [...]}``,
one result per job in order; every Bridge test module starts them the same way, here. With ``tp`` / ``pp`` > 1,
TP x PP processes of the oracle form one gloo world (each told its rank, the sizes and a FileStore by
``PMZ_BRIDGE_WORLD``, read by bridge_oracle.init_world); every rank runs every job and rank 0 writes the results
of all of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BRIDGE_PYTHON = ROOT / ".venv-bridge" / "bin" / "python"
BRIDGE_VERSION = "0.6.2"


def run_bridge_oracle(oracle: str, jobs: list[dict], root: Path, timeout: int = 300, tp: int = 1,
                      pp: int = 1) -> list[dict]:
    """Run ``tests/<oracle>`` under ``.venv-bridge`` on ``jobs`` (files in ``root``, also its working directory)
    and return its results, one per job, in order: one process, or ``tp * pp`` ranks building every model at that
    TP / PP. Fails with the output tail of a process that failed, and if the venv is missing or holds another
    Megatron-Bridge than the one the layouts are checked against."""
    assert BRIDGE_PYTHON.exists(), f"{BRIDGE_PYTHON} missing: run tools/setup.sh (it creates the Bridge venv)"
    root = Path(root)
    (root / "jobs.json").write_text(json.dumps(jobs))
    cmd = [str(BRIDGE_PYTHON), str(ROOT / "tests" / oracle), str(root / "jobs.json"), str(root / "result.json")]
    if tp * pp == 1:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(root))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    else:
        _run_world(cmd, root, timeout, tp, pp)
    result = json.loads((root / "result.json").read_text())
    assert result.get("parallel", {"tp": 1, "pp": 1}) == {"tp": tp, "pp": pp}, result.get("parallel")
    assert result["versions"]["megatron-bridge"] == BRIDGE_VERSION, result["versions"]
    assert len(result["results"]) == len(jobs), (len(result["results"]), len(jobs))
    return result["results"]


def _run_world(cmd: list[str], root: Path, timeout: int, tp: int, pp: int) -> None:
    """``cmd`` as the ``tp * pp`` ranks of one gloo world (output of rank R in ``root/rank{R}.log``); all of them
    are ended if one fails or the time runs out."""
    store = root / "bridge_world.store"  # FileStore: a fresh file per world
    store.unlink(missing_ok=True)
    logs = [root / f"rank{r}.log" for r in range(tp * pp)]
    procs = []
    for r, log in enumerate(logs):
        env = {**os.environ, "PMZ_BRIDGE_WORLD": f"{r},{tp},{pp},{store}"}
        with open(log, "w") as out:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(root)))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break  # a failed rank leaves the others waiting in a collective
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    assert not failed, f"ranks (rank, returncode) {failed} of TP{tp} x PP{pp}, " + "; ".join(
        f"rank {r}: {logs[r].read_text()[-4000:]}" for r, _ in failed[:2])
