"""Every block compressible: ZipFusion's 12-bit block plus a per-page list of rare exponents (beyond §III-B).

ZipFusion (§III-B, :mod:`zipkv.format`) stores a 512-value block in 12 bits per value only when every BF16
exponent of the block lies in an 8-pair window ``[b, b + 15]``; any other block stays raw (16 bits). On real KV
the blocks that do not fit are almost all *nearly* fitting: a few values, mostly tiny ones (exact zeros among
them), lie below the window. This format stores **every** block in ZipFusion's compressed byte layout and lists
those few values on the side.

Block (unchanged from :mod:`zipkv.format`)
------------------------------------------
A compressed block is the 768 bytes :func:`zipkv.format.pack` writes -- 512 low bytes (``e & 1`` and the 7
fraction bits) and 256 code bytes, code ``c = s << 3 | (e >> 1) - b/2`` -- for a base ``b`` (even) that is no
longer the block's lowest exponent but the bottom of the window the block's values are coded in:

* a block whose exponents fit ``[b, b + 15]`` (ZipFusion's eligible block) keeps ZipFusion's base, the lowest
  exponent rounded down to even, and lists nothing: its bytes are ZipFusion's;
* any other block is anchored at its **top**: ``b/2 = max(e >> 1) - 7`` (the window holds the 8 largest exponent
  pairs); every value with ``e >> 1 < b/2`` is an *escape*: its code is ``s << 3`` (sign kept, offset 0) and its
  exponent goes to the page's escape list. Values above the window cannot occur (the anchor is the top);
* *zero mode*, chosen per block where it lists fewer escapes: the window holds the 7 largest pairs (``b/2 = max(e >>
  1) - 6``, or the lowest non-zero pair where nothing else falls below) and code offset 7 names exponent pair 0
  (exact zeros, subnormals, exponent 1), which real keys hold many of (Gemma-3's keys: whole channels of zeros).
  A zero-mode block's base is at most 240, so ``b/2 + 7 <= 127`` still never carries.

So the decode of a block is ZipFusion's, bit for bit (one 32-bit add of ``(b/2) * 0x01010101`` restores four high
bytes; ``b/2 + 7 <= 127``: no carry); a zero-mode block then clears the exponent of every value that decoded to
pair ``b/2 + 7``, and the listed values are patched. A page without
escapes is byte for byte :func:`zipkv.format.pack`'s page.

Escape list (one fixed-size area per page-head)
-----------------------------------------------
Each page-head (16 tokens x head_dim of one KV head, keys or values: ``n_blocks = 16 * head_dim / 512`` blocks)
owns ``capacity`` 16-bit entries, an int16 tensor ``[..., capacity]`` beside the payload (not in the byte pool, so
blocks keep their 256-byte alignment). An entry is ``p << 7 | e >> 1`` (``p`` = the value's position in its block,
0..511, in the block arrangement of :mod:`zipkv.format`; ``e >> 1`` its upper 7 exponent bits; the sign is in the
code, ``e & 1`` in the low byte). Entries are block-major (block 0's first), positions ascending inside a block;
block ``j``'s entries are ``[start_j, start_j + count_j)`` with ``start_j = count_0 + ... + count_{j-1}``
(``EscapeMeta.count``, one byte per block). Unused entries hold ``-1`` (0xFFFF: ``e >> 1 = 127`` lies above every
window, so no escape has it).

List sized per page (``capacity=PAGE``): each page-head's list holds exactly its escapes, so no block overflows
(only a block with more than :data:`MAX_BLOCK_ESCAPES` escapes is stored raw) and a page-head stores ``2 * count``
list bytes. In a byte pool the list then needs a home of variable size: :mod:`zipkv.memory` puts every page-head's
list of one page (all KV heads, keys then values) after the page's last page-head, rounded up to the pool's 256-byte
units; :func:`survey` measures the list at its exact size (``capacity`` -1 in its table).

Overflow rule: when a page-head's escapes exceed ``capacity``, its blocks with the most escapes (ties: the lower
block index first) are stored raw -- ZipFusion's 1024-byte raw block, flag 0, count 0 -- one at a time until the
rest fit. A raw block is plain bf16, so nothing is lost. :func:`survey` measures how often it happens.

Metadata per block (:class:`EscapeMeta`): ``compressed`` and ``base`` as in :class:`zipkv.format.PageMeta` (the
kernels' byte ``flag << 7 | b >> 1``), a second byte ``zero << 7 | count`` (zero mode, escapes 0..127; a block with
more is stored raw; 0 for raw blocks), and a check byte. In the paged cache
the count fits a descriptor for free: a block address is a multiple of 256, so bits 8..15 of
``address << 8 | meta byte`` are zero and can hold it.

Intended read pattern of a fused decode kernel
----------------------------------------------
The kernel reads compressed blocks exactly as today (a thread owns 8 or 16 consecutive positions of a block: 8
low bytes and 4 code bytes, or the mma layouts' 16-byte runs) and rebuilds its values in registers. Then, where
the block's count is not zero (one branch, uniform over the warp), every thread of the warp reads the block's
``count`` entries -- the same addresses for all threads, one broadcast load per entry, ``start_j`` from the counts
of the blocks before (at most 7 adds) -- and the thread whose positions contain ``p`` replaces that value's high
byte's low 7 bits by ``e >> 1`` (compare ``p`` against its run, select the register). No restore pass, no shared
memory needed; the cost is ``count`` broadcast loads and compares per warp and block (measured on real KV: a few
tenths of an entry per block on average, see :func:`survey`). A kernel that rebuilds values with a fixed exponent
base (the block's values times ``2**(128 - b)``, undone per token) must patch escapes the same way: an escape lies
below the window, so its scaled exponent ``e - b + 128`` is below 128; where it would fall below 1 (``e < b - 127``,
or ``e = 0``: zeros and subnormals) the scaled value is no longer the exact ``x * 2**(128 - b)`` in bf16 and the
kernel computes it in fp32 (zero stays zero, sign included).

Validation and corruption
-------------------------
:func:`pack` gives each block a check byte: CRC-8/AUTOSAR (as :func:`zipkv.format.meta_check`) of the bytes
``0x45, layout index, head_dim // 32, j, meta byte, second byte``: any change of a block's flag, base, zero mode or
count alone is
caught, and so is metadata of another layout or head_dim. ``unpack(..., validate=True)`` (the default) also checks
the list: counts that sum past ``capacity`` or sit on raw blocks, unused entries that are not ``-1``, positions not
strictly ascending inside a block, an entry whose exponent lies inside its block's window (the packer never lists
one), and an entry whose value does not have code offset 0 (the packer's placeholder); each a ``ValueError``
naming the page, block and entry. The low bytes and codes, and an entry changed to another value that passes these
checks, are payload: as in :mod:`zipkv.format`, only checksums find them (:func:`zipkv.format.page_checksum` of the
payload and of ``escapes.view(torch.uint8)``).
"""
from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass

import torch

from zipkv import format as fmt

__all__ = ["PER_BLOCK", "PAGE", "PAGE_CAPACITY", "MAX_BLOCK_ESCAPES", "pack_slots", "read_lists", "list_descriptors", "meta_check", "check_meta", "UNUSED", "EscapeMeta", "escape_counts",
           "pack", "unpack", "survey", "CANDIDATES",
           "ANCHORS"]

UNUSED = -1
"""An unused escape entry (0xFFFF as uint16)."""
PER_BLOCK = 1
"""Default escape entries per block of a page-head: ``capacity = PER_BLOCK * n_blocks`` (0.03125 bits per value;
:func:`survey` measures the overflow it leaves)."""
PAGE = "page"
"""``capacity=PAGE``: the list sized per page-head, exactly its escapes (module docstring, "List sized per page")."""
PAGE_CAPACITY = -1
""":func:`survey`'s ``capacity`` of the rows with the list sized per page (:data:`PAGE`)."""
MAX_CAPACITY = 127 * 8
MAX_BLOCK_ESCAPES = 127
"""Escapes one block may list (7 bits of its second metadata byte); a block with more is stored raw."""
_WINDOW_PAIRS = 8                     # exponent pairs a 3-bit code offset names
_TAG = 0x45                           # first byte of every check-byte CRC: this format, not zipkv.format's


# ----------------------------------------------------------------------------- checks

def _check_capacity(capacity, name="capacity"):
    if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral):
        raise TypeError(f"{name} must be an int (escape entries per page-head) or {PAGE!r} (the list sized per "
                        f"page-head), got {type(capacity).__name__} {capacity!r}")
    if not 0 <= capacity <= MAX_CAPACITY:
        raise ValueError(f"{name} must be in 0..{MAX_CAPACITY} (escape entries per page-head), got {capacity}")
    return int(capacity)


def _exponents(blocks: torch.Tensor) -> torch.Tensor:
    """int32 exponent field of bf16 blocks (any shape)."""
    return (blocks.contiguous().view(torch.int16).to(torch.int32) >> 7) & 0xFF


def _as_int16(x: torch.Tensor) -> torch.Tensor:
    """int32 values in 0..65535 as the int16 with the same 16 bits."""
    return torch.where(x >= 1 << 15, x - (1 << 16), x).to(torch.int16)


def _block_plan(pages: torch.Tensor, layout: str):
    """The format's choices per block (module docstring): blocks int16 ``[..., nb, 512]``, base uint8 ``[..., nb]``
    (even), zero-mode bool ``[..., nb]``, escape mask and zero mask bool ``[..., nb, 512]`` (the values a zero-mode
    block codes as exponent pair 0)."""
    blocks = fmt.to_blocks(pages, layout).contiguous().view(torch.int16)
    pair = (blocks.to(torch.int32) >> 8) & 0x7F
    lo, hi = pair.amin(-1), pair.amax(-1)
    b8 = torch.where(hi - lo < _WINDOW_PAIRS, lo, hi - (_WINDOW_PAIRS - 1))
    esc8 = pair < b8[..., None]
    is_zero = pair == 0
    esc7 = ~is_zero & (pair < (hi - (_WINDOW_PAIRS - 2))[..., None])
    lo_nz = torch.where(is_zero, 127, pair).amin(-1)
    b7 = torch.where(esc7.any(-1), hi - (_WINDOW_PAIRS - 2), lo_nz)
    zero = (esc7.sum(-1) < esc8.sum(-1)) & (hi <= 126) & (b7 <= 127 - _WINDOW_PAIRS)
    b2 = torch.where(zero, b7, b8)
    esc = torch.where(zero[..., None], esc7, esc8)
    return blocks, (2 * b2).to(torch.uint8), zero, esc, zero[..., None] & is_zero


# ----------------------------------------------------------------------------- metadata

@dataclass(frozen=True)
class EscapeMeta:
    """Per-block metadata of escape-format pages (module docstring).

    compressed: bool ``[..., n_blocks]``; base: uint8 ``[..., n_blocks]`` (even, the window's bottom exponent; 0 for
    raw blocks); count: uint8 ``[..., n_blocks]`` escape entries of each block (0..127; 0 for raw blocks); zero: bool
    ``[..., n_blocks]``, the block's code offset 7 names exponent pair 0 (False for raw blocks); capacity: entries per
    page-head; check: uint8 ``[..., n_blocks]`` check bytes or None (structural checks only).
    """
    layout: str
    head_dim: int
    capacity: int
    compressed: torch.Tensor
    base: torch.Tensor
    count: torch.Tensor
    zero: torch.Tensor
    check: torch.Tensor | None = None
    per_page: bool = False

    @property
    def n_blocks(self) -> int:
        return fmt.n_blocks(self.head_dim)

    def page_meta(self) -> fmt.PageMeta:
        """The blocks' flags and bases as :class:`zipkv.format.PageMeta` (no check bytes)."""
        return fmt.PageMeta(self.layout, self.head_dim, self.compressed, self.base)

    @property
    def nbytes(self) -> torch.Tensor:
        """int64 ``[...]``: bytes each page-head stores: its blocks (the used prefix of its slot) and its escape
        area (``2 * capacity``; a list sized per page: ``2 *`` its own entries), metadata excluded."""
        if self.per_page:
            return self.page_meta().nbytes + 2 * self.count.sum(-1, dtype=torch.int64)
        return self.page_meta().nbytes + 2 * self.capacity

    def second_byte(self) -> torch.Tensor:
        """uint8 ``[..., n_blocks]``: ``zero << 7 | count``, the byte a descriptor carries beside the kernels' byte."""
        return (self.zero.to(torch.uint8) << 7) | self.count

    def start(self) -> torch.Tensor:
        """int64 ``[..., n_blocks]``: index of each block's first escape entry."""
        c = self.count.to(torch.int64)
        return torch.cumsum(c, -1) - c

    def sealed(self) -> "EscapeMeta":
        """This metadata with its check bytes computed from its flags, bases and counts."""
        _check_structure(self)
        return EscapeMeta(self.layout, self.head_dim, self.capacity, self.compressed, self.base, self.count, self.zero,
                          meta_check(self.page_meta().packed(), self.second_byte(), self.layout, self.head_dim),
                          self.per_page)

    def __getitem__(self, idx) -> "EscapeMeta":
        """Select page-heads (indexing the leading dims)."""
        return EscapeMeta(self.layout, self.head_dim, self.capacity, self.compressed[idx], self.base[idx],
                          self.count[idx], self.zero[idx], None if self.check is None else self.check[idx],
                          self.per_page)


@functools.lru_cache(maxsize=1)
def _crc8_table() -> torch.Tensor:
    t = []
    for x in range(256):
        crc = x
        for _ in range(8):
            crc = ((crc << 1) ^ 0x2F) & 0xFF if crc & 0x80 else (crc << 1) & 0xFF
        t.append(crc)
    return torch.tensor(t, dtype=torch.int64)


def meta_check(packed: torch.Tensor, count: torch.Tensor, layout: str, head_dim: int) -> torch.Tensor:
    """Check bytes uint8 ``[..., n_blocks]`` of metadata bytes ``packed`` (``flag << 7 | b >> 1``) and second bytes
    ``count`` (``zero << 7 | count``, :meth:`EscapeMeta.second_byte`; both uint8 ``[..., n_blocks]``): CRC-8/AUTOSAR
    of ``0x45, layout index, head_dim // 32, j, packed, count`` (module docstring)."""
    fmt._check_layout_head_dim(fmt._check_layout(layout), fmt._check_head_dim(head_dim))
    nb = fmt.n_blocks(head_dim)
    for name, t in (("packed", packed), ("count", count)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() < 1 or t.shape[-1] != nb:
            raise ValueError(f"{name} must be a uint8 tensor [..., {nb}] (head_dim {head_dim}), got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    table = _crc8_table().to(packed.device)
    j = torch.arange(nb, device=packed.device).expand(packed.shape)
    crc = torch.full(packed.shape, 0xFF, dtype=torch.int64, device=packed.device)
    for byte in (_TAG, fmt.LAYOUTS.index(layout), head_dim // 32, j, packed.long(), count.long()):
        crc = table[crc ^ byte]
    return (crc ^ 0xFF).to(torch.uint8)


def _check_structure(meta: EscapeMeta, name: str = "meta") -> None:
    if not isinstance(meta, EscapeMeta):
        raise TypeError(f"{name} must be an EscapeMeta, got {type(meta).__name__}")
    fmt._check_meta_structure(meta.page_meta(), name)
    _check_capacity(meta.capacity, f"{name}.capacity")
    if not isinstance(meta.per_page, bool):
        raise TypeError(f"{name}.per_page must be a bool, got {type(meta.per_page).__name__}")
    if not isinstance(meta.count, torch.Tensor) or meta.count.dtype != torch.uint8 \
            or meta.count.shape != meta.compressed.shape:
        raise TypeError(f"{name}.count must be a uint8 tensor of shape {tuple(meta.compressed.shape)}, got "
                        f"{getattr(meta.count, 'dtype', type(meta.count).__name__)} "
                        f"{tuple(getattr(meta.count, 'shape', ()))}")
    if not isinstance(meta.zero, torch.Tensor) or meta.zero.dtype != torch.bool \
            or meta.zero.shape != meta.compressed.shape:
        raise TypeError(f"{name}.zero must be a bool tensor of shape {tuple(meta.compressed.shape)}, got "
                        f"{getattr(meta.zero, 'dtype', type(meta.zero).__name__)} "
                        f"{tuple(getattr(meta.zero, 'shape', ()))}")
    if meta.check is not None and (not isinstance(meta.check, torch.Tensor) or meta.check.dtype != torch.uint8
                                   or meta.check.shape != meta.compressed.shape):
        raise ValueError(f"{name}.check must be None or a uint8 tensor of shape {tuple(meta.compressed.shape)}, got "
                         f"{getattr(meta.check, 'dtype', type(meta.check).__name__)} "
                         f"{tuple(getattr(meta.check, 'shape', ()))}")


def check_meta(meta: EscapeMeta, name: str = "meta") -> None:
    """The metadata checks of :func:`unpack`: structure, even bases, check bytes (where given), counts on raw blocks
    and counts past the capacity. ``ValueError``/``TypeError`` naming the page and block."""
    _check_structure(meta, name)
    fmt._check_bases(meta.page_meta(), name)
    if meta.check is not None:
        bad = meta_check(meta.page_meta().packed(), meta.second_byte(), meta.layout, meta.head_dim) != meta.check
        if bool(bad.any()):
            at = fmt._where(bad)
            raise ValueError(f"{name}: page {at[:-1]}, block {at[-1]}: flag {bool(meta.compressed[at])}, base "
                             f"{int(meta.base[at])}, count {int(meta.count[at])} and zero mode {bool(meta.zero[at])} "
                             f"do not match its check byte "
                             f"{int(meta.check[at]):#04x} (layout {meta.layout!r}, head_dim {meta.head_dim}): the "
                             "metadata is corrupted or for another layout")
    raw_count = ~meta.compressed & ((meta.count != 0) | meta.zero)
    if bool(raw_count.any()):
        at = fmt._where(raw_count)
        raise ValueError(f"{name}.count: raw block {at} has {int(meta.count[at])} escapes and zero mode "
                         f"{bool(meta.zero[at])}; a raw block has neither")
    big = meta.count > MAX_BLOCK_ESCAPES
    if bool(big.any()):
        at = fmt._where(big)
        raise ValueError(f"{name}.count: block {at} has {int(meta.count[at])} escapes; a block lists at most "
                         f"{MAX_BLOCK_ESCAPES} (more: it is stored raw)")
    high = meta.zero & (meta.base > 2 * (127 - _WINDOW_PAIRS))
    if bool(high.any()):
        at = fmt._where(high)
        raise ValueError(f"{name}.base: zero-mode block {at} has base {int(meta.base[at])}; a zero-mode block's base "
                         f"is at most {2 * (127 - _WINDOW_PAIRS)} (its code offset 7 must not reach the sign bit)")
    total = meta.count.sum(-1, dtype=torch.int64)
    over = total > meta.capacity
    if bool(over.any()):
        at = fmt._where(over)
        raise ValueError(f"{name}.count: page {at} lists {int(total[at])} escapes, more than its capacity "
                         f"{meta.capacity}")


# ----------------------------------------------------------------------------- pack / unpack

def escape_counts(pages: torch.Tensor, layout: str = "token") -> torch.Tensor:
    """Escapes each block needs in this format, before any overflow: int64 ``[..., n_blocks]`` for ``pages``
    ``[..., 16, head_dim]`` bf16 (0 for ZipFusion's eligible blocks)."""
    d = fmt._check_pages(pages)
    fmt._check_layout_head_dim(fmt._check_layout(layout), d)
    return _block_plan(pages, layout)[3].sum(-1)


def _overflow_raw(count: torch.Tensor, capacity: int) -> torch.Tensor:
    """bool ``[..., nb]``: the blocks the overflow rule stores raw (most escapes first, ties: lower index; a block
    with more than :data:`MAX_BLOCK_ESCAPES` always)."""
    nb = count.shape[-1]
    count = torch.where(count > MAX_BLOCK_ESCAPES, 1 << 20, count)
    j = torch.arange(nb, device=count.device)
    order = torch.argsort(count * (nb + 1) + (nb - j), dim=-1, descending=True)    # most escapes, then lower j
    ranked = count.gather(-1, order)
    left = count.sum(-1, keepdim=True) - (torch.cumsum(ranked, -1) - ranked)       # escapes left before dropping r
    drop_ranked = left > capacity
    return torch.zeros_like(drop_ranked).scatter(-1, order, drop_ranked)


def pack(pages: torch.Tensor, layout: str = "token", *, capacity: int | None = None):
    """Compress pages into the escape format (module docstring).

    pages: ``[..., 16, head_dim]`` bf16; layout: one of :data:`zipkv.format.LAYOUTS`; capacity: escape entries per
    page-head (None: ``PER_BLOCK * n_blocks``), or :data:`PAGE`: the list sized per page-head (no overflow: only a
    block with more than :data:`MAX_BLOCK_ESCAPES` escapes is stored raw; the tensor is as wide as the widest
    page-head's list, ``meta.per_page`` set and ``meta.nbytes`` counting each page-head's own entries). Returns ``(payload, escapes, meta)``: payload uint8
    ``[..., 32 * head_dim]`` (the slot as
    :func:`zipkv.format.pack` lays it out), escapes int16 ``[..., capacity]``, and an :class:`EscapeMeta`.
    """
    d = fmt._check_pages(pages)
    fmt._check_layout_head_dim(fmt._check_layout(layout), d)
    nb = fmt.n_blocks(d)
    per_page = isinstance(capacity, str) and capacity == PAGE
    capacity = (PER_BLOCK * nb if capacity is None else nb * MAX_BLOCK_ESCAPES if per_page
                else _check_capacity(capacity))
    lead = pages.shape[:-2]
    blocks, base, zero, esc, zeros = _block_plan(pages, layout)
    raw = _overflow_raw(esc.sum(-1), capacity)
    if per_page:                      # the list as long as the page-head needs: the widest page-head's entries
        kept = (esc.sum(-1) * ~raw).sum(-1)
        capacity = int(kept.max()) if kept.numel() else 0
    esc, zeros, zero = esc & ~raw[..., None], zeros & ~raw[..., None], zero & ~raw
    # escaped values take the window's bottom pair (code offset 0), a zero-mode block's pair-0 values its pair + 7
    # (code offset 7), sign and low byte kept (0x80FF): ZipFusion's pack then writes exactly these codes
    keep = blocks & -0x7F01
    subst = torch.where(esc, keep | (base.to(torch.int16) << 7)[..., None], blocks)
    subst = torch.where(zeros, keep | ((base.to(torch.int16) + 2 * (_WINDOW_PAIRS - 1)) << 7)[..., None], subst)
    subst = subst.view(torch.bfloat16)
    payload, zmeta = fmt.pack(fmt.from_blocks(subst, layout, d), layout, enable=~raw)
    count = esc.sum(-1)
    # entries: block-major, positions ascending; sort key puts escapes first in that order
    pos = torch.arange(fmt.BLOCK_VALUES, device=pages.device)
    entry = (pos << 7) | ((blocks.to(torch.int32) >> 8) & 0x7F)                    # [..., nb, 512]
    key = torch.where(esc, torch.arange(nb * fmt.BLOCK_VALUES, device=pages.device).reshape(nb, -1), 1 << 30)
    key, idx = key.reshape(*lead, -1).sort(-1)
    width = min(capacity, nb * fmt.BLOCK_VALUES)
    entries = entry.reshape(*lead, -1).gather(-1, idx[..., :width])
    entries = torch.where(key[..., :width] < (1 << 30), entries, 0xFFFF)
    escapes = torch.full((*lead, capacity), UNUSED, dtype=torch.int16, device=pages.device)
    escapes[..., :width] = _as_int16(entries)
    meta = EscapeMeta(layout, d, capacity, zmeta.compressed, zmeta.base, count.to(torch.uint8), zero,
                      per_page=per_page).sealed()
    return payload, escapes, meta


def _entries_of(escapes: torch.Tensor, meta: EscapeMeta):
    """(entries int32 ``[..., K]`` as uint16, block int64 ``[..., K]`` (-1 unused), used bool ``[..., K]``)."""
    e = escapes.to(torch.int32) & 0xFFFF
    k = torch.arange(meta.capacity, device=escapes.device)
    start = meta.start()
    ends = start + meta.count.to(torch.int64)
    total = ends[..., -1:] if meta.n_blocks else torch.zeros_like(k)
    used = k < total
    block = (k[..., None] >= ends[..., None, :]).sum(-1)                            # blocks ending at or before k
    return e, torch.where(used, block, -1), used


def _check_escapes(escapes, meta: EscapeMeta, name: str = "escapes") -> None:
    lead = meta.compressed.shape[:-1]
    if not isinstance(escapes, torch.Tensor) or escapes.dtype != torch.int16 \
            or escapes.shape != (*lead, meta.capacity):
        raise ValueError(f"{name} must be an int16 tensor of shape {(*lead, meta.capacity)} (meta.capacity entries "
                         f"per page-head), got {getattr(escapes, 'dtype', type(escapes).__name__)} "
                         f"{tuple(getattr(escapes, 'shape', ()))}")


def _check_list(e, block, used, meta: EscapeMeta, decoded_blocks: torch.Tensor, name: str) -> None:
    """The list's checks against the metadata and the decoded (unpatched) blocks (module docstring)."""
    stale = ~used & (e != 0xFFFF)
    if bool(stale.any()):
        at = fmt._where(stale)
        raise ValueError(f"{name}: page {at[:-1]}, entry {at[-1]} is {e[at]:#06x} past the "
                         f"{int(meta.count[at[:-1]].sum())} "
                         "escapes the metadata counts; unused entries hold -1 (0xFFFF): the list or the counts are "
                         "corrupted")
    pos, pair = e >> 7, e & 0x7F
    order = torch.zeros_like(used)
    order[..., 1:] = used[..., 1:] & (block[..., 1:] == block[..., :-1]) & (pos[..., 1:] <= pos[..., :-1])
    if bool(order.any()):
        at = fmt._where(order)
        raise ValueError(f"{name}: page {at[:-1]}, entry {at[-1]}: position {int(pos[at])} does not follow the "
                         "previous entry's of its block (positions ascend strictly): the list is corrupted")
    b2 = meta.base.to(torch.int32).gather(-1, block.clamp(min=0)) >> 1
    inside = used & ((pair >= b2) | (meta.zero.gather(-1, block.clamp(min=0)) & (pair == 0)))
    if bool(inside.any()):
        at = fmt._where(inside)
        raise ValueError(f"{name}: page {at[:-1]}, entry {at[-1]} (block {int(block[at])}, position {int(pos[at])}) "
                         f"names exponent pair {int(pair[at])}, which its block codes (base {2 * int(b2[at])}, zero "
                         f"mode {bool(meta.zero.gather(-1, block.clamp(min=0))[at])}); "
                         "an escape lies below the window: the list or the base is corrupted")
    flat = decoded_blocks.reshape(*decoded_blocks.shape[:-2], -1)
    got = (flat.to(torch.int32).gather(-1, (block.clamp(min=0) * fmt.BLOCK_VALUES + pos)) >> 8) & 0x7F
    placeholder = used & (got != b2)
    if bool(placeholder.any()):
        at = fmt._where(placeholder)
        raise ValueError(f"{name}: page {at[:-1]}, entry {at[-1]}: the value at block {int(block[at])}, position "
                         f"{int(pos[at])} does not hold the escape placeholder (code offset 0): the position, the "
                         "codes or the base are corrupted")


def unpack(payload: torch.Tensor, escapes: torch.Tensor, meta: EscapeMeta, *, validate: bool = True) -> torch.Tensor:
    """Inverse of :func:`pack`, bit-exact: ``(payload uint8 [..., L], escapes int16 [..., capacity], meta)`` ->
    pages ``[..., 16, head_dim]`` bf16. validate: the metadata and list checks of the module docstring first
    (``ValueError`` naming page, block and entry); ``validate=False`` checks types and shapes only."""
    if validate:
        check_meta(meta)
    else:
        _check_structure(meta)
    _check_escapes(escapes, meta)
    d = meta.head_dim
    pages = fmt.unpack(payload, meta.page_meta(), validate=validate)
    blocks = fmt.to_blocks(pages, meta.layout).contiguous().view(torch.int16)
    marker = ((meta.base.to(torch.int32) >> 1) + _WINDOW_PAIRS - 1)[..., None]      # a zero-mode block's offset 7
    to_zero = meta.zero[..., None] & (((blocks.to(torch.int32) >> 8) & 0x7F) == marker)
    blocks = torch.where(to_zero, blocks & -0x7F01, blocks)
    e, block, used = _entries_of(escapes, meta)
    if validate:
        _check_list(e, block, used, meta, blocks, "escapes")
    lead = blocks.shape[:-2]
    flat = blocks.reshape(*lead, -1).clone()
    idx = torch.where(used, block * fmt.BLOCK_VALUES + (e >> 7), flat.shape[-1])       # unused: a trash slot
    flat = torch.cat([flat, flat.new_zeros(*lead, 1)], -1)
    old = flat.to(torch.int32).gather(-1, idx)
    new = (old & 0x80FF) | ((e & 0x7F) << 8)
    flat.scatter_(-1, idx, _as_int16(new))
    out = flat[..., :-1].reshape(blocks.shape).view(torch.bfloat16)
    return fmt.from_blocks(out, meta.layout, d)


# ----------------------------------------------------------------------------- layouts measured on real KV

CANDIDATES = {
    # name: (what a 4-bit code names, bits per escape entry)
    "escape": ("ZipFusion's code (sign + 8 exponent pairs); escapes listed by position + upper 7 exponent bits", 16),
    "escape+zero": ("the escape layout; a block may instead code 7 pairs and exponent pair 0 (zeros, subnormals), "
                    "whichever lists fewer escapes", 16),
    "exp15": ("sign kept with the fraction; 15 exponents and one escape code; position + exponent listed", 24),
    "exp14+zero": ("sign kept with the fraction; 14 exponents, a code for exponent 0, one escape code", 24),
}
"""The block layouts :func:`survey` compares (beside ZipFusion's own): what the code names, and the bits of one
escape entry (a 9-bit position and the exponent bits the code does not give, rounded up to whole bytes)."""
ANCHORS = ("top", "min", "best")
"""Where a block's window sits: at its largest exponent, at its smallest, or where it holds the most values."""
META_BITS = 16
"""Metadata bits per block of the escape layouts (flag and base byte, count byte); ZipFusion's: 8."""


def _block_histograms(x: torch.Tensor, layout: str) -> torch.Tensor:
    """int64 ``[n_blocks_total, 256]``: exponent counts of each 512-value block of a ``[heads, T, head_dim]`` bf16
    cache (full 16-token pages; a partial last page is left out, as the paged cache keeps it raw)."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 3:
        raise TypeError(f"keys and values must be bf16 tensors [kv_heads, T, head_dim], got "
                        f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    h, t, d = x.shape
    t = t // fmt.PAGE_TOKENS * fmt.PAGE_TOKENS
    pages = x[:, :t].reshape(h, t // fmt.PAGE_TOKENS, fmt.PAGE_TOKENS, d)
    e = _exponents(fmt.to_blocks(pages, layout)).reshape(-1, fmt.BLOCK_VALUES).long()
    out = torch.zeros(e.shape[0], 256, dtype=torch.int64, device=e.device)
    return out.scatter_add_(1, e, torch.ones_like(e)).cpu()


def _window_escapes(hist: torch.Tensor, candidate: str, anchor: str) -> torch.Tensor:
    """int64 ``[n]``: escapes of each block (exponent histogram ``hist`` ``[n, 256]``) under a candidate layout."""
    n = hist.shape[0]
    if candidate == "escape+zero":
        esc8, esc7 = _window_escapes(hist, "escape", anchor), _window_escapes(hist, "pair7+zero", anchor)
        if anchor == "top":             # the format's rule (_block_plan): zero mode needs room below the sign bit
            pairs = hist[:, 0::2] + hist[:, 1::2]
            idx = torch.arange(pairs.shape[1])
            top = torch.where(pairs > 0, idx, -1).amax(1)
            low_nz = torch.where((pairs > 0) & (idx > 0), idx, 127).amin(1)
            base = torch.where(esc7 > 0, top - (_WINDOW_PAIRS - 2), low_nz)
            esc7 = torch.where((top <= 126) & (base <= 127 - _WINDOW_PAIRS), esc7, esc8)
        return torch.minimum(esc8, esc7)
    if candidate in ("escape", "pair7+zero"):
        hist, width = hist[:, 0::2] + hist[:, 1::2], _WINDOW_PAIRS      # exponent pairs
    else:
        width = 15 if candidate == "exp15" else 14
    if candidate == "pair7+zero":
        width = _WINDOW_PAIRS - 1
    bins = hist.shape[1]
    idx = torch.arange(bins)
    present = hist > 0
    top = torch.where(present, idx, -1).amax(1)
    bottom = torch.where(present, idx, bins).amin(1)
    cum = torch.cat([torch.zeros(n, 1, dtype=torch.int64), hist.cumsum(1)], 1)
    zero = hist[:, 0] if candidate in ("exp14+zero", "pair7+zero") else torch.zeros(n, dtype=torch.int64)

    def held(lo):                       # values a window starting at lo holds (plus exponent 0 where it has a code)
        lo = lo.clamp(0, bins)
        hi = (lo + width).clamp(max=bins)
        inside = cum.gather(1, hi[:, None])[:, 0] - cum.gather(1, lo[:, None])[:, 0]
        return inside + torch.where(lo > 0, zero, 0)

    if anchor == "top":
        kept = held(top - width + 1)
        if candidate == "escape":       # the format: a block that fits keeps ZipFusion's base
            kept = torch.where(top - bottom < width, hist.sum(1), kept)
    elif anchor == "min":
        if candidate in ("exp14+zero", "pair7+zero"):
            bottom = torch.where(present & (idx > 0), idx, bins).amin(1)
        kept = held(bottom)
    else:
        hi = (idx + width).clamp(max=bins)
        windows = cum[:, hi] - cum[:, :-1] + torch.where(idx > 0, zero[:, None], 0)     # [n, bins]: start at w
        kept = windows.amax(1)
    return hist.sum(1) - kept


def _fixed_area(count: torch.Tensor, capacity: int):
    """(raw bool ``[pages, nb]``, stored bits int64 ``[pages]``) of page-heads with escape counts ``count``
    ``[pages, nb]`` under the overflow rule with ``capacity`` entries per page-head (16 bits each)."""
    raw = _overflow_raw(count, capacity)
    nb = count.shape[-1]
    stored = 8 * (nb * fmt.PACKED_BLOCK_BYTES + 256 * raw.sum(-1) + 2 * capacity) + META_BITS * nb
    return raw, stored


def survey(captures, *, k_layout: str = "token", v_layout: str = "token", per_block=(1, 2, 4),
           model: str | None = None):
    """Bits per value and escapes per block of the candidate layouts on a captured KV cache.

    captures: a list of :class:`zipkv.models.Capture` (``layers[i].keys/values`` bf16 ``[kv_heads, T, head_dim]``);
    only full 16-token pages count. For each window, layer and tensor, one row per layout:

    * ``zipfusion``: the paper's format (§III-B): a block in 12 bits per value if its exponents fit the window,
      else raw; 8 metadata bits per block;
    * each of :data:`CANDIDATES` with each anchor of :data:`ANCHORS`, escape list unbounded (``capacity`` 0 in
      the table: every block compressed, the list as long as it needs);
    * this module's format (``escape+zero``, top anchor) with a fixed escape area of ``k * n_blocks`` entries per
      page-head for each ``k`` of ``per_block``, under the overflow rule (module docstring);
    * the same with the list sized per page (``capacity=PAGE``; :data:`PAGE_CAPACITY`, -1, in the table): each
      entry 16 bits, a block with more than :data:`MAX_BLOCK_ESCAPES` escapes raw.

    Columns: model, window, layer, tensor ("K"/"V"), block_layout, head_dim, layout, anchor, capacity, blocks, pages,
    escapes, escapes_max (per block), blocks_without (blocks with no escape), blocks_1, blocks_2, blocks_3_plus,
    raw_blocks, overflow_pages (page-heads with a raw block), bits (stored bits, metadata included), bits_per_value.
    Returns a ``pandas.DataFrame``.
    """
    import pandas as pd

    if not isinstance(captures, (list, tuple)) or not captures:
        raise TypeError(f"captures must be a non-empty list of zipkv.models.Capture, got {type(captures).__name__}")
    for name, lay in (("k_layout", k_layout), ("v_layout", v_layout)):
        fmt._check_layout(lay, name)
    for k in per_block:
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= MAX_BLOCK_ESCAPES:
            raise ValueError(f"per_block must hold ints in 1..{MAX_BLOCK_ESCAPES} (escape entries per block; the "
                             f"unbounded list is always measured), got "
                             f"{k!r}")
    groups, hists = [], {}                       # one histogram stack per head_dim (page-heads have nb blocks)
    for w, cap in enumerate(captures):
        if not hasattr(cap, "layers"):
            raise TypeError(f"captures[{w}] must be a zipkv.models.Capture, got {type(cap).__name__}")
        for layer, lc in enumerate(cap.layers):
            for tensor, x, lay in (("K", lc.keys, k_layout), ("V", lc.values, v_layout)):
                fmt._check_layout_head_dim(lay, x.shape[-1], "k_layout" if tensor == "K" else "v_layout")
                hist = _block_histograms(x, lay)
                if hist.shape[0]:
                    d = x.shape[-1]
                    hists.setdefault(d, []).append((len(groups), hist))
                    groups.append(dict(model=model, window=w, layer=layer, tensor=tensor, block_layout=lay,
                                       head_dim=d))
    rows = []
    for d, parts in hists.items():
        nb = fmt.n_blocks(d)
        hist = torch.cat([h for _, h in parts])
        gid = torch.cat([torch.full((h.shape[0],), g, dtype=torch.int64) for g, h in parts])
        page_gid = gid[::nb]
        ids = [g for g, _ in parts]

        def add(layout, anchor, capacity, esc, raw, bits):
            def per(x, index=gid):
                return torch.zeros(len(groups), dtype=torch.int64).index_add_(0, index, x.to(torch.int64))
            big = torch.zeros(len(groups), dtype=torch.int64).scatter_reduce_(0, gid, esc.to(torch.int64), "amax")
            cols = dict(blocks=per(torch.ones_like(gid)), pages=per(torch.ones_like(page_gid), page_gid),
                        escapes=per(esc), escapes_max=big, blocks_without=per(esc == 0), blocks_1=per(esc == 1),
                        blocks_2=per(esc == 2), blocks_3_plus=per(esc >= 3), raw_blocks=per(raw),
                        overflow_pages=per(raw.reshape(-1, nb).any(-1), page_gid), bits=per(bits, page_gid))
            for g in ids:
                r = dict(groups[g], layout=layout, anchor=anchor, capacity=capacity,
                         **{k: int(v[g]) for k, v in cols.items()})
                r["bits_per_value"] = r["bits"] / (r["blocks"] * fmt.BLOCK_VALUES)
                rows.append(r)

        top = _window_escapes(hist, "escape+zero", "top")
        fits = _window_escapes(hist, "escape", "top") == 0
        none = torch.zeros_like(top)
        add("zipfusion", "min", 0, none, ~fits,
            (8 * (fmt.PACKED_BLOCK_BYTES + 256 * (~fits).long()) + 8).reshape(-1, nb).sum(-1))
        for layout, (_, entry_bits) in CANDIDATES.items():
            for anchor in ANCHORS:
                esc = top if (layout, anchor) == ("escape+zero", "top") else _window_escapes(hist, layout, anchor)
                add(layout, anchor, 0, esc, torch.zeros_like(fits),
                    (12 * fmt.BLOCK_VALUES + entry_bits * esc + META_BITS).reshape(-1, nb).sum(-1))
        for capacity in [k * nb for k in per_block]:
            raw, bits = _fixed_area(top.reshape(-1, nb), capacity)
            add("escape+zero", "top", capacity, top.masked_fill(raw.reshape(-1), 0), raw.reshape(-1), bits)
        raw = top > MAX_BLOCK_ESCAPES                           # the list sized per page (capacity=PAGE): -1
        kept = top.masked_fill(raw, 0)
        add("escape+zero", "top", PAGE_CAPACITY, kept, raw,
            (8 * (fmt.PACKED_BLOCK_BYTES + 256 * raw.long() + 2 * kept) + META_BITS).reshape(-1, nb).sum(-1))
    order = ["model", "window", "layer", "tensor", "layout", "anchor", "capacity"]
    return pd.DataFrame(rows).sort_values(order, kind="stable", ignore_index=True)


# ----------------------------------------------------------------------------- pages in a byte pool

def list_descriptors(list_addr: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Escape descriptors int64 ``[..., n_blocks]`` of page-heads whose list (block-major, 2 bytes an entry) begins at
    byte ``list_addr`` int64 ``[...]`` of a pool, with second bytes ``second`` uint8 ``[..., n_blocks]``
    (``zero << 7 | count``, :meth:`EscapeMeta.second_byte`): ``entry_address << 8 | second``, ``entry_address`` the byte
    address of the block's first entry (every block has one, a block without escapes the address where its entries
    would begin): the descriptor a decode kernel loads beside :mod:`zipkv.paged`'s block descriptor."""
    count = (second & 0x7F).to(torch.int64)
    start = torch.cumsum(count, -1) - count
    return ((list_addr[..., None].to(torch.int64) + 2 * start) << 8) | second.to(torch.int64)


def pack_slots(pool: torch.Tensor, offsets: torch.Tensor, head_dim: int, layout: str):
    """Compress raw page-head slots of a byte pool in place in this format, the list sized per page (:data:`PAGE`):
    each slot's blocks as :func:`zipkv.format.pack` lays them out, then the page-head's list right after its blocks
    (block-major, 2 bytes an entry, little-endian; a slot always has room: a compressed block frees 256 bytes and lists
    at most 127 entries). The reference of the Triton escape pack kernel (:func:`zipkv.kernels.pack_escape.pack_into`).

    pool: uint8 ``[bytes]``; offsets: int64 ``[n]`` byte addresses of raw slots (a whole slot, ``32 * head_dim`` bytes,
    from each). Returns ``(packed, second)``: uint8 ``[n, n_blocks]`` each, the blocks' metadata byte ``flag << 7 |
    b >> 1`` and second byte ``zero << 7 | count``; each list begins at ``offset + blocks' bytes``
    (:func:`list_descriptors`)."""
    pb = fmt.page_bytes(head_dim)
    idx = offsets.to(torch.int64)[:, None] + torch.arange(pb, device=pool.device)
    stored = pool[idx].view(torch.bfloat16).reshape(-1, fmt.n_blocks(head_dim), fmt.BLOCK_VALUES)
    pages = fmt.from_blocks(fmt.from_raw(stored, layout), layout, head_dim)
    payload, escapes, meta = pack(pages, layout, capacity=PAGE)
    used = meta.page_meta().nbytes                                                   # [n] the blocks' bytes
    entries = escapes.contiguous().view(torch.uint8)                                 # [n, 2 * width]
    k = torch.arange(entries.shape[-1], device=pool.device)
    keep = k < 2 * meta.count.sum(-1, dtype=torch.int64)[:, None]
    rows = torch.arange(payload.shape[0], device=pool.device)[:, None].expand_as(keep)
    payload[rows[keep], (used[:, None] + k)[keep]] = entries[keep]
    pool[idx] = payload
    return meta.page_meta().packed(), meta.second_byte()


def read_lists(pool: torch.Tensor, esc: torch.Tensor):
    """The escape lists that descriptors ``esc`` int64 ``[..., n_blocks]`` (:func:`list_descriptors`) point at in
    ``pool``: ``(escapes int16 [..., width], count uint8 [..., n_blocks], zero bool [..., n_blocks])``, each
    page-head's entries in order and -1 past them, ``width`` the most any page-head lists (what :func:`unpack` takes
    with an :class:`EscapeMeta` of ``capacity=width``, ``per_page=True``)."""
    second = esc & 0xFF
    count = (second & 0x7F).to(torch.uint8)
    c = count.to(torch.int64)
    total = c.sum(-1)
    width = int(total.max()) if total.numel() else 0
    lead = esc.shape[:-1]
    if width == 0:
        return torch.full((*lead, 0), UNUSED, dtype=torch.int16, device=esc.device), count, (second >> 7).bool()
    ends = torch.cumsum(c, -1)
    k = torch.arange(width, device=esc.device)
    block = (k[..., None] >= ends[..., None, :]).sum(-1)                          # [..., width]
    used = k < total[..., None]
    block = block.clamp(max=esc.shape[-1] - 1)
    start = (ends - c).gather(-1, block)
    addr = (esc >> 8).gather(-1, block) + 2 * (k - start)
    addr = torch.where(used, addr, 0).clamp(0, pool.numel() - 2)
    lo, hi = pool[addr].to(torch.int32), pool[addr + 1].to(torch.int32)
    e = torch.where(used, lo | (hi << 8), 0xFFFF)
    return _as_int16(e), count, (second >> 7).bool()
