"""Decode-attention latency of every method on the same data, as in ZipFusion Fig. 4 (§IV-B):
zipkv's two decode kernels (compressed and uncompressed caches) beside FlashInfer (tensor-core and
CUDA-core paths) and torch SDPA, at the attention shapes of :data:`ATTENTION_SHAPES`."""
from __future__ import annotations

import torch

from zipkv import format as kvformat
from zipkv import models
from zipkv.bench.baselines import FlashInferDecode, error_vs_reference, paged_table, reference_attention, sdpa_decode
from zipkv.bench.timing import ColdTimer, copy_bandwidth

__all__ = ["ATTENTION_SHAPES", "METHODS", "KERNEL_LAYOUTS", "attention_benchmark", "measured_compressible_fraction",
           "mix_mask", "mix_sweep", "sweep_fractions", "with_bytes_bound", "compressible_kv", "attention_inputs"]

ATTENTION_SHAPES = {
    "llama3.1-8b": models.PAPER_MODELS["Llama-3.1-8B-Instruct"],   # also Qwen3-8B's attention shape
    "smollm2-135m": models.EMBEDDED_SHAPE,
}
"""Benchmark shape name (the ``shape`` column) -> the model's attention shape (:class:`zipkv.models.ModelShape`)."""
METHODS = ("zipkv_compressed", "zipkv_uncompressed", "flashinfer_tc", "flashinfer_cuda", "flashinfer_fp8", "sdpa")
KERNEL_LAYOUTS = {"gluon": kvformat.MMA_LAYOUTS, "triton": ("token", "token")}
"""zipkv's two decode kernels and the cache layouts each reads: the Gluon kernel
(:mod:`zipkv.kernels.decode_mma`, the mma layouts, at the head dims :func:`zipkv.format.layouts_for` defines them)
and the Triton kernel (:mod:`zipkv.kernels.decode_triton`, any head_dim)."""
PAGE = kvformat.PAGE_TOKENS


def measured_compressible_fraction(results_csv, layout: str = "token") -> dict[str, float]:
    """Mean compressible-block fraction of K and V over layers, from the first chapter's table."""
    import pandas as pd

    table = pd.read_csv(results_csv)
    return {"K": float(table[f"K_{layout}"].mean()), "V": float(table[f"V_{layout}"].mean())}


def compressible_kv(batch: int, kv_heads: int, ctx: int, head_dim: int, generator: torch.Generator):
    """Random bf16 K and V [batch, kv_heads, ctx, head_dim] whose every 512-value block is compressible:
    magnitudes in [2^-9, 2^3) span 12 exponents, inside any [b, b+15] window."""
    shape = (batch, kv_heads, ctx, head_dim)
    out = []
    for _ in range(2):
        mag = torch.exp2(torch.empty(shape, device="cuda").uniform_(-9, 3, generator=generator))
        sign = torch.randint(0, 2, shape, device="cuda", generator=generator) * 2 - 1
        out.append((mag * sign).to(torch.bfloat16))
    return out


def attention_inputs(shape: str, ctx: int, batch: int, generator: torch.Generator):
    """All-compressible K, V ``[batch, kv_heads, ctx, head_dim]`` and q ``[batch, q_heads, head_dim]`` (bf16) of an
    attention shape of :data:`ATTENTION_SHAPES`."""
    model = ATTENTION_SHAPES[shape]
    k, v = compressible_kv(batch, model.kv_heads, ctx, model.head_dim, generator)
    q = torch.randn(batch, model.q_heads, model.head_dim, device="cuda", generator=generator).to(torch.bfloat16)
    return k, v, q


def mix_mask(batch, kv_heads, ctx, head_dim, fraction: dict[str, float], seed: int) -> torch.Tensor:
    """Bool [pages, 2, kv_heads, n_blocks]: each K block compressed with probability fraction["K"], V likewise."""
    n_pages = batch * ctx // PAGE
    gen = torch.Generator().manual_seed(seed)
    draw = torch.rand(n_pages, 2, kv_heads, kvformat.n_blocks(head_dim), generator=gen)
    rate = torch.tensor([fraction["K"], fraction["V"]])[None, :, None, None]
    return draw < rate


def kernels_for(head_dim: int) -> list[str]:
    """zipkv's decode kernels whose layouts are defined at ``head_dim``."""
    return [name for name, layouts in KERNEL_LAYOUTS.items() if layouts[0] in kvformat.layouts_for(head_dim)]


def attention_benchmark(shape: str = "llama3.1-8b", contexts=(2048, 8192), batches=(32, 64, 96),
                        real_fraction: dict[str, float] | None = None, reps: int = 30,
                        methods=METHODS, seed: int = 0, progress: bool = True, splits=(None,), maxnregs=(None,),
                        mixes=None, kernels=None, routings=("auto",), stages=(None,)):
    """Decode-attention latency of every method on the same data, as in ZipFusion Fig. 4.

    For each (context, batch): K/V whose blocks are all compressible ("all compressible"), and, when
    ``real_fraction`` is given, the same data with only that fraction of K and V blocks compressed
    ("measured mix", the fractions measured on the embedded model's PG19 KV). Each method is checked
    against fp32 attention before it is timed (relative RMS error reported). Every paged method reads the same
    page table: :func:`~zipkv.paged.physical_page_ids`' random physical page order, as a serving engine's page
    pool hands pages out (FlashInfer's NHD pages are placed at those ids). zipkv's kernels and FlashInfer are
    planned once per configuration and their ``run`` is timed.

    zipkv's rows say which kernel ran (``kernel``, ``layout``): every kernel of :func:`kernels_for` the shape's
    head_dim, on every kind of data, once per split-KV factor of ``splits`` (None: the plan's choice; the column
    ``num_splits`` says which ran -- a sweep shows how the split count meets the GPU's waves of programs) and of
    ``maxnregs`` (a register cap per thread, ``launch={"maxnreg": n}``; None: the kernel's default; column ``maxnreg``,
    0 for none: fewer registers let more programs share an SM, :mod:`zipkv.kernels.kernel_info`) and of ``routings``
    (the plan's ``routing``, column ``routing``: ``"device"`` sends even a uniform cache through the mixed path) and
    of ``stages`` (``launch={"stages": n}``: pipeline depth, the Gluon kernel's ring slots; None: the kernel's
    default; column ``stages``: deeper rings hold more bytes in flight per program but fewer programs per SM).
    mixes: the kinds of data instead of the two above, ``[(kv_data, fraction)]`` with ``fraction`` a ``{"K", "V"}``
    dict of compressed-block fractions (:func:`mix_mask`; :func:`mix_sweep`). kernels: zipkv's kernels to time
    (default :func:`kernels_for` the head_dim).

    Returns a DataFrame with one row per (shape, ctx, batch, kv_data, method[, kernel]): latency_us (median of
    ``reps`` cold-L2 calls), bytes_read, tbps, frac_copy_bw, rel_rms_error, max_abs_error, zipkv's compressed
    block fractions and fractions of page-heads holding both kinds (``frac_mixed_pages_k`` / ``_v``),
    speedup_vs_flashinfer_tc / _cuda, copy_bw_tbps and the device.
    """
    import pandas as pd
    from tqdm.auto import tqdm

    from zipkv.kernels.decode_attention import plan
    from zipkv.paged import build_paged_cache

    if shape not in ATTENTION_SHAPES:
        raise ValueError(f"shape={shape!r}: expected one of {sorted(ATTENTION_SHAPES)}")
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise ValueError(f"methods {sorted(unknown)} unknown: expected names from {METHODS}")
    model = ATTENTION_SHAPES[shape]
    q_heads, kv_heads, head_dim = model.q_heads, model.kv_heads, model.head_dim
    copy_bw = copy_bandwidth()
    timer = ColdTimer()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = []
    configs = [(c, b) for c in contexts for b in batches]
    for ctx, batch in tqdm(configs, desc=f"attention {shape}", disable=not progress):
        k, v, q = attention_inputs(shape, ctx, batch, gen)
        ref = reference_attention(q, k, v)
        io_bytes = 2 * q.numel() * q.element_size()  # q in, out
        raw_kv_bytes = 2 * k.numel() * k.element_size()
        measured = {}

        def record(method, kv_data, fn, kv_bytes, check=None):
            out = fn()
            rel, mx = error_vs_reference(out, ref)
            checked = rel if check is None else error_vs_reference(out, check)[0]
            if checked > 2e-2:
                raise AssertionError(f"{method} ({kv_data}, ctx {ctx}, batch {batch}) disagrees with fp32 "
                                     f"attention{'' if check is None else ' over its own (e4m3) values'}: relative "
                                     f"RMS error {checked:.3g}, max abs {mx:.3g}")
            micros = timer(fn, reps=reps)
            moved = kv_bytes + io_bytes
            measured[(method, kv_data)] = micros
            rows.append(dict(shape=shape, ctx=ctx, batch=batch, kv_data=kv_data, method=method,
                             latency_us=micros, bytes_read=moved, tbps=moved / micros / 1e6,
                             frac_copy_bw=moved / (micros * 1e-6) / copy_bw,
                             rel_rms_error=rel, max_abs_error=mx))

        if mixes is None:
            kinds = [("all compressible", "eligible")]
            if real_fraction is not None:
                kinds.append(("measured mix", mix_mask(batch, kv_heads, ctx, head_dim, real_fraction, seed)))
        else:
            kinds = [(name, mix_mask(batch, kv_heads, ctx, head_dim, f, seed)) for name, f in mixes]
        for kv_data, compress in kinds:
            for method in ("zipkv_compressed", "zipkv_uncompressed"):
                if method not in methods or (method == "zipkv_uncompressed" and kv_data != kinds[0][0]):
                    continue
                mode = "none" if method == "zipkv_uncompressed" else compress
                for kernel in kernels_for(head_dim) if kernels is None else kernels:
                    layout = KERNEL_LAYOUTS[kernel]
                    cache, indptr, indices, last = build_paged_cache(k, v, compress=mode, seed=seed,
                                                                     k_layout=layout[0], v_layout=layout[1])
                    stats = cache.stats()
                    desc_bytes = cache.desc.numel() * cache.desc.element_size()
                    kv_bytes = stats["used_bytes"] + desc_bytes + indices.numel() * 4
                    out = torch.empty_like(q)
                    for split, nreg, routing, depth in ((x, n, r, d) for x in splits for n in maxnregs
                                                        for r in routings for d in stages):
                        launch = {k: v for k, v in (("maxnreg", nreg), ("stages", depth)) if v is not None}
                        planned = plan(indptr, indices, last, cache, q_heads, num_splits=split, routing=routing,
                                       launch=launch or None)
                        record(method, kv_data, lambda: planned.run(q, out), kv_bytes)
                        rows[-1].update(kernel=kernel, layout="/".join(layout), num_splits=planned.num_splits,
                                        routing=routing, stages=planned.configs[0]["stages"],
                                        maxnreg=planned.configs[0].get("maxnreg") or 0,
                                        frac_compressed_k=stats["frac_k"], frac_compressed_v=stats["frac_v"],
                                        frac_mixed_pages_k=stats["mixed_k"], frac_mixed_pages_v=stats["mixed_v"])
                        del planned
                    del cache
        # FlashInfer's NHD pages at the physical ids of zipkv's caches: the same page table for every paged method
        indptr, indices, last, k_pages, v_pages = paged_table(k, v, seed)
        for method, tensor_cores in (("flashinfer_tc", True), ("flashinfer_cuda", False)):
            if method in methods:
                runner = FlashInferDecode(indptr, indices, last, q_heads, kv_heads, head_dim, PAGE, tensor_cores)
                record(method, "any", lambda: runner(q, k_pages, v_pages), raw_kv_bytes + indices.numel() * 4)
        if "flashinfer_fp8" in methods:
            # FlashInfer's FP8 KV cache (e4m3, scale 1: these inputs lie far inside +-448); its tensor-core path
            # where this FlashInfer builds it for a bf16 query over e4m3 pages, else its CUDA-core path (column
            # ``fp8_path``). Checked against fp32 attention over the e4m3 values; ``rel_rms_error`` against the
            # bf16 values is what the 8 bits cost.
            f8 = torch.float8_e4m3fn
            k8, v8 = k_pages.to(f8), v_pages.to(f8)
            exact = reference_attention(q, k.to(f8).to(k.dtype), v.to(f8).to(v.dtype))
            for tensor_cores in (True, False):
                try:
                    runner = FlashInferDecode(indptr, indices, last, q_heads, kv_heads, head_dim, PAGE, tensor_cores,
                                              kv_dtype=f8)
                    runner(q, k8, v8)
                except Exception as err:                          # noqa: BLE001  (FlashInfer's own build errors)
                    if not tensor_cores:
                        raise RuntimeError(f"FlashInfer's FP8 decode runs on neither path: {err}") from err
                    continue
                record("flashinfer_fp8", "any", lambda: runner(q, k8, v8), raw_kv_bytes // 2 + indices.numel() * 4,
                       check=exact)
                rows[-1]["fp8_path"] = "tensor cores" if tensor_cores else "CUDA cores"
                break
            del k8, v8, exact
        del k_pages, v_pages
        if "sdpa" in methods:
            record("sdpa", "any", lambda: sdpa_decode(q, k, v), raw_kv_bytes)
        for row in rows:
            if row["ctx"] == ctx and row["batch"] == batch:
                for anchor in ("flashinfer_tc", "flashinfer_cuda", "flashinfer_fp8", "sdpa"):
                    if (anchor, "any") in measured:
                        row[f"speedup_vs_{anchor}"] = measured[(anchor, "any")] / row["latency_us"]
        del k, v, q, ref
        torch.cuda.empty_cache()
    table = pd.DataFrame(rows)
    table["copy_bw_tbps"] = copy_bw / 1e12
    table["device"] = torch.cuda.get_device_name()
    return table


def sweep_fractions(real_fraction: dict[str, float] | None = None) -> list[tuple[str, dict[str, float]]]:
    """The mixes :func:`mix_sweep` times, ``[(kv_data, {"K", "V"} compressed-block fractions)]``: all compressed,
    90 %, the measured mix (when given), half, keys or values only, and none."""
    points = [(1.0, 1.0), (0.9, 0.9)] + ([(real_fraction["K"], real_fraction["V"])] if real_fraction else [])
    points += [(0.5, 0.5), (1.0, 0.0), (0.0, 1.0), (0.0, 0.0)]
    measured = (real_fraction["K"], real_fraction["V"]) if real_fraction else None
    return [(f"K {k:.0%} / V {v:.0%}" + (" (measured mix)" if (k, v) == measured else ""), {"K": k, "V": v})
            for k, v in points]


def mix_sweep(shape: str = "llama3.1-8b", ctx: int = 8192, batch: int = 64, real_fraction=None, reps: int = 30,
              seed: int = 0, progress: bool = True):
    """The Gluon kernel against its bytes as the share of compressed blocks goes from all to none (ZipFusion §III-B:
    a page may hold both kinds): :func:`attention_benchmark` at one point over :func:`sweep_fractions`, each cache
    planned with ``routing="auto"`` (uniform caches take their single specialised launch, others the grouped
    launches by page kind) and ``"device"`` (every page through the mixed path), beside FlashInfer TC from the same
    run, with :func:`with_bytes_bound`'s ``bytes_bound_us``: the row's bytes at FlashInfer TC's measured read rate
    (the latency of a kernel as fast per byte as FlashInfer; ``latency_us / bytes_bound_us`` is the row's cost per
    byte against FlashInfer's). The columns ``frac_compressed_k`` / ``_v`` give each cache's measured fractions;
    ``commit`` and ``date`` the run's (:func:`zipkv.provenance.provenance`), since the sweep is saved beside tables of
    other runs."""
    from zipkv.provenance import provenance

    run = provenance("bench")
    table = attention_benchmark(shape, (ctx,), (batch,), reps=reps, methods=("zipkv_compressed", "flashinfer_tc"),
                                seed=seed, progress=progress, mixes=sweep_fractions(real_fraction), kernels=("gluon",),
                                routings=("auto", "device"))
    return with_bytes_bound(table).assign(commit=run["commit"], date=run["date"])


def with_bytes_bound(table):
    """``table`` (one point of :func:`attention_benchmark`, FlashInfer TC among its rows) with ``bytes_bound_us``:
    each row's ``bytes_read`` at FlashInfer TC's measured ``tbps``."""
    if (table.method == "flashinfer_tc").sum() != 1:
        raise ValueError(f"table must hold one flashinfer_tc row, got {(table.method == 'flashinfer_tc').sum()}")
    anchor_tbps = float(table.loc[table.method == "flashinfer_tc", "tbps"].iloc[0])
    return table.assign(bytes_bound_us=table.bytes_read / anchor_tbps / 1e6)
