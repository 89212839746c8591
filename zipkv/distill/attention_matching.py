"""Attention Matching (Zweiger, Fu, Guo & Kim 2026, arXiv 2602.16284) as a peer baseline (issue 17).

Attention Matching compacts a block of keys and values into ``k`` keys ``C_1``, one additive logit bias
``β`` per key and ``k`` values ``C_2``, chosen so that for reference queries the compact block reproduces
the block's attention *mass* (its partition function ``Σ_i exp(q·k_i/√d)``) and its attention *output*.
The paper builds the keys three ways; all three are here (:data:`KEY_METHODS`), batched over a layer's heads:

1. ``"highest"`` (HighestAttnKeys): the ``k`` old keys with the highest root-mean-square full-cache
   attention weight over the reference queries, kept as they are.
2. ``"omp"``: orthogonal matching pursuit on the mass match: with ``M_qj = exp(s_qj − μ_q)`` (every old
   key's shifted exponential, ``μ_q`` the query's largest old-zone logit) and ``t_q = Σ_j M_qj``, keys are
   added greedily by the correlation of their column with the residual ``t − M_S w`` (normalised by the
   column's norm, positive only since ``w ≥ 0``), ``⌈k / omp_rounds⌉`` per round (the paper's several-keys-
   per-step speed-up), ``w`` re-solved on the selected set after each round. Everything runs in the
   ``(N − m)``-dimensional space of the Gram matrix ``MᵀM``, so a round costs one ``[P, N − m, |S|]``
   product and one Cholesky of the selected block.
3. ``"lbfgs"``: the highest-attention keys and their β as a start, then L-BFGS (strong-Wolfe line search,
   ``lbfgs_steps`` iterations) on the free keys ``C_1`` and ``β`` against the log-sum-exp match
   ``mean_q (lse(q K_oldᵀ) − lse(q C_1ᵀ + β))²``.

Then for every construction:

* **Bias** (for 1 and 2): non-negative least squares for ``w = e^β``: ``min_{w ≥ 0} ‖M w − t‖²``, started
  from the clamped unconstrained solution and refined by projected gradient steps (step ``1/λ_max(MᵀM)``,
  :func:`largest_eigenvalue`, by power iteration: no SVD), ``w`` kept in ``[e^{−3}, e^{3}]`` (the paper's
  bounds). OMP's keys reuse its Gram, restricted to the chosen keys.
* **Values**: least squares (a vanishing ridge, ``ridge``, for conditioning) of the whole cache's
  attention output with the retain zone fixed — the block's own output, since mass and output together
  determine its contribution to any later softmax.

Here the block is KVSculpt's compress zone (the oldest ``N − m`` pairs); the retain zone is kept, as for
every method in the KVSculpt chapters. Reference queries are zipkv's distiller's
(:func:`zipkv.distill.generalise.future_queries`, training split) and, given the model's sampled
continuation (``probe=``), its queries on-policy: layer ``ℓ`` is fitted inside one forward pass of the probe
tokens with layers ``< ℓ`` already compacted (:func:`zipkv.distill.generalise.compress_cascade`, the paper's
on-policy queries) — the same queries zipkv's distiller trains on, so a difference in KL is the fit's.
:func:`select_by_validation` picks one construction per cache by the objective on the validation queries,
which no construction trained on. The budget is uniform (the paper's non-uniform head budgets come from an
offline search this chapter does not run).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from .keywords import suggest_keywords
from .bias import BiasedCache
from .generalise import HeadTargets, _spd_solve, check_config, layer_targets, objective

KEY_METHODS = ("highest", "omp", "lbfgs")
"""Attention Matching's key constructions (module docstring)."""


@dataclass
class AttentionMatchingConfig:
    """Attention Matching settings (the paper's HighestAttnKeys with NNLS β and least-squares values).

    Attributes:
        keys: one of :data:`KEY_METHODS`.
        horizon, validation_every: the reference queries (as :class:`~zipkv.distill.generalise.ZipkvConfig`;
            the validation split is not used for fitting, only reported and used by :func:`select_by_validation`).
        omp_rounds: OMP rounds (``⌈k / omp_rounds⌉`` keys added per round).
        lbfgs_steps: L-BFGS iterations of the ``"lbfgs"`` key refinement.
        nnls_iters: projected-gradient steps of the β fit.
        bias_bound: ``|β| ≤ bias_bound``.
        ridge: relative ridge of the value least squares (``ridge·tr(AᵀA)/k``).
        dtype, device: where and in what to solve.
    """

    keys: str = "highest"
    horizon: int = 256
    validation_every: int = 8
    omp_rounds: int = 32
    lbfgs_steps: int = 30
    nnls_iters: int = 2
    bias_bound: float = 3.0
    ridge: float = 1e-6
    dtype: torch.dtype = torch.float32
    device: str | torch.device | None = None

    def __post_init__(self):
        if self.keys not in KEY_METHODS:
            raise ValueError(f"AttentionMatchingConfig(keys={self.keys!r}): expected one of {list(KEY_METHODS)}")
        check_config(self, ints=(("horizon", 1), ("validation_every", 2), ("omp_rounds", 1), ("lbfgs_steps", 0),
                                 ("nnls_iters", 0)), reals=(("bias_bound", False), ("ridge", True)))


def largest_eigenvalue(gram: torch.Tensor, rtol: float = 1e-10, check_every: int = 8,
                       max_iter: int = 512) -> torch.Tensor:
    """``λ_max`` ``[P]`` of a batch of symmetric positive semi-definite ``gram`` ``[P, k, k]`` (its spectral norm).

    Power iteration from ``G·1``, stopped when every head's residual ``‖Gv − ρv‖ ≤ rtol·ρ`` (then ``ρ`` is
    within ``‖r‖²/gap`` of ``λ_max``: round-off for the Grams here); a head that has not converged by
    ``max_iter``, or whose ``ρ`` is below its largest diagonal entry (``λ_max ≥ max_i G_ii``), gets
    ``torch.linalg.eigvalsh``. The mass-match Grams are entrywise positive, so ``λ_max`` is simple and its
    eigenvector positive (Perron); at N = 2048 on PG19 ``λ₂/λ₁ ≤ 0.33``: 16–24 products, ``ρ`` within 2e-15
    of ``eigvalsh``'s. It replaces ``torch.linalg.matrix_norm(ord=2)``, a full SVD of a Gram whose condition
    reaches ~1e11 (on CUDA cuSOLVER's Jacobi ``gesvdj``, up to 100 sweeps, then a QR fallback where it does
    not converge; on a loaded 2-core CPU 26–40 s of a layer's 30–40 s fit)."""
    v = gram.sum(dim=2, keepdim=True)
    v = v / v.norm(dim=1, keepdim=True)
    diag_max = gram.diagonal(dim1=-2, dim2=-1).amax(dim=-1)
    for _ in range(0, max_iter, check_every):
        for _ in range(check_every - 1):
            v = torch.bmm(gram, v)
            v = v / v.norm(dim=1, keepdim=True)
        gv = torch.bmm(gram, v)
        rho = (v * gv).sum(dim=(1, 2))
        ok = ((gv - rho[:, None, None] * v).norm(dim=(1, 2)) <= rtol * rho) & (rho >= (1 - 1e-9) * diag_max)
        if bool(ok.all()):
            return rho
        v = gv / gv.norm(dim=1, keepdim=True)
    return torch.where(ok, rho, torch.linalg.eigvalsh(gram)[:, -1])


def mass_system(t: HeadTargets, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The normal equations of the mass match on the kept keys ``index`` ``[P, k]``: ``(MᵀM, Mᵀt)``,
    ``[P, k, k]`` and ``[P, k, 1]`` float64, ``M_qj = exp(s_qj − μ_q)`` (module docstring, step 2)."""
    s_old = t.s_old
    mu = s_old.amax(dim=-1, keepdim=True).double()
    target = s_old.to(torch.float64, copy=True).sub_(mu).exp_().sum(dim=-1, keepdim=True)  # [P, n, 1]; one buffer
    # exp after the gather: the kept columns only, the same numbers as gathering exp of every column
    M = torch.exp(s_old.gather(2, index[:, None, :].expand(-1, s_old.shape[1], -1)).double() - mu)  # [P, n, k]
    Mt = M.transpose(1, 2)
    return torch.bmm(Mt, M), torch.bmm(Mt, target)


def nnls_bias(t: HeadTargets, index: torch.Tensor, iters: int, bound: float, system=None) -> torch.Tensor:
    """``β`` ``[P, k]`` from the bounded NNLS mass match of step 2 (module docstring); ``system``: its
    :func:`mass_system` when already at hand (OMP's Gram restricted to ``index``)."""
    gram, rhs = mass_system(t, index) if system is None else system
    k = index.shape[1]
    eye = torch.eye(k, dtype=gram.dtype, device=gram.device)
    tiny = 1e-10 * gram.diagonal(dim1=-2, dim2=-1).mean(-1)[:, None, None]
    lo, hi = math.exp(-bound), math.exp(bound)
    w = _spd_solve(gram + tiny * eye, rhs).clamp(lo, hi)
    if iters > 0:
        step = 1.0 / largest_eigenvalue(gram)[:, None, None]  # 1/L for the quadratic's gradient
    for _ in range(iters):
        w = (w - step * (torch.bmm(gram, w) - rhs)).clamp(lo, hi)
    return torch.log(w[..., 0]).to(t.q.dtype)


def omp_index(t: HeadTargets, k: int, rounds: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """``[P, k]`` old positions chosen by OMP on the mass match (module docstring, construction 2), sorted, and
    their :func:`mass_system` (``G``, ``b`` restricted to them, for :func:`nnls_bias`).

    The residual's correlation with every column is ``Mᵀt − MᵀM_S w = b − G[:, S] w`` (``G = MᵀM``,
    ``b = Mᵀt``), so ``M`` ``[P, n, N − m]`` is read once to form ``G`` and ``b``."""
    s_old = t.s_old.to(torch.float64, copy=True)
    e_old = s_old.sub_(s_old.amax(dim=-1, keepdim=True)).exp_()  # M, [P, n, N − m], in place of the copy
    gram = torch.bmm(e_old.transpose(1, 2), e_old)  # [P, N − m, N − m]
    b = torch.bmm(e_old.transpose(1, 2), e_old.sum(dim=-1, keepdim=True))[..., 0]  # [P, N − m]
    del e_old
    P, n_old = b.shape
    norms = gram.diagonal(dim1=-2, dim2=-1).sqrt().clamp_min(1e-300)
    rows = torch.arange(P, device=b.device)[:, None]
    index = b.new_zeros(P, 0, dtype=torch.long)
    chosen = torch.zeros(P, n_old, dtype=torch.bool, device=b.device)
    corr = b
    per_round = max(1, math.ceil(k / max(rounds, 1)))
    while index.shape[1] < k:
        step = min(per_round, k - index.shape[1])
        score = (corr / norms).masked_fill(chosen, -math.inf)
        new = torch.topk(score, step, dim=1).indices
        index = torch.cat([index, new], dim=1)
        chosen[rows, new] = True
        g_s = gram.gather(2, index[:, None, :].expand(-1, n_old, -1))  # [P, N − m, |S|]
        g_ss = g_s.gather(1, index[..., None].expand(-1, -1, index.shape[1]))
        eye = torch.eye(index.shape[1], dtype=gram.dtype, device=gram.device)
        tiny = 1e-10 * g_ss.diagonal(dim1=-2, dim2=-1).mean(-1)[:, None, None]
        w = _spd_solve(g_ss + tiny * eye, b.gather(1, index)[..., None]).clamp_min(0.0)
        corr = b - torch.bmm(g_s, w)[..., 0]
    index = index.sort(dim=1).values
    system = (gram.gather(1, index[..., None].expand(-1, -1, n_old)).gather(2, index[:, None, :].expand(-1, k, -1)),
              b.gather(1, index)[..., None])
    return index, system


def lbfgs_keys(t: HeadTargets, keys_c: torch.Tensor, bias_c: torch.Tensor, steps: int):
    """``(keys, bias)`` ``[P, k, d]``, ``[P, k]`` refined by L-BFGS on the log-sum-exp match of the old zone
    (module docstring, construction 3); the heads' losses are summed, their parameters independent."""
    target = torch.logsumexp(t.s_old, dim=-1).detach()  # [P, n]
    keys = keys_c.detach().clone().requires_grad_(True)
    beta = bias_c.detach().clone().requires_grad_(True)
    optimizer = torch.optim.LBFGS([keys, beta], lr=1, max_iter=steps, history_size=10,
                                  line_search_fn="strong_wolfe")
    q = t.q.detach()

    def closure():
        optimizer.zero_grad()
        lse = torch.logsumexp(torch.baddbmm(beta[:, None, :], q, keys.transpose(1, 2)), dim=-1)
        loss = (lse - target).square().mean(dim=1).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    return keys.detach(), beta.detach()


def least_squares_values(t: HeadTargets, keys_c, bias_c, v_ret, ridge: float) -> torch.Tensor:
    """``[P, k, d]`` values minimising the whole cache's output error (float64, relative ridge ``ridge``)."""
    s = torch.cat([torch.baddbmm(bias_c[:, None, :], t.q, keys_c.transpose(1, 2)), t.s_ret], dim=-1).double()
    a = torch.softmax(s, dim=-1)
    k = keys_c.shape[1]
    a_c = a[..., :k]
    residual = t.y.double() - torch.bmm(a[..., k:], v_ret.double())
    gram = torch.bmm(a_c.transpose(1, 2), a_c)
    lam = (ridge * gram.diagonal(dim1=-2, dim2=-1).sum(-1) / k)[:, None, None]
    eye = torch.eye(k, dtype=gram.dtype, device=gram.device)
    return _spd_solve(gram + lam * eye, torch.bmm(a_c.transpose(1, 2), residual)).to(keys_c.dtype)


def compact_layer(keys: torch.Tensor, values: torch.Tensor, train: torch.Tensor, validation: torch.Tensor, m: int,
                  k: int, config: AttentionMatchingConfig | None = None, scale: float | None = None) -> dict:
    """Attention Matching on the ``P`` KV heads of one layer: ``keys``, ``values`` ``[P, N, d]`` → dict with
    ``keys``, ``values`` ``[P, k, d]``, ``bias`` ``[P, k]``, ``index`` and ``train``/``validation`` objectives."""
    cfg = config or AttentionMatchingConfig()
    if cfg.keys not in KEY_METHODS:
        raise ValueError(f"keys={cfg.keys!r}: expected one of {list(KEY_METHODS)}")
    keys, values, t, a_old, scale = layer_targets(keys, values, train, m, k, scale, cfg.dtype, cfg.device)
    P, N, d = keys.shape
    dev = keys.device
    v_ret = values[:, N - m:]
    system = None
    if cfg.keys == "omp":
        del a_old
        index, system = omp_index(t, k, cfg.omp_rounds)
    else:
        importance = a_old.square().mean(dim=1).sqrt()  # rms attention per old key
        del a_old
        index = torch.topk(importance, k, dim=1).indices.sort(dim=1).values
    keys_c = keys.gather(1, index[..., None].expand(-1, -1, d))
    bias_c = nnls_bias(t, index, cfg.nnls_iters, cfg.bias_bound, system)
    if cfg.keys == "lbfgs" and cfg.lbfgs_steps > 0:
        keys_c, bias_c = lbfgs_keys(t, keys_c, bias_c, cfg.lbfgs_steps)
    values_c = least_squares_values(t, keys_c, bias_c, v_ret, cfg.ridge)
    v = HeadTargets.of(validation.to(dev, cfg.dtype), keys, values, m, scale)
    return dict(keys=keys_c, values=values_c, bias=bias_c, index=index,
                train=sum(objective(t, keys_c, values_c, bias_c, v_ret)),
                validation=sum(objective(v, keys_c, values_c, bias_c, v_ret)))


@suggest_keywords
def compress(capture, ratio: float, *, m: int = 256, config: AttentionMatchingConfig | None = None, model=None,
             probe=None) -> BiasedCache:
    """Compact a captured context's old zone at ``r = (k + m)/N`` with Attention Matching (module docstring).

    Args:
        capture: a :class:`zipkv.models.Capture` of the ``N``-token context.
        ratio, m: as :func:`zipkv.distill.generalise.compress` (uniform ``k = round(r·N) − m``).
        config: :class:`AttentionMatchingConfig` (``keys`` picks the construction).
        model, probe: the model and its sampled continuation
            (:func:`~zipkv.distill.generalise.sample_probe`): with both, the fit is on-policy (module docstring).

    Returns a :class:`~zipkv.distill.bias.BiasedCache` (``k + m`` pairs per head, β on the first ``k``) whose
    ``info`` holds ``[L, H]`` ``train`` and ``validation`` objectives; ``method`` is ``"am_" + keys``.
    """
    from .generalise import _assemble, _compressed_inputs, compress_cascade
    from .kvsculpt import budget_for_ratio, check_capture

    check_capture(capture)
    if config is not None and not isinstance(config, AttentionMatchingConfig):
        raise TypeError(f"config must be a zipkv.distill.attention_matching.AttentionMatchingConfig or None, got "
                        f"{type(config).__name__}")
    cfg = config or AttentionMatchingConfig()
    if cfg.keys not in KEY_METHODS:
        raise ValueError(f"keys={cfg.keys!r}: expected one of {list(KEY_METHODS)}")
    if (model is None) != (probe is None):
        raise ValueError("model= and probe= go together (on-policy queries): got only one of them")
    method = f"am_{cfg.keys}"
    started = time.perf_counter()
    L = len(capture.layers)
    H, N, d = capture.layers[0].keys.shape
    k = budget_for_ratio(ratio, N, m)

    def fit(keys, values, train, validation, m_, ks):
        return compact_layer(keys, values, train, validation, m_, int(ks[0]), cfg)

    if probe is not None:
        return compress_cascade(model, capture, ratio, probe, m=m, config=cfg, fit=fit, method=method)
    inputs = _compressed_inputs(capture, m, cfg)
    ks = torch.zeros(L, H, dtype=torch.long)
    ks[[layer for layer, inp in enumerate(inputs) if inp is not None]] = k
    solved = [None if inp is None else fit(inp[0].keys, inp[0].values, inp[1], inp[2], m, ks[layer])
              for layer, inp in enumerate(inputs)]
    cache = _assemble(capture, inputs, solved, ks, m, ratio, time.perf_counter() - started)
    cache.method = method
    return cache


def select_by_validation(caches: dict) -> str:
    """The name in ``caches`` (name → :class:`BiasedCache` from :func:`compress`) whose mean validation objective
    (``info["validation"]``, queries no construction trained on) is lowest: Attention Matching's pick per cache."""
    if not caches:
        raise ValueError("caches is empty: expected at least one Attention Matching cache")
    return min(caches, key=lambda name: float(caches[name].info["validation"].mean()))
