"""Chapter "Inside the kernels": compiled resources, the committed tuning sweep and Nsight Compute
report, and how the way L2 is cleared enters the latency chapter's timings."""
from __future__ import annotations

import pandas as pd

from zipkv.study.nsight_report import NsightReport
from zipkv.study.settings import PROJECT_TARGETS, ZIPFUSION_PAPER

COMPRESSED, UNCOMPRESSED = "decode all compressed", "decode uncompressed"


def _span(values, unit: str = "") -> str:
    lo, hi = int(min(values)), int(max(values))
    return f"{lo}{unit}" if lo == hi else f"{lo}–{hi}{unit}"


def resources_text(table: pd.DataFrame, warp_slots: int) -> str:
    """What the compiler's resource numbers mean for occupancy."""
    decode = table[table.kernel == "_decode_kernel"]
    clean, spilling = decode[decode.spill_stores == 0], decode[decode.spill_stores > 0]
    text = (f"Without spills, the Triton decode specialisations use {_span(clean.registers)} registers per thread and "
            f"{_span(clean.shared_bytes // 1024, ' KB')} of shared memory, so an SM runs {_span(clean.programs_per_sm)} "
            f"programs ({_span(clean.programs_per_sm * clean.num_warps)} of its {warp_slots} warp slots), with "
            f"{_span(clean.cp_async_ptx)} asynchronous copies in their PTX.")
    if len(spilling):
        spills = "; ".join(f"the {path} one with {int(r.pages_per_tile)} pages per tile spills {int(r.spill_stores)} bytes"
                           for path, r in spilling.set_index("path").iterrows())
        text += f" Of the options compiled, {spills} of registers."
    gluon = table[table.kernel == "_pipelined_kernel"].set_index("path")
    return text + (f" The Gluon kernel's pipelined loop runs one warp per program: all-compressed "
                   f"{int(gluon.registers['compressed'])} registers, {gluon.shared_bytes['compressed'] / 1024:.1f} KB "
                   f"(a ring of {int(gluon.num_stages['compressed'])} pages), {int(gluon.programs_per_sm['compressed'])} "
                   f"programs per SM; all-raw {int(gluon.registers['raw'])} registers, "
                   f"{gluon.shared_bytes['raw'] / 1024:.1f} KB, {int(gluon.programs_per_sm['raw'])} programs per SM; "
                   f"any page (mixed) {int(gluon.registers['mixed'])} registers, "
                   f"{gluon.shared_bytes['mixed'] / 1024:.1f} KB, {int(gluon.programs_per_sm['mixed'])} "
                   f"programs per SM.")


def tuning_summary(sweep: pd.DataFrame) -> pd.DataFrame:
    """Per decode path of a launch-option sweep: fastest, median and slowest latency (µs), the configurations timed and
    those that failed or disagreed with the reference (a Styler)."""
    ok = sweep.dropna(subset=["latency_us"])
    summary = ok.groupby("path").latency_us.agg(["min", "median", "max"]).rename(columns=lambda c: f"{c} µs")
    summary["configurations"] = ok.groupby("path").size()
    summary["failed or disagreed"] = sweep.groupby("path").size() - summary["configurations"]
    return summary.style.format("{:.1f}", subset=[c for c in summary if c.endswith("µs")])


def tuning_options(tuning: dict) -> pd.DataFrame:
    """The stored launch options (the kernels' tuning file, ``{gpu: {path: options, "gluon": {head_dim: {path:
    options}}}}``) as a table: one row per GPU, kernel and path, the options in words (a Styler)."""
    names = {"pages_per_tile": "pages per tile", "num_warps": "warps", "stages": "pipeline stages",
             "programs_per_sm": "programs per SM", "maxnreg": "register cap"}
    rows = []
    for gpu, options in tuning.items():
        for path, o in options.items():
            if path == "gluon":
                rows += [{"GPU": gpu, "kernel": f"Gluon, head_dim {d}", "path": p, **q}
                         for d, paths in o.items() for p, q in paths.items()]
            else:
                rows.append({"GPU": gpu, "kernel": "Triton", "path": path, **o})
    table = pd.DataFrame(rows).rename(columns=names).sort_values(["GPU", "kernel", "path"], kind="stable")
    if "register cap" in table:
        table["register cap"] = table["register cap"].map(lambda r: "none" if r == 0 else f"{r:.0f}")
    counts = [c for c in names.values() if c in table and c != "register cap"]
    return table.style.format("{:.0f}", subset=counts, na_rep="–").hide(axis="index")


def verdict(report: NsightReport) -> str:
    """The kernel-resources chapter's verdict from the Nsight Compute ``report``: DRAM use, time and instructions of the
    all-compressed Gluon kernel against the uncompressed one, its two commonest stall reasons, and the SmolLM2 shape's."""
    v = report.value
    comp, unc = COMPRESSED, UNCOMPRESSED
    return (f"Under Nsight Compute the all-compressed Gluon kernel keeps DRAM {v('DRAM Throughput', comp):.0f} % busy "
            f"and takes {v('Duration', comp):.0f} µs against {v('Duration', unc):.0f} µs uncompressed "
            f"({v('Duration', unc) / v('Duration', comp):.2f}×), executing "
            f"{v('instructions', comp) / v('instructions', unc):.2f}× the instructions; its warps wait most often on "
            + ", ".join(f"{r} ({s:.0f} %)" for r, s in report.stalls[comp].sort_values(ascending=False).head(2).items())
            + ". " + _small_shape(report)
            + f"The report: {report.device.removeprefix('device: ')}; a kernel changed after that commit is not "
            f"in it.")


def _small_shape(report: NsightReport) -> str:
    """The SmolLM2-shape kernels of a report that has them (head_dim 64, 3 query heads per KV head): how busy DRAM
    is and what the compressed kernel executes per byte against the uncompressed one."""
    from zipkv.bench.attention import ATTENTION_SHAPES
    from zipkv.bench.nsight import NCU_BATCH

    comp, unc = "SmolLM2 " + COMPRESSED, "SmolLM2 " + UNCOMPRESSED
    if comp not in report.metrics.columns:
        return ""
    v = report.value
    shape = ATTENTION_SHAPES["smollm2-135m"]
    return (f"At SmolLM2's shape (head_dim {shape.head_dim}, {shape.kv_heads} KV heads: {NCU_BATCH * shape.kv_heads} "
            f"request-head pairs at batch {NCU_BATCH}) the all-compressed "
            f"kernel keeps DRAM only {v('DRAM Throughput', comp):.0f} % busy (uncompressed {v('DRAM Throughput', unc):.0f} "
            f"%) in {v('Duration', comp):.1f} µs against {v('Duration', unc):.1f} µs, with "
            f"{v('instructions', comp) / v('instructions', unc):.2f}× the uncompressed kernel's instructions; its one-warp "
            f"programs fill {v('Achieved Occupancy', comp):.0f} % of the warp slots where "
            f"{v('Theoretical Occupancy', comp):.0f} % would fit (the Llama-shape kernel {v('Achieved Occupancy', COMPRESSED):.0f} "
            f"%, with DRAM {v('DRAM Throughput', COMPRESSED):.0f} % busy: not the occupancy, the shape sets the rate; the "
            "latency chapter's SmolLM2 point says more); its warps wait most often on "
            + ", ".join(f"{r} ({s:.0f} %)" for r, s in report.stalls[comp].sort_values(ascending=False).head(2).items())
            + ". ")


def stall_figure(report: NsightReport):
    """Horizontal bars: share of sampled warp states by stall reason, per profiled kernel."""
    import matplotlib.pyplot as plt

    share = report.stalls.loc[report.stalls.max(axis=1) >= 1].sort_values(COMPRESSED)
    fig, ax = plt.subplots(figsize=(10, 0.25 * len(share) + 1.2))
    share.plot.barh(ax=ax, width=0.8)
    ax.set_xlabel("share of sampled warp states (%)")
    ax.set_ylabel("stall reason ('selected': issuing)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(title="kernel (Nsight Compute, H200)")
    return fig


def metrics_table(report: NsightReport):
    """The report's metrics per kernel, with bank conflicts per shared load added (a Styler)."""
    table = report.metrics.copy()
    table.loc["bank conflicts per shared load"] = table.loc["shared load bank conflicts"] / table.loc["shared loads"]
    return table.style.format("{:,.2f}").set_caption(report.device)


def flush_table(latest: pd.DataFrame, older: pd.DataFrame) -> pd.DataFrame:
    """The anchor point of two latency runs, one per way of clearing L2 (writing, then reading a buffer)."""
    runs = []
    for flush, t in (("write (older run)", older), ("read (latency chapter)", latest)):
        t = t[(t["shape"] == "llama3.1-8b") & (t.ctx == ZIPFUSION_PAPER.anchor_context)
              & (t.batch == ZIPFUSION_PAPER.anchor_batch)]
        t = t[t.kernel.fillna("gluon").eq("gluon") & t.kv_data.isin(["all compressible", "any"])]
        lat = t.set_index("method").latency_us
        runs.append({"L2 flush": flush, "FlashInfer TC (µs)": lat["flashinfer_tc"],
                     "zipkv compressed (µs)": lat["zipkv_compressed"], "zipkv uncompressed (µs)": lat["zipkv_uncompressed"],
                     "speedup vs FlashInfer TC": lat["flashinfer_tc"] / lat["zipkv_compressed"]})
    return pd.DataFrame(runs).set_index("L2 flush")


def flush_text(flushes: pd.DataFrame) -> str:
    """The anchor point timed with the writing and the reading L2 flush (``flushes``, two rows): both speedups against
    this project's target."""
    w, r = flushes.iloc[0], flushes.iloc[1]
    target = PROJECT_TARGETS.speedup_vs_flashinfer_tc
    side = lambda x: "above" if x >= target else "below"  # noqa: E731
    return (f"With the reading flush instead of the writing one FlashInfer TC took {r['FlashInfer TC (µs)']:.1f} µs instead of "
            f"{w['FlashInfer TC (µs)']:.1f}, ours {r['zipkv compressed (µs)']:.1f} instead of {w['zipkv compressed (µs)']:.1f} "
            f"(two runs, two leases of the H200): speedup {w['speedup vs FlashInfer TC']:.3f}× with the writing flush and "
            f"{r['speedup vs FlashInfer TC']:.3f}× with the reading one, {_sides(side(w['speedup vs FlashInfer TC']), side(r['speedup vs FlashInfer TC']))} "
            f"this project's {target:.2f}× target.")


def _sides(first: str, second: str) -> str:
    return f"both {first}" if first == second else f"{first} and {second} respectively"
