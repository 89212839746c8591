"""zipkv.scheduler: the engine's policy -- admission order, reservations, retraction choice, requeue -- without a
model or a GPU (the memory manager below runs on the CPU with nothing but its pool)."""
import pytest

from zipkv import format as fmt
from zipkv.memory import KVMemory
from zipkv.scheduler import Request, Scheduler


def requests(*prompt_lengths, max_new=4):
    return [Request(i, list(range(1, n + 1)), None, max_new) for i, n in enumerate(prompt_lengths)]


def admit(sched, req, step=0, first=7):
    """What the engine does when ``req`` fits: its prefill gives its next token, then it joins the batch."""
    req.out.append(first)
    sched.admitted(req, step)


def test_admission_is_first_come_first_served_without_skipping():
    sched = Scheduler(requests(5, 3, 2))
    head = sched.next_to_admit(space_returns=0)
    assert head.rid == 0
    sched.blocked(head, space_returns=0)
    assert sched.next_to_admit(0) is None, "a blocked head is not skipped for a later request that might fit"
    assert sched.next_to_admit(1) is head, "the head is tried again once the memory gave space back"
    admit(sched, head)
    assert sched.next_to_admit(1).rid == 1
    with pytest.raises(ValueError, match="head of the waiting queue"):
        sched.admitted(sched.waiting[1], 0)


def test_max_batch_caps_the_running_batch():
    sched = Scheduler(requests(2, 2, 2), max_batch=2)
    for step in range(2):
        admit(sched, sched.next_to_admit(0), step)
    assert sched.next_to_admit(0) is None and len(sched.running) == 2
    sched.running[0].out = [7] * 4                                   # finished: leaves, and makes room
    assert [r.rid for r in sched.retire()] == [0]
    assert sched.next_to_admit(0).rid == 2 and sched.admitted_at == {0: 0, 1: 1}


def test_retraction_takes_the_request_that_grew_least_then_the_longest():
    sched = Scheduler(requests(10, 30, 20, 30))
    for _ in range(4):
        admit(sched, sched.next_to_admit(0))
    for r, grown in zip(sched.running, (1, 2, 1, 1)):
        r.grown = grown
    assert sched.retraction_victim().rid == 3, "fewest grown (1), then most cached at admission (30 + 1)"
    sched.running[3].grown = 2
    assert sched.retraction_victim().rid == 2
    with pytest.raises(ValueError, match="no running request"):
        Scheduler([]).retraction_victim()


def test_a_retracted_request_goes_first_with_its_tokens_and_its_steps_in_flight_dropped():
    sched = Scheduler(requests(4, 4, 4))
    a = sched.next_to_admit(0)
    admit(sched, a)
    b = sched.next_to_admit(0)
    admit(sched, b)
    b.out += [8, 9]
    b.pending, epoch = 1, b.epoch
    sched.requeue(b)
    assert sched.waiting[0] is b and b.out == [7, 8, 9] and b.pending == 0 and b.epoch == epoch + 1
    assert sched.retracted == 1 and sched.running == [a]
    assert b.cached == 4 + 3, "re-admission prefills the prompt and every token it has"
    admit(sched, sched.next_to_admit(0), step=5)
    assert b.cached_at_admission == 8 and b.grown == 0 and sched.admitted_at[b.rid] == 0, "first admission kept"


def test_decode_batch_and_retirement_follow_outputs_steps_in_flight_and_stop_tokens():
    sched = Scheduler(requests(3, 3, 3, max_new=3), eos={5})
    for _ in range(3):
        admit(sched, sched.next_to_admit(0))
    r0, r1, r2 = sched.running
    r0.pending = 2                                                   # its last token is already launched
    r1.out.append(5)                                                 # a stop token
    assert sched.decode_batch() == [r1, r2]
    assert sched.retire() == [r1] and sched.done == {1: [7, 5]}
    assert sched.outputs(3) == [[7], [7, 5], [7]]


def simulate(prompt_lengths, max_new, budget_pages, reserve_ratio):
    """The engine's loop without a model: the scheduler and a CPU memory manager (2 layers, 1 KV head, head_dim 64,
    chunks of one page), every decode step one token per running request. Returns the scheduler and, per retraction,
    whether its victim is the one SGLang's order picks from the memory's own counts."""
    mem = KVMemory(2, 1, 64, budget_pages * 2 * 2 * fmt.page_bytes(64), pages_per_chunk=1)
    sched = Scheduler(requests(*prompt_lengths, max_new=max_new))
    checks = []
    for step in range(10_000):
        for r in sched.retire():
            mem.free(r.rid)
        mem.reads_done()
        while (req := sched.next_to_admit(mem.space_returns)) is not None:
            if mem.admit(req.rid, req.cached, req.remaining, reserve_ratio=reserve_ratio) is None:
                sched.blocked(req, mem.space_returns)
                break
            admit(sched, req, step)
        batch = sched.decode_batch()
        if not sched.has_work():
            return sched, checks
        for r in batch:
            while r in sched.running and mem.alloc(r.rid, 1) is None:
                victim = sched.retraction_victim()
                # the memory's own count: tokens allocated since admission, then the longest cache at admission
                prompt_len = {x.rid: x.cached_at_admission - 1 for x in sched.running}     # before the prefill's token
                checks.append(victim is min(sched.running, key=lambda x: (mem.cache_len(x.rid) - prompt_len[x.rid],
                                                                         -prompt_len[x.rid])))
                mem.free(victim.rid)
                sched.requeue(victim)
            if r in sched.running:
                r.grown += 1
        for r in batch:
            if r in sched.running:
                r.out.append(step)
    raise AssertionError("the simulated run did not finish")


def test_full_reservations_never_retract_and_every_request_finishes():
    sched, checks = simulate([40, 20, 33, 8, 50], max_new=40, budget_pages=12, reserve_ratio=1.0)
    assert sched.retracted == 0 and not checks
    assert [len(o) for o in sched.outputs(5)] == [40] * 5
    assert len(set(sched.admitted_at.values())) > 1, "the budget held only some requests at once"


def test_short_reservations_retract_by_policy_and_every_request_still_finishes():
    sched, checks = simulate([40, 20, 33, 8, 50], max_new=40, budget_pages=12, reserve_ratio=0.25)
    assert sched.retracted > 0 and all(checks), "each victim grew least among the running requests"
    assert [len(o) for o in sched.outputs(5)] == [40] * 5
