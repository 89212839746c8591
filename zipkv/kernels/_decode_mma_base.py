"""Fused decode attention for the mma layouts (ZipFusion §III-C), written in Gluon.

The caches of :mod:`zipkv.paged` with ``k_layout="k_mma"`` and
``v_layout="v_mma"`` (head_dim 128, see :mod:`zipkv.format`) store each 512-value block so that
one thread's tensor-core operand values (``mma.m16n8k16``, bf16 B operand: keys for ``q @ K^T``,
values for ``P @ V``) are two or four runs of 16 contiguous bytes. Gluon (Triton's explicit-layout
dialect, ``triton.experimental.gluon``) lets the kernel say so: a page is copied with 16-byte
``cp.async`` into a ring of shared-memory slots (each thread later reads back exactly the bytes
it copied, so no barrier between threads is needed), read into registers in a blocked layout whose
reshape/permute *is* the operand layout (the conversion is a register renaming, checked offline),
rebuilt with integer ops and fed to ``mma``. Nothing is written back to shared memory and no layout
conversion moves data between threads.

One warp per program: grid ``(batch, kv_heads, num_splits)``, the program's ``G`` query rows padded
to 16 (the A operand, kept in registers), online softmax over one page (16 tokens) per step.

Specialisations (constexpr ``KIND``, the page kinds of :mod:`zipkv.paged`), all through the same
pipeline -- with a ring of S slots (launch option ``stages``, default 2), the data of pages
i+1 .. i+S-1, the descriptors of page i+S and the page id of i+S+1 are in flight while page i is
computed:

* COMPRESSED: pages whose K and V blocks are all compressed. The rebuild uses a fixed exponent base
  128 (``high = sign << 7 | (64 + offset)``: one ``or`` per 4 values, no per-block operand) and undoes
  it exactly with a power of two per token: ``2^(b - 128)`` on the scores for keys, on P for values (a
  block with b = 0 gets 0: exact for an all-zero block; a value below 2^-126 would be flushed).
* RAW: raw blocks (bf16 in block position order): the uncompressed baseline, the same kernel with
  compression switched off.
* MIXED: any page, each block as stored. A block covers fixed rows of the operand tiles (keys: the
  4 token rows of the block; values: one of the 4 block rows of every value chunk), so a ring slot of
  raw size holds each block's stored bytes in the rows it covers (:func:`_issue_mixed`: only stored
  bytes are read), the slot is read once as 32-bit words, and one word-wise select per 4 values takes
  the rebuilt or the raw bf16 pairs (:func:`_select_words`); a raw token's scale is 1. Measured on the
  H200 (8192 x 64, Llama-3.1-8B shape): the measured real mix in 492 us; the same specialisation on
  all-compressed pages 492 us (COMPRESSED: 379 us) and on all-raw pages 1083 us (RAW: 502 us), so its
  per-page cost, not its bytes, bounds it (an earlier version with two rings, zero-filled copies and
  both rings read took 1015 us on the mix, L1/TEX-bound under Nsight Compute: 73 % vs DRAM 35 %).

Every launch takes every page of its requests, the last one too (tokens past ``last_page_len`` are
masked), so a batch is one launch (:func:`zipkv.kernels.decode_attention.plan`: COMPRESSED or RAW for
a uniform cache, MIXED otherwise), and it merges its own splits: the last split of each request and
KV head to arrive does it (:func:`_finish`).

Gluon has no interpreter (``TRITON_INTERPRET=1``): this kernel runs on CUDA GPUs only; its tests
run on the GPU, the format and the pack kernel are tested on the CPU.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from zipkv import format as fmt
from zipkv import paged

__all__ = ["launch", "workspace", "MMA_LAUNCH"]

MMA_LAUNCH = dict(programs_per_sm=6, stages=2)
"""Launch options of this kernel (one warp per program): the split-KV target in programs per SM and
the pipeline depth (shared-memory ring slots); a plan's ``launch`` overrides them. From a sweep on the
H200 at the benchmark's six Llama-shape points: with 2 slots (12.5 KB of shared memory) 12 programs
fit on an SM, and about 6 per SM as the target (so 6 to 12 resident, one wave) was the fastest or
within 1 % of it at each point."""
MAX_GROUP = 16
"""Query heads per KV head this kernel takes (the A operand's 16 rows)."""

D = fmt.MMA_HEAD_DIM
COMPRESSED = gl.constexpr(paged.COMPRESSED)
RAW = gl.constexpr(paged.RAW)
MIXED = gl.constexpr(paged.MIXED)
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA.value, k_width=2))
B_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA.value, k_width=2))
# Key page in registers: [16 tokens, 4 lanes q, 16 values]: lanes = q, t0..t2; registers = values, t3.
K_REGS = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 1, 16], threads_per_warp=[8, 4, 1],
                                       warps_per_cta=[1, 1, 1], order=[2, 1, 0]))
# Value block chunk in registers: [4 blocks, 8 lanes m, 16 values]: lanes = block (t1, t2), c0..c2.
V_REGS = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 1, 16], threads_per_warp=[4, 8, 1],
                                       warps_per_cta=[1, 1, 1], order=[2, 0, 1]))
ROWS = gl.constexpr(gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[1], order=[0]))
# The same tiles as 32-bit words (MIXED pages): [16 tokens, 4 lanes q, 4 words] and [4 blocks, 8 lanes m, 4 words].
K_WORDS = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 1, 4], threads_per_warp=[8, 4, 1],
                                        warps_per_cta=[1, 1, 1], order=[2, 1, 0]))
V_WORDS = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 1, 4], threads_per_warp=[4, 8, 1],
                                        warps_per_cta=[1, 1, 1], order=[2, 0, 1]))
RING = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0]))
SCALES = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
COLS = gl.constexpr(gl.SliceLayout(0, MMA.value))
K_ROWS = gl.constexpr(gl.SliceLayout(1, gl.SliceLayout(2, K_REGS.value)))   # a key tile's 16 token rows
V_ROWS = gl.constexpr(gl.SliceLayout(1, gl.SliceLayout(2, V_REGS.value)))   # a value chunk's 4 block rows


# ----------------------------------------------------------------------------- rebuild

@gluon.jit
def _rebuild128(low, code, HIGH: gl.constexpr):
    """uint8 low bytes + uint8 code bytes (low or HIGH nibble) -> bf16 with exponent base 128,
    4 values per asm: high byte ``(c << 4) & 0x80 | c & 7 | 0x40``, two byte permutes."""
    if HIGH:
        return gl.inline_asm_elementwise(
            "{ .reg .b32 n, t; and.b32 n, $3, 0x80808080; shr.b32 t, $3, 4; and.b32 t, t, 0x07070707; "
            "or.b32 n, n, t; or.b32 n, n, 0x40404040; prmt.b32 $0, $2, n, 0x5140; prmt.b32 $1, $2, n, 0x7362; }",
            "=r,=r,r,r", [low, code], dtype=gl.bfloat16, is_pure=True, pack=4)
    else:
        return gl.inline_asm_elementwise(
            "{ .reg .b32 n, t; shl.b32 n, $3, 4; and.b32 n, n, 0x80808080; and.b32 t, $3, 0x07070707; "
            "or.b32 n, n, t; or.b32 n, n, 0x40404040; prmt.b32 $0, $2, n, 0x5140; prmt.b32 $1, $2, n, 0x7362; }",
            "=r,=r,r,r", [low, code], dtype=gl.bfloat16, is_pure=True, pack=4)


@gluon.jit
def _select_words(low, code, raw_a, raw_b, comp, HIGH: gl.constexpr):
    """MIXED pages, per 32-bit word (4 values): where ``comp``, the bf16 pair words rebuilt (base 128) from a
    low-byte word and a code word (its low or HIGH nibbles), else the raw pair words ``raw_a``, ``raw_b``
    (values 0-1, 2-3 of the 4). int32 in, int32 out."""
    if HIGH:
        return gl.inline_asm_elementwise(
            "{ .reg .b32 n, t, x, y; .reg .pred p; setp.ne.b32 p, $6, 0; and.b32 n, $3, 0x80808080; shr.b32 t, $3, 4; "
            "and.b32 t, t, 0x07070707; or.b32 n, n, t; or.b32 n, n, 0x40404040; prmt.b32 x, $2, n, 0x5140; "
            "prmt.b32 y, $2, n, 0x7362; selp.b32 $0, x, $4, p; selp.b32 $1, y, $5, p; }",
            "=r,=r,r,r,r,r,r", [low, code, raw_a, raw_b, comp], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
    else:
        return gl.inline_asm_elementwise(
            "{ .reg .b32 n, t, x, y; .reg .pred p; setp.ne.b32 p, $6, 0; shl.b32 n, $3, 4; and.b32 n, n, 0x80808080; "
            "and.b32 t, $3, 0x07070707; or.b32 n, n, t; or.b32 n, n, 0x40404040; prmt.b32 x, $2, n, 0x5140; "
            "prmt.b32 y, $2, n, 0x7362; selp.b32 $0, x, $4, p; selp.b32 $1, y, $5, p; }",
            "=r,=r,r,r,r,r,r", [low, code, raw_a, raw_b, comp], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)


@gluon.jit
def _raw_pairs(first, second, WORDS: gl.constexpr):
    """Two 16-byte chunks of raw bf16 (values 0-7, 8-15; int32 [a, b, 4] words) -> the words of values
    (4w, 4w+1) and (4w+2, 4w+3), w = 0..3, as :func:`_select_words` pairs them (register regrouping only)."""
    fe, fo = gl.split(first.reshape([first.shape[0], first.shape[1], 2, 2]))
    se, so = gl.split(second.reshape([second.shape[0], second.shape[1], 2, 2]))
    a = gl.join(fe, se).permute([0, 1, 3, 2]).reshape([first.shape[0], first.shape[1], 4])
    b = gl.join(fo, so).permute([0, 1, 3, 2]).reshape([first.shape[0], first.shape[1], 4])
    return gl.convert_layout(a, WORDS), gl.convert_layout(b, WORDS)


@gluon.jit
def _words_to_values(a, b, REGS: gl.constexpr):
    """Pair words of values (4w, 4w+1) and (4w+2, 4w+3) ``[x, y, 4]`` -> bf16 ``[x, y, 16]`` in REGS."""
    a0, a1 = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [a], dtype=(gl.bfloat16, gl.bfloat16),
                                       is_pure=True, pack=1)
    b0, b1 = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [b], dtype=(gl.bfloat16, gl.bfloat16),
                                       is_pure=True, pack=1)
    v = gl.join(gl.join(a0, a1), gl.join(b0, b1))                      # [x, y, w, ab, lohi]
    v = v.permute([0, 1, 2, 4, 3]).reshape([a.shape[0], a.shape[1], 16])
    return gl.convert_layout(v, REGS)


@gluon.jit
def _pow2(b2):
    """``2^(b - 128)`` for the block base ``b = 2 * b2`` (fp32; 0 for b = 0, below the normal range)."""
    e = 2 * b2.to(gl.int32) - 1
    return gl.where(e > 0, e << 23, 0).to(gl.float32, bitcast=True)


@gluon.jit
def _key_operand(k0, k1):
    """The two key halves ``[16, 4, 16]`` (channel bit 6 = 0, 1) -> the B operand ``[128, 16]``."""
    k = gl.join(k0, k1).reshape([16, 4, 8, 2, 2]).permute([4, 2, 1, 3, 0]).reshape([128, 16])
    return gl.convert_layout(k, B_OP)


@gluon.jit
def _value_operand(v0, v1, v2, v3):
    """The four value chunks ``[4, 8, 16]`` (channel bits 5, 6) -> the B operand ``[16, 128]``."""
    v = gl.join(gl.join(v0, v1), gl.join(v2, v3))                    # [blk, m, r, c5, c6]
    v = v.reshape([2, 2, 8, 2, 2, 2, 2, 2, 2]).permute([5, 0, 1, 6, 8, 7, 3, 4, 2]).reshape([16, 128])
    return gl.convert_layout(v, B_OP)


@gluon.jit
def _softmax_step(q, kop, vop, m_i, l_i, acc, k_scale, v_scale, valid):
    """One page of ``valid`` tokens: scores (log2 domain, scaled per token), online softmax,
    ``acc += P @ V``."""
    st = gl.arange(0, 16, layout=COLS)
    sc = mma_v2(q, kop, gl.zeros([16, 16], gl.float32, layout=MMA)) * k_scale[None, :]
    sc = gl.where((st < valid)[None, :], sc, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(sc, axis=1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(sc - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    pb = gl.convert_layout((p * v_scale[None, :]).to(gl.bfloat16), A_OP)
    return m_new, l_i, mma_v2(pb, vop, acc * alpha[:, None])


# ----------------------------------------------------------------------------- pipeline

@gluon.jit
def _descs(desc_ptr, page, h, HKV: gl.constexpr):
    """Descriptors of one page: keys per token row ``[16]``, values per block ``[4]``."""
    kt = gl.arange(0, 16, layout=K_ROWS)
    vb = gl.arange(0, 4, layout=V_ROWS)
    kd = gl.load(desc_ptr + (page * 2 * HKV + h) * 4 + kt // 4)
    vd = gl.load(desc_ptr + ((page * 2 + 1) * HKV + h) * 4 + vb)
    return kd, vd


@gluon.jit
def _compressed(dsc):
    return ((dsc >> 7) & 1) != 0


@gluon.jit
def _scales(desc_ptr, page, h, qk_scale, HKV: gl.constexpr, KIND: gl.constexpr):
    """Per token of the page (an S / P column): the key scale (softmax scale included) and the
    value scale, ``2^(b - 128)`` of the token's block if it is compressed, else 1."""
    st = gl.arange(0, 16, layout=COLS)
    if KIND == RAW:
        return gl.full([16], qk_scale, gl.float32, layout=COLS), gl.full([16], 1.0, gl.float32, layout=COLS)
    kd = gl.load(desc_ptr + (page * 2 * HKV + h) * 4 + st // 4)
    vd = gl.load(desc_ptr + ((page * 2 + 1) * HKV + h) * 4 + (st >> 1) % 4)
    ks = _pow2(kd & 0x7F)
    vs = _pow2(vd & 0x7F)
    if KIND == MIXED:
        ks = gl.where(_compressed(kd), ks, 1.0)
        vs = gl.where(_compressed(vd), vs, 1.0)
    return ks * qk_scale, vs


@gluon.jit
def _tile_indices():
    """Index vectors of the ring tiles: key tile ``[16 tokens t, 4 lanes q, 16 bytes j]``, value chunk
    ``[4 blocks, 8 lanes m, 16 bytes r]``, each in the layout of its dimension."""
    kt = gl.arange(0, 16, layout=K_ROWS)
    kq = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, K_REGS)))
    kj = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, K_REGS)))
    vm = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, V_REGS)))
    vr = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, V_REGS)))
    return kt, kq, kj, vm, vr


@gluon.jit
def _issue_compressed(pool_ptr, kbuf, vbuf, slot, kd, vd):
    """cp.async of a page's compressed blocks into ring ``slot``: keys as 3 tiles ``[16, 4, 16]`` (low
    bytes of channel bit 6 = 0, 1; codes), values as 6 chunks ``[4, 8, 16]`` (low bytes of channel bits
    (5, 6) = c; codes of bit 5 = c - 4); 16 contiguous bytes per thread and copy."""
    kt, kq, kj, vm, vr = _tile_indices()
    k_in = (kq * 16)[None, :, None] + kj[None, None, :]
    v_in = (vm * 16)[None, :, None] + vr[None, None, :]
    ka = pool_ptr + gl.multiple_of((kd >> 8) + (kt % 4) * 64, 16)[:, None, None] + k_in
    va = pool_ptr + gl.multiple_of(vd >> 8, 256)[:, None, None] + v_in
    for c in gl.static_range(3):
        async_copy.async_copy_global_to_shared(kbuf.index(slot * 3 + c), ka + c * 256)
    for c in gl.static_range(6):
        async_copy.async_copy_global_to_shared(vbuf.index(slot * 6 + c), va + c * 128)


@gluon.jit
def _issue_raw(pool_ptr, kbuf, vbuf, slot, kd, vd):
    """cp.async of a page's raw blocks (bf16 in position order: the compressed copies' indices in 2-byte
    units) into ring ``slot``: keys as 2 tiles ``[16, 4, 16]``, values as 4 chunks ``[4, 8, 16]``."""
    kt, kq, kj, vm, vr = _tile_indices()
    k_in = (kq * 16)[None, :, None] + kj[None, None, :]
    v_in = (vm * 16)[None, :, None] + vr[None, None, :]
    pool16 = pool_ptr.to(gl.pointer_type(gl.bfloat16))
    ka = pool16 + gl.multiple_of((kd >> 9) + (kt % 4) * 64, 8)[:, None, None] + k_in
    va = pool16 + gl.multiple_of(vd >> 9, 128)[:, None, None] + v_in
    for c in gl.static_range(2):
        async_copy.async_copy_global_to_shared(kbuf.index(slot * 2 + c), ka + c * 256)
    for c in gl.static_range(4):
        async_copy.async_copy_global_to_shared(vbuf.index(slot * 4 + c), va + c * 128)


@gluon.jit
def _issue_mixed(pool_ptr, kbuf, vbuf, slot, kd, vd):
    """cp.async of a page of any blocks into ring ``slot`` of raw size: keys as 4 tiles ``[16, 4, 16]``, values
    as 8 chunks ``[4, 8, 16]`` of bytes. A compressed key row fills tiles 0-2 (low bytes of channel bit 6 = 0,
    1; codes), a raw one tiles 0-1 (its bf16 of channel bit 6 = 0) and 2-3 (bit 6 = 1); a compressed value
    block row fills chunks 0-5 as the compressed ring, a raw one chunk 2c + i with bytes 16i.. of its bf16
    chunk c. Only stored bytes are read (the unused tiles of a compressed row are zero-filled)."""
    kt, kq, kj, vm, vr = _tile_indices()
    kc = _compressed(kd)
    vc = _compressed(vd)
    kq3 = kq[None, :, None]
    vm3 = vm[None, :, None]
    kc3 = kc[:, None, None]
    vc3 = vc[:, None, None]
    kbase = ((kd >> 8) + (kt % 4) * 64)[:, None, None]
    for u in gl.static_range(4):
        off = gl.where(kc3, kbase + u * 256 + kq3 * 16, kbase * 2 - (kd >> 8)[:, None, None]
                       + (u // 2) * 512 + kq3 * 32 + (u % 2) * 16)
        ptr = pool_ptr + gl.multiple_of(off, [16, 16, 16]) + kj[None, None, :]
        if u == 3:
            async_copy.async_copy_global_to_shared(kbuf.index(slot * 4 + u), ptr, mask=~kc3)
        else:
            async_copy.async_copy_global_to_shared(kbuf.index(slot * 4 + u), ptr)
    vbase = (vd >> 8)[:, None, None]
    for u in gl.static_range(8):
        off = gl.where(vc3, vbase + u * 128 + vm3 * 16, vbase + (u // 2) * 256 + vm3 * 32 + (u % 2) * 16)
        ptr = pool_ptr + gl.multiple_of(off, [16, 16, 16]) + vr[None, None, :]
        if u >= 6:
            async_copy.async_copy_global_to_shared(vbuf.index(slot * 8 + u), ptr, mask=~vc3)
        else:
            async_copy.async_copy_global_to_shared(vbuf.index(slot * 8 + u), ptr)


@gluon.jit
def _issue(pool_ptr, kbuf, vbuf, kflags, vflags, slot, kd, vd, KIND: gl.constexpr):
    """cp.async of one page into ring ``slot`` (MIXED: its block flags into ``kflags`` / ``vflags``)."""
    if KIND == COMPRESSED:
        _issue_compressed(pool_ptr, kbuf, vbuf, slot, kd, vd)
    elif KIND == RAW:
        _issue_raw(pool_ptr, kbuf, vbuf, slot, kd, vd)
    else:
        _issue_mixed(pool_ptr, kbuf, vbuf, slot, kd, vd)
        kflags.index(slot).store(_compressed(kd).to(gl.int32))
        vflags.index(slot).store(_compressed(vd).to(gl.int32))


@gluon.jit
def _rebuilt_keys(kbuf, slot):
    kc = kbuf.index(slot * 3 + 2).load(K_REGS)
    return (_rebuild128(kbuf.index(slot * 3).load(K_REGS), kc, False),
            _rebuild128(kbuf.index(slot * 3 + 1).load(K_REGS), kc, True))


@gluon.jit
def _rebuilt_values(vbuf, slot):
    c0 = vbuf.index(slot * 6 + 4).load(V_REGS)
    c1 = vbuf.index(slot * 6 + 5).load(V_REGS)
    return (_rebuild128(vbuf.index(slot * 6).load(V_REGS), c0, False),
            _rebuild128(vbuf.index(slot * 6 + 1).load(V_REGS), c1, False),
            _rebuild128(vbuf.index(slot * 6 + 2).load(V_REGS), c0, True),
            _rebuild128(vbuf.index(slot * 6 + 3).load(V_REGS), c1, True))


@gluon.jit
def _mixed_operands(kbuf, vbuf, kflags, vflags, slot):
    """MIXED page in ring ``slot`` -> the bf16 key tiles (channel bit 6 = 0, 1) and value chunks, each row
    rebuilt or raw as its block is stored: one word-wise rebuild-or-raw select (:func:`_select_words`)."""
    kw = kbuf._reinterpret(gl.int32, [kbuf.shape[0], 16, 4, 4], RING)
    vw = vbuf._reinterpret(gl.int32, [vbuf.shape[0], 4, 8, 4], RING)
    t0 = kw.index(slot * 4).load(K_WORDS)
    t1 = kw.index(slot * 4 + 1).load(K_WORDS)
    t2 = kw.index(slot * 4 + 2).load(K_WORDS)
    t3 = kw.index(slot * 4 + 3).load(K_WORDS)
    kc = kflags.index(slot).load(gl.SliceLayout(1, gl.SliceLayout(2, K_WORDS)))[:, None, None] + t0 * 0
    ra, rb = _raw_pairs(t0, t1, K_WORDS)
    a0, b0 = _select_words(t0, t2, ra, rb, kc, False)
    ra, rb = _raw_pairs(t2, t3, K_WORDS)
    a1, b1 = _select_words(t1, t2, ra, rb, kc, True)
    k0 = _words_to_values(a0, b0, K_REGS)
    k1 = _words_to_values(a1, b1, K_REGS)
    u0 = vw.index(slot * 8).load(V_WORDS)
    u1 = vw.index(slot * 8 + 1).load(V_WORDS)
    u2 = vw.index(slot * 8 + 2).load(V_WORDS)
    u3 = vw.index(slot * 8 + 3).load(V_WORDS)
    u4 = vw.index(slot * 8 + 4).load(V_WORDS)
    u5 = vw.index(slot * 8 + 5).load(V_WORDS)
    u6 = vw.index(slot * 8 + 6).load(V_WORDS)
    u7 = vw.index(slot * 8 + 7).load(V_WORDS)
    vc = vflags.index(slot).load(gl.SliceLayout(1, gl.SliceLayout(2, V_WORDS)))[:, None, None] + u0 * 0
    ra, rb = _raw_pairs(u0, u1, V_WORDS)
    a, b = _select_words(u0, u4, ra, rb, vc, False)
    v0 = _words_to_values(a, b, V_REGS)
    ra, rb = _raw_pairs(u2, u3, V_WORDS)
    a, b = _select_words(u1, u5, ra, rb, vc, False)
    v1 = _words_to_values(a, b, V_REGS)
    ra, rb = _raw_pairs(u4, u5, V_WORDS)
    a, b = _select_words(u2, u4, ra, rb, vc, True)
    v2 = _words_to_values(a, b, V_REGS)
    ra, rb = _raw_pairs(u6, u7, V_WORDS)
    a, b = _select_words(u3, u5, ra, rb, vc, True)
    v3 = _words_to_values(a, b, V_REGS)
    return k0, k1, v0, v1, v2, v3


@gluon.jit
def _compute(q, m_i, l_i, acc, kbuf, vbuf, kflags, vflags, slot, k_scale, v_scale, valid, KIND: gl.constexpr):
    """Page in ring ``slot`` (its first ``valid`` tokens) into the softmax state."""
    if KIND == COMPRESSED:
        k0, k1 = _rebuilt_keys(kbuf, slot)
        v0, v1, v2, v3 = _rebuilt_values(vbuf, slot)
    elif KIND == RAW:
        k0, k1 = kbuf.index(slot * 2).load(K_REGS), kbuf.index(slot * 2 + 1).load(K_REGS)
        v0, v1 = vbuf.index(slot * 4).load(V_REGS), vbuf.index(slot * 4 + 1).load(V_REGS)
        v2, v3 = vbuf.index(slot * 4 + 2).load(V_REGS), vbuf.index(slot * 4 + 3).load(V_REGS)
    else:
        k0, k1, v0, v1, v2, v3 = _mixed_operands(kbuf, vbuf, kflags, vflags, slot)
    kop = _key_operand(k0, k1)
    vop = _value_operand(v0, v1, v2, v3)
    if KIND != COMPRESSED:                   # raw bytes past a partial page may be any bf16 (inf, nan)
        tv = gl.arange(0, 16, layout=gl.SliceLayout(1, B_OP))
        vop = gl.where((tv < valid)[:, None], vop, 0.0)
    return _softmax_step(q, kop, vop, m_i, l_i, acc, k_scale, v_scale, valid)


@gluon.jit
def _pipelined(q, m_i, l_i, acc, pool_ptr, desc_ptr, indices_ptr, p_start, lo, hi, last_page, last_len, h,
               qk_scale, HKV: gl.constexpr, KIND: gl.constexpr, SLOTS: gl.constexpr):
    """Pages [lo, hi) (hi > lo) of one request (page ``last_page`` holds ``last_len`` tokens, the
    others 16) through a ring of SLOTS shared-memory slots: while
    page i is computed, the data of pages i+1 .. i+SLOTS-1, the descriptors of page i+SLOTS and
    the page id of i+SLOTS+1 are in flight. The per-token scales (and MIXED: the block flags) wait in
    the ring too."""
    NK: gl.constexpr = 3 if KIND == COMPRESSED else (2 if KIND == RAW else 4)   # key tiles, value chunks per slot
    NV: gl.constexpr = 6 if KIND == COMPRESSED else (4 if KIND == RAW else 8)
    ELEM: gl.constexpr = gl.bfloat16 if KIND == RAW else gl.uint8
    kbuf = gl.allocate_shared_memory(ELEM, [SLOTS * NK, 16, 4, 16], RING)
    vbuf = gl.allocate_shared_memory(ELEM, [SLOTS * NV, 4, 8, 16], RING)
    sbuf = gl.allocate_shared_memory(gl.float32, [2 * SLOTS, 16], SCALES)
    kflags = gl.allocate_shared_memory(gl.int32, [SLOTS if KIND == MIXED else 1, 16], SCALES)
    vflags = gl.allocate_shared_memory(gl.int32, [SLOTS if KIND == MIXED else 1, 4], SCALES)
    last = hi - 1
    for j in gl.static_range(SLOTS - 1):
        pg = gl.load(indices_ptr + p_start + gl.minimum(lo + j, last)).to(gl.int64)
        kd, vd = _descs(desc_ptr, pg, h, HKV)
        _issue(pool_ptr, kbuf, vbuf, kflags, vflags, j, kd, vd, KIND)
        async_copy.commit_group()
        ks, vs = _scales(desc_ptr, pg, h, qk_scale, HKV, KIND)
        sbuf.index(2 * j).store(ks)
        sbuf.index(2 * j + 1).store(vs)
    pga = gl.load(indices_ptr + p_start + gl.minimum(lo + SLOTS - 1, last)).to(gl.int64)
    kdn, vdn = _descs(desc_ptr, pga, h, HKV)
    pgn = gl.load(indices_ptr + p_start + gl.minimum(lo + SLOTS, last)).to(gl.int64)
    for i in range(lo, hi):
        ahead = (i - lo + SLOTS - 1) % SLOTS                               # slot of page i + SLOTS - 1
        _issue(pool_ptr, kbuf, vbuf, kflags, vflags, ahead, kdn, vdn, KIND)
        async_copy.commit_group()
        ks, vs = _scales(desc_ptr, pga, h, qk_scale, HKV, KIND)
        sbuf.index(2 * ahead).store(ks)
        sbuf.index(2 * ahead + 1).store(vs)
        kdn, vdn = _descs(desc_ptr, pgn, h, HKV)                         # page i + SLOTS
        pga = pgn
        pgn = gl.load(indices_ptr + p_start + gl.minimum(i + SLOTS + 1, last)).to(gl.int64)
        async_copy.wait_group(SLOTS - 1)                                  # page i has landed
        slot = (i - lo) % SLOTS
        m_i, l_i, acc = _compute(q, m_i, l_i, acc, kbuf, vbuf, kflags, vflags, slot,
                                 sbuf.index(2 * slot).load(COLS), sbuf.index(2 * slot + 1).load(COLS),
                                 gl.where(i == last_page, last_len, 16), KIND)
    async_copy.wait_group(0)
    return m_i, l_i, acc


# ----------------------------------------------------------------------------- kernel

@gluon.jit
def _prologue(q_ptr, indptr_ptr, b, h, s, HKV: gl.constexpr, G: gl.constexpr, SPLITS: gl.constexpr):
    """The request's pages, this split's share [lo, hi) of its full pages before the last, q as the
    A operand and an empty softmax state."""
    p_start = gl.load(indptr_ptr + b)
    npages = gl.load(indptr_ptr + b + 1) - p_start
    per = gl.cdiv(npages - 1, SPLITS)
    lo = gl.minimum(s * per, npages - 1)
    hi = gl.minimum(lo + per, npages - 1)
    gq = gl.arange(0, 16, layout=gl.SliceLayout(1, A_OP))
    dq = gl.arange(0, 128, layout=gl.SliceLayout(0, A_OP))
    q_rows = b * (HKV * G) + h * G + gq
    q = gl.load(q_ptr + q_rows[:, None] * 128 + dq[None, :], mask=(gq < G)[:, None], other=0.0)
    m_i = gl.full([16], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MMA))
    l_i = gl.zeros([16], gl.float32, layout=gl.SliceLayout(1, MMA))
    acc = gl.zeros([16, 128], gl.float32, layout=MMA)
    return p_start, npages, lo, hi, q, m_i, l_i, acc


@gluon.jit
def _store_split(part_ptr, lse_ptr, m_i, l_i, acc, b, h, slot, HKV: gl.constexpr, G: gl.constexpr,
                 SPLITS: gl.constexpr):
    """Normalised partial output and log2-sum-exp of split slot ``slot`` (empty: l = 0, lse = -inf, o = 0)."""
    go = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    do = gl.arange(0, 128, layout=gl.SliceLayout(0, MMA))
    gm = go < G
    den = gl.where(l_i > 0, l_i, 1.0)
    lse = gl.where(l_i > 0, m_i + gl.log2(den), float("-inf"))
    prow = (b * (HKV * G) + h * G + go) * SPLITS + slot
    gl.store(part_ptr + prow[:, None] * 128 + do[None, :], acc / den[:, None], mask=gm[:, None])
    gl.store(lse_ptr + prow, lse, mask=gm)


@gluon.jit
def _finish(part_ptr, lse_ptr, out_ptr, cnt_ptr, m_i, l_i, acc, b, h, s, HKV: gl.constexpr, G: gl.constexpr,
            SPLITS: gl.constexpr):
    """Output of a launch without a merge kernel: one split writes ``out`` (bf16)
    directly; with more, each split writes its slot and counts itself in the (request, kv head)'s
    arrival counter, and the last to arrive merges the slots into ``out`` and resets the counter to 0."""
    go = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    do = gl.arange(0, 128, layout=gl.SliceLayout(0, MMA))
    rows = b * (HKV * G) + h * G + go
    gm = (go < G)[:, None]
    if SPLITS == 1:
        den = gl.where(l_i > 0, l_i, 1.0)
        gl.store(out_ptr + rows[:, None] * 128 + do[None, :], (acc / den[:, None]).to(gl.bfloat16), mask=gm)
    else:
        _store_split(part_ptr, lse_ptr, m_i, l_i, acc, b, h, s, HKV, G, SPLITS)
        gl.thread_barrier()                    # every lane's stores before the release below
        arrived = gl.atomic_add(cnt_ptr + b * HKV + h, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            gl.store(cnt_ptr + b * HKV + h, 0)
            m = gl.full([16], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MMA))
            for j in range(SPLITS):
                m = gl.maximum(m, gl.load(lse_ptr + rows * SPLITS + j, mask=go < G, other=float("-inf"),
                                          cache_modifier=".cg"))
            m = gl.where(go < G, m, 0.0)       # some split of a real row holds a token: m is finite
            num = gl.zeros([16, 128], gl.float32, layout=MMA)
            wsum = gl.zeros([16], gl.float32, layout=gl.SliceLayout(1, MMA))
            for j in range(SPLITS):            # written by other programs: read past L1 (.cg)
                w = gl.exp2(gl.load(lse_ptr + rows * SPLITS + j, mask=go < G, other=float("-inf"),
                                    cache_modifier=".cg") - m)
                o = gl.load(part_ptr + (rows * SPLITS + j)[:, None] * 128 + do[None, :], mask=gm, other=0.0,
                            cache_modifier=".cg")
                num += o * w[:, None]
                wsum += w
            wsum = gl.where(wsum > 0, wsum, 1.0)
            gl.store(out_ptr + rows[:, None] * 128 + do[None, :], (num / wsum[:, None]).to(gl.bfloat16), mask=gm)


@gluon.jit
def _pipelined_kernel(q_ptr, pool_ptr, desc_ptr, indptr_ptr, indices_ptr, last_ptr, part_ptr, lse_ptr, out_ptr,
                      cnt_ptr, qk_scale, HKV: gl.constexpr, G: gl.constexpr, SPLITS: gl.constexpr,
                      KIND: gl.constexpr, SLOTS: gl.constexpr):
    """Grid (batch, kv_heads, splits), one warp: split s of the request's full pages before its last
    (the last split also takes the last page) through the cp.async ring as pages of kind KIND; the splits
    are merged into ``out`` here (:func:`_finish`)."""
    b = gl.program_id(0)
    h = gl.program_id(1)
    s = gl.program_id(2)
    p_start, npages, lo, hi, q, m_i, l_i, acc = _prologue(q_ptr, indptr_ptr, b, h, s, HKV, G, SPLITS)
    if s == SPLITS - 1:
        hi = npages
    if hi > lo:
        m_i, l_i, acc = _pipelined(q, m_i, l_i, acc, pool_ptr, desc_ptr, indices_ptr, p_start, lo, hi, npages - 1,
                                   gl.load(last_ptr + b), h, qk_scale, HKV, KIND, SLOTS)
    _finish(part_ptr, lse_ptr, out_ptr, cnt_ptr, m_i, l_i, acc, b, h, s, HKV, G, SPLITS)


def workspace(batch: int, q_heads: int, kv_heads: int, num_splits: int, device) -> dict:
    """Buffers of one batch layout: with splits, the split slots (fp32 ``part``, ``lse``) and the zeroed
    int32 arrival counters of :func:`_finish` (every launch leaves them at 0 again)."""
    if num_splits == 1:
        return {}
    return dict(part=torch.empty(batch, q_heads, num_splits, D, dtype=torch.float32, device=device),
                lse=torch.empty(batch, q_heads, num_splits, dtype=torch.float32, device=device),
                counters=torch.zeros(batch * kv_heads, dtype=torch.int32, device=device))


def launch(q, cache, indptr, indices, last_page_len, launches, num_splits: int, qk_scale: float,
           out: torch.Tensor, ws: dict, slots: int) -> torch.Tensor:
    """Launch the pipelined kernel for ``launches`` -- one ``(kind, routed)`` with ``kind`` a page kind of
    :mod:`zipkv.paged` (MIXED: any page) -- into ``out``; it merges its own splits. ``slots``: ring slots;
    ``ws``: :func:`workspace`. No host sync; inputs are checked by
    :func:`zipkv.kernels.decode_attention.plan`."""
    (kind, _), = launches
    B, HQ, _ = q.shape
    HKV = cache.kv_heads
    part, lse, counters = (ws.get(name, out) for name in ("part", "lse", "counters"))
    _pipelined_kernel[(B, HKV, num_splits)](
        q, cache.pool, cache.desc, indptr, indices, last_page_len, part, lse, out, counters, qk_scale,
        HKV=HKV, G=HQ // HKV, SPLITS=num_splits, KIND=kind, SLOTS=slots, num_warps=1)
    return out
