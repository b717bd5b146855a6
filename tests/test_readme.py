"""README.md's "Use" block runs as written: the block after the ``readme-use-snippet`` marker,
saved as a script and launched by a real torchrun with 2 gloo ranks on CPU, on a tiny random Qwen2
directory (only its path and the batch shape are substituted). Every other ``python`` block of the
README at least parses. A README edit that breaks the snippet fails here."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MARKER = "<!-- readme-use-snippet:"
PATH_IN_README = '"/path/to/Qwen2-HF-dir"'
BATCH_IN_README = "(4, 512)"
FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def use_snippet(text: str) -> str:
    """The first ```python block after the marker line."""
    assert text.count(MARKER) == 1, f"README.md must hold exactly one {MARKER!r} line"
    match = FENCE.search(text, text.index(MARKER))
    assert match, f"no ```python block after {MARKER!r}"
    return match.group(1)


def test_every_python_block_of_the_readme_parses():
    blocks = FENCE.findall(README.read_text())
    assert len(blocks) >= 2
    for block in blocks:
        ast.parse(block)


def test_the_use_snippet_runs_under_torchrun_on_cpu(tmp_path):
    from transformers import Qwen2Config

    from tests.cases import write_hf_model

    snippet = use_snippet(README.read_text())
    for target in (PATH_IN_README, BATCH_IN_README):  # what the test swaps must still be there, once
        assert snippet.count(target) == 1, f"the README's Use block no longer has {target} exactly once"
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    src = write_hf_model(tmp_path, "qwen2", config, seed=1)
    script = snippet.replace(PATH_IN_README, repr(str(src))).replace(BATCH_IN_README, "(4, 16)")
    # what the block computed (out.logits is None when the last forward skipped them), one file per
    # rank: the ranks share torchrun's stdout, where their lines can interleave (CI saw two on one line)
    script += ("import json, math, os\n"
               "assert math.isfinite(out.loss.item()) and math.isfinite(loss.item()), (out.loss, loss)\n"
               "assert out.logits is None or tuple(out.logits.shape[:2]) == tuple(input_ids.shape)\n"
               "with open(f'result-rank{os.environ[\"RANK\"]}.json', 'w') as f:\n"
               "    json.dump({'loss': loss.item(), 'first_loss': out.loss.item()}, f)\n")
    (tmp_path / "step.py").write_text(script)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(tmp_path / "step.py")], capture_output=True, text=True, cwd=str(tmp_path),
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = {p.name: json.loads(p.read_text()) for p in sorted(tmp_path.glob("result-rank*.json"))}
    assert sorted(results) == ["result-rank0.json", "result-rank1.json"], (sorted(results), proc.stdout[-2000:])
    first, second = results.values()
    # the two ranks are one TP group: both report the same global losses
    assert first["loss"] == second["loss"] and first["first_loss"] == second["first_loss"], results
    # the block says what it computed (rank 0 alone prints, so its line cannot interleave with another's)
    said = f"loss {first['first_loss']:.4f} then {first['loss']:.4f}"
    assert said in proc.stdout, (said, proc.stdout[-2000:])
