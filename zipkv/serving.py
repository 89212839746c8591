"""Serving a stream of requests: traces of requests arriving over time, and what a serving benchmark measures
(ZipFusion §II-C, §III-D: the memory manager turns the room compression frees into room for new requests).

A :class:`Trace` is a list of requests, each with its arrival time (seconds from the start), its prompt token ids and
its number of output tokens. :func:`poisson_trace` draws one -- Poisson arrivals at ``rate`` requests per second
(exponential gaps, the first request at 0, as vLLM's and SGLang's serving benchmarks send them), prompt and output
lengths uniform over stated ranges, prompts cut from PG19 windows (:func:`zipkv.data.windows`) -- and
:func:`all_at_once` the same requests all arriving at 0; both are seeded: the same arguments give the same trace.

:func:`serve` runs the engine's own loop (:meth:`zipkv.engine.Engine.generate`:
the same admission, compression as pages fill, retraction when a step finds no page, greedy tokens) with the requests
joining the waiting queue as the clock reaches their arrival times, and records

* per request: arrival, each admission (when its prefill began; a retracted request is admitted again), each token's
  time (the first from its prefill), retractions -- hence TTFT (first token - arrival), TPOT ((last token - first token) / (tokens - 1), vLLM's
  definition) and queueing delay (first admission - arrival);
* per decode step: its time, the running batch, KV bytes in use per layer, free chunks, chunks reassigned between
  layers so far, retractions so far and the waiting queue's length.

Two clocks. ``clock="wall"``: :func:`time.perf_counter` from the start, except that when the engine has nothing to do
(nothing running, waiting or in flight) it jumps to the next arrival instead of sleeping (the gap is counted as
time, not spent). ``clock="simulated"`` (the default): time advances only by a cost model, :class:`StepCost` -- a
decode step costs a fixed time (the weights read), a time per running request and the KV bytes in use read at a
bandwidth; a prefill costs a time per token -- so a run on a CPU gives the same times on every machine and every
run (the tokens are the model's either way). :meth:`StepCost.roofline` is the default: a GPU whose step reads the
model's weights and the KV once at its bandwidth and whose prefill runs at a fraction of its bf16 peak.
"""
from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Trace", "poisson_trace", "all_at_once", "StepCost", "ServeResult", "serve", "summarize"]


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_range(name: str, r) -> tuple[int, int]:
    if not (isinstance(r, (list, tuple)) and len(r) == 2 and all(_is_int(x) for x in r) and 1 <= r[0] <= r[1]):
        raise ValueError(f"{name} must be a (low, high) pair of ints with 1 <= low <= high (both included), got {r!r}")
    return int(r[0]), int(r[1])


@dataclass(frozen=True)
class Trace:
    """Requests arriving over time.

    arrivals: seconds from the start, non-decreasing, one per request. prompts: token ids per request (non-empty).
    max_new_tokens: output tokens per request (>= 1). rate: requests per second it was drawn at (``inf``: all at once;
    None: given by hand). seed, prompt_lengths, output_lengths: how it was drawn (None: given by hand).
    An empty trace, unequal lengths, a negative, unordered or non-finite arrival are ``ValueError`` s here."""
    arrivals: tuple
    prompts: tuple
    max_new_tokens: tuple
    rate: float | None = None
    seed: int | None = None
    prompt_lengths: tuple | None = None
    output_lengths: tuple | None = None

    def __post_init__(self):
        for name in ("arrivals", "prompts", "max_new_tokens"):
            v = getattr(self, name)
            if isinstance(v, (str, bytes)) or not hasattr(v, "__len__"):
                raise TypeError(f"Trace.{name} must be a sequence (one entry per request), got {type(v).__name__}")
        if not len(self.arrivals):
            raise ValueError("Trace: the trace is empty (no request): expected at least one request")
        n = {len(self.arrivals), len(self.prompts), len(self.max_new_tokens)}
        if len(n) != 1:
            raise ValueError(f"Trace: arrivals, prompts and max_new_tokens must have one entry per request, got "
                             f"{len(self.arrivals)}, {len(self.prompts)} and {len(self.max_new_tokens)}")
        bad = next((i for i, a in enumerate(self.arrivals) if isinstance(a, bool) or not isinstance(a, numbers.Real)), None)
        if bad is not None:
            raise TypeError(f"Trace.arrivals[{bad}] must be a number (seconds from the start), got "
                            f"{type(self.arrivals[bad]).__name__} {self.arrivals[bad]!r}")
        arr = [float(a) for a in self.arrivals]
        if not all(math.isfinite(a) and a >= 0 for a in arr) or any(b < a for a, b in zip(arr, arr[1:])):
            raise ValueError(f"Trace.arrivals must be finite, >= 0 and non-decreasing (seconds from the start), got "
                             f"{arr[:6]}{' ...' if len(arr) > 6 else ''}")
        bad = next((i for i, m in enumerate(self.max_new_tokens) if not _is_int(m) or m < 1), None)
        if bad is not None:
            raise ValueError(f"Trace.max_new_tokens[{bad}] must be an int >= 1, got {self.max_new_tokens[bad]!r}")
        bad = next((i for i, p in enumerate(self.prompts) if isinstance(p, (str, bytes)) or not hasattr(p, "__len__")
                    or not all(_is_int(t) for t in (p.tolist() if hasattr(p, "tolist") else p))), None)
        if bad is not None:
            raise TypeError(f"Trace.prompts[{bad}] must be a sequence of int token ids, got "
                            f"{type(self.prompts[bad]).__name__} {str(self.prompts[bad])[:60]!r}")
        bad = next((i for i, p in enumerate(self.prompts) if not len(p)), None)
        if bad is not None:
            raise ValueError(f"Trace.prompts[{bad}] is empty: a request needs at least one prompt token")
        object.__setattr__(self, "arrivals", tuple(arr))
        object.__setattr__(self, "prompts", tuple(tuple(int(t) for t in p) for p in self.prompts))
        object.__setattr__(self, "max_new_tokens", tuple(int(m) for m in self.max_new_tokens))

    def __len__(self) -> int:
        return len(self.arrivals)


def _draw(n, prompt_lengths, output_lengths, seed, tokenizer, books):
    if not _is_int(n) or n < 1:
        raise ValueError(f"n must be an int >= 1 (requests in the trace), got {n!r}")
    if not _is_int(seed) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    plo, phi = _check_range("prompt_lengths", prompt_lengths)
    olo, ohi = _check_range("output_lengths", output_lengths)
    from zipkv import data
    books = data.load_books() if books is None else books
    rng = np.random.default_rng(seed)
    lengths = rng.integers(plo, phi + 1, n)
    outputs = rng.integers(olo, ohi + 1, n)
    windows = data.windows(tokenizer, books, n=int(n), context=phi, continuation=0, seed=int(seed))
    prompts = [w.context_ids[:k].tolist() for w, k in zip(windows, lengths)]
    return rng, prompts, [int(m) for m in outputs], (plo, phi), (olo, ohi)


def poisson_trace(rate: float, n: int, prompt_lengths: tuple, output_lengths: tuple, seed: int = 0, *, tokenizer,
                  books=None) -> Trace:
    """``n`` requests arriving as a Poisson process of ``rate`` requests per second (exponential gaps; the first at 0).

    prompt_lengths, output_lengths: ``(low, high)`` token counts, each request's drawn uniformly (both ends included);
    prompts are the first tokens of PG19 windows (:func:`zipkv.data.windows` of ``books``, default
    :func:`zipkv.data.load_books`, with ``tokenizer``). seed: one seed for lengths, arrivals and windows. Bad arguments
    (``rate <= 0`` among them) are ``ValueError`` s before anything is drawn."""
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a finite number > 0 (requests per second), got {rate!r} "
                         f"(all requests at once: zipkv.serving.all_at_once)")
    rng, prompts, outputs, pl, ol = _draw(n, prompt_lengths, output_lengths, seed, tokenizer, books)
    gaps = rng.exponential(1.0 / rate, n)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    return Trace(tuple(arrivals.tolist()), prompts, outputs, float(rate), int(seed), pl, ol)


def all_at_once(n: int, prompt_lengths: tuple, output_lengths: tuple, seed: int = 0, *, tokenizer,
                books=None) -> Trace:
    """:func:`poisson_trace`'s requests (the same prompts and lengths for the same seed), all arriving at 0."""
    _, prompts, outputs, pl, ol = _draw(n, prompt_lengths, output_lengths, seed, tokenizer, books)
    return Trace((0.0,) * n, prompts, outputs, math.inf, int(seed), pl, ol)


@dataclass(frozen=True)
class StepCost:
    """The simulated clock's cost model (seconds). A decode step of ``batch`` running requests with ``kv_bytes`` of KV
    in use costs ``step_s + request_s * batch + kv_bytes / kv_bytes_per_s``; a prefill of ``tokens`` tokens costs
    ``prefill_token_s * tokens``."""
    step_s: float = 5e-3
    request_s: float = 2e-5
    kv_bytes_per_s: float = 3.35e12
    prefill_token_s: float = 2.5e-5

    def __post_init__(self):
        for name in ("step_s", "request_s", "kv_bytes_per_s", "prefill_token_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0 \
                    or (name == "kv_bytes_per_s" and v == 0):
                raise ValueError(f"StepCost.{name} must be a finite number >= 0 (> 0 for a bandwidth), got {v!r}")

    def step(self, batch: int, kv_bytes: int) -> float:
        return self.step_s + self.request_s * batch + kv_bytes / self.kv_bytes_per_s

    def prefill(self, tokens: int) -> float:
        return self.prefill_token_s * tokens

    @classmethod
    def roofline(cls, model, *, bytes_per_s: float = 3.35e12, flops_per_s: float = 4e14,
                 request_s: float = 2e-5) -> "StepCost":
        """A GPU serving ``model`` (a torch module): a decode step reads every weight once at ``bytes_per_s`` (default
        an H100 SXM's 3.35 TB/s) and the KV in use at the same rate; a prefill does ``2 * parameters`` FLOPs per token
        at ``flops_per_s`` (default 400 TFLOP/s, about 40 % of its dense bf16 peak)."""
        params = sum(p.numel() for p in model.parameters())
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        return cls(step_s=weight_bytes / bytes_per_s, request_s=request_s, kv_bytes_per_s=bytes_per_s,
                   prefill_token_s=2 * params / flops_per_s)


class Recorder:
    """The clock and the records of one :func:`serve` run; the engine's loop calls it (:meth:`zipkv.engine.Engine._run`)."""

    def __init__(self, trace: Trace, clock: str, cost: StepCost):
        self.arrivals, self.clock, self.cost = list(trace.arrivals), clock, cost
        self._t = 0.0                                            # simulated time
        self._t0, self._skipped = time.perf_counter(), 0.0       # wall clock: its start, idle gaps jumped
        self.requests = [dict(arrival=a, prompt_tokens=len(p), max_new_tokens=m, admissions=[], admission_seconds=[],
                              token_times=[], retracted=0)
                         for a, p, m in zip(trace.arrivals, trace.prompts, trace.max_new_tokens)]
        self.steps: list[dict] = []

    def now(self) -> float:
        if self.clock == "simulated":
            return self._t
        return time.perf_counter() - self._t0 + self._skipped

    def _advance_to(self, t: float) -> None:
        gap = t - self.now()
        if gap > 0:
            if self.clock == "simulated":
                self._t += gap
            else:
                self._skipped += gap

    def arrive(self, sched, idle: bool) -> None:
        """Requests whose arrival time has come join the queue; an ``idle`` engine first moves to the next arrival."""
        if idle and sched.next_arrival() is not None:
            self._advance_to(sched.next_arrival())
        sched.arrive(self.now())

    def admitted(self, req, seconds: float) -> None:
        """``req`` was admitted and prefilled (its prompt, and after a retraction its outputs too), which took
        ``seconds`` of wall time: its admission is when that prefill began."""
        record = self.requests[req.rid]
        if self.clock == "simulated":
            seconds = self.cost.prefill(req.cached - 1)
            record["admissions"].append(self._t)
            self._t += seconds
        else:
            record["admissions"].append(self.now() - seconds)
        record["admission_seconds"].append(seconds)     # the running requests wait this long (TPOT counts it)

    def token(self, req) -> None:
        self.requests[req.rid]["token_times"].append(self.now())

    def retracted(self, req) -> None:
        self.requests[req.rid]["retracted"] += 1

    def step(self, batch: int, snapshot: dict, sched) -> None:
        """A decode step's tokens reached the host: the clock moves past it and its row is recorded."""
        if self.clock == "simulated":
            self._t += self.cost.step(batch, sum(snapshot["used_bytes"]))
        self.steps.append(dict(time=self.now(), batch=batch, used_bytes=list(snapshot["used_bytes"]),
                               chunks_free=snapshot["chunks_free"], chunks_held=snapshot["chunks_held"],
                               reassigned=snapshot["reassigned"], retracted=sched.retracted,
                               waiting=len(sched.waiting)))


@dataclass
class ServeResult:
    """What :func:`serve` gives back. outputs: each request's tokens (trace order). requests: per request ``arrival``,
    ``prompt_tokens``, ``max_new_tokens``, ``admissions`` (times; more than one after a retraction),
    ``admission_seconds`` (how long each admission -- prefill, packing, placing -- held the engine), ``token_times``
    (one per output token), ``retracted``. steps: per decode step ``time`` (its tokens on the host), ``batch``,
    ``used_bytes`` (per layer), ``chunks_free``, ``chunks_held``, ``reassigned`` (chunks taken so far by a layer
    other than the one that emptied them), ``retracted`` (so far), ``waiting``. stats: the engine's
    (:meth:`zipkv.engine.Engine.generate`'s). clock: ``"simulated"`` or ``"wall"``."""
    outputs: list
    requests: list
    steps: list
    stats: dict
    clock: str
    trace: Trace = field(repr=False, default=None)

    def summary(self) -> dict:
        """:func:`summarize` of this run."""
        return summarize(self)


def _pct(x, q) -> float:
    return float(np.percentile(x, q)) if len(x) else float("nan")


def summarize(result: ServeResult) -> dict:
    """A run's serving metrics: ``requests``; ``duration_s`` (first arrival to last token); ``output_tokens``;
    ``tokens_per_s`` (output tokens / duration); ``requests_per_s`` (requests / duration); ``max_batch`` (largest
    running batch of a decode step); ``queue_median_s``, ``queue_p99_s`` (first admission - arrival); ``ttft_median_s``,
    ``ttft_p99_s``; ``tpot_median_s``, ``tpot_p99_s`` (requests of two tokens or more); ``admission_s`` (the
    engine's seconds spent admitting requests, when no decode step runs); ``retractions``; ``chunks_reassigned``.
    Percentiles as ``numpy.percentile`` (linear), as vLLM's benchmark reports them."""
    if not isinstance(result, ServeResult):
        raise TypeError(f"result must be a zipkv.serving.ServeResult (what serve returns), got {type(result).__name__}")
    reqs = result.requests
    first_arrival = min(r["arrival"] for r in reqs)
    end = max((r["token_times"][-1] for r in reqs if r["token_times"]), default=first_arrival)
    duration = end - first_arrival
    tokens = sum(len(r["token_times"]) for r in reqs)
    queue = [r["admissions"][0] - r["arrival"] for r in reqs if r["admissions"]]
    ttft = [r["token_times"][0] - r["arrival"] for r in reqs if r["token_times"]]
    tpot = [(r["token_times"][-1] - r["token_times"][0]) / (len(r["token_times"]) - 1)
            for r in reqs if len(r["token_times"]) > 1]
    return dict(requests=len(reqs), duration_s=duration, output_tokens=tokens,
                tokens_per_s=tokens / duration if duration > 0 else float("nan"),
                requests_per_s=len(reqs) / duration if duration > 0 else float("nan"),
                max_batch=max((s["batch"] for s in result.steps), default=0),
                queue_median_s=_pct(queue, 50), queue_p99_s=_pct(queue, 99),
                ttft_median_s=_pct(ttft, 50), ttft_p99_s=_pct(ttft, 99),
                tpot_median_s=_pct(tpot, 50), tpot_p99_s=_pct(tpot, 99),
                admission_s=float(sum(sum(r.get("admission_seconds", ())) for r in reqs)),
                retractions=sum(r["retracted"] for r in reqs),
                chunks_reassigned=result.steps[-1]["reassigned"] if result.steps else 0)


def serve(engine, trace: Trace, *, clock: str = "simulated", cost: StepCost | None = None, prefixes=None,
          progress: bool | None = False) -> ServeResult:
    """Serve ``trace`` on ``engine`` (a :class:`zipkv.engine.Engine`; greedy tokens, the engine's own loop with the
    requests arriving on ``clock``, module docstring) and record every request's and every step's times.

    clock: ``"simulated"`` (time moves by ``cost``, default :meth:`StepCost.roofline` of the engine's model) or
    ``"wall"``. prefixes: None, or one :class:`zipkv.engine.Prefix` (or None) per request, the KV it starts from (its
    prompt continues after it; the throughput chapter's real-KV prefixes at model shapes). Every request is checked before anything is allocated: a request that can never fit the engine's budget
    (or reaches past the model's sliding window) is a ``ValueError`` naming it. Returns :class:`ServeResult`."""
    from zipkv.engine import Engine
    if not isinstance(engine, Engine):
        raise TypeError(f"engine must be a zipkv.engine.Engine, got {type(engine).__name__}")
    if not isinstance(trace, Trace):
        raise TypeError(f"trace must be a zipkv.serving.Trace (poisson_trace, all_at_once or Trace(...)), got "
                        f"{type(trace).__name__}")
    if clock not in ("simulated", "wall"):
        raise ValueError(f"clock must be 'simulated' or 'wall', got {clock!r}")
    if cost is not None and not isinstance(cost, StepCost):
        raise TypeError(f"cost must be a zipkv.serving.StepCost or None, got {type(cost).__name__}")
    if cost is not None and clock == "wall":
        raise ValueError("cost sets the simulated clock's step costs: pass clock='simulated', or leave cost None")
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress must be a bool or None, got {type(progress).__name__}")
    if prefixes is not None and (not isinstance(prefixes, (list, tuple)) or len(prefixes) != len(trace)):
        raise ValueError(f"prefixes must be None or a list of one Prefix (or None) per request ({len(trace)}), got "
                         f"{type(prefixes).__name__}" + (f" of {len(prefixes)}" if isinstance(prefixes, (list, tuple)) else ""))
    requests = []
    for i, (p, m) in enumerate(zip(trace.prompts, trace.max_new_tokens)):
        try:
            (req,) = engine._validate([list(p)], m, None if prefixes is None else [prefixes[i]])
        except (TypeError, ValueError) as err:
            msg = (str(err).replace("request 'prompts[0]': ", "\0").replace("prompts[0]", f"trace.prompts[{i}]")
                   .replace("\0", f"trace.prompts[{i}] with trace.max_new_tokens[{i}]: ")
                   .replace("prefixes[0]", f"the prefix of request {i}"))
            raise type(err)(f"trace request {i}: {msg}") from None
        req.rid = i
        requests.append(req)
    rec = Recorder(trace, clock, cost if cost is not None else StepCost.roofline(engine.model))
    run = engine._run(requests, max(trace.max_new_tokens), None, progress, None, {}, serving=rec)
    while True:
        try:
            next(run)
        except StopIteration as done:
            res = done.value
            break
    return ServeResult(res.outputs, rec.requests, rec.steps, res.stats, clock, trace)
