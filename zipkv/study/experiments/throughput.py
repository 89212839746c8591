"""Decode throughput under a memory budget (ZipFusion §IV-A, §IV-C, Fig. 5): the runs of the engine of
:mod:`zipkv.engine` at a fixed batch and at each method's largest batch under one KV budget (what the chapter
shows of them: :mod:`zipkv.study.chapters.throughput`).

Setup (the paper's, §IV-A): 8192-token inputs, 256 output tokens, the decode steps after the first
token timed; prefixes pre-compressed (ZipFusion), new KV uncompressed for every method. Substitutions,
stated by the chapter: Llama-3.1-8B *shapes* with random bf16 weights (decode speed depends on shapes,
not on weight values); the prefix KV made of **real KV blocks** of the embedded model (see
:func:`real_kv_blocks`), so that which blocks compress is what a real model produces; our engine instead
of SGLang; an H200 instead of the H100.
"""
from __future__ import annotations

import json
import math
from contextlib import nullcontext

import torch

from zipkv import format as fmt
from zipkv.engine import Engine, Prefix, kv_budget_for
from zipkv.models import MODEL_SHAPES, random_model
from zipkv.study.settings import THROUGHPUT_MMA_BASELINE_MODEL, THROUGHPUT_PAPER_MODEL, THROUGHPUT_UNFUSED_MODEL

__all__ = ["LLAMA_8B", "METHODS", "RESTORE", "BASELINE_LAYOUTS", "REPEATED", "engine_settings", "make_codec",
           "restore_buffer_pages", "random_llama", "real_kv_blocks", "real_prefix", "CAPACITY_LAYOUTS", "packed_capacity",
           "largest_batch_budget",
           "decode_throughput", "step_profile", "token_agreement", "divergence_gap", "figure5", "repeat_largest",
           "median_run", "few_requests"]

LLAMA_8B = MODEL_SHAPES["llama3.1-8b"][1]
"""Llama-3.1-8B's shape (its config.json, :data:`zipkv.models.MODEL_SHAPES`)."""

METHODS = {"uncompressed": "none", "zipfusion": "prompt", "splitzip": "prompt", "huffman": "prompt"}
"""Engine compression mode per method: uncompressed stores everything raw; ZipFusion compresses the
prefix pages, new KV stays raw (§IV-A); the restore baselines (:data:`RESTORE`) keep the prefix as their
codec's payload and restore it before attention (:class:`zipkv.runner.RestoreBuffer`)."""

RESTORE = ("splitzip", "huffman")
"""The restore-before-attention baselines: SplitZip-style and Huffman (DFloat11-style) of :mod:`zipkv.codecs`."""

BASELINE_LAYOUTS = dict(k_layout="token", v_layout="token")
"""The cache layouts of the chapter's uncompressed method: token-layout pages, read by the Triton kernel's all-raw
path -- the stand-in for SGLang's FlashInfer decode (timed beside FlashInfer's tensor-core decode in "Decode
attention latency") and the raw kernel the restore baselines' buffers go through. The engine's own default
for raw pages on a GPU, the mma layouts and the Gluon kernel (:func:`zipkv.engine.default_layouts`), runs as rows of
:data:`~zipkv.study.settings.THROUGHPUT_MMA_BASELINE_MODEL` (:func:`figure5`'s ``mma_baseline``)."""


def engine_settings(method: str) -> dict:
    """:class:`zipkv.engine.Engine` keywords of ``method`` (a key of :data:`METHODS`): its compression mode, and for
    uncompressed the :data:`BASELINE_LAYOUTS`."""
    return dict(compress=METHODS[method], **(BASELINE_LAYOUTS if method == "uncompressed" else {}))


def make_codec(method: str, calibration_blocks=None):
    """The codec of a restore baseline: SplitZip's 16-entry codebook calibrated on ``calibration_blocks``
    (``(k_blocks, v_blocks)`` of windows the benchmark's prefixes do not use), or a Huffman codec (one code per
    encoded tensor, DFloat11-style)."""
    from zipkv import codecs
    if method == "splitzip":
        if calibration_blocks is None:
            raise ValueError("splitzip needs calibration_blocks (real KV of other windows) for its codebook")
        return codecs.SplitZip.calibrate(list(calibration_blocks))
    if method == "huffman":
        return codecs.Huffman()
    raise ValueError(f"method must be one of {RESTORE}, got {method!r}")


def restore_buffer_pages(config, kv_budget_bytes: int, codec, prefixes, context: int, new_tokens: int,
                         *, pages_per_chunk: int = 16) -> int:
    """Pages of the shared restore buffer that let a restore baseline run its largest batch under the budget:
    ``S`` requests' prefix pages, with ``S = budget // (buffer pages + held payload chunks + raw pages for the
    output, per request)``, the payload measured on ``prefixes`` (a sample of the benchmark's)."""
    H = config.num_key_value_heads
    D = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    L = config.num_hidden_layers
    page = 2 * H * fmt.page_bytes(D)
    chunk = pages_per_chunk * page
    n_pages = (context - 1) // fmt.PAGE_TOKENS
    payload = []
    for pre in prefixes:
        total = 0
        for layer in range(L):
            for x in pre.layer(layer):
                total += codec.encode(x[:, : n_pages * fmt.PAGE_TOKENS].contiguous()).nbytes
        payload.append(-(-total // chunk) * chunk)
    tail = -(-(context + new_tokens - 1 - n_pages * fmt.PAGE_TOKENS) // fmt.PAGE_TOKENS)
    per_request = max(payload) + tail * L * page + n_pages * page
    return max(1, kv_budget_bytes // per_request) * n_pages


def random_llama(device="cuda", **overrides):
    """A ``LlamaForCausalLM`` with Llama-3.1-8B's shape (:data:`LLAMA_8B`, ``overrides`` applied) and
    random bf16 weights, built directly on ``device``."""
    return random_model("llama3.1-8b", device=device, **overrides)


def real_kv_blocks(model, tokenizer, books, *, windows: int = 2, context: int = 2048, seed: int = 0):
    """The embedded model's captured KV as 512-value blocks: ``(k_blocks, v_blocks)``, bf16
    ``[n_blocks, 512]`` on the model's device.

    Each block is one token-layout block of the captured cache (``512 / head_dim`` consecutive tokens ×
    all channels of one layer's KV head, post-RoPE, bf16), in order. A Llama-8B page-head (16 tokens ×
    128 channels, token layout) is 4 such blocks laid out as they are, so in the token layout every block the
    engine stores is a real block and compresses exactly when the real one does; in the mma layouts
    (ZipFusion on a GPU, :func:`zipkv.engine.default_layouts`) a page-head's blocks regroup the same real values in the
    kernel's operand order."""
    from zipkv import data, models
    ks, vs = [], []
    for w in data.windows(tokenizer, books, n=windows, context=context, continuation=0, seed=seed):
        cap = models.capture(model, w.context_ids.to(next(model.parameters()).device))
        for layer in cap.layers:
            ks.append(layer.keys.to(torch.bfloat16).reshape(-1, fmt.BLOCK_VALUES))
            vs.append(layer.values.to(torch.bfloat16).reshape(-1, fmt.BLOCK_VALUES))
    return torch.cat(ks), torch.cat(vs)


def real_prefix(blocks, config, length: int, seed: int) -> Prefix:
    """A :class:`zipkv.engine.Prefix` of ``length`` tokens for a model of ``config``'s shape, built per
    layer on demand from real KV ``blocks`` (:func:`real_kv_blocks`): the (layer, head) stream is a run of
    consecutive blocks starting at a seeded random block."""
    k_blocks, v_blocks = blocks
    H = config.num_key_value_heads
    D = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_head = math.ceil(length * D / fmt.BLOCK_VALUES)
    n = k_blocks.shape[0]
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(n, (config.num_hidden_layers, H), generator=gen)

    def kv(layer):
        idx = ((starts[layer][:, None] + torch.arange(per_head)) % n).to(k_blocks.device)     # [H, per_head]
        k = k_blocks[idx].reshape(H, -1, D)[:, :length]
        v = v_blocks[idx].reshape(H, -1, D)[:, :length]
        return k, v
    return Prefix(kv, length)


CAPACITY_LAYOUTS = (("k_mma", "v_mma"), ("token", "token"), ("channel", "v_mma"), ("channel", "channel"))
"""The (K, V) block arrangements :func:`packed_capacity` compares: ZipFusion's on a GPU (the mma layouts), the token
layouts, and keys (then values too) grouped by channel (a block: 16 tokens x 32 channels)."""


def packed_capacity(blocks, config, kv_budget_bytes: int, *, context: int = 8192, new_tokens: int = 256,
                    pages_per_chunk: int = 16, seed: int = 0, layouts=CAPACITY_LAYOUTS, max_requests: int | None = None,
                    progress: bool = True, block_formats=("zipfusion",)):
    """How many of Fig. 5's requests ZipFusion's memory manager admits under ``kv_budget_bytes`` with the prefixes
    packed in each (K, V) block arrangement of ``layouts`` (names of :data:`zipkv.format.LAYOUTS`), and how far the
    next request is from admission: requests of ``context`` real-KV tokens (:func:`real_prefix` of ``blocks`` with
    :func:`decode_throughput`'s seeds; every token of the prefix real here, where the engine's runs end it with one
    prompt token) and ``new_tokens`` outputs reserved raw, admitted packed in order
    (:meth:`zipkv.memory.KVMemory.admit_packed`) until one is refused. Placement needs only the blocks' sizes, so the
    memory runs on PyTorch's meta device (shapes, no bytes): about 0.5 s of host time per request and arrangement, plus
    the blocks' eligibility (minutes for Fig. 5's 58 requests on a CPU; ``progress``: a tqdm bar over the requests).

    block_formats: the block formats placed, each with every layout pair: ``"zipfusion"`` (ZipFusion's, §III-B: a
    block whose exponents do not fit its window stays raw) and ``"escape"`` (:mod:`zipkv.escape`'s: every block
    compressed but those with more than 127 escapes, each page's escape list -- every page-head of one layer, 2 bytes an
    entry -- after its last page-head, rounded up to 256-byte units, as :class:`zipkv.memory.KVMemory` with
    ``block_format="escape"`` places it).

    Returns a DataFrame, a row per block format and layout pair: ``block_format, k_layout, v_layout,
    frac_compressed_k, frac_compressed_v``,
    ``bits_per_value`` (stored per value of the admitted prefixes, payloads and escape lists), ``max_batch``, ``chunks_short``
    (:meth:`~zipkv.memory.KVMemory.chunks_short` of the first request refused), ``frac_budget_short`` (those chunks
    over the budget's) and ``kv_budget_bytes``."""
    import pandas as pd
    from tqdm.auto import tqdm

    from zipkv import escape
    from zipkv.memory import KVMemory, Packed
    from zipkv.memory.placement import UNIT
    block_formats = tuple(block_formats)
    if not block_formats or not set(block_formats) <= {"zipfusion", "escape"}:
        raise ValueError(f"block_formats must name 'zipfusion' and/or 'escape', got {block_formats!r}")
    H = config.num_key_value_heads
    D = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    L, P, nb = config.num_hidden_layers, fmt.PAGE_TOKENS, fmt.n_blocks(D)
    n = context // P
    if max_requests is None:
        raw_request = L * 2 * H * fmt.page_bytes(D) * math.ceil((context + new_tokens - 1) / P)
        max_requests = math.ceil(1.5 * kv_budget_bytes / raw_request) + 1
    meta = torch.device("meta")
    slots = [torch.empty(n, 2, H, fmt.page_bytes(D), dtype=torch.uint8, device=meta)] * L
    flags = [torch.empty(n, 2, H, nb, dtype=torch.uint8, device=meta)] * L
    tail = [(torch.empty(H, context - n * P, D, dtype=torch.bfloat16, device=meta),) * 2] * L
    keys = [(f, pair) for f in block_formats for pair in layouts]
    mems = {key: KVMemory(L, H, D, kv_budget_bytes, pages_per_chunk=pages_per_chunk, k_layout=key[1][0],
                          v_layout=key[1][1], device=meta) for key in keys}
    state = {key: dict(max_batch=0, chunks_short=None, comp=torch.zeros(2, dtype=torch.int64), units=0) for key in keys}
    for i in tqdm(range(max_requests), desc="requests placed", disable=not progress):
        open_keys = [key for key in keys if state[key]["chunks_short"] is None]
        if not open_keys:
            break
        prefix = real_prefix(blocks, config, context, seed + i)
        comp = {}                          # (format, kv, layout) -> (compressed blocks, escape entries) [L, n, H] (CPU)
        for layer in range(L):
            for x, which in zip(prefix.kv(layer), (0, 1)):
                pages = x[:, : n * P].reshape(H, n, P, D)
                for f, lay in {(f, pair[which]) for f, pair in open_keys}:
                    if f == "zipfusion":
                        c, e = fmt.eligible(pages, lay).sum(-1).T.cpu(), torch.zeros(n, H, dtype=torch.int64)
                    else:
                        count = escape.escape_counts(pages, lay)                          # [H, n, nb]
                        kept = count <= escape.MAX_BLOCK_ESCAPES
                        c, e = kept.sum(-1).T.cpu(), (count * kept).sum(-1).T.cpu()
                    comp.setdefault((f, which, lay), []).append((c, e))                   # [n, H] each
        for key in open_keys:
            f, pair = key
            (ck, ek), (cv, ev) = ([torch.stack(t) for t in zip(*comp[f, which, lay])] for which, lay in zip((0, 1), pair))
            head_units = torch.cat([4 * nb - ck, 4 * nb - cv], -1)                                # [L, n, 2H]
            if f == "escape":                          # the page's list after its last page-head, in whole units
                entries = ek.sum(-1) + ev.sum(-1)                                                 # [L, n]
                head_units[..., -1] += (2 * entries + UNIT - 1) // UNIT
            packed = Packed(context, n, slots, flags, head_units.tolist(), tail)
            st, mem = state[key], mems[key]
            if mem.admit_packed(i, packed, new_tokens) is None:
                st["chunks_short"] = mem.chunks_short(packed, new_tokens)
            else:
                st["max_batch"] += 1
                st["comp"] += torch.stack([ck.sum(), cv.sum()])
                st["units"] += int(head_units.sum())
    rows = []
    for (f, (kl, vl)), st in state.items():
        blocks_stored = max(1, st["max_batch"]) * L * n * H * nb
        fk, fv = (st["comp"] / blocks_stored).tolist()
        rows.append(dict(block_format=f, k_layout=kl, v_layout=vl, frac_compressed_k=fk, frac_compressed_v=fv,
                         bits_per_value=8 * UNIT * st["units"] / (2 * blocks_stored * fmt.BLOCK_VALUES),
                         max_batch=st["max_batch"], chunks_short=st["chunks_short"],
                         frac_budget_short=(st["chunks_short"] * mems[f, (kl, vl)].chunk_bytes / kv_budget_bytes
                                            if st["chunks_short"] is not None else float("nan")),
                         kv_budget_bytes=kv_budget_bytes))
    return pd.DataFrame(rows)


def largest_batch_budget(config, batch: int, tokens: int, *, pages_per_chunk: int = 16) -> int:
    """The smallest KV budget whose uncompressed engine's largest batch is ``batch`` requests of ``tokens``
    cached tokens (prompt + new tokens - 1)."""
    return kv_budget_for(config, batch, tokens, pages_per_chunk=pages_per_chunk)


def decode_throughput(model, method: str, *, kv_budget_bytes: int, blocks, context: int = 8192,
                      new_tokens: int = 256, batch: int | None = None, submit: int | None = None,
                      timed_steps: int | None = None, seed: int = 0, codec=None, profile: bool = False,
                      **engine_kw) -> dict:
    """Decode tokens/s of ``method`` (a key of :data:`METHODS`) for requests of ``context`` input tokens (a
    real-KV prefix of ``context - 1`` tokens + one prompt token) and ``new_tokens`` outputs, under
    ``kv_budget_bytes``.

    batch: a fixed batch (``batch`` requests submitted, at most ``batch`` running); None: the largest
    batch that fits -- ``submit`` requests (default: enough for 1.5x the uncompressed capacity) are
    queued and the engine admits as many as fit. Only the first wave's decode steps run (``timed_steps``,
    default ``new_tokens - 1``: every step after the first token); with CUDA graphs the first of them runs
    eagerly as the warm-up and is not timed. codec: a restore baseline's codec (:func:`make_codec`); its
    shared buffer holds ``batch`` requests' prefixes, or, for the largest batch, what
    :func:`restore_buffer_pages` finds on a sample of the prefixes. profile: after the run, time replays of
    the last captured step graph and split its GPU time by kernel kind (:func:`zipkv.bench.engine.step_breakdown`;
    columns ``replay_ms``, ``launch_ms`` (the host's graph launch, inside ``replay_ms``), ``host_ms`` =
    ``step_ms - replay_ms`` (the host work the engine's overlapped steps do not hide behind the GPU; below zero
    where they also hide part of the replay's launch), ``<kind>_ms``, the GPU's idle time by the kind of
    kernel it waits before, ``gap_before_<kind>_ms``, and the five costliest ``top_gaps`` as JSON; CUDA graphs only).
    On CUDA the row also has the GPU's median SM clock, median and largest power and the share of samples the power
    cap limited over the decode steps (:class:`zipkv.bench.power.GpuMonitor`: ``sm_clock_mhz``, ``power_w``,
    ``power_w_max``, ``frac_power_capped``) and ``fused_ops`` (the engine's step kernels, ``engine_kw``'s
    ``fused_ops``). Returns a row of the chapter's table plus the run's ``stats``."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {method!r}")
    if (method in RESTORE) != (codec is not None):
        raise ValueError(f"codec: a restore baseline ({RESTORE}) needs its codec, the other methods none; "
                         f"got method={method!r}, codec={type(codec).__name__}")
    cfg = model.config
    if submit is None:
        per_req = math.ceil((context + new_tokens - 1) / fmt.PAGE_TOKENS) * cfg.num_hidden_layers * 2 \
            * cfg.num_key_value_heads * fmt.page_bytes(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        submit = batch if batch is not None else math.ceil(1.5 * kv_budget_bytes / per_req) + 1
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(cfg.vocab_size, (submit, 1), generator=gen).tolist()
    prefixes = [real_prefix(blocks, cfg, context - 1, seed + i) for i in range(submit)]
    if codec is not None:
        n_pages = (context - 1) // fmt.PAGE_TOKENS
        pages = batch * n_pages if batch is not None else restore_buffer_pages(
            cfg, kv_budget_bytes, codec, prefixes[:2], context, new_tokens,
            pages_per_chunk=engine_kw.get("pages_per_chunk", 16))
        engine_kw = dict(restore=codec, restore_buffer_pages=pages, **engine_kw)
    engine = Engine(model, kv_budget_bytes, max_batch=batch, eos_token_id=None, **{**engine_settings(method), **engine_kw})
    steps = new_tokens - 1 if timed_steps is None else timed_steps
    from zipkv.bench.power import GpuMonitor
    with GpuMonitor(engine.device.index or 0) if engine.device.type == "cuda" else nullcontext() as monitor:
        res = engine.generate(prompts, new_tokens, prefixes=prefixes, max_decode_steps=steps, progress=False)
    st = res.stats
    power = monitor.summary(st["decode_seconds"]) if monitor is not None else {}
    row = dict(method=method, **_run_columns(st), fused_ops=engine.runner.step_ops.fused, **power,
               step_ms_each=json.dumps([round(1e3 * x["seconds"], 3) for x in st["steps"]]),
               graph_capture_s=st["graph_capture_seconds"])
    if profile and engine.runner.graphs.graph is not None:
        from zipkv.bench.engine import step_breakdown
        br = step_breakdown(engine.runner.graphs.graph)
        plan = (engine.runner.attention.plans or [None])[0]
        row.update(replay_ms=br["replay_ms"], launch_ms=br["launch_ms"], host_ms=row["step_ms"] - br["replay_ms"],
                   **{f"{k}_ms": v for k, v in br["kernel_ms"].items()},
                   **{f"gap_before_{k}_ms": v for k, v in br["gap_ms"].items()},
                   top_gaps=json.dumps([[b, a, round(ms, 4), n] for b, a, ms, n in br["top_gaps"][:5]]),
                   num_splits=plan.num_splits if plan is not None else None)
        st["top_kernels"] = br["top_kernels"]
    del engine
    _free_device()
    return dict(row, stats=st)


def step_profile(*, device="cuda", context=8192, new_tokens=256, timed_steps=24, fixed_batch=32,
                 uncompressed_max_batch=46, methods=("uncompressed", "zipfusion"), kv_windows=2, kv_window_context=2048,
                 pages_per_chunk=16, seed=0, splits=(None,), overlaps=(True, False)):
    """Decode-step breakdowns (``decode_throughput(profile=True)``) of ``methods`` at ``fixed_batch`` and at each
    one's largest batch, in :func:`figure5`'s Llama-3.1-8B-shape setting (random weights, real-KV prefixes, the
    budget of ``uncompressed_max_batch`` uncompressed requests), ``timed_steps`` decode steps each: a shorter
    run than the chapter's, for the "where the step goes" table (``results/paper/zipfusion_engine_profile.csv``),
    with the run's ``device``, ``commit`` and ``date``. splits: the decode kernel's split-KV factors to run each
    row with (None: the plan's choice; the column ``num_splits`` says which ran). overlaps: the engine's scheduler
    for each row (``Engine(overlap=...)``; column ``overlap``): with and without the overlapped steps, what the
    host's work costs a step."""
    import pandas as pd
    from zipkv.provenance import provenance
    from zipkv import data, models
    small, tok = models.load_model(dtype=torch.bfloat16, device=device)
    model, common = _llama_setting(small, tok, data.load_books(), device=device, context=context, new_tokens=new_tokens,
                                   uncompressed_max_batch=uncompressed_max_batch, kv_windows=kv_windows,
                                   kv_window_context=kv_window_context, pages_per_chunk=pages_per_chunk, seed=seed)
    del small
    rows = []
    for method in methods:
        for batch, split, overlap in ((b, x, o) for b in (fixed_batch, None) for x in splits for o in overlaps):
            r = decode_throughput(model, method, batch=batch, timed_steps=timed_steps, profile=True, num_splits=split,
                                  overlap=overlap, **common)
            r.pop("stats")
            rows.append({"model": THROUGHPUT_PAPER_MODEL, **r})
    run = provenance("bench")
    return pd.DataFrame(rows).assign(device=run["device"], commit=run["commit"], date=run["date"])


def gpu_run_record() -> dict:
    """This run's provenance (:func:`zipkv.provenance.provenance`: ``device``, ``commit``, ``date``, ...) and, on a GPU,
    ``gpu_uuid``: the board, which tells apart two GPUs of one model (their power draw and clocks differ)."""
    from zipkv.provenance import provenance
    record = provenance("throughput")
    if torch.cuda.is_available():
        record["gpu_uuid"] = str(torch.cuda.get_device_properties(0).uuid)
    return record


def _run_columns(st: dict) -> dict:
    """The table's columns every run has, from :meth:`zipkv.engine.Engine.generate`'s ``stats``."""
    return dict(batch=st["max_batch"], tokens_per_s=st["decode_tokens_per_s"], kv_budget_bytes=st["kv_budget_bytes"],
                frac_compressed_k=st["frac_compressed_k"], frac_compressed_v=st["frac_compressed_v"],
                stored_bits_per_value=st["stored_bits_per_value"], timed_steps=st["timed_steps"],
                step_ms=1e3 * st["decode_seconds"] / max(1, st["timed_steps"]), overlap=st["overlap"],
                admitted_raw=st["admitted_raw"])


def _llama_setting(small, tokenizer, books, *, device, context, new_tokens, uncompressed_max_batch, kv_windows,
                   kv_window_context, pages_per_chunk, seed):
    """Fig. 5's Llama-3.1-8B-shape setting: ``(model, common)``, the random-weight model and the
    :func:`decode_throughput` arguments every method shares (real-KV blocks captured with ``small``, the budget
    of ``uncompressed_max_batch`` uncompressed requests)."""
    blocks = real_kv_blocks(small, tokenizer, books, windows=kv_windows, context=kv_window_context, seed=seed)
    model = random_llama(device)
    budget = largest_batch_budget(model.config, uncompressed_max_batch, context + new_tokens - 1,
                                  pages_per_chunk=pages_per_chunk)
    return model, dict(kv_budget_bytes=budget, blocks=blocks, context=context, new_tokens=new_tokens, seed=seed,
                       pages_per_chunk=pages_per_chunk)


def _free_device() -> None:
    """Free a dropped engine's pool, payloads and graphs now (its step graph refers back to it: a cycle)."""
    import gc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _end_to_end(model, method: str, prompts, new_tokens: int, budget: int, pages_per_chunk: int, codec=None):
    """One engine run of ``method`` over ``prompts`` under ``budget``, a real model end to end (ZipFusion compresses
    every page it fills, not only the prompt's; a restore baseline keeps the prompt as ``codec``'s payload)."""
    kw = engine_settings(method)
    if codec is not None:
        kw["restore"] = codec
    if method == "zipfusion":
        kw["compress"] = "all"
    engine = Engine(model, budget, pages_per_chunk=pages_per_chunk, eos_token_id=None, **kw)
    res = engine.generate(prompts, new_tokens, progress=False)
    del engine
    _free_device()
    return res


def _e2e(device, requests, context, new_tokens, budget_requests, pages_per_chunk, seed, calibration_blocks=None):
    """The embedded model end to end on PG19 windows under the budget that holds ``budget_requests``
    requests uncompressed: uncompressed, ZipFusion (every full page compressed after the step that filled
    it) and, with ``calibration_blocks`` (SplitZip's codebook), the restore baselines (prompt pages as
    their codec's payload)."""
    from zipkv import data, models
    model, tok = models.load_model(dtype=torch.bfloat16)
    model = model.to(device)
    prompts = [w.context_ids.tolist() for w in data.windows(tok, data.load_books(), n=requests, context=context,
                                                            continuation=0, seed=seed)]
    budget = largest_batch_budget(model.config, budget_requests, context + new_tokens - 1, pages_per_chunk=pages_per_chunk)
    if calibration_blocks is None:
        calibration_blocks = real_kv_blocks(model, tok, data.load_books(), windows=1, context=context, seed=seed + 1)
    rows, runs = [], {}
    for method in METHODS:
        codec = make_codec(method, calibration_blocks) if method in RESTORE else None
        runs[method] = res = _end_to_end(model, method, prompts, new_tokens, budget, pages_per_chunk, codec)
        st = res.stats
        rows.append(dict(model=models.EMBEDDED_NAME, method=method, **_run_columns(st), max_batch=st["max_batch"],
                         mean_batch=sum(x["batch"] for x in st["steps"]) / max(1, len(st["steps"])),
                         retracted=st["retracted"], cuda_graphs=st["graph_error"] or ("replayed" if st["cuda_graphs"] else "off")))
    same = {method: token_agreement(r.outputs, runs["uncompressed"].outputs, model=model, prompts=prompts)
            for method, r in runs.items() if method != "uncompressed"}
    return rows, runs, same, (model, tok)


def token_agreement(outputs, reference, *, model=None, prompts=None) -> dict:
    """How far greedy outputs agree with the uncompressed engine's: ``identical`` requests of ``requests``, and for
    the others the index of the first differing token (``first_difference``). With ``model`` and ``prompts`` also
    ``logit_gap``: per differing request, how far apart the model's logits of the two tokens are at that first
    difference (:func:`divergence_gap`): a near-tie a summation order can break, or a real disagreement."""
    first, gaps = [], []
    for prompt, o, r in zip(prompts or [None] * len(outputs), outputs, reference):
        if o == r:
            continue
        i = next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), min(len(o), len(r)))
        first.append(i)
        if model is not None and i < min(len(o), len(r)):
            gaps.append(divergence_gap(model, list(prompt) + list(r[:i]), r[i], o[i]))
    out = dict(identical=len(outputs) - len(first), requests=len(outputs), first_difference=first)
    return dict(out, logit_gap=gaps) if model is not None else out


@torch.no_grad()
def divergence_gap(model, ids, reference_token: int, other_token: int) -> float:
    """``|logit(reference_token) − logit(other_token)|`` of ``model``'s own forward (Hugging Face attention) at the
    token after ``ids``: how close to a tie the two greedy choices were."""
    device = next(model.parameters()).device
    logits = model(input_ids=torch.tensor([ids], device=device), logits_to_keep=1).logits[0, -1].float()
    return float((logits[reference_token] - logits[other_token]).abs())


def figure5(*, device="cuda", shape="llama3.1-8b", context=8192, new_tokens=256, timed_steps=None, restore_timed_steps=None,
            fixed_batch=32, uncompressed_max_batch=46, kv_windows=2, kv_window_context=2048, e2e_requests=12,
            e2e_context=1024, e2e_new_tokens=64, e2e_budget_requests=4, e2e_pages_per_chunk=16, pages_per_chunk=16,
            seed=0, progress_csv=None, profile=False, repeats=1, unfused=False, mma_baseline=False, methods=None,
            capacity=True):
    """The chapter's runs: returns ``dict(table, e2e_runs, e2e_same_tokens, capacity)`` (``e2e_same_tokens``: per
    method, :func:`token_agreement` with the uncompressed run; ``capacity``: with ``shape`` and ``capacity``,
    :func:`packed_capacity` in the Llama-shape setting, the same prefixes and budget, with the run's ``device``,
    ``commit`` and ``date`` (about 0.5 s of host time per request and block arrangement), else None).

    ``table`` (one row per model, method and batch; columns of ``results/paper/zipfusion_throughput.csv``
    plus ``stored_bits_per_value``, ``timed_steps``, ``step_ms``): with ``shape="llama3.1-8b"`` (GPU)
    Llama-3.1-8B shapes with random weights and real-KV prefixes (:func:`real_prefix`), every method of
    :data:`METHODS` at ``fixed_batch`` and at its largest batch under the budget whose uncompressed engine
    holds ``uncompressed_max_batch`` requests (``restore_timed_steps``: decode steps run for the restore
    baselines, default ``timed_steps``); always the embedded model end to end on PG19 windows (``e2e_*``).
    SplitZip's codebook is calibrated on captured KV of windows the prefixes do not use (seed + 1).
    ``shape=None`` runs the end-to-end part only (the CPU quick profile). progress_csv: rows are appended
    there as they are measured (a long GPU run keeps what it measured). profile: each Llama-shape row also gets its
    decode-step breakdown (``decode_throughput(profile=True)``; :func:`zipkv.study.chapters.throughput.step_table`). repeats: runs of each of
    :data:`REPEATED`'s methods at its largest batch (an odd number; after every method's first run, in rounds that
    alternate the methods), whose median run is the row (:func:`median_run`). unfused: also run :data:`REPEATED` at
    their largest batches with the model's own modules for the step's norms, rotary and MLP product
    (``fused_ops=False``), as rows of model :data:`~zipkv.study.settings.THROUGHPUT_UNFUSED_MODEL`. mma_baseline: also run
    uncompressed at its largest batch with its pages in the mma layouts, read by the Gluon kernel's all-raw path (the
    engine's default on a GPU), ``repeats`` times, its median run a row of model
    :data:`~zipkv.study.settings.THROUGHPUT_MMA_BASELINE_MODEL` (:func:`zipkv.study.chapters.throughput.mma_baseline_text`).
    methods: the Llama-shape runs' methods (default every one of :data:`METHODS`; a card whose memory does not hold
    the restore baselines' buffers at their largest batch, such as the H100 of ``.ci/gpu/paper_card.sh``, runs
    :data:`REPEATED`)."""
    import pandas as pd
    from zipkv import data
    if shape not in ("llama3.1-8b", None):
        raise ValueError(f"shape must be 'llama3.1-8b' or None, got {shape!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1 or repeats % 2 == 0:
        raise ValueError(f"repeats must be an odd int >= 1 (its median is one run), got {repeats!r}")
    methods = tuple(METHODS) if methods is None else tuple(methods)
    if not methods or not set(methods) <= set(METHODS) or not set(REPEATED) <= set(methods):
        raise ValueError(f"methods must be names of {sorted(METHODS)} including {list(REPEATED)}, got {methods!r}")
    cols = ["model", "method", "batch", "max_batch", "tokens_per_s", "kv_budget_bytes", "frac_compressed_k", "frac_compressed_v"]

    def done(rows):
        table = pd.DataFrame(rows)
        table = table[cols + [c for c in table.columns if c not in cols]]
        if progress_csv:
            table.to_csv(progress_csv, index=False)
        return table
    placed = None                                # packed_capacity's table (Llama-shape runs)
    e2e_rows, runs, same, (small, tok) = _e2e(device, e2e_requests, e2e_context, e2e_new_tokens, e2e_budget_requests,
                                              e2e_pages_per_chunk, seed)
    rows = list(e2e_rows)
    done(rows)
    if shape is not None:
        books = data.load_books()
        calibration = real_kv_blocks(small, tok, books, windows=1, context=kv_window_context, seed=seed + 1)
        model, common = _llama_setting(small, tok, books, device=device, context=context, new_tokens=new_tokens,
                                       uncompressed_max_batch=uncompressed_max_batch, kv_windows=kv_windows,
                                       kv_window_context=kv_window_context, pages_per_chunk=pages_per_chunk, seed=seed)
        del small
        if capacity:
            record = gpu_run_record()
            placed = packed_capacity(common["blocks"], model.config, common["kv_budget_bytes"], context=context,
                                     new_tokens=new_tokens, pages_per_chunk=pages_per_chunk, seed=seed,
                                     progress=False).assign(**{k: record[k] for k in ("device", "commit", "date")})
        big = []
        for m in (m for m in METHODS if m in methods):
            codec = make_codec(m, calibration) if m in RESTORE else None
            steps = restore_timed_steps if m in RESTORE and restore_timed_steps is not None else timed_steps
            largest = decode_throughput(model, m, codec=codec, timed_steps=steps, profile=profile, **common)
            fixed = decode_throughput(model, m, codec=codec, batch=fixed_batch, timed_steps=steps, profile=profile, **common)
            for r in (fixed, largest):
                big.append({"model": THROUGHPUT_PAPER_MODEL, **{k: v for k, v in r.items() if k != "stats"},
                            "max_batch": largest["batch"]})
            done(big + rows)
        if repeats > 1:
            big = repeat_largest(big, lambda m: decode_throughput(model, m, timed_steps=timed_steps, profile=profile,
                                                                  **common), repeats)
            done(big + rows)
        if unfused:
            for m in REPEATED:
                r = decode_throughput(model, m, timed_steps=timed_steps, profile=profile, fused_ops=False, **common)
                big.append({"model": THROUGHPUT_UNFUSED_MODEL, **{k: v for k, v in r.items() if k != "stats"},
                            "max_batch": r["batch"]})
            done(big + rows)
        if mma_baseline:
            mma_runs = [decode_throughput(model, "uncompressed", timed_steps=timed_steps, profile=profile,
                                          k_layout="k_mma", v_layout="v_mma", **common) for _ in range(repeats)]
            big.append(median_run([{"model": THROUGHPUT_MMA_BASELINE_MODEL, **{k: v for k, v in r.items() if k != "stats"},
                                    "max_batch": r["batch"]} for r in mma_runs]))
            done(big + rows)
        rows = big + rows
        del model
    return dict(table=done(rows), e2e_runs=runs, e2e_same_tokens=same, capacity=placed)


REPEATED = ("uncompressed", "zipfusion")
"""The methods :func:`figure5` runs ``repeats`` times at their largest batch: the two of the tokens/s bar."""


def repeat_largest(big: list[dict], run, repeats: int) -> list[dict]:
    """``big`` (rows of :func:`figure5`'s table, each method's first runs) with the largest-batch row of each method
    of :data:`REPEATED` replaced by the median of ``repeats`` runs (:func:`median_run`): the first, then ``repeats -
    1`` rounds that alternate the methods (drift hits both alike), ``run(method)`` a :func:`decode_throughput` row
    at the method's largest batch. A repeated run that admits another batch is an error."""
    first = {r["method"]: r for r in big if r["method"] in REPEATED and r["batch"] == r["max_batch"]}
    runs = {m: [first[m]] for m in REPEATED}
    for _ in range(repeats - 1):
        for m in REPEATED:
            r = {k: v for k, v in run(m).items() if k != "stats"}
            if r["batch"] != first[m]["batch"]:
                raise RuntimeError(f"{m}: a repeated run's largest batch {r['batch']} is not the first run's "
                                   f"{first[m]['batch']} (admission should not depend on the run)")
            runs[m].append({"model": first[m]["model"], **r, "max_batch": r["batch"]})
    return [median_run(runs[r["method"]]) if first.get(r["method"]) is r else r for r in big]


def median_run(runs: list[dict]) -> dict:
    """The run with the median tokens/s of ``runs`` (rows of :func:`figure5`'s table, an odd number), with every
    run's tokens/s in run order as ``tokens_per_s_runs`` (JSON)."""
    mid = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
    return {**mid, "tokens_per_s_runs": json.dumps([round(r["tokens_per_s"], 1) for r in runs])}


def few_requests(*, device="cuda", contexts=(32768, 131072), batches=(1, 4), new_tokens=64, timed_steps=None,
                 embedded=True, embedded_context=None, kv_windows=2, kv_window_context=2048, pages_per_chunk=16, seed=0,
                 methods=("uncompressed", "zipfusion"), model_overrides=None, progress=True):
    """Decode tokens/s of one and a few long requests (the latency chapter's few-requests panel, in the engine;
    ZipFusion §IV-C's setting at batch 1-4): per (context, batch, method), ``batch`` requests of ``context`` input tokens decoding
    ``new_tokens`` under a budget that holds exactly them uncompressed, so nothing queues.

    Llama-3.1-8B shape, random weights, real-KV prefixes (:func:`figure5`'s setting, :func:`decode_throughput`),
    then with ``embedded`` the embedded model end to end at ``embedded_context`` tokens (default its longest: its
    window minus ``new_tokens``; PG19 prompts, every page compressed as it fills). model_overrides: changes to the
    Llama shape (tests: a tiny one). A point whose budget does not fit the GPU's free memory is a
    row with ``skipped`` set. Returns a DataFrame: ``model``, ``context``, ``method``, :func:`_run_columns`'s columns,
    ``skipped``; with the run's ``device``, ``commit`` and ``date``."""
    import pandas as pd
    from tqdm.auto import tqdm
    from zipkv import data, models

    small, tok = models.load_model(dtype=torch.bfloat16, device=device)
    books = data.load_books()
    blocks = real_kv_blocks(small, tok, books, windows=kv_windows, context=kv_window_context, seed=seed)
    points = [(c, b, m) for c in contexts for b in batches for m in methods]
    rows = []
    model = random_llama(device, **(model_overrides or {}))
    for context, batch, method in tqdm(points, desc="long requests, Llama-3.1-8B shape", disable=not progress):
        budget = largest_batch_budget(model.config, batch, context + new_tokens - 1, pages_per_chunk=pages_per_chunk)
        free = torch.cuda.mem_get_info()[0] if torch.device(device).type == "cuda" else math.inf
        row = dict(model="Llama-3.1-8B shape", context=context, method=method, kv_budget_bytes=budget)
        if budget * 1.1 > free:           # the pool plus the engine's workspaces
            rows.append(dict(row, batch=batch, skipped=f"KV budget {budget / 2**30:.1f} GiB > free {free / 2**30:.1f} GiB"))
            continue
        r = decode_throughput(model, method, kv_budget_bytes=budget, blocks=blocks, context=context,
                              new_tokens=new_tokens, batch=batch, timed_steps=timed_steps, seed=seed,
                              pages_per_chunk=pages_per_chunk)
        r.pop("stats")
        rows.append(dict(row, **r))
    del model
    _free_device()
    if embedded:
        context = embedded_context or small.config.max_position_embeddings - new_tokens
        for batch in batches:
            prompts = [w.context_ids.tolist() for w in data.windows(tok, books, n=batch, context=context,
                                                                    continuation=0, seed=seed)]
            budget = largest_batch_budget(small.config, batch, context + new_tokens - 1, pages_per_chunk=pages_per_chunk)
            for method in methods:
                res = _end_to_end(small, method, prompts, new_tokens, budget, pages_per_chunk)
                rows.append(dict(model=models.EMBEDDED_NAME, context=context, method=method,
                                 **_run_columns(res.stats)))
    out = pd.DataFrame(rows)
    record = gpu_run_record()
    for k in ("device", "commit", "date", "gpu_uuid"):
        out[k] = record.get(k)
    return out
