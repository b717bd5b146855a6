"""LoRA on the vision-language models against peft (issue 41 item 3), fp32 on CPU: a peft adapter of random
A and B whose targets cover the vision tower and the language model as users write them (``["qkv", "proj",
"fc1", ...]``: peft matches a list entry against a module name or its dotted suffix, so ``proj`` also reaches
the tower's Conv3d patch embedding ``patch_embed.proj``, which takes peft's Conv3d LoRA; ``all-linear``;
regular expressions), on the images-and-video batch (two images of different sizes and a video) and the
packed batch: logits and loss against ``PeftModel`` on transformers' model, every LoRA gradient (the
tower's included) after ``forward_backward``, at TP1 and TP2 with SP (gloo); then our adapter saved back
(the loaded tensors, bitwise, under peft's names) and the merged export against peft's ``merge_and_unload``.
Models: Qwen3-VL (blocks, merger and DeepStack mergers), Qwen3-VL-MoE (the attention and the dense MLP of
its ``mlp_only_layers``; routed experts and the router refused by name), Qwen2-VL and Qwen2.5-VL (whose
weight maps use the release names ``model.layers.*`` / ``visual.*`` where peft names transformers' modules
``model.language_model.layers.*`` / ``model.visual.*``: targets are matched and adapters named through
``Architecture.module_name``), the multimodal Qwen3.5 / Qwen3.5-MoE (``ParallelQwen3_5VL``: gated attention,
the Gated DeltaNet projections, the dense MLP or the MoE's shared expert, and the Qwen3-VL tower blocks).
Tower weights that are not linear modules (the position table) are refused by name. ~60 s on 2 cores (load 5-8)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.vl_cases import vl_batch as qwen2_vl_batch
from tests.vl_cases import vl_packed_batch as qwen2_vl_packed_batch
from tests.vl_cases import write_vl_model
from tests.workers_lora import lora_state_of_grads
from tests.workers_qwen3_5_vl import build_ours, vl_batch, vl_packed_batch, write_case
from tests.workers_qwen3_vl import qwen3_vl_batch, qwen3_vl_packed_batch, write_qwen3_vl_model
from tests.workers_qwen3_vl_moe import BASE as MOE_BASE
from tests.workers_qwen3_vl_moe import write_qwen3_vl_moe_model
from tests.workers_vl import _inputs, _segments

# Qwen3-VL: tower (qkv, attn.proj and the Conv3d patch_embed.proj, the blocks' MLP, the merger's and the DeepStack
# mergers' linear_fc1/2) and text attention and MLP, as a user writes the list
Q3_TARGETS = ["qkv", "proj", "linear_fc1", "linear_fc2", "q_proj", "v_proj", "o_proj", "down_proj"]
# Qwen3.5: tower, gated attention, the Gated DeltaNet projections and the dense MLP; the MoE case's experts are
# refused, so there a regular expression names the tower's linear modules and the text ones (attention, Gated
# DeltaNet, shared expert)
HYBRID_TARGETS = {
    "q35_dense": ["qkv", "proj", "linear_fc1", "linear_fc2", "q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv",
                  "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "gate_proj", "up_proj", "down_proj"],
    "q35_moe": r".*(visual\.(blocks\.\d+\.(attn\.(qkv|proj)|mlp\.linear_fc[12])|merger\.linear_fc[12])|"
               r"language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|linear_attn\.(in_proj_qkv|in_proj_z|"
               r"in_proj_b|in_proj_a|out_proj)|mlp\.shared_expert\.(gate|up|down)_proj))",
}
# Qwen2-VL: the tower's qkv/proj (and the Conv3d patch embedding)/fc1/fc2, the merger's mlp.0/mlp.2 and the text
# attention and MLP; Qwen2.5-VL: all-linear (its tower MLP is gate_proj/up_proj/down_proj too)
QWEN2_VL_TARGETS = {
    "untied": ["qkv", "proj", "fc1", "fc2", "mlp.0", "mlp.2", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
               "up_proj", "down_proj"],
    "v25_untied": "all-linear",
}
QWEN2_VL_CASES = tuple(QWEN2_VL_TARGETS)
# Qwen3-VL-MoE: the tower's linear modules and patch embedding, the attention and the dense MLP of its mlp_only
# layer (layer 1); routed experts and the router take none (refused by name, as in Qwen3-MoE)
MOE_TARGETS = (r".*(visual\.(patch_embed\.proj|blocks\.\d+\.(attn\.(qkv|proj)|mlp\.linear_fc[12])|"
               r"(merger|deepstack_merger_list\.\d+)\.linear_fc[12])|"
               r"language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj))")
TOL = {"logits": 1e-5, "loss": 1e-5, "grads": 1e-4, "adapter": 0.0, "merged": 1e-5}
# Qwen3.5 (Gated DeltaNet, transformers' torch fallback): text-only LoRA's logits already differ by 9.3e-6 at TP1
# (the tower's alone: 6.3e-6); with both, 1.18e-5 at TP2+SP on the packed batch (measured 2026-11-29)
HYBRID_LOGITS_TOL = 2e-5


def _adapter(path: str, out: str, targets) -> str:
    """A peft adapter of random A and B (peft's init leaves B = 0, which would hide B's handling)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(5)
    peft_model = get_peft_model(AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32),
                                LoraConfig(r=4, lora_alpha=16, target_modules=targets, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.1)
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl_lora")
    q3 = write_qwen3_vl_model(root, "q3_untied", seed=31)
    out = {"q3_untied": (q3, _adapter(q3, str(root / "q3_adapter"), Q3_TARGETS))}
    for i, case in enumerate(QWEN2_VL_CASES):
        path = write_vl_model(root, case, seed=35 + i)
        out[case] = (path, _adapter(path, str(root / f"{case}_adapter"), QWEN2_VL_TARGETS[case]))
    moe = write_qwen3_vl_moe_model(root, "m_untied", seed=34)
    out["m_untied"] = (moe, _adapter(moe, str(root / "m_adapter"), MOE_TARGETS))
    for i, (case, targets) in enumerate(HYBRID_TARGETS.items()):
        path = write_case(root, case.removeprefix("q35_"), seed=32 + i)
        out[case] = (path, _adapter(path, str(root / f"{case}_adapter"), targets))
    return out


def _builder(case: str):
    if case.startswith("q35_"):
        return functools.partial(build_ours, case.removeprefix("q35_"))
    if case in QWEN2_VL_CASES:
        from models.qwen2_5_vl import build_parallel_model as build_25
        from models.qwen2_vl import build_parallel_model as build_2

        return build_25 if case.startswith("v25") else build_2
    if case in MOE_BASE:
        from models.qwen3_vl_moe import build_parallel_model as build_moe

        return build_moe
    from models.qwen3_vl import build_parallel_model

    return build_parallel_model


def _batches(case: str, path: str) -> dict:
    if case.startswith("q35_"):
        name = case.removeprefix("q35_")
        return {"padded": vl_batch(name, "images_and_video"), "packed": vl_packed_batch(name)}
    if case in QWEN2_VL_CASES:
        return {"padded": qwen2_vl_batch(case, "image_video"), "packed": qwen2_vl_packed_batch(case)}
    case = MOE_BASE.get(case, case)  # the MoE cases extend a Qwen3-VL case: its batches
    return {"padded": qwen3_vl_batch(case, "images_and_video"), "packed": qwen3_vl_packed_batch(case)}


def lora_records(case: str, path: str, adapter: str, tp: int) -> list[tuple]:
    """Rank body: ours with the adapter against peft, logits / loss / LoRA gradients per batch."""
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForImageTextToText

    from parallel import ParallelConfig

    pconfig = ParallelConfig(tp=tp, sequence_parallel=tp > 1)
    model = _builder(case)(path, pconfig, lora=LoraConfig.from_pretrained(adapter))
    model.load_lora_adapter(adapter)
    ref = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32), adapter,
                                    is_trainable=True)
    records = []
    for kind, batch in _batches(case, path).items():
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        inputs = _inputs(batch)
        with torch.no_grad():
            ours = model(**inputs, gather_logits=True)
        if kind == "packed":
            segments = [ref(**seg) for seg in _segments(batch, ref.config)]
            ref_logits = torch.cat([out.logits[0] for out in segments])
            counts = [int((seg["labels"][0, 1:] != -100).sum()) for seg in _segments(batch, ref.config)]
            ref_loss = sum(out.loss * n for out, n in zip(segments, counts)) / sum(counts)
            ours_logits = ours.logits[0]
        else:
            out = ref(**inputs)
            valid = batch["attention_mask"].bool()
            ref_logits, ref_loss, ours_logits = out.logits[valid], out.loss, ours.logits[valid]
            ref_logits = ref_logits.detach()
        ids, labels = inputs.pop("input_ids"), inputs.pop("labels")
        loss = model.forward_backward(ids, labels, **inputs)
        ref_loss.backward()
        grads = lora_state_of_grads(model)
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        worst = max(((g - ref_grads[k.replace(".weight", ".default.weight")]).abs().max()
                     / ref_grads[k.replace(".weight", ".default.weight")].abs().max()).item() for k, g in grads.items())
        base = sum(1 for n, p in model.named_parameters() if p.grad is not None and ".lora." not in n)
        records += [(case, tp, kind, "logits", (ours_logits - ref_logits).abs().max().item()),
                    (case, tp, kind, "loss", abs(loss.item() - ref_loss.item())),
                    (case, tp, kind, "grads", worst if len(grads) == len(ref_grads) and not base else float("inf"))]
    return records + _saved_records(case, tp, model, ref, adapter)


def _saved_records(case: str, tp: int, model, ref, adapter: str) -> list[tuple]:
    """Our adapter saved (peft's names, the tensors loaded, bitwise) and the merged weights of every adapted
    module (``iter_export(merge_lora=True)``) against peft's ``merge_and_unload``."""
    from safetensors.torch import load_file

    saved = f"{Path(adapter).parent}/ours_{case}_tp{tp}"
    model.save_lora_adapter(saved)
    theirs, ours = (load_file(f"{d}/adapter_model.safetensors") for d in (adapter, saved))
    same = set(theirs) == set(ours) and any(".visual." in k for k in ours)
    adapter_diff = max((ours[k] - theirs[k]).abs().max().item() for k in ours) if same else float("inf")
    rename = module_name(case)
    merged = {rename(n): t.clone() for b in model.iter_export("hf", merge_lora=True) for n, t in b.tensors()}
    ref_merged = ref.merge_and_unload().state_dict()
    adapted = [t.hf_module + ".weight" for t in model.all_lora_targets]
    merged_diff = max((merged[n] - ref_merged[n]).abs().max().item() for n in adapted)
    return [(case, tp, "saved", "adapter", adapter_diff), (case, tp, "saved", "merged", merged_diff)]


@functools.lru_cache(maxsize=None)
def _records(tp: int, case: str, path: str, adapter: str) -> tuple:
    if tp == 1:
        return tuple(lora_records(case, path, adapter, 1))
    return tuple(run_distributed(tp, lora_records, case, path, adapter, tp)[0])


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case", ["q3_untied", "m_untied", *QWEN2_VL_CASES, *HYBRID_TARGETS])
def test_lora_on_vl_models_matches_peft(dirs, case, tp):
    records = _records(tp, case, *dirs[case])
    assert {r[2] for r in records} == {*_batches(case, dirs[case][0]), "saved"}
    tol = {**TOL, "logits": HYBRID_LOGITS_TOL} if case in HYBRID_TARGETS else TOL
    bad = [f"{r[2]} {r[3]}={r[4]:.3g}" for r in records if not r[4] <= tol[r[3]]]
    assert not bad, f"{case} tp={tp}: {bad}"


@pytest.mark.parametrize(("case", "targets", "module"), [
    ("q3_untied", ["q_proj", "pos_embed"], "model.visual.pos_embed"),
    ("q35_dense", r".*visual\.(pos_embed|blocks\.0\.attn\.qkv)", "model.visual.pos_embed"),
    ("untied", ["qkv", "embed_tokens"], "model.language_model.embed_tokens"),
])
def test_tower_and_text_weights_that_are_not_linear_are_refused(dirs, case, targets, module):
    """peft would adapt an embedding (the tower's position table, the token embedding) named by a target: LoRA on
    it is not built here, refused by name in one line (Qwen2-VL: the name transformers gives the module)."""
    from peft import LoraConfig

    from models.common.blocks.lora import LoraError

    with pytest.raises(LoraError, match=rf"selects {module.replace('.', '[.]')} \(an embedding\)") as err:
        _builder(case)(dirs[case][0], lora=LoraConfig(r=4, target_modules=targets))
    assert "\n" not in str(err.value)


def test_tower_dropout_with_tp_is_refused_before_any_group(dirs):
    """The tower's activations are whole on every TP rank, whose dropout masks would differ: lora_dropout with
    tp > 1 on a tower target is refused by ``check_lora_config`` (before any process group), text targets under
    SP are not."""
    from peft import LoraConfig

    from models.common.blocks.lora import check_lora_config
    from models.common.weight_map import hf_shapes
    from parallel import ParallelConfig
    from parallel.config import ParallelConfigError

    model = _builder("q3_untied")(dirs["q3_untied"][0])
    cfg, wmap, sp2 = model.config, model.weight_map, ParallelConfig(tp=2, sequence_parallel=True)
    with pytest.raises(ParallelConfigError, match=r"lora_dropout=0.1 with tp=2 on the vision tower "
                                                  r"\(model\.visual\.blocks\.0\.attn\.qkv\)"):
        check_lora_config(cfg, wmap, LoraConfig(r=4, target_modules=["q_proj", "qkv"], lora_dropout=0.1), sp2,
                          hf_shapes(cfg, wmap))
    assert check_lora_config(cfg, wmap, LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.1), sp2,
                             hf_shapes(cfg, wmap))


@pytest.mark.parametrize(("case", "targets", "selects"), [
    ("q35_moe", ["q_proj", "gate_proj"], r"'gate_proj' selects .*mlp\.experts"),
    ("m_untied", ["q_proj", "down_proj"], r"'down_proj' selects .*mlp\.experts"),
    ("m_untied", ["q_proj", "gate"], r"'gate' selects .*mlp\.gate\b"),
])
def test_expert_and_router_targets_of_the_moe_vl_models_are_refused(dirs, case, targets, selects):
    """The routed experts (and Qwen3-VL-MoE's router) of the MoE vision-language models take no LoRA (peft would
    adapt transformers' fused experts): refused by name, in one line."""
    from peft import LoraConfig

    from models.common.blocks.lora import LoraError

    with pytest.raises(LoraError, match=rf"LoRA target {selects}.*not supported") as err:
        _builder(case)(dirs[case][0], lora=LoraConfig(r=4, target_modules=targets))
    assert "\n" not in str(err.value)


def module_name(case: str):
    """The case's weight-map name -> transformers' name (Qwen2-VL / Qwen2.5-VL: ``hf_key_aliases`` backwards)."""
    if case not in QWEN2_VL_CASES:
        return lambda name: name
    from models.qwen2_5_vl.architecture import ARCHITECTURE as QWEN2_5_VL
    from models.qwen2_vl.architecture import ARCHITECTURE as QWEN2_VL

    return (QWEN2_5_VL if case.startswith("v25") else QWEN2_VL).module_name


def test_peft_module_names_are_the_weight_maps_hf_names(dirs):
    """The modules peft adapts on transformers' vision-language models, text and tower, are named as our weight
    map's HF tensors (``model.language_model.layers.N...``, ``model.visual...``); on Qwen2-VL / Qwen2.5-VL, whose
    weight map keeps the release names (``model.layers.N...``, ``visual...``), as those names read through
    ``Architecture.module_name``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForImageTextToText

    from models.common.blocks.lora import lora_targets
    from models.common.weight_map import hf_shapes

    for case, targets in [*HYBRID_TARGETS.items(), *QWEN2_VL_TARGETS.items(), ("q3_untied", Q3_TARGETS),
                          ("m_untied", MOE_TARGETS)]:
        path = dirs[case][0]
        model = _builder(case)(path)
        cfg, wmap = model.config, model.weight_map
        rename = module_name(case)
        ours = {t.hf_module for t in lora_targets(cfg, wmap, LoraConfig(r=4, target_modules=targets),
                                                  hf_shapes(cfg, wmap), module_name=rename)}
        hf = {rename(n) for e in wmap.entries(range(cfg.num_hidden_layers)) for n in e.hf}
        with torch.device("meta"):
            ref = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(path))
        peft_model = get_peft_model(ref, LoraConfig(r=4, target_modules=targets))
        adapted = {n.removeprefix("base_model.model.") for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
        assert adapted and [n for n in adapted if n + ".weight" not in hf] == [] and ours == adapted, case
        assert {n.split(".")[1] for n in adapted} == {"language_model", "visual"}, case
