"""``save_pretrained`` of a Gated DeltaNet hybrid built from a checkpoint holding tensors the model does not hold
(the vision tower of a ``Qwen3_5ForConditionalGeneration`` checkpoint, the MTP block): they are written beside the
trained text model, bitwise from the source (cast only to another ``dtype``), listed in the index. Checked against
transformers (its conditional-generation class loads the directory with no missing or unexpected key and gives
our trained model's logits) and against the source's own tensors; a source directory moved after the build is
refused on every rank with nothing written. One 2-rank gloo run (TP2) does every save."""

from __future__ import annotations

import glob
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.distributed import run_distributed

VOCAB_IDS = (2, 9)  # the evaluation batch's shape
RESHAPED = "model.visual.pos_embed.weight"  # one row more in the "reshaped" source after the build
GROWN = "mtp.layers.0.added_after_the_build.weight"  # in the "grown" source after the build: not carried


def _tensors(directory) -> dict:
    out = {}
    for f in sorted(glob.glob(f"{directory}/*.safetensors")):
        out.update(load_file(f))
    return out


def _worker(paths: dict, out: str) -> dict:
    """Rank body: the CondGen model trained one SGD step and saved (fp32, FP8); the text model saved (fp32, bf16,
    FP8); the moved source refused."""
    import os

    from models.common.export import ExportError
    from models.qwen3_5 import build_parallel_model
    from parallel import ParallelConfig

    result = {}
    model = build_parallel_model(paths["condgen"], ParallelConfig(tp=2), text_only=True)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(3))
    model(ids, labels=ids.clone(), return_logits=False).loss.backward()
    model.finalize_grads()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    model.save_pretrained(f"{out}/condgen")
    model.save_pretrained(f"{out}/condgen-fp8", quantization="fp8")
    evaluation = torch.randint(0, vocab, VOCAB_IDS, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        result["logits"] = model(evaluation, gather_logits=True).logits
    text = build_parallel_model(paths["text"], ParallelConfig(tp=2))
    text.save_pretrained(f"{out}/text", max_shard_size=20_000)  # several text files and carried files
    text.save_pretrained(f"{out}/text-bf16", dtype=torch.bfloat16)
    text.save_pretrained(f"{out}/text-fp8", quantization="fp8")
    moved = build_parallel_model(paths["moved"], ParallelConfig(tp=2))
    reshaped = build_parallel_model(paths["reshaped"], ParallelConfig(tp=2), text_only=True)
    grown = build_parallel_model(paths["grown"], ParallelConfig(tp=2))
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        os.rename(paths["moved"], paths["moved"] + "-elsewhere")
        tensors = load_file(f"{paths['reshaped']}/model.safetensors")
        tensors[RESHAPED] = torch.cat([tensors[RESHAPED], tensors[RESHAPED][:1]])
        save_file(tensors, f"{paths['reshaped']}/model.safetensors", metadata={"format": "pt"})
        tensors = load_file(f"{paths['grown']}/model.safetensors")
        tensors[GROWN] = torch.ones(3)  # a tensor the model did not leave unread at build time
        save_file(tensors, f"{paths['grown']}/model.safetensors", metadata={"format": "pt"})
    torch.distributed.barrier()
    grown.save_pretrained(f"{out}/grown")
    for name, built in (("moved", moved), ("reshaped", reshaped)):
        try:
            built.save_pretrained(f"{out}/{name}")
        except ExportError as exc:
            result[name] = str(exc)
    return result


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from tests.test_convert_hybrid import add_mtp
    from tests.test_hybrid_checkpoints import conditional_generation_checkpoint
    from tests.workers_qwen3_5 import configs, write_model

    root = tmp_path_factory.mktemp("save_carried")
    condgen, _ = conditional_generation_checkpoint(root, "qwen3_5")
    add_mtp(condgen, seed=21)
    text = write_model(root, "text", configs()["tied_kv1"], seed=8)
    add_mtp(text, seed=9)
    moved = str(shutil.copytree(text, root / "moved"))
    reshaped = str(shutil.copytree(condgen, root / "reshaped"))
    grown = str(shutil.copytree(text, root / "grown"))
    paths = {"condgen": condgen, "text": text, "moved": moved, "reshaped": reshaped, "grown": grown}
    out = root / "out"
    out.mkdir()
    ranks = run_distributed(2, _worker, paths, str(out))
    return {"paths": paths, "out": out, "ranks": ranks}


def _carried(source: dict) -> dict:
    return {n: t for n, t in source.items() if n.startswith(("model.visual.", "mtp."))}


def test_condgen_save_loads_in_transformers_with_the_tower_and_mtp_bitwise(run):
    """transformers' ``Qwen3_5ForConditionalGeneration`` loads the save with nothing missing or unexpected and gives
    our trained model's text logits; tower and MTP tensors are the source's bitwise; the text tensors were
    trained (differ from the source); the index names each tensor's file. An FP8 save keeps the tower as stored
    and lists its linears in ``modules_to_not_convert``."""
    from transformers import Qwen3_5ForConditionalGeneration

    saved_dir = run["out"] / "condgen"
    hf, info = Qwen3_5ForConditionalGeneration.from_pretrained(saved_dir, dtype=torch.float32,
                                                               output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    evaluation = torch.randint(0, hf.config.text_config.vocab_size, VOCAB_IDS,
                               generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf.eval()(input_ids=evaluation).logits
    ours = run["ranks"][0]["logits"]
    assert (ours - ref).abs().max().item() < 1e-5
    assert torch.equal(ours, run["ranks"][1]["logits"])
    source, saved = _tensors(run["paths"]["condgen"]), _tensors(saved_dir)
    carried = _carried(source)
    assert any(n.startswith("mtp.") for n in carried) and any(n.startswith("model.visual.") for n in carried)
    assert set(saved) == set(source)
    assert all(torch.equal(saved[n], t) for n, t in carried.items())
    assert not torch.equal(saved["model.language_model.embed_tokens.weight"],
                           source["model.language_model.embed_tokens.weight"])
    index = json.loads((saved_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(saved)
    assert all(n in load_file(str(saved_dir / f)) for n, f in index.items() if n in carried)
    config = json.loads((saved_dir / "config.json").read_text())
    assert config["text_config"]["mtp_num_hidden_layers"] == 1 and config["vision_config"]["depth"] == 2
    fp8 = _tensors(run["out"] / "condgen-fp8")  # the tower has no FP8 role: kept as stored, left to loaders as is
    assert all(torch.equal(fp8[n], t) for n, t in carried.items() if n.startswith("model.visual."))
    assert any(n.startswith("mtp.") and n.endswith("_scale_inv") for n in fp8)
    assert not any(n.startswith("model.visual.") and n.endswith("_scale_inv") for n in fp8)
    kept = json.loads((run["out"] / "condgen-fp8" / "config.json").read_text())["quantization_config"]
    assert {"model.visual.blocks.0.attn.qkv", "model.visual.merger.linear_fc2"} <= set(kept["modules_to_not_convert"])


def test_text_checkpoint_keeps_mtp_bitwise_cast_and_quantized_as_pmz_does(run, tmp_path):
    """A text-only checkpoint with MTP: ``mtp.*`` bitwise in fp32 (files split at a small max_shard_size, every
    one in the index), the source cast to bf16 in a bf16 save (one dtype throughout); in an FP8 save the MTP
    tensors and ``quantization_config`` are what ``pmz convert --to hf --quantize fp8`` of the source writes."""
    from transformers import AutoModelForCausalLM

    from converters.engine import convert

    source = _tensors(run["paths"]["text"])
    mtp = _carried(source)
    assert mtp and all(n.startswith("mtp.") for n in mtp)
    saved = _tensors(run["out"] / "text")
    assert set(saved) == set(source) and all(torch.equal(saved[n], t) for n, t in mtp.items())
    index = json.loads((run["out"] / "text" / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(saved) and len(set(index.values())) > 2
    _, info = AutoModelForCausalLM.from_pretrained(run["out"] / "text", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    bf16 = _tensors(run["out"] / "text-bf16")
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())
    assert all(torch.equal(bf16[n], t.to(torch.bfloat16)) for n, t in mtp.items())
    convert(run["paths"]["text"], tmp_path / "pmz-fp8", to="hf", quantization="fp8")
    ours, theirs = _tensors(run["out"] / "text-fp8"), _tensors(tmp_path / "pmz-fp8")
    ours_mtp, theirs_mtp = _carried(ours), _carried(theirs)
    assert any(n.endswith("_scale_inv") for n in theirs_mtp) and sorted(ours_mtp) == sorted(theirs_mtp)
    assert all(ours_mtp[n].dtype == t.dtype and torch.equal(ours_mtp[n], t) for n, t in theirs_mtp.items())

    def qconfig(path):
        return json.loads((path / "config.json").read_text())["quantization_config"]

    assert qconfig(run["out"] / "text-fp8") == qconfig(tmp_path / "pmz-fp8")


def test_condgen_fp8_save_is_pmz_fp8_of_its_plain_save(run, tmp_path):
    """``save_pretrained(quantization="fp8")`` of the trained conditional-generation model writes exactly what
    ``pmz convert --to hf --quantize fp8`` makes of its fp32 save (the same parameters, tower and MTP block): every
    tensor bitwise under its name (text and MTP linears FP8 with their scales, the tower as stored) and the same
    ``quantization_config`` (the tower's linears in ``modules_to_not_convert``: one rule, ``fp8.py``)."""
    from converters.engine import convert

    convert(run["out"] / "condgen", tmp_path / "pmz-fp8", to="hf", quantization="fp8")
    ours, theirs = _tensors(run["out"] / "condgen-fp8"), _tensors(tmp_path / "pmz-fp8")
    assert any(n.startswith("model.language_model.") and n.endswith("_scale_inv") for n in theirs)
    assert sorted(ours) == sorted(theirs)
    assert [n for n, t in theirs.items() if ours[n].dtype != t.dtype or not torch.equal(ours[n], t)] == []

    def qconfig(path):
        return json.loads((path / "config.json").read_text())["quantization_config"]

    assert qconfig(run["out"] / "condgen-fp8") == qconfig(tmp_path / "pmz-fp8")


@pytest.mark.parametrize("case,named", [("moved", "model.safetensors"), ("reshaped", RESHAPED)])
def test_changed_source_refused_with_nothing_written(run, case, named):
    """The source directory moved, or a tower tensor reshaped, after the build: refused on both ranks in one line
    naming the directory and the file or tensor, before anything is written."""
    where = run["paths"][case]
    messages = [rank.get(case) for rank in run["ranks"]]
    assert all(m is not None and "\n" not in m and where in m and named in m for m in messages), messages
    assert not (run["out"] / case).exists() and not list(run["out"].glob(f".{case}*"))


def test_save_carries_exactly_what_the_build_left_unread(run):
    """A tensor added to the source directory after the build is not written: save_pretrained carries exactly the
    names the builder recorded (``model.unloaded_tensors``), the MTP block bitwise, nothing else of the source's."""
    saved = _tensors(run["out"] / "grown")
    source = _tensors(run["paths"]["grown"])
    assert GROWN in source and GROWN not in saved
    mtp = {n: t for n, t in source.items() if n.startswith("mtp.") and n != GROWN}
    assert mtp and all(n in saved and torch.equal(saved[n], t) for n, t in mtp.items()), sorted(mtp)
    assert not {n for n in saved if n.startswith("mtp.")} - set(mtp)
