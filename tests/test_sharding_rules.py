"""Property tests of the pure sharding rules (parallel/sharding.py) and the pipeline layer layout.

Every expectation is computed here with plain torch slicing / arithmetic, never with the rules
themselves: a rule's shard for rank r is compared with the rows/columns written out by hand, and
merging every rank's shard must give back the original tensor bit for bit.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parallel.config import ParallelConfig, ParallelConfigError
from parallel.pipeline_layout import stage_layer_ranges
from parallel.sharding import KVHeads, Packed, Piece, Replicated, ShardingError, Split, Vocab, read_piece

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _tensor(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float32).to(dtype)


def _rows(t: torch.Tensor, start: int, stop: int, dim: int = 0) -> torch.Tensor:
    """``t[..., start:stop, ...]`` along ``dim`` by plain indexing."""
    index = [slice(None)] * t.dim()
    index[dim] = slice(start, stop)
    return t[tuple(index)]


def _assert_owned(shard: torch.Tensor, full: torch.Tensor) -> None:
    """A shard is a new tensor: writing into it leaves the full tensor untouched."""
    before = full.clone()
    shard.fill_(123)
    assert torch.equal(full, before), "shard aliases the full tensor's memory"


# ------------------------------------------------------------------ Split


@st.composite
def split_cases(draw):
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(0, ndim - 1))
    n = draw(st.integers(1, 8))
    shape = [draw(st.integers(1, 5)) for _ in range(ndim)]
    shape[dim] = n * draw(st.integers(1, 4))
    return shape, dim, n, draw(st.integers(0, 2**31 - 1)), draw(st.sampled_from(DTYPES))


@SETTINGS
@given(split_cases())
def test_split_shards_are_contiguous_chunks_and_merge_back(case):
    shape, dim, n, seed, dtype = case
    full = _tensor(shape, seed, dtype)
    rule = Split(dim)
    per = shape[dim] // n
    shards = rule.split_all(full, n)
    assert len(shards) == n
    for r, shard in enumerate(shards):
        expected = _rows(full, r * per, (r + 1) * per, dim)
        assert shard.dtype == dtype
        assert shard.is_contiguous()
        assert torch.equal(shard, expected), f"rank {r} of {n}, dim {dim}, shape {shape}"
        assert rule.shard_shape(shape, n) == tuple(expected.shape)
    merged = rule.merge(shards)
    assert torch.equal(merged, full)
    _assert_owned(shards[0], full)


@SETTINGS
@given(st.integers(1, 16), st.integers(1, 8), st.integers(0, 1000))
def test_split_along_missing_dim_replicates_1d_bias(length, n, seed):
    bias = _tensor([length], seed)
    shards = Split(1).split_all(bias, n)
    for shard in shards:
        assert torch.equal(shard, bias)
    assert torch.equal(Split(1).merge(shards), bias)
    _assert_owned(shards[-1], bias)


def test_replicated_copies_whole_tensor():
    full = _tensor([3, 5], 0)
    shards = Replicated().split_all(full, 4)
    assert all(torch.equal(s, full) for s in shards)
    assert torch.equal(Replicated().merge(shards), full)
    _assert_owned(shards[1], full)


# ------------------------------------------------------------------ KV heads


def _expected_kv(full: torch.Tensor, kv: int, head_dim: int, r: int, n: int) -> torch.Tensor:
    if kv % n == 0:
        heads_per_rank = kv // n
        return full[r * heads_per_rank * head_dim:(r + 1) * heads_per_rank * head_dim]
    assert n % kv == 0
    head = r // (n // kv)
    return full[head * head_dim:(head + 1) * head_dim]


@st.composite
def kv_cases(draw):
    kv = draw(st.integers(1, 8))
    head_dim = draw(st.integers(1, 4))
    if draw(st.booleans()):
        n = draw(st.sampled_from([d for d in range(1, kv + 1) if kv % d == 0]))  # heads split
    else:
        n = kv * draw(st.integers(1, 4))  # heads replicated n / kv times
    cols = draw(st.one_of(st.none(), st.integers(1, 5)))  # None: a 1-D bias
    return kv, head_dim, n, cols, draw(st.integers(0, 2**31 - 1))


@SETTINGS
@given(kv_cases())
def test_kv_heads_shards_and_merge(case):
    kv, head_dim, n, cols, seed = case
    shape = [kv * head_dim] + ([] if cols is None else [cols])
    full = _tensor(shape, seed)
    rule = KVHeads(head_dim, kv)
    shards = rule.split_all(full, n)
    for r, shard in enumerate(shards):
        expected = _expected_kv(full, kv, head_dim, r, n)
        assert torch.equal(shard, expected), f"kv={kv} head_dim={head_dim} rank {r} of {n}"
    if n % kv == 0 and n > kv:
        # every head is held by exactly n/kv consecutive ranks
        for head in range(kv):
            holders = [r for r in range(n) if torch.equal(shards[r], full[head * head_dim:(head + 1) * head_dim])]
            assert len(holders) >= n // kv
    assert torch.equal(rule.merge(shards), full)
    _assert_owned(shards[0], full)


# ------------------------------------------------------------------ vocabulary


@st.composite
def vocab_cases(draw):
    vocab = draw(st.integers(1, 150))
    n = draw(st.integers(1, 8))
    extra = draw(st.integers(0, 40))
    padded = -(-(vocab + extra) // n) * n
    hidden = draw(st.integers(1, 4))
    return vocab, padded, n, hidden, draw(st.integers(0, 2**31 - 1)), draw(st.sampled_from(DTYPES))


@SETTINGS
@given(vocab_cases())
def test_vocab_shards_are_rows_of_zero_padded_table(case):
    vocab, padded, n, hidden, seed, dtype = case
    full = _tensor([vocab, hidden], seed, dtype)
    padded_full = torch.cat([full, torch.zeros(padded - vocab, hidden, dtype=dtype)], dim=0)
    per = padded // n
    rule = Vocab(vocab, padded)
    shards = rule.split_all(full, n)
    for r, shard in enumerate(shards):
        assert shard.dtype == dtype
        assert torch.equal(shard, padded_full[r * per:(r + 1) * per]), f"vocab {vocab} padded {padded} rank {r}/{n}"
        assert tuple(shard.shape) == rule.shard_shape(full.shape, n)
    merged = rule.merge(shards)
    assert merged.shape == full.shape
    assert torch.equal(merged, full)


# ------------------------------------------------------------------ packed q|k|v


@st.composite
def qkv_cases(draw):
    kv = draw(st.integers(1, 4))
    group = draw(st.integers(1, 3))
    heads = kv * group
    head_dim = draw(st.integers(1, 4))
    sizes = [n for n in range(1, 9) if heads % n == 0 and (kv % n == 0 or n % kv == 0)]
    n = draw(st.sampled_from(sizes))
    cols = draw(st.one_of(st.none(), st.integers(1, 4)))
    return heads, kv, head_dim, n, cols, draw(st.integers(0, 2**31 - 1))


@SETTINGS
@given(qkv_cases())
def test_packed_qkv_pack_and_merge(case):
    heads, kv, head_dim, n, cols, seed = case
    tail = [] if cols is None else [cols]
    q = _tensor([heads * head_dim] + tail, seed)
    k = _tensor([kv * head_dim] + tail, seed + 1)
    v = _tensor([kv * head_dim] + tail, seed + 2)
    packed = Packed((("q", Split(0)), ("k", KVHeads(head_dim, kv)), ("v", KVHeads(head_dim, kv))))
    q_per = heads * head_dim // n
    shards = []
    for r in range(n):
        expected = torch.cat([q[r * q_per:(r + 1) * q_per], _expected_kv(k, kv, head_dim, r, n),
                              _expected_kv(v, kv, head_dim, r, n)], dim=0)
        shard = packed.pack([q, k, v], r, n)
        assert torch.equal(shard, expected), f"heads={heads} kv={kv} head_dim={head_dim} rank {r}/{n}"
        shards.append(shard)
    merged = packed.merge(shards, [q.shape, k.shape, v.shape])
    assert len(merged) == 3
    for got, want in zip(merged, (q, k, v)):
        assert torch.equal(got, want)


@SETTINGS
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4), st.integers(0, 10**6))
def test_packed_gate_up_pack_and_merge(n, per_rank, cols, seed):
    gate = _tensor([n * per_rank, cols], seed)
    up = _tensor([n * per_rank, cols], seed + 7)
    packed = Packed((("gate", Split(0)), ("up", Split(0))))
    shards = [packed.pack([gate, up], r, n) for r in range(n)]
    for r, shard in enumerate(shards):
        rows = slice(r * per_rank, (r + 1) * per_rank)
        assert torch.equal(shard, torch.cat([gate[rows], up[rows]]))
    merged = packed.merge(shards, [gate.shape, up.shape])
    assert torch.equal(merged[0], gate) and torch.equal(merged[1], up)


# ------------------------------------------------------------------ lazy safetensors reads


@st.composite
def lazy_cases(draw):
    n = draw(st.integers(1, 4))
    kv = draw(st.sampled_from([d for d in (1, 2, 4, 8) if d % n == 0 or n % d == 0]))
    head_dim = draw(st.integers(1, 3))
    hidden = n * draw(st.integers(1, 3))
    vocab = draw(st.integers(1, 30))
    padded = -(-(vocab + draw(st.integers(0, 20))) // n) * n
    return n, kv, head_dim, hidden, vocab, padded, draw(st.integers(0, 2**31 - 1)), draw(st.sampled_from(DTYPES))


@SETTINGS
@given(lazy_cases())
def test_read_piece_from_lazy_safetensors_slice_equals_in_memory_split(case):
    from safetensors import safe_open
    from safetensors.torch import save_file

    n, kv, head_dim, hidden, vocab, padded, seed, dtype = case
    tensors = {
        "col": _tensor([hidden * 2, hidden], seed, dtype),
        "row": _tensor([hidden, hidden * 2], seed + 1, dtype),
        "kv": _tensor([kv * head_dim, hidden], seed + 2, dtype),
        "kv_bias": _tensor([kv * head_dim], seed + 3, dtype),
        "vocab": _tensor([vocab, hidden], seed + 4, dtype),
        "norm": _tensor([hidden], seed + 5, dtype),
    }
    rules = {
        "col": Split(0), "row": Split(1), "kv": KVHeads(head_dim, kv), "kv_bias": KVHeads(head_dim, kv),
        "vocab": Vocab(vocab, padded), "norm": Replicated(),
    }
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "t.safetensors"
        save_file(tensors, str(path))
        with safe_open(str(path), framework="pt") as f:
            for name, rule in rules.items():
                full = tensors[name]
                for r in range(n):
                    lazy = f.get_slice(name)
                    shape = tuple(lazy.get_shape())
                    assert shape == tuple(full.shape)
                    got = read_piece(lambda idx, lazy=lazy: lazy[idx], shape, rule.piece(shape, r, n))
                    want = rule.split(full, r, n)
                    assert got.dtype == dtype
                    assert torch.equal(got, want), f"{name} rank {r}/{n}"
                    # and both agree with explicit slicing for the split rules
                    if name == "col":
                        per = full.shape[0] // n
                        assert torch.equal(got, full[r * per:(r + 1) * per])
                    elif name == "row":
                        per = full.shape[1] // n
                        assert torch.equal(got, full[:, r * per:(r + 1) * per])
                    elif name == "vocab":
                        per = padded // n
                        pad = torch.cat([full, torch.zeros(padded - vocab, hidden, dtype=dtype)])
                        assert torch.equal(got, pad[r * per:(r + 1) * per])
                    elif name.startswith("kv"):
                        assert torch.equal(got, _expected_kv(full, kv, head_dim, r, n))


def test_read_piece_casts_dtype_and_pads_beyond_end():
    full = _tensor([5, 3], 1)
    got = read_piece(lambda idx: full[idx], (5, 3), Piece(0, 4, 8), torch.float64)
    want = torch.cat([full[4:5], torch.zeros(3, 3)]).to(torch.float64)
    assert got.dtype == torch.float64
    assert torch.equal(got, want)
    # a piece entirely in the padding
    got = read_piece(lambda idx: full[idx], (5, 3), Piece(0, 6, 8))
    assert torch.equal(got, torch.zeros(2, 3))


# ------------------------------------------------------------------ padded vocabulary size


@SETTINGS
@given(st.integers(1, 300_000), st.integers(1, 16))
def test_padded_vocab_size_is_minimal_multiple_of_64_and_tp(vocab, tp):
    padded = ParallelConfig(tp=tp).padded_vocab_size(vocab)
    assert padded >= vocab
    assert padded % 64 == 0 and padded % tp == 0
    # minimal: no smaller multiple of 64 that is >= vocab is also divisible by tp
    smaller = padded - 64
    while smaller >= vocab:
        assert smaller % tp != 0, f"{smaller} would do for vocab={vocab} tp={tp}"
        smaller -= 64
    lcm = 64 * tp // math.gcd(64, tp)
    assert padded == -(-vocab // lcm) * lcm
    if (-(-vocab // 64) * 64) % tp == 0:
        assert padded == -(-vocab // 64) * 64  # vLLM's ceil(V/64)*64


@SETTINGS
@given(st.integers(1, 5000), st.integers(1, 12), st.integers(1, 100))
def test_padded_vocab_size_other_multiples(vocab, tp, multiple):
    padded = ParallelConfig(tp=tp, vocab_padding_multiple=multiple).padded_vocab_size(vocab)
    lcm = multiple * tp // math.gcd(multiple, tp)
    assert padded == -(-vocab // lcm) * lcm


# ------------------------------------------------------------------ errors


def test_split_not_divisible_raises():
    with pytest.raises(ShardingError, match="7"):
        Split(0).piece((7, 3), 0, 2)
    with pytest.raises(ShardingError):
        Split(1).split(torch.zeros(4, 5), 1, 2)
    with pytest.raises(ShardingError):
        Split(0).split_all(torch.zeros(10), 3)


def test_rank_out_of_range_raises():
    with pytest.raises(ShardingError):
        Split(0).piece((8,), 2, 2)
    with pytest.raises(ShardingError):
        Split(0).piece((8,), -1, 2)
    with pytest.raises(ShardingError):
        Replicated().piece((8,), 3, 2)
    with pytest.raises(ShardingError):
        KVHeads(2, 2).piece((4, 3), 4, 4)


@pytest.mark.parametrize("kv,n", [(3, 2), (2, 3), (4, 6), (6, 4), (3, 4)])
def test_kv_heads_neither_dividing_raises(kv, n):
    rule = KVHeads(2, kv)
    with pytest.raises(ShardingError, match=str(kv)):
        rule.piece((kv * 2, 5), 0, n)
    with pytest.raises(ShardingError):
        rule.split(torch.zeros(kv * 2, 5), 0, n)
    with pytest.raises(ShardingError):
        rule.merge([torch.zeros(2, 5)] * n)


def test_kv_heads_wrong_rows_raises():
    with pytest.raises(ShardingError):
        KVHeads(4, 2).piece((12, 3), 0, 2)


def test_vocab_errors():
    with pytest.raises(ShardingError):
        Vocab(10, 8).piece((10, 3), 0, 2)  # padded smaller than vocab
    with pytest.raises(ShardingError):
        Vocab(10, 15).piece((10, 3), 0, 2)  # padded not divisible by ranks
    with pytest.raises(ShardingError):
        Vocab(10, 16).piece((11, 3), 0, 2)  # tensor is not the declared vocabulary


def test_packed_unpack_wrong_rows_raises():
    packed = Packed((("q", Split(0)), ("k", KVHeads(2, 2)), ("v", KVHeads(2, 2))))
    with pytest.raises(ShardingError):
        packed.unpack(torch.zeros(7, 3), [(8, 3), (4, 3), (4, 3)], 2)  # needs 4 + 2 + 2 = 8 rows


def test_sharding_error_is_value_error():
    assert issubclass(ShardingError, ValueError)


# ------------------------------------------------------------------ pipeline layout


def _flatten(ranges):
    return [i for stage in ranges for chunk in stage for i in chunk]


@st.composite
def even_layouts(draw):
    pp = draw(st.integers(1, 6))
    vpp = 1 if pp == 1 else draw(st.integers(1, 4))
    per_chunk = draw(st.integers(1, 4))
    return pp, vpp, pp * vpp * per_chunk


@SETTINGS
@given(even_layouts())
def test_even_pipeline_split_follows_megatron_interleaving(case):
    pp, vpp, L = case
    ranges = stage_layer_ranges(L, ParallelConfig(pp=pp, vpp=vpp))
    assert len(ranges) == pp and all(len(stage) == vpp for stage in ranges)
    assert sorted(_flatten(ranges)) == list(range(L))  # every layer exactly once
    per_chunk = L // (pp * vpp)
    for p in range(pp):
        for v in range(vpp):
            start = v * (L // vpp) + p * (L // (pp * vpp))
            assert list(ranges[p][v]) == list(range(start, start + per_chunk)), f"pp={pp} vpp={vpp} L={L} p={p} v={v}"
    # Megatron's interleaved forward order (chunk-major, then rank) walks the layers in order
    walk = [i for v in range(vpp) for p in range(pp) for i in ranges[p][v]]
    assert walk == list(range(L))


@st.composite
def uneven_layouts(draw):
    pp = draw(st.integers(2, 6))
    first = draw(st.one_of(st.none(), st.integers(1, 6)))
    last = draw(st.one_of(st.none(), st.integers(1, 6)))
    if first is None and last is None:
        first = draw(st.integers(1, 6))
    free = pp - (first is not None) - (last is not None)
    middle = draw(st.integers(1, 4)) if free else 0
    L = (first or 0) + (last or 0) + free * middle
    return pp, first, last, middle, L


@SETTINGS
@given(uneven_layouts())
def test_uneven_pipeline_split_respects_first_and_last(case):
    pp, first, last, middle, L = case
    cfg = ParallelConfig(pp=pp, num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
    ranges = stage_layer_ranges(L, cfg)
    assert len(ranges) == pp and all(len(stage) == 1 for stage in ranges)
    counts = [len(stage[0]) for stage in ranges]
    expected = [middle] * pp
    if first is not None:
        expected[0] = first
    if last is not None:
        expected[-1] = last
    assert counts == expected
    assert _flatten(ranges) == list(range(L))  # consecutive, in stage order, each layer once


@pytest.mark.parametrize("L,kw", [
    (10, dict(pp=4)),  # 10 % 4
    (8, dict(pp=2, vpp=3)),  # 8 % 6
    (3, dict(pp=4)),  # fewer layers than stages
    (0, dict(pp=1)),
    (8, dict(pp=2, vpp=2, num_layers_in_first_pipeline_stage=3)),  # uneven + vpp
    (10, dict(pp=4, num_layers_in_first_pipeline_stage=3)),  # 7 left for 3 stages
    (5, dict(pp=3, num_layers_in_first_pipeline_stage=3, num_layers_in_last_pipeline_stage=2)),  # 0 left for middle
    (6, dict(pp=2, num_layers_in_first_pipeline_stage=3, num_layers_in_last_pipeline_stage=2)),  # 3+2 != 6
    (4, dict(pp=2, num_layers_in_first_pipeline_stage=5)),  # more than all layers
])
def test_bad_pipeline_splits_raise(L, kw):
    with pytest.raises(ParallelConfigError):
        stage_layer_ranges(L, ParallelConfig(**kw))


def test_uneven_control_cases():
    cfg = ParallelConfig(pp=3, num_layers_in_first_pipeline_stage=3, num_layers_in_last_pipeline_stage=3)
    assert [list(s[0]) for s in stage_layer_ranges(8, cfg)] == [[0, 1, 2], [3, 4], [5, 6, 7]]
    cfg = ParallelConfig(pp=4, num_layers_in_last_pipeline_stage=1)
    assert [list(s[0]) for s in stage_layer_ranges(7, cfg)] == [[0, 1], [2, 3], [4, 5], [6]]


def test_pipeline_config_errors():
    with pytest.raises(ParallelConfigError):
        ParallelConfig(vpp=2)  # vpp without pp
    with pytest.raises(ParallelConfigError):
        ParallelConfig(num_layers_in_first_pipeline_stage=2)  # uneven without pp
    with pytest.raises(ParallelConfigError):
        ParallelConfig(pp=2, num_layers_in_last_pipeline_stage=0)
    assert issubclass(ParallelConfigError, ValueError)
