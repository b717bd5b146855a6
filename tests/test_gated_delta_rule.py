"""The gated delta rule kernel (parallel/gated_delta_rule.py) and the ``Blocks`` sharding rule:

  * chunked form == recurrent form (the definition), outputs, final states and gradients, fp64 to
    ~1e-12 and fp32 to ~1e-6, with GQA-style value heads, lengths not a multiple of the chunk;
  * packed batches (``cu_seqlens``, an empty sequence and a one-token one among them): each sequence
    equal to itself run alone, initial states applied per sequence, final states per sequence;
  * the causal depthwise conv restarts its window at every sequence (against F.conv1d per sequence,
    outputs and gradients);
  * transformers' own torch chunked kernel agrees (fp32, unpacked), outputs and gradients;
  * the chunked form's pieces: the blocked triangular inverse against LAPACK's solve (fp64, chunk
    sizes that are and are not 16 * 2^j), chunk sizes 5/48/128 and packed gradients (the state scan's
    per-sequence backward, initial states included) against the recurrent form in fp64;
  * the kernel dispatch on CPU: automatic and ``PMZ_GDN_KERNEL=torch`` run the torch forms, fla asked
    for without CUDA/fla is refused in one line (the fla kernels themselves: tests/test_gpu_gdn.py);
  * ``Blocks`` splits unequal q/k/v blocks per rank, merges back, and reads the same rows lazily.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallel.gated_delta_rule import causal_conv1d, gated_delta_rule, positions_in_sequence
from parallel.sharding import Blocks, Packed, Split, read_piece

LENGTHS = [70, 1, 0, 130, 64, 3]


def _inputs(b, t, dtype, hk=2, hv=4, dk=16, dv=24, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    q, k, v = rnd(b, t, hk, dk), rnd(b, t, hk, dk), rnd(b, t, hv, dv)
    g = -torch.rand(b, t, hv, generator=gen, dtype=torch.float64).to(dtype) * 0.5
    beta = torch.rand(b, t, hv, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_chunked_equals_recurrent(dtype, tol):
    q, k, v, g, beta = _inputs(2, 150, dtype)
    init = torch.randn(2, 4, 16, 24, dtype=dtype)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, init)]
    results = {}
    for form in ("chunked", "recurrent"):
        xs = [x.detach().clone().requires_grad_() for x in leaves]
        o, s = gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, use_qk_l2norm=True, form=form)
        ((o * torch.linspace(-1, 1, o.numel(), dtype=dtype).view_as(o)).sum() + s.square().sum()).backward()
        results[form] = (o, s, [x.grad for x in xs])
    (oc, sc, gc), (orr, sr, gr) = results["chunked"], results["recurrent"]
    assert (oc - orr).abs().max().item() < tol
    assert (sc - sr).abs().max().item() < tol
    for a, b in zip(gc, gr):
        assert ((a - b).abs().max() / b.abs().max()).item() < 10 * tol


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_packed_equals_each_sequence_alone(form):
    cu = torch.tensor([0] + LENGTHS).cumsum(0)
    total = int(cu[-1])
    q, k, v, g, beta = _inputs(1, total, torch.float64, seed=1)
    init = torch.randn(len(LENGTHS), 4, 16, 24, dtype=torch.float64)
    o, s = gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, initial_state=init, output_final_state=True,
                            use_qk_l2norm=True, form=form, chunk_size=16)
    for j, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if e == a:
            assert torch.equal(s[j], init[j]), "an empty sequence keeps its initial state"
            continue
        alone, state = gated_delta_rule(q[:, a:e], k[:, a:e], v[:, a:e], g[:, a:e], beta[:, a:e],
                                        initial_state=init[j:j + 1], output_final_state=True, use_qk_l2norm=True,
                                        form="recurrent")
        assert (alone - o[:, a:e]).abs().max().item() < 1e-12
        assert (state - s[j:j + 1]).abs().max().item() < 1e-12


def test_padded_rows_are_independent_sequences():
    q, k, v, g, beta = _inputs(3, 40, torch.float64, seed=2)
    o = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True, chunk_size=16)
    for r in range(3):
        alone = gated_delta_rule(q[r:r + 1], k[r:r + 1], v[r:r + 1], g[r:r + 1], beta[r:r + 1], use_qk_l2norm=True,
                                 form="recurrent")
        assert (alone - o[r:r + 1]).abs().max().item() < 1e-12


def test_transformers_chunked_kernel_agrees():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    theirs_fn = getattr(hf.torch_chunk_gated_delta_rule, "__wrapped__", hf.torch_chunk_gated_delta_rule)
    inputs = _inputs(2, 100, torch.float32, seed=3)
    results = []
    for fn in (lambda *x: gated_delta_rule(*x, use_qk_l2norm=True),
               lambda *x: theirs_fn(*x, use_qk_l2norm_in_kernel=True)[0]):
        xs = [x.clone().requires_grad_() for x in inputs]
        o = fn(*xs)
        (o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum().backward()
        results.append([o] + [x.grad for x in xs])
    assert (results[0][0] - results[1][0]).abs().max().item() < 2e-6
    for a, b in zip(results[0][1:], results[1][1:]):
        assert ((a - b).abs().max() / b.abs().max()).item() < 1e-5


def test_unit_lower_inverse_matches_lapack():
    from parallel.gated_delta_chunk import _unit_lower_inverse

    gen = torch.Generator().manual_seed(4)
    for c in (1, 5, 16, 48, 64, 100):
        a = (torch.randn(3, c, c, generator=gen, dtype=torch.float64) * 0.3).tril(-1)
        eye = torch.eye(c, dtype=torch.float64)
        ref = torch.linalg.solve_triangular(eye + a, eye.expand(3, c, c), upper=False, unitriangular=True)
        assert (_unit_lower_inverse(a) - ref).abs().max().item() < 1e-12, c


def _forms_agree(inputs, tol, **kw):
    """Chunked and recurrent forms on the same leaves: outputs, final states and every gradient."""
    results = []
    for form in ("chunked", "recurrent"):
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        o, s = gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, use_qk_l2norm=True,
                                form=form, **kw)
        ((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum() + s.square().sum()).backward()
        results.append([o, s] + [x.grad for x in xs])
    for i, (a, b) in enumerate(zip(*results)):
        assert ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() < tol, i


@pytest.mark.parametrize("chunk_size", [5, 48, 128])
def test_chunk_sizes_equal_recurrent(chunk_size):
    q, k, v, g, beta = _inputs(2, 100, torch.float64, seed=5)
    _forms_agree([q, k, v, g, beta, torch.randn(2, 4, 16, 24, dtype=torch.float64)], 1e-10, chunk_size=chunk_size)


def test_packed_gradients_equal_recurrent():
    cu = torch.tensor([0] + LENGTHS).cumsum(0)
    q, k, v, g, beta = _inputs(1, int(cu[-1]), torch.float64, seed=6)
    init = torch.randn(len(LENGTHS), 4, 16, 24, dtype=torch.float64)
    _forms_agree([q, k, v, g, beta, init], 1e-10, cu_seqlens=cu, chunk_size=16)


def test_kernel_dispatch_on_cpu(monkeypatch):
    from parallel.gated_delta_rule import KERNEL_ENV, delta_rule_kernel

    q = torch.zeros(1, 4, 2, 8)
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    assert delta_rule_kernel(q) == delta_rule_kernel(q.bfloat16()) == "torch"
    with pytest.raises(ValueError, match=r"kernel='fla' needs CUDA bf16/fp16 tensors and fla-core installed; got cpu"):
        gated_delta_rule(q, q, q, q[..., 0], q[..., 0], kernel="fla")
    monkeypatch.setenv(KERNEL_ENV, "torch")
    assert delta_rule_kernel(q.bfloat16()) == "torch"
    monkeypatch.setenv(KERNEL_ENV, "triton")
    with pytest.raises(ValueError, match=r"PMZ_GDN_KERNEL='triton': expected one of \('torch', 'fla'\)"):
        delta_rule_kernel(q)


def test_conv_window_restarts_per_sequence():
    cu = torch.tensor([0] + LENGTHS).cumsum(0)
    total = int(cu[-1])
    x, w = torch.randn(1, total, 10, dtype=torch.float64), torch.randn(10, 4, dtype=torch.float64)
    weights = torch.randn(1, total, 10, dtype=torch.float64)
    grads = []
    for ours in (True, False):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        if ours:
            got = causal_conv1d(xs, ws, positions_in_sequence(cu, total))
            out = got
        else:  # F.conv1d on each sequence alone
            out = torch.cat([F.conv1d(xs[:, a:e].transpose(1, 2), ws[:, None], padding=3, groups=10)[:, :, : e - a]
                             .transpose(1, 2) for a, e in zip(cu[:-1].tolist(), cu[1:].tolist()) if e > a], dim=1)
            assert (got - out).abs().max().item() < 1e-12
        (out * weights).sum().backward()
        grads.append((xs.grad, ws.grad))
    for a, b in zip(*grads):
        assert (a - b).abs().max().item() < 1e-12, "gradients of x and the weight"
    ref = F.conv1d(x.transpose(1, 2), w[:, None], padding=3, groups=10)[:, :, :total].transpose(1, 2)
    assert (causal_conv1d(x, w) - ref).abs().max().item() < 1e-12  # no positions: one sequence per row


def test_bad_kernel_input_refused():
    q, k, v, g, beta = _inputs(2, 10, torch.float32)
    with pytest.raises(ValueError, match="batch 1"):
        gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 10]))
    with pytest.raises(ValueError, match=r"cu_seqlens must rise from 0 to the token count 10"):
        gated_delta_rule(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="multiple of key heads"):
        gated_delta_rule(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])


def test_blocks_rule_split_merge_and_lazy_read():
    sizes = (8, 8, 12)  # q, k of Hk*dk rows, v of Hv*dv rows
    full = torch.arange(28 * 3, dtype=torch.float32).reshape(28, 3)
    rule = Blocks(sizes)
    shards = rule.split_all(full, 2)
    assert shards[1][:, 0].tolist() == [12, 15, 18, 21, 36, 39, 42, 45, 66, 69, 72, 75, 78, 81]
    assert torch.equal(rule.merge(shards), full)
    assert rule.shard_shape((28, 3), 2) == (14, 3)
    piece = rule.piece((28, 3), 1, 4)
    assert piece.ranges(28) == [(2, 4, 0), (10, 12, 2), (19, 22, 4)]
    assert torch.equal(read_piece(lambda idx: full[idx], (28, 3), piece), rule.split(full, 1, 4))
    packed = Packed((("qkv", rule), ("z", Split(0))))  # in_proj_qkvz = [q_r | k_r | v_r | z_r]
    z = torch.randn(12, 3)
    merged = packed.merge([packed.pack([full, z], r, 2) for r in range(2)], [(28, 3), (12, 3)])
    assert torch.equal(merged[0], full) and torch.equal(merged[1], z)
    with pytest.raises(ValueError, match=r"does not stack blocks of \[8, 8, 12\] rows"):
        rule.piece((27, 3), 0, 2)
    with pytest.raises(ValueError, match="not divisible by 8"):
        rule.piece((28, 3), 0, 8)
