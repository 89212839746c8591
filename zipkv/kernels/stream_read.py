"""A streaming read: every 32-bit word of a buffer read once and summed, nothing else computed or written
(one int32 per program). Its rate is the HBM read bandwidth a kernel can reach, the ceiling of a
bandwidth-bound decode kernel that only reads (:func:`zipkv.bench.read_bandwidth` times it), where the copy
bandwidth (:func:`zipkv.bench.copy_bandwidth`) mixes reads with writes."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from zipkv.kernels import check_launchable, interpreted

__all__ = ["stream_sum"]


@triton.jit
def _stream_sum_kernel(words_ptr, partial_ptr, n_words, rounds, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    # grid-stride over BLOCK-word tiles: at any moment the programs read one contiguous stretch of HBM
    if INTERPRETED:                        # the interpreter's range() cannot take a tensor bound
        r = 0
        while r < rounds:
            offs = (r * tl.num_programs(0) + pid) * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(words_ptr + offs, mask=offs < n_words, other=0)
            r += 1
    else:
        for r in tl.range(0, rounds):
            offs = (r * tl.num_programs(0) + pid) * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(words_ptr + offs, mask=offs < n_words, other=0)
    tl.store(partial_ptr + pid, tl.sum(acc, axis=0))


def stream_sum(words: torch.Tensor, programs: int, *, block: int = 4096, num_warps: int = 8) -> torch.Tensor:
    """words: int32 ``[n]`` (contiguous, n < 2**31) -> int32 ``[programs]``, program ``p``'s sum (mod 2**32)
    of the ``block``-word tiles ``p, p + programs, ...``; their total is the sum of ``words`` mod 2**32."""
    if not isinstance(words, torch.Tensor) or words.dtype != torch.int32 or words.dim() != 1:
        raise TypeError(f"words: expected a 1-D int32 tensor, got "
                        f"{type(words).__name__ if not isinstance(words, torch.Tensor) else f'{words.dtype} {tuple(words.shape)}'}")
    if not words.is_contiguous() or words.numel() >= 2**31:
        raise ValueError(f"words: expected a contiguous tensor of fewer than 2**31 words, got "
                         f"{words.numel()} words{'' if words.is_contiguous() else ', not contiguous'}")
    if isinstance(programs, bool) or not isinstance(programs, int) or programs < 1:
        raise ValueError(f"programs={programs!r}: expected a positive int")
    if isinstance(block, bool) or not isinstance(block, int) or block < 16 or block & (block - 1):
        raise ValueError(f"block={block!r}: expected a power of two >= 16")
    check_launchable(_stream_sum_kernel, words.device, "words")
    partial = torch.empty(programs, dtype=torch.int32, device=words.device)
    _stream_sum_kernel[(programs,)](words, partial, words.numel(), triton.cdiv(words.numel(), programs * block),
                             BLOCK=block, INTERPRETED=interpreted(_stream_sum_kernel), num_warps=num_warps)
    return partial
