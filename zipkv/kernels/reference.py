"""fp32 torch references for the kernels in ``zipkv.kernels``."""
from __future__ import annotations

import torch

from zipkv import paged
from zipkv.kernels.inputs import batch_mismatch, check_page_table, check_scale, check_values

__all__ = ["decode_attention_reference", "gather_kv", "request_kv", "attention_fp32"]


def request_kv(k_pages: torch.Tensor, v_pages: torch.Tensor, indptr, indices: torch.Tensor, last_page_len):
    """Each request's K and V out of pages already unpacked: k_pages, v_pages bf16 ``[num_pages, kv_heads, 16,
    head_dim]`` at the page ids that ``indices`` (int ``[nnz_pages]``) holds; indptr, last_page_len: the page table's
    (tensors or lists). Returns a list of ``(k, v)``, each bf16 ``[kv_heads, seq_len, head_dim]``."""
    ip = indptr.tolist() if isinstance(indptr, torch.Tensor) else list(indptr)
    last = last_page_len.tolist() if isinstance(last_page_len, torch.Tensor) else list(last_page_len)
    idx = indices.long()
    H, T, D = k_pages.shape[1:]
    out = []
    for b in range(len(ip) - 1):
        pages = idx[ip[b]: ip[b + 1]]
        n = (len(pages) - 1) * T + last[b]
        k = k_pages[pages].permute(1, 0, 2, 3).reshape(H, -1, D)[:, :n]
        v = v_pages[pages].permute(1, 0, 2, 3).reshape(H, -1, D)[:, :n]
        out.append((k, v))
    return out


def gather_kv(cache, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, *, validate: bool = True):
    """Decode the pages the page table names (only those) with ``zipkv.format.unpack`` (``validate`` passed on): list
    of ``(k, v)`` per request, each bf16 ``[kv_heads, seq_len, head_dim]``."""
    nnz = int(indptr[-1])
    if not nnz:
        return []
    k_used, v_used = cache.read_pages(indices[:nnz], validate=validate)     # [nnz, H, 16, D], the table's order
    return request_kv(k_used, v_used, indptr, torch.arange(nnz), last_page_len)


def attention_fp32(q: torch.Tensor, kv: list, scale: float) -> torch.Tensor:
    """Attention of one query token per request in fp32: q ``[batch, q_heads, head_dim]``; kv: per request ``(k, v)``
    bf16 ``[kv_heads, seq_len, head_dim]`` (:func:`request_kv`), a group of ``q_heads / kv_heads`` query heads per KV
    head. Returns fp32 ``[batch, q_heads, head_dim]``."""
    B, HQ, D = q.shape
    out = torch.empty(B, HQ, D, dtype=torch.float32, device=q.device)
    for b, (k, v) in enumerate(kv):
        qb = q[b].float().reshape(k.shape[0], HQ // k.shape[0], D)
        s = torch.einsum("hgd,htd->hgt", qb, k.float()) * scale
        out[b] = torch.einsum("hgt,htd->hgd", s.softmax(-1), v.float()).reshape(HQ, D)
    return out


def decode_attention_reference(q: torch.Tensor, cache, indptr, indices, last_page_len, *,
                               softmax_scale: float | None = None, validate: bool = True) -> torch.Tensor:
    """Reference of :func:`zipkv.kernels.decode_attention.decode_attention`: unpack the pages the page table names,
    then attention in fp32 (:func:`attention_fp32`). q: ``[batch, q_heads, head_dim]``; returns fp32. The inputs are
    checked as :func:`~zipkv.kernels.decode_attention.plan` checks them, and every page read is unpacked with
    validation; ``validate=False`` skips reading the page table's values and the pages' checks (a caller that built
    the table itself). Unlike the kernels it reads any layouts for keys and values, the mma layouts outside their
    pair too."""
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
    return attention_fp32(q, gather_kv(cache, indptr, indices, last_page_len, validate=validate), scale)
