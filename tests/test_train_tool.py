"""tools/train.py as an entry point: bad input ends every rank with exit 1 and one line from rank 0,
before any process group exists (under a real torchrun, whose own report then names that line);
``--help`` prints once under torchrun and says its whole description; ``--init-from HF_DIR`` /
``--save DIR`` round trip: the saved checkpoint, loaded by transformers, gives the held-out loss the
training job printed for its own model (transformers is the reference)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from tests.distributed import free_port

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "tools" / "train.py"


def _train_module():
    spec = importlib.util.spec_from_file_location("pmz_train_tool", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _as_torchrun_ranks(args: list[str], world: int = 2, timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """Start ``world`` processes with the environment torchrun gives its ranks. The rendezvous port
    has no server: a rank that tried to create its process group would hang until the timeout."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(TRAIN), *args], env=env, cwd=str(ROOT), text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    done = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def _bad_cases(tmp_path: Path) -> list[tuple[list[str], str]]:
    (tmp_path / "exists").mkdir(exist_ok=True)
    return [
        (["--tp", "3"], "num_attention_heads=4 is not divisible by tp=3"),
        (["--hidden", "36"], "head_dim=9 is odd"),  # used to pass and fail inside rope.py
        (["--batch", "3"], "do not split evenly over dp=2"),  # world 2 -> dp 2
        (["--cp", "2", "--seq", "6"], "2*cp = 4 context-parallel chunks"),
        # 1F1B runs a micro-batch per stage
        (["--pp", "2", "--batch", "1", "--microbatches", "1"], "need at least 2 samples per replica"),
        (["--pp", "2", "--vpp", "2", "--schedule", "gpipe"], "needs one of interleaved_1f1b"),
        (["--init-from", str(tmp_path / "missing")], "missing"),
        (["--steps", "2", "--bogus"], "unrecognized arguments: --bogus"),
        (["--tp", "abc"], "invalid int value: 'abc'"),
        (["--save", str(tmp_path / "exists")], "already exists"),
    ]


def test_bad_arguments_in_process_every_rank_exits_1_rank_zero_says_one_line(tmp_path, monkeypatch, capsys):
    """Each bad input through main() as rank 0 and as rank 1 of a world of 2 (no process group is
    ever created: validation comes first)."""
    import pytest

    train = _train_module()
    for args, words in _bad_cases(tmp_path):
        for rank in (0, 1):
            monkeypatch.setenv("RANK", str(rank))
            monkeypatch.setenv("WORLD_SIZE", "2")
            with pytest.raises(SystemExit) as exit_info:
                train.main(args)
            assert exit_info.value.code == 1, (args, rank)
            out, err = capsys.readouterr()
            lines = err.strip().splitlines()
            if rank == 0:
                assert len(lines) == 1 and lines[0].startswith("train.py: error: ") and words in lines[0], (args, err)
            else:
                assert out == "" and err == "", (args, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"]  # nothing written
    assert not torch.distributed.is_initialized()


def test_bad_arguments_two_real_ranks(tmp_path):
    """The same through two processes started as torchrun starts its ranks."""
    for args, words in ((["--tp", "3"], "is not divisible by tp=3"), (["--steps", "2", "--bogus"], "--bogus")):
        ranks = _as_torchrun_ranks(args)
        assert [r.returncode for r in ranks] == [1, 1], (args, [r.stderr[-500:] for r in ranks])
        lines = ranks[0].stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("train.py: error: ") and words in lines[0], (args, lines)
        assert ranks[1].stderr.strip() == "" and ranks[1].stdout.strip() == "", (args, ranks[1].stderr[-500:])


def test_help_prints_once_under_torchrun():
    ranks = _as_torchrun_ranks(["--help"])
    assert [r.returncode for r in ranks] == [0, 0]
    assert "--init-from" in ranks[0].stdout and "--save" in ranks[0].stdout
    assert ranks[1].stdout == "" and ranks[1].stderr == ""


def test_help_says_the_whole_first_sentence_and_the_examples():
    """``--help`` used to stop mid-sentence ("... on synthetic data with any")."""
    proc = subprocess.run([sys.executable, str(TRAIN), "--help"], capture_output=True, text=True, cwd=str(ROOT),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    flat = " ".join(proc.stdout.split())
    first = " ".join(_train_module().__doc__.split("\n\n")[0].split())
    assert first.endswith("(torchrun-ready).") and first in flat, proc.stdout[:1500]
    assert "torchrun --standalone --nproc-per-node 4 tools/train.py --tp 2 --pp 2 --steps 20" in proc.stdout


def test_real_torchrun_bad_argument_is_one_line_and_torchruns_summary_names_it():
    """Under a real torchrun: the one line, no traceback of train.py's own, and torchrun's report
    (which it prints after any non-zero exit) gives that line as each rank's reason, not a link."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(TRAIN), "--tp", "3"], capture_output=True, text=True, cwd=str(ROOT), timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 1, proc.stderr[-3000:]
    ours = [line for line in proc.stderr.splitlines() if line.startswith("train.py: error: ")]
    assert len(ours) == 1 and "num_attention_heads=4 is not divisible by tp=3" in ours[0], proc.stderr[-3000:]
    assert 'train.py", line' not in proc.stderr, proc.stderr[-3000:]  # no traceback from the ranks
    assert proc.stdout.strip() == "", proc.stdout[-2000:]
    root_cause = proc.stderr.split("Root Cause")[-1]
    assert f"traceback : {ours[0]}" in root_cause, proc.stderr[-3000:]
    assert "To enable traceback" not in proc.stderr, proc.stderr[-3000:]


def test_checkpoint_that_cannot_load_is_one_line_after_the_group_exists(tmp_path):
    """A valid config.json without weights passes the checks before the process group; loading
    then fails on every rank: one line, exit 1, not a traceback per rank."""
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(str(tmp_path / "src"))
    proc = subprocess.run([sys.executable, str(TRAIN), "--init-from", str(tmp_path / "src"), "--steps", "1"],
                          capture_output=True, text=True, cwd=str(ROOT), timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.strip().splitlines() if "Warning" not in line and "warnings.warn" not in line]
    assert len(lines) == 1 and lines[0].startswith("train.py: error: ") and "no model.safetensors" in lines[0], \
        proc.stderr[-3000:]


def _transformers_eval_loss(directory: Path, train_mod, samples: int, seq: int, seed: int) -> float:
    """The held-out loss train.py prints, computed by transformers on the saved checkpoint: each
    sample on its own, the token mean of -log p(next token)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    flat, cu = train_mod.synthetic_batch(10**6, samples, seq, model.config.vocab_size, seed + 1)
    total, count = 0.0, 0
    with torch.no_grad():
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            ids = flat[a:b][None]
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), dim=-1)
            total -= logp.gather(-1, ids[0, 1:, None]).sum().item()
            count += b - a - 1
    return total / count


def test_init_from_and_save_round_trip_equals_transformers(tmp_path):
    from safetensors.torch import load_file
    from transformers import Qwen2Config

    from tests.cases import write_hf_model

    config = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    src = write_hf_model(tmp_path, "src", config, seed=5)
    out = tmp_path / "trained"
    proc = subprocess.run([sys.executable, str(TRAIN), "--init-from", str(src), "--tp", "2", "--pp", "2", "--dp", "1",
                           "--steps", "2", "--microbatches", "2", "--batch", "4", "--seq", "16", "--seed", "3",
                           "--save", str(out)],
                          capture_output=True, text=True, cwd=str(ROOT), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^step 2/2 loss [0-9.]+ [0-9,]+ tokens/s$", proc.stdout, re.M), proc.stdout
    ours = float(re.search(r"eval loss ([0-9.]+)", proc.stdout).group(1))
    reference = _transformers_eval_loss(out, _train_module(), samples=2, seq=16, seed=3)  # pp 2, 2 micro-batches
    assert abs(ours - reference) <= 1e-5, (ours, reference)
    trained = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    initial = load_file(str(src / "model.safetensors"))
    assert set(trained) == set(initial)
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)  # two AdamW steps moved the weights
    assert _transformers_eval_loss(src, _train_module(), 2, 16, 3) - reference > 1e-4  # and the loss
