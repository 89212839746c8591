"""Batched KVSculpt solver: every (layer, KV head) problem of a context solved together (issue #5).

:func:`solve` has the reference's signature (:data:`zipkv.distill.problem.Solver`) and runs the
reference's algorithm (:func:`zipkv.distill.kvsculpt.solve_one`, paper §3.4) on a batch of ``P``
problems at once, with nothing shared between problems:

* **Initialisation** — the reference's start, Select+Fit (top-``k`` old positions by accumulated
  attention, ridge values), computed for all problems of a shape at once with
  :class:`~zipkv.distill.problem.PreparedBatch` (what the batched Select+Fit baseline runs), so the
  starting loss is Select+Fit's (to the rounding of batched matmuls).
* **K-step** — ``torch.optim.LBFGS`` re-implemented over a batch: per problem its own history, its
  own step count, its own ``func_evals`` budget (``max_eval = 5·max_iter//4`` per outer step) and
  its own stopping tests (``tolerance_grad``, ``tolerance_change``, curvature test ``sᵀy > 1e-10``),
  all with ``LBFGS``'s defaults. The two-loop recursion is replaced by the compact representation
  of the same inverse-Hessian approximation (Byrd, Nocedal & Schnabel 1994; Nocedal & Wright
  eq. 7.24): ``H g = γg + S p − γY u`` with ``u = R⁻¹Sᵀg``, ``p = R⁻ᵀ((D + γYᵀY)u − γYᵀg)``, ``R``
  the upper triangle of ``SᵀY`` and ``D`` its diagonal. It is equal to the two-loop recursion in
  exact arithmetic, but costs a fixed dozen batched kernels instead of four per stored pair.
* **Line search** — ``LBFGS``'s strong-Wolfe search (cubic interpolation, bracketing then zoom,
  ``c1 = 1e-4``, ``c2 = 0.9``) as a per-problem state machine: each round evaluates the objective
  for the problems that still need a trial step (only those: a gathered sub-batch), and every
  problem accepts its own step. No line search over a summed loss.
* **Objective and gradient** — the §3.2 loss (attention-output MSE + LSE MSE over the training
  queries) with an analytic gradient (the attention backward, four batched matmuls). The fixed
  retain zone enters only through its per-query log-sum-exp ``ℓ_r`` and normalised output ``y_r``:
  ``ŷ = Σ_j P_j v_j + β·y_r`` with ``P_j = exp(s_j − ℓ̂)``, ``β = exp(ℓ_r − ℓ̂)``,
  ``ℓ̂ = log(Σ_j e^{s_j} + e^{ℓ_r})``, which is the reference's softmax over ``[K_c; K_ret]``
  rewritten, without its ``m`` retain columns.
* **V-step** — every ``value_every`` steps, ridge regression (λ) for all problems at once in float64
  (one batched Cholesky solve, :func:`~zipkv.distill.problem.ridge_solve`); the L-BFGS history is
  kept across it, or restarted with ``reset_history``, as in the reference.
* **Best iterate** — the lowest-loss iterate over the outer steps is returned, and never one whose
  loss is above Select+Fit's.

**Ragged k.** Problems are bucketed by ``k`` so that no problem is padded by a whole tile
(``tile`` keys, default 64) or more: sorted by ``k``, a bucket takes every problem within ``tile − 1``
of its largest ``k``. Padded keys get ``−inf`` logits (zero attention), zero values and zero gradient,
so their L-BFGS directions are zero and they never move; in the V-step their Gram rows are the
identity with zero right-hand side, so their values stay zero and do not couple to the real ones.
Uniform budgets make one bucket. Problems also group by query count and head dim.

**Freezing.** With ``reset_history`` (not the default) a problem whose keys did not change
at all over a whole V-step block restarts the next block from exactly the state it started the
last one (same keys, same ridge values, fresh L-BFGS): the reference would repeat that block
forever, so the problem is frozen (its keys and values never change again, its history repeats its
loss) and dropped from the batch right there (the batch shrinks). That happens when its gradient is below
``tolerance_grad`` or its line searches make no progress. ``freeze_rtol`` (off by default, not the
reference's behaviour) also freezes problems whose best loss improved by less than that fraction
over a block. A problem whose loss becomes non-finite stops there, as in the reference.

Per outer step, the reference evaluates the objective once more at the point its line search just
evaluated (``LBFGS.step``'s opening closure call) and once for the step's history; the batched
solver reuses those values (bitwise the same point and values) and only re-evaluates after a V-step,
but counts the opening call against ``max_eval`` as the reference does.

**Device.** Plain batched torch on any device (no Python loop over problems inside an iteration).
The host waits on the device once per inner iteration in the common case (how many problems search,
how many first trials failed the strong Wolfe conditions) and once more per extra line-search round.
On CUDA every fixed-shape part of an iteration (history and direction with the first trial; each
line-search round's state update; accepting the steps) is replayed as a CUDA graph (:class:`_Graphs`):
eager, the solver is bound by the CPU's kernel launches (about 440 per inner iteration).
Agreement with the reference is to rounding only: both follow the same decisions, but the
trajectories are chaotic (float64 histories agree to ~1e-9 over a few steps, float32 ones drift
apart within tens of steps), so compare the two solvers by distributions over problems.

:func:`zipkv.bench.distill.bench_distill` times the reference and this solver on the same problems in
one run (re-exported here, as are its Qwen-shaped problem builders and ``speed_sweep``).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

import torch
from tqdm import tqdm

from .problem import (Prepared, PreparedBatch, Problem, SculptConfig, Solution, Solver, chunk_for, objective,
                      objective_grad, problem_groups, ridge_solve)

TILE = 64
"""Default bucket width: no problem is padded by ``TILE`` keys or more."""

TOLERANCE_GRAD = 1e-7
TOLERANCE_CHANGE = 1e-9
CURVATURE_MIN = 1e-10
WOLFE_C1, WOLFE_C2 = 1e-4, 0.9
"""``torch.optim.LBFGS``'s defaults and its strong-Wolfe constants (what the reference runs with)."""

_BRACKET, _ZOOM, _DONE = 0, 1, 2


# --- the objective over a batch ---------------------------------------------------------------------------

class _Batch:
    """Fixed tensors of ``P`` problems with equal query count ``n_q`` and head dim ``d``, keys padded to ``k_max``.

    Attributes:
        q: ``[P, n_q, d]`` scaled queries; y: ``[P, n_q, d]`` full-cache outputs; lse: ``[P, n_q]``.
        lse_r, y_r: ``[P, n_q]``, ``[P, n_q, d]`` the retain zone's log-sum-exp and normalised output
            (``*_64``: the same in float64, for the V-step).
        bias: ``[P, 1, k_max]`` 0 on real keys, −inf on padding; mask: ``[P, k_max]`` True on real keys.
    """

    def __init__(self, preps: Sequence[Prepared], ks: Sequence[int]):
        P, kmax = len(preps), max(ks)
        self.kmax, self.d = kmax, preps[0].q.shape[1]
        self.q = torch.stack([p.q for p in preps])
        self.y = torch.stack([p.y for p in preps])
        self.lse = torch.stack([p.lse for p in preps])
        if len({tuple(p.s_ret.shape) for p in preps}) == 1:  # one retain-zone size: batched
            s_ret64 = torch.stack([p.s_ret for p in preps]).double()
            self.lse_r64 = torch.logsumexp(s_ret64, dim=-1)
            self.y_r64 = torch.bmm(torch.softmax(s_ret64, dim=-1), torch.stack([p.v_ret for p in preps]).double())
            del s_ret64
        else:
            s_ret64 = [p.s_ret.double() for p in preps]
            self.lse_r64 = torch.stack([torch.logsumexp(s, dim=-1) for s in s_ret64])
            self.y_r64 = torch.stack([torch.softmax(s, dim=-1) @ p.v_ret.double() for s, p in zip(s_ret64, preps)])
        dtype, device = self.q.dtype, self.q.device
        self.lse_r = self.lse_r64.to(dtype)
        self.y_r = self.y_r64.to(dtype)
        ks_t = torch.as_tensor(list(ks), device=device)
        self.mask = torch.arange(kmax, device=device)[None] < ks_t[:, None]
        self.bias = torch.zeros(P, 1, kmax, dtype=dtype, device=device).masked_fill(~self.mask[:, None], -math.inf)

    def take(self, idx: torch.Tensor) -> "_Batch":
        sub = object.__new__(_Batch)
        sub.kmax, sub.d = self.kmax, self.d
        for name in ("q", "y", "lse", "lse_r64", "y_r64", "lse_r", "y_r", "mask", "bias"):
            setattr(sub, name, getattr(self, name)[idx])
        return sub

    def loss_grad(self, keys: torch.Tensor, values: torch.Tensor, grad: bool = True):
        """Per-problem §3.2 loss ``[P]`` and, with ``grad``, its gradient in the keys ``[P, k_max, d]``.

        With ``P_j`` the compressed keys' weights in the joint softmax, ``G = ∂L/∂ŷ`` and
        ``g_ℓ = ∂L/∂ℓ̂``: ``∂L/∂s_j = P_j (G·v_j − G·ŷ + g_ℓ)`` and ``∂L/∂k = (∂L/∂s)ᵀ q``.
        """
        s = torch.baddbmm(self.bias, self.q, keys.transpose(1, 2))  # [P, n_q, k_max], −inf on padding
        mx = torch.maximum(s.amax(dim=-1), self.lse_r)  # stabiliser ≥ every logit, retain zone included
        p = s.sub_(mx[..., None]).exp_()
        er = torch.exp(self.lse_r - mx)
        z = p.sum(dim=-1) + er
        lse_hat = mx + torch.log(z)
        p = p.div_(z[..., None])
        beta = er / z
        y_hat = torch.baddbmm(beta[..., None] * self.y_r, p, values)
        out, lse = objective(y_hat, lse_hat, self.y, self.lse)
        loss = out + lse
        if not grad:
            return loss
        g_out, g_lse = objective_grad(y_hat, lse_hat, self.y, self.lse)
        row = g_lse - (g_out * y_hat).sum(dim=-1)  # g_ℓ − G·ŷ, [P, n_q]
        ds = torch.baddbmm(row[..., None], g_out, values.transpose(1, 2)).mul_(p)
        return loss, torch.bmm(ds.transpose(1, 2), self.q)

    def ridge(self, keys: torch.Tensor, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
        """V-step (§3.4) for all problems: ``[P, k_max, d]`` values, zero on padding, solved in float64, and
        ``[P]`` True where the system was finite (elsewhere the values are zero: the caller keeps its own)."""
        s = torch.baddbmm(self.bias, self.q, keys.transpose(1, 2)).double()
        lse_hat = torch.logaddexp(torch.logsumexp(s, dim=-1), self.lse_r64)
        a = torch.exp(s - lse_hat[..., None])  # [P, n_q, k_max] compressed weights, 0 on padding
        residual = self.y.double() - torch.exp(self.lse_r64 - lse_hat)[..., None] * self.y_r64
        v, ok = ridge_solve(a, residual, lam, self.mask)
        return v.to(keys.dtype), ok


# --- strong-Wolfe line search, one per problem ------------------------------------------------------------

def _cubic(x1, f1, g1, x2, f2, g2, lo, hi):
    """``torch.optim.lbfgs._cubic_interpolate`` elementwise: minimiser of the cubic through two points, in [lo, hi]."""
    d1 = g1 + g2 - 3 * (f1 - f2) / (x1 - x2)
    d2_square = d1 * d1 - g1 * g2
    d2 = d2_square.clamp_min(0).sqrt()
    left = torch.where(x1 <= x2, x2 - (x2 - x1) * ((g2 + d2 - d1) / (g2 - g1 + 2 * d2)),
                       x1 - (x1 - x2) * ((g1 + d2 - d1) / (g1 - g2 + 2 * d2)))
    return torch.where(d2_square >= 0, torch.minimum(torch.maximum(left, lo), hi), (lo + hi) / 2)


def _pick(pair: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``pair[p, pos[p]]`` for ``pair`` ``[P, 2, ...]``."""
    index = pos.view(-1, 1, *([1] * (pair.ndim - 2))).expand(-1, 1, *pair.shape[2:])
    return pair.gather(1, index).squeeze(1)


def _put(pair: torch.Tensor, pos: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``pair`` with ``pair[p, pos[p]] = value[p]`` where ``mask[p]``."""
    slot = (torch.arange(2, device=pair.device)[None] == pos[:, None]) & mask[:, None]  # [P, 2]
    slot = slot.view(*slot.shape, *([1] * (pair.ndim - 2)))
    return torch.where(slot, value[:, None], pair)


def _evaluate(fg, x, t, d, need, f, g):
    """The objective at ``x + t·d`` for the problems in ``need`` (a gathered sub-batch: one host sync);
    ``(f, g)`` elsewhere. Returns None when no problem needs it."""
    idx = need.nonzero().squeeze(1)
    if idx.numel() == 0:
        return None
    if idx.numel() == x.shape[0]:
        return fg(x + t[:, None] * d, None)
    fs, gs = fg(x[idx] + t[idx, None] * d[idx], idx)
    return f.index_copy(0, idx, fs), g.index_copy(0, idx, gs)


def _wolfe_tests(f, t, gtd, f_new, gtd_new):
    """Strong-Wolfe tests of trial steps ``t``: ``(armijo_fail, curvature_ok)`` ``[P]``."""
    return f_new > f + WOLFE_C1 * t * gtd, gtd_new.abs() <= -WOLFE_C2 * gtd


class _Graphs:
    """Named fixed-shape parts of an iteration, replayed as CUDA graphs when ``enabled``: a part is captured
    at its second call (the first runs eagerly: it initialises cuBLAS and the allocator, which capture may
    not) and replayed from then on. A part must keep its results in tensors allocated outside it and be
    called with the same tensors every time (a graph replays fixed addresses); :meth:`clear` when they change."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.parts: dict[str, object] = {}

    def run(self, name: str, part):
        if not self.enabled:
            part()
            return
        graph = self.parts.get(name)
        if graph is None:
            part()
            self.parts[name] = "warm"
            return
        if graph == "warm":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                part()
            self.parts[name] = graph
        graph.replay()

    def clear(self):
        self.parts.clear()


class _LineSearch:
    """``torch.optim.lbfgs._strong_wolfe`` for ``P`` problems at once, each with its own search: the
    search's variables as ``[P]`` state tensors (bracketing, then zoom, per problem).

    A search round is the objective at the trial steps of the problems still searching (``need``; a
    gathered sub-batch, eager) followed by :meth:`_update`, the state machine for every problem at once
    (fixed shapes, no host sync: a CUDA graph under ``graphs``); the host reads ``n_need`` once per round.
    """

    def __init__(self, P: int, n: int, dtype, device, graphs: _Graphs):
        kw = dict(dtype=dtype, device=device)
        long = dict(dtype=torch.long, device=device)
        self.graphs = graphs
        self.t, self.f_new, self.gtd_new, self.d_norm = (torch.zeros(P, **kw) for _ in range(4))
        self.t_prev, self.f_prev, self.gtd_prev = (torch.zeros(P, **kw) for _ in range(3))
        self.out_t, self.out_f = torch.zeros(P, **kw), torch.zeros(P, **kw)
        self.g_new, self.g_prev, self.out_g = (torch.zeros(P, n, **kw) for _ in range(3))
        self.b_t, self.b_f, self.b_gtd = (torch.zeros(P, 2, **kw) for _ in range(3))
        self.b_g = torch.zeros(P, 2, n, **kw)
        self.evals, self.ls_iter, self.phase, self.low = (torch.zeros(P, **long) for _ in range(4))
        self.need = torch.zeros(P, dtype=torch.bool, device=device)
        self.insuf = torch.zeros(P, dtype=torch.bool, device=device)
        self.n_need = torch.zeros((), **long)

    def _begin(self, f, g, gtd, d, active, t, f_new, g_new, gtd_new):
        """State after the first trial ``t`` (evaluated for every ``active`` problem)."""
        self.t.copy_(t)
        self.f_new.copy_(f_new)
        self.g_new.copy_(g_new)
        self.gtd_new.copy_(gtd_new)
        self.d_norm.copy_(d.abs().amax(dim=1))
        self.need.copy_(active)
        self.evals.copy_(active.long())
        self.ls_iter.zero_()
        self.phase.copy_(torch.where(active, _BRACKET, _DONE))
        self.low.zero_()
        self.insuf.zero_()
        self.t_prev.zero_()
        self.f_prev.copy_(f)
        self.g_prev.copy_(g)
        self.gtd_prev.copy_(gtd)
        for b in (self.b_t, self.b_f, self.b_gtd, self.b_g):
            b.zero_()
        self.out_t.zero_()
        self.out_f.copy_(f)
        self.out_g.copy_(g)

    def _evaluate(self, fg, x, d):
        """The objective at the trial steps of the problems in ``need`` (one host sync)."""
        trial = _evaluate(fg, x, self.t, d, self.need, self.f_new, self.g_new)
        if trial is not None:
            self.f_new.copy_(trial[0])
            self.g_new.copy_(trial[1])

    def _update(self, f, g, gtd, d, max_ls, evaluated: bool, tolerance_change: float):
        """One round of every search's state machine (the two while loops of ``_strong_wolfe``), after the
        trial steps of ``need`` were evaluated (``evaluated``: by :meth:`_evaluate`; else the first trial)."""
        need, t, f_new, g_new = self.need, self.t, self.f_new, self.g_new
        if evaluated:
            self.gtd_new.copy_(torch.where(need, (g_new * d).sum(dim=1), self.gtd_new))
            self.evals.add_(need.long())
            self.ls_iter.add_(need.long())
        gtd_new, ls_iter, phase, low, insuf = self.gtd_new, self.ls_iter, self.phase, self.low, self.insuf
        b_t, b_f, b_gtd, b_g = self.b_t, self.b_f, self.b_gtd, self.b_g
        t_prev, f_prev, g_prev, gtd_prev = self.t_prev, self.f_prev, self.g_prev, self.gtd_prev
        armijo_fail, curvature_ok = _wolfe_tests(f, t, gtd, f_new, gtd_new)

        # bracketing phase (the first while loop of _strong_wolfe)
        in_b = need & (phase == _BRACKET)
        exhausted = in_b & (ls_iter >= max_ls)  # ran out of evaluations: best of {0, t}
        live = in_b & ~exhausted
        to_zoom_1 = live & (armijo_fail | ((ls_iter > 1) & (f_new >= f_prev)))
        wolfe = live & ~to_zoom_1 & curvature_ok
        to_zoom_2 = live & ~to_zoom_1 & ~wolfe & (gtd_new >= 0)
        extrapolate = live & ~to_zoom_1 & ~wolfe & ~to_zoom_2
        to_zoom = to_zoom_1 | to_zoom_2

        # zoom phase update for problems that evaluated a zoom trial
        in_z = need & (phase == _ZOOM)
        high = 1 - low
        z_fail = in_z & (armijo_fail | (f_new >= _pick(b_f, low)))
        z_ok = in_z & ~z_fail
        z_done = z_ok & curvature_ok
        collapse = z_ok & ~z_done & (gtd_new * (_pick(b_t, high) - _pick(b_t, low)) >= 0)
        b_t = _put(b_t, high, _pick(b_t, low), collapse)
        b_f = _put(b_f, high, _pick(b_f, low), collapse)
        b_gtd = _put(b_gtd, high, _pick(b_gtd, low), collapse)
        b_g = _put(b_g, high, _pick(b_g, low), collapse)
        slot = torch.where(z_fail, high, low)
        b_t = _put(b_t, slot, t, in_z)
        b_f = _put(b_f, slot, f_new, in_z)
        b_gtd = _put(b_gtd, slot, gtd_new, in_z)
        b_g = _put(b_g, slot, g_new, in_z)

        # entering zoom: bracket [t_prev, t]
        enter = to_zoom[:, None]
        b_t = torch.where(enter, torch.stack([t_prev, t], 1), b_t)
        b_f = torch.where(enter, torch.stack([f_prev, f_new], 1), b_f)
        b_gtd = torch.where(enter, torch.stack([gtd_prev, gtd_new], 1), b_gtd)
        b_g = torch.where(enter[..., None], torch.stack([g_prev, g_new], 1), b_g)
        relow = to_zoom | z_fail
        low = torch.where(relow, torch.where(b_f[:, 0] <= b_f[:, 1], 0, 1), low)
        insuf = insuf & ~to_zoom

        # zoom: stop, or the next trial step
        zooming = to_zoom | (in_z & ~z_done)
        lo_t, hi_t = torch.minimum(b_t[:, 0], b_t[:, 1]), torch.maximum(b_t[:, 0], b_t[:, 1])
        z_stop = zooming & ((ls_iter >= max_ls) | ((b_t[:, 1] - b_t[:, 0]).abs() * self.d_norm < tolerance_change))
        z_next = zooming & ~z_stop
        t_z = _cubic(b_t[:, 0], b_f[:, 0], b_gtd[:, 0], b_t[:, 1], b_f[:, 1], b_gtd[:, 1], lo_t, hi_t)
        eps = 0.1 * (hi_t - lo_t)
        close = torch.minimum(hi_t - t_z, t_z - lo_t) < eps
        adjust = close & (insuf | (t_z >= hi_t) | (t_z <= lo_t))
        t_z = torch.where(adjust, torch.where((t_z - hi_t).abs() < (t_z - lo_t).abs(), hi_t - eps, lo_t + eps), t_z)
        insuf = torch.where(z_next, close & ~adjust, insuf)

        # results
        zero = torch.zeros_like(t)
        fallback_low = exhausted & (f <= f_new)
        fallback_high = exhausted & ~fallback_low
        from_bracket = z_stop | z_done
        take_new = wolfe | fallback_high
        out_t = torch.where(take_new, t, torch.where(fallback_low, zero, self.out_t))
        out_f = torch.where(take_new, f_new, torch.where(fallback_low, f, self.out_f))
        out_g = torch.where(take_new[:, None], g_new, torch.where(fallback_low[:, None], g, self.out_g))
        out_t = torch.where(from_bracket, _pick(b_t, low), out_t)
        out_f = torch.where(from_bracket, _pick(b_f, low), out_f)
        out_g = torch.where(from_bracket[:, None], _pick(b_g, low), out_g)

        # extrapolation: the next bracketing trial
        t_x = _cubic(t_prev, f_prev, gtd_prev, t, f_new, gtd_new, t + 0.01 * (t - t_prev), t * 10)
        new_t = torch.where(extrapolate, t_x, torch.where(z_next, t_z, t))
        self.t_prev.copy_(torch.where(extrapolate, t, t_prev))
        self.f_prev.copy_(torch.where(extrapolate, f_new, f_prev))
        self.g_prev.copy_(torch.where(extrapolate[:, None], g_new, g_prev))
        self.gtd_prev.copy_(torch.where(extrapolate, gtd_new, gtd_prev))
        self.t.copy_(new_t)

        finished = exhausted | wolfe | from_bracket
        self.phase.copy_(torch.where(finished, _DONE, torch.where(to_zoom, _ZOOM, phase)))
        for state, value in ((self.b_t, b_t), (self.b_f, b_f), (self.b_gtd, b_gtd), (self.b_g, b_g),
                             (self.low, low), (self.insuf, insuf), (self.out_t, out_t), (self.out_f, out_f),
                             (self.out_g, out_g)):
            state.copy_(value)
        need = extrapolate | z_next
        self.need.copy_(need)
        self.n_need.copy_(need.sum())

    def run(self, fg, x, d, f, g, gtd, active, max_ls, t, f_new, g_new, gtd_new,
            tolerance_change: float = TOLERANCE_CHANGE) -> int:
        """Every ``active`` search from its evaluated first trial to an accepted step; results in ``out_t``,
        ``out_f``, ``out_g`` and ``evals``. ``f, g, gtd, d, max_ls`` must be the same tensors at every call
        under CUDA graphs. Returns the number of evaluation rounds (the first trial included)."""
        self.graphs.run("search_begin", lambda: self._begin(f, g, gtd, d, active, t, f_new, g_new, gtd_new))
        self.graphs.run("search_first", lambda: self._update(f, g, gtd, d, max_ls, False, tolerance_change))
        rounds = 1
        while int(self.n_need):  # the one host sync per round
            self._evaluate(fg, x, d)
            rounds += 1
            self.graphs.run("search_round", lambda: self._update(f, g, gtd, d, max_ls, True, tolerance_change))
        return rounds


# --- L-BFGS over a batch ----------------------------------------------------------------------------------

class _LBFGS:
    """``torch.optim.LBFGS`` state for ``P`` independent problems of ``n`` parameters each.

    History in the compact form: ``H`` ``[P, 2, cap, n]`` holds the ring buffers ``S = H[:, 0]`` and
    ``Y = H[:, 1]`` (a problem's logical pair ``j``, in acceptance order, sits in slot ``(head + j) % cap``;
    ``count`` valid), ``SY[i, j] = s_iᵀy_j`` and ``YY[i, j] = y_iᵀy_j`` ``[P, cap, cap]`` in logical order,
    ``gamma`` the initial scaling ``sᵀy/yᵀy`` of the newest pair (``LBFGS``'s ``H_diag``). A full history drops
    its oldest pair by advancing ``head`` and shifting the small ``SY``/``YY`` matrices: the big buffers are
    never moved. With the paper's 100 pairs the buffers are the dominant memory traffic (about 1 GB each
    for a Qwen-shaped context), so an iteration reads them twice: once for every product with the new
    pair and the gradient (one batched matmul of ``[y; g; s]`` against ``[S | Y]``, before the new pair is
    written; its own products are computed directly), once for ``H g``.

    One inner iteration is three parts: :meth:`_open` (new history pair, direction, first trial step of
    every search and its strong-Wolfe tests), the rest of the line searches (:class:`_LineSearch`, only
    when some first trial failed), and :meth:`_close` (accept the steps, stopping tests). Every part but
    the objective's evaluation on a gathered sub-batch has fixed shapes and no host sync, and keeps its
    results in tensors allocated here, so on CUDA (``graphs``) each is captured once as a CUDA graph and
    replayed (:class:`_Graphs`): an iteration costs a few graph launches and one host sync per search
    round instead of hundreds of kernel launches. With graphs every problem's first trial is evaluated
    (inactive ones at ``t = 0``, discarded); without (the CPU), only the active problems'.
    """

    def __init__(self, P: int, n: int, cfg: SculptConfig, dtype, device, graphs: bool = False):
        self.lr, self.max_iter = cfg.lr, cfg.inner_iterations
        self.max_eval = cfg.inner_iterations * 5 // 4
        per_block = cfg.value_every * cfg.inner_iterations if cfg.reset_history else cfg.history_size
        self.cap = max(1, min(cfg.history_size, per_block))
        self.graphs = _Graphs(graphs and torch.device(device).type == "cuda")
        self.P, self.n, self.dtype, self.device = P, n, dtype, device
        kw = dict(dtype=dtype, device=device)
        long = dict(dtype=torch.long, device=device)
        self.H = torch.zeros(P, 2, self.cap, n, **kw)
        self.SY = torch.zeros(P, self.cap, self.cap, **kw)
        self.YY = torch.zeros(P, self.cap, self.cap, **kw)
        self.count = torch.zeros(P, **long)
        self.head = torch.zeros(P, **long)
        self.gamma = torch.ones(P, **kw)
        self.n_iter = torch.zeros(P, **long)
        self.d = torch.zeros(P, n, **kw)
        self.t = torch.zeros(P, **kw)
        self.prev_g = torch.zeros(P, n, **kw)
        self.prev_loss = torch.zeros(P, **kw)
        # one LBFGS.step: which problems still iterate, evaluations spent and left
        self.active = torch.zeros(P, dtype=torch.bool, device=device)
        self.evals = torch.zeros(P, **long)
        self.max_ls = torch.zeros(P, **long)
        # one inner iteration: the direction's slope; the first trial step, its loss, gradient and slope;
        # flags = [#active, #first trials that failed]
        self.gtd, self.t_new, self.f_new, self.gtd_new = (torch.zeros(P, **kw) for _ in range(4))
        self.g_new = torch.zeros(P, n, **kw)
        self.flags = torch.zeros(2, **long)
        self.search = _LineSearch(P, n, dtype, device, self.graphs)

    def reset(self):
        """A fresh optimizer (the reference re-creates ``LBFGS`` after each V-step)."""
        self.count.zero_()
        self.head.zero_()
        self.gamma.fill_(1.0)
        self.n_iter.zero_()

    def take(self, idx: torch.Tensor):
        """Keep problems ``idx`` only (new tensors: the captured graphs are dropped)."""
        for name, value in list(vars(self).items()):
            if isinstance(value, torch.Tensor) and name != "flags":
                setattr(self, name, value[idx])
        self.P = int(idx.numel())
        self.graphs.clear()
        self.search = _LineSearch(self.P, self.n, self.dtype, self.device, self.graphs)

    def _order(self) -> torch.Tensor:
        """``[P, cap]`` slot of each logical pair."""
        return (self.head[:, None] + torch.arange(self.cap, device=self.head.device)[None]) % self.cap

    def _push(self, s, y, g, accept):
        """Store the pair ``(s, y)`` where ``accept``; returns ``g·S`` and ``g·Y`` ``[P, cap]`` (slot order) of
        the updated history, for :meth:`_direction`."""
        P, cap, n = s.shape[0], self.cap, s.shape[1]
        # products with every stored pair before the new one is written: rows y, g, s against [S | Y]
        prod = torch.bmm(torch.stack([y, g, s], dim=1), self.H.view(P, 2 * cap, n).transpose(1, 2))
        yS, gS, yY, gY, sY = prod[:, 0, :cap], prod[:, 1, :cap], prod[:, 0, cap:], prod[:, 1, cap:], prod[:, 2, cap:]
        ys, yy, gs, gy = (y * s).sum(dim=1), (y * y).sum(dim=1), (g * s).sum(dim=1), (g * y).sum(dim=1)

        full = accept & (self.count >= cap)  # a full history drops its oldest pair
        m = full[:, None, None]
        self.SY.copy_(torch.where(m, self.SY.roll((-1, -1), (1, 2)), self.SY))
        self.YY.copy_(torch.where(m, self.YY.roll((-1, -1), (1, 2)), self.YY))
        self.head.copy_((self.head + full.long()) % cap)
        self.count.sub_(full.long())
        slot = self.count.clamp(max=cap - 1)  # logical position of the new pair
        phys = (self.head + slot) % cap
        flat = torch.arange(P, device=s.device) * (2 * cap) + phys  # its rows of H viewed [P·2·cap, n]
        a = accept[:, None]
        rows = self.H.view(P * 2 * cap, n)
        rows.index_copy_(0, flat, torch.where(a, s, rows.index_select(0, flat)))
        rows.index_copy_(0, flat + cap, torch.where(a, y, rows.index_select(0, flat + cap)))
        new = (torch.arange(cap, device=s.device)[None] == phys[:, None]) & a  # [P, cap] the new pair's slot
        yS = torch.where(new, ys[:, None], yS)  # s_iᵀ y_new
        sY = torch.where(new, ys[:, None], sY)  # s_newᵀ y_j
        yY = torch.where(new, yy[:, None], yY)
        gS = torch.where(new, gs[:, None], gS)
        gY = torch.where(new, gy[:, None], gY)
        order = self._order()
        at = torch.arange(cap, device=s.device)[None] == slot[:, None]  # logical position of the new pair
        col = (at & a)[:, None, :]  # [P, 1, cap]: column `slot`
        row = (at & a)[:, :, None]  # [P, cap, 1]: row `slot`
        s_y, sn_y, y_y = yS.gather(1, order), sY.gather(1, order), yY.gather(1, order)
        self.SY.copy_(torch.where(row, sn_y[:, None, :], torch.where(col, s_y[:, :, None], self.SY)))
        self.YY.copy_(torch.where(row, y_y[:, None, :], torch.where(col, y_y[:, :, None], self.YY)))
        self.gamma.copy_(torch.where(accept, ys / yy, self.gamma))
        self.count.add_(accept.long())
        return gS, gY

    def _direction(self, g, gS, gY):
        """``−H g`` per problem, ``H`` the L-BFGS inverse Hessian of its own history (compact form); ``gS``,
        ``gY`` ``[P, cap]`` the gradient's products with the stored pairs (slot order)."""
        P, cap, n = g.shape[0], self.cap, g.shape[1]
        gamma = self.gamma[:, None]
        order = self._order()
        valid = torch.arange(cap, device=g.device)[None] < self.count[:, None]  # [P, cap], logical order
        both = valid[:, :, None] & valid[:, None, :]
        a = torch.where(valid, gS.gather(1, order), 0.0)[..., None]  # [P, cap, 1]
        b = torch.where(valid, gY.gather(1, order), 0.0)[..., None]
        eye = torch.diag_embed((~valid).to(g.dtype))  # identity on unused slots keeps R invertible
        R = torch.where(both, self.SY.triu(), 0.0) + eye
        D = torch.where(valid, self.SY.diagonal(dim1=1, dim2=2), 0.0)[..., None]
        YY = torch.where(both, self.YY, 0.0)
        u = torch.linalg.solve_triangular(R, a, upper=True)
        w = D * u + gamma[..., None] * (torch.bmm(YY, u) - b)
        p = torch.linalg.solve_triangular(R.transpose(1, 2), w, upper=False)
        # H g = γg + S p − γ Y u: back to slot order, one product with [S | Y]
        coef = torch.zeros(P, 2 * cap, dtype=g.dtype, device=g.device)
        coef.scatter_(1, order, p.squeeze(2))
        coef.scatter_(1, order + cap, -gamma * u.squeeze(2))
        hg = gamma * g + torch.bmm(coef[:, None, :], self.H.view(P, 2 * cap, n)).squeeze(1)
        return -hg

    def _open(self, x, loss, g, fg):
        """First part of an inner iteration of ``LBFGS.step``: history, direction, first trial step."""
        active = self.active
        self.n_iter.add_(active.long())
        y = g - self.prev_g
        s = self.d * self.t[:, None]
        accept = active & (self.n_iter > 1) & ((y * s).sum(dim=1) > CURVATURE_MIN)
        gS, gY = self._push(s, y, g, accept)
        self.d.copy_(torch.where(active[:, None], self._direction(g, gS, gY), self.d))
        self.prev_g.copy_(torch.where(active[:, None], g, self.prev_g))
        self.prev_loss.copy_(torch.where(active, loss, self.prev_loss))
        first_t = (1.0 / g.abs().sum(dim=1)).clamp(max=1.0) * self.lr
        self.t.copy_(torch.where(active, torch.where(self.n_iter == 1, first_t, self.lr), self.t))
        gtd = (g * self.d).sum(dim=1)
        self.gtd.copy_(gtd)
        active = active & ~(gtd > -TOLERANCE_CHANGE)
        self.active.copy_(active)
        t = torch.where(active, self.t, 0.0)
        if self.graphs.enabled:  # fixed shapes: every problem, the inactive ones at t = 0 (discarded below)
            f_new, g_new = fg(x + t[:, None] * self.d, None)
            f_new = torch.where(active, f_new, loss)
            g_new = torch.where(active[:, None], g_new, g)
        else:
            f_new, g_new = _evaluate(fg, x, t, self.d, active, loss, g) or (loss, g)
        gtd_new = torch.where(active, (g_new * self.d).sum(dim=1), gtd)
        armijo_fail, curvature_ok = _wolfe_tests(loss, t, gtd, f_new, gtd_new)
        self.t_new.copy_(t)
        self.f_new.copy_(f_new)
        self.g_new.copy_(g_new)
        self.gtd_new.copy_(gtd_new)
        self.max_ls.copy_(self.max_eval - self.evals)
        self.flags.copy_(torch.stack([active.sum(), (active & (armijo_fail | ~curvature_ok)).sum()]))

    def _close(self, x, loss, g, searched: bool):
        """Last part of an inner iteration: take the accepted steps, then ``LBFGS``'s stopping tests."""
        active = self.active
        if searched:
            t_new, f_new, g_new, spent = self.search.out_t, self.search.out_f, self.search.out_g, self.search.evals
        else:  # every first trial was accepted
            t_new, f_new, g_new, spent = self.t_new, self.f_new, self.g_new, active.long()
        self.t.copy_(torch.where(active, t_new, self.t))
        x.copy_(torch.where(active[:, None], x + self.t[:, None] * self.d, x))
        loss.copy_(torch.where(active, f_new, loss))
        g.copy_(torch.where(active[:, None], g_new, g))
        self.evals.add_(spent)
        stop = ((self.evals >= self.max_eval) | (g.abs().amax(dim=1) <= TOLERANCE_GRAD)
                | ((self.d * self.t[:, None]).abs().amax(dim=1) <= TOLERANCE_CHANGE)
                | ((loss - self.prev_loss).abs() < TOLERANCE_CHANGE))
        self.active.copy_(active & ~stop)

    def step(self, x, loss, g, fg, frozen):
        """One ``LBFGS.step(closure)`` for every problem not ``frozen``; updates ``x`` ``[P, n]``, ``loss`` ``[P]``
        and ``g`` ``[P, n]`` in place (on entry the objective at ``x``: the closure call that opens
        ``LBFGS.step``). With graphs, pass the same tensors every time (the graphs read their addresses)."""
        self.evals.fill_(1)
        self.active.copy_(~frozen & ~(g.abs().amax(dim=1) <= TOLERANCE_GRAD))
        for _ in range(self.max_iter):
            self.graphs.run("open", lambda: self._open(x, loss, g, fg))
            n_active, n_failed = self.flags.tolist()  # host sync
            if n_active == 0:  # nobody searched: every problem has left this step
                break
            if n_failed:
                self.search.run(fg, x, self.d, loss, g, self.gtd, self.active, self.max_ls, self.t_new,
                                self.f_new, self.g_new, self.gtd_new)
            self.graphs.run("close_searched" if n_failed else "close",
                            lambda: self._close(x, loss, g, bool(n_failed)))


# --- the solver -------------------------------------------------------------------------------------------

@dataclass
class BatchStats:
    """What a batched solve did, per problem (input order) and per bucket.

    Attributes:
        bucket: ``[P]`` bucket index; k_padded: ``[P]`` keys the problem was padded to.
        frozen_at: ``[P]`` outer step at which the problem froze (−1: never).
        bucket_seconds: wall time of each bucket.
    """

    bucket: list[int]
    k_padded: list[int]
    frozen_at: list[int]
    bucket_seconds: list[float]


def buckets(ks: Sequence[int], tile: int | None = TILE) -> list[list[int]]:
    """Indices of ``ks`` grouped so that each problem is padded by fewer than ``tile`` keys.

    Sorted by ``k`` descending, a bucket starts at the largest remaining ``k`` and takes every problem
    with ``k > k_max − tile``. ``tile=None``: one bucket.
    """
    order = sorted(range(len(ks)), key=lambda i: -ks[i])
    if tile is None:
        return [order] if order else []
    if tile < 1:
        raise ValueError(f"tile={tile}: expected a positive number of keys or None")
    out: list[list[int]] = []
    for i in order:
        if out and ks[out[-1][0]] - ks[i] < tile:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def _solve_bucket(problems: Sequence[Problem], cfg: SculptConfig, freeze_rtol: float | None, bar=None,
                  cuda_graphs: bool = True, starts: Sequence[torch.Tensor | None] | None = None):
    """The batched solver on problems of equal query count and head dim; returns (solutions, frozen_at).
    ``starts[i]``, when given, replaces problem ``i``'s top-attention start positions (``[k]`` old positions)."""
    started = time.perf_counter()
    P, ks = len(problems), [p.k for p in problems]
    dtype = cfg.dtype
    kmax, d = max(ks), problems[0].head_dim
    # the reference's start, Select+Fit (top-k old positions by accumulated attention, ridge values),
    # computed for all problems of a shape (N, m) at once: baselines.select_fit's batched path
    groups = [(members, PreparedBatch([problems[i] for i in members], dtype, cfg.device))
              for members in problem_groups(problems, chunk_for(problems, cfg.device))]
    device = groups[0][1].device
    preps: list[Prepared | None] = [None] * P
    x0 = torch.zeros(P, kmax, d, dtype=dtype, device=device)
    values = torch.zeros_like(x0)
    init_loss_t = torch.empty(P, dtype=dtype, device=device)
    for members, pb in groups:
        rows = torch.tensor(members, device=device)
        index = pb.top_attention()
        for j, i in enumerate(members):
            if starts is not None and starts[i] is not None:
                index[j, : problems[i].k] = torch.as_tensor(starts[i], device=device)
        keys0 = pb.gather_old(index)
        values0 = pb.ridge(keys0, cfg.ridge)
        init_loss_t[rows] = pb.loss(keys0, values0)
        x0[rows, : pb.kmax], values[rows, : pb.kmax] = keys0, values0
        for j, i in enumerate(members):
            preps[i] = pb.prepared(j)
    init_loss = init_loss_t.tolist()
    values_start = values.clone()
    batch = _Batch(preps, ks)
    n = kmax * d
    x = x0.reshape(P, n).clone()

    work = torch.arange(P, device=device)  # global indices of the working set
    sub = batch

    def fg(points, idx):
        b = sub if idx is None else sub.take(idx)
        v = values if idx is None else values[idx]
        f, g = b.loss_grad(points.view(-1, kmax, d), v)
        return f, g.reshape(-1, n)

    steps = cfg.steps
    history = torch.full((steps + 1, P), math.nan, dtype=torch.float64, device=device)
    frozen_at = torch.full((P,), -1, dtype=torch.long, device=device)
    stopped_at = torch.full((P,), steps, dtype=torch.long, device=device)  # last history entry
    best_loss_all = torch.empty(P, dtype=dtype, device=device)
    best_x_all, best_v_all = x.clone(), values.clone()

    loss, g = fg(x, None)  # updated in place from here on (the CUDA graphs read these tensors)
    history[0] = loss.double()
    best_loss, best_x, best_v = loss.clone(), x.clone(), values.clone()
    best_loss_all.copy_(loss)
    frozen = torch.zeros(P, dtype=torch.bool, device=device)
    anchor, block_best = x.clone(), loss.clone()
    lbfgs = _LBFGS(P, n, cfg, dtype, device, graphs=cuda_graphs) if steps > 0 else None
    for step in range(1, steps + 1):
        if work.numel() == 0:
            break
        lbfgs.step(x, loss, g, fg, frozen)
        boundary = step % cfg.value_every == 0
        if boundary:  # V-step; frozen rows and rows whose loss just became non-finite solve at their best
            # keys (finite, so the batched solve never sees NaN) and keep their values; the latter stop below
            keep = frozen | ~torch.isfinite(loss)
            at = torch.where(keep[:, None], best_x, x).view(-1, kmax, d)
            solved, ok = sub.ridge(at, cfg.ridge)
            values.copy_(torch.where((keep | ~ok)[:, None, None], values, solved))
            if cfg.reset_history:
                lbfgs.reset()
            f, gr = fg(x, None)
            loss.copy_(f)
            g.copy_(gr)
        history[step, work] = loss.double()
        finite = torch.isfinite(loss)
        better = ~frozen & finite & (loss < best_loss)
        best_loss = torch.where(better, loss, best_loss)
        best_x = torch.where(better[:, None], x, best_x)
        best_v = torch.where(better[:, None, None], values, best_v)
        broken = ~frozen & ~finite  # the reference stops a problem at a non-finite loss
        stopped_at[work] = torch.where(broken, step, stopped_at[work])
        newly = broken
        if boundary:
            if cfg.reset_history:
                newly = newly | (~frozen & (x == anchor).all(dim=1))
            if freeze_rtol is not None:
                newly = newly | (~frozen & (block_best - best_loss <= freeze_rtol * block_best.abs()))
            anchor, block_best = x.clone(), best_loss.clone()
        frozen_at[work] = torch.where(newly & ~broken, step, frozen_at[work])
        frozen = frozen | newly
        if bar is not None:
            bar.update(1)
        if boundary or step == steps:
            gone = frozen.nonzero().squeeze(1)
            if gone.numel() or step == steps:  # write back, then drop frozen problems from the batch
                done = gone if step < steps else torch.arange(work.numel(), device=device)
                best_loss_all[work[done]] = best_loss[done]
                best_x_all[work[done]] = best_x[done]
                best_v_all[work[done]] = best_v[done]
            if gone.numel() and step < steps:
                keep = (~frozen).nonzero().squeeze(1)
                work, sub, x, values = work[keep], sub.take(keep), x[keep], values[keep]
                loss, g, frozen = loss[keep], g[keep], frozen[keep]
                best_loss, best_x, best_v = best_loss[keep], best_x[keep], best_v[keep]
                anchor, block_best = anchor[keep], block_best[keep]
                lbfgs.take(keep)
    if steps == 0:
        best_loss_all.copy_(best_loss)
    # a frozen problem repeats its loss for the remaining steps, as the reference would
    frozen_at_h, stopped_at_h = frozen_at.tolist(), stopped_at.tolist()
    hist = history.cpu()
    _sync(device)
    seconds = (time.perf_counter() - started) / P
    histories = []
    for i in range(P):
        if frozen_at_h[i] >= 0:
            hist[frozen_at_h[i] + 1:, i] = hist[frozen_at_h[i], i]
        histories.append(hist[: stopped_at_h[i] + 1, i].tolist())
    solutions: list[Solution | None] = [None] * P
    best_keys = best_x_all.view(P, kmax, d)
    for members, pb in groups:  # one host sync per shape group
        rows = torch.tensor(members, device=device)
        k = pb.kmax
        sols = pb.solutions(best_keys[rows, :k].clone(), best_v_all[rows, :k].clone(),
                            initial_loss=[init_loss[i] for i in members], seconds=seconds,
                            histories=[histories[i] for i in members])
        worse = [j for j, s in enumerate(sols) if not s.loss <= s.initial_loss]
        if worse:  # never above Select+Fit's (rounding of a non-improvement): return the start
            start = pb.solutions(x0[rows, :k], values_start[rows, :k],
                                 initial_loss=[init_loss[i] for i in members], seconds=seconds,
                                 histories=[histories[i] for i in members])
            for j in worse:
                sols[j] = start[j]
        for i, s in zip(members, sols):
            solutions[i] = s
    return solutions, frozen_at_h


def solve_batched(problems: Sequence[Problem], config: SculptConfig | None = None, *, tile: int | None = TILE,
                  freeze_rtol: float | None = None, cuda_graphs: bool = True,
                  starts: Sequence[torch.Tensor | None] | None = None) -> tuple[list[Solution], BatchStats]:
    """The batched KVSculpt solver (module docstring), with per-problem statistics.

    Args:
        problems: independent problems (each with its own ``k``; ``k = 0`` is returned empty).
        config: the reference's settings (steps, lr, inner iterations, V-step period, ridge λ, history,
            dtype, device); ``progress`` shows a bar over outer steps.
        tile: bucket width in keys (no problem is padded by ``tile`` or more); ``None``: one bucket.
        freeze_rtol: also freeze problems whose best loss improves by less than this fraction over
            a V-step block (not the reference's behaviour; ``None``: off).
        cuda_graphs: on CUDA, replay each inner iteration's fixed part as CUDA graphs (:class:`_LBFGS`);
            ``False``: plain eager launches (the same arithmetic).
        starts: per problem ``None`` (the reference's start, top-``k`` by attention) or ``[k]`` distinct old
            positions ``< N − m`` to start from (with ridge values), e.g. random restarts (Table 3's oracle).

    Returns:
        ``(solutions, stats)``, solutions in input order. A solution's ``seconds`` is its bucket's wall
        time divided by the bucket's size (the problems are solved together).
    """
    cfg = config or SculptConfig()
    P = len(problems)
    if starts is not None:
        if len(starts) != P:
            raise ValueError(f"starts has {len(starts)} entries: expected one per problem ({P})")
        for i, start in enumerate(starts):
            if start is None:
                continue
            idx, k, cut = torch.as_tensor(start), problems[i].k, problems[i].n - problems[i].m
            if tuple(idx.shape) != (k,) or (k > 0 and not 0 <= int(idx.min()) <= int(idx.max()) < cut):
                raise ValueError(f"starts[{i}] has shape {tuple(idx.shape)}: expected [{k}] old positions in [0, {cut})")
    solutions: list[Solution | None] = [None] * P
    bucket_of, k_padded, frozen_at, bucket_seconds = [-1] * P, [0] * P, [-1] * P, []
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(problems):
        if p.k == 0:  # nothing to optimise, as in the reference
            prep = Prepared(p, cfg.dtype, cfg.device)
            sol = prep.solution(prep.k_old[:0], prep.v_old[:0])
            sol.history = [sol.loss]
            solutions[i] = sol
            continue
        groups.setdefault((p.queries.shape[0], p.head_dim), []).append(i)
    plan = [[members[j] for j in b] for members in groups.values()
            for b in buckets([problems[i].k for i in members], tile)]
    bar = tqdm(total=len(plan) * cfg.steps, desc="kvsculpt-batched", disable=not cfg.progress, leave=False)
    for b, members in enumerate(plan):
        started = time.perf_counter()
        sols, frozen = _solve_bucket([problems[i] for i in members], cfg, freeze_rtol, bar, cuda_graphs,
                                     None if starts is None else [starts[i] for i in members])
        bucket_seconds.append(time.perf_counter() - started)
        kmax = max(problems[i].k for i in members)
        for i, s, f in zip(members, sols, frozen):
            solutions[i], bucket_of[i], k_padded[i], frozen_at[i] = s, b, kmax, f
    bar.close()
    return solutions, BatchStats(bucket_of, k_padded, frozen_at, bucket_seconds)


def solve(problems: Sequence[Problem], config: SculptConfig | None = None) -> list[Solution]:
    """Drop-in for :func:`zipkv.distill.kvsculpt.solve` (a :data:`~zipkv.distill.problem.Solver`)."""
    return solve_batched(problems, config)[0]


def make_solver(*, tile: int | None = TILE, freeze_rtol: float | None = None, cuda_graphs: bool = True) -> Solver:
    """A :data:`~zipkv.distill.problem.Solver` with non-default bucketing, freezing or CUDA graphs."""
    def solver(problems: Sequence[Problem], config: SculptConfig | None = None) -> list[Solution]:
        return solve_batched(problems, config, tile=tile, freeze_rtol=freeze_rtol, cuda_graphs=cuda_graphs)[0]
    return solver
