"""Attention Matching's fit (issue 17): the faster code gives the earlier code's results, and runs no SVD.

``_reference_nnls_bias`` and ``_reference_omp_index`` are the earlier implementation (β's step size from
``torch.linalg.matrix_norm(ord=2)``, an SVD; OMP's Gram recomputed for the β fit), kept here only as the
reference the module's code must reproduce."""
import math

import pytest
import torch

from conftest import tiny_llama
from zipkv.distill import attention_matching
from zipkv.distill.generalise import HeadTargets, _spd_solve

pytestmark = pytest.mark.usefixtures("one_thread")


def _reference_nnls_bias(t, index, iters, bound, system=None):
    s_old = t.s_old.double()
    mu = s_old.amax(dim=-1, keepdim=True)
    e_old = torch.exp(s_old - mu)
    target = e_old.sum(dim=-1, keepdim=True)
    M = e_old.gather(2, index[:, None, :].expand(-1, e_old.shape[1], -1))
    gram = torch.bmm(M.transpose(1, 2), M)
    rhs = torch.bmm(M.transpose(1, 2), target)
    eye = torch.eye(index.shape[1], dtype=gram.dtype)
    tiny = 1e-10 * gram.diagonal(dim1=-2, dim2=-1).mean(-1)[:, None, None]
    lo, hi = math.exp(-bound), math.exp(bound)
    w = _spd_solve(gram + tiny * eye, rhs).clamp(lo, hi)
    step = 1.0 / torch.linalg.matrix_norm(gram, ord=2)[:, None, None]
    for _ in range(iters):
        w = (w - step * (torch.bmm(gram, w) - rhs)).clamp(lo, hi)
    return torch.log(w[..., 0]).to(t.q.dtype)


def _reference_omp_index(t, k, rounds):
    s_old = t.s_old.double()
    e_old = torch.exp(s_old - s_old.amax(dim=-1, keepdim=True))
    gram = torch.bmm(e_old.transpose(1, 2), e_old)
    b = torch.bmm(e_old.transpose(1, 2), e_old.sum(dim=-1, keepdim=True))[..., 0]
    P, n_old = b.shape
    norms = gram.diagonal(dim1=-2, dim2=-1).sqrt().clamp_min(1e-300)
    rows = torch.arange(P)[:, None]
    index = b.new_zeros(P, 0, dtype=torch.long)
    chosen = torch.zeros(P, n_old, dtype=torch.bool)
    corr = b
    per_round = max(1, math.ceil(k / max(rounds, 1)))
    while index.shape[1] < k:
        new = torch.topk((corr / norms).masked_fill(chosen, -math.inf), min(per_round, k - index.shape[1]), dim=1).indices
        index = torch.cat([index, new], dim=1)
        chosen[rows, new] = True
        g_s = gram.gather(2, index[:, None, :].expand(-1, n_old, -1))
        g_ss = g_s.gather(1, index[..., None].expand(-1, -1, index.shape[1]))
        tiny = 1e-10 * g_ss.diagonal(dim1=-2, dim2=-1).mean(-1)[:, None, None]
        w = _spd_solve(g_ss + tiny * torch.eye(index.shape[1], dtype=gram.dtype),
                       b.gather(1, index)[..., None]).clamp_min(0.0)
        corr = b - torch.bmm(g_s, w)[..., 0]
    return index.sort(dim=1).values, None


@pytest.fixture
def reference_fit(monkeypatch):
    """Within the test, attention_matching runs the reference (earlier) β and OMP code."""
    def use():
        monkeypatch.setattr(attention_matching, "nnls_bias", _reference_nnls_bias)
        monkeypatch.setattr(attention_matching, "omp_index", _reference_omp_index)
    return use


def _layer(P=2, N=96, m=16, d=16, n=400, seed=0):
    """Random keys with a few near-duplicate ones (an ill-conditioned mass Gram, as on real caches) and
    queries sharp enough that attention is far from uniform."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(P, N, d, generator=g) * 1.5
    keys[:, 1::7] = keys[:, 0:-1:7][:, :keys[:, 1::7].shape[1]] + 1e-3 * torch.randn(P, len(range(1, N, 7)), d, generator=g)
    values = torch.randn(P, N, d, generator=g)
    train = torch.randn(P, n, d, generator=g) * 2.0
    validation = torch.randn(P, n // 4, d, generator=g) * 2.0
    return keys, values, train, validation, m


def _assert_rel(new, old, rtol):
    err = float((new.double() - old.double()).abs().max() / old.double().abs().max().clamp_min(1e-30))
    assert err <= rtol, f"relative difference {err:.3g} > {rtol}"


def test_largest_eigenvalue_is_the_spectral_norm_of_ill_conditioned_positive_grams():
    keys, values, train, _, m = _layer(P=3)
    t = HeadTargets.of(train, keys, values, m, 0.25)
    gram, _ = attention_matching.mass_system(t, torch.arange(keys.shape[1] - m).expand(3, -1))
    eig = torch.linalg.eigvalsh(gram)
    assert float((eig[:, -1] / eig[:, 0]).min()) > 1e6  # as ill-conditioned as the real ones (1e5-1e11)
    _assert_rel(attention_matching.largest_eigenvalue(gram), torch.linalg.matrix_norm(gram, ord=2), 1e-12)
    # power iteration that cannot converge in the steps given falls back to the exact eigenvalue
    slow = torch.diag_embed(torch.tensor([[1.0, 0.999, 0.5], [2.0, 1.0, 1.0]], dtype=torch.float64))
    _assert_rel(attention_matching.largest_eigenvalue(slow, max_iter=8), torch.tensor([1.0, 2.0], dtype=torch.float64),
                1e-15)


def test_nnls_bias_runs_no_svd_and_gives_the_reference_bias(monkeypatch):
    """The β fit's step size once came from an SVD (torch.linalg.matrix_norm(ord=2)): cuSOLVER's Jacobi SVD on
    these ill-conditioned Grams was most of the fit's GPU time, and the suspect of windows 8 and 10's stall.
    No SVD runs now, and β is the reference's."""
    keys, values, train, _, m = _layer(P=3, seed=1)
    t = HeadTargets.of(train, keys, values, m, 0.25)
    index = torch.sort(torch.randperm(keys.shape[1] - m, generator=torch.Generator().manual_seed(2))[:30]).values
    index = index.expand(3, -1).contiguous()
    expected = _reference_nnls_bias(t, index, 2, 3.0)

    def no_svd(*args, **kwargs):
        raise AssertionError("an SVD ran in the β fit")
    for name in ("svd", "svdvals", "matrix_norm"):
        monkeypatch.setattr(torch.linalg, name, no_svd)
    _assert_rel(attention_matching.nnls_bias(t, index, 2, 3.0), expected, 1e-6)


@pytest.mark.parametrize("keys_method", attention_matching.KEY_METHODS)
@pytest.mark.parametrize("k", [5, 24, 80])
def test_compact_layer_equals_the_reference(keys_method, k, reference_fit):
    """Same keys chosen, same β, keys and values (to round-off) as the earlier code, k up to N − m."""
    keys, values, train, validation, m = _layer(seed=k)
    cfg = attention_matching.AttentionMatchingConfig(keys=keys_method, omp_rounds=4, lbfgs_steps=10)
    new = attention_matching.compact_layer(keys, values, train, validation, m, k, cfg)
    reference_fit()
    old = attention_matching.compact_layer(keys, values, train, validation, m, k, cfg)
    assert torch.equal(new["index"], old["index"])
    for name in ("bias", "keys", "values", "train", "validation"):
        _assert_rel(new[name], old[name], 1e-6)


def test_compare_gives_the_reference_kl_for_every_attention_matching_method(reference_fit):
    """beyond.compare (on-policy cascade, the KL on the continuation) on a small window: the reference's KL."""
    from zipkv.data import Window
    from zipkv.study.experiments import beyond

    model = tiny_llama(sharpen_logits=True)
    N, C, M = 64, 6, 8
    window = Window(torch.randint(0, 128, (N + C,), generator=torch.Generator().manual_seed(3)), N, C, 0, "t", 0)
    methods = list(beyond.AM_VARIANTS) + ["attention_matching"]

    def kl():
        table, _ = beyond.compare(model, [window], [0.3, 0.5], methods, m=M, probe_tokens=4, progress=False)
        return table.set_index(["ratio", "method"])

    new = kl()
    reference_fit()
    old = kl()
    assert (new.choice == old.choice).all()
    for row in old.index:
        assert new.kl[row] == pytest.approx(old.kl[row], rel=1e-6, abs=1e-9), row


@pytest.mark.parametrize("field, value, error, match", [
    ("keys", "best", ValueError, r"AttentionMatchingConfig\(keys='best'\): expected one of \['highest', 'omp', 'lbfgs'\]"),
    ("omp_rounds", 0, ValueError, r"AttentionMatchingConfig\(omp_rounds=0\): expected an int ≥ 1"),     # was accepted
    ("lbfgs_steps", -1, ValueError, r"AttentionMatchingConfig\(lbfgs_steps=-1\): expected an int ≥ 0"),
    ("nnls_iters", 1.5, ValueError, r"AttentionMatchingConfig\(nnls_iters=1.5\): expected an int ≥ 0"),
    ("bias_bound", -1.0, ValueError, r"AttentionMatchingConfig\(bias_bound=-1.0\): expected a number ≥ 0"),
    ("ridge", float("nan"), ValueError, r"AttentionMatchingConfig\(ridge=nan\): expected a finite number ≥ 0"),
    ("dtype", torch.int32, TypeError, r"AttentionMatchingConfig\(dtype=torch.int32\): expected torch.float32"),
    ("device", "nodevice", ValueError, r"AttentionMatchingConfig\(device='nodevice'\): expected a torch device"),
])
def test_attention_matching_config_is_checked_when_made(field, value, error, match):
    """Bad settings were used silently (negative step counts, a negative bias bound) or failed deep in the solve
    (torch's dtype and device errors, a Cholesky error for a negative ridge)."""
    with pytest.raises(error, match=match):
        attention_matching.AttentionMatchingConfig(**{field: value})
