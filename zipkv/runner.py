"""The step runner of :class:`zipkv.engine.Engine` (ZipFusion §III-D, §IV-A): the model's side of serving, as SGLang's
``model_executor/model_runner.py`` and vLLM v1's ``worker/gpu_model_runner.py`` are.

:class:`StepRunner` prefills a request with the model's own forward and runs the decode step -- every layer's
projections, rotary embedding, KV writes into the memory's pages, attention, MLP and the next token (the greedy
argmax, or :func:`zipkv.sampling.sample`) -- on the machinery below: the adapter onto the attention kernels' plan/run
API over a static page table (:class:`StepAttention`; on the CPU the torch reference over pages unpacked once and
kept until they change, :class:`UnpackedPages`), the shared restore buffer of the restore-before-attention
baselines (:class:`RestoreBuffer`, §II-B), the step's elementwise ops (:class:`StepOps`), its CUDA graph
(:class:`StepGraph`) and a launched step whose tokens the host has not read yet (:class:`StepInFlight`). Which
requests run, and when, is the scheduler's (:mod:`zipkv.scheduler`); where their pages are is the memory manager's
(:mod:`zipkv.memory`)."""
from __future__ import annotations

import time

import torch

from zipkv import format as fmt
from zipkv.memory import KVMemory, copy_to_device, free_extent, to_device
from zipkv.models import cache_keyword
from zipkv.paged import PagedKVCache, page_kinds_of
from zipkv.sampling import SAMPLING_ROWS, sample, step_inputs

__all__ = ["StepRunner", "StepAttention", "UnpackedPages", "RestoreBuffer", "StepOps", "StepGraph", "StepInFlight",
           "RMS_NORMS", "GATED_SILU_MLPS"]


class RestoreBuffer:
    """Restore-before-attention baseline (ZipFusion §II-B, §IV-C): the rows of Fig. 5 whose codecs restore
    the cache before attention. A request's prefix -- every full page of its cached tokens at admission,
    "pre-compressed" as in §IV-A -- is kept as one payload per layer and K/V of ``codec``
    (:mod:`zipkv.codecs`: SplitZip-style or Huffman); what it generates stays in raw pages of the memory.
    Before each layer's attention, every running request's payload of that layer is decoded
    (:func:`zipkv.codecs.decode_into`; the torch reference on the CPU) into **one restore buffer shared by
    all layers**, laid out as raw token-layout pages, and the raw decode kernel reads those pages and the raw
    ones through one page table (buffer page ``j`` has descriptor row ``memory.max_pages + j``).

    Memory: the buffer takes ``buffer_pages`` raw pages of *one* layer out of the budget (it is
    ``memory``'s extra region); a request's payload bytes are held as whole chunks of the memory's pool
    (``admit(hold_chunks=...)``), so every method's bytes come out of one budget. The payload tensors
    themselves are torch allocations beside the pool (same bytes, counted by those held chunks).
    A request's buffer pages are one contiguous run (first fit)."""

    def __init__(self, memory: KVMemory, codec, buffer_pages: int, reference: bool):
        self.memory, self.codec, self.reference = memory, codec, reference
        self.buffer_pages, self.extents, self.entries = buffer_pages, [[0, buffer_pages]], {}
        self.slot_positions = memory._write_index                                   # [2, 16, D]

    def fits(self, n_pages: int) -> bool:
        return n_pages == 0 or any(n >= n_pages for _, n in self.extents)

    def encode(self, kv, n_pages: int):
        """Payloads ``[(K, V)]`` per layer of the first ``n_pages`` pages of ``kv`` (per layer ``(k, v)`` bf16
        ``[H, n, D]``), each encoding raw page-head slots ``[n_pages, H, slot values]`` in the kernel's order."""
        m = self.memory
        out = []
        for k, v in (kv if n_pages else []):
            pair = []
            for i, x in enumerate((k, v)):
                x = x[:, : n_pages * fmt.PAGE_TOKENS].reshape(m.kv_heads, n_pages, -1).transpose(0, 1)
                slots = torch.empty(n_pages, m.kv_heads, m.slot_bytes // 2, dtype=torch.bfloat16, device=x.device)
                slots[..., self.slot_positions[i].reshape(-1)] = x
                pair.append(self.codec.encode(slots))
            out.append(tuple(pair))
        return out

    @staticmethod
    def payload_bytes(payload) -> int:
        return sum(e.nbytes for pair in payload for e in pair)

    def place(self, rid, payload, n_pages: int):
        """Give request ``rid`` ``n_pages`` contiguous buffer pages and point their descriptors (every layer)
        there; returns their descriptor rows."""
        m = self.memory
        if n_pages == 0:                                # a short prompt: nothing was encoded
            return None
        ext = next(e for e in self.extents if e[1] >= n_pages)
        start = ext[0]
        ext[0] += n_pages
        ext[1] -= n_pages
        self.extents = [e for e in self.extents if e[1]]
        base = m.extra_offset + start * m.page_bytes
        head = m.slot_bytes * (torch.arange(n_pages)[:, None] * m.kv_heads + torch.arange(m.kv_heads))    # [n, H]
        addr = torch.stack([base + head, base + n_pages * m.kv_heads * m.slot_bytes + head], 1)          # [n, 2, H]
        d = ((addr[..., None] + fmt.RAW_BLOCK_BYTES * torch.arange(fmt.n_blocks(m.head_dim))) << 8).to(m.device)
        host_rows = torch.arange(m.max_pages + start, m.max_pages + start + n_pages)
        rows = to_device(host_rows, m.device)
        for l in range(m.num_layers):
            m.desc[l][rows] = d
        pool = m.pool
        half = n_pages * m.kv_heads * m.slot_bytes
        views = (pool[base: base + half].view(torch.bfloat16), pool[base + half: base + 2 * half].view(torch.bfloat16))
        self.entries[rid] = dict(start=start, n=n_pages, payload=payload, views=views,
                                 host_rows=host_rows.to(torch.int32), bytes=self.payload_bytes(payload))
        return rows

    def release(self, rid) -> None:
        e = self.entries.pop(rid, None)
        if e is None:
            return
        self.extents = free_extent(self.extents, e["start"], e["n"])

    def restore(self, layer: int, rids) -> None:
        """Decode layer ``layer``'s payloads of ``rids`` into the shared buffer (no sync on the GPU)."""
        from zipkv import codecs
        for rid in rids:
            e = self.entries[rid]
            for enc, view in zip(e["payload"][layer], e["views"]):
                if self.reference:
                    view.copy_(codecs.decode_reference(enc).reshape(-1))
                else:
                    codecs.decode_into(enc, view, validate=False)


class UnpackedPages:
    """The torch reference's pages of every layer, unpacked once and kept until their bytes change: the CPU engine's
    decode step (``attention="reference"``) without unpacking the whole batch in every layer at every step.

    A page's bytes change in two ways only: the step writes its new token into each request's last page (in place,
    descriptors unchanged), and the memory rewrites a page's descriptors when it allocates, compresses or moves it
    (:meth:`zipkv.memory.KVMemory.changed_pages`, which :meth:`StepAttention.plan` reads before every step). So
    :meth:`new_step` marks those pages stale in every layer, and :meth:`request_kv` unpacks, per layer, only the
    batch's stale pages (:meth:`zipkv.paged.PagedKVCache.read_pages`, bit-exact) into ``k[layer]``, ``v[layer]`` --
    bf16 ``[num_pages, kv_heads, 16, head_dim]`` by page id, allocated at the first read (the unpacked size of every
    page the descriptors can name: about 4/3 of the budget's bytes at most). Not for the restore baselines, whose
    buffer pages are rewritten before every layer's attention."""

    def __init__(self, caches: list):
        self.caches = caches
        self.k = self.v = None
        self.fresh = [set() for _ in caches]              # per layer: page ids whose unpacked K/V are current
        self.table = None                                 # the step's page table, host lists

    def new_step(self, changed: list, indptr: list, indices: list, last_page_len: list) -> None:
        """The page table of the step about to run (host lists) and the pages whose descriptors changed since the
        last step: those, and each request's last page (where the step writes), are unpacked again."""
        stale = set(changed).union(indices[e - 1] for e in indptr[1:])
        for fresh in self.fresh:
            fresh -= stale
        self.table = (indptr, indices, last_page_len)

    def request_kv(self, layer: int) -> list:
        """Layer ``layer``'s K and V per request of the step (:func:`zipkv.kernels.reference.request_kv`: bf16
        ``[kv_heads, seq_len, head_dim]`` each), after unpacking its stale pages; call it after the step wrote the
        layer's new tokens."""
        from zipkv.kernels.reference import request_kv
        cache, fresh = self.caches[layer], self.fresh[layer]
        if self.k is None:
            shape = (len(self.caches), cache.num_pages, cache.kv_heads, fmt.PAGE_TOKENS, cache.head_dim)
            self.k, self.v = (torch.empty(shape, dtype=torch.bfloat16, device=cache.pool.device) for _ in range(2))
        indptr, indices, last = self.table
        stale = sorted(set(indices[: indptr[-1]]) - fresh)
        if stale:
            ids = torch.tensor(stale, dtype=torch.int64, device=cache.desc.device)
            self.k[layer, ids], self.v[layer, ids] = cache.read_pages(ids, validate=False)
            fresh.update(stale)
        return request_kv(self.k[layer], self.v[layer], indptr, torch.tensor(indices[: indptr[-1]]), last)


class StepAttention:
    """The engine's one adapter onto ``zipkv.kernels``: per-layer caches over the memory's pool, the kernels'
    plan/run split and the pack kernel.

    A **static page table per batch composition** (the running requests, in order): ``indptr``,
    ``indices`` (room for every request's pages at its output length) and ``last_page_len`` are device
    buffers updated in place -- a new token raises ``last_page_len``, a new page rewrites ``indptr`` and
    ``indices`` -- so one :func:`zipkv.kernels.decode_attention.plan` per layer serves the composition's
    every step, and a CUDA graph of the step stays valid. Pages compressed between steps keep the plans
    valid too: their descriptors change in place and the plans route on the device (``routing="device"``); a
    cache that is never compressed (``static_kinds``) keeps the kernels' single specialised launch. Only the
    Triton kernel's routed launches read the page kinds (:attr:`reads_kinds`): for them the kinds of the pages
    whose descriptors changed are recomputed before each step; the Gluon kernel's mixed launch reads each
    block's descriptor, and the reference reads nothing of the kind, so for those no step pays for it. The reference
    (``backend="reference"``) keeps the pages it unpacked until they change (:class:`UnpackedPages`), but under a
    restore baseline, which rewrites its buffer pages every layer."""

    def __init__(self, memory: KVMemory, backend: str, q_heads: int, scale: float, static_kinds: bool,
                 restore: RestoreBuffer | None = None, num_splits: int | None = None):
        self.memory, self.backend, self.q_heads, self.scale, self.restore = memory, backend, q_heads, scale, restore
        self.num_splits = num_splits
        pool = memory.pool if restore is not None else memory.pool[: memory.total_bytes]
        esc = memory.esc or [None] * len(memory.desc)                # the escape format's descriptors, or none
        self.caches = [PagedKVCache(pool, d, memory.head_dim, *memory.layouts, escapes=e) for d, e in zip(memory.desc, esc)]
        self.static_kinds = static_kinds
        self.reads_kinds = False
        if backend == "kernel" and not static_kinds:
            from zipkv.kernels.decode_attention import kernel_for
            self.reads_kinds = kernel_for(self.caches[0]) == "triton"
        self.key = self.pages_key = self.plans_key = self.table = self.plans = None
        self.rids = []
        self.unpacked = UnpackedPages(self.caches) if backend == "reference" and restore is None else None

    @staticmethod
    def pack_slots(backend, block_format: str = "zipfusion"):
        """The Triton pack kernel compressing raw slots in place (``backend="kernel"``; on the CPU under
        ``TRITON_INTERPRET=1``), or None: the memory's torch reference. block_format ``"escape"``: the escape
        format's pack kernel (:mod:`zipkv.kernels.pack_escape`)."""
        if backend != "kernel":
            return None
        if block_format == "escape":
            from zipkv.kernels.pack_escape import pack_slots
            return pack_slots
        from zipkv.kernels.pack import pack_into

        def pack(pool, off, head_dim, layout):
            return pack_into(pool, off, pool, off, head_dim, layout, src_packed=True, validate=False)
        return pack

    def _host_table(self, rids):
        """The batch's page table (new device tensors): a restored request's buffer pages first, then its raw ones."""
        if self.restore is None:
            return self.memory.page_table(rids)
        indptr, indices, last = self.memory.page_table(rids, device="cpu")
        parts, counts = [], []
        ip = indptr.tolist()
        for i, r in enumerate(rids):
            own = indices[ip[i]: ip[i + 1]]
            e = self.restore.entries.get(r)
            parts += [e["host_rows"], own] if e is not None else [own]
            counts.append(own.numel() + (e["n"] if e is not None else 0))
        indptr = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32)
        return tuple(to_device(x, self.memory.device) for x in (indptr, torch.cat(parts), last))

    def plan(self, rids) -> tuple:
        """Bring the static page table up to date for ``rids``; plan again when the composition changed.
        Returns the composition's key (what a captured step graph depends on)."""
        pages = self.memory.changed_pages()                          # flushes this step's new pages first
        if pages and self.reads_kinds:                               # their kinds, all layers at once
            ids = to_device(torch.tensor(pages, dtype=torch.int64), self.memory.device)
            kinds = page_kinds_of(self.memory.desc_all[:, ids])                      # [layers, n, kv_heads]
            for c, k in zip(self.caches, kinds):
                c.refresh(k, pages=ids)
        mem = self.memory
        key = tuple(mem.requests[r].serial for r in rids)           # a re-admitted request is new
        lens = [mem.cache_len(r) for r in rids]
        pages_key = tuple((n + fmt.PAGE_TOKENS - 1) // fmt.PAGE_TOKENS for n in lens)
        if self.unpacked is not None:
            self.unpacked.new_step(pages, *(x.tolist() for x in mem.page_table(rids, device="cpu")))
        if key == self.key and pages_key == self.pages_key:          # same pages: only last_page_len moves
            last = [n - fmt.PAGE_TOKENS * (p - 1) for n, p in zip(lens, pages_key)]
            copy_to_device(self.table[2], torch.tensor(last, dtype=torch.int32))
            return key
        indptr, indices, last = self._host_table(rids)
        if key != self.key:
            extra = [self.restore.entries[r]["n"] if self.restore and r in self.restore.entries else 0 for r in rids]
            room = sum(-(-mem.requests[r].max_len // fmt.PAGE_TOKENS) + x for r, x in zip(rids, extra))
            self.table = (torch.zeros_like(indptr), torch.zeros(max(room, indices.numel()), dtype=torch.int32,
                                                                device=indices.device), torch.zeros_like(last))
            self.key, self.rids = key, list(rids)
        self.table[0].copy_(indptr)
        self.table[1][: indices.numel()].copy_(indices)
        self.table[2].copy_(last)
        if key != self.plans_key:
            self.plans_key = key
            if self.backend == "kernel":
                from zipkv.kernels.decode_attention import plan
                routing = "auto" if self.static_kinds else "device"
                self.plans = [plan(*self.table, c, self.q_heads, softmax_scale=self.scale, validate=False, routing=routing,
                                   num_splits=self.num_splits) for c in self.caches]
        self.pages_key = pages_key
        return key

    def run(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q bf16 ``[batch, q_heads, head_dim]`` -> bf16 attention output, same shape (restoring the layer's
        payloads into the shared buffer first, for a restore baseline)."""
        if self.restore is not None:
            self.restore.restore(layer, [r for r in self.rids if r in self.restore.entries])
        if self.unpacked is not None:
            from zipkv.kernels.reference import attention_fp32
            return attention_fp32(q, self.unpacked.request_kv(layer), self.scale).to(q.dtype)
        if self.backend == "reference":
            from zipkv.kernels.reference import decode_attention_reference
            return decode_attention_reference(q, self.caches[layer], *self.table, softmax_scale=self.scale,
                                              validate=False).to(q.dtype)
        return self.plans[layer].run(q.contiguous())


RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
"""Norm classes that compute Llama's RMSNorm (fp32 statistics, ``weight * bf16(normed)``), the one
:func:`zipkv.kernels.fused_ops.add_rms_norm` computes."""

GATED_SILU_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")
"""MLP classes computing ``down(act(gate(x)) * up(x))``; with a SiLU ``act`` the product is
:func:`zipkv.kernels.fused_ops.silu_mul`."""


class StepOps:
    """The elementwise pieces of the decode step: residual add + norm, rotary embedding, the MLP's gated product.
    ``fused``: through one kernel each (:mod:`zipkv.kernels.fused_ops`, which rounds where the modules do) wherever
    a module computes exactly what the kernel does (:data:`RMS_NORMS`, :data:`GATED_SILU_MLPS` with SiLU, a
    power-of-two head_dim); elsewhere, and with ``fused=False``, through the model's own modules and
    ``apply_rotary_pos_emb``. Shapes: the residual stream ``[B, hidden]``; q, k ``[B, heads, head_dim]``."""

    def __init__(self, head_dim: int, fused: bool):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        self.fused, self.fused_rotary = fused, fused and head_dim & (head_dim - 1) == 0
        self.apply_rotary = apply_rotary_pos_emb
        if fused:
            from zipkv.kernels import fused_ops
            self.kernels = fused_ops

    def add_norm(self, h, delta, norm):
        """``(h + delta, norm(h + delta))`` (delta None: no add)."""
        if self.fused and type(norm).__name__ in RMS_NORMS:
            return self.kernels.add_rms_norm(h, delta, norm.weight, norm.variance_epsilon)
        h = h if delta is None else h + delta
        return h, norm(h[:, None])[:, 0]

    def rotary(self, q, k, cos, sin):
        """Rotated ``(q, k)``, q contiguous."""
        if self.fused_rotary:
            return self.kernels.rotary(q.contiguous(), k.contiguous(), cos, sin)
        q, k = self.apply_rotary(q, k, cos, sin, unsqueeze_dim=1)
        return q.contiguous(), k

    def mlp(self, mlp, x):
        """The MLP block's output for the normed stream ``x`` ``[B, hidden]``."""
        if self.fused and type(mlp).__name__ in GATED_SILU_MLPS \
                and type(mlp.act_fn).__name__ in ("SiLU", "SiLUActivation"):
            return mlp.down_proj(self.kernels.silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))
        return mlp(x[:, None])[:, 0]


class StepGraph:
    """The whole decode step captured in a CUDA graph, one per batch composition (ZipFusion §IV-A: the
    framework runs use CUDA graphs). The step reads its inputs from a static buffer ``[4, batch]`` (tokens,
    positions, page and in-page offset of the new token; ``[8, batch]`` with the sampling rows of
    :meth:`StepRunner.decode_forward`) and writes the next tokens into a static output;
    everything else it reads -- pool, descriptors, page kinds, the static page table, restore payloads and
    buffer -- stays in place for the composition. The composition's first step runs eagerly (it compiles
    the kernels and warms up the allocator), the second is captured and replayed, the rest replayed.
    Without CUDA (or ``enabled=False``) every step runs eagerly through the same function."""

    def __init__(self, step, device, enabled: bool):
        self.step, self.device, self.enabled = step, device, enabled and device.type == "cuda"
        self.key = self.graph = self.failed = None

    def replays(self, key) -> bool:
        """Whether the next :meth:`run` of composition ``key`` only launches (a graph replay, or an eager step
        without graphs): no warm-up and no capture, which synchronise."""
        return not self.enabled or (key == self.key and self.graph is not None)

    def run(self, key, host_inputs: torch.Tensor, carry=None):
        """Launch the step on ``host_inputs`` (CPU int64 ``[4, batch]``, or ``[8, batch]`` with the sampling rows).
        carry: ``(tokens, src)`` -- the tokens of a step still in flight (device int64) and, per row, the index there
        of the row's input token, or -1 to keep ``host_inputs``' (CPU int64 ``[batch]``): the overlapped engine feeds
        a step the tokens of the one before it on the device, before the host has them.
        Returns ``(next tokens on the device, mode, capture seconds)``, mode ``"warmup"`` (a composition's
        first step, eager, before its capture), ``"capture"``, ``"replay"`` or ``"eager"`` (no graphs)."""
        if key != self.key or self.inp.shape != host_inputs.shape:
            self.key, self.graph, self.warm = key, None, False
            self.inp = torch.empty(host_inputs.shape, dtype=torch.int64, device=self.device)
            self.out = torch.empty(host_inputs.shape[1], dtype=torch.int64, device=self.device)
        copy_to_device(self.inp, host_inputs)
        if carry is not None:
            tokens, src = carry
            src = to_device(src, self.device)
            self.inp[0] = torch.where(src >= 0, tokens[src.clamp(min=0)], self.inp[0])
        if not self.enabled or not self.warm:
            mode = "eager" if not self.enabled else "warmup"
            self.warm = True
            self.out.copy_(self.step(self.inp))
            return self.out, mode, 0.0
        mode, capture_s = "replay", 0.0
        if self.graph is None:
            t0 = time.perf_counter()
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    self.out.copy_(self.step(self.inp))
            except Exception as err:         # a step that cannot be captured still runs, eagerly, and says so
                import warnings
                failed_s = time.perf_counter() - t0
                warnings.warn(f"CUDA graph capture of the decode step failed ({type(err).__name__}: {err}); "
                              f"running eagerly from now on")
                torch.cuda.synchronize(self.device)
                self.enabled, self.failed = False, f"{type(err).__name__}: {err}"
                self.out.copy_(self.step(self.inp))
                return self.out, "warmup", failed_s
            self.graph, mode, capture_s = graph, "capture", time.perf_counter() - t0
        self.graph.replay()
        return self.out, mode, capture_s


class StepInFlight:
    """A launched decode step whose tokens the host has not read yet: its rows ``(request, epoch)``, its
    tokens on the device (read by the next step, :meth:`StepGraph.run`'s ``carry``) and their copy to the host,
    queued behind the step (pinned, non-blocking, with an event, on CUDA), its mode and its memory snapshot."""

    def __init__(self, rows, tokens: torch.Tensor, mode: str, capture_s: float, snapshot: dict):
        self.rows, self.tokens, self.mode, self.capture_s, self.snapshot = rows, tokens, mode, capture_s, snapshot
        if tokens.device.type == "cuda":
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = tokens.clone(), None     # the next eager step overwrites ``tokens``

    def read(self) -> list:
        """The step's tokens (waits for this step only, not for steps queued after it)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class StepRunner:
    """The model's side of the engine: prefill, and the decode step launched through its CUDA graph.

    model: a Hugging Face Llama-family ``*ForCausalLM`` in bf16 (:data:`zipkv.engine.DECODE_MODEL_TYPES`). memory: the
    engine's :class:`~zipkv.memory.KVMemory`. attention: ``"kernel"`` or ``"reference"``; static_kinds, restore,
    num_splits: :class:`StepAttention`'s; fused_ops: :class:`StepOps`' ``fused``; cuda_graphs: :class:`StepGraph`'s
    ``enabled``.
    """

    def __init__(self, model, memory: KVMemory, *, attention: str, static_kinds: bool, restore: RestoreBuffer | None,
                 num_splits: int | None, fused_ops: bool, cuda_graphs: bool):
        cfg = model.config
        self.model, self.inner, self.memory = model, model.model, memory
        self.device = next(model.parameters()).device
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.attention = StepAttention(memory, attention, cfg.num_attention_heads, model.model.layers[0].self_attn.scaling,
                                       static_kinds=static_kinds, restore=restore, num_splits=num_splits)
        self.step_ops = StepOps(self.head_dim, fused_ops)
        self.graphs = StepGraph(self.decode_forward, self.device, cuda_graphs)

    def prefill(self, req):
        """Hugging Face forward over request ``req``'s tokens (a :class:`zipkv.scheduler.Request`: prompt and outputs,
        on its prefix): K/V per layer ``[kv_heads, n, head_dim]`` of everything the cache must hold, and the next
        token -- greedy, or drawn as the decode step draws (:func:`zipkv.sampling.sample`) where ``req.sampling``
        is set."""
        from transformers import DynamicCache
        tokens = req.prompt + req.out
        past = DynamicCache()
        start = 0
        if req.prefix is not None:
            for l in range(self.memory.num_layers):
                k, v = req.prefix.layer(l, (self.kv_heads, self.head_dim))
                past.update(k[None].to(self.device, torch.bfloat16), v[None].to(self.device, torch.bfloat16), l)
            start = req.prefix.position
        ids = torch.tensor([tokens], device=self.device)
        pos = torch.arange(start, start + len(tokens), device=self.device)[None]
        with torch.no_grad():
            out = self.model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=1,
                             **{cache_keyword(self.model): past})
        kv = [(layer.keys[0], layer.values[0]) for layer in past.layers]      # the model appended to ``past`` itself
        if req.sampling is None:
            return kv, int(out.logits[0, -1].argmax())
        rows = torch.tensor(req.sampling, device=self.device)[:, None]
        keys, top_k, temperature, top_p = step_inputs(rows)
        return kv, int(sample(out.logits[:, -1], keys, pos[:, -1], temperature, top_k, top_p))

    def decode_forward(self, inp):
        """One new token per running request through every layer. inp int64 ``[4, batch]``: tokens,
        positions, page ids and in-page offsets of the new tokens; ``[8, batch]``: and the sampling rows
        (:func:`zipkv.sampling.step_inputs`). Returns the logits' argmax ``[batch]``, or with the sampling rows
        :func:`zipkv.sampling.sample`'s tokens. Neither syncs nor allocates on the host: it is the step a CUDA graph
        captures."""
        tokens, positions, pages, offsets = inp[:4]
        B, ops = tokens.shape[0], self.step_ops
        h = self.inner.embed_tokens(tokens[:, None])                          # [B, 1, hidden]
        cos, sin = (t[:, 0] for t in self.inner.rotary_emb(h, position_ids=positions[:, None]))   # [B, head_dim]
        h, delta = h[:, 0], None                                              # the residual stream [B, hidden]
        for l, layer in enumerate(self.inner.layers):
            attn = layer.self_attn
            h, x = ops.add_norm(h, delta, layer.input_layernorm)
            q = attn.q_proj(x).view(B, -1, self.head_dim)                     # [B, heads, head_dim]
            k = attn.k_proj(x).view(B, -1, self.head_dim)
            v = attn.v_proj(x).view(B, -1, self.head_dim)
            if hasattr(attn, "q_norm"):                                     # Qwen3-style per-head norms
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = ops.rotary(q, k, cos, sin)
            self.memory.write_tokens(l, pages, offsets, k, v)
            o = self.attention.run(l, q)                                      # [B, Hq, D]
            delta = attn.o_proj(o.reshape(B, -1))
            h, x = ops.add_norm(h, delta, layer.post_attention_layernorm)
            delta = ops.mlp(layer.mlp, x)
        logits = self.model.lm_head(ops.add_norm(h, delta, self.inner.norm)[1])
        if inp.shape[0] == 4:
            return logits.argmax(-1)
        keys, top_k, temperature, top_p = step_inputs(inp[4:4 + SAMPLING_ROWS])
        return sample(logits, keys, positions, temperature, top_k, top_p)

    def plan(self, rids) -> tuple:
        """Bring the attention's page table up to date for the batch ``rids`` (:meth:`StepAttention.plan`): the batch
        composition's key."""
        return self.attention.plan(rids)

    def replays(self, key) -> bool:
        """Whether the next launch of composition ``key`` only launches (:meth:`StepGraph.replays`)."""
        return self.graphs.replays(key)

    def launch(self, key, host_inputs: torch.Tensor, carry=None):
        """Launch the decode step of composition ``key`` on ``host_inputs`` (CPU int64 ``[4, batch]``; ``carry``: see
        :meth:`StepGraph.run`): ``(next tokens on the device, mode, capture seconds)``."""
        with torch.no_grad():
            return self.graphs.run(key, host_inputs, carry)
