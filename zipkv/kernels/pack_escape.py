"""Triton pack kernel of the escape format (:mod:`zipkv.escape`, every block compressible; the list sized per page).

Bit-identical to :func:`zipkv.escape.pack_slots` (the torch reference): each page-head slot is packed in place or
into another buffer -- blocks as :func:`zipkv.format.pack` lays them out, then the page-head's escape list right after
its blocks (block-major, positions ascending, 2 bytes an entry ``p << 7 | e >> 1``) -- and each block gets its
metadata byte ``flag << 7 | b >> 1`` and second byte ``zero << 7 | count``.

The structure is :mod:`zipkv.kernels.pack`'s (one program packs ``PAGES`` whole page-heads, an int32 ``[BLK, 64, 4]``
tile of 16-byte group loads, every load before the first store so packing in place is safe). What the escape format
adds, in registers on the two bf16 halves of each word (int32, integer ops only: exact in the interpreter):

* per block the exponent pairs' range, the lowest non-zero pair, and the escapes of both window choices (8 pairs at
  the top; 7 pairs at the top plus pair 0, *zero mode*): a few reductions over the block's 512 values;
* the escaped values' pairs become the window's bottom pair and a zero-mode block's pair-0 values its pair + 7 (sign,
  exponent bit 0 and fraction kept), then ZipFusion's SWAR code path packs the substituted words with base ``b``;
* the list: an escape's rank in its block (a prefix count over the block's 64 rows of 8 values, then within its
  row, in the registers the values were loaded to) plus the escapes of the page-head's blocks before it (a prefix
  count over the page's blocks) gives its entry's place after the page's blocks; one masked 2-byte store per escape,
  skipped by programs whose blocks list nothing (most, on real KV).

A block with more than 127 escapes stays raw (count 0), as in the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from zipkv import format as fmt
from zipkv.kernels import check_launchable
from zipkv.kernels.pack import _check_int_tensor, _check_page_slots, _check_pages_per_program, _interpreting, _launch_config

__all__ = ["pack_into", "pack_slots", "pack_pages", "NUM_WARPS"]

NUM_WARPS = 8
"""Warps per program on a GPU (programs of about 4 KB of input, as :mod:`zipkv.kernels.pack`'s): the escape kernel's
per-value tiles (``[blocks, 512]`` ranks and entries) take 217 registers per thread with 2 warps and 75 with 8
(offline, sm_90a, head_dim 128, one page per program); untuned on a GPU (``.ci/gpu/escape_probe.py`` times it)."""


@triton.jit(do_not_specialize=["n_pages"])
def _pack_escape_kernel(src_ptr, src_off_ptr, dst_ptr, dst16_ptr, dst_off_ptr, meta_ptr, second_ptr, n_pages,
                        D: tl.constexpr, LAYOUT: tl.constexpr, SRC_PACKED: tl.constexpr, PAGES: tl.constexpr):
    """src_ptr, dst_ptr: int32 views of the byte buffers, dst16_ptr the int16 view of dst; offsets in bytes
    (multiples of 256)."""
    NB: tl.constexpr = D // 32
    BLK: tl.constexpr = PAGES * NB
    pid = tl.program_id(0)
    blk = tl.arange(0, BLK)
    page = pid * PAGES + blk // NB
    j = blk % NB
    ok = page < n_pages
    src_w = tl.multiple_of(tl.load(src_off_ptr + page, mask=ok, other=0) // 4, 64)
    dst_off = tl.load(dst_off_ptr + page, mask=ok, other=0)                      # bytes, int64
    dst_w = tl.multiple_of(dst_off // 4, 64)
    m = tl.arange(0, 64)[None, :, None]
    w = tl.arange(0, 4)[None, None, :]
    if LAYOUT >= 2:
        run: tl.constexpr = 32 if LAYOUT == 2 else 16
        piece = (m & -run) | (m & 1) * (run // 2) | ((m >> 1) & (run // 2 - 1))
    else:
        piece = m
    if SRC_PACKED or LAYOUT == 0:
        row = (j * 256)[:, None, None] + 4 * piece
    else:
        row = (j * 16)[:, None, None] + (m // 4) * (D // 2) + 4 * (m % 4)
    okb = ok[:, None, None]
    X = tl.load(src_ptr + src_w[:, None, None] + tl.multiple_of(row, [1, 4, 4]) + w, mask=okb, other=0)

    # the two bf16 values of each word (position 8m + 2w + h of the block, h = 0 the low half)
    V0 = X & 0xFFFF
    V1 = (X >> 16) & 0xFFFF
    P0 = (V0 >> 8) & 0x7F                                                           # exponent pairs
    P1 = (V1 >> 8) & 0x7F
    hi = tl.max(tl.max(tl.maximum(P0, P1), axis=2), axis=1)
    lo = tl.min(tl.min(tl.minimum(P0, P1), axis=2), axis=1)
    NZ0 = tl.where(P0 == 0, 127, P0)
    NZ1 = tl.where(P1 == 0, 127, P1)
    lo_nz = tl.min(tl.min(tl.minimum(NZ0, NZ1), axis=2), axis=1)
    # window of 8 pairs: ZipFusion's base where the block fits, else anchored at the top
    b8 = tl.where(hi - lo < 8, lo, hi - 7)
    b8e = b8[:, None, None]
    E8_0 = P0 < b8e
    E8_1 = P1 < b8e
    n8 = tl.sum(tl.sum(E8_0.to(tl.int32) + E8_1.to(tl.int32), axis=2), axis=1)
    # zero mode: 7 pairs at the top, code offset 7 for pair 0
    top7 = (hi - 6)[:, None, None]
    E7_0 = (P0 != 0) & (P0 < top7)
    E7_1 = (P1 != 0) & (P1 < top7)
    n7 = tl.sum(tl.sum(E7_0.to(tl.int32) + E7_1.to(tl.int32), axis=2), axis=1)
    b7 = tl.where(n7 > 0, hi - 6, lo_nz)
    zero = (n7 < n8) & (hi <= 126) & (b7 <= 119)
    b2 = tl.where(zero, b7, b8)
    count = tl.where(zero, n7, n8)
    comp = count <= 127
    zero = zero & comp
    count = tl.where(comp, count, 0)

    ze = zero[:, None, None]
    E0 = tl.where(ze, E7_0, E8_0) & comp[:, None, None]
    E1 = tl.where(ze, E7_1, E8_1) & comp[:, None, None]
    Z0 = ze & (P0 == 0)
    Z1 = ze & (P1 == 0)
    b2e = b2[:, None, None]
    S0 = tl.where(E0, (V0 & 0x80FF) | (b2e << 8), tl.where(Z0, (V0 & 0x80FF) | ((b2e + 7) << 8), V0))
    S1 = tl.where(E1, (V1 & 0x80FF) | (b2e << 8), tl.where(Z1, (V1 & 0x80FF) | ((b2e + 7) << 8), V1))
    XS = S0 | (S1 << 16)

    # ZipFusion's SWAR code path on the substituted words, base b2 (zipkv.kernels.pack)
    XA, XB = tl.split(XS.reshape([BLK, 64, 2, 2]))
    X0, X2 = tl.split(XA)
    X1, X3 = tl.split(XB)
    L0 = (X0 & 0xFF) | ((X0 >> 8) & 0xFF00) | ((X1 & 0xFF) << 16) | ((X1 << 8) & -16777216)
    L1 = (X2 & 0xFF) | ((X2 >> 8) & 0xFF00) | ((X3 & 0xFF) << 16) | ((X3 << 8) & -16777216)
    H0 = ((X0 >> 8) & 0xFF) | ((X0 >> 16) & 0xFF00) | ((X1 << 8) & 0xFF0000) | (X1 & -16777216)
    H1 = ((X2 >> 8) & 0xFF) | ((X2 >> 16) & 0xFF00) | ((X3 << 8) & 0xFF0000) | (X3 & -16777216)
    b4 = (b2 * 0x01010101)[:, None]
    c0 = ((H0 >> 4) & 0x08080808) | ((H0 & 0x7F7F7F7F) - b4)
    c1 = ((H1 >> 4) & 0x08080808) | ((H1 & 0x7F7F7F7F) - b4)
    if LAYOUT >= 2:
        lo_hi = tl.join(c0, c1).reshape([BLK, 2, 64]).permute(0, 2, 1)
        c_lo, c_hi = tl.split(lo_hi)
        codes = c_lo | (c_hi << 4)
    else:
        codes = c0 | (c1 << 4)

    # the escape list: entry places after the page-head's blocks
    f = comp.to(tl.int32).reshape([PAGES, NB])
    before = (tl.cumsum(f, axis=1) - f).reshape([BLK])
    cnt = count.reshape([PAGES, NB])
    start = (tl.cumsum(cnt, axis=1) - cnt).reshape([BLK])                         # entries of the blocks before
    ncomp = tl.sum(f, axis=1)                                                      # [PAGES]
    blocks_bytes = tl.broadcast_to((1024 * NB - 256 * ncomp)[:, None], [PAGES, NB]).reshape([BLK])
    # an escape's rank in its block, in the load's own [BLK, 64, 4] layout (position 8m + 2w + h): the escapes of the
    # rows before (a scan over 64 rows) plus those of the words before in its row, plus h = 0's where h = 1
    e0 = E0.to(tl.int32)
    e1 = E1.to(tl.int32)
    ew = e0 + e1
    in_row = tl.cumsum(ew, axis=2) - ew
    per_row = tl.sum(ew, axis=2)
    rank0 = (tl.cumsum(per_row, axis=1) - per_row)[:, :, None] + in_row
    rank1 = rank0 + e0
    pos0 = 8 * m + 2 * w
    slot16 = (dst_off + blocks_bytes) // 2 + start                                 # int16 index of block's first
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
    if tl.sum(count, axis=0) > 0:             # most programs of real KV list nothing
        at = slot16[:, None, None]
        okl = ok[:, None, None]
        tl.store(dst16_ptr + at + rank0, ((pos0 << 7) | P0).to(tl.int16), mask=E0 & okl)
        tl.store(dst16_ptr + at + rank1, (((pos0 + 1) << 7) | P1).to(tl.int16), mask=E1 & okl)
    tl.store(meta_ptr + page * NB + j, tl.where(comp, 128 + b2, 0).to(tl.uint8), mask=ok)
    tl.store(second_ptr + page * NB + j, (zero.to(tl.int32) * 128 + count).to(tl.uint8), mask=ok)


def pack_into(src: torch.Tensor, src_offsets: torch.Tensor, dst: torch.Tensor, dst_offsets: torch.Tensor,
              head_dim: int, layout: str = "token", *, src_packed: bool = False,
              pages_per_program: int | None = None, validate: bool = True):
    """Low-level launcher (:func:`zipkv.kernels.pack.pack_into`'s arguments and checks): compress ``N`` page-heads
    addressed by byte offsets into the escape format, each page-head's list after its blocks in its destination
    slot. Returns ``(packed, second)``, uint8 ``[N, n_blocks]`` each (:func:`zipkv.escape.pack_slots`)."""
    fmt._check_layout(layout)
    fmt._check_layout_head_dim(layout, head_dim)
    _check_pages_per_program(pages_per_program)
    if layout in fmt.MMA_LAYOUTS and not src_packed:
        raise ValueError(f"layout {layout!r}: pack_into reads mma-layout pages only as all-raw packed slots "
                         f"(src_packed=True)")
    nb = fmt.n_blocks(head_dim)
    for name, buf in (("src", src), ("dst", dst)):
        if not isinstance(buf, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
        if buf.dim() != 1 or not buf.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D buffer, got shape {tuple(buf.shape)}")
    if src.dtype not in (torch.bfloat16, torch.uint8):
        raise TypeError(f"src must have dtype torch.bfloat16 or torch.uint8, got {src.dtype}")
    if dst.dtype != torch.uint8:
        raise TypeError(f"dst must have dtype torch.uint8, got {dst.dtype}")
    n = src_offsets.shape[0] if isinstance(src_offsets, torch.Tensor) and src_offsets.dim() == 1 else -1
    if n < 0:
        raise ValueError(f"src_offsets must be a 1-D int64 tensor, got {getattr(src_offsets, 'shape', src_offsets)}")
    _check_int_tensor(src_offsets, "src_offsets", torch.int64, n)
    _check_int_tensor(dst_offsets, "dst_offsets", torch.int64, n)
    devs = {t.device for t in (src, dst, src_offsets, dst_offsets)}
    if len(devs) != 1:
        raise ValueError(f"src, dst and offsets must be on one device, got {sorted(map(str, devs))}")
    packed = torch.empty(n, nb, dtype=torch.uint8, device=dst.device)
    second = torch.empty_like(packed)
    if n == 0:
        return packed, second
    src8 = src.view(torch.uint8)
    _check_page_slots(src8, src_offsets, dst, dst_offsets, fmt.page_bytes(head_dim), validate)
    check_launchable(_pack_escape_kernel, dst.device, "dst")
    gpu = dst.device.type == "cuda" and not _interpreting()
    if not gpu and pages_per_program is None:  # the interpreter: few programs, tiles of [BLK, 512] within its limit
        pages_per_program = max(1, 512 // nb)
    cst, _ = _launch_config(head_dim, pages_per_program, gpu)
    warps = NUM_WARPS
    grid = (triton.cdiv(n, cst["PAGES"]),)
    n4 = lambda b: b[: b.numel() // 4 * 4].view(torch.int32)          # noqa: E731
    n2 = lambda b: b[: b.numel() // 2 * 2].view(torch.int16)          # noqa: E731
    _pack_escape_kernel[grid](n4(src8), src_offsets, n4(dst), n2(dst), dst_offsets, packed, second, n,
                              D=head_dim, LAYOUT=fmt.LAYOUTS.index(layout), SRC_PACKED=bool(src_packed),
                              **cst, **({"num_warps": warps} if gpu else {}))
    return packed, second


def pack_slots(pool: torch.Tensor, offsets: torch.Tensor, head_dim: int, layout: str):
    """:func:`zipkv.escape.pack_slots`'s contract on the Triton kernel (raw slots of ``pool`` packed in place):
    ``(packed, second)``, uint8 ``[n, n_blocks]`` each. The memory manager's packer on a GPU."""
    return pack_into(pool, offsets, pool, offsets, head_dim, layout, src_packed=True, validate=False)


def pack_pages(pages: torch.Tensor, layout: str = "token", *, pages_per_program: int | None = None):
    """Compress full pages ``[N, 16, head_dim]`` bf16 (contiguous) with the kernel into new slots: ``(payload uint8
    [N, 32 * head_dim], packed, second)``; each slot's blocks then its list (its first ``blocks + 2 * count`` bytes
    are :func:`zipkv.escape.pack_slots`'s; the rest of a slot is not written). The mma layouts gather the pages into
    block order first (one torch pass)."""
    d = fmt._check_pages(pages)
    fmt._check_layout(layout)
    if pages.dim() != 3 or not pages.is_contiguous():
        raise ValueError(f"pages must be a contiguous [N, 16, head_dim] tensor, got {tuple(pages.shape)}")
    n, pb = pages.shape[0], fmt.page_bytes(d)
    out = torch.zeros(n, pb, dtype=torch.uint8, device=pages.device)
    off = torch.arange(n, dtype=torch.int64, device=pages.device) * pb
    mma = layout in fmt.MMA_LAYOUTS
    src = fmt.to_raw(fmt.to_blocks(pages, layout), layout).contiguous().view(-1) if mma else pages.view(-1)
    packed, second = pack_into(src, off, out.view(-1), off, d, layout, src_packed=mma,
                               pages_per_program=pages_per_program, validate=False)
    return out, packed, second
