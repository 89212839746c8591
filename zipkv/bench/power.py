"""The GPU's SM clock, power draw and clock-limit reasons while a benchmark runs, sampled by ``nvidia-smi``
(:class:`GpuMonitor`).

A decode step that draws the board's power limit runs at a lowered SM clock: a kernel whose speed depends on
the clock (ZipFusion's rebuilds every value with integer and shuffle work) then slows where one bound by
memory bandwidth alone does not. The throughput chapter records, per run, the median SM clock, the median
power and the share of samples that the power cap limited, so that a step-time ratio can be read with them.
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time

__all__ = ["GpuMonitor", "POWER_CAP", "parse_sample", "summarize"]

POWER_CAP = 0x4
"""``clocks_event_reasons.active`` bit: the SM clock is lowered to hold the board's power limit (``SW Power Cap``)."""

QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"


def parse_sample(line: str):
    """One ``nvidia-smi --query-gpu=clocks.sm,power.draw,clocks_event_reasons.active --format=csv,noheader,nounits``
    line -> ``(sm_clock_mhz, power_w, reasons)``, or None for a line that is not one (a header, ``[N/A]``)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 3:
        return None
    try:
        return float(parts[0]), float(parts[1]), int(parts[2], 16)
    except ValueError:
        return None


def summarize(samples) -> dict:
    """``samples``: ``(sm_clock_mhz, power_w, reasons)``. Returns the median SM clock (MHz), the median and the
    largest power (W) and the share of samples limited by the power cap (:data:`POWER_CAP`); NaNs without samples."""
    nan = float("nan")
    if not samples:
        return dict(sm_clock_mhz=nan, power_w=nan, power_w_max=nan, frac_power_capped=nan)
    return dict(sm_clock_mhz=statistics.median(s[0] for s in samples),
                power_w=statistics.median(s[1] for s in samples), power_w_max=max(s[1] for s in samples),
                frac_power_capped=sum(1 for s in samples if s[2] & POWER_CAP) / len(samples))


class GpuMonitor:
    """``with GpuMonitor(index) as mon: ...`` samples GPU ``index`` every ``interval_ms`` (``nvidia-smi -lms``) in
    a background process; :meth:`summary` summarises the samples of the last ``seconds`` (default all) of the
    block. Without ``nvidia-smi`` it samples nothing and the summary is NaNs (:attr:`available` False)."""

    def __init__(self, index: int = 0, interval_ms: int = 100):
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"index must be a GPU index (int >= 0), got {index!r}")
        if isinstance(interval_ms, bool) or not isinstance(interval_ms, int) or interval_ms < 10:
            raise ValueError(f"interval_ms must be an int >= 10, got {interval_ms!r}")
        self.index, self.interval_ms = index, interval_ms
        self.available = shutil.which("nvidia-smi") is not None
        self.samples: list[tuple[float, tuple]] = []          # (monotonic time, sample)
        self.proc = self.reader = None
        self.end = None

    def _read(self):
        for line in self.proc.stdout:
            s = parse_sample(line)
            if s is not None:
                self.samples.append((time.monotonic(), s))

    def __enter__(self):
        if self.available:
            self.proc = subprocess.Popen(["nvidia-smi", "-i", str(self.index), f"--query-gpu={QUERY}",
                                          "--format=csv,noheader,nounits", "-lms", str(self.interval_ms)],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self.reader = threading.Thread(target=self._read, daemon=True)
            self.reader.start()
        return self

    def __exit__(self, *exc):
        self.end = time.monotonic()
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
            self.reader.join(timeout=5)
        return False

    def summary(self, seconds: float | None = None) -> dict:
        """:func:`summarize` of the samples taken in the last ``seconds`` before the block ended (None: all)."""
        end = self.end if self.end is not None else time.monotonic()
        return summarize([s for t, s in self.samples if seconds is None or t >= end - seconds])
