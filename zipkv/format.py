"""ZipFusion's lossless 12-bit BF16 block format, in plain torch (the reference).

ZipFusion §III-B (Fig. 2). A *page* holds 16 tokens of one KV head, ``[16, head_dim]``
bf16. It is split into ``n_blocks = 16 * head_dim / 512`` independently encoded
blocks of 512 values. A BF16 value has bits ``s eeeeeeee fffffff``:

* low byte  = ``e & 1`` (lowest exponent bit) ``<< 7 | fraction`` — kept as is;
* high byte = ``s << 7 | e >> 1`` — replaced by a 4-bit code.

A block is *compressed* iff all its exponents lie in ``[b, b + 15]`` with ``b`` = the
block's minimum exponent rounded down to even. Then every value's ``e >> 1`` lies in
``[b/2, b/2 + 7]`` and its code is ``c = s << 3 | (e >> 1) - b/2`` (0..15). The high byte
comes back as ``(c >> 3) << 7 | (b/2 + (c & 7))``: since ``b/2 + (c & 7) = e >> 1 <= 127`` the add
never carries into the sign bit (for ``b <= 240`` whatever the code; for ``b`` in 242..254, blocks
whose exponents all lie in ``[242, 255]``, with every code ``pack`` writes), so four high bytes are
restored by one 32-bit add of ``(b/2) * 0x01010101`` to a word holding ``(c >> 3) << 7 | (c & 7)``
in each byte. A compressed block's base is never odd.

Block arrangement (``layout``) — which page values form block ``j``, and in which order
(``p`` = position in the block, 0..511):

* ``"token"`` (token-major): block ``j`` = tokens ``[j*T, (j+1)*T)`` × all channels,
  ``T = 512 / head_dim``; ``p = (token - j*T) * head_dim + channel``.
* ``"channel"`` (channel-major): block ``j`` = all 16 tokens × channels
  ``[32j, 32j + 32)``; ``p = token * 32 + (channel - 32j)``.

In these two layouts 8 consecutive positions ``8m .. 8m+7`` are 8 consecutive channels of one
token.

Two more layouts, for ``head_dim`` 128 and 64, arrange a block for the tensor cores' operand
fragments (``mma.m16n8k16``, bf16) of the fused kernel's Gluon path
(:mod:`zipkv.kernels.decode_mma`), so that one thread's operand values are 16 contiguous bytes
and a page goes from memory to the tensor cores without a layout change. With ``t`` a token
of the page (bits ``t0..t3``) and ``c`` a channel (bits ``c0..c6``):

* ``"k_mma"`` (keys, the B operand of ``q @ K^T``): block ``j`` = tokens ``4j .. 4j+3`` (the
  token layout's blocks); ``p = (c >> 6) * 256 + ((c >> 1 & 3) | (t & 3) << 2) * 16 + r`` with
  ``r = c0 | c3 << 1 | c4 << 2 | c5 << 3``;
* ``"v_mma"`` (values, the B operand of ``P @ V``): block ``j`` = the tokens with
  ``(t >> 1) & 3 == j`` (``2j, 2j+1, 2j+8, 2j+9``); ``p = (r >> 4) * 128 + (c & 7) * 16 + (r & 15)``
  with ``r = t0 | t3 << 1 | c3 << 2 | c4 << 3 | c5 << 4 | c6 << 5``.

At ``head_dim`` 64 a page is half of such a 16-row, 128-channel tile: its tokens ``2l, 2l + 1`` form
row ``l`` (channel ``c + 64 (t & 1)``), rows ``0..3`` and ``4..7`` of the page being tile rows ``0..3``
and ``8..11`` (the kernel's second page of a pair gives ``4..7``, ``12..15``), and each block keeps the
byte positions above for its tile rows. So ``k_mma`` blocks are tokens ``0..7`` and ``8..15`` (the token
layout's blocks) and ``v_mma`` blocks are tokens ``0..3, 8..11`` and ``4..7, 12..15``.

Byte order of one block (little-endian everywhere):

* compressed (768 bytes): bytes ``0..511`` = low byte of value ``p`` at byte ``p``;
  bytes ``512..767`` = codes. Token and channel layouts: code byte ``512 + 4m + k`` (``k`` =
  0..3) holds the code of value ``8m + k`` in its low nibble and of value ``8m + 4 + k`` in its
  high nibble. So the 32-bit code word ``m`` gives, masked with ``0x0F0F0F0F``, the four codes
  that match 32-bit low-byte word ``2m`` (values ``8m..8m+3``), and shifted right by 4 and
  masked, the four codes of low-byte word ``2m + 1`` (ZipFusion §III-C: eight low bytes and four
  code bytes rebuild eight BF16 values). Mma layouts: code byte ``512 + i`` (``i`` = 0..255)
  holds the codes of values ``i`` (low nibble) and ``i + 256`` (high nibble), so a thread's 16
  code bytes sit beside its two 16-byte runs of low bytes.
* raw (1024 bytes): value ``p`` as little-endian bf16 at bytes ``2q, 2q+1``, ``q = raw_index(layout)[p]``:
  ``q = p`` for the token and channel layouts. The mma layouts store a raw block's 16-byte pieces (8
  values, ``P = p >> 3``) so that the pieces a kernel's lanes copy with one instruction are back to back:
  ``k_mma`` within each half of 32 pieces, piece ``2l + s`` at ``s * 16 + l`` (lane ``l`` = the low-byte
  run it reads in a compressed block, ``s`` its first or second 8 values); ``v_mma`` within each chunk of 16
  pieces, ``2m + s`` at ``s * 8 + m``. The 16 bytes a lane copies for ring tile ``u`` then sit at the same
  offset of a raw and of a compressed block (keys ``256u + 16l``, values ``128u + 16m``), so one address
  serves both kinds (:mod:`zipkv.kernels.decode_mma`), and a copy instruction reads whole 32-byte sectors
  (with each lane's 32 bytes contiguous, as ``2p`` would store them, every instruction read half sectors
  and a warp's raw rows cost one L2 request per lane: measured on the H200, 2x slower than their bytes).

Page payload (``pack``): one fixed slot of ``32 * head_dim`` bytes per page (the raw
size). Blocks are stored in order ``j = 0, 1, ...`` back to back from the start of the
slot, 768 bytes if compressed, 1024 if not (block ``j`` starts at
``1024*j - 256 * #compressed blocks before j``). ``PageMeta.nbytes`` is the used prefix: the
page's compressed size; the slot's last ``256 * #compressed`` bytes are not part of the page
(``pack`` leaves zeros there, the Triton pack kernel leaves them as they were). With the token
layout a page with no compressed block is byte for
byte the plain row-major ``[16, head_dim]`` bf16 page.

Metadata per block (``PageMeta``): the compressed flag and the base ``b`` (even; 0 for
raw blocks); ``PageMeta.packed()`` gives one byte per block, ``flag << 7 | b >> 1``.

Validation and checksums
------------------------
Beside the kernels' metadata byte, :func:`pack` gives each block a *check byte* (``PageMeta.check``, uint8
``[..., n_blocks]``; the kernels never read it, the paged cache keeps it in ``PagedKVCache.check``):
CRC-8/AUTOSAR (poly ``0x2F``, init and final xor ``0xFF``) of the four bytes ``layout index, head_dim // 32,
block index j, metadata byte`` (:func:`meta_check`). It binds the flag and base to the block's position, the
layout and the head_dim. For each block it is a bijection of the metadata byte (a CRC maps the last byte of a
fixed prefix one to one), so any change of the metadata byte alone is caught -- every flipped flag or base bit,
any other base -- and so is any change of layout or head_dim (a CRC finds every change within one byte); the 16
bits of a block's (metadata byte, check byte) are at Hamming distance 4 (checked exhaustively), so 1 to 3 flipped
bits anywhere in them are caught, more with probability 255/256.

* **Metadata, always in validate mode** (``unpack(..., validate=True)``, the default; ``plan(...,
  validate=True)`` of :mod:`zipkv.kernels.decode_attention`): a ``ValueError`` naming the page, (head) and block
  for a compressed block with an odd base; a metadata byte that does not match its check byte (a flipped flag or
  base bit, a flipped check bit, a base changed to any other value); a ``PageMeta`` whose layout is not the one
  its check bytes were written for (the error names both); a payload longer than a slot of ``meta.head_dim`` or
  shorter than ``meta.nbytes`` (metadata of another head_dim). Without check bytes (``PageMeta.check`` None, a
  ``PageMeta`` built by hand or by :meth:`PageMeta.from_packed` without ``check``) only the structural checks
  run: an odd base; a compressed block none of whose codes names its base (``b`` is its lowest exponent rounded
  down to even, so some code has ``c & 7 == 0``: this checks the codes, which a changed base leaves as they
  were); codes that would carry past exponent 255 (bases above :data:`NO_CARRY_BASE`). They catch few
  corruptions: of single-bit flips injected into packed pages of every layout (head_dim 64 and 128), they
  raised on 9 % of the flag flips and 8 % of the base flips, decoded 91 % and 45 % to wrong values, and every
  relabelled layout decoded wrong values. The paged cache's descriptors add the structural checks of their
  addresses (:func:`zipkv.paged.check_descriptors`): inside the pool at multiples of 256, a page-head's blocks
  back to back in order (a cleared or set flag moves the next block's start), raw blocks' base bits 0, no two
  page-heads overlapping. Alone these catch every flipped address bit (at least 2 blocks per page-head) and
  77 % of the flag flips, but no base of a compressed block changed to another even value: its decode is wrong.
* **Payload, only with checksums**: the low bytes and codes of a compressed block and a raw block's values can
  hold any bits, so a flipped payload bit decodes to another valid value. :func:`page_checksum` (CRC-32 of each
  page's used bytes, ``zlib.crc32``'s, computed in torch on the payload's device) and :func:`verify_checksum`
  find every 1, 2 or 3 flipped bits and every burst of up to 32 (Hamming distance 4 up to 11 KB); use them where
  pages leave the pool: :meth:`zipkv.paged.PagedKVCache.export_pages` takes them and ``import_pages`` verifies
  them; :meth:`zipkv.memory.KVMemory.export` and :meth:`~zipkv.memory.KVMemory.pack` take them and
  :meth:`~zipkv.memory.KVMemory.admit_packed` verifies them before it allocates. The decode path never computes
  them: a payload bit flipped inside the pool while pages serve (``plan``/``run``, the engine's steps, whose plans
  are ``validate=False``) is not detected, in any mode.
* **Not detected**: with ``validate=False`` nothing is read: ``unpack`` checks types and shapes and that the
  payload covers ``meta.nbytes`` (torch indexing keeps it in bounds), then decodes what the metadata says, right
  or wrong; ``plan(validate=False)`` does not read the page table or the descriptors at all (a bad one is
  undefined behaviour in the kernels). In validate mode: payload corruption without checksums (beyond the
  codes checks above); a whole metadata row replaced by another self-consistent one (another page's flags,
  bases and check bytes, or a stale copy); at head_dim 32 (one block per page-head) a flipped address bit that
  lands on unused pool bytes; a page table entry changed to another valid page id.
"""
from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass

import torch

__all__ = [
    "PAGE_TOKENS", "BLOCK_VALUES", "NO_CARRY_BASE", "LAYOUTS", "MMA_LAYOUTS", "HEAD_DIMS", "PageMeta", "CacheStats",
    "n_blocks", "page_bytes", "layouts_for", "mma_index", "raw_index", "to_raw", "from_raw", "to_pages", "to_blocks",
    "from_blocks", "eligible", "pack", "unpack", "cache_stats", "meta_check", "check_meta", "page_checksum",
    "verify_checksum",
]

PAGE_TOKENS = 16
BLOCK_VALUES = 512
RAW_BLOCK_BYTES = 2 * BLOCK_VALUES          # 1024
PACKED_BLOCK_BYTES = BLOCK_VALUES * 3 // 2  # 768: 512 low bytes + 256 code bytes
LAYOUTS = ("token", "channel", "k_mma", "v_mma")
MMA_LAYOUTS = ("k_mma", "v_mma")
MMA_HEAD_DIM = 128
MMA_HEAD_DIMS = (64, 128)
"""Head dims at which the mma layouts are defined (128: a page is one operand tile; 64: a page is half
of one, see the module docstring)."""
HEAD_DIMS = (32, 64, 128, 256)


# ----------------------------------------------------------------------------- checks

def _check_layout(layout, name="layout"):
    if layout not in LAYOUTS:
        raise ValueError(f"{name} must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _check_layout_head_dim(layout, head_dim, name="layout"):
    if layout in MMA_LAYOUTS and head_dim not in MMA_HEAD_DIMS:
        raise ValueError(f"{name}: the {layout!r} layout is defined for head_dim 64 and 128 only, got "
                         f"head_dim {head_dim}; use 'token' or 'channel'")


def layouts_for(head_dim: int) -> tuple:
    """The layouts defined for ``head_dim`` (every layout at 64 and 128; token and channel otherwise)."""
    _check_head_dim(head_dim)
    return LAYOUTS if head_dim in MMA_HEAD_DIMS else LAYOUTS[:2]


def _check_head_dim(head_dim, name="head_dim"):
    if isinstance(head_dim, bool) or not isinstance(head_dim, numbers.Integral):
        raise TypeError(f"{name}: head_dim must be an int, one of {HEAD_DIMS}, got {type(head_dim).__name__} {head_dim!r}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(
            f"{name}: head_dim must be one of {HEAD_DIMS} (16*head_dim a multiple of "
            f"{BLOCK_VALUES}, power of two), got {head_dim!r}")
    return head_dim


def _check_pages(pages, name="pages"):
    if not isinstance(pages, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(pages).__name__}")
    if pages.dtype != torch.bfloat16:
        raise TypeError(f"{name} must have dtype torch.bfloat16, got {pages.dtype}")
    if pages.dim() < 2 or pages.shape[-2] != PAGE_TOKENS:
        raise ValueError(
            f"{name} must have shape [..., {PAGE_TOKENS}, head_dim], got {tuple(pages.shape)}")
    _check_head_dim(pages.shape[-1], f"{name} (shape {tuple(pages.shape)})")
    return pages.shape[-1]


def n_blocks(head_dim: int) -> int:
    """Blocks per page: ``16 * head_dim / 512``."""
    return PAGE_TOKENS * _check_head_dim(head_dim) // BLOCK_VALUES


def page_bytes(head_dim: int) -> int:
    """Raw (and slot) size of one page in bytes: ``32 * head_dim``."""
    return 2 * PAGE_TOKENS * _check_head_dim(head_dim)


# ----------------------------------------------------------------------------- arrangement

def to_pages(x: torch.Tensor) -> torch.Tensor:
    """``[..., T, d]`` -> ``[..., T // 16, 16, d]`` full pages (a partial last page is dropped)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError(f"x must be a tensor [..., T, head_dim], got {getattr(x, 'shape', x)}")
    n = x.shape[-2] // PAGE_TOKENS
    return x[..., : n * PAGE_TOKENS, :].reshape(*x.shape[:-2], n, PAGE_TOKENS, x.shape[-1])


def to_blocks(pages: torch.Tensor, layout: str) -> torch.Tensor:
    """``[..., 16, d]`` -> ``[..., n_blocks, 512]`` in block order (see module docstring)."""
    d = _check_pages(pages)
    _check_layout(layout)
    _check_layout_head_dim(layout, d)
    nb = PAGE_TOKENS * d // BLOCK_VALUES
    lead = pages.shape[:-2]
    if layout == "token":
        return pages.reshape(*lead, nb, BLOCK_VALUES)
    if layout in MMA_LAYOUTS:
        return pages.reshape(*lead, PAGE_TOKENS * d)[..., mma_index(layout, pages.device, d)]
    return pages.reshape(*lead, PAGE_TOKENS, nb, 32).transpose(-3, -2).reshape(*lead, nb, BLOCK_VALUES)


def from_blocks(blocks: torch.Tensor, layout: str, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`to_blocks`: ``[..., n_blocks, 512]`` -> ``[..., 16, d]``."""
    _check_layout(layout)
    _check_layout_head_dim(layout, head_dim)
    nb = n_blocks(head_dim)
    if not isinstance(blocks, torch.Tensor):
        raise TypeError(f"blocks must be a torch.Tensor [..., {nb}, {BLOCK_VALUES}], got {type(blocks).__name__}")
    if blocks.shape[-2:] != (nb, BLOCK_VALUES):
        raise ValueError(f"blocks must have shape [..., {nb}, {BLOCK_VALUES}], got {tuple(blocks.shape)}")
    lead = blocks.shape[:-2]
    if layout == "token":
        return blocks.reshape(*lead, PAGE_TOKENS, head_dim)
    if layout in MMA_LAYOUTS:
        out = blocks.new_empty(*lead, PAGE_TOKENS * head_dim)
        out[..., mma_index(layout, blocks.device, head_dim).reshape(-1)] = blocks.reshape(*lead, nb * BLOCK_VALUES)
        return out.reshape(*lead, PAGE_TOKENS, head_dim)
    return blocks.reshape(*lead, nb, PAGE_TOKENS, 32).transpose(-3, -2).reshape(*lead, PAGE_TOKENS, head_dim)


def mma_index(layout: str, device="cpu", head_dim: int = MMA_HEAD_DIM) -> torch.Tensor:
    """int64 ``[n_blocks, 512]``: for an mma layout, the flat page index ``token * head_dim + channel`` of
    the value at position ``p`` of block ``j`` (module docstring)."""
    if layout not in MMA_LAYOUTS:
        raise ValueError(f"layout must be one of the mma layouts {MMA_LAYOUTS}, got {layout!r} (the token and channel "
                         f"layouts have no mma index: zipkv.format.to_blocks arranges them)")
    _check_layout_head_dim(layout, _check_head_dim(head_dim))
    return _mma_index(layout, head_dim).to(device)


@functools.lru_cache(maxsize=4)
def _mma_index(layout: str, head_dim: int) -> torch.Tensor:
    p = torch.arange(BLOCK_VALUES)
    j = torch.arange(n_blocks(head_dim))[:, None]
    if layout == "k_mma":
        r, lane, half = p % 16, (p % 256) // 16, p // 256
        c = (r & 1) | (lane & 3) << 1 | ((r >> 1) & 7) << 3 | half << 6
        t = 4 * j + (lane >> 2)
    else:
        r = p % 16 | (p // 128) << 4
        c = (p % 128) // 16 | ((r >> 2) & 15) << 3
        t = (r & 1) | j << 1 | ((r >> 1) & 1) << (3 if head_dim == 128 else 2)
    if head_dim == 64:                       # (virtual token, channel c of 128) -> token 2t + c6, channel c % 64
        return (2 * t + (c >> 6)) * 64 + (c & 63)
    return t * MMA_HEAD_DIM + c


def raw_index(layout: str) -> torch.Tensor:
    """int64 ``[512]``: the bf16 index inside a raw block at which position ``p`` is stored (module docstring:
    the identity for the token and channel layouts, a permutation of 16-byte pieces for the mma layouts)."""
    return _raw_index(_check_layout(layout))


@functools.lru_cache(maxsize=8)
def _raw_index(layout: str) -> torch.Tensor:
    p = torch.arange(BLOCK_VALUES)
    if layout not in MMA_LAYOUTS:
        return p
    piece, run = p >> 3, 32 if layout == "k_mma" else 16          # pieces per group: key half, value chunk
    moved = (piece & -run) | (piece & 1) * (run // 2) | ((piece >> 1) & (run // 2 - 1))
    return moved << 3 | (p & 7)


@functools.lru_cache(maxsize=8)
def _raw_positions(layout: str) -> torch.Tensor:
    """int64 ``[512]``: the position stored at each bf16 index of a raw block (the inverse of :func:`raw_index`)."""
    return torch.argsort(_raw_index(layout))


def to_raw(blocks: torch.Tensor, layout: str) -> torch.Tensor:
    """Blocks ``[..., 512]`` (any 2-byte dtype) in position order -> the raw byte order of ``layout``
    (:func:`raw_index`); a new tensor."""
    return blocks[..., _raw_positions(_check_layout(layout)).to(blocks.device)]


def from_raw(raw: torch.Tensor, layout: str) -> torch.Tensor:
    """Inverse of :func:`to_raw`: raw blocks ``[..., 512]`` -> position order; a new tensor."""
    return raw[..., raw_index(layout).to(raw.device)]


def _exponent_view(pages: torch.Tensor, layout: str):
    """Exponents of ``pages`` as int16, viewed so that reducing over ``dims`` reduces a block."""
    d = pages.shape[-1]
    nb = PAGE_TOKENS * d // BLOCK_VALUES
    e = (pages.view(torch.int16) >> 7) & 0xFF
    lead = pages.shape[:-2]
    if layout == "k_mma":                           # the token layout's blocks
        layout = "token"
    if layout == "v_mma" and d == 64:               # tokens (t >> 2) & 1 == j: [t3, j, t1 t0, d]
        return e.reshape(*lead, 2, 2, 4, d), (-4, -2, -1)
    if layout == "v_mma":                           # tokens (t >> 1) & 3 == j: [t3, j, t0, d]
        return e.reshape(*lead, 2, 4, 2, d), (-4, -2, -1)
    if layout == "token":
        return e.reshape(*lead, nb, BLOCK_VALUES // d, d), (-2, -1)
    return e.reshape(*lead, PAGE_TOKENS, nb, 32), (-3, -1)


# ----------------------------------------------------------------------------- API

def eligible(pages: torch.Tensor, layout: str = "token") -> torch.Tensor:
    """Which blocks can be compressed.

    pages: ``[..., 16, head_dim]`` bf16. Returns bool ``[..., n_blocks]``: all exponents of
    the block lie in ``[b, b + 15]``, ``b`` = min exponent rounded down to even (§III-B).
    Works without copying the values (one int16 exponent tensor); fine for millions of values.
    """
    _check_layout(layout)
    _check_layout_head_dim(layout, _check_pages(pages))
    e, dims = _exponent_view(pages, layout)
    lo = torch.amin(e, dim=dims) & ~1
    hi = torch.amax(e, dim=dims)
    return (hi - lo) <= 15


@dataclass(frozen=True)
class PageMeta:
    """Per-block metadata of packed pages.

    compressed: bool ``[..., n_blocks]``; base: uint8 ``[..., n_blocks]`` = the block's
    exponent base ``b`` (even), 0 for raw blocks. check: uint8 ``[..., n_blocks]``, each block's
    check byte (:func:`meta_check`, module docstring), or None (only structural checks in :func:`unpack`).
    """
    layout: str
    head_dim: int
    compressed: torch.Tensor
    base: torch.Tensor
    check: torch.Tensor | None = None

    def __post_init__(self):
        _check_meta_structure(self, "PageMeta")          # types, shapes, devices: reads no values

    @property
    def n_blocks(self) -> int:
        return n_blocks(self.head_dim)

    @property
    def nbytes(self) -> torch.Tensor:
        """int64 ``[...]``: bytes each page uses (prefix of its slot), metadata excluded."""
        nc = self.compressed.sum(-1, dtype=torch.int64)
        return self.n_blocks * RAW_BLOCK_BYTES - (RAW_BLOCK_BYTES - PACKED_BLOCK_BYTES) * nc

    def block_offsets(self) -> torch.Tensor:
        """int64 ``[..., n_blocks]``: byte offset of each block inside its page slot."""
        size = torch.where(self.compressed, PACKED_BLOCK_BYTES, RAW_BLOCK_BYTES).to(torch.int64)
        return torch.cumsum(size, -1) - size

    def packed(self) -> torch.Tensor:
        """uint8 ``[..., n_blocks]``: ``flag << 7 | b >> 1`` (the kernels' metadata byte)."""
        return (self.compressed.to(torch.uint8) << 7) | (self.base >> 1)

    def sealed(self) -> "PageMeta":
        """This metadata with its check bytes computed from its flags and bases (:func:`meta_check`): what
        :func:`pack` returns. Seal only metadata known to be right (e.g. just written by a pack kernel)."""
        _check_meta_structure(self)
        return PageMeta(self.layout, self.head_dim, self.compressed, self.base,
                        meta_check(self.packed(), self.layout, self.head_dim))

    @classmethod
    def from_packed(cls, packed: torch.Tensor, layout: str, head_dim: int,
                    check: torch.Tensor | None = None) -> "PageMeta":
        """Metadata from the kernels' bytes uint8 ``[..., n_blocks]`` (:meth:`packed`), with the check bytes
        ``check`` (uint8, same shape) that came with them, if any."""
        if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
            raise TypeError(f"packed must be a uint8 tensor, got {getattr(packed, 'dtype', type(packed))}")
        nb = n_blocks(head_dim)
        if packed.dim() < 1 or packed.shape[-1] != nb:
            raise ValueError(f"packed must have shape [..., {nb}] for head_dim={head_dim}, got {tuple(packed.shape)}")
        _check_layout_head_dim(_check_layout(layout), head_dim)
        if check is not None and (not isinstance(check, torch.Tensor) or check.dtype != torch.uint8
                                  or check.shape != packed.shape):
            raise ValueError(f"check must be a uint8 tensor of packed's shape {tuple(packed.shape)}, got "
                             f"{getattr(check, 'dtype', type(check).__name__)} {tuple(getattr(check, 'shape', ()))}")
        comp = (packed >> 7).bool()
        base = torch.where(comp, (packed & 0x7F) << 1, torch.zeros_like(packed))
        return cls(layout, head_dim, comp, base, check)

    def __getitem__(self, idx) -> "PageMeta":
        """Select pages (indexing the leading dims)."""
        try:
            return PageMeta(self.layout, self.head_dim, self.compressed[idx], self.base[idx],
                            None if self.check is None else self.check[idx])
        except IndexError as err:
            raise IndexError(f"PageMeta[{idx!r}]: the metadata holds pages {tuple(self.compressed.shape[:-1])} "
                             f"(and {self.compressed.shape[-1]} blocks each): {err}") from None


def _check_flag(x, name: str) -> bool:
    """``x`` must be a bool (or numpy bool): a string or None is refused, not read as true or false."""
    if isinstance(x, bool) or type(x).__name__ == "bool_":
        return bool(x)
    raise TypeError(f"{name} must be True or False, got {type(x).__name__} {x!r}")


# ----------------------------------------------------------------------------- check bytes

_CRC8_POLY = 0x2F                    # CRC-8/AUTOSAR: init 0xFF, final xor 0xFF, not reflected


def _crc8(data: bytes) -> int:
    crc = 0xFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = ((crc << 1) ^ _CRC8_POLY) & 0xFF if crc & 0x80 else (crc << 1) & 0xFF
    return crc ^ 0xFF


@functools.lru_cache(maxsize=None)
def _check_table(layout: str, head_dim: int) -> torch.Tensor:
    """uint8 ``[n_blocks, 256]``: the check byte of block ``j`` for each metadata byte."""
    tag = (LAYOUTS.index(layout), head_dim // 32)
    return torch.tensor([[_crc8(bytes((*tag, j, m))) for m in range(256)] for j in range(n_blocks(head_dim))],
                        dtype=torch.uint8)


@functools.lru_cache(maxsize=64)
def _check_table_on(layout: str, head_dim: int, device: torch.device) -> torch.Tensor:
    return _check_table(layout, head_dim).to(device)


def meta_check(packed: torch.Tensor, layout: str, head_dim: int) -> torch.Tensor:
    """Check bytes of metadata bytes ``packed`` uint8 ``[..., n_blocks]`` (:meth:`PageMeta.packed`, or a
    descriptor's low byte): uint8, same shape, on ``packed``'s device; block ``j``'s is CRC-8/AUTOSAR of
    ``bytes([LAYOUTS.index(layout), head_dim // 32, j, packed[..., j]])`` (module docstring)."""
    _check_layout_head_dim(_check_layout(layout), _check_head_dim(head_dim))
    nb = n_blocks(head_dim)
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() < 1 or packed.shape[-1] != nb:
        raise ValueError(f"packed must be a uint8 tensor [..., {nb}] (head_dim {head_dim}), got "
                         f"{getattr(packed, 'dtype', type(packed).__name__)} {tuple(getattr(packed, 'shape', ()))}")
    table = _check_table_on(layout, head_dim, packed.device)
    return table[torch.arange(nb, device=packed.device), packed.long()]


def _where(mask: torch.Tensor) -> tuple:
    return tuple(int(i) for i in mask.nonzero()[0])


def _check_against(meta: PageMeta, packed: torch.Tensor, name: str, page_label=None, layout_name=None) -> None:
    """ValueError naming the first block whose check byte is not that of its metadata byte ``packed``; where all of
    a page's bytes match another layout's check bytes, the error names that layout (``layout_name``, default
    ``name.layout``). ``page_label(index tuple)``: the page-head in words (default ``page (i, ...)``)."""
    bad = meta_check(packed, meta.layout, meta.head_dim) != meta.check
    if not bool(bad.any()):
        return
    at = _where(bad)
    page, j = at[:-1], at[-1]
    where = page_label(page) if page_label else f"page {page}"
    where_block = f"{where} block {j}" if page_label else f"{where}, block {j}"
    if bool(bad[page].all()):
        for other in layouts_for(meta.head_dim):
            if other != meta.layout and torch.equal(meta_check(packed[page], other, meta.head_dim), meta.check[page]):
                raise ValueError(f"{layout_name or name + '.layout'} is {meta.layout!r}, but the check bytes of {where} "
                                 f"were written for the {other!r} layout (head_dim {meta.head_dim}): the metadata is "
                                 f"for another layout")
    m, c = int(packed[at]), int(meta.check[at])
    want = int(meta_check(packed[page], meta.layout, meta.head_dim)[j])
    kind = (f"compressed, base {(m & 0x7F) << 1}" if m & 0x80
            else "raw" + (f", base bits {m & 0x7F:#04x}" if m & 0x7F else ""))
    raise ValueError(f"{name}: {where_block}: its metadata byte {m:#04x} ({kind}) does not match its check byte "
                     f"{c:#04x} ({want:#04x} expected for layout {meta.layout!r}, head_dim {meta.head_dim}): the flag, "
                     f"the base or the check byte is corrupted")


def check_meta(meta: "PageMeta", name: str = "meta") -> None:
    """The checks of :func:`unpack` that read only metadata (module docstring): dtypes and shapes, no odd base
    on a compressed block, and every block's check byte where ``meta.check`` is given. ``ValueError``/``TypeError``
    naming the page and block."""
    _check_meta_structure(meta, name)
    _check_bases(meta, name)
    if meta.check is not None:
        _check_against(meta, meta.packed(), name)


def _check_meta_structure(meta: "PageMeta", name: str = "meta") -> None:
    """The types and shapes of ``meta``'s fields (what ``unpack(..., validate=False)`` checks too): reads no values."""
    if not isinstance(meta, PageMeta):
        raise TypeError(f"{name} must be a PageMeta, got {type(meta).__name__}")
    _check_layout(meta.layout, f"{name}.layout")
    _check_layout_head_dim(meta.layout, _check_head_dim(meta.head_dim, f"{name}.head_dim"), f"{name}.layout")
    nb = meta.n_blocks
    if not isinstance(meta.compressed, torch.Tensor) or meta.compressed.dtype != torch.bool:
        raise TypeError(f"{name}.compressed must be a bool tensor, got "
                        f"{getattr(meta.compressed, 'dtype', type(meta.compressed))}")
    if not isinstance(meta.base, torch.Tensor) or meta.base.dtype != torch.uint8:
        raise TypeError(f"{name}.base must be a uint8 tensor, got {getattr(meta.base, 'dtype', type(meta.base))}")
    if meta.compressed.dim() < 1 or meta.compressed.shape[-1] != nb or meta.base.shape != meta.compressed.shape:
        raise ValueError(f"{name}.compressed/{name}.base must have shape [..., {nb}] ({name}.head_dim={meta.head_dim}), "
                         f"got {tuple(meta.compressed.shape)} / {tuple(meta.base.shape)}")
    if meta.check is not None and (not isinstance(meta.check, torch.Tensor) or meta.check.dtype != torch.uint8
                                   or meta.check.shape != meta.compressed.shape):
        raise ValueError(f"{name}.check must be None or a uint8 tensor of shape {tuple(meta.compressed.shape)}, got "
                         f"{getattr(meta.check, 'dtype', type(meta.check).__name__)} {tuple(getattr(meta.check, 'shape', ()))}")
    devices = {t.device for t in (meta.compressed, meta.base, meta.check) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"{name}.compressed, .base and .check must share a device, got "
                         f"{', '.join(sorted(map(str, devices)))}")


_UNIT = 256  # blocks are 3 (packed) or 4 (raw) units of 256 bytes


def _unit_map(meta: PageMeta):
    """For every 256-byte unit of the per-block 1024-byte buffers (``[..., n_blocks * 4]``,
    block order): its unit index in the page slot, or ``n_blocks * 4`` (a trash unit) if unused."""
    used = torch.ones(*meta.compressed.shape, 4, dtype=torch.bool, device=meta.compressed.device)
    used[..., 3] = ~meta.compressed
    used = used.flatten(-2)
    rank = torch.cumsum(used, -1) - 1
    return torch.where(used, rank, used.shape[-1])


def _row_index(rows: int, n_units: int, device) -> torch.Tensor:
    return torch.arange(rows, device=device)[:, None].expand(rows, n_units)


def pack(pages: torch.Tensor, layout: str = "token", *, enable: bool | torch.Tensor = True):
    """Compress pages (§III-B).

    pages: ``[..., 16, head_dim]`` bf16. layout: one of :data:`LAYOUTS` (the mma layouts need
    head_dim 64 or 128).
    enable: ``False`` keeps every block raw; a bool tensor ``[..., n_blocks]`` compresses
    only eligible blocks where it is True (forcing a mix).
    Returns ``(payload, meta)``: payload uint8 ``[..., 32 * head_dim]`` (page slots, byte
    order in the module docstring) and a :class:`PageMeta`.
    """
    d = _check_pages(pages)
    _check_layout(layout)
    if type(enable).__module__ == "numpy" and getattr(enable, "dtype", None) == bool and enable.ndim == 0:
        enable = bool(enable)                          # numpy's bool scalar
    if not isinstance(enable, (bool, torch.Tensor)):   # a list or None would read as one truth value
        raise TypeError(f"enable must be a bool or a bool tensor [..., n_blocks], got {type(enable).__name__}")
    nb = PAGE_TOKENS * d // BLOCK_VALUES
    lead = pages.shape[:-2]
    raw = to_blocks(pages, layout).contiguous().view(torch.uint8)   # [..., nb, 1024]
    low, high = raw[..., 0::2], raw[..., 1::2]                       # [..., nb, 512] each
    exp = (high << 1) | (low >> 7)                                   # uint8 exponent
    emin = exp.amin(-1) & 0xFE
    comp = (exp.amax(-1) - emin) <= 15                               # exp >= emin: no wrap
    if isinstance(enable, torch.Tensor):
        if enable.dtype != torch.bool or enable.shape != comp.shape:
            raise ValueError(f"enable must be a bool tensor of shape {tuple(comp.shape)}, "
                             f"got {enable.dtype} {tuple(enable.shape)}")
        comp = comp & enable.to(comp.device)
    elif not enable:
        comp = torch.zeros_like(comp)
    base = torch.where(comp, emin, 0)
    code = ((high >> 7) << 3) | ((high & 0x7F) - (base >> 1)[..., None])  # garbage where raw
    if layout in MMA_LAYOUTS:                                        # values i, i + 256
        codes = code[..., :256] | (code[..., 256:] << 4)
    else:                                                            # values 8m + k, 8m + 4 + k
        code = code.reshape(*lead, nb, 64, 2, 4)
        codes = (code[..., 0, :] | (code[..., 1, :] << 4)).reshape(*lead, nb, 256)
    stored = to_raw(raw.view(torch.int16), layout).view(torch.uint8)
    buf = torch.where(comp[..., None], torch.cat([low, codes, codes], -1), stored)
    meta = PageMeta(layout, d, comp, base).sealed()
    dst = _unit_map(meta)                                            # [..., nb*4]
    dst = dst.reshape(-1, 4 * nb)
    payload = torch.zeros(*lead, 4 * nb + 1, _UNIT, dtype=torch.uint8, device=pages.device)
    payload.view(-1, 4 * nb + 1, _UNIT)[_row_index(dst.shape[0], 4 * nb, dst.device), dst] = \
        buf.reshape(-1, 4 * nb, _UNIT)
    return payload[..., : 4 * nb, :].reshape(*lead, nb * RAW_BLOCK_BYTES), meta


NO_CARRY_BASE = 240
"""Up to this base every code decodes without a carry (``b/2 + 7 <= 127``); above it (blocks whose
exponents all lie in ``[242, 255]``) only the codes :func:`pack` writes do, which :func:`unpack` checks."""


def _check_bases(meta: PageMeta, name: str = "meta") -> None:
    """A compressed block's base is its lowest exponent rounded down to even: never odd."""
    odd = meta.compressed & (meta.base % 2 == 1)
    if bool(odd.any()):
        where = _where(odd)
        raise ValueError(f"{name}.base: compressed block {where} has base {int(meta.base[where])}; a compressed "
                         "block's base is even (its lowest exponent rounded down to even)")


def _check_codes(meta: PageMeta, code: torch.Tensor, name: str = "meta") -> None:
    """Payload checks of compressed blocks: above :data:`NO_CARRY_BASE` a code can name an exponent past 255
    (``b/2 + (c & 7) > 127``), which would carry into the sign bit; and ``b`` is the block's lowest exponent
    rounded down to even, so some code names it (``c & 7 == 0``). Metadata and payload that :func:`pack`
    cannot produce."""
    high_base = meta.compressed & (meta.base > NO_CARRY_BASE)
    if bool(high_base.any()):
        over = high_base[..., None] & ((meta.base >> 1)[..., None] + (code & 7) > 127)
        if bool(over.any()):
            where = _where(over.any(-1))
            raise ValueError(f"{name}.base: compressed block {where} has base {int(meta.base[where])}, but its codes "
                             f"name exponents above 255 (b/2 + (code & 7) > 127); with that payload a compressed "
                             f"block's base is at most {NO_CARRY_BASE}")
    lowest = (code & 7).amin(-1)
    unnamed = meta.compressed & (lowest != 0)
    if bool(unnamed.any()):
        where = _where(unnamed)
        b = int(meta.base[where])
        raise ValueError(f"{name}.base: compressed block {where} has base {b}, but no value of the block has exponent "
                         f"{b} or {b + 1} (its lowest is {b + 2 * int(lowest[where])} or one more); a compressed block's "
                         f"base is its lowest exponent rounded down to even: the base or the payload is corrupted")


def unpack(payload: torch.Tensor, meta: PageMeta, *, validate: bool = True) -> torch.Tensor:
    """Inverse of :func:`pack`, bit-exact: payload uint8 ``[..., L]`` (``meta.nbytes`` <= L <= ``32 * head_dim``,
    e.g. the full slot) -> pages ``[..., 16, head_dim]`` bf16 (ZipFusion §III-B).

    validate (default): check the metadata before decoding -- odd bases, every block's check byte where
    ``meta.check`` is given (a corrupted flag or base, metadata of another layout), a payload longer than a slot of
    ``meta.head_dim`` -- and the codes against the bases (a base that no code names, codes that pass exponent
    255): a ``ValueError`` naming the page and block instead of wrong values (module docstring: what is and is
    not detected). ``validate=False`` checks types and shapes only and decodes what the metadata says."""
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8:
        raise TypeError(f"payload must be a uint8 tensor, got {getattr(payload, 'dtype', type(payload))}")
    _check_flag(validate, "validate")
    if validate:
        check_meta(meta)
    else:
        _check_meta_structure(meta)
    if payload.device != meta.compressed.device:
        raise ValueError(f"payload is on {payload.device}, meta on {meta.compressed.device}: they must share a device")
    d, nb = meta.head_dim, meta.n_blocks
    pb = nb * RAW_BLOCK_BYTES
    lead = meta.compressed.shape[:-1]
    if payload.shape[:-1] != lead:
        raise ValueError(f"payload must have shape [{', '.join(map(str, lead))}, L] to match meta, "
                         f"got {tuple(payload.shape)}")
    if validate and payload.shape[-1] > pb:
        raise ValueError(f"payload: last dim {payload.shape[-1]} is longer than a page slot at meta.head_dim={d} "
                         f"({pb} bytes): is the metadata for another head_dim (a {payload.shape[-1]}-byte slot holds "
                         f"head_dim {payload.shape[-1] // (2 * PAGE_TOKENS)})?")
    need = int(meta.nbytes.max()) if meta.nbytes.numel() else 0
    if payload.shape[-1] < need:
        raise ValueError(f"payload: last dim {payload.shape[-1]} is shorter than the {need} bytes meta describes "
                         f"(meta.head_dim={d}, {nb} blocks)")
    if payload.shape[-1] != pb:
        payload = torch.nn.functional.pad(payload[..., :min(pb, payload.shape[-1])],
                                          (0, max(0, pb - payload.shape[-1])))
    src = _unit_map(meta).reshape(-1, 4 * nb)                       # trash unit reads zeros
    units = torch.cat([payload.reshape(-1, 4 * nb, _UNIT),
                       payload.new_zeros(src.shape[0], 1, _UNIT)], 1)
    buf = units[_row_index(src.shape[0], 4 * nb, src.device), src]
    buf = buf.reshape(*lead, nb, RAW_BLOCK_BYTES)
    low = buf[..., :BLOCK_VALUES]
    cb = buf[..., BLOCK_VALUES:PACKED_BLOCK_BYTES]
    if meta.layout in MMA_LAYOUTS:
        code = torch.cat([cb & 15, cb >> 4], -1)
    else:
        cb = cb.reshape(*lead, nb, 64, 4)
        code = torch.stack([cb & 15, cb >> 4], -2).reshape(*lead, nb, BLOCK_VALUES)
    if validate:
        _check_codes(meta, code)
    high = ((code >> 3) << 7) | ((meta.base >> 1)[..., None] + (code & 7))
    rebuilt = torch.stack([low, high], -1).reshape(*lead, nb, RAW_BLOCK_BYTES)
    raw = from_raw(buf.view(torch.int16), meta.layout).view(torch.uint8)
    x = torch.where(meta.compressed[..., None], rebuilt, raw).contiguous()
    return from_blocks(x.view(torch.bfloat16), meta.layout, d)


# ----------------------------------------------------------------------------- payload checksums

_CRC32_POLY = 0xEDB88320             # CRC-32/ISO-HDLC (zlib.crc32), reflected


@functools.lru_cache(maxsize=8)
def _crc32_tables(length: int):
    """(``T`` int32 ``[length, 256]``, ``Z`` int64 ``[length + 1]``): ``T[k, b]`` = the zero-init CRC-32 register
    after byte ``b`` and ``k`` zero bytes; ``Z[L]`` = ``zlib.crc32`` of ``L`` zero bytes."""
    x = torch.arange(256, dtype=torch.int64)
    for _ in range(8):
        x = torch.where(x & 1 == 1, (x >> 1) ^ _CRC32_POLY, x >> 1)
    byte_table = x
    rows = [byte_table]
    for _ in range(length - 1):                     # CRC is linear: a zero byte maps r to (r >> 8) ^ table[r & 0xFF]
        r = rows[-1]
        rows.append((r >> 8) ^ byte_table[r & 0xFF])
    t = torch.stack(rows)
    zeros, r, small = [0], 0xFFFFFFFF, byte_table.tolist()
    for _ in range(length):
        r = (r >> 8) ^ small[r & 0xFF]
        zeros.append(r ^ 0xFFFFFFFF)
    return torch.where(t >= 2 ** 31, t - 2 ** 32, t).to(torch.int32), torch.tensor(zeros, dtype=torch.int64)


@functools.lru_cache(maxsize=16)
def _crc32_tables_on(length: int, device: torch.device):
    t, z = _crc32_tables(length)
    return t.reshape(-1).to(device), z.to(device)


_CRC_CHUNK = 1 << 24                 # bytes per gather (bounds the int32 temporaries)


def _check_payload(payload, name: str = "payload") -> None:
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() < 1:
        got = (f"{payload.dtype} tensor of shape {tuple(payload.shape)}" if isinstance(payload, torch.Tensor)
               else type(payload).__name__)
        raise TypeError(f"{name} must be a uint8 tensor [..., L] (one row of bytes per page), got {got}")


def page_checksum(payload: torch.Tensor, meta: PageMeta | None = None) -> torch.Tensor:
    """CRC-32 (``zlib.crc32``'s) of each page's bytes: payload uint8 ``[..., L]`` -> int64 ``[...]`` in
    ``[0, 2**32)``, computed in torch on the payload's device (one table gather and a xor tree per byte).
    meta: only the first ``meta.nbytes`` bytes of each page (the bytes :func:`unpack` reads; the rest of a
    slot is not part of the page); None: all ``L`` bytes. Finds every 1, 2 or 3 flipped bits of a page up to
    11 KB and every burst of up to 32 (module docstring)."""
    _check_payload(payload)
    lead, width = payload.shape[:-1], payload.shape[-1]
    if meta is None:
        used = torch.full(lead, width, dtype=torch.int64, device=payload.device)
    else:
        check_meta(meta)
        if meta.compressed.shape[:-1] != lead:
            raise ValueError(f"payload must have shape [{', '.join(map(str, meta.compressed.shape[:-1]))}, L] to match "
                             f"meta, got {tuple(payload.shape)}")
        used = meta.nbytes.to(payload.device)
        if used.numel() and int(used.max()) > width:
            raise ValueError(f"payload: last dim {width} is shorter than the {int(used.max())} bytes meta describes")
    if width == 0 or payload.numel() == 0:
        return torch.tensor(0, dtype=torch.int64).expand(lead).to(payload.device).clone()
    table, zeros = _crc32_tables_on(width, payload.device)
    flat, used = payload.reshape(-1, width), used.reshape(-1)
    out = torch.empty(flat.shape[0], dtype=torch.int64, device=payload.device)
    span = 1 << max(0, (width - 1).bit_length())
    pos = torch.arange(width, device=payload.device)
    step = max(1, _CRC_CHUNK // span)
    for s in range(0, flat.shape[0], step):
        rows, n = flat[s: s + step], used[s: s + step]
        dist = n[:, None] - 1 - pos                                   # zero bytes after each byte
        x = torch.where(dist >= 0, table[dist.clamp(min=0) * 256 + rows.long()], 0)
        x = torch.nn.functional.pad(x, (0, span - width))
        while x.shape[-1] > 1:
            half = x.shape[-1] // 2
            x = x[..., :half] ^ x[..., half:]
        out[s: s + step] = (x[:, 0].to(torch.int64) & 0xFFFFFFFF) ^ zeros[n]
    return out.reshape(lead)


def verify_checksum(payload: torch.Tensor, checksum: torch.Tensor, meta: PageMeta | None = None,
                    name: str = "payload") -> None:
    """``ValueError`` naming the first page whose :func:`page_checksum` (with ``meta``) is not ``checksum``
    (int64 ``[...]``, recorded when the pages were written): its bytes changed since (one device sync)."""
    _check_payload(payload, name)
    if not isinstance(checksum, torch.Tensor) or checksum.dtype != torch.int64 or checksum.shape != payload.shape[:-1]:
        raise ValueError(f"checksum must be an int64 tensor of shape {tuple(payload.shape[:-1])} (one per page), got "
                         f"{getattr(checksum, 'dtype', type(checksum).__name__)} {tuple(getattr(checksum, 'shape', ()))}")
    got = page_checksum(payload, meta)
    bad = got != checksum.to(got.device)
    if bool(bad.any()):
        at = _where(bad)
        raise ValueError(f"{name}: page {at} has CRC-32 {int(got[at]):#010x}, but its checksum is "
                         f"{int(checksum[at]):#010x}: its bytes changed since the checksum was taken ({int(bad.sum())} "
                         f"of {bad.numel()} pages differ)")


@dataclass(frozen=True)
class CacheStats:
    """Compressibility of a set of pages (ZipFusion §III-B, Fig. 2). Bytes exclude metadata."""
    layout: str
    n_pages: int
    n_blocks: int
    n_compressed: int
    raw_bytes: int
    packed_bytes: int

    @property
    def frac_blocks(self) -> float:
        """Fraction of blocks that are compressible."""
        return self.n_compressed / self.n_blocks if self.n_blocks else 0.0

    @property
    def ratio(self) -> float:
        """packed bytes / raw bytes (0.75 when every block is compressed)."""
        return self.packed_bytes / self.raw_bytes if self.raw_bytes else 1.0

    @property
    def bits_per_value(self) -> float:
        return 16.0 * self.ratio

    def as_dict(self) -> dict:
        return dict(layout=self.layout, n_pages=self.n_pages, n_blocks=self.n_blocks,
                    n_compressed=self.n_compressed, frac_blocks=self.frac_blocks,
                    raw_bytes=self.raw_bytes, packed_bytes=self.packed_bytes,
                    ratio=self.ratio, bits_per_value=self.bits_per_value)


def cache_stats(pages: torch.Tensor, layout: str = "token") -> CacheStats:
    """Compressible blocks and bytes for ``pages`` ``[..., 16, head_dim]`` bf16 (full pages;
    use :func:`to_pages` on a ``[..., T, head_dim]`` cache)."""
    ok = eligible(pages, layout)
    nblk, ncomp = ok.numel(), int(ok.sum())
    raw = nblk * RAW_BLOCK_BYTES
    return CacheStats(layout, nblk // max(ok.shape[-1], 1), nblk, ncomp, raw,
                      raw - (RAW_BLOCK_BYTES - PACKED_BLOCK_BYTES) * ncomp)
