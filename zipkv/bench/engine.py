"""Where an engine's decode step spends its time (ZipFusion §IV-C): the GPU time of one replay of the
captured step graph, split by kernel kind from a profiler trace, beside the step's wall time as the
engine measured it (the rest is host work: scheduling, page tables, the token copy back).

Used by :func:`zipkv.study.experiments.throughput.decode_throughput` (``profile=True``) for the throughput chapter's
"why" rows: a tokens/s ratio is the ratio of whole steps, and only part of a step is attention.
"""
from __future__ import annotations

import re
import time

import torch

__all__ = ["KERNEL_KINDS", "idle_gaps", "kernel_kind", "step_breakdown"]

KERNEL_KINDS = (
    ("attention", re.compile(r"_pipelined_kernel|_decode_kernel|_merge_kernel")),
    ("restore", re.compile(r"_splitzip|_huffman")),
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|matmul", re.I)),
    ("kv_write", re.compile(r"index_put|scatter|indexing_backward", re.I)),
)
"""Kernel kinds by name (first match): zipkv's decode and merge kernels, the codecs' restore kernels,
cuBLAS/CUTLASS matrix products (projections, MLP, LM head), the KV writes; everything else is ``other``
(norms, RoPE, activations, copies, argmax)."""


def kernel_kind(name: str) -> str:
    """The :data:`KERNEL_KINDS` entry a kernel named ``name`` belongs to, else ``"other"``."""
    return next((kind for kind, pat in KERNEL_KINDS if pat.search(name)), "other")


def _per_kind() -> dict:
    """``{kind: 0.0}`` for every :func:`kernel_kind`, ``other`` last."""
    return {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"other": 0.0}


def idle_gaps(kernels, replays: int) -> dict:
    """Where the GPU idles during ``replays`` back-to-back replays of one graph.

    kernels: ``(name, start_ns, end_ns)`` of every kernel (and copy) the replays ran on the GPU, any order.
    In start order, the idle time before a kernel is its start minus the latest end of the kernels before
    it (0 when they overlap); the time before the first one is not counted, and a gap between two replays
    counts before the graph's first kernel (the next replay's launch, which ``replay_ms`` includes too).

    Returns ``gap_ms`` (mean idle ms per replay by the :func:`kernel_kind` of the kernel *after* the gap)
    and ``top_gaps`` (the ten ``(kernel before, kernel after, ms per replay, count per replay)`` pairs
    with the most idle time).
    """
    if not isinstance(replays, int) or replays < 1:
        raise ValueError(f"replays must be an int >= 1, got {replays!r}")
    ordered = sorted(kernels, key=lambda k: k[1])
    by_kind = _per_kind()
    pairs: dict[tuple, list] = {}
    last_end = ordered[0][2] if ordered else 0
    for (before, _, _), (name, start, end) in zip(ordered, ordered[1:]):
        gap = max(0, start - last_end) / 1e6 / replays
        last_end = max(last_end, end)
        by_kind[kernel_kind(name)] += gap
        entry = pairs.setdefault((before, name), [0.0, 0])
        entry[0] += gap
        entry[1] += 1
    top = sorted(pairs.items(), key=lambda kv: -kv[1][0])[:10]
    return dict(gap_ms=by_kind, top_gaps=[(b, a, ms, n / replays) for (b, a), (ms, n) in top])


def step_breakdown(graph: "torch.cuda.CUDAGraph", *, reps: int = 20, profiled: int = 3) -> dict:
    """GPU time of a captured decode step: ``replay_ms`` (median of ``reps`` timed replays, events
    around each), ``launch_ms`` (median host time until ``graph.replay()`` returns, inside those events: until
    the launch has enqueued the graph its first kernel cannot start) and ``kernel_ms`` (mean GPU
    milliseconds per replay by :func:`kernel_kind`, from ``torch.profiler`` over ``profiled`` replays; the
    kinds sum to the step's kernel time, which is at most ``replay_ms``: the difference is gaps between
    kernels), ``top_kernels`` (the ten kernels with the most time, ``(name, ms per replay, kind)``) and the
    same replays' :func:`idle_gaps` (``gap_ms``, ``top_gaps``: which kernels the GPU waits before).

    Replaying writes each request's new K/V again into the slot the step wrote (same inputs, same
    values) and reads the same pages: the cache is left as it was."""
    import statistics
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times, launch = [], []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        graph.replay()
        launch.append(1e3 * (time.perf_counter() - t0))
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(profiled):
            graph.replay()
        torch.cuda.synchronize()
    per_name: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.device_time_total and ev.key != "cudaGraphLaunch":      # kernels only, not the launch call
            per_name[ev.key] = per_name.get(ev.key, 0.0) + ev.device_time_total / 1e3 / profiled
    kinds = _per_kind()
    for name, ms in per_name.items():
        kinds[kernel_kind(name)] += ms
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:10]
    launched = [(e.name(), e.start_ns(), e.end_ns()) for e in prof.profiler.kineto_results.events()
                if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0]
    return dict(replay_ms=statistics.median(times), launch_ms=statistics.median(launch), kernel_ms=kinds,
                top_kernels=[(name, ms, kernel_kind(name)) for name, ms in top], **idle_gaps(launched, profiled))
