"""The mixture-of-experts Gated DeltaNet hybrids (Qwen3.5-MoE, Qwen3-Next, MTP block included) in every Megatron
direction on the copy path (converters/copy_path, no torch), against the torch path (``PMZ_COPY_PATH=0``), which
test_convert_hybrid checks against transformers and real Megatron-Bridge.

* HF -> legacy at TP2 x EP2 and PP2 x EP4 (SequentialMLP experts) and with Transformer Engine's grouped names
  (``--moe-grouped-gemm``: ``mlp.experts.linear_fc{1,2}.weight{i}``), HF -> torch_dist (experts ``[E, ...]`` per
  layer); legacy, grouped and torch_dist sources -> HF, and Megatron -> Megatron reshards (EP and TP changed,
  legacy <-> torch_dist).
* Both paths write the same files (``test_copy_path_hybrid._same_output``: rank files' keys in order, args and
  tensors; torch_dist metadata, common.pt, every tensor read back by our reader and by DCP's own loader; every
  other file byte for byte), and the copy path was taken.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from converters.engine import convert
from tests.test_convert_hybrid import _configs, add_mtp
from tests.test_copy_path_hybrid import _same_output
from tests.test_copy_targets import _torch_path

SOURCES = {"leg": ("megatron", dict(tp=2, ep=2)), "dist": ("megatron-dist", dict(tp=2, ep=2)),
           "te": ("megatron", dict(tp=2, ep=2, moe_grouped_gemm=True))}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    """Qwen3.5-MoE and Qwen3-Next (a dense layer among sparse ones) with an MTP block, and their Megatron
    checkpoints written by the torch path (``SOURCES``)."""
    from tests.workers_qwen3_5 import write_model

    root = tmp_path_factory.mktemp("copy_moe_hybrid")
    configs = _configs()
    out = {}
    for name in ("qwen3_5_moe", "qwen3_next"):
        hf = write_model(root, name, copy.deepcopy(configs[name]), 12)
        add_mtp(hf, 0)
        out[name] = hf
        for tag, (to, kw) in SOURCES.items():
            _torch_path(hf, root / f"{name}-{tag}", to=to, workers=1, **kw)
            out[f"{name}-{tag}"] = str(root / f"{name}-{tag}")
    return out


CASES = [("", "megatron", dict(tp=2, ep=2)), ("", "megatron", dict(pp=2, ep=4)),
         ("", "megatron-dist", dict(tp=2, ep=2)), ("", "megatron", dict(tp=2, ep=2, moe_grouped_gemm=True)),
         ("-leg", "hf", {}), ("-dist", "hf", {}), ("-te", "hf", {}),
         ("-leg", "megatron-dist", {}), ("-dist", "megatron", dict(tp=1, ep=4)), ("-te", "megatron", dict(ep=1))]


@pytest.mark.parametrize("model", ["qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("source, to, kw", CASES, ids=[f"hf{s}-{t}-{''.join(f'{k}{v}' for k, v in kw.items())}"
                                                       for s, t, kw in CASES])
def test_moe_hybrids_on_the_copy_path_write_what_the_torch_path_writes(sources, tmp_path, monkeypatch, model, source,
                                                                       to, kw):
    import converters.engine as engine

    used: list = []
    real = engine._convert_by_copy
    monkeypatch.setattr(engine, "_convert_by_copy", lambda *a, **k: used.append(real(*a, **k)) or used[-1])
    src = sources[model + source]
    _torch_path(src, tmp_path / "slow", to=to, workers=1, **kw)
    convert(src, tmp_path / "fast", to=to, workers=2, **kw)
    assert used[-1] is True, "the copy path was not taken"
    _same_output(tmp_path / "slow", tmp_path / "fast")
    if kw.get("moe_grouped_gemm"):  # Transformer Engine's TEGroupedMLP names, as the torch path writes them
        import torch

        state = torch.load(next(Path(tmp_path / "fast").rglob("model_optim_rng.pt")), weights_only=False)["model"]
        assert any(".mlp.experts.linear_fc1.weight0" in k for k in state)
