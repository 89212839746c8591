"""The cross-layer KV memory manager: chunks, pages, compression migration, admission, capacity
(ZipFusion §II-C, §III-D).

Memory model
------------
* One uint8 byte ``pool`` (the KV budget) is cut into **chunks** of ``pages_per_chunk`` raw pages. A *page*
  is 16 tokens of one layer, keys and values of every KV head: ``2 * kv_heads`` page-heads of
  ``zipkv.format.page_bytes(head_dim)`` bytes each, laid out as :mod:`zipkv.format` packs them.
* A chunk is **free** (in the pool shared by all layers), **owned** by one layer -- as a *raw* chunk
  (fixed slots of one raw page) or a *compressed* chunk (variable extents of compressed pages, in
  256-byte units; a page that no free extent holds whole may end one chunk and begin the next, cut between
  page-heads: :meth:`~zipkv.memory.placement.Placement.comp_alloc`) -- or **pending**: emptied by its layer and
  waiting for the attention reads that may still touch it. :meth:`KVMemory.reads_done` returns pending chunks
  to the pool; only then can another layer take them (a chunk *reassigned*). Its own layer may take a pending
  chunk back at once.
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
:meth:`~zipkv.memory.placement.Placement.comp_alloc` places a page, and admission checks that the capacity left
after the chunks they need still covers its raw last page, its reservation and every outstanding one
(:meth:`KVMemory.chunks_short`: how many chunks a request that does not fit lacks).
:meth:`admit` (SGLang's ``PrefillAdder.add_one_req`` + ``alloc``) takes a request only if
``capacity_pages() - outstanding`` covers its prompt pages plus a *reservation* of
``ceil(reserve_ratio * pages it can still grow by)``; ``outstanding`` is the sum of running requests'
unused reservations. With ``reserve_ratio=1`` (default) an admitted request can always grow to its
output length: no operation lowers the capacity below the outstanding reservations (allocating a
reserved page lowers both by one; compression takes a chunk only when that still holds; freeing and
:meth:`reads_done` only raise capacity). With ``reserve_ratio < 1`` (SGLang's ``new_token_ratio``) more
requests fit and :meth:`alloc` can fail: it then returns ``None`` and changes nothing (never a silent
overwrite), and the caller retracts a request: it frees it (:meth:`free`) and requeues it. Which one is policy,
the scheduler's (:mod:`zipkv.scheduler`: SGLang's ``retract_decode`` order).

Ablation options (the memory manager chapter)
---------------------------------------------
``pool="per_layer"``: each layer a fixed share of the chunks, freed chunks serving only their own layer
(:class:`~zipkv.memory.chunks.ChunkPool` ``per_layer``): the capacity is then the layer with the least room.
``admission="uncompressed"``: compression still runs, but admission does not count the room it frees -- a request is
admitted only while every running request's pages *at their uncompressed size*, the outstanding reservations and its
own pages fit the budget's uncompressed capacity (:attr:`KVMemory.max_request_pages`), as an uncompressed server
would (ZipFusion's "capacity grows as compression releases memory" turned off). Decode growth is unchanged.

Pages that leave the pool
-------------------------
Inside the pool nothing is checked on the decode path: the engine plans with ``validate=False`` and the memory keeps
no check bytes of its own (its descriptors are written only by this package, from the packer's metadata), so a bit
flipped in the pool's payload or descriptors while a request runs is not detected -- it decodes to other values, or,
for a descriptor, is undefined behaviour in the kernels (``zipkv.format``'s "Validation and checksums"). Pages that
leave the pool carry their own checks: :meth:`KVMemory.pack` (a prefix packed outside the pool) and
:meth:`KVMemory.export` (a running request's pages copied out) give a :class:`~zipkv.memory.pages.Packed` with each
block's check byte (:func:`zipkv.format.meta_check`) and, with ``checksum=True`` (the default), each page-head's
CRC-32 of its used bytes (:func:`zipkv.format.page_checksum`); :meth:`KVMemory.admit_packed` verifies both before it
takes any chunk or page id (``validate=False`` skips that). Detected there: every change of a metadata byte alone,
1 to 3 flipped bits of a block's (metadata, check) pair, any page-head's payload with 1 to 3 flipped bits or one burst
of up to 32 (with checksums). Not detected: payload bits without checksums; a whole metadata row with its check bytes
and checksum replaced by another self-consistent one (another page's, or a stale copy); ``Packed.tail``, the partial
last page's plain bf16 tokens; bytes a request holds outside its pages (``hold_chunks``).
:meth:`zipkv.paged.PagedKVCache.export_pages` / ``import_pages`` are the same checks for one layer's paged cache.

Mapping onto serving engines
----------------------------
* SGLang ``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator``: ``alloc(need_size)`` ->
  :meth:`alloc` (per request, in tokens, returns the new page ids or ``None``); ``free(indices)`` ->
  :meth:`free` (a request's pages); ``available_size()`` -> :meth:`available_size` (tokens that can still
  be promised: capacity minus outstanding reservations). The per-layer ``k_buffer[layer]`` /
  ``v_buffer[layer]`` become ``pool`` + ``desc[layer]``.
* SGLang ``PrefillAdder``: ``rem_total_tokens`` (free minus running requests' ``max_new_tokens``
  scaled by ``new_token_ratio``) is ``available_size()`` with ``reserve_ratio``; ``add_one_req`` is
  :meth:`can_admit` + :meth:`admit`; ``ScheduleBatch.retract_decode`` is :mod:`zipkv.scheduler`'s choice + :meth:`free`.
* vLLM ``KVCacheManager``: ``allocate_slots(request, num_new_tokens)`` -> :meth:`alloc`,
  ``free(request)`` -> :meth:`free`, ``get_num_free_blocks`` -> :meth:`capacity_pages`; a block is a page.
  vLLM's preemption (recompute) is :meth:`free` + re-admission.

Parts
-----
:class:`KVMemory` is the facade that callers and the engine use (requests, admission, freeing, statistics); it
holds the parts, each with its one job:

* :mod:`zipkv.memory.chunks` -- :class:`~zipkv.memory.chunks.ChunkPool`, the chunks' states and who owns them;
* :mod:`zipkv.memory.placement` -- :class:`~zipkv.memory.placement.Placement`, raw slots and compressed extents
  inside each layer's chunks (host bookkeeping);
* :mod:`zipkv.memory.pages` -- :class:`~zipkv.memory.pages.Pages`, page ids, the byte pool and descriptors, writes,
  packing and compression migration;
* :mod:`zipkv.memory.capacity` -- the capacity and admission arithmetic on plain numbers.
"""
from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, field

import torch

from zipkv import format as fmt
from zipkv.memory import capacity as cap
from zipkv.memory.chunks import COMP, FREE, HELD, OWNED, PENDING, RAW, ChunkPool
from zipkv.memory.pages import Packed, Pages, copy_to_device, pack_slots_reference, to_device
from zipkv.memory.placement import UNIT, Placement, free_extent

__all__ = ["KVMemory", "Packed", "free_extent", "pack_slots_reference", "UNIT", "to_device", "copy_to_device",
           "COMP", "FREE", "HELD", "OWNED", "PENDING", "RAW"]


@dataclass
class _Request:
    prompt_len: int
    max_len: int                      # most tokens the cache will hold: prompt + max_new_tokens - 1
    pages: list
    cache_len: int
    reserved: int                     # pages promised and not yet allocated
    held: list = field(default_factory=list)   # chunks held for the request's bytes kept elsewhere
    serial: int = 0                   # admission number: tells a re-admitted request from its earlier self


_PROBE = object()
"""The request id admission checks use for a request that is not admitted (no caller's id can equal it)."""


def _is_int(x) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_device(device) -> torch.device:
    """``device`` as a ``torch.device`` where the pool can be allocated: the CPU, an available CUDA GPU, or the meta
    device (bookkeeping without bytes)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device={device!r}: expected a torch device such as 'cpu' or 'cuda'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: this machine has no CUDA GPU (torch.cuda.is_available() is False)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    if dev.type not in ("cpu", "cuda", "meta"):
        raise ValueError(f"device={device!r}: expected 'cpu', a CUDA device ('cuda', 'cuda:1') or 'meta'")
    if dev.type == "cuda" and dev.index is None:       # the tensors made on it say which GPU
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _device_memory(device: torch.device) -> int | None:
    """Bytes of memory ``device`` has (the GPU's, or the machine's RAM), or None where that cannot be read."""
    try:
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError, RuntimeError):
        return None


def _check_fits_device(pool_bytes: int, device: torch.device) -> None:
    """A pool larger than the device's whole memory can never be allocated: a ``ValueError`` before the bookkeeping
    of its chunks is built (which, for such a budget, would take hours)."""
    total = None if device.type == "meta" else _device_memory(device)
    if total is not None and pool_bytes > total:
        raise ValueError(f"kv_budget_bytes={pool_bytes} is more than the whole memory of {device} ({total} bytes): "
                         f"expected a budget that fits the device")


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
    they are not part of ``kv_budget_bytes``. pool: ``"shared"`` (chunks move between layers) or ``"per_layer"``;
    admission: ``"compressed"`` (room compression frees admits requests) or ``"uncompressed"`` (module docstring,
    "Ablation options"). block_format: ``"zipfusion"`` (§III-B) or ``"escape"`` (:mod:`zipkv.escape`'s, every block
    compressible: :mod:`zipkv.memory.escape_pages`; pack_slots then has :func:`zipkv.escape.pack_slots`'s contract,
    and :attr:`esc` holds the escape descriptors).

    Parts: ``chunks`` (:class:`~zipkv.memory.chunks.ChunkPool`), ``placement``
    (:class:`~zipkv.memory.placement.Placement`), ``pages`` (:class:`~zipkv.memory.pages.Pages`).
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, kv_budget_bytes: int, *,
                 pages_per_chunk: int = 16, k_layout: str = "token", v_layout: str = "token",
                 device="cpu", pack_slots=None, extra_bytes: int = 0, extra_pages: int = 0,
                 pool: str = "shared", admission: str = "compressed", block_format: str = "zipfusion"):
        if block_format not in ("zipfusion", "escape"):
            raise ValueError(f"block_format must be 'zipfusion' or 'escape', got {block_format!r}")
        if pool not in ("shared", "per_layer"):
            raise ValueError(f"pool must be 'shared' or 'per_layer', got {pool!r}")
        if admission not in ("compressed", "uncompressed"):
            raise ValueError(f"admission must be 'compressed' or 'uncompressed', got {admission!r}")
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
        if pack_slots is not None and not callable(pack_slots):
            raise TypeError(f"pack_slots must be None or a function f(pool, offsets, head_dim, layout) -> metadata "
                            f"bytes, got {type(pack_slots).__name__}")
        device = _check_device(device)
        _check_fits_device(int(kv_budget_bytes) + int(extra_bytes), device)
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
        min_page_units = 2 * kv_heads * fmt.n_blocks(head_dim) * fmt.PACKED_BLOCK_BYTES // UNIT
        self.pool_kind, self.admission = pool, admission
        self.chunks = ChunkPool(self.num_chunks, num_layers, per_layer=pool == "per_layer")
        self.placement = Placement(self.chunks, self.pages_per_chunk, self.page_bytes, min_page_units)
        self.block_format = block_format
        if block_format == "escape":                 # zipkv.memory.escape_pages: every block compressible
            from zipkv.memory.escape_pages import EscapePages, pack_slots_reference as escape_reference
            self.pages = EscapePages(self.placement, kv_heads, head_dim, self.layouts, self.device,
                                     pack_slots or escape_reference, extra_bytes, extra_pages)
        else:
            self.pages = Pages(self.placement, kv_heads, head_dim, self.layouts, self.device,
                               pack_slots or pack_slots_reference, extra_bytes, extra_pages)
        self.max_pages, self.extra_offset = self.pages.max_pages, self.pages.extra_offset
        self.pool = self.pages.pool
        self._write_index = self.pages.write_index                        # [2, 16, D]
        self.requests: dict = {}
        self.admitted = 0
        self._returns = 0                                                 # reservations and pending chunks given back
        self.max_request_pages = self.capacity_pages()

    @property
    def space_returns(self) -> int:
        """Operations so far that gave space back (a raw slot, a compressed extent, a reservation, pending chunks to
        the pool). Nothing else makes room, so an admission check that failed fails again until this count moves
        (the engine retries a blocked request only then, :meth:`zipkv.engine.Engine.generate`)."""
        return self._returns + self.placement.space_returns

    @property
    def reassigned(self) -> int:
        """Chunks taken so far by a layer other than the one that emptied them."""
        return self.chunks.reassigned

    # ------------------------------------------------------------------ capacity

    def capacity_pages(self) -> int:
        """New logical pages that fit raw now: a raw slot in every layer (own free slots, own pending
        chunks, then chunks of the shared pool)."""
        return cap.capacity(self.placement.free_slots(), self.chunks.free_chunks, self.pages_per_chunk)

    @property
    def outstanding(self) -> int:
        """Pages promised to running requests and not yet allocated."""
        return sum(r.reserved for r in self.requests.values())

    def available_size(self) -> int:
        """Tokens that can still be promised to new requests (SGLang's ``available_size``)."""
        return max(0, self.capacity_pages() - self.outstanding) * fmt.PAGE_TOKENS

    def reads_done(self) -> None:
        """The attention reads issued so far are finished: pending chunks go back to the shared pool,
        where any layer can take them."""
        if self.chunks.reads_done():
            self._returns += 1

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
        need, prompt_pages, reserve = cap.request_pages(prompt_len, max_new_tokens, reserve_ratio)
        if need > self.max_request_pages:
            raise ValueError(f"request {rid!r}: {prompt_len} prompt + {max_new_tokens} new tokens need {need} pages "
                             f"per layer, but the budget ({self.total_bytes} bytes) holds at most "
                             f"{self.max_request_pages} uncompressed pages per layer for one request")
        return prompt_pages, reserve

    def _check_hold(self, prompt_len, max_new_tokens, hold_chunks):
        """A request that holds ``hold_chunks`` chunks must fit, with them, into the empty budget: else it never will."""
        if not _is_int(hold_chunks) or hold_chunks < 0:
            raise ValueError(f"hold_chunks must be an int >= 0, got {hold_chunks!r}")
        need = cap.pages_for(prompt_len + max_new_tokens - 1)
        if hold_chunks and self.pool_kind == "per_layer":
            raise ValueError(f"hold_chunks={hold_chunks}: a request holds chunks of the shared pool, and this memory's "
                             f"chunks are per-layer shares (pool='per_layer'); expected hold_chunks=0")
        if hold_chunks and not cap.fits([0] * self.num_layers, self.num_chunks, need, self.pages_per_chunk, hold_chunks):
            raise ValueError(f"hold_chunks={hold_chunks}: with {need} pages per layer for {prompt_len} prompt + "
                             f"{max_new_tokens} new tokens, the request never fits the budget's {self.num_chunks} "
                             f"chunks of {self.pages_per_chunk} pages")

    def _fits(self, prompt_pages, reserve, hold_chunks):
        return self._fits_uncompressed(prompt_pages + reserve) and cap.fits(
            self.placement.free_slots(), self.chunks.free_chunks, prompt_pages + reserve + self.outstanding,
            self.pages_per_chunk, hold_chunks)

    def _fits_uncompressed(self, pages: int) -> bool:
        """With ``admission="uncompressed"``: whether ``pages`` more pages, beside every running request's pages at
        their uncompressed size and the outstanding reservations, fit the budget's uncompressed capacity (the room
        compression freed is not counted); True otherwise."""
        if self.admission == "compressed":
            return True
        held = sum(len(r.pages) for r in self.requests.values())
        return held + self.outstanding + pages <= self.max_request_pages

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
        held = [self.chunks.hold() for _ in range(hold_chunks)]   # from the pool; the pages below fit in what is left
        ids = self.pages.new_pages(prompt_pages)
        self.admitted += 1
        self.requests[rid] = _Request(prompt_len, prompt_len + max_new_tokens - 1, ids, prompt_len, reserve,
                                      held=held, serial=self.admitted)
        self.pages.queue_full(ids[: prompt_len // fmt.PAGE_TOKENS])
        return list(ids)

    def pack(self, kv, *, checksum: bool = True) -> Packed:
        """Pack the full pages of a request's KV (per layer ``(k, v)`` bf16 ``[kv_heads, n, head_dim]``, the
        same ``n`` in every layer) with the memory's packer, outside the pool: the input of
        :meth:`admit_packed`. With check bytes and, with ``checksum``, each page-head's CRC-32 (:class:`Packed`;
        "Pages that leave the pool" in this module's docstring)."""
        return self.pages.pack(kv, checksum=checksum)

    def export(self, rid, *, checksum: bool = True) -> Packed:
        """Copy running request ``rid``'s cached KV out of the pool (offload, transfer to another memory of the same
        shape, swap-out before :meth:`free`): a :class:`Packed` of its full pages as each layer stores them, with check
        bytes and, with ``checksum``, CRC-32s taken now, and the partial last page's tokens as ``tail``. Nothing in
        the memory changes. :meth:`admit_packed` takes it back (verified there), then the caller writes ``tail``.
        Chunks the request holds for bytes kept elsewhere (``hold_chunks``) are not part of it."""
        r = self._request(rid)
        self.pages.flush_pages()
        return self.pages.export(r.pages, r.cache_len, checksum=checksum)

    def can_admit_packed(self, packed: Packed | int, max_new_tokens: int, *, reserve_ratio: float = 1.0) -> bool:
        """Whether :meth:`admit_packed` would take ``packed`` now. Given only a token count (before packing),
        a necessary condition: its last page and its reservation fit raw."""
        if not isinstance(packed, int) or isinstance(packed, bool):
            self.pages.check_packed(packed)
        tokens = packed if isinstance(packed, int) else packed.tokens
        prompt_pages, reserve = self._check_new(_PROBE, tokens, max_new_tokens, reserve_ratio)
        n_full = tokens // fmt.PAGE_TOKENS
        if not self._fits_uncompressed(prompt_pages + reserve):
            return False
        if isinstance(packed, int):
            return self._fits(prompt_pages - n_full, reserve, 0)
        # first from the fewest chunks the pages could take (per layer, O(chunks)): an engine asks again whenever
        # memory gives space back, and the exact walk is O(pages x layers) -- tens of ms for a 16K-token prompt
        for exact in (False, True):
            free, n_free, need = self._after_packed(packed, prompt_pages - n_full + reserve, exact=exact)
            if not cap.fits(free, n_free, need, self.pages_per_chunk):
                return False
        return True

    def _after_packed(self, packed: Packed, raw_pages: int, exact: bool = True):
        """``(free slots per layer, free chunks, raw pages needed)`` once ``packed``'s pages took their compressed
        chunks, for a request that then needs ``raw_pages`` raw pages beside the outstanding reservations; with
        ``exact`` False, the fewest chunks they could take (:meth:`Placement.least_new_comp_chunks`: fewer chunks
        taken never fit less, so a refusal then is final)."""
        new = (self.placement.new_comp_chunks(packed.units, packed.head_units) if exact
               else self.placement.least_new_comp_chunks(packed.layer_units))
        free, n_free = cap.take_chunks(self.placement.free_slots(), self.chunks.free_chunks,
                                       [self.chunks.n_pending(l) for l in range(self.num_layers)], new,
                                       self.pages_per_chunk)
        return free, n_free, raw_pages + self.outstanding

    def chunks_short(self, packed: Packed, max_new_tokens: int, *, reserve_ratio: float = 1.0) -> int:
        """Free chunks the pool lacks for :meth:`admit_packed` to take ``packed`` now: 0 when it fits, else how many
        more chunks a budget would need (with what is running now) -- how far one more request is from admission."""
        self.pages.check_packed(packed)
        prompt_pages, reserve = self._check_new(_PROBE, packed.tokens, max_new_tokens, reserve_ratio)
        free, n_free, need = self._after_packed(packed, prompt_pages - packed.n_pages + reserve)
        return cap.chunks_short(free, n_free, need, self.pages_per_chunk)

    def admit_packed(self, rid, packed: Packed, max_new_tokens: int, *, reserve_ratio: float = 1.0,
                     validate: bool = True):
        """Admit a request whose full pages are already packed (:meth:`pack`, :meth:`export`; a pre-compressed
        prefix, §IV-A): they go straight into compressed chunks of each layer, counted at their packed size, and only
        the last, partial page is raw. Otherwise as :meth:`admit` (reservation, ``None`` when it does not fit now);
        the caller writes ``packed.tail`` into the last page (:meth:`write`). validate: first verify ``packed``'s
        check bytes and checksums (:meth:`~zipkv.memory.pages.Pages.verify_packed`: a ``ValueError`` naming the layer,
        page and block, before anything is taken; one sync per layer); False: shapes and dtypes only."""
        if fmt._check_flag(validate, "validate"):
            self.pages.verify_packed(packed)
        else:
            self.pages.check_packed(packed)
        prompt_pages, reserve = self._check_new(rid, packed.tokens, max_new_tokens, reserve_ratio)
        max_new_tokens = int(max_new_tokens)
        if not self.can_admit_packed(packed, max_new_tokens, reserve_ratio=reserve_ratio):
            return None
        ids = self.pages.place_packed(packed, self.outstanding)
        ids += self.pages.new_pages(prompt_pages - packed.n_pages)
        self.admitted += 1
        self.requests[rid] = _Request(packed.tokens, packed.tokens + max_new_tokens - 1, ids, packed.tokens, reserve,
                                      serial=self.admitted)
        return list(ids)

    def alloc(self, rid, n_tokens: int = 1):
        """Grow request ``rid``'s cache by ``n_tokens`` tokens: new pages come from its reservation, then
        from capacity nobody else was promised. Returns the new page ids (maybe ``[]``), or ``None``
        (nothing changed) when there is no room -- the caller retracts a request (frees one, :meth:`free`)."""
        r = self._request(rid)
        if not _is_int(n_tokens) or n_tokens < 1:
            raise ValueError(f"n_tokens must be an int >= 1, got {n_tokens!r}")
        n_tokens = int(n_tokens)
        if cap.pages_for(r.cache_len + n_tokens) > self.max_request_pages:
            raise ValueError(f"n_tokens={n_tokens}: request {rid!r} would hold {r.cache_len + n_tokens} tokens, more "
                             f"than the budget's {self.max_request_pages} uncompressed pages per layer ever hold")
        need = cap.pages_for(r.cache_len + n_tokens) - len(r.pages)
        from_reserve = min(need, r.reserved)
        if need > from_reserve and self.capacity_pages() < self.outstanding + need - from_reserve:
            return None
        ids = self.pages.new_pages(need)
        r.reserved -= from_reserve
        r.pages.extend(ids)
        self.pages.queue_full(r.pages[r.cache_len // fmt.PAGE_TOKENS: (r.cache_len + n_tokens) // fmt.PAGE_TOKENS])
        r.cache_len += n_tokens
        return ids

    def free(self, rid) -> None:
        """Free every page of request ``rid`` in every layer and drop its reservation."""
        r = self.requests.pop(self._request_key(rid))
        self._returns += 1                                   # its reservation, at least
        self.pages.free_pages(r.pages)
        self.chunks.let_go(r.held)                     # back to the pool once the reads using them are done

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
        for name, x in (("start", start), ("n", n)):
            if not _is_int(x):
                raise TypeError(f"{name} must be an int, got {type(x).__name__} {x!r}")
        start, n = int(start), int(n)
        if n < 0 or start < 0 or start + n > r.cache_len:
            raise ValueError(f"tokens [{start}, {start + n}) lie outside request {rid!r}'s cache of {r.cache_len}")
        t = torch.arange(start, start + n)
        pages = torch.tensor(r.pages, dtype=torch.int64)[t // fmt.PAGE_TOKENS]
        return pages.to(self.device), (t % fmt.PAGE_TOKENS).to(self.device)

    def write_tokens(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> None:
        """Write one token's K and V per row into raw pages of ``layer``: pages, offsets int64 ``[n]``;
        k, v bf16 ``[n, kv_heads, head_dim]``, on the memory's device. No host sync: the types, shapes and devices
        are checked on the host; the values of ``pages`` and ``offsets`` (allocated raw pages of ``layer``, offsets in
        0..15) only where they are CPU tensors -- on a GPU the caller vouches for them (the engine writes only its
        requests' filling pages)."""
        layer = self._check_layer(layer, "write_tokens")
        n = pages.shape[0] if isinstance(pages, torch.Tensor) and pages.dim() == 1 else None
        for name, t in (("pages", pages), ("offsets", offsets)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1 or t.shape[0] != n \
                    or t.device != self.device:
                raise ValueError(f"write_tokens: {name} must be a 1-D int64 tensor on {self.device} (one entry per "
                                 f"row, as many as pages), got {getattr(t, 'dtype', type(t).__name__)} "
                                 f"{tuple(getattr(t, 'shape', ()))} on {getattr(t, 'device', None)}")
        self._check_kv(k, v, (n, self.kv_heads, self.head_dim), "write_tokens", "[n, kv_heads, head_dim]")
        if self.device.type == "cpu" and n:
            if int(offsets.min()) < 0 or int(offsets.max()) >= fmt.PAGE_TOKENS:
                raise ValueError(f"write_tokens: offsets must lie in [0, {fmt.PAGE_TOKENS}), got range "
                                 f"[{int(offsets.min())}, {int(offsets.max())}]")
            for p in set(pages.tolist()):
                if p not in self.pages._loc[layer] or not self.pages.is_raw(layer, p):
                    raise ValueError(f"write_tokens: page {p} is not a raw page of layer {layer} (unallocated, or "
                                     f"compressed): only the filling pages of running requests are written")
        self.pages.write_tokens(layer, pages, offsets, k, v)

    def _check_layer(self, layer, what: str) -> int:
        if not _is_int(layer) or not 0 <= layer < self.num_layers:
            raise ValueError(f"{what}: layer must be an int in [0, {self.num_layers}), got {layer!r}")
        return int(layer)

    def _check_kv(self, k, v, shape: tuple, what: str, spelled: str) -> None:
        """k and v bf16 tensors of ``shape`` (``None`` entries: any size, the same for both) on the memory's device."""
        for name, t in (("k", k), ("v", v)):
            ok = (isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and t.dim() == len(shape)
                  and all(w is None or g == w for g, w in zip(t.shape, shape)) and t.shape == getattr(k, "shape", None))
            if not ok:
                want = spelled.replace("kv_heads", f"kv_heads={self.kv_heads}").replace("head_dim",
                                                                                        f"head_dim={self.head_dim}")
                raise ValueError(f"{what}: {name} must be bf16 {want} like k, got "
                                 f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
            if t.device != self.device:
                raise ValueError(f"{what}: {name} is on {t.device}, the memory on {self.device}")

    def write(self, layer: int, rid, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write tokens ``start ..`` of request ``rid`` in ``layer``: k, v bf16 ``[kv_heads, n, head_dim]``."""
        layer = self._check_layer(layer, "write")
        self._check_kv(k, v, (self.kv_heads, None, self.head_dim), "write", "[kv_heads, n, head_dim]")
        n = k.shape[1]
        pages, offsets = self.slots(rid, start, n)
        for p in set(pages.tolist()):
            if not self.pages.is_raw(layer, p):
                raise ValueError(f"write: page {p} of request {rid!r} is compressed (only filling pages are written)")
        self.pages.write_tokens(layer, pages, offsets, k.transpose(0, 1), v.transpose(0, 1))

    def page_table(self, rids, device=None):
        """FlashInfer CSR page table of requests ``rids`` (the same for every layer): ``indptr``,
        ``indices``, ``last_page_len``, int32 on ``device`` (default: the pool's; copied without a host sync)."""
        if isinstance(rids, (str, bytes)) or not hasattr(rids, "__iter__"):
            raise TypeError(f"rids must be a list of request ids, got {type(rids).__name__} {rids!r}")
        reqs = [self._request(r) for r in rids]
        indptr, indices = [0], []
        for r in reqs:
            indptr.append(indptr[-1] + cap.pages_for(r.cache_len))
            indices += r.pages[: cap.pages_for(r.cache_len)]
        last = [r.cache_len - fmt.PAGE_TOKENS * (cap.pages_for(r.cache_len) - 1) for r in reqs]
        dev = self.device if device is None else _check_device(device)
        t = lambda x: to_device(torch.tensor(x, dtype=torch.int32), dev)          # noqa: E731  (one copy each)
        return t(indptr), t(indices), t(last)

    # ------------------------------------------------------------------ pages and descriptors

    def flush_pages(self) -> None:
        """Write the descriptors of the pages allocated since the last flush (raw slots), one indexed write for
        all layers. Reading :attr:`desc` flushes first; the engine flushes once per step, after its allocations."""
        self.pages.flush_pages()

    def changed_pages(self) -> list:
        """Sorted ids of the pages whose descriptors this memory changed (in any layer) since the last call; the
        record is cleared. The engine recomputes the kernels' page kinds of these pages only."""
        return self.pages.changed_pages()

    @property
    def desc_all(self) -> torch.Tensor:
        """Every layer's descriptors in one tensor, int64 ``[layers, pages, 2, kv_heads, blocks]``
        (:attr:`desc` holds views of it); pending new pages are written first."""
        return self.pages.desc_all

    @property
    def desc(self) -> list:
        """Per layer the block descriptors ``int64 [pages, 2, kv_heads, blocks]`` (``zipkv.format``), shared with
        the kernels' caches; pending new pages are written first (:meth:`flush_pages`)."""
        return self.pages.desc

    @property
    def esc(self) -> list | None:
        """Per layer the escape descriptors ``int64 [pages, 2, kv_heads, blocks]`` (``block_format="escape"``:
        :mod:`zipkv.memory.escape_pages`; the kernels' caches' ``escapes``), or None (ZipFusion's format)."""
        return self.pages.esc if self.block_format == "escape" else None

    # ------------------------------------------------------------------ compression

    def compress(self) -> dict:
        """Compress the queued full pages of every layer (call once the reads that used them are done)
        and move in-place compressed pages into compressed chunks where room has appeared. Returns
        counts ``moved`` and ``in_place``.

        Device work is batched over layers -- the pack kernel twice (K, V), one read of the compressed
        sizes back to the host, one copy for every move -- so a step that fills pages costs a few launches,
        not a few per layer; the host places pages layer by layer as before."""
        return self.pages.compress(self.outstanding)

    def keep_raw(self) -> None:
        """Leave the pages queued so far raw (drop them from the compression queue): new KV stays
        uncompressed, as in ZipFusion's throughput setup (§IV-A)."""
        self.pages.keep_raw()

    def compressed_fraction(self, rids=None):
        """Fractions of K and V blocks stored compressed over the pages of ``rids`` (default all running
        requests), all layers: ``(frac_k, frac_v)``."""
        if rids is not None and (isinstance(rids, (str, bytes)) or not hasattr(rids, "__iter__")):
            raise TypeError(f"rids must be None or a list of request ids, got {type(rids).__name__} {rids!r}")
        return self.pages.compressed_fraction([p for r in (self.requests if rids is None else rids)
                                               for p in self._request(r).pages])

    # ------------------------------------------------------------------ accounting

    def used_bytes(self, layer: int | None = None) -> int:
        """Bytes held by pages (raw slots, in-place compressed slots, compressed extents) of ``layer``
        (all layers by default)."""
        return sum(self.placement.used) if layer is None else self.placement.used[self._check_layer(layer, "used_bytes")]

    def held_bytes(self) -> int:
        """Bytes of the whole chunks running requests hold for bytes kept outside the pages (``hold_chunks``)."""
        return self.chunk_bytes * sum(len(r.held) for r in self.requests.values())

    def free_bytes(self) -> int:
        """Bytes neither held by a page nor by a request's held chunks: free and pending chunks, free slots
        and free extents."""
        return self.total_bytes - self.used_bytes() - self.held_bytes()

    def snapshot(self) -> dict:
        """Cheap per-step counters: bytes in use per layer, free and pending chunks, chunks reassigned so far."""
        return dict(used_bytes=list(self.placement.used), chunks_free=self.chunks.n_free,
                    chunks_pending=self.chunks.n_pending(),
                    chunks_held=sum(len(r.held) for r in self.requests.values()),
                    reassigned=self.reassigned, running=len(self.requests))

    def stats(self) -> dict:
        """A full snapshot (walks every page and chunk): :meth:`snapshot` plus chunks per layer and kind,
        pages per kind, capacity and outstanding reservations."""
        return dict(self.snapshot(),
                    chunks_raw=[self.chunks.n_owned(l, RAW) for l in range(self.num_layers)],
                    chunks_comp=[self.chunks.n_owned(l, COMP) for l in range(self.num_layers)],
                    **self.pages.page_kinds(), capacity_pages=self.capacity_pages(), outstanding=self.outstanding)
