"""KVSculpt: distil the old part of a KV cache into k free key/value pairs per layer and KV head (§3).

:func:`solve` is the reference solver, exactly as §3.4 and §4 describe it, one problem at a time:

* keys start at Select+Fit's solution: the top-``k`` old positions by accumulated attention, with
  ridge values (so the starting loss *is* Select+Fit's);
* K-step: ``torch.optim.LBFGS`` (lr 0.5, strong Wolfe line search, 10 inner iterations per outer
  step) on the §3.2 objective with the values frozen;
* V-step every 5 outer steps: ridge regression (λ = 1e-3). One L-BFGS optimizer runs through all
  outer steps, its curvature history kept across V-steps (§3.4: "L-BFGS uses curvature information
  from gradient history"). ``SculptConfig.reset_history`` restarts it after each V-step instead;
  measured here, that restart leaves a fresh steepest-descent step whose loss change falls under
  ``LBFGS``'s absolute ``tolerance_change`` (1e-9) on this objective's scale, so problems stall,
  with final losses ~30× higher;
* the best iterate is returned, so the final loss is never above Select+Fit's.

Its interface is a batch of independent :class:`~zipkv.distill.problem.Problem` (layers × heads,
each with its own ``k``) → one :class:`~zipkv.distill.problem.Solution` each (a
:data:`~zipkv.distill.problem.Solver`, settings in :class:`~zipkv.distill.problem.SculptConfig`), so
the batched solver (:mod:`.batched`) or another with the same signature can be passed to
:func:`compress` as ``solver=``.

:func:`compress` compresses a whole captured cache at ratio ``r = (k + m)/N`` with a named method and
a uniform or pilot-MSE budget (§3.5), returning a :class:`CompressedCache` (per layer and KV head,
``k_lh + m`` post-RoPE pairs); :class:`zipkv.cache.DistilledCache` puts it into a model for ``generate`` and for
:mod:`zipkv.distill.evaluate`.
"""
from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass, replace
from typing import Sequence

import torch
from tqdm import tqdm

from zipkv.models import rope_of

from .keywords import suggest_keywords
from . import baselines, batched, budget as budget_mod
from .baselines import JointConfig
from .problem import Prepared, Problem, SculptConfig, Solution, Solver
from .queries import check_strategy, training_queries

DETERMINISTIC_STRATEGIES = ("uniform",)
"""Query sampling strategies that draw no random numbers (so the per-head seed is irrelevant)."""

METHODS = ("kvsculpt", "random", "attention_score", "select_fit", "joint_opt")
"""Method names accepted by :func:`compress` (§4 baselines and KVSculpt)."""

BUDGETS = ("uniform", "pilot", "pilot_layer")
"""Named budget policies: equal ``k``; pilot-MSE per layer then per head; pilot-MSE per layer only."""


def _lbfgs(param: torch.Tensor, cfg: SculptConfig) -> torch.optim.LBFGS:
    return torch.optim.LBFGS([param], lr=cfg.lr, max_iter=cfg.inner_iterations, history_size=cfg.history_size,
                             line_search_fn="strong_wolfe")


def solve_one(problem: Problem, cfg: SculptConfig) -> Solution:
    """KVSculpt on one problem (§3.4); see the module docstring. Returns the best iterate."""
    started = time.perf_counter()
    prep = Prepared(problem, cfg.dtype, cfg.device)
    index = prep.top_attention(problem.k)
    keys = prep.k_old[index].clone()
    values = prep.ridge(keys, cfg.ridge)
    with torch.no_grad():
        initial = float(prep.loss(keys, values))
    best = (initial, keys.clone(), values.clone())
    history = [initial]
    if problem.k > 0 and cfg.steps > 0:
        keys.requires_grad_(True)
        opt = _lbfgs(keys, cfg)

        def closure():
            opt.zero_grad()
            loss = prep.loss(keys, values)
            loss.backward()
            return loss

        for step in range(1, cfg.steps + 1):
            opt.step(closure)
            if step % cfg.value_every == 0:
                values = prep.ridge(keys.detach(), cfg.ridge)
                if cfg.reset_history:
                    opt = _lbfgs(keys, cfg)
            with torch.no_grad():
                current = float(prep.loss(keys, values))
            history.append(current)
            if not math.isfinite(current):
                break
            if current < best[0]:
                best = (current, keys.detach().clone(), values.clone())
    _, keys, values = best
    return prep.solution(keys, values, initial_loss=initial, seconds=time.perf_counter() - started,
                         history=history)


def solve(problems: Sequence[Problem], config: SculptConfig | None = None) -> list[Solution]:
    """The reference KVSculpt solver over a batch of independent problems, one at a time (§3.4)."""
    cfg = config or SculptConfig()
    return [solve_one(p, cfg) for p in tqdm(problems, desc="kvsculpt", disable=not cfg.progress, leave=False)]


def solver_named(name: str) -> Solver:
    """The batch solver called ``name``: ``"reference"`` (:func:`solve`) or ``"batched"`` (all problems at once)."""
    if name == "reference":
        return solve
    if name == "batched":
        return batched.solve
    raise ValueError(f"solver={name!r}: expected 'reference' or 'batched'")


# --- a whole cache -----------------------------------------------------------------------------------------

@dataclass
class CompressedCache:
    """A per-layer, per-KV-head cache of post-RoPE pairs, possibly of different lengths.

    Attributes:
        keys, values: ``keys[layer][head]`` is ``[n_lh, head_dim]`` (compressed pairs first, then the
            retain zone), in the solver dtype or the capture's.
        n_context: ``N``, the original context length: the continuation starts at position ``N``.
        method, ratio: how it was made (``"full"``, 1.0 for the uncompressed cache).
        budget: ``[L, H]`` compressed pairs ``k_lh`` (``None`` for the full cache).
        loss, initial_loss: ``[L, H]`` the method's objective on the training queries at the
            returned solution and at its starting point (KVSculpt: Select+Fit's loss).
        seconds: ``[L, H]`` solver time per problem.
        bias: ``bias[layer][head]`` ``[n_lh]`` float logit bias added to the attention scores of the cached
            pairs (``None``: zero everywhere; Attention Matching's pairs stand for several tokens each).
    """

    keys: list[list[torch.Tensor]]
    values: list[list[torch.Tensor]]
    n_context: int
    method: str = "full"
    ratio: float = 1.0
    budget: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    initial_loss: torch.Tensor | None = None
    seconds: torch.Tensor | None = None
    bias: list[list[torch.Tensor]] | None = None

    def __post_init__(self):
        if len(self.keys) != len(self.values):
            raise ValueError(f"keys has {len(self.keys)} layers but values has {len(self.values)}")
        for layer, (ks, vs) in enumerate(zip(self.keys, self.values)):
            if len(ks) != len(vs) or len(ks) != len(self.keys[0]):
                raise ValueError(f"layer {layer}: {len(ks)} key heads and {len(vs)} value heads, expected "
                                 f"{len(self.keys[0])} each")
            for head, (k, v) in enumerate(zip(ks, vs)):
                if k.ndim != 2 or k.shape != v.shape:
                    raise ValueError(f"layer {layer} head {head}: keys {tuple(k.shape)} and values {tuple(v.shape)}, "
                                     "expected equal [n, head_dim]")
        if self.bias is not None:
            for layer, (bs, ks) in enumerate(zip(self.bias, self.keys)):
                if len(bs) != len(ks) or any(b.shape != (k.shape[0],) for b, k in zip(bs, ks)):
                    raise ValueError(f"layer {layer}: bias shapes {[tuple(b.shape) for b in bs]}, expected "
                                     f"{[(k.shape[0],) for k in ks]} (one value per cached pair)")
            if len(self.bias) != len(self.keys):
                raise ValueError(f"bias has {len(self.bias)} layers, keys {len(self.keys)}")

    @classmethod
    def from_capture(cls, capture) -> "CompressedCache":
        """The uncompressed cache of a :class:`zipkv.models.Capture` (the reference for KL)."""
        keys = [list(layer.keys.unbind(0)) for layer in capture.layers]
        values = [list(layer.values.unbind(0)) for layer in capture.layers]
        return cls(keys, values, n_context=int(capture.positions[-1]) + 1)

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_heads(self) -> int:
        return len(self.keys[0])

    @property
    def lengths(self) -> torch.Tensor:
        """``[L, H]`` int64 cached pairs per layer and head."""
        return torch.tensor([[k.shape[0] for k in ks] for ks in self.keys], dtype=torch.long)

    @property
    def memory_ratio(self) -> float:
        """Cached pairs over the pairs the model itself holds: the full cache's ``L·H·N``, except that a layer
        with no compressed pairs (a ``budget`` row of zeros: a sliding-window layer kept as the model keeps it,
        :func:`compressed_layers`) counts its own pairs, so that pairs the model drops by itself are not
        counted as compressed away."""
        lengths = self.lengths
        held = torch.full((self.num_layers,), self.num_heads * self.n_context, dtype=torch.long)
        if self.budget is not None:
            kept = (torch.as_tensor(self.budget) == 0).all(dim=1)
            held[kept] = lengths[kept].sum(dim=1)
        return float(lengths.sum()) / int(held.sum())

    def padded(self, layer: int, dtype=None, device=None):
        """One layer padded to its longest head.

        Returns:
            ``(keys, values, valid)``: ``[H, n_max, d]``, ``[H, n_max, d]`` (zeros where padded) and
            ``[H, n_max]`` bool, True on real pairs.
        """
        ks, vs = self.keys[layer], self.values[layer]
        dtype = dtype or ks[0].dtype
        device = device or ks[0].device
        n_max = max(k.shape[0] for k in ks)
        H, d = len(ks), ks[0].shape[1]
        if all(k.shape[0] == n_max for k in ks):  # equal lengths (uniform budget): no padding
            keys = torch.stack(ks).to(device=device, dtype=dtype)
            values = torch.stack(vs).to(device=device, dtype=dtype)
            return keys, values, torch.ones(H, n_max, dtype=torch.bool, device=device)
        keys = torch.zeros(H, n_max, d, dtype=dtype, device=device)
        values = torch.zeros(H, n_max, d, dtype=dtype, device=device)
        valid = torch.zeros(H, n_max, dtype=torch.bool, device=device)
        for h, (k, v) in enumerate(zip(ks, vs)):
            keys[h, : k.shape[0]] = k.to(device=device, dtype=dtype)
            values[h, : v.shape[0]] = v.to(device=device, dtype=dtype)
            valid[h, : k.shape[0]] = True
        return keys, values, valid

    def padded_bias(self, layer: int, device=None) -> torch.Tensor:
        """``[H, n_max]`` float32 logit bias of one layer padded like :meth:`padded` (zeros where none or padded)."""
        ks = self.keys[layer]
        device = device or ks[0].device
        out = torch.zeros(len(ks), max(k.shape[0] for k in ks), device=device)
        if self.bias is not None:
            for h, b in enumerate(self.bias[layer]):
                out[h, : b.shape[0]] = b.to(device=device, dtype=torch.float32)
        return out

    def with_layers(self, other: "CompressedCache", layers: Sequence[int]) -> "CompressedCache":
        """A copy of this cache whose ``layers`` come from ``other`` (e.g. one compressed layer in a full cache)."""
        if other.num_layers != self.num_layers or other.n_context != self.n_context:
            raise ValueError(f"other has {other.num_layers} layers and N={other.n_context}, expected "
                             f"{self.num_layers} and N={self.n_context}")
        chosen = set(int(x) for x in layers)
        def pick(mine, theirs, i):
            source = theirs if i in chosen else mine
            if source is not None:
                return source[i]
            return [torch.zeros(k.shape[0]) for k in (other.keys if i in chosen else self.keys)[i]]

        keys = [other.keys[i] if i in chosen else self.keys[i] for i in range(self.num_layers)]
        values = [other.values[i] if i in chosen else self.values[i] for i in range(self.num_layers)]
        bias = None
        if self.bias is not None or other.bias is not None:
            bias = [pick(self.bias, other.bias, i) for i in range(self.num_layers)]
        return CompressedCache(keys, values, self.n_context, method=f"{self.method}+{other.method}@{sorted(chosen)}",
                               ratio=self.ratio, bias=bias)


def check_capture(capture, name: str = "capture") -> None:
    """``TypeError`` unless ``capture`` is a :class:`zipkv.models.Capture` (the distillers' input): a model passed in its
    place is named, with the call that takes a model."""
    from zipkv.models import Capture

    if not isinstance(capture, Capture):
        hint = (": this function takes a capture of the context, zipkv.models.capture(model, context_ids); "
                "zipkv.compress(model, context_ids, ...) takes the model itself"
                if hasattr(capture, "config") and hasattr(capture, "forward") else "")
        raise TypeError(f"{name} must be a zipkv.models.Capture, got {type(capture).__name__}{hint}")


def compressed_layers(capture) -> list[int]:
    """The layers of ``capture`` a distiller compresses (:attr:`zipkv.models.Capture.compressed_layers`: every
    layer of a Llama-family model; Gemma 3's global layers, its sliding-window layers kept as the model keeps
    them, :meth:`zipkv.models.Capture.kept_pairs`)."""
    layers = getattr(capture, "compressed_layers", None)
    layers = list(range(len(capture.layers))) if layers is None else list(layers)
    if not layers:
        windows = sorted({w for w in capture.windows if w is not None})
        raise ValueError(f"every layer attends within a sliding window ({windows} tokens, config.sliding_window), "
                         "which the distillers keep as the model does: no layer is left to compress (where contexts "
                         "and continuations stay shorter than the window it changes nothing: set "
                         "model.config.sliding_window = None)")
    return layers


def budget_for_ratio(ratio: float, n_context: int, m: int) -> int:
    """Compressed pairs per head ``k = round(r·N) − m`` for ratio ``r = (k + m)/N`` (§3.1).

    Raises ``TypeError`` unless ``ratio`` is a real number and ``m`` an int, ``ValueError`` unless ``m/N < r ≤ 1``
    and ``k ≥ 1``.
    """
    if isinstance(m, bool) or not isinstance(m, numbers.Integral):
        raise TypeError(f"m={m!r}: expected an int (the retain zone's token count)")
    if not 0 <= m < n_context:
        raise ValueError(f"m={m}: expected 0 ≤ m < N={n_context}")
    if not isinstance(ratio, numbers.Real) or isinstance(ratio, bool):
        raise TypeError(f"ratio={ratio!r}: expected a real number (r = (k + m)/N), got {type(ratio).__name__}")
    if not math.isfinite(ratio) or not m / n_context < ratio <= 1:
        raise ValueError(f"ratio={ratio!r}: expected m/N = {m}/{n_context} = {m / n_context:.4g} < ratio ≤ 1 "
                         "(r = (k + m)/N)")
    k = int(round(ratio * n_context) - m)
    if k < 1:
        raise ValueError(f"ratio={ratio!r} leaves k = round(r·N) − m = {k} < 1 compressed pairs (N={n_context}, m={m})")
    return k


def build_problems(capture, k, *, m: int = 256, n_synthetic: int = 128, strategy: str = "uniform",
                   seed: int = 0, scale: float | None = None) -> list[Problem]:
    """One :class:`Problem` per (layer, KV head) of a capture, layer-major.

    Args:
        capture: a :class:`zipkv.models.Capture` (``layers[l].keys`` ``[H, N, d]``, ``.values``,
            ``.queries`` ``[H_q, N, d]``, ``positions`` ``[N]``, ``rope``).
        k: compressed pairs per head: an int, or ``[L, H]`` integers.
        m, n_synthetic, strategy, seed: training queries (§3.3, :func:`~zipkv.distill.queries.training_queries`).
        scale: score scale (``1/√d`` when ``None``).
    """
    check_strategy(strategy)
    for name, value in (("m", m), ("n_synthetic", n_synthetic)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{name}={value!r}: expected an integer ≥ 0")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed={seed!r}: expected an int")
    m, n_synthetic, seed = int(m), int(n_synthetic), int(seed)        # NumPy integers as ints
    if m + n_synthetic == 0:
        raise ValueError("m=0 and n_synthetic=0 leave no training queries: the objective (§3.2) needs "
                         "m + n_synthetic ≥ 1 (paper: m=256, n_synthetic=128)")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
                              or not math.isfinite(scale) or scale <= 0):
        raise ValueError(f"scale={scale!r}: expected a finite positive attention score scale, or None for 1/√d")
    L = len(capture.layers)
    if L == 0:
        raise ValueError("capture has no layers")
    H, N, d = capture.layers[0].keys.shape
    ks = (torch.full((L, H), int(k), dtype=torch.long) if isinstance(k, numbers.Integral) and not isinstance(k, bool)
          else torch.as_tensor(k))
    if tuple(ks.shape) != (L, H):
        raise ValueError(f"budget has shape {tuple(ks.shape)}: expected [layers, kv_heads] = [{L}, {H}]")
    if tuple(capture.positions.shape) != (N,):
        raise ValueError(f"capture.positions has shape {tuple(capture.positions.shape)}: expected [{N}]")
    for layer, lc in enumerate(capture.layers):
        if lc.keys.shape != (H, N, d) or lc.values.shape != (H, N, d):
            raise ValueError(f"layer {layer}: keys {tuple(lc.keys.shape)} / values {tuple(lc.values.shape)}, "
                             f"expected [{H}, {N}, {d}] like layer 0")
        Hq = lc.queries.shape[0]
        if lc.queries.ndim != 3 or Hq % H or lc.queries.shape[1:] != (N, d):
            raise ValueError(f"layer {layer}: queries {tuple(lc.queries.shape)}, expected [q_heads, {N}, {d}] "
                             f"with q_heads a multiple of kv_heads={H}")
    # "uniform" sampling draws no random numbers, so the per-head seeds do not matter and every query head
    # of every layer goes through one training_queries call (elementwise the same as one call per head;
    # only where every layer shares one RoPE)
    together = None
    if (strategy in DETERMINISTIC_STRATEGIES and len({lc.queries.shape[0] for lc in capture.layers}) == 1
            and capture.rope is not None):
        stacked = torch.stack([lc.queries for lc in capture.layers])  # [L, Hq, N, d]
        Hq = stacked.shape[1]
        together = training_queries(stacked.flatten(0, 1), capture.positions, capture.rope, m, n_synthetic,
                                    strategy=strategy, seed=seed).view(L, H, Hq // H, -1, d)
    problems = []
    for layer, lc in enumerate(capture.layers):
        g = lc.queries.shape[0] // H
        for head in range(H):
            if together is not None:
                q = together[layer, head]
            else:
                q = training_queries(lc.queries[head * g:(head + 1) * g], capture.positions, rope_of(capture, layer), m,
                                     n_synthetic, strategy=strategy, seed=seed + 7919 * layer + head)
            problems.append(Problem(keys=lc.keys[head], values=lc.values[head], queries=q, m=m,
                                    k=int(ks[layer, head]), scale=scale, layer=layer, head=head))
    return problems


def run_method(method: str, problems: Sequence[Problem], *, config: SculptConfig | None = None,
               joint_config: JointConfig | None = None, seed: int = 0, solver: Solver | None = None
               ) -> list[Solution]:
    """Run one named method (:data:`METHODS`) on a batch of problems."""
    cfg = config or SculptConfig()
    if method == "kvsculpt":
        return (solver or solve)(problems, cfg)
    kw = dict(dtype=cfg.dtype, device=cfg.device)
    if method == "random":
        return baselines.random_selection(problems, seed=seed, **kw)
    if method == "attention_score":
        return baselines.attention_score(problems, **kw)
    if method == "select_fit":
        return baselines.select_fit(problems, ridge=cfg.ridge, **kw)
    if method == "joint_opt":
        return baselines.joint_opt(problems, joint_config, seed=seed, progress=cfg.progress, **kw)
    raise ValueError(f"method={method!r} is not a compression method: expected one of {list(METHODS)}")


def _grid(problems: Sequence[Problem], solutions: Sequence[Solution], attr: str, L: int, H: int) -> torch.Tensor:
    out = torch.full((L, H), float("nan"), dtype=torch.float64)
    for p, s in zip(problems, solutions):
        out[p.layer, p.head] = getattr(s, attr)
    return out


def check_settings(*, m: int = 256, n_synthetic: int = 128, strategy: str = "uniform", budget="uniform",
                   pilot_steps: int = 30, alpha: float = 0.5, scale: float | None = None,
                   joint_config: JointConfig | None = None, seed: int = 0, problems=None, **_) -> None:
    """Check :func:`compress`'s settings that need no capture, so that a bad one fails before any work (the
    capture's forward pass, a pilot solve); the rest are :func:`compress`'s to check."""
    check_strategy(strategy)
    for name, value in (("m", m), ("n_synthetic", n_synthetic)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{name}={value!r}: expected an integer ≥ 0")
    if m + n_synthetic == 0 and problems is None:
        raise ValueError("m=0 and n_synthetic=0 leave no training queries: the objective (§3.2) needs "
                         "m + n_synthetic ≥ 1 (paper: m=256, n_synthetic=128)")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed={seed!r}: expected an int")
    if joint_config is not None and not isinstance(joint_config, JointConfig):
        raise TypeError(f"joint_config={joint_config!r}: expected a zipkv.distill.baselines.JointConfig or None")
    if not isinstance(budget, (str, torch.Tensor)):
        raise ValueError(f"budget={budget!r}: expected one of {list(BUDGETS)} or an [L, H] tensor of ints")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
                              or not math.isfinite(scale) or scale <= 0):
        raise ValueError(f"scale={scale!r}: expected a finite positive attention score scale, or None for 1/√d")
    if isinstance(budget, str):
        if budget not in BUDGETS:
            raise ValueError(f"budget={budget!r}: expected one of {list(BUDGETS)} or an [L, H] tensor of ints")
        if budget != "uniform":
            if isinstance(pilot_steps, bool) or not isinstance(pilot_steps, numbers.Integral) or pilot_steps < 1:
                raise ValueError(f"pilot_steps={pilot_steps!r}: expected an integer ≥ 1 (the pilot run's KVSculpt steps)")
            if (isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not math.isfinite(alpha)
                    or alpha < 0):
                raise ValueError(f"alpha={alpha!r}: expected a finite exponent ≥ 0 (the pilot allocation's dampening)")


@suggest_keywords
def compress(capture, ratio: float, method: str = "kvsculpt", *, m: int = 256, n_synthetic: int = 128,
             strategy: str = "uniform", budget="uniform", config: SculptConfig | None = None,
             joint_config: JointConfig | None = None, pilot_steps: int = 30, alpha: float = 0.5,
             seed: int = 0, scale: float | None = None, solver: Solver | None = None,
             problems: Sequence[Problem] | None = None) -> CompressedCache:
    """Compress a whole captured cache at ratio ``r = (k + m)/N`` with a named method (§3, §4).

    Args:
        capture: a :class:`zipkv.models.Capture` of the ``N``-token context.
        ratio: ``r``, with ``m/N < r ≤ 1``; ``k = round(r·N) − m`` pairs per head on average.
        method: one of :data:`METHODS`.
        m: retain-zone size (paper: 256).
        n_synthetic: synthetic future queries per query head (paper: 128).
        strategy: synthetic-query sampling strategy (§5.3; paper: ``"uniform"``).
        budget: ``"uniform"`` (``k`` everywhere), ``"pilot"`` (pilot-MSE^alpha per layer then per head,
            §3.5), ``"pilot_layer"`` (per layer only, even within a layer), or an ``[L, H]`` integer
            tensor of per-head budgets.
        config: KVSculpt solver settings (also the dtype/device of every method).
        joint_config: Joint Optimization settings.
        pilot_steps: KVSculpt steps of the pilot run (paper: 30 per head).
        alpha: dampening exponent of the pilot allocation.
        seed: for random selection, query sampling and Joint Optimization's gate noise.
        scale: attention score scale (``1/√d`` when ``None``).
        solver: a batch solver replacing :func:`solve` for ``"kvsculpt"`` and the pilot, or its name
            (:func:`solver_named`: ``"batched"``, ``"reference"``).
        problems: this capture's problems from :func:`build_problems` (any ``k``; built with the same
            ``m``, ``n_synthetic``, ``strategy``, ``seed`` and ``scale``), to reuse the training queries
            across ratios and methods; their ``k`` is replaced by the budget.

    Returns:
        A :class:`CompressedCache` with ``k_lh + m`` pairs per layer and KV head; a layer that is not
        compressed (:func:`compressed_layers`: Gemma 3's sliding-window layers) keeps its window
        (:meth:`zipkv.models.Capture.kept_pairs`) with ``k_lh = 0``, its losses and seconds NaN.
    """
    check_capture(capture)
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not a compression method: expected one of {list(METHODS)}")
    check_settings(m=m, n_synthetic=n_synthetic, strategy=strategy, budget=budget, pilot_steps=pilot_steps,
                   alpha=alpha, scale=scale, joint_config=joint_config, seed=seed, problems=problems)
    m, n_synthetic, seed = int(m), int(n_synthetic), int(seed)                       # NumPy integers as ints
    pilot_steps = int(pilot_steps) if isinstance(pilot_steps, numbers.Integral) else pilot_steps
    if config is not None and not isinstance(config, SculptConfig):
        raise TypeError(f"config={config!r}: expected a zipkv.distill.SculptConfig")
    if isinstance(solver, str):                                     # a name, as zipkv.compress takes it
        solver = solver_named(solver)
    elif solver is not None and not callable(solver):
        raise TypeError(f"solver={solver!r}: expected 'batched', 'reference' or a batch solver function")
    cfg = config or SculptConfig()
    L = len(capture.layers)
    H, N, _ = capture.layers[0].keys.shape
    k = budget_for_ratio(ratio, N, m)
    if problems is None:
        problems = build_problems(capture, k, m=m, n_synthetic=n_synthetic, strategy=strategy, seed=seed, scale=scale)
    else:
        if len(problems) != L * H or any(p.m != m or p.n != N for p in problems):
            raise ValueError(f"problems: expected {L * H} problems (layer-major) with N={N} and m={m}, as "
                             "build_problems makes for this capture")
        problems = [replace(p, k=k) for p in problems]
    kept = compressed_layers(capture)
    if len(kept) < L:
        problems = [p for p in problems if p.layer in set(kept)]
    if isinstance(budget, str):
        if budget != "uniform":
            pilot = (solver or solve)(problems, replace(cfg, steps=pilot_steps))
            signal = _grid(problems, pilot, "loss", L, H)[kept]
            ks = torch.zeros(L, H, dtype=torch.long)
            ks[kept] = budget_mod.allocate(signal, k * len(kept) * H, alpha=alpha, per_head=budget == "pilot",
                                           k_min=1, k_max=N - m)
            problems = [replace(p, k=int(ks[p.layer, p.head])) for p in problems]
    else:
        ks = torch.as_tensor(budget)
        if tuple(ks.shape) != (L, H) or ks.is_floating_point() or ks.dtype == torch.bool:
            raise ValueError(f"budget has shape {tuple(ks.shape)} and dtype {ks.dtype}: expected [layers, kv_heads] = "
                             f"[{L}, {H}] integers")
        if not bool(((ks[kept] >= 1) & (ks[kept] <= N - m)).all()):
            raise ValueError(f"budget: compressed pairs per head must lie in [1, N − m = {N - m}], got "
                             f"{int(ks[kept].min())}–{int(ks[kept].max())}")
        problems = [replace(p, k=int(ks[p.layer, p.head])) for p in problems]
        ratio = (float(ks[kept].double().mean()) + m) / N      # what the budget keeps, not the ratio argument
    # A head that keeps every old pair keeps them as they are: the exact cache (zero loss), which a fit of its
    # values on a few training queries would only perturb.
    fit = [p for p in problems if p.k < p.n - p.m]
    fitted = iter(run_method(method, fit, config=cfg, joint_config=joint_config, seed=seed, solver=solver) if fit else [])
    solutions = [next(fitted) if p.k < p.n - p.m else
                 Solution(p.keys[:N - m], p.values[:N - m], 0.0, 0.0, indices=torch.arange(N - m)) for p in problems]
    keys = [[None] * H for _ in range(L)]
    values = [[None] * H for _ in range(L)]
    for p, s in zip(problems, solutions):
        if s.keys.shape != (p.k, p.head_dim):
            raise RuntimeError(f"{method} returned keys {tuple(s.keys.shape)} for layer {p.layer} head {p.head}, "
                               f"expected [{p.k}, {p.head_dim}]")
        keys[p.layer][p.head] = torch.cat([s.keys.to(p.keys.dtype).to(p.keys.device), p.keys[N - m:]])
        values[p.layer][p.head] = torch.cat([s.values.to(p.values.dtype).to(p.values.device), p.values[N - m:]])
    ks = torch.zeros(L, H, dtype=torch.long)
    for p in problems:
        ks[p.layer, p.head] = p.k
    for layer in sorted(set(range(L)) - set(kept)):
        window_keys, window_values = capture.kept_pairs(layer)
        keys[layer], values[layer] = list(window_keys.unbind(0)), list(window_values.unbind(0))
    return CompressedCache(keys, values, n_context=int(capture.positions[-1]) + 1, method=method, ratio=ratio,
                           budget=ks,
                           loss=_grid(problems, solutions, "loss", L, H),
                           initial_loss=_grid(problems, solutions, "initial_loss", L, H),
                           seconds=_grid(problems, solutions, "seconds", L, H))
