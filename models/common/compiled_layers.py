"""``build_parallel_model(..., compile=True)``: each decoder layer's forward through ``torch.compile``.

As torchtitan does, the unit of compilation is one decoder layer: every layer of a model runs the
same code, so dynamo traces it once and reuses the graph for every layer (parameters are graph
inputs), and a whole-model graph would have to cross the pipeline schedule, the fused LM-head loss
and the embedding's collectives for nothing. Only the layer's ``forward`` is compiled, not its
``__call__``: module hooks (FSDP2's all-gather/reshard, activation recompute's checkpoint wrapper
around the call) stay eager, so compilation composes with TP/SP, CP/Ulysses, PP, FSDP2, LoRA and
``recompute="full"`` without graph breaks in their machinery; collectives inside a layer (TP
all-reduces, the context-parallel ring) are graph breaks that dynamo steps around.

The backend must be able to build kernels before anything else happens: inductor needs a C++
compiler on CPU and Triton on CUDA. ``check_compile_backend`` finds out on every rank before any
process group or collective, and says in one line what is missing.
"""

from __future__ import annotations

from typing import Any

import torch


class CompileUnavailableError(RuntimeError):
    """``compile=True`` where torch.compile's backend cannot build kernels (what is missing named)."""


def check_compile_option(compile: Any) -> None:
    """``compile`` must be a bool (a string like "false" would read as True)."""
    if not isinstance(compile, bool):
        raise ValueError(f"compile={compile!r}: expected True or False")


def check_compile_backend(device: torch.device | str | None) -> None:
    """Raise CompileUnavailableError unless inductor can build kernels for ``device`` here."""
    kind = torch.device(device).type if device is not None else "cpu"
    if kind == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise CompileUnavailableError("compile=True on CUDA needs Triton (torch.compile's inductor backend "
                                          "generates Triton kernels); install it or build with compile=False")
        return
    if kind != "cpu":
        raise CompileUnavailableError(f"compile=True: device type {kind!r} is not supported (cpu, cuda)")
    from torch._inductor import config as inductor_config
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as exc:  # InvalidCxxCompiler, or a compiler that does not run
        tried = [c for c in inductor_config.cpp.cxx if c] if isinstance(inductor_config.cpp.cxx, (list, tuple)) \
            else [inductor_config.cpp.cxx]
        raise CompileUnavailableError(f"compile=True on CPU needs a C++ compiler for inductor; none works here "
                                      f"(tried {', '.join(map(str, tried)) or 'none'}: set CXX or install g++), "
                                      f"or build with compile=False") from exc


def compile_layers(layers: Any) -> None:
    """Replace each decoder layer's ``forward`` with its ``torch.compile``d version (in place: the
    modules, their parameters and state-dict names are unchanged)."""
    for layer in layers:
        layer.forward = torch.compile(layer.forward)
