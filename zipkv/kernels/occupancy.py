"""Occupancy of a compiled kernel on an sm_90 SM (H100/H200): how many of its programs one SM holds at once.

Used at run time by the decode planner (:mod:`zipkv.kernels.decode_mma`) and offline by
:mod:`zipkv.kernels.kernel_info`'s resource table.
"""
from __future__ import annotations

H200_SM = dict(registers=65536, shared_bytes=233472, threads=2048, programs=32, reserved_per_block=1024, sms=132)
"""Per-SM limits of the H200/H100 (sm_90): 64 K registers, 228 KB shared memory (of which the driver reserves
1 KB per resident block), 2048 threads, 32 blocks; and the H200's (and H100 SXM's) 132 SMs."""


def programs_per_sm(registers: int, num_warps: int, shared_bytes: int, sm: dict = H200_SM) -> int:
    """How many programs of a compiled kernel fit on one SM at once (occupancy), from its
    registers per thread, warps and shared memory; registers are allocated per warp in units of 256."""
    regs_per_warp = -(-registers * 32 // 256) * 256
    by_regs = sm["registers"] // (regs_per_warp * num_warps)
    by_smem = sm["shared_bytes"] // (shared_bytes + sm["reserved_per_block"]) if shared_bytes else sm["programs"]
    by_threads = sm["threads"] // (32 * num_warps)
    return int(min(by_regs, by_smem, by_threads, sm["programs"]))
