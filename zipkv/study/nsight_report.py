"""Parse the committed Nsight Compute text report (``python -m zipkv bench ncu``) into tables.

The report is ``ncu``'s plain-text output behind a header of ``# key: value`` lines; its kernels appear
in the order its ``# kernels, in order:`` line names (``zipkv.bench.NCU_TARGETS`` when it was written, so a
report written before a target was added still parses). Each kernel block gives section metrics as rows
``<name> <unit> <value>`` and the raw counters named in ``zipkv.bench.NCU_METRICS``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import pandas as pd

SECTION_METRICS = ("Duration", "DRAM Throughput", "Memory Throughput", "Registers Per Thread",
                   "Dynamic Shared Memory Per Block", "Theoretical Occupancy", "Achieved Occupancy",
                   "Warp Cycles Per Issued Instruction")
COUNTERS = {"instructions": "smsp__inst_executed.sum", "shared loads": "smsp__inst_executed_op_shared_ld.sum",
            "shared load wavefronts": "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
            "shared load bank conflicts": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"}


@dataclass(frozen=True)
class NsightReport:
    device: str
    """The header's device line (device, driver, date, commit)."""
    metrics: pd.DataFrame
    """Rows ``"<metric> (<unit>)"`` and counters, one column per kernel, values as floats."""
    stalls: pd.DataFrame
    """Share (%) of sampled warp states by stall reason, one column per kernel."""

    def value(self, metric: str, kernel: str) -> float:
        """A section metric by name without its unit (``"Duration"``) or a counter label, for one kernel."""
        rows = [r for r in self.metrics.index if r == metric or r.startswith(metric + " (")]
        if not rows:
            raise KeyError(f"metric {metric!r} not in the report; it has {list(self.metrics.index)}")
        return float(self.metrics.loc[rows[0], kernel])


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def report_targets(report: str) -> list | None:
    """The kernels a report's header says it holds, in order (``# kernels, in order: a; b; c (...)``), or None."""
    line = next((x for x in report.splitlines() if x.startswith("# kernels, in order: ")), None)
    if line is None:
        return None
    return [name.strip() for name in line[len("# kernels, in order: "):].split(" (")[0].split(";")]


def parse(report: str, targets, kernels, stall_reasons) -> NsightReport:
    """Parse ``report``; its kernels are named as its header lists them (:func:`report_targets`), else by
    ``targets`` in order; ``kernels`` are the kernel function names that open each block, ``stall_reasons``
    the sampled stall counters. Raises ValueError when the number of kernel blocks is not the number of
    names."""
    blocks = re.split(rf"\n  (?={' |'.join(kernels)} )", report)[1:]
    targets = report_targets(report) or list(targets)
    if len(blocks) != len(targets):
        raise ValueError(f"report has {len(blocks)} kernel blocks, expected {len(targets)} ({targets})")
    rows, stalls = {}, {}
    for name, block in zip(targets, blocks):
        for metric in SECTION_METRICS:
            for hit in re.finditer(rf"^\s+{re.escape(metric)}\s+(\S.*?)\s{{2,}}([\d.,]+)\s*$", block, re.M):
                rows.setdefault(f"{metric} ({hit.group(1).strip()})", {})[name] = _number(hit.group(2))
        for label, counter in COUNTERS.items():
            hit = re.search(rf"^\s+{re.escape(counter)}\s+(?:[A-Za-z]\S*\s+)?([\d.,]+)\s*$", block, re.M)
            rows.setdefault(label, {})[name] = _number(hit.group(1)) if hit else float("nan")
        for reason in stall_reasons:
            hit = re.search(rf"^\s+smsp__pcsamp_warps_issue_stalled_{reason}\s+(?:[A-Za-z]\S*\s+)?([\d.,]+)\s*$",
                            block, re.M)
            stalls.setdefault(reason.replace("_", " "), {})[name] = _number(hit.group(1)) if hit else 0.0
    stall_share = pd.DataFrame(stalls).T
    device = next((line[2:] for line in report.splitlines() if line.startswith("# device")), "device not recorded")
    return NsightReport(device, pd.DataFrame(rows).T, 100 * stall_share / stall_share.sum())
