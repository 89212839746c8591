"""Merge of split-KV partial attention outputs (FlashDecoding's second step), shared by both decode
kernels (:mod:`zipkv.kernels.decode_triton`, :mod:`zipkv.kernels.decode_mma`).

Each split of a (request, query head) row wrote its normalised partial output ``o_s`` (fp32) and its
log2-sum-exp ``lse_s`` (``-inf`` for a split that held no token); the row's output is
``sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m)`` with ``m = max_s lse_s``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["merge_splits"]


@triton.jit
def _merge_kernel(part_ptr, lse_ptr, out_ptr, D: tl.constexpr, SPLITS: tl.constexpr,
                  S_PAD: tl.constexpr):
    row = tl.program_id(0)
    sp = tl.arange(0, S_PAD)
    dd = tl.arange(0, D)
    sm = sp < SPLITS
    lse = tl.load(lse_ptr + row * SPLITS + sp, mask=sm, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))    # some split holds a token: max is finite
    o = tl.load(part_ptr + (row * SPLITS + sp)[:, None] * D + dd[None, :], mask=sm[:, None], other=0.0)
    res = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + row * D + dd, res.to(out_ptr.dtype.element_ty))


def merge_splits(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """part: fp32 ``[batch, q_heads, splits, head_dim]``, lse: fp32 ``[batch, q_heads, splits]`` ->
    ``out`` ``[batch, q_heads, head_dim]`` (bf16 or fp32), one program per row. Inputs are the decode
    launchers' own buffers (not checked here)."""
    B, HQ, splits, D = part.shape
    _merge_kernel[(B * HQ,)](part, lse, out, D=D, SPLITS=splits, S_PAD=triton.next_power_of_2(splits))
    return out
