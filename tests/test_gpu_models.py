"""The models on CUDA against transformers on the same GPU: what CPU CI cannot see (a tensor made on
the CPU inside a forward, a CPU-only op, NCCL process groups). Attention is torch's flash varlen kernel
in bf16 (parallel/varlen_kernels.py, checked alone in test_gpu.py) and SDPA in fp32. Skipped, and
reported as skipped, on machines without CUDA.

- fp32 with TF32 off: logits, loss and every gradient within the CPU suite's tolerances (a little
  wider for the GPU's reduction orders: 2e-5 absolute for logits/loss, 1e-4 relative for gradients);
- bf16: our error against the fp32 reference at most 2x transformers' own bf16 error (+ 1e-3), so
  bf16 rounding inside our kernels is no worse than transformers';
- NCCL: a one-rank NCCL group (``torch.distributed`` initialized, as under ``torchrun``) running
  ``forward_backward`` with micro-batches gives transformers' loss and gradients.
"""

from __future__ import annotations

import pytest
import torch

from tests.cases import _case_configs, seq_len_for, write_hf_model
from tests.workers import _max_diff, hf_named_grads

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

FP32_TOL = 2e-5
GRAD_REL_TOL = 1e-4
TEXT_CASES = sorted(_case_configs())


@pytest.fixture(autouse=True)
def _exact_fp32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture(scope="module")
def text_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_text")
    return {name: str(write_hf_model(root, name, cfg, seed=i)) for i, (name, cfg) in enumerate(_case_configs().items())}


def _batch(vocab: int, seq: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, seq), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, seq - 3:] = 0  # right padding in the second row
    labels = ids.masked_fill(mask == 0, -100)
    return {k: v.cuda() for k, v in {"input_ids": ids, "attention_mask": mask, "labels": labels}.items()}


def _build(arch: str, path: str, **kw):
    import importlib

    return importlib.import_module(f"models.{arch}").build_parallel_model(path, device="cuda", **kw)


def _grads_by_hf_name(model) -> dict[str, torch.Tensor]:
    return {n: g.float().cpu() for n, g in hf_named_grads(model).items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("case", TEXT_CASES)
def test_cuda_fp32_logits_loss_and_grads_match_transformers(text_dirs, case):
    from transformers import AutoModelForCausalLM

    path = text_dirs[case]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    ours = _build(case.split("_")[0], path)
    assert all(p.is_cuda for p in ours.parameters())
    batch = _batch(hf.config.vocab_size, seq_len_for(case))
    ref = hf(**batch)
    out = ours(**batch, gather_logits=True)
    valid = batch["attention_mask"].bool()
    assert out.logits.is_cuda
    assert _max_diff(out.logits[valid], ref.logits[valid]) <= FP32_TOL
    assert _max_diff(out.loss, ref.loss) <= FP32_TOL
    ref.loss.backward()
    out.loss.backward()
    ref_grads = {n: p.grad.float().cpu() for n, p in hf.named_parameters() if p.grad is not None}
    got = _grads_by_hf_name(ours)
    missing = set(ref_grads) - set(got)
    if hf.config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    assert not missing, sorted(missing)
    bad = {n: _rel(got[n], g) for n, g in ref_grads.items() if n in got and _rel(got[n], g) > GRAD_REL_TOL}
    assert not bad, bad


@pytest.mark.parametrize("case", ["qwen2_untied", "llama_llama3"])
def test_cuda_bf16_error_is_no_worse_than_transformers(text_dirs, case):
    from transformers import AutoModelForCausalLM

    path = text_dirs[case]
    batch = _batch(_case_configs()[case].vocab_size, seq_len_for(case), seed=1)
    valid = batch["attention_mask"].bool()
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()(**batch).logits[valid]
        hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()(**batch).logits[valid]
        ours16 = _build(case.split("_")[0], path, dtype=torch.bfloat16)(**batch, gather_logits=True).logits[valid]
    assert ours16.dtype == torch.bfloat16
    hf_err, our_err = _max_diff(hf16, ref), _max_diff(ours16, ref)
    assert our_err <= 2 * hf_err + 1e-3, (our_err, hf_err)


def test_cuda_moe_matches_transformers(tmp_path):
    from transformers import Qwen2MoeForCausalLM

    from tests.workers_moe import MOE_CASES, hf_grads, write_moe_model

    name = sorted(MOE_CASES)[0]
    path = write_moe_model(tmp_path, name)
    hf = Qwen2MoeForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    ours = _build("qwen2_moe", path)
    batch = _batch(hf.config.vocab_size, 12, seed=2)
    ref = hf(**batch)
    out = ours(**batch, gather_logits=True)
    valid = batch["attention_mask"].bool()
    assert _max_diff(out.logits[valid], ref.logits[valid]) <= FP32_TOL
    assert _max_diff(out.loss, ref.loss) <= FP32_TOL
    ref.loss.backward()
    out.loss.backward()
    ref_grads = {n: g.float().cpu() for n, g in hf_grads(hf).items()}
    got = _grads_by_hf_name(ours)
    bad = {n: _rel(got[n], g) for n, g in ref_grads.items() if n in got and _rel(got[n], g) > GRAD_REL_TOL}
    assert not bad and set(ref_grads) <= set(got), (bad, sorted(set(ref_grads) - set(got))[:5])


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_cuda_qwen2_vl_matches_transformers(tmp_path, family):
    """Qwen2-VL, and Qwen2.5-VL (window attention: the window order is built on the host)."""
    from tests.vl_cases import VL25_CASES, VL_CASES, vl_batch, write_vl_model
    from tests.workers_vl import _family

    name = sorted(VL25_CASES if family == "qwen2_5_vl" else VL_CASES)[0]
    path = write_vl_model(tmp_path, name)
    hf_class, build_parallel_model = _family(path)
    hf = hf_class.from_pretrained(path, dtype=torch.float32).cuda().eval()
    ours = build_parallel_model(path, device="cuda")
    for kind in ("one_image", "mixed"):
        batch = {k: v.cuda() for k, v in vl_batch(name, kind).items() if v is not None}
        ref = hf(**batch)
        out = ours(**batch, gather_logits=True)
        valid = batch["attention_mask"].bool()
        assert _max_diff(out.logits[valid], ref.logits[valid]) <= FP32_TOL, kind
        assert _max_diff(out.loss, ref.loss) <= FP32_TOL, kind
    ref.loss.backward()
    out.loss.backward()
    got = _grads_by_hf_name(ours)
    for name, ref_grad in (("visual.blocks.0.attn.qkv.weight", hf.model.visual.blocks[0].attn.qkv.weight.grad),
                           ("visual.merger.mlp.0.weight", hf.model.visual.merger.mlp[0].weight.grad),
                           ("model.layers.0.self_attn.q_proj.weight",
                            hf.model.language_model.layers[0].self_attn.q_proj.weight.grad)):
        assert _rel(got[name], ref_grad.cpu()) <= GRAD_REL_TOL, name
    assert all(p.is_cuda for p in ours.parameters())


def _nccl_forward_backward(path: str, arch: str, pconfig: dict) -> dict:
    """Rank 0 of a one-rank NCCL group: forward_backward with 2 micro-batches against transformers."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from parallel.config import ParallelConfig

    assert dist.get_backend() == "nccl"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    ours = _build(arch, path, parallel_config=ParallelConfig(**pconfig))
    batch = _batch(hf.config.vocab_size, 10, seed=3)
    ref = hf(**batch)
    ref.loss.backward()
    loss = ours.forward_backward(batch["input_ids"], batch["labels"], attention_mask=batch["attention_mask"],
                                 num_microbatches=2)
    ours.finalize_grads()
    got = _grads_by_hf_name(ours)
    grads = {n: _rel(got[n], p.grad.float().cpu()) for n, p in hf.named_parameters() if p.grad is not None and n in got}
    # forward_only: per-token log-probs laid out like the inputs, on their device
    logp = ours.forward_backward(batch["input_ids"], batch["labels"], attention_mask=batch["attention_mask"],
                                 num_microbatches=2, forward_only=True)
    with torch.no_grad():
        ref_logp = torch.log_softmax(hf(**batch).logits.float(), -1)[:, :-1].gather(
            -1, batch["input_ids"][:, 1:, None].clamp(min=0))[..., 0]
    scored = batch["labels"][:, 1:] != -100
    return {"loss": abs(float(loss) - ref.loss.item()), "grads": grads, "logp_device": str(logp.device),
            "logp": _max_diff(logp[:, 1:][scored], ref_logp[scored])}


@pytest.mark.parametrize("pconfig", [{}, {"fsdp": True}, {"recompute": "full"}], ids=["plain", "fsdp2", "recompute"])
def test_nccl_process_group_forward_backward_matches_transformers(text_dirs, pconfig):
    from tests.distributed import run_distributed

    (result,) = run_distributed(1, _nccl_forward_backward, text_dirs["qwen2_untied"], "qwen2", pconfig,
                                backend="nccl")
    assert result["loss"] <= FP32_TOL, result["loss"]
    assert result["grads"] and max(result["grads"].values()) <= GRAD_REL_TOL, result["grads"]
    assert result["logp_device"].startswith("cuda") and result["logp"] <= FP32_TOL, result


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_cuda_qwen2_vl_forward_backward_matches_transformers(tmp_path, family):
    """Micro-batched training on CUDA with images: the micro-batches are planned on the host and
    must reach the GPU with their pixels (Qwen2.5-VL: and its videos' second_per_grid_ts)."""
    from tests.vl_cases import VL25_CASES, VL_CASES, vl_batch, write_vl_model
    from tests.workers_vl import _family

    name = sorted(VL25_CASES if family == "qwen2_5_vl" else VL_CASES)[0]
    path = write_vl_model(tmp_path, name)
    hf_class, build_parallel_model = _family(path)
    hf = hf_class.from_pretrained(path, dtype=torch.float32).cuda()
    ours = build_parallel_model(path, device="cuda")
    batch = {k: v.cuda() for k, v in vl_batch(name, "mixed").items() if v is not None}
    ref = hf(**batch)
    ref.loss.backward()
    loss = ours.forward_backward(**batch, num_microbatches=2)
    assert abs(float(loss) - ref.loss.item()) <= FP32_TOL
    got = _grads_by_hf_name(ours)
    assert _rel(got["visual.blocks.0.attn.qkv.weight"], hf.model.visual.blocks[0].attn.qkv.weight.grad.cpu()) \
        <= GRAD_REL_TOL
