"""Checks of a decode-attention call's inputs (FlashInfer's CSR page table, the softmax scale, the batch of ``q``), shared by the
kernels' :func:`~zipkv.kernels.decode_attention.plan` and the fp32 torch reference (:mod:`zipkv.kernels.reference`):
each raises a ``TypeError``/``ValueError`` naming the argument before any work."""
from __future__ import annotations

import math
import numbers

import torch

from zipkv import format as fmt
from zipkv import paged


def check_index(x, name, n=None):
    """``x`` (the argument ``name``) must be a contiguous 1-D int32 tensor, of length ``n`` when given."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {x.dtype}")
    if x.dim() != 1 or (n is not None and x.shape[0] != n):
        want = f"[{n}]" if n is not None else "1-D"
        raise ValueError(f"{name} must have shape {want}, got {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got stride {x.stride()}")


def check_scale(softmax_scale, head_dim) -> float:
    """The softmax scale: ``1/√head_dim`` for ``None``, else a finite positive real number."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number or None, got {type(softmax_scale).__name__}")
    scale = float(softmax_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale must be a finite positive number, got {softmax_scale!r}")
    return scale


def check_values(cache, indptr, indices, last_page_len):
    """The page table's values and every used block descriptor (one device sync)."""
    ip = indptr.tolist()
    if ip[0] != 0 or any(b <= a for a, b in zip(ip, ip[1:])) or ip[-1] > indices.numel():
        raise ValueError(f"indptr must start at 0, increase strictly (every request has >= 1 page) "
                         f"and end at <= len(indices)={indices.numel()}, got {ip if len(ip) <= 20 else ip[:20] + ['...']}")
    used = indices[: ip[-1]]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= cache.num_pages):
        raise ValueError(f"indices must lie in [0, {cache.num_pages}) (cache.num_pages), got range "
                         f"[{int(used.min())}, {int(used.max())}]")
    if last_page_len.numel() and (int(last_page_len.min()) < 1 or int(last_page_len.max()) > fmt.PAGE_TOKENS):
        raise ValueError(f"last_page_len must lie in [1, {fmt.PAGE_TOKENS}], got range "
                         f"[{int(last_page_len.min())}, {int(last_page_len.max())}]")
    paged.check_descriptors(cache, used)


def batch_mismatch(q_batch: int, indptr_len: int) -> str:
    """The message for a ``q`` batch that does not match the page table's ``indptr``."""
    return (f"q: batch {q_batch} does not match the page table: indptr has {indptr_len} entries, i.e. "
            f"{indptr_len - 1} requests (indptr must have shape [batch + 1])")


def check_page_table(cache, indptr, indices, last_page_len) -> int:
    """The page table's types, shapes and device, against ``cache`` (no device sync; :func:`check_values` reads the
    values): returns the batch size."""
    check_index(indptr, "indptr")
    if indptr.numel() == 0:
        raise ValueError("indptr must have shape [batch + 1], got (0,)")
    batch = indptr.shape[0] - 1
    check_index(indices, "indices")
    check_index(last_page_len, "last_page_len (batch = len(indptr) - 1)", batch)
    devs = {t.device for t in (cache.pool, indptr, indices, last_page_len)}
    if len(devs) != 1:
        raise ValueError(f"cache, indptr, indices and last_page_len must be on one device, got {sorted(map(str, devs))}")
    return batch
