"""Serving a stream of requests (zipkv.serving) and the memory manager's ablation options (zipkv.memory: per-layer
pools, admission that does not count the room compression frees), ZipFusion §II-C, §III-D.

The memory state machine of ``test_memory`` runs here with requests *arriving over time*: a queue fed by arrivals,
and steps that admit its head while it fits (raw or packed), grow every running request by a token (retracting in
SGLang's order when a step finds no page), compress the pages the step filled, give pending chunks back and free the
requests that finished -- on the shared pool, on per-layer pools, and with uncompressed-size admission -- and every
one of its invariants is checked after every step (no page lost or owned twice, exact byte accounting, bytes read back
bit-exact), with the options' own: per-layer pools never lend a chunk across layers; uncompressed-size admission never
admits past what an uncompressed memory would hold.
"""
import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings, strategies as st  # noqa: E402
from hypothesis.stateful import initialize, invariant, precondition, rule  # noqa: E402

from conftest import tiny_llama  # noqa: E402
from test_engine import _assert_tokens_of_generate, _generate  # noqa: E402  (registers "zipkv_reference" attention)
from test_memory import L, H, D, MemoryMachine, _tokens, m_page  # noqa: E402
from zipkv.engine import Engine  # noqa: E402
from zipkv.memory import FREE, OWNED, PENDING, KVMemory  # noqa: E402
from zipkv.serving import StepCost, Trace, all_at_once, poisson_trace, serve  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- the memory under arrival traces

class ArrivalMachine(MemoryMachine):
    """Requests arrive into a queue; each ``step`` is an engine step over the memory (class docstring of the module).
    The parent's one-operation rules are replaced by these two; its invariants stay."""
    POOL, ADMISSION = "shared", "compressed"

    # the parent's rules, switched off (a plain attribute is no rule)
    admit = admit_packed = append = compress = reads_done = finish = retract = None

    @initialize(chunks_per_layer=st.integers(2, 6), ppc=st.integers(1, 4), seed=st.integers(0, 2**16),
                ratio=st.sampled_from([1.0, 0.5, 0.25]))
    def setup(self, chunks_per_layer, ppc, seed, ratio):
        page = 2 * self.HEADS * 2 * 16 * self.DIM
        self.m = KVMemory(L, self.HEADS, self.DIM, L * chunks_per_layer * ppc * page + 100, pages_per_chunk=ppc,
                          k_layout=self.LAYOUTS[0], v_layout=self.LAYOUTS[1], pool=self.POOL, admission=self.ADMISSION)
        self.gen = torch.Generator().manual_seed(seed)
        self.kv, self.max_new, self.full_reserve = {}, {}, set()
        self.next_rid, self.since_reads_done, self.refused = 0, {}, []
        self.initial_capacity = self.m.capacity_pages()
        self.ratio, self.queue, self.steps, self.retracted = ratio, [], 0, 0
        self.owner = {}                                    # chunk -> first layer that owned it (per-layer pools)

    @rule(prompt=st.integers(1, 60), max_new=st.integers(1, 30), packed=st.booleans(), wide=st.floats(0, 1))
    def arrive(self, prompt, max_new, packed, wide):
        if (prompt + max_new - 1 + 15) // 16 > self.m.max_request_pages:
            with pytest.raises(ValueError, match="holds at most"):
                self.m.can_admit(prompt, max_new)
            return
        self.queue.append((self.next_rid, prompt, max_new, packed, wide))
        self.next_rid += 1

    def _kv(self, n, wide):
        kv = []
        for _ in range(L):
            w = bool(torch.rand((), generator=self.gen) < wide)
            kv.append(tuple(_tokens(self.gen, n, x, self.HEADS, self.DIM) for x in (w, not w)))
        return kv

    def _admit(self, rid, prompt, max_new, packed, wide) -> bool:
        m = self.m
        kv = self._kv(prompt, wide)
        if packed:
            p = m.pack(kv)
            ok = m.admit_packed(rid, p, max_new, reserve_ratio=self.ratio) is not None
            if ok:
                for l, (k, v) in enumerate(p.tail):
                    if k.shape[1]:
                        m.write(l, rid, p.n_pages * 16, k, v)
        else:
            ok = m.admit(rid, prompt, max_new, reserve_ratio=self.ratio) is not None
            if ok:
                for l, (k, v) in enumerate(kv):
                    m.write(l, rid, 0, k, v)
        if not ok:
            return False
        if self.ADMISSION == "uncompressed":        # never past what an uncompressed memory would have admitted
            assert sum(len(r.pages) for r in m.requests.values()) + m.outstanding <= m.max_request_pages
        for l in range(L):
            self.kv[rid, l] = kv[l]
        self.max_new[rid] = max_new
        if self.ratio == 1.0:
            self.full_reserve.add(rid)
        return True

    @rule()
    def step(self):
        m = self.m
        while self.queue and self._admit(*self.queue[0]):                  # first come, first served
            self.queue.pop(0)
        for rid in sorted(m.requests):
            if rid not in m.requests:
                continue
            r = m.requests[rid]
            if r.cache_len >= r.max_len:
                continue
            n = r.cache_len
            while m.alloc(rid, 1) is None:                                  # retract in retract_decode's order
                assert rid not in self.full_reserve, "an admitted request could not get the page it was promised"
                reqs = m.requests
                victim = min(reqs, key=lambda q: (reqs[q].cache_len - reqs[q].prompt_len, -reqs[q].prompt_len))
                m.free(victim)
                self._drop(victim)
                self.retracted += 1
                if victim == rid:
                    break
            else:
                wide = bool(torch.rand((), generator=self.gen) < 0.3)
                k, v = (_tokens(self.gen, 1, w, self.HEADS, self.DIM) for w in (wide, not wide))
                for l in range(L):
                    m.write(l, rid, n, k, v)
                    old = self.kv[rid, l]
                    self.kv[rid, l] = (torch.cat([old[0], k], 1), torch.cat([old[1], v], 1))
        m.compress()                                                        # the pages this step filled
        m.reads_done()
        self.since_reads_done = {}
        for rid in [q for q, r in m.requests.items() if r.cache_len >= r.max_len]:   # finished
            m.free(rid)
            self._drop(rid)
        self.steps += 1

    @invariant()
    def per_layer_pools_never_lend(self):
        if self.POOL != "per_layer":
            return
        assert self.m.reassigned == 0
        for c, ch in enumerate(self.m.chunks):
            if ch.state in (OWNED, PENDING):
                assert ch.layer == c % L, f"chunk {c} of layer {c % L}'s share is owned by layer {ch.layer}"
        for l, free in self.m.chunks._free.items():
            assert all(c % L == l and self.m.chunks[c].state == FREE for c in free)


class PerLayerArrivalMachine(ArrivalMachine):
    POOL = "per_layer"


class UncompressedAdmissionArrivalMachine(ArrivalMachine):
    ADMISSION = "uncompressed"


class ShiftingArrivalMachine(ArrivalMachine):
    """Each request's KV is incompressible in one layer, which its ``wide`` picks (``int(wide * L)``), and compressible in
    the others: the layers' shares of the pages shift from request to request, so a layer that held little may later
    need more than it ever had -- the case that makes the shared pool hand one layer's emptied chunk to another."""

    def _kv(self, n, wide):
        hard = min(int(wide * L), L - 1)
        return [tuple(_tokens(self.gen, n, l == hard, self.HEADS, self.DIM) for _ in "kv") for l in range(L)]


class PerLayerShiftingArrivalMachine(ShiftingArrivalMachine):
    POOL = "per_layer"


_SETTINGS = settings(max_examples=12, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
for _m in (ArrivalMachine, PerLayerArrivalMachine, UncompressedAdmissionArrivalMachine, ShiftingArrivalMachine,
           PerLayerShiftingArrivalMachine):
    _m.TestCase.settings = _SETTINGS
TestArrivalMachine = ArrivalMachine.TestCase
TestPerLayerArrivalMachine = PerLayerArrivalMachine.TestCase
TestUncompressedAdmissionArrivalMachine = UncompressedAdmissionArrivalMachine.TestCase
TestShiftingArrivalMachine = ShiftingArrivalMachine.TestCase
TestPerLayerShiftingArrivalMachine = PerLayerShiftingArrivalMachine.TestCase

_INVARIANTS = ("pages_owned_once_and_bytes_exact", "chunks_change_layer_only_after_reads_done",
               "a_refused_request_stays_refused_until_space_returns", "promises_are_covered", "bytes_read_back_exactly",
               "per_layer_pools_never_lend")


@pytest.mark.parametrize("machine", [ShiftingArrivalMachine, PerLayerShiftingArrivalMachine])
def test_an_arrival_trace_reassigns_chunks_with_every_page_and_byte_accounted(machine):
    """A fixed trace on the arrival machine: one 64-token request arrives every step (8 new tokens each, prompts
    packed), each incompressible in the next layer in turn, under 6 chunks of 2 pages per layer, reservations of half
    the growth. Requests queue, are admitted as others finish, compress and leave, for 40 steps; after every step no
    page is lost or owned twice, the bytes add up exactly and read back bit for bit. The shared pool reassigns chunks
    between layers (the layer that holds the incompressible pages takes chunks the others emptied); per-layer pools
    never do."""
    m = machine()
    m.setup(chunks_per_layer=6, ppc=2, seed=0, ratio=0.5)
    for i in range(40):
        m.arrive(prompt=64, max_new=8, packed=True, wide=(i % L + 0.5) / L)
        m.step()
        for name in _INVARIANTS:
            getattr(m, name)()
    assert m.m.admitted > 10 and len(m.queue) > 0, "the trace keeps the budget full: requests finish and are replaced"
    if machine.POOL == "shared":
        assert m.m.reassigned > 0
    else:
        assert m.m.reassigned == 0


# --------------------------------------------------------------------------- the options, one by one

def test_per_layer_pools_never_lend_a_chunk_that_the_shared_pool_reassigns():
    """Two layers, 24 chunks of 4 pages (12 per layer's share); a 40-page request, layer 0 compressible (3 of 4 units
    a block), layer 1 not. Once compression has settled, layer 0 holds 8 chunks and layer 1 10: the shared pool's 6
    free chunks give 12 more pages (a chunk emptied by layer 0 serves layer 1), the per-layer shares only 8 (layer 1's
    2 chunks; layer 0's 4 lie unused) -- a 12-page request is admitted with the shared pool only, and no chunk ever
    changes layer in the per-layer pools."""
    runs = {}
    for pool in ("shared", "per_layer"):
        m = KVMemory(2, H, D, 24 * 4 * m_page(), pages_per_chunk=4, pool=pool)
        gen = torch.Generator().manual_seed(0)
        assert m.admit("a", 640, 1) is not None
        m.write(0, "a", 0, _tokens(gen, 640, False), _tokens(gen, 640, False))         # layer 0: compressible
        m.write(1, "a", 0, _tokens(gen, 640, True), _tokens(gen, 640, True))           # layer 1: not
        for _ in range(4):                                                             # until every page moved
            m.compress()
            m.reads_done()
        assert m.stats()["chunks_comp"] == [8, 0] and m.stats()["chunks_raw"] == [0, 10]
        cap = m.capacity_pages()
        runs[pool] = (cap, m.admit("b", 16 * 12, 1) is not None, m.reassigned)
        if pool == "per_layer":
            assert all(ch.layer == c % 2 for c, ch in enumerate(m.chunks) if ch.state != FREE)
    assert runs == {"shared": (12, True, 3), "per_layer": (8, False, 0)}


def test_admission_that_does_not_count_compression_admits_what_uncompressed_admits():
    """Every block compressible (3 of 4 units): packed, five 4-page requests fit a budget of 16 raw pages per layer
    (test_memory's case); with ``admission="uncompressed"`` only four do -- as many as raw admission takes -- though
    their pages are stored compressed all the same."""
    gen = torch.Generator().manual_seed(2)
    one = lambda: (1 + torch.rand(H, 64, D, generator=gen)).bfloat16()                 # noqa: E731
    admitted = {}
    for admission in ("compressed", "uncompressed"):
        m = KVMemory(2, H, D, 16 * 2 * m_page(), pages_per_chunk=4, admission=admission)
        n = 0
        while m.admit_packed(n, m.pack([(one(), one()) for _ in range(2)]), 1) is not None:
            n += 1
        admitted[admission] = (n, m.used_bytes())
    raw = KVMemory(2, H, D, 16 * 2 * m_page(), pages_per_chunk=4)
    n_raw = 0
    while raw.admit(n_raw, 64, 1) is not None:
        n_raw += 1
    assert admitted["compressed"][0] > admitted["uncompressed"][0] == n_raw
    assert admitted["uncompressed"][1] == 2 * n_raw * 4 * 6 * 256 < raw.used_bytes()     # still compressed


@pytest.mark.parametrize("kwargs, match", [(dict(pool="layers"), "pool must be"),
                                           (dict(admission="raw"), "admission must be")])
def test_bad_memory_options_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KVMemory(2, H, D, 16 * 2 * m_page(), **kwargs)


def test_per_layer_pools_hold_no_chunk_for_a_request():
    m = KVMemory(2, H, D, 16 * 2 * m_page(), pages_per_chunk=4, pool="per_layer")
    with pytest.raises(ValueError, match="hold_chunks=1.*per-layer"):
        m.admit("a", 16, 1, hold_chunks=1)
    assert not m.requests and m.chunks.n_free == m.num_chunks


# --------------------------------------------------------------------------- the engine serving a trace

def _tiny():
    return tiny_llama(q_heads=4, kv_heads=2, head_dim=32, seed=5).to(torch.bfloat16)


def _page(model):
    cfg = model.config
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * 32 * cfg.head_dim


def _trace(n=8, rate=40.0, seed=0, lo=5, hi=60, new=(4, 20)):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 120, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    gaps = torch.empty(n).exponential_(rate, generator=g).tolist()
    arrivals = [sum(gaps[:i]) for i in range(n)]
    outputs = torch.randint(new[0], new[1] + 1, (n,), generator=g).tolist()
    return Trace(arrivals, prompts, outputs)


@pytest.fixture(scope="module")
def tiny():
    model = _tiny()
    model.config._attn_implementation = "zipkv_reference"      # generate's arithmetic = the engine's (test_engine)
    model.generation_config.eos_token_id = None                   # every request runs to its length, as served
    return model


_PROMPT_LENGTHS, _OUTPUTS, _ARRIVALS = (20, 35, 9, 28), [60, 50, 45, 40], [0.0, 0.004, 0.01, 0.03]


@pytest.fixture(scope="module")
def tiny_reference(tiny):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 120, (n,), generator=g).tolist() for n in _PROMPT_LENGTHS]
    return prompts, _generate(tiny, prompts, max(_OUTPUTS))


@pytest.mark.parametrize("compress, pool, admission, overlap", [
    ("all", "shared", "compressed", True), ("all", "per_layer", "compressed", False),
    ("all", "shared", "uncompressed", True), ("none", "shared", "compressed", False)])
def test_a_served_trace_gives_each_request_the_tokens_generate_gives_it(tiny, tiny_reference, compress, pool, admission,
                                                                       overlap):
    """Four requests arriving over time, a budget of 10 pages per layer, reservations of 20 % (steps run out of pages:
    requests are retracted and requeued): every request's tokens are ``model.generate``'s (up to an exact tie, which
    a retracted request's second prefill may break the other way: test_engine's rule), nobody is admitted before it
    arrives, and every token is recorded, in time order."""
    prompts, ref = tiny_reference
    trace = Trace(_ARRIVALS, prompts, _OUTPUTS)
    eng = Engine(tiny, 10 * _page(tiny), compress=compress, pages_per_chunk=2, reserve_ratio=0.2, eos_token_id=None,
                 overlap=overlap, pool=pool, admission=admission)
    res = serve(eng, trace, cost=StepCost(step_s=2e-3))
    _assert_tokens_of_generate(res.outputs, [(want[:n], top2[:n]) for (want, top2), n in zip(ref, _OUTPUTS)])
    assert sum(r["retracted"] for r in res.requests) == res.stats["retracted"] > 0
    for r, n in zip(res.requests, trace.max_new_tokens):
        assert r["arrival"] <= r["admissions"][0] < r["token_times"][0] and len(r["token_times"]) == n
        assert r["token_times"] == sorted(r["token_times"])
    assert any(len(r["admissions"]) > 1 for r in res.requests)          # a retracted request admitted again
    times = [s["time"] for s in res.steps]
    assert times == sorted(times) and max(s["batch"] for s in res.steps) > 1
    assert not eng.memory.requests and eng.memory.used_bytes() == 0
    if pool == "per_layer":
        assert res.summary()["chunks_reassigned"] == 0


def test_the_simulated_clock_gives_the_same_records_every_run_and_states_its_costs(tiny):
    """The simulated clock moves by the cost model only: two runs give identical records; the first request's first
    token comes exactly one prefill after its arrival (nothing runs before it), the next decode step one step's cost
    later; an engine with nothing to do waits for the next arrival."""
    cost = StepCost(step_s=1e-3, request_s=1e-4, kv_bytes_per_s=1e9, prefill_token_s=1e-5)
    trace = Trace([0.0, 0.5], [list(range(3, 40)), list(range(5, 20))], [3, 3])
    runs = []
    for _ in range(2):
        eng = Engine(tiny, 10 * _page(tiny), pages_per_chunk=2, eos_token_id=None)
        runs.append(serve(eng, trace, cost=cost))
    assert runs[0].requests == runs[1].requests and runs[0].steps == runs[1].steps
    first, second = runs[0].requests
    assert first["token_times"][0] == pytest.approx(cost.prefill(37 - 1 + 1))
    step = runs[0].steps[0]
    assert step["time"] == pytest.approx(first["token_times"][0] + cost.step(1, sum(step["used_bytes"])))
    assert first["admissions"] == [0.0] and second["admissions"] == [pytest.approx(0.5)]   # idle until it arrived
    assert first["admission_seconds"] == [pytest.approx(cost.prefill(37))]     # the first token comes right after
    assert second["admission_seconds"] == [pytest.approx(cost.prefill(15))]
    s = runs[0].summary()
    assert s["admission_s"] == pytest.approx(cost.prefill(37) + cost.prefill(15))
    assert s["requests"] == 2 and s["output_tokens"] == 6 and s["max_batch"] == 1
    assert s["ttft_median_s"] == pytest.approx((cost.prefill(37) + cost.prefill(15)) / 2)


def test_serving_summary_metrics_are_the_records_statistics():
    """TTFT, TPOT and queueing delay of hand-made records, as vLLM's benchmark defines them."""
    from zipkv.serving import ServeResult, summarize
    reqs = [dict(arrival=0.0, admissions=[0.5], admission_seconds=[0.25], token_times=[1.0, 2.0, 4.0], retracted=0),
            dict(arrival=1.0, admissions=[1.0, 3.0], admission_seconds=[0.5, 0.125], token_times=[1.5, 5.0],
                 retracted=1)]
    steps = [dict(batch=1, reassigned=0), dict(batch=2, reassigned=3)]
    s = summarize(ServeResult([[1, 2, 3], [4, 5]], reqs, steps, {}, "simulated"))
    assert s["duration_s"] == 5.0 and s["output_tokens"] == 5 and s["tokens_per_s"] == 1.0
    assert s["ttft_median_s"] == pytest.approx(0.75) and s["queue_median_s"] == pytest.approx(0.25)
    assert s["tpot_median_s"] == pytest.approx((1.5 + 3.5) / 2) and s["retractions"] == 1
    assert s["max_batch"] == 2 and s["chunks_reassigned"] == 3 and s["admission_s"] == 0.875


class _Tok:
    """A stand-in tokenizer: one token per character (enough for zipkv.data.windows)."""
    def __call__(self, text, **kw):
        return {"input_ids": self.encode(text)}

    def encode(self, text, **kw):
        return [ord(c) % 100 + 3 for c in text]


def _books():
    from zipkv.data import Book
    return [Book(pg_id=i, title=f"b{i}", text="".join(chr(97 + (i * 7 + j * j) % 26) for j in range(6000)))
            for i in range(3)]


def test_traces_are_seeded_and_draw_within_their_stated_ranges():
    a = poisson_trace(5.0, 30, (10, 40), (2, 9), 3, tokenizer=_Tok(), books=_books())
    assert a == poisson_trace(5.0, 30, (10, 40), (2, 9), 3, tokenizer=_Tok(), books=_books())
    assert a.arrivals[0] == 0.0 and list(a.arrivals) == sorted(a.arrivals)
    assert all(10 <= len(p) <= 40 for p in a.prompts) and all(2 <= m <= 9 for m in a.max_new_tokens)
    mean_gap = a.arrivals[-1] / (len(a) - 1)
    assert 0.1 < mean_gap < 0.4                                          # 1 / rate = 0.2 s
    b = all_at_once(30, (10, 40), (2, 9), 3, tokenizer=_Tok(), books=_books())
    assert b.prompts == a.prompts and b.max_new_tokens == a.max_new_tokens and set(b.arrivals) == {0.0}
    assert poisson_trace(5.0, 30, (10, 40), (2, 9), 4, tokenizer=_Tok(), books=_books()) != a


@pytest.mark.parametrize("rate", [0, -1.0, float("nan"), float("inf"), True])
def test_a_rate_that_is_not_positive_is_an_error_before_anything_is_drawn(rate):
    with pytest.raises(ValueError, match="rate must be a finite number > 0"):
        poisson_trace(rate, 4, (10, 20), (2, 3), tokenizer=None, books=None)   # no tokenizer: nothing drawn


@pytest.mark.parametrize("args, match", [
    (((), (), ()), "empty"),
    (((0.0, 1.0), ([1, 2],), (3, 3)), "one entry per request"),
    (((1.0, 0.5), ([1], [2]), (3, 3)), "non-decreasing"),
    (((-1.0,), ([1],), (3,)), ">= 0"),
    (((0.0,), ([],), (3,)), r"prompts\[0\] is empty"),
    (((0.0,), ([1],), (0,)), r"max_new_tokens\[0\]"),
])
def test_bad_traces_are_clear_errors(args, match):
    with pytest.raises(ValueError, match=match):
        Trace(*args)


def test_a_request_that_can_never_fit_is_an_error_before_anything_is_allocated(tiny, monkeypatch):
    eng = Engine(tiny, 6 * _page(tiny), pages_per_chunk=2, eos_token_id=None)
    monkeypatch.setattr(eng.runner, "prefill", lambda req: pytest.fail("prefilled before the trace was checked"))
    trace = Trace([0.0, 0.1], [list(range(3, 20)), list(range(3, 120))], [4, 4])
    with pytest.raises(ValueError, match="trace request 1: .*holds at most 6 uncompressed pages"):
        serve(eng, trace)
    assert not eng.memory.requests and eng.memory.used_bytes() == 0 and not eng.busy
    with pytest.raises(ValueError, match="clock must be"):
        serve(eng, trace, clock="cpu")
    with pytest.raises(TypeError, match="trace must be a zipkv.serving.Trace"):
        serve(eng, [(0.0, [1, 2], 3)])


# --------------------------------------------------------------------------- the embedded model

@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the engine's fused kernel against generate's attention on a GPU"))])
def test_embedded_model_served_with_arrivals_compression_and_retraction_gives_generate_s_tokens(device):
    """SmolLM2-135M on PG19 prompts arriving over time under a budget of 6 pages per layer, chunks of 2 pages,
    reservations of 30 %, every full page compressed after the step that filled it: requests wait and are admitted as
    room appears -- and every request's greedy tokens are model.generate's (ties as in test_engine). On the CPU the
    reference attention on both sides; on a GPU the engine's fused kernel over packed pages against generate's own
    attention. Retraction is exercised on the tiny model above: at this size on the CPU no setting tried (budgets of
    4-6 pages, chunks of 1-2 pages, reservations down to 1 %) retracted or moved a chunk between layers."""
    from test_engine import _assert_tokens_of_generate, _generate
    from zipkv import data, models
    model, tok = models.load_model(dtype=torch.bfloat16, device=device)
    if device == "cpu":
        model.config._attn_implementation = "zipkv_reference"
    trace = poisson_trace(200.0, 5, (5, 40), (10, 24), 1, tokenizer=tok, books=data.load_books(limit=5))
    eng = Engine(model, 6 * _page(model), compress="all", pages_per_chunk=2, reserve_ratio=0.3, eos_token_id=None)
    res = serve(eng, trace)
    for p, m, got in zip(trace.prompts, trace.max_new_tokens, res.outputs):
        _assert_tokens_of_generate([got], _generate(model, [list(p)], m))
    s = res.summary()
    assert s["queue_p99_s"] > 0 and s["max_batch"] >= 2, s
