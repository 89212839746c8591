"""Experiment loops behind the KVSculpt analysis chapters (paper §3.3, §5.2–5.5, §6, Appendix B).

Every loop captures each window once, puts every KVSculpt problem of every window and
configuration into as few :func:`~zipkv.distill.batched.solve_batched` calls as the data
dependencies allow (one call is one set of batched kernels, whatever the number of windows), and
evaluates the results with :mod:`zipkv.distill.evaluate`:

* :func:`optimizer_study` — Table 3: per-layer objective of Adam, L-BFGS (one run) and an oracle of
  random L-BFGS restarts (which includes the single run), on training and held-out real queries.
* :func:`optimizer_kl` — §5.2: end-to-end KL with every problem solved by Adam and by L-BFGS.
* :func:`query_study` — §3.3 statistics of content vectors and Table 4: each synthetic-query
  strategy by attention-output cosine against real queries from further along the same book.
* :func:`budget_sweep` — Tables 5–8 and Appendix B: uniform, ``‖V‖^α``, pilot-MSE^α per layer and
  per layer + head allocations at one total budget, plus the uniform run's error propagation (§6).
  Its result is cached (JSON, with the parameters that produced it) so the six chapters that
  read it solve once.

Shared helpers: :func:`attention_cosine` (near/far horizon metric), :func:`error_metrics` (§6).
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NamedTuple, Sequence

import torch

from zipkv.models import rope_of
from zipkv.study.paper_values import KVSCULPT_EASY_KL

from zipkv.distill import budget as budget_mod
from zipkv.distill.baselines import Problem, PreparedBatch, Solution, problem_loss
from zipkv.distill.batched import solve_batched
from zipkv.distill.kvsculpt import CompressedCache, SculptConfig, budget_for_ratio, build_problems, compress
from zipkv.distill.evaluate import kl_divergence, teacher_force

# --- a chapter's setting ----------------------------------------------------------------------------------


@dataclass
class Chapter:
    """What every analysis chapter starts from: the model, its windows, the solver settings, and a note."""

    model: object
    tokenizer: object
    shape: object
    windows: list
    config: SculptConfig
    note: str
    paper_setting: bool


def chapter(*, model_name, books_dir, n_windows, context, continuation, m, n_synthetic, steps, seed, device) -> Chapter:
    """Load the model and the PG19 windows of a chapter and state its setting against KVSculpt's.

    On the CPU it sets one intra-op thread (``torch.set_num_threads(1)``) for the rest of the process.
    ``note`` (markdown) names the model substitution and says whether this is the paper's setting
    (:data:`zipkv.study.settings.KVSCULPT_PAPER`); a scaled-down run says its numbers are not comparable.
    """
    from zipkv import data, models
    from zipkv.study import paper_values, settings

    torch.manual_seed(seed)
    if torch.device(device).type == "cpu":  # the quick profile's batches are small: one intra-op thread runs
        torch.set_num_threads(1)            # them several times faster than two on a shared 2-core machine
    model, tokenizer = models.load_model(model_name, dtype=torch.float32, device=device)
    shape = models.model_shape(model)
    windows = data.windows(tokenizer, data.load_books(books_dir), n_windows, context=context,
                           continuation=continuation, seed=seed)
    paper = settings.KVSCULPT_PAPER.matches(context=context, m=m, n_synthetic=n_synthetic, steps=steps)
    note = (f"**Setting.** {shape.name} ({shape.layers} layers × {shape.kv_heads} KV heads, head_dim {shape.head_dim}) "
            f"in place of the paper's {paper_values.KVSCULPT_MODEL} (28 × 2, head_dim 128); PG19 windows as in the paper; "
            f"{len(windows)} windows of N = {context} tokens + {continuation}; m = {m}, {n_synthetic} synthetic queries, "
            f"{steps} L-BFGS steps (batched solver) on {device}."
            + ("" if paper else " **A scaled-down run (not the paper's setting): its numbers are not comparable "
                                "with the paper's.**"))
    return Chapter(model, tokenizer, shape, windows, SculptConfig(steps=steps, progress=False), note, paper)


def sweep_cache(results_csv) -> Path | None:
    """Where the budget sweep is cached: beside the chapter's results table (``None``: not cached)."""
    return None if results_csv is None else Path(results_csv).with_name("kvsculpt_budget_sweep.json")


def committed_sweep(committed_csv, **expected) -> "BudgetSweep":
    """The budget sweep committed at ``HEAD`` beside ``committed_csv`` (a budget chapter's ``from_results``).

    ``expected``: the chapter's parameters that the sweep records (``ratio``, ``m``, ``n_synthetic``, ``alphas``,
    ``alpha``, ``pilot_steps``, ``head_pilot_steps``, ``seed``; ``steps`` is checked against its solver settings,
    ``n_windows`` against its windows);
    a chapter asked for other values than the committed run used is an error, not a relabelled table.
    """
    import pandas as pd

    from zipkv.study import committed

    data = json.loads(committed.read_committed_text(sweep_cache(committed_csv)))
    recorded = {**data["params"], "steps": data["params"]["config"]["steps"],
                "n_windows": len(set(data["tables"]["runs"]["window"]))}
    differ = {k: (v, recorded.get(k)) for k, v in expected.items()
              if json.loads(json.dumps(v)) != recorded.get(k) and not (isinstance(v, (list, tuple)) and
                                                                      [float(a) for a in v] == recorded.get(k))}
    if differ:
        raise ValueError("from_results: the committed budget sweep was made with other parameters: "
                         + ", ".join(f"{k}={v!r} (committed: {c!r})" for k, (v, c) in differ.items())
                         + "; run the chapter, or render it with the committed run's parameters")
    return BudgetSweep(**{name: pd.DataFrame(t) for name, t in data["tables"].items()}, params=data["params"],
                       seconds=data.get("seconds", {}))


def rendered_note(model: str, n_windows: int, context: int, continuation: int, m: int, n_synthetic: int, steps: int,
                  source: str) -> str:
    """The setting line of an analysis chapter rendered from committed results (``source``: which, and where they
    were computed), in place of :func:`chapter`'s ``note``."""
    from zipkv.study.settings import setting_line

    return ("**Setting.** " + setting_line(model, n_windows, context, continuation, m, n_synthetic, steps, "batched")
            + f" Rendered from {source}; the provenance box names the run.")


def committed_note(sweep: "BudgetSweep", context: int, continuation: int) -> str:
    """:func:`rendered_note` of a budget chapter rendered from the committed sweep (:func:`committed_sweep`)."""
    p = sweep.params
    return rendered_note(p["model"], sweep.runs.window.nunique(), context, continuation, p["m"], p["n_synthetic"],
                         p["config"]["steps"], f"the committed sweep (solved on {p['solver_device']})")


class BudgetChapter(NamedTuple):
    """What a budget chapter (Tables 5–8, App. B, §6) shows: the sweep, its setting note, and the tokenizer
    (``None`` unless asked for, when rendered from the committed sweep)."""
    sweep: "BudgetSweep"
    note: str
    tokenizer: object


def budget_chapter(*, from_results: bool, committed_csv, results_csv, model_name, books_dir, n_windows, context,
                   continuation, m, n_synthetic, steps, seed, device, ratio, alphas, alpha, pilot_steps,
                   head_pilot_steps, top_tokens: int = 5, with_tokenizer: bool = False) -> BudgetChapter:
    """The budget sweep of a chapter: solved (:func:`chapter`, :func:`budget_sweep`, cached beside ``results_csv``) or,
    with ``from_results``, the one committed beside ``committed_csv`` (:func:`committed_sweep`, no model needed
    unless ``with_tokenizer``)."""
    if from_results:
        sweep = committed_sweep(committed_csv, ratio=ratio, m=m, n_synthetic=n_synthetic, steps=steps,
                                n_windows=n_windows, alphas=alphas, alpha=alpha, pilot_steps=pilot_steps,
                                head_pilot_steps=head_pilot_steps, top_tokens=top_tokens, seed=seed)
        if with_tokenizer:
            from zipkv import models
            return BudgetChapter(sweep, committed_note(sweep, context, continuation), models.load_model(model_name)[1])
        return BudgetChapter(sweep, committed_note(sweep, context, continuation), None)
    ch = chapter(model_name=model_name, books_dir=books_dir, n_windows=n_windows, context=context,
                 continuation=continuation, m=m, n_synthetic=n_synthetic, steps=steps, seed=seed, device=device)
    sweep = budget_sweep(ch.model, ch.windows, ratio=ratio, m=m, n_synthetic=n_synthetic, config=ch.config,
                         alphas=alphas, alpha=alpha, pilot_steps=pilot_steps, head_pilot_steps=head_pilot_steps,
                         top_tokens=top_tokens, seed=seed, cache=sweep_cache(results_csv), model_name=model_name)
    return BudgetChapter(sweep, ch.note, ch.tokenizer)


def optimizer_chapter(*, from_results: bool, committed_csv, model_name, books_dir, n_windows, context, continuation,
                      m, n_synthetic, steps, seed, device, layers, ratio, adam_lr, restarts, oracle_windows):
    """Table 3's and §5.2's ``(table, kl, note)``: :func:`optimizer_study` run (its ``table``) and :func:`optimizer_kl`
    on the same windows, or with ``from_results`` the table committed at ``committed_csv``, checked against the
    chapter's ``layers``, ``n_windows`` and ``oracle_windows``, and its side table ``kl`` (None where no run has
    committed one)."""
    if not from_results:
        ch = chapter(model_name=model_name, books_dir=books_dir, n_windows=n_windows, context=context,
                     continuation=continuation, m=m, n_synthetic=n_synthetic, steps=steps, seed=seed, device=device)
        contexts = prepare(ch.model, ch.windows, m=m, n_synthetic=n_synthetic, seed=seed)
        table, _ = optimizer_study(ch.model, ch.windows, layers=layers, ratio=ratio, m=m, n_synthetic=n_synthetic,
                                   config=ch.config, adam_lr=adam_lr, restarts=restarts, oracle_windows=oracle_windows,
                                   seed=seed, contexts=contexts)
        kl = optimizer_kl(ch.model, contexts, ratio=ratio, m=m, config=ch.config, adam_lr=adam_lr)
        return table, kl, ch.note
    from zipkv.study import committed
    from zipkv import models

    table = committed.read_committed_csv(committed_csv)
    seen = dict(layers=sorted(table.layer.unique().tolist()), n_windows=table.window.nunique(),
                oracle_windows=table[table.optimizer == "oracle"].window.nunique())
    asked = dict(layers=sorted(layers), n_windows=n_windows, oracle_windows=oracle_windows)
    if seen != asked:
        raise ValueError(f"from_results: the committed table {committed_csv} has {seen}, the chapter asks for {asked}; "
                         "run the chapter, or render it with the committed run's parameters")
    return table, committed.read_committed_side(committed_csv, "kl"), rendered_note(
        model_name or models.EMBEDDED_NAME, n_windows, context, continuation, m, n_synthetic, steps, "the committed table")


# --- one window, captured once --------------------------------------------------------------------------------


@dataclass
class Context:
    """One window: the context's capture, the whole window's (held-out queries), the full-cache reference.

    Attributes:
        capture: :class:`zipkv.models.Capture` of the ``N`` context tokens.
        whole: the capture of context + continuation (queries at positions ``N …`` are held out).
        continuation: ``[C]`` continuation ids (teacher-forced for KL).
        reference: the full cache's teacher-forced run (logits, hidden states).
        problems: layer-major problems of the context (``k`` is replaced per configuration).
    """

    capture: object
    whole: object
    continuation: torch.Tensor
    reference: object
    problems: list[Problem]

    @property
    def n_context(self) -> int:
        return self.capture.positions.shape[0]


def prepare(model, windows: Sequence, *, m: int, n_synthetic: int, strategy: str = "uniform",
            seed: int = 0) -> list[Context]:
    """Capture each window once (``whole`` = context + continuation), teacher-force the full cache, build the problems."""
    from zipkv.models import capture as capture_fn

    out = []
    for window in windows:
        whole = capture_fn(model, window.input_ids)
        cap = whole.prefix(window.context)
        cont = window.continuation_ids
        reference = teacher_force(model, CompressedCache.from_capture(cap), cont)
        problems = build_problems(cap, 1, m=m, n_synthetic=n_synthetic, strategy=strategy, seed=seed)
        out.append(Context(cap, whole, cont, reference, problems))
    return out


def solve_jobs(jobs: Sequence[Sequence[Problem]], config: SculptConfig, *, starts=None) -> list[list]:
    """Solve every job's problems in ONE :func:`solve_batched` call; solutions split back per job.

    ``starts``: per job ``None`` or a list of per-problem start positions (random restarts)."""
    flat = [p for job in jobs for p in job]
    flat_starts = None
    if starts is not None:
        flat_starts = [s for job, js in zip(jobs, starts) for s in (js if js is not None else [None] * len(job))]
    solutions, _ = solve_batched(flat, config, starts=flat_starts)
    out, at = [], 0
    for job in jobs:
        out.append(solutions[at:at + len(job)])
        at += len(job)
    return out


def assemble(ctx: Context, ratio: float, budget: torch.Tensor, solutions, *, m: int) -> CompressedCache:
    """The :class:`CompressedCache` of already-solved problems (``compress`` with a solver that returns them)."""
    return compress(ctx.capture, ratio, "kvsculpt", m=m, budget=budget, problems=ctx.problems,
                    solver=lambda problems, config: list(solutions))


def with_budget(ctx: Context, budget: torch.Tensor) -> list[Problem]:
    """The context's problems with budget ``[L, H]``."""
    return [replace(p, k=int(budget[p.layer, p.head])) for p in ctx.problems]


def _grid(ctx: Context, values: Sequence[float]) -> torch.Tensor:
    L, H = len(ctx.capture.layers), ctx.capture.layers[0].keys.shape[0]
    out = torch.full((L, H), math.nan, dtype=torch.float64)
    for p, v in zip(ctx.problems, values):
        out[p.layer, p.head] = float(v)
    return out


def _heldout_problem(ctx: Context, layer: int, head: int, k: int, m: int, queries: slice) -> Problem:
    """The §3.2 objective's problem on the window's real queries at ``queries`` (positions ≥ N), not trained on."""
    lc = ctx.whole.layers[layer]
    g = lc.queries.shape[0] // lc.keys.shape[0]
    N = ctx.n_context
    return Problem(keys=lc.keys[head, :N].float(), values=lc.values[head, :N].float(),
                   queries=lc.queries[head * g:(head + 1) * g, queries].float(), m=m, k=k, layer=layer, head=head)


def heldout_loss(ctx: Context, problem: Problem, solution, m: int) -> float:
    """The objective of ``solution`` on the continuation's real queries (held out)."""
    N = ctx.n_context
    held = _heldout_problem(ctx, problem.layer, problem.head, problem.k, m, slice(N, None))
    return problem_loss(held, solution.keys.float().to(held.keys.device), solution.values.float().to(held.keys.device))


def _config_key(config: SculptConfig) -> dict:
    d = asdict(config)
    d["dtype"] = str(d["dtype"])
    d["device"] = str(d["device"])
    d.pop("progress", None)
    return d


def windows_digest(windows: Sequence) -> str:
    """sha256 of the windows' token ids (a cache made from other windows is never reused)."""
    h = hashlib.sha256()
    for w in windows:
        h.update(torch.as_tensor(w.input_ids).to(torch.int64).numpy().tobytes())
        h.update(str(w.context).encode())
    return h.hexdigest()


# --- Table 3: optimisers ------------------------------------------------------------------------------------


def adam_solve(problems: Sequence[Problem], config: SculptConfig, *, lr: float = 1e-2) -> list[Solution]:
    """Adam in place of L-BFGS (Table 3): ``steps × inner_iterations`` Adam iterations on the keys (the
    same gradient budget as L-BFGS's inner iterations), V-step every ``value_every × inner_iterations``,
    from the same Select+Fit start; returns each problem's best iterate.

    All problems of one shape run as one batch (:class:`~zipkv.distill.baselines.PreparedBatch`, the
    objective every solver uses)."""
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr={lr!r}: expected a finite learning rate > 0")
    pb = PreparedBatch(list(problems), config.dtype, config.device)
    keys = pb.gather_old(pb.top_attention()).clone()
    values = pb.ridge(keys, config.ridge)
    with torch.no_grad():
        initial = pb.loss(keys, values)
    best, best_keys, best_values = initial.clone(), keys.clone(), values.clone()
    keys.requires_grad_(True)
    opt = torch.optim.Adam([keys], lr=lr)
    iterations, every = config.steps * config.inner_iterations, config.value_every * config.inner_iterations
    for it in range(1, iterations + 1):
        opt.zero_grad()
        pb.loss(keys, values).sum().backward()  # independent problems: the sum's gradient is each one's own
        opt.step()
        if it % every == 0:
            values = pb.ridge(keys.detach(), config.ridge)
        with torch.no_grad():
            current = pb.loss(keys, values)
            better = torch.isfinite(current) & (current < best)
            best = torch.where(better, current, best)
            best_keys = torch.where(better[:, None, None], keys, best_keys)
            best_values = torch.where(better[:, None, None], values, best_values)
    return pb.solutions(best_keys, best_values, initial_loss=initial.tolist())


def oracle_search(problems: Sequence[Problem], single, config: SculptConfig, *, restarts: int, seed: int = 0):
    """Oracle of ``restarts`` L-BFGS runs per problem: the given single run (restart 0, from Select+Fit's
    start) and ``restarts − 1`` runs from ``k`` random old positions (with ridge values), all in one
    batched call. Returns per problem the best run's solution (lowest training objective)."""
    if restarts < 1:
        raise ValueError(f"restarts={restarts}: expected ≥ 1 (the single run is restart 0)")
    gen = torch.Generator().manual_seed(seed)
    jobs, starts = [], []
    for _ in range(restarts - 1):
        jobs.append(list(problems))
        starts.append([torch.randperm(p.n - p.m, generator=gen)[:p.k].sort().values for p in problems])
    runs = solve_jobs(jobs, config, starts=starts) if jobs else []
    best = list(single)
    for run in runs:
        best = [r if r.loss < b.loss else b for r, b in zip(run, best)]
    return best


def optimizer_study(model, windows: Sequence, *, layers: Sequence[int], ratio: float = 0.3, m: int = 256,
                    n_synthetic: int = 128, config: SculptConfig | None = None, adam_lr: float = 1e-2,
                    restarts: int = 100, oracle_windows: int = 1, seed: int = 0, contexts: Sequence[Context] | None = None):
    """Table 3: per-layer objective (mean over KV heads) of Adam, L-BFGS (one run) and the oracle.

    Returns ``(table, heads)``: ``table`` has ``window, layer, optimizer, mse_train, mse_heldout`` (held out:
    the continuation's real queries) and ``k``, means over KV heads; ``heads`` the same per KV head. The
    oracle runs on the first ``oracle_windows`` windows only. ``contexts``: the windows already
    :func:`prepare`-d with this ``m``, ``n_synthetic`` and ``seed`` (None: prepared here).
    """
    import pandas as pd

    cfg = config or SculptConfig()
    if not 0 <= oracle_windows <= len(windows):
        raise ValueError(f"oracle_windows={oracle_windows}: expected 0 … {len(windows)} (the number of windows)")
    if contexts is None:
        contexts = prepare(model, windows, m=m, n_synthetic=n_synthetic, seed=seed)
    k = budget_for_ratio(ratio, contexts[0].n_context, m)
    L = len(contexts[0].capture.layers)
    if not layers or any(not 0 <= int(l) < L for l in layers):
        raise ValueError(f"layers={list(layers)}: expected layer indices in [0, {L})")
    chosen = [[replace(p, k=k) for p in ctx.problems if p.layer in set(layers)] for ctx in contexts]
    single = solve_jobs(chosen, cfg)
    oracle_problems = [p for job in chosen[:oracle_windows] for p in job]
    oracle = oracle_search(oracle_problems, [s for run in single[:oracle_windows] for s in run], cfg,
                           restarts=restarts, seed=seed)
    adam = adam_solve([p for job in chosen for p in job], cfg, lr=adam_lr)
    rows, at_adam, at_oracle = [], 0, 0
    for w, (ctx, job, sols) in enumerate(zip(contexts, chosen, single)):
        methods = {"adam": adam[at_adam:at_adam + len(job)], "lbfgs": sols}
        at_adam += len(job)
        if w < oracle_windows:
            methods["oracle"] = oracle[at_oracle:at_oracle + len(job)]
            at_oracle += len(job)
        for name, results in methods.items():
            for p, sol in zip(job, results):
                rows.append(dict(window=w, layer=p.layer, head=p.head, optimizer=name, mse_train=sol.loss,
                                 mse_heldout=heldout_loss(ctx, p, sol, m), k=p.k))
    heads = pd.DataFrame(rows)
    table = heads.groupby(["window", "layer", "optimizer"], as_index=False)[["mse_train", "mse_heldout", "k"]].mean()
    return table, heads


def optimizer_kl(model, contexts: Sequence[Context], *, ratio: float = 0.3, m: int = 256,
                 config: SculptConfig | None = None, adam_lr: float = 1e-2, easy_kl: float = KVSCULPT_EASY_KL):
    """§5.2's end-to-end claim ("8–15× worse end-to-end KL on easy sequences"): per window, KL(full ‖ compressed)
    over the continuation, every layer's and KV head's problem (uniform ``k`` at ``ratio``) solved by L-BFGS
    (:func:`solve_jobs`) and by Adam (:func:`adam_solve`, the same start and gradient budget).

    Returns a DataFrame ``window, optimizer, kl, label`` (``lbfgs`` and ``adam`` per window; label ``easy`` where
    L-BFGS's KL is below ``easy_kl``, §5.1's definition, else ``hard``)."""
    import numpy as np
    import pandas as pd

    cfg = config or SculptConfig()
    N = contexts[0].n_context
    k = budget_for_ratio(ratio, N, m)
    L, H = len(contexts[0].capture.layers), contexts[0].capture.layers[0].keys.shape[0]
    uniform = budget_mod.uniform(L, H, k, k_max=N - m)
    jobs = [with_budget(ctx, uniform) for ctx in contexts]
    lbfgs = solve_jobs(jobs, cfg)
    adam = adam_solve([p for job in jobs for p in job], cfg, lr=adam_lr)
    rows, at = [], 0
    for w, (ctx, job, sols) in enumerate(zip(contexts, jobs, lbfgs)):
        for name, solved in (("lbfgs", sols), ("adam", adam[at:at + len(job)])):
            run = teacher_force(model, assemble(ctx, ratio, uniform, solved, m=m), ctx.continuation)
            rows.append(dict(window=w, optimizer=name, kl=float(kl_divergence(ctx.reference.logits, run.logits).mean())))
        at += len(job)
    table = pd.DataFrame(rows)
    lbfgs_kl = table[table.optimizer == "lbfgs"].set_index("window").kl
    table["label"] = np.where(table.window.map(lbfgs_kl) < easy_kl, "easy", "hard")
    return table


def adam_over_lbfgs(kl) -> tuple:
    """From :func:`optimizer_kl`'s table: per window Adam's KL over L-BFGS's (a Series indexed by window), and the
    windows the paper's claim is about -- the easy ones, or every window where none is easy -- with their label
    (``"easy"`` or ``"all"``)."""
    wide = kl.pivot_table(index="window", columns="optimizer", values="kl")
    ratio = wide.adam / wide.lbfgs
    easy = sorted(kl[kl.label == "easy"].window.unique())
    return ratio, (ratio.loc[easy], "easy") if easy else (ratio, "all")


# --- §3.3 statistics and Table 4: training queries -------------------------------------------------------------


def attention_output(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor,
                     valid: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """``softmax(q kᵀ·scale) v`` over a cache: keys/values ``[H, n, d]``, queries ``[H, g, T, d]``,
    ``valid`` ``[H, n]`` (False entries masked); returns ``[H, g, T, d]`` float64."""
    scale = keys.shape[-1] ** -0.5 if scale is None else scale
    s = torch.einsum("hgtd,hnd->hgtn", queries.double(), keys.double()) * scale
    if valid is not None:
        s = s.masked_fill(~valid[:, None, None, :], -math.inf)
    return torch.einsum("hgtn,hnd->hgtd", torch.softmax(s, dim=-1), values.double())


def attention_cosine(full: tuple[torch.Tensor, torch.Tensor], compressed: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                     queries: torch.Tensor) -> torch.Tensor:
    """``[H]`` mean cosine similarity of attention outputs, compressed cache vs full cache (Table 4).

    Args:
        full: ``(keys, values)`` ``[H, N, d]`` of the full context cache.
        compressed: ``(keys, values, valid)`` of the compressed cache (:meth:`CompressedCache.padded`).
        queries: ``[H_q, T, d]`` real post-RoPE queries (``H_q = g·H``).
    """
    H = full[0].shape[0]
    q = queries.reshape(H, queries.shape[0] // H, *queries.shape[1:])
    a = attention_output(*full, q)
    b = attention_output(compressed[0], compressed[1], q, compressed[2])
    return torch.nn.functional.cosine_similarity(a, b, dim=-1).mean(dim=(1, 2))


def content_statistics(ctx: Context, *, near: int, variance: float = 0.9):
    """§3.3 statistics of de-RoPE'd query content vectors ``q_c = RoPE⁻¹(q, p)`` per layer and query head.

    * ``consecutive_cosine``: mean cosine of ``q_c`` at consecutive context positions;
    * ``effective_dim``: PCA components (on the context's ``q_c``) for ``variance`` of its variance;
    * ``decode_captured``: share of the variance of the next ``near`` decode queries' ``q_c`` (about the
      context mean) inside that basis; ``far_captured``: the same for the window's last ``near`` queries.

    Returns a DataFrame: ``layer, q_head, consecutive_cosine, effective_dim, decode_captured, far_captured``.
    """
    import pandas as pd

    N = ctx.n_context
    T = ctx.whole.positions.shape[0]
    rows = []
    for layer, lc in enumerate(ctx.whole.layers):
        content = rope_of(ctx.whole, layer).invert(lc.queries.float(), ctx.whole.positions).double()  # [H_q, T, d]
        past = content[:, :N]
        cos = torch.nn.functional.cosine_similarity(past[:, 1:], past[:, :-1], dim=-1).mean(dim=1)
        mean = past.mean(dim=1, keepdim=True)
        centred = past - mean
        eigval, eigvec = torch.linalg.eigh(centred.transpose(1, 2) @ centred)  # ascending, [H_q, d], [H_q, d, d]
        eigval, eigvec = eigval.flip(-1).clamp_min(0), eigvec.flip(-1)
        share = eigval.cumsum(-1) / eigval.sum(-1, keepdim=True)
        dims = (share < variance).sum(-1) + 1  # [H_q] components holding `variance` of the context's variance

        def captured(block):  # [H_q] share of the block's variance (about the context mean) inside the basis
            x = block - mean
            proj = (x @ eigvec).square().sum(dim=1)  # [H_q, d] variance along each component
            keep = torch.arange(proj.shape[-1], device=proj.device)[None] < dims[:, None]
            return (proj * keep).sum(-1) / proj.sum(-1)

        near_c, far_c = captured(content[:, N:N + near]), captured(content[:, T - near:])
        for h in range(content.shape[0]):
            rows.append(dict(layer=layer, q_head=h, consecutive_cosine=float(cos[h]), effective_dim=int(dims[h]),
                             decode_captured=float(near_c[h]), far_captured=float(far_c[h])))
    return pd.DataFrame(rows)


def query_study(model, windows: Sequence, *, strategies: Sequence[str], near: int = 128, ratio: float = 0.3,
                m: int = 256, n_synthetic: int = 128, config: SculptConfig | None = None, seed: int = 0):
    """Table 4 and the §3.3 statistics.

    Each window holds ``N`` context tokens and at least ``far`` further tokens of the same book
    (``window.continuation`` = the far horizon). Every strategy's uniform-budget KVSculpt cache of every
    window is solved in one batched call; the cosine of attention outputs (compressed vs full context
    cache) is measured on the real queries of the ``near`` tokens right after the context (*near*) and
    of the ``near`` tokens ending ``window.continuation`` tokens after it (*far*).

    Returns ``(table, statistics)``: ``table`` has ``strategy, horizon, cosine, window`` (mean over
    layers and KV heads); ``statistics`` is :func:`content_statistics` per window (``window`` column).
    """
    import pandas as pd

    from zipkv.models import capture as capture_fn

    cfg = config or SculptConfig()
    jobs, meta = [], []
    per_window = []
    for w, window in enumerate(windows):
        whole = capture_fn(model, window.input_ids)
        cap = whole.prefix(window.context)
        N, T = window.context, whole.positions.shape[0]
        k = budget_for_ratio(ratio, N, m)
        ctx = Context(cap, whole, window.continuation_ids[:near], None, [])
        per_window.append(content_statistics(ctx, near=near).assign(window=w))
        blocks = {"near": slice(N, N + near), "far": slice(T - near, T)}
        views = dict(full=[(lc.keys[:, :N], lc.values[:, :N]) for lc in whole.layers],
                     queries={name: [lc.queries[:, b] for lc in whole.layers] for name, b in blocks.items()})
        for strategy in strategies:
            problems = build_problems(cap, k, m=m, n_synthetic=n_synthetic, strategy=strategy, seed=seed)
            jobs.append(problems)
            meta.append((w, strategy, Context(cap, None, ctx.continuation, None, problems), views, k))
        del whole
    solved = solve_jobs(jobs, cfg)
    rows = []
    for (w, strategy, ctx, views, k), sols in zip(meta, solved):
        L, H = len(ctx.capture.layers), ctx.capture.layers[0].keys.shape[0]
        cache = assemble(ctx, ratio, torch.full((L, H), k), sols, m=m)
        for horizon, queries in views["queries"].items():
            cos = [attention_cosine(views["full"][l], cache.padded(l, dtype=torch.float64), queries[l]).mean()
                   for l in range(L)]
            rows.append(dict(strategy=strategy, horizon=horizon, cosine=float(torch.stack(cos).mean()), window=w))
    return pd.DataFrame(rows), pd.concat(per_window, ignore_index=True)


# --- §6: error propagation -------------------------------------------------------------------------------------


def error_metrics(reference, run, *, top: int = 5) -> dict:
    """§6 metrics of one compressed run against the full cache's (both :func:`teacher_force` results).

    Returns ``hidden_mse`` ``[L]`` (mean squared hidden-state error per layer output),
    ``growth_first_to_last`` (last layer's MSE over the first's), ``kl_per_token`` ``[C]``,
    ``topk_kl_share`` (share of the summed KL in the ``top`` largest tokens) and ``max_over_mean_kl``.
    With no error at all (the uncompressed cache) every metric is 0: nothing grows, nothing is concentrated.
    """
    mse = (run.hidden.double() - reference.hidden.double()).square().mean(dim=(1, 2))
    kl = kl_divergence(reference.logits, run.logits)
    total = float(kl.sum())
    return dict(hidden_mse=mse, kl_per_token=kl,
                growth_first_to_last=float(mse[-1] / mse[0]) if float(mse[0]) > 0 else 0.0,
                topk_kl_share=float(kl.topk(min(top, kl.numel())).values.sum() / total) if total > 0 else 0.0,
                max_over_mean_kl=float(kl.max() / kl.mean()) if total > 0 else 0.0)


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation (Pearson on ranks; ties by order)."""
    a = torch.as_tensor(list(x), dtype=torch.float64).argsort().argsort().double()
    b = torch.as_tensor(list(y), dtype=torch.float64).argsort().argsort().double()
    if a.numel() < 2:
        return math.nan
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])


# --- Tables 5–8, Appendix B: budgets ------------------------------------------------------------------------


@dataclass
class BudgetSweep:
    """Results of :func:`budget_sweep` (long tables, ``pandas.DataFrame``).

    Attributes:
        runs: one row per (window, policy, alpha): ``kl``, ``vs_uniform`` (KL / the window's uniform KL),
            ``k_min``, ``k_max`` (smallest / largest per-layer budget per head), ``pairs`` (total budget).
        heads: one row per (window, layer, head): ``v_norm`` (layer's ‖V‖), ``pilot`` (60-step pilot MSE),
            ``head_pilot`` (30-step), ``uniform`` (final objective), ``select_fit`` (its start), ``heldout``.
        layers: one row per (window, layer) of the uniform run: ``hidden_mse``, ``loss`` (compression MSE,
            mean over heads), ``single_layer_kl`` (KL with only that layer compressed).
        tokens: one row per (window, position) of the uniform run: ``token_id``, ``kl``.
        params: the parameters that produced it; seconds: wall time of its parts (not a benchmark).
    """

    runs: object
    heads: object
    layers: object
    tokens: object
    params: dict
    seconds: dict

    def save(self, path) -> None:
        tables = {name: getattr(self, name).to_dict(orient="list") for name in ("runs", "heads", "layers", "tokens")}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(dict(params=self.params, seconds=self.seconds, tables=tables)))

    @classmethod
    def load(cls, path, params: dict) -> "BudgetSweep | None":
        """The cached sweep at ``path`` if it was made with exactly ``params``, else ``None``."""
        import pandas as pd

        path = Path(path)
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        if data.get("params") != json.loads(json.dumps(params)):
            return None
        return cls(**{name: pd.DataFrame(t) for name, t in data["tables"].items()}, params=data["params"],
                   seconds=data.get("seconds", {}))


def held_out_wins(table, method: str, other: str) -> tuple[int, int]:
    """Table 3's study (:func:`optimizer_study`'s ``table``): the (window, layer) pairs where ``method``'s objective on
    the held-out continuation queries is below ``other``'s, and how many pairs there are."""
    pairs = table.pivot_table(index=["window", "layer"], columns="optimizer", values="mse_heldout")
    return int((pairs[method] < pairs[other]).sum()), len(pairs)


class OptimizerSummary(NamedTuple):
    """Table 3's numbers (:func:`optimizer_summary`): per-layer objectives on the oracle's windows (``w0``: columns
    (``mse_train`` | ``mse_heldout``, optimizer)), Adam / L-BFGS on the mean over all windows (``adam_x`` training,
    ``held_x`` held out), the oracle gap (``gap``), and the table the chapter shows (``shown``)."""
    w0: object
    adam_x: object
    held_x: object
    gap: object
    shown: object


def optimizer_summary(table, oracle_windows: int) -> OptimizerSummary:
    """Table 3 from :func:`optimizer_study`'s ``table``: Adam's, one L-BFGS run's and the oracle's training objective
    and the oracle gap on the first ``oracle_windows`` windows (where the oracle ran), and Adam / L-BFGS on the mean
    over all windows, training and held out."""
    import pandas as pd

    cols = ["mse_train", "mse_heldout"]
    mean = table.pivot_table(index="layer", columns="optimizer", values=cols)
    w0 = table[table.window < oracle_windows].pivot_table(index="layer", columns="optimizer", values=cols)
    adam_x, held_x = mean.mse_train.adam / mean.mse_train.lbfgs, mean.mse_heldout.adam / mean.mse_heldout.lbfgs
    gap = w0.mse_train.lbfgs / w0.mse_train.oracle - 1
    on = "window 0" if oracle_windows == 1 else f"windows 0–{oracle_windows - 1}"
    shown = pd.DataFrame({f"Adam ({on})": w0.mse_train.adam, f"L-BFGS ({on})": w0.mse_train.lbfgs,
                          f"Oracle ({on})": w0.mse_train.oracle, f"Gap ({on})": gap,
                          "Adam / L-BFGS training (all windows)": adam_x, "Adam / L-BFGS held-out (all windows)": held_x})
    return OptimizerSummary(w0, adam_x, held_x, gap, shown)


def dampening_table(runs):
    """Appendix B: per budget signal (``vnorm``: ‖V‖^α, the static policy; ``pilot``: pilot-MSE^α) and exponent α
    (0: uniform), the mean KL over windows, its ratio to uniform's, the smallest and largest per-head budget and the
    windows, from :func:`budget_sweep`'s ``runs`` (a DataFrame)."""
    import pandas as pd

    rows, u = [], runs[runs.policy == "uniform"]
    for signal, policy in (("vnorm", "static"), ("pilot", "pilot")):
        rows.append(dict(signal=signal, alpha=0.0, kl=u.kl.mean(), vs_uniform=1.0, k_min=u.k_min.min(),
                         k_max=u.k_max.max(), windows=len(u)))
        for a, d in runs[runs.policy == policy].groupby("alpha"):
            rows.append(dict(signal=signal, alpha=a, kl=d.kl.mean(), vs_uniform=d.kl.mean() / u.kl.mean(),
                             k_min=d.k_min.min(), k_max=d.k_max.max(), windows=len(d)))
    return pd.DataFrame(rows)


def versus_uniform(runs, policy: str, alpha: float, column: str):
    """Per window ``window, uniform_kl, <column>, vs_uniform`` for one policy and exponent of a sweep's ``runs``."""
    import pandas as pd

    uniform = runs[runs.policy == "uniform"].set_index("window").kl
    chosen = runs[(runs.policy == policy) & (runs.alpha == float(alpha))].set_index("window").kl
    if chosen.empty:
        raise ValueError(f"the sweep has no runs of policy={policy!r} with alpha={alpha}")
    table = pd.DataFrame({"window": uniform.index, "uniform_kl": uniform.values, column: chosen.reindex(uniform.index).values})
    table["vs_uniform"] = table[column] / table.uniform_kl
    return table


def error_table(sweep: "BudgetSweep", easy_kl: float):
    """§6 per window from a sweep's uniform run: ``window, label`` (easy: KL < ``easy_kl``),
    ``growth_first_to_last, top5_kl_share, max_over_mean_kl, layer_mse_kl_correlation`` (Spearman across
    layers between a layer's compression MSE and the KL with only that layer compressed) and ``kl``."""
    import numpy as np
    import pandas as pd

    u = sweep.runs[sweep.runs.policy == "uniform"].set_index("window")
    rho = sweep.layers.groupby("window").apply(lambda d: spearman(d.loss, d.single_layer_kl))
    return pd.DataFrame({"window": u.index, "label": np.where(u.kl < easy_kl, "easy", "hard"),
                         "growth_first_to_last": u.growth_first_to_last.values, "top5_kl_share": u.top_kl_share.values,
                         "max_over_mean_kl": u.max_over_mean_kl.values,
                         "layer_mse_kl_correlation": rho.reindex(u.index).values, "kl": u.kl.values})


def budget_sweep(model, windows: Sequence, *, ratio: float = 0.3, m: int = 256, n_synthetic: int = 128,
                 config: SculptConfig | None = None, alphas: Sequence[float] = (0.3, 0.5, 0.7, 1.0),
                 alpha: float = 0.5, pilot_steps: int = 60, head_pilot_steps: int = 30, top_tokens: int = 5,
                 seed: int = 0, cache: str | Path | None = None, model_name: str | None = None,
                 progress: bool = True) -> BudgetSweep:
    """Every budget policy of Tables 5–8 and Appendix B on every window at one total ``B = k·L·H``.

    Two batched solves: (1) the uniform run of every window (its loss history gives the 60- and 30-step
    pilots exactly: :func:`~zipkv.distill.budget.pilot_signal`); (2) every other policy of every window
    at once: ``‖V‖^α`` and pilot^α per layer for each ``alphas`` (Appendix B; ``alpha`` is Tables 5–6's),
    and the 30-step per-head pilot per layer and per layer + head at ``alpha`` (Table 8). Each cache is
    teacher-forced once for KL; the uniform run also gives §6's error propagation.

    ``cache``: a JSON file; reused only when it was written with exactly these parameters and windows.
    """
    import pandas as pd

    cfg = config or SculptConfig()
    if pilot_steps > cfg.steps or head_pilot_steps > cfg.steps:
        raise ValueError(f"pilot_steps={pilot_steps}, head_pilot_steps={head_pilot_steps}: expected ≤ steps={cfg.steps} "
                         "(pilots are read from the uniform run's history)")
    model_id = f"{model_name or getattr(model.config, 'name_or_path', '')} ({model.config.num_hidden_layers} layers)"
    params = dict(windows=windows_digest(windows), model=model_id, ratio=ratio, m=m, n_synthetic=n_synthetic,
                  config=_config_key(cfg), alphas=[float(a) for a in alphas], alpha=float(alpha),
                  pilot_steps=pilot_steps, head_pilot_steps=head_pilot_steps, top_tokens=top_tokens, seed=seed,
                  solver_device=str(cfg.device or next(model.parameters()).device))
    if cache is not None:
        found = BudgetSweep.load(cache, params)
        if found is not None:
            if progress:
                print(f"budget sweep: reusing {cache} (same parameters and windows)", flush=True)
            return found
    started = time.perf_counter()
    contexts = prepare(model, windows, m=m, n_synthetic=n_synthetic, seed=seed)
    N = contexts[0].n_context
    L, H = len(contexts[0].capture.layers), contexts[0].capture.layers[0].keys.shape[0]
    k, k_max = budget_for_ratio(ratio, N, m), N - m
    uniform = budget_mod.uniform(L, H, k, k_max=k_max)
    first = solve_jobs([with_budget(ctx, uniform) for ctx in contexts], cfg)
    t_uniform = time.perf_counter() - started
    jobs, plan, heads, layers, tokens = [], [], [], [], []
    runs = []
    for w, (ctx, sols) in enumerate(zip(contexts, first)):
        histories = [s.history for s in sols]
        signals = dict(v_norm=budget_mod.value_norm_signal([lc.values for lc in ctx.capture.layers], m),
                       pilot=_grid(ctx, budget_mod.pilot_signal(histories, pilot_steps)),
                       head_pilot=_grid(ctx, budget_mod.pilot_signal(histories, head_pilot_steps)))
        for p, s in zip(ctx.problems, sols):
            heads.append(dict(window=w, layer=p.layer, head=p.head, v_norm=float(signals["v_norm"][p.layer]),
                              pilot=float(signals["pilot"][p.layer, p.head]),
                              head_pilot=float(signals["head_pilot"][p.layer, p.head]),
                              uniform=s.loss, select_fit=s.initial_loss,
                              heldout=heldout_loss(ctx, replace(p, k=k), s, m)))
        policies = [("static", a, budget_mod.static(signals["v_norm"], k, H, alpha=a, k_max=k_max)) for a in alphas]
        policies += [("pilot", a, budget_mod.pilot(signals["pilot"], k, alpha=a, k_max=k_max)) for a in alphas]
        policies += [("head_pilot_layer", alpha, budget_mod.pilot(signals["head_pilot"], k, alpha=alpha, k_max=k_max)),
                     ("head_pilot_head", alpha, budget_mod.pilot(signals["head_pilot"], k, alpha=alpha, per_head=True,
                                                                 k_max=k_max))]
        for policy, a, b in policies:
            jobs.append(with_budget(ctx, b))
            plan.append((w, policy, a, b))
        # the uniform run: KL and §6 error propagation
        cache_u = assemble(ctx, ratio, uniform, sols, m=m)
        run = teacher_force(model, cache_u, ctx.continuation)
        metrics = error_metrics(ctx.reference, run, top=top_tokens)
        runs.append(dict(window=w, policy="uniform", alpha=0.0, kl=float(metrics["kl_per_token"].mean()),
                         k_min=float(k), k_max=float(k), pairs=int(uniform.sum()),
                         growth_first_to_last=metrics["growth_first_to_last"],
                         top_kl_share=metrics["topk_kl_share"], max_over_mean_kl=metrics["max_over_mean_kl"]))
        full = CompressedCache.from_capture(ctx.capture)
        loss = _grid(ctx, [s.loss for s in sols]).mean(dim=1)
        for layer in range(L):
            single = teacher_force(model, full.with_layers(cache_u, [layer]), ctx.continuation)
            layers.append(dict(window=w, layer=layer, hidden_mse=float(metrics["hidden_mse"][layer]),
                               loss=float(loss[layer]),
                               single_layer_kl=float(kl_divergence(ctx.reference.logits, single.logits).mean())))
        for t, (tok, kl) in enumerate(zip(ctx.continuation.tolist(), metrics["kl_per_token"].tolist())):
            tokens.append(dict(window=w, position=t, token_id=tok, kl=kl))
    if progress:
        print(f"budget sweep: uniform runs of {len(contexts)} windows in {t_uniform:.1f} s; "
              f"{len(jobs)} adaptive runs in one batched solve …", flush=True)
    t0 = time.perf_counter()
    solved = solve_jobs(jobs, cfg)
    t_adaptive = time.perf_counter() - t0
    uniform_kl = {r["window"]: r["kl"] for r in runs}
    for (w, policy, a, b), sols in zip(plan, solved):
        ctx = contexts[w]
        run = teacher_force(model, assemble(ctx, ratio, b, sols, m=m), ctx.continuation)
        kl = float(kl_divergence(ctx.reference.logits, run.logits).mean())
        lo, hi = budget_mod.layer_range(b)
        runs.append(dict(window=w, policy=policy, alpha=float(a), kl=kl, k_min=lo, k_max=hi, pairs=int(b.sum())))
    runs = pd.DataFrame(runs)
    runs["vs_uniform"] = runs.kl / runs.window.map(uniform_kl)
    if progress:
        print(f"budget sweep: adaptive solve {t_adaptive:.1f} s; total {time.perf_counter() - started:.1f} s", flush=True)
    sweep = BudgetSweep(runs=runs, heads=pd.DataFrame(heads), layers=pd.DataFrame(layers),
                        tokens=pd.DataFrame(tokens), params=params,
                        seconds=dict(uniform=t_uniform, adaptive=t_adaptive, total=time.perf_counter() - started))
    if cache is not None:
        sweep.save(cache)
    return sweep
