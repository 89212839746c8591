"""The chunk pool shared by all layers (ZipFusion §II-C, §III-D): which layer owns each chunk of the byte pool.

A chunk is **free** (in the pool, listed under its last owner), **owned** by one layer as a *raw* or a *compressed*
chunk, **pending** (emptied by its layer, waiting for the attention reads that may still touch it) or **held** by a
request for bytes kept outside the pages. A layer takes its own pending chunk back at once; any other layer gets it
only after :meth:`ChunkPool.reads_done` (a chunk *reassigned*). Only chunk numbers live here: where the pages sit
inside an owned chunk is :mod:`zipkv.memory.placement`'s, the bytes are :mod:`zipkv.memory.pages`'.

``per_layer=True`` is the ablation of the shared pool (the memory manager chapter): each layer gets a fixed share of
the chunks (chunk ``c`` belongs to layer ``c % num_layers``) and a chunk it empties returns to its own share only, so
no chunk is ever reassigned and room compression frees in one layer never serves another.
"""
from __future__ import annotations

from dataclasses import dataclass, field

FREE, OWNED, PENDING, HELD = "free", "owned", "pending", "held"
RAW, COMP = "raw", "comp"


@dataclass
class Chunk:
    state: str = FREE
    layer: int = -1                   # owner (owned / pending) or last owner (free)
    kind: str = ""                    # RAW or COMP while owned
    free_slots: list = field(default_factory=list)    # RAW: free slot numbers
    extents: list = field(default_factory=list)       # COMP: free [start_unit, n_units], sorted
    live: int = 0                     # pages stored


class ChunkPool:
    """``num_chunks`` chunks shared by ``num_layers`` layers: chunk ``c`` is ``pool[c]`` (a :class:`Chunk`).

    n_free: chunks in the pool; reassigned: chunks taken so far by a layer other than their last owner. per_layer:
    each layer only ever takes the chunks of its own fixed share (module docstring)."""

    def __init__(self, num_chunks: int, num_layers: int, *, per_layer: bool = False):
        self.num_layers, self.per_layer = num_layers, bool(per_layer)
        self._chunks = [Chunk() for _ in range(num_chunks)]
        if self.per_layer:                       # free chunks by layer; every chunk's last owner is its home layer
            self._free = {l: [c for c in range(num_chunks - 1, -1, -1) if c % num_layers == l]
                          for l in range(num_layers)}
        else:
            self._free = {-1: list(range(num_chunks - 1, -1, -1))}     # free chunks by last owner (-1: none)
        self.n_free = num_chunks
        self._pending = [[] for _ in range(num_layers)]
        self._held_pending = []                                      # held chunks let go, before reads_done
        self.reassigned = 0

    def __len__(self) -> int:
        return len(self._chunks)

    def __getitem__(self, c: int) -> Chunk:
        return self._chunks[c]

    def __iter__(self):
        return iter(self._chunks)

    def n_pending(self, layer: int | None = None) -> int:
        """Pending chunks of ``layer`` (only it may take them before :meth:`reads_done`); by default all pending
        chunks, held ones let go included."""
        if layer is None:
            return sum(map(len, self._pending)) + len(self._held_pending)
        return len(self._pending[layer])

    def n_owned(self, layer: int, kind: str) -> int:
        """Chunks ``layer`` owns as ``kind`` (:data:`RAW` or :data:`COMP`)."""
        return sum(1 for c in self._chunks if c.state == OWNED and c.layer == layer and c.kind == kind)

    @property
    def free_chunks(self):
        """The pool's free chunks as the capacity arithmetic takes them (:mod:`zipkv.memory.capacity`): their number
        (shared pool), or per layer the free chunks of its own share (``per_layer``)."""
        if self.per_layer:
            return [len(self._free[l]) for l in range(self.num_layers)]
        return self.n_free

    def can_take(self, layer: int) -> bool:
        """Whether :meth:`take` finds a chunk for ``layer``."""
        if self.per_layer:
            return bool(self._pending[layer] or self._free[layer])
        return bool(self._pending[layer]) or self.n_free > 0

    def take(self, layer: int, kind: str) -> int | None:
        """An empty chunk for ``layer`` to own as ``kind``, its slots and extents empty: its own pending chunk, else
        one from the pool (its last owner's first, then one never owned, then any). None if there is none."""
        if self._pending[layer]:
            c = self._pending[layer].pop()
        elif self.can_take(layer):
            owner = next(o for o in ((layer,) if self.per_layer else (layer, -1, *self._free)) if self._free.get(o))
            c = self._free[owner].pop()
            self.n_free -= 1
            if owner not in (-1, layer):
                self.reassigned += 1
        else:
            return None
        ch = self._chunks[c]
        ch.state, ch.layer, ch.kind, ch.live, ch.free_slots, ch.extents = OWNED, layer, kind, 0, [], []
        return c

    def release(self, c: int) -> None:
        """Owned chunk ``c``, now empty, becomes pending: its layer's until :meth:`reads_done`."""
        ch = self._chunks[c]
        ch.state, ch.kind, ch.free_slots, ch.extents = PENDING, "", [], []
        self._pending[ch.layer].append(c)

    def hold(self) -> int:
        """A free chunk held for a request (one never owned first, then any); the pool must have one (and be shared:
        per-layer shares hold no chunk for a request)."""
        if self.per_layer:
            raise ValueError("a request holds chunks of the shared pool only; these chunks are per-layer shares")
        owner = next(o for o in (-1, *self._free) if self._free.get(o))
        c = self._free[owner].pop()
        self.n_free -= 1
        ch = self._chunks[c]
        ch.state, ch.layer, ch.kind, ch.live, ch.free_slots, ch.extents = HELD, -1, "", 0, [], []
        return c

    def let_go(self, held: list) -> None:
        """Held chunks ``held`` become pending: back to the pool at :meth:`reads_done`."""
        for c in held:
            self._chunks[c].state = PENDING
        self._held_pending.extend(held)

    def reads_done(self) -> bool:
        """The attention reads issued so far are finished: every pending chunk goes back to the pool (under its last
        owner). Returns whether any did."""
        returned = any(self._pending) or bool(self._held_pending)
        for l in range(self.num_layers):
            for c in self._pending[l]:
                self._chunks[c].state = FREE
                self._free.setdefault(l, []).append(c)
            self.n_free += len(self._pending[l])
            self._pending[l] = []
        for c in self._held_pending:
            self._chunks[c].state = FREE
            self._free.setdefault(-1, []).append(c)
        self.n_free += len(self._held_pending)
        self._held_pending = []
        return returned
