"""The comparison points of ZipFusion's attention benchmark (§IV-B): FlashInfer's paged decode
(tensor-core and CUDA-core paths) over bf16 NHD pages, torch SDPA on a contiguous cache, and fp32
attention, the reference every timed method is checked against."""
from __future__ import annotations

import torch

from zipkv import format as kvformat

__all__ = ["FlashInferDecode", "sdpa_decode", "nhd_pages", "paged_table", "reference_attention", "error_vs_reference"]

PAGE = kvformat.PAGE_TOKENS


class FlashInferDecode:
    """FlashInfer's batch paged decode over a bf16 NHD paged cache, planned once.

    Args:
        indptr, indices, last_page_len: the CSR page table (int32, on the GPU).
        q_heads, kv_heads, head_dim, page_size: the attention shape.
        use_tensor_cores: FlashInfer's tensor-core (prefill-style) path or its CUDA-core path.
        kv_dtype: the pages' dtype: ``torch.bfloat16``, or ``torch.float8_e4m3fn`` (FlashInfer's FP8 KV cache, scale 1:
            the pages passed to the call are already e4m3).
    """

    def __init__(self, indptr, indices, last_page_len, q_heads: int, kv_heads: int, head_dim: int,
                 page_size: int, use_tensor_cores: bool, kv_dtype: torch.dtype = torch.bfloat16):
        import flashinfer

        if kv_dtype not in (torch.bfloat16, torch.float8_e4m3fn):
            raise ValueError(f"kv_dtype={kv_dtype}: expected torch.bfloat16 or torch.float8_e4m3fn")
        self.workspace = torch.empty(256 << 20, dtype=torch.uint8, device=indptr.device)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                     use_tensor_cores=use_tensor_cores)
        self.wrapper.plan(indptr, indices, last_page_len, q_heads, kv_heads, head_dim, page_size,
                          pos_encoding_mode="NONE", q_data_type=torch.bfloat16, kv_data_type=kv_dtype)

    def __call__(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        """q [batch, q_heads, d]; k_pages, v_pages [num_pages, page_size, kv_heads, d] → [batch, q_heads, d]."""
        return self.wrapper.run(q, (k_pages, v_pages))


def sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """torch SDPA decode on a contiguous cache: q [batch, q_heads, d], k/v [batch, kv_heads, T, d]."""
    out = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)
    return out[:, :, 0]


def nhd_pages(x, physical):
    """K or V ``[batch, kv_heads, T, d]`` (T a multiple of the page size) -> FlashInfer's NHD pages
    ``[num_pages, PAGE, kv_heads, d]`` with logical page i stored at ``physical[i]``."""
    batch, kv_heads, T, d = x.shape
    logical = x.reshape(batch, kv_heads, T // PAGE, PAGE, d).permute(0, 2, 3, 1, 4).reshape(-1, PAGE, kv_heads, d)
    pages = torch.empty_like(logical)
    pages[physical] = logical
    return pages


def paged_table(k, v, seed: int = 0, shuffle: bool = True):
    """FlashInfer's inputs for full-page requests of contiguous K/V ``[batch, kv_heads, T, d]`` (T a multiple of the
    page size) at :func:`zipkv.paged.physical_page_ids` -- the page table of
    :func:`zipkv.paged.build_paged_cache`'s caches built with the same ``seed`` and ``shuffle``: ``(indptr, indices,
    last_page_len, k_pages, v_pages)``, the table int32 on k's device, the pages as :func:`nhd_pages`."""
    from zipkv.paged import physical_page_ids

    batch, _, T, _ = k.shape
    if T % PAGE:
        raise ValueError(f"k must hold whole pages of {PAGE} tokens, got T={T} (paged_table's requests are full pages)")
    ids = physical_page_ids(batch * T // PAGE, seed, shuffle=shuffle).to(k.device)
    indptr = torch.arange(batch + 1, device=k.device, dtype=torch.int32) * (T // PAGE)
    last = torch.full((batch,), PAGE, device=k.device, dtype=torch.int32)
    return indptr, ids.to(torch.int32), last, nhd_pages(k, ids), nhd_pages(v, ids)


def reference_attention(q, k, v):
    """fp32 attention, q [B, Hq, d], k/v [B, Hkv, T, d] → [B, Hq, d], one request at a time."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b in range(q.shape[0]):
        kb = k[b].float().repeat_interleave(group, 0)
        vb = v[b].float().repeat_interleave(group, 0)
        scores = torch.einsum("hd,htd->ht", q[b].float(), kb) / q.shape[-1] ** 0.5
        out[b] = torch.einsum("ht,htd->hd", scores.softmax(-1), vb)
    return out


def error_vs_reference(out, ref) -> tuple[float, float]:
    """(relative RMS error, max abs error) of ``out`` against the fp32 ``ref``."""
    diff = out.float() - ref
    return float(diff.norm() / ref.norm()), float(diff.abs().max())
