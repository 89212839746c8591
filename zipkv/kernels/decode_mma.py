"""Fused decode attention for the mma layouts (ZipFusion §III-C), written in Gluon.

The caches of :mod:`zipkv.paged` with ``k_layout="k_mma"`` and ``v_layout="v_mma"`` (head_dim 128 or 64,
see :mod:`zipkv.format`) store each 512-value block so that one thread's tensor-core operand values
(``mma.m16n8k16``, bf16) are two or four runs of 16 contiguous bytes. Gluon (Triton's explicit-layout
dialect, ``triton.experimental.gluon``) lets the kernel say so: a unit of 16 token rows is copied with 16-byte
``cp.async`` into a ring of shared-memory slots (each thread later reads back exactly the bytes it copied, so
no barrier between threads is needed; each tile of the ring is its own allocation, so Triton puts no barrier
between the copies either), read into registers in a blocked layout whose reshape/permute *is* the operand
layout (the conversion is a register renaming, checked offline), rebuilt with integer ops and fed to ``mma``.

**Transposed products.** The scores are ``S^T = K @ q^T`` ``[16 token rows, NQ]`` and the output
``O^T += V^T @ P^T`` ``[head_dim, NQ]``: keys and values are the A operands (the lane holding a key or value
as a B operand of ``q @ K^T`` or ``P @ V`` holds it as the A operand of the transposed product: the layouts
of :mod:`zipkv.format` serve both), q^T and P^T the B operands, and the program's G query heads are the
``NQ = 8`` columns of one n-tile (16: two, for G up to 16, :func:`query_columns`). So q^T lives in registers
(8 per lane per 64 channels), no query row is padded to the m-tile's 16, the accumulator is half the size
of ``q @ K^T``'s ``[16, head_dim]`` for G <= 8, and P^T reaches its B layout by warp shuffles (no shared
memory). Head_dim 128: a unit is a page (16 tokens x 128 channels). Head_dim 64: a unit is a page *pair*
seen as 16 rows of 128 channels (a row holds two consecutive tokens; the second page of an odd request's
last pair is empty and masked): the key halves (channels 0-63, 64-127) are the rows' first and second
tokens, each multiplied with the same q^T, and the value halves' products add into one ``[64, NQ]`` output.
Tried and measured slower (H200 at 8881080, SmolLM2 shape, 8192 x 64, same run): a *paired* head_dim 64, the
rows' two tokens as separate query-head columns (one softmax per unit instead of two, a ``[128, NQ]``
accumulator, the two columns of a head merged like splits): 1-3 % slower at every split count (all compressible
83.5 vs 82.5 us at the plan's 5 splits, measured mix 89.5 vs 86.6 us at 8, raw 102.3 vs 100.6 us); and a register
cap at 128 for every launch: 0.6-0.9 % slower at the Llama-3.1-8B shape (378.4 vs 376.1 us all compressible,
398.3 vs 394.9 us on the measured mix); the run's table: ``results/paper/zipfusion_kernel_variants_ab.csv``.
Tried on two H100 boards (921a1f7, Llama-3.1-8B shape, 8192 x 64, all compressed, as copies of this module rewritten
at run time, same rounds; ``results/paper/zipfusion_kernel_stream_ab.csv``): value chunks stored block-fastest in the
ring, which frees the reads of their bank conflicts but gives them to the copies' fills, 525.0 -> 611.7 us; a
fourth ring slot 528.0 us; L2 prefetch hints on the copies (``.L2::128B``, ``.L2::256B``) 525.0 and 525.4 us; the
per-token scales taken from the copies' descriptors instead of a second load 524.1 / 523.7 us (it costs the mixed
path about 30 registers). Kept: the XOR-swizzled value ring (:data:`RING_V`) and the five-instruction rebuild, 525.2 ->
523.6 us together; with no descriptor loads at all the H100 gives 524.4 / 524.3 us: it streams at its bandwidth.
At d930675 (a third H100, ``.ci/gpu/stream_variants.py``): this kernel 523.3 us, FlashInfer TC 694.3 (1.327x); 2 or 4
ring slots 525.1 / 525.8, the per-token scales from the copies' descriptors 523.2, an ``.L2::256B`` hint 523.5, both
522.3, no descriptor loads 522.7, 1 or 4 splits instead of the plan's 2 543.6 / 536.8 us. The same probe at 72e78aa on
an H200 (run 4): this kernel 374.7 us, FlashInfer TC 496.0 (1.324x); 2 or 4 ring slots 375.9 / 376.9, one descriptor load
375.8, ``.L2::256B`` 391.9 (+4.6 %), both 390.2, no descriptor loads 371.2, 1 or 4 splits 435.6 / 410.8 us. Where the rest
goes (``.ci/gpu/timeline_probe.py``, same H200 and commit): the programs' page loops end between 348.6 and 371.9 us
(median 360.9), so the static split's tail costs about 11 us; on an H100 the SMs' mean loop ends differ by up to 3 %
(raw pages 11 %): equal shares do not end together (the latency chapter, "Where the launch's time goes"). Handing the
first K x C units of each split out as fixed chunks that any free program claims (``.ci/gpu/balanced_probe.py``; still
deterministic and lossless) was slower at every K, C tried: on an H100 527.6 (K = 2, C = 8) to 552.5 us (8, 2) against
this kernel's 523.5 us in the same rounds, on an H200 374.7 to 404.7 us against 367.2. A program whose loop has ended
prefetching its sibling split's last N units into L2 (``.ci/gpu/l2_assist_probe.py``, output unchanged bit for bit)
gained nothing on an H100 (544.4 us; N = 2-8: 544.6-546.5, N = 32: 578.0). More programs in one wave did not help
either (same H100, ``bench attention --splits 2 3 4 --stages 2 3``, ``results/paper/zipfusion_kernel_split_stage_ab.csv``):
2 splits 544.6 / 542.9 us at 2 / 3 ring slots, 3 splits 550.3 / 632.7, 4 splits (2048 programs, 16 per SM at 2 slots)
551.2 / 558.7. Nor did the block scheduler as the tail's queue (``.ci/gpu/tail_blocks_probe.py``, an H100 at dde18f0:
each split's last N x T units as N short programs launched after every long one, residency held to 8 per SM): 543.9 us
as committed, the control 544.1, N = 1: 547.7-548.9, 2: 550.9-551.5, 4: 557.8-557.9
(``results/paper/zipfusion_kernel_short_programs_ab.csv``).

One warp per program: grid ``(batch, kv_heads, num_splits)``, online softmax over one unit per step.

Specialisations (constexpr ``KIND``, the page kinds of :mod:`zipkv.paged`), all through the same
pipeline -- with a ring of S slots (launch option ``stages``, default 2), the data of units
i+1 .. i+S-1, the descriptors of unit i+S and the page ids of i+S+1 are in flight while unit i is
computed; full units run without a token mask, the last unit of a range after the loop:

* COMPRESSED: units whose K and V blocks are all compressed. The rebuild uses a fixed exponent base
  128 (``high = sign << 7 | (64 + offset)``: one ``or`` per 4 values, no per-block operand) and undoes
  it exactly with a power of two per token: ``2^(b - 128)`` on the scores for keys, on P for values (a
  block with b = 0 gets 0: exact for an all-zero block; a value below 2^-126 would be flushed). A power of
  two commutes with every rounding in normal range, so at the same split count the kernel's output over packed
  pages is its output over the same pages raw, bit for bit, whichever specialisation reads them
  (``tests/test_decode_mma.py``, "The lossless format"; an H200 probe at 9fbb6cf,
  ``results/paper/zipfusion_lossless_probe.txt``: ZipFusion's engine and the
  uncompressed engine in these layouts gave the same greedy tokens for 8 of 8 PG19 windows of 1024 tokens and 64
  new ones, the uncompressed engine in the token layouts -- the Triton kernel -- for 4 of 8).
* RAW: raw blocks (bf16 in the raw byte order of :func:`zipkv.format.raw_index`): the same kernel with
  compression switched off (the engine's uncompressed cache on a GPU, :func:`zipkv.engine.default_layouts`).
* MIXED: any unit, each block as stored, in a ring slot of raw size. Each block covers fixed rows of the
  operand tiles (keys: the 4 token rows of the block; values: one of the 4 block rows of every value
  chunk), the slot holds each block's stored bytes in the rows it covers (:func:`_issue`: one address per
  tile for both kinds, only stored bytes are read), is read as 32-bit words, and one word-wise select per 4
  values takes the rebuilt or the raw bf16 pairs (:func:`_select_words`); a raw token's scale is 1. There is no per-unit
  branch: a warp-uniform shortcut for units whose blocks are all compressed kept two versions of the
  operands live (205 registers instead of 144) and was slower on every measured mix.

Registers (offline, sm_90a, :func:`zipkv.kernels.kernel_info.decode_mma_info`; G = 4, 3): the scores are two
mma over the key halves, so only one half's words are live at once: 111-128 registers (:data:`MAX_REGISTERS`),
where the untransposed kernel (q as the A operand, from shared memory) took 140-148 and 4 KB more shared
memory per program, which held the mixed and raw specialisations to 10 programs per SM instead of 13.
Measured on the H200 (latency chapter at ec5d2c1, 8192 x 64, Llama-3.1-8B shape): COMPRESSED 376.7 us, MIXED on
the measured mix 396.7 us, RAW 488.6 us, FlashInfer TC 495.5 us in the same run; the untransposed kernel's run at
9b2abad: 371.1, 400.5 and 479.0 us against FlashInfer TC's 483.9 us. In absolute time the change is small
(the mix -1 %); SmolLM2 shape (head_dim 64, G = 3): 81.8 and 88.4 us (was 81.4 and 90.1 us).

The online softmax rescales lazily (:func:`_softmax_step`). Every launch takes every page of its
requests, the last one too (tokens past ``last_page_len`` are masked), so a batch is one launch
(:func:`zipkv.kernels.decode_attention.plan`: COMPRESSED or RAW for a uniform cache, MIXED otherwise),
and it merges its own splits: the last split of each request and KV head to arrive does it, in two levels
beyond 16 splits (:func:`_finish`, :func:`merge_groups`). With few requests the plan spreads a KV head over ~100-200
splits, and one warp merging them all, its loads unrolled, after everything else had ended, set the launch's
length: H200 at 55b3dff, Llama-3.1-8B shape, 32768 tokens x 1 request at the plan's split counts, one level
against two in the same rounds: all compressed 136.4 -> 40.7 us (132 splits), measured mix 252.6 -> 53.0 (214),
raw 108.3 -> 44.8 (99), FlashInfer TC 44.8; 131072 x 1: 213.1 -> 109.6, 344.4 -> 162.8, 198.8 -> 135.6 against
138.2 (``results/paper/zipfusion_kernel_merge_tree_ab.csv``, ``.ci/gpu/merge_tree_probe.py``). At 16 splits or fewer
the merge is the one level it was, bit for bit.

Gluon has no interpreter (``TRITON_INTERPRET=1``): this kernel runs on CUDA GPUs only; its tests
run on the GPU, the format and the pack kernel are tested on the CPU.
"""
from __future__ import annotations

import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from zipkv import paged
from zipkv.kernels import occupancy, tuning

__all__ = ["launch", "launch_config", "merge_groups", "merge_constants", "workspace", "MMA_LAUNCH"]

MMA_LAUNCH = dict(programs_per_sm=6, stages=2, maxnreg=0)
"""Launch options of this kernel (one warp per program): the split-KV target in programs per SM and
the pipeline depth (shared-memory ring slots); a plan's ``launch`` overrides them; the defaults for a GPU
without tuned options. On the H200 a specialisation holds 13-16 programs per SM with two ring slots and 8-11 with
the three that its tuned options give the all-compressed and all-raw paths at head_dim 128 (:func:`resident_per_sm`,
"Inside the kernels"); what a target changes is the split count it implies (:func:`zipkv.kernels.decode_attention.gluon_split_count`).
``bench tune --kernel gluon`` (8192 tokens x batch 64, ``results/paper/zipfusion_gluon_tuning.csv``): at head_dim
128 (42181af) targets 4-8 within 0.4 % of each other (10-16: the all-compressed path 3 % slower); at head_dim 64
(b97b35f, with the confirming rounds) targets under 6 up to 36 % slower, 6-16 within 5 % (mixed pages: 12)."""


def launch_config(path: str, gpu_name: str | None = None, head_dim: int = 128) -> dict:
    """Launch options of the ``path`` specialisation (a name of :data:`zipkv.paged.PAGE_KINDS`) at ``head_dim`` on
    the GPU model ``gpu_name``: its entry measured by ``python -m zipkv bench tune --kernel gluon --write``
    (:func:`zipkv.kernels.tuning.tuned`) over :data:`MMA_LAUNCH`."""
    if path not in paged.PAGE_KINDS:
        raise ValueError(f"path must be one of {paged.PAGE_KINDS}, got {path!r}")
    return {**MMA_LAUNCH, **tuning.tuned(gpu_name, path, kernel="gluon", head_dim=head_dim)}


MAX_REGISTERS = {8: 128, 16: 224}
"""Registers per thread that every specialisation of the pipelined kernel stays within, per query-head columns
(:func:`query_columns`; offline, sm_90a: 111-128 with 8 columns, 133-217 with 16; the CPU tests compile them and
check): with :func:`shared_bytes`, how many programs an SM holds at once (:func:`resident_per_sm`; 208 and 224
registers give the same count with 16 columns)."""


def shared_bytes(kind: int, slots: int) -> int:
    """Shared memory of one program of the pipelined kernel of page kind ``kind`` with ``slots`` ring slots
    (bytes): the ring (:func:`_rings`: per slot COMPRESSED 3 + 6, RAW and MIXED 4 + 8 tiles), the
    per-token scales and MIXED's block flags (q stays in registers)."""
    ring = {paged.COMPRESSED: 3 * 1024 + 6 * 512, paged.RAW: 4 * 1024 + 8 * 512, paged.MIXED: 4 * 1024 + 8 * 512}
    flags = slots * (16 + 4) * 4 if kind == paged.MIXED else 0
    return slots * (ring[kind] + 2 * 16 * 4) + flags


def resident_per_sm(kind: int, slots: int, shared_per_sm: int | None = None, group: int = 1) -> int:
    """Programs of the pipelined kernel one SM holds at once (:func:`zipkv.kernels.occupancy.programs_per_sm`
    at :data:`MAX_REGISTERS` for ``group`` query heads per KV head and :func:`shared_bytes`; ``shared_per_sm``
    default the H200's)."""
    sm = dict(occupancy.H200_SM, **({"shared_bytes": shared_per_sm} if shared_per_sm else {}))
    return occupancy.programs_per_sm(MAX_REGISTERS[query_columns(group)], 1, shared_bytes(kind, slots), sm)


MAX_GROUP = {128: 16, 64: 16}
"""Query heads per KV head this kernel takes, per head_dim (the columns of the transposed scores and output)."""


def query_columns(group: int) -> int:
    """Columns ``NQ`` of the transposed scores ``K @ q^T`` and output for ``group`` query heads per KV head: one
    mma n-tile (8) up to 8, two up to :data:`MAX_GROUP`."""
    return 8 if group <= 8 else 16


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
# The same tiles as 32-bit words (MIXED pages): [16 tokens, 4 lanes q, 4 words] and [4 blocks, 8 lanes m, 4 words].
K_WORDS = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 1, 4], threads_per_warp=[8, 4, 1],
                                        warps_per_cta=[1, 1, 1], order=[2, 1, 0]))
V_WORDS = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 1, 4], threads_per_warp=[4, 8, 1],
                                        warps_per_cta=[1, 1, 1], order=[2, 0, 1]))
# The ring's tiles in shared memory. Key tiles [16 t, 4 q, 16 bytes]: lane l's 16 bytes at 16 l (no bank conflicts).
# Value chunks [4 blk, 8 m, 16 bytes] at 128 blk + 16 (m ^ 2 blk) (a linear layout: the [blk, m, byte] of each offset
# bit): a block's 128 bytes (one line of a copy) fill all 8 bank groups, and so do each quarter warp's reads (blocks
# 0-3 x m = 2p, 2p + 1). Unswizzled, the reads had 4-way conflicts (Nsight at 2067832: 72 of the 124 shared-memory
# wavefronts per unit); block-fastest moved them to the copies' fills (measured: see the module docstring).
RING = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0]))
RING_V = gl.constexpr(gl.SharedLinearLayout(offset_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 1, 0],
                                                          [0, 2, 0], [0, 4, 0], [1, 2, 0], [2, 4, 0]]))
RING_V_WORDS = gl.constexpr(gl.SharedLinearLayout(offset_bases=[[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 2, 0], [0, 4, 0],
                                                                [1, 2, 0], [2, 4, 0]]))   # the same as int32 words
SCALES = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
TOKS = gl.constexpr(gl.SliceLayout(1, MMA.value))     # the token rows of S^T [16, NQ]
QCOLS = gl.constexpr(gl.SliceLayout(0, MMA.value))    # its query-head columns
RESCALE_LOG2 = gl.constexpr(8.0)
"""Lazy rescaling threshold of the online softmax (log2 units): see :func:`_softmax_step`."""
K_ROWS = gl.constexpr(gl.SliceLayout(1, gl.SliceLayout(2, K_REGS.value)))   # a key tile's 16 token rows
V_ROWS = gl.constexpr(gl.SliceLayout(1, gl.SliceLayout(2, V_REGS.value)))   # a value chunk's 4 block rows


# ----------------------------------------------------------------------------- rebuild

@gluon.jit
def _rebuild128(low, code, HIGH: gl.constexpr):
    """uint8 low bytes + uint8 code bytes (low or HIGH nibble) -> bf16 with exponent base 128,
    4 values per asm: high byte ``(c << 4) & 0x80 | c & 7 | 0x40`` (low nibble; high: ``c & 0x80 | (c >> 4) & 7
    | 0x40``), two byte permutes. Five instructions: a shift and two ``lop3`` ``(a & b) | c`` (LUT 0xEA), the
    first with the constant 0x40 bytes in a register (ptxas made shift, and, and-or, or of the plain ands and
    ors), then the permutes."""
    if HIGH:
        return gl.inline_asm_elementwise(
            "{ .reg .b32 n, t, c; mov.b32 c, 0x40404040; shr.b32 t, $3, 4; lop3.b32 t, t, 0x07070707, c, 0xEA; "
            "lop3.b32 n, $3, 0x80808080, t, 0xEA; prmt.b32 $0, $2, n, 0x5140; prmt.b32 $1, $2, n, 0x7362; }",
            "=r,=r,r,r", [low, code], dtype=gl.bfloat16, is_pure=True, pack=4)
    else:
        return gl.inline_asm_elementwise(
            "{ .reg .b32 n, t, c; mov.b32 c, 0x40404040; shl.b32 n, $3, 4; lop3.b32 t, $3, 0x07070707, c, 0xEA; "
            "lop3.b32 n, n, 0x80808080, t, 0xEA; prmt.b32 $0, $2, n, 0x5140; prmt.b32 $1, $2, n, 0x7362; }",
            "=r,=r,r,r", [low, code], dtype=gl.bfloat16, is_pure=True, pack=4)


@gluon.jit
def _select_words(low, code, raw_a, raw_b, comp, HIGH: gl.constexpr):
    """MIXED pages, per 32-bit word (4 values): where ``comp``, the bf16 pair words rebuilt (base 128) from a
    low-byte word and a code word (its low or HIGH nibbles), else the raw pair words ``raw_a``, ``raw_b``
    (values 0-1, 2-3 of the 4). int32 in, int32 out."""
    if HIGH:
        return gl.inline_asm_elementwise(
            "{ .reg .b32 n, t, c, x, y; .reg .pred p; setp.ne.b32 p, $6, 0; mov.b32 c, 0x40404040; shr.b32 t, $3, 4; "
            "lop3.b32 t, t, 0x07070707, c, 0xEA; lop3.b32 n, $3, 0x80808080, t, 0xEA; prmt.b32 x, $2, n, 0x5140; "
            "prmt.b32 y, $2, n, 0x7362; selp.b32 $0, x, $4, p; selp.b32 $1, y, $5, p; }",
            "=r,=r,r,r,r,r,r", [low, code, raw_a, raw_b, comp], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
    else:
        return gl.inline_asm_elementwise(
            "{ .reg .b32 n, t, c, x, y; .reg .pred p; setp.ne.b32 p, $6, 0; mov.b32 c, 0x40404040; shl.b32 n, $3, 4; "
            "lop3.b32 t, $3, 0x07070707, c, 0xEA; lop3.b32 n, n, 0x80808080, t, 0xEA; prmt.b32 x, $2, n, 0x5140; "
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
def _key_operand(k):
    """A key half ``[16, 4, 16]`` (channel bit 6 = 0 or 1) -> the A operand ``[16 token rows, 64 channels]``."""
    return gl.convert_layout(k.reshape([16, 4, 8, 2]).permute([0, 2, 1, 3]).reshape([16, 64]), A_OP)


@gluon.jit
def _value_operands(v0, v1, v2, v3, HD: gl.constexpr):
    """The four value chunks ``[4, 8, 16]`` (channel bits 5, 6) -> V^T as A operands: head_dim 128 one
    ``[128 channels, 16 token rows]`` (twice); 64 the two ``[64, 16]`` of channels 0-63 (the rows' first
    tokens) and 64-127 (their second)."""
    v = gl.join(gl.join(v0, v1), gl.join(v2, v3))                    # [blk, m, r, c5, c6]
    v = v.reshape([2, 2, 8, 2, 2, 2, 2, 2, 2]).permute([5, 0, 1, 6, 8, 7, 3, 4, 2]).reshape([16, 128])
    if HD == 128:
        vt = gl.convert_layout(v.permute([1, 0]), A_OP)
        return vt, vt
    else:
        v0t, v1t = gl.split(v.reshape([16, 2, 64]).permute([2, 0, 1]))   # [64, 16] per channel half
        return gl.convert_layout(v0t, A_OP), gl.convert_layout(v1t, A_OP)


@gluon.jit
def _row_valid(r, valid_a, valid_b, HD: gl.constexpr, HALF: gl.constexpr):
    """Whether token row ``r`` of a unit holds a valid token (page ``pa`` holds ``valid_a``, head_dim 64's
    ``pb`` ``valid_b``); head_dim 64: the row's first (HALF 0) or second token. Token row ``r`` of a head_dim-64
    pair is tokens ``2l``, ``2l + 1`` of page ``pa`` if ``(r >> 2) & 1 == 0`` else ``pb`` (``l = r % 4 + 4 (r >> 3)``)."""
    if HD == 128:
        return r < valid_a
    else:
        tok = 2 * (r % 4 + 4 * (r >> 3)) + HALF
        return tok < gl.where(((r >> 2) & 1) == 0, valid_a, valid_b)


@gluon.jit
def _softmax_step(s0, s1, va0, va1, m_i, l_i, acc, k_scale, v_scale, valid_a, valid_b, LAST: gl.constexpr,
                  HD: gl.constexpr):
    """One unit (16 token rows; only the LAST of a range may hold fewer valid tokens than 16 per row) from its
    transposed scores ``[16 token rows, NQ query heads]`` (``K @ q^T``, before the per-token scale; head_dim 64:
    ``s0`` of the rows' first tokens, ``s1`` of their second, else ``s1`` is unused): scores in the log2 domain,
    online softmax, ``acc += V^T @ P^T`` (``acc`` ``[head_dim, NQ]``; V^T as the A operands ``va0``, ``va1``).
    The running max ``m_i`` is raised (and ``acc``, ``l_i`` rescaled) only when a query head's max exceeds it by
    more than :data:`RESCALE_LOG2` (a warp-uniform branch): below that, P stays <= 2^RESCALE_LOG2 and the
    result is the same up to rounding (``m_i`` cancels in ``acc / l_i`` and in the log-sum-exp), and most
    pages skip the rescale. Every unit's first token is valid, so ``m_i`` is finite from the first unit on."""
    r = gl.arange(0, 16, layout=TOKS)[:, None]
    s0 = s0 * k_scale[:, None]
    if LAST:
        s0 = gl.where(_row_valid(r, valid_a, valid_b, HD, 0), s0, float("-inf"))
    m_page = gl.max(s0, axis=0)
    if HD == 64:
        s1 = s1 * k_scale[:, None]
        if LAST:
            s1 = gl.where(_row_valid(r, valid_a, valid_b, HD, 1), s1, float("-inf"))
        m_page = gl.maximum(m_page, gl.max(s1, axis=0))
    if gl.max(gl.where(m_page > m_i, m_page - m_i, 0.0), axis=0) > RESCALE_LOG2:
        m_new = gl.maximum(m_i, m_page)
        alpha = gl.where(m_i == m_new, 1.0, gl.exp2(m_i - m_new))
        acc = acc * alpha[None, :]
        l_i = l_i * alpha
        m_i = m_new
    p = gl.exp2(s0 - m_i[None, :])
    l_i = l_i + gl.sum(p, axis=0)
    acc = mma_v2(va0, gl.convert_layout((p * v_scale[:, None]).to(gl.bfloat16), B_OP), acc)
    if HD == 64:
        p = gl.exp2(s1 - m_i[None, :])
        l_i = l_i + gl.sum(p, axis=0)
        acc = mma_v2(va1, gl.convert_layout((p * v_scale[:, None]).to(gl.bfloat16), B_OP), acc)
    return m_i, l_i, acc


@gluon.jit
def _kdesc(desc_ptr, pa, pb, h, blk, HKV: gl.constexpr, HD: gl.constexpr):
    """Descriptors of the unit's key blocks ``blk`` (0..3, any shape): head_dim 128, the unit is page ``pa``;
    64, the page pair (``pa``, ``pb``) as one 16-row tile, key blocks 0, 2 from ``pa`` and 1, 3 from ``pb``."""
    if HD == 128:
        return gl.load(desc_ptr + (pa * 2 * HKV + h) * 4 + blk)
    else:
        return gl.load(desc_ptr + (gl.where(blk % 2 == 0, pa, pb) * 2 * HKV + h) * 2 + blk // 2)


@gluon.jit
def _vdesc(desc_ptr, pa, pb, h, blk, HKV: gl.constexpr, HD: gl.constexpr):
    """As :func:`_kdesc` for value blocks; head_dim 64: value blocks 0, 1 from ``pa`` and 2, 3 from ``pb``."""
    if HD == 128:
        return gl.load(desc_ptr + ((pa * 2 + 1) * HKV + h) * 4 + blk)
    else:
        return gl.load(desc_ptr + ((gl.where(blk < 2, pa, pb) * 2 + 1) * HKV + h) * 2 + blk % 2)


@gluon.jit
def _descs(desc_ptr, pa, pb, h, HKV: gl.constexpr, HD: gl.constexpr):
    """Descriptors of one unit (a page; head_dim 64: a page pair): keys per token row ``[16]``, values per
    block ``[4]``."""
    kt = gl.arange(0, 16, layout=K_ROWS)
    vb = gl.arange(0, 4, layout=V_ROWS)
    return _kdesc(desc_ptr, pa, pb, h, kt // 4, HKV, HD), _vdesc(desc_ptr, pa, pb, h, vb, HKV, HD)


@gluon.jit
def _compressed(dsc):
    return ((dsc >> 7) & 1) != 0


@gluon.jit
def _scales(desc_ptr, pa, pb, h, qk_scale, HKV: gl.constexpr, KIND: gl.constexpr, HD: gl.constexpr):
    """Per token row of the unit (a row of S^T / P^T): the key scale (softmax scale included) and the
    value scale, ``2^(b - 128)`` of the row's block if it is compressed, else 1."""
    st = gl.arange(0, 16, layout=TOKS)
    if KIND == RAW:
        return gl.full([16], qk_scale, gl.float32, layout=TOKS), gl.full([16], 1.0, gl.float32, layout=TOKS)
    kd = _kdesc(desc_ptr, pa, pb, h, st // 4, HKV, HD)
    vd = _vdesc(desc_ptr, pa, pb, h, (st >> 1) % 4, HKV, HD)
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
def _issue(pool_ptr, kbuf, vbuf, kflags, vflags, slot, kd, vd, KIND: gl.constexpr):
    """cp.async of one page into ring ``slot``, 16 contiguous bytes per thread and copy, the same addresses for
    both kinds of block (:func:`zipkv.format.raw_index`): key tile u ``[16, 4, 16]`` at byte ``256u + 64 (t % 4)
    + 16 q`` of each token row's block, value chunk u ``[4, 8, 16]`` at ``128u + 16 m`` of each block row's
    block. A compressed block fills key tiles 0-2 (low bytes of channel bit 6 = 0, 1; codes) and value chunks
    0-5 (low bytes of channel bits (5, 6) = c; codes of bit 5 = c - 4); a raw one key tiles 0-3 (2 h + s: the
    first or second 8 bf16 of each lane's 16 in channel half h) and value chunks 0-7 (2 c + s, of chunk c).
    COMPRESSED copies 3 + 6 tiles, RAW 4 + 8, MIXED 4 + 8 with tile 3 and chunks 6-7 masked off for compressed
    blocks (and its block flags into ``kflags`` / ``vflags``): only stored bytes are read."""
    kt, kq, kj, vm, vr = _tile_indices()
    ka = pool_ptr + gl.multiple_of((kd >> 8) + (kt % 4) * 64, 16)[:, None, None] + ((kq * 16)[None, :, None]
                                                                                    + kj[None, None, :])
    va = pool_ptr + gl.multiple_of(vd >> 8, 256)[:, None, None] + ((vm * 16)[None, :, None] + vr[None, None, :])
    KT: gl.constexpr = 3 if KIND == COMPRESSED else 4
    VT: gl.constexpr = 6 if KIND == COMPRESSED else 8
    for u in gl.static_range(KT):
        if KIND == MIXED and u == 3:
            async_copy.async_copy_global_to_shared(kbuf[u].index(slot), ka + u * 256,
                                                   mask=~_compressed(kd)[:, None, None])
        else:
            async_copy.async_copy_global_to_shared(kbuf[u].index(slot), ka + u * 256)
    for u in gl.static_range(VT):
        if KIND == MIXED and u >= 6:
            async_copy.async_copy_global_to_shared(vbuf[u].index(slot), va + u * 128,
                                                   mask=~_compressed(vd)[:, None, None])
        else:
            async_copy.async_copy_global_to_shared(vbuf[u].index(slot), va + u * 128)
    if KIND == MIXED:
        kflags.index(slot).store(_compressed(kd).to(gl.int32))
        vflags.index(slot).store(_compressed(vd).to(gl.int32))


@gluon.jit
def _rebuilt_values(vbuf, slot):
    c0 = vbuf[4].index(slot).load(V_REGS)
    c1 = vbuf[5].index(slot).load(V_REGS)
    return (_rebuild128(vbuf[0].index(slot).load(V_REGS), c0, False),
            _rebuild128(vbuf[1].index(slot).load(V_REGS), c1, False),
            _rebuild128(vbuf[2].index(slot).load(V_REGS), c0, True),
            _rebuild128(vbuf[3].index(slot).load(V_REGS), c1, True))


@gluon.jit
def _words(buf, slot, WORDS: gl.constexpr):
    """Ring tile ``slot`` of a byte ring ``buf`` (key tiles ``[SLOTS, 16, 4, 16]`` or value chunks ``[SLOTS, 4, 8, 16]``)
    read as 32-bit words ``[a, b, 4]``."""
    shape: gl.constexpr = [buf.shape[0], buf.shape[1], buf.shape[2], 4]
    if buf.shape[1] == 4:
        return buf._reinterpret(gl.int32, shape, RING_V_WORDS).index(slot).load(WORDS)
    else:
        return buf._reinterpret(gl.int32, shape, RING).index(slot).load(WORDS)


@gluon.jit
def _mixed_key_half(kbuf, kflags, slot, HALF: gl.constexpr):
    """MIXED page in ring ``slot`` -> bf16 key half HALF (channel bit 6): each row rebuilt or raw as its
    block is stored, by one word-wise rebuild-or-raw select (:func:`_select_words`)."""
    low = _words(kbuf[HALF], slot, K_WORDS)
    code = _words(kbuf[2], slot, K_WORDS)
    kcomp = kflags.index(slot).load(gl.SliceLayout(1, gl.SliceLayout(2, K_WORDS)))[:, None, None] + low * 0
    ra, rb = _raw_pairs(_words(kbuf[2 * HALF], slot, K_WORDS), _words(kbuf[2 * HALF + 1], slot, K_WORDS), K_WORDS)
    a, b = _select_words(low, code, ra, rb, kcomp, HALF == 1)
    return _words_to_values(a, b, K_REGS)


@gluon.jit
def _key_half(kbuf, kflags, slot, KIND: gl.constexpr, HALF: gl.constexpr):
    """Key half HALF (channels 64 HALF .. of the unit's rows) in ring ``slot`` as the A operand ``[16, 64]``
    (raw bytes past a partial page may be any bf16: their scores are masked, and a score is one token's)."""
    if KIND == COMPRESSED:
        k = _rebuild128(kbuf[HALF].index(slot).load(K_REGS), kbuf[2].index(slot).load(K_REGS), HALF == 1)
    elif KIND == RAW:
        ra, rb = _raw_pairs(_words(kbuf[2 * HALF], slot, K_WORDS), _words(kbuf[2 * HALF + 1], slot, K_WORDS), K_WORDS)
        k = _words_to_values(ra, rb, K_REGS)
    else:
        k = _mixed_key_half(kbuf, kflags, slot, HALF)
    return _key_operand(k)


@gluon.jit
def _raw_values(vbuf, slot):
    """RAW page in ring ``slot`` -> the four bf16 value chunks (chunk c from byte tiles 2c, 2c + 1)."""
    a0, b0 = _raw_pairs(_words(vbuf[0], slot, V_WORDS), _words(vbuf[1], slot, V_WORDS), V_WORDS)
    a1, b1 = _raw_pairs(_words(vbuf[2], slot, V_WORDS), _words(vbuf[3], slot, V_WORDS), V_WORDS)
    a2, b2 = _raw_pairs(_words(vbuf[4], slot, V_WORDS), _words(vbuf[5], slot, V_WORDS), V_WORDS)
    a3, b3 = _raw_pairs(_words(vbuf[6], slot, V_WORDS), _words(vbuf[7], slot, V_WORDS), V_WORDS)
    return (_words_to_values(a0, b0, V_REGS), _words_to_values(a1, b1, V_REGS),
            _words_to_values(a2, b2, V_REGS), _words_to_values(a3, b3, V_REGS))


@gluon.jit
def _mixed_values(vbuf, vflags, slot):
    """MIXED page in ring ``slot`` -> the four bf16 value chunks, each block row rebuilt or raw as
    :func:`_mixed_key_half`."""
    u0 = _words(vbuf[0], slot, V_WORDS)
    u1 = _words(vbuf[1], slot, V_WORDS)
    u2 = _words(vbuf[2], slot, V_WORDS)
    u3 = _words(vbuf[3], slot, V_WORDS)
    u4 = _words(vbuf[4], slot, V_WORDS)
    u5 = _words(vbuf[5], slot, V_WORDS)
    u6 = _words(vbuf[6], slot, V_WORDS)
    u7 = _words(vbuf[7], slot, V_WORDS)
    vc = vflags.index(slot).load(gl.SliceLayout(1, gl.SliceLayout(2, V_WORDS)))[:, None, None] + u0 * 0
    ra, rb = _raw_pairs(u0, u1, V_WORDS)
    a0, b0 = _select_words(u0, u4, ra, rb, vc, False)
    ra, rb = _raw_pairs(u2, u3, V_WORDS)
    a1, b1 = _select_words(u1, u5, ra, rb, vc, False)
    ra, rb = _raw_pairs(u4, u5, V_WORDS)
    a2, b2 = _select_words(u2, u4, ra, rb, vc, True)
    ra, rb = _raw_pairs(u6, u7, V_WORDS)
    a3, b3 = _select_words(u3, u5, ra, rb, vc, True)
    return (_words_to_values(a0, b0, V_REGS), _words_to_values(a1, b1, V_REGS),
            _words_to_values(a2, b2, V_REGS), _words_to_values(a3, b3, V_REGS))


@gluon.jit
def _compute(qk0, qk1, m_i, l_i, acc, kbuf, vbuf, kflags, vflags, slot, k_scale, v_scale, valid_a, valid_b,
             KIND: gl.constexpr, LAST: gl.constexpr, HD: gl.constexpr, NQ: gl.constexpr):
    """Page in ring ``slot`` (its first ``valid`` tokens) into the softmax state. Only the LAST unit of a
    range may be partial (``valid_a``, ``valid_b``: see :func:`_row_valid`): the pipeline's loop takes
    full units, so it has no token mask. The transposed scores ``K @ q^T`` are two mma over the key halves
    (``qk0``, ``qk1``: q^T's B operands ``[64, NQ]``, kept in registers; head_dim 64: one per half, the same q
    for the rows' first and second tokens), so that only one half's words are live at once."""
    z = gl.zeros([16, NQ], gl.float32, layout=MMA)
    s0 = mma_v2(_key_half(kbuf, kflags, slot, KIND, 0), qk0, z)
    if HD == 128:
        s0 = mma_v2(_key_half(kbuf, kflags, slot, KIND, 1), qk1, s0)
        s1 = s0
    else:
        s1 = mma_v2(_key_half(kbuf, kflags, slot, KIND, 1), qk0, z)
    if KIND == COMPRESSED:
        v0, v1, v2, v3 = _rebuilt_values(vbuf, slot)
    elif KIND == RAW:
        v0, v1, v2, v3 = _raw_values(vbuf, slot)
    else:
        v0, v1, v2, v3 = _mixed_values(vbuf, vflags, slot)
    va0, va1 = _value_operands(v0, v1, v2, v3, HD)
    if KIND != COMPRESSED and LAST:
        if valid_a + valid_b < 32:           # raw bytes past a partial page may be any bf16 (inf, nan): 0 x inf
            r = gl.arange(0, 16, layout=gl.SliceLayout(0, A_OP))[None, :]
            va0 = gl.where(_row_valid(r, valid_a, valid_b, HD, 0), va0, 0.0)
            if HD == 64:
                va1 = gl.where(_row_valid(r, valid_a, valid_b, HD, 1), va1, 0.0)
    return _softmax_step(s0, s1, va0, va1, m_i, l_i, acc, k_scale, v_scale, valid_a, valid_b, LAST, HD)


@gluon.jit
def _key_tiles(SLOTS: gl.constexpr):
    return gl.allocate_shared_memory(gl.uint8, [SLOTS, 16, 4, 16], RING)


@gluon.jit
def _value_chunks(SLOTS: gl.constexpr):
    return gl.allocate_shared_memory(gl.uint8, [SLOTS, 4, 8, 16], RING_V)


@gluon.jit
def _rings(KIND: gl.constexpr, SLOTS: gl.constexpr):
    """The ring of one specialisation: a tuple of key tiles ``[SLOTS, 16, 4, 16]`` and one of value chunks
    ``[SLOTS, 4, 8, 16]`` of bytes (COMPRESSED 3 + 6, RAW and MIXED 4 + 8), one
    allocation each: copies into different allocations need no barrier between them (Triton's barrier
    pass sees one allocation as one buffer)."""
    if KIND == COMPRESSED:
        kbuf = (_key_tiles(SLOTS), _key_tiles(SLOTS), _key_tiles(SLOTS))
        vbuf = (_value_chunks(SLOTS), _value_chunks(SLOTS), _value_chunks(SLOTS), _value_chunks(SLOTS),
                _value_chunks(SLOTS), _value_chunks(SLOTS))
    else:
        kbuf = (_key_tiles(SLOTS), _key_tiles(SLOTS), _key_tiles(SLOTS), _key_tiles(SLOTS))
        vbuf = (_value_chunks(SLOTS), _value_chunks(SLOTS), _value_chunks(SLOTS), _value_chunks(SLOTS),
                _value_chunks(SLOTS), _value_chunks(SLOTS), _value_chunks(SLOTS), _value_chunks(SLOTS))
    return kbuf, vbuf


@gluon.jit
def _unit_pages(indices_ptr, p_start, u, last, npages, HD: gl.constexpr):
    """Physical page ids (int64) of unit ``min(u, last)`` of a request: head_dim 128 its page (twice),
    64 its page pair (pages 2u, 2u + 1; the second is the first again past the request's last page)."""
    u = gl.minimum(u, last)
    if HD == 128:
        pa = gl.load(indices_ptr + p_start + u).to(gl.int64)
        return pa, pa
    else:
        pa = gl.load(indices_ptr + p_start + 2 * u).to(gl.int64)
        return pa, gl.load(indices_ptr + p_start + gl.minimum(2 * u + 1, npages - 1)).to(gl.int64)


@gluon.jit
def _unit_valid(u, npages, last_len, HD: gl.constexpr):
    """Valid tokens of unit ``u``'s pages (``pa``, ``pb``: :func:`_row_valid`); page ``npages - 1``
    holds ``last_len``, a page past the request none."""
    if HD == 128:
        return gl.where(u == npages - 1, last_len, 16), 16
    else:
        vb = gl.where(2 * u + 1 == npages - 1, last_len, 16)
        return gl.where(2 * u == npages - 1, last_len, 16), gl.where(2 * u + 1 < npages, vb, 0)


@gluon.jit
def _pipelined(qk0, qk1, m_i, l_i, acc, pool_ptr, desc_ptr, indices_ptr, p_start, npages, lo, hi, last_len, h,
               qk_scale, HKV: gl.constexpr, KIND: gl.constexpr, SLOTS: gl.constexpr, HD: gl.constexpr,
               NQ: gl.constexpr):
    """Units [lo, hi) (hi > lo; a unit is a page, head_dim 64 a page pair: 16 token rows of 128 channels)
    of one request of ``npages`` pages (its last holds ``last_len`` tokens, the others 16) through a ring of
    SLOTS shared-memory slots: while unit i is computed, the data of units i+1 .. i+SLOTS-1, the
    descriptors of unit i+SLOTS and the page ids of i+SLOTS+1 are in flight. The per-token scales (and
    MIXED: the block flags) wait in the ring too. The last unit of the range is computed after the loop
    (:func:`_compute`'s LAST)."""
    kbuf, vbuf = _rings(KIND, SLOTS)
    ksbuf = gl.allocate_shared_memory(gl.float32, [SLOTS, 16], SCALES)
    vsbuf = gl.allocate_shared_memory(gl.float32, [SLOTS, 16], SCALES)
    kflags = gl.allocate_shared_memory(gl.int32, [SLOTS if KIND == MIXED else 1, 16], SCALES)
    vflags = gl.allocate_shared_memory(gl.int32, [SLOTS if KIND == MIXED else 1, 4], SCALES)
    last = hi - 1
    for j in gl.static_range(SLOTS - 1):
        pa, pb = _unit_pages(indices_ptr, p_start, lo + j, last, npages, HD)
        kd, vd = _descs(desc_ptr, pa, pb, h, HKV, HD)
        _issue(pool_ptr, kbuf, vbuf, kflags, vflags, j, kd, vd, KIND)
        async_copy.commit_group()
        ks, vs = _scales(desc_ptr, pa, pb, h, qk_scale, HKV, KIND, HD)
        ksbuf.index(j).store(ks)
        vsbuf.index(j).store(vs)
    paa, pba = _unit_pages(indices_ptr, p_start, lo + SLOTS - 1, last, npages, HD)
    kdn, vdn = _descs(desc_ptr, paa, pba, h, HKV, HD)
    pan, pbn = _unit_pages(indices_ptr, p_start, lo + SLOTS, last, npages, HD)
    for i in range(lo, hi - 1):                                          # full units: no token mask
        ahead = (i - lo + SLOTS - 1) % SLOTS                               # slot of unit i + SLOTS - 1
        _issue(pool_ptr, kbuf, vbuf, kflags, vflags, ahead, kdn, vdn, KIND)
        async_copy.commit_group()
        ks, vs = _scales(desc_ptr, paa, pba, h, qk_scale, HKV, KIND, HD)
        ksbuf.index(ahead).store(ks)
        vsbuf.index(ahead).store(vs)
        kdn, vdn = _descs(desc_ptr, pan, pbn, h, HKV, HD)               # unit i + SLOTS
        paa = pan
        pba = pbn
        pan, pbn = _unit_pages(indices_ptr, p_start, i + SLOTS + 1, last, npages, HD)
        async_copy.wait_group(SLOTS - 1)                                  # unit i has landed
        slot = (i - lo) % SLOTS
        m_i, l_i, acc = _compute(qk0, qk1, m_i, l_i, acc, kbuf, vbuf, kflags, vflags, slot,
                                 ksbuf.index(slot).load(TOKS), vsbuf.index(slot).load(TOKS),
                                 16, 16, KIND, False, HD, NQ)
    async_copy.wait_group(0)                                              # unit hi - 1, maybe partial
    slot = (hi - 1 - lo) % SLOTS
    valid_a, valid_b = _unit_valid(hi - 1, npages, last_len, HD)
    return _compute(qk0, qk1, m_i, l_i, acc, kbuf, vbuf, kflags, vflags, slot, ksbuf.index(slot).load(TOKS),
                    vsbuf.index(slot).load(TOKS), valid_a, valid_b, KIND, True, HD, NQ)


# ----------------------------------------------------------------------------- kernel

@gluon.jit
def _q_operand(q_ptr, qrow, G: gl.constexpr, NQ: gl.constexpr, HD: gl.constexpr, HALF: gl.constexpr):
    """q^T's channels ``64 HALF ..`` (head_dim 64: all 64) as the B operand ``[64, NQ]`` (bf16): column g is
    query head ``qrow + g`` for g < G, zero past the group."""
    c = gl.arange(0, 64, layout=gl.SliceLayout(1, B_OP))[:, None]
    g = gl.arange(0, NQ, layout=gl.SliceLayout(0, B_OP))[None, :]
    return gl.load(q_ptr + (qrow + g) * HD + HALF * (HD - 64) + c, mask=(g < G) & (c >= 0), other=0.0)


@gluon.jit
def _prologue(q_ptr, indptr_ptr, b, h, s, HKV: gl.constexpr, G: gl.constexpr, SPLITS: gl.constexpr,
              HD: gl.constexpr, NQ: gl.constexpr):
    """The request's pages, this split's share [lo, hi) of its units before the last (a unit: a page;
    head_dim 64: a page pair), q^T as two B operands (:func:`_q_operand`) and an empty softmax state
    (``acc`` ``[head_dim, NQ]``: the output transposed)."""
    p_start = gl.load(indptr_ptr + b)
    npages = gl.load(indptr_ptr + b + 1) - p_start
    units = npages if HD == 128 else (npages + 1) // 2
    per = gl.cdiv(units - 1, SPLITS)
    lo = gl.minimum(s * per, units - 1)
    hi = gl.minimum(lo + per, units - 1)
    qrow = b * (HKV * G) + h * G
    qk0 = _q_operand(q_ptr, qrow, G, NQ, HD, 0)
    qk1 = _q_operand(q_ptr, qrow, G, NQ, HD, 1) if HD == 128 else qk0
    m_i = gl.full([NQ], float("-inf"), gl.float32, layout=QCOLS)
    l_i = gl.zeros([NQ], gl.float32, layout=QCOLS)
    acc = gl.zeros([HD, NQ], gl.float32, layout=MMA)
    return p_start, npages, units, lo, hi, qk0, qk1, m_i, l_i, acc


@gluon.jit
def _merge(part_ptr, lse_ptr, out_ptr, rows, rows1, go, do, g1, first, count, TOT: gl.constexpr, N: gl.constexpr,
           G: gl.constexpr, NQ: gl.constexpr, HD: gl.constexpr, TO_OUT: gl.constexpr, slot):
    """Merge slots ``first .. first + count - 1`` (count <= N) of each query row, weighted by their log2-sum-exp,
    into ``out`` (bf16, TO_OUT) or into slot ``slot`` (fp32 output and its log2-sum-exp). The loop is unrolled, so
    that every slot's loads are in flight at once; the slots were written by other programs: read past L1 (.cg)."""
    m = gl.full([NQ], float("-inf"), gl.float32, layout=QCOLS)
    for j in gl.static_range(N):
        m = gl.maximum(m, gl.load(lse_ptr + rows1 * TOT + first + j, mask=(g1 < G) & (j < count),
                                  other=float("-inf"), cache_modifier=".cg"))
    top = gl.where(m > float("-inf"), m, 0.0)
    num = gl.zeros([HD, NQ], gl.float32, layout=MMA)
    wsum = gl.zeros([NQ], gl.float32, layout=QCOLS)
    for j in gl.static_range(N):
        w = gl.exp2(gl.load(lse_ptr + rows1 * TOT + first + j, mask=(g1 < G) & (j < count), other=float("-inf"),
                            cache_modifier=".cg") - top)
        o = gl.load(part_ptr + (rows * TOT + first + j) * HD + do, mask=(go < G) & (do >= 0) & (j < count),
                    other=0.0, cache_modifier=".cg")
        num += o * w[None, :]
        wsum += w
    den = gl.where(wsum > 0, wsum, 1.0)
    gm = (go < G) & (do >= 0)
    if TO_OUT:
        gl.store(out_ptr + rows * HD + do, (num / den[None, :]).to(gl.bfloat16), mask=gm)
    else:
        gl.store(part_ptr + (rows * TOT + slot) * HD + do, num / den[None, :], mask=gm)
        gl.store(lse_ptr + rows1 * TOT + slot, gl.where(wsum > 0, top + gl.log2(den), float("-inf")), mask=g1 < G)


@gluon.jit
def _finish(part_ptr, lse_ptr, out_ptr, cnt_ptr, m_i, l_i, acc, b, h, s, HKV: gl.constexpr, G: gl.constexpr,
            SPLITS: gl.constexpr, NQ: gl.constexpr, HD: gl.constexpr, GS: gl.constexpr, NG: gl.constexpr,
            TOT: gl.constexpr):
    """Output of a launch without a merge kernel (``acc`` ``[HD, NQ]``: the output of the KV head's query heads,
    transposed): one split writes ``out`` (bf16) directly; with more, each split writes its normalised partial
    output and log2-sum-exp into its slot of TOT (an empty split: l = 0, lse = -inf, o = 0). Up to 16 splits (one
    group, NG = 1) each counts itself in the (request, KV head)'s arrival counter and the last to arrive merges every
    slot into ``out``, its loads unrolled so that all are in flight at once: as runtime loops each split cost one L2
    round trip in series at the end of the launch (H200, 8192 x 64, SmolLM2 shape all compressible 80.9 -> 79.1 us
    at 5 splits; ``results/paper/zipfusion_kernel_merge_ab.csv``). With more, the splits form NG groups of GS
    (:func:`merge_groups`), each with its counter: the last of a group to arrive merges it into the group's slot
    ``SPLITS + g`` (:func:`_merge`) and counts the group in the pair's last counter, whose last arrival merges the NG
    group slots into ``out`` -- two short serial merges instead of one of ~100-200 slots (few requests, long
    contexts). Every counter is reset to 0 by its last arrival; the merge order is fixed, so the output is
    deterministic, and packed == raw bit for bit at the same split count. The one-level path is its own code, so
    that the kernels of the paper's grid (a few splits) compile as before (registers: :data:`MAX_REGISTERS`); the
    two-level path takes up to 168 registers at head_dim 128 (offline, sm_90a, no spills), which holds 12 programs
    per SM: more than splits past 16 ever launch (only for fewer pairs than SMs, at most 8 programs per SM:
    :data:`zipkv.kernels.decode_attention.FEW_REQUESTS_PROGRAMS_PER_SM`)."""
    g1 = gl.arange(0, NQ, layout=QCOLS)
    go = g1[None, :]
    do = gl.arange(0, HD, layout=gl.SliceLayout(1, MMA))[:, None]
    rows = b * (HKV * G) + h * G + go
    rows1 = b * (HKV * G) + h * G + g1
    gm = (go < G) & (do >= 0)
    den = gl.where(l_i > 0, l_i, 1.0)
    if SPLITS == 1:
        gl.store(out_ptr + rows * HD + do, (acc / den[None, :]).to(gl.bfloat16), mask=gm)
    else:
        gl.store(part_ptr + (rows * TOT + s) * HD + do, acc / den[None, :], mask=gm)
        gl.store(lse_ptr + rows1 * TOT + s, gl.where(l_i > 0, m_i + gl.log2(den), float("-inf")), mask=g1 < G)
        gl.thread_barrier()                    # every lane's stores before the release below
        if NG == 1:                            # one level: its loads unrolled, all in flight together
            arrived = gl.atomic_add(cnt_ptr + b * HKV + h, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLITS - 1:
                gl.store(cnt_ptr + b * HKV + h, 0)
                m = gl.full([NQ], float("-inf"), gl.float32, layout=QCOLS)
                for j in gl.static_range(SPLITS):
                    m = gl.maximum(m, gl.load(lse_ptr + rows1 * SPLITS + j, mask=g1 < G, other=float("-inf"),
                                              cache_modifier=".cg"))
                m = gl.where(g1 < G, m, 0.0)   # some split of a real row holds a token: m is finite
                num = gl.zeros([HD, NQ], gl.float32, layout=MMA)
                wsum = gl.zeros([NQ], gl.float32, layout=QCOLS)
                for j in gl.static_range(SPLITS):  # written by other programs: read past L1 (.cg)
                    w = gl.exp2(gl.load(lse_ptr + rows1 * SPLITS + j, mask=g1 < G, other=float("-inf"),
                                        cache_modifier=".cg") - m)
                    o = gl.load(part_ptr + (rows * SPLITS + j) * HD + do, mask=gm, other=0.0, cache_modifier=".cg")
                    num += o * w[None, :]
                    wsum += w
                wsum = gl.where(wsum > 0, wsum, 1.0)
                gl.store(out_ptr + rows * HD + do, (num / wsum[None, :]).to(gl.bfloat16), mask=gm)
        else:
            g = s // GS
            size = gl.minimum(GS, SPLITS - g * GS)
            cnt = cnt_ptr + (b * HKV + h) * (NG + 1)
            arrived = gl.atomic_add(cnt + g, 1, sem="acq_rel", scope="gpu")
            if arrived == size - 1:
                gl.store(cnt + g, 0)
                _merge(part_ptr, lse_ptr, out_ptr, rows, rows1, go, do, g1, g * GS, size, TOT, GS, G, NQ, HD, False,
                       SPLITS + g)
                gl.thread_barrier()
                done = gl.atomic_add(cnt + NG, 1, sem="acq_rel", scope="gpu")
                if done == NG - 1:
                    gl.store(cnt + NG, 0)
                    _merge(part_ptr, lse_ptr, out_ptr, rows, rows1, go, do, g1, SPLITS, NG, TOT, NG, G, NQ, HD,
                           True, 0)


@gluon.jit
def _pipelined_kernel(q_ptr, pool_ptr, desc_ptr, indptr_ptr, indices_ptr, last_ptr, part_ptr, lse_ptr, out_ptr,
                      cnt_ptr, qk_scale, HKV: gl.constexpr, G: gl.constexpr, SPLITS: gl.constexpr, GS: gl.constexpr, NG: gl.constexpr,
                      TOT: gl.constexpr,
                      KIND: gl.constexpr, SLOTS: gl.constexpr, HD: gl.constexpr, NQ: gl.constexpr):
    """Grid (batch, kv_heads, splits), one warp: split s of the request's units before its last (the last
    split also takes the last unit) through the cp.async ring as pages of kind KIND; the splits are merged
    into ``out`` here (:func:`_finish`). HD: head_dim, 128 or 64; NQ: the query heads' columns (8 or 16)."""
    b = gl.program_id(0)
    h = gl.program_id(1)
    s = gl.program_id(2)
    p_start, npages, units, lo, hi, qk0, qk1, m_i, l_i, acc = _prologue(q_ptr, indptr_ptr, b, h, s, HKV, G, SPLITS,
                                                                        HD, NQ)
    if s == SPLITS - 1:
        hi = units
    if hi > lo:
        m_i, l_i, acc = _pipelined(qk0, qk1, m_i, l_i, acc, pool_ptr, desc_ptr, indices_ptr, p_start, npages, lo,
                                   hi, gl.load(last_ptr + b), h, qk_scale, HKV, KIND, SLOTS, HD, NQ)
    _finish(part_ptr, lse_ptr, out_ptr, cnt_ptr, m_i, l_i, acc, b, h, s, HKV, G, SPLITS, NQ, HD, GS, NG, TOT)


def merge_groups(num_splits: int) -> tuple[int, int]:
    """(splits per group, groups) of :func:`_finish`'s merge: one group up to 16 splits (one level), else groups of
    ceil(sqrt(num_splits)) consecutive splits, so that neither level merges more than ~sqrt(num_splits) slots."""
    if num_splits <= 16:
        return num_splits, 1
    size = math.ceil(math.sqrt(num_splits))
    return size, math.ceil(num_splits / size)


def merge_constants(num_splits: int) -> dict:
    """The merge's constexprs of :func:`_pipelined_kernel` for ``num_splits``: GS splits per group, NG groups, TOT slots
    per query row (the splits', then the groups' where there are several)."""
    size, groups = merge_groups(num_splits)
    return dict(GS=size, NG=groups, TOT=num_splits + (groups if groups > 1 else 0))


def workspace(batch: int, q_heads: int, kv_heads: int, num_splits: int, device, head_dim: int = 128) -> dict:
    """Buffers of one batch layout: with splits, the slots of :func:`_finish` (fp32 ``part``
    ``[batch, q_heads, slots, head_dim]``, ``lse`` ``[batch, q_heads, slots]``: one per split, then one per merge
    group when there are several) and its zeroed int32 arrival counters: one per (request, KV head), groups + 1 with
    several groups (every launch leaves them at 0 again)."""
    if num_splits == 1:
        return {}
    merge = merge_constants(num_splits)
    return dict(part=torch.empty(batch, q_heads, merge["TOT"], head_dim, dtype=torch.float32, device=device),
                lse=torch.empty(batch, q_heads, merge["TOT"], dtype=torch.float32, device=device),
                counters=torch.zeros(batch * kv_heads * (merge["NG"] + 1 if merge["NG"] > 1 else 1), dtype=torch.int32,
                                     device=device))


def launch(q, cache, indptr, indices, last_page_len, launches, num_splits: int, qk_scale: float,
           out: torch.Tensor, ws: dict, slots: int, maxnreg: int = 0) -> torch.Tensor:
    """Launch the pipelined kernel for ``launches`` -- one ``(kind, routed)`` with ``kind`` a page kind of
    :mod:`zipkv.paged` (MIXED: any page) -- into ``out``; it merges its own splits. ``slots``: ring slots;
    ``ws``: :func:`workspace`; ``maxnreg``: a register cap per thread (0: the compiler's choice). No host sync; inputs are checked by
    :func:`zipkv.kernels.decode_attention.plan`."""
    (kind, _), = launches
    B, HQ, _ = q.shape
    HKV = cache.kv_heads
    part, lse, counters = (ws.get(name, out) for name in ("part", "lse", "counters"))
    _pipelined_kernel[(B, HKV, num_splits)](
        q, cache.pool, cache.desc, indptr, indices, last_page_len, part, lse, out, counters, qk_scale,
        HKV=HKV, G=HQ // HKV, SPLITS=num_splits, **merge_constants(num_splits), KIND=kind, SLOTS=slots, HD=cache.head_dim,
        NQ=query_columns(HQ // HKV), num_warps=1,
        **({"maxnreg": maxnreg} if maxnreg else {}))
    return out
