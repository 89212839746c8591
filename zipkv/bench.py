"""GPU timing: cold-L2 medians, measured copy bandwidth, and the comparison points of ZipFusion's
attention benchmark (§IV-B): FlashInfer's paged decode (tensor-core and CUDA-core paths) and
torch SDPA on a contiguous cache.

Every timing is reported with the bytes it moved and its fraction of the copy bandwidth measured
in the same process (:func:`copy_bandwidth`), never against a typed-in constant.
"""
from __future__ import annotations

import statistics

import torch

from zipkv import format as kvformat

L2_FLUSH_BYTES = 256 << 20


class ColdTimer:
    """Median GPU latency of a CUDA callable with the L2 cache cleared before each timed call.

    The flush reads a buffer larger than L2 (the H200's is 50 MB): the previous call's KV bytes are
    evicted, so every call reads its inputs from HBM, and lines written before the flush are written
    back during it. Writing the buffer instead (``triton.testing.do_bench``'s flush) leaves L2 full of
    dirty lines whose write-back then falls inside the next timed call (on the H200 it added the same
    few microseconds to FlashInfer's and zipkv's times): traffic no decode step has. After the
    flush a spin kernel (``spin_us``, longer than any method's host-side launch work) keeps the GPU busy
    while the host enqueues the call, so the events time what the GPU does between them, not the
    Python and launch overhead of whichever method is slower to enqueue (FlashInfer's planned
    ``run`` and zipkv's ``decode_attention`` both have some).
    """

    def __init__(self, flush_bytes: int = L2_FLUSH_BYTES, device: str = "cuda", spin_us: float = 1000.0):
        self.flush = torch.ones(flush_bytes // 8, dtype=torch.int64, device=device)
        self.spin_cycles = int(spin_us * 2e3)  # at most 2 GHz: at least spin_us

    def __call__(self, fn, reps: int = 30, warmup: int = 3) -> float:
        """Median microseconds of ``fn()`` over ``reps`` timed calls."""
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            self.flush.sum()                   # reads only: L2 left holding clean lines
            torch.cuda._sleep(self.spin_cycles)
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


# ----------------------------------------------------------------------------- decode attention (Fig. 4)

ATTENTION_SHAPES = {
    # name: (q_heads, kv_heads, head_dim)
    "llama3.1-8b": (32, 8, 128),   # also Qwen3-8B's attention shape
    "smollm2-135m": (9, 3, 64),
}
METHODS = ("zipkv_compressed", "zipkv_uncompressed", "flashinfer_tc", "flashinfer_cuda", "sdpa")
KERNEL_LAYOUTS = {"gluon": ("k_mma", "v_mma"), "triton": ("token", "token")}
"""zipkv's two decode kernels and the cache layouts each reads: the Gluon kernel
(:mod:`zipkv.kernels.decode_mma`, head_dim 128) and the Triton kernel (any head_dim, mixed pages)."""
PAGE = 16


def measured_compressible_fraction(results_csv, layout: str = "token") -> dict[str, float]:
    """Mean compressible-block fraction of K and V over layers, from the first chapter's table."""
    import pandas as pd

    table = pd.read_csv(results_csv)
    return {"K": float(table[f"K_{layout}"].mean()), "V": float(table[f"V_{layout}"].mean())}


def _compressible_kv(batch: int, kv_heads: int, ctx: int, head_dim: int, generator: torch.Generator):
    """Random bf16 K and V [batch, kv_heads, ctx, head_dim] whose every 512-value block is compressible:
    magnitudes in [2^-9, 2^3) span 12 exponents, inside any [b, b+15] window."""
    shape = (batch, kv_heads, ctx, head_dim)
    out = []
    for _ in range(2):
        mag = torch.exp2(torch.empty(shape, device="cuda").uniform_(-9, 3, generator=generator))
        sign = torch.randint(0, 2, shape, device="cuda", generator=generator) * 2 - 1
        out.append((mag * sign).to(torch.bfloat16))
    return out


def _attention_inputs(shape: str, ctx: int, batch: int, generator: torch.Generator):
    """All-compressible K, V ``[batch, kv_heads, ctx, head_dim]`` and q ``[batch, q_heads, head_dim]`` (bf16) of an
    attention shape of :data:`ATTENTION_SHAPES`."""
    q_heads, kv_heads, head_dim = ATTENTION_SHAPES[shape]
    k, v = _compressible_kv(batch, kv_heads, ctx, head_dim, generator)
    q = torch.randn(batch, q_heads, head_dim, device="cuda", generator=generator).to(torch.bfloat16)
    return k, v, q


def _pack_inputs(head_dim: int, n_bytes: int, generator: torch.Generator):
    """``n_bytes`` of compressible bf16 pages ``[n, 16, head_dim]`` and an output buffer for their slots."""
    n_pages = n_bytes // (PAGE * head_dim * 2)
    pages = _compressible_kv(1, 1, n_pages * PAGE, head_dim, generator)[0].reshape(n_pages, PAGE, head_dim)
    return pages, torch.empty(n_pages, PAGE * head_dim * 2, dtype=torch.uint8, device="cuda")


def _reference_attention(q, k, v):
    """fp32 attention, q [B, Hq, d], k/v [B, Hkv, T, d] → [B, Hq, d], one request at a time."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b in range(q.shape[0]):
        kb = k[b].float().repeat_interleave(group, 0)
        vb = v[b].float().repeat_interleave(group, 0)
        scores = torch.einsum("hd,htd->ht", q[b].float(), kb) / q.shape[-1] ** 0.5
        out[b] = torch.einsum("ht,htd->hd", scores.softmax(-1), vb)
    return out


def _nhd_pages(x, physical):
    """K or V ``[batch, kv_heads, T, d]`` (T a multiple of the page size) -> FlashInfer's NHD pages
    ``[num_pages, PAGE, kv_heads, d]`` with logical page i stored at ``physical[i]``."""
    batch, kv_heads, T, d = x.shape
    logical = x.reshape(batch, kv_heads, T // PAGE, PAGE, d).permute(0, 2, 3, 1, 4).reshape(-1, PAGE, kv_heads, d)
    pages = torch.empty_like(logical)
    pages[physical] = logical
    return pages


def _error(out, ref) -> tuple[float, float]:
    diff = out.float() - ref
    return float(diff.norm() / ref.norm()), float(diff.abs().max())


def attention_benchmark(shape: str = "llama3.1-8b", contexts=(2048, 8192), batches=(32, 64, 96),
                        real_fraction: dict[str, float] | None = None, reps: int = 30,
                        methods=METHODS, seed: int = 0, progress: bool = True):
    """Decode-attention latency of every method on the same data, as in ZipFusion Fig. 4.

    For each (context, batch): K/V whose blocks are all compressible ("all compressible"), and, when
    ``real_fraction`` is given, the same data with only that fraction of K and V blocks compressed
    ("measured mix", the fractions measured on the embedded model's PG19 KV). Each method is checked
    against fp32 attention before it is timed (relative RMS error reported). Every paged method reads the same
    page table: :func:`~zipkv.kernels.decode_attention.physical_page_ids`' random physical page order, as a
    serving engine's page pool hands pages out (FlashInfer's NHD pages are placed at those ids).

    zipkv's rows say which kernel ran (``kernel``, ``layout``): on head_dim-128 shapes the all-compressible and
    uncompressed data are timed with both kernels of :data:`KERNEL_LAYOUTS`, the measured mix with the Triton
    kernel (the Gluon kernel takes mixed pages element by element).

    Returns a DataFrame with one row per (shape, ctx, batch, kv_data, method[, kernel]): latency_us (median of
    ``reps`` cold-L2 calls), bytes_read, tbps, frac_copy_bw, rel_rms_error, max_abs_error,
    speedup_vs_flashinfer_tc / _cuda, copy_bw_tbps and the device.
    """
    import pandas as pd
    from tqdm.auto import tqdm

    from zipkv.kernels.decode_attention import build_paged_cache, decode_attention, physical_page_ids

    if shape not in ATTENTION_SHAPES:
        raise ValueError(f"shape={shape!r}: expected one of {sorted(ATTENTION_SHAPES)}")
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise ValueError(f"methods {sorted(unknown)} unknown: expected names from {METHODS}")
    q_heads, kv_heads, head_dim = ATTENTION_SHAPES[shape]
    copy_bw = copy_bandwidth()
    timer = ColdTimer()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = []
    configs = [(c, b) for c in contexts for b in batches]
    for ctx, batch in tqdm(configs, desc=f"attention {shape}", disable=not progress):
        k, v, q = _attention_inputs(shape, ctx, batch, gen)
        ref = _reference_attention(q, k, v)
        io_bytes = 2 * q.numel() * q.element_size()  # q in, out
        raw_kv_bytes = 2 * k.numel() * k.element_size()
        measured = {}

        def record(method, kv_data, fn, kv_bytes):
            out = fn()
            rel, mx = _error(out, ref)
            if rel > 2e-2:
                raise AssertionError(f"{method} ({kv_data}, ctx {ctx}, batch {batch}) disagrees with fp32 "
                                     f"attention: relative RMS error {rel:.3g}, max abs {mx:.3g}")
            micros = timer(fn, reps=reps)
            moved = kv_bytes + io_bytes
            measured[(method, kv_data)] = micros
            rows.append(dict(shape=shape, ctx=ctx, batch=batch, kv_data=kv_data, method=method,
                             latency_us=micros, bytes_read=moved, tbps=moved / micros / 1e6,
                             frac_copy_bw=moved / (micros * 1e-6) / copy_bw,
                             rel_rms_error=rel, max_abs_error=mx))

        mixes = [("all compressible", "eligible")]
        if real_fraction is not None:
            mixes.append(("measured mix", real_fraction))
        for kv_data, compress in mixes:
            for method in ("zipkv_compressed", "zipkv_uncompressed"):
                if method not in methods or (method == "zipkv_uncompressed" and kv_data != mixes[0][0]):
                    continue
                if method == "zipkv_uncompressed":
                    mode = "none"
                elif isinstance(compress, dict):
                    mode = _mix_mask(batch, kv_heads, ctx, head_dim, compress, seed)
                else:
                    mode = compress
                kernels = ["gluon", "triton"] if head_dim == kvformat.MMA_HEAD_DIM and kv_data == mixes[0][0] else ["triton"]
                for kernel in kernels:
                    layout = KERNEL_LAYOUTS[kernel]
                    cache, indptr, indices, last = build_paged_cache(k, v, compress=mode, seed=seed,
                                                                     k_layout=layout[0], v_layout=layout[1])
                    stats = cache.stats()
                    desc_bytes = cache.desc.numel() * cache.desc.element_size()
                    kv_bytes = stats["used_bytes"] + desc_bytes + indices.numel() * 4
                    fn = lambda: decode_attention(q, cache, indptr, indices, last, validate=False)
                    record(method, kv_data, fn, kv_bytes)
                    rows[-1].update(kernel=kernel, layout="/".join(layout), frac_compressed_k=stats["frac_k"],
                                    frac_compressed_v=stats["frac_v"])
                    del cache
        # FlashInfer's NHD pages at the physical ids of zipkv's caches: the same page table for every paged method
        indices = physical_page_ids(batch * ctx // PAGE, seed).to("cuda")
        k_pages, v_pages = (_nhd_pages(x, indices) for x in (k, v))
        indices = indices.to(torch.int32)
        indptr = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * (ctx // PAGE)
        last = torch.full((batch,), PAGE, device="cuda", dtype=torch.int32)
        for method, tensor_cores in (("flashinfer_tc", True), ("flashinfer_cuda", False)):
            if method in methods:
                runner = FlashInferDecode(indptr, indices, last, q_heads, kv_heads, head_dim, PAGE, tensor_cores)
                record(method, "any", lambda: runner(q, k_pages, v_pages), raw_kv_bytes + indices.numel() * 4)
        del k_pages, v_pages
        if "sdpa" in methods:
            record("sdpa", "any", lambda: sdpa_decode(q, k, v), raw_kv_bytes)
        for row in rows:
            if row["ctx"] == ctx and row["batch"] == batch:
                for anchor in ("flashinfer_tc", "flashinfer_cuda"):
                    if (anchor, "any") in measured:
                        row[f"speedup_vs_{anchor}"] = measured[(anchor, "any")] / row["latency_us"]
        del k, v, q, ref
        torch.cuda.empty_cache()
    table = pd.DataFrame(rows)
    table["copy_bw_tbps"] = copy_bw / 1e12
    table["device"] = torch.cuda.get_device_name()
    return table


def _mix_mask(batch, kv_heads, ctx, head_dim, fraction: dict[str, float], seed: int) -> torch.Tensor:
    """Bool [pages, 2, kv_heads, n_blocks]: each K block compressed with probability fraction["K"], V likewise."""
    n_pages = batch * ctx // PAGE
    gen = torch.Generator().manual_seed(seed)
    draw = torch.rand(n_pages, 2, kv_heads, kvformat.n_blocks(head_dim), generator=gen)
    rate = torch.tensor([fraction["K"], fraction["V"]])[None, :, None, None]
    return draw < rate


def pack_benchmark(head_dim: int = 128, n_bytes: int = 1 << 30, layout: str = "token", reps: int = 20):
    """Throughput of the Triton pack kernel on ``n_bytes`` of compressible bf16 pages: dict of
    latency_us, input TB/s, bytes moved (read + written) and fraction of copy bandwidth."""
    from zipkv.kernels.pack import pack_pages

    pages, out = _pack_inputs(head_dim, n_bytes, torch.Generator(device="cuda").manual_seed(0))
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


# ----------------------------------------------------------------------------- Nsight Compute

NCU_SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "Occupancy", "WarpStateStats", "LaunchStats")
NCU_STALLS = ("long_scoreboard", "short_scoreboard", "wait", "selected", "not_selected", "mio_throttle", "barrier",
              "math_pipe_throttle", "dispatch_stall", "branch_resolving", "lg_throttle", "no_instructions")
"""Warp stall reasons sampled per kernel (``smsp__pcsamp_warps_issue_stalled_<reason>``)."""
NCU_METRICS = tuple(f"smsp__pcsamp_warps_issue_stalled_{r}" for r in NCU_STALLS) + (
    "smsp__inst_executed.sum", "smsp__inst_executed_op_shared_ld.sum",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum")
NCU_TARGETS = ("decode all compressed", "decode uncompressed", "pack")
NCU_KERNELS = ("_pipelined_kernel", "_pack_kernel")
"""Kernel names profiled: the Gluon decode kernel's pipelined launch (the only one a uniform cache needs: it
merges its own splits) and the pack kernel."""


def nsight_targets(shape: str = "llama3.1-8b", ctx: int = 8192, batch: int = 64):
    """Launch the kernels :func:`nsight_report` profiles, in the order of :data:`NCU_TARGETS`, each once inside
    the NVTX range ``zipkv`` after a warm-up call outside it: the Gluon decode kernel (mma layouts, default
    launch options) on all-compressible KV and on the same KV uncompressed, and the pack kernel on 1 GiB of
    head_dim-128 pages."""
    from zipkv.kernels.decode_attention import build_paged_cache, decode_attention
    from zipkv.kernels.pack import pack_pages

    gen = torch.Generator(device="cuda").manual_seed(0)
    k, v, q = _attention_inputs(shape, ctx, batch, gen)
    calls = []
    for mode in ("eligible", "none"):
        cache, indptr, indices, last = build_paged_cache(k, v, compress=mode, k_layout="k_mma", v_layout="v_mma")
        calls.append(lambda c=cache, i=indptr, j=indices, n=last: decode_attention(q, c, i, j, n, validate=False))
    pages, out = _pack_inputs(128, 1 << 30, gen)
    calls.append(lambda: pack_pages(pages, "token", out=out))
    for call in calls:
        call()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("zipkv")
        call()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()


def nsight_report(out, ncu: str = "ncu", timeout: float = 900) -> str:
    """Profile :func:`nsight_targets` under ``ncu --clock-control none`` (sections :data:`NCU_SECTIONS`, metrics
    :data:`NCU_METRICS`) in a subprocess and write the report to ``out`` behind a header with the device, driver,
    date, commit and the launch options in use. Returns the report text."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from zipkv.book import provenance
    from zipkv.kernels.decode_attention import MMA_LAUNCH

    cmd = [ncu, "--clock-control", "none", "--nvtx", "--nvtx-include", "zipkv/", "-k", "regex:" + "|".join(NCU_KERNELS)]
    for section in NCU_SECTIONS:
        cmd += ["--section", section]
    cmd += ["--metrics", ",".join(NCU_METRICS), sys.executable, "-m", "zipkv", "bench", "ncu-targets"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"ncu failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.strip()
    record = provenance("ncu")
    header = [f"# zipkv kernels under Nsight Compute: {' '.join(cmd[:7])} ..., sections {', '.join(NCU_SECTIONS)}; "
              f"stall reasons and shared-memory counters as metrics",
              f"# device: {record['device']} (driver {driver}); date: {record['date']}; commit: {record['commit']}",
              f"# launch options of the Gluon kernel: {json.dumps(MMA_LAUNCH)}",
              f"# kernels, in order: {'; '.join(NCU_TARGETS)} (zipkv.bench.nsight_targets: Llama-3.1-8B attention shape, "
              f"ctx 8192, batch 64; pack: 1 GiB of head_dim-128 pages)"]
    text = "\n".join(header) + "\n" + done.stdout
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text)
    return text


# ----------------------------------------------------------------------------- launch tuning

TUNE_GRID = dict(pages_per_tile=(2, 4, 8), num_warps=(4, 8), stages=(3, 4), maxnreg=(0, 168))
"""Launch options swept per kernel specialisation by :func:`tune_decode_attention` (``maxnreg`` 0: no
cap); the best of them is then tried at every ``programs_per_sm`` in :data:`TUNE_PROGRAMS_PER_SM`."""
TUNE_PROGRAMS_PER_SM = (2, 4, 8)


def tune_decode_attention(shape: str = "llama3.1-8b", ctx: int = 8192, batch: int = 64,
                          real_fraction: dict[str, float] | None = None, grid: dict | None = None,
                          programs_per_sm=TUNE_PROGRAMS_PER_SM, reps: int = 10, seed: int = 0,
                          progress: bool = True):
    """Time every launch configuration of each decode-attention specialisation at one shape.

    Specialisations and their data: ``compressed`` on K/V whose blocks are all compressible, ``raw`` on
    the same data uncompressed, ``mixed`` (forced, ``path="mixed"``) on the measured mix of compressed
    blocks when ``real_fraction`` is given. Every configuration is checked against fp32 attention before
    it is timed (cold L2, median of ``reps``); one that fails to compile or disagrees is recorded with its
    error and no latency.

    Returns a DataFrame: ``path``, the launch options (:data:`zipkv.kernels.decode_attention.LAUNCH_KEYS`),
    ``latency_us``, ``rel_rms_error``, ``error``, ``best`` (the fastest configuration of its path) and
    ``device``; :func:`write_tuning` stores the best ones.
    """
    import itertools

    import pandas as pd
    from tqdm.auto import tqdm

    from zipkv.kernels.decode_attention import DEFAULT_LAUNCH, build_paged_cache, decode_attention

    _, kv_heads, head_dim = ATTENTION_SHAPES[shape]
    grid = grid or TUNE_GRID
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k, v, q = _attention_inputs(shape, ctx, batch, gen)
    ref = _reference_attention(q, k, v)
    data = [("compressed", "eligible", "auto"), ("raw", "none", "auto")]
    if real_fraction is not None:
        data.append(("mixed", _mix_mask(batch, kv_heads, ctx, head_dim, real_fraction, seed), "mixed"))
    timer = ColdTimer()
    rows = []
    names = list(grid)
    for path, compress, route in data:
        cache, indptr, indices, last = build_paged_cache(k, v, compress=compress, seed=seed)

        def trial(launch):
            row = dict(path=path, **{**DEFAULT_LAUNCH, **launch}, latency_us=float("nan"),
                       rel_rms_error=float("nan"), error="")
            fn = lambda: decode_attention(q, cache, indptr, indices, last, validate=False, path=route,
                                          launch=launch)
            try:
                row["rel_rms_error"] = _error(fn(), ref)[0]
                if row["rel_rms_error"] > 2e-2:
                    row["error"] = "disagrees with fp32 attention"
                else:
                    row["latency_us"] = timer(fn, reps=reps)
            except Exception as err:  # a configuration that does not compile (e.g. shared memory)
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
            rows.append(row)
            return row

        combos = list(itertools.product(*(grid[n] for n in names)))
        for values in tqdm(combos, desc=f"tune {path}", disable=not progress):
            trial(dict(zip(names, values)))
        mine = pd.DataFrame([r for r in rows if r["path"] == path]).dropna(subset=["latency_us"])
        if len(mine):
            best = mine.sort_values("latency_us").iloc[0]
            for pps in programs_per_sm:
                if pps != best["programs_per_sm"]:
                    trial({n: _plain(best[n]) for n in names} | dict(programs_per_sm=pps))
        del cache
        torch.cuda.empty_cache()
    table = pd.DataFrame(rows)
    fastest = table.dropna(subset=["latency_us"]).groupby("path")["latency_us"].idxmin()
    table["best"] = table.index.isin(fastest.values)
    table["device"] = torch.cuda.get_device_name()
    table["shape"], table["ctx"], table["batch"] = shape, ctx, batch
    return table


def _plain(x):
    return x.item() if hasattr(x, "item") else x


def write_tuning(table, path=None) -> dict:
    """Store the best configuration of each specialisation in ``table`` (from
    :func:`tune_decode_attention`) for its device in the decode kernel's tuning file; returns the entry."""
    import json

    from zipkv.kernels.decode_attention import LAUNCH_KEYS, TUNING_FILE

    path = path or TUNING_FILE
    stored = json.loads(path.read_text()) if path.exists() else {}
    best = table[table["best"]]
    entry = {row["path"]: {key: _plain(row[key]) for key in LAUNCH_KEYS} for _, row in best.iterrows()}
    stored[str(table["device"].iloc[0])] = entry
    path.write_text(json.dumps(stored, indent=2, sort_keys=True) + "\n")
    return entry
