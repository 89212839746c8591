"""Fused elementwise kernels of the engine's decode step (:meth:`zipkv.engine.Engine._decode_forward`): residual
add + RMSNorm, the rotary embedding of q and k, and the SiLU-gated product of the MLP.

Each replaces the chain of small kernels that the Hugging Face modules launch per call (RMSNorm alone launches
eight: two casts, square, mean, add, rsqrt, two products) with one launch, and rounds to BF16 exactly where the
modules do, so that its output equals theirs bit for bit -- except RMSNorm's mean of squares, summed in another
order (fp32; the normalised value is rounded to BF16 afterwards, so it rarely moves a bit) and the exponential
of SiLU, which is libdevice's ``expf`` (the one PyTorch's CUDA kernel calls) on the GPU and numpy's in Triton's
interpreter. A decode step runs tens of such small kernels per layer, each about as short as a kernel can be:
fusing them shortens the fixed part of every step ("Decode throughput under a memory budget").

Values travel as int16 BF16 bit patterns and are converted with integer ops (:func:`_f32`, :func:`_bf16`,
round to nearest even, NaN to PyTorch's quiet NaN): exact on the GPU and in Triton's interpreter, whose
fp32 -> bf16 casts are wrong. All launchers take contiguous bf16 tensors on one device, validate them before
launching, allocate their outputs and never synchronise (CUDA-graph capturable).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from zipkv.kernels import check_launchable, interpreted

__all__ = ["add_rms_norm", "rotary", "silu_mul", "launchable"]


@triton.jit
def _f32(bits):
    """int16 BF16 bit patterns -> fp32 (exact)."""
    return ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _bf16(x):
    """fp32 -> int16 BF16 bit patterns, rounded to nearest even (overflow to +-inf), NaN -> 0x7FC0 like
    PyTorch's conversion."""
    b = x.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16          # the carry of the rounding may run into the exponent: exact
    return tl.where(x != x, 0x7FC0, r).to(tl.int16)


@triton.jit
def _add_rms_norm_kernel(h_ptr, d_ptr, w_ptr, h_out_ptr, x_out_ptr, n, inv_n, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    h = _f32(tl.load(h_ptr + row * n + cols, mask=m, other=0))
    if HAS_DELTA:
        hb = _bf16(h + _f32(tl.load(d_ptr + row * n + cols, mask=m, other=0)))       # bf16 residual add
        tl.store(h_out_ptr + row * n + cols, hb, mask=m)
        h = _f32(hb)
    var = tl.sum(h * h, 0) * inv_n                                  # PyTorch's mean multiplies by 1/n
    y = _f32(_bf16(h * tl.math.rsqrt(var + eps)))
    tl.store(x_out_ptr + row * n + cols, _bf16(_f32(tl.load(w_ptr + cols, mask=m, other=0)) * y), mask=m)


@triton.jit
def _rotate(src, dst, c, s, d, D: tl.constexpr):
    """One head: ``x * cos + rotate_half(x) * sin``, each product and the sum rounded to BF16."""
    x = _f32(tl.load(src + d))
    half = _f32(tl.load(src + (d + D // 2) % D))
    rot = tl.where(d < D // 2, -half, half)
    tl.store(dst + d, _bf16(_f32(_bf16(x * c)) + _f32(_bf16(rot * s))))


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, HQ, HK, D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, D)
    c = _f32(tl.load(cos_ptr + b * D + d))
    s = _f32(tl.load(sin_ptr + b * D + d))
    if head < HQ:
        _rotate(q_ptr + (b * HQ + head) * D, q_out_ptr + (b * HQ + head) * D, c, s, d, D)
    else:
        _rotate(k_ptr + (b * HK + head - HQ) * D, k_out_ptr + (b * HK + head - HQ) * D, c, s, d, D)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, INTERPRET: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = _f32(tl.load(g_ptr + offs, mask=m, other=0))
    if INTERPRET:
        e = tl.exp(-g)
    else:
        e = libdevice.exp(-g)                         # expf, as PyTorch's silu: x / (1 + exp(-x))
    act = _f32(_bf16(tl.math.div_rn(g, 1.0 + e)))
    tl.store(out_ptr + offs, _bf16(act * _f32(tl.load(u_ptr + offs, mask=m, other=0))), mask=m)


def _check(name: str, t, shape: tuple | None = None, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.bfloat16 or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous bf16 tensor, got {t.dtype}"
                         f"{'' if t.is_contiguous() else ' (not contiguous)'}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, the other operands on {device}")


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """``h + delta`` (the residual stream, BF16) and its RMSNorm as Hugging Face's ``LlamaRMSNorm`` computes it:
    ``weight * bf16(r * rsqrt(mean(r**2) + eps))``, statistics in fp32. h, delta: bf16 ``[rows, hidden]`` (delta
    None: no add); weight: bf16 ``[hidden]``. Returns ``(h + delta, normed)``, both ``[rows, hidden]`` (the first is
    ``h`` itself when delta is None)."""
    _check("h", h)
    if h.dim() != 2 or h.shape[1] == 0:
        raise ValueError(f"h must be [rows, hidden] with hidden >= 1, got {tuple(h.shape)}")
    if delta is not None:
        _check("delta", delta, h.shape, h.device)
    _check("weight", weight, (h.shape[1],), h.device)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 <= eps < float("inf"):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    check_launchable(_add_rms_norm_kernel, h.device, "h")
    rows, n = h.shape
    h_out = torch.empty_like(h) if delta is not None else h
    x = torch.empty_like(h)
    if rows:
        bits = lambda t: t.view(torch.int16)                                      # noqa: E731
        _add_rms_norm_kernel[(rows,)](bits(h), bits(delta if delta is not None else h), bits(weight), bits(h_out),
                                      bits(x), n, 1.0 / n, float(eps), HAS_DELTA=delta is not None,
                                      BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 2048 else 8)
    return h_out, x


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotary position embedding of one token per row, as Hugging Face's ``apply_rotary_pos_emb``: ``x * cos +
    rotate_half(x) * sin`` per head, rounded to BF16 after each product and the sum. q: bf16 ``[batch, q_heads,
    head_dim]``, k: ``[batch, kv_heads, head_dim]``, cos, sin: ``[batch, head_dim]`` (head_dim a power of two).
    Returns the rotated ``(q, k)`` as new contiguous tensors of the same shapes."""
    _check("q", q)
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, q_heads, head_dim], got {tuple(q.shape)}")
    B, HQ, D = q.shape
    if D < 2 or D & (D - 1):
        raise ValueError(f"head_dim must be a power of two >= 2, got {D}")
    if k.dim() != 3 or (k.shape[0], k.shape[2]) != (B, D):
        raise ValueError(f"k must be [batch={B}, kv_heads, head_dim={D}], got {tuple(k.shape)}")
    _check("k", k, device=q.device)
    _check("cos", cos, (B, D), q.device)
    _check("sin", sin, (B, D), q.device)
    check_launchable(_rotary_kernel, q.device, "q")
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if B and HQ + k.shape[1]:
        bits = lambda t: t.view(torch.int16)                                      # noqa: E731
        _rotary_kernel[(B, HQ + k.shape[1])](bits(q), bits(k), bits(cos), bits(sin), bits(q_out), bits(k_out),
                                             HQ, k.shape[1], D=D, num_warps=1 if D <= 128 else 2)
    return q_out, k_out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` as the Llama MLP computes it in BF16 (the activation rounded to BF16, then the
    product). gate, up: bf16 of one shape. Returns a new tensor of that shape."""
    _check("gate", gate)
    _check("up", up, gate.shape, gate.device)
    check_launchable(_silu_mul_kernel, gate.device, "gate")
    out = torch.empty_like(gate)
    n, block = gate.numel(), 1024
    if n:
        _silu_mul_kernel[(triton.cdiv(n, block),)](gate.view(torch.int16), up.view(torch.int16), out.view(torch.int16),
                                                   n, INTERPRET=interpreted(_silu_mul_kernel), BLOCK=block,
                                                   num_warps=4)
    return out


def launchable(device) -> bool:
    """Whether these kernels run on ``device``: a CUDA GPU, or any device in Triton's interpreter."""
    return torch.device(device).type == "cuda" or interpreted(_rotary_kernel)
