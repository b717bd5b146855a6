"""The CUDA kernel choices, checked on a CPU with the device facts faked: which kernel each dispatch picks
for a device (CUDA or not, compute capability), dtype, shape and the libraries present, and the
fallbacks when a library is missing, does not import, or refuses a shape. Tables of
``(device, dtype, shape, libraries) -> expected kernel`` for:

  * ``parallel.fused_ops``: RMSNorm (Liger), SwiGLU and rotary (our Triton kernels), and that the
    automatic call reaches the chosen implementation;
  * ``parallel.varlen_kernels``: which attention kernels a device has (``installed_kernels``) and the
    per-call choice (``flash_kernel``; the preference order itself: tests/test_varlen_attention.py);
  * ``parallel.lm_head_loss``: the fused head's chunk size per device, its fp32-accumulating GEMM probe and
    the backward's use of it;
  * ``parallel.experts``: grouped GEMM or the per-expert loop;
  * ``parallel.gated_delta_rule``: flash-linear-attention or the torch forms (``PMZ_GDN_KERNEL``), and
    what the fla path hands the library;
  * ``models.common.compiled_layers``: ``compile=True`` needs Triton on CUDA only.

"Faked" means: ``torch.Tensor.is_cuda``, ``torch.cuda.get_device_capability`` / ``is_available`` and
the cuDNN/flash queries are replaced for one test (monkeypatch), the optional packages are replaced by
stand-in modules or made unimportable (``sys.modules[name] = None``). The tensors stay on the CPU; the
kernels are never run here (tests/test_triton_interpreter.py runs ours in Triton's interpreter)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import parallel
from parallel import experts, fused_ops, gated_delta_rule, lm_head_loss, varlen_kernels

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


def fake_cuda(monkeypatch, capability=(9, 0), on=True):
    """Every tensor reads as a CUDA tensor (``on``) of a device with ``capability``; CUDA is 'available'."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: on))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: on)


def module(name, **attrs):
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


# ---------------------------------------------------------------------- fused elementwise ops
def fused_choices(dtype=BF16, *, hidden=64, swiglu_width=80, d=16, rd=16, weight_dtype=None, residual="same",
                  cos_dtype=None, cos_heads=1, cos_grad=False):
    """(rms_norm, rms_norm with residual, swiglu, rotary) backends for tensors built from these facts."""
    x = torch.zeros(3, 2, hidden, dtype=dtype)
    w = torch.zeros(hidden, dtype=weight_dtype or dtype)
    r = {"same": x, "dtype": x.float() if dtype != FP32 else x.double(), "shape": x[:1]}[residual]
    q = torch.zeros(3, 2, 4, d, dtype=dtype)
    cos = torch.zeros(3, 2, cos_heads, rd, dtype=cos_dtype or dtype, requires_grad=cos_grad)
    return (fused_ops.rms_norm_backend(x, w), fused_ops.rms_norm_backend(x, w, r),
            fused_ops.swiglu_backend(torch.zeros(3, 2, swiglu_width, dtype=dtype)),
            fused_ops.rotary_backend(q, cos, cos))


FUSED_TABLE = [
    # (id, cuda, triton, liger, facts, expected (rms, rms+residual, swiglu, rotary))
    ("cuda bf16, both libraries", True, True, True, {}, ("liger", "liger", "triton", "triton")),
    ("cuda fp16", True, True, True, {"dtype": FP16}, ("liger", "liger", "triton", "triton")),
    ("cuda fp32", True, True, True, {"dtype": FP32}, ("liger", "liger", "triton", "triton")),
    ("cuda fp64: no kernel takes it", True, True, True, {"dtype": FP64}, ("reference",) * 4),
    ("cpu bf16, both libraries", False, True, True, {}, ("reference",) * 4),
    ("cuda bf16, Triton without Liger", True, True, False, {}, ("reference", "reference", "triton", "triton")),
    ("cuda bf16, neither", True, False, False, {}, ("reference",) * 4),
    ("rms weight fp32 under bf16 x (promotes)", True, True, True, {"weight_dtype": FP32},
     ("reference", "reference", "triton", "triton")),
    ("residual of another dtype", True, True, True, {"residual": "dtype"}, ("liger", "reference", "triton", "triton")),
    ("residual broadcast (another shape)", True, True, True, {"residual": "shape"},
     ("liger", "reference", "triton", "triton")),
    ("swiglu odd width", True, True, True, {"swiglu_width": 81}, ("liger", "liger", "reference", "triton")),
    ("partial rotary rd < d", True, True, True, {"d": 32, "rd": 16}, ("liger", "liger", "triton", "triton")),
    ("rotary rd odd", True, True, True, {"rd": 15, "d": 16}, ("liger", "liger", "triton", "reference")),
    ("rotary rd > d", True, True, True, {"rd": 32, "d": 16}, ("liger", "liger", "triton", "reference")),
    ("rotary table of another dtype", True, True, True, {"cos_dtype": FP32}, ("liger", "liger", "triton", "reference")),
    ("rotary table per head", True, True, True, {"cos_heads": 4}, ("liger", "liger", "triton", "reference")),
    ("rotary table needing a gradient", True, True, True, {"cos_grad": True, "cos_dtype": FP32, "dtype": FP32},
     ("liger", "liger", "triton", "reference")),
]


@pytest.mark.parametrize("cuda,triton,liger,facts,want", [t[1:] for t in FUSED_TABLE], ids=[t[0] for t in FUSED_TABLE])
def test_fused_op_backend_table(monkeypatch, cuda, triton, liger, facts, want):
    fake_cuda(monkeypatch, on=cuda)
    monkeypatch.setattr(fused_ops, "_has_triton", lambda: triton)
    monkeypatch.setattr(fused_ops, "_has_liger", lambda: liger)
    assert fused_choices(**facts) == want


@pytest.mark.parametrize("switch", ["PMZ_FUSED=0", "compiling"])
def test_kill_switch_and_tracing_choose_the_reference(monkeypatch, switch):
    fake_cuda(monkeypatch)
    monkeypatch.setattr(fused_ops, "_has_triton", lambda: True)
    monkeypatch.setattr(fused_ops, "_has_liger", lambda: True)
    assert fused_choices() == ("liger", "liger", "triton", "triton")
    if switch == "compiling":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    else:
        monkeypatch.setenv("PMZ_FUSED", "0")
    assert fused_choices() == ("reference",) * 4


def test_library_probes_follow_what_imports(monkeypatch):
    """``_has_triton``/``_has_liger`` (uncached bodies): False when the import fails, Liger never without Triton."""
    monkeypatch.setitem(sys.modules, "triton", None)
    assert fused_ops._has_triton.__wrapped__() is False
    monkeypatch.setitem(sys.modules, "triton", module("triton"))
    monkeypatch.setitem(sys.modules, "triton.language", module("triton.language"))
    assert fused_ops._has_triton.__wrapped__() is True
    names = {"liger_kernel.ops.rms_norm": "LigerRMSNormFunction",
             "liger_kernel.ops.fused_add_rms_norm": "LigerFusedAddRMSNormFunction"}
    for name, attr in names.items():
        monkeypatch.setitem(sys.modules, name, module(name, **{attr: object()}))
    monkeypatch.setattr(fused_ops, "_has_triton", lambda: False)
    assert fused_ops._has_liger.__wrapped__() is False  # Liger's kernels are Triton kernels
    monkeypatch.setattr(fused_ops, "_has_triton", lambda: True)
    assert fused_ops._has_liger.__wrapped__() is True
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.fused_add_rms_norm", None)  # an older Liger without it
    assert fused_ops._has_liger.__wrapped__() is False


def test_automatic_calls_reach_the_chosen_kernel(monkeypatch):
    """With CUDA faked and stand-ins for the kernels, ``rms_norm``/``swiglu``/``apply_rotary`` call exactly
    the implementation their backend names (and the reference where it says so), with Liger's arguments
    (casting mode "llama", not in place)."""
    calls = []

    def recorder(name, result):
        return type(name, (), {"apply": staticmethod(lambda *a: calls.append((name, a[1:] if "Rotary" in name
                                                                              else a[-4:])) or result(*a))})

    fake_kernels = module("parallel.fused_kernels",
                          SwiGLU=recorder("SwiGLU", lambda gu: fused_ops.swiglu_reference(gu)),
                          Rotary=recorder("Rotary", lambda x, c, s: fused_ops.rotary_reference(x, c, s)))
    monkeypatch.setitem(sys.modules, "parallel.fused_kernels", fake_kernels)
    monkeypatch.setattr(parallel, "fused_kernels", fake_kernels, raising=False)
    norm = recorder("LigerRMSNormFunction", lambda x, w, eps, *_: fused_ops.rms_norm_reference(x, w, eps))
    add_norm = recorder("LigerFusedAddRMSNormFunction",
                        lambda x, r, w, eps, *_: (fused_ops.rms_norm_reference(x + r, w, eps), x + r))
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.rms_norm", module("m", LigerRMSNormFunction=norm))
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.fused_add_rms_norm",
                        module("m", LigerFusedAddRMSNormFunction=add_norm))
    fake_cuda(monkeypatch)
    monkeypatch.setattr(fused_ops, "_has_triton", lambda: True)
    monkeypatch.setattr(fused_ops, "_has_liger", lambda: True)
    x, w = torch.randn(3, 2, 8, dtype=BF16), torch.ones(8, dtype=BF16)
    fused_ops.rms_norm(x, w, 1e-6)
    fused_ops.rms_norm(x, w, 1e-6, x)
    fused_ops.rms_norm(x, w.float(), 1e-6)  # weight dtype differs: reference, no call
    fused_ops.swiglu(torch.randn(3, 2, 16, dtype=BF16))
    q, k = torch.randn(3, 2, 4, 8, dtype=BF16), torch.randn(3, 2, 2, 8, dtype=FP32)
    cos = torch.randn(3, 2, 1, 8, dtype=BF16)
    fused_ops.apply_rotary(q, k, cos, cos)  # k's dtype differs from the table's: k alone takes the reference
    names = [c[0] for c in calls]
    assert names == ["LigerRMSNormFunction", "LigerFusedAddRMSNormFunction", "SwiGLU", "Rotary"]
    assert calls[0][1] == (1e-6, 0.0, "llama", False) and calls[1][1] == (1e-6, 0.0, "llama", False)
    assert calls[3][1][0] is cos


# ---------------------------------------------------------------------- attention kernels (varlen_kernels)
@pytest.fixture
def clean_attention_caches():
    varlen_kernels.installed_kernels.cache_clear()
    varlen_kernels._torch_flash_on.cache_clear()
    yield
    varlen_kernels.installed_kernels.cache_clear()
    varlen_kernels._torch_flash_on.cache_clear()


def fake_attention_device(monkeypatch, capability, *, flash=True, cudnn=91600, cudnn_sdp=True, impls=(),
                          packages=(), flash_attn=False):
    """A CUDA device of ``capability``: torch's flash kernels built in (``flash``), cuDNN ``cudnn`` (None:
    absent), SDPA's cuDNN backend enabled (``cudnn_sdp``), FlashAttention impls torch can activate
    (``impls``), importable packages (``packages``) and the FA2 package's extension (``flash_attn``)."""
    fake_cuda(monkeypatch, capability)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: flash)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: cudnn is not None)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: cudnn)
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: cudnn_sdp)
    monkeypatch.setattr(varlen_kernels, "_flash_impls", lambda: tuple(impls))
    monkeypatch.setattr(varlen_kernels, "_spec", lambda name: name in packages)
    monkeypatch.setattr(varlen_kernels, "FLASH_ATTN_INSTALLED", flash_attn)


FA3 = {"impls": ("FA3",), "packages": ("flash_attn_interface",)}
FA4 = {"impls": ("FA4",), "packages": ("flash_attn.cute.interface",)}
ATTENTION_DEVICES = [
    # (id, capability, device facts, installed kernels)
    ("H100, torch + cuDNN 9.16", (9, 0), {}, {"torch", "cudnn"}),
    ("H100, cuDNN 9.15.0 (wrong-results bug)", (9, 0), {"cudnn": 91500}, {"torch"}),
    ("H100, no cuDNN", (9, 0), {"cudnn": None}, {"torch"}),
    ("H100, SDPA's cuDNN backend off", (9, 0), {"cudnn_sdp": False}, {"torch"}),
    ("H100, FA3 impl and package", (9, 0), FA3, {"torch", "cudnn", "fa3"}),
    ("H100, FA3 impl without its package", (9, 0), {"impls": ("FA3",)}, {"torch", "cudnn"}),
    ("H100, FA3 package without torch's impl", (9, 0), {"packages": ("flash_attn_interface",)}, {"torch", "cudnn"}),
    ("H100, FA4", (9, 0), FA4, {"torch", "cudnn", "fa4"}),
    ("B200, FA3 and FA4 (FA3 is Hopper only)", (10, 0), {"impls": ("FA3", "FA4"),
                                                         "packages": ("flash_attn_interface",
                                                                      "flash_attn.cute.interface")},
     {"torch", "cudnn", "fa4"}),
    ("A100, FA3/FA4 listed, flash_attn", (8, 0), {"impls": ("FA3", "FA4"), "packages": ("flash_attn_interface",
                                                                                       "flash_attn.cute.interface"),
                                                  "flash_attn": True}, {"torch", "cudnn", "flash_attn"}),
    ("T4 (sm75): nothing", (7, 5), {"flash_attn": True}, set()),
    ("torch built without flash", (9, 0), {"flash": False}, {"cudnn"}),
]


@pytest.mark.parametrize("cap,facts,want", [t[1:] for t in ATTENTION_DEVICES], ids=[t[0] for t in ATTENTION_DEVICES])
def test_installed_attention_kernels_per_device(monkeypatch, clean_attention_caches, cap, facts, want):
    fake_attention_device(monkeypatch, cap, **facts)
    assert varlen_kernels.installed_kernels(torch.device("cuda", 0)) == frozenset(want)


ATTENTION_CALLS = [
    # (id, capability, device facts, q dtype, head dim, need_lse, equal lengths, PMZ_ATTENTION_KERNEL, expected)
    ("H100 bf16 equal lengths: cuDNN", (9, 0), {}, BF16, 64, False, True, None, "cudnn"),
    ("H100 bf16 unequal: torch", (9, 0), {}, BF16, 64, False, False, None, "torch"),
    ("H100 bf16 ring step (lse)", (9, 0), {}, BF16, 64, True, True, None, "torch"),
    ("H100 fp16 with FA3", (9, 0), FA3, FP16, 128, False, False, None, "fa3"),
    ("H100 fp32: exact path", (9, 0), FA3, FP32, 64, False, True, None, None),
    ("H100 fp64: exact path", (9, 0), {}, FP64, 64, False, True, None, None),
    ("head dim 60 (not a multiple of 8)", (9, 0), {}, BF16, 60, False, True, None, None),
    ("head dim 264 (over 256)", (9, 0), {}, BF16, 264, False, False, None, None),
    ("head dim 256", (9, 0), {}, BF16, 256, False, False, None, "torch"),
    ("B200 with FA4", (10, 0), FA4, BF16, 64, False, True, None, "fa4"),
    ("A100 with flash_attn", (8, 0), {"flash_attn": True}, BF16, 64, False, True, None, "flash_attn"),
    ("A100 flash_attn but lse needed", (8, 0), {"flash_attn": True}, BF16, 64, True, False, None, "torch"),
    ("T4: none", (7, 5), {}, BF16, 64, False, True, None, None),
    ("env forces torch over cuDNN", (9, 0), {}, BF16, 64, False, True, "torch", "torch"),
    ("env cudnn on unequal lengths: automatic", (9, 0), FA3, BF16, 64, False, False, "cudnn", "fa3"),
    ("env reference", (9, 0), {}, BF16, 64, False, True, "reference", "reference"),
    ("env on fp32: never consulted", (9, 0), {}, FP32, 64, False, True, "fa4", None),
]


@pytest.mark.parametrize("cap,facts,dtype,d,lse,equal,env,want", [t[1:] for t in ATTENTION_CALLS],
                         ids=[t[0] for t in ATTENTION_CALLS])
def test_attention_kernel_per_call(monkeypatch, clean_attention_caches, cap, facts, dtype, d, lse, equal, env, want):
    fake_attention_device(monkeypatch, cap, **facts)
    if env:
        monkeypatch.setenv(varlen_kernels.KERNEL_ENV, env)
    else:
        monkeypatch.delenv(varlen_kernels.KERNEL_ENV, raising=False)
    q = torch.zeros(4, 2, d, dtype=dtype)
    assert varlen_kernels.flash_kernel(q, need_lse=lse, equal_lengths=equal) == want


def test_attention_override_of_a_missing_kernel_is_refused(monkeypatch, clean_attention_caches):
    fake_attention_device(monkeypatch, (9, 0))
    monkeypatch.setenv(varlen_kernels.KERNEL_ENV, "fa3")
    q = torch.zeros(4, 2, 64, dtype=BF16)
    with pytest.raises(RuntimeError, match="'fa3' was asked for.*sm90.*usable: cudnn, torch"):
        varlen_kernels.flash_kernel(q)
    assert varlen_kernels.flash_kernel(q, override="torch") == "torch"  # the argument beats the variable


def test_lse_layout_is_probed_for_torchs_kernel_only(monkeypatch):
    probed = []
    monkeypatch.setattr(varlen_kernels, "_torch_padded_lse", lambda device: probed.append(device) or True)
    dev = torch.device("cuda", 0)
    assert not varlen_kernels._padded_lse(dev, "fa3") and not varlen_kernels._padded_lse(dev, "fa4") and not probed
    assert varlen_kernels._padded_lse(dev, "torch") and probed == [dev]


# ---------------------------------------------------------------------- the fused LM head / loss
@pytest.mark.parametrize("device,free,vocab,dtype,want", [
    ("cpu", None, 151936, BF16, 441),  # 256 MiB of fp32 logits
    ("cpu", 80 << 30, 151936, BF16, 441),  # free memory is ignored off CUDA
    ("cpu", None, 1000, FP32, 8192),  # capped at MAX_CHUNK_TOKENS
    ("cpu", None, 10 << 20, FP32, 16),  # at least MIN_CHUNK_TOKENS
    ("cuda", 80 << 30, 151936, BF16, 4096),  # plenty of memory: CUDA_CHUNK_TOKENS
    ("cuda", 4 << 30, 151936, BF16, 640),  # 1 GiB (1/4 of free) over 10 B x 151936 per token: 706 -> 640
    ("cuda", 1 << 30, 151936, FP32, 128),  # 256 MiB over 12 B x 151936: 147 -> 128
    ("cuda", 100 << 20, 151936, BF16, 17),  # 25 MiB: 17 rows, below 128: not rounded
    ("cuda", 10 << 20, 151936, BF16, 16),  # 1 row fits: at least MIN_CHUNK_TOKENS
    ("cuda", None, 151936, BF16, 441),  # no free-memory figure: the CPU rule
])
def test_fused_head_chunk_tokens_per_device(device, free, vocab, dtype, want):
    assert lm_head_loss.chunk_tokens_for(free, vocab, dtype, device) == want


class _Probe:
    """``lm_head_loss``'s view of torch with tensors made on the CPU whatever device is asked (the GEMM probe
    then runs here) and ``addmm`` replaced by the given stand-in."""

    def __init__(self, addmm):
        self.addmm = addmm

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def arange(*a, device=None, **k):
        return torch.arange(*a, **k)

    @staticmethod
    def full(*a, device=None, **k):
        return torch.full(*a, **k)


def _accumulating_addmm(acc, a, b, *, out_dtype, out):
    return out.add_(a.to(out_dtype) @ b.to(out_dtype))


def _overwriting_addmm(acc, a, b, *, out_dtype, out):  # beta = 0: the accumulator is lost
    return out.copy_(a.to(out_dtype) @ b.to(out_dtype))


def _old_addmm(acc, a, b, **kwargs):  # a torch without out_dtype
    raise TypeError("addmm() got an unexpected keyword argument 'out_dtype'")


@pytest.mark.parametrize("device,dtype,addmm,want", [
    ("cuda", BF16, _accumulating_addmm, True),
    ("cuda", FP16, _accumulating_addmm, True),
    ("cuda", BF16, _overwriting_addmm, False),
    ("cuda", BF16, _old_addmm, False),
    ("cuda", BF16, None, False),  # the real op: aten::addmm.dtype_out is missing on CPU -> NotImplementedError
    ("cuda", FP32, _accumulating_addmm, False),  # fp32 never takes the in-GEMM path
    ("cpu", BF16, _accumulating_addmm, False),  # CPU keeps the reference path, never probed
])
def test_fused_head_gemm_probe(monkeypatch, device, dtype, addmm, want):
    calls = []
    real = torch.addmm

    def counted(*a, **k):
        calls.append(1)
        return (addmm or real)(*a, **k)

    monkeypatch.setattr(lm_head_loss, "torch", _Probe(counted))
    monkeypatch.setattr(lm_head_loss, "_IN_GEMM", {})
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    assert lm_head_loss.gemm_accumulates_fp32(dev, dtype) is want
    assert lm_head_loss.gemm_accumulates_fp32(dev, dtype) is want  # cached: probed once
    assert len(calls) == (1 if device == "cuda" and dtype in (BF16, FP16) else 0)


@pytest.mark.parametrize("dtype,probe,want_in_gemm", [(BF16, True, True), (BF16, False, False), (FP32, True, False)])
def test_fused_head_backward_takes_the_in_gemm_path_where_probed(monkeypatch, dtype, probe, want_in_gemm):
    """The backward's weight gradient goes through ``addmm(..., out_dtype=float32)`` once per chunk exactly
    when the probe says the GEMM accumulates in fp32 (never in fp32), and gives the product-then-add
    path's gradient to bf16 rounding of the per-chunk products."""
    in_gemm = []

    def addmm(*a, **k):
        if "out_dtype" in k:
            in_gemm.append(1)
            return _accumulating_addmm(*a, **k)
        return torch.addmm(*a, **k)

    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(12, 16, generator=gen).to(dtype)
    weight = (0.3 * torch.randn(24, 16, generator=gen)).to(dtype)
    target = torch.randint(0, 20, (12,), generator=gen)

    def grad_w():
        w = weight.clone().requires_grad_()
        lm_head_loss.linear_cross_entropy(hidden, w, target, vocab_start=0, valid_columns=20, chunk_tokens=5).sum() \
            .backward()
        return w.grad.float()

    reference = grad_w()
    monkeypatch.setattr(lm_head_loss, "torch", _Probe(addmm))
    monkeypatch.setattr(lm_head_loss, "gemm_accumulates_fp32", lambda device, dt: probe)
    got = grad_w()
    assert len(in_gemm) == (3 if want_in_gemm else 0)  # 12 tokens in chunks of 5
    assert (got - reference).abs().max() <= (2e-2 if want_in_gemm else 0) * reference.abs().max()


# ---------------------------------------------------------------------- MoE experts: grouped GEMM or loop
def expert_operands(dtype, hidden=64, inter=32, experts_=4, contiguous=True):
    x = torch.zeros(10, hidden, dtype=dtype)
    w13 = torch.zeros(experts_, 2 * inter, hidden, dtype=dtype)
    w2 = torch.zeros(experts_, hidden, inter, dtype=dtype)
    if not contiguous:
        w2 = torch.zeros(experts_, inter, hidden, dtype=dtype).transpose(1, 2)
    return x, w13, w2


@pytest.mark.parametrize("cuda,cap,dtype,shape,want", [
    (True, (9, 0), BF16, {}, "grouped"),  # Hopper bf16: CUTLASS grouped kernel
    (True, (10, 0), BF16, {}, "grouped"),  # datacenter Blackwell
    (True, (8, 0), BF16, {}, "loop"),  # Ampere: torch's per-group fallback
    (True, (12, 0), BF16, {}, "loop"),  # consumer Blackwell
    (True, (9, 0), FP16, {}, "loop"),
    (True, (9, 0), FP32, {}, "loop"),
    (False, (9, 0), BF16, {}, "loop"),  # CPU: the reference
    (True, (9, 0), BF16, {"hidden": 12}, "loop"),  # 24-byte rows: grouped_mm would refuse them
    (True, (9, 0), BF16, {"inter": 4}, "loop"),  # 8-byte expert width
    (True, (9, 0), BF16, {"contiguous": False}, "loop"),
])
def test_experts_kernel_table(monkeypatch, cuda, cap, dtype, shape, want):
    fake_cuda(monkeypatch, cap, on=cuda)
    assert experts.choose_kernel(*expert_operands(dtype, **shape)) == want
    assert experts.choose_kernel(*expert_operands(dtype, **shape), kernel="loop") == "loop"


def test_experts_mixed_dtypes_stay_on_the_loop(monkeypatch):
    fake_cuda(monkeypatch, (9, 0))
    x, w13, w2 = expert_operands(BF16)
    assert experts.choose_kernel(x, w13, w2.float()) == "loop"


# ---------------------------------------------------------------------- Gated DeltaNet: fla or torch
def fake_fla(monkeypatch, present=True, conv=None):
    calls = []

    def rule(q, k, v, g, beta, **kw):
        calls.append(("rule", q, k, v, kw))
        n = len(kw["cu_seqlens"]) - 1 if kw["cu_seqlens"] is not None else q.shape[0]
        return v.new_zeros(v.shape), torch.full((n, v.shape[2], q.shape[-1], v.shape[-1]), 7.0)

    monkeypatch.setattr(gated_delta_rule, "_fla_delta_rule", lambda: rule if present else None)
    monkeypatch.setattr(gated_delta_rule, "_fla_conv", lambda: conv if present else None)
    return calls


@pytest.mark.parametrize("cuda,dtype,fla,env,kernel,want", [
    (True, BF16, True, None, None, "fla"),
    (True, FP16, True, None, None, "fla"),
    (True, FP32, True, None, None, "torch"),  # fla's kernels in fp32: not taken automatically
    (False, BF16, True, None, None, "torch"),  # CPU
    (True, BF16, False, None, None, "torch"),  # fla-core absent
    (True, BF16, True, "torch", None, "torch"),  # PMZ_GDN_KERNEL=torch
    (True, BF16, True, "fla", None, "fla"),
    (True, FP32, True, "fla", None, "torch"),  # insisted on, but a call fla does not take stays on torch
    (True, BF16, False, "fla", None, ValueError),  # insisted on without fla-core
    (False, BF16, True, "fla", None, ValueError),  # insisted on without CUDA
    (True, BF16, True, "triton", None, ValueError),  # unknown name
    (True, BF16, True, None, "torch", "torch"),
    (True, BF16, True, "fla", "torch", "torch"),  # kernel= beats the variable
    (True, BF16, True, None, "fla", "fla"),
    (True, FP32, True, None, "fla", ValueError),
    (False, BF16, True, None, "fla", ValueError),
    (True, BF16, False, None, "fla", ValueError),
])
def test_gdn_kernel_table(monkeypatch, cuda, dtype, fla, env, kernel, want):
    fake_cuda(monkeypatch, on=cuda)
    fake_fla(monkeypatch, fla)
    if env:
        monkeypatch.setenv(gated_delta_rule.KERNEL_ENV, env)
    else:
        monkeypatch.delenv(gated_delta_rule.KERNEL_ENV, raising=False)
    x = torch.zeros(1, 4, 2, 8, dtype=dtype)
    if want is ValueError:
        with pytest.raises(ValueError):
            gated_delta_rule.delta_rule_kernel(x, kernel)
    else:
        assert gated_delta_rule.delta_rule_kernel(x, kernel) == want


def test_gdn_fla_call_gets_value_heads_and_nonempty_sequences(monkeypatch):
    """What the fla path hands the library: q/k expanded to the value heads, ``cu_seqlens`` without the
    empty sequences, fp32 gates; the final state of an empty sequence is its initial state."""
    fake_cuda(monkeypatch)
    calls = fake_fla(monkeypatch)
    monkeypatch.delenv(gated_delta_rule.KERNEL_ENV, raising=False)
    t, hk, hv, dk, dv = 6, 2, 4, 8, 8
    q, k = torch.randn(1, t, hk, dk, dtype=BF16), torch.randn(1, t, hk, dk, dtype=BF16)
    v = torch.randn(1, t, hv, dv, dtype=BF16)
    g, beta = -torch.rand(1, t, hv, dtype=BF16), torch.rand(1, t, hv, dtype=BF16)
    cu = torch.tensor([0, 2, 2, 6])
    init = torch.randn(3, hv, dk, dv)
    o, final = gated_delta_rule.gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, initial_state=init,
                                                 output_final_state=True)
    (_, fq, fk, fv, kw), = calls
    assert fq.shape[2] == fk.shape[2] == hv and torch.equal(fq[:, :, 1], q[:, :, 0])
    assert torch.equal(fq[:, :, 2], q[:, :, 1]) and torch.equal(fk[:, :, 3], k[:, :, 1])  # head j reads j // 2
    assert kw["cu_seqlens"].tolist() == [0, 2, 6] and torch.equal(kw["initial_state"], init[[0, 2]])
    assert kw["scale"] == dk ** -0.5
    assert torch.equal(final[1], init[1]) and (final[[0, 2]] == 7).all() and o.dtype == BF16
    with pytest.raises(ValueError, match="chunked form only"):
        gated_delta_rule.gated_delta_rule(q, k, v, g, beta, form="recurrent", kernel="fla")
    calls.clear()
    gated_delta_rule.gated_delta_rule(q.float(), k.float(), v.float(), g.float(), beta.float())  # fp32: torch
    assert not calls


@pytest.mark.parametrize("packed,weight_dtype,want_fla", [
    ("none", BF16, True),  # every row one sequence
    ("cu_seqlens", BF16, True),  # packed with cu_seqlens, batch 1
    ("positions only", BF16, False),  # no cu_seqlens for fla: the torch conv restarts at the positions
    ("none", FP32, False),  # weight in another dtype: the torch conv
])
def test_gdn_conv_routing(monkeypatch, packed, weight_dtype, want_fla):
    calls = []

    def conv(x, weight, bias, residual, activation, cu_seqlens, backend="triton"):
        calls.append((cu_seqlens, backend))
        return x.clone(), None

    fake_cuda(monkeypatch)
    fake_fla(monkeypatch, conv=conv)
    monkeypatch.delenv(gated_delta_rule.KERNEL_ENV, raising=False)
    x, w = torch.randn(1, 6, 8, dtype=BF16), torch.randn(8, 4, dtype=weight_dtype)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    pos = gated_delta_rule.positions_in_sequence(cu, 6)
    args = {"none": {}, "cu_seqlens": {"positions": pos, "cu_seqlens": cu}, "positions only": {"positions": pos}}
    gated_delta_rule.causal_conv1d(x, w, **args[packed])
    assert bool(calls) == want_fla
    if calls:
        assert calls[0][1] == "triton"
        assert (calls[0][0] is None) == (packed == "none")
        assert calls[0][0] is None or calls[0][0].dtype == torch.long


def test_gdn_fla_probes(monkeypatch):
    """``_fla_delta_rule``/``_fla_conv`` (uncached bodies): None where fla does not import; the conv only
    with the sequence-first signature (an older head-first release is left alone)."""
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", None)
    monkeypatch.setitem(sys.modules, "fla.modules.convolution", None)
    assert gated_delta_rule._fla_delta_rule.__wrapped__() is None
    assert gated_delta_rule._fla_conv.__wrapped__() is None

    def rule(q, k, v, g, beta):
        return None

    def new_conv(x, weight, bias=None, residual=None, activation=None, cu_seqlens=None):
        return None

    def old_conv(x, weight, bias=None, activation=None, seq_idx=None):
        return None

    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", module("f", chunk_gated_delta_rule=rule))
    assert gated_delta_rule._fla_delta_rule.__wrapped__() is rule
    monkeypatch.setitem(sys.modules, "fla.modules.convolution", module("f", causal_conv1d=new_conv))
    assert gated_delta_rule._fla_conv.__wrapped__() is new_conv
    monkeypatch.setitem(sys.modules, "fla.modules.convolution", module("f", causal_conv1d=old_conv))
    assert gated_delta_rule._fla_conv.__wrapped__() is None


# ---------------------------------------------------------------------- compile=True: Triton on CUDA
@pytest.mark.parametrize("device,triton,ok", [("cuda", True, True), ("cuda", False, False), ("cpu", False, True)])
def test_compile_backend_needs_triton_on_cuda_only(monkeypatch, device, triton, ok):
    """``build_parallel_model(compile=True)`` checks the backend first: inductor's CUDA kernels are Triton
    kernels (refused in one line without it); on CPU it needs a C++ compiler, not Triton."""
    import torch.utils._triton as torch_triton

    from models.common.compiled_layers import CompileUnavailableError, check_compile_backend

    monkeypatch.setattr(torch_triton, "has_triton", lambda: triton)
    if ok:
        check_compile_backend(device)
    else:
        with pytest.raises(CompileUnavailableError, match="needs Triton"):
            check_compile_backend(device)
