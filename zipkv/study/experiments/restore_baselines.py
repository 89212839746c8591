"""Why restore-before-attention is slow (ZipFusion §II-B): the codecs of :mod:`zipkv.codecs` restoring each
layer into a shared buffer before FlashInfer's paged decode, against ZipFusion's fused kernel.

* :func:`real_kv_bits`: bits per value of ZipFusion's format, SplitZip-style and Huffman on captured KV
  (K and V separately); the SplitZip codebook is calibrated on other windows (:func:`calibration_codebook`).
* :func:`llama_shaped_kv`: Llama-3.1-8B-shaped K/V of one layer (``[batch, 8, ctx, 128]``) tiled from a
  captured SmolLM2 layer (``[3, T, 64]``): KV head ``h`` is SmolLM2 heads ``h % 3`` and ``(h+1) % 3`` side by
  side along head_dim, batch row ``b`` the tokens rolled by ``16 * b`` (whole pages), so the values, their
  exponent statistics and their page-level structure are the embedded model's.
* :func:`restore_step_benchmark` (GPU): per decode step of ``layers`` layers, the restore time (K and V
  into one shared buffer pair per layer) and FlashInfer's attention time on the restored pages, for each
  codec; ZipFusion's fused decode over the compressed cache; encode / decode GB/s; bit-exact checks.
"""
from __future__ import annotations

import statistics

import pandas as pd
import torch

from zipkv import codecs, format as kvformat

LLAMA = dict(layers=32, q_heads=32, kv_heads=8, head_dim=128)
"""Llama-3.1-8B's attention shape (ZipFusion §II-B measures it at 2048 tokens, batch 32)."""
PAGE = kvformat.PAGE_TOKENS


def capture_kv(n_windows: int, context: int, seed: int, device: str = "cpu", model_name=None, books_dir=None):
    """Per-layer ``(K, V)`` bf16 ``[kv_heads, context, head_dim]`` of the embedded model on PG19 windows:
    a list (windows) of lists (layers)."""
    from tqdm.auto import tqdm

    from zipkv import data, models

    model, tokenizer = models.load_model(model_name, dtype=torch.bfloat16, device=device)
    wins = data.windows(tokenizer, data.load_books(books_dir), n_windows, context=context, continuation=0, seed=seed)
    out = []
    for w in tqdm(wins, desc="capture"):
        cap = models.capture(model, w.context_ids)
        out.append([(x.keys.contiguous(), x.values.contiguous()) for x in cap.layers])
    return out


def calibration_codebook(calibration) -> codecs.SplitZip:
    """SplitZip's offline step: the 16 most frequent exponents of K and V over every layer of ``calibration``
    (windows disjoint from the evaluation ones)."""
    return codecs.SplitZip.calibrate([t for window in calibration for layer in window for t in layer])


def _zipfusion_bits(x: torch.Tensor) -> float:
    """ZipFusion's bits per value on K or V ``[heads, T, d]`` (full pages, token layout), the metadata byte
    per 512-value block included."""
    stats = kvformat.cache_stats(kvformat.to_pages(x[:, : x.shape[1] // PAGE * PAGE]), "token")
    return stats.bits_per_value + 8 / kvformat.BLOCK_VALUES


def real_kv_bits(captures, splitzip: codecs.SplitZip, huffman: codecs.Huffman | None = None) -> pd.DataFrame:
    """Bits per value of each codec for K and V over every layer and window of ``captures``: rows
    (codec, tensor, bits_per_value). Huffman builds one code per layer's K or V of a window (DFloat11: one per
    tensor); SplitZip uses its fixed codebook."""
    huffman = huffman or codecs.Huffman()
    total = {}
    for window in captures:
        for layer in window:
            for tensor, x in zip("KV", layer):
                n = x.numel()
                for codec, bits in (("zipfusion", _zipfusion_bits(x)), ("splitzip", splitzip.encode(x).bits_per_value),
                                    ("huffman", huffman.encode(x).bits_per_value)):
                    acc = total.setdefault((codec, tensor), [0.0, 0])
                    acc[0] += bits * n
                    acc[1] += n
    return pd.DataFrame([dict(codec=c, tensor=t, bits_per_value=b / n) for (c, t), (b, n) in total.items()])


def llama_shaped_kv(layer, batch: int, ctx: int, kv_heads: int = 8, head_dim: int = 128):
    """K, V bf16 ``[batch, kv_heads, ctx, head_dim]`` tiled from one captured layer ``(K, V)`` ``[h, T, d]``
    (see the module docstring; ``T`` >= ctx, ``head_dim`` = 2 d)."""
    out = []
    for x in layer:
        h, T, d = x.shape
        if T < ctx or 2 * d != head_dim:
            raise ValueError(f"a captured layer [{h}, {T}, {d}] cannot tile [{batch}, {kv_heads}, {ctx}, {head_dim}]: "
                             f"expected T >= {ctx} and d = {head_dim // 2}")
        heads = torch.stack([torch.cat([x[i % h], x[(i + 1) % h]], -1)[:ctx] for i in range(kv_heads)])
        out.append(torch.stack([torch.roll(heads, PAGE * b, dims=1) for b in range(batch)]).contiguous())
    return out[0], out[1]


def _nhd(x):
    """[B, H, T, d] -> FlashInfer NHD pages [B*T/16, 16, H, d] (request b's pages b*T/16 ...)."""
    B, H, T, d = x.shape
    return x.reshape(B, H, T // PAGE, PAGE, d).permute(0, 2, 3, 1, 4).reshape(-1, PAGE, H, d).contiguous()


def _graph_ms(fn, reps: int) -> float:
    """Median milliseconds of ``fn`` captured once in a CUDA graph and replayed (no host work between launches);
    NaN when ``fn`` cannot be captured."""
    import warnings

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as err:                    # a method whose launch path syncs or allocates on the host
        warnings.warn(f"CUDA graph capture failed ({type(err).__name__}: {err}); graph time left as NaN")
        torch.cuda.synchronize()
        return float("nan")
    return _events_ms(graph.replay, reps)


def _events_ms(fn, reps: int) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` calls (each call moves far more than L2: cold by size). A spin
    kernel before each call keeps the GPU busy while the host enqueues it, so the events time the GPU's work."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda._sleep(2_000_000)            # about 1 ms at 2 GHz: longer than any launch path here
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def restore_step_benchmark(captures, splitzip: codecs.SplitZip, *, ctx: int = 2048, batch: int = 32,
                           layers: int = LLAMA["layers"], reps: int = 10, progress: bool = True) -> pd.DataFrame:
    """One decode step of Llama-3.1-8B attention (``layers`` layers, 32 q / 8 kv heads, d = 128) on KV tiled
    from ``captures[0]``'s layers (layer ``l`` from captured layer ``l % len``), on the GPU.

    For SplitZip and Huffman: each layer's K and V pages (FlashInfer NHD order) are encoded once; a step
    restores layer by layer into one shared K/V buffer pair and runs FlashInfer's paged decode (tensor-core
    path, planned once) on it. Timed separately: all restores of a step (``restore_ms_per_step``) and all
    attentions (``attention_ms_per_step``), and the step as it runs (``step_ms``: restore then attention per
    layer, launched from Python; ``step_graph_ms``: the same captured in a CUDA graph and replayed, as a serving
    engine runs decode steps; NaN where a method cannot be captured). ZipFusion: zipkv's fused decode (Gluon kernel, mma layouts, planned once, ``run`` timed) over ``build_paged_cache(compress=
    "eligible")`` of the same KV (every layer its own cache). "flashinfer (bf16)" is the uncompressed baseline.
    Encode and decode GB/s are bf16 bytes per second on a layer's K and V separately. Every restore is
    checked bit-exact and every attention against FlashInfer on the original pages.
    """
    from tqdm.auto import tqdm

    from zipkv.bench import FlashInferDecode, copy_bandwidth
    from zipkv.kernels.decode_attention import build_paged_cache, physical_page_ids, plan

    H, D, HQ = LLAMA["kv_heads"], LLAMA["head_dim"], LLAMA["q_heads"]
    sources = captures[0]
    n_src = min(len(sources), layers)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, HQ, D, device="cuda", generator=gen).to(torch.bfloat16)
    pages_per_req = ctx // PAGE
    phys = physical_page_ids(batch * pages_per_req).to("cuda")        # the same random page table for all
    indices = phys.to(torch.int32)
    indptr = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * pages_per_req
    last = torch.full((batch,), PAGE, device="cuda", dtype=torch.int32)
    fi = FlashInferDecode(indptr, indices, last, HQ, H, D, PAGE, use_tensor_cores=True)
    rows, kv_pages, zf_caches, steps = [], [], [], {}
    for s in tqdm(range(n_src), desc="layers", disable=not progress):
        k, v = llama_shaped_kv([t.to("cuda") for t in sources[s]], batch, ctx, H, D)
        kp, vp = (torch.empty_like(_nhd(x)) for x in (k, v))
        kp[phys], vp[phys] = _nhd(k), _nhd(v)
        kv_pages.append((kp, vp))
        cache, zf_indptr, zf_indices, zf_last = build_paged_cache(k, v, compress="eligible",
                                                                  k_layout="k_mma", v_layout="v_mma")
        zf_caches.append(plan(zf_indptr, zf_indices, zf_last, cache, HQ))
        del k, v
    ref = [fi(q, kp, vp).clone() for kp, vp in kv_pages]
    buf_k, buf_v = torch.empty_like(kv_pages[0][0]), torch.empty_like(kv_pages[0][1])
    layer_src = [i % n_src for i in range(layers)]
    raw_bytes = 2 * kv_pages[0][0].numel()                              # one K (or V) in bf16
    copy_bw = copy_bandwidth()

    def attention_only():
        for i in layer_src:
            fi(q, buf_k, buf_v)
    attention_ms = _events_ms(attention_only, reps)
    rows.append(dict(codec="flashinfer (bf16)", tensor="K+V", bits_per_value=16.0, restore_ms_per_step=0.0,
                     attention_ms_per_step=_events_ms(lambda: [fi(q, *kv_pages[i]) for i in layer_src], reps)))
    for codec in (splitzip, codecs.Huffman()):
        enc, enc_gbps, dec_gbps = [], {"K": [], "V": []}, {"K": [], "V": []}
        for s, (kp, vp) in enumerate(kv_pages):
            pair = []
            for tensor, x, buf in (("K", kp, buf_k), ("V", vp, buf_v)):
                e = codec.encode(x)
                codecs.decode_into(e, buf, validate=s == 0)
                if not torch.equal(buf.view(torch.int16), x.view(torch.int16)):
                    raise AssertionError(f"{codec.name} restore of layer {s} {tensor} is not bit-exact")
                if s == 0:
                    enc_gbps[tensor].append(raw_bytes / _events_ms(lambda: codec.encode(x), 3) / 1e6)
                    dec_gbps[tensor].append(raw_bytes / _events_ms(lambda: codecs.decode_into(e, buf, validate=False), reps) / 1e6)
                pair.append(e)
            enc.append(pair)
        same_attention = True
        for (ek, ev), r in zip(enc, ref):
            codecs.decode_into(ek, buf_k, validate=False), codecs.decode_into(ev, buf_v, validate=False)
            same_attention &= torch.equal(fi(q, buf_k, buf_v), r)

        def restore_only():
            for i in layer_src:
                codecs.decode_into(enc[i][0], buf_k, validate=False)
                codecs.decode_into(enc[i][1], buf_v, validate=False)

        def step(enc=enc):                      # bound now: the graphs below are captured after the loop
            for i in layer_src:
                codecs.decode_into(enc[i][0], buf_k, validate=False)
                codecs.decode_into(enc[i][1], buf_v, validate=False)
                fi(q, buf_k, buf_v)
        restore_ms = _events_ms(restore_only, reps)
        restore_graph_ms = _graph_ms(restore_only, reps)              # decode_into is capturable: never NaN
        step_ms = _events_ms(step, reps)
        steps[codec.name] = step
        for tensor in "KV":
            bits = statistics.mean(p["KV".index(tensor)].bits_per_value for p in enc)
            rows.append(dict(codec=codec.name, tensor=tensor, bits_per_value=bits,
                             encode_gbps=enc_gbps[tensor][0], decode_gbps=dec_gbps[tensor][0],
                             decode_frac_copy_bw=dec_gbps[tensor][0] * 1e9 * (1 + bits / 16) / copy_bw))
        rows.append(dict(codec=codec.name, tensor="K+V",
                         bits_per_value=statistics.mean(e.bits_per_value for p in enc for e in p),
                         restore_ms_per_step=restore_ms, restore_graph_ms_per_step=restore_graph_ms,
                         attention_ms_per_step=attention_ms, step_ms=step_ms,
                         attention_equals_original=same_attention))
    steps["flashinfer (bf16)"] = lambda: [fi(q, *kv_pages[i]) for i in layer_src]
    zf_out = torch.empty_like(q)
    steps["zipfusion"] = lambda: [zf_caches[i].run(q, zf_out) for i in layer_src]
    zf_ms = _events_ms(steps["zipfusion"], reps)
    zf_err = max(float((p.run(q).float() - r.float()).norm() / r.float().norm()) for p, r in zip(zf_caches, ref))
    st = [p.cache.stats() for p in zf_caches]
    rows.append(dict(codec="zipfusion", tensor="K+V", restore_ms_per_step=0.0, attention_ms_per_step=zf_ms,
                     step_ms=zf_ms, rel_rms_error_vs_flashinfer=zf_err,
                     bits_per_value=statistics.mean(16 * x["used_bytes"] / x["raw_bytes"] for x in st)))
    graph_ms = {name: _graph_ms(fn, reps) for name, fn in steps.items()}   # last: a failed capture spoils nothing
    for row in rows:
        if row["tensor"] == "K+V":
            row["step_graph_ms"] = graph_ms.get(row["codec"], float("nan"))
    table = pd.DataFrame(rows)
    step = table.tensor == "K+V"
    table.loc[step, "step_ms"] = table.step_ms[step].fillna(table.restore_ms_per_step + table.attention_ms_per_step)
    table["ctx"], table["batch"], table["layers"] = ctx, batch, layers
    table["copy_bw_tbps"] = copy_bw / 1e12
    table["device"] = torch.cuda.get_device_name()
    return table


def decode_launch_sweep(x: torch.Tensor, splitzip: codecs.SplitZip, reps: int = 10,
                        v: torch.Tensor | None = None) -> pd.DataFrame:
    """Decode GB/s (restored bf16 bytes per second) of both kernels over their launch options on ``x`` (GPU):
    the SplitZip-style kernels on ``x`` (tensor K) and on ``v`` too when given (tensor V), Huffman on ``x``."""
    from zipkv.kernels import restore

    out = torch.empty_like(x)
    rows = []
    options = [(False, False, cpp, warps) for cpp in (2, 4) for warps in (2, 4)] + \
              [(True, early, cpp, warps) for early in (False, True) for cpp in (2, 4, 8) for warps in (1, 2, 4)]
    for tensor, t in (("K", x), ("V", v)):
        if t is None:
            continue
        e = splitzip.encode(t)
        d = e.data
        for words, early, cpp, warps in options:
            fn = lambda: restore.splitzip_decode(d["sm"], d["codes"], e.info["book"], d["esc_indptr"], d["esc_pos"],
                                                 d["esc_exp"], out.view(torch.int16).reshape(-1), e.n_values,
                                                 e.n_chunks, e.info["chunk"], chunks_per_program=cpp,
                                                 num_warps=warps, words=words, early_escapes=early)
            out.zero_()
            fn()
            ok = torch.equal(out.view(torch.int16), t.view(torch.int16))
            rows.append(dict(codec="splitzip", tensor=tensor, words=words, early_escapes=early,
                             chunks_per_program=cpp, num_warps=warps, smem_lut=None, exact=ok,
                             decode_gbps=2 * t.numel() / _events_ms(fn, reps) / 1e6))
    e = codecs.Huffman().encode(x)
    d, i = e.data, e.info
    for cpp in (8, 16, 32):
        for warps in (2, 4, 8):
            for smem in (True, False):
                fn = lambda: restore.huffman_decode(d["stream"], d["chunk_bits"], d["lane_bits"], d["lut"], d["sm"],
                                                    out.view(torch.int16).reshape(-1), e.n_values, e.n_chunks,
                                                    i["lanes"], i["per_lane"], i["max_len"], chunks_per_program=cpp,
                                                    num_warps=warps, smem_lut=smem)
                out.zero_()
                fn()
                ok = torch.equal(out.view(torch.int16), x.view(torch.int16))
                rows.append(dict(codec="huffman", tensor="K", chunks_per_program=cpp, num_warps=warps, smem_lut=smem, exact=ok,
                                 decode_gbps=2 * x.numel() / _events_ms(fn, reps) / 1e6))
    return pd.DataFrame(rows)


def roundtrip_check(captures, splitzip: codecs.SplitZip, layers: int = 2) -> pd.DataFrame:
    """Bit-exact encode -> Triton decode and -> torch reference on the first ``layers`` captured layers (K, V):
    one row per (codec, layer, tensor) with ``exact``."""
    rows = []
    for i, layer in enumerate(captures[0][:layers]):
        for tensor, x in zip("KV", layer):
            for codec in (splitzip, codecs.Huffman()):
                e = codec.encode(x)
                same = [torch.equal(y.view(torch.int16), x.view(torch.int16))
                        for y in (codecs.decode(e), codecs.decode_reference(e))]
                rows.append(dict(codec=codec.name, layer=i, tensor=tensor, values=x.numel(), exact=all(same)))
    return pd.DataFrame(rows)


def measure(n_windows: int, context: int, *, device: str = "cpu", books_dir=None, reps: int = 10, gpu_csv=None):
    """The chapter's run: bits per value on real KV (:func:`real_kv_bits`, a codebook calibrated on another window),
    the round trips (:func:`roundtrip_check`: one layer on the CPU, 30 on a GPU; an inexact one is an error), and the
    per-step timings: measured here on a CUDA ``device``, else the committed GPU table ``gpu_csv`` where it exists.
    Returns ``(bits, gpu, check, source)``: ``gpu`` ``None`` without timings, ``source`` says where they come from."""
    from pathlib import Path

    splitzip = calibration_codebook(capture_kv(1, context, seed=1, device=device, books_dir=books_dir))
    captures = capture_kv(n_windows, context, seed=0, device=device, books_dir=books_dir)
    bits = real_kv_bits(captures, splitzip)
    check = roundtrip_check(captures, splitzip, layers=1 if device == "cpu" else 30)
    if not check.exact.all():
        raise RuntimeError(f"a codec's round trip is not bit-exact:\n{check[~check.exact]}")
    if torch.cuda.is_available() and device == "cuda":
        gpu = restore_step_benchmark(captures, splitzip, reps=reps, progress=False)
        source = f"measured in this run on {gpu.device.iloc[0]}"
    elif gpu_csv is not None and Path(gpu_csv).is_file():
        gpu = pd.read_csv(gpu_csv)
        source = (f"the committed GPU results ({gpu.device.dropna().iloc[0]}, {gpu.date.dropna().iloc[0]}, "
                  f"commit {gpu.commit.dropna().iloc[0]}); bits per value recomputed here")
    else:
        gpu, source = None, "no GPU results committed yet"
    return bits, gpu, check, source


def main(argv=None):
    """``python -m zipkv.study.experiments.restore_baselines SAMPLE OUT_DIR``: the GPU run behind the chapter, from a saved sample
    (``torch.save(dict(layers=[(K, V), ...], codebook=[...]))``: every 4th layer of one 2048-token PG19 window (seed
    0) and the SplitZip codebook calibrated on another (seed 1); captured and saved first when SAMPLE does not
    exist): launch sweep, then :func:`restore_step_benchmark` with the sweep's best SplitZip-style launch (the one
    whose slower tensor is fastest, recorded in the table's ``splitzip_launch``); writes ``restore_launch_sweep.csv`` and
    ``zipfusion_restore_baselines_gpu.csv`` into OUT_DIR."""
    import argparse
    import datetime
    from pathlib import Path

    p = argparse.ArgumentParser()
    p.add_argument("sample")
    p.add_argument("out")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--commit", default="")
    a = p.parse_args(argv)
    if not Path(a.sample).is_file():            # build it: needs the embedded model and PG19 books
        book = calibration_codebook(capture_kv(1, 2048, seed=1, device="cuda"))
        layers = capture_kv(1, 2048, seed=0, device="cuda")[0]
        torch.save(dict(layers=[tuple(t.cpu() for t in x) for x in layers[::4]], codebook=book.codebook), a.sample)
    sample = torch.load(a.sample)
    book = codecs.SplitZip(sample["codebook"])
    k, v = llama_shaped_kv([t.to("cuda") for t in sample["layers"][0]], 32, 2048)
    stamp = dict(date=datetime.date.today().isoformat(), commit=a.commit)
    sweep = decode_launch_sweep(_nhd(k), book, a.reps, v=_nhd(v)).assign(device=torch.cuda.get_device_name(), **stamp)
    sweep.to_csv(Path(a.out) / "restore_launch_sweep.csv", index=False)
    print(sweep.to_string())
    del k, v
    from zipkv.kernels import restore
    sz = sweep[(sweep.codec == "splitzip") & sweep.exact].groupby(["words", "early_escapes", "chunks_per_program",
                                                                  "num_warps"]).decode_gbps.min()
    words, early, cpp, warps = sz.idxmax()        # the launch whose slower tensor (K or V) is fastest
    restore.SPLITZIP_LAUNCH.update(words=bool(words), early_escapes=bool(early), chunks_per_program=int(cpp),
                                   num_warps=int(warps))
    print("SplitZip-style launch for the step benchmark:", restore.SPLITZIP_LAUNCH)
    stamp["splitzip_launch"] = str(restore.SPLITZIP_LAUNCH)
    table = restore_step_benchmark([sample["layers"]], book, reps=a.reps, progress=False).assign(**stamp)
    table.to_csv(Path(a.out) / "zipfusion_restore_baselines_gpu.csv", index=False)
    print(table.to_string())


if __name__ == "__main__":
    main()
