"""fp32 torch references for the kernels in ``zipkv.kernels``."""
from __future__ import annotations

import torch

from zipkv import paged
from zipkv.kernels.inputs import batch_mismatch, check_page_table, check_scale, check_values

__all__ = ["decode_attention_reference", "gather_kv"]


def gather_kv(cache, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, *, validate: bool = True):
    """Decode every request's K and V with ``zipkv.format.unpack`` (``validate`` passed on): list of ``(k, v)``,
    each bf16 ``[kv_heads, seq_len, head_dim]``."""
    k_all, v_all = cache.read_pages(validate=validate)      # [num_pages, H, 16, D]
    ip, idx, last = indptr.tolist(), indices.long(), last_page_len.tolist()
    out = []
    for b in range(len(ip) - 1):
        pages = idx[ip[b]: ip[b + 1]]
        n = (len(pages) - 1) * 16 + last[b]
        k = k_all[pages].permute(1, 0, 2, 3).reshape(cache.kv_heads, -1, cache.head_dim)[:, :n]
        v = v_all[pages].permute(1, 0, 2, 3).reshape(cache.kv_heads, -1, cache.head_dim)[:, :n]
        out.append((k, v))
    return out


def decode_attention_reference(q: torch.Tensor, cache, indptr, indices, last_page_len, *,
                               softmax_scale: float | None = None, validate: bool = True) -> torch.Tensor:
    """Reference of :func:`zipkv.kernels.decode_attention.decode_attention`: unpack the
    cache, then attention in fp32. q: ``[batch, q_heads, head_dim]``; returns fp32. The inputs are checked as
    :func:`~zipkv.kernels.decode_attention.plan` checks them, and every page is unpacked with validation;
    ``validate=False`` skips reading the page table's values and the pages' checks (a caller that built the table
    itself). Unlike the kernels it reads any layouts for keys and values, the mma layouts outside their pair too."""
    paged.check_cache(cache, kernel_layouts=False)
    batch = check_page_table(cache, indptr, indices, last_page_len)
    if not isinstance(q, torch.Tensor) or not q.is_floating_point():
        raise TypeError(f"q must be a floating-point torch.Tensor, got {getattr(q, 'dtype', type(q).__name__)}")
    D, HKV = cache.head_dim, cache.kv_heads
    if q.dim() != 3 or q.shape[2] != D or q.shape[1] % HKV or q.shape[1] == 0:
        raise ValueError(f"q must have shape [batch, q_heads, {D}] with q_heads a multiple of kv_heads={HKV}, "
                         f"got {tuple(q.shape)}")
    if q.shape[0] != batch:
        raise ValueError(batch_mismatch(q.shape[0], batch + 1))
    scale = check_scale(softmax_scale, D)
    if validate and batch:
        check_values(cache, indptr, indices, last_page_len)
    B, HQ, _ = q.shape
    G = HQ // HKV
    out = torch.empty(B, HQ, D, dtype=torch.float32, device=q.device)
    for b, (k, v) in enumerate(gather_kv(cache, indptr, indices, last_page_len, validate=validate)):
        qb = q[b].float().reshape(cache.kv_heads, G, D)
        s = torch.einsum("hgd,htd->hgt", qb, k.float()) * scale
        out[b] = torch.einsum("hgt,htd->hgd", s.softmax(-1), v.float()).reshape(HQ, D)
    return out
