"""Triton decode kernels of the restore-before-attention codecs (:mod:`zipkv.codecs`).

Both kernels write restored BF16 bit patterns (int16) into a caller's buffer and take every size
from host integers: no allocation, no host sync, CUDA-graph capturable. Every load index is
masked or clamped into its tensor, so a corrupted payload can give wrong values but never an
out-of-bounds access (:func:`zipkv.codecs.validate_payload` finds the corruption).

* :func:`splitzip_decode` (SplitZip-style, arXiv 2605.01708): one program rebuilds ``BLOCK`` values
  (whole 1,024-value chunks) from the sign+mantissa bytes and the 4-bit codes (two per byte,
  even value in the low nibble) through the 16-entry exponent codebook (two 64-bit arguments), then -- after a barrier,
  so its own dense stores are visible -- patches its chunks' escapes (position in chunk, exponent).
* :func:`huffman_decode` (DFloat11-style, arXiv 2504.11651): one program decodes ``CPP`` chunks of
  ``LANES`` lane streams each; lane ``j`` of a chunk decodes the chunk's values ``t*LANES + j``
  (``t`` = 0..S-1) from its own bit stream, so consecutive lanes store consecutive values. A lane's
  start bit is the chunk's start bit plus the other lanes' bit counts before it (a prefix sum in
  registers). Codes are read LSB-first from a 64-bit window refilled one 32-bit word at a time; the
  decode table (``2**max_len`` entries, ``symbol | length << 8``) is read through L1 (default) or held
  in shared memory (``SMEM_LUT=True``: ``tl.gather`` on the table loaded once per program, which Triton
  lowers through shared memory; 3-4x slower on the H200 than the L1 reads).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["splitzip_decode", "huffman_decode"]


@triton.jit
def _bf16_bits(sm, exp):
    """int32 sign+mantissa byte ``s mmmmmmm`` and exponent -> the BF16 bit pattern ``s eeeeeeee mmmmmmm``."""
    return ((sm & 0x80) << 8) | (exp << 7) | (sm & 0x7F)


@triton.jit
def _last_at_most(starts, k, G: tl.constexpr, LOG_G: tl.constexpr):
    """Per element of ``k``: the last ``g`` with ``starts[g] <= k`` (``starts`` [G] sorted, ``starts[0] <= k``),
    by branchless binary search."""
    lo = tl.zeros(k.shape, tl.int32)
    for step in tl.static_range(LOG_G):
        cand = lo + (G >> (step + 1))
        lo = tl.where(tl.gather(starts, cand, 0) <= k, cand, lo)
    return lo


@triton.jit
def _escape_range(chunk0, esc_indptr_ptr, n_chunks, G: tl.constexpr):
    """The escapes of chunks chunk0 .. chunk0+G-1: their first escapes ``starts`` [G] and the range e0 .. e1."""
    g = tl.arange(0, G)
    starts = tl.load(esc_indptr_ptr + tl.minimum(chunk0 + g, n_chunks))    # [G] first escape of each chunk
    ends = tl.load(esc_indptr_ptr + tl.minimum(chunk0 + g + 1, n_chunks))
    return starts, tl.min(starts, 0), tl.max(ends, 0)


@triton.jit
def _escape_block(e, e1, chunk0, starts, sm_ptr, esc_pos_ptr, esc_exp_ptr, n_values,
                  G: tl.constexpr, CHUNK: tl.constexpr, ESC_BLOCK: tl.constexpr, LOG_G: tl.constexpr):
    """Escapes e .. e+ESC_BLOCK-1 (those below e1): value index, its BF16 bits, and which are live (loads only)."""
    k = e + tl.arange(0, ESC_BLOCK)
    live = k < e1
    pos = tl.load(esc_pos_ptr + k, mask=live, other=0).to(tl.int32)
    ex = tl.load(esc_exp_ptr + k, mask=live, other=0).to(tl.int32)
    chunk = chunk0 + _last_at_most(starts, k, G, LOG_G)
    v = chunk.to(tl.int64) * CHUNK + pos
    live = live & (pos >= 0) & (pos < CHUNK) & (v < n_values)
    s = tl.load(sm_ptr + v, mask=live, other=0).to(tl.int32)
    return v, _bf16_bits(s, ex).to(tl.int16), live


@triton.jit
def _patch_escapes(pid, sm_ptr, esc_indptr_ptr, esc_pos_ptr, esc_exp_ptr, out_ptr, n_values, n_chunks,
                   G: tl.constexpr, CHUNK: tl.constexpr, ESC_BLOCK: tl.constexpr, LOG_G: tl.constexpr):
    """Program ``pid``'s escapes (its G chunks'): value chunk*CHUNK + pos gets exponent esc_exp."""
    chunk0 = pid * G
    starts, e0, e1 = _escape_range(chunk0, esc_indptr_ptr, n_chunks, G)
    _patch_escape_blocks(e0, e1, chunk0, starts, sm_ptr, esc_pos_ptr, esc_exp_ptr, out_ptr, n_values,
                         G, CHUNK, ESC_BLOCK, LOG_G)


@triton.jit
def _patch_escape_blocks(e, e1, chunk0, starts, sm_ptr, esc_pos_ptr, esc_exp_ptr, out_ptr, n_values,
                         G: tl.constexpr, CHUNK: tl.constexpr, ESC_BLOCK: tl.constexpr, LOG_G: tl.constexpr):
    """Store escapes e .. e1-1, ESC_BLOCK at a time."""
    while e < e1:                               # (a while loop: the interpreter's range() takes no tensor bounds)
        v, bits, live = _escape_block(e, e1, chunk0, starts, sm_ptr, esc_pos_ptr, esc_exp_ptr, n_values,
                                      G, CHUNK, ESC_BLOCK, LOG_G)
        tl.store(out_ptr + v, bits, mask=live)
        e += ESC_BLOCK


@triton.jit
def _splitzip_kernel(sm_ptr, code_ptr, book_lo, book_hi, esc_indptr_ptr, esc_pos_ptr, esc_exp_ptr, out_ptr,
                     n_values, n_chunks, n_padded, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                     ESC_BLOCK: tl.constexpr, LOG_G: tl.constexpr):
    G: tl.constexpr = BLOCK // CHUNK
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < n_padded
    c = tl.load(code_ptr + idx // 2, mask=ok, other=0).to(tl.int32)  # value 2i: low nibble, 2i+1: high
    code = (c >> ((idx & 1) * 4).to(tl.int32)) & 15
    # the codebook as 16 bytes in two 64-bit words: no table load per value
    word = tl.where(code < 8, book_lo, book_hi).to(tl.int64)
    exp = ((word >> ((code & 7) * 8).to(tl.int64)) & 0xFF).to(tl.int32)
    sm = tl.load(sm_ptr + idx, mask=ok, other=0).to(tl.int32)
    tl.store(out_ptr + idx, _bf16_bits(sm, exp).to(tl.int16), mask=idx < n_values)
    tl.debug_barrier()                          # the escape stores below land after the dense ones
    _patch_escapes(pid, sm_ptr, esc_indptr_ptr, esc_pos_ptr, esc_exp_ptr, out_ptr, n_values, n_chunks,
                   G, CHUNK, ESC_BLOCK, LOG_G)


@triton.jit
def _splitzip_words_kernel(sm32_ptr, code16_ptr, sm_ptr, book_lo, book_hi, esc_indptr_ptr, esc_pos_ptr, esc_exp_ptr,
                           out64_ptr, out_ptr, n_values, n_chunks, n_words, BLOCK: tl.constexpr,
                           CHUNK: tl.constexpr, ESC_BLOCK: tl.constexpr, LOG_G: tl.constexpr,
                           EARLY: tl.constexpr):
    """The same decode on 32-bit words: 4 sign+mantissa bytes and their 4 codes (16 bits) -> 4 BF16 values
    as one 64-bit store (n_values a multiple of 4, the output 8-byte aligned). ``EARLY``: the first ESC_BLOCK
    escapes are loaded (a chain of three dependent loads) while the dense words are in flight, and only
    stored after the barrier."""
    G: tl.constexpr = BLOCK // CHUNK
    pid = tl.program_id(0)
    w = pid.to(tl.int64) * (BLOCK // 4) + tl.arange(0, BLOCK // 4)
    ok = w < n_words
    S = tl.load(sm32_ptr + w, mask=ok, other=0).to(tl.int64) & 0xFFFFFFFF
    C = tl.load(code16_ptr + w, mask=ok, other=0).to(tl.int64) & 0xFFFF
    if EARLY:
        chunk0 = pid * G
        starts, e0, e1 = _escape_range(chunk0, esc_indptr_ptr, n_chunks, G)
        v, bits, live = _escape_block(e0, e1, chunk0, starts, sm_ptr, esc_pos_ptr, esc_exp_ptr, n_values,
                                      G, CHUNK, ESC_BLOCK, LOG_G)
    x = (S | (S << 16)) & 0x0000FFFF0000FFFF     # byte j of S -> bits 16j .. 16j+7
    x = (x | (x << 8)) & 0x00FF00FF00FF00FF
    out = (x & 0x007F007F007F007F) | ((x & 0x0080008000800080) << 8)
    for j in tl.static_range(4):                 # value j's code is nibble j of C
        c = (C >> (4 * j)) & 15
        book = tl.where(c < 8, book_lo, book_hi).to(tl.int64)
        out |= ((book >> ((c & 7) * 8)) & 0xFF) << (16 * j + 7)
    tl.store(out64_ptr + w, out, mask=ok)
    tl.debug_barrier()
    if EARLY:
        tl.store(out_ptr + v, bits, mask=live)
        _patch_escape_blocks(e0 + ESC_BLOCK, e1, chunk0, starts, sm_ptr, esc_pos_ptr, esc_exp_ptr, out_ptr,
                             n_values, G, CHUNK, ESC_BLOCK, LOG_G)
    else:
        _patch_escapes(pid, sm_ptr, esc_indptr_ptr, esc_pos_ptr, esc_exp_ptr, out_ptr, n_values, n_chunks,
                       G, CHUNK, ESC_BLOCK, LOG_G)


@triton.jit
def _huffman_kernel(stream_ptr, chunk_bits_ptr, lane_bits_ptr, lut_ptr, sm_ptr, out_ptr,
                    n_values, n_chunks, n_words, CPP: tl.constexpr, LANES: tl.constexpr, S: tl.constexpr,
                    LUT_BITS: tl.constexpr, SMEM_LUT: tl.constexpr):
    R: tl.constexpr = CPP * LANES
    pid = tl.program_id(0)
    r = tl.arange(0, R)
    chunk = pid * CPP + r // LANES
    lane = r % LANES
    ok = chunk < n_chunks
    lb = tl.load(lane_bits_ptr + chunk * LANES + lane, mask=ok, other=0).to(tl.int32)
    lb2 = tl.reshape(lb, (CPP, LANES))
    before = tl.reshape(tl.cumsum(lb2, axis=1) - lb2, (R,))          # bits of the chunk's earlier lanes
    start = tl.load(chunk_bits_ptr + chunk, mask=ok, other=0) + before.to(tl.int64)
    word = start >> 5
    off = (start & 31).to(tl.int32)
    w0 = tl.load(stream_ptr + tl.minimum(tl.maximum(word, 0), n_words - 1)).to(tl.int64) & 0xFFFFFFFF
    w1 = tl.load(stream_ptr + tl.minimum(tl.maximum(word + 1, 0), n_words - 1)).to(tl.int64) & 0xFFFFFFFF
    buf = w0 | (w1 << 32)                                              # bits [32*word, 32*word + 64)
    if SMEM_LUT:
        lut = tl.load(lut_ptr + tl.arange(0, 1 << LUT_BITS)).to(tl.int32)
    v = chunk.to(tl.int64) * (LANES * S) + lane
    for t in range(S):
        peek = ((buf >> off) & ((1 << LUT_BITS) - 1)).to(tl.int32)
        if SMEM_LUT:
            entry = tl.gather(lut, peek, 0)
        else:
            entry = tl.load(lut_ptr + peek).to(tl.int32)
        sm = tl.load(sm_ptr + v, mask=ok, other=0).to(tl.int32)
        tl.store(out_ptr + v, _bf16_bits(sm, entry & 0xFF).to(tl.int16), mask=ok & (v < n_values))
        v += LANES
        off += (entry >> 8) & 0xFF                                     # off + length < 44: inside the window
        refill = off >= 32
        word = tl.where(refill, word + 1, word)
        nxt = tl.load(stream_ptr + tl.minimum(tl.maximum(word + 1, 0), n_words - 1), mask=refill & ok, other=0)
        buf = tl.where(refill, ((buf >> 32) & 0xFFFFFFFF) | ((nxt.to(tl.int64) & 0xFFFFFFFF) << 32), buf)
        off = tl.where(refill, off - 32, off)


# ----------------------------------------------------------------------------- launchers

def _interpreting() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes")


# GPU launch options from the H200 sweep (results/paper/zipfusion_restore_launch_sweep.csv, 8b5f44b): SplitZip on
# 32-bit words with the first escapes loaded before the barrier, 8 chunks x 4 warps: the launch whose slower tensor is
# fastest (K 2.07, V 2.01 TB/s; without early escapes 4 x 2 gave K 2.11, V 1.98). Huffman 16 chunks x 4 warps with the
# table read through L1 (the shared-memory gather was 2-7x slower).
SPLITZIP_LAUNCH = dict(chunks_per_program=8, num_warps=4, words=True, early_escapes=True)
"""``words``: the 32-bit-word SplitZip kernel where it applies, else the per-value one (both bit-exact; the sweep
of :func:`zipkv.study.experiments.restore_baselines.decode_launch_sweep` times both)."""
HUFFMAN_LAUNCH = dict(chunks_per_program=16, num_warps=4, smem_lut=False)


def _book_words(book: list[int]):
    """The 16 codebook exponents as two signed 64-bit integers (entry i in byte i % 8)."""
    words = []
    for half in (book[:8], book[8:]):
        w = sum(int(e) << (8 * i) for i, e in enumerate(half))
        words.append(w - (1 << 64) if w >= 1 << 63 else w)
    return words


def splitzip_decode(sm, codes, book, esc_indptr, esc_pos, esc_exp, out16, n_values: int, n_chunks: int,
                    chunk: int, *, chunks_per_program: int | None = None, num_warps: int | None = None,
                    words: bool | None = None, early_escapes: bool | None = None):
    """Launch the SplitZip-style decode (arguments already validated by :mod:`zipkv.codecs`). words: the
    32-bit-word kernel where it applies (``n_values % 4 == 0``, ``out16`` 8-byte aligned), else per value;
    early_escapes: the word kernel loads its first escapes before the barrier.

    sm uint8 ``[n_chunks*chunk]``; codes uint8 ``[n_chunks*chunk/2]``; book: 16 exponents (host ints);
    esc_indptr int32 ``[n_chunks+1]``; esc_pos int16, esc_exp uint8 ``[n_escapes]``; out16 int16 ``[n_values]``.
    """
    interp = _interpreting()
    # the interpreter's cost is per operation: few programs of many values, one escape pass each
    g = chunks_per_program or (min(256, n_chunks) if interp else SPLITZIP_LAUNCH["chunks_per_program"])
    g = triton.next_power_of_2(g)
    grid = (triton.cdiv(n_chunks, g),)
    lo, hi = _book_words(book)
    meta = dict(BLOCK=g * chunk, CHUNK=chunk, ESC_BLOCK=g * chunk if interp else 128, LOG_G=g.bit_length() - 1,
                num_warps=num_warps or SPLITZIP_LAUNCH["num_warps"])
    if words is None:
        words = SPLITZIP_LAUNCH["words"]
    if words and n_values % 4 == 0 and out16.data_ptr() % 8 == 0:
        _splitzip_words_kernel[grid](sm.view(torch.int32), codes.view(torch.int16), sm, lo, hi, esc_indptr, esc_pos,
                                     esc_exp, out16.view(torch.int64), out16, n_values, n_chunks, n_values // 4,
                                     EARLY=SPLITZIP_LAUNCH["early_escapes"] if early_escapes is None else early_escapes,
                                     **meta)
    else:
        _splitzip_kernel[grid](sm, codes, lo, hi, esc_indptr, esc_pos, esc_exp, out16, n_values, n_chunks,
                               n_chunks * chunk, **meta)


def huffman_decode(stream, chunk_bits, lane_bits, lut, sm, out16, n_values: int, n_chunks: int, lanes: int,
                   per_lane: int, lut_bits: int, *, chunks_per_program: int | None = None,
                   num_warps: int | None = None, smem_lut: bool | None = None):
    """Launch the Huffman-exponent decode (arguments already validated by :mod:`zipkv.codecs`).

    stream int32 words ``[n_words]``; chunk_bits int64 ``[n_chunks]``; lane_bits int16 ``[n_chunks, lanes]``;
    lut int16 ``[2**lut_bits]``; sm uint8 ``[n_chunks*lanes*per_lane]``; out16 int16 ``[n_values]``.
    """
    interp = _interpreting()
    cpp = chunks_per_program or (min(4096, n_chunks) if interp else HUFFMAN_LAUNCH["chunks_per_program"])
    cpp = triton.next_power_of_2(cpp)
    smem = HUFFMAN_LAUNCH["smem_lut"] if smem_lut is None else smem_lut
    grid = (triton.cdiv(n_chunks, cpp),)
    _huffman_kernel[grid](stream, chunk_bits, lane_bits, lut, sm, out16, n_values, n_chunks, stream.numel(),
                          CPP=cpp, LANES=lanes, S=per_lane, LUT_BITS=lut_bits, SMEM_LUT=bool(smem),
                          num_warps=num_warps or HUFFMAN_LAUNCH["num_warps"])
