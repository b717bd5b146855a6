"""vLLM itself as the test client: run with the interpreter of ``.venv-vllm`` (``tools/setup.sh``).

    .venv-vllm/bin/python tests/vllm_client.py STEP JSON_ARGS OUT_FILE

Steps (each starts one engine; results go to OUT_FILE as JSON / safetensors):
  capture   engine built from an HF directory at TP N; on every worker a fresh vLLM model is built
            and filled by vLLM's own ``load_weights`` from the same files, and its state is saved
            *before* the CPU backend repacks the linear weights (the reference for vLLM shards);
            the engine's prompt log-probs are recorded too
  logprobs  prompt log-probs of an engine (``load_format`` "auto" or "sharded_state", TP N), through
            a peft LoRA adapter directory when ``adapter`` is given (vLLM's own LoRA support)
  push      a TP-1 engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) from an HF directory; our
            parallel model (the architecture its config names) is built from the same directory,
            trained two SGD steps, and its weights pushed with
            ``push_to_vllm(llm, model.iter_export("hf"))``; log-probs before and after the push and our
            own model's log-probs are recorded
  state     no engine (a vision-language model's engine needs an HF processor, which needs torchvision,
            absent beside CPU torch): ``tp * pp`` processes set up vLLM's distributed state and each
            builds vLLM's model twice, once filled by its own ``load_weights`` from the HF directory
            (the reference) and once by vLLM's strict ``ShardedStateLoader`` from a ``sharded_state``
            directory; both states are saved per rank, and with ``pixels`` (pp 1) the vision tower of
            the second model encodes them (vLLM's own ``visual`` forward at TP N)
The project is imported from the repository root (PYTHONPATH); vLLM pins its own transformers.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the default takes most of the machine's memory
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # 2 cores: one per TP worker
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function (test only)


def _engine(model: str, tp: int, load_format: str = "auto", lora_rank: int | None = None):
    from vllm import LLM

    lora = dict(enable_lora=True, max_lora_rank=lora_rank, max_loras=1) if lora_rank else {}
    return LLM(model=model, tensor_parallel_size=tp, load_format=load_format, dtype="float32", max_model_len=64,
               enforce_eager=True, seed=0, skip_tokenizer_init=True, max_num_seqs=4,
               distributed_executor_backend="mp" if tp > 1 else None, **lora)


def _prompt_logprobs(llm, prompts: list[list[int]], adapter: str | None = None) -> list[list[float]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False)
    request = None
    if adapter:
        from vllm.lora.request import LoRARequest

        request = LoRARequest("pmz", 1, adapter)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=request)
    result = []
    for prompt, out in zip(prompts, outs):
        lps = out.prompt_logprobs
        result.append([0.0] + [lps[i][tok].logprob for i, tok in enumerate(prompt) if i > 0])
    return result


def _capture(worker, hf_dir: str, prefix: str, out: str) -> int:
    """On a vLLM worker: a fresh model filled by vLLM's own ``load_weights`` (no post-load processing),
    its state saved to ``{out}.rank{tp_rank}.safetensors``."""
    import glob

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = worker.vllm_config

    def weights():
        for path in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
            with safe_open(path, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118
                    yield key, f.get_tensor(key)

    with set_current_vllm_config(config), set_default_torch_dtype(config.model_config.dtype):
        with torch.device("cpu"):
            model = initialize_model(vllm_config=config, prefix=prefix)  # own layer names: no clash with the engine's
        model.load_weights(weights())
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    rank = get_tensor_model_parallel_rank()
    save_file(state, f"{out}.rank{rank}.safetensors")
    return rank


def step_capture(args: dict, out: str) -> None:
    llm = _engine(args["model"], args["tp"])
    ranks = llm.collective_rpc(_capture, args=(args["model"], "pmz_capture", out))
    assert sorted(ranks) == list(range(args["tp"])), ranks
    json.dump({"logprobs": _prompt_logprobs(llm, args["prompts"])}, open(out, "w"))


def step_logprobs(args: dict, out: str) -> None:
    """Prompt log-probs; with ``adapter`` (and ``lora_rank``) through vLLM's LoRA support."""
    llm = _engine(args["model"], args["tp"], args.get("load_format", "auto"), args.get("lora_rank"))
    json.dump({"logprobs": _prompt_logprobs(llm, args["prompts"], args.get("adapter"))}, open(out, "w"))


def step_push(args: dict, out: str) -> None:
    import importlib

    import torch

    from models.common.engine_push import push_to_vllm

    model_type = json.load(open(os.path.join(args["model"], "config.json")))["model_type"]
    build_parallel_model = importlib.import_module(f"models.{model_type}").build_parallel_model
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0", "push needs the engine in this process"
    llm = _engine(args["model"], 1)
    before = _prompt_logprobs(llm, args["prompts"])
    model = build_parallel_model(args["model"])
    opt = torch.optim.SGD(model.parameters(), lr=args.get("lr", 0.5))
    ids = torch.tensor(args["train_ids"])
    for _ in range(2):
        opt.zero_grad()
        model.forward_backward(ids, ids, num_microbatches=1)
        opt.step()
    pushed = push_to_vllm(llm, model.iter_export("hf", bucket_bytes=args.get("bucket_bytes", 1 << 16)))
    after = _prompt_logprobs(llm, args["prompts"])
    ours = []
    with torch.no_grad():
        for prompt in args["prompts"]:
            ids = torch.tensor([prompt])
            ours.append(model.forward_backward(ids, ids, forward_only=True)[0].tolist())
    json.dump({"before": before, "after": after, "ours": ours, "pushed": pushed}, open(out, "w"))


def _state_rank(rank: int, args: dict, port: int, out: str) -> None:
    """One vLLM rank of ``step_state`` (global rank = pp_rank * tp + tp_rank, as vLLM numbers them)."""
    import glob

    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    tp, pp = args["tp"], args["pp"]

    def config(model: str, load_format: str):
        return EngineArgs(model=model, tensor_parallel_size=tp, pipeline_parallel_size=pp, dtype="float32",
                          load_format=load_format, skip_tokenizer_init=True, max_model_len=64, enforce_eager=True,
                          distributed_executor_backend="mp" if tp * pp > 1 else None).create_engine_config()

    def weights():
        for path in sorted(glob.glob(os.path.join(args["model"], "*.safetensors"))):
            with safe_open(path, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118
                    yield key, f.get_tensor(key)

    def state(model) -> dict:
        return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}

    ref_config = config(args["model"], "auto")
    with set_current_vllm_config(ref_config), set_default_torch_dtype(torch.float32), torch.device("cpu"):
        init_distributed_environment(world_size=tp * pp, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(tp, pp)
        reference = initialize_model(vllm_config=ref_config, prefix="reference")
        reference.load_weights(weights())
        save_file(state(reference), f"{out}.rank{rank}.reference.safetensors")
    if not args.get("sharded"):
        return
    ours_config = config(args["sharded"], "sharded_state")
    with set_current_vllm_config(ours_config), set_default_torch_dtype(torch.float32), torch.device("cpu"):
        ours = initialize_model(vllm_config=ours_config, prefix="ours")
        get_model_loader(ours_config.load_config).load_weights(ours, ours_config.model_config)  # strict
        save_file(state(ours), f"{out}.rank{rank}.ours.safetensors")
        if args.get("pixels") and pp == 1:
            from vllm.model_executor.model_loader.utils import process_weights_after_loading

            process_weights_after_loading(ours, ours_config.model_config, torch.device("cpu"))  # CPU GEMM packing
            inputs = load_file(args["pixels"])
            with torch.no_grad():
                features = ours.visual(inputs["pixel_values"], grid_thw=inputs["grid_thw"].tolist())
            save_file({"features": features.contiguous()}, f"{out}.rank{rank}.features.safetensors")


def step_state(args: dict, out: str) -> None:
    import socket

    import torch.multiprocessing as mp

    os.environ.setdefault("VLLM_DIST_IDENT", f"pmz-state-{os.getpid()}")  # vLLM's CPU shared-memory group name
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_state_rank, args=(args, port, out), nprocs=args["tp"] * args["pp"])
    json.dump({"ranks": args["tp"] * args["pp"]}, open(out, "w"))


if __name__ == "__main__":
    step, raw, out_file = sys.argv[1:4]
    if step == "push":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    steps = {"capture": step_capture, "logprobs": step_logprobs, "push": step_push, "state": step_state}
    steps[step](json.loads(raw), out_file)
