"""The fused decode kernel of :mod:`zipkv.kernels.decode_mma` reading pages in the escape format (:mod:`zipkv.escape`,
every block compressible), written as a variant beside it: the same Gluon pipeline, rings, rebuild, softmax and
merge (imported from :mod:`~zipkv.kernels.decode_mma`, unchanged), plus the escape lists patched in registers.

What the variant adds (``esc_ptr``: :attr:`zipkv.paged.PagedKVCache.escapes`, per block ``entry_address << 8 | zero
<< 7 | count``):

* **Descriptors in the pipeline.** The escape descriptors of unit i + SLOTS are loaded with its block descriptors
  (the same index math, :func:`~zipkv.kernels.decode_mma._descs`), folded with each block's base into one int64 per
  key token row and per value block row (``entry_address << 16 | b/2 << 8 | zero << 7 | count``, :func:`_fold`) and
  wait, with the blocks' addresses, in rings of their own beside the per-token scales.
* **Patching in registers, by the threads that own the elements.** After a key half is rebuilt with the fixed base
  128 and laid out as the A operand ``[16 token rows, 64 channels]`` (channel ``c`` of row ``t`` is block position
  ``256 h + 64 (t % 4) + 16 ((c >> 1) & 3) + 2 (c >> 3) + (c & 1)`` of the row's block), and after a value chunk
  ``[4 blocks, 8 lanes, 16 values]`` is rebuilt (position ``128 c + 16 m + r``), two warp-uniform branches skip units
  without zero-mode blocks and units whose blocks list nothing (most units of real KV). Zero mode: every element of
  a zero-mode block that decoded to code offset 7 (high byte ``64 + 7``) is exponent pair 0, rewritten in place
  (:func:`_zero_mode`). Escapes: every thread reads the unit's entries (the same addresses for all lanes: broadcast
  loads of 2 bytes), computes the escaped value -- its low byte and its code's sign read back from the block just
  copied (L2 hits), exponent ``e + 128 - b`` (:func:`_escaped`) -- and the one thread that holds that position
  selects it in (:func:`_patch`). The per-token power of two ``2^(b - 128)`` then undoes the scale exactly as for
  every other value of the block, so the output over escape pages is the output over the same pages raw, bit for
  bit, at the same split count.
* Resources (offline, sm_90a, Llama-3.1-8B shape, :func:`compile_info`): 218 registers, no spills, 13.2 KB of shared
  memory for the all-compressed path (decode_mma's: 128 registers): fewer programs per SM; a register cap
  (``launch={"maxnreg": n}``) trades them for spills (168: 48 bytes), which ``.ci/gpu/escape_probe.py`` times.
* Not exact: a listed or zero-mode value that is a bf16 subnormal, or whose scaled exponent would fall below bf16's
  normal range (``e + 128 - b < 1``: a value more than ``2^127`` times smaller than its block's window), becomes a
  signed zero, as ZipFusion's kernel flushes values below ``2^-126`` of a block with base 0 (:func:`scaled_reference`
  reproduces it; ``tests/test_decode_escape.py`` checks that real-KV-like data has none).

Gluon has no interpreter: the kernel runs on CUDA GPUs only (``tests/test_decode_escape.py``); the CPU suite checks
:func:`scaled_reference` (the per-element arithmetic) against the format and the attention reference over escape
pages, and compiles the kernel offline (:func:`compile_info`).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from zipkv import paged
from zipkv.kernels import decode_mma as dm
from zipkv.kernels.decode_mma import (A_OP, COMPRESSED, K_REGS, K_ROWS, MIXED, MMA, RAW, SCALES, TOKS, V_REGS,
                                      V_ROWS, _descs, _finish, _issue, _key_operand, _mixed_key_half, _mixed_values,
                                      _prologue, _raw_pairs, _raw_values, _rebuild128, _rebuilt_values, _rings,
                                      _row_valid, _scales, _softmax_step, _unit_pages, _unit_valid, _words,
                                      _words_to_values, K_WORDS)

__all__ = ["launch", "scaled_reference", "operands_reference", "compile_info"]


# ----------------------------------------------------------------------------- the patch, element-wise

@gluon.jit
def _zero_mode(x, zf, b2):
    """Tile ``x`` (bf16, rebuilt with base 128) whose elements of zero-mode blocks (``zf`` != 0, int32 broadcast per
    element's block; ``b2``: its base / 2) that decoded to code offset 7 (high byte ``64 + 7``) are exponent pair 0:
    rewritten as the kernel's scaled value (exponent ``1 + 128 - b`` where the stored exponent bit is 1, else a
    signed zero: zeros exactly, bf16 subnormals flushed; :func:`scaled_reference`)."""
    v = x.to(gl.int16, bitcast=True).to(gl.int32)
    hp = 64 - b2
    hit = (zf != 0) & ((v & 0x7F00) == 0x4700)
    new = gl.where(((v & 0x80) != 0) & (hp >= 0), (v & -32513) | (hp << 8), v & -32768)   # -32513: 0x...80FF
    return gl.where(hit, new, v).to(gl.int16).to(gl.bfloat16, bitcast=True)


@gluon.jit
def _entry(pool_ptr, addr, i):
    """Escape entry ``i`` of a list at byte ``addr``: ``p << 7 | e >> 1`` (int32; two broadcast byte loads)."""
    lo = gl.load(pool_ptr + addr + 2 * i).to(gl.int32)
    hi = gl.load(pool_ptr + addr + 2 * i + 1).to(gl.int32)
    return lo | (hi << 8)


@gluon.jit
def _escaped(pool_ptr, block, p, pair, b2):
    """The kernel's scaled value (bf16, a scalar) of the escape at position ``p`` of the compressed block at byte
    ``block`` whose exponent pair is ``pair`` (block base ``2 * b2``): its low byte and its code's sign read back
    (two broadcast byte loads, L2 hits: the block was just copied), exponent ``e + 128 - b``; a signed zero for a
    zero, a bf16 subnormal or a result below the normal range (:func:`scaled_reference`)."""
    low = gl.load(pool_ptr + block + p).to(gl.int32)
    code = gl.load(pool_ptr + block + 512 + (p & 255)).to(gl.int32)
    sign = gl.where(p >= 256, code >> 7, (code >> 3) & 1) << 15
    hp = pair + 64 - b2
    e1 = low >> 7
    ok = (2 * hp + e1 >= 1) & ((pair > 0) | (e1 == 1))
    bits = gl.where(ok, sign | (hp << 8) | low, sign)
    return bits.to(gl.int16).to(gl.bfloat16, bitcast=True)


@gluon.jit
def _patch(x, pool_ptr, info, addr, rows, rowblk, base, j):
    """Tile ``x`` with its unit's listed escapes written in: for each of the unit's 4 blocks (``rows``: the block row
    of each entry of ``info`` / ``addr``, the folded descriptors and block addresses; ``rowblk``: each element's), each
    entry's element -- block position ``base + j`` (``base`` per thread, ``j`` per register) -- gets
    :func:`_escaped`, selected by the thread that holds it."""
    for r in gl.static_range(4):
        sel = rows == r
        inf = gl.max(gl.where(sel, info, 0), axis=0)
        block = gl.max(gl.where(sel, addr, 0), axis=0)
        cnt = (inf & 0x7F).to(gl.int32)
        lst = inf >> 16
        b2 = ((inf >> 8) & 0x7F).to(gl.int32)
        for i in range(cnt):
            ent = _entry(pool_ptr, lst, i)
            p = ent >> 7
            val = _escaped(pool_ptr, block, p, ent & 0x7F, b2)
            x = gl.where((rowblk == r) & (j == p - base), val, x)
    return x


@gluon.jit
def _patch_keys(ka, pool_ptr, kinfo, kaddr, HALF: gl.constexpr):
    """The A operand ``[16 token rows, 64 channels]`` of key half HALF (rebuilt with base 128,
    :func:`zipkv.kernels.decode_mma._key_operand`) with its unit's zero-mode values and escapes written in
    (:func:`_zero_mode`, :func:`_patch`); ``kinfo``, ``kaddr`` ``[16]`` per token row (K_ROWS). Channel ``c`` of
    row ``t`` is the key tile's element ``(t, q, j)`` with ``q = (c >> 1) & 3``, ``j = 2 (c >> 3) + (c & 1)``: block
    position ``256 HALF + 64 (t % 4) + 16 q + j`` of the row's block. Each step behind a warp-uniform branch: most
    units of real KV skip both."""
    t = gl.arange(0, 16, layout=gl.SliceLayout(1, A_OP))[:, None]
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, A_OP))[None, :]
    if gl.sum(((kinfo >> 7) & 1).to(gl.int32), axis=0) != 0:
        info = gl.convert_layout(kinfo, gl.SliceLayout(1, A_OP))[:, None]
        ka = _zero_mode(ka, ((info >> 7) & 1).to(gl.int32), ((info >> 8) & 0x7F).to(gl.int32))
    if gl.sum((kinfo & 0x7F).to(gl.int32), axis=0) != 0:
        kt = gl.arange(0, 16, layout=K_ROWS)
        pos = 256 * HALF + 64 * (t % 4) + 16 * ((c >> 1) & 3) + 2 * (c >> 3) + (c & 1)
        ka = _patch(ka, pool_ptr, kinfo, kaddr, kt // 4, t // 4, pos, 0)
    return ka


@gluon.jit
def _patch_chunk(x, pool_ptr, vinfo, vaddr, C: gl.constexpr):
    """Value chunk C ``[4, 8, 16]`` (V_REGS) patched as :func:`_patch_keys`; ``vinfo``, ``vaddr`` ``[4]`` per block
    row (V_ROWS)."""
    if gl.sum(((vinfo >> 7) & 1).to(gl.int32), axis=0) != 0:
        x = _zero_mode(x, ((vinfo >> 7) & 1).to(gl.int32)[:, None, None], ((vinfo >> 8) & 0x7F).to(gl.int32)[:, None, None])
    if gl.sum((vinfo & 0x7F).to(gl.int32), axis=0) != 0:
        vb = gl.arange(0, 4, layout=V_ROWS)
        m = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, V_REGS)))[None, :, None]
        r = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, V_REGS)))[None, None, :]
        x = _patch(x, pool_ptr, vinfo, vaddr, vb, vb[:, None, None], 128 * C + 16 * m + 0 * vb[:, None, None], r)
    return x


@gluon.jit
def _key_half_esc(kbuf, kflags, slot, pool_ptr, kinfo, kaddr, KIND: gl.constexpr, HALF: gl.constexpr):
    """:func:`zipkv.kernels.decode_mma._key_half` with the unit's escapes patched before the operand layout."""
    if KIND == COMPRESSED:
        k = _rebuild128(kbuf[HALF].index(slot).load(K_REGS), kbuf[2].index(slot).load(K_REGS), HALF == 1)
    elif KIND == RAW:
        ra, rb = _raw_pairs(_words(kbuf[2 * HALF], slot, K_WORDS), _words(kbuf[2 * HALF + 1], slot, K_WORDS), K_WORDS)
        k = _words_to_values(ra, rb, K_REGS)
    else:
        k = _mixed_key_half(kbuf, kflags, slot, HALF)
    ka = _key_operand(k)
    if KIND != RAW:
        ka = _patch_keys(ka, pool_ptr, kinfo, kaddr, HALF)
    return ka


@gluon.jit
def _compute_esc(qk0, qk1, m_i, l_i, acc, kbuf, vbuf, kflags, vflags, slot, k_scale, v_scale, valid_a, valid_b,
                 pool_ptr, kinfo, vinfo, kaddr, vaddr, KIND: gl.constexpr, LAST: gl.constexpr, HD: gl.constexpr,
                 NQ: gl.constexpr):
    """:func:`zipkv.kernels.decode_mma._compute` over escape pages (``kinfo`` ``[16]``, ``vinfo`` ``[4]``: the unit's
    folded escape descriptors)."""
    z = gl.zeros([16, NQ], gl.float32, layout=MMA)
    s0 = mma_v2(_key_half_esc(kbuf, kflags, slot, pool_ptr, kinfo, kaddr, KIND, 0), qk0, z)
    if HD == 128:
        s0 = mma_v2(_key_half_esc(kbuf, kflags, slot, pool_ptr, kinfo, kaddr, KIND, 1), qk1, s0)
        s1 = s0
    else:
        s1 = mma_v2(_key_half_esc(kbuf, kflags, slot, pool_ptr, kinfo, kaddr, KIND, 1), qk0, z)
    if KIND == COMPRESSED:
        v0, v1, v2, v3 = _rebuilt_values(vbuf, slot)
    elif KIND == RAW:
        v0, v1, v2, v3 = _raw_values(vbuf, slot)
    else:
        v0, v1, v2, v3 = _mixed_values(vbuf, vflags, slot)
    if KIND != RAW:
        v0 = _patch_chunk(v0, pool_ptr, vinfo, vaddr, 0)
        v1 = _patch_chunk(v1, pool_ptr, vinfo, vaddr, 1)
        v2 = _patch_chunk(v2, pool_ptr, vinfo, vaddr, 2)
        v3 = _patch_chunk(v3, pool_ptr, vinfo, vaddr, 3)
    va0, va1 = dm._value_operands(v0, v1, v2, v3, HD)
    if KIND != COMPRESSED and LAST:
        if valid_a + valid_b < 32:
            r = gl.arange(0, 16, layout=gl.SliceLayout(0, A_OP))[None, :]
            va0 = gl.where(_row_valid(r, valid_a, valid_b, HD, 0), va0, 0.0)
            if HD == 64:
                va1 = gl.where(_row_valid(r, valid_a, valid_b, HD, 1), va1, 0.0)
    return _softmax_step(s0, s1, va0, va1, m_i, l_i, acc, k_scale, v_scale, valid_a, valid_b, LAST, HD)


@gluon.jit
def _fold(ed, d):
    """One block's escape descriptor and block descriptor -> ``entry_address << 16 | b/2 << 8 | zero << 7 | count``."""
    return ((ed >> 8) << 16) | ((d & 0x7F) << 8) | (ed & 0xFF)


@gluon.jit
def _pipelined_esc(qk0, qk1, m_i, l_i, acc, pool_ptr, desc_ptr, esc_ptr, indices_ptr, p_start, npages, lo, hi,
                   last_len, h, qk_scale, HKV: gl.constexpr, KIND: gl.constexpr, SLOTS: gl.constexpr,
                   HD: gl.constexpr, NQ: gl.constexpr):
    """:func:`zipkv.kernels.decode_mma._pipelined` with the units' escape descriptors in the pipeline (loaded with
    the block descriptors, waiting in their own ring) and :func:`_compute_esc`."""
    kbuf, vbuf = _rings(KIND, SLOTS)
    ksbuf = gl.allocate_shared_memory(gl.float32, [SLOTS, 16], SCALES)
    vsbuf = gl.allocate_shared_memory(gl.float32, [SLOTS, 16], SCALES)
    kibuf = gl.allocate_shared_memory(gl.int64, [SLOTS, 16], SCALES)
    vibuf = gl.allocate_shared_memory(gl.int64, [SLOTS, 4], SCALES)
    kabuf = gl.allocate_shared_memory(gl.int64, [SLOTS, 16], SCALES)
    vabuf = gl.allocate_shared_memory(gl.int64, [SLOTS, 4], SCALES)
    kflags = gl.allocate_shared_memory(gl.int32, [SLOTS if KIND == MIXED else 1, 16], SCALES)
    vflags = gl.allocate_shared_memory(gl.int32, [SLOTS if KIND == MIXED else 1, 4], SCALES)
    last = hi - 1
    for j in gl.static_range(SLOTS - 1):
        pa, pb = _unit_pages(indices_ptr, p_start, lo + j, last, npages, HD)
        kd, vd = _descs(desc_ptr, pa, pb, h, HKV, HD)
        ke, ve = _descs(esc_ptr, pa, pb, h, HKV, HD)
        _issue(pool_ptr, kbuf, vbuf, kflags, vflags, j, kd, vd, KIND)
        async_copy.commit_group()
        ks, vs = _scales(desc_ptr, pa, pb, h, qk_scale, HKV, KIND, HD)
        ksbuf.index(j).store(ks)
        vsbuf.index(j).store(vs)
        kibuf.index(j).store(_fold(ke, kd))
        vibuf.index(j).store(_fold(ve, vd))
        kabuf.index(j).store(kd >> 8)
        vabuf.index(j).store(vd >> 8)
    paa, pba = _unit_pages(indices_ptr, p_start, lo + SLOTS - 1, last, npages, HD)
    kdn, vdn = _descs(desc_ptr, paa, pba, h, HKV, HD)
    ken, ven = _descs(esc_ptr, paa, pba, h, HKV, HD)
    pan, pbn = _unit_pages(indices_ptr, p_start, lo + SLOTS, last, npages, HD)
    for i in range(lo, hi - 1):
        ahead = (i - lo + SLOTS - 1) % SLOTS
        _issue(pool_ptr, kbuf, vbuf, kflags, vflags, ahead, kdn, vdn, KIND)
        async_copy.commit_group()
        ks, vs = _scales(desc_ptr, paa, pba, h, qk_scale, HKV, KIND, HD)
        ksbuf.index(ahead).store(ks)
        vsbuf.index(ahead).store(vs)
        kibuf.index(ahead).store(_fold(ken, kdn))
        vibuf.index(ahead).store(_fold(ven, vdn))
        kabuf.index(ahead).store(kdn >> 8)
        vabuf.index(ahead).store(vdn >> 8)
        kdn, vdn = _descs(desc_ptr, pan, pbn, h, HKV, HD)
        ken, ven = _descs(esc_ptr, pan, pbn, h, HKV, HD)
        paa = pan
        pba = pbn
        pan, pbn = _unit_pages(indices_ptr, p_start, i + SLOTS + 1, last, npages, HD)
        async_copy.wait_group(SLOTS - 1)
        slot = (i - lo) % SLOTS
        m_i, l_i, acc = _compute_esc(qk0, qk1, m_i, l_i, acc, kbuf, vbuf, kflags, vflags, slot,
                                     ksbuf.index(slot).load(TOKS), vsbuf.index(slot).load(TOKS), 16, 16, pool_ptr,
                                     kibuf.index(slot).load(K_ROWS), vibuf.index(slot).load(V_ROWS),
                                     kabuf.index(slot).load(K_ROWS), vabuf.index(slot).load(V_ROWS),
                                     KIND, False, HD, NQ)
    async_copy.wait_group(0)
    slot = (hi - 1 - lo) % SLOTS
    valid_a, valid_b = _unit_valid(hi - 1, npages, last_len, HD)
    return _compute_esc(qk0, qk1, m_i, l_i, acc, kbuf, vbuf, kflags, vflags, slot, ksbuf.index(slot).load(TOKS),
                        vsbuf.index(slot).load(TOKS), valid_a, valid_b, pool_ptr, kibuf.index(slot).load(K_ROWS),
                        vibuf.index(slot).load(V_ROWS), kabuf.index(slot).load(K_ROWS),
                        vabuf.index(slot).load(V_ROWS), KIND, True, HD, NQ)


@gluon.jit
def _escape_kernel(q_ptr, pool_ptr, desc_ptr, esc_ptr, indptr_ptr, indices_ptr, last_ptr, part_ptr, lse_ptr, out_ptr,
                   cnt_ptr, qk_scale, HKV: gl.constexpr, G: gl.constexpr, SPLITS: gl.constexpr, GS: gl.constexpr,
                   NG: gl.constexpr, TOT: gl.constexpr, KIND: gl.constexpr, SLOTS: gl.constexpr, HD: gl.constexpr,
                   NQ: gl.constexpr):
    """:func:`zipkv.kernels.decode_mma._pipelined_kernel` over escape pages (``esc_ptr``: the escape descriptors)."""
    b = gl.program_id(0)
    h = gl.program_id(1)
    s = gl.program_id(2)
    p_start, npages, units, lo, hi, qk0, qk1, m_i, l_i, acc = _prologue(q_ptr, indptr_ptr, b, h, s, HKV, G, SPLITS,
                                                                        HD, NQ)
    if s == SPLITS - 1:
        hi = units
    if hi > lo:
        m_i, l_i, acc = _pipelined_esc(qk0, qk1, m_i, l_i, acc, pool_ptr, desc_ptr, esc_ptr, indices_ptr, p_start,
                                       npages, lo, hi, gl.load(last_ptr + b), h, qk_scale, HKV, KIND, SLOTS, HD, NQ)
    _finish(part_ptr, lse_ptr, out_ptr, cnt_ptr, m_i, l_i, acc, b, h, s, HKV, G, SPLITS, NQ, HD, GS, NG, TOT)


def launch(q, cache, indptr, indices, last_page_len, launches, num_splits: int, qk_scale: float,
           out: torch.Tensor, ws: dict, slots: int, maxnreg: int = 0) -> torch.Tensor:
    """:func:`zipkv.kernels.decode_mma.launch` for a cache whose ``escapes`` are set (the same arguments, workspace
    and merge). No host sync; inputs are checked by :func:`zipkv.kernels.decode_attention.plan`."""
    (kind, _), = launches
    B, HQ, _ = q.shape
    HKV = cache.kv_heads
    part, lse, counters = (ws.get(name, out) for name in ("part", "lse", "counters"))
    _escape_kernel[(B, HKV, num_splits)](
        q, cache.pool, cache.desc, cache.escapes, indptr, indices, last_page_len, part, lse, out, counters, qk_scale,
        HKV=HKV, G=HQ // HKV, SPLITS=num_splits, **dm.merge_constants(num_splits), KIND=kind, SLOTS=slots,
        HD=cache.head_dim, NQ=dm.query_columns(HQ // HKV), num_warps=1, **({"maxnreg": maxnreg} if maxnreg else {}))
    return out


def compile_info(path: str = "compressed", *, q_heads: int = 32, kv_heads: int = 8, splits: int = 2, slots: int = 2,
                 head_dim: int = 128, arch: int = 90, keep_asm: bool = False) -> dict:
    """Offline resources of the escape variant (:func:`zipkv.kernels.kernel_info.compile_info`; no GPU, without
    ``TRITON_INTERPRET=1``): registers, spills, shared memory, as :func:`zipkv.kernels.kernel_info.decode_mma_info`."""
    from zipkv.kernels.kernel_info import compile_info as info_of

    sig = {"q_ptr": "*bf16", "pool_ptr": "*u8", "desc_ptr": "*i64", "esc_ptr": "*i64", "indptr_ptr": "*i32",
           "indices_ptr": "*i32", "last_ptr": "*i32", "part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*bf16",
           "cnt_ptr": "*i32", "qk_scale": "fp32"}
    cst = dict(HKV=kv_heads, G=q_heads // kv_heads, SPLITS=splits, KIND=paged.PAGE_KINDS.index(path), SLOTS=slots,
               HD=head_dim, NQ=dm.query_columns(q_heads // kv_heads), **dm.merge_constants(splits))
    out = info_of(_escape_kernel, sig, cst, num_warps=1, num_stages=slots, arch=arch, divisible=tuple(range(10)),
                  keep_asm=keep_asm)
    out.update(path=path, head_dim=head_dim)
    return out


# ----------------------------------------------------------------------------- the torch reference

def scaled_reference(bits: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """What the kernel feeds the tensor cores for each value of a compressed block, in torch: bf16 ``x * 2^(128 -
    b)`` for the block base ``b`` (``bits``: the values' bf16 bits int16 ``[..., 512]``, ``b`` ``[...]`` even),
    computed as the kernel computes it (:func:`_zero_mode`, :func:`_escaped`): the exponent shifted by ``128 - b``; zeros stay signed
    zeros, and a bf16 subnormal, or a result below bf16's normal range, becomes a signed zero. Where nothing is
    flushed it equals the exact ``x * 2^(128 - b)`` (fp32 arithmetic, then bf16): the CPU suite checks both."""
    v = bits.to(torch.int32) & 0xFFFF
    e, sign = (v >> 7) & 0xFF, v & 0x8000
    ep = e + 128 - (b.to(torch.int32))[..., None]
    out = torch.where((e >= 1) & (ep >= 1), sign | (ep << 7) | (v & 0x7F), sign)
    return torch.where(out >= 1 << 15, out - (1 << 16), out).to(torch.int16)


def operands_reference(payload: torch.Tensor, escapes: torch.Tensor, meta) -> torch.Tensor:
    """The kernel's operand values of compressed blocks, rebuilt as the kernel rebuilds them, in torch: each block's
    codes with the fixed base 128 (high byte ``sign << 7 | 64 + offset``, ZipFusion's rebuild), a zero-mode block's
    code offset 7 rewritten (:func:`_zero_mode`), each listed value rewritten from its low byte, its code's sign and
    its entry's pair (:func:`_escaped`). ``(payload, escapes, meta)`` as :func:`zipkv.escape.pack` returns them (any
    capacity); returns int16 bits ``[..., n_blocks, 512]`` in block order (raw blocks: their raw values). Equal to
    :func:`scaled_reference` of the original values for every compressed block: what the CPU suite checks, on every
    bf16 pattern at every position."""
    from zipkv import escape, format as fmt

    escape._check_structure(meta)
    nb = meta.n_blocks
    lead = meta.compressed.shape[:-1]
    low = payload[..., : nb * fmt.PACKED_BLOCK_BYTES]
    offs = meta.page_meta().block_offsets()                                            # [..., nb] bytes
    k = torch.arange(fmt.BLOCK_VALUES, device=payload.device)
    lowb = payload.gather(-1, (offs[..., None] + k).reshape(*lead, -1)).reshape(*lead, nb, 512).to(torch.int32)
    mma = meta.layout in fmt.MMA_LAYOUTS            # code byte of value k (zipkv.format): mma k % 256, else 4 (k // 8) + k % 4
    kc = k % 256 if mma else 4 * (k // 8) + k % 4
    code = payload.gather(-1, (offs[..., None] + 512 + kc).reshape(*lead, -1)).reshape(*lead, nb, 512).to(torch.int32)
    hi_nib = (k >= 256) if mma else (k % 8 >= 4)
    nib = torch.where(hi_nib, code >> 4, code) & 0xF
    sign = (nib >> 3) & 1
    v = (sign << 15) | ((64 + (nib & 7)) << 8) | lowb                                   # base 128
    b2 = (meta.base.to(torch.int32) >> 1)[..., None]
    hp = 64 - b2
    hit = meta.zero[..., None] & (((v >> 8) & 0x7F) == 71)
    zeroed = torch.where(((v & 0x80) != 0) & (hp >= 0), (v & 0x80FF) | (hp << 8), v & 0x8000)
    v = torch.where(hit, zeroed, v)
    e, block, used = escape._entries_of(escapes, meta)
    for idx in zip(*torch.nonzero(used, as_tuple=True)):
        ent, blk = int(e[idx]), int(block[idx])
        page = idx[:-1]
        p, pair = ent >> 7, ent & 0x7F
        lo, s = int(lowb[page + (blk, p)]), int(sign[page + (blk, p)])
        h = pair + 64 - int(b2[page + (blk, 0)])
        e1 = lo >> 7
        ok = (2 * h + e1 >= 1) and (pair > 0 or e1 == 1)
        v[page + (blk, p)] = (s << 15) | (h << 8) | lo if ok else s << 15
    raw = fmt.to_blocks(fmt.unpack(payload, meta.page_meta(), validate=False), meta.layout).contiguous()
    raw = raw.view(torch.int16).to(torch.int32) & 0xFFFF
    v = torch.where(meta.compressed[..., None], v, raw)
    return torch.where(v >= 1 << 15, v - (1 << 16), v).to(torch.int16)
