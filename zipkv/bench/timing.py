"""GPU timing: cold-L2 medians (:class:`ColdTimer`) and the copy bandwidth measured in the same process
(:func:`copy_bandwidth`), the anchor every benchmark's fraction of bandwidth is computed against."""
from __future__ import annotations

import statistics

import torch

__all__ = ["ColdTimer", "copy_bandwidth", "L2_FLUSH_BYTES"]

L2_FLUSH_BYTES = 256 << 20


class ColdTimer:
    """Median GPU latency of a CUDA callable with the L2 cache cleared before each timed call.

    The flush reads a buffer larger than L2 (the H200's is 50 MB): the previous call's KV bytes are
    evicted, so every call reads its inputs from HBM, and lines written before the flush are written
    back during it. Writing the buffer instead (``triton.testing.do_bench``'s flush) leaves L2 full of
    dirty lines whose write-back then falls inside the next timed call (on the H200 it added the same
    few microseconds to FlashInfer's and zipkv's times): traffic no decode step has. After the
    flush a spin kernel (``spin_us``, longer than any method's host-side launch work) keeps the GPU busy
    while the host enqueues the call, so the events time what the GPU does between them, not the
    Python and launch overhead of whichever method is slower to enqueue.
    """

    def __init__(self, flush_bytes: int = L2_FLUSH_BYTES, device: str = "cuda", spin_us: float = 1000.0):
        self.flush = torch.ones(flush_bytes // 8, dtype=torch.int64, device=device)
        self.spin_cycles = int(spin_us * 2e3)  # at most 2 GHz: at least spin_us

    def __call__(self, fn, reps: int = 30, warmup: int = 3) -> float:
        """Median microseconds of ``fn()`` over ``reps`` timed calls."""
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            self.flush.sum()                   # reads only: L2 left holding clean lines
            torch.cuda._sleep(self.spin_cycles)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)


def copy_bandwidth(nbytes: int = 4 << 30, device: str = "cuda", reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s: (bytes read + bytes written) / time, median."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    timer = ColdTimer(device=device)
    micros = timer(lambda: dst.copy_(src), reps=reps)
    del src, dst
    return 2 * nbytes / (micros * 1e-6)
