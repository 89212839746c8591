"""Where each layer's pages sit inside the chunks it owns (ZipFusion §III-D): raw slots and compressed extents.

A raw chunk holds ``pages_per_chunk`` fixed slots of one raw page; a compressed chunk holds variable extents of
compressed pages, in :data:`UNIT` s of 256 bytes (a chunk is ``units_per_chunk`` units). A page that no free extent
holds whole may end one compressed chunk and begin the next, cut between page-heads
(:meth:`Placement.comp_alloc`). Host bookkeeping only: chunk numbers, slot numbers and unit ranges, no tensors (the
bytes and descriptors are :mod:`zipkv.memory.pages`').
"""
from __future__ import annotations

from zipkv.memory import capacity as cap
from zipkv.memory.chunks import COMP, OWNED, RAW, ChunkPool

UNIT = 256
"""Address granularity of the descriptors (a compressed block is 3 units, a raw one 4)."""


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


class Placement:
    """Raw slots and compressed extents of every layer in the chunks of ``chunks``.

    pages_per_chunk: raw slots per chunk; page_bytes: one raw page of one layer; min_page_units: the smallest
    compressed page (every block compressed), below which a free extent takes no page. used: bytes held by pages,
    per layer; space_returns: slots and extents given back so far."""

    def __init__(self, chunks: ChunkPool, pages_per_chunk: int, page_bytes: int, min_page_units: int):
        self.chunks = chunks
        self.num_layers = chunks.num_layers
        self.pages_per_chunk, self.page_bytes, self.min_page_units = pages_per_chunk, page_bytes, min_page_units
        self.units_per_chunk = pages_per_chunk * page_bytes // UNIT
        L = self.num_layers
        self._raw_open = [dict() for _ in range(L)]               # raw chunks with a free slot
        self._raw_free = [0] * L                                  # free slots in owned raw chunks
        self._comp = [dict() for _ in range(L)]                   # compressed chunks
        self._comp_open = [dict() for _ in range(L)]              # ... with room for a page
        self._comp_last = [None] * L                              # the compressed chunk taken last
        self.used = [0] * L
        self.space_returns = 0

    def free_slots(self) -> list[int]:
        """Per layer the raw slots a new page can take without the shared pool: free slots of its raw chunks and
        ``pages_per_chunk`` per pending chunk of its own."""
        return [self._raw_free[l] + self.pages_per_chunk * self.chunks.n_pending(l) for l in range(self.num_layers)]

    # ------------------------------------------------------------------ chunks

    def _take_chunk(self, layer, kind):
        c = self.chunks.take(layer, kind)
        if c is None:
            return None
        ch = self.chunks[c]
        if kind == RAW:
            ch.free_slots = list(range(self.pages_per_chunk - 1, -1, -1))
            self._raw_open[layer][c] = None
            self._raw_free[layer] += self.pages_per_chunk
        else:
            ch.extents = [[0, self.units_per_chunk]]
            self._comp[layer][c] = None
            self._comp_open[layer][c] = None
        return c

    def _release_chunk(self, c):
        ch = self.chunks[c]
        l = ch.layer
        if ch.kind == RAW:
            del self._raw_open[l][c]
            self._raw_free[l] -= self.pages_per_chunk
        else:
            del self._comp[l][c]
            self._comp_open[l].pop(c, None)
        self.chunks.release(c)

    # ------------------------------------------------------------------ raw slots

    def raw_alloc(self, layer: int) -> tuple[int, int]:
        """A raw slot of ``layer``, ``(chunk, slot)``: in an open raw chunk, else in a chunk taken for it."""
        if not self._raw_open[layer] and self._take_chunk(layer, RAW) is None:
            raise RuntimeError("KVMemory: no raw slot although the capacity check passed (internal error)")
        c = next(iter(self._raw_open[layer]))
        ch = self.chunks[c]
        s = ch.free_slots.pop()
        ch.live += 1
        self._raw_free[layer] -= 1
        if not ch.free_slots:
            del self._raw_open[layer][c]
        self.used[layer] += self.page_bytes
        return c, s

    def raw_free(self, layer: int, c: int, s: int) -> None:
        """Give back raw slot ``s`` of chunk ``c``; an emptied chunk goes pending."""
        ch = self.chunks[c]
        ch.free_slots.append(s)
        ch.live -= 1
        self._raw_free[layer] += 1
        self.space_returns += 1
        self._raw_open[layer][c] = None
        self.used[layer] -= self.page_bytes
        if ch.live == 0:
            self._release_chunk(c)

    # ------------------------------------------------------------------ compressed extents

    def comp_alloc(self, layer: int, head_units, outstanding: int, new_chunk: bool = True):
        """Room in ``layer`` for a compressed page whose page-heads take ``head_units`` units (in their order in
        the page): the pieces ``[(chunk, start unit, units)]`` it goes to, or None. The whole page first fit in
        the layer's open chunks; else, where a new chunk may be taken (``new_chunk``, and the capacity left covers
        the ``outstanding`` reserved pages), the page's first page-heads fill the largest free extent of the chunk
        this layer took last (the end of a chunk that no whole page fits, which first fit alone leaves unused) and
        the rest starts the new chunk. A page-head is never cut: each block's descriptor holds its own address, so
        the kernels read a page of two pieces as any other. On the throughput chapter's Llama-3.1-8B-shape prefixes
        (real-KV pages of about 201 units, chunks of 4096; 57 requests of 8192 tokens admitted packed, CPU,
        2026-12-05) first fit alone used 98.3 % of the compressed chunks' bytes and this 99.8 %: 696 chunks fewer,
        1.4 % of the budget."""
        units = sum(head_units)
        for c in self._comp_open[layer]:
            for e in self.chunks[c].extents:
                if e[1] >= units:
                    self.used[layer] += units * UNIT
                    return [self._carve(c, e, units)]
        if not new_chunk or not self.chunks.can_take(layer) or units > self.units_per_chunk:
            return None
        new = [0] * self.num_layers
        new[layer] = 1
        free, n_free = cap.take_chunks(self.free_slots(), self.chunks.free_chunks,
                                       [self.chunks.n_pending(l) for l in range(self.num_layers)], new,
                                       self.pages_per_chunk)
        if cap.capacity(free, n_free, self.pages_per_chunk) < outstanding:
            return None
        tail = self._spill_extent(layer)
        cut = _head_cut(head_units, tail[1][1]) if tail else 0
        pieces = [self._carve(tail[0], tail[1], cut)] if cut else []
        c = self._take_chunk(layer, COMP)
        self._comp_last[layer] = c
        self.used[layer] += units * UNIT
        return pieces + [self._carve(c, self.chunks[c].extents[0], units - cut)]

    def _spill_extent(self, layer):
        """``(chunk, extent)``: the largest free extent of the compressed chunk ``layer`` took last, None if that
        chunk is no longer its compressed chunk or is full."""
        c = self._comp_last[layer]
        ch = self.chunks[c] if c is not None else None
        if ch is None or ch.state != OWNED or ch.layer != layer or ch.kind != COMP or not ch.extents:
            return None
        return c, max(ch.extents, key=lambda e: e[1])

    def room_for(self, layer: int, units: int, pages: int) -> bool:
        """Whether :meth:`comp_alloc` might place a page of ``units`` in ``layer`` during a compression pass over
        ``pages`` in-place pages and nothing new (a superset of its success: False means it returns None)."""
        if any(e[1] >= units for c in self._comp_open[layer] for e in self.chunks[c].extents):
            return True
        return pages >= self.pages_per_chunk and self.chunks.can_take(layer)

    def _carve(self, c, extent, units):
        start = extent[0]
        extent[0] += units
        extent[1] -= units
        ch = self.chunks[c]
        if extent[1] == 0:
            ch.extents.remove(extent)
        if max((n for _, n in ch.extents), default=0) < self.min_page_units:
            self._comp_open[ch.layer].pop(c, None)
        ch.live += 1
        return c, start, units

    def comp_free(self, layer: int, c: int, start: int, units: int) -> None:
        """Give back the extent ``[start, units]`` of compressed chunk ``c``; an emptied chunk goes pending."""
        ch = self.chunks[c]
        ch.live -= 1
        self.used[layer] -= units * UNIT
        self.space_returns += 1
        ch.extents = merged = free_extent(ch.extents, start, units)
        if max(n for _, n in merged) >= self.min_page_units:
            self._comp_open[layer][c] = None
        if ch.live == 0:
            self._release_chunk(c)

    def least_new_comp_chunks(self, layer_units: list[int]) -> list[int]:
        """A lower bound of :meth:`new_comp_chunks` from each layer's total units alone: what the layer's open
        compressed chunks (and the spill extent of the one it took last) cannot hold, in whole chunks. Every unit goes
        to one of those extents or to a new chunk, so no placement needs fewer; O(chunks), not O(pages)."""
        need = []
        for l, total in enumerate(layer_units):
            held = dict.fromkeys(self._comp_open[l])
            if self._spill_extent(l) is not None:
                held[self._comp_last[l]] = None
            room = sum(e[1] for c in held for e in self.chunks[c].extents)
            need.append(-(-max(0, total - room) // self.units_per_chunk))
        return need

    def new_comp_chunks(self, units: list[list[int]], head_units: list[list[list[int]]]) -> list[int]:
        """New compressed chunks each layer needs to place pages of ``units`` (per layer and page) whose page-heads
        take ``head_units`` (per layer and page, in their order) as :meth:`comp_alloc` does (first fit, else a new
        chunk, with the page's first page-heads in the largest extent of the chunk taken last). Changes nothing."""
        upc, need = self.units_per_chunk, []
        for l in range(self.num_layers):
            least = min(units[l], default=upc + 1)
            spill = self._spill_extent(l)
            last = [list(e) for e in self.chunks[spill[0]].extents] if spill else []   # the last chunk's extents
            copies = {spill[0]: last} if spill else {}
            # extents smaller than the request's smallest page never take one of its pages: leaving them out keeps
            # first-fit's choices and makes each page's search short (else O(pages x chunks) per layer)
            room = [r for r in ([e for e in (copies.get(c) or [list(e) for e in self.chunks[c].extents]) if e[1] >= least]
                                for c in self._comp_open[l]) if r]
            new = 0
            for u, hu in zip(units[l], head_units[l]):
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
