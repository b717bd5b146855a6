"""FP8 rollout weights (``quantization="fp8"`` of ``save_pretrained``, ``iter_export`` and
``save_vllm_sharded_state``) against references written here in plain torch and against transformers:

* the files equal this module's own block quantization (per-block loops, no padding) of the
  weights transformers wrote, bitwise, for every architecture: partial edge blocks (160 / 200 / 136
  wide tensors), all-zero blocks (full and partial), every other tensor untouched;
* transformers loads the directory with ``FineGrainedFP8Config(dequantize=True)`` on CPU to exactly
  the weights this module dequantizes, and its logits stay near the unquantized model's;
* exports at TP2 / PP2 / EP2 equal the single-process export bitwise; every rank gets the same;
* vLLM shards at target TP 2 are the rows and scale blocks of the HF FP8 tensors (and the FP8 of the
  unquantized vLLM shards); a target TP that cuts a 128 block, or a name we do not write, is refused
  in one line.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.workers_fp8 import aligned_configs, as_bytes, build, fp8_configs, fp8_suite, loader_configs, write_model

E4M3_MAX = 448.0
QUANTIZED = re.compile(r"(_proj\.weight|^visual\.blocks\.\d+\.(attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.weight)$")
KEPT_LINEAR = re.compile(r"(mlp\.gate|shared_expert_gate|^visual\.merger\.mlp\.\d+)\.weight$")
CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# Relative RMS difference of transformers' logits on the FP8 directory against the unquantized model's
# (docs/numerics.md): 5.0-6.4% measured on the three loader models (random weights, 2 layers; the RMS
# relative weight error is 2.6%, and every weight moves by at most 1/28 of its block's largest entry).
LOGITS_VS_UNQUANTIZED = 0.15


def ref_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-layout block quantization, one block at a time: scale_inv = amax / 448 (1 for an
    all-zero block), fp8 = e4m3(clamp(w / scale_inv)); edge blocks are what is left of the tensor."""
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    s = torch.empty(math.ceil(rows / 128), math.ceil(cols / 128), dtype=torch.float32)
    for i in range(0, rows, 128):
        for j in range(0, cols, 128):
            block = w[i:i + 128, j:j + 128].to(torch.float32)
            scale = block.abs().max() / E4M3_MAX
            if not (scale > 0 and torch.isfinite(scale)):
                scale = torch.tensor(1.0)
            q[i:i + 128, j:j + 128] = (block / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            s[i // 128, j // 128] = scale
    return q, s


def ref_dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(0, q.shape[0], 128):
        for j in range(0, q.shape[1], 128):
            out[i:i + 128, j:j + 128] = q[i:i + 128, j:j + 128].to(torch.float32) * s[i // 128, j // 128]
    return out


def _load(directory) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(Path(directory).glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_models")
    dirs = {name: write_model(root / "partial", name, cfg, seed=i)
            for i, (name, cfg) in enumerate(fp8_configs().items())}
    dirs |= {f"aligned_{n}": write_model(root / "aligned", n, c, seed=10 + i)
             for i, (n, c) in enumerate(aligned_configs().items())}
    dirs |= {f"loader_{n}": write_model(root / "loader", n, c, seed=20 + i)
             for i, (n, c) in enumerate(loader_configs().items())}
    return dirs


@pytest.mark.parametrize("arch", list(fp8_configs()))
def test_save_pretrained_fp8_equals_independent_block_quantization(arch, model_dirs, tmp_path):
    source = _load(model_dirs[arch])
    model = build(arch, model_dirs[arch])
    model.save_pretrained(tmp_path / "fp8", quantization="fp8")
    saved = _load(tmp_path / "fp8")
    quantized = sorted(n for n in source if QUANTIZED.search(n))
    assert set(saved) == set(source) | {n + "_scale_inv" for n in quantized}
    zero_blocks = partial = 0
    for name, tensor in source.items():
        if name not in quantized:
            assert _equal(saved[name], tensor), name
            continue
        q, s = ref_quantize(tensor)
        assert _equal(saved[name], q) and _equal(saved[name + "_scale_inv"], s), name
        # e4m3 rounding: at most half its top spacing (32 * scale_inv / 2 = amax / 28) per element
        half_step = 16 * s.repeat_interleave(128, 0)[:q.shape[0]].repeat_interleave(128, 1)[:, :q.shape[1]]
        assert ((ref_dequantize(q, s) - tensor).abs() <= half_step * (1 + 1e-6)).all(), name
        zero_blocks += int((s == 1.0).sum())
        partial += tensor.shape[0] % 128 != 0 or tensor.shape[1] % 128 != 0
    assert zero_blocks >= 2 and partial >= 3  # the cases really hold all-zero and partial edge blocks
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    kept = {n.removesuffix(".weight") for n in source if KEPT_LINEAR.search(n)} | {"lm_head"}
    qconfig = config["quantization_config"]
    skip = qconfig.pop("modules_to_not_convert")
    assert qconfig == CONFIG and skip[0] == "lm_head" and len(skip) == len(kept) and set(skip) == kept
    # the live export reads the same rule; with dtype=bf16 only the kept tensors change (FP8 comes from fp32)
    exported = {n: t for b in model.iter_export("hf", bucket_bytes=50_000, dtype=torch.bfloat16, quantization="fp8")
                for n, t in b.tensors()}
    assert set(exported) == set(saved)
    bad = [n for n, t in exported.items()
           if not _equal(t, saved[n] if n.endswith("_scale_inv") or n in quantized else source[n].to(torch.bfloat16))]
    assert not bad, bad


def _hf_class(config):
    from transformers import (
        AutoModelForCausalLM,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )

    if isinstance(config, Qwen2_5_VLConfig):
        return Qwen2_5_VLForConditionalGeneration
    return Qwen2VLForConditionalGeneration if isinstance(config, Qwen2VLConfig) else AutoModelForCausalLM


@pytest.mark.parametrize("arch", list(loader_configs()))
def test_transformers_loads_fp8_with_dequantize_on_cpu(arch, model_dirs, tmp_path):
    """transformers' FineGrainedFP8Config(dequantize=True) gives exactly this module's dequantized
    weights (so the same logits as transformers on them) and logits near the unquantized model's."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, FineGrainedFP8Config

    from tests.vl_cases import vl_batch

    path = model_dirs[f"loader_{arch}"]
    build(arch, path).save_pretrained(tmp_path / "fp8", quantization="fp8")
    saved = _load(tmp_path / "fp8")
    dequantized = {n: ref_dequantize(t, saved[n + "_scale_inv"]) if t.dtype == torch.float8_e4m3fn else t
                   for n, t in saved.items() if not n.endswith("_scale_inv")}
    (tmp_path / "deq").mkdir()
    save_file(dequantized, str(tmp_path / "deq" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "deq" / "config.json").write_text((Path(path) / "config.json").read_text())
    config = AutoConfig.from_pretrained(path)
    cls = _hf_class(config)
    loaded = cls.from_pretrained(tmp_path / "fp8", quantization_config=FineGrainedFP8Config(dequantize=True),
                                 dtype=torch.float32).eval()
    on_dequantized = cls.from_pretrained(tmp_path / "deq", dtype=torch.float32).eval()
    unquantized = cls.from_pretrained(path, dtype=torch.float32).eval()
    ref_state = on_dequantized.state_dict()
    assert all(torch.equal(t, ref_state[n]) for n, t in loaded.state_dict().items())
    if cls.__name__.endswith("ConditionalGeneration"):
        batch = vl_batch(config.to_dict(), "one_image")
        inputs = {k: v for k, v in batch.items() if v is not None and k != "labels"}
    else:
        inputs = {"input_ids": torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))}
    with torch.no_grad():
        logits = loaded(**inputs).logits
        ref, base = on_dequantized(**inputs).logits, unquantized(**inputs).logits
    assert (logits - ref).abs().max().item() <= 1e-6
    assert ((logits - base).norm() / base.norm()).item() <= LOGITS_VS_UNQUANTIZED


def test_fp8_exports_do_not_depend_on_the_layout(model_dirs, tmp_path):
    """TP2 (Qwen2-VL, aligned Qwen2 with replicated KV), PP2 (Llama), EP2 (Qwen2-MoE), TP2 (Qwen3-MoE):
    the HF buckets, save_pretrained files and vLLM shards equal the single-process export bitwise and
    are the same on every rank; a quantization name we do not write is refused in one line on every
    rank with nothing written."""
    cases = [("qwen2_vl", model_dirs["qwen2_vl"], dict(tp=2), None),
             ("llama", model_dirs["llama"], dict(pp=2), None),
             ("qwen2_moe", model_dirs["qwen2_moe"], dict(ep=2), None),
             ("qwen3_moe", model_dirs["qwen3_moe"], dict(tp=2), None),
             ("qwen2", model_dirs["aligned_qwen2"], dict(tp=2), 2)]
    ranks = run_distributed(2, fp8_suite, cases, model_dirs["aligned_qwen2"], str(tmp_path))
    for n, (arch, path, parallel, vllm_tp) in enumerate(cases):
        assert not any(r[n]["ranks_differ"] or r[n]["shm_differs"] for r in ranks), arch
        single = build(arch, path)
        expected = {k: as_bytes(t) for b in single.iter_export("hf", quantization="fp8") for k, t in b.tensors()}
        got = _load_file(tmp_path / f"case{n}" / "exported.safetensors")
        assert set(got) == set(expected) and all(torch.equal(as_bytes(got[k]), expected[k]) for k in expected), \
            (arch, parallel)
        files = _load(tmp_path / f"case{n}" / "hf")
        assert set(files) == set(expected) and all(torch.equal(as_bytes(files[k]), expected[k]) for k in expected)
        if vllm_tp:
            single.save_vllm_sharded_state(tmp_path / f"single{n}", tp=vllm_tp, quantization="fp8")
            for r in range(vllm_tp):
                name = f"model-rank-{r}-part-0.safetensors"
                ours = _load_file(tmp_path / f"case{n}" / "vllm" / name)
                ref = _load_file(tmp_path / f"single{n}" / name)
                assert set(ours) == set(ref) and all(_equal(ours[k], ref[k]) for k in ref)
    for messages in (r["bad"] for r in ranks):
        assert all("\n" not in m for m in messages), messages
        assert [m.count(v) for m, v in zip(messages, ("'fp4'", "'int8'", "'FP8'"))] == [1, 1, 1], messages
    assert not (tmp_path / "bad").exists() and not (tmp_path / "badv").exists()


def _load_file(path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def _rank_rows(full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    rows = full.shape[0] // tp
    return full[rank * rows:(rank + 1) * rows]


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_moe"])
def test_vllm_fp8_shards_split_scales_with_weights(arch, model_dirs, tmp_path):
    """At target TP 2 each vLLM shard is the FP8 of the unquantized vLLM shard (quantized here), and
    (dense layers) exactly the rows and scale blocks of the HF FP8 tensors: q and gate/up by rank,
    the single KV head replicated, o/down by column blocks; vLLM's FP8 KV-scale parameters are there;
    the PP2 files hold the same tensors split by stage (Qwen2-MoE's embedding, norm and head on both)."""
    path = model_dirs[f"aligned_{arch}"]
    model = build(arch, path)
    model.save_vllm_sharded_state(tmp_path / "plain", tp=2)
    model.save_vllm_sharded_state(tmp_path / "fp8", tp=2, quantization="fp8")
    model.save_pretrained(tmp_path / "hf", quantization="fp8")
    hf = _load(tmp_path / "hf")
    for r in range(2):
        name = f"model-rank-{r}-part-0.safetensors"
        plain, fp8 = _load_file(tmp_path / "plain" / name), _load_file(tmp_path / "fp8" / name)
        weights = [k for k in plain if re.search(r"(_proj\.weight|w13_weight|w2_weight)$", k)]
        kv = [k.replace("_k_scale", s) for k in plain if k.endswith("attn._k_scale")
              for s in ("k_scale", "v_scale", "q_scale", "prob_scale")]
        assert set(fp8) == set(plain) | {k + "_scale_inv" for k in weights} | set(kv)
        assert all(fp8[k].item() == -1.0 for k in kv)
        for k, t in plain.items():
            if k not in weights:
                assert _equal(fp8[k], t), k
                continue
            pairs = [ref_quantize(e) for e in t] if t.dim() == 3 else [ref_quantize(t)]  # experts one by one
            q, s = (torch.stack(x) if t.dim() == 3 else x[0] for x in zip(*pairs))
            assert _equal(fp8[k], q) and _equal(fp8[k + "_scale_inv"], s), k
        for i in range(2):  # the dense attention and MLP against the HF FP8 tensors, sliced here
            hf_layer, v = f"model.layers.{i}.", f"model.layers.{i}."
            qkv = torch.cat([_rank_rows(hf[hf_layer + "self_attn.q_proj.weight"], r, 2),
                             hf[hf_layer + "self_attn.k_proj.weight"], hf[hf_layer + "self_attn.v_proj.weight"]])
            qkv_s = torch.cat([_rank_rows(hf[hf_layer + "self_attn.q_proj.weight_scale_inv"], r, 2),
                               hf[hf_layer + "self_attn.k_proj.weight_scale_inv"],
                               hf[hf_layer + "self_attn.v_proj.weight_scale_inv"]])
            o = hf[hf_layer + "self_attn.o_proj.weight"].t()
            o_s = hf[hf_layer + "self_attn.o_proj.weight_scale_inv"].t()
            assert _equal(fp8[v + "self_attn.qkv_proj.weight"], qkv)
            assert _equal(fp8[v + "self_attn.qkv_proj.weight_scale_inv"], qkv_s)
            assert _equal(fp8[v + "self_attn.o_proj.weight"], _rank_rows(o, r, 2).t().contiguous())
            assert _equal(fp8[v + "self_attn.o_proj.weight_scale_inv"], _rank_rows(o_s, r, 2).t().contiguous())
            if arch == "qwen2":
                for part in ("gate_up_proj.weight", "gate_up_proj.weight_scale_inv"):
                    gate, up = (hf[hf_layer + f"mlp.{p}_proj.{part.split('.', 1)[1]}"] for p in ("gate", "up"))
                    assert _equal(fp8[v + "mlp." + part], torch.cat([_rank_rows(gate, r, 2), _rank_rows(up, r, 2)]))
    model.save_vllm_sharded_state(tmp_path / "pp2", tp=2, pp=2, quantization="fp8")
    for r in range(2):
        stages = [_load_file(tmp_path / "pp2" / f"model-pp-{p}-tp-{r}-part-0.safetensors") for p in range(2)]
        whole = _load_file(tmp_path / "fp8" / f"model-rank-{r}-part-0.safetensors")
        # vLLM 0.32's Qwen2-MoE builds the embedding, final norm and LM head on every stage (qwen2_moe.py has no
        # PPMissingLayer), so both stages' files hold them; nothing else is on two stages
        shared = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} & set(whole) \
            if arch == "qwen2_moe" else set()
        assert set(stages[0]) & set(stages[1]) == shared and set(stages[0]) | set(stages[1]) == set(whole)
        assert all(_equal(t, whole[k]) for stage in stages for k, t in stage.items())


def test_vllm_target_tp_cutting_a_block_is_refused_naming_the_numbers(model_dirs, tmp_path):
    from models.common.export import ExportError

    model = build("qwen2", model_dirs["qwen2"])  # 160 query rows (80 per rank at TP 2), a 200-wide MLP
    with pytest.raises(ExportError) as info:
        model.save_vllm_sharded_state(tmp_path / "tp2", tp=2, quantization="fp8")
    message = str(info.value)
    assert "\n" not in message and "tp=2" in message and "q_proj.weight: 80 rows per rank (of 160)" in message
    assert not (tmp_path / "tp2").exists()
    with pytest.raises(ExportError, match=r"q_proj.weight: 80 rows per rank \(of 160\)"):
        next(iter(model.iter_export("vllm", target_tp=2, target_rank=0, quantization="fp8")))
    with pytest.raises(ExportError, match=r"tp=1.*gate_proj.weight: 200 rows packed before"):  # even TP 1
        model.save_vllm_sharded_state(tmp_path / "tp1", tp=1, quantization="fp8")
    model.save_vllm_sharded_state(tmp_path / "plain", tp=2)  # control: without FP8 the layout is fine


@pytest.mark.parametrize("value", ["fp4", "FP8", 8, "int8"])
def test_unknown_quantization_refused_in_one_line(value, model_dirs, tmp_path):
    from models.common.export import ExportError

    model = build("qwen2", model_dirs["qwen2"])
    for call in (lambda: model.save_pretrained(tmp_path / "out", quantization=value),
                 lambda: next(iter(model.iter_export("hf", quantization=value))),
                 lambda: model.save_vllm_sharded_state(tmp_path / "v", tp=1, quantization=value)):
        with pytest.raises(ExportError) as info:
            call()
        assert "\n" not in str(info.value) and f"quantization={value!r}" in str(info.value)
    assert list(tmp_path.iterdir()) == []
