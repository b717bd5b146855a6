"""One call into real Megatron-Bridge for the tests: write the jobs, run an oracle script under ``.venv-bridge``'s
Python (one subprocess for all jobs), check it is Megatron-Bridge 0.6.2 and hand back its per-job results.

The oracles (``tests/bridge_oracle.py`` for the text and VL models, ``tests/bridge_gdn_oracle.py`` for the Gated
DeltaNet hybrids) read a ``jobs.json`` list and write ``result.json`` = ``{"versions": ..., "results": [...]}``,
one result per job in order; every Bridge test module starts them the same way, here.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BRIDGE_PYTHON = ROOT / ".venv-bridge" / "bin" / "python"
BRIDGE_VERSION = "0.6.2"


def run_bridge_oracle(oracle: str, jobs: list[dict], root: Path, timeout: int = 300) -> list[dict]:
    """Run ``tests/<oracle>`` under ``.venv-bridge`` on ``jobs`` (files in ``root``, also its working directory)
    and return its results, one per job, in order. Fails with the subprocess's output tail if it fails, and if
    the venv is missing or holds another Megatron-Bridge than the one the layouts are checked against."""
    assert BRIDGE_PYTHON.exists(), f"{BRIDGE_PYTHON} missing: run tools/setup.sh (it creates the Bridge venv)"
    root = Path(root)
    (root / "jobs.json").write_text(json.dumps(jobs))
    proc = subprocess.run([str(BRIDGE_PYTHON), str(ROOT / "tests" / oracle), str(root / "jobs.json"),
                           str(root / "result.json")], capture_output=True, text=True, timeout=timeout, cwd=str(root))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads((root / "result.json").read_text())
    assert result["versions"]["megatron-bridge"] == BRIDGE_VERSION, result["versions"]
    assert len(result["results"]) == len(jobs), (len(result["results"]), len(jobs))
    return result["results"]
