"""GPU timing: cold-L2 medians, measured copy bandwidth, and the comparison points of ZipFusion's
attention benchmark (§IV-B): FlashInfer's paged decode (tensor-core and CUDA-core paths) and
torch SDPA on a contiguous cache.

Every timing is reported with the bytes it moved and its fraction of the copy bandwidth measured
in the same process (:func:`copy_bandwidth`), never against a typed-in constant.
"""
from __future__ import annotations

import statistics

import torch

L2_FLUSH_BYTES = 256 << 20


class ColdTimer:
    """Median latency of a CUDA callable with the L2 cache cleared before each timed call.

    FlashInfer's benchmarks clear L2 the same way: writing a buffer larger than L2 (the H200's is
    50 MB) evicts the previous call's KV bytes, so every call reads its inputs from HBM.
    """

    def __init__(self, flush_bytes: int = L2_FLUSH_BYTES, device: str = "cuda"):
        self.flush = torch.empty(flush_bytes, dtype=torch.uint8, device=device)

    def __call__(self, fn, reps: int = 30, warmup: int = 3) -> float:
        """Median microseconds of ``fn()`` over ``reps`` timed calls."""
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            self.flush.zero_()
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


class FlashInferDecode:
    """FlashInfer's batch paged decode over a bf16 NHD paged cache, planned once.

    Args:
        indptr, indices, last_page_len: the CSR page table (int32, on the GPU).
        q_heads, kv_heads, head_dim, page_size: the attention shape.
        use_tensor_cores: FlashInfer's tensor-core (prefill-style) path or its CUDA-core path.
    """

    def __init__(self, indptr, indices, last_page_len, q_heads: int, kv_heads: int, head_dim: int,
                 page_size: int, use_tensor_cores: bool):
        import flashinfer

        self.workspace = torch.empty(256 << 20, dtype=torch.uint8, device=indptr.device)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                     use_tensor_cores=use_tensor_cores)
        self.wrapper.plan(indptr, indices, last_page_len, q_heads, kv_heads, head_dim, page_size,
                          pos_encoding_mode="NONE", q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)

    def __call__(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        """q [batch, q_heads, d]; k_pages, v_pages [num_pages, page_size, kv_heads, d] → [batch, q_heads, d]."""
        return self.wrapper.run(q, (k_pages, v_pages))


def sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """torch SDPA decode on a contiguous cache: q [batch, q_heads, d], k/v [batch, kv_heads, T, d]."""
    out = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)
    return out[:, :, 0]
