"""The cross-layer KV memory manager: chunks, pages, compression migration, admission, retraction
(ZipFusion §II-C, §III-D).

Memory model
------------
* One uint8 byte ``pool`` (the KV budget) is cut into **chunks** of ``pages_per_chunk`` raw pages. A *page*
  is 16 tokens of one layer, keys and values of every KV head: ``2 * kv_heads`` page-heads of
  ``zipkv.format.page_bytes(head_dim)`` bytes each, laid out as :mod:`zipkv.format` packs them.
* A chunk is **free** (in the pool shared by all layers), **owned** by one layer -- as a *raw* chunk
  (fixed slots of one raw page) or a *compressed* chunk (variable extents of compressed pages, in
  256-byte units; a page that no free extent holds whole may end one chunk and begin the next, cut between
  page-heads: :meth:`KVMemory._comp_alloc`) -- or **pending**: emptied by its layer and waiting for the
  attention reads that may still touch it. :meth:`KVMemory.reads_done` returns pending chunks to the pool;
  only then can another layer take them (a chunk *reassigned*). Its own layer may take a pending chunk back at once.
* **Page ids are logical and shared by all layers**: a request's j-th page has the same id in every
  layer, so the page table -- FlashInfer's CSR ``indptr``, ``indices``, ``last_page_len`` (int32),
  :meth:`KVMemory.page_table` -- is the same array for every layer; where the page's bytes are differs per
  layer and lives in that layer's descriptor tensor ``desc[layer]`` (int64 ``[max_pages, 2, kv_heads,
  n_blocks]``, ``byte_address << 8 | flag << 7 | b >> 1`` per block, the format of
  ``zipkv.kernels.decode_attention.PagedKVCache``). ``PagedKVCache(memory.pool, memory.desc[layer], ...)``
  is layer ``layer``'s cache for the kernel: moving or compressing a page rewrites its descriptors, never
  its id, so the page table stays valid.
* A page is **raw while it fills** (decoding appends in place, :meth:`write_tokens`). When it is full it
  is queued; :meth:`compress` -- called once the reads of the step that filled it are done -- packs it
  in place, then moves it into a compressed chunk of its layer when a destination is free (the raw
  slot is released) or leaves it compressed **in place** (it keeps its raw slot; a later
  :meth:`compress` moves it when room appears). A compressed chunk is taken from the pool only for at
  least a chunk's worth of pages to move (their raw slots give back what the chunk takes in that layer) and
  only when the capacity left still covers every reservation.
* A request may also **hold** whole chunks of the pool (``admit(..., hold_chunks=n)``) for bytes kept on its
  behalf outside the pages -- the engine's restore-before-attention baselines keep a compressed prefix as a
  codec payload -- so that one budget counts every method's bytes. They return to the pool with the request
  (after :meth:`reads_done`).

Admission and capacity (SGLang vocabulary)
------------------------------------------
Capacity is counted in **uncompressed pages across all layers** (:meth:`capacity_pages`): the number of
new logical pages that could be written raw now, each needing a raw slot in *every* layer -- from the
layer's raw chunks, its pending chunks, or the shared pool. It grows as compression empties raw chunks.
A request whose full pages arrive already packed (a pre-compressed prefix: :meth:`pack`,
:meth:`admit_packed`) is counted at their packed size: they go into compressed chunks of each layer as
:meth:`KVMemory._comp_alloc` places a page, and admission checks that the capacity left after the chunks they need
still covers its raw last page, its reservation and every outstanding one (:meth:`KVMemory.chunks_short`: how many
chunks a request that does not fit lacks).
:meth:`admit` (SGLang's ``PrefillAdder.add_one_req`` + ``alloc``) takes a request only if
``capacity_pages() - outstanding`` covers its prompt pages plus a *reservation* of
``ceil(reserve_ratio * pages it can still grow by)``; ``outstanding`` is the sum of running requests'
unused reservations. With ``reserve_ratio=1`` (default) an admitted request can always grow to its
output length: no operation lowers the capacity below the outstanding reservations (allocating a
reserved page lowers both by one; compression takes a chunk only when that still holds; freeing and
:meth:`reads_done` only raise capacity). With ``reserve_ratio < 1`` (SGLang's ``new_token_ratio``) more
requests fit and :meth:`alloc` can fail: it then returns ``None`` and changes nothing (never a silent
overwrite), and the caller retracts a request with :meth:`retract` -- SGLang's ``retract_decode`` order:
the request with the fewest decoded tokens, ties broken by the longest prompt -- which frees its pages.

Mapping onto serving engines
----------------------------
* SGLang ``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator``: ``alloc(need_size)`` ->
  :meth:`alloc` (per request, in tokens, returns the new page ids or ``None``); ``free(indices)`` ->
  :meth:`free` (a request's pages); ``available_size()`` -> :meth:`available_size` (tokens that can still
  be promised: capacity minus outstanding reservations). The per-layer ``k_buffer[layer]`` /
  ``v_buffer[layer]`` become ``pool`` + ``desc[layer]``.
* SGLang ``PrefillAdder``: ``rem_total_tokens`` (free minus running requests' ``max_new_tokens``
  scaled by ``new_token_ratio``) is ``available_size()`` with ``reserve_ratio``; ``add_one_req`` is
  :meth:`can_admit` + :meth:`admit`; ``ScheduleBatch.retract_decode`` is :meth:`retract`.
* vLLM ``KVCacheManager``: ``allocate_slots(request, num_new_tokens)`` -> :meth:`alloc`,
  ``free(request)`` -> :meth:`free`, ``get_num_free_blocks`` -> :meth:`capacity_pages`; a block is a page.
  vLLM's preemption (recompute) is :meth:`retract` + re-admission.
"""
from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass, field

import torch

from zipkv import format as fmt

__all__ = ["KVMemory", "Packed", "free_extent", "pack_slots_reference", "UNIT"]

UNIT = 256
"""Address granularity of the descriptors (a compressed block is 3 units, a raw one 4)."""

FREE, OWNED, PENDING, HELD = "free", "owned", "pending", "held"
RAW, COMP = "raw", "comp"


@dataclass
class _Chunk:
    state: str = FREE
    layer: int = -1                   # owner (owned / pending) or last owner (free)
    kind: str = ""                    # RAW or COMP while owned
    free_slots: list = field(default_factory=list)    # RAW: free slot numbers
    extents: list = field(default_factory=list)       # COMP: free [start_unit, n_units], sorted
    live: int = 0                     # pages stored


@dataclass
class _Request:
    prompt_len: int
    max_len: int                      # most tokens the cache will hold: prompt + max_new_tokens - 1
    pages: list
    cache_len: int
    reserved: int                     # pages promised and not yet allocated
    held: list = field(default_factory=list)   # chunks held for the request's bytes kept elsewhere
    serial: int = 0                   # admission number: tells a re-admitted request from its earlier self


@dataclass
class Packed:
    """A request's cached KV with its full pages packed before admission (:meth:`KVMemory.pack`).

    tokens: cached tokens; n_pages: full pages packed; slots: per layer uint8 ``[n_pages, 2, kv_heads,
    slot_bytes]`` (each page-head packed at the start of its slot); meta: per layer uint8 ``[n_pages, 2,
    kv_heads, n_blocks]``; head_units: per layer and page the sizes of its ``2 * kv_heads`` page-heads (keys, then
    values) in :data:`UNIT` s; tail: per layer ``(k, v)`` bf16 ``[kv_heads, tokens - 16 n_pages, head_dim]`` (the last,
    partial page, written raw)."""
    tokens: int
    n_pages: int
    slots: list
    meta: list
    head_units: list
    tail: list

    @functools.cached_property
    def units(self) -> list:
        """Per layer the pages' sizes in :data:`UNIT` s (their page-heads' sum)."""
        return [[sum(h) for h in layer] for layer in self.head_units]


def free_extent(extents: list[list[int]], start: int, n: int) -> list[list[int]]:
    """Free list ``extents`` (``[start, length]`` runs) with ``[start, n]`` returned to it, adjacent runs merged."""
    ext = sorted(extents + [[start, n]])
    merged = [ext[0]]
    for s, k in ext[1:]:
        if merged[-1][0] + merged[-1][1] == s:
            merged[-1][1] += k
        else:
            merged.append([s, k])
    return merged


def _head_cut(head_units, room: int) -> int:
    """Units of the longest run of whole page-heads, from a page's first, that fits ``room`` units."""
    cut = 0
    for u in head_units:
        if cut + u > room:
            break
        cut += u
    return cut


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


_PROBE = object()
"""The request id admission checks use for a request that is not admitted (no caller's id can equal it)."""


def _is_int(x) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _pages_for(tokens: int) -> int:
    return -(-tokens // fmt.PAGE_TOKENS)


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


class KVMemory:
    """Chunked, cross-layer KV pool with compression migration and admission (module docstring).

    num_layers, kv_heads, head_dim: the model's KV shape. kv_budget_bytes: bytes of the pool (whole
    chunks are used; the rest is left out). pages_per_chunk: raw pages per chunk (lowered when the budget
    holds fewer than one chunk per layer). k_layout / v_layout: block arrangements (``zipkv.format``).
    pack_slots: ``f(pool, offsets, head_dim, layout) -> meta`` compressing raw slots in place (default
    :func:`pack_slots_reference`; the engine passes the Triton pack kernel on the GPU). extra_bytes,
    extra_pages: a region of ``extra_bytes`` after the budget's chunks (at :attr:`extra_offset` of
    ``pool``) and ``extra_pages`` descriptor rows after the ``max_pages`` the memory allocates, both for
    the caller (the engine's restore buffer, whose pages the kernel reads through the same ``desc``);
    they are not part of ``kv_budget_bytes``.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, kv_budget_bytes: int, *,
                 pages_per_chunk: int = 16, k_layout: str = "token", v_layout: str = "token",
                 device="cpu", pack_slots=None, extra_bytes: int = 0, extra_pages: int = 0):
        for name, x in (("num_layers", num_layers), ("kv_heads", kv_heads), ("pages_per_chunk", pages_per_chunk)):
            if not _is_int(x) or x < 1:
                raise ValueError(f"{name} must be a positive int, got {x!r}")
        fmt._check_head_dim(head_dim)
        for name, lay in (("k_layout", k_layout), ("v_layout", v_layout)):
            fmt._check_layout(lay, name)
            fmt._check_layout_head_dim(lay, head_dim, name)
        if not _is_int(kv_budget_bytes):
            raise TypeError(f"kv_budget_bytes must be an int, got {type(kv_budget_bytes).__name__}")
        for name, x in (("extra_bytes", extra_bytes), ("extra_pages", extra_pages)):
            if not _is_int(x) or x < 0:
                raise ValueError(f"{name} must be an int >= 0, got {x!r}")
        num_layers, kv_heads, pages_per_chunk, kv_budget_bytes = map(int, (num_layers, kv_heads, pages_per_chunk,
                                                                           kv_budget_bytes))
        extra_bytes, extra_pages = int(extra_bytes), int(extra_pages)
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.layouts = (k_layout, v_layout)
        self.slot_bytes = fmt.page_bytes(head_dim)                       # one page-head
        self.page_bytes = 2 * kv_heads * self.slot_bytes                  # one page of one layer, raw
        per_layer = kv_budget_bytes // (num_layers * self.page_bytes)
        if per_layer < 1:
            raise ValueError(f"kv_budget_bytes={kv_budget_bytes} is smaller than one page per layer "
                             f"({num_layers} layers x {self.page_bytes} bytes = {num_layers * self.page_bytes})")
        self.pages_per_chunk = min(pages_per_chunk, per_layer)
        self.chunk_bytes = self.pages_per_chunk * self.page_bytes
        self.num_chunks = kv_budget_bytes // self.chunk_bytes
        self.total_bytes = self.num_chunks * self.chunk_bytes
        self.units_per_chunk = self.chunk_bytes // UNIT
        self.device = torch.device(device)
        nb = fmt.n_blocks(head_dim)
        min_page_units = 2 * kv_heads * nb * fmt.PACKED_BLOCK_BYTES // UNIT
        self.max_pages = self.total_bytes // UNIT // (num_layers * min_page_units) + 1
        # pad: the pack kernel checks a whole slot fits after each offset
        self.extra_offset = self.total_bytes + self.slot_bytes
        self.pool = torch.zeros(self.extra_offset + extra_bytes, dtype=torch.uint8, device=self.device)
        # one tensor for every layer's descriptors: a step's compression reads and writes all layers in one op
        self._desc_all = torch.zeros(num_layers, self.max_pages + extra_pages, 2, kv_heads, nb, dtype=torch.int64,
                                     device=self.device)
        self._desc = list(self._desc_all)                                 # per layer views
        self._new_rows: list = []                                         # (page id, raw slot address per layer)
        self._changed: set = set()                                        # page ids whose descriptors changed
        self._pack = pack_slots or pack_slots_reference
        self._chunks = [_Chunk() for _ in range(self.num_chunks)]
        self._free_chunks = {-1: list(range(self.num_chunks - 1, -1, -1))}  # free chunks by last owner
        self._n_free = self.num_chunks
        self._raw_open = [dict() for _ in range(num_layers)]               # raw chunks with a free slot
        self._comp = [dict() for _ in range(num_layers)]                   # compressed chunks
        self._comp_open = [dict() for _ in range(num_layers)]              # ... with room for a page
        self._comp_last = [None] * num_layers                              # the compressed chunk taken last
        self._min_page_units = 2 * kv_heads * fmt.n_blocks(head_dim) * fmt.PACKED_BLOCK_BYTES // UNIT
        self._pending = [[] for _ in range(num_layers)]
        self._held_pending = []                                            # held chunks let go, before reads_done
        self._raw_free = [0] * num_layers                                 # free slots in owned raw chunks
        self._used = [0] * num_layers
        self._loc = [dict() for _ in range(num_layers)]                   # page id -> location
        self._free_ids = list(range(self.max_pages - 1, -1, -1))
        self._full: list = []                                             # full raw pages awaiting compress
        self._inplace = [dict() for _ in range(num_layers)]               # compressed in place: page id -> units [2][H]
        self.requests: dict = {}
        self.admitted = 0
        self.reassigned = 0
        self.space_returns = 0
        """Operations so far that gave space back (a raw slot, a compressed extent, a reservation, pending chunks to
        the pool). Nothing else makes room, so an admission check that failed fails again until this count moves
        (the engine retries a blocked request only then, :meth:`zipkv.engine.Engine.generate`)."""
        head = torch.arange(2 * kv_heads, device=self.device).reshape(2, kv_heads) * self.slot_bytes
        self._raw_offsets = (head[..., None] + fmt.RAW_BLOCK_BYTES * torch.arange(nb, device=self.device))
        self._write_index = torch.stack([self._slot_positions(lay) for lay in self.layouts])   # [2, 16, D]
        self.max_request_pages = self.capacity_pages()

    # ------------------------------------------------------------------ capacity

    def _slot_positions(self, layout):
        """int64 ``[16, head_dim]``: bf16 index inside a raw page-head slot of each (token, channel)
        (:func:`zipkv.format.raw_index`: where a raw block stores each position)."""
        nb = fmt.n_blocks(self.head_dim)
        pos = torch.arange(nb)[:, None] * fmt.BLOCK_VALUES + fmt.raw_index(layout)
        return fmt.from_blocks(pos, layout, self.head_dim).to(self.device)

    def _layer_free_slots(self, layer):
        return self._raw_free[layer] + self.pages_per_chunk * len(self._pending[layer])

    def _capacity(self, free_slots, free_chunks):
        ppc = self.pages_per_chunk
        lo, hi = 0, min(free_slots) + free_chunks * ppc
        while lo < hi:
            mid = (lo + hi + 1) // 2
            need = sum(-(-(mid - f) // ppc) for f in free_slots if mid > f)
            lo, hi = (mid, hi) if need <= free_chunks else (lo, mid - 1)
        return lo

    def capacity_pages(self) -> int:
        """New logical pages that fit raw now: a raw slot in every layer (own free slots, own pending
        chunks, then chunks of the shared pool)."""
        return self._capacity([self._layer_free_slots(l) for l in range(self.num_layers)], self._n_free)

    @property
    def outstanding(self) -> int:
        """Pages promised to running requests and not yet allocated."""
        return sum(r.reserved for r in self.requests.values())

    def available_size(self) -> int:
        """Tokens that can still be promised to new requests (SGLang's ``available_size``)."""
        return max(0, self.capacity_pages() - self.outstanding) * fmt.PAGE_TOKENS

    # ------------------------------------------------------------------ chunks and slots

    def _take_chunk(self, layer, kind):
        """An empty chunk for ``layer``: its own pending chunk, else one from the pool (its last owner's
        first). None if there is none."""
        if self._pending[layer]:
            c = self._pending[layer].pop()
        elif self._n_free:
            owner = next(o for o in (layer, -1, *self._free_chunks) if self._free_chunks.get(o))
            c = self._free_chunks[owner].pop()
            self._n_free -= 1
            if owner not in (-1, layer):
                self.reassigned += 1
        else:
            return None
        ch = self._chunks[c]
        ch.state, ch.layer, ch.kind, ch.live = OWNED, layer, kind, 0
        if kind == RAW:
            ch.free_slots = list(range(self.pages_per_chunk - 1, -1, -1))
            ch.extents = []
            self._raw_open[layer][c] = None
            self._raw_free[layer] += self.pages_per_chunk
        else:
            ch.free_slots, ch.extents = [], [[0, self.units_per_chunk]]
            self._comp[layer][c] = None
            self._comp_open[layer][c] = None
        return c

    def _release_chunk(self, c):
        ch = self._chunks[c]
        l = ch.layer
        if ch.kind == RAW:
            del self._raw_open[l][c]
            self._raw_free[l] -= self.pages_per_chunk
        else:
            del self._comp[l][c]
            self._comp_open[l].pop(c, None)
        ch.state, ch.kind, ch.free_slots, ch.extents = PENDING, "", [], []
        self._pending[l].append(c)

    def _raw_alloc(self, layer):
        if not self._raw_open[layer] and self._take_chunk(layer, RAW) is None:
            raise RuntimeError("KVMemory: no raw slot although the capacity check passed (internal error)")
        c = next(iter(self._raw_open[layer]))
        ch = self._chunks[c]
        s = ch.free_slots.pop()
        ch.live += 1
        self._raw_free[layer] -= 1
        if not ch.free_slots:
            del self._raw_open[layer][c]
        self._used[layer] += self.page_bytes
        return c, s

    def _raw_free_slot(self, layer, c, s):
        ch = self._chunks[c]
        ch.free_slots.append(s)
        ch.live -= 1
        self._raw_free[layer] += 1
        self.space_returns += 1
        self._raw_open[layer][c] = None
        self._used[layer] -= self.page_bytes
        if ch.live == 0:
            self._release_chunk(c)

    def _comp_alloc(self, layer, head_units, new_chunk=True):
        """Room in ``layer`` for a compressed page whose page-heads take ``head_units`` units (in their order in
        the page): the pieces ``[(chunk, start unit, units)]`` it goes to, or None. The whole page first fit in
        the layer's open chunks; else, where a new chunk may be taken, the page's first page-heads fill the largest
        free extent of the chunk this layer took last (the end of a chunk that no whole page fits, which first fit
        alone leaves unused) and the rest starts the new chunk. A page-head is never cut: each block's descriptor
        holds its own address, so the kernels read a page of two pieces as any other. On the throughput chapter's
        Llama-3.1-8B-shape prefixes (real-KV pages of about 201 units, chunks of 4096; 57 requests of 8192 tokens
        admitted packed, CPU, 2026-12-05) first fit alone used 98.3 % of the compressed chunks' bytes and this
        99.8 %: 696 chunks fewer, 1.4 % of the budget."""
        units = sum(head_units)
        for c in self._comp_open[layer]:
            for e in self._chunks[c].extents:
                if e[1] >= units:
                    return [self._carve(c, e, units)]
        if not new_chunk:
            return None
        # a new compressed chunk only if the capacity left still covers every reservation
        free = [self._layer_free_slots(l) for l in range(self.num_layers)]
        if self._pending[layer]:
            free[layer] -= self.pages_per_chunk
            n_free = self._n_free
        elif self._n_free:
            n_free = self._n_free - 1
        else:
            return None
        if units > self.units_per_chunk or self._capacity(free, n_free) < self.outstanding:
            return None
        tail = self._spill_extent(layer)
        cut = _head_cut(head_units, tail[1][1]) if tail else 0
        pieces = [self._carve(tail[0], tail[1], cut)] if cut else []
        c = self._take_chunk(layer, COMP)
        self._comp_last[layer] = c
        return pieces + [self._carve(c, self._chunks[c].extents[0], units - cut)]

    def _spill_extent(self, layer):
        """``(chunk, extent)``: the largest free extent of the compressed chunk ``layer`` took last, None if that
        chunk is no longer its compressed chunk or is full."""
        c = self._comp_last[layer]
        ch = self._chunks[c] if c is not None else None
        if ch is None or ch.state != OWNED or ch.layer != layer or ch.kind != COMP or not ch.extents:
            return None
        return c, max(ch.extents, key=lambda e: e[1])

    def _room_for(self, layer, units, pages) -> bool:
        """Whether :meth:`_comp_alloc` might place a page of ``units`` in ``layer`` during a :meth:`compress` pass
        over ``pages`` in-place pages and nothing new (a superset of its success: False means it returns None)."""
        if any(e[1] >= units for c in self._comp_open[layer] for e in self._chunks[c].extents):
            return True
        return pages >= self.pages_per_chunk and (self._n_free > 0 or bool(self._pending[layer]))

    def _carve(self, c, extent, units):
        start = extent[0]
        extent[0] += units
        extent[1] -= units
        ch = self._chunks[c]
        if extent[1] == 0:
            ch.extents.remove(extent)
        if max((n for _, n in ch.extents), default=0) < self._min_page_units:
            self._comp_open[ch.layer].pop(c, None)
        ch.live += 1
        return c, start, units

    def _comp_free(self, layer, c, start, units):
        ch = self._chunks[c]
        ch.live -= 1
        self._used[layer] -= units * UNIT
        self.space_returns += 1
        ch.extents = merged = free_extent(ch.extents, start, units)
        if max(n for _, n in merged) >= self._min_page_units:
            self._comp_open[layer][c] = None
        if ch.live == 0:
            self._release_chunk(c)

    def reads_done(self) -> None:
        """The attention reads issued so far are finished: pending chunks go back to the shared pool,
        where any layer can take them."""
        if any(self._pending) or self._held_pending:
            self.space_returns += 1
        for l in range(self.num_layers):
            for c in self._pending[l]:
                self._chunks[c].state = FREE
                self._free_chunks.setdefault(l, []).append(c)
            self._n_free += len(self._pending[l])
            self._pending[l] = []
        for c in self._held_pending:
            self._chunks[c].state = FREE
            self._free_chunks.setdefault(-1, []).append(c)
        self._n_free += len(self._held_pending)
        self._held_pending = []

    # ------------------------------------------------------------------ pages

    def _slot_address(self, c, s):
        return c * self.chunk_bytes + s * self.page_bytes

    def _new_pages(self, n):
        """Take ``n`` page ids with a raw slot in every layer. Their descriptors are written later, all of a
        step's new pages at once (:meth:`flush_pages`): one write for all layers instead of one per page and layer."""
        ids = [self._free_ids.pop() for _ in range(n)]
        for p in ids:
            addr = []
            for l in range(self.num_layers):
                c, s = self._raw_alloc(l)
                self._loc[l][p] = (RAW, c, s)
                addr.append(self._slot_address(c, s))
            self._new_rows.append((p, addr))
        return ids

    def flush_pages(self) -> None:
        """Write the descriptors of the pages allocated since the last flush (raw slots), one indexed write for
        all layers. Reading :attr:`desc` flushes first; the engine flushes once per step, after its allocations."""
        if not self._new_rows:
            return
        rows = dict(self._new_rows)               # a page id freed and taken again since: its latest slot
        self._new_rows = []
        self._changed.update(rows)
        idx = to_device(torch.tensor(list(rows), dtype=torch.int64), self.device)
        addr = to_device(torch.tensor(list(rows.values()), dtype=torch.int64).T.contiguous(), self.device)   # [L, n]
        self._desc_all[:, idx] = (addr[:, :, None, None, None] + self._raw_offsets) << 8

    def changed_pages(self) -> list:
        """Sorted ids of the pages whose descriptors this memory changed (in any layer) since the last call; the
        record is cleared. The engine recomputes the kernels' page kinds of these pages only."""
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
        """Per layer the block descriptors ``int64 [pages, 2, kv_heads, blocks]`` (``zipkv.format``), shared with
        the kernels' caches; pending new pages are written first (:meth:`flush_pages`)."""
        self.flush_pages()
        return self._desc

    def _free_page(self, p):
        for l in range(self.num_layers):
            loc = self._loc[l].pop(p)
            if loc[0] == COMP:
                for c, start, units in loc[1]:
                    self._comp_free(l, c, start, units)
            else:
                self._inplace[l].pop(p, None)
                self._raw_free_slot(l, loc[1], loc[2])
        self._free_ids.append(p)

    # ------------------------------------------------------------------ requests (SGLang vocabulary)

    def _check_new(self, rid, prompt_len, max_new_tokens, reserve_ratio):
        try:
            hash(rid)
        except TypeError:
            raise TypeError(f"rid must be a hashable request id (a str or an int), got {type(rid).__name__}") from None
        if rid in self.requests:
            raise ValueError(f"request {rid!r} is already running")
        if not _is_int(prompt_len) or prompt_len < 1:
            raise ValueError(f"prompt_len must be an int >= 1 (an empty prompt has nothing to attend to), got {prompt_len!r}")
        if not _is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if isinstance(reserve_ratio, bool) or not isinstance(reserve_ratio, numbers.Real) or not 0.0 < reserve_ratio <= 1.0:
            raise ValueError(f"reserve_ratio must be a number in (0, 1], got {reserve_ratio!r}")
        prompt_len, max_new_tokens = int(prompt_len), int(max_new_tokens)
        need = _pages_for(prompt_len + max_new_tokens - 1)
        if need > self.max_request_pages:
            raise ValueError(f"request {rid!r}: {prompt_len} prompt + {max_new_tokens} new tokens need {need} pages "
                             f"per layer, but the budget ({self.total_bytes} bytes) holds at most "
                             f"{self.max_request_pages} uncompressed pages per layer for one request")
        prompt_pages = _pages_for(prompt_len)
        return prompt_pages, math.ceil(reserve_ratio * (need - prompt_pages))

    def _check_hold(self, prompt_len, max_new_tokens, hold_chunks):
        """A request that holds ``hold_chunks`` chunks must fit, with them, into the empty budget: else it never will."""
        if not _is_int(hold_chunks) or hold_chunks < 0:
            raise ValueError(f"hold_chunks must be an int >= 0, got {hold_chunks!r}")
        need = _pages_for(prompt_len + max_new_tokens - 1)
        if hold_chunks and (hold_chunks > self.num_chunks
                            or self._capacity([0] * self.num_layers, self.num_chunks - hold_chunks) < need):
            raise ValueError(f"hold_chunks={hold_chunks}: with {need} pages per layer for {prompt_len} prompt + "
                             f"{max_new_tokens} new tokens, the request never fits the budget's {self.num_chunks} "
                             f"chunks of {self.pages_per_chunk} pages")

    def _fits(self, prompt_pages, reserve, hold_chunks):
        if hold_chunks > self._n_free:
            return False
        free = [self._layer_free_slots(l) for l in range(self.num_layers)]
        return self._capacity(free, self._n_free - hold_chunks) - self.outstanding >= prompt_pages + reserve

    def can_admit(self, prompt_len: int, max_new_tokens: int, *, reserve_ratio: float = 1.0,
                  hold_chunks: int = 0) -> bool:
        """Whether :meth:`admit` would take this request now (SGLang ``PrefillAdder``'s budget check)."""
        prompt_pages, reserve = self._check_new(_PROBE, prompt_len, max_new_tokens, reserve_ratio)
        self._check_hold(prompt_len, max_new_tokens, hold_chunks)
        return self._fits(prompt_pages, reserve, hold_chunks)

    def admit(self, rid, prompt_len: int, max_new_tokens: int, *, reserve_ratio: float = 1.0, hold_chunks: int = 0):
        """Admit request ``rid``: allocate raw pages for its ``prompt_len`` cached tokens (in every layer)
        and reserve ``ceil(reserve_ratio * remaining pages)`` for its growth to ``prompt_len +
        max_new_tokens - 1`` cached tokens. Returns the prompt's page ids, or ``None`` (nothing changed)
        when it does not fit now. Raises ``ValueError`` for input it could never take.

        hold_chunks: whole chunks of the shared pool the request also holds until it is freed, for bytes
        the caller keeps on its behalf outside the pages (a restore-before-attention codec's payload of a
        compressed prefix: the budget counts it, rounded up to chunks)."""
        prompt_pages, reserve = self._check_new(rid, prompt_len, max_new_tokens, reserve_ratio)
        self._check_hold(prompt_len, max_new_tokens, hold_chunks)
        prompt_len, max_new_tokens, hold_chunks = int(prompt_len), int(max_new_tokens), int(hold_chunks)
        if not self._fits(prompt_pages, reserve, hold_chunks):
            return None
        held = []
        for _ in range(hold_chunks):                   # from the pool; the pages below then fit in what is left
            owner = next(o for o in (-1, *self._free_chunks) if self._free_chunks.get(o))
            c = self._free_chunks[owner].pop()
            self._n_free -= 1
            ch = self._chunks[c]
            ch.state, ch.layer, ch.kind, ch.live, ch.free_slots, ch.extents = HELD, -1, "", 0, [], []
            held.append(c)
        ids = self._new_pages(prompt_pages)
        self.admitted += 1
        self.requests[rid] = _Request(prompt_len, prompt_len + max_new_tokens - 1, ids, prompt_len, reserve,
                                      held=held, serial=self.admitted)
        self._full.extend(ids[: prompt_len // fmt.PAGE_TOKENS])
        return list(ids)

    def pack(self, kv) -> Packed:
        """Pack the full pages of a request's KV (per layer ``(k, v)`` bf16 ``[kv_heads, n, head_dim]``, the
        same ``n`` in every layer) with the memory's packer, outside the pool: the input of
        :meth:`admit_packed`."""
        if not isinstance(kv, (list, tuple)) or len(kv) != self.num_layers:
            raise ValueError(f"kv must hold one (k, v) pair per layer ({self.num_layers}), got "
                             f"{len(kv) if isinstance(kv, (list, tuple)) else type(kv).__name__}")
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
                view[:, i, :, self._write_index[i].reshape(-1)] = x
            off = (torch.arange(n * 2 * H, device=self.device) * sb).reshape(n, 2, H)
            meta = torch.stack([self._pack(buf, off[:, i].reshape(-1).contiguous(), self.head_dim, self.layouts[i])
                                .reshape(n, H, -1) for i in (0, 1)], 1) if n else \
                torch.zeros(0, 2, H, fmt.n_blocks(self.head_dim), dtype=torch.uint8, device=self.device)
            comp = (meta >> 7).to(torch.int64).sum(-1)                                         # [n, 2, H]
            head_units.append((fmt.n_blocks(self.head_dim) * 4 - comp).reshape(n, 2 * H).tolist())
            slots.append(buf[: n * 2 * H * sb].view(n, 2, H, sb))
            metas.append(meta)
            tails.append((k[:, n * fmt.PAGE_TOKENS:], v[:, n * fmt.PAGE_TOKENS:]))
        return Packed(n_tok, n, slots, metas, head_units, tails)

    def _packed_chunks(self, packed: Packed) -> list:
        """New compressed chunks each layer needs to place ``packed``'s pages as :meth:`_comp_alloc` does (first fit,
        else a new chunk, with the page's first page-heads in the largest extent of the chunk taken last)."""
        upc, need = self.units_per_chunk, []
        for l in range(self.num_layers):
            units = packed.units[l]
            least = min(units, default=upc + 1)
            spill = self._spill_extent(l)
            last = [list(e) for e in self._chunks[spill[0]].extents] if spill else []   # the last chunk's extents
            copies = {spill[0]: last} if spill else {}
            # extents smaller than the request's smallest page never take one of its pages: leaving them out keeps
            # first-fit's choices and makes each page's search short (else O(pages x chunks) per layer)
            room = [r for r in ([e for e in (copies.get(c) or [list(e) for e in self._chunks[c].extents]) if e[1] >= least]
                                for c in self._comp_open[l]) if r]
            new = 0
            for u, hu in zip(units, packed.head_units[l]):
                for i, extents in enumerate(room):
                    e = next((e for e in extents if e[1] >= u), None)
                    if e is not None:
                        e[0], e[1] = e[0] + u, e[1] - u
                        if e[1] < least:
                            extents.remove(e)
                            if not extents:
                                del room[i]
                        break
                else:
                    new += 1
                    tail = max(last, key=lambda e: e[1]) if last else None
                    cut = _head_cut(hu, tail[1]) if tail else 0
                    if cut:
                        tail[0], tail[1] = tail[0] + cut, tail[1] - cut
                        room = [r for r in ([e for e in ext if e is not tail or e[1] >= least] for ext in room) if r]
                    last = [[u - cut, upc - u + cut]] if u - cut < upc else []
                    if last and last[0][1] >= least:
                        room.append([last[0]])
            need.append(new)
        return need

    def _check_packed(self, packed) -> None:
        """``packed`` must come from :meth:`pack` of a memory of this one's shape (layers, KV heads, head_dim)."""
        if not isinstance(packed, Packed):
            raise TypeError(f"packed must be a KVMemory.pack result (Packed), got {type(packed).__name__}")
        want = (packed.n_pages, 2, self.kv_heads, fmt.n_blocks(self.head_dim))
        for name, per_layer in (("meta", packed.meta), ("slots", packed.slots), ("head_units", packed.head_units)):
            if len(per_layer) != self.num_layers:
                raise ValueError(f"packed.{name} holds {len(per_layer)} layers; this memory has {self.num_layers}")
        for l in range(self.num_layers):
            if tuple(packed.meta[l].shape) != want or tuple(packed.slots[l].shape) != (*want[:3], self.slot_bytes):
                raise ValueError(f"packed, layer {l}: metadata {tuple(packed.meta[l].shape)} and slots "
                                 f"{tuple(packed.slots[l].shape)}, expected {want} and {(*want[:3], self.slot_bytes)} "
                                 f"(kv_heads={self.kv_heads}, head_dim={self.head_dim}): packed by another memory?")

    def can_admit_packed(self, packed: Packed | int, max_new_tokens: int, *, reserve_ratio: float = 1.0) -> bool:
        """Whether :meth:`admit_packed` would take ``packed`` now. Given only a token count (before packing),
        a necessary condition: its last page and its reservation fit raw."""
        if not isinstance(packed, int) or isinstance(packed, bool):
            self._check_packed(packed)
        tokens = packed if isinstance(packed, int) else packed.tokens
        prompt_pages, reserve = self._check_new(_PROBE, tokens, max_new_tokens, reserve_ratio)
        n_full = tokens // fmt.PAGE_TOKENS
        if isinstance(packed, int):
            return self._fits(prompt_pages - n_full, reserve, 0)
        free, n_free, need = self._after_packed(packed, prompt_pages - n_full + reserve)
        return n_free >= 0 and self._capacity(free, n_free) >= need

    def _after_packed(self, packed: Packed, raw_pages: int):
        """``(free slots per layer, free chunks, raw pages needed)`` once ``packed``'s pages took their compressed
        chunks, for a request that then needs ``raw_pages`` raw pages beside the outstanding reservations."""
        free = [self._layer_free_slots(l) for l in range(self.num_layers)]
        n_free = self._n_free
        for l, new in enumerate(self._packed_chunks(packed)):
            own = min(new, len(self._pending[l]))             # _take_chunk takes the layer's pending chunks first
            free[l] -= own * self.pages_per_chunk
            n_free -= new - own
        return free, n_free, raw_pages + self.outstanding

    def chunks_short(self, packed: Packed, max_new_tokens: int, *, reserve_ratio: float = 1.0) -> int:
        """Free chunks the pool lacks for :meth:`admit_packed` to take ``packed`` now: 0 when it fits, else how many
        more chunks a budget would need (with what is running now) -- how far one more request is from admission."""
        self._check_packed(packed)
        prompt_pages, reserve = self._check_new(_PROBE, packed.tokens, max_new_tokens, reserve_ratio)
        free, n_free, need = self._after_packed(packed, prompt_pages - packed.n_pages + reserve)
        lo, hi = max(0, -n_free), max(0, -n_free) + self.num_layers * -(-need // self.pages_per_chunk)
        while lo < hi:                                        # the fewest extra chunks whose capacity covers need
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self._capacity(free, n_free + mid) >= need else (mid + 1, hi)
        return lo

    def admit_packed(self, rid, packed: Packed, max_new_tokens: int, *, reserve_ratio: float = 1.0):
        """Admit a request whose full pages are already packed (:meth:`pack`; a pre-compressed prefix, §IV-A):
        they go straight into compressed chunks of each layer, counted at their packed size, and only the last,
        partial page is raw. Otherwise as :meth:`admit` (reservation, ``None`` when it does not fit now);
        the caller writes ``packed.tail`` into the last page (:meth:`write`)."""
        self._check_packed(packed)
        prompt_pages, reserve = self._check_new(rid, packed.tokens, max_new_tokens, reserve_ratio)
        max_new_tokens = int(max_new_tokens)
        if not self.can_admit_packed(packed, max_new_tokens, reserve_ratio=reserve_ratio):
            return None
        n, H = packed.n_pages, self.kv_heads
        ids = [self._free_ids.pop() for _ in range(n)]
        slot_units = self.slot_bytes // UNIT
        for l in range(self.num_layers):
            pieces = []
            for p, hu in zip(ids, packed.head_units[l]):
                where = self._comp_alloc(l, hu)
                if where is None:
                    raise RuntimeError("KVMemory: no room for a packed page although the check passed (internal error)")
                self._loc[l][p] = (COMP, tuple(where))
                self._used[l] += sum(hu) * UNIT
                pieces.append(where)
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
        ids += self._new_pages(prompt_pages - n)
        self.admitted += 1
        self.requests[rid] = _Request(packed.tokens, packed.tokens + max_new_tokens - 1, ids, packed.tokens, reserve,
                                      serial=self.admitted)
        return list(ids)

    def alloc(self, rid, n_tokens: int = 1):
        """Grow request ``rid``'s cache by ``n_tokens`` tokens: new pages come from its reservation, then
        from capacity nobody else was promised. Returns the new page ids (maybe ``[]``), or ``None``
        (nothing changed) when there is no room -- the caller retracts a request (:meth:`retract`)."""
        r = self._request(rid)
        if not _is_int(n_tokens) or n_tokens < 1:
            raise ValueError(f"n_tokens must be an int >= 1, got {n_tokens!r}")
        n_tokens = int(n_tokens)
        if _pages_for(r.cache_len + n_tokens) > self.max_request_pages:
            raise ValueError(f"n_tokens={n_tokens}: request {rid!r} would hold {r.cache_len + n_tokens} tokens, more "
                             f"than the budget's {self.max_request_pages} uncompressed pages per layer ever hold")
        need = _pages_for(r.cache_len + n_tokens) - len(r.pages)
        from_reserve = min(need, r.reserved)
        if need > from_reserve and self.capacity_pages() < self.outstanding + need - from_reserve:
            return None
        ids = self._new_pages(need)
        r.reserved -= from_reserve
        r.pages.extend(ids)
        self._full.extend(r.pages[r.cache_len // fmt.PAGE_TOKENS: (r.cache_len + n_tokens) // fmt.PAGE_TOKENS])
        r.cache_len += n_tokens
        return ids

    def free(self, rid) -> None:
        """Free every page of request ``rid`` in every layer and drop its reservation."""
        r = self.requests.pop(self._request_key(rid))
        self.space_returns += 1                              # its reservation, at least
        gone = set(r.pages)
        self._full = [p for p in self._full if p not in gone]
        for p in r.pages:
            self._free_page(p)
        for c in r.held:                               # back to the pool once the reads using them are done
            self._chunks[c].state = PENDING
        self._held_pending.extend(r.held)

    def retract(self, candidates=None):
        """Retract one running request (SGLang ``retract_decode`` order: fewest tokens decoded since admission, then the
        longest prompt), free it and return its id; the caller requeues it. candidates: ids to choose
        from (default all running)."""
        rids = list(self.requests) if candidates is None else [self._request_key(q) for q in candidates]
        if not rids:
            raise ValueError("retract: no running request to retract" if candidates is None else
                             f"retract: candidates is empty ({len(self.requests)} requests running)")
        victim = min(rids, key=lambda q: (self.requests[q].cache_len - self.requests[q].prompt_len,
                                          -self.requests[q].prompt_len))
        self.free(victim)
        return victim

    def _request_key(self, rid):
        try:
            running = rid in self.requests
        except TypeError:
            raise TypeError(f"rid must be a hashable request id (a str or an int), got {type(rid).__name__}") from None
        if not running:
            raise ValueError(f"unknown request {rid!r} (running: {sorted(map(str, self.requests))[:10]})")
        return rid

    def _request(self, rid):
        return self.requests[self._request_key(rid)]

    def cache_len(self, rid) -> int:
        return self._request(rid).cache_len

    # ------------------------------------------------------------------ data

    def slots(self, rid, start: int, n: int):
        """Page ids and in-page offsets of tokens ``start .. start + n - 1`` of request ``rid``."""
        r = self._request(rid)
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (start, n)) or n < 0 \
                or start < 0 or start + n > r.cache_len:
            raise ValueError(f"tokens [{start}, {start + n}) lie outside request {rid!r}'s cache of {r.cache_len}")
        t = torch.arange(start, start + n)
        pages = torch.tensor(r.pages, dtype=torch.int64)[t // fmt.PAGE_TOKENS]
        return pages.to(self.device), (t % fmt.PAGE_TOKENS).to(self.device)

    def write_tokens(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> None:
        """Write one token's K and V per row into raw pages of ``layer``: pages, offsets int64 ``[n]``;
        k, v bf16 ``[n, kv_heads, head_dim]``. No host sync (the engine checks the pages are raw: only
        pages that are not full are written)."""
        base = (self.desc[layer][pages, :, :, 0] >> 8) // 2                       # [n, 2, H] bf16 index
        idx = base[..., None] + self._write_index[:, offsets].transpose(0, 1)[:, :, None, :]
        self.pool[: self.total_bytes].view(torch.bfloat16)[idx] = torch.stack([k, v], 1)

    def write(self, layer: int, rid, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write tokens ``start ..`` of request ``rid`` in ``layer``: k, v bf16 ``[kv_heads, n, head_dim]``."""
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"write: layer must be an int in [0, {self.num_layers}), got {layer!r}")
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16 or t.dim() != 3 \
                    or (t.shape[0], t.shape[2]) != (self.kv_heads, self.head_dim) or t.shape != k.shape:
                raise ValueError(f"write: {name} must be bf16 [kv_heads={self.kv_heads}, n, head_dim={self.head_dim}] "
                                 f"like k, got {getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        n = k.shape[1]
        pages, offsets = self.slots(rid, start, n)
        for p in set(pages.tolist()):
            if self._loc[layer][p][0] != RAW:
                raise ValueError(f"write: page {p} of request {rid!r} is compressed (only filling pages are written)")
        self.write_tokens(layer, pages, offsets, k.transpose(0, 1), v.transpose(0, 1))

    def page_table(self, rids, device=None):
        """FlashInfer CSR page table of requests ``rids`` (the same for every layer): ``indptr``,
        ``indices``, ``last_page_len``, int32 on ``device`` (default: the pool's; copied without a host sync)."""
        if isinstance(rids, (str, bytes)) or not hasattr(rids, "__iter__"):
            raise TypeError(f"rids must be a list of request ids, got {type(rids).__name__} {rids!r}")
        reqs = [self._request(r) for r in rids]
        indptr, indices = [0], []
        for r in reqs:
            indptr.append(indptr[-1] + _pages_for(r.cache_len))
            indices += r.pages[: _pages_for(r.cache_len)]
        last = [r.cache_len - fmt.PAGE_TOKENS * (_pages_for(r.cache_len) - 1) for r in reqs]
        dev = self.device if device is None else device
        t = lambda x: to_device(torch.tensor(x, dtype=torch.int32), dev)          # noqa: E731  (one copy each)
        return t(indptr), t(indices), t(last)

    # ------------------------------------------------------------------ compression

    def compress(self) -> dict:
        """Compress the queued full pages of every layer (call once the reads that used them are done)
        and move in-place compressed pages into compressed chunks where room has appeared. Returns
        counts ``moved`` and ``in_place``.

        Device work is batched over layers -- the pack kernel twice (K, V), one read of the compressed
        sizes back to the host, one copy for every move -- so a step that fills pages costs a few launches,
        not a few per layer; the host places pages layer by layer as before."""
        full, self._full = self._full, []
        new_units = self._pack_full(full) if full else None               # [L][n][2][H] ints
        moves, moved, in_place = [], 0, 0                                 # (layer, page, head units, src, dst)
        for l in range(self.num_layers):
            waiting = sorted(self._inplace[l])
            if not full and not (waiting and self._room_for(l, min(map(_units, (self._inplace[l][p] for p in waiting))),
                                                             len(waiting))):
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
                    self._loc[l][p] = ("inplace",) + loc[1:]
                    continue
                # a fresh chunk only for at least a chunk's worth of pages: their raw slots give back as much
                # as the chunk takes in this layer
                dest = self._comp_alloc(l, [u for kv in head_units[i] for u in kv],
                                        not refused and left >= self.pages_per_chunk)
                left -= 1
                if dest is None:
                    refused = refused or left + 1 >= self.pages_per_chunk
                    if loc[0] == RAW:
                        self._loc[l][p] = ("inplace",) + loc[1:]
                        self._inplace[l][p] = head_units[i]
                        in_place += 1
                    continue
                moves.append((l, p, head_units[i], self._slot_address(loc[1], loc[2]) // UNIT, dest))
                self._inplace[l].pop(p, None)
                released.append(loc)
                self._loc[l][p] = (COMP, tuple(dest))
                self._used[l] += page_units[i] * UNIT
                moved += 1
            # an emptied chunk goes to this layer's pending list: no later layer of this pass can take it, so
            # the copies can wait for the end of the pass
            for loc in released:
                self._raw_free_slot(l, loc[1], loc[2])
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

    def keep_raw(self) -> None:
        """Leave the pages queued so far raw (drop them from the compression queue): new KV stays
        uncompressed, as in ZipFusion's throughput setup (§IV-A)."""
        self._full = []

    def compressed_fraction(self, rids=None):
        """Fractions of K and V blocks stored compressed over the pages of ``rids`` (default all running
        requests), all layers: ``(frac_k, frac_v)``."""
        pages = [p for r in (self.requests if rids is None else rids) for p in self._request(r).pages]
        if not pages:
            return float("nan"), float("nan")
        idx = torch.tensor(pages, device=self.device)
        comp = torch.stack([((d[idx] >> 7) & 1).to(torch.float32).mean((0, 2, 3)) for d in self.desc])
        k, v = comp.mean(0).tolist()
        return k, v

    def _head_starts(self, pieces: list, hu: torch.Tensor) -> torch.Tensor:
        """Pool unit where each page-head begins, int64 ``[n, 2H]``, for pages of page-head units ``hu`` ``[n, 2H]``
        placed in ``pieces`` (per page the :meth:`_comp_alloc` pieces: the page's units in order, cut between
        page-heads)."""
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
        per page (:meth:`_comp_alloc`)."""
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

    # ------------------------------------------------------------------ accounting

    def used_bytes(self, layer: int | None = None) -> int:
        """Bytes held by pages (raw slots, in-place compressed slots, compressed extents) of ``layer``
        (all layers by default)."""
        return sum(self._used) if layer is None else self._used[layer]

    def held_bytes(self) -> int:
        """Bytes of the whole chunks running requests hold for bytes kept outside the pages (``hold_chunks``)."""
        return self.chunk_bytes * sum(len(r.held) for r in self.requests.values())

    def free_bytes(self) -> int:
        """Bytes neither held by a page nor by a request's held chunks: free and pending chunks, free slots
        and free extents."""
        return self.total_bytes - self.used_bytes() - self.held_bytes()

    def snapshot(self) -> dict:
        """Cheap per-step counters: bytes in use per layer, free and pending chunks, chunks reassigned so far."""
        return dict(used_bytes=list(self._used), chunks_free=self._n_free,
                    chunks_pending=sum(map(len, self._pending)) + len(self._held_pending),
                    chunks_held=sum(len(r.held) for r in self.requests.values()),
                    reassigned=self.reassigned, running=len(self.requests))

    def stats(self) -> dict:
        """A full snapshot (walks every page and chunk): :meth:`snapshot` plus chunks per layer and kind,
        pages per kind, capacity and outstanding reservations."""
        kinds = {RAW: 0, "inplace": 0, COMP: 0}
        for locs in self._loc:
            for loc in locs.values():
                kinds[loc[0]] += 1
        return dict(self.snapshot(),
                    chunks_raw=[sum(1 for c in self._chunks if c.state == OWNED and c.layer == l and c.kind == RAW)
                                for l in range(self.num_layers)],
                    chunks_comp=[len(x) for x in self._comp], pages_raw=kinds[RAW], pages_in_place=kinds["inplace"],
                    pages_compressed=kinds[COMP], capacity_pages=self.capacity_pages(), outstanding=self.outstanding)
