"""Throughput of the Triton pack kernel (ZipFusion §III-B, §III-D: compressing full pages)."""
from __future__ import annotations

import torch

from zipkv import format as kvformat
from zipkv.bench.attention import compressible_kv
from zipkv.bench.timing import ColdTimer, copy_bandwidth

__all__ = ["pack_benchmark", "pack_inputs"]

PAGE = kvformat.PAGE_TOKENS


def pack_inputs(head_dim: int, n_bytes: int, generator: torch.Generator):
    """``n_bytes`` of compressible bf16 pages ``[n, 16, head_dim]`` and an output buffer for their slots."""
    n_pages = n_bytes // (PAGE * head_dim * 2)
    pages = compressible_kv(1, 1, n_pages * PAGE, head_dim, generator)[0].reshape(n_pages, PAGE, head_dim)
    return pages, torch.empty(n_pages, PAGE * head_dim * 2, dtype=torch.uint8, device="cuda")


def pack_benchmark(head_dim: int = 128, n_bytes: int = 1 << 30, layout: str = "token", reps: int = 20):
    """Throughput of the Triton pack kernel on ``n_bytes`` of compressible bf16 pages: dict of
    latency_us, input TB/s, bytes moved (read + written) and fraction of copy bandwidth."""
    from zipkv.kernels.pack import pack_pages

    pages, out = pack_inputs(head_dim, n_bytes, torch.Generator(device="cuda").manual_seed(0))
    payload, meta = pack_pages(pages, layout, out=out)
    sample = slice(0, 64)
    if not torch.equal(kvformat.unpack(payload[sample], meta[sample]).view(torch.int16), pages[sample].view(torch.int16)):
        raise AssertionError("pack kernel output does not unpack to its input")
    written = int(meta.nbytes.sum())
    micros = ColdTimer()(lambda: pack_pages(pages, layout, out=out), reps=reps)
    copy_bw = copy_bandwidth()
    moved = n_bytes + written
    return dict(head_dim=head_dim, layout=layout, input_bytes=n_bytes, latency_us=micros,
                input_tbps=n_bytes / micros / 1e6, bytes_moved=moved, frac_copy_bw=moved / (micros * 1e-6) / copy_bw,
                copy_bw_tbps=copy_bw / 1e12, device=torch.cuda.get_device_name())
