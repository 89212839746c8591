"""fp32 torch references for the kernels in ``zipkv.kernels``."""
from __future__ import annotations

import math

import torch

__all__ = ["decode_attention_reference", "gather_kv"]


def gather_kv(cache, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor):
    """Decode every request's K and V with ``zipkv.format.unpack``: list of ``(k, v)``,
    each bf16 ``[kv_heads, seq_len, head_dim]``."""
    k_all, v_all = cache.read_pages()                       # [num_pages, H, 16, D]
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
                               softmax_scale: float | None = None) -> torch.Tensor:
    """Reference of :func:`zipkv.kernels.decode_attention.decode_attention`: unpack the
    cache, then attention in fp32. q: ``[batch, q_heads, head_dim]``; returns fp32."""
    B, HQ, D = q.shape
    G = HQ // cache.kv_heads
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    out = torch.empty(B, HQ, D, dtype=torch.float32, device=q.device)
    for b, (k, v) in enumerate(gather_kv(cache, indptr, indices, last_page_len)):
        qb = q[b].float().reshape(cache.kv_heads, G, D)
        s = torch.einsum("hgd,htd->hgt", qb, k.float()) * scale
        out[b] = torch.einsum("hgt,htd->hgd", s.softmax(-1), v.float()).reshape(HQ, D)
    return out
