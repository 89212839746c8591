"""Fused decode attention over a paged, partly compressed KV cache (ZipFusion §III-C).

One Triton kernel reads K and V pages as they are stored — compressed blocks (low bytes +
4-bit codes) or raw bf16 blocks — rebuilds BF16 in registers with integer ops, and runs
online-softmax attention for all query heads of one KV head (GQA), so each KV byte is
read once. With every page raw it is the uncompressed baseline (same kernel).

The cache and its page table are :mod:`zipkv.paged`'s; the plan/run wrapper that validates,
routes and launches is :mod:`zipkv.kernels.decode_attention`.

Kernel
------
Grid ``(batch, kv_heads, num_splits)``. A program keeps its ``G = q_heads / kv_heads``
query rows (padded to 16 for the tensor cores) and walks tiles of ``pages_per_tile``
whole pages; split ``s`` takes a contiguous range of tiles. The kernel is specialised by
a constexpr ``PATH`` so that each compiled variant carries only its own tile code (one
kernel with three run-time paths needed 255 registers and spilled):

* all-compressed (token layouts): per row, the low bytes as 8-byte words (one per group of
  8 channels) and the codes as 4-byte words, both loaded 8 bytes per thread so that a
  thread holds the same channel groups of both streams; K and V loads are issued together,
  V is rebuilt after QK^T. Four high bytes are rebuilt per 32-bit op:
  ``H = (C << 4) & 0x80808080 | C & 0x07070707`` then ``H += (b/2) * 0x01010101`` (no
  carries: ``b/2 + 7 <= 127``), and two ``prmt.b32`` byte permutes of ``H`` and the
  low-byte word give two bf16 pairs, split into bf16 halves with a register move. Covers
  every page of a request but the last, which (partial, so raw, or full) goes through the
  mixed code after the loop, in the last split;
* all-raw (token layouts): plain bf16 rows (the uncompressed baseline);
* mixed, token layouts: a row lies in one block, so each row loads either its compressed
  form or its raw form, with the pure paths' wide loads under per-row masks (only the
  stored bytes move), and a per-row select takes the rebuilt or the raw row;
* mixed, channel layouts (a row spans several blocks): per (row, group of 8 channels) two
  8-byte loads whose addresses depend on the block's flag -- compressed: the 8 low bytes and
  the aligned 8 bytes holding the group's code word; raw: the four bf16 pair words -- so one
  register set serves both kinds of block, then a select between the rebuilt and the raw words.

Routing (:func:`zipkv.kernels.decode_attention.plan`): :meth:`zipkv.paged.PagedKVCache.page_kinds`
keeps one byte per (page, kv head) -- all-compressed, all-raw or mixed, the numbers of the
specialisations' ``PATH``. A uniform cache
(:meth:`PagedKVCache.kind`) gets one launch of its specialisation; otherwise three
launches with ``ROUTE``: each program first classifies its (request, kv head) from the page
kinds of the request and does nothing unless the class is its kernel's.

Pipelining: in every path a tile needs three dependent loads (page ids -> descriptors ->
data). They are written plainly in the loop and ``tl.range(num_stages=4)`` lets Triton's
pipeliner put each level one stage apart as ``cp.async`` copies into shared memory: the
page ids of tile i+3, the descriptors of tile i+2 and the data of tile i+1 are in flight
while tile i is computed. ``zipkv.kernels.kernel_info`` compiles the variants offline and
reports registers, spills, shared memory and async copies.

Splits write normalised partial outputs and a log2-sum-exp; a second small kernel merges
them (:mod:`zipkv.kernels.merge`).

The mma layouts of :mod:`zipkv.format` (``k_mma`` / ``v_mma``, head_dim 64 and 128), arranged for the
tensor cores' operand fragments, are decoded by a Gluon kernel instead
(:mod:`zipkv.kernels.decode_mma`): same cache, page table and plan; CUDA only.

Numerics: on the GPU, bf16 ``tl.dot`` (fp32 accumulate), bf16 P for PV. Under
``TRITON_INTERPRET=1`` bf16 math is wrong, so the rebuilt bits are turned into fp32 (exact:
bf16 bits << 16) and all dots run in fp32 (``FP32`` constexpr).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from zipkv import format as fmt
from zipkv import paged
from zipkv.kernels import tuning
from zipkv.kernels.merge import merge_splits

__all__ = ["launch", "launch_config", "workspace", "DEFAULT_LAUNCH", "LAUNCH_KEYS"]

COMPRESSED = tl.constexpr(paged.COMPRESSED)      # PATH values: the page kinds of zipkv.paged
RAW = tl.constexpr(paged.RAW)
MIXED = tl.constexpr(paged.MIXED)


# ----------------------------------------------------------------------------- helpers


@triton.jit
def _interleave(a, b, FP32: tl.constexpr):
    """Byte interleave of two int32 words (a ``prmt`` on the GPU), little-endian bytes:
    x0 = a0 b0 a1 b1, x1 = a2 b2 a3 b3 -- with a = low bytes, b = high bytes, two bf16
    pairs."""
    if FP32:
        x0 = (a & 0xFF) | ((b & 0xFF) << 8) | ((a & 0xFF00) << 8) | ((b & 0xFF00) << 16)
        x1 = ((a >> 16) & 0xFF) | ((b >> 8) & 0xFF00) | ((a >> 8) & 0xFF0000) | (b & -16777216)
    else:
        x0, x1 = tl.inline_asm_elementwise(
            "prmt.b32 $0, $2, $3, 0x5140;\n\tprmt.b32 $1, $2, $3, 0x7362;",
            "=r,=r,r,r", [a, b], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    return x0, x1


@triton.jit
def _high_bytes(N, base4):
    """Four 4-bit codes (low nibbles of N's bytes) -> four high bytes: one 32-bit add of
    ``(b/2) * 0x01010101`` (carry-free since b/2 + 7 <= 127)."""
    N = N & 0x0F0F0F0F
    return (((N << 4) & -2139062144) | (N & 0x07070707)) + base4     # -2139062144 = 0x80808080


@triton.jit
def _words(L0, L1, C, base4, FP32: tl.constexpr):
    """Low-byte words L0, L1 (channels 8m..8m+3, 8m+4..8m+7) + code word C -> the four bf16
    pair words (channels 8m+2w, 8m+2w+1), w = 0..3."""
    w0, w1 = _interleave(L0, _high_bytes(C, base4), FP32)
    w2, w3 = _interleave(L1, _high_bytes(C >> 4, base4), FP32)
    return w0, w1, w2, w3


@triton.jit
def _pairs_to_tile(w0, w1, w2, w3, BN: tl.constexpr, D: tl.constexpr, FP32: tl.constexpr):
    """Four int32 [BN, M] bf16 pair words (channels 8m+2w, 8m+2w+1) -> the [BN, D] tile
    (bf16 on the GPU, fp32 under FP32), channels in natural order."""
    M: tl.constexpr = D // 8
    P = tl.join(tl.join(w0, w2), tl.join(w1, w3)).reshape([BN, M, 4])
    if FP32:                                   # exact: a bf16's fp32 bits are its bits << 16
        lo = (P << 16).to(tl.float32, bitcast=True)
        hi = (P & -65536).to(tl.float32, bitcast=True)
    else:                                      # a register split, no instruction
        lo, hi = tl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [P],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
    return tl.join(lo, hi).reshape([BN, D])


@triton.jit
def _scores(q, m_i, l_i, k, row_ok, qk_scale, FP32: tl.constexpr):
    """Online softmax, first half: scores of one [BN, D] K tile (log2 domain) ->
    (p, alpha, m_new, l_new)."""
    if FP32:
        sc = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    else:
        sc = tl.dot(q, tl.trans(k)) * qk_scale
    sc = tl.where(row_ok[None, :], sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))           # finite: every tile has a token
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(sc - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@triton.jit
def _accum(acc, p, alpha, v, FP32: tl.constexpr):
    """Online softmax, second half: acc * alpha + p @ V."""
    if FP32:
        return acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


# ------------------------------------------------------------------- page table and descriptors

@triton.jit
def _pages(indices_ptr, p_start, n_pg, tile, t_hi, tp, PPT: tl.constexpr):
    """Physical page id of every row of ``tile`` ([BN] int32; 0 where the row's page is past
    ``n_pg`` pages or the tile past ``t_hi``: masked later, loads stay in bounds)."""
    pg = tile * PPT + tp
    return tl.load(indices_ptr + p_start + pg, mask=(pg < n_pg) & (tile < t_hi), other=0)


@triton.jit
def _row_desc(desc_ptr, page, h, r, ok, HKV: tl.constexpr, D: tl.constexpr):
    """Token layout: the K and V descriptors of every row's block ([BN] int64 each)."""
    NB: tl.constexpr = D // 32
    TPB: tl.constexpr = 512 // D
    k_row = ((page.to(tl.int64) * 2) * HKV + h) * NB + r // TPB
    kd = tl.load(desc_ptr + k_row, mask=ok, other=0)
    vd = tl.load(desc_ptr + k_row + HKV * NB, mask=ok, other=0)
    return kd, vd


# ------------------------------------------------------------------- tile loads, one per path

@triton.jit
def _row_words(dsc, r, D: tl.constexpr):
    """Token layout: word (int32) address of each row's block start and the row's offset in
    it (``rr * D`` values)."""
    TPB: tl.constexpr = 512 // D
    return dsc >> 10, (r % TPB) * D


@triton.jit
def _load_comp(pool_ptr, dsc, r, ok, BN: tl.constexpr, D: tl.constexpr):
    """All-compressed tile (token layout): the low bytes as one 8-byte word per group of 8
    channels and the codes as one 4-byte word per group, both 8 bytes per thread so a
    thread holds the same groups of both streams. Returns (L int64 [BN, M], C int32 [BN, M])."""
    M: tl.constexpr = D // 8
    blk, p = _row_words(dsc, r, D)
    a_l = tl.multiple_of((blk + p // 4) // 2, 2)                 # int64 units
    a_c = tl.multiple_of(blk + 128 + p // 8, 2)
    m = tl.arange(0, M)[None, :]
    pool64 = pool_ptr.to(tl.pointer_type(tl.int64))
    L = tl.load(pool64 + a_l[:, None] + m, mask=ok[:, None], other=0)
    C = tl.load(pool_ptr + a_c[:, None] + m, mask=ok[:, None], other=0)
    return L, C


@triton.jit
def _rebuild_comp(L, C, base4, BN: tl.constexpr, D: tl.constexpr, FP32: tl.constexpr):
    w0, w1, w2, w3 = _words(L.to(tl.int32), (L >> 32).to(tl.int32), C, base4[:, None], FP32)
    return _pairs_to_tile(w0, w1, w2, w3, BN, D, FP32)


@triton.jit
def _load_raw(pool_ptr, dsc, r, ok, BN: tl.constexpr, D: tl.constexpr, FP32: tl.constexpr):
    """All-raw tile (token layout): the plain [BN, D] bf16 rows (int32 pairs under FP32)."""
    blk, p = _row_words(dsc, r, D)
    a_r = tl.multiple_of(blk + p // 2, 4)
    if FP32:
        return tl.load(pool_ptr + a_r[:, None] + tl.arange(0, D // 2)[None, :], mask=ok[:, None], other=0)
    else:
        pool16 = pool_ptr.to(tl.pointer_type(tl.bfloat16))
        return tl.load(pool16 + tl.multiple_of(a_r * 2, 8)[:, None] + tl.arange(0, D)[None, :],
                       mask=ok[:, None], other=0.0)


@triton.jit
def _raw_tile(R, BN: tl.constexpr, D: tl.constexpr, FP32: tl.constexpr):
    if FP32:                                   # int32 pairs -> fp32 (exact)
        lo = (R << 16).to(tl.float32, bitcast=True)
        hi = (R & -65536).to(tl.float32, bitcast=True)
        return tl.join(lo, hi).reshape([BN, D])
    else:
        return R


@triton.jit
def _mixed_desc(desc_ptr, page, h, r, ok, KV: tl.constexpr, HKV: tl.constexpr,
                D: tl.constexpr, LAYOUT: tl.constexpr):
    """Mixed tile: the descriptor of the block holding each (row, group of 8 channels) and
    the group's first value's position p in that block (int64 / int32 [BN, M] or [BN, 1])."""
    NB: tl.constexpr = D // 32
    M: tl.constexpr = D // 8
    m = tl.arange(0, M)[None, :]
    row = (((page.to(tl.int64) * 2) + KV) * HKV + h) * NB
    if LAYOUT == 0:                            # token-major: block r // TPB, p = rr * D + 8m
        TPB: tl.constexpr = 512 // D
        dsc = tl.load(desc_ptr + row + r // TPB, mask=ok, other=0)[:, None]
        p = ((r % TPB) * D)[:, None] + 8 * m
    else:                                      # channel-major: block m // 4, p = r * 32 + 8 (m % 4)
        dsc = tl.load(desc_ptr + row[:, None] + m // 4, mask=ok[:, None] & (m >= 0), other=0)
        p = (r * 32)[:, None] + 8 * (m % 4)
    return dsc, p


@triton.jit
def _load_mixed(pool_ptr, dsc, p, ok, BN: tl.constexpr, D: tl.constexpr):
    """Mixed tile, any layout: per (row, group of 8 channels) two 8-byte loads whose address
    depends on the block's flag -- compressed: A = the 8 low bytes, B = the 8-byte-aligned
    code word pair holding the group's code word; raw: A, B = the four bf16 pair words. One
    register set whatever the flag (no raw and compressed streams live side by side).
    Returns A, B int32 [BN, M, 2]."""
    blk = dsc >> 10
    comp = ((dsc >> 7) & 1) != 0
    a = tl.where(comp, blk + p // 4, blk + p // 2)
    b = tl.where(comp, blk + 128 + ((p // 8) & -2), blk + p // 2 + 2)
    two = tl.arange(0, 2)[None, None, :]
    okk = ok[:, None, None]
    A = tl.load(pool_ptr + tl.multiple_of(a, [2, 2])[:, :, None] + two, mask=okk, other=0)
    B = tl.load(pool_ptr + tl.multiple_of(b, [2, 2])[:, :, None] + two, mask=okk, other=0)
    return A, B


@triton.jit
def _rebuild_mixed(A, B, dsc, BN: tl.constexpr, D: tl.constexpr, FP32: tl.constexpr):
    M: tl.constexpr = D // 8
    A0, A1 = tl.split(A)
    B0, B1 = tl.split(B)
    comp = ((dsc >> 7) & 1) != 0
    base4 = (dsc & 0x7F).to(tl.int32) * 0x01010101
    odd = (tl.arange(0, M) & 1)[None, :] != 0  # the group's code word is the odd half of B
    w0, w1, w2, w3 = _words(A0, A1, tl.where(odd, B1, B0), base4, FP32)
    return _pairs_to_tile(tl.where(comp, w0, A0), tl.where(comp, w1, A1),
                          tl.where(comp, w2, B0), tl.where(comp, w3, B1), BN, D, FP32)


# ------------------------------------------------------------------- routing

@triton.jit
def _route(indices_ptr, kind_ptr, p_start, npages, h, HKV: tl.constexpr, CH: tl.constexpr):
    """Class of (request, kv head) from the per-page kinds: COMPRESSED every page but the last is
    all-compressed (K and V), RAW every page is raw, MIXED anything else."""
    bad_c = p_start * 0
    bad_r = p_start * 0
    c = p_start * 0
    while c < npages:
        pg = c + tl.arange(0, CH)
        m = pg < npages
        page = tl.load(indices_ptr + p_start + pg, mask=m, other=0)
        kd = tl.load(kind_ptr + page.to(tl.int64) * HKV + h, mask=m, other=0)
        bad_c += tl.sum((m & (pg < npages - 1) & (kd != COMPRESSED)).to(tl.int32), axis=0)
        bad_r += tl.sum((m & (kd != RAW)).to(tl.int32), axis=0)
        c += CH
    return tl.where(bad_c == 0, COMPRESSED, tl.where(bad_r == 0, RAW, MIXED))


# ------------------------------------------------------------------- per-path tiles and loops

@triton.jit
def _comp_tile(q, m_i, l_i, acc, pool_ptr, desc_ptr, page, h, r, ok, qk_scale,
               HKV: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, FP32: tl.constexpr):
    """One all-compressed tile (token layout): K and V loads issued together, V rebuilt
    after QK^T."""
    kd, vd = _row_desc(desc_ptr, page, h, r, ok, HKV, D)
    kL, kC = _load_comp(pool_ptr, kd, r, ok, BN, D)
    vL, vC = _load_comp(pool_ptr, vd, r, ok, BN, D)
    k = _rebuild_comp(kL, kC, (kd & 0x7F).to(tl.int32) * 0x01010101, BN, D, FP32)
    p, alpha, m_i, l_i = _scores(q, m_i, l_i, k, ok, qk_scale, FP32)
    v = _rebuild_comp(vL, vC, (vd & 0x7F).to(tl.int32) * 0x01010101, BN, D, FP32)
    acc = _accum(acc, p, alpha, v, FP32)
    return m_i, l_i, acc


@triton.jit
def _raw_tile_attend(q, m_i, l_i, acc, pool_ptr, desc_ptr, page, h, r, ok, qk_scale,
                     HKV: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, FP32: tl.constexpr):
    """One all-raw tile (token layout): plain bf16 rows, straight into the dots."""
    kd, vd = _row_desc(desc_ptr, page, h, r, ok, HKV, D)
    kR = _load_raw(pool_ptr, kd, r, ok, BN, D, FP32)
    vR = _load_raw(pool_ptr, vd, r, ok, BN, D, FP32)
    p, alpha, m_i, l_i = _scores(q, m_i, l_i, _raw_tile(kR, BN, D, FP32), ok, qk_scale, FP32)
    acc = _accum(acc, p, alpha, _raw_tile(vR, BN, D, FP32), FP32)
    return m_i, l_i, acc


@triton.jit
def _select_tile(q, m_i, l_i, acc, pool_ptr, desc_ptr, page, h, r, ok, qk_scale,
                 HKV: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, FP32: tl.constexpr):
    """One tile of any mix of compressed and raw blocks, token layouts: a row lies in one block,
    so each row loads either its compressed form (as the all-compressed path) or its raw form (as
    the all-raw path) -- masked loads, only the stored bytes move, in the same wide loads as the
    pure paths -- and a per-row select takes the rebuilt or the raw row."""
    kd, vd = _row_desc(desc_ptr, page, h, r, ok, HKV, D)
    kc = ((kd >> 7) & 1) != 0
    vc = ((vd >> 7) & 1) != 0
    kL, kC = _load_comp(pool_ptr, kd, r, ok & kc, BN, D)
    kR = _load_raw(pool_ptr, kd, r, ok & ~kc, BN, D, FP32)
    vL, vC = _load_comp(pool_ptr, vd, r, ok & vc, BN, D)
    vR = _load_raw(pool_ptr, vd, r, ok & ~vc, BN, D, FP32)
    k = tl.where(kc[:, None], _rebuild_comp(kL, kC, (kd & 0x7F).to(tl.int32) * 0x01010101, BN, D, FP32),
                 _raw_tile(kR, BN, D, FP32))
    p, alpha, m_i, l_i = _scores(q, m_i, l_i, k, ok, qk_scale, FP32)
    v = tl.where(vc[:, None], _rebuild_comp(vL, vC, (vd & 0x7F).to(tl.int32) * 0x01010101, BN, D, FP32),
                 _raw_tile(vR, BN, D, FP32))
    acc = _accum(acc, p, alpha, v, FP32)
    return m_i, l_i, acc


@triton.jit
def _mixed_tile(q, m_i, l_i, acc, pool_ptr, desc_ptr, page, h, r, ok, qk_scale,
                HKV: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
                K_LAYOUT: tl.constexpr, V_LAYOUT: tl.constexpr, FP32: tl.constexpr):
    """One mixed tile, any layout: per-block flags, one register set per (row, group) (see
    :func:`_load_mixed`); K and V loads issued together, V rebuilt after QK^T."""
    kd, kp = _mixed_desc(desc_ptr, page, h, r, ok, 0, HKV, D, K_LAYOUT)
    vd, vp = _mixed_desc(desc_ptr, page, h, r, ok, 1, HKV, D, V_LAYOUT)
    kA, kB = _load_mixed(pool_ptr, kd, kp, ok, BN, D)
    vA, vB = _load_mixed(pool_ptr, vd, vp, ok, BN, D)
    k = _rebuild_mixed(kA, kB, kd, BN, D, FP32)
    p, alpha, m_i, l_i = _scores(q, m_i, l_i, k, ok, qk_scale, FP32)
    v = _rebuild_mixed(vA, vB, vd, BN, D, FP32)
    acc = _accum(acc, p, alpha, v, FP32)
    return m_i, l_i, acc


@triton.jit
def _step(q, m_i, l_i, acc, pool_ptr, desc_ptr, indices_ptr, p_start, n_pg, seq_len, tile, t_hi,
          h, tp, r, qk_scale, HKV: tl.constexpr, D: tl.constexpr, PPT: tl.constexpr,
          K_LAYOUT: tl.constexpr, V_LAYOUT: tl.constexpr, FP32: tl.constexpr, PATH: tl.constexpr):
    """One tile through path PATH: page ids -> descriptors -> data, three dependent loads.
    On the GPU the loop runs with ``num_stages`` >= 3 and Triton's software pipeliner puts
    each level of that chain one stage apart, as ``cp.async`` copies into shared memory
    (with 4 stages: the page ids of tile i+3, the descriptors of tile i+2 and the data of
    tile i+1 are in flight while tile i is computed; see ``zipkv.kernels.kernel_info``). The
    chain is written plainly on purpose: rotating prefetched page ids through loop-carried
    registers made the pipeliner give up (no async copies at all)."""
    BN: tl.constexpr = 16 * PPT
    pg = tile * PPT + tp
    page = _pages(indices_ptr, p_start, n_pg, tile, t_hi, tp, PPT)
    ok = (pg < n_pg) & (pg * 16 + r < seq_len)
    if PATH == COMPRESSED:
        m_i, l_i, acc = _comp_tile(q, m_i, l_i, acc, pool_ptr, desc_ptr, page, h, r, ok, qk_scale,
                                   HKV, D, BN, FP32)
    elif PATH == RAW:
        m_i, l_i, acc = _raw_tile_attend(q, m_i, l_i, acc, pool_ptr, desc_ptr, page, h, r, ok,
                                         qk_scale, HKV, D, BN, FP32)
    elif (K_LAYOUT == 0) and (V_LAYOUT == 0):
        m_i, l_i, acc = _select_tile(q, m_i, l_i, acc, pool_ptr, desc_ptr, page, h, r, ok, qk_scale,
                                     HKV, D, BN, FP32)
    else:
        m_i, l_i, acc = _mixed_tile(q, m_i, l_i, acc, pool_ptr, desc_ptr, page, h, r, ok, qk_scale,
                                    HKV, D, BN, K_LAYOUT, V_LAYOUT, FP32)
    return m_i, l_i, acc


@triton.jit
def _loop(q, m_i, l_i, acc, pool_ptr, desc_ptr, indices_ptr, p_start, n_pg, seq_len, t_lo, t_hi,
          h, tp, r, qk_scale, HKV: tl.constexpr, D: tl.constexpr, PPT: tl.constexpr,
          K_LAYOUT: tl.constexpr, V_LAYOUT: tl.constexpr, FP32: tl.constexpr,
          PATH: tl.constexpr, STAGES: tl.constexpr):
    """Tiles [t_lo, t_hi) of pages [0, n_pg) through path PATH (same body on the GPU and in
    the interpreter, whose range() cannot take tensor bounds)."""
    if FP32:
        tile = t_lo
        while tile < t_hi:
            m_i, l_i, acc = _step(q, m_i, l_i, acc, pool_ptr, desc_ptr, indices_ptr, p_start, n_pg,
                                  seq_len, tile, t_hi, h, tp, r, qk_scale, HKV, D, PPT, K_LAYOUT,
                                  V_LAYOUT, FP32, PATH)
            tile += 1
    else:
        for tile in tl.range(t_lo, t_hi, num_stages=STAGES):
            m_i, l_i, acc = _step(q, m_i, l_i, acc, pool_ptr, desc_ptr, indices_ptr, p_start, n_pg,
                                  seq_len, tile, t_hi, h, tp, r, qk_scale, HKV, D, PPT, K_LAYOUT,
                                  V_LAYOUT, FP32, PATH)
    return m_i, l_i, acc


# ----------------------------------------------------------------------------- kernels

@triton.jit
def _decode_kernel(q_ptr, pool_ptr, desc_ptr, indptr_ptr, indices_ptr, last_ptr, kind_ptr,
                   out_ptr, part_ptr, lse_ptr, qk_scale,
                   HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                   K_LAYOUT: tl.constexpr, V_LAYOUT: tl.constexpr, PPT: tl.constexpr,
                   SPLITS: tl.constexpr, FP32: tl.constexpr, PATH: tl.constexpr,
                   ROUTE: tl.constexpr, STAGES: tl.constexpr):
    """Grid (batch, kv_heads, splits). PATH (a page kind of :mod:`zipkv.paged`): COMPRESSED
    (token layouts; the request's last page goes through the mixed code after the loop), RAW
    (token layouts), MIXED (any layout). ROUTE: the program first classifies its (request, head) from the
    per-page kinds and does nothing unless the class is PATH (three launches cover a batch)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    p_start = tl.load(indptr_ptr + b)
    npages = tl.load(indptr_ptr + b + 1) - p_start
    seq_len = (npages - 1) * 16 + tl.load(last_ptr + b)
    if PATH == COMPRESSED:
        n_pg = npages - 1                      # full pages before the last one
    else:
        n_pg = npages
    n_tiles = tl.cdiv(n_pg, PPT)
    mine = n_pg >= 0
    if ROUTE:
        mine = _route(indices_ptr, kind_ptr, p_start, npages, h, HKV, 128) == PATH
        n_tiles = tl.where(mine, n_tiles, 0)
    per = tl.cdiv(n_tiles, SPLITS)             # split s: tiles [s * per, (s + 1) * per)
    t_lo = tl.minimum(s * per, n_tiles)
    t_hi = tl.minimum(t_lo + per, n_tiles)

    g = tl.arange(0, G_PAD)
    dd = tl.arange(0, D)
    q_rows = b * (HKV * G) + h * G + g
    q = tl.load(q_ptr + q_rows[:, None] * D + dd[None, :], mask=(g < G)[:, None], other=0.0)
    t = tl.arange(0, 16 * PPT)
    tp = t // 16                               # page of the row inside the tile
    r = t % 16                                 # row inside its page
    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D], dtype=tl.float32)
    m_i, l_i, acc = _loop(q, m_i, l_i, acc, pool_ptr, desc_ptr, indices_ptr, p_start, n_pg, seq_len,
                          t_lo, t_hi, h, tp, r, qk_scale, HKV, D, PPT, K_LAYOUT, V_LAYOUT, FP32,
                          PATH, STAGES)
    if PATH == COMPRESSED:
        if mine & (s == SPLITS - 1):           # the last page (partial: raw; full: any kind)
            r16 = tl.arange(0, 16)
            last = tl.load(indices_ptr + p_start + n_pg + r16 * 0)
            ok = n_pg * 16 + r16 < seq_len
            m_i, l_i, acc = _select_tile(q, m_i, l_i, acc, pool_ptr, desc_ptr, last, h, r16, ok,
                                         qk_scale, HKV, D, 16, FP32)

    gm = (g < G) & mine
    if SPLITS == 1:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + q_rows[:, None] * D + dd[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=gm[:, None])
    else:                                      # empty split: l = 0, lse = -inf, o = 0
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        prow = q_rows * SPLITS + s
        tl.store(part_ptr + prow[:, None] * D + dd[None, :], o, mask=gm[:, None])
        tl.store(lse_ptr + prow, lse, mask=gm)


# ----------------------------------------------------------------------------- launch options

# GPU launch options per kernel specialisation: pages per tile, warps, pipeline stages, register
# cap and the split-KV target (programs per SM). Defaults below; entries measured per GPU model by
# ``python -m zipkv bench tune --write`` (:mod:`zipkv.kernels.tuning`) take precedence on that GPU.
DEFAULT_LAUNCH = dict(pages_per_tile=4, num_warps=4, stages=4, maxnreg=168, programs_per_sm=4)
LAUNCH_KEYS = tuple(DEFAULT_LAUNCH)


def launch_config(path: str, gpu_name: str | None = None) -> dict:
    """Launch options of the ``path`` specialisation (a name of :data:`zipkv.paged.PAGE_KINDS`:
    ``"compressed"``, ``"raw"`` or ``"mixed"``) on the GPU model ``gpu_name``
    (``torch.cuda.get_device_name()``): its tuned entry (:func:`zipkv.kernels.tuning.tuned`) over
    :data:`DEFAULT_LAUNCH`."""
    if path not in paged.PAGE_KINDS:
        raise ValueError(f"path must be one of {paged.PAGE_KINDS}, got {path!r}")
    return {**DEFAULT_LAUNCH, **tuning.tuned(gpu_name, path)}


# ----------------------------------------------------------------------------- launcher

def workspace(batch: int, q_heads: int, head_dim: int, num_splits: int, fp32: bool, device) -> dict:
    """Buffers of one batch layout: the split slots (fp32 ``part [B, Hq, splits, D]``, ``lse [B, Hq,
    splits]``) when ``num_splits > 1``, and under ``fp32`` (the interpreter) the fp32 output ``res``."""
    ws = {}
    if num_splits > 1:
        ws["part"] = torch.empty(batch, q_heads, num_splits, head_dim, dtype=torch.float32, device=device)
        ws["lse"] = torch.empty(batch, q_heads, num_splits, dtype=torch.float32, device=device)
    if fp32:
        ws["res"] = torch.empty(batch, q_heads, head_dim, dtype=torch.float32, device=device)
    return ws


def launch(q, cache, indptr, indices, last_page_len, kinds, launches, configs, num_splits: int, qk_scale: float,
           out, ws: dict, fp32: bool, interp: bool):
    """Launch the Triton kernel once per ``(path, route)`` of ``launches`` (launch options ``configs``,
    one dict per launch, with ``pages_per_tile``), then merge the splits, into ``out``. No host sync;
    inputs are checked by :func:`zipkv.kernels.decode_attention.plan`."""
    B, HQ, D = q.shape
    HKV = cache.kv_heads
    G = HQ // HKV
    qk = q.float() if fp32 else q
    res = ws["res"] if fp32 else out
    part, lse = ws.get("part", res), ws.get("lse", res)
    for (path, route), cfg in zip(launches, configs):
        _decode_kernel[(B, HKV, num_splits)](
            qk, cache.pool.view(torch.int32), cache.desc, indptr, indices, last_page_len, kinds,
            res, part, lse, qk_scale,
            HKV=HKV, G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D,
            K_LAYOUT=fmt.LAYOUTS.index(cache.k_layout), V_LAYOUT=fmt.LAYOUTS.index(cache.v_layout),
            PPT=cfg["pages_per_tile"], SPLITS=num_splits, FP32=fp32, PATH=path, ROUTE=route, STAGES=cfg["stages"],
            **({} if interp else dict(num_warps=cfg["num_warps"],
                                      **({"maxnreg": cfg["maxnreg"]} if cfg["maxnreg"] else {}))))
    if num_splits > 1:
        merge_splits(part, lse, res)
    if fp32:
        out.copy_(res)                                                 # torch's fp32 -> bf16 (exact RNE)
    return out
