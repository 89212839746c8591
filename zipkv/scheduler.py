"""The engine's scheduling policy (ZipFusion §III-D): which request is tried for admission next, which requests decode
in a step, which one is retracted when a step finds no page, and where a retracted request goes.

The seams of SGLang's ``managers/scheduler.py`` and vLLM v1's ``core/sched/scheduler.py``: policy only. The scheduler
never touches memory, tensors or the model -- :class:`zipkv.engine.Engine` asks the memory manager whether a request
fits and the step runner to prefill and decode it -- so it runs, and is tested, without either.

* **Admission** -- first come, first served, no skipping (SGLang's default ``fcfs``): only the head of the waiting
  queue is tried, while the running batch is below ``max_batch``. A head that did not fit is tried again only after
  the memory has given space back (its ``space_returns`` count moved, :meth:`Scheduler.blocked`): nothing else makes
  room, and an admission check walks every layer's chunks.
* **Reservations** are the memory manager's (``reserve_ratio``, :class:`zipkv.memory.KVMemory`): the scheduler
  only records what each request has grown by since its admission.
* **Retraction** -- SGLang's ``retract_decode`` order (:meth:`Scheduler.retraction_victim`): the running request
  that has grown by the fewest tokens since its admission, ties broken by the most tokens cached at admission.
* **Requeue** -- a retracted request goes back to the *front* of the waiting queue with every token it has; it is
  prefilled again (on its prompt and outputs) when admitted (vLLM's preemption by recompute).
* **Arrivals** -- served as a trace (:mod:`zipkv.serving`), a request joins the back of the waiting queue only once
  the clock has reached its arrival time (:meth:`Scheduler.arrive`); without arrival times every request is waiting
  from the start (:meth:`zipkv.engine.Engine.generate`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Request", "Scheduler"]


@dataclass
class Request:
    """One request of a :meth:`zipkv.engine.Engine.generate` call.

    rid: its index among the prompts. prompt: its token ids. prefix: a :class:`zipkv.engine.Prefix` it starts from
    (or None). max_new: tokens to generate. out: tokens generated so far (kept across retraction). stop_token_ids:
    its own stop tokens, beside the call's ``eos``. sampling: its column of the decode step's sampling inputs
    (:meth:`zipkv.sampling.SamplingParams.step_column`), or None where the call is greedy.
    """
    rid: int
    prompt: list
    prefix: object
    max_new: int
    out: list = field(default_factory=list)
    position: int = 0                 # position of the next token to feed
    pending: int = 0                  # launched steps whose token is not read yet
    epoch: int = 0                    # raised on retraction and retirement: a step in flight then drops its token
    staged: tuple | None = None       # prefilled (and packed or encoded) while it waits: reused when it fits
    blocked: int | None = None        # the memory's space_returns when its admission last failed
    cached_at_admission: int = 0      # ``cached`` right after its last admission (its prefill's token included)
    grown: int = 0                    # tokens its cache has grown by since then (one per decode step it took part in)
    stop_token_ids: frozenset = frozenset()
    sampling: tuple | None = None
    stopped: bool = False             # a stop string appeared in its text (the engine cut ``out`` before it)

    @property
    def cached(self) -> int:
        """Tokens its cache must hold to continue: the prefix's pairs, the prompt and the outputs."""
        return (self.prefix.length if self.prefix is not None else 0) + len(self.prompt) + len(self.out)

    @property
    def remaining(self) -> int:
        """Tokens still to generate."""
        return self.max_new - len(self.out)

    def finished(self, eos: set) -> bool:
        """Whether it has all its tokens, its last one is a stop token (of ``eos`` or its own) or it met a stop
        string."""
        return self.stopped or len(self.out) >= self.max_new or (
            bool(self.out) and (self.out[-1] in eos or self.out[-1] in self.stop_token_ids))


class Scheduler:
    """The waiting queue and the running batch of one ``generate`` call (module docstring).

    requests: :class:`Request` s in arrival order. max_batch: cap on running requests (None: none). eos: stop token
    ids (:meth:`Request.finished`). arrivals: per request its arrival time (seconds, in the order of ``requests``), or
    None: all waiting from the start.
    """

    def __init__(self, requests, *, max_batch: int | None = None, eos=frozenset(), arrivals=None):
        requests = list(requests)
        if arrivals is not None and len(arrivals) != len(requests):
            raise ValueError(f"arrivals must hold one time per request: {len(arrivals)} for {len(requests)} requests")
        # not yet arrived, latest first (popped from the end); ties keep the requests' order
        self.future: list = [] if arrivals is None else sorted(zip(arrivals, range(len(requests)), requests),
                                                              key=lambda a: (-a[0], -a[1]))
        self.waiting: list[Request] = requests if arrivals is None else []
        self.running: list[Request] = []
        self.done: dict = {}
        self.max_batch, self.eos = max_batch, set(eos)
        self.retracted = 0
        self.admitted_at: dict = {}

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.future)

    # ------------------------------------------------------------------ arrivals

    def arrive(self, now: float) -> list[Request]:
        """The requests whose arrival time is ``now`` or earlier join the back of the waiting queue, in arrival order.
        Returns them."""
        came = []
        while self.future and self.future[-1][0] <= now:
            came.append(self.future.pop()[2])
        self.waiting.extend(came)
        return came

    def next_arrival(self) -> float | None:
        """The arrival time of the next request not yet arrived, or None."""
        return self.future[-1][0] if self.future else None

    # ------------------------------------------------------------------ admission

    def next_to_admit(self, space_returns: int) -> Request | None:
        """The request to try for admission now: the head of the queue, unless the batch is full or the head was
        refused since the memory last gave space back (``space_returns``: :attr:`zipkv.memory.KVMemory.space_returns`)."""
        if not self.waiting or (self.max_batch is not None and len(self.running) >= self.max_batch):
            return None
        head = self.waiting[0]
        return None if head.blocked == space_returns else head

    def blocked(self, req: Request, space_returns: int) -> None:
        """``req`` did not fit: it is tried again once ``space_returns`` has moved."""
        req.blocked = space_returns

    def admitted(self, req: Request, step: int) -> None:
        """``req`` (the head of the queue) was admitted and prefilled (its next token appended) before decode step
        ``step``."""
        if not self.waiting or self.waiting[0] is not req:
            raise ValueError(f"request {req.rid} is not the head of the waiting queue (fcfs admits only the head)")
        self.waiting.pop(0)
        self.running.append(req)
        req.cached_at_admission, req.grown = req.cached, 0
        self.admitted_at.setdefault(req.rid, step)

    # ------------------------------------------------------------------ decoding

    def decode_batch(self) -> list[Request]:
        """The running requests that still need a token beyond the steps already launched for them."""
        return [r for r in self.running if len(r.out) + r.pending < r.max_new]

    def leave(self, req: Request) -> None:
        """``req`` leaves the running batch; a step in flight then drops its token (its epoch moves)."""
        self.running.remove(req)
        req.pending, req.epoch = 0, req.epoch + 1

    def retire(self) -> list[Request]:
        """The running requests that finished leave the batch, their tokens recorded in :attr:`done`. Returns them."""
        gone = [r for r in self.running if r.finished(self.eos)]
        for r in gone:
            self.leave(r)
            self.done[r.rid] = r.out
        return gone

    # ------------------------------------------------------------------ retraction

    def retraction_victim(self) -> Request:
        """The running request to retract when a step finds no page (SGLang's ``retract_decode`` order): the one that
        has grown least since its admission, ties broken by the longest cache at admission, then by batch order."""
        if not self.running:
            raise ValueError("no running request to retract")
        return min(self.running, key=lambda r: (r.grown, -r.cached_at_admission))

    def requeue(self, req: Request) -> None:
        """Retract ``req``: it leaves the batch and goes to the front of the waiting queue with the tokens it has."""
        self.leave(req)
        self.waiting.insert(0, req)
        self.retracted += 1

    def outputs(self, n: int) -> list:
        """Every request's tokens in prompt order (unfinished ones with the tokens they have)."""
        for r in self.running + self.waiting + [f[2] for f in self.future]:
            self.done.setdefault(r.rid, r.out)
        return [self.done[i] for i in range(n)]
