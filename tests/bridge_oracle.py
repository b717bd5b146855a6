"""Real Megatron-Bridge as a test oracle, run under ``.venv-bridge`` (tools/setup.sh makes it) by
tests/test_convert_bridge_vl.py: ``python tests/bridge_oracle.py JOBS.json RESULT.json``.

Jobs (a JSON list), all run in one process (importing Bridge costs ~12 s):
  {"op": "write", "hf": DIR, "out": DIR}   ``AutoBridge.from_hf_pretrained(hf).to_megatron_provider(
                                           load_weights=True)`` builds the model from the HF weights with
                                           Bridge's own mapping; ``save_megatron_model`` writes its checkpoint.
  {"op": "load", "ckpt": DIR, "hf": DIR}   Bridge's own loader (``load_model_config`` on run_config.yaml,
                                           ``build_and_load_model``: dist_checkpointing, strict) loads
                                           ``ckpt``; its state dict is compared bitwise with the model Bridge
                                           builds from ``hf``. Result: tensors compared, mismatches, missing.

Megatron-Bridge 0.6.2 / megatron-core 0.19.2 run on CPU here with, in this process only: Python 3.11's
missing ``typing.override``; stub modules for the imports ``megatron.bridge`` (and one megatron-core
Triton kernel file) make of transformer_engine, modelopt, megatron.energon, nvidia_resiliency_ext and
triton (megatron-core's own guarded imports still fail, so it builds its local non-TE layers);
``torch.cuda`` device and RNG calls mapped to the CPU; a gloo world of one; the local layer spec,
fp32, no fusions, CPU initialisation. Nothing of the project is imported here.
"""

from __future__ import annotations

import builtins
import json
import os
import sys
import typing

typing.override = getattr(typing, "override", lambda f: f)  # Bridge asks for Python 3.12; this is 3.11
STUB_ROOTS = ("transformer_engine", "modelopt", "megatron.energon", "nvidia_resiliency_ext", "triton")
STUBBED_FOR = ("megatron.bridge", "megatron.core.transformer.moe.ops.paged_stash")


class _Stub(type):
    """A stand-in for a module or class of a package that is not installed: any attribute is another
    stand-in, calling or subclassing one works (what module-level code of Bridge needs)."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(name)


def _stub(name: str) -> type:
    return _Stub(name, (object,), {"__init__": lambda self, *a, **k: None})


_import = builtins.__import__
_stubs: dict[str, type] = {}


def _guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
    importer = (globals or {}).get("__name__") or ""
    if level == 0 and importer.startswith(STUBBED_FOR) and any(name == r or name.startswith(r + ".")
                                                               for r in STUB_ROOTS):
        if fromlist:
            return _stubs.setdefault(name, _stub(name))
        if name.startswith("megatron."):
            return _import("megatron", globals, locals, fromlist, level)
        return _stubs.setdefault(name.split(".")[0], _stub(name))
    return _import(name, globals, locals, fromlist, level)


builtins.__import__ = _guarded_import

import torch  # noqa: E402

torch.cuda.current_device = lambda: "cpu"
torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
FUSIONS = ("gradient_accumulation_fusion", "bias_activation_fusion", "masked_softmax_fusion", "persist_layer_norm",
           "bias_dropout_fusion", "apply_rope_fusion", "cross_entropy_loss_fusion", "bf16", "fp16")


def _cpu(provider) -> None:
    """The provider on CPU: local (non-TE) layers, fp32, no fusions, one rank."""
    from megatron.bridge.models.gpt_provider import local_layer_spec

    provider.transformer_layer_spec = local_layer_spec
    for name in FUSIONS:
        if hasattr(provider, name):
            setattr(provider, name, False)
    provider.params_dtype = provider.pipeline_dtype = torch.float32
    provider.use_cpu_initialization = True
    provider.perform_initialization = False
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        setattr(provider, name, 1)
    provider.virtual_pipeline_model_parallel_size = None
    provider.sequence_parallel = False


def _from_hf(hf: str):
    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(hf, torch_dtype=torch.float32)
    provider = bridge.to_megatron_provider(load_weights=True)
    _cpu(provider)
    provider.finalize()
    return bridge, provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)


def _weights(model) -> dict[str, torch.Tensor]:
    module = model[0] if isinstance(model, list) else model
    return {k: v for k, v in module.state_dict().items() if "_extra_state" not in k}


def _load(ckpt: str, hf: str) -> dict:
    from pathlib import Path

    from megatron.bridge.training.model_load_save import build_and_load_model, load_model_config

    iters = sorted(p for p in Path(ckpt).iterdir() if p.is_dir() and p.name.startswith("iter_"))
    it_dir = str(iters[-1]) if iters else ckpt  # as AutoBridge.load_megatron_model picks it
    cfg, _ = load_model_config(it_dir)
    provider_class = f"{type(cfg).__module__}.{type(cfg).__name__}"
    _cpu(cfg)
    loaded = _weights(build_and_load_model(it_dir, cfg, use_cpu_init=True, skip_temp_dist_context=True))
    _, reference = _from_hf(hf)
    expected = _weights(reference)
    mismatched = sorted(k for k in expected if k in loaded and not (
        loaded[k].shape == expected[k].shape and torch.equal(loaded[k], expected[k])))
    return {"provider": provider_class, "compared": len(expected), "mismatched": mismatched,
            "missing": sorted(set(expected) - set(loaded)), "unexpected": sorted(set(loaded) - set(expected))}


def main(jobs_path: str, result_path: str) -> None:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(20000 + os.getpid() % 20000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    import megatron.bridge

    results = []
    for job in json.loads(open(jobs_path).read()):
        if job["op"] == "write":
            bridge, model = _from_hf(job["hf"])
            bridge.save_megatron_model(model, job["out"])
            results.append({"op": "write", "out": job["out"]})
        else:
            results.append({"op": "load", **_load(job["ckpt"], job["hf"])})
    from importlib.metadata import version

    out = {"versions": {p: version(p) for p in ("megatron-bridge", "megatron-core", "transformers", "torch")},
           "bridge_file": megatron.bridge.__file__, "results": results}
    with open(result_path, "w") as f:
        json.dump(out, f)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":  # the checkpoint writer starts worker processes that import this file
    main(sys.argv[1], sys.argv[2])
