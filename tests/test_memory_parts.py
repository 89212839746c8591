"""The parts of the KV memory manager on their own (zipkv.memory.capacity, .chunks, .placement, .pages; ZipFusion
§III-D): capacity arithmetic on plain numbers against brute force, the chunk pool's take / release / hold /
reads_done rules, raw slots and compressed extents without tensors (first fit, the spill of a page between two
chunks, the admission check's count of new chunks), and new pages' descriptors."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from zipkv import format as fmt
from zipkv.memory import capacity as cap
from zipkv.memory.chunks import COMP, FREE, HELD, OWNED, PENDING, RAW, ChunkPool
from zipkv.memory.pages import Pages, pack_slots_reference
from zipkv.memory.placement import UNIT, Placement, free_extent

pytestmark = pytest.mark.usefixtures("one_thread")

slots_st = st.lists(st.integers(0, 12), min_size=1, max_size=4)


def _chunks_for(n, free_slots, ppc):
    """Chunks the layers need for ``n`` new pages, counted one layer at a time."""
    return sum(-(-(n - f) // ppc) for f in free_slots if n > f)


# ---------------------------------------------------------------------- capacity


def test_capacity_counts_a_slot_in_every_layer():
    assert cap.capacity([0, 0, 0], 3, 4) == 4                 # one chunk per layer: 4 pages each
    assert cap.capacity([0, 0, 0], 2, 4) == 0                 # a layer without a chunk takes no page
    assert cap.capacity([5, 0], 1, 4) == 4                    # layer 1's one chunk bounds it
    assert cap.capacity([5, 0], 2, 4) == 5                    # 6 would need a chunk in layer 0 too
    assert cap.capacity([7, 7], 0, 4) == 7


@given(free_slots=slots_st, free_chunks=st.integers(0, 10), ppc=st.integers(1, 5))
@settings(max_examples=200, deadline=None)
def test_capacity_is_the_most_pages_whose_chunks_the_pool_holds(free_slots, free_chunks, ppc):
    got = cap.capacity(free_slots, free_chunks, ppc)
    assert _chunks_for(got, free_slots, ppc) <= free_chunks < _chunks_for(got + 1, free_slots, ppc)
    assert cap.capacity(free_slots, free_chunks + 1, ppc) >= got
    assert cap.capacity([f + 1 for f in free_slots], free_chunks, ppc) >= got


@given(free_slots=slots_st, free_chunks=st.integers(-3, 10), pages=st.integers(0, 30), hold=st.integers(0, 4),
       ppc=st.integers(1, 5))
@settings(max_examples=200, deadline=None)
def test_fits_holds_chunks_first_and_never_overdraws_the_pool(free_slots, free_chunks, pages, hold, ppc):
    want = free_chunks - hold >= 0 and _chunks_for(pages, free_slots, ppc) <= free_chunks - hold
    assert cap.fits(free_slots, free_chunks, pages, ppc, hold) == want


def test_take_chunks_takes_a_layers_own_pending_chunks_first():
    free, n_free = [8, 3, 5], 4
    assert cap.take_chunks(free, n_free, [2, 0, 1], [3, 1, 0], 4) == ([0, 3, 5], 2)
    assert free == [8, 3, 5]                                  # the caller's list is left as it was
    assert cap.take_chunks(free, 0, [0, 0, 0], [2, 0, 1], 4) == ([8, 3, 5], -3)   # the pool lacks 3


@given(free_slots=slots_st, free_chunks=st.integers(-5, 8), pages=st.integers(0, 30), ppc=st.integers(1, 5))
@settings(max_examples=200, deadline=None)
def test_chunks_short_is_the_fewest_chunks_that_make_it_fit(free_slots, free_chunks, pages, ppc):
    short = cap.chunks_short(free_slots, free_chunks, pages, ppc)
    assert cap.fits(free_slots, free_chunks + short, pages, ppc)
    assert short == 0 or not cap.fits(free_slots, free_chunks + short - 1, pages, ppc)
    assert (short == 0) == cap.fits(free_slots, free_chunks, pages, ppc)


def test_request_pages_and_its_reservation():
    assert [cap.pages_for(t) for t in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
    assert cap.request_pages(20, 5, 1.0) == (2, 2, 0)         # 24 tokens: nothing left to reserve
    assert cap.request_pages(16, 65, 1.0) == (5, 1, 4)        # 80 tokens
    assert cap.request_pages(16, 65, 0.5) == (5, 1, 2)
    assert cap.request_pages(16, 65, 0.3) == (5, 1, 2)        # rounded up


# ---------------------------------------------------------------------- chunk pool


def test_a_layer_takes_its_own_pending_chunk_at_once_and_others_only_after_reads_done():
    pool = ChunkPool(3, 2)
    a, b = pool.take(0, RAW), pool.take(0, COMP)
    assert (a, b) == (0, 1) and pool.n_free == 1 and pool[a].state == OWNED and pool[b].kind == COMP
    pool.release(a)
    assert pool[a].state == PENDING and pool[a].kind == "" and pool.n_pending(0) == 1 and pool.n_pending(1) == 0
    assert pool.take(1, RAW) == 2                               # layer 1 gets the pool's last chunk, not a
    assert pool.take(1, RAW) is None and not pool.can_take(1)   # a is layer 0's until reads_done
    assert pool.can_take(0) and pool.take(0, COMP) == a and pool.n_free == 0 and pool.reassigned == 0
    pool.release(a)
    assert pool.reads_done() and pool[a].state == FREE and pool[a].layer == 0 and pool.n_free == 1
    assert not pool.reads_done()                                # nothing pending: nothing came back
    assert pool.take(1, RAW) == a and pool.reassigned == 1 and pool[a].layer == 1


def test_the_pool_gives_a_layer_its_own_chunks_first_then_unowned_ones():
    pool = ChunkPool(4, 2)
    taken = [pool.take(0, RAW), pool.take(1, RAW), pool.take(1, RAW)]
    for c in taken:
        pool.release(c)
    pool.reads_done()
    assert pool.take(1, RAW) in taken[1:] and pool.take(1, RAW) in taken[1:]
    assert pool.take(1, RAW) == 3 and pool.reassigned == 0      # never owned before layer 0's chunk
    assert pool.take(1, COMP) == taken[0] and pool.reassigned == 1
    assert pool.n_owned(1, RAW) == 3 and pool.n_owned(1, COMP) == 1 and pool.n_owned(0, RAW) == 0


def test_held_chunks_come_from_unowned_ones_and_return_after_reads_done():
    pool = ChunkPool(3, 1)
    c = pool.take(0, RAW)
    pool.release(c)
    pool.reads_done()
    held = [pool.hold(), pool.hold()]
    assert c not in held and all(pool[h].state == HELD and pool[h].layer == -1 for h in held)
    assert pool.n_free == 1 and pool.hold() == c and pool.n_free == 0        # then the others
    pool.let_go(held)
    assert pool.n_pending() == 2 and pool.n_pending(0) == 0 and not pool.can_take(0)
    assert pool.reads_done() and pool.n_free == 2 and all(pool[h].state == FREE for h in held)
    assert pool.take(0, RAW) in held and pool.reassigned == 0


@given(ops=st.lists(st.tuples(st.sampled_from(["take", "release", "hold", "let_go", "reads_done"]),
                              st.integers(0, 2), st.integers(0, 10)), max_size=60))
@settings(max_examples=100, deadline=None)
def test_chunk_states_and_counts_agree_under_any_sequence(ops):
    pool, held, owner_since = ChunkPool(5, 3), [], {}
    for op, layer, pick in ops:
        owned = [c for c, ch in enumerate(pool) if ch.state == OWNED]
        if op == "take":
            before = (pool.n_pending(layer), pool.n_free, pool.reassigned)
            last = {c: ch.layer for c, ch in enumerate(pool)}
            c = pool.take(layer, RAW)
            if c is None:
                assert before[:2] == (0, 0)
                continue
            assert before[0] == 0 or pool.n_free == before[1]        # its own pending chunk first
            assert pool.reassigned - before[2] == (last[c] not in (-1, layer))
            assert owner_since.setdefault(c, layer) == layer, "a chunk changed layer before reads_done"
        elif op == "release" and owned:
            pool.release(owned[pick % len(owned)])
        elif op == "hold" and pool.n_free:
            held.append(pool.hold())
        elif op == "let_go" and held:
            pool.let_go([held.pop(pick % len(held))])
        elif op == "reads_done":
            pool.reads_done()
            owner_since = {c: ch.layer for c, ch in enumerate(pool) if ch.state == OWNED}
        states = [ch.state for ch in pool]
        assert states.count(FREE) == pool.n_free == sum(map(len, pool._free.values()))
        assert states.count(PENDING) == pool.n_pending()
        assert {c for c, s in enumerate(states) if s == HELD} == set(held)


# ---------------------------------------------------------------------- placement (no tensors)


def _placement(chunks=8, layers=1, ppc=4, page_bytes=1024, min_page_units=3):
    """``chunks`` chunks of ``ppc`` raw pages of ``page_bytes``: ``ppc * page_bytes / 256`` units a chunk."""
    return Placement(ChunkPool(chunks, layers), ppc, page_bytes, min_page_units)


def test_free_extent_merges_neighbours():
    assert free_extent([[0, 2], [5, 3]], 2, 3) == [[0, 8]]
    assert free_extent([[0, 2], [6, 3]], 3, 2) == [[0, 2], [3, 2], [6, 3]]
    assert free_extent([], 4, 4) == [[4, 4]]


def test_raw_slots_fill_a_chunk_and_an_empty_chunk_goes_pending():
    p = _placement(chunks=2, layers=2, ppc=2)
    assert p.free_slots() == [0, 0]
    assert [p.raw_alloc(0) for _ in range(3)] == [(0, 0), (0, 1), (1, 0)]
    assert p.free_slots() == [1, 0] and p.used == [3 * 1024, 0] and p.chunks.n_free == 0
    p.raw_free(0, 0, 1)
    p.raw_free(0, 0, 0)
    assert p.chunks[0].state == PENDING and p.free_slots() == [3, 0] and p.space_returns == 2
    with pytest.raises(RuntimeError, match="no raw slot although the capacity check passed"):
        p.raw_alloc(1)                                          # chunk 0 is layer 0's until reads_done
    assert p.raw_alloc(0) == (1, 1)                             # layer 0 fills its open chunk first


def test_a_page_no_extent_holds_whole_is_cut_between_page_heads():
    """Chunks of 16 units, pages of four 3-unit page-heads: the second page begins in the 4 units the first left."""
    p = _placement()
    assert p.units_per_chunk == 16
    assert p.comp_alloc(0, [3, 3, 3, 3], 0) == [(0, 0, 12)]
    assert p.comp_alloc(0, [3, 3, 3, 3], 0) == [(0, 12, 3), (1, 0, 9)]
    assert p.comp_alloc(0, [3, 3, 3, 3], 0) == [(1, 9, 6), (2, 0, 6)]
    assert p.comp_alloc(0, [2, 2], 0) == [(2, 6, 4)]            # first fit in an open chunk
    assert p.used == [(36 + 4) * UNIT] and p.chunks.n_owned(0, COMP) == 3
    assert p.comp_alloc(0, [3, 3, 3, 3], 0, new_chunk=False) is None
    p.comp_free(0, 0, 0, 12)
    assert p.chunks[0].extents == [[0, 12], [15, 1]] and p.chunks[0].state == OWNED   # the cut page lives there
    p.comp_free(0, 0, 12, 3)
    p.comp_free(0, 1, 0, 9)
    assert p.chunks[0].state == PENDING and p.chunks[1].extents == [[0, 9], [15, 1]]


def test_a_new_compressed_chunk_keeps_room_for_reserved_pages():
    """Two layers, three chunks of one raw page, each layer's raw chunk full: taking the last free chunk (then
    layer 0's own pending one) for layer 0's compressed pages leaves no room for a new page, refused while a page is
    reserved."""
    p = _placement(chunks=3, layers=2, ppc=1)
    assert (p.raw_alloc(1), p.raw_alloc(0)) == ((0, 0), (1, 0))
    assert p.comp_alloc(0, [3], outstanding=1) is None and p.chunks.n_free == 1 and p.used[0] == 1024
    assert p.comp_alloc(0, [3], outstanding=0) == [(2, 0, 3)]
    assert p.comp_alloc(0, [3], outstanding=0) is None          # no chunk left, 1 unit free in chunk 2
    p.raw_free(0, 1, 0)                                          # layer 0's raw chunk goes pending: its own
    assert not p.room_for(0, 3, 0) and p.room_for(0, 3, 1)
    assert p.comp_alloc(0, [3], outstanding=1) is None           # taking it leaves no raw slot in layer 0
    assert p.comp_alloc(0, [3], outstanding=0) == [(1, 0, 3)] and p.chunks.n_pending(0) == 0


@given(pages=st.lists(st.lists(st.integers(3, 8), min_size=4, max_size=4), max_size=12),
       before=st.lists(st.lists(st.integers(3, 8), min_size=4, max_size=4), max_size=6), free_some=st.booleans())
@settings(max_examples=100, deadline=None)
def test_new_comp_chunks_is_what_placing_the_pages_takes(pages, before, free_some):
    """The packed admission check counts the chunks :meth:`Placement.comp_alloc` will take, without changing
    anything, and its quick bound (:meth:`Placement.least_new_comp_chunks`) never more; from a layer whose chunks already hold pages (some freed again) and with a partly empty last chunk."""
    p = _placement(chunks=40, ppc=2, page_bytes=4096)           # 32 units a chunk, pages of 12 to 32
    placed = [p.comp_alloc(0, hu, 0) for hu in before]
    if free_some:
        for where in placed[::2]:
            for c, start, units in where:
                p.comp_free(0, c, start, units)
    state = [(ch.state, ch.layer, ch.kind, [list(e) for e in ch.extents], ch.live) for ch in p.chunks]
    want = p.new_comp_chunks([[sum(hu) for hu in pages]], [pages])
    least = p.least_new_comp_chunks([sum(map(sum, pages))])     # the quick refusal's bound never says more
    assert least[0] <= want[0]
    assert [(ch.state, ch.layer, ch.kind, [list(e) for e in ch.extents], ch.live) for ch in p.chunks] == state
    owned = p.chunks.n_owned(0, COMP)
    for hu in pages:
        assert p.comp_alloc(0, hu, 0) is not None
    assert want == [p.chunks.n_owned(0, COMP) - owned]


# ---------------------------------------------------------------------- pages


def test_new_pages_point_at_their_raw_slots_and_freed_ids_come_back():
    layers, heads, dim, ppc = 2, 2, 32, 2
    min_page_units = 2 * heads * fmt.n_blocks(dim) * fmt.PACKED_BLOCK_BYTES // UNIT
    placement = Placement(ChunkPool(4, layers), ppc, 2 * heads * fmt.page_bytes(dim), min_page_units)
    pages = Pages(placement, heads, dim, ("token", "channel"), "cpu", pack_slots_reference, 0, 0)
    ids = pages.new_pages(3)
    assert ids == [0, 1, 2] and pages.changed_pages() == ids
    d = pages.desc_all                                                        # [L, pages, 2, H, blocks]
    for p in ids:
        for l in range(layers):
            kind, c, s = pages._loc[l][p]
            assert kind == RAW and pages.is_raw(l, p)
            head = (c * pages.chunk_bytes + s * pages.page_bytes
                    + torch.arange(2 * heads).reshape(2, heads) * pages.slot_bytes)
            assert torch.equal(d[l, p, :, :, 0] >> 8, head) and not ((d[l, p] >> 7) & 1).any()
    pages.queue_full(ids[:2])
    pages.free_pages([1])
    assert pages._full == [0] and pages.new_pages(1) == [1] and placement.used == [3 * pages.page_bytes] * layers
