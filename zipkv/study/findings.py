"""The findings scorecard: one row per claim of each paper (every table and figure, the abstracts'
headline claims), the paper's number, ours, a verdict and the chapter that shows it.

Every ``our_value`` is computed here from the committed results tables (``results/<profile>/<stem>.csv``,
one per chapter, stem = the chapter notebook's name); the papers' numbers come from
:mod:`zipkv.study.paper_values`. A claim whose table is not committed reads "not yet run".

Verdicts: a claim states a number (or a range lo–hi) and which way is better for the paper's method.
Ours *reproduces* it when it lies in the paper's range widened by the claim's ``slack`` factor
(``lo / slack ≤ ours ≤ hi × slack``; each row shows its tolerance), *exceeds* it when it lies beyond
that on the better side, and does *not reproduce* it otherwise; a range of ours is judged by its worse
end. Two rules keep a verdict honest to the claim's words:

* **direction** (``Claim.holds``): a claim "A better than B" (a ratio above 1, a gain above 0) is reproduced
  only if ours has A better than B, whatever the tolerance -- "marginally better" is not reproduced by
  "marginally worse";
* **exceeded** (``Claim.exceedable``): only a comparison with the paper's own baseline (FlashInfer, Select+Fit,
  uniform allocation, Adam, the oracle) can be exceeded; ours against a stand-in (this study's SplitZip-style codec,
  its own engine for SGLang), a time on other hardware or a property of the model reads "reproduced" there.

Summary counts count each claim of a paper once: :data:`CLAIM_GROUPS` names the rows that judge one claim
(on two GPUs, overall and per ratio, in two tables) and which of them counts. A claim whose quantity ours does not measure the same way (the chapter says how) reads "not
comparable". Rows of this project's own measurements that the papers do not make read "beyond the paper".
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import pandas as pd

from zipkv.study import paper_values as pv
from zipkv.study.chapters import restore as restore_chapter
from zipkv.study.committed import table1_kvsculpt
from zipkv.study.settings import (PAPER_CARD, PROJECT_TARGETS, THROUGHPUT_MMA_BASELINE_MODEL, THROUGHPUT_PAPER_MODEL, THROUGHPUT_UNFUSED_MODEL, ZIPFUSION_PAPER)

COLUMNS = ["paper", "item", "claim", "paper_value", "our_value", "verdict", "tolerance", "chapter"]
VERDICTS = ("reproduced", "exceeded", "not reproduced", "not comparable", "not yet run", "beyond the paper")
BEYOND = "beyond the paper"
NOT_COMPARABLE = "not comparable"


class Measured(NamedTuple):
    """Ours: ``value`` (a number, a (lo, hi) range or a label) judged, ``text`` shown."""

    value: object
    text: str


@dataclass(frozen=True)
class Claim:
    paper: str
    item: str
    claim: str
    chapter: str
    """Results stem of the chapter that measures it (= its notebook's name)."""
    paper_value: object
    """A number, a (lo, hi) range, a label, or None for a row beyond the paper."""
    ours: Callable[["Results"], object] | None
    """Computes ours from the results tables; None when no chapter table holds this quantity."""
    better: str | None = "higher"
    slack: float = 1.05
    fmt: str = "{:.2f}×"
    comparable: bool = True
    """False: ours measures another quantity than the paper's number (the chapter says how); shown, not judged."""
    holds: tuple[str, float] | None = None
    """The claim's direction, an inequality ours must satisfy to be reproduced whatever the tolerance: ``(">", 1.0)``
    for "A better than B" stated as a ratio above 1, ``("<", 1.0)`` for a KL ratio below 1, ``(">", 0.0)`` for a gain."""
    exceedable: bool = False
    """Whether ours beyond the paper's number on the better side reads "exceeded": only where ours compares the paper's
    method with the paper's own baseline, measured as the paper does."""


class Results:
    """The results tables of one profile (``<directory>/<stem>.csv``), each read once."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._tables: dict[str, pd.DataFrame] = {}

    def has(self, stem: str) -> bool:
        return (self.directory / f"{stem}.csv").is_file()

    def __getitem__(self, stem: str) -> pd.DataFrame:
        if stem not in self._tables:
            self._tables[stem] = pd.read_csv(self.directory / f"{stem}.csv")
        return self._tables[stem]


def _span(values) -> tuple[float, float]:
    values = [float(v) for v in values]
    return (min(values), max(values))


def _fmt(value, fmt: str) -> str:
    if value is None:
        return "–"
    if isinstance(value, str):
        return value
    if isinstance(value, tuple):
        lo, hi = (fmt.format(v) for v in value)
        if lo == hi:
            return lo
        unit = re.search(r"[^\d.]*$", lo).group(0)  # one unit for both ends: "5.3–30.8 ms"
        return f"{lo[:len(lo) - len(unit)] if hi.endswith(unit) else lo}–{hi}"
    return fmt.format(value)


def tolerance(paper, slack: float) -> str:
    """The widening of the paper's number that still reads "reproduced", as the findings table shows it."""
    if paper is None or isinstance(paper, str):
        return ""
    if slack <= 1.001:
        return "exact"
    return f"±{100 * (slack - 1):.0f} %" if slack < 1.5 else f"within {slack:g}×"


_HOLDS = {">": lambda a, b: a > b, ">=": lambda a, b: a >= b, "<": lambda a, b: a < b, "<=": lambda a, b: a <= b}


def judge(paper, ours, better: str | None, slack: float, *, holds: tuple[str, float] | None = None,
          exceedable: bool = True) -> str:
    """The verdict of ``ours`` against ``paper`` (see the module docstring): ``holds`` the claim's direction, which
    every value of ours must satisfy; ``exceedable`` False turns "exceeded" into "reproduced"."""
    if paper is None:
        return BEYOND
    if ours is None:
        return "not yet run"
    if isinstance(paper, str) or isinstance(ours, str):
        return "reproduced" if str(ours) == str(paper) else "not reproduced"
    lo, hi = paper if isinstance(paper, tuple) else (paper, paper)
    o_lo, o_hi = ours if isinstance(ours, tuple) else (ours, ours)
    if any(math.isnan(v) for v in (o_lo, o_hi)):
        return "not reproduced"
    if holds is not None:
        op, bound = holds
        if op not in _HOLDS:
            raise ValueError(f"holds={holds!r}: expected an operator of {sorted(_HOLDS)} and a number")
        if not (_HOLDS[op](o_lo, bound) and _HOLDS[op](o_hi, bound)):      # A not better than B: the claim fails
            return "not reproduced"
    if better == "higher":
        verdict = "exceeded" if o_lo > hi * slack else "reproduced" if o_lo >= lo / slack else "not reproduced"
    elif better == "lower":
        verdict = "exceeded" if o_hi < lo / slack else "reproduced" if o_hi <= hi * slack else "not reproduced"
    else:
        verdict = "reproduced" if lo / slack <= o_lo and o_hi <= hi * slack else "not reproduced"
    return "reproduced" if verdict == "exceeded" and not exceedable else verdict


def judge_claim(claim: "Claim", ours) -> str:
    """:func:`judge` with ``claim``'s number, direction, tolerance and whether it can be exceeded."""
    return judge(claim.paper_value, ours, claim.better, claim.slack, holds=claim.holds, exceedable=claim.exceedable)


# ---------------------------------------------------------------- ours, per chapter table

def _latency_speedups(kv_data: str, stem: str = "zipfusion_attention_latency", card: str = "H200"):
    def ours(res: Results):
        t = res[stem]
        t = t[(t["shape"] == "llama3.1-8b") & (t.kv_data == kv_data) & (t.method == "zipkv_compressed")]
        t = t[t.ctx.isin(ZIPFUSION_PAPER.contexts) & t.batch.isin(ZIPFUSION_PAPER.batches)]
        best = t.groupby(["ctx", "batch"]).speedup_vs_flashinfer_tc.max()  # the faster of our kernels per point
        lo, hi = _span(best)
        return Measured((lo, hi), f"{lo:.3f}–{hi:.3f}× ({len(best)} points, {card})")
    return ours


def _improvement(r: float):
    def ours(res: Results):
        kl = res["kvsculpt_main"].groupby(["method", "ratio"]).kl.mean()
        return kl["select_fit", r] / kl["kvsculpt", r]
    return ours


def _improvement_span(res: Results):
    return _span(_improvement(r)(res) for r in pv.KVSCULPT_TABLE1_IMPROVEMENT)


def _joint_gain(res: Results):
    kl = res["kvsculpt_main"].groupby(["method", "ratio"]).kl.mean()
    return float((kl["select_fit"] / kl["joint_opt"]).mean())


def _appendix_joint_gain(res: Results):
    kl = res["kvsculpt_appendix"].groupby(["method", "ratio"]).kl.mean()
    return float((kl["select_fit"] / kl["joint_opt"]).mean())


PAPER_APPENDIX_JOINT_GAIN = sum(pv.KVSCULPT_APPENDIX["select_fit"][r][0] / pv.KVSCULPT_APPENDIX["joint_opt"][r][0]
                                for r in pv.KVSCULPT_APPENDIX["select_fit"]) / len(pv.KVSCULPT_APPENDIX["select_fit"])


METHOD_LABELS = {"random": "Random", "attention_score": "Attention Score", "select_fit": "Select+Fit",
                 "select_fit_dense": "Select+Fit, n_s = N", "select_fit_future": "Select+Fit on zipkv's queries",
                 "joint_opt": "Joint Opt", "kvsculpt": "KVSculpt", "am_highest": "Attention Matching, highest-attention keys",
                 "am_omp": "Attention Matching, OMP keys", "am_lbfgs": "Attention Matching, L-BFGS keys",
                 "attention_matching": "Attention Matching", "zipkv": "zipkv"}
"""What a reader sees for each method the results tables name."""


def label(method: str) -> str:
    """A method's name for readers (:data:`METHOD_LABELS`), the id itself where it has none."""
    return METHOD_LABELS.get(method, method)


def _best_baseline(table: pd.DataFrame) -> str:
    best = table.groupby(["ratio", "method"]).kl.mean().unstack().idxmin(axis=1)
    return best.mode().iloc[0] if best.nunique() > 1 else best.iloc[0]


def _paper_best_baseline() -> str:
    rows = [{"ratio": r, "method": m, "kl": v[0]} for m, by_r in pv.KVSCULPT_APPENDIX.items() for r, v in by_r.items()]
    return _best_baseline(pd.DataFrame(rows))


def _per_window(res: Results, column: str):
    t = res["kvsculpt_per_window"]
    return t[column]


def _easy_share(res: Results):
    t = res["kvsculpt_per_window"]
    easy = int((t.label == "easy").sum())
    return Measured(easy / len(t), f"{easy} of {len(t)} ({easy / len(t):.0%})")


def _lossless_bits(res: Results):
    t = res["zipfusion_lossless_format"]
    c = t.compressible_blocks
    implied = ((t.bits_per_value - 16 * (1 - c)) / c)[c > 0]  # bits of a compressed block, metadata excluded
    return _span(implied)


def _lossless_exact(res: Results):
    text = _executed_text(res, "zipfusion_lossless_format")
    hit = re.search(r"Bit-exact: (\d+) pages.*?and (\d+) pages through the Triton pack kernel", text or "", re.S)
    if not hit:
        return None
    return Measured("bit-exact", f"bit-exact: {int(hit.group(1)):,} pages (torch reference), "
                                 f"{int(hit.group(2)):,} (Triton kernel)")


def _read_identity(res: Results):
    from zipkv.study.chapters.lossless import SAME_KERNEL

    if not res.has("zipfusion_lossless_identity"):
        return None
    t = res["zipfusion_lossless_identity"]
    reads, gens = t[t.check == "read"], t[t.check == "generation"]
    same = gens[gens.comparison == SAME_KERNEL]
    if reads.empty or same.empty:              # a run without the Gluon kernel (the CPU)
        return None
    kernels = ", ".join(k.capitalize() for k in sorted(reads.kernel.unique()))
    return Measured(None, f"{int(reads.identical.sum()):,} of {int(reads.outputs.sum()):,} attention outputs "
                          f"bit-identical ({kernels}); greedy tokens identical in {int(same.identical.sum())} of "
                          f"{len(same)} requests")


def _executed_text(res: Results, stem: str) -> str | None:
    import nbformat

    for path in (res.directory.parent.parent / "book").glob(f"*/{stem}.ipynb"):
        nb = nbformat.read(path, as_version=4)
        return "\n".join(str(o.get("data", {}).get("text/markdown", o.get("text", "")))
                         for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    return None


def _cache_fraction(res: Results):
    t = res["zipfusion_lossless_format"]
    size = t.groupby("tensor").size_fraction.mean()
    return Measured(None, f"cache at {100 * t.size_fraction.mean():.1f} % of BF16 (K {100 * size['K']:.1f} %, "
                          f"V {100 * size['V']:.1f} %)")


def _compressible(res: Results):
    t = res["model_data_kv_cache"]
    return Measured(None, f"compressible blocks: K {100 * t.K_token.mean():.1f} %, V {100 * t.V_token.mean():.1f} % "
                          f"token-major (the measured mix), K {100 * t.K_channel.mean():.1f} %, "
                          f"V {100 * t.V_channel.mean():.1f} % channel-major (SmolLM2, PG19)")


def _distilled_prefix(res: Results):
    """The distilled-prefix chapter's bytes (KVSculpt's pairs in ZipFusion's format over the raw context), per
    ratio, and its lossless runs."""
    t = res["distilled_prefix"]
    full = t[t.method == "full context"]
    parts = [f"r = {r:g}: {100 * g.memory_vs_raw_context.mean():.1f} % (V blocks compressible "
             f"{100 * g.frac_compressed_v.mean():.0f} %)" for r, g in t[t.method != "full context"].groupby("ratio")]
    return Measured(None, "a KVSculpt prefix stored in ZipFusion's format takes, of the raw context's bytes, "
                          + "; ".join(parts) + f" (the model's own KV: {100 * full.memory_vs_raw_context.mean():.1f} %, "
                          f"V {100 * full.frac_compressed_v.mean():.0f} %); packed pages lossless in "
                          f"{int(t.lossless.sum())} of {len(t)} runs")


def _pack(res: Results):
    """The pack kernel's table, committed beside the latency chapter's (which shows it), or None without it."""
    if not res.has("zipfusion_pack_throughput"):
        return None
    t = res["zipfusion_pack_throughput"]
    return Measured(None, f"{t.input_tbps.min():.2f} TB/s of input, slowest head size "
                          f"(project target ≥ {PROJECT_TARGETS.pack_input_tbps:g} TB/s)")


def _per_token_gain(res: Results):
    """The latency chapter's context-sweep fit (:func:`zipkv.study.chapters.latency.context_fit`) at the Llama-3.1-8B
    shape: the all-compressed kernel's gain per token over FlashInfer TC and each launch's fixed cost."""
    from zipkv.study.chapters.latency import SHAPE, fit_pair, read_context_fit

    fit = read_context_fit(res.directory)
    pair = None if fit is None else fit_pair(fit, SHAPE)
    if pair is None:
        return None
    o, b = pair
    return Measured(None, f"{b.us_per_1k / o.us_per_1k:.3f}× FlashInfer TC per token (the bytes allow "
                          f"{b.mb_per_1k / o.mb_per_1k:.3f}×), {o.fixed_us:.1f} against {b.fixed_us:.1f} µs fixed per "
                          f"launch (Llama-3.1-8B shape, every block compressible, batch 64, {o.contexts} tokens)")


def _resources(res: Results):
    t = res["zipfusion_kernel_resources"]
    return Measured(None, f"{int((t.spill_stores == 0).sum())} of {len(t)} compiled kernels without register spills")


RESTORE_CODECS = ("splitzip", "huffman")
"""The restore-before-attention codecs of the §II-B table (its other rows: FlashInfer on BF16, ZipFusion)."""


def _restore_ms(column: str):
    """``column`` of :func:`zipkv.study.chapters.restore.step_times` (``restore_ms`` or ``attention_ms``) over the codecs
    that restore first."""
    def ours(res: Results):
        t = restore_chapter.step_times(res["zipfusion_restore_baselines"])
        t = t.loc[t.index.isin(RESTORE_CODECS), column]
        lo, hi = _span(t)
        return Measured((lo, hi), f"{_fmt((lo, hi), '{:.1f} ms')} ({len(t)} codecs)")
    return ours


def _restore_share(res: Results):
    """The restore's share of restore + attention per decode step, over the codecs that restore first (the paper's
    share is of its instrumented decode step, which also holds the rest of the layer: not the same quantity)."""
    t = restore_chapter.step_times(res["zipfusion_restore_baselines"])
    t = t[t.index.isin(RESTORE_CODECS)]
    lo, hi = _span(t.restore_ms / t.step_ms)
    return Measured((lo, hi), f"{100 * lo:.1f}–{100 * hi:.1f} % of restore + attention ({len(t)} codecs)")


def _latency_8192x64(stem: str = "zipfusion_attention_latency", card: str = "H200", judged: bool = False):
    """Fig. 4's printed point, Llama-3.1-8B shape at 8192 tokens × batch 64: FlashInfer TC and our fastest
    compressed kernel, on the measured mix and all compressible; ``judged``: the measured mix's µs is the value
    judged (the paper's Fig. 4 times captured KV), on the paper's card."""
    def ours(res: Results):
        t = res[stem]
        t = t[(t["shape"] == "llama3.1-8b") & (t.ctx == 8192) & (t.batch == 64)]
        fi = float(t[t.method == "flashinfer_tc"].latency_us.min())
        us = t[t.method == "zipkv_compressed"].groupby("kv_data").latency_us.min()
        return Measured(float(us["measured mix"]) if judged else None,
                        f"FlashInfer TC {fi:.1f} µs → ours {us['measured mix']:.1f} µs (measured mix), "
                        f"{us['all compressible']:.1f} µs (all compressible), {card}")
    return ours


def _card_gain(batch: int | None = None):
    """On the paper's card: ZipFusion's tokens/s over the faster of our two uncompressed engines (token layouts and
    the Triton kernel, the H200 chapter's baseline; the mma layouts and the Gluon kernel's raw path, timed at the
    largest batch only), minus 1, at its largest batch (``batch`` None) or at ``batch``."""
    def ours(res: Results):
        from zipkv.study.chapters.throughput import largest_batch_rows

        t = res[f"{PAPER_CARD}_throughput"]
        big = t[t.model == THROUGHPUT_PAPER_MODEL]
        if batch is None:
            z, u = (largest_batch_rows(big, m).iloc[0] for m in ("zipfusion", "uncompressed"))
        else:
            z, u = (big[(big.method == m) & (big.batch == batch)].iloc[0] for m in ("zipfusion", "uncompressed"))
        mma = t[(t.model == THROUGHPUT_MMA_BASELINE_MODEL) & (t.method == "uncompressed")] if batch is None else t.iloc[:0]
        base = max([u] + [r for _, r in mma.iterrows()], key=lambda r: r.tokens_per_s)
        layouts = "tensor-core layout" if base.model == THROUGHPUT_MMA_BASELINE_MODEL else "token layout"
        other = (f"; over the token layout's {u.tokens_per_s:,.0f}: {z.tokens_per_s / u.tokens_per_s - 1:.1%}"
                 if base is not u else "")
        gain = z.tokens_per_s / base.tokens_per_s - 1
        return Measured(gain, f"{gain:.1%} ({z.tokens_per_s:,.0f} tokens/s at batch {z.batch} over {base.tokens_per_s:,.0f} "
                              f"at batch {base.batch}, {layouts}{other}), H100")
    return ours


def _at_max_batch(t: pd.DataFrame) -> pd.DataFrame:
    return t[t.batch == t.max_batch]


def _fig5_rows(res: Results) -> pd.DataFrame:
    """The throughput table's rows in the paper's Fig. 5 setting (if it has none, an older table: all rows but the
    side runs' of the same setting)."""
    t = res["zipfusion_throughput"]
    paper = t[t.model == THROUGHPUT_PAPER_MODEL]
    return paper if len(paper) else t[~t.model.isin([THROUGHPUT_UNFUSED_MODEL, THROUGHPUT_MMA_BASELINE_MODEL])]


def _max_batch_ratio(res: Results):
    t = _fig5_rows(res)
    rows = []
    for model, g in t.groupby("model"):
        mb = g.groupby("method").max_batch.max()
        rows.append((mb["zipfusion"] / mb["uncompressed"], f"{model}: {mb['uncompressed']} → {mb['zipfusion']}"))
    lo, hi = _span(r for r, _ in rows)
    return Measured((lo, hi), "; ".join(text for _, text in rows) + f" ({lo:.2f}–{hi:.2f}×)" if lo != hi
                    else "; ".join(text for _, text in rows) + f" ({lo:.2f}×)")


def _throughput_ratio(baselines: tuple[str, ...], minus_one: bool, batch: int | None = None):
    def ours(res: Results):
        t = _fig5_rows(res)
        values = []
        for _, g in t.groupby("model"):
            g = g[g.batch == batch] if batch else _at_max_batch(g)
            tps = g.groupby("method").tokens_per_s.max()
            ref = max(tps[b] for b in baselines if b in tps)
            values.append(tps["zipfusion"] / ref - (1 if minus_one else 0))
        return _span(values)
    return ours


def _vs_mma_baseline(res: Results):
    """ZipFusion's tokens/s at its largest batch over the uncompressed engine's in the mma layouts (the engine's own
    default on a GPU, the Gluon kernel's raw path), where the throughput run timed it."""
    from zipkv.study.chapters.throughput import vs_mma_baseline

    if not res.has("zipfusion_throughput"):       # the claim's page is the appendix; its numbers are the chapter's run
        return None
    t = res["zipfusion_throughput"]
    vs = vs_mma_baseline(_fig5_rows(res), t[(t.model == THROUGHPUT_MMA_BASELINE_MODEL) & (t.method == "uncompressed")])
    if vs is None:
        return None
    ratio, z, m = vs
    return Measured(ratio, f"{ratio:.3f}× ({z.tokens_per_s:,.0f} tokens/s at batch {z.batch} over "
                           f"{m.tokens_per_s:,.0f} at batch {m.batch})")


def _throughput_runs(res: Results):
    """The throughput chapter's table of GPU runs (:data:`zipkv.study.chapters.throughput.RUNS_SIDE`): the range of ZipFusion's
    tokens/s over uncompressed's at the largest batches, and in how many runs the project's bar holds; None before two
    runs are in it."""
    from zipkv.study.chapters.throughput import BARS, RUNS_SIDE

    stem = f"zipfusion_throughput_{RUNS_SIDE}"
    if not res.has(stem) or len(res[stem]) < 2:
        return None
    r = res[stem].tokens_per_s_ratio
    lo, hi = _span(r)
    return Measured((lo, hi), f"{_fmt((lo, hi), '{:.3f}×')} over {len(r)} runs (ZipFusion's SM clock "
                              f"{_fmt(_span(res[stem].zipfusion_sm_clock_mhz), '{:.0f} MHz')}); project target ≥ "
                              f"{BARS['tokens_per_s']}× held in {int((r >= BARS['tokens_per_s']).sum())}")


def _optimizer_gap(kind: str):
    """Per layer, Adam over L-BFGS (mean over windows), or one L-BFGS run over the oracle on the windows the
    oracle ran on (the chapter's ``oracle_windows``)."""
    def ours(res: Results):
        t = res["kvsculpt_optimizer"]
        if kind != "adam":
            t = t[t.window.isin(t[t.optimizer == "oracle"].window)]
        mse = t.groupby(["layer", "optimizer"]).mse_train.mean().unstack()
        gap = mse.adam / mse.lbfgs if kind == "adam" else mse.lbfgs / mse.oracle - 1
        return _span(gap)
    return ours


def _adam_kl(res: Results):
    """§5.2 from the optimizer chapter's side table (:func:`zipkv.study.experiments.analysis.optimizer_kl`): Adam's KL over
    L-BFGS's on the easy windows, or on every window where none is easy; None before a run committed it."""
    from zipkv.study.experiments.analysis import adam_over_lbfgs

    if not res.has("kvsculpt_optimizer_kl"):
        return None
    _, (ratio, which) = adam_over_lbfgs(res["kvsculpt_optimizer_kl"])
    lo, hi = _span(ratio)
    n = len(ratio)
    where = f"{n} easy window{'s' * (n > 1)}" if which == "easy" else f"all {n} windows, none easy"
    return Measured((lo, hi), f"{_fmt((lo, hi), '{:.2f}×')} ({where})")


def _best_far_strategy(res: Results):
    far = res["kvsculpt_queries"].query("horizon == 'far'").groupby("strategy").cosine.mean()
    return Measured(far.idxmax(), f"{far.idxmax()} ({far.max():.3f})")


def _ratio_of_means(stem: str, column: str, reference: str = "uniform_kl"):
    """Mean KL of ``column`` over mean KL of ``reference``: the papers' "Mean" rows (Tables 5 and 6)."""
    def ours(res: Results):
        t = res[stem]
        return float(t[column].mean() / t[reference].mean())
    return ours


def _mean(stem: str, column: str, query: str | None = None):
    def ours(res: Results):
        t = res[stem]
        return float((t.query(query) if query else t)[column].mean())
    return ours


def _median(stem: str, column: str):
    """Median of ``column`` (the chapters' statistic over layers, heads and windows); None while ``stem`` is absent."""
    def ours(res: Results):
        return float(res[stem][column].median()) if res.has(stem) else None
    return ours


def _sweep_table(res: Results, name: str) -> pd.DataFrame | None:
    """Table ``name`` (``heads``, ``layers``, ...) of the budget chapters' cached sweep (``kvsculpt_budget_sweep.json``,
    committed with its parameters); None while absent."""
    import json

    path = res.directory / "kvsculpt_budget_sweep.json"
    return pd.DataFrame(json.loads(path.read_text())["tables"][name]) if path.is_file() else None


def _layer_pilot_spread(res: Results):
    """Max over windows of (largest / smallest per-layer pilot MSE, mean over the layer's heads), from the budget
    chapters' cached sweep; None while absent."""
    heads = _sweep_table(res, "heads")
    if heads is None:
        return None
    per_layer = heads.groupby(["window", "layer"]).pilot.mean().unstack()
    spread = per_layer.max(axis=1) / per_layer.min(axis=1)
    return Measured(float(spread.max()), f"up to {spread.max():.0f}× (median over {len(spread)} windows "
                                         f"{spread.median():.0f}×)")


def _layer0_over_median(res: Results):
    """Layer 0's pilot MSE over the median layer's (mean over the layer's heads), median over windows, as the pilot
    chapter computes it, from the budget chapters' cached sweep; None while absent."""
    heads = _sweep_table(res, "heads")
    if heads is None:
        return None
    pilot = heads.groupby(["window", "layer"]).pilot.mean().unstack(0)                # [layer, window]
    return float((pilot.iloc[0] / pilot.median()).median())


def _commonest_layer_share(layers: pd.Series) -> tuple[int, int, int]:
    """(the commonest most-asymmetric layer, on how many sequences, of how many)."""
    top = int(layers.mode().iloc[0])
    return top, int((layers == top).sum()), len(layers)


def _asymmetric_layer(res: Results):
    top, n, of = _commonest_layer_share(res["kvsculpt_head_asymmetry"].layer_of_max)
    return Measured(n / of, f"layer {top} on {n} of {of} windows")


def _select_fit_floor(res: Results):
    """Select+Fit's KL at r = 0.3 per window against the paper's "KL > 0.1 for all sequences"."""
    kl = res["kvsculpt_per_window"].select_fit
    above = int((kl > pv.KVSCULPT_SELECT_FIT_ABOVE).sum())
    label = _above_label() if above == len(kl) else f"above {pv.KVSCULPT_SELECT_FIT_ABOVE:g} on {above} of {len(kl)} windows"
    return Measured(label, f"{label} (lowest {kl.min():.3g})")


def _above_label() -> str:
    return f"above {pv.KVSCULPT_SELECT_FIT_ABOVE:g} on every sequence"


def _best_near_strategy(res: Results):
    near = res["kvsculpt_queries"].query("horizon == 'near'").groupby("strategy").cosine.mean()
    return Measured(near.idxmax(), f"{near.idxmax()} ({near.max():.3f})")


def _wins(res: Results):
    t = res["kvsculpt_pilot_budget"]
    wins = int((t.pilot_kl < t.uniform_kl).sum())
    return Measured(wins / len(t), f"{wins} of {len(t)} ({wins / len(t):.0%})")


def _head_wins(res: Results):
    t = res["kvsculpt_head_budget"]
    wins = int((t.per_layer_head_vs_uniform < t.per_layer_vs_uniform).sum())
    return Measured(wins / len(t), f"{wins} of {len(t)} ({wins / len(t):.0%})")


def _best_alpha(res: Results):
    t = res["kvsculpt_dampening"].query("signal == 'vnorm'").groupby("alpha").kl.mean()
    return Measured(float(t.idxmin()), f"α = {t.idxmin():g}")


def _growth(label: str, how: str):
    def ours(res: Results):
        t = res["kvsculpt_error_propagation"].query(f"label == '{label}'").growth_first_to_last
        return float(t.max() if how == "max" else t.mean())
    return ours


def _concentration(column: str):
    """``column`` on the hardest window (the highest KL), as the chapter and the paper report it."""
    def ours(res: Results):
        t = res["kvsculpt_error_propagation"]
        return float(t.loc[t.kl.idxmax(), column])
    return ours


def _weak_correlation(rho: float) -> Measured:
    return Measured("weak" if abs(rho) < 0.5 else "not weak", f"ρ = {rho:.2f} ({'weak' if abs(rho) < 0.5 else 'not weak'}: |ρ| < 0.5 is weak)")


def _kl_sources_correlation(res: Results):
    t = res["kvsculpt_kl_sources"]
    per_layer = t[t.layer >= 0].pivot_table(index="layer", columns="method", values=["kl", "objective"])
    objective = per_layer["objective"].kvsculpt / per_layer["objective"].select_fit
    kl = per_layer["kl"].kvsculpt / per_layer["kl"].select_fit
    rho = float(objective.rank().corr(kl.rank()))
    return Measured(None, f"Spearman ρ = {rho:.2f} over {len(kl)} layers (KVSculpt / Select+Fit: per-layer objective "
                          f"against single-layer KL)")


def _error_correlation(res: Results):
    """Across windows (the paper compares sequences): Spearman correlation of a window's per-layer compression
    MSE (mean over layers, from the budget chapters' cached sweep) with its end-to-end KL; None while absent."""
    layers = _sweep_table(res, "layers")
    if layers is None:
        return None
    kl = res["kvsculpt_error_propagation"].set_index("window").kl
    mse = layers.groupby("window").loss.mean().reindex(kl.index)
    m = _weak_correlation(float(mse.rank().corr(kl.rank())))
    return Measured(m.value, m.text + f", over {len(kl)} windows")


def _distill_seconds(solver: str):
    def ours(res: Results):
        t = res["distill_speed"]
        row = t[t.problem_shape.str.startswith("Qwen") & (t.ctx == 2048) & (t.ratio == 0.3) & (t.solver == solver)]
        return float(row.seconds.iloc[0])
    return ours


def _fp8_quality(res: Results):
    """The FP8 chapter: what an e4m3 KV cache costs in KL against ZipFusion's lossless format, per scaling."""
    t = res["zipfusion_fp8_quality"]
    kl, agree = t.groupby("format").kl.mean(), t.groupby("format").top1_agreement.mean()
    parts = [f"{name} {kl[f]:.2g}" for f, name in (("fp8_e4m3 unit", "scale 1"), ("fp8_e4m3 per_layer", "per-layer scale"))
             if f in kl]
    return Measured(None, f"FP8 e4m3 cache: mean KL {', '.join(parts)} nats/token, the most likely token changed at "
                          f"{100 * (1 - agree.get('fp8_e4m3 unit', 1.0)):.1f} % of positions; ZipFusion's format "
                          f"{kl.get('zipfusion', float('nan')):.2g} ({t.window.nunique()} PG19 windows of "
                          f"{int(t.n_context.iloc[0])} tokens, SmolLM2-135M)")


def _escape_format(res: Results):
    """The escape-format chapter: bits per value of keys and values per model, the escape format as stored against
    ZipFusion's, escapes per block (mean, most), against this project's target
    (:func:`zipkv.study.chapters.escape.summary`)."""
    from zipkv.study.chapters.escape import summary

    t = res["escape_format"]
    s, bar = summary(t), PROJECT_TARGETS.escape_bits_per_value
    parts = []
    for model in dict.fromkeys(s.index.get_level_values(0)):
        k, v = s.loc[(model, "keys")], s.loc[(model, "values")]
        parts.append(f"{model}: keys {k['escape format (bits/value)']:.2f}, values {v['escape format (bits/value)']:.2f} "
                     f"bits/value (ZipFusion's format {k['ZipFusion (bits/value)']:.2f}, "
                     f"{v['ZipFusion (bits/value)']:.2f}), {k['escapes per block']:.2f} and {v['escapes per block']:.2f} "
                     f"escapes per block (most {int(k['most in a block'])}, {int(v['most in a block'])})")
    over = int((s["escape format (bits/value)"] > bar).sum())
    return Measured(None, "; ".join(parts) + f"; project target ≤ {bar:g} bits/value "
                          + (f"missed by {over} of {len(s)} tensors" if over else "met by every tensor")
                          + f" ({t.window.nunique()} PG19 windows of {int(t.context.iloc[0])} tokens, every layer)")


def _memory_manager(res: Results):
    """The memory manager chapter: chunks reassigned between layers in the shared pool's run, and the largest batch and
    tokens/s of each part of the manager on the same trace and budget."""
    t = res["memory_manager"].set_index("variant")
    sh = t.loc["shared pool"]
    runs = ", ".join(f"{v} {int(r.max_batch)} at {r.tokens_per_s:.0f} tokens/s" for v, r in t.iterrows())
    gpu = ""
    if res.has("memory_manager_gpu"):      # the serving curves of the GPU run
        from zipkv.study.chapters.memory_manager import gpu_sustained
        g = gpu_sustained(res["memory_manager_gpu"])
        gpu = (f"; serving on a GPU (Llama-3.1-8B's shapes, p99 TTFT ≤ {g['limit']:g} s): uncompressed sustains "
               f"{g['uncompressed']}, ZipFusion {g['zipfusion']} (time per output token {g['tpot_ratio']:.1f}×)")
    return Measured(None, f"{int(sh.chunks_reassigned)} chunks reassigned between layers, {int(sh.retractions)} "
                          f"retraction(s); largest batch: {runs} ({int(sh.requests)} requests of "
                          f"{int(sh.prompt_lengths_min)}-{int(sh.prompt_lengths_max)} + {int(sh.output_lengths_min)}-"
                          f"{int(sh.output_lengths_max)} tokens under one budget, {sh.model} on the {sh.device}, "
                          f"{sh.clock} clock){gpu}")


def _kl_readings(res: Results):
    """The why-KVSculpt page: how far the readings of the paper's KL that its text leaves open move ours (the sum
    over tokens aside, which its own numbers rule out)."""
    t = res["kvsculpt_why_definitions"]
    per = t.pivot_table(index=["window", "ratio", "method"], columns="definition", values="kl")
    moves = [(per[d] / per["ours"]).median() for d in per.columns if d not in ("ours", "sum")]
    ours = t[t.definition == "ours"].groupby(["method", "ratio"]).kl.mean()
    scale = pd.Series([pv.KVSCULPT_TABLE1[m][r] / kl for (m, r), kl in ours.items()
                       if r in pv.KVSCULPT_TABLE1.get(m, {})]).median()
    return Measured(None, f"the readings of the paper's KL its text leaves open move ours by {min(moves):.2f}–"
                          f"{max(moves):.2f}× (median over {per.shape[0]} runs): none explains the {scale:.1f}× "
                          "between the paper's baselines and ours")


def _kvpress(res: Results):
    """The kvpress chapter: zipkv's distiller over the best kvpress press per model and kept fraction ≤ 0.5, and the
    task accuracy at 4× and 8× where it ran (:mod:`zipkv.study.chapters.kvpress_presses`)."""
    from zipkv.study.chapters.kvpress_presses import by_fraction, label as press_label, task_gaps

    f = by_fraction(res["kvpress_presses"])
    f = f[f.kept_fraction <= 0.5]
    parts = []
    for model, g in f.groupby("model", sort=False):
        low, high = f"{g.ratio.min():.2f}", f"{g.ratio.max():.2f}"
        parts.append(f"{model} {low if low == high else low + '–' + high}× the best press's KL at kept "
                     f"{g.kept_fraction.max():g}–{g.kept_fraction.min():g} ({g.windows.min()} windows"
                     + ("" if g.lowest.all() else f"; not the lowest of all methods at {int((~g.lowest).sum())} "
                        "fraction(s)") + ")")
    text = "; ".join(parts)
    side = res.directory / "kvpress_presses_task.csv"
    task = pd.read_csv(side) if side.is_file() else None
    gaps = task_gaps(task) if task is not None else None
    if gaps is not None and len(gaps):
        text += "; task: " + ", ".join(f"{r.model} kept {r.kept_fraction:g}: zipkv {r.zipkv:.0%} ({r.zipkv_prompts} "
                                       f"prompts) vs {press_label(r.best_press)} {r.best_press_accuracy:.0%}"
                                       for r in gaps.itertuples())
        rereading = task[task.method == "zipkv_reconstruction"].sort_values("kept_fraction", ascending=False)
        if len(rereading):
            text += "; with the re-reading probe for questions about the context: " + ", ".join(
                f"kept {r.kept_fraction:g}: {r.accuracy:.0%} ({r.prompts} prompts)" for r in rereading.itertuples())
    return Measured(None, text)


def _solver_agreement(res: Results):
    t = res["solver_agreement"]
    median = float((t.batched / t.reference).median())
    return Measured(None, f"median batched / reference final loss {median:.3f} over {len(t)} problems "
                          f"(project target within {100 * PROJECT_TARGETS.solver_loss_within:g} %)")


_SELECT_FIT = ("select_fit", "select_fit_dense", "select_fit_future")
"""The beyond chapter's Select+Fit variants (``zipkv.study.experiments.beyond.SELECT_FIT_VARIANTS``, not imported: no torch here)."""


def _zipkv_against_baselines(t: pd.DataFrame) -> str:
    """zipkv's mean KL in ``t`` (one ratio) against the best Select+Fit variant and Attention Matching."""
    kl, per = t.groupby("method").kl.mean(), t.pivot_table(index="window", columns="method", values="kl")
    text = f"zipkv mean KL {kl['zipkv']:.3g}"
    sf = [x for x in _SELECT_FIT if x in kl]
    if sf:
        best = min(sf, key=kl.get)
        text += (f", {kl[best] / kl['zipkv']:.2f}× below the best Select+Fit ({label(best)}, {kl[best]:.3g}; lower on "
                 f"{int((per.zipkv < per[best]).sum())} of {per[[best, 'zipkv']].dropna().shape[0]} windows)")
    if "attention_matching" in kl:
        text += f", {kl['attention_matching'] / kl['zipkv']:.2f}× below Attention Matching"
    return text


def _beyond(res: Results):
    """zipkv's distiller at r = 0.3 (the issue's bar; the lowest ratio run when 0.3 is absent) against the best
    Select+Fit variant, Attention Matching and, where it ran on the same windows, KVSculpt (the chapter's rows
    and those of ``kvsculpt_beyond_extra.csv`` it takes: :func:`zipkv.study.chapters.beyond.with_extra_rows`)."""
    from zipkv.study.chapters.beyond import with_extra_rows

    t, _ = with_extra_rows(res["kvsculpt_beyond"], res.directory / "kvsculpt_beyond_extra.csv")
    t = t[t.ratio == (0.3 if (t.ratio == 0.3).any() else t.ratio.min())]
    r, kl = t.ratio.iloc[0], t.groupby("method").kl.mean()
    if "zipkv" not in kl:
        best = kl.idxmin()
        return Measured(None, f"r = {r:g}: best {label(best)} (mean KL {kl[best]:.3g})")
    text = f"r = {r:g}, {t[t.method == 'zipkv'].window.nunique()} windows: " + _zipkv_against_baselines(t)
    source = ""
    if "kvsculpt" not in kl and res.has("kvsculpt_main"):
        t, source = pd.concat([t, table1_kvsculpt(t, res["kvsculpt_main"])]), " of Table 1's run"
    if (t.method == "kvsculpt").any():
        both = t[t.window.isin(t[t.method == "kvsculpt"].window)]
        k = both.groupby("method").kl.mean()
        text += (f", {k['kvsculpt'] / k['zipkv']:.2f}× below KVSculpt (paper setting{source}, on its "
                 f"{both.window.nunique()} windows)")
    return Measured(None, text)


def _beyond_other_ratios(res: Results):
    """zipkv's distiller at the ratios other than 0.3 against the best baseline (any method but zipkv, by mean KL),
    over the chapter's rows and those of the separate runs in ``kvsculpt_beyond_extra.csv`` (the same model and
    settings; rows the chapter has are not taken: :func:`zipkv.study.chapters.beyond.with_extra_rows`)."""
    from zipkv.study.chapters.beyond import with_extra_rows

    t, _ = with_extra_rows(res["kvsculpt_beyond"], res.directory / "kvsculpt_beyond_extra.csv")
    parts = []
    for r, g in t[t.ratio != 0.3].groupby("ratio"):
        per = g.pivot_table(index="window", columns="method", values="kl")
        if "zipkv" not in per:
            continue
        per = per.dropna()
        base = per.drop(columns="zipkv").mean()
        best = base.idxmin()
        parts.append(f"r = {r:g}, {len(per)} windows: zipkv {per.zipkv.mean():.3g}, {base[best] / per.zipkv.mean():.1f}× "
                     f"below the best baseline ({label(best)}, {base[best]:.3g}; zipkv lower than every baseline on "
                     f"{int((per.zipkv < per.drop(columns='zipkv').min(axis=1)).sum())} of {len(per)} windows)")
    return Measured(None, "; ".join(parts)) if parts else None


def _step_breakdown(res: Results):
    """Where the throughput chapter's decode step goes at the largest batches (:func:`zipkv.study.chapters.throughput.step_table`):
    from the chapter's own profiled rows, else from the separate run ``zipfusion_engine_profile.csv``."""
    from zipkv.study.chapters.throughput import overlapped_rows, step_row, step_table

    big = _fig5_rows(res) if res.has("zipfusion_throughput") else None
    if big is not None and "replay_ms" in big.columns and big.replay_ms.notna().any():
        steps, where = step_table(big)[0], "the chapter's run"
    elif res.has("zipfusion_engine_profile"):
        run = res["zipfusion_engine_profile"].iloc[0]
        steps, where = step_table(res["zipfusion_engine_profile"])[0], f"a separate run: {run.device}, commit {run.commit}"
    else:
        return None
    steps = overlapped_rows(steps)
    u, z = step_row(steps, "uncompressed"), step_row(steps, "zipfusion")
    per = lambda x: x.attention_us_per_request_layer                                         # noqa: E731
    return Measured(None, f"attention {per(u) / per(z):.2f}× faster per request (batch {z.batch} vs {u.batch}); "
                          f"the rest of the step, {z.step_ms - z.attention_ms:.1f} ms (ZipFusion) and "
                          f"{u.step_ms - u.attention_ms:.1f} ms (uncompressed) of matrix products, other kernels, GPU "
                          f"idle and host, is paid per step: tokens/s {z.batch / u.batch:.3f} × {u.step_ms:.1f}/{z.step_ms:.1f} ms = "
                          f"{z.batch / u.batch * u.step_ms / z.step_ms:.3f}× ({where})")


def _second_model(res: Results):
    """The beyond chapter's second model (``kvsculpt_beyond_gemma.csv``) at r = 0.3: zipkv against the best
    Select+Fit variant and Attention Matching; None while that table is absent."""
    if not res.has("kvsculpt_beyond_gemma"):
        return None
    t = res["kvsculpt_beyond_gemma"]
    t = t[t.ratio == 0.3]
    from zipkv.study.chapters.escape import LABELS as MODEL_LABELS

    return Measured(None, f"{MODEL_LABELS.get(t.model.iloc[0], t.model.iloc[0])}, r = 0.3, {t.window.nunique()} windows ({t.device.iloc[0]}): "
                          + _zipkv_against_baselines(t))


# ---------------------------------------------------------------- the claims

Z, K = "ZipFusion", "KVSculpt"
_speedup = pv.ZIPFUSION_SPEEDUP_RANGE
_mb = pv.ZIPFUSION_MAX_BATCH

CLAIMS: list[Claim] = [
    # ZipFusion
    Claim(Z, "Abstract, Fig. 4", "decode attention over FlashInfer (TC), real-KV mix of compressible blocks",
          "zipfusion_attention_latency", _speedup, _latency_speedups("measured mix"), fmt="{:.2f}×", slack=1.02,
          holds=(">", 1.0), exceedable=True),
    Claim(Z, "§IV-B, Fig. 4", "decode attention at 8192 tokens × batch 64, Llama-3.1-8B shape, µs (the paper on an "
          "H100, ours on an H200: shown, not judged)", "zipfusion_attention_latency",
          "FlashInfer {flashinfer} → ZipFusion {zipfusion} µs".format(**pv.ZIPFUSION_ATTENTION_8192x64["Llama-3.1-8B"]),
          _latency_8192x64(), comparable=False),
    Claim(Z, "Abstract, Fig. 4", "decode attention over FlashInfer (TC), real-KV mix of compressible blocks, on the "
          "paper's card (H100)", PAPER_CARD, _speedup, _latency_speedups("measured mix", PAPER_CARD, "H100"),
          fmt="{:.2f}×", slack=1.02, holds=(">", 1.0), exceedable=True),
    Claim(Z, "§IV-B, Fig. 4", "ZipFusion's decode attention at 8192 tokens × batch 64, Llama-3.1-8B shape, µs, on the "
          "paper's card (H100; ours on the real-KV mix, as the paper times captured KV)", PAPER_CARD,
          pv.ZIPFUSION_ATTENTION_8192x64["Llama-3.1-8B"]["zipfusion"], _latency_8192x64(PAPER_CARD, "H100", judged=True),
          better="lower", slack=1.1, fmt="{:.1f} µs"),
    Claim(Z, "beyond", "decode attention over FlashInfer (TC) when every block is compressible (a best case: the "
          "paper's Fig. 4 times captured KV, the row above)", "zipfusion_attention_latency", None,
          _latency_speedups("all compressible")),
    Claim(Z, "Fig. 2, §III-B", "lossless: unpacking restores every bit", "zipfusion_lossless_format",
          "bit-exact", _lossless_exact),
    Claim(Z, "beyond", "the fused kernel reads packed pages into the same attention output, bit for bit, as the same "
          "pages raw (same kernel, same splits; captured KV of every layer), so the engine on that kernel generates the "
          "same tokens with and without compression (not against the Triton-kernel baseline, which sums in another "
          "order: the chapter counts both)", "zipfusion_lossless_format", None, _read_identity),
    Claim(Z, "Fig. 2, §III-B", "an eligible block stores 12 bits per value (metadata excluded)",
          "zipfusion_lossless_format", float(pv.ZIPFUSION_BITS_PER_VALUE), _lossless_bits, better=None, slack=1.0001,
          fmt="{:.2f} bits"),
    Claim(Z, "§II-B", "restoring codecs before attention: ms per decode step", "zipfusion_restore_baselines",
          pv.ZIPFUSION_RESTORE_MS_RANGE, _restore_ms("restore_ms"), better=None, slack=1.5, fmt="{:.1f} ms"),
    Claim(Z, "§I", "decompression's share of the decode step when codecs restore before attention (ours: of restore "
          "+ attention; the paper's: of its instrumented step)", "zipfusion_restore_baselines",
          pv.ZIPFUSION_RESTORE_FRACTION_RANGE, _restore_share, fmt="{:.1%}", comparable=False),
    Claim(Z, "§II-B", "the rest of the decode step beside the restore: ms per step", "zipfusion_restore_baselines",
          pv.ZIPFUSION_RESTORE_OTHER_MS, _restore_ms("attention_ms"), fmt="{:.1f} ms", comparable=False),
    Claim(Z, "Fig. 5, §IV-C", "largest supported batch, ZipFusion over uncompressed (same memory budget; the paper's range "
          "over Llama-3.1-8B and Qwen3-8B, ours Llama-3.1-8B shapes)",
          "zipfusion_throughput", _span(m["zipfusion"] / m["uncompressed"] for m in _mb.values()), _max_batch_ratio,
          holds=(">", 1.0)),
    Claim(Z, "Abstract, Fig. 5", "tokens/s at each method's largest batch over uncompressed (gain), the paper's "
          "uncompressed being SGLang, ours this project's engine",
          "zipfusion_throughput", _span(pv.ZIPFUSION_THROUGHPUT_GAIN_AT_MAX_BATCH.values()),
          _throughput_ratio(("uncompressed",), True), fmt="{:.1%}", slack=1.1, holds=(">", 0.0)),
    Claim(Z, "Abstract, Fig. 5", "tokens/s at each method's largest batch over uncompressed (gain), on the paper's card "
          "(H100; over the faster of our two uncompressed engines)", PAPER_CARD,
          _span(pv.ZIPFUSION_THROUGHPUT_GAIN_AT_MAX_BATCH.values()), _card_gain(), fmt="{:.1%}", slack=1.1, holds=(">", 0.0)),
    Claim(Z, "§IV-C", "tokens/s at batch 32 over uncompressed (gain), on the paper's card (H100; over the token "
          "layouts, the one uncompressed engine timed at batch 32, the slower one at the largest batch)", PAPER_CARD,
          _span(pv.ZIPFUSION_GAIN_BATCH32.values()), _card_gain(32), fmt="{:.1%}", slack=1.1, holds=(">", 0.0)),
    Claim(Z, "beyond", "tokens/s at the largest batch over the engine's own uncompressed default on a GPU (the mma "
          "layout for the tensor cores, not the token layout of the chapter's baseline)",
          "zipfusion_throughput_engineering", None, _vs_mma_baseline, fmt="{:.3f}×"),
    Claim(Z, "beyond", "tokens/s at each method's largest batch over uncompressed, from run to run (the chapter's GPU "
          "runs, one board or several)", "zipfusion_throughput_engineering", None, _throughput_runs),
    Claim(Z, "Abstract, §IV-C", "tokens/s at the largest batch over the best lossless restore baseline",
          "zipfusion_throughput", _span(pv.ZIPFUSION_VS_BEST_LOSSLESS_BASELINE.values()),
          _throughput_ratio(("splitzip", "huffman"), False), slack=1.1, holds=(">", 1.0)),
    Claim(Z, "§IV-C", "tokens/s at batch 32 over uncompressed (gain)", "zipfusion_throughput",
          _span(pv.ZIPFUSION_GAIN_BATCH32.values()), _throughput_ratio(("uncompressed",), True, batch=32),
          fmt="{:.1%}", slack=1.1, holds=(">", 0.0)),
    Claim(Z, "§IV-C", "tokens/s at batch 32 over SplitZip (the fastest compressed baseline there)",
          "zipfusion_throughput", _span(pv.ZIPFUSION_VS_SPLITZIP_BATCH32.values()),
          _throughput_ratio(("splitzip",), False, batch=32), slack=1.1, holds=(">", 1.0)),
    Claim(Z, "beyond", "real KV cache: share of compressible blocks", "model_data_kv_cache", None, _compressible),
    Claim(Z, "beyond", "packed size of the real KV cache", "zipfusion_lossless_format", None, _cache_fraction),
    Claim(Z, "beyond", "where a decode step goes at the largest batches (why the tokens/s ratio is what it is)",
          "zipfusion_throughput_engineering", None, _step_breakdown),
    Claim(Z, "beyond", "decode attention per token, each launch's fixed cost set apart (a fit over contexts)",
          "zipfusion_kernel_engineering", None, _per_token_gain),
    Claim(Z, "beyond", "pack kernel throughput (compress full pages on the GPU)", "zipfusion_kernel_engineering", None,
          _pack),
    Claim(Z, "beyond", "compiled decode kernels: registers and spills", "zipfusion_kernel_resources", None,
          _resources),
    Claim(Z, "§II-C, §III-D", "a pool shared by all layers: a chunk emptied in one layer is reassigned to another, "
          "and the room compression frees admits new requests (requests arriving over time; the manager's parts "
          "ablated)", "memory_manager", None, _memory_manager),
    Claim(Z, "beyond", "an FP8 KV cache (what serving engines offer) against the lossless format: the KL it costs",
          "zipfusion_fp8_quality", None, _fp8_quality),
    Claim(Z, "beyond", "every block compressible: ZipFusion's 12-bit block plus a list of the few values outside its "
          "exponent window, on the real KV of both embedded models", "escape_format", None, _escape_format),
    Claim(Z, "beyond", "both papers together: a KVSculpt-distilled prefix in ZipFusion pages, served by the engine",
          "distilled_prefix", None, _distilled_prefix),
    # KVSculpt
    Claim(K, "Abstract, Table 1", "KL reduction over Select+Fit, r ∈ {0.3, 0.5, 0.7}", "kvsculpt_main",
          _span(pv.KVSCULPT_TABLE1_IMPROVEMENT.values()), _improvement_span, holds=(">", 1.0), exceedable=True),
    *[Claim(K, "Table 1", f"KL reduction over Select+Fit at r = {r}", "kvsculpt_main", x, _improvement(r),
            holds=(">", 1.0), exceedable=True)
      for r, x in pv.KVSCULPT_TABLE1_IMPROVEMENT.items()],
    Claim(K, "§7", "eviction to Joint Optimization: Select+Fit KL over Joint Opt KL", "kvsculpt_main",
          pv.KVSCULPT_JOINT_OPT_GAIN, _joint_gain, better=None, slack=1.1, holds=(">", 1.0), fmt="{:.3f}×"),
    Claim(K, "Table 2", "per-sequence: KVSculpt never worse than Select+Fit (smallest factor)", "kvsculpt_per_window",
          float(pv.KVSCULPT_TABLE2.improvement.min()), lambda res: float(_per_window(res, "improvement").min()),
          slack=1.1, holds=(">=", 1.0), exceedable=True),
    Claim(K, "§5.1", "Select+Fit's KL at r = 0.3 stays above 0.1 on every sequence, the easy ones included",
          "kvsculpt_per_window", _above_label(), _select_fit_floor),
    Claim(K, "Table 2", f"easy sequences (KVSculpt KL < {pv.KVSCULPT_EASY_KL:g})", "kvsculpt_per_window",
          float((pv.KVSCULPT_TABLE2.label == "easy").mean()), _easy_share, fmt="{:.0%}", slack=1.0001),
    Claim(K, "Appendix A", "Joint Opt marginally better than Select+Fit (KL ratio, mean over ratios)",
          "kvsculpt_appendix", PAPER_APPENDIX_JOINT_GAIN, _appendix_joint_gain, better=None, slack=1.1, holds=(">", 1.0),
          fmt="{:.3f}×"),
    Claim(K, "Appendix A", "best eviction baseline at most ratios", "kvsculpt_appendix", label(_paper_best_baseline()),
          lambda res: label(_best_baseline(res["kvsculpt_appendix"]))),
    Claim(K, "Abstract, Table 6", f"adaptive (pilot) allocation: further KL reduction over uniform (the abstract's "
          f"{pv.KVSCULPT_ADAPTIVE_GAIN:g}×; Table 6's mean, 1 / {pv.KVSCULPT_TABLE6_MEAN:g}, is "
          f"{1 / pv.KVSCULPT_TABLE6_MEAN:.2f}×)",
          "kvsculpt_pilot_budget", pv.KVSCULPT_ADAPTIVE_GAIN,
          lambda res: 1 / _ratio_of_means("kvsculpt_pilot_budget", "pilot_kl")(res), holds=(">", 1.0), exceedable=True),
    Claim(K, "§3.5, §5.4", "layer 0's pilot MSE over the median layer's", "kvsculpt_pilot_budget",
          pv.KVSCULPT_LAYER0_MSE_OVER_MEDIAN, _layer0_over_median, better=None, slack=3.0, fmt="{:.3g}×"),
    Claim(K, "Abstract", "per-layer pilot MSE varies across layers (max over min)", "kvsculpt_pilot_budget",
          pv.KVSCULPT_LAYER_PILOT_MSE_SPREAD, _layer_pilot_spread, slack=3.0, fmt="{:.0f}×"),
    Claim(K, "Abstract, Table 7", "two KV heads of one layer differ in pilot MSE by up to", "kvsculpt_head_asymmetry",
          pv.KVSCULPT_HEAD_PILOT_MSE_MAX_RATIO, lambda res: float(res["kvsculpt_head_asymmetry"].max_ratio.max()),
          better=None, slack=3.0, fmt="{:.0f}×"),
    Claim(K, "§3.3", "consecutive query content vectors: cosine", "kvsculpt_queries", pv.KVSCULPT_QUERY_STATS["consecutive_cosine"],
          _median("kvsculpt_queries_stats", "consecutive_cosine"), better=None, fmt="{:.2f}"),
    Claim(K, "§3.3", "PCA basis of the context captures decode variance", "kvsculpt_queries",
          pv.KVSCULPT_QUERY_STATS["decode_variance_captured"], _median("kvsculpt_queries_stats", "decode_captured"),
          better=None, fmt="{:.0%}"),
    Claim(K, "Table 3", "Adam's per-layer MSE over L-BFGS's", "kvsculpt_optimizer", pv.KVSCULPT_TABLE3_ADAM_RANGE,
          _optimizer_gap("adam"), fmt="{:.1f}×", slack=1.1, holds=(">", 1.0), exceedable=True),
    Claim(K, "§5.2", "Adam's end-to-end KL over L-BFGS's on easy sequences (every layer solved by each; all windows "
          "where none is easy)", "kvsculpt_optimizer", pv.KVSCULPT_ADAM_KL_RANGE, _adam_kl, fmt="{:.0f}×", holds=(">", 1.0),
          exceedable=True),
    Claim(K, "Table 3", "one L-BFGS run above the 100-restart oracle (gap)", "kvsculpt_optimizer",
          pv.KVSCULPT_TABLE3_GAP_RANGE, _optimizer_gap("oracle"), better="lower", fmt="{:.0%}", slack=1.25, exceedable=True),
    Claim(K, "Table 4", "best query strategy at the far horizon (4096 tokens)", "kvsculpt_queries",
          pv.KVSCULPT_TABLE4.set_index("strategy").far.idxmax(), _best_far_strategy),
    Claim(K, "Table 4", "best query strategy at the near horizon (128 tokens)", "kvsculpt_queries",
          pv.KVSCULPT_TABLE4.set_index("strategy").near.idxmax(), _best_near_strategy),
    Claim(K, "Table 4", "uniform spread: attention cosine at the far horizon", "kvsculpt_queries",
          float(pv.KVSCULPT_TABLE4.set_index("strategy").far["uniform"]),
          _mean("kvsculpt_queries", "cosine", "strategy == 'uniform' and horizon == 'far'"), better=None, fmt="{:.3f}",
          slack=1.02),
    Claim(K, "Table 5", "static ‖V‖^0.5 allocation: mean KL vs uniform (worse)", "kvsculpt_static_budget",
          pv.KVSCULPT_TABLE5_MEAN, _ratio_of_means("kvsculpt_static_budget", "static_kl"), better=None, slack=1.1,
          holds=(">", 1.0)),
    Claim(K, "Table 6", "pilot-MSE^0.5 allocation: mean KL vs uniform", "kvsculpt_pilot_budget",
          pv.KVSCULPT_TABLE6_MEAN, _ratio_of_means("kvsculpt_pilot_budget", "pilot_kl"), better="lower", holds=("<", 1.0),
          exceedable=True),
    Claim(K, "Table 6", "pilot-MSE^0.5 allocation: sequences where it beats uniform", "kvsculpt_pilot_budget",
          pv.KVSCULPT_TABLE6_WINS[0] / pv.KVSCULPT_TABLE6_WINS[1], _wins, fmt="{:.0%}", slack=1.0001, exceedable=True),
    Claim(K, "Table 7", "per-head pilot MSE ratio within a layer, mean over layers", "kvsculpt_head_asymmetry",
          _span(pv.KVSCULPT_TABLE7.mean_ratio), lambda res: _span(res["kvsculpt_head_asymmetry"].mean_ratio),
          better=None, slack=1.1, fmt="{:.1f}×"),
    Claim(K, "§5.5, Table 7", "one layer is the most asymmetric on most sequences (share of sequences whose most "
          "asymmetric layer is the commonest one; the paper: layer {}, {} of {})".format(
              *_commonest_layer_share(pv.KVSCULPT_TABLE7.layer_of_max)), "kvsculpt_head_asymmetry",
          _commonest_layer_share(pv.KVSCULPT_TABLE7.layer_of_max)[1] / len(pv.KVSCULPT_TABLE7), _asymmetric_layer,
          fmt="{:.0%}", slack=1.0001),
    Claim(K, "Table 8", "per-layer allocation: mean KL vs uniform", "kvsculpt_head_budget",
          pv.KVSCULPT_TABLE8_MEAN["per_layer_vs_uniform"], _ratio_of_means("kvsculpt_head_budget", "per_layer_kl"),
          better=None, slack=1.1, holds=(">", 1.0)),
    Claim(K, "Table 8", "per-layer + per-head allocation: mean KL vs uniform", "kvsculpt_head_budget",
          pv.KVSCULPT_TABLE8_MEAN["per_layer_head_vs_uniform"], _ratio_of_means("kvsculpt_head_budget", "per_layer_head_kl"),
          better="lower", holds=("<", 1.0), exceedable=True),
    Claim(K, "Table 8", "per-head allocation improves over per-layer alone (sequences)", "kvsculpt_head_budget",
          float((pv.KVSCULPT_TABLE8.per_layer_head_vs_uniform < pv.KVSCULPT_TABLE8.per_layer_vs_uniform).mean()),
          _head_wins, fmt="{:.0%}", slack=1.0001, exceedable=True),
    Claim(K, "Appendix B", "best dampening exponent α for ‖V‖^α allocation", "kvsculpt_dampening",
          pv.KVSCULPT_BEST_ALPHA, _best_alpha, better=None, slack=1.0001, fmt="α = {:g}"),
    Claim(K, "Appendix B", "pilot-MSE^0.5 allocation: KL vs uniform", "kvsculpt_dampening",
          pv.KVSCULPT_APPENDIX_B_PILOT[0.5], _mean("kvsculpt_dampening", "vs_uniform", "signal == 'pilot' and alpha == 0.5"),
          better="lower", holds=("<", 1.0), exceedable=True),
    Claim(K, "Appendix B, §5.4", "pilot-MSE^1 allocation (undampened): KL vs uniform", "kvsculpt_dampening",
          pv.KVSCULPT_APPENDIX_B_PILOT[1.0], _mean("kvsculpt_dampening", "vs_uniform", "signal == 'pilot' and alpha == 1.0"),
          better="lower", holds=("<", 1.0), exceedable=True),
    Claim(K, "§6", "hidden-state MSE growth, first to last layer, easy sequences", "kvsculpt_error_propagation",
          pv.KVSCULPT_ERROR_GROWTH["easy"], _growth("easy", "mean"), better=None, slack=3.0, fmt="{:.0f}×"),
    Claim(K, "§6", "hidden-state MSE growth, first to last layer, hard sequences (up to)",
          "kvsculpt_error_propagation", pv.KVSCULPT_ERROR_GROWTH["hard"], _growth("hard", "max"), better=None,
          slack=3.0, fmt="{:.0f}×"),
    Claim(K, "§6", "per-layer compression MSE and end-to-end KL, across sequences: correlation",
          "kvsculpt_error_propagation", "weak", _error_correlation),
    Claim(K, "beyond", "per layer, KVSculpt's objective gain over Select+Fit against its single-layer KL gain",
          "kvsculpt_kl_sources", None, _kl_sources_correlation),
    Claim(K, "§6", "share of the KL in the top 5 of 128 tokens (hard sequence)", "kvsculpt_error_propagation",
          pv.KVSCULPT_TOP5_KL_SHARE, _concentration("top5_kl_share"), better=None, slack=1.2, fmt="{:.0%}"),
    Claim(K, "§6", "per-token KL, max over mean (hard sequence)", "kvsculpt_error_propagation",
          pv.KVSCULPT_TOKEN_KL["max_over_mean"], _concentration("max_over_mean_kl"), better=None, slack=2.0, fmt="{:.0f}×"),
    Claim(K, "§7", "seconds to compress a 2048-token context (Qwen2.5-1.5B shape), one problem at a time as the "
          "paper's solver (the paper on an A100, ours on an H200)", "distill_speed",
          pv.KVSCULPT_SECONDS_PER_CONTEXT, _distill_seconds("reference"), better="lower", fmt="{:.0f} s"),
    Claim(K, "beyond", f"the same with this project's batched solver (every problem at once; the paper's solver: "
          f"{pv.KVSCULPT_SECONDS_PER_CONTEXT:g} s)", "distill_speed", None, _distill_seconds("batched"), fmt="{:.1f} s"),
    Claim(K, "beyond", "why KVSculpt does not reproduce here: the paper's KL metric under each reading",
          "kvsculpt_why", None, _kl_readings),
    Claim(K, "beyond", "zipkv's distiller among the presses users already pick: kvpress's own presses on the same KL "
          "protocol (2× to 16×) and a retrieval task after the compressed context", "kvpress_presses", None, _kvpress),
    Claim(K, "beyond", "batched solver against the one-at-a-time reference", "solver_agreement", None,
          _solver_agreement),
    Claim(K, "beyond", "this project's own method and Attention Matching against KVSculpt", "kvsculpt_beyond", None,
          _beyond),
    Claim(K, "beyond", "the same at r = 0.5, 0.7 and 0.2, against the best baseline", "kvsculpt_beyond", None,
          _beyond_other_ratios),
    Claim(K, "beyond", "the same comparison on a second model (sliding-window layers kept as the model keeps them)",
          "kvsculpt_beyond", None, _second_model),
]


def _row(claim: Claim, res: Results) -> dict:
    value = text = None
    if claim.ours is not None and res.has(claim.chapter):
        try:
            got = claim.ours(res)
        except (KeyError, IndexError, ValueError, AttributeError) as err:  # a table without the rows this claim reads
            got = Measured(None, f"table incomplete ({type(err).__name__}: {err})")
        if got is not None:                          # None: the chapter's table lacks what this claim reads
            value, text = got if isinstance(got, Measured) else (got, _fmt(got, claim.fmt))
    if claim.paper_value is None:
        verdict = BEYOND if text is not None else "not yet run"
    elif not claim.comparable:
        verdict = NOT_COMPARABLE if text is not None else "not yet run"
    else:
        verdict = judge_claim(claim, value)
    judged = verdict in ("reproduced", "exceeded", "not reproduced")
    return {"paper": claim.paper, "item": claim.item, "claim": claim.claim,
            "paper_value": _fmt(claim.paper_value, claim.fmt) if claim.paper_value is not None else "–",
            "our_value": text if text is not None else "–", "verdict": verdict,
            "tolerance": tolerance(claim.paper_value, claim.slack) if judged else "", "chapter": claim.chapter}


def findings(results_dir: Path, claims: list[Claim] | None = None) -> pd.DataFrame:
    """The scorecard (columns :data:`COLUMNS`), computed from ``results_dir``'s CSVs."""
    results_dir = Path(results_dir)
    if not results_dir.is_dir():
        raise ValueError(f"results_dir={str(results_dir)!r}: expected a folder of results CSVs")
    res = Results(results_dir)
    return pd.DataFrame([_row(c, res) for c in (claims or CLAIMS)], columns=COLUMNS)


def chapter_docs(toc: Path) -> dict[str, str]:
    """Results stem → the book's document path (``book/part/name``) for every chapter in ``_toc.yml`` (its executed
    notebooks; pages written by hand in markdown, such as a design page, have no results and are left out)."""
    import yaml

    docs = {}

    def walk(node):
        if isinstance(node, dict):
            if "file" in node:
                docs[Path(node["file"]).name] = node["file"]
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(yaml.safe_load(Path(toc).read_text()))
    root = Path(toc).parent                      # a page written by hand (``.md``, a design) is no results chapter
    return {k: v for k, v in docs.items() if not (root / f"{v}.md").is_file()}


BADGES = {"reproduced": "success", "exceeded": "primary", "not reproduced": "danger", NOT_COMPARABLE: "warning",
          "not yet run": "secondary", BEYOND: "info"}


def chapter_titles(notebooks: Path) -> dict[str, str]:
    """Notebook name → its title without the parenthesised paper reference (the link text)."""
    import nbformat

    titles = {}
    for path in sorted(Path(notebooks).rglob("*.ipynb")):
        first = next((c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown"), "")
        title = first.splitlines()[0].lstrip("# ").strip() if first else path.stem
        titles[path.stem] = re.sub(r"\s*\(.*\)$", "", title)
    return titles


def markdown_table(table: pd.DataFrame, docs: dict[str, str], titles: dict[str, str] | None = None) -> str:
    """The scorecard as MyST, one table per paper: verdicts as badges, chapters as links to their pages,
    or their names where the chapter is not in the book yet."""
    def cell(text) -> str:
        return str(text).replace("|", "\\|")

    titles = titles or {}
    parts = []
    for paper, rows in table.groupby("paper", sort=False):
        lines = [f"**{paper}**", "", "| claim | paper | ours | verdict | chapter |", "|---|---|---|---|---|"]
        for row in rows.itertuples():
            link = (f"{{doc}}`{cell(titles.get(row.chapter, row.chapter))} </{docs[row.chapter]}>`"
                    if row.chapter in docs else f"`{row.chapter}` (no chapter yet)")
            tol = f" ({row.tolerance})" if isinstance(row.tolerance, str) and row.tolerance else ""
            lines.append("| " + " | ".join([f"**{cell(row.item)}**: {cell(row.claim)}", cell(row.paper_value),
                                             cell(row.our_value), f"{{bdg-{BADGES[row.verdict]}}}`{row.verdict}`{tol}",
                                             link]) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def verdict_for(chapter: str, claim: str, ours) -> str:
    """The findings page's verdict of ``ours`` on the claim of ``chapter`` (a notebook stem) whose text starts with
    ``claim`` -- so that a chapter's own verdict and the findings page judge alike."""
    found = [c for c in CLAIMS if c.chapter == chapter and c.claim.startswith(claim)]
    if len(found) != 1:
        raise ValueError(f"claim: expected one claim of {chapter!r} starting with {claim!r}, found {len(found)}")
    return judge_claim(found[0], ours)


# ---------------------------------------------------------------- counting each claim once

CLAIM_GROUPS: dict[str, tuple[str, ...]] = {
    "decode attention over FlashInfer, real-KV mix": (
        "decode attention over FlashInfer (TC), real-KV mix of compressible blocks, on the paper's card (H100)",
        "decode attention over FlashInfer (TC), real-KV mix of compressible blocks"),
    "decode attention at 8192 tokens × batch 64": (
        "ZipFusion's decode attention at 8192 tokens × batch 64, Llama-3.1-8B shape, µs, on the paper's card",
        "decode attention at 8192 tokens × batch 64, Llama-3.1-8B shape, µs (the paper on an H100"),
    "tokens/s gain at the largest batch": (
        "tokens/s at each method's largest batch over uncompressed (gain), on the paper's card (H100",
        "tokens/s at each method's largest batch over uncompressed (gain), the paper's uncompressed being SGLang"),
    "tokens/s gain at batch 32": (
        "tokens/s at batch 32 over uncompressed (gain), on the paper's card (H100",
        "tokens/s at batch 32 over uncompressed (gain)"),
    "KVSculpt's KL reduction over Select+Fit": (
        "KL reduction over Select+Fit, r ∈ {0.3, 0.5, 0.7}", "KL reduction over Select+Fit at r = 0.3",
        "KL reduction over Select+Fit at r = 0.5", "KL reduction over Select+Fit at r = 0.7"),
    "Joint Opt marginally better than Select+Fit": (
        "eviction to Joint Optimization: Select+Fit KL over Joint Opt KL",
        "Joint Opt marginally better than Select+Fit"),
    "adaptive (pilot-MSE^0.5) allocation against uniform": (
        "adaptive (pilot) allocation: further KL reduction over uniform",
        "pilot-MSE^0.5 allocation: mean KL vs uniform", "pilot-MSE^0.5 allocation: KL vs uniform"),
}
"""Rows of the scorecard that judge one claim of a paper: on two GPUs (the paper's card first), overall and per
ratio (overall first), in two tables, or the abstract's number and the table it comes from (the abstract first).
Each member names one claim (its full text, else the unique claim its text starts); the first one's verdict is the
claim's in the counts."""


def claim_of(start: str, claims: list[Claim] | None = None) -> Claim:
    """The claim whose text is ``start``, else the one claim whose text starts with it."""
    claims = claims or CLAIMS
    exact = [c for c in claims if c.claim == start]
    found = exact or [c for c in claims if c.claim.startswith(start)]
    if len(found) != 1:
        raise ValueError(f"claim: expected one claim whose text is or starts with {start!r}, found {len(found)}")
    return found[0]


def counted(table: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``table`` (:func:`findings`) that the counts count: the papers' claims (no row beyond the paper,
    even one not yet run), each :data:`CLAIM_GROUPS` group once, by its first member."""
    drop = set()
    for members in CLAIM_GROUPS.values():
        for start in members[1:]:
            drop.add(claim_of(start).claim)
    claims = table[(table.verdict != BEYOND) & (table["item"] != "beyond")]
    return claims[~claims.claim.isin(drop)]


def summary(table: pd.DataFrame) -> str:
    """One sentence per paper: how many of its claims each verdict holds, each claim counted once (:func:`counted`)."""
    parts = []
    for paper, claims in counted(table).groupby("paper", sort=False):
        counts = claims.verdict.value_counts()
        parts.append(f"**{paper}**: of {len(claims)} claims, " + ", ".join(
            f"{counts[v]} {v}" for v in VERDICTS if v in counts) + ".")
    return " ".join(parts)


# ---------------------------------------------------------------- the headline: ten claims, in plain words

EMBEDDED_MODEL = "SmolLM2-135M"
"""The model the KVSculpt chapters ran (the embedded one, :data:`zipkv.models.EMBEDDED_NAME` without its suffix)."""

HEADLINE_COLUMNS = ["claim", "paper", "ours", "verdict", "chapters"]


def _worse_end(value, better: str | None):
    lo, hi = value if isinstance(value, tuple) else (value, value)
    return lo if better != "lower" else hi


def _measured(start: str, res: Results):
    """(the claim, its verdict, ours as judged, ours as shown) of the claim ``start`` names."""
    claim = claim_of(start)
    row = _row(claim, res)
    value = None
    if claim.ours is not None and res.has(claim.chapter) and row["verdict"] not in ("not yet run",):
        got = claim.ours(res)
        value = got.value if isinstance(got, Measured) else got
    return claim, row["verdict"], value, row["our_value"]


def _short(value, fmt: str) -> str:
    return _fmt(value, fmt) if value is not None else "–"


def _held(verdict: str) -> bool:
    return verdict in ("reproduced", "exceeded")


def _two_cards(card: str, other: str, res: Results, fmt: str) -> tuple[str, str, str]:
    """(ours, verdict in words, chapters) of a claim judged on the paper's H100 (``card``) and on the H200."""
    c, v_card, x_card, _ = _measured(card, res)
    o, v_other, x_other, _ = _measured(other, res)
    paper = _fmt(c.paper_value, fmt)
    ours = f"H100 (the paper's card): {_short(x_card, fmt)}; H200: {_short(x_other, fmt)}"
    if _held(v_card) and _held(v_other):
        words = f"{v_card} on the paper's H100 and on the H200"
    elif _held(v_card):
        words = (f"{v_card} on the paper's H100, not on the H200 ({_fmt(_worse_end(x_other, c.better), fmt)} "
                 f"vs {paper})")
    elif _held(v_other):
        words = f"{v_other} on the H200, not on the paper's H100 ({_fmt(_worse_end(x_card, c.better), fmt)} vs {paper})"
    else:
        words = f"{v_card} on either card"
    return ours, words, [c.chapter, o.chapter]


def _beyond_numbers(res: Results) -> dict | None:
    """zipkv's distiller at r = 0.3 against the best Select+Fit variant and KVSculpt (as :func:`_beyond`)."""
    from zipkv.study.chapters.beyond import with_extra_rows

    if not res.has("kvsculpt_beyond"):
        return None
    t, _ = with_extra_rows(res["kvsculpt_beyond"], res.directory / "kvsculpt_beyond_extra.csv")
    t = t[t.ratio == 0.3]
    kl = t.groupby("method").kl.mean()
    sf = [x for x in _SELECT_FIT if x in kl]
    if "zipkv" not in kl or not sf:
        return None
    best = min(sf, key=kl.get)
    per = t.pivot_table(index="window", columns="method", values="kl")[[best, "zipkv"]].dropna()
    out = {"gain": kl[best] / kl["zipkv"], "best": label(best), "lower": int((per.zipkv < per[best]).sum()),
           "windows": len(per)}
    if "kvsculpt" not in kl and res.has("kvsculpt_main"):
        t = pd.concat([t, table1_kvsculpt(t, res["kvsculpt_main"])])
    if (t.method == "kvsculpt").any():
        k = t[t.window.isin(t[t.method == "kvsculpt"].window)].groupby("method").kl.mean()
        out["vs_kvsculpt"] = k["kvsculpt"] / k["zipkv"]
    return out


def _escape_numbers(res: Results) -> dict | None:
    from zipkv.study.chapters.escape import summary as escape_summary

    if not res.has("escape_format"):
        return None
    s = escape_summary(res["escape_format"])
    return {"ours": _span(s["escape format (bits/value)"]), "zipfusion": _span(s["ZipFusion (bits/value)"]),
            "models": " and ".join(dict.fromkeys(s.index.get_level_values(0)))}


def headline(results_dir: Path, table: pd.DataFrame | None = None) -> pd.DataFrame:
    """At most ten claims, one row each (columns :data:`HEADLINE_COLUMNS`; ``chapters`` a list of results stems),
    the paper's number, ours (H100 and H200 in one row where both ran) and the verdict in words, computed from
    ``results_dir``'s tables as the scorecard judges them."""
    res = Results(Path(results_dir))
    table = findings(results_dir) if table is None else table
    rows = []

    def add(claim, paper, ours, words, chapters):
        rows.append(dict(zip(HEADLINE_COLUMNS, [claim, paper, ours, words, chapters])))

    # ZipFusion
    card, other = CLAIM_GROUPS["decode attention over FlashInfer, real-KV mix"]
    ours, words, chapters = _two_cards(card, other, res, "{:.2f}×")
    add("ZipFusion's decode attention over FlashInfer, real-KV mix", f"{_fmt(pv.ZIPFUSION_SPEEDUP_RANGE, '{:.2f}×')} "
        f"({pv.ZIPFUSION_GPU})", ours, words, chapters)

    c, v, _, shown = _measured("lossless: unpacking restores every bit", res)
    b, vb, bits, _ = _measured("an eligible block stores 12 bits per value", res)
    pages = re.search(r"([\d,]+) pages", shown)
    add("Lossless: unpacking restores every bit, 12 bits per eligible value", "bit-exact, 12 bits",
        (f"bit-exact on {pages.group(1)} pages of real KV cache, " if pages else f"{shown}, ") + _short(bits, b.fmt),
        v if v == vb else f"{v} (bit-exact), {vb} (bits per value)", [c.chapter])

    c, v, ratio, _ = _measured("largest supported batch, ZipFusion over uncompressed", res)
    mb = _fig5_rows(res).groupby("method").max_batch.max() if res.has(c.chapter) else None
    capacity = f"{mb['uncompressed']} → {mb['zipfusion']} requests ({_short(ratio, c.fmt)})" if mb is not None else "–"
    if mb is not None and res.has(f"{PAPER_CARD}_throughput"):
        card_mb = res[f"{PAPER_CARD}_throughput"].groupby("method").max_batch.max()
        if (card_mb["uncompressed"], card_mb["zipfusion"]) == (mb["uncompressed"], mb["zipfusion"]):
            capacity += ", the same on both cards"
    add("Largest batch under the same memory", _fmt(c.paper_value, c.fmt), capacity, v, [c.chapter])

    card, other = CLAIM_GROUPS["tokens/s gain at the largest batch"]
    ours, words, chapters = _two_cards(card, other, res, "{:.1%}")
    add("Tokens/s gain at the largest batch, over the same engine uncompressed (the paper's: SGLang)",
        _fmt(claim_of(card).paper_value, "{:.1%}"), ours, words, chapters)

    c, v, ratio, _ = _measured("tokens/s at the largest batch over the best lossless restore baseline", res)
    add("Tokens/s over the best codec that restores the cache before attention", _fmt(c.paper_value, c.fmt),
        f"{_short(ratio, c.fmt)}, H200", f"{v} against this study's stand-ins for SplitZip and Huffman"
        + (f" ({_short(ratio, c.fmt)} vs {_fmt(c.paper_value, c.fmt)})" if ratio is not None else ""), [c.chapter])

    c, v, _, shown = _measured("a pool shared by all layers", res)
    if res.has(c.chapter):
        sh = res[c.chapter].set_index("variant").loc["shared pool"]
        ours = (f"{int(sh.chunks_reassigned)} chunks reassigned between layers; largest batch {int(sh.max_batch)} "
                f"({sh.model}, {sh.device})")
        words = "shown at work; no number in the paper to compare"
    else:
        ours, words = "–", "not yet run on the paper profile"
    add("The memory manager: one pool shared by all layers", "a design, no number", ours, words, [c.chapter])

    # KVSculpt
    c, v, ratio, _ = _measured("KL reduction over Select+Fit, r ∈ {0.3, 0.5, 0.7}", res)
    add("KVSculpt's KL reduction over Select+Fit, r = 0.3–0.7", _fmt(c.paper_value, c.fmt), _short(ratio, c.fmt),
        f"{v} on {EMBEDDED_MODEL}" + (f" ({_short(ratio, c.fmt)} vs {_fmt(c.paper_value, c.fmt)})"
                                      if ratio is not None else ""), [c.chapter, "kvsculpt_why"])

    c, v, ratio, _ = _measured("adaptive (pilot) allocation: further KL reduction over uniform", res)
    add("KVSculpt's adaptive budgets over a uniform one", _fmt(c.paper_value, c.fmt), _short(ratio, c.fmt),
        f"{v} on {EMBEDDED_MODEL}" + (f" ({_short(ratio, c.fmt)} vs {_fmt(c.paper_value, c.fmt)})"
                                      if ratio is not None else ""), [c.chapter])

    # beyond both papers
    b = _beyond_numbers(res)
    ours = "–" if b is None else (f"{b['gain']:.2f}× lower KL than the best Select+Fit "
                                  f"({b['best'].removeprefix('Select+Fit, ').removeprefix('Select+Fit')}) at r = 0.3, lower "
                                  f"on {b['lower']} of {b['windows']} windows"
                                  + (f"; {b['vs_kvsculpt']:.1f}× below KVSculpt" if "vs_kvsculpt" in b else ""))
    add("Beyond both papers: this project's own distiller", "–", ours,
        "beyond both papers" if b is not None else "not yet run", ["kvsculpt_beyond"])

    e = _escape_numbers(res)
    ours = "–" if e is None else (f"{_fmt(e['ours'], '{:.2f}')} bits per value with every block compressible "
                                  f"(ZipFusion's format: {_fmt(e['zipfusion'], '{:.2f}')}), {e['models']}")
    add("Beyond both papers: the escape format", "–", ours, "beyond both papers" if e is not None else "not yet run",
        ["escape_format"])
    return pd.DataFrame(rows, columns=HEADLINE_COLUMNS)


def headline_markdown(head: pd.DataFrame, docs: dict[str, str], titles: dict[str, str] | None = None) -> str:
    """The headline table as MyST: each claim linked to its chapters."""
    titles = titles or {}

    def cell(text) -> str:
        return str(text).replace("|", "\\|")

    def link(stem: str) -> str:
        return (f"{{doc}}`{cell(titles.get(stem, stem))} </{docs[stem]}>`" if stem in docs else cell(titles.get(stem, stem)))

    lines = ["| claim | the paper | ours | verdict |", "|---|---|---|---|"]
    for row in head.itertuples():
        chapters = ", ".join(link(s) for s in dict.fromkeys(row.chapters))
        lines.append(f"| **{cell(row.claim)}** ({chapters}) | {cell(row.paper)} | {cell(row.ours)} | "
                     f"{cell(row.verdict)} |")
    return "\n".join(lines)


def headline_text(table: pd.DataFrame) -> str:
    """The findings page's opening sentences: the counts, each claim once."""
    return (summary(table) + " A claim judged on two GPUs, overall and per ratio, or in two tables counts once (on "
            "the paper's card where both ran). The ten claims a reader asks about first:")


# ---------------------------------------------------------------- the landing page: the verdict in a minute

def _speedup_words(verdict: str, value, paper) -> str:
    return "the paper's number reproduced" if _held(verdict) else (
        f"short of the paper's {_fmt(paper, '{:.2f}×')} at its slowest point")


def landing(results_dir: Path, table: pd.DataFrame | None = None) -> tuple[str, pd.DataFrame]:
    """The landing page's opening (MyST) and its sentences as a table (``topic``, ``sentence``): ZipFusion's attention
    speedup on the paper's card and on the H200, its capacity and tokens/s gain, the lossless guarantee, KVSculpt's
    main claim and what goes beyond both papers, each computed from ``results_dir``'s tables as the findings page
    judges them."""
    res = Results(Path(results_dir))
    table = findings(results_dir) if table is None else table
    sentences = []
    card, other = CLAIM_GROUPS["decode attention over FlashInfer, real-KV mix"]
    c, v_card, x_card, _ = _measured(card, res)
    _, v_other, x_other, _ = _measured(other, res)
    if x_card is not None and x_other is not None:
        sentences.append(("attention", (
            f"On the paper's own card, an H100, ZipFusion's fused decode attention runs {_fmt(x_card, '{:.2f}×')} as fast "
            f"as FlashInfer on a real mix of compressible and incompressible blocks "
            f"({_speedup_words(v_card, x_card, c.paper_value)}: {_fmt(c.paper_value, '{:.2f}×')}); on an H200 it runs "
            f"{_fmt(x_other, '{:.2f}×')}, {_speedup_words(v_other, x_other, c.paper_value)}.")))
    b, v_b, ratio, _ = _measured("largest supported batch, ZipFusion over uncompressed", res)
    card, other = CLAIM_GROUPS["tokens/s gain at the largest batch"]
    g, v_g, gain_card, _ = _measured(card, res)
    _, v_g2, gain_other, _ = _measured(other, res)
    if ratio is not None and gain_card is not None:
        mb = _fig5_rows(res).groupby("method").max_batch.max()
        sentences.append(("throughput", (
            f"Under one memory budget it serves {mb['zipfusion']} requests at once where the uncompressed cache serves "
            f"{mb['uncompressed']} ({_fmt(ratio, b.fmt)}; the paper: {_fmt(b.paper_value, b.fmt)}), and "
            f"{_fmt(gain_card, '{:.1%}')} more tokens per second on the H100 ({v_g}) and "
            f"{_fmt(gain_other, '{:.1%}')} on the H200 ({v_g2}; the paper: {_fmt(g.paper_value, '{:.1%}')}).")))
    _, v_l, _, shown = _measured("lossless: unpacking restores every bit", res)
    bc, _, bits, _ = _measured("an eligible block stores 12 bits per value", res)
    pages = re.search(r"([\d,]+) pages", shown)
    if pages and bits is not None:
        sentences.append(("lossless", (
            f"The format is lossless ({v_l}): {pages.group(1)} pages of a real model's KV cache unpack bit for bit, "
            f"and every eligible block stores {_fmt(bits, bc.fmt)} per value.")))
    k, v_k, gain, _ = _measured("KL reduction over Select+Fit, r ∈ {0.3, 0.5, 0.7}", res)
    if gain is not None:
        sentences.append(("kvsculpt", (
            f"KVSculpt's main claim, a KL divergence {_fmt(k.paper_value, k.fmt)} lower than Select+Fit's, is "
            f"{v_k} on {EMBEDDED_MODEL}: ours is {_fmt(gain, k.fmt)} "
            f"({{doc}}`why </book/kvsculpt/kvsculpt_why>`).")))
    beyond, escape = _beyond_numbers(res), _escape_numbers(res)
    if beyond is not None and escape is not None:
        sentences.append(("beyond", (
            f"Beyond both papers, this project's own distiller reaches a KL {beyond['gain']:.1f}× below the best "
            f"Select+Fit at r = 0.3 (lower on {beyond['lower']} of {beyond['windows']} windows), and an escape format "
            f"makes every block compressible at {_fmt(escape['ours'], '{:.2f}')} bits per value.")))
    sentences.append(("where", (
        "Each number above is computed from the committed results tables when the book is rendered (the provenance "
        "box names the run); every claim, the paper's number beside ours, is on the "
        "{doc}`findings page </book/findings/findings>`.")))
    frame = pd.DataFrame(sentences, columns=["topic", "sentence"])
    return " ".join(frame.sentence), frame
