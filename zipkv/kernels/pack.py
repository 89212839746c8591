"""Triton pack kernel: compress many full pages per launch (ZipFusion §III-B, §III-D).

Bit-identical to :func:`zipkv.format.pack` (payload slot and metadata byte
``flag << 7 | b >> 1``; byte order in ``zipkv.format``'s docstring). One program handles
``pages_per_program`` pages, i.e. a ``[pages * n_blocks, 512]`` tile of values, loaded as two
``[.., 256]`` halves: values ``8m+k`` and ``8m+4+k`` (k = 0..3), whose codes share code byte
``4m+k`` — so the codes are packed without any shuffle.

Source and destination are addressed per page by byte offsets, so the same kernel packs
a contiguous batch of pages into a new buffer, packs in place (every value of a page is
loaded before the first store; the per-block reductions order them), or compresses page
slots of a :class:`zipkv.kernels.decode_attention.PagedKVCache` pool.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from zipkv import format as fmt

__all__ = ["pack_pages", "pack_into"]


@triton.jit
def _pack_kernel(src16_ptr, src_off_ptr, dst8_ptr, dst_off_ptr, meta_ptr, n_pages,
                 D: tl.constexpr, LAYOUT: tl.constexpr, SRC_PACKED: tl.constexpr,
                 PAGES: tl.constexpr):
    NB: tl.constexpr = D // 32
    BM: tl.constexpr = PAGES * NB
    PB: tl.constexpr = 32 * D
    pid = tl.program_id(0)
    blk = tl.arange(0, BM)
    page = pid * PAGES + blk // NB
    j = blk % NB
    ok = page < n_pages
    src_off = tl.load(src_off_ptr + page, mask=ok, other=0).to(tl.int64)
    dst_off = tl.load(dst_off_ptr + page, mask=ok, other=0).to(tl.int64)
    q = tl.arange(0, 256)
    p_a = (q // 4) * 8 + q % 4                 # value 8m+k: low nibble of code byte 4m+k
    p_b = p_a + 4                              # value 8m+4+k: high nibble
    if SRC_PACKED or LAYOUT == 0:              # raw block order (token layout = plain page)
        s_a = j[:, None] * 512 + p_a[None, :]
        s_b = j[:, None] * 512 + p_b[None, :]
    else:                                      # plain page, channel layout: [16 tok, 32 ch] blocks
        s_a = (p_a // 32)[None, :] * D + j[:, None] * 32 + (p_a % 32)[None, :]
        s_b = (p_b // 32)[None, :] * D + j[:, None] * 32 + (p_b % 32)[None, :]
    src = src16_ptr + (src_off // 2)[:, None]
    xa = tl.load(src + s_a, mask=ok[:, None], other=0).to(tl.int32) & 0xFFFF
    xb = tl.load(src + s_b, mask=ok[:, None], other=0).to(tl.int32) & 0xFFFF
    ea = (xa >> 7) & 0xFF
    eb = (xb >> 7) & 0xFF
    emin = tl.minimum(tl.min(ea, axis=1), tl.min(eb, axis=1))
    emax = tl.maximum(tl.max(ea, axis=1), tl.max(eb, axis=1))
    base_hi = emin >> 1
    comp = (emax - 2 * base_hi) <= 15
    ca = ((xa >> 15) << 3) | (((xa >> 8) & 0x7F) - base_hi[:, None])
    cb = ((xb >> 15) << 3) | (((xb >> 8) & 0x7F) - base_hi[:, None])
    codes = (ca | (cb << 4)) & 0xFF
    # block offsets inside the slot: 1024*j - 256 * (#compressed blocks before j)
    f = comp.to(tl.int32).reshape([PAGES, NB])
    before = (tl.cumsum(f, axis=1) - f).reshape([BM])
    boff = dst_off + j * 1024 - 256 * before
    tl.debug_barrier()                         # in place: all loads before any store
    cm = (ok & comp)[:, None]
    rm = (ok & (comp == 0))[:, None]
    dst = dst8_ptr + boff[:, None]
    tl.store(dst + p_a[None, :], (xa & 0xFF).to(tl.uint8), mask=cm)
    tl.store(dst + p_b[None, :], (xb & 0xFF).to(tl.uint8), mask=cm)
    tl.store(dst + 512 + q[None, :], codes.to(tl.uint8), mask=cm)
    # zero the slot's tail: compressed block of rank k clears [PB - 256(k+1), PB - 256k)
    tail = dst8_ptr + (dst_off + PB - 256 * (before + 1))[:, None]
    tl.store(tail + q[None, :], tl.zeros([BM, 256], dtype=tl.uint8), mask=cm)
    dst16 = dst8_ptr.to(tl.pointer_type(tl.int16)) + (boff // 2)[:, None]
    tl.store(dst16 + p_a[None, :], xa.to(tl.int16), mask=rm)
    tl.store(dst16 + p_b[None, :], xb.to(tl.int16), mask=rm)
    mbyte = tl.where(comp, 128 + base_hi, 0)
    tl.store(meta_ptr + page * NB + j, mbyte.to(tl.uint8), mask=ok)


def _interpreting() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes")


def _default_pages_per_program(head_dim: int) -> int:
    if _interpreting():                        # few, large programs: the interpreter's cost is per program
        return max(1, (1 << 21) // (16 * head_dim))
    return max(1, 4096 // (16 * head_dim))


def _check_int_tensor(x, name, dtype, n):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {x.dtype}")
    if x.shape != (n,):
        raise ValueError(f"{name} must have shape [{n}], got {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def pack_into(src: torch.Tensor, src_offsets: torch.Tensor, dst: torch.Tensor,
              dst_offsets: torch.Tensor, head_dim: int, layout: str = "token", *,
              src_packed: bool = False, meta_out: torch.Tensor | None = None,
              pages_per_program: int | None = None) -> torch.Tensor:
    """Low-level launcher: compress ``N`` pages addressed by byte offsets.

    src: bf16 or uint8 1-D contiguous buffer; page ``i`` is read at byte ``src_offsets[i]``
    (int64 ``[N]``) as a plain ``[16, head_dim]`` page, or, with ``src_packed``, as an
    all-raw packed slot (raw blocks in block order; the same thing for the token layout).
    dst: uint8 1-D contiguous buffer; page ``i``'s slot (``32 * head_dim`` bytes) is written
    at ``dst_offsets[i]`` — ``dst`` may be ``src`` with equal offsets (in place).
    Offsets must be multiples of 256. Returns the metadata bytes uint8 ``[N, n_blocks]``
    (``flag << 7 | b >> 1``).
    """
    fmt._check_layout(layout)
    nb = fmt.n_blocks(head_dim)
    for name, buf in (("src", src), ("dst", dst)):
        if not isinstance(buf, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
        if buf.dim() != 1 or not buf.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D buffer, got shape {tuple(buf.shape)} "
                             f"stride {buf.stride()}")
    if src.dtype not in (torch.bfloat16, torch.uint8):
        raise TypeError(f"src must have dtype torch.bfloat16 or torch.uint8, got {src.dtype}")
    if dst.dtype != torch.uint8:
        raise TypeError(f"dst must have dtype torch.uint8, got {dst.dtype}")
    n = src_offsets.shape[0] if isinstance(src_offsets, torch.Tensor) and src_offsets.dim() == 1 else -1
    if n < 0:
        raise ValueError(f"src_offsets must be a 1-D int64 tensor, got {getattr(src_offsets, 'shape', src_offsets)}")
    _check_int_tensor(src_offsets, "src_offsets", torch.int64, n)
    _check_int_tensor(dst_offsets, "dst_offsets", torch.int64, n)
    if meta_out is None:
        meta_out = torch.empty(n, nb, dtype=torch.uint8, device=dst.device)
    elif (not isinstance(meta_out, torch.Tensor) or meta_out.dtype != torch.uint8
          or meta_out.shape != (n, nb) or not meta_out.is_contiguous()):
        raise ValueError(f"meta_out must be a contiguous uint8 tensor [{n}, {nb}], got "
                         f"{getattr(meta_out, 'dtype', None)} {tuple(getattr(meta_out, 'shape', ()))}")
    devs = {t.device for t in (src, dst, src_offsets, dst_offsets, meta_out)}
    if len(devs) != 1:
        raise ValueError(f"src, dst, offsets and meta_out must be on one device, got {sorted(map(str, devs))}")
    if n == 0:
        return meta_out
    src8 = src.view(torch.uint8)
    pb = fmt.page_bytes(head_dim)
    for name, off, buf in (("src_offsets", src_offsets, src8), ("dst_offsets", dst_offsets, dst)):
        lo, hi = int(off.min()), int(off.max())
        if lo < 0 or hi + pb > buf.numel() or bool((off % 256 != 0).any()):
            raise ValueError(f"{name} must be multiples of 256 in [0, {buf.numel() - pb}] "
                             f"(buffer of {buf.numel()} bytes), got range [{lo}, {hi}]")
    ppp = pages_per_program or _default_pages_per_program(head_dim)
    ppp = triton.next_power_of_2(ppp)
    grid = (triton.cdiv(n, ppp),)
    _pack_kernel[grid](src8.view(torch.int16), src_offsets, dst, dst_offsets, meta_out, n,
                       D=head_dim, LAYOUT=fmt.LAYOUTS.index(layout), SRC_PACKED=bool(src_packed),
                       PAGES=ppp)
    return meta_out


def pack_pages(pages: torch.Tensor, layout: str = "token", *, out: torch.Tensor | None = None,
               pages_per_program: int | None = None):
    """Compress full pages with the Triton kernel; bit-identical to ``zipkv.format.pack``.

    pages: bf16 ``[N, 16, head_dim]`` contiguous. out: uint8 ``[N, 32 * head_dim]``
    contiguous, or ``pages`` viewed as uint8 (the same memory) to compress in place.
    Returns ``(payload, meta)`` like :func:`zipkv.format.pack`.
    """
    d = fmt._check_pages(pages)
    fmt._check_layout(layout)
    if pages.dim() != 3:
        raise ValueError(f"pages must have shape [N, 16, head_dim], got {tuple(pages.shape)}")
    if not pages.is_contiguous():
        raise ValueError(f"pages must be contiguous, got stride {pages.stride()} for shape {tuple(pages.shape)}")
    n, pb = pages.shape[0], fmt.page_bytes(d)
    if out is None:
        out = torch.empty(n, pb, dtype=torch.uint8, device=pages.device)
    else:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.dtype != torch.uint8:
            raise TypeError(f"out must have dtype torch.uint8, got {out.dtype}")
        if out.shape != (n, pb):
            raise ValueError(f"out must have shape [{n}, {pb}], got {tuple(out.shape)}")
        if not out.is_contiguous():
            raise ValueError(f"out must be contiguous, got stride {out.stride()}")
        if out.device != pages.device:
            raise ValueError(f"out is on {out.device}, pages on {pages.device}")
        a0, a1 = pages.data_ptr(), pages.data_ptr() + n * pb
        b0, b1 = out.data_ptr(), out.data_ptr() + n * pb
        if a0 < b1 and b0 < a1 and a0 != b0:
            raise ValueError("out partially overlaps pages: pass disjoint memory, or the same memory to pack in place")
    off = torch.arange(n, dtype=torch.int64, device=pages.device) * pb
    packed = pack_into(pages.view(-1), off, out.view(-1), off, d, layout,
                       pages_per_program=pages_per_program)
    return out, fmt.PageMeta.from_packed(packed, layout, d)
