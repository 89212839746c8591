"""Fused decode attention over a paged, partly compressed KV cache (ZipFusion §III-C).

One Triton kernel reads K and V pages as they are stored — compressed blocks (low bytes +
4-bit codes) or raw bf16 blocks — rebuilds BF16 in registers with integer ops, and runs
online-softmax attention for all query heads of one KV head (GQA), so each KV byte is
read once. With every page raw it is the uncompressed baseline (same kernel).

Physical storage (:class:`PagedKVCache`)
----------------------------------------
* ``pool``: one uint8 byte pool. Each *page-head* (16 tokens × head_dim of one KV head,
  keys or values) is a slot laid out exactly as :func:`zipkv.format.pack` writes it:
  its blocks back to back, 768 bytes per compressed block, 1024 per raw block.
* ``desc``: int64 ``[num_pages, 2, kv_heads, n_blocks]`` block descriptors (index 0 of
  dim 1 = keys, 1 = values): ``desc = byte_address << 8 | flag << 7 | b >> 1``, i.e. the
  block's absolute byte address in ``pool`` (a multiple of 256), its compressed flag and
  its exponent base. One 8-byte load per block gives everything needed to decode it, and
  slots may sit anywhere (fixed slots, or packed back to back: ``compact=True``), so a
  memory manager can move pages without touching the page table.
* Page table: FlashInfer's CSR form, page size 16: ``indptr`` int32 ``[batch + 1]``,
  ``indices`` int32 ``[nnz_pages]`` (physical page ids), ``last_page_len`` int32
  ``[batch]`` in 1..16. The last page of a request is partial and stays raw.
* Keys use ``k_layout``, values ``v_layout`` (``"token"`` or ``"channel"``, see
  ``zipkv.format``); with the token layout a raw page is the plain row-major
  ``[16, head_dim]`` bf16 page.

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

Routing (:func:`decode_attention`, ``path="auto"``): :meth:`PagedKVCache.page_kinds` keeps
one byte per (page, kv head) -- all-compressed, all-raw or mixed. A uniform cache
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
them.

The mma layouts of :mod:`zipkv.format` (``k_mma`` / ``v_mma``, head_dim 128), arranged for the
tensor cores' operand fragments, are decoded by a Gluon kernel instead
(:mod:`zipkv.kernels.decode_mma`): same cache, page table and routing; CUDA only.

Numerics: on the GPU, bf16 ``tl.dot`` (fp32 accumulate), bf16 P for PV. Under
``TRITON_INTERPRET=1`` bf16 math is wrong, so the rebuilt bits are turned into fp32 (exact:
bf16 bits << 16) and all dots run in fp32 (``FP32`` constexpr).
"""
from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton
import triton.language as tl

from zipkv import format as fmt
from zipkv.kernels import check_launchable

__all__ = ["PagedKVCache", "build_paged_cache", "compress_cache_", "decode_attention"]


# ----------------------------------------------------------------------------- helpers

PATH_COMP, PATH_RAW, PATH_MIXED = 0, 1, 2
PATHS = ("compressed", "raw", "mixed")
KIND_MIXED, KIND_COMP, KIND_RAW = 0, 1, 2        # PagedKVCache.page_kinds() values


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
    """Class of (request, kv head) from the per-page kinds: 0 every page but the last is
    all-compressed (K and V), 1 every page is raw, 2 anything else."""
    bad_c = p_start * 0
    bad_r = p_start * 0
    c = p_start * 0
    while c < npages:
        pg = c + tl.arange(0, CH)
        m = pg < npages
        page = tl.load(indices_ptr + p_start + pg, mask=m, other=0)
        kd = tl.load(kind_ptr + page.to(tl.int64) * HKV + h, mask=m, other=0)
        bad_c += tl.sum((m & (pg < npages - 1) & (kd != 1)).to(tl.int32), axis=0)
        bad_r += tl.sum((m & (kd != 2)).to(tl.int32), axis=0)
        c += CH
    return tl.where(bad_c == 0, 0, tl.where(bad_r == 0, 1, 2))


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
    if PATH == 0:
        m_i, l_i, acc = _comp_tile(q, m_i, l_i, acc, pool_ptr, desc_ptr, page, h, r, ok, qk_scale,
                                   HKV, D, BN, FP32)
    elif PATH == 1:
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
    """Grid (batch, kv_heads, splits). PATH: 0 all-compressed (token layouts; the request's
    last page goes through the mixed code after the loop), 1 all-raw (token layouts), 2
    mixed (any layout). ROUTE: the program first classifies its (request, head) from the
    per-page kinds and does nothing unless the class is PATH (three launches cover a batch)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    p_start = tl.load(indptr_ptr + b)
    npages = tl.load(indptr_ptr + b + 1) - p_start
    seq_len = (npages - 1) * 16 + tl.load(last_ptr + b)
    if PATH == 0:
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
    if PATH == 0:
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


@triton.jit
def _merge_kernel(part_ptr, lse_ptr, out_ptr, D: tl.constexpr, SPLITS: tl.constexpr,
                  S_PAD: tl.constexpr):
    row = tl.program_id(0)
    sp = tl.arange(0, S_PAD)
    dd = tl.arange(0, D)
    sm = sp < SPLITS
    lse = tl.load(lse_ptr + row * SPLITS + sp, mask=sm, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))    # some split holds a token: max is finite
    o = tl.load(part_ptr + (row * SPLITS + sp)[:, None] * D + dd[None, :], mask=sm[:, None], other=0.0)
    res = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + row * D + dd, res.to(out_ptr.dtype.element_ty))


# ----------------------------------------------------------------------------- cache

@dataclass
class PagedKVCache:
    """Paged KV cache whose page-heads may be compressed per block (see module docstring).

    pool: uint8 ``[pool_bytes]``; desc: int64 ``[num_pages, 2, kv_heads, n_blocks]``.
    """
    pool: torch.Tensor
    desc: torch.Tensor
    head_dim: int
    k_layout: str = "token"
    v_layout: str = "token"
    _kinds: tuple | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def num_pages(self) -> int:
        return self.desc.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.desc.shape[2]

    @property
    def n_blocks(self) -> int:
        return fmt.n_blocks(self.head_dim)

    def meta(self, kv: int) -> fmt.PageMeta:
        """Metadata of keys (kv=0) or values (kv=1): PageMeta ``[num_pages, kv_heads, n_blocks]``."""
        d = self.desc[:, kv]
        return fmt.PageMeta.from_packed((d & 0xFF).to(torch.uint8),
                                        (self.k_layout, self.v_layout)[kv], self.head_dim)

    def slot_offsets(self) -> torch.Tensor:
        """int64 ``[num_pages, 2, kv_heads]``: byte address of each page-head slot."""
        return self.desc[..., 0] >> 8

    def read_pages(self, page_ids: torch.Tensor | None = None):
        """Decode pages with ``zipkv.format.unpack``: ``(k, v)``, each bf16
        ``[len(page_ids), kv_heads, 16, head_dim]`` (all pages by default)."""
        ids = torch.arange(self.num_pages, device=self.desc.device) if page_ids is None else page_ids.long()
        pb = fmt.page_bytes(self.head_dim)
        off = self.slot_offsets()[ids]                                   # [n, 2, H]
        padded = torch.cat([self.pool, self.pool.new_zeros(pb)])        # compact slots may end early
        idx = off[..., None] + torch.arange(pb, device=off.device)
        slots = padded[idx]                                              # [n, 2, H, pb]
        out = []
        for kv in (0, 1):
            m = self.meta(kv)[ids]
            out.append(fmt.unpack(slots[:, kv], m))
        return out[0], out[1]

    def page_kinds(self) -> torch.Tensor:
        """uint8 ``[num_pages, kv_heads]``: 1 where every K and V block of the page-head is
        compressed, 2 where every one is raw, 0 otherwise (what :func:`decode_attention`
        routes on). Cached; :func:`compress_cache_` refreshes it, and code that edits
        ``desc`` by hand must call :meth:`refresh`."""
        return self._kind_info()[0]

    def kind(self) -> str:
        """``"compressed"`` (every page-head all-compressed), ``"raw"`` (every one raw) or
        ``"mixed"``; computed once (one device sync) and cached like :meth:`page_kinds`."""
        info = self._kind_info()
        if info[1] is None:
            present = set(torch.unique(info[0]).tolist())
            k = {frozenset({1}): "compressed", frozenset({2}): "raw"}.get(frozenset(present), "mixed")
            self._kinds = info = (info[0], k)
        return info[1]

    def refresh(self) -> "PagedKVCache":
        """Forget the cached page kinds (after editing ``desc`` by hand)."""
        self._kinds = None
        return self

    def _kind_info(self):
        if self._kinds is None or self._kinds[0].shape != self.desc.shape[:1] + self.desc.shape[2:3]:
            comp = ((self.desc >> 7) & 1).bool()                      # [P, 2, H, nb]
            allc = comp.all(-1).all(1)
            allr = (~comp).all(-1).all(1)
            kinds = torch.where(allc, 1, torch.where(allr, 2, 0)).to(torch.uint8).contiguous()
            self._kinds = (kinds, None)
        return self._kinds

    def stats(self) -> dict:
        """Pool bytes in use vs. raw, compressed block fractions for K and V."""
        mk, mv = self.meta(0), self.meta(1)
        used = int(mk.nbytes.sum() + mv.nbytes.sum())
        raw = 2 * self.num_pages * self.kv_heads * fmt.page_bytes(self.head_dim)
        return dict(pool_bytes=self.pool.numel(), used_bytes=used, raw_bytes=raw,
                    frac_k=float(mk.compressed.float().mean()), frac_v=float(mv.compressed.float().mean()))


def _check_kv(x, name):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"{name} must have dtype torch.bfloat16, got {x.dtype}")
    if x.dim() != 4:
        raise ValueError(f"{name} must have shape [batch, kv_heads, T, head_dim], got {tuple(x.shape)}")
    fmt._check_head_dim(x.shape[-1], f"{name} (shape {tuple(x.shape)})")


def physical_page_ids(num_pages: int, seed: int = 0, shuffle: bool = True) -> torch.Tensor:
    """int64 ``[num_pages]``: the physical page id of each logical page (requests' pages in order) in
    :func:`build_paged_cache`'s caches -- a seeded random permutation, as a serving engine's page pool
    hands pages out (``shuffle``), or the identity. The benchmark gives FlashInfer the same page table."""
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randperm(num_pages, generator=gen) if shuffle else torch.arange(num_pages)


def build_paged_cache(k: torch.Tensor, v: torch.Tensor, seq_lens=None, *,
                      k_layout: str = "token", v_layout: str = "token",
                      compress="eligible", shuffle: bool = True, compact: bool = False,
                      seed: int = 0):
    """Build a :class:`PagedKVCache` and its CSR page table from contiguous K/V.

    k, v: bf16 ``[batch, kv_heads, T, head_dim]``; seq_lens: ``[batch]`` ints in 1..T
    (default T): request ``b`` uses its first ``seq_lens[b]`` tokens. Full pages are packed
    with ``zipkv.format.pack`` (partial last pages stay raw). compress: ``"eligible"``
    (every eligible block), ``"none"`` (all raw: the uncompressed baseline), a float ``f``
    (a seeded random fraction ``f`` of the eligible blocks), or a bool tensor
    ``[num_pages, 2, kv_heads, n_blocks]`` in logical page order (forcing the mix).
    shuffle: random physical page ids; compact: slots back to back at their packed size.
    Returns ``(cache, indptr, indices, last_page_len)`` on k's device.
    """
    _check_kv(k, "k")
    _check_kv(v, "v")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    B, H, T, D = k.shape
    _check_layouts(k_layout, v_layout, D)
    dev = k.device
    lens = [T] * B if seq_lens is None else [int(x) for x in seq_lens]
    if len(lens) != B or any(not 1 <= x <= T for x in lens):
        raise ValueError(f"seq_lens must hold {B} lengths in [1, {T}], got {lens}")
    npg = [(x + 15) // 16 for x in lens]
    P = sum(npg)
    pages, full = [], []
    for b in range(B):
        n = npg[b] * 16
        kv = torch.stack([k[b, :, :lens[b]], v[b, :, :lens[b]]])        # [2, H, L, D]
        kv = torch.nn.functional.pad(kv, (0, 0, 0, n - lens[b]))
        pages.append(kv.reshape(2, H, npg[b], 16, D).permute(2, 0, 1, 3, 4))
        full.append(torch.arange(npg[b]) < lens[b] // 16)
    pages = torch.cat(pages).contiguous()                              # [P, 2, H, 16, D] logical
    full = torch.cat(full).to(dev)
    nb = fmt.n_blocks(D)
    if isinstance(compress, torch.Tensor):
        if compress.dtype != torch.bool or compress.shape != (P, 2, H, nb):
            raise ValueError(f"compress mask must be bool [{P}, 2, {H}, {nb}], got {compress.dtype} {tuple(compress.shape)}")
        enable = compress.to(dev)
    elif compress == "eligible":
        enable = torch.ones(P, 2, H, nb, dtype=torch.bool, device=dev)
    elif compress == "none":
        enable = torch.zeros(P, 2, H, nb, dtype=torch.bool, device=dev)
    elif isinstance(compress, float) and 0.0 <= compress <= 1.0:
        gen = torch.Generator().manual_seed(seed)
        enable = (torch.rand(P, 2, H, nb, generator=gen) < compress).to(dev)
    else:
        raise ValueError(f"compress must be 'eligible', 'none', a float in [0, 1] or a bool mask, got {compress!r}")
    enable = enable & full[:, None, None, None]
    pb = fmt.page_bytes(D)
    payload = torch.empty(P, 2, H, pb, dtype=torch.uint8, device=dev)
    packed = torch.empty(P, 2, H, nb, dtype=torch.uint8, device=dev)
    for kv, lay in ((0, k_layout), (1, v_layout)):
        pl, m = fmt.pack(pages[:, kv], lay, enable=enable[:, kv])
        payload[:, kv], packed[:, kv] = pl, m.packed()
    perm = physical_page_ids(P, seed, shuffle).to(dev)                 # logical page i -> physical id perm[i]
    phys_payload = torch.empty_like(payload)
    phys_payload[perm] = payload
    phys_packed = torch.empty_like(packed)
    phys_packed[perm] = packed
    comp = (phys_packed >> 7).bool()
    size = torch.where(comp, fmt.PACKED_BLOCK_BYTES, fmt.RAW_BLOCK_BYTES).to(torch.int64)
    blk_off = torch.cumsum(size, -1) - size                            # inside the slot
    if compact:
        used = size.sum(-1).reshape(-1)                                # [P*2*H]
        slot = (torch.cumsum(used, 0) - used).reshape(P, 2, H)
        units = torch.arange(pb // 256, device=dev) < (used // 256)[:, None]
        pool = phys_payload.reshape(-1, pb // 256, 256)[units].reshape(-1)
    else:
        slot = torch.arange(P * 2 * H, device=dev, dtype=torch.int64).reshape(P, 2, H) * pb
        pool = phys_payload.reshape(-1)
    desc = ((slot[..., None] + blk_off) << 8) | phys_packed.to(torch.int64)
    indptr = torch.tensor([0] + npg, dtype=torch.int64).cumsum(0).to(torch.int32).to(dev)
    last = torch.tensor([x - 16 * (n - 1) for x, n in zip(lens, npg)], dtype=torch.int32, device=dev)
    cache = PagedKVCache(pool.contiguous(), desc.contiguous(), D, k_layout, v_layout)
    return cache, indptr, perm.to(torch.int32), last


def compress_cache_(cache: PagedKVCache, page_ids: torch.Tensor, *,
                    pages_per_program: int | None = None) -> PagedKVCache:
    """Compress raw full pages of ``cache`` in place with the Triton pack kernel
    (ZipFusion §III-D: the page id stays, its slot shrinks to a prefix). page_ids: int
    ``[n]`` physical ids whose page-heads are all raw; their descriptors are updated."""
    from zipkv.kernels.pack import pack_into
    _check_cache(cache)
    if not isinstance(page_ids, torch.Tensor) or page_ids.dim() != 1 or page_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"page_ids must be a 1-D int32/int64 tensor, got {getattr(page_ids, 'dtype', type(page_ids))} "
                         f"{tuple(getattr(page_ids, 'shape', ()))}")
    ids = page_ids.long().to(cache.desc.device)
    if ids.numel() == 0:
        return cache
    if int(ids.min()) < 0 or int(ids.max()) >= cache.num_pages:
        raise ValueError(f"page_ids must lie in [0, {cache.num_pages}), got range [{int(ids.min())}, {int(ids.max())}]")
    if ids.unique().numel() != ids.numel():
        raise ValueError("page_ids must not repeat")
    d = cache.desc[ids]                                                # [n, 2, H, nb]
    slot = d[..., :1] >> 8
    raw_contig = (d >> 8) == slot + 1024 * torch.arange(cache.n_blocks, device=d.device)
    if bool(((d >> 7) & 1).any()) or not bool(raw_contig.all()):
        raise ValueError("compress_cache_: every page-head of page_ids must be raw (not yet compressed)")
    for kv, lay in ((0, cache.k_layout), (1, cache.v_layout)):
        off = slot[:, kv, :, 0].reshape(-1).contiguous()
        meta = pack_into(cache.pool, off, cache.pool, off, cache.head_dim, lay, src_packed=True,
                         pages_per_program=pages_per_program)
        m = fmt.PageMeta.from_packed(meta, lay, cache.head_dim)
        new = ((off[:, None] + m.block_offsets()) << 8) | meta.to(torch.int64)
        cache.desc[ids, kv] = new.reshape(ids.numel(), cache.kv_heads, cache.n_blocks)
    return cache.refresh()


# ----------------------------------------------------------------------------- launcher

# GPU launch options per kernel specialisation: pages per tile, warps, pipeline stages, register
# cap and the split-KV target (programs per SM). Defaults below; ``decode_tuning.json`` beside this
# file holds entries measured per GPU model by ``python -m zipkv bench tune --write``
# (:func:`zipkv.bench.tune_decode_attention`), which take precedence on that GPU.
TUNING_FILE = Path(__file__).with_name("decode_tuning.json")
DEFAULT_LAUNCH = dict(pages_per_tile=4, num_warps=4, stages=4, maxnreg=168, programs_per_sm=4)
LAUNCH_KEYS = tuple(DEFAULT_LAUNCH)


def launch_config(path: str, gpu_name: str | None = None) -> dict:
    """Launch options of the ``path`` specialisation (``"compressed"``, ``"raw"`` or ``"mixed"``) on
    the GPU model ``gpu_name`` (``torch.cuda.get_device_name()``): its tuned entry in
    :data:`TUNING_FILE` if there is one, else :data:`DEFAULT_LAUNCH`."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    config = dict(DEFAULT_LAUNCH)
    if gpu_name and TUNING_FILE.exists():
        config.update(_tuned(TUNING_FILE, TUNING_FILE.stat().st_mtime_ns).get(gpu_name, {}).get(path, {}))
    return config


@functools.lru_cache(maxsize=4)
def _tuned(file: Path, mtime_ns: int) -> dict:
    """The tuning file's entries, parsed once per version of the file (not on every call)."""
    return json.loads(file.read_text())


def _check_launch(launch):
    if launch is None:
        return
    if not isinstance(launch, dict) or set(launch) - set(LAUNCH_KEYS):
        raise ValueError(f"launch must be a dict with keys from {LAUNCH_KEYS}, got {launch!r}")


def _plan(cache, path: str):
    """Kernel launches for one call: list of (PATH, ROUTE)."""
    if path not in ("auto", "mixed"):
        raise ValueError(f"path must be 'auto' or 'mixed', got {path!r}")
    if path == "mixed" or (cache.k_layout, cache.v_layout) not in (("token", "token"), ("k_mma", "v_mma")):
        return [(PATH_MIXED, False)]
    kind = cache.kind()
    if kind == "compressed":
        return [(PATH_COMP, False)]
    if kind == "raw":
        return [(PATH_RAW, False)]
    return [(PATH_COMP, True), (PATH_RAW, True), (PATH_MIXED, True)]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes")


def _check_layouts(k_layout, v_layout, head_dim, prefix=""):
    fmt._check_layout(k_layout, f"{prefix}k_layout")
    fmt._check_layout(v_layout, f"{prefix}v_layout")
    fmt._check_layout_head_dim(k_layout, head_dim, f"{prefix}k_layout")
    fmt._check_layout_head_dim(v_layout, head_dim, f"{prefix}v_layout")
    if (k_layout in fmt.MMA_LAYOUTS or v_layout in fmt.MMA_LAYOUTS) and (k_layout, v_layout) != ("k_mma", "v_mma"):
        raise ValueError(f"{prefix}k_layout/v_layout: the mma layouts go together (k_layout='k_mma', "
                         f"v_layout='v_mma'), got k_layout={k_layout!r}, v_layout={v_layout!r}")


def _check_cache(cache):
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    fmt._check_head_dim(cache.head_dim, "cache.head_dim")
    _check_layouts(cache.k_layout, cache.v_layout, cache.head_dim, "cache.")
    p, d = cache.pool, cache.desc
    if not isinstance(p, torch.Tensor) or p.dtype != torch.uint8 or p.dim() != 1 or not p.is_contiguous():
        raise TypeError(f"cache.pool must be a contiguous 1-D uint8 tensor, got "
                        f"{getattr(p, 'dtype', type(p))} {tuple(getattr(p, 'shape', ()))}")
    if p.numel() % 4 or p.data_ptr() % 16:
        raise ValueError(f"cache.pool must be 16-byte aligned with a size multiple of 4, got {p.numel()} bytes "
                         f"at address {p.data_ptr():#x}")
    nb = fmt.n_blocks(cache.head_dim)
    if (not isinstance(d, torch.Tensor) or d.dtype != torch.int64 or d.dim() != 4
            or d.shape[1] != 2 or d.shape[3] != nb or not d.is_contiguous()):
        raise ValueError(f"cache.desc must be a contiguous int64 tensor [num_pages, 2, kv_heads, {nb}], got "
                         f"{getattr(d, 'dtype', type(d))} {tuple(getattr(d, 'shape', ()))}")


def _check_index(x, name, n=None):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {x.dtype}")
    if x.dim() != 1 or (n is not None and x.shape[0] != n):
        want = f"[{n}]" if n is not None else "1-D"
        raise ValueError(f"{name} must have shape {want}, got {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got stride {x.stride()}")


MMA_LAUNCH = dict(programs_per_sm=6, stages=2)
"""Launch options of the mma-layout kernel (one warp per program): the split-KV target in programs
per SM and the pipeline depth (shared-memory ring slots); ``launch`` overrides them. From a sweep on
the H200 at the benchmark's six Llama-shape points: with 2 slots (12.5 KB of shared memory) 12
programs fit on an SM, and about 6 per SM as the target (so 6 to 12 resident, one wave) was the
fastest or within 1 % of it at each point."""


def _check_mma_call(q, cache, interp, cfg):
    """What the mma layouts' Gluon kernel (:mod:`zipkv.kernels.decode_mma`) needs: a CUDA GPU, at most 16
    query heads per KV head, at least 2 ring slots."""
    if q.device.type != "cuda" or interp:
        raise ValueError(f"the k_mma/v_mma layouts are decoded by a Gluon kernel that needs a CUDA GPU "
                         f"(q is on {q.device}{', TRITON_INTERPRET=1' if interp else ''}); "
                         f"use the 'token' layouts on the CPU")
    if q.shape[1] // cache.kv_heads > 16:
        raise ValueError(f"q: the mma-layout kernel takes at most 16 query heads per KV head, got "
                         f"{q.shape[1] // cache.kv_heads} ({q.shape[1]} q heads, {cache.kv_heads} kv heads)")
    if cfg["stages"] < 2:
        raise ValueError(f"launch['stages'] (ring slots of the mma-layout kernel) must be >= 2, got {cfg['stages']}")


def decode_attention(q: torch.Tensor, cache: PagedKVCache, indptr: torch.Tensor,
                     indices: torch.Tensor, last_page_len: torch.Tensor, *,
                     softmax_scale: float | None = None, num_splits: int | None = None,
                     pages_per_tile: int | None = None, out: torch.Tensor | None = None,
                     validate: bool = True, path: str = "auto", launch: dict | None = None) -> torch.Tensor:
    """Decode attention of one new token per request over a paged, partly compressed cache.

    q: bf16 ``[batch, q_heads, head_dim]`` (q_heads a multiple of kv_heads; query head
    ``i`` reads KV head ``i // (q_heads / kv_heads)``). Page table in FlashInfer's CSR form
    (int32; every request has >= 1 page). softmax_scale: default ``1/sqrt(head_dim)``.
    num_splits: split-KV factor (default: about ``programs_per_sm`` programs per SM on the
    GPU, 1 on CPU).
    pages_per_tile: pages per inner tile (default: the launch configuration's on the GPU, 1
    interpreting).
    validate: also check values (indptr consistent, page ids in range, last_page_len in
    1..16) — this syncs with the device; pass False in timed loops / CUDA graphs.
    path: ``"auto"`` (default) routes each (request, kv head) to a specialised kernel --
    all-compressed (every page but the last all-compressed, K and V), all-raw, or mixed --
    from the cache's page kinds (:meth:`PagedKVCache.page_kinds`; the cache-wide kind,
    computed once with one sync, picks a single launch when the cache is uniform, three
    routed launches otherwise). ``"mixed"`` sends everything through the mixed kernel.
    Channel layouts always use the mixed kernel. The mma layouts (``k_layout='k_mma'``,
    ``v_layout='v_mma'``, head_dim 128) go to the Gluon kernel of :mod:`zipkv.kernels.decode_mma`
    (CUDA only; all-compressed and all-raw pages pipelined, other pages and each request's last
    page element by element), launch options :data:`MMA_LAUNCH`.
    launch: overrides of the GPU launch options (keys :data:`LAUNCH_KEYS`) for every launched
    specialisation; default :func:`launch_config` per specialisation. The mma layouts' kernel reads
    ``programs_per_sm`` and ``stages`` (its ring slots) only, default :data:`MMA_LAUNCH`.
    Returns bf16 ``[batch, q_heads, head_dim]``.
    """
    _check_cache(cache)
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype != torch.bfloat16:
        raise TypeError(f"q must have dtype torch.bfloat16, got {q.dtype}")
    D, HKV = cache.head_dim, cache.kv_heads
    if q.dim() != 3 or q.shape[2] != D or q.shape[1] % HKV or q.shape[1] == 0:
        raise ValueError(f"q must have shape [batch, q_heads, {D}] with q_heads a multiple of "
                         f"kv_heads={HKV}, got {tuple(q.shape)}")
    if not q.is_contiguous():
        raise ValueError(f"q must be contiguous, got stride {q.stride()} for shape {tuple(q.shape)}")
    B, HQ = q.shape[0], q.shape[1]
    _check_index(indptr, "indptr", B + 1)
    _check_index(indices, "indices")
    _check_index(last_page_len, "last_page_len", B)
    devs = {t.device for t in (q, cache.pool, cache.desc, indptr, indices, last_page_len)}
    if len(devs) != 1:
        raise ValueError(f"q, cache, indptr, indices and last_page_len must be on one device, got {sorted(map(str, devs))}")
    if validate:
        ip = indptr.tolist()
        if ip[0] != 0 or any(b2 <= a for a, b2 in zip(ip, ip[1:])) or ip[-1] > indices.numel():
            raise ValueError(f"indptr must start at 0, increase strictly (every request has >= 1 page) "
                             f"and end at <= len(indices)={indices.numel()}, got {ip if len(ip) <= 20 else ip[:20] + ['...']}")
        used = indices[: ip[-1]]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= cache.num_pages):
            raise ValueError(f"indices must lie in [0, {cache.num_pages}) (cache.num_pages), got range "
                             f"[{int(used.min())}, {int(used.max())}]")
        if B and (int(last_page_len.min()) < 1 or int(last_page_len.max()) > 16):
            raise ValueError(f"last_page_len must lie in [1, 16], got range "
                             f"[{int(last_page_len.min())}, {int(last_page_len.max())}]")
    if out is None:
        out = torch.empty_like(q)
    elif (not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16 or out.shape != q.shape
          or not out.is_contiguous() or out.device != q.device):
        raise ValueError(f"out must be a contiguous bf16 tensor {tuple(q.shape)} on {q.device}")
    if B == 0:
        return out
    _check_launch(launch)
    interp = _interpreting()
    plan = _plan(cache, path)
    mma = cache.k_layout in fmt.MMA_LAYOUTS
    if mma:                                    # one warp per program, one page per step
        configs = [{**MMA_LAUNCH, **(launch or {})}]
        _check_mma_call(q, cache, interp, configs[0])
        ppt = 1
    else:
        check_launchable(_decode_kernel, q.device, "q")
        gpu = torch.cuda.get_device_name(q.device) if q.device.type == "cuda" else None
        configs = [{**launch_config(PATHS[p], gpu), **(launch or {})} for p, _ in plan]
        ppt = pages_per_tile or (1 if interp else configs[0]["pages_per_tile"])
        if ppt < 1 or ppt & (ppt - 1):
            raise ValueError(f"pages_per_tile must be a power of two >= 1, got {ppt}")
    if num_splits is None:
        if q.device.type == "cuda" and not interp:
            sms = torch.cuda.get_device_properties(q.device).multi_processor_count
            avg_tiles = max(1, indices.numel() // max(B, 1) // ppt)
            want = configs[0]["programs_per_sm"] * sms
            num_splits = max(1, min(avg_tiles, math.ceil(want / (B * HKV))))
        else:
            num_splits = 1
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    if mma:
        from zipkv.kernels.decode_mma import decode_mma
        return decode_mma(q, cache, indptr, indices, last_page_len, cache.page_kinds(), plan, scale, num_splits,
                          out, slots=configs[0]["stages"])
    G = HQ // HKV
    fp32 = interp or q.device.type != "cuda"
    qk = q.float() if fp32 else q
    res = torch.empty(B, HQ, D, dtype=torch.float32, device=q.device) if fp32 else out
    if num_splits > 1:
        part = torch.empty(B, HQ, num_splits, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, HQ, num_splits, dtype=torch.float32, device=q.device)
    else:
        part = lse = res                                               # unused
    kinds = cache.page_kinds()
    for (p, route), cfg in zip(plan, configs):
        _decode_kernel[(B, HKV, num_splits)](
            qk, cache.pool.view(torch.int32), cache.desc, indptr, indices, last_page_len, kinds,
            res, part, lse, scale * math.log2(math.e),
            HKV=HKV, G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D,
            K_LAYOUT=fmt.LAYOUTS.index(cache.k_layout), V_LAYOUT=fmt.LAYOUTS.index(cache.v_layout),
            PPT=pages_per_tile or (1 if interp else cfg["pages_per_tile"]), SPLITS=num_splits, FP32=fp32,
            PATH=p, ROUTE=route, STAGES=cfg["stages"],
            **({} if interp else dict(num_warps=cfg["num_warps"],
                                      **({"maxnreg": cfg["maxnreg"]} if cfg["maxnreg"] else {}))))
    if num_splits > 1:
        _merge_kernel[(B * HQ,)](part, lse, res, D=D, SPLITS=num_splits,
                                 S_PAD=triton.next_power_of_2(num_splits))
    if fp32:
        out.copy_(res)                                                 # torch's fp32 -> bf16 (exact RNE)
    return out
