"""Experiment loops of the KVSculpt analysis chapters (zipkv.study.experiments.analysis) on small problems."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from zipkv.study.experiments import analysis as A
from zipkv.distill import baselines as B
from zipkv.distill import budget
from zipkv.distill.batched import solve_batched
from zipkv.distill.kvsculpt import SculptConfig

pytestmark = pytest.mark.usefixtures("one_thread")
CFG = SculptConfig(steps=6, progress=False)


def problems(count=3, n=40, m=8, d=8, n_q=24, k=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        out.append(B.Problem(torch.randn(n, d, generator=gen) * 2, torch.randn(n, d, generator=gen),
                             torch.randn(2, n_q, d, generator=gen) * 2, m=m, k=k, layer=i))
    return out


def test_random_starts_are_used_and_the_oracle_never_reports_above_its_single_run():
    ps = problems()
    single, _ = solve_batched(ps, CFG)
    starts = [torch.arange(p.k) for p in ps]  # the k oldest positions: not the top-attention start
    from_start, _ = solve_batched(ps, SculptConfig(steps=0, progress=False), starts=starts)
    for p, s, st, s1 in zip(ps, from_start, starts, single):
        want = B.problem_loss(p, p.keys[st], B.ridge_values(p, p.keys[st]))
        assert s.initial_loss == pytest.approx(want, rel=1e-4)
        assert s.initial_loss != pytest.approx(s1.initial_loss, rel=1e-3)
    oracle = A.oracle_search(ps, single, CFG, restarts=4, seed=1)
    assert all(o.loss <= s.loss for o, s in zip(oracle, single))
    assert [o.loss for o in A.oracle_search(ps, single, CFG, restarts=1)] == [s.loss for s in single]
    with pytest.raises(ValueError, match="starts\\[0\\]"):
        solve_batched(ps, CFG, starts=[torch.arange(3)] + [None] * 2)


def test_adam_starts_at_select_fit_and_returns_its_best_iterate():
    ps = problems(seed=2)
    sols = A.adam_solve(ps, SculptConfig(steps=3, inner_iterations=4, progress=False), lr=0.05)
    sf = B.select_fit(ps)
    for s, f, p in zip(sols, sf, ps):
        assert s.keys.shape == (p.k, p.head_dim)
        assert s.initial_loss == pytest.approx(f.loss, rel=1e-4) and s.loss <= s.initial_loss * (1 + 1e-6)
        assert s.loss == pytest.approx(B.problem_loss(p, s.keys, s.values), rel=1e-4)


def test_a_pilot_read_from_the_history_equals_a_separate_pilot_run():
    ps = problems(seed=3)
    long, _ = solve_batched(ps, SculptConfig(steps=10, progress=False))
    pilot, _ = solve_batched(ps, SculptConfig(steps=5, progress=False))
    read = budget.pilot_signal([s.history for s in long], 5)
    assert read.tolist() == pytest.approx([min(s.history) for s in pilot], rel=1e-6)


def test_near_far_cosine_is_one_for_identical_caches_and_below_for_others():
    gen = torch.Generator().manual_seed(4)
    keys, values = torch.randn(2, 30, 8, generator=gen), torch.randn(2, 30, 8, generator=gen)
    queries = torch.randn(6, 5, 8, generator=gen) * 3
    same = (keys, values, torch.ones(2, 30, dtype=torch.bool))
    assert torch.allclose(A.attention_cosine((keys, values), same, queries), torch.ones(2, dtype=torch.float64))
    # padding that is masked out changes nothing
    pad_k = torch.cat([keys, torch.randn(2, 4, 8, generator=gen) * 10], 1)
    pad_v = torch.cat([values, torch.randn(2, 4, 8, generator=gen)], 1)
    valid = torch.cat([torch.ones(2, 30), torch.zeros(2, 4)], 1).bool()
    assert torch.allclose(A.attention_cosine((keys, values), (pad_k, pad_v, valid), queries), torch.ones(2, dtype=torch.float64))
    half = (keys[:, :15], values[:, :15], torch.ones(2, 15, dtype=torch.bool))
    assert float(A.attention_cosine((keys, values), half, queries).max()) < 0.999


def test_error_metrics_are_zero_for_the_uncompressed_cache():
    gen = torch.Generator().manual_seed(5)
    ref = SimpleNamespace(logits=torch.randn(16, 50, generator=gen), hidden=torch.randn(4, 16, 12, generator=gen))
    m = A.error_metrics(ref, ref)
    assert float(m["hidden_mse"].abs().max()) == 0 and float(m["kl_per_token"].max()) == 0
    assert m["growth_first_to_last"] == 0 and m["topk_kl_share"] == 0 and m["max_over_mean_kl"] == 0
    hidden = ref.hidden.clone()
    for layer in range(4):
        hidden[layer] += 10.0 ** layer * 1e-3
    logits = ref.logits.clone()
    logits[3] += torch.randn(50, generator=gen) * 5  # all the KL in one token
    m = A.error_metrics(ref, SimpleNamespace(logits=logits, hidden=hidden), top=1)
    assert m["growth_first_to_last"] == pytest.approx(1e6, rel=1e-4)
    assert m["topk_kl_share"] == pytest.approx(1.0) and m["max_over_mean_kl"] == pytest.approx(16.0)


def test_spearman():
    assert A.spearman([1, 2, 3, 4], [10, 20, 30, 45]) == pytest.approx(1.0)
    assert A.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(A.spearman([1], [2]))


def test_a_cached_sweep_is_reused_only_with_the_same_parameters(tmp_path):
    import pandas as pd

    table = pd.DataFrame(dict(window=[0], kl=[0.5]))
    sweep = A.BudgetSweep(runs=table, heads=table, layers=table, tokens=table, params=dict(steps=100, windows="abc"),
                          seconds=dict(total=1.0))
    path = tmp_path / "sweep.json"
    sweep.save(path)
    again = A.BudgetSweep.load(path, dict(steps=100, windows="abc"))
    assert again is not None and again.runs.kl.tolist() == [0.5] and again.seconds == dict(total=1.0)
    assert A.BudgetSweep.load(path, dict(steps=60, windows="abc")) is None
    assert A.BudgetSweep.load(path, dict(steps=100, windows="abd")) is None
    assert A.BudgetSweep.load(tmp_path / "missing.json", dict(steps=100)) is None


def test_content_statistics_of_low_rank_queries():
    class Identity:  # RoPE that rotates nothing: content vectors are the queries themselves
        def invert(self, x, positions):
            return x

    gen = torch.Generator().manual_seed(6)
    q = torch.randn(3, 200, 4, generator=gen) @ torch.randn(4, 16, generator=gen)  # rank 4 in 16 dimensions
    whole = SimpleNamespace(layers=[SimpleNamespace(queries=q)], positions=torch.arange(200), rope=Identity())
    stats = A.content_statistics(SimpleNamespace(whole=whole, n_context=150), near=20)
    assert stats.effective_dim.max() <= 4 and stats.decode_captured.min() > 0.8
    smooth = torch.cumsum(torch.randn(1, 200, 16, generator=gen), dim=1)  # slowly varying: consecutive cosine near 1
    whole.layers = [SimpleNamespace(queries=smooth)]
    assert A.content_statistics(SimpleNamespace(whole=whole, n_context=150), near=20).consecutive_cosine[0] > 0.9


def tiny_windows(count, context, continuation, seed=7):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, 128, (context + continuation,), generator=gen)
        out.append(SimpleNamespace(input_ids=ids, context=context, continuation=continuation,
                                   context_ids=ids[:context], continuation_ids=ids[context:]))
    return out


@pytest.fixture(scope="module")
def tiny():
    from conftest import tiny_llama

    return tiny_llama(sharpen_logits=True)


def test_budget_sweep_keeps_the_total_in_every_run_and_is_reused_from_its_cache(tiny, tmp_path):
    windows = tiny_windows(2, 40, 8)
    kw = dict(ratio=0.5, m=8, n_synthetic=8, config=SculptConfig(steps=4, progress=False), alphas=(0.5, 1.0),
              pilot_steps=2, head_pilot_steps=1, cache=tmp_path / "sweep.json", progress=False)
    sweep = A.budget_sweep(tiny, windows, **kw)
    k, L, H = 12, 2, 2  # round(0.5 · 40) − 8
    assert set(sweep.runs.pairs) == {k * L * H}
    assert len(sweep.runs) == 2 * (1 + 2 * 2 + 2)  # uniform, 2 α × (‖V‖, pilot), per-layer and per-head pilot
    uni = sweep.runs[sweep.runs.policy == "uniform"]
    assert (uni.vs_uniform == 1).all() and (uni.k_min == k).all() and (uni.growth_first_to_last > 0).all()
    assert (sweep.heads.uniform <= sweep.heads.select_fit * (1 + 1e-6)).all()
    assert (sweep.heads.pilot >= sweep.heads.uniform * (1 - 1e-6)).all()  # a shorter run is never better
    assert len(sweep.tokens) == 2 * 8 and len(sweep.layers) == 2 * L
    # §5.2's end-to-end table: its L-BFGS runs are the sweep's uniform runs, solved and assembled anew
    contexts = A.prepare(tiny, windows, m=8, n_synthetic=8, seed=0)
    kl = A.optimizer_kl(tiny, contexts, ratio=0.5, m=8, config=kw["config"])
    lbfgs = kl[kl.optimizer == "lbfgs"].set_index("window").kl
    assert lbfgs.to_numpy() == pytest.approx(uni.set_index("window").kl.to_numpy(), rel=1e-5)
    assert set(kl.optimizer) == {"lbfgs", "adam"} and (kl.kl > 0).all()
    again = A.budget_sweep(tiny, windows, **kw)
    assert again.runs.kl.tolist() == sweep.runs.kl.tolist()
    table = A.versus_uniform(sweep.runs, "pilot", 0.5, "pilot_kl")
    assert table.columns.tolist() == ["window", "uniform_kl", "pilot_kl", "vs_uniform"]
    errors = A.error_table(sweep, easy_kl=0.01)
    assert errors.columns[:6].tolist() == ["window", "label", "growth_first_to_last", "top5_kl_share",
                                           "max_over_mean_kl", "layer_mse_kl_correlation"]


def test_optimizer_and_query_studies_on_a_tiny_model(tiny):
    cfg = SculptConfig(steps=3, progress=False)
    table, heads = A.optimizer_study(tiny, tiny_windows(2, 40, 8), layers=[1], ratio=0.5, m=8, n_synthetic=8, config=cfg,
                                     restarts=3, seed=1)
    assert set(table.optimizer) == {"adam", "lbfgs", "oracle"} and set(table[table.optimizer == "oracle"].window) == {0}
    w0 = heads[heads.window == 0].pivot_table(index="head", columns="optimizer", values="mse_train")
    assert (w0.oracle <= w0.lbfgs).all() and (heads.mse_heldout > 0).all()
    cos, stats = A.query_study(tiny, tiny_windows(1, 40, 24), strategies=["uniform", "bootstrap"], near=8, ratio=0.5,
                               m=8, n_synthetic=8, config=cfg)
    assert len(cos) == 4 and ((cos.cosine > 0) & (cos.cosine <= 1 + 1e-9)).all()
    assert len(stats) == 2 * 4  # layers × query heads
