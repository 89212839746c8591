"""Where an engine's decode step spends its time (ZipFusion §IV-C): the GPU time of one replay of the
captured step graph, split by kernel kind from a profiler trace, beside the step's wall time as the
engine measured it (the rest is host work: scheduling, page tables, the token copy back).

Used by :func:`zipkv.throughput.decode_throughput` (``profile=True``) for the throughput chapter's
"why" rows: a tokens/s ratio is the ratio of whole steps, and only part of a step is attention.
"""
from __future__ import annotations

import re

import torch

__all__ = ["KERNEL_KINDS", "kernel_kind", "step_breakdown"]

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


def step_breakdown(graph: "torch.cuda.CUDAGraph", *, reps: int = 20, profiled: int = 3) -> dict:
    """GPU time of a captured decode step: ``replay_ms`` (median of ``reps`` timed replays, events
    around each) and ``kernel_ms`` (mean GPU milliseconds per replay by :func:`kernel_kind`, from
    ``torch.profiler`` over ``profiled`` replays; the kinds sum to the step's kernel time, which is at
    most ``replay_ms``: the difference is gaps between kernels) and ``top_kernels`` (the ten kernels
    with the most time, ``(name, ms per replay, kind)``).

    Replaying writes each request's new K/V again into the slot the step wrote (same inputs, same
    values) and reads the same pages: the cache is left as it was."""
    import statistics
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
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
    kinds = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"other": 0.0}
    for name, ms in per_name.items():
        kinds[kernel_kind(name)] += ms
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:10]
    return dict(replay_ms=statistics.median(times), kernel_ms=kinds,
                top_kernels=[(name, ms, kernel_kind(name)) for name, ms in top])
