"""Budget allocation (KVSculpt §3.5): every policy sums exactly to B and respects the per-head bounds."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from zipkv.distill import budget

# difficulty signals as a real pilot gives them: 0, tiny, and outliers 10-100× the median
finite = st.floats(min_value=0.0, max_value=1e6, allow_nan=False, allow_infinity=False)
signal_values = st.one_of(finite, st.sampled_from([0.0, 1e-300, 1e-12, 1e12]))


@st.composite
def problem(draw):
    L = draw(st.integers(1, 12))
    H = draw(st.integers(1, 4))
    k_max = draw(st.integers(1, 400))
    k = draw(st.integers(1, k_max))
    values = draw(st.lists(signal_values, min_size=L * H, max_size=L * H))
    alpha = draw(st.sampled_from([0.0, 0.3, 0.5, 0.7, 1.0, 2.0]))
    return torch.tensor(values, dtype=torch.float64).view(L, H), k, k_max, alpha


@settings(max_examples=300, deadline=None)
@given(problem(), st.booleans())
def test_pilot_allocation_sums_to_the_total_and_respects_bounds(case, per_head):
    signal, k, k_max, alpha = case
    L, H = signal.shape
    out = budget.pilot(signal, k, alpha=alpha, per_head=per_head, k_max=k_max)
    assert out.dtype == torch.long and out.shape == (L, H)
    assert int(out.sum()) == k * L * H
    assert int(out.min()) >= 1 and int(out.max()) <= k_max
    if not per_head:  # evenly within a layer: heads differ by at most one pair
        assert int((out.max(dim=1).values - out.min(dim=1).values).max()) <= 1


@settings(max_examples=200, deadline=None)
@given(problem())
def test_static_allocation_sums_to_the_total_and_respects_bounds(case):
    signal, k, k_max, alpha = case
    L, H = signal.shape
    out = budget.static(signal[:, 0], k, H, alpha=alpha, k_max=k_max)
    assert int(out.sum()) == k * L * H and int(out.min()) >= 1 and int(out.max()) <= k_max


@settings(max_examples=300, deadline=None)
@given(st.lists(signal_values, min_size=1, max_size=40), st.integers(0, 5), st.integers(0, 300), st.data())
def test_split_is_exact_within_bounds(weights, lo, width, data):
    hi = lo + width
    n = len(weights)
    total = data.draw(st.integers(n * lo, n * hi))
    out = budget.split(total, torch.tensor(weights, dtype=torch.float64), lo, hi)
    assert int(out.sum()) == total and int(out.min()) >= lo and int(out.max()) <= hi


def test_split_is_proportional_when_unconstrained():
    out = budget.split(100, torch.tensor([1.0, 3.0, 6.0]), 0, 100)
    assert out.tolist() == [10, 30, 60]


def test_alpha_zero_and_equal_signals_give_the_uniform_budget():
    sig = torch.rand(6, 3, generator=torch.Generator().manual_seed(0)) * 100
    for out in (budget.pilot(sig, 17, alpha=0.0, per_head=True, k_max=50),
                budget.pilot(torch.ones(6, 3), 17, alpha=0.5, per_head=True, k_max=50)):
        assert torch.equal(out, budget.uniform(6, 3, 17))


def test_larger_alpha_spreads_the_layer_budgets_more():
    sig = torch.tensor([[100.0], [1.0], [1.0], [1.0]])
    spans = [budget.layer_range(budget.pilot(sig, 40, alpha=a, k_max=150)) for a in (0.3, 0.5, 1.0)]
    assert spans[0][1] < spans[1][1] < spans[2][1] and spans[0][0] > spans[1][0] > spans[2][0]


def test_an_outlier_layer_is_capped_at_its_compress_zone():
    sig = torch.tensor([[1e9, 1e9], [1.0, 1.0], [1.0, 1.0]])
    out = budget.pilot(sig, 10, alpha=1.0, per_head=True, k_max=12)
    assert out[0].tolist() == [12, 12] and int(out.sum()) == 60


def test_pilot_signal_reads_the_best_loss_of_the_first_steps():
    hist = [[5.0, 4.0, 4.5, 1.0], [3.0, 3.0]]
    assert budget.pilot_signal(hist, 2).tolist() == [4.0, 3.0]
    assert budget.pilot_signal(hist, 0).tolist() == [5.0, 3.0]


def test_value_norm_signal_is_the_mean_value_norm_of_the_compress_zone():
    v = torch.zeros(2, 5, 4)
    v[:, :3, 0] = 2.0  # compress zone (m = 2): norm 2; retain zone: norm 0 (ignored)
    assert budget.value_norm_signal([v, 3 * v], m=2).tolist() == [2.0, 6.0]


@pytest.mark.parametrize("call, match", [
    (lambda: budget.split(10, torch.tensor([1.0, 1.0]), 1, 4), "cannot split"),
    (lambda: budget.split(4, torch.tensor([1.0, -1.0]), 1, 4), "finite and ≥ 0"),
    (lambda: budget.pilot(torch.ones(3), 2, k_max=4), "expected \\[layers, kv_heads\\]"),
    (lambda: budget.pilot(torch.full((2, 2), float("nan")), 2, k_max=4), "finite"),
    (lambda: budget.pilot(torch.ones(2, 2), 5, k_max=4), "cannot split"),
    (lambda: budget.pilot(torch.ones(2, 2), 2, alpha=-1.0, k_max=4), "alpha"),
    (lambda: budget.uniform(2, 2, 0), "k=0"),
    (lambda: budget.pilot_signal([[]], 3), "empty"),
])
def test_bad_input_raises_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
