"""Triton pack kernel: compress many full pages per launch (ZipFusion §III-B, §III-D).

Bit-identical to :func:`zipkv.format.pack` (payload slot and metadata byte
``flag << 7 | b >> 1``; byte order in ``zipkv.format``'s docstring). One program handles
``pages_per_program`` whole pages, i.e. ``BLK = pages * n_blocks`` blocks, as an int32
``[BLK, 64, 4]`` tile: block, group ``m`` of 8 values (``8m .. 8m+7``), bf16 pair word.
A group is 16 contiguous source bytes in every layout (token layout: bytes ``16m`` of the
block; channel layout from a plain page: 8 channels of one token; mma layouts: the raw block's
piece that :func:`zipkv.format.raw_index` puts it in), so every load is one 16-byte vector per
thread. Everything after is 32-bit SWAR on those words, in registers:

* exponent min / max per block: two reductions over the block's 256 words
  (``(x >> 7) & 0xFF`` and ``(x >> 23) & 0xFF``);
* low bytes: two byte permutes give the two 4-byte low-byte words of the group;
* codes: the four high bytes of 4 values in one word, then ``(H & 0x80808080) >> 4`` (sign
  to bit 3 of each byte) ``| (H & 0x7F7F7F7F) - (b/2) * 0x01010101`` (no borrows: every
  value's ``e >> 1 >= b/2`` in a compressed block); the group's code word is
  ``codes(8m..8m+3) | codes(8m+4..8m+7) << 4``.

Stores are int32 words: low bytes ``[BLK, 64, 2]`` (8 contiguous bytes per group), codes
``[BLK, 64]``, raw blocks the loaded words themselves; offsets are computed per block
(int64), never per element. Source and destination are addressed per page by byte
offsets, so the same kernel packs a contiguous batch of pages into a new buffer, packs in
place (every value of a page is loaded before the first store: a program owns whole
pages, and a barrier separates its loads from its stores), or compresses page slots of a
:class:`zipkv.paged.PagedKVCache` pool. The bytes of a slot past the page's
compressed size are left as they were: they are not part of the page (the space ZipFusion's
memory manager hands on, §III-D), so writing zeros there would only cost bandwidth.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from zipkv import format as fmt
from zipkv.kernels import check_launchable

__all__ = ["pack_pages", "pack_into"]


# n_pages not specialised (Triton would compile apart for n == 1 and n % 16 == 0): the engine packs a different
# number of page-heads at every step that fills pages, and each new variant is a compile inside a decode step
@triton.jit(do_not_specialize=["n_pages"])
def _pack_kernel(src_ptr, src_off_ptr, dst_ptr, dst_off_ptr, meta_ptr, n_pages,
                 D: tl.constexpr, LAYOUT: tl.constexpr, SRC_PACKED: tl.constexpr,
                 PAGES: tl.constexpr):
    """src_ptr, dst_ptr: int32 views of the byte buffers; offsets in bytes (multiples of 256)."""
    NB: tl.constexpr = D // 32
    BLK: tl.constexpr = PAGES * NB
    pid = tl.program_id(0)
    blk = tl.arange(0, BLK)
    page = pid * PAGES + blk // NB
    j = blk % NB
    ok = page < n_pages
    src_w = tl.multiple_of(tl.load(src_off_ptr + page, mask=ok, other=0) // 4, 64)   # int64 per block
    dst_w = tl.multiple_of(tl.load(dst_off_ptr + page, mask=ok, other=0) // 4, 64)
    m = tl.arange(0, 64)[None, :, None]
    w = tl.arange(0, 4)[None, None, :]
    if LAYOUT >= 2:                            # mma layouts: group m's 16 bytes are raw piece `piece`
        run: tl.constexpr = 32 if LAYOUT == 2 else 16  # (zipkv.format.raw_index: key halves, value chunks)
        piece = (m & -run) | (m & 1) * (run // 2) | ((m >> 1) & (run // 2 - 1))
    else:
        piece = m
    if SRC_PACKED or LAYOUT == 0:              # raw block order: block j = words 256j ..
        row = (j * 256)[:, None, None] + 4 * piece
    else:                                      # plain page, channel layout: token m // 4, channels 32j + 8 (m % 4) ..
        row = (j * 16)[:, None, None] + (m // 4) * (D // 2) + 4 * (m % 4)
    okb = ok[:, None, None]
    X = tl.load(src_ptr + src_w[:, None, None] + tl.multiple_of(row, [1, 4, 4]) + w, mask=okb, other=0)

    # exponent range per block (0 for masked blocks: harmless, never stored)
    e_lo = (X >> 7) & 0xFF
    e_hi = (X >> 23) & 0xFF
    emin = tl.min(tl.min(tl.minimum(e_lo, e_hi), axis=2), axis=1)
    emax = tl.max(tl.max(tl.maximum(e_lo, e_hi), axis=2), axis=1)
    base_hi = emin >> 1
    comp = (emax - 2 * base_hi) <= 15

    XA, XB = tl.split(X.reshape([BLK, 64, 2, 2]))    # words (0, 2) and (1, 3) of each group
    X0, X2 = tl.split(XA)
    X1, X3 = tl.split(XB)
    # low bytes: bytes 0, 2 of each word
    L0 = (X0 & 0xFF) | ((X0 >> 8) & 0xFF00) | ((X1 & 0xFF) << 16) | ((X1 << 8) & -16777216)
    L1 = (X2 & 0xFF) | ((X2 >> 8) & 0xFF00) | ((X3 & 0xFF) << 16) | ((X3 << 8) & -16777216)
    # high bytes: bytes 1, 3 of each word
    H0 = ((X0 >> 8) & 0xFF) | ((X0 >> 16) & 0xFF00) | ((X1 << 8) & 0xFF0000) | (X1 & -16777216)
    H1 = ((X2 >> 8) & 0xFF) | ((X2 >> 16) & 0xFF00) | ((X3 << 8) & 0xFF0000) | (X3 & -16777216)
    b4 = (base_hi * 0x01010101)[:, None]
    c0 = ((H0 >> 4) & 0x08080808) | ((H0 & 0x7F7F7F7F) - b4)
    c1 = ((H1 >> 4) & 0x08080808) | ((H1 & 0x7F7F7F7F) - b4)
    if LAYOUT >= 2:                            # mma layouts: code byte i pairs values i and i + 256
        lo_hi = tl.join(c0, c1).reshape([BLK, 2, 64]).permute(0, 2, 1)   # word w: values 4w .. 4w+3 (+ 256)
        c_lo, c_hi = tl.split(lo_hi)
        codes = c_lo | (c_hi << 4)
    else:                                      # values 8m + k and 8m + 4 + k
        codes = c0 | (c1 << 4)                 # [BLK, 64]

    # block offsets inside the slot: 1024*j - 256 * (#compressed blocks before j), in words
    f = comp.to(tl.int32).reshape([PAGES, NB])
    before = (tl.cumsum(f, axis=1) - f).reshape([BLK])
    boff = tl.multiple_of(dst_w + j * 256 - 64 * before, 64)
    tl.debug_barrier()                         # in place: all loads before any store
    cm = ok & comp
    rm = ok & (comp == 0)
    m2 = tl.arange(0, 64)[None, :]
    dst = dst_ptr + boff[:, None]
    tl.store(dst[:, :, None] + 2 * m2[:, :, None] + tl.arange(0, 2)[None, None, :],
             tl.join(L0, L1), mask=cm[:, None, None])
    tl.store(dst + 128 + m2, codes, mask=cm[:, None])
    tl.store(dst[:, :, None] + 4 * piece + w, X, mask=rm[:, None, None])
    mbyte = tl.where(comp, 128 + base_hi, 0)
    tl.store(meta_ptr + page * NB + j, mbyte.to(tl.uint8), mask=ok)


def _interpreting() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes")


# GPU launch options: input bytes per program and warps, the fastest of an H200 timing sweep (4–64 KB per
# program × 2/4/8 warps, head_dim 64 and 128; many small programs keep more loads in flight per SM). The
# pack throughput in "Decode attention latency" is measured with these.
_TUNE = dict(bytes_per_program=4096, num_warps=2)


def _launch_config(head_dim: int, pages_per_program: int | None, gpu: bool):
    """(constexprs, num_warps) for a launch: PAGES is a power of two."""
    if pages_per_program:
        ppp = pages_per_program
    elif not gpu:                              # few, large programs: the interpreter's cost is per program
        ppp = max(1, (1 << 21) // (16 * head_dim))
    else:
        ppp = max(1, _TUNE["bytes_per_program"] // fmt.page_bytes(head_dim))
    return dict(PAGES=triton.next_power_of_2(ppp)), _TUNE["num_warps"]


def _check_pages_per_program(pages_per_program):
    if pages_per_program is None:
        return
    if isinstance(pages_per_program, bool) or not isinstance(pages_per_program, int) or pages_per_program <= 0:
        raise ValueError(f"pages_per_program must be a positive int or None, got {pages_per_program!r}")


def _check_int_tensor(x, name, dtype, n):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {x.dtype}")
    if x.shape != (n,):
        raise ValueError(f"{name} must have shape [{n}], got {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_page_slots(src8, src_offsets, dst, dst_offsets, page_bytes: int, validate: bool) -> None:
    """Both buffers 16-byte aligned; with ``validate`` every offset a multiple of 256 with a whole page inside its buffer
    (one device sync)."""
    checked = (("src_offsets", src_offsets, src8), ("dst_offsets", dst_offsets, dst)) if validate else ()
    for name, off, buf in checked:
        lo, hi = int(off.min()), int(off.max())
        if lo < 0 or hi + page_bytes > buf.numel() or bool((off % 256 != 0).any()):
            raise ValueError(f"{name} must be multiples of 256 in [0, {buf.numel() - page_bytes}] "
                             f"(buffer of {buf.numel()} bytes), got range [{lo}, {hi}]")
    for name, buf in (("src", src8), ("dst", dst)):
        if buf.data_ptr() % 16:
            raise ValueError(f"{name} must start at a 16-byte aligned address, got {buf.data_ptr():#x}")


def pack_into(src: torch.Tensor, src_offsets: torch.Tensor, dst: torch.Tensor,
              dst_offsets: torch.Tensor, head_dim: int, layout: str = "token", *,
              src_packed: bool = False, meta_out: torch.Tensor | None = None,
              pages_per_program: int | None = None, validate: bool = True) -> torch.Tensor:
    """Low-level launcher: compress ``N`` pages addressed by byte offsets.

    src: bf16 or uint8 1-D contiguous buffer; page ``i`` is read at byte ``src_offsets[i]``
    (int64 ``[N]``) as a plain ``[16, head_dim]`` page, or, with ``src_packed``, as an
    all-raw packed slot (raw blocks in block order; the same thing for the token layout).
    dst: uint8 1-D contiguous buffer; page ``i``'s slot (``32 * head_dim`` bytes) is written
    at ``dst_offsets[i]`` — ``dst`` may be ``src`` with equal offsets (in place).
    Offsets must be multiples of 256. Bytes of a destination slot past the page's compressed
    size are not written. validate: also check the offsets' values (range, multiples of 256) --
    this syncs with the device; pass False when the offsets are known good (e.g. timed loops).
    Returns the metadata bytes uint8 ``[N, n_blocks]`` (``flag << 7 | b >> 1``).
    """
    fmt._check_layout(layout)
    fmt._check_layout_head_dim(layout, head_dim)
    _check_pages_per_program(pages_per_program)
    if layout in fmt.MMA_LAYOUTS and not src_packed:
        raise ValueError(f"layout {layout!r}: pack_into reads mma-layout pages only as all-raw packed slots "
                         f"(src_packed=True); pack_pages takes plain pages")
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
    _check_page_slots(src8, src_offsets, dst, dst_offsets, fmt.page_bytes(head_dim), validate)
    check_launchable(_pack_kernel, dst.device, "dst")
    gpu = dst.device.type == "cuda" and not _interpreting()
    cst, warps = _launch_config(head_dim, pages_per_program, gpu)
    grid = (triton.cdiv(n, cst["PAGES"]),)
    n4 = lambda b: b[: b.numel() // 4 * 4].view(torch.int32)          # noqa: E731 (offsets stay in bounds)
    _pack_kernel[grid](n4(src8), src_offsets, n4(dst), dst_offsets, meta_out, n,
                       D=head_dim, LAYOUT=fmt.LAYOUTS.index(layout), SRC_PACKED=bool(src_packed),
                       **cst, **({"num_warps": warps} if gpu else {}))
    return meta_out


def pack_pages(pages: torch.Tensor, layout: str = "token", *, out: torch.Tensor | None = None,
               pages_per_program: int | None = None):
    """Compress full pages with the Triton kernel; bit-identical to ``zipkv.format.pack``.

    pages: bf16 ``[N, 16, head_dim]`` contiguous. out: uint8 ``[N, 32 * head_dim]``
    contiguous, or ``pages`` viewed as uint8 (the same memory) to compress in place.
    Returns ``(payload, meta)`` like :func:`zipkv.format.pack` (equal in each page's first
    ``meta.nbytes`` bytes; the rest of a slot is left as it was). The mma layouts first gather the
    pages into block order (one extra pass in torch), then compress them as raw slots.
    """
    d = fmt._check_pages(pages)
    fmt._check_layout(layout)
    _check_pages_per_program(pages_per_program)
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
    mma = layout in fmt.MMA_LAYOUTS
    if mma:                                    # into block order first (a gather), then as raw slots
        blocks = fmt.to_raw(fmt.to_blocks(pages, layout), layout).contiguous().view(-1)
        if out.data_ptr() == pages.data_ptr():
            pages.view(-1).copy_(blocks)
            blocks = pages.view(-1)
    packed = pack_into(blocks if mma else pages.view(-1), off, out.view(-1), off, d, layout, src_packed=mma,
                       pages_per_program=pages_per_program, validate=False)   # offsets built here
    return out, fmt.PageMeta.from_packed(packed, layout, d).sealed()
