"""Every layer's pages in the byte pool (ZipFusion §II-C, §III-D): page ids, their descriptors, writes into raw
pages, and compression migration.

Page ids are logical and shared by all layers; where page ``p``'s bytes are in layer ``l`` is its descriptor row
``desc_all[l, p]``, int64 ``[2, kv_heads, n_blocks]`` (``byte_address << 8 | flag << 7 | b >> 1`` per block, the format
of ``zipkv.kernels.decode_attention.PagedKVCache``). A page is raw while it fills; once full it is queued, and
:meth:`Pages.compress` packs it in place and moves it into a compressed chunk of its layer when
:class:`~zipkv.memory.placement.Placement` finds room (else it stays compressed in place, in its raw slot). Moving or
compressing a page rewrites its descriptors, never its id.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from zipkv import format as fmt
from zipkv.memory.chunks import COMP, RAW
from zipkv.memory.placement import UNIT, Placement

IN_PLACE = "inplace"
"""The location kind of a page compressed in its raw slot (beside :data:`RAW` and :data:`COMP`)."""


@dataclass
class Packed:
    """A request's cached KV with its full pages packed outside the pool (:meth:`KVMemory.pack`, :meth:`KVMemory.export`).

    tokens: cached tokens; n_pages: full pages packed; slots: per layer uint8 ``[n_pages, 2, kv_heads,
    slot_bytes]`` (each page-head packed at the start of its slot); meta: per layer uint8 ``[n_pages, 2,
    kv_heads, n_blocks]``; head_units: per layer and page the sizes of its ``2 * kv_heads`` page-heads (keys, then
    values) in :data:`UNIT` s; tail: per layer ``(k, v)`` bf16 ``[kv_heads, tokens - 16 n_pages, head_dim]`` (the last,
    partial page, written raw).

    Self-checking while outside the pool (:mod:`zipkv.memory`'s "Pages that leave the pool"): check: per layer uint8
    ``[n_pages, 2, kv_heads, n_blocks]``, each metadata byte's check byte (:func:`zipkv.format.meta_check`), or None;
    checksum: per layer int64 ``[n_pages, 2, kv_heads]``, the CRC-32 of each page-head's used bytes
    (:func:`zipkv.format.page_checksum`), or None. :meth:`KVMemory.admit_packed` verifies both where present before
    it takes anything. ``tail`` is not covered: plain bf16 tokens, written raw like any new token."""
    tokens: int
    n_pages: int
    slots: list
    meta: list
    head_units: list
    tail: list
    check: list | None = None
    checksum: list | None = None

    @functools.cached_property
    def units(self) -> list:
        """Per layer the pages' sizes in :data:`UNIT` s (their page-heads' sum)."""
        return [[sum(h) for h in layer] for layer in self.head_units]

    @functools.cached_property
    def layer_units(self) -> list:
        """Per layer the units of all its pages."""
        return [sum(layer) for layer in self.units]


def _units(head_units) -> int:
    """Units of a page: the sum of its page-heads' ``[2][H]``."""
    return sum(map(sum, head_units))


def to_device(x: torch.Tensor, device) -> torch.Tensor:
    """CPU tensor ``x`` on ``device``, without a host sync on CUDA: staged in pinned memory and copied
    non-blocking, so the copy is ordered in the stream after the work already queued (a decode step in flight)
    and the host goes on (the engine's overlapped steps, :class:`zipkv.engine.Engine`)."""
    device = torch.device(device)
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def copy_to_device(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` for a CPU ``src``, without a host sync where ``dst`` is on CUDA (see :func:`to_device`)."""
    if dst.device.type != "cuda":
        return dst.copy_(src)
    return dst.copy_(src.pin_memory(), non_blocking=True)


def pack_slots_reference(pool: torch.Tensor, offsets: torch.Tensor, head_dim: int, layout: str) -> torch.Tensor:
    """Compress raw page-head slots of ``pool`` in place with ``zipkv.format.pack`` (the reference of the
    Triton pack kernel's ``pack_into(pool, off, pool, off, src_packed=True)``). offsets: int64 ``[n]`` byte
    addresses of raw slots. Returns the metadata bytes uint8 ``[n, n_blocks]``."""
    pb, nb = fmt.page_bytes(head_dim), fmt.n_blocks(head_dim)
    idx = offsets[:, None] + torch.arange(pb, device=pool.device)
    stored = pool[idx].view(torch.bfloat16).reshape(-1, nb, fmt.BLOCK_VALUES)
    blocks = fmt.from_raw(stored, layout)
    payload, meta = fmt.pack(fmt.from_blocks(blocks, layout, head_dim), layout)
    pool[idx] = payload
    return meta.packed()


class Pages:
    """The byte pool, every layer's descriptors and the pages' locations, over the chunks of ``placement``.

    kv_heads, head_dim, layouts: the KV shape and the (K, V) block arrangements. pack_slots: ``f(pool, offsets,
    head_dim, layout) -> meta`` (:func:`pack_slots_reference`'s contract). extra_bytes, extra_pages: the caller's
    region after the chunks (at :attr:`extra_offset` of :attr:`pool`) and its descriptor rows after
    :attr:`max_pages`. pool: uint8 ``[extra_offset + extra_bytes]``; write_index: int64 ``[2, 16, head_dim]``, the bf16
    index inside a raw page-head slot of each (token, channel) of K and of V."""

    def __init__(self, placement: Placement, kv_heads: int, head_dim: int, layouts: tuple, device, pack_slots,
                 extra_bytes: int, extra_pages: int):
        self.placement = placement
        self.num_layers, self.kv_heads, self.head_dim, self.layouts = placement.num_layers, kv_heads, head_dim, layouts
        self.pages_per_chunk, self.page_bytes = placement.pages_per_chunk, placement.page_bytes
        self.units_per_chunk = placement.units_per_chunk
        self.slot_bytes = fmt.page_bytes(head_dim)                        # one page-head
        self.chunk_bytes = self.pages_per_chunk * self.page_bytes
        self.total_bytes = len(placement.chunks) * self.chunk_bytes
        self.device = torch.device(device)
        L, nb = self.num_layers, fmt.n_blocks(head_dim)
        self.max_pages = self.total_bytes // UNIT // (L * placement.min_page_units) + 1
        # pad: the pack kernel checks a whole slot fits after each offset
        self.extra_offset = self.total_bytes + self.slot_bytes
        self.pool = torch.zeros(self.extra_offset + extra_bytes, dtype=torch.uint8, device=self.device)
        # one tensor for every layer's descriptors: a step's compression reads and writes all layers in one op
        self._desc_all = torch.zeros(L, self.max_pages + extra_pages, 2, kv_heads, nb, dtype=torch.int64,
                                     device=self.device)
        self._desc = list(self._desc_all)                                 # per layer views
        self._new_rows: list = []                                         # (page id, raw slot address per layer)
        self._changed: set = set()                                        # page ids whose descriptors changed
        self._pack = pack_slots
        self._loc = [dict() for _ in range(L)]                            # page id -> location
        self._free_ids = list(range(self.max_pages - 1, -1, -1))
        self._full: list = []                                             # full raw pages awaiting compress
        self._inplace = [dict() for _ in range(L)]                        # compressed in place: page id -> units [2][H]
        head = torch.arange(2 * kv_heads, device=self.device).reshape(2, kv_heads) * self.slot_bytes
        self._raw_offsets = (head[..., None] + fmt.RAW_BLOCK_BYTES * torch.arange(nb, device=self.device))
        self.write_index = torch.stack([self._slot_positions(lay) for lay in self.layouts])   # [2, 16, D]

    def _slot_positions(self, layout):
        """int64 ``[16, head_dim]``: bf16 index inside a raw page-head slot of each (token, channel)
        (:func:`zipkv.format.raw_index`: where a raw block stores each position)."""
        nb = fmt.n_blocks(self.head_dim)
        pos = torch.arange(nb)[:, None] * fmt.BLOCK_VALUES + fmt.raw_index(layout)
        return fmt.from_blocks(pos, layout, self.head_dim).to(self.device)

    def _slot_address(self, c, s):
        return c * self.chunk_bytes + s * self.page_bytes

    # ------------------------------------------------------------------ page ids

    def new_pages(self, n: int) -> list[int]:
        """Take ``n`` page ids with a raw slot in every layer. Their descriptors are written later, all of a
        step's new pages at once (:meth:`flush_pages`): one write for all layers instead of one per page and layer."""
        ids = [self._free_ids.pop() for _ in range(n)]
        for p in ids:
            addr = []
            for l in range(self.num_layers):
                c, s = self.placement.raw_alloc(l)
                self._loc[l][p] = (RAW, c, s)
                addr.append(self._slot_address(c, s))
            self._new_rows.append((p, addr))
        return ids

    def free_pages(self, ids: list[int]) -> None:
        """Give back pages ``ids`` in every layer (their slots or extents) and their ids; they leave the
        compression queue."""
        gone = set(ids)
        self._full = [p for p in self._full if p not in gone]
        for p in ids:
            for l in range(self.num_layers):
                loc = self._loc[l].pop(p)
                if loc[0] == COMP:
                    for c, start, units in loc[1]:
                        self.placement.comp_free(l, c, start, units)
                else:
                    self._inplace[l].pop(p, None)
                    self.placement.raw_free(l, loc[1], loc[2])
            self._free_ids.append(p)

    def queue_full(self, ids: list[int]) -> None:
        """Queue raw pages ``ids``, now full, for :meth:`compress`."""
        self._full.extend(ids)

    def keep_raw(self) -> None:
        """Drop the queued pages from the compression queue: they stay raw."""
        self._full = []

    def is_raw(self, layer: int, page: int) -> bool:
        """Whether ``page`` is raw (uncompressed, writable) in ``layer``."""
        return self._loc[layer][page][0] == RAW

    def page_kinds(self) -> dict:
        """Pages, counted once per layer, that are raw, compressed in place and compressed in chunks:
        ``pages_raw``, ``pages_in_place``, ``pages_compressed``."""
        kinds = {RAW: 0, IN_PLACE: 0, COMP: 0}
        for locs in self._loc:
            for loc in locs.values():
                kinds[loc[0]] += 1
        return dict(pages_raw=kinds[RAW], pages_in_place=kinds[IN_PLACE], pages_compressed=kinds[COMP])

    # ------------------------------------------------------------------ descriptors

    def flush_pages(self) -> None:
        """Write the descriptors of the pages allocated since the last flush (raw slots), one indexed write for
        all layers. Reading :attr:`desc` flushes first."""
        if not self._new_rows:
            return
        rows = dict(self._new_rows)               # a page id freed and taken again since: its latest slot
        self._new_rows = []
        self._changed.update(rows)
        idx = to_device(torch.tensor(list(rows), dtype=torch.int64), self.device)
        addr = to_device(torch.tensor(list(rows.values()), dtype=torch.int64).T.contiguous(), self.device)   # [L, n]
        self._desc_all[:, idx] = (addr[:, :, None, None, None] + self._raw_offsets) << 8

    def changed_pages(self) -> list:
        """Sorted ids of the pages whose descriptors changed (in any layer) since the last call; the record is
        cleared."""
        self.flush_pages()
        out, self._changed = sorted(self._changed), set()
        return out

    @property
    def desc_all(self) -> torch.Tensor:
        """Every layer's descriptors in one tensor, int64 ``[layers, pages, 2, kv_heads, blocks]``
        (:attr:`desc` holds views of it); pending new pages are written first."""
        self.flush_pages()
        return self._desc_all

    @property
    def desc(self) -> list:
        """Per layer the block descriptors ``int64 [pages, 2, kv_heads, blocks]`` (``zipkv.format``); pending new
        pages are written first (:meth:`flush_pages`)."""
        self.flush_pages()
        return self._desc

    def compressed_fraction(self, pages: list[int]):
        """Fractions of K and V blocks stored compressed over ``pages``, all layers: ``(frac_k, frac_v)``."""
        if not pages:
            return float("nan"), float("nan")
        idx = torch.tensor(pages, device=self.device)
        comp = torch.stack([((d[idx] >> 7) & 1).to(torch.float32).mean((0, 2, 3)) for d in self.desc])
        k, v = comp.mean(0).tolist()
        return k, v

    # ------------------------------------------------------------------ writes

    def write_tokens(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> None:
        """Write one token's K and V per row into raw pages of ``layer``: pages, offsets int64 ``[n]``;
        k, v bf16 ``[n, kv_heads, head_dim]``. No host sync."""
        base = (self.desc[layer][pages, :, :, 0] >> 8) // 2                       # [n, 2, H] bf16 index
        idx = base[..., None] + self.write_index[:, offsets].transpose(0, 1)[:, :, None, :]
        self.pool[: self.total_bytes].view(torch.bfloat16)[idx] = torch.stack([k, v], 1)

    # ------------------------------------------------------------------ compression

    def compress(self, outstanding: int) -> dict:
        """Compress the queued full pages of every layer and move in-place compressed pages into compressed chunks
        where room has appeared, a new chunk only while the capacity left covers the ``outstanding`` reserved pages.
        Returns counts ``moved`` and ``in_place``.

        Device work is batched over layers -- the pack kernel twice (K, V), one read of the compressed
        sizes back to the host, one copy for every move -- so a step that fills pages costs a few launches,
        not a few per layer; the host places pages layer by layer."""
        full, self._full = self._full, []
        new_units = self._pack_full(full) if full else None               # [L][n][2][H] ints
        moves, moved, in_place = [], 0, 0                                 # (layer, page, head units, src, dst)
        ppc = self.pages_per_chunk
        for l in range(self.num_layers):
            waiting = sorted(self._inplace[l])
            if not full and not (waiting and self.placement.room_for(
                    l, min(map(_units, (self._inplace[l][p] for p in waiting))), len(waiting))):
                continue                          # nothing new, and no in-place page could move
            todo = full + waiting
            # an in-place page keeps the units it was packed to: no device read
            head_units = (new_units[l] if full else []) + [self._inplace[l][p] for p in waiting]
            page_units = [_units(u) for u in head_units]
            released = []
            refused = False                  # a new chunk refused once is refused for the rest of this pass
            left = sum(u * UNIT < self.page_bytes for u in page_units)          # pages a move would shrink
            for i, p in enumerate(todo):
                loc = self._loc[l][p]
                if page_units[i] * UNIT == self.page_bytes:        # nothing compressible: stays where it is
                    self._loc[l][p] = (IN_PLACE,) + loc[1:]
                    continue
                # a fresh chunk only for at least a chunk's worth of pages: their raw slots give back as much
                # as the chunk takes in this layer
                dest = self.placement.comp_alloc(l, [u for kv in head_units[i] for u in kv], outstanding,
                                                 not refused and left >= ppc)
                left -= 1
                if dest is None:
                    refused = refused or left + 1 >= ppc
                    if loc[0] == RAW:
                        self._loc[l][p] = (IN_PLACE,) + loc[1:]
                        self._inplace[l][p] = head_units[i]
                        in_place += 1
                    continue
                moves.append((l, p, head_units[i], self._slot_address(loc[1], loc[2]) // UNIT, dest))
                self._inplace[l].pop(p, None)
                released.append(loc)
                self._loc[l][p] = (COMP, tuple(dest))
                moved += 1
            # an emptied chunk goes to this layer's pending list: no later layer of this pass can take it, so
            # the copies can wait for the end of the pass
            for loc in released:
                self.placement.raw_free(l, loc[1], loc[2])
        if moves:
            self._move(moves)
        return dict(moved=moved, in_place=in_place)

    def _pack_full(self, full) -> list:
        """Compress the raw slots of pages ``full`` in every layer in place and point their descriptors at the
        packed blocks. Returns the units each page-head now uses, ``[layers][n][2][kv_heads]`` ints (one device read)."""
        n, H = len(full), self.kv_heads
        self._changed.update(full)
        idx = torch.tensor(full, dtype=torch.int64, device=self.device)
        d = self.desc_all
        base = d[:, idx, :, :, 0] >> 8                                           # [L, n, 2, H]
        for kv in (0, 1):
            off = base[:, :, kv].reshape(-1).contiguous()
            meta = self._pack(self.pool, off, self.head_dim, self.layouts[kv])
            m = fmt.PageMeta.from_packed(meta, self.layouts[kv], self.head_dim)
            d[:, idx, kv] = (((off[:, None] + m.block_offsets()) << 8)
                             | meta.to(torch.int64)).reshape(self.num_layers, n, H, -1)
        comp = ((d[:, idx] >> 7) & 1).sum(-1)                                    # [L, n, 2, H] compressed blocks
        return (fmt.n_blocks(self.head_dim) * 4 - comp).tolist()

    def _head_starts(self, pieces: list, hu: torch.Tensor) -> torch.Tensor:
        """Pool unit where each page-head begins, int64 ``[n, 2H]``, for pages of page-head units ``hu`` ``[n, 2H]``
        placed in ``pieces`` (per page the :meth:`Placement.comp_alloc` pieces: the page's units in order, cut
        between page-heads)."""
        upc = self.units_per_chunk
        first = torch.tensor([p[0][2] for p in pieces], dtype=torch.int64)[:, None]     # units of the first piece
        at = torch.tensor([[c * upc + start for c, start, _ in p] + [0] * (2 - len(p)) for p in pieces],
                          dtype=torch.int64)                                                           # [n, 2]
        local = torch.cumsum(hu, -1) - hu                                       # head start in the page's units
        second = local >= first
        return torch.where(second, at[:, 1:] + local - first, at[:, :1] + local)

    def _move(self, moves):
        """Copy compressed pages (their page-heads' used prefixes) from their raw slots to their pieces and point
        their descriptors there, all in one copy. moves: ``(layer, page id, head units [2][H], src unit, pieces)``
        per page (:meth:`Placement.comp_alloc`)."""
        n, H = len(moves), self.kv_heads
        layers = torch.tensor([m[0] for m in moves], dtype=torch.int64)
        ids = torch.tensor([m[1] for m in moves], dtype=torch.int64)
        self._changed.update(m[1] for m in moves)
        hu = torch.tensor([m[2] for m in moves], dtype=torch.int64).reshape(n, 2 * H)
        src = torch.tensor([m[3] for m in moves])
        start = self._head_starts([m[4] for m in moves], hu)                        # [n, 2H] pool units
        slot_units = self.slot_bytes // UNIT
        u = torch.arange(slot_units)
        used = u < hu[..., None]                                                   # [n, 2H, slot_units]
        src_u = (src[:, None, None] + torch.arange(2 * H)[None, :, None] * slot_units + u)[used]
        dst_u = (start[..., None] + u)[used]
        units = self.pool[: self.total_bytes].view(-1, UNIT)
        units[dst_u.to(self.device)] = units[src_u.to(self.device)]
        head_src = src[:, None] * UNIT + torch.arange(2 * H) * self.slot_bytes
        shift = ((start * UNIT - head_src).reshape(n, 2, H, 1) << 8).to(self.device)
        self.desc_all[layers.to(self.device), ids.to(self.device)] += shift         # (layer, page) pairs are unique

    # ------------------------------------------------------------------ packed requests

    def pack(self, kv, *, checksum: bool = True) -> Packed:
        """Pack the full pages of a request's KV (per layer ``(k, v)`` bf16 ``[kv_heads, n, head_dim]``, the
        same ``n`` in every layer) with the packer, outside the pool: the input of :meth:`place_packed`. Check bytes
        always, and with ``checksum`` each page-head's CRC-32 (:class:`Packed`)."""
        fmt._check_flag(checksum, "checksum")
        if not isinstance(kv, (list, tuple)) or len(kv) != self.num_layers:
            raise ValueError(f"kv must hold one (k, v) pair per layer ({self.num_layers}), got "
                             f"{len(kv) if isinstance(kv, (list, tuple)) else type(kv).__name__}")
        for l, pair in enumerate(kv):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2 \
                    or not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in pair):
                raise ValueError(f"kv[{l}] must be a (k, v) pair of tensors [kv_heads, n, head_dim], got "
                                 f"{type(pair).__name__}"
                                 + (f" of {len(pair)}: {[tuple(getattr(t, 'shape', ())) for t in pair]}"
                                    if isinstance(pair, (list, tuple)) else ""))
        n_tok = kv[0][0].shape[1]
        n, H, sb = n_tok // fmt.PAGE_TOKENS, self.kv_heads, self.slot_bytes
        slots, metas, head_units, tails = [], [], [], []
        for k, v in kv:
            if k.shape != (H, n_tok, self.head_dim) or v.shape != k.shape:
                raise ValueError(f"kv: every layer's k and v must have shape {(H, n_tok, self.head_dim)}, got "
                                 f"{tuple(k.shape)} and {tuple(v.shape)}")
            if k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
                raise TypeError(f"kv: k and v must be torch.bfloat16, got {k.dtype} and {v.dtype}")
            buf = torch.zeros(n * 2 * H * sb + sb, dtype=torch.uint8, device=self.device)   # pad: see self.pool
            view = buf[: n * 2 * H * sb].view(torch.bfloat16).view(n, 2, H, sb // 2)
            for i, x in enumerate((k, v)):
                x = x[:, : n * fmt.PAGE_TOKENS].to(self.device).reshape(H, n, fmt.PAGE_TOKENS * self.head_dim).transpose(0, 1)
                view[:, i, :, self.write_index[i].reshape(-1)] = x
            off = (torch.arange(n * 2 * H, device=self.device) * sb).reshape(n, 2, H)
            meta = torch.stack([self._pack(buf, off[:, i].reshape(-1).contiguous(), self.head_dim, self.layouts[i])
                                .reshape(n, H, -1) for i in (0, 1)], 1) if n else \
                torch.zeros(0, 2, H, fmt.n_blocks(self.head_dim), dtype=torch.uint8, device=self.device)
            comp = (meta >> 7).to(torch.int64).sum(-1)                                         # [n, 2, H]
            head_units.append((fmt.n_blocks(self.head_dim) * 4 - comp).reshape(n, 2 * H).tolist())
            slots.append(buf[: n * 2 * H * sb].view(n, 2, H, sb))
            metas.append(meta)
            tails.append((k[:, n * fmt.PAGE_TOKENS:], v[:, n * fmt.PAGE_TOKENS:]))
        checks = [self._checks(m) for m in metas]
        holds_bytes = self.device.type != "meta"                # a memory on the meta device counts sizes only
        sums = [self._checksums(s, m) for s, m in zip(slots, metas)] if checksum and holds_bytes else None
        return Packed(n_tok, n, slots, metas, head_units, tails, checks, sums)

    def _checks(self, meta: torch.Tensor) -> torch.Tensor:
        """Check bytes of metadata bytes uint8 ``[n, 2, kv_heads, n_blocks]`` (keys with the K layout, values with V's)."""
        return torch.stack([fmt.meta_check(meta[:, i].contiguous(), self.layouts[i], self.head_dim) for i in (0, 1)], 1)

    def _checksums(self, slots: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        """CRC-32 of each page-head's used bytes: slots uint8 ``[n, 2, kv_heads, slot_bytes]`` -> int64 ``[n, 2, kv_heads]``."""
        return torch.stack([fmt.page_checksum(slots[:, i], fmt.PageMeta.from_packed(meta[:, i], self.layouts[i],
                                                                                    self.head_dim)) for i in (0, 1)], 1)

    def export(self, ids: list[int], tokens: int, *, checksum: bool = True) -> Packed:
        """Copy a request's cached KV out of the pool (offload, transfer, swap): a :class:`Packed` of its full pages
        ``ids[: tokens // 16]`` as each layer stores them (compressed or raw blocks; descriptors checked first,
        :func:`zipkv.paged.check_descriptors`), with check bytes and, with ``checksum``, CRC-32s taken here, and the
        partial last page's tokens as ``tail``. The pool is not changed; :meth:`place_packed` takes it back."""
        from zipkv import paged                                     # paged imports format only: no import circle

        fmt._check_flag(checksum, "checksum")
        n, rest = divmod(tokens, fmt.PAGE_TOKENS)
        full = torch.tensor(ids[:n], dtype=torch.int64, device=self.device)
        nb, at = fmt.n_blocks(self.head_dim), torch.arange(self.slot_bytes, device=self.device)
        slots, metas, head_units, tails = [], [], [], []
        for l in range(self.num_layers):
            cache = paged.PagedKVCache(self.pool, self.desc[l], self.head_dim, *self.layouts)
            paged.check_descriptors(cache, full)                    # addresses inside the pool, back to back, no overlap
            d = self.desc[l][full]                                  # [n, 2, H, nb]
            meta = (d & 0xFF).to(torch.uint8)
            size = torch.where(((d >> 7) & 1).bool(), fmt.PACKED_BLOCK_BYTES, fmt.RAW_BLOCK_BYTES).sum(-1)
            idx = ((d[..., 0] >> 8)[..., None] + at).clamp(0, self.pool.numel() - 1)
            slots.append(torch.where(at < size[..., None], self.pool[idx], 0).to(torch.uint8))
            metas.append(meta)
            head_units.append((nb * 4 - (meta >> 7).to(torch.int64).sum(-1)).reshape(n, 2 * self.kv_heads).tolist())
            if rest:
                k, v = cache.read_pages(torch.tensor(ids[n: n + 1], device=self.device), validate=True)
                tails.append((k[0, :, :rest].contiguous(), v[0, :, :rest].contiguous()))
            else:
                empty = torch.empty(self.kv_heads, 0, self.head_dim, dtype=torch.bfloat16, device=self.device)
                tails.append((empty, empty.clone()))
        checks = [self._checks(m) for m in metas]
        sums = [self._checksums(x, m) for x, m in zip(slots, metas)] if checksum else None
        return Packed(tokens, n, slots, metas, head_units, tails, checks, sums)

    def check_packed(self, packed) -> None:
        """``packed`` must come from :meth:`pack` of a memory of this one's shape (layers, KV heads, head_dim): types and
        shapes only, no values read (:meth:`verify_packed` reads them)."""
        if not isinstance(packed, Packed):
            raise TypeError(f"packed must be a KVMemory.pack result (Packed), got {type(packed).__name__}")
        if isinstance(packed.tokens, bool) or not isinstance(packed.tokens, int) or packed.tokens < 1 \
                or packed.n_pages != packed.tokens // fmt.PAGE_TOKENS:
            raise ValueError(f"packed.tokens and packed.n_pages must be ints with n_pages = tokens // "
                             f"{fmt.PAGE_TOKENS} (its full pages), got tokens={packed.tokens!r}, "
                             f"n_pages={packed.n_pages!r}")
        want = (packed.n_pages, 2, self.kv_heads, fmt.n_blocks(self.head_dim))
        for name in ("meta", "slots", "head_units", "tail", "check", "checksum"):
            per_layer = getattr(packed, name)
            if per_layer is None and name in ("check", "checksum"):
                continue
            if not isinstance(per_layer, (list, tuple)) or len(per_layer) != self.num_layers:
                raise ValueError(f"packed.{name} must hold one entry per layer ({self.num_layers}), got "
                                 f"{len(per_layer) if isinstance(per_layer, (list, tuple)) else type(per_layer).__name__}")
        for l in range(self.num_layers):
            for name, dtype, shape in (("meta", torch.uint8, want), ("check", torch.uint8, want),
                                       ("checksum", torch.int64, want[:3]),
                                       ("slots", torch.uint8, (*want[:3], self.slot_bytes))):
                t = None if getattr(packed, name) is None else getattr(packed, name)[l]
                if t is None and name in ("check", "checksum"):
                    continue
                if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape:
                    raise ValueError(f"packed.{name}[{l}] must be a {dtype} tensor of shape {shape} (kv_heads="
                                     f"{self.kv_heads}, head_dim={self.head_dim}), got {getattr(t, 'dtype', type(t).__name__)} "
                                     f"{tuple(getattr(t, 'shape', ()))}: packed by another memory?")
            rest = (self.kv_heads, packed.tokens - packed.n_pages * fmt.PAGE_TOKENS, self.head_dim)
            pair = packed.tail[l]
            if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not all(
                    isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and tuple(t.shape) == rest for t in pair):
                got = ([f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}" for t in pair]
                       if isinstance(pair, (list, tuple)) else type(pair).__name__)
                raise ValueError(f"packed.tail[{l}] must be (k, v), bf16 tensors of shape {rest} each (the tokens after "
                                 f"the full pages), got {got}")
        for l in range(self.num_layers):
            if tuple(packed.meta[l].shape) != want or tuple(packed.slots[l].shape) != (*want[:3], self.slot_bytes):
                raise ValueError(f"packed, layer {l}: metadata {tuple(packed.meta[l].shape)} and slots "
                                 f"{tuple(packed.slots[l].shape)}, expected {want} and {(*want[:3], self.slot_bytes)} "
                                 f"(kv_heads={self.kv_heads}, head_dim={self.head_dim}): packed by another memory?")

    def verify_packed(self, packed: Packed) -> None:
        """``ValueError`` naming the layer, page, KV head and block unless every metadata byte of ``packed`` matches its
        check byte (raw blocks' base bits 0) and, where it has checksums, every page-head's used bytes their CRC-32
        (one device sync per layer and check). A ``packed`` without check bytes gets the structural checks of the
        metadata only; on a memory on the meta device (sizes, no bytes) only the shapes are checked."""
        self.check_packed(packed)
        if self.device.type == "meta":                          # sizes only: no bytes to verify
            return
        for l in range(self.num_layers):
            for i, part in enumerate(("keys", "values")):
                name = f"packed, layer {l}, {part}"
                meta = packed.meta[l][:, i]
                m = fmt.PageMeta.from_packed(meta, self.layouts[i], self.head_dim,
                                             None if packed.check is None else packed.check[l][:, i])
                fmt.check_meta(m, name)
                if packed.check is not None:
                    fmt._check_against(m, meta, name)                # raw blocks' base bits too
                if packed.checksum is not None:
                    fmt.verify_checksum(packed.slots[l][:, i], packed.checksum[l][:, i], m, f"{name} ([page, kv head])")

    def _alloc_packed(self, layer: int, ids, head_units, outstanding: int) -> list:
        """Compressed-chunk room in ``layer`` for pages ``ids`` of ``head_units`` units each, recorded as their
        locations; the pieces, in order. The caller checked they fit."""
        pieces = []
        for p, hu in zip(ids, head_units):
            where = self.placement.comp_alloc(layer, hu, outstanding)
            if where is None:
                raise RuntimeError("KVMemory: no room for a packed page although the check passed (internal error)")
            self._loc[layer][p] = (COMP, tuple(where))
            pieces.append(where)
        return pieces

    def place_packed(self, packed: Packed, outstanding: int) -> list[int]:
        """Take page ids for ``packed``'s full pages and place them in compressed chunks of each layer
        (:meth:`Placement.comp_alloc`, keeping room for the ``outstanding`` reserved pages), their bytes copied in and
        their descriptors written. The caller checked they fit (:meth:`Placement.new_comp_chunks`)."""
        n, H = packed.n_pages, self.kv_heads
        ids = [self._free_ids.pop() for _ in range(n)]
        slot_units = self.slot_bytes // UNIT
        for l in range(self.num_layers):
            pieces = self._alloc_packed(l, ids, packed.head_units[l], outstanding)
            if not n:
                continue
            meta = packed.meta[l]
            hu = torch.tensor(packed.head_units[l], dtype=torch.int64)                   # [n, 2H]
            start = self._head_starts(pieces, hu)                                       # [n, 2H] pool units
            u = torch.arange(slot_units)
            used = u < hu[..., None]                                                   # [n, 2H, slot_units]
            src_u = ((torch.arange(n)[:, None, None] * 2 * H + torch.arange(2 * H)[None, :, None]) * slot_units + u)[used]
            dst_u = (start[..., None] + u)[used]
            units = self.pool[: self.total_bytes].view(-1, UNIT)
            units[dst_u.to(self.device)] = packed.slots[l].reshape(-1, UNIT)[src_u.to(self.device)]
            head = (start * UNIT).reshape(n, 2, H, 1).to(self.device)
            offsets = fmt.PageMeta.from_packed(meta, self.layouts[0], self.head_dim).block_offsets()   # layout-free
            self.desc[l][torch.tensor(ids, device=self.device)] = ((head + offsets) << 8) | meta.to(torch.int64)
        self._changed.update(ids)
        return ids
