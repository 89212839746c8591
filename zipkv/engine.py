"""Batch decoding of a Hugging Face Llama-family model over :mod:`zipkv.memory` and the fused decode
kernel, with an admission scheduler (ZipFusion §III-D, §IV-C).

``Engine(model, kv_budget_bytes=...).generate(list_of_prompt_ids, max_new_tokens)`` returns every
request's greedy tokens and the run's statistics (decode tokens/s, batch and memory per step).

One step of the loop (:meth:`Engine.generate`):

1. **Admission** (first come, first served, no skipping -- SGLang's default ``fcfs``): the head of the
   queue is admitted while :meth:`zipkv.memory.KVMemory.can_admit` says its prompt pages plus the
   reservation for its remaining output fit (``reserve_ratio``, default 1: an admitted request always
   reaches its output length), and the batch is below ``max_batch``. Each admitted request is prefilled
   at once with the model's own forward (any correct attention: Hugging Face's, batch 1, on top of its
   prefix if it has one), its first token taken greedily from the prompt's last logits, its KV written
   raw into its pages, and its full pages compressed (nothing reads them yet), so the next admission
   sees the room compression freed.
2. **Decode step** for every running request: a slot for the new token (:meth:`~zipkv.memory.KVMemory.alloc`;
   when there is none, a request is retracted in SGLang's ``retract_decode`` order and requeued with
   the tokens it has, to be prefilled again), then the model layer by layer: projections, RoPE at each
   request's *position*, the new K/V written into its page at the cache's end, attention through
   :class:`_Attention`, MLP; greedy next token.
3. **After the step**, the pages the step filled are compressed (``compress=True``: the step's reads are
   done) and pending chunks return to the shared pool; finished requests free their pages.

A request's **cache length** (pairs stored) is kept apart from its **position** (tokens it stands for):
a :class:`Prefix` distilled by KVSculpt holds ``k + m`` pairs for ``N`` tokens; its prompt and outputs
continue at position ``N``.

:class:`_Attention` is the only place that calls into ``zipkv.kernels``: the plan/run API of
``zipkv.kernels.decode_attention`` (a plan per layer, kept while the batch's pages stay the same),
``decode_attention_reference`` and the Triton pack kernel. On the GPU the fused kernel runs; on the CPU
the torch reference (``attention="reference"``). CUDA graphs: not captured yet. What a capture needs is
in place for attention (``DecodePlan.run`` neither syncs nor allocates with ``out`` given, and stays valid
as pages fill and compress); the step around it is not yet static -- token slots, positions and the page
table are rebuilt on the host per step, and the batch changes as requests come and go.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from zipkv import format as fmt
from zipkv.memory import KVMemory

__all__ = ["Engine", "Prefix", "GenerateResult"]


@dataclass
class Prefix:
    """KV a request starts from instead of prompt tokens (e.g. a KVSculpt-distilled context).

    kv: per layer ``(keys, values)``, bf16 ``[kv_heads, length, head_dim]``, post-RoPE -- a list, or a
    function ``layer -> (keys, values)`` (built on demand, for large benchmarks). length: pairs stored
    (the cache length). n_tokens: tokens they stand for (the position the prompt continues at;
    default ``length``).
    """
    kv: object
    length: int
    n_tokens: int | None = None

    def layer(self, l):
        return self.kv(l) if callable(self.kv) else self.kv[l]

    @property
    def position(self) -> int:
        return self.length if self.n_tokens is None else self.n_tokens


@dataclass
class GenerateResult:
    """outputs: each request's generated token ids; stats: see :meth:`Engine.generate`."""
    outputs: list
    stats: dict


@dataclass
class _Running:
    rid: int
    prompt: list
    prefix: Prefix | None
    max_new: int
    out: list = field(default_factory=list)
    position: int = 0                 # position of the next token to feed


class _Attention:
    """The engine's one adapter onto ``zipkv.kernels``: per-layer caches over the memory's pool, the kernels'
    plan/run split -- one :func:`zipkv.kernels.decode_attention.plan` per layer, made again only when the
    batch's page table changes (a new token in a request's last page only raises ``last_page_len``, in
    place) -- and the pack kernel. Pages compressed between steps keep the plans valid: their descriptors
    and page kinds change in place and the plans route on the device (``routing="device"``); a cache that
    is never compressed (``static_kinds``) keeps the kernels' single specialised launch."""

    def __init__(self, memory: KVMemory, backend: str, q_heads: int, scale: float, static_kinds: bool):
        from zipkv.paged import PagedKVCache
        self.memory, self.backend, self.q_heads, self.scale = memory, backend, q_heads, scale
        pool = memory.pool[: memory.total_bytes]
        self.caches = [PagedKVCache(pool, d, memory.head_dim, *memory.layouts) for d in memory.desc]
        self.static_kinds = static_kinds
        self.versions = [-1] * memory.num_layers
        self.key = self.table = self.plans = None

    @staticmethod
    def pack_slots(backend):
        """The Triton pack kernel compressing raw slots in place (``backend="kernel"``; on the CPU under
        ``TRITON_INTERPRET=1``), or None: the memory's torch reference."""
        if backend != "kernel":
            return None
        from zipkv.kernels.pack import pack_into

        def pack(pool, off, head_dim, layout):
            return pack_into(pool, off, pool, off, head_dim, layout, src_packed=True, validate=False)
        return pack

    def plan(self, rids):
        for l, c in enumerate(self.caches):
            if self.versions[l] != self.memory.version[l]:
                if not self.static_kinds:
                    c.refresh()                                     # page kinds recomputed in place
                self.versions[l] = self.memory.version[l]
        lens = [self.memory.cache_len(r) for r in rids]
        key = (tuple(self.memory.requests[r].serial for r in rids),            # a re-admitted request is new
               tuple((n + fmt.PAGE_TOKENS - 1) // fmt.PAGE_TOKENS for n in lens))
        if key == self.key:                                         # same pages: only last_page_len moves
            last = [n - fmt.PAGE_TOKENS * (p - 1) for n, p in zip(lens, key[1])]
            self.table[2].copy_(torch.tensor(last, dtype=torch.int32))
            return
        self.key, self.table = key, self.memory.page_table(rids)
        if self.backend == "kernel":
            from zipkv.kernels.decode_attention import plan
            routing = "auto" if self.static_kinds else "device"
            self.plans = [plan(*self.table, c, self.q_heads, softmax_scale=self.scale, validate=False, routing=routing)
                          for c in self.caches]

    def run(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q bf16 ``[batch, q_heads, head_dim]`` -> bf16 attention output, same shape."""
        if self.backend == "reference":
            from zipkv.kernels.reference import decode_attention_reference
            return decode_attention_reference(q, self.caches[layer], *self.table, softmax_scale=self.scale).to(q.dtype)
        return self.plans[layer].run(q.contiguous())


def _eos_ids(model, eos_token_id):
    if eos_token_id == "model":
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return set()
    return {int(x) for x in (eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id])}


class Engine:
    """Batch greedy decoding of ``model`` (a Hugging Face Llama-family ``*ForCausalLM`` in bf16) within
    ``kv_budget_bytes`` of KV memory.

    compress: ``"all"`` (or True: prompt pages after prefill and every page the decode fills, after the
    reads of its step), ``"prompt"`` (prompt and prefix pages only, new KV stays raw: ZipFusion's
    throughput setup, §IV-A) or ``"none"`` (or False: the uncompressed baseline). attention:
    ``"kernel"`` (fused decode kernel), ``"reference"`` (fp32 torch reference) or ``"auto"`` (kernel on
    CUDA, reference elsewhere). k_layout / v_layout: block arrangements of the cache (``zipkv.format``).
    pages_per_chunk, reserve_ratio: see :class:`zipkv.memory.KVMemory`. max_batch: cap on running
    requests. eos_token_id: stop token(s), ``"model"`` (the model's generation config, like
    ``model.generate``) or None (always ``max_new_tokens``).
    """

    def __init__(self, model, kv_budget_bytes: int, *, compress="all", attention: str = "auto",
                 k_layout: str = "token", v_layout: str = "token", pages_per_chunk: int = 16,
                 reserve_ratio: float = 1.0, max_batch: int | None = None, eos_token_id="model"):
        cfg = model.config
        self.model, self.inner = model, model.model
        self.device = next(model.parameters()).device
        if next(model.parameters()).dtype != torch.bfloat16:
            raise TypeError(f"model must be in torch.bfloat16 (the KV format is BF16), got {next(model.parameters()).dtype}")
        if attention not in ("auto", "kernel", "reference"):
            raise ValueError(f"attention must be 'auto', 'kernel' or 'reference', got {attention!r}")
        if attention == "auto":
            attention = "kernel" if self.device.type == "cuda" else "reference"
        if not 0.0 < reserve_ratio <= 1.0:
            raise ValueError(f"reserve_ratio must lie in (0, 1], got {reserve_ratio!r}")
        compress = {True: "all", False: "none"}.get(compress, compress)
        if compress not in ("all", "prompt", "none"):
            raise ValueError(f"compress must be 'all', 'prompt', 'none' or a bool, got {compress!r}")
        if max_batch is not None and (not isinstance(max_batch, int) or max_batch < 1):
            raise ValueError(f"max_batch must be a positive int or None, got {max_batch!r}")
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.q_heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.memory = KVMemory(cfg.num_hidden_layers, self.kv_heads, self.head_dim, kv_budget_bytes,
                               pages_per_chunk=pages_per_chunk, k_layout=k_layout, v_layout=v_layout,
                               device=self.device, pack_slots=_Attention.pack_slots(attention))
        self.attention = _Attention(self.memory, attention, self.q_heads, model.model.layers[0].self_attn.scaling,
                                    static_kinds=compress == "none")
        self.compress, self.reserve_ratio, self.max_batch = compress, reserve_ratio, max_batch
        self.eos = _eos_ids(model, eos_token_id)

    # ------------------------------------------------------------------ model pieces

    def _prefill(self, req: _Running):
        """Hugging Face forward over the request's tokens (on its prefix): K/V per layer ``[H, n, D]`` of
        everything the cache must hold, and the greedy next token."""
        from transformers import DynamicCache
        tokens = req.prompt + req.out
        past = DynamicCache()
        start = 0
        if req.prefix is not None:
            for l in range(self.memory.num_layers):
                k, v = req.prefix.layer(l)
                past.update(k[None].to(self.device, torch.bfloat16), v[None].to(self.device, torch.bfloat16), l)
            start = req.prefix.position
        ids = torch.tensor([tokens], device=self.device)
        pos = torch.arange(start, start + len(tokens), device=self.device)[None]
        with torch.no_grad():
            out = self.model(input_ids=ids, position_ids=pos, past_key_values=past, use_cache=True, logits_to_keep=1)
        kv = [(layer.keys[0], layer.values[0]) for layer in out.past_key_values.layers]
        return kv, int(out.logits[0, -1].argmax())

    def _decode_forward(self, tokens, positions, pages, offsets):
        """One new token per running request through every layer: logits' argmax ``[batch]``."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        B = tokens.shape[0]
        h = self.inner.embed_tokens(tokens[:, None])                          # [B, 1, hidden]
        cos, sin = self.inner.rotary_emb(h, position_ids=positions[:, None])
        for l, layer in enumerate(self.inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(B, 1, -1, self.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(B, 1, -1, self.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(B, 1, -1, self.head_dim).transpose(1, 2)
            if hasattr(attn, "q_norm"):                                     # Qwen3-style per-head norms
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            self.memory.write_tokens(l, pages, offsets, k[:, :, 0], v[:, :, 0])
            o = self.attention.run(l, q[:, :, 0].contiguous())                 # [B, Hq, D]
            h = h + attn.o_proj(o.reshape(B, 1, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(self.inner.norm(h[:, -1])).argmax(-1)

    # ------------------------------------------------------------------ scheduling

    def _validate(self, prompts, max_new_tokens, prefixes):
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError(f"prompts must be a non-empty list of token-id lists, got {type(prompts).__name__}")
        if prefixes is not None and len(prefixes) != len(prompts):
            raise ValueError(f"prefixes must hold one entry (or None) per prompt: {len(prefixes)} for {len(prompts)} prompts")
        out = []
        for i, p in enumerate(prompts):
            ids = p.tolist() if isinstance(p, torch.Tensor) else list(p)
            if not ids:
                raise ValueError(f"prompts[{i}] is empty: a request needs at least one prompt token")
            if any(not isinstance(t, int) or not 0 <= t < self.model.config.vocab_size for t in ids):
                raise ValueError(f"prompts[{i}] must hold token ids in [0, {self.model.config.vocab_size})")
            pre = prefixes[i] if prefixes is not None else None
            cached = len(ids) + (pre.length if pre is not None else 0)
            self.memory._check_new(None, cached, max_new_tokens, self.reserve_ratio)   # never fits: ValueError
            out.append(_Running(i, ids, pre, max_new_tokens))
        return out

    def _admit(self, req: _Running) -> bool:
        cached = (req.prefix.length if req.prefix is not None else 0) + len(req.prompt) + len(req.out)
        remaining = req.max_new - len(req.out)
        if not self.memory.can_admit(cached, remaining, reserve_ratio=self.reserve_ratio):
            return False
        kv, first = self._prefill(req)
        self.memory.admit(req.rid, cached, remaining, reserve_ratio=self.reserve_ratio)
        for l, (k, v) in enumerate(kv):
            self.memory.write(l, req.rid, 0, k, v)
        req.out.append(first)
        req.position = (req.prefix.position if req.prefix is not None else 0) + len(req.prompt) + len(req.out) - 1
        if self.compress != "none":
            self.memory.compress()                            # nothing reads the prompt's pages yet
        self.memory.keep_raw()
        self.memory.reads_done()
        return True

    def _admit_possible(self, req: _Running) -> bool:
        cached = (req.prefix.length if req.prefix is not None else 0) + len(req.prompt) + len(req.out)
        return self.memory.can_admit(cached, req.max_new - len(req.out), reserve_ratio=self.reserve_ratio)

    def generate(self, prompts, max_new_tokens: int, *, prefixes=None, max_decode_steps: int | None = None,
                 progress: bool | None = None) -> GenerateResult:
        """Greedy generation for every prompt (token-id lists or 1-D tensors).

        prefixes: optional list (one :class:`Prefix` or None per prompt). max_decode_steps: stop after this
        many decode steps (benchmarks; unfinished requests keep the tokens they have). progress: tqdm bar
        (default: on for runs of more than 64 steps' worth of tokens).
        Returns :class:`GenerateResult`: ``outputs`` (list of token lists, in prompt order) and ``stats``:
        ``decode_tokens_per_s`` (tokens produced by decode steps / their wall time; the first token of
        each request comes from its prefill and is not counted), ``decode_seconds``, ``prefill_seconds``,
        ``steps`` (per decode step: ``batch``, ``seconds``, ``used_bytes`` per layer, ``chunks_free``,
        ``reassigned``), ``max_batch``, ``retracted``, ``admitted_at`` (decode steps run before each
        request was first admitted), ``frac_compressed_k`` / ``_v`` (blocks stored
        compressed over the running requests' pages at the first decode step), ``kv_budget_bytes``, ``memory`` (final
        :meth:`KVMemory.stats`).
        """
        waiting = self._validate(prompts, max_new_tokens, prefixes)
        running, done, steps, admitted_at = [], {}, [], {}
        retracted = prefill_s = decode_s = 0.0
        bar = None
        if progress or (progress is None and len(waiting) * max_new_tokens > 64 * 64):
            from tqdm.auto import tqdm
            bar = tqdm(total=len(waiting) * max_new_tokens, desc="generate", unit="tok")
        def retire():
            for r in [r for r in running if len(r.out) >= r.max_new or r.out[-1] in self.eos]:
                running.remove(r)
                done[r.rid] = r.out
                self.memory.free(r.rid)
            self.memory.reads_done()                       # one stream: every read issued so far is ordered

        while waiting or running:
            if max_decode_steps is not None and len(steps) >= max_decode_steps:
                break
            t0 = time.perf_counter()
            while waiting and (self.max_batch is None or len(running) < self.max_batch) and self._admit(waiting[0]):
                running.append(waiting.pop(0))
                admitted_at.setdefault(running[-1].rid, len(steps))
                if bar:
                    bar.update(1)
            prefill_s += time.perf_counter() - t0
            retire()
            if not running:
                if waiting and not self.memory.requests and not self._admit_possible(waiting[0]):
                    raise RuntimeError("generate: a request does not fit an empty memory (internal error)")
                continue
            t0 = time.perf_counter()
            for r in list(running):
                if r not in running:
                    continue
                while self.memory.alloc(r.rid, 1) is None:             # no room: retract by policy
                    victim = self.memory.retract([x.rid for x in running])
                    vr = next(x for x in running if x.rid == victim)
                    running.remove(vr)
                    waiting.insert(0, vr)
                    retracted += 1
                    if vr is r:
                        break
            if not running:
                continue
            rids = [r.rid for r in running]
            if not steps:
                frac = self.memory.compressed_fraction(rids)
            last = [self.memory.cache_len(rid) - 1 for rid in rids]         # the new token's slot
            pages = torch.tensor([self.memory.requests[rid].pages[t // fmt.PAGE_TOKENS] for rid, t in zip(rids, last)],
                                 device=self.device)
            offsets = torch.tensor([t % fmt.PAGE_TOKENS for t in last], device=self.device)
            self.attention.plan(rids)
            tokens = torch.tensor([r.out[-1] for r in running], device=self.device)
            positions = torch.tensor([r.position for r in running], device=self.device)
            with torch.no_grad():
                nxt = self._decode_forward(tokens, positions, pages, offsets).tolist()
            for r, t in zip(running, nxt):
                r.out.append(t)
                r.position += 1
            if self.compress == "all":
                self.memory.compress()                      # the pages this step filled: its reads are done
            self.memory.keep_raw()
            batch = len(running)
            dt = time.perf_counter() - t0                   # the step ends with its tokens on the host
            decode_s += dt
            st = self.memory.snapshot()                     # during the step, before finished requests leave
            retire()
            steps.append(dict(batch=batch, seconds=dt, used_bytes=st["used_bytes"],
                              chunks_free=st["chunks_free"], reassigned=st["reassigned"]))
            if bar:
                bar.update(batch)
        if bar:
            bar.close()
        for r in running + waiting:
            done.setdefault(r.rid, r.out)
        n_decoded = sum(s["batch"] for s in steps)
        frac = frac if steps else (float("nan"), float("nan"))
        stats = dict(frac_compressed_k=frac[0], frac_compressed_v=frac[1], decode_tokens_per_s=n_decoded / decode_s if decode_s else float("nan"),
                     decode_seconds=decode_s, prefill_seconds=prefill_s, steps=steps,
                     max_batch=max((s["batch"] for s in steps), default=0), retracted=int(retracted),
                     admitted_at=[admitted_at.get(i) for i in range(len(prompts))],
                     kv_budget_bytes=self.memory.total_bytes, memory=self.memory.stats())
        return GenerateResult([done[i] for i in range(len(prompts))], stats)

    def page_bytes(self) -> int:
        """Bytes of one uncompressed logical page over all layers (16 tokens of K and V)."""
        return self.memory.num_layers * self.memory.page_bytes


def kv_budget_for(model_config, requests: int, tokens_per_request: int, *, pages_per_chunk: int = 16) -> int:
    """The smallest KV budget (bytes) whose uncompressed capacity holds ``requests`` requests of
    ``tokens_per_request`` cached tokens each, in whole chunks per layer (rounding up to a chunk can make
    room for more requests when a request is smaller than a chunk; the engine measures its largest batch)."""
    H = model_config.num_key_value_heads
    D = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    layers = model_config.num_hidden_layers
    page = 2 * H * fmt.page_bytes(D)
    pages = requests * math.ceil(tokens_per_request / fmt.PAGE_TOKENS)
    return layers * math.ceil(pages / pages_per_chunk) * pages_per_chunk * page
