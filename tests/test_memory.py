"""Property tests of the cross-layer KV memory manager (zipkv.memory, ZipFusion §III-D).

A hypothesis state machine drives long random sequences of admit / admit packed (full pages arriving
compressed, counted at their packed size) / append (pages filling) / compress /
reads_done (chunks reassigned to other layers) / finish / retract over several layers and checks after
every step, against an independent recount: no page lost or owned twice (slots, extents, ids), byte
accounting exact, admission never promising room a later append cannot get, the bytes of every request
reading back bit-exact through the kernel's cache format, and every freed byte available again.
"""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch.utils._python_dispatch import TorchDispatchMode

from zipkv.kernels.decode_attention import PagedKVCache
from zipkv.memory import COMP, FREE, HELD, OWNED, PENDING, RAW, UNIT, KVMemory

pytestmark = pytest.mark.usefixtures("one_thread")

L, H, D = 3, 1, 32                       # one 512-value block per page-head: eligibility varies per page


def _tokens(gen, n, wide, heads=H, dim=D):
    """bf16 [heads, n, dim]: narrow exponents (compressible blocks) or, with ``wide``, a spread that is not."""
    x = torch.randn(heads, n, dim, generator=gen)
    if wide:
        x = x * torch.exp2(torch.randint(-30, 30, (heads, n, 1), generator=gen).float())
    return x.bfloat16()


class MemoryMachine(RuleBasedStateMachine):
    """One KV head of 32 channels: a page-head is one block, so a page is cut only between its K and V."""
    HEADS, DIM, LAYOUTS = H, D, ("token", "channel")

    @initialize(chunks_per_layer=st.integers(1, 6), ppc=st.integers(1, 4), seed=st.integers(0, 2**16))
    def setup(self, chunks_per_layer, ppc, seed):
        page = 2 * self.HEADS * 2 * 16 * self.DIM
        self.m = self._memory(L * chunks_per_layer * ppc * page + 100, ppc)
        self.gen = torch.Generator().manual_seed(seed)
        self.kv = {}                     # (rid, layer) -> (k, v) written so far
        self.max_new = {}
        self.full_reserve = set()        # requests admitted with reserve_ratio = 1
        self.next_rid = 0
        self.since_reads_done = {}
        self.initial_capacity = self.m.capacity_pages()
        self.refused = []                # (check, space_returns when it failed): the engine's retry rule

    def _memory(self, budget, ppc):
        return KVMemory(L, self.HEADS, self.DIM, budget, pages_per_chunk=ppc, k_layout=self.LAYOUTS[0],
                        v_layout=self.LAYOUTS[1])

    def _cache(self, l):
        """Layer ``l``'s cache as the kernels read it."""
        return PagedKVCache(self.m.pool[: self.m.total_bytes], self.m.desc[l], self.DIM, *self.LAYOUTS)

    def _write(self, rid, start, n):
        for l in range(L):
            wide = bool(torch.rand((), generator=self.gen) < 0.3)
            k, v = (_tokens(self.gen, n, w, self.HEADS, self.DIM) for w in (wide, not wide))
            self.m.write(l, rid, start, k, v)
            old = self.kv.get((rid, l))
            self.kv[rid, l] = (k, v) if old is None else (torch.cat([old[0], k], 1), torch.cat([old[1], v], 1))

    def _drop(self, rid):
        for l in range(L):
            self.kv.pop((rid, l), None)
        self.full_reserve.discard(rid)

    # ---------------------------------------------------------------- rules

    @rule(prompt=st.integers(1, 70), max_new=st.integers(1, 40), full=st.booleans(), hold=st.integers(0, 2))
    def admit(self, prompt, max_new, full, hold):
        ratio = 1.0 if full else 0.5
        if (prompt + max_new - 1 + 15) // 16 > self.m.max_request_pages:
            with pytest.raises(ValueError, match="holds at most"):
                self.m.admit(self.next_rid, prompt, max_new, reserve_ratio=ratio, hold_chunks=hold)
            return
        # with its held chunks taken, the empty budget holds (chunks left // layers) chunks of pages per layer
        if hold and (self.m.num_chunks - hold) // L * self.m.pages_per_chunk < (prompt + max_new - 1 + 15) // 16:
            with pytest.raises(ValueError, match="never fits"):
                self.m.admit(self.next_rid, prompt, max_new, reserve_ratio=ratio, hold_chunks=hold)
            return
        expect = self.m.can_admit(prompt, max_new, reserve_ratio=ratio, hold_chunks=hold)
        free_before, held_before = self.m.chunks.n_free, self.m.held_bytes()
        ids = self.m.admit(self.next_rid, prompt, max_new, reserve_ratio=ratio, hold_chunks=hold)
        assert (ids is not None) == expect
        if ids is None:
            self.refused.append((lambda: self.m.can_admit(prompt, max_new, reserve_ratio=ratio, hold_chunks=hold),
                                 self.m.space_returns))
            prompt_pages = (prompt + 15) // 16
            need = prompt_pages + math.ceil(ratio * ((prompt + max_new + 14) // 16 - prompt_pages))
            # an independent recount: what would be left after holding the chunks, one capacity step at a time
            left = self.m.chunks.n_free - hold
            slots = self.m.placement.free_slots()
            cap = 0
            while left >= 0:
                short = [l for l in range(L) if slots[l] == 0]
                if len(short) > left:
                    break
                left -= len(short)
                for l in range(L):
                    slots[l] += self.m.pages_per_chunk if l in short else 0
                    slots[l] -= 1
                cap += 1
            assert hold > free_before or cap - self.m.outstanding < need
            return
        assert self.m.held_bytes() - held_before == hold * self.m.chunk_bytes
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        self.max_new[rid] = max_new
        if full:
            self.full_reserve.add(rid)
        self._write(rid, 0, prompt)

    @rule(prompt=st.integers(1, 70), max_new=st.integers(1, 40), wide=st.floats(0, 1))
    def admit_packed(self, prompt, max_new, wide):
        """A request whose full pages arrive packed (a pre-compressed prefix): counted at its packed size."""
        if (prompt + max_new - 1 + 15) // 16 > self.m.max_request_pages:
            return
        kv = []
        for _ in range(L):
            w = bool(torch.rand((), generator=self.gen) < wide)
            kv.append(tuple(_tokens(self.gen, prompt, x, self.HEADS, self.DIM) for x in (w, not w)))
        packed = self.m.pack(kv)
        expect = self.m.can_admit_packed(packed, max_new)
        used = self.m.used_bytes()
        chunks = [len(c) for c in self.m.placement._comp]
        need = self.m.placement.new_comp_chunks(packed.units, packed.head_units)
        assert all(a <= b for a, b in zip(self.m.placement.least_new_comp_chunks(packed.layer_units), need))
        ids = self.m.admit_packed(self.next_rid, packed, max_new)
        assert (ids is not None) == expect
        if ids is not None:          # the admission check's count of new chunks is what placing the pages took
            assert [len(c) - n for c, n in zip(self.m.placement._comp, chunks)] == need
        if ids is None:
            assert self.m.used_bytes() == used
            self.refused.append((lambda: self.m.can_admit_packed(packed, max_new), self.m.space_returns))
            return
        assert self.m.used_bytes() - used == UNIT * sum(map(sum, packed.units)) + L * (prompt % 16 > 0) * self.m.page_bytes
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        self.max_new[rid] = max_new
        self.full_reserve.add(rid)
        for l, (k, v) in enumerate(packed.tail):
            if k.shape[1]:
                self.m.write(l, rid, packed.n_pages * 16, k, v)
        for l in range(L):
            self.kv[rid, l] = kv[l]

    @precondition(lambda self: self.m.requests)
    @rule(data=st.data())
    def append(self, data):
        rid = data.draw(st.sampled_from(sorted(self.m.requests)))
        r = self.m.requests[rid]
        if r.cache_len >= r.max_len:
            return
        n = r.cache_len
        ids = self.m.alloc(rid, 1)
        if rid in self.full_reserve:
            assert ids is not None, "an admitted request could not get the page it was promised"
        if ids is None:                  # no room: retract one (the victim may be rid itself)
            self.retract()
            return
        self._write(rid, n, 1)

    @rule()
    def compress(self):
        self.m.compress()

    @rule()
    def reads_done(self):
        self.m.reads_done()
        self.since_reads_done = {}       # chunk -> the layer that owned it since the last reads_done

    @precondition(lambda self: self.m.requests)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.m.requests)))
        self.m.free(rid)
        self._drop(rid)

    @precondition(lambda self: self.m.requests)
    @rule()
    def retract(self):
        """The scheduler's choice (SGLang's ``retract_decode`` order, on the memory's own counts), freed."""
        reqs = self.m.requests
        victim = min(reqs, key=lambda q: (reqs[q].cache_len - reqs[q].prompt_len, -reqs[q].prompt_len))
        self.m.free(victim)
        assert victim not in self.m.requests
        self._drop(victim)

    # ---------------------------------------------------------------- invariants

    @invariant()
    def pages_owned_once_and_bytes_exact(self):
        m = self.m
        ids = [p for r in m.requests.values() for p in r.pages]
        assert len(ids) == len(set(ids)), "a page id is owned by two requests"
        assert set(ids).isdisjoint(m.pages._free_ids) and len(ids) + len(m.pages._free_ids) == m.max_pages, "page id lost"
        for l in range(L):
            assert set(m.pages._loc[l]) == set(ids)
            raw_slots, units = set(), {}
            used = 0
            for p, loc in m.pages._loc[l].items():
                if loc[0] == COMP:
                    assert 1 <= len(loc[1]) <= 2, "a compressed page lies in one extent or ends one chunk and begins another"
                    for c, start, n in loc[1]:
                        ch = m.chunks[c]
                        assert ch.state == OWNED and ch.layer == l and ch.kind == COMP and n > 0
                        for u in range(start, start + n):
                            assert (c, u) not in units, "two pages share compressed bytes"
                            units[c, u] = p
                        used += n * UNIT
                    continue
                ch = m.chunks[loc[1]]
                assert ch.state == OWNED and ch.layer == l
                assert ch.kind == RAW and (loc[1], loc[2]) not in raw_slots, "two pages share a raw slot"
                raw_slots.add((loc[1], loc[2]))
                used += m.page_bytes
            assert used == m.used_bytes(l), "byte accounting"
            for c, ch in enumerate(m.chunks):
                if ch.state != OWNED or ch.layer != l:
                    continue
                if ch.kind == RAW:
                    live = {s for (cc, s) in raw_slots if cc == c}
                    assert live.isdisjoint(ch.free_slots) and len(live) + len(ch.free_slots) == m.pages_per_chunk
                    assert live and ch.live == len(live), "an owned chunk is empty (should be pending)"
                else:
                    free_u = [u for s, n in ch.extents for u in range(s, s + n)]
                    live_u = [u for (cc, u) in units if cc == c]
                    assert not set(free_u) & set(live_u) and len(free_u) + len(live_u) == m.units_per_chunk
                    assert live_u
            assert m.placement._raw_free[l] == sum(len(ch.free_slots) for ch in m.chunks
                                         if ch.state == OWNED and ch.layer == l and ch.kind == RAW)
        states = [c.state for c in m.chunks]
        assert states.count(FREE) == m.chunks.n_free == sum(map(len, m.chunks._free.values()))
        assert states.count(PENDING) == sum(map(len, m.chunks._pending)) + len(m.chunks._held_pending)
        held = [c for r in m.requests.values() for c in r.held]
        assert len(held) == len(set(held)) and {c for c, s in enumerate(states) if s == HELD} == set(held)
        for l in range(L):
            comp, comp_open = m.placement._comp[l], m.placement._comp_open[l]
            assert set(comp) == {c for c, ch in enumerate(m.chunks)
                                 if ch.state == OWNED and ch.layer == l and ch.kind == COMP}
            assert set(comp_open) == {c for c in comp
                                      if max((n for _, n in m.chunks[c].extents), default=0) >= m.placement.min_page_units}
        assert m.free_bytes() + m.used_bytes() + len(held) * m.chunk_bytes == m.total_bytes

    @invariant()
    def chunks_change_layer_only_after_reads_done(self):
        for c, ch in enumerate(self.m.chunks):
            if ch.state == OWNED:
                before = self.since_reads_done.setdefault(c, ch.layer)
                assert before == ch.layer, f"chunk {c} went from layer {before} to {ch.layer} before reads_done"

    @invariant()
    def a_refused_request_stays_refused_until_space_returns(self):
        """Only the operations :attr:`KVMemory.space_returns` counts make room, so the engine checks a blocked
        request again only once that count has moved."""
        self.refused = [(check, n) for check, n in self.refused if n == self.m.space_returns]
        for check, _ in self.refused:
            assert not check(), "a refused request fits although no space came back"

    @invariant()
    def promises_are_covered(self):
        assert self.m.capacity_pages() >= self.m.outstanding

    @invariant()
    def bytes_read_back_exactly(self):
        for rid in self.m.requests:
            pages = torch.tensor(self.m.requests[rid].pages)
            n = self.m.requests[rid].cache_len
            for l in range(L):
                cache = self._cache(l)
                k, v = (x.permute(1, 0, 2, 3).reshape(self.HEADS, -1, self.DIM)[:, :n] for x in cache.read_pages(pages))
                wk, wv = self.kv[rid, l]
                assert torch.equal(k.view(torch.int16), wk.view(torch.int16)), f"keys of request {rid}, layer {l}"
                assert torch.equal(v.view(torch.int16), wv.view(torch.int16)), f"values of request {rid}, layer {l}"

    def teardown(self):
        for rid in list(self.m.requests):
            self.m.free(rid)
        self.m.reads_done()
        assert self.m.used_bytes() == 0
        assert self.m.chunks.n_free == self.m.num_chunks, "a freed chunk did not come back to the pool"
        assert self.m.capacity_pages() == self.initial_capacity == self.m.max_request_pages
        assert self.m.available_size() == 16 * self.initial_capacity


class MmaMemoryMachine(MemoryMachine):
    """Two KV heads of 64 channels in the mma layouts (ZipFusion's on a GPU): two blocks per page-head, so a
    compressed page that no free extent holds whole can be cut at any of three page-head boundaries."""
    HEADS, DIM, LAYOUTS = 2, 64, ("k_mma", "v_mma")


MemoryMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=40, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
MmaMemoryMachine.TestCase.settings = settings(max_examples=20, stateful_step_count=40, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
TestMemoryMachine = MemoryMachine.TestCase
TestMmaMemoryMachine = MmaMemoryMachine.TestCase


def test_compression_frees_chunks_for_other_layers():
    """A compressible layer moves its full pages into compressed chunks (a fresh chunk only for at least a
    chunk's worth of pages: the last page stays compressed in place), its raw chunks empty (pending until
    reads_done, usable by their own layer only), and then a chunk emptied by layer 0 serves layer 1."""
    m = KVMemory(2, H, D, 11 * 4 * m_page(), pages_per_chunk=4)           # 11 chunks of 4 pages
    gen = torch.Generator().manual_seed(0)
    m.admit("a", 256, 1)                                                   # 16 pages: 4 chunks per layer
    m.write(0, "a", 0, _tokens(gen, 256, False), _tokens(gen, 256, False))  # layer 0: compressible
    m.write(1, "a", 0, _tokens(gen, 256, True), _tokens(gen, 256, True))    # layer 1: not
    assert m.compress() == dict(moved=15, in_place=1)                      # 5 + 5 + 5 in 3 compressed chunks
    assert m.used_bytes(0) == 15 * 2 * H * 768 + m.page_bytes and m.used_bytes(1) == 16 * m.page_bytes
    assert m.stats()["chunks_pending"] == 3 and m.stats()["chunks_free"] == 0
    assert m.capacity_pages() == 0                                         # pending: for layer 0 only
    m.reads_done()
    assert m.stats()["chunks_free"] == 3 and m.capacity_pages() == 7
    layer0_chunks = {c for c, ch in enumerate(m.chunks) if ch.layer == 0 and ch.state == FREE}
    m.admit("b", 16, 1)                                                    # layer 1 needs one of them
    assert m.reassigned == 1
    assert any(m.chunks[c].layer == 1 and m.chunks[c].state == OWNED for c in layer0_chunks)


def test_packed_admission_counts_the_packed_size():
    """A budget of 16 raw pages per layer (chunks of 4) holds four 4-page requests written raw; packed first
    (every block compressible: 3 of its 4 units, so 5 pages to a chunk), their pages go straight into
    compressed chunks and a fifth request fits -- where raw admission refuses it."""
    gen = torch.Generator().manual_seed(2)
    one = lambda: (1 + torch.rand(H, 64, D, generator=gen)).bfloat16()                   # noqa: E731  one exponent
    kv = lambda: [(one(), one()) for _ in range(2)]                                        # noqa: E731
    m = KVMemory(2, H, D, 16 * 2 * m_page(), pages_per_chunk=4)
    for rid in range(4):
        assert m.admit(rid, 64, 1) is not None
    assert not m.can_admit(64, 1)
    p = KVMemory(2, H, D, 16 * 2 * m_page(), pages_per_chunk=4)
    for rid in range(5):
        packed = p.pack(kv())
        assert packed.n_pages == 4 and all(u == [6] * 4 for u in packed.units)
        assert p.admit_packed(rid, packed, 1) is not None, rid
    assert p.used_bytes() == 2 * 5 * 4 * 6 * UNIT and p.stats()["chunks_comp"] == [4, 4]
    assert not p.can_admit_packed(p.pack(kv()), 1) and p.admit_packed(5, p.pack(kv()), 1) is None


@pytest.mark.parametrize("max_new", [1, 40])
def test_chunks_short_is_what_one_more_request_lacks(max_new):
    """Packed requests of mixed compressibility fill a budget; the first one refused is ``chunks_short`` chunks
    from admission: with that many more chunks in the budget the same sequence admits it, with one fewer not."""
    gen = torch.Generator().manual_seed(4)
    kvs = [[(_tokens(gen, 100, w), _tokens(gen, 100, not w)) for w in (i % 3 == 0, i % 2 == 0, False)] for i in range(40)]

    def fill(extra_chunks):
        m = KVMemory(L, H, D, (L * 12 + extra_chunks) * 2 * m_page(), pages_per_chunk=2)
        for i, kv in enumerate(kvs):
            if m.admit_packed(i, m.pack(kv), max_new) is None:
                return m, i
        raise AssertionError("the budget held every request")
    m, refused = fill(0)
    short = m.chunks_short(m.pack(kvs[refused]), max_new)
    assert short > 0 and not m.can_admit_packed(m.pack(kvs[refused]), max_new)
    assert fill(short)[1] > refused and fill(short - 1)[1] == refused


def test_a_page_no_extent_holds_whole_ends_one_chunk_and_begins_the_next():
    """Two KV heads: a compressible page is four page-heads of 3 units, 12 units, and a chunk of 4 raw pages is 64.
    First fit alone stores 5 such pages a chunk (60 units, 4 unused: a 21-page request takes 5 chunks); cut between
    page-heads, the pages that no extent holds whole fill the ends of chunks and the 21 pages take 4 (252 units).
    The bytes read back bit-exact through the kernel's descriptors, and freeing the request returns every chunk."""
    heads, n_pages = 2, 21
    gen = torch.Generator().manual_seed(3)
    one = lambda: (1 + torch.rand(heads, 16 * n_pages, D, generator=gen)).bfloat16()     # noqa: E731  one exponent
    m = KVMemory(1, heads, D, 8 * 4 * 2 * heads * 2 * 16 * D, pages_per_chunk=4)
    kv = [(one(), one())]
    packed = m.pack(kv)
    assert packed.head_units == [[[3] * 2 * heads] * n_pages] and m.units_per_chunk == 64
    whole_per_chunk = m.units_per_chunk // 12
    assert m.placement.new_comp_chunks(packed.units, packed.head_units) == [4] < [-(-n_pages // whole_per_chunk)]
    ids = m.admit_packed("r", packed, 1)
    assert len(m.placement._comp[0]) == 4 and m.used_bytes() == n_pages * 12 * UNIT
    cut = [loc[1] for loc in m.pages._loc[0].values() if len(loc[1]) == 2]
    assert len(cut) == 3 and all(a[0] != b[0] and a[2] % 3 == 0 and a[2] + b[2] == 12 for a, b in cut)
    cache = PagedKVCache(m.pool[: m.total_bytes], m.desc[0], D, "token", "token")
    k, v = (x.permute(1, 0, 2, 3).reshape(heads, -1, D) for x in cache.read_pages(torch.tensor(ids)))
    assert torch.equal(k.view(torch.int16), kv[0][0].view(torch.int16))
    assert torch.equal(v.view(torch.int16), kv[0][1].view(torch.int16))
    m.free("r")
    m.reads_done()
    assert m.used_bytes() == 0 and m.chunks.n_free == m.num_chunks


def m_page():
    return 2 * H * 2 * 16 * D


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt_len=0, max_new_tokens=4), "prompt_len"),
    (dict(prompt_len=5, max_new_tokens=0), "max_new_tokens"),
    (dict(prompt_len=5, max_new_tokens=-3), "max_new_tokens"),
    (dict(prompt_len=10_000, max_new_tokens=1), "holds at most"),
])
def test_bad_requests_are_refused_before_anything_is_allocated(kwargs, match):
    m = KVMemory(2, H, D, 2 * 4 * 2 * H * 2 * 16 * D, pages_per_chunk=2)
    m.admit("running", 20, 5)
    snapshot = (m.capacity_pages(), m.outstanding, m.used_bytes(), list(m.pages._free_ids))
    with pytest.raises(ValueError, match=match):
        m.admit("new", **kwargs)
    assert (m.capacity_pages(), m.outstanding, m.used_bytes(), list(m.pages._free_ids)) == snapshot
    assert list(m.requests) == ["running"]


@pytest.mark.parametrize("layer, shape, dtype, start, match", [
    (2, (H, 5, D), torch.bfloat16, 0, r"layer must be an int in \[0, 2\), got 2"),
    (0, (H, 5, D // 2), torch.bfloat16, 0, rf"k must be bf16 \[kv_heads={H}, n, head_dim={D}\]"),
    (0, (H + 1, 5, D), torch.bfloat16, 0, "k must be bf16"),
    (0, (H, 5, D), torch.float32, 0, "got torch.float32"),
    (0, (H, 5, D), torch.bfloat16, 18, r"tokens \[18, 23\) lie outside request 'a''s cache of 20"),
])
def test_a_write_of_the_wrong_tokens_is_refused_and_writes_nothing(layer, shape, dtype, start, match):
    """``write`` (the prefill's path into the pages) checks its layer, the K/V shapes and dtype and the token range
    before touching the pool (before: torch's own errors from the indexing, or none for an out-of-range layer index)."""
    m = KVMemory(2, H, D, 2 * 4 * 2 * H * 2 * 16 * D, pages_per_chunk=2)
    m.admit("a", 20, 5)
    pool = m.pool.clone()
    with pytest.raises(ValueError, match=match):
        m.write(layer, "a", start, torch.ones(shape, dtype=dtype), torch.ones(shape, dtype=dtype))
    assert torch.equal(m.pool, pool)


def _state(m):
    return (m.capacity_pages(), m.outstanding, m.used_bytes(), list(m.pages._free_ids), m.stats()["chunks_free"],
            sorted(map(str, m.requests)), [dict(loc) for loc in m.pages._loc])


@pytest.mark.parametrize("other", [dict(head_dim=64), dict(kv_heads=2), dict(layers=3)])
def test_a_packed_request_of_another_memory_is_refused_before_anything_changes(other):
    """Admitting a ``Packed`` made by a memory of another shape took pages and chunks and then failed, leaking them
    (another head_dim or KV-head count), or dropped layers silently (more layers)."""
    layers, heads, dim = other.get("layers", 2), other.get("kv_heads", H), other.get("head_dim", D)
    src = KVMemory(layers, heads, dim, 16 * layers * 2 * heads * 2 * 16 * dim, pages_per_chunk=4)
    one = (1 + torch.rand(heads, 40, dim)).bfloat16()
    packed = src.pack([(one, one)] * layers)
    m = KVMemory(2, H, D, 16 * 2 * m_page(), pages_per_chunk=4)
    m.admit("running", 20, 5)
    before = _state(m)
    for call in (lambda: m.admit_packed("new", packed, 4), lambda: m.can_admit_packed(packed, 4)):
        with pytest.raises(ValueError, match="packed"):
            call()
        assert _state(m) == before
    with pytest.raises(ValueError, match=r"kv must hold one \(k, v\) pair per layer \(2\), got 3"):
        m.pack([(torch.zeros(H, 40, D).bfloat16(),) * 2] * 3)
    with pytest.raises(TypeError, match="kv: k and v must be torch.bfloat16"):
        m.pack([(torch.zeros(H, 40, D),) * 2] * 2)


def test_requests_that_can_never_fit_are_errors_not_waits():
    """``admit`` returns None for "not now"; a request whose held chunks leave no room for its pages even in the
    empty budget, or an ``alloc`` past what the budget ever holds, would wait (or retract others) forever."""
    m = KVMemory(2, H, D, 8 * 2 * m_page(), pages_per_chunk=2)          # 8 chunks of 2 pages: 8 pages per layer
    m.admit("a", 20, 5)
    before = _state(m)
    with pytest.raises(ValueError, match="hold_chunks=100: .* never fits the budget's 8 chunks"):
        m.admit("r", 10, 4, hold_chunks=100)
    with pytest.raises(ValueError, match="hold_chunks=6: .* never fits"):
        m.can_admit(100, 20, hold_chunks=6)
    with pytest.raises(ValueError, match="n_tokens=1000000: request 'a' would hold"):
        m.alloc("a", 10**6)
    with pytest.raises(ValueError, match="n_tokens must be an int >= 1, got True"):
        m.alloc("a", True)
    with pytest.raises(ValueError, match="unknown request 'zz'"):
        m.free("zz")
    with pytest.raises(ValueError, match=r"tokens \[5, 2\) lie outside"):
        m.slots("a", 5, -3)
    assert _state(m) == before
    assert m.admit("r", 10, 4, hold_chunks=2) is not None                 # room for 2 held + its pages: fine


def test_none_is_a_request_id_like_any_other():
    m = KVMemory(2, H, D, 8 * 2 * m_page(), pages_per_chunk=2)
    assert m.admit(None, 10, 4) is not None
    assert m.can_admit(10, 4) and m.admit("b", 10, 4) is not None      # the checks' own id is not None any more
    m.free(None)


def test_budget_smaller_than_one_page_per_layer():
    with pytest.raises(ValueError, match="smaller than one page per layer"):
        KVMemory(4, H, D, 4 * 2 * H * 2 * 16 * D - 1)
    with pytest.raises(ValueError, match="head_dim"):
        KVMemory(4, H, 48, 10**6)


@given(ratio=st.sampled_from([0.25, 0.5]), seed=st.integers(0, 1000))
@settings(max_examples=20, deadline=None)
def test_alloc_without_room_changes_nothing(ratio, seed):
    """With partial reservations an append can fail: it returns None and leaves every count as it was."""
    m = KVMemory(1, H, D, 6 * 2 * H * 2 * 16 * D, pages_per_chunk=1)
    for rid in range(3):
        assert m.admit(rid, 16, 64, reserve_ratio=ratio) is not None or rid
    rng = torch.Generator().manual_seed(seed)
    for _ in range(200):
        rid = sorted(m.requests)[int(torch.randint(len(m.requests), (1,), generator=rng))]
        r = m.requests[rid]
        if r.cache_len >= r.max_len:
            continue
        before = (m.capacity_pages(), m.outstanding, m.used_bytes(), r.cache_len, len(r.pages))
        if m.alloc(rid, 1) is None:
            assert before == (m.capacity_pages(), m.outstanding, m.used_bytes(), r.cache_len, len(r.pages))
            return
    pytest.fail("the partial reservations never ran out")


def test_compression_keeps_room_for_reserved_pages():
    """Compression must not take the chunks a running request was promised: layer 0's full pages could
    fill two fresh compressed chunks, but layer 1 needs one of the two free chunks for request b's
    reservation (layer 0's emptied chunks are pending, its own, until reads_done), so they are compressed
    in place and every reserved append of b gets its page before any reads_done."""
    m = KVMemory(2, H, D, 8 * 4 * m_page(), pages_per_chunk=4)            # 8 chunks of 4 pages
    gen = torch.Generator().manual_seed(1)
    m.admit("a", 128, 1)                                                   # 8 full pages
    m.write(0, "a", 0, _tokens(gen, 128, False), _tokens(gen, 128, False))
    m.write(1, "a", 0, _tokens(gen, 128, True), _tokens(gen, 128, True))
    m.admit("b", 16, 65)                                                   # 1 page now, 4 reserved
    m.write(0, "b", 0, _tokens(gen, 16, False), _tokens(gen, 16, False))
    m.write(1, "b", 0, _tokens(gen, 16, True), _tokens(gen, 16, True))
    assert m.capacity_pages() == 7 and m.outstanding == 4
    result = m.compress()
    assert m.capacity_pages() >= m.outstanding, "compression took room promised to b"
    assert result == dict(moved=0, in_place=9)
    for _ in range(64):
        assert m.alloc("b", 1) is not None


class _TorchOps(TorchDispatchMode):
    """Counts the torch ops run inside it (each one a kernel launch on a GPU)."""
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _step_that_fills_pages(layers: int, compressible: bool):
    """A memory of ``layers`` layers holding 3 requests' pages, each with one more token queued that fills
    its last page; ``compressible``: every block of those pages fits the rule (else none does)."""
    gen = torch.Generator().manual_seed(3)
    m = KVMemory(layers, H, D, layers * 12 * m_page(), pages_per_chunk=1, k_layout="token", v_layout="channel")
    for r in range(3):
        m.admit(r, 31, 2)
        for l in range(layers):
            m.write(l, r, 0, _tokens(gen, 31, not compressible), _tokens(gen, 31, not compressible))
    m.compress()
    m.reads_done()
    for r in range(3):
        m.alloc(r, 1)
        for l in range(layers):
            m.write(l, r, 31, _tokens(gen, 1, not compressible), _tokens(gen, 1, not compressible))
    m.flush_pages()
    return m


@pytest.mark.parametrize("compressible", [True, False])
def test_compress_work_does_not_grow_with_layers(compressible):
    """The step that fills pages compresses them in every layer with the same torch ops whatever the number of
    layers (pack twice, one read back, one copy for every move): on a GPU a few launches, not a few per layer."""
    counts, results = [], []
    for layers in (2, 6):
        m = _step_that_fills_pages(layers, compressible)
        with _TorchOps() as ops:
            results.append(m.compress())
        counts.append(ops.n)
    if compressible:                                            # each layer's 3 filled pages move
        assert results == [dict(moved=6, in_place=0), dict(moved=18, in_place=0)]
    else:                                                       # nothing to gain: every page stays raw
        assert results == [dict(moved=0, in_place=0)] * 2
    assert counts[0] == counts[1], f"torch ops for 2 and 6 layers: {counts}"


def test_in_place_pages_wait_without_device_work_until_room_appears():
    """Pages compressed in place are retried by every compress(); while no compressed chunk could take them (and
    nothing new is queued) that pass runs no torch op and changes no descriptor (so the kernels' page kinds
    need no refresh); once room appears they move into compressed chunks and read back bit-exact."""
    m = KVMemory(2, H, D, 8 * 4 * m_page(), pages_per_chunk=4, k_layout="token", v_layout="channel")
    gen = torch.Generator().manual_seed(1)
    m.admit("a", 128, 1)
    ka, va = _tokens(gen, 128, False), _tokens(gen, 128, False)
    m.write(0, "a", 0, ka, va)
    m.write(1, "a", 0, _tokens(gen, 128, True), _tokens(gen, 128, True))
    m.admit("b", 16, 65)
    m.write(0, "b", 0, _tokens(gen, 16, False), _tokens(gen, 16, False))
    m.write(1, "b", 0, _tokens(gen, 16, True), _tokens(gen, 16, True))
    assert m.compress() == dict(moved=0, in_place=9)
    m.changed_pages()
    with _TorchOps() as ops:
        for _ in range(3):
            assert m.compress() == dict(moved=0, in_place=0)
    assert ops.n == 0, f"a pass with nothing to do ran {ops.n} torch ops"
    assert m.changed_pages() == [], "a pass with nothing to do changed descriptors"
    m.free("b")
    m.reads_done()
    moved = m.compress()["moved"]
    changed = set(m.changed_pages())
    assert moved > 0 and changed and changed <= set(m.requests["a"].pages)      # the moved pages, a's
    assert moved + len(m.pages._inplace[0]) == 8            # a's pages: moved, or still waiting in place
    assert m.used_bytes(0) < 8 * m.page_bytes
    cache = PagedKVCache(m.pool[: m.total_bytes], m.desc[0], D, "token", "channel")
    k, v = (x.permute(1, 0, 2, 3).reshape(H, -1, D) for x in cache.read_pages(torch.tensor(m.requests["a"].pages)))
    assert torch.equal(k.view(torch.int16), ka.view(torch.int16)) and torch.equal(v.view(torch.int16), va.view(torch.int16))


def test_new_pages_descriptors_are_written_once_per_step_and_equal_one_at_a_time_writes():
    """A step's new pages get their descriptors in one write per layer (flush_pages); reading desc flushes, and the
    descriptors equal those of flushing after every allocation (the old one-write-per-page path)."""
    from zipkv.memory import KVMemory

    def run(flush_each):
        m = KVMemory(3, 2, 64, 3 * 64 * 2 * 2 * 2048, pages_per_chunk=4, device="cpu")
        for r in range(3):
            m.admit(r, 20, 40)
        m.flush_pages()
        for step in range(30):
            for r in list(m.requests):
                m.alloc(r, 1)
                if flush_each:
                    m.flush_pages()
            if step == 11:
                m.free(1)                           # a page freed, its id taken again by the next allocation
        return m
    a, b = run(True), run(False)
    assert b.pages._new_rows                         # deferred until someone reads the descriptors
    ids = [p for r in a.requests.values() for p in r.pages]
    assert [p for r in b.requests.values() for p in r.pages] == ids
    for da, db in zip(a.desc, b.desc):
        assert torch.equal(da[ids], db[ids])
    assert not b.pages._new_rows


def test_numpy_integers_are_integers_and_bad_request_ids_are_named():
    """A user's numpy ints are ints (kv_budget_bytes=np.int64(...) was "must be an int, got int64"); an unhashable
    id, a string where a list of ids goes and a reserve_ratio string got Python's own TypeErrors or a wrong answer."""
    import numpy as np

    m = KVMemory(np.int64(2), np.int64(H), D, np.int64(8 * 4 * m_page()), pages_per_chunk=np.int32(4))
    assert m.num_chunks == 8 and type(m.total_bytes) is int
    assert m.admit("a", np.int64(20), np.int64(4)) is not None and m.cache_len("a") == 20
    assert m.alloc("a", np.int64(1)) == [] and m.cache_len("a") == 21
    with pytest.raises(ValueError, match=r"reserve_ratio must be a number in \(0, 1\], got '1'"):
        m.admit("b", 3, 5, reserve_ratio="1")
    with pytest.raises(TypeError, match="rid must be a hashable request id .* got list"):
        m.admit(["x"], 3, 5)
    with pytest.raises(TypeError, match="rid must be a hashable request id .* got list"):
        m.free(["a"])
    with pytest.raises(TypeError, match="rids must be a list of request ids, got str 'a'"):
        m.page_table("a")
    m.free("a")
    assert not m.requests


def test_constructor_arguments_that_could_never_work_are_refused_at_once():
    """An unavailable device failed with torch's AssertionError, a pack_slots that is no function at the first
    compress; a budget past the device's memory spent hours building the bookkeeping of its chunks before the pool's
    allocation failed. The meta device (bookkeeping without bytes) stays a device."""
    import time

    assert KVMemory(2, H, D, 2**20, device="meta").device.type == "meta"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda': this machine has no CUDA GPU"):
            KVMemory(2, H, D, 2**20, device="cuda")
    for device in ("nodevice", 5):
        with pytest.raises(ValueError, match=rf"device={device!r}: expected a torch device"):
            KVMemory(2, H, D, 2**20, device=device)
    with pytest.raises(TypeError, match="pack_slots must be None or a function .* got str"):
        KVMemory(2, H, D, 2**20, pack_slots="fast")
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"kv_budget_bytes=1000000000000000 is more than the whole memory of cpu"):
        KVMemory(2, H, D, 10**15)
    assert time.perf_counter() - started < 5


def test_low_level_writes_and_queries_check_their_arguments():
    """``write_tokens`` (public, no host sync) wrote a [1, 1, D] K by broadcasting, wrote into an unallocated page's
    descriptor row (address 0: another request's bytes) and raised IndexError for a bad layer, page or offset;
    ``used_bytes(-1)`` was the last layer's; numpy ints were refused with a misleading message; a string of request
    ids was read letter by letter; K on another device and pack's malformed layers were torch's or Python's errors."""
    import numpy as np

    m = KVMemory(2, H, D, 8 * 2 * m_page(), pages_per_chunk=2)
    m.admit("a", 20, 5)
    page = torch.tensor(m.requests["a"].pages[1:2])
    one = torch.ones(1, H, D, dtype=torch.bfloat16)
    pool = m.pool.clone()
    for args, match in (
            ((2, page, torch.tensor([0]), one, one), r"write_tokens: layer must be an int in \[0, 2\), got 2"),
            ((0, page, torch.tensor([16]), one, one), r"offsets must lie in \[0, 16\), got range \[16, 16\]"),
            ((0, torch.tensor([m.max_pages - 1]), torch.tensor([0]), one, one), "is not a raw page of layer 0"),
            ((0, page, torch.tensor([0]), one[:, :, :1], one[:, :, :1]), r"k must be bf16 \[n, kv_heads=1, head_dim=32\]"),
            ((0, page, torch.tensor([0.0]), one, one), "offsets must be a 1-D int64 tensor"),
            ((0, page, torch.tensor([0]), one.float(), one), "got torch.float32")):
        with pytest.raises(ValueError, match=match):
            m.write_tokens(*args)
    assert torch.equal(m.pool, pool)
    m.write_tokens(0, page, torch.tensor([3]), one, one)                       # a right one is written
    assert not torch.equal(m.pool, pool)
    with pytest.raises(ValueError, match="write: k is on meta, the memory on cpu"):
        m.write(0, "a", 0, torch.empty(H, 2, D, dtype=torch.bfloat16, device="meta"), one.transpose(0, 1).expand(H, 2, D))
    m.write(np.int64(1), "a", np.int64(4), one.transpose(0, 1), one.transpose(0, 1))    # numpy ints are ints
    with pytest.raises(TypeError, match="start must be an int, got float 0.0"):
        m.slots("a", 0.0, 2)
    for layer in (-1, 2, "0"):
        with pytest.raises(ValueError, match=r"used_bytes: layer must be an int in \[0, 2\)"):
            m.used_bytes(layer)
    with pytest.raises(TypeError, match="rids must be None or a list of request ids, got str 'a'"):
        m.compressed_fraction("a")
    with pytest.raises(ValueError, match="device='nodevice': expected a torch device"):
        m.page_table(["a"], device="nodevice")
    kv = torch.ones(H, 20, D, dtype=torch.bfloat16)
    for bad, match in (([(kv, kv, kv)] * 2, r"kv\[0\] must be a \(k, v\) pair of tensors .* got tuple of 3"),
                       ([(kv.tolist(), kv)] * 2, r"kv\[0\] must be a \(k, v\) pair of tensors"),
                       ([kv, kv], r"kv\[0\] must be a \(k, v\) pair of tensors .* got Tensor")):
        with pytest.raises(ValueError, match=match):
            m.pack(bad)


def test_a_packed_request_far_from_fitting_is_refused_without_walking_its_pages(monkeypatch):
    """The packed admission check first counts the fewest chunks the pages could take (their units against the
    layers' free extents): a request that cannot fit even so is refused without the page-by-page walk an engine
    would otherwise repeat whenever memory gives space back; one that fits still gets the walk and is admitted."""
    gen = torch.Generator().manual_seed(4)
    m = KVMemory(1, H, D, 8 * 2 * H * 2 * 16 * D, pages_per_chunk=2)
    wide = lambda n: m.pack([tuple(_tokens(gen, 16 * n, True) for _ in range(2))])     # noqa: E731
    assert m.admit_packed("a", wide(5), 1) is not None
    large, small = wide(5), m.pack([tuple(_tokens(gen, 16, False) for _ in range(2))])
    walked = []
    exact = m.placement.new_comp_chunks
    monkeypatch.setattr(m.placement, "new_comp_chunks", lambda *a: walked.append(1) or exact(*a))
    assert not m.can_admit_packed(large, 1) and not walked
    assert m.can_admit_packed(small, 1) and walked
    assert m.admit_packed("b", small, 1) is not None
