"""The ``_extra_state`` items of Transformer-Engine norms in the Megatron checkpoints pmz writes
(``converters.layout.stages.writes_te_norms``), against megatron-core's own Transformer-Engine GPT layer spec.

megatron-core builds a norm that is a module of its own as ``TENorm`` in its TE spec; TE's norms override
``get_extra_state``, so a TE model's state dict holds ``<norm>._extra_state`` and a strict load refuses a
checkpoint without. Which norms those are is read here from the spec itself
(``get_gpt_layer_with_transformer_engine_spec`` of the installed megatron-core, built with a backend whose
``layer_norm()`` is a marker class, as tests/bridge_oracle.py does for Megatron-Bridge): each slot of the layer
spec holding the marker, and the block's final norm (``TransformerBlock``'s ``LayerNormImpl``, TENorm with TE).
A TE target (``transformer_impl="transformer_engine"`` in the args; forced here on both paths' arg builders,
since pmz's CLI makes Megatron-LM TE targets only for Qwen3-VL) must hold exactly those extra ``_extra_state``
items beyond the local-spec target's, and the copy path must write the same bytes as the torch path.
Megatron-Bridge targets (the TE spec on a GPU) are checked by Bridge's own save and strict load:
tests/test_convert_bridge_text.py.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from transformers import Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

from converters.engine import convert
from tests.cases import snapshot, write_hf_model
from tests.test_copy_targets import _same_dist, _same_rank_file

TE_IMPL = "transformer_engine"


def _configs() -> dict:
    small = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, max_position_embeddings=64)
    return {
        "qwen3": Qwen3Config(intermediate_size=48, **small),  # q/k norms, dense
        "qwen3moe": Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                                   num_experts_per_tok=2, **small),  # q/k norms, MoE layers
        "qwen2moe": Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                                   num_experts_per_tok=2, shared_expert_intermediate_size=24,
                                   **{k: v for k, v in small.items() if k != "head_dim"}),  # MoE, shared expert
    }


class _Norm:
    """Marks TE's ``TENorm`` in the spec ``_te_norm_slots`` builds."""


def _te_norm_slots(moe: bool, qk_norm: bool) -> set[str]:
    """The layer-relative modules megatron-core's TE GPT layer spec builds as ``backend.layer_norm()``."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import gpt_layer_specs as specs

    class MarkedNormBackend(LocalSpecProvider):
        def fuse_layernorm_and_linear(self) -> bool:
            return True

        def column_parallel_layer_norm_linear(self) -> type:
            return torch.nn.Linear  # any module: the fused input / dense pre-MLP norm lives in it

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False) -> type:
            return _Norm

    missing = object()
    saved = getattr(specs, "TESpecProvider", missing)  # imported only with TE installed
    specs.TESpecProvider = MarkedNormBackend
    try:
        kw = dict(num_experts=4 if moe else None, moe_grouped_gemm=False, qk_layernorm=qk_norm)
        build = getattr(specs, "get_gpt_layer_with_transformer_engine_submodules", None)
        sub = build(**kw) if build else specs.get_gpt_layer_with_transformer_engine_spec(**kw).submodules
    finally:
        if saved is missing:
            del specs.TESpecProvider
        else:
            specs.TESpecProvider = saved
    slots = {s for s in ("input_layernorm", "pre_mlp_layernorm") if getattr(sub, s) is _Norm}
    attn = sub.self_attention.submodules
    return slots | {f"self_attention.{s}" for s in ("q_layernorm", "k_layernorm") if getattr(attn, s) is _Norm}


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("te_norms")
    return {name: write_hf_model(root, name, cfg, seed=3) for name, cfg in _configs().items()}


def _convert(src: Path, dst: Path, monkeypatch, *, te: bool, copy_path: bool, fmt: str) -> Path:
    """``convert`` with the target args' ``transformer_impl`` forced to TE (``te``) in both paths' arg builders."""
    import converters.copy_path.megatron as copy_megatron
    import converters.formats.megatron_args as megatron_args

    with monkeypatch.context() as m:
        if te:
            real = megatron_args.target_arg_fields

            def te_fields(*a, **k):
                return {**real(*a, **k), "transformer_impl": TE_IMPL}

            m.setattr(megatron_args, "target_arg_fields", te_fields)
            m.setattr(copy_megatron, "target_arg_fields", te_fields)
        m.setenv("PMZ_COPY_PATH", "1" if copy_path else "0")
        return convert(src, dst, to=fmt)


def _legacy_extra_states(out: Path) -> set[str]:
    (rank_file,) = out.glob("*/mp_rank_00/model_optim_rng.pt")
    state = torch.load(rank_file, map_location="cpu", weights_only=False)
    return {k for k in state["model"] if k.endswith("._extra_state")}


def _dist_objects(out: Path) -> set[str]:
    (meta,) = out.glob("*/.metadata")
    with open(meta, "rb") as f:
        md = pickle.load(f)
    return {k for k, v in md.state_dict_metadata.items() if not hasattr(v, "chunks")}


@pytest.mark.parametrize("model", list(_configs()))
def test_te_targets_hold_the_te_specs_norm_extra_states(hf, tmp_path, monkeypatch, model):
    """Legacy and torch_dist, torch path: a TE target holds, beyond the local target's ``_extra_state`` items,
    exactly one per norm megatron-core's TE spec builds as TENorm (per layer) and the block's final norm; the
    local target holds none of them."""
    cfg = _configs()[model]
    L = cfg.num_hidden_layers
    slots = _te_norm_slots(moe=hasattr(cfg, "num_experts"), qk_norm=model.startswith("qwen3"))
    assert slots and "input_layernorm" not in slots  # the input norm is fused into linear_qkv
    legacy = {f"decoder.layers.{i}.{s}._extra_state" for i in range(L) for s in slots}
    legacy.add("decoder.final_layernorm._extra_state")
    dist = {f"decoder.layers.{s}._extra_state/shard_{i}_{L}" for i in range(L) for s in slots}
    dist.add("decoder.final_layernorm._extra_state/shard_0_1")
    got = {}
    for fmt, keys in (("megatron", _legacy_extra_states), ("megatron-dist", _dist_objects)):
        local, te = (keys(_convert(hf[model], tmp_path / f"{fmt}-{t}", monkeypatch, te=t, copy_path=False,
                                   fmt=fmt)) for t in (False, True))
        got[fmt] = (te - local, local - te)
    assert got["megatron"] == (legacy, set()), got["megatron"]
    assert got["megatron-dist"] == (dist, set()), got["megatron-dist"]


@pytest.mark.parametrize("fmt", ["megatron", "megatron-dist"])
def test_copy_path_writes_te_targets_as_the_torch_path(hf, tmp_path, monkeypatch, fmt):
    """The copy path's TE targets (Qwen3-MoE: q/k norms and MoE pre-MLP norms) hold the torch path's objects
    (test_copy_targets' comparison: keys and their order, args, values, torch_dist metadata)."""
    ref = _convert(hf["qwen3moe"], tmp_path / "torch", monkeypatch, te=True, copy_path=False, fmt=fmt)
    out = _convert(hf["qwen3moe"], tmp_path / "copy", monkeypatch, te=True, copy_path=True, fmt=fmt)
    assert sorted(snapshot(out)) == sorted(snapshot(ref))
    if fmt == "megatron":
        _same_rank_file(*(next(d.glob("*/mp_rank_00/model_optim_rng.pt")) for d in (ref, out)))
    else:
        _same_dist(*(next(d.glob("*/.metadata")).parent for d in (ref, out)))
    assert "decoder.final_layernorm._extra_state" in (_legacy_extra_states(out) if fmt == "megatron" else
                                                      {k.split("/")[0] for k in _dist_objects(out)})
