"""Capacity accounting on plain numbers (ZipFusion §III-D): how many new logical pages fit raw, what a request
reserves, and whether it fits.

A new logical page needs a raw slot in *every* layer. ``free_slots[l]`` counts layer ``l``'s free slots in its raw
chunks and its pending chunks (``pages_per_chunk`` each); ``free_chunks`` counts the chunks of the shared pool, each
good for ``pages_per_chunk`` slots in any one layer. The memory's own counts come from
:meth:`zipkv.memory.placement.Placement.free_slots` and :attr:`zipkv.memory.chunks.ChunkPool.free_chunks`.

With per-layer pools (``KVMemory(..., pool="per_layer")``, the shared pool's ablation) ``free_chunks`` is a list: layer
``l``'s own free chunks, good for its slots only. Every function here takes either form.
"""
from __future__ import annotations

import math

from zipkv import format as fmt


def pages_for(tokens: int) -> int:
    """Pages of ``fmt.PAGE_TOKENS`` tokens that hold ``tokens`` tokens."""
    return -(-tokens // fmt.PAGE_TOKENS)


def capacity(free_slots: list[int], free_chunks: int, pages_per_chunk: int) -> int:
    """New logical pages that fit raw: the most ``n`` whose missing slots, ``ceil((n - free_slots[l]) /
    pages_per_chunk)`` chunks in each layer short of ``n``, add up to at most ``free_chunks`` (a binary search). Per-layer
    pools (``free_chunks`` a list): the layer with the least room, its own chunks only."""
    if isinstance(free_chunks, list):
        return max(0, min(f + c * pages_per_chunk for f, c in zip(free_slots, free_chunks)))
    lo, hi = 0, min(free_slots) + free_chunks * pages_per_chunk
    while lo < hi:
        mid = (lo + hi + 1) // 2
        need = sum(-(-(mid - f) // pages_per_chunk) for f in free_slots if mid > f)
        lo, hi = (mid, hi) if need <= free_chunks else (lo, mid - 1)
    return lo


def fits(free_slots: list[int], free_chunks: int, pages: int, pages_per_chunk: int, hold_chunks: int = 0) -> bool:
    """Whether ``pages`` new logical pages fit raw once ``hold_chunks`` chunks of the pool are held (and the pool is
    not overdrawn: ``free_chunks`` may be negative after :func:`take_chunks`)."""
    if isinstance(free_chunks, list):          # per-layer pools hold no chunk for a request
        return hold_chunks == 0 and min(free_chunks) >= 0 and capacity(free_slots, free_chunks, pages_per_chunk) >= pages
    return hold_chunks <= free_chunks and capacity(free_slots, free_chunks - hold_chunks, pages_per_chunk) >= pages


def take_chunks(free_slots: list[int], free_chunks: int, pending: list[int], new_chunks: list[int],
                pages_per_chunk: int) -> tuple[list[int], int]:
    """``(free_slots, free_chunks)`` once each layer ``l`` took ``new_chunks[l]`` chunks for other use (compressed
    chunks): its ``pending[l]`` own pending chunks first (their slots leave ``free_slots[l]``), then the pool's
    (``free_chunks`` may go below zero: the pool lacks that many; per layer, for per-layer pools)."""
    free_slots = list(free_slots)
    per_layer = isinstance(free_chunks, list)
    free_chunks = list(free_chunks) if per_layer else free_chunks
    for l, new in enumerate(new_chunks):
        own = min(new, pending[l])
        free_slots[l] -= own * pages_per_chunk
        if per_layer:
            free_chunks[l] -= new - own
        else:
            free_chunks -= new - own
    return free_slots, free_chunks


def chunks_short(free_slots: list[int], free_chunks: int, pages: int, pages_per_chunk: int) -> int:
    """The fewest chunks to add to the pool for ``pages`` new logical pages to fit raw (0 when they fit); per-layer
    pools: to the layers' shares, summed."""
    if isinstance(free_chunks, list):
        return sum(max(0, -(-max(0, pages - f) // pages_per_chunk) - c) for f, c in zip(free_slots, free_chunks))
    lo = max(0, -free_chunks)
    hi = lo + len(free_slots) * -(-pages // pages_per_chunk)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if capacity(free_slots, free_chunks + mid, pages_per_chunk) >= pages else (mid + 1, hi)
    return lo


def request_pages(prompt_len: int, max_new_tokens: int, reserve_ratio: float) -> tuple[int, int, int]:
    """``(most, prompt, reserve)`` pages of a request: those it holds at its longest (``prompt_len + max_new_tokens -
    1`` cached tokens), those of its prompt, and its reservation ``ceil(reserve_ratio * (most - prompt))`` (SGLang's
    ``new_token_ratio`` share of the pages it can still grow by)."""
    most, prompt = pages_for(prompt_len + max_new_tokens - 1), pages_for(prompt_len)
    return most, prompt, math.ceil(reserve_ratio * (most - prompt))
