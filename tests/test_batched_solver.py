"""The batched KVSculpt solver (issue #5) against the one-problem-at-a-time reference, on tiny problems.

Agreement is measured in float64: the reference's trajectories are chaotic (a rounding-level change
grows by roughly 10× per outer step on these problems), so the batched solver equals the reference
to ~1e-9 over a few steps in float64 and only to ~1e-3 in float32 (see the tolerances below).
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.optim.lbfgs import _strong_wolfe as torch_strong_wolfe

from zipkv.distill import baselines as B
from zipkv.distill import batched as BT
from zipkv.distill import kvsculpt as K

F64 = torch.float64


from conftest import tiny_llama  # noqa: E402
from test_distill import random_problem  # noqa: E402  (shared synthetic problem builder)

pytestmark = pytest.mark.usefixtures("one_thread")


def mixed_problems():
    """Different k (one bucket spans 1 … 20 with tile=None), N, m (one with m = 0) and sharpness."""
    spec = [(1, 40, 8, 2.0), (3, 30, 4, 1.0), (6, 40, 8, 3.0), (12, 48, 8, 2.0), (20, 40, 0, 1.5)]
    return [random_problem(n=n, m=m, k=k, seed=10 + k, sharp=sh) for k, n, m, sh in spec]


def cfg(steps, dtype=F64, **kw):
    return K.SculptConfig(steps=steps, dtype=dtype, progress=False, **kw)


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-300)


# --- building blocks ---------------------------------------------------------------------------------------

def test_loss_and_gradient_match_the_reference_objective_with_padding():
    problems = [random_problem(k=k, seed=k) for k in (2, 5, 9)]
    preps = [B.Prepared(p, F64) for p in problems]
    batch = BT._Batch(preps, [p.k for p in problems])
    gen = torch.Generator().manual_seed(0)
    keys = torch.zeros(3, 9, 8, dtype=F64)
    values = torch.zeros(3, 9, 8, dtype=F64)
    for i, p in enumerate(problems):
        keys[i, : p.k] = torch.randn(p.k, 8, generator=gen, dtype=F64) * 2
        values[i, : p.k] = torch.randn(p.k, 8, generator=gen, dtype=F64)
    loss, grad = batch.loss_grad(keys.clone(), values)
    for i, (p, prep) in enumerate(zip(problems, preps)):
        kc = keys[i, : p.k].clone().requires_grad_(True)
        want = prep.loss(kc, values[i, : p.k])
        want.backward()
        assert rel(float(loss[i]), float(want.detach())) < 1e-12
        assert (grad[i, : p.k] - kc.grad).abs().max() < 1e-12 * kc.grad.abs().max()
        assert torch.equal(grad[i, p.k:], torch.zeros_like(grad[i, p.k:])), "padded keys get no gradient"
    # V-step: the reference's ridge values on the real keys, exact zeros on the padding
    v, ok = batch.ridge(keys, 1e-3)
    assert ok.all()
    for i, (p, prep) in enumerate(zip(problems, preps)):
        want = prep.ridge(keys[i, : p.k], 1e-3)
        assert (v[i, : p.k] - want).abs().max() < 1e-7 * want.abs().max()
        assert torch.equal(v[i, p.k:], torch.zeros_like(v[i, p.k:]))
    # a problem whose keys overflow is flagged and solved as the identity; the others are untouched
    bad = keys.clone()
    bad[1, 0, 0] = float("inf")
    v2, ok2 = batch.ridge(bad, 1e-3)
    assert ok2.tolist() == [True, False, True] and torch.equal(v2[1], torch.zeros_like(v2[1]))
    assert torch.equal(v2[0], v[0]) and torch.equal(v2[2], v[2])


def batched_strong_wolfe(fg, x, t, d, f, g, gtd, active, max_ls):
    """The batched solver's line search run eagerly from its first trial, as ``_LBFGS`` runs it:
    ``(f, g, t, evals, rounds)`` per problem (inactive problems get ``(f, g, 0, 0)``)."""
    t = torch.where(active, t, torch.zeros_like(t))
    f_new, g_new = BT._evaluate(fg, x, t, d, active, f, g)
    gtd_new = torch.where(active, (g_new * d).sum(dim=1), gtd)
    search = BT._LineSearch(x.shape[0], x.shape[1], x.dtype, x.device, BT._Graphs(False))
    rounds = search.run(fg, x, d, f, g, gtd, active, max_ls, t, f_new, g_new, gtd_new)
    return search.out_f, search.out_g, search.out_t, search.evals, rounds


def test_batched_strong_wolfe_is_torchs_line_search_per_problem():
    """Each problem's search equals torch.optim.lbfgs._strong_wolfe: same step, loss, gradient, evaluations,
    through extrapolation, zoom and the out-of-evaluations fallback (max_ls 1–3)."""
    torch.manual_seed(3)
    P, n = 40, 5
    a, b, c = torch.rand(P, n, dtype=F64) + 0.1, torch.randn(P, n, dtype=F64), torch.rand(P, n, dtype=F64) * 0.5

    def one(i, x):
        return (c[i] * x ** 4 + a[i] * x ** 2 / 2 + b[i] * x).sum(), 4 * c[i] * x ** 3 + a[i] * x + b[i]

    def fg(points, idx):
        rows = range(P) if idx is None else idx.tolist()
        fs, gs = zip(*[one(i, pt) for i, pt in zip(rows, points)])
        return torch.stack(fs), torch.stack(gs)

    x = torch.randn(P, n, dtype=F64)
    f, g = fg(x, None)
    d = -g * torch.logspace(-4, 2, P, dtype=F64)[:, None]
    t = torch.logspace(-5, 3, P, dtype=F64)[torch.randperm(P)]
    gtd = (g * d).sum(1)
    max_ls = torch.tensor([25, 1, 2, 3] * (P // 4))
    active = torch.ones(P, dtype=torch.bool)
    active[7] = False
    fb, gb, tb, evals, rounds = batched_strong_wolfe(fg, x, t, d, f, g, gtd, active, max_ls)
    assert rounds == int(evals.max()) and tb[7] == 0 and evals[7] == 0
    seen = set()
    for i in range(P):
        if not active[i]:
            continue

        def obj(xx, tt, dd, i=i):
            loss, grad = one(i, xx + tt * dd)
            return float(loss), grad

        fr, gr, tr, er = torch_strong_wolfe(obj, x[i], float(t[i]), d[i], float(f[i]), g[i], gtd[i],
                                            max_ls=int(max_ls[i]))
        assert er == int(evals[i]) and rel(float(tb[i]), float(tr)) < 1e-12 and rel(float(fb[i]), fr) < 1e-12
        assert (gb[i] - gr).abs().max() < 1e-10
        seen.add(er)
    assert len(seen) >= 4, "the problems exercise searches of several lengths"


def test_buckets_pad_by_less_than_a_tile():
    ks = [5, 200, 64, 130, 70, 1, 199]
    groups = BT.buckets(ks, 64)
    assert sorted(i for g in groups for i in g) == list(range(len(ks)))
    for g in groups:
        assert max(ks[i] for i in g) - min(ks[i] for i in g) < 64
    assert BT.buckets(ks, None) == [sorted(range(len(ks)), key=lambda i: -ks[i])]
    assert BT.buckets([7, 7, 7], 64) == [[0, 1, 2]], "uniform budgets make one bucket"
    with pytest.raises(ValueError, match="tile=0"):
        BT.buckets(ks, 0)


# --- the solver against the reference ---------------------------------------------------------------------

@pytest.mark.parametrize("reset_history", [False, True])
def test_batched_solver_equals_reference_float64(reset_history):
    """Same loss history step by step (across a V-step at step 5, with or without restarting the
    L-BFGS history there), same final loss."""
    problems = mixed_problems()
    config = cfg(7, reset_history=reset_history)
    ref = K.solve(problems, config)
    got, stats = BT.solve_batched(problems, config, tile=None)
    assert len(set(stats.bucket)) == 1 and set(stats.k_padded) == {20}
    for p, r, s in zip(problems, ref, got):
        assert s.keys.shape == (p.k, p.head_dim) and s.values.shape == (p.k, p.head_dim)
        assert len(s.history) == len(r.history) == 8
        assert s.initial_loss == r.initial_loss, "same start: Select+Fit"
        assert max(rel(a, b) for a, b in zip(s.history, r.history)) < 1e-6
        assert rel(s.loss, r.loss) < 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("freeze_rtol", [None, 1e-3])
def test_batched_solver_equals_reference_on_cuda(freeze_rtol):
    """CUDA graphs (captured at the second inner iteration; re-captured when a frozen problem leaves the
    batch) give the same histories as eager launches, and the reference's loss."""
    problems = mixed_problems()
    config = cfg(12, device="cuda")
    graphed, stats = BT.solve_batched(problems, config, tile=None, freeze_rtol=freeze_rtol)
    eager = BT.solve_batched(problems, config, tile=None, freeze_rtol=freeze_rtol, cuda_graphs=False)[0]
    if freeze_rtol:
        assert 0 < max(stats.frozen_at) < config.steps, "a problem left the batch before the end"
    else:
        for r, s in zip(K.solve(problems, config), graphed):
            assert rel(s.loss, r.loss) < 1e-6
    for s, e in zip(graphed, eager):
        assert s.keys.device.type == "cuda" and max(rel(a, b) for a, b in zip(s.history, e.history)) < 1e-6


def test_batched_solver_close_to_reference_float32():
    """float32 trajectories drift apart by rounding (different reduction orders, more so on the GPU),
    so only closeness after a few steps is asked."""
    problems = mixed_problems()
    config = cfg(4, torch.float32)
    ref = K.solve(problems, config)
    got = BT.solve(problems, config)
    for r, s in zip(ref, got):
        assert s.initial_loss == pytest.approx(r.initial_loss, rel=1e-6)
        assert rel(s.loss, r.loss) < 1e-2


def test_history_overflow_without_restart_matches_reference():
    """reset_history=False with a 3-pair memory: the oldest pair is dropped, as in torch's LBFGS."""
    problems = [random_problem(k=k, seed=40 + k) for k in (4, 9)]
    config = cfg(3, history_size=3, reset_history=False)
    ref = K.solve(problems, config)
    got = BT.solve(problems, config)
    for r, s in zip(ref, got):
        assert max(rel(a, b) for a, b in zip(s.history, r.history)) < 1e-6


def test_padding_does_not_change_results():
    """One bucket padded to the largest k gives each problem what it gets when solved alone."""
    problems = mixed_problems()
    config = cfg(6)
    together = BT.solve_batched(problems, config, tile=None)[0]
    for p, s in zip(problems, together):
        alone = BT.solve([p], config)[0]
        assert rel(s.loss, alone.loss) < 1e-8
        assert max(rel(a, b) for a, b in zip(s.history, alone.history)) < 1e-8
    tiles = BT.solve_batched(problems, config, tile=4)
    assert len(set(tiles[1].bucket)) == 4  # k = 20 | 12 | 6, 3 | 1
    for s, t in zip(together, tiles[0]):
        assert rel(t.loss, s.loss) < 1e-8


@pytest.mark.parametrize("reset_history", [False, True])
def test_converged_problem_stops_changing_while_others_continue(reset_history):
    """k = N − m and no ridge: Select+Fit is exact, the gradient is below tolerance_grad, L-BFGS never
    moves it; the other problem keeps descending. With history restarts the converged problem is also
    frozen (dropped from the batch) at the first V-step boundary."""
    exact = random_problem(n=32, m=8, k=24, n_q=32, seed=6)
    hard = random_problem(k=8, seed=7, sharp=3.0)
    config = cfg(12, ridge=0.0, reset_history=reset_history)
    (s_exact, s_hard), stats = BT.solve_batched([exact, hard], config, tile=None)
    assert stats.frozen_at == ([config.value_every, -1] if reset_history else [-1, -1])
    start = B.Prepared(exact, F64)
    index = start.top_attention(exact.k)
    assert torch.equal(s_exact.keys, start.k_old[index]), "a converged problem's keys never change"
    want = start.ridge(start.k_old[index], 0.0)  # the V-step at the boundary re-solves the same values
    assert (s_exact.values - want).abs().max() < 1e-10 * want.abs().max()
    after = s_exact.history[config.value_every:]
    assert len(s_exact.history) == 13 and len(set(after)) == 1 and s_exact.loss < 1e-20, "its loss repeats"
    assert s_hard.history[-1] < s_hard.history[config.value_every] < s_hard.history[0]
    ref = K.solve([exact, hard], config)
    assert torch.equal(ref[0].keys, s_exact.keys), "the reference does not move it either"
    assert max(rel(a, b) for a, b in zip(s_hard.history, ref[1].history)) < 1e-6
    assert ref[0].loss < 1e-20


def test_freeze_rtol_freezes_slow_problems():
    problems = mixed_problems()[:3]
    _, stats = BT.solve_batched(problems, cfg(10), freeze_rtol=1.0)  # any block improving < 100 % freezes
    assert stats.frozen_at == [5, 5, 5]


def test_batched_starts_at_select_fit_and_zero_budget():
    problems = [random_problem(k=k, seed=60 + k, sharp=s) for k in (1, 4, 9, 32) for s in (0.5, 3.0)]
    problems.append(random_problem(k=0, seed=1))
    sf = B.select_fit(problems)
    got = BT.solve(problems, cfg(6, torch.float32))
    for p, a, s in zip(problems, sf, got):
        assert s.keys.shape == (p.k, p.head_dim)
        assert s.initial_loss == pytest.approx(a.loss, rel=1e-6, abs=1e-12)
        assert s.loss == pytest.approx(B.problem_loss(p, s.keys, s.values), rel=1e-4, abs=1e-9)


def test_compress_with_the_batched_solver(tiny_capture):
    budget = torch.tensor([[1, 40, 5], [7, 13, 2]])
    cache = K.compress(tiny_capture, 0.5, "kvsculpt", m=8, n_synthetic=8, budget=budget,
                       config=cfg(4, torch.float32), solver=BT.make_solver(tile=16))
    assert torch.equal(cache.lengths, budget + 8)
    # the reported loss is the objective of the returned pairs, recomputed from scratch
    for p in K.build_problems(tiny_capture, budget, m=8, n_synthetic=8):
        k = p.k
        got = B.problem_loss(p, cache.keys[p.layer][p.head][:k], cache.values[p.layer][p.head][:k])
        assert got == pytest.approx(float(cache.loss[p.layer, p.head]), rel=2e-3, abs=1e-9)  # float32 solve


# --- Qwen-shaped problems and the benchmark ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_capture():
    from zipkv.models import capture

    model = tiny_llama(q_heads=9, kv_heads=3)
    ids = torch.randint(0, 128, (48,), generator=torch.Generator().manual_seed(1))
    return capture(model, ids)


def test_qwen_shaped_problems_concatenate_real_heads(tiny_capture):
    cap = tiny_capture  # 2 layers × 3 KV heads × 16, 3 query heads per KV head
    from zipkv.bench import distill as BD

    problems = BD.qwen_shaped_problems(cap, 0.5, m=8, n_synthetic=4, layers=2)
    assert len(problems) == 4 and [(p.layer, p.head) for p in problems] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(p.k == 16 and p.head_dim == 32 and p.queries.shape == (6 * 12, 32) for p in problems)
    p = problems[1]  # layer 0, head 1 = [h2 | h0]
    lc = cap.layers[0]
    assert torch.equal(p.keys, torch.cat([lc.keys[2], lc.keys[0]], -1))
    assert torch.equal(p.values, torch.cat([lc.values[2], lc.values[0]], -1))
    q = p.queries.view(6, 12, 32)
    # retain queries: real queries of both halves at the same positions; pairs (i, i), then (i, i+1 mod 3)
    assert torch.equal(q[3, :8], torch.cat([lc.queries[6, -8:], lc.queries[1, -8:]], -1).float())
    # every logit is the sum of the two heads' logits
    s = q[0] @ p.keys.T.float()
    s_halves = q[0, :, :16] @ lc.keys[2].T.float() + q[0, :, 16:] @ lc.keys[0].T.float()
    assert (s - s_halves).abs().max() < 1e-4 * s.abs().max()
    with pytest.raises(ValueError, match="layers=28"):
        BD.qwen_shaped_problems(cap, 0.5, m=8)


def test_bench_distill_reports_both_solvers(monkeypatch):
    problems = mixed_problems()
    from zipkv.bench import distill as BD

    clock = iter([2.0, 3.0])                    # the batched solve, then the reference's on 3 of the 5 problems
    monkeypatch.setattr(BD, "_timed", lambda fn, device: (fn(), next(clock)))
    timings, losses = BD.bench_distill(problems, problem_shape="tiny", config=cfg(3, torch.float32),
                                       reference_limit=3)
    assert list(timings.solver) == ["reference", "batched"]
    for column in ("problem_shape", "ctx", "ratio", "solver", "seconds", "speedup"):
        assert column in timings.columns
    assert timings.reference_problems.iloc[0] == 3
    # the reference's seconds scaled from its 3 problems to the context's 5; speedups against that
    assert timings.seconds.tolist() == [3.0 * 5 / 3, 2.0] and timings.speedup.tolist() == [1.0, 2.5]
    assert len(losses) == 5 and losses.reference.notna().sum() == 3
    assert (losses.rel_diff.dropna().abs() < 1e-2).all()


def test_a_problem_going_non_finite_at_a_v_step_stops_alone(monkeypatch):
    """A problem whose keys become non-finite on a V-step boundary stops there with its best iterate, as in
    the reference; the V-step of the others is unaffected (on the CPU a NaN Gram matrix makes LU raise)."""
    problems = mixed_problems()[:3]
    config = cfg(10)
    clean = BT.solve_batched(problems, config, tile=None)[0]
    step, calls = BT._LBFGS.step, []

    def poisoned(self, x, loss, g, fg, frozen):
        step(self, x, loss, g, fg, frozen)
        calls.append(1)
        if len(calls) == config.value_every:  # the step that ends with the first V-step
            x[0] = float("inf")
            loss[0] = float("nan")

    ridge = BT._Batch.ridge

    def finite_ridge(self, keys, lam):
        assert torch.isfinite(keys).all(), "a problem that stopped is solved at its (finite) best keys"
        return ridge(self, keys, lam)

    monkeypatch.setattr(BT._LBFGS, "step", poisoned)
    monkeypatch.setattr(BT._Batch, "ridge", finite_ridge)
    got = BT.solve_batched(problems, config, tile=None)[0]
    row0 = max(range(len(problems)), key=lambda i: (problems[i].k, -i))  # the batch is ordered by k, largest first
    first = got[row0]
    assert len(first.history) == config.value_every + 1 and math.isnan(first.history[-1])
    assert math.isfinite(first.loss) and torch.isfinite(first.keys).all()
    assert rel(first.loss, min(first.history[:-1])) < 1e-12
    for i, (s, c) in enumerate(zip(got, clean)):
        if i != row0:
            assert rel(s.loss, c.loss) < 1e-12
