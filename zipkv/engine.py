"""Batch decoding of a Hugging Face Llama-family model over :mod:`zipkv.memory` and the fused decode
kernel, with an admission scheduler (ZipFusion §III-D, §IV-C).

The engine wires three parts with the seams SGLang and vLLM v1 have: the **scheduler** (:mod:`zipkv.scheduler`:
admission order, retraction choice, requeue -- policy, no tensors), the **step runner** (:mod:`zipkv.runner`: prefill,
the decode step through the kernels' plan/run and its CUDA graph, the fused ops) and the **memory manager**
(:mod:`zipkv.memory`: chunks, pages, compression, capacity and reservations). :class:`Engine` holds the loop below
and the admission paths that move a request's KV between the runner and the memory.

``Engine(model, kv_budget_bytes=...).generate(list_of_prompt_ids, max_new_tokens)`` returns every
request's greedy tokens and the run's statistics (decode tokens/s, batch and memory per step). ``temperature``,
``top_p``, ``top_k`` and ``seed`` sample instead (or a :class:`~zipkv.sampling.SamplingParams` per request), ``stop``
strings and ``stop_token_ids`` end requests early, ``Engine(..., tokenizer=tok)`` takes strings and gives texts, and
:meth:`Engine.stream` gives the tokens as the steps are read.

One step of the loop (:meth:`Engine.generate`):

1. **Admission** (the scheduler's first come, first served, no skipping -- SGLang's default ``fcfs``): the head
   of the queue is admitted while its prompt pages plus the reservation for its remaining output fit
   (``reserve_ratio``, default 1: an admitted request always reaches its output length), and the batch is
   below ``max_batch``. Each admitted request is prefilled with the model's own forward (any correct
   attention: Hugging Face's, batch 1, on top of its prefix if it has one) and its first token taken
   from the prompt's last logits, as the decode step takes the others. Uncompressed: its KV is written raw
   (:meth:`zipkv.memory.KVMemory.admit`). Compressed: its full pages are packed first and admitted at their
   packed size (:meth:`~zipkv.memory.KVMemory.admit_packed`: a pre-compressed prefix never needs its raw
   size in memory), the last, partial page raw; a request that does not fit yet keeps its packed pages
   while it waits. A request whose raw pages fit where its packed ones do not (packed pages need compressed chunks,
   whole chunks of the pool) is admitted raw, its full pages then compressed in place (``stats["admitted_raw"]``).
2. **Decode step** for every running request: a slot for the new token (:meth:`~zipkv.memory.KVMemory.alloc`;
   when there is none, the scheduler picks a request to retract in SGLang's ``retract_decode`` order, and it is
   freed and requeued with the tokens it has, to be prefilled again), then the model layer by layer: projections, RoPE at each
   request's *position*, the new K/V written into its page at the cache's end, attention through
   :class:`~zipkv.runner.StepAttention`, MLP; the next token, greedy or sampled (:func:`zipkv.sampling.sample`: the
   same function in the prefill and in the step, per row, its noise hashed from the request's seed and position, so a
   request's tokens depend neither on the requests beside it, nor on retraction, nor on overlap). The host reads the
   tokens, and checks stop tokens and stop strings (:class:`zipkv.sampling.TextStream`).
3. **After the step**, the pages the step filled are compressed (``compress=True``: the step's reads are
   done) and pending chunks return to the shared pool; finished requests free their pages.

**Overlap** (``overlap=True``, the default; SGLang's overlap scheduler): step n + 1 is prepared and launched
before the host reads step n's tokens -- its input tokens come from step n's output on the device, its page
table and slots are host bookkeeping, and every host-to-device copy is non-blocking -- so that host work and
graph launch hide behind the GPU's step. The host then reads step n's tokens (an event behind step n, not a
device sync). A step that needs a warm-up or a capture first drains the pipeline. Everything the two steps
share is ordered on one stream: pages freed while a step is in flight are written again only by later work.

A request's **cache length** (pairs stored) is kept apart from its **position** (tokens it stands for):
a :class:`Prefix` distilled by KVSculpt holds ``k + m`` pairs for ``N`` tokens; its prompt and outputs
continue at position ``N``.

:class:`~zipkv.runner.StepAttention` is the only place that calls into the attention kernels: the plan/run API of
``zipkv.kernels.decode_attention`` (a plan per layer and batch composition, over a static page table updated in
place), ``decode_attention_reference`` and the Triton pack kernel. On the GPU the fused kernel runs; on the CPU
the torch reference (``attention="reference"``). **CUDA graphs** (:class:`~zipkv.runner.StepGraph`): the whole decode step --
embeddings, every layer's projections, KV writes, (restores,) attention and MLP, the greedy argmax or the sampler --
reads its per-step inputs (the sampling parameters among them, one column per request) from one static device buffer
and is captured once per batch composition, then replayed; the host only copies tokens, positions and slots in,
updates the page table in place and reads the tokens back. The step's norms, rotary embedding and gated MLP product
run as one kernel each on the GPU (:class:`~zipkv.runner.StepOps`).

**Restore-before-attention baselines** (``restore=codec``, :class:`~zipkv.runner.RestoreBuffer`): the same loop, with each
request's prefix pages kept as a :mod:`zipkv.codecs` payload and decoded per layer into one shared restore buffer
before attention (ZipFusion §II-B's setting), its bytes counted in the same budget.

**What is checked**: bad requests are refused before anything is allocated; the pages themselves are not checked while
they serve -- the step plans with ``validate=False`` and a request's packed prefix goes from the packer to the pool
without checksums -- so a bit flipped in the pool (payload or descriptors) is not detected. Pages copied out of the
engine's memory for offload or transfer carry check bytes and CRC-32s (:meth:`zipkv.memory.KVMemory.export`, verified
by :meth:`~zipkv.memory.KVMemory.admit_packed`; :mod:`zipkv.memory`'s "Pages that leave the pool").
"""
from __future__ import annotations

import collections
import collections.abc
import math
import numbers
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from zipkv import format as fmt
from zipkv.memory import KVMemory
from zipkv.paged import check_layouts
from zipkv.runner import RestoreBuffer, StepAttention, StepInFlight, StepRunner
from zipkv.sampling import SamplingParams, TextStream, stream_key
from zipkv.scheduler import Request, Scheduler

__all__ = ["Engine", "Prefix", "GenerateResult", "StreamOutput", "SamplingParams", "DECODE_MODEL_TYPES",
           "kv_budget_for"]


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

    @classmethod
    def from_cache(cls, cache) -> "Prefix":
        """The pairs of a :class:`zipkv.cache.DistilledCache` (``zipkv.compress``'s, before anything is appended), standing
        for its ``n_context`` tokens: the engine serves them as a request's start, its prompt (the tokens after the
        context) continuing at position ``n_context``. The engine's pages hold one number of pairs for every layer and
        KV head and its attention adds no logit bias, so a cache with adaptive budgets (``budget="pilot"``), with a
        bias (Attention Matching), with pairs per sequence or with appended tokens is a ``ValueError``."""
        from zipkv.cache import DistilledCache
        if not isinstance(cache, DistilledCache):
            raise TypeError(f"cache must be a zipkv.cache.DistilledCache, got {type(cache).__name__}")
        if cache.get_seq_length():
            raise ValueError(f"cache holds {cache.get_seq_length()} appended tokens: call cache.reset() first")
        lengths = cache.lengths
        if lengths.ndim != 2:
            raise ValueError("cache holds pairs per sequence: a Prefix is one context")
        if bool((lengths != lengths[0, 0]).any()):
            raise ValueError(f"cache keeps {lengths.min().item()}-{lengths.max().item()} pairs per layer and KV head: the "
                             "engine's pages need one number for all (compress with budget='uniform')")
        kv = []
        for l, layer in enumerate(cache.layers):
            if bool((layer.bias[layer.valid] != 0).any()):
                raise ValueError(f"cache layer {l} adds a logit bias to its pairs: the engine's attention has none")
            keep = layer.valid                                                   # [H, P], the same count per head
            H, D = keep.shape[0], layer.keys.shape[-1]
            kv.append((layer.keys[0, :, :layer.cached][keep].view(H, -1, D),
                       layer.values[0, :, :layer.cached][keep].view(H, -1, D)))
        return cls(kv, int(lengths[0, 0]), n_tokens=cache.n_context)

    def layer(self, l, shape: tuple | None = None):
        """Layer ``l``'s ``(keys, values)``; with ``shape`` (``(kv_heads, head_dim)``), a ``ValueError`` unless each is
        ``[kv_heads, length, head_dim]``."""
        kv = self.kv(l) if callable(self.kv) else self.kv[l]
        if shape is not None:
            want = (shape[0], self.length, shape[1])
            pair = kv if isinstance(kv, (tuple, list)) else [kv]
            got = [tuple(getattr(t, "shape", ())) for t in pair]
            if len(got) != 2 or any(g != want for g in got):
                raise ValueError(f"prefix layer {l}: expected (keys, values) of shape {list(want)} each "
                                 f"([kv_heads, length, head_dim]), got shapes {got}")
            kinds = [f"{type(t).__name__} {getattr(t, 'dtype', '')}".strip() for t in pair]
            if not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in pair):
                raise TypeError(f"prefix layer {l}: expected (keys, values) as floating-point torch tensors "
                                f"(bf16, as the cache stores them), got {kinds}")
        return kv

    def check(self, name: str, num_layers: int, kv_heads: int, head_dim: int):
        """A ``TypeError`` / ``ValueError`` naming ``name`` for a prefix the engine cannot serve: lengths that are not
        positive ints, or (``kv`` a list) another number of layers or a layer not ``[kv_heads, length, head_dim]``. A
        function ``kv`` is checked per layer as it is built (:meth:`layer` with ``shape``)."""
        if self.length is None or not _is_int(self.length) or self.length < 1:
            raise ValueError(f"{name}.length must be an int >= 1 (pairs stored), got {self.length!r}")
        if self.n_tokens is not None and (not _is_int(self.n_tokens) or self.n_tokens < 1):
            raise ValueError(f"{name}.n_tokens must be None or an int >= 1 (tokens the pairs stand for), "
                             f"got {self.n_tokens!r}")
        self.length, self.n_tokens = int(self.length), None if self.n_tokens is None else int(self.n_tokens)
        if callable(self.kv):
            return
        if not isinstance(self.kv, (list, tuple)) or len(self.kv) != num_layers:
            raise ValueError(f"{name}.kv must hold one (keys, values) per layer: {num_layers} layers, got "
                             f"{len(self.kv) if isinstance(self.kv, (list, tuple)) else type(self.kv).__name__}")
        for l in range(num_layers):
            try:
                self.layer(l, (kv_heads, head_dim))
            except (TypeError, ValueError) as err:
                raise type(err)(f"{name}: {err}") from None

    @property
    def position(self) -> int:
        return self.length if self.n_tokens is None else self.n_tokens


@dataclass
class GenerateResult:
    """outputs: each request's generated token ids; stats: see :meth:`Engine.generate`; texts: each request's text
    where the engine has a tokenizer, else None."""
    outputs: list
    stats: dict
    texts: list | None = None


class StreamOutput(NamedTuple):
    """What :meth:`Engine.stream` gives out: request ``index`` (among the prompts) has ``token_ids`` more tokens and
    ``text`` more text (None without a tokenizer); ``finished``: its last delta."""
    index: int
    token_ids: list
    text: str | None
    finished: bool


DECODE_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma")
"""``config.model_type`` of the models whose decoder layer :meth:`zipkv.runner.StepRunner.decode_forward` computes exactly as the model's
own forward does (pre-norm residual blocks, full-width RoPE, softmax(q·k·scaling) attention, no logit or residual
multipliers; Qwen 3's per-head q/k norms; Mixtral's expert MLP); ``tests/test_engine.py`` checks each against
``model.generate``. Others (Gemma 2 / 3, Granite, OLMo 2, Phi-3, StableLM, ...) are refused: their prefill would
run the model's own forward but their decode steps a different layer."""


def _is_int(x) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _decode_window(model) -> int | None:
    """The smallest sliding attention window of ``model``'s layers (:func:`zipkv.models.sliding_windows`), or None
    where every layer attends to the whole cache."""
    from zipkv.models import sliding_windows
    return min((w for w in sliding_windows(model) if w is not None), default=None)


def _check_model(model):
    """Refuse, before anything is allocated, a model whose decode step the engine would compute wrongly."""
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in DECODE_MODEL_TYPES or not hasattr(model, "model") or not hasattr(model, "lm_head"):
        raise ValueError(f"model: the engine's decode step computes the Llama-family decoder layer of model types "
                         f"{DECODE_MODEL_TYPES}; got {type(model).__name__} (model_type {kind!r}), whose layers "
                         f"differ (its decode steps would not be the model's)")
    dtype = next(model.parameters()).dtype
    if dtype != torch.bfloat16:
        raise TypeError(f"model must be in torch.bfloat16 (the KV format is BF16), got {dtype}: load it with "
                        f"zipkv.load_model(dtype=torch.bfloat16), or convert it with model.to(torch.bfloat16)")


def _eos_ids(model, eos_token_id):
    """The stop tokens of ``eos_token_id`` (:class:`Engine`'s argument) as a set of ids in the vocabulary."""
    if isinstance(eos_token_id, str) and eos_token_id == "model":
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        return set() if eos is None else {int(t) for t in (eos if isinstance(eos, (list, tuple)) else [eos])}
    if eos_token_id is None:
        return set()
    ids = list(eos_token_id) if isinstance(eos_token_id, (list, tuple, set)) else [eos_token_id]
    vocab = model.config.vocab_size
    bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab), None)
    if bad is not None or not ids:
        raise ValueError(f"eos_token_id must be 'model', None, or token ids in [0, {vocab}) (an int or a list), "
                         f"got {eos_token_id!r}")
    return {int(t) for t in ids}


def default_layouts(attention: str, device, restore, head_dim: int, group: int) -> tuple[str, str]:
    """The cache layouts ``k_layout="auto"`` / ``v_layout="auto"`` choose: the mma layouts (``k_mma``, ``v_mma``) under
    the fused kernel on CUDA at a head_dim and GQA group the Gluon kernel takes (``zipkv.format.MMA_HEAD_DIMS``,
    ``decode_mma.MAX_GROUP``), compressed or not -- its pipelined path reads compressed and mixed pages faster than the
    Triton kernel reads token-layout ones, and raw pages as fast or faster ("Decode attention latency", the
    uncompressed rows of both kernels), and one kernel for both means that compressing changes no token at the same
    split count ("The lossless format"); the token layouts otherwise (the torch reference, other shapes, and the
    restore baselines, which restore into raw token-layout pages)."""
    if attention != "kernel" or torch.device(device).type != "cuda" or restore is not None:
        return ("token", "token")
    from zipkv.kernels import decode_mma
    if head_dim in fmt.MMA_HEAD_DIMS and group <= decode_mma.MAX_GROUP[head_dim]:
        return ("k_mma", "v_mma")
    return ("token", "token")


class Engine:
    """Batch decoding, greedy or sampled, of ``model`` (a Hugging Face Llama-family ``*ForCausalLM`` in bf16, one of
    :data:`DECODE_MODEL_TYPES`; others, and requests that reach past a sliding window, are refused) within
    ``kv_budget_bytes`` of KV memory.

    compress: ``"all"`` (or True: prompt pages after prefill and every page the decode fills, after the
    reads of its step), ``"prompt"`` (prompt and prefix pages only, new KV stays raw: ZipFusion's
    throughput setup, §IV-A) or ``"none"`` (or False: the uncompressed baseline). restore: a codec of
    :mod:`zipkv.codecs` (``SplitZip`` / ``Huffman`` instance): the restore-before-attention baseline
    (:class:`~zipkv.runner.RestoreBuffer`; needs ``compress="prompt"``, the codec compressing the prefix, the token layouts);
    restore_buffer_pages: raw pages of one layer in its shared restore buffer, taken out of the budget
    (default: ``budget / (num_layers + 1)``, what a batch of raw prefixes would need). attention:
    ``"kernel"`` (fused decode kernel), ``"reference"`` (fp32 torch reference; restore baselines then use
    the codecs' torch decoders) or ``"auto"`` (kernel on CUDA, reference elsewhere). cuda_graphs: capture
    each batch composition's decode step in a CUDA graph (:class:`~zipkv.runner.StepGraph`; on CUDA only). k_layout /
    v_layout: block arrangements of the cache (``zipkv.format``) or ``"auto"`` (:func:`default_layouts`: the mma
    layouts under the fused kernel where the Gluon kernel takes the shape). pages_per_chunk, reserve_ratio: see
    :class:`zipkv.memory.KVMemory`. max_batch: cap on running requests. num_splits: the decode kernel's split-KV
    factor (default: its plan's choice, :func:`zipkv.kernels.decode_attention.plan`). eos_token_id: stop token(s),
    ``"model"`` (the model's generation config, like ``model.generate``) or None (always
    ``max_new_tokens``). overlap: launch each decode step before reading the tokens of the one before it
    (SGLang's overlap scheduler): the step takes its input tokens from the previous step's output on the device,
    so the host's scheduling, page-table updates and graph launch of step n + 1 run while the GPU computes step
    n; a request that meets its stop token runs one more step, whose token is dropped. False: launch a step,
    wait for its tokens, then prepare the next. fused_ops: the decode step's norms, rotary embedding and
    gated MLP product through one kernel each (:class:`~zipkv.runner.StepOps`, :mod:`zipkv.kernels.fused_ops`) instead of the
    modules' chains of small kernels; None (default): on CUDA; True on the CPU needs ``TRITON_INTERPRET=1``.
    tokenizer: the model's Hugging Face tokenizer: :meth:`generate` and :meth:`stream` then take strings as prompts
    and give texts, and ``stop`` strings can be used. pool, admission: the memory manager's ablation options
    (:class:`zipkv.memory.KVMemory`: ``pool="per_layer"``, ``admission="uncompressed"``; the defaults are ZipFusion's).
    block_format: how compressed pages are stored: ``"zipfusion"`` (§III-B: a block whose exponents do not fit its
    window stays raw) or ``"escape"`` (:mod:`zipkv.escape`: every block compressed, the few values outside the window
    in a per-page escape list; :mod:`zipkv.memory.escape_pages`), with any ``compress`` mode that compresses.
    :func:`zipkv.serving.serve` serves it a trace of requests arriving over time.
    """

    def __init__(self, model, kv_budget_bytes: int, *, compress="all", attention: str = "auto",
                 k_layout: str = "auto", v_layout: str = "auto", pages_per_chunk: int = 16,
                 reserve_ratio: float = 1.0, max_batch: int | None = None, eos_token_id="model",
                 restore=None, restore_buffer_pages: int | None = None, cuda_graphs: bool = True,
                 num_splits: int | None = None, overlap: bool = True, fused_ops: bool | None = None, tokenizer=None,
                 pool: str = "shared", admission: str = "compressed", block_format: str = "zipfusion"):
        _check_model(model)
        if tokenizer is not None and not (callable(tokenizer) and hasattr(tokenizer, "decode")):
            raise TypeError(f"tokenizer must be a Hugging Face tokenizer (callable, with decode) or None, "
                            f"got {type(tokenizer).__name__}")
        self.tokenizer = tokenizer
        cfg = model.config
        self.model = model
        self.device = next(model.parameters()).device
        self.window = _decode_window(model)
        if attention not in ("auto", "kernel", "reference"):
            raise ValueError(f"attention must be 'auto', 'kernel' or 'reference', got {attention!r}")
        if attention == "auto":
            attention = "kernel" if self.device.type == "cuda" else "reference"
        if attention == "kernel" and self.device.type != "cuda":
            from zipkv.kernels import check_launchable, decode_triton
            check_launchable(decode_triton._decode_kernel, self.device, "attention='kernel': the model")
        if isinstance(reserve_ratio, bool) or not isinstance(reserve_ratio, numbers.Real):
            raise TypeError(f"reserve_ratio must be a number in (0, 1], got {type(reserve_ratio).__name__}")
        if not 0.0 < reserve_ratio <= 1.0:
            raise ValueError(f"reserve_ratio must lie in (0, 1], got {reserve_ratio!r}")
        if isinstance(compress, bool):
            compress = "all" if compress else "none"
        if not isinstance(compress, str) or compress not in ("all", "prompt", "none"):
            raise ValueError(f"compress must be 'all', 'prompt', 'none' or a bool, got {compress!r}")
        if block_format not in ("zipfusion", "escape"):
            raise ValueError(f"block_format must be 'zipfusion' or 'escape', got {block_format!r}")
        if block_format == "escape" and restore is not None:
            raise ValueError("block_format='escape' stores the engine's own pages; a restore baseline (restore=) keeps "
                             "its prefix as a codec payload instead: leave block_format='zipfusion'")
        if not isinstance(cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be a bool, got {type(cuda_graphs).__name__}")
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool, got {type(overlap).__name__}")
        if fused_ops is not None and not isinstance(fused_ops, bool):
            raise TypeError(f"fused_ops must be a bool or None, got {type(fused_ops).__name__}")
        if fused_ops and self.device.type != "cuda":
            from zipkv.kernels import fused_ops as kernels
            if not kernels.launchable(self.device):
                raise ValueError(f"fused_ops=True: the model is on {self.device}, where the Triton kernels run only in "
                                 f"Triton's interpreter (start Python with TRITON_INTERPRET=1), or pass fused_ops=None")
        if max_batch is not None and (not _is_int(max_batch) or max_batch < 1):
            raise ValueError(f"max_batch must be a positive int or None, got {max_batch!r}")
        if num_splits is not None and (not _is_int(num_splits) or num_splits < 1):
            raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
        if _is_int(kv_budget_bytes):
            kv_budget_bytes = int(kv_budget_bytes)
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.q_heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        auto = default_layouts(attention, self.device, restore, self.head_dim, self.q_heads // self.kv_heads)
        k_layout, v_layout = (a if lay == "auto" else lay for lay, a in zip((k_layout, v_layout), auto))
        if attention == "kernel":                     # the decode kernels' pairs, before the first step finds out
            check_layouts(k_layout, v_layout, self.head_dim)
            if block_format == "escape" and (k_layout, v_layout) != fmt.MMA_LAYOUTS:
                raise ValueError(f"block_format='escape' with attention='kernel': escape pages are read by the Gluon "
                                 f"kernel of the mma layouts (k_mma/v_mma, a CUDA GPU), got layouts "
                                 f"{(k_layout, v_layout)}; use attention='reference' on the CPU")
        L = cfg.num_hidden_layers
        buffer_pages, budget = 0, kv_budget_bytes
        if restore is None and restore_buffer_pages is not None:
            raise ValueError(f"restore_buffer_pages={restore_buffer_pages!r} sizes the restore baseline's buffer: it "
                             f"needs restore= (a zipkv.codecs.SplitZip or Huffman codec), or leave it None")
        if restore is not None:
            if not (hasattr(restore, "encode") and getattr(restore, "name", None) in ("splitzip", "huffman")):
                raise TypeError(f"restore must be a zipkv.codecs.SplitZip or Huffman codec, got {type(restore).__name__}")
            if compress != "prompt" or (k_layout, v_layout) != ("token", "token"):
                raise ValueError(f"restore: the codec compresses the prefix and restores raw token-layout pages; "
                                 f"use compress='prompt' and the token layouts, got compress={compress!r}, "
                                 f"layouts {(k_layout, v_layout)}")
            page = 2 * self.kv_heads * fmt.page_bytes(self.head_dim)
            if not _is_int(kv_budget_bytes):
                raise TypeError(f"kv_budget_bytes must be an int, got {type(kv_budget_bytes).__name__}")
            buffer_pages = kv_budget_bytes // ((L + 1) * page) if restore_buffer_pages is None else restore_buffer_pages
            if not _is_int(buffer_pages) or buffer_pages < 1 or buffer_pages * page >= kv_budget_bytes:
                raise ValueError(f"restore_buffer_pages must be an int >= 1 whose pages ({page} bytes each) leave "
                                 f"room in kv_budget_bytes={kv_budget_bytes}, got {restore_buffer_pages!r}")
            buffer_pages = int(buffer_pages)
            budget = kv_budget_bytes - buffer_pages * page
        self.kv_budget_bytes = kv_budget_bytes
        self.memory = KVMemory(L, self.kv_heads, self.head_dim, budget,
                               pages_per_chunk=pages_per_chunk, k_layout=k_layout, v_layout=v_layout,
                               device=self.device, pack_slots=StepAttention.pack_slots(attention, block_format),
                               extra_bytes=buffer_pages * 2 * self.kv_heads * fmt.page_bytes(self.head_dim),
                               extra_pages=buffer_pages, pool=pool, admission=admission, block_format=block_format)
        self.restore = None if restore is None else RestoreBuffer(self.memory, restore, buffer_pages, attention == "reference")
        self.runner = StepRunner(model, self.memory, attention=attention,
                                 static_kinds=compress == "none" or restore is not None, restore=self.restore,
                                 num_splits=num_splits, cuda_graphs=cuda_graphs,
                                 fused_ops=self.device.type == "cuda" if fused_ops is None else fused_ops)
        self.compress = "none" if restore is not None else compress
        self.reserve_ratio, self.max_batch, self.overlap = reserve_ratio, max_batch, overlap
        self.eos = _eos_ids(model, eos_token_id)
        self.admitted_raw = 0     # requests of the last generate admitted raw with compression on (_admit_raw)
        self.busy = False         # a generate or stream call is running (a stream between its deltas included)

    # ------------------------------------------------------------------ requests and admission

    def _validate(self, prompts, max_new_tokens, prefixes):
        if not _is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        max_new_tokens = int(max_new_tokens)
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError(f"prompts must be a non-empty list of token-id lists (or strings, with a tokenizer), "
                             f"got {type(prompts).__name__}")
        if prefixes is not None and not isinstance(prefixes, (list, tuple)):
            raise TypeError(f"prefixes must be a list (one Prefix or None per prompt), got {type(prefixes).__name__}")
        if prefixes is not None and len(prefixes) != len(prompts):
            raise ValueError(f"prefixes must hold one entry (or None) per prompt: {len(prefixes)} for {len(prompts)} prompts")
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise TypeError(f"prompts[{i}] is a str: text prompts need the tokenizer, "
                                    f"Engine(model, ..., tokenizer=tokenizer); or pass token ids")
                p = self.tokenizer(p).input_ids
            if isinstance(p, torch.Tensor) and p.dim() != 1:
                raise ValueError(f"prompts[{i}] must be a 1-D sequence of token ids, got a tensor of shape "
                                 f"{tuple(p.shape)} (one prompt per entry: pass ids[0], not the [1, n] batch)")
            if isinstance(p, (str, bytes, collections.abc.Set, collections.abc.Mapping)) or not hasattr(p, "__iter__"):
                raise TypeError(f"prompts[{i}] must be a sequence of token ids, got {type(p).__name__} (expected a "
                                f"list, tuple or 1-D tensor of ints)")
            ids = p.tolist() if isinstance(p, torch.Tensor) else list(p)
            if not ids:
                raise ValueError(f"prompts[{i}] is empty: a request needs at least one prompt token")
            bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)
                        or not 0 <= t < self.model.config.vocab_size), None)
            if bad is not None:
                raise ValueError(f"prompts[{i}] must hold integer token ids in [0, {self.model.config.vocab_size}), "
                                 f"got {bad!r}")
            ids = [int(t) for t in ids]
            pre = prefixes[i] if prefixes is not None else None
            if pre is not None:
                if not isinstance(pre, Prefix):
                    raise TypeError(f"prefixes[{i}] must be a zipkv.engine.Prefix or None, got {type(pre).__name__}")
                pre.check(f"prefixes[{i}]", self.memory.num_layers, self.kv_heads, self.head_dim)
            cached = len(ids) + (pre.length if pre is not None else 0)
            last = (pre.position if pre is not None else 0) + len(ids) + max_new_tokens - 2   # last position fed
            if self.window is not None and last >= self.window:
                raise ValueError(f"prompts[{i}]: its last decode step queries position {last}, but the model attends "
                                 f"within a sliding window of {self.window} tokens (config.sliding_window) and the "
                                 f"engine to the whole cache: keep prompt + max_new_tokens - 1 <= {self.window}")
            self.memory._check_new(f"prompts[{i}]", cached, max_new_tokens, self.reserve_ratio)   # never fits: ValueError
            if self.restore is not None and (cached - 1) // fmt.PAGE_TOKENS > self.restore.buffer_pages:
                raise ValueError(f"prompts[{i}]: its {cached} cached tokens need {(cached - 1) // fmt.PAGE_TOKENS} pages "
                                 f"of the restore buffer, which holds {self.restore.buffer_pages}")
            out.append(Request(i, ids, pre, max_new_tokens))
        return out

    def _restore_split(self, req: Request):
        """(pages kept as the codec's payload, raw tokens after them) for a restore baseline's request."""
        n = (req.cached - 1) // fmt.PAGE_TOKENS              # every full page but one token stays raw
        return n, req.cached - n * fmt.PAGE_TOKENS

    def _admit(self, req: Request) -> bool:
        """Prefill ``req`` and place its KV in memory if it fits now (else change nothing but what it staged)."""
        cached, remaining = req.cached, req.remaining
        if self.restore is not None:
            return self._admit_restore(req, remaining)
        if self.compress != "none":
            return self._admit_packed(req, cached, remaining) or self._admit_raw(req, cached, remaining)
        return self._admit_raw(req, cached, remaining)

    def _admit_raw(self, req: Request, cached: int, remaining: int) -> bool:
        """Prefill into raw pages (:meth:`zipkv.memory.KVMemory.admit`). With compression on, this is the path of a
        request whose packed pages find no room while its raw pages do (compressed chunks are whole chunks of the pool,
        so a budget of few chunks per layer may hold a request only raw); its full pages are then compressed like
        decode-filled ones: in place, and moved into a compressed chunk once one is free."""
        if not self.memory.can_admit(cached, remaining, reserve_ratio=self.reserve_ratio):
            return False
        req.staged = None                                     # packed pages that found no room: prefilled again
        kv, first = self.runner.prefill(req)
        self.memory.admit(req.rid, cached, remaining, reserve_ratio=self.reserve_ratio)
        for l, (k, v) in enumerate(kv):
            self.memory.write(l, req.rid, 0, k, v)
        self._started(req, first)
        if self.compress != "none":
            self.admitted_raw += 1
            self.memory.compress()                            # nothing reads the prompt's pages yet
        self.memory.keep_raw()
        self.memory.reads_done()
        return True

    def _started(self, req, first):
        req.out.append(first)
        req.position = (req.prefix.position if req.prefix is not None else 0) + len(req.prompt) + len(req.out) - 1

    def _admit_packed(self, req: Request, cached: int, remaining: int) -> bool:
        """ZipFusion's admission: prefill, pack the full pages (kept with the waiting request until it fits),
        admit them at their packed size (:meth:`zipkv.memory.KVMemory.admit_packed`), the last page raw."""
        mem = self.memory
        if not mem.can_admit_packed(cached, remaining, reserve_ratio=self.reserve_ratio):
            return False
        if req.staged is None:
            kv, first = self.runner.prefill(req)
            # packed here and placed by this engine, never leaving it: no checksums and no verification (they
            # are for pages in transit: zipkv.memory's "Pages that leave the pool"), as for the pool's own pages
            req.staged = (mem.pack(kv, checksum=False), first)
        packed, first = req.staged
        if mem.admit_packed(req.rid, packed, remaining, reserve_ratio=self.reserve_ratio, validate=False) is None:
            return False
        req.staged = None
        for l, (k, v) in enumerate(packed.tail):
            if k.shape[1]:
                mem.write(l, req.rid, packed.n_pages * fmt.PAGE_TOKENS, k, v)
        self._started(req, first)
        mem.keep_raw()
        mem.reads_done()
        return True

    def _admit_restore(self, req: Request, remaining: int) -> bool:
        """A restore baseline's admission: prefill, encode the full pages (kept with the waiting request
        until it fits), then hold chunks for the payload, take buffer pages and admit the raw tail."""
        n_pages, tail = self._restore_split(req)
        rs, mem = self.restore, self.memory
        if not rs.fits(n_pages) or not mem.can_admit(tail, remaining, reserve_ratio=self.reserve_ratio):
            return False
        if req.staged is None:
            kv, first = self.runner.prefill(req)
            req.staged = (rs.encode(kv, n_pages), [(k[:, n_pages * fmt.PAGE_TOKENS:], v[:, n_pages * fmt.PAGE_TOKENS:])
                                                   for k, v in kv], first)
        payload, raw, first = req.staged
        hold = -(-rs.payload_bytes(payload) // mem.chunk_bytes)
        if mem.admit(req.rid, tail, remaining, reserve_ratio=self.reserve_ratio, hold_chunks=hold) is None:
            return False
        req.staged = None
        rs.place(req.rid, payload, n_pages)
        for l, (k, v) in enumerate(raw):
            mem.write(l, req.rid, 0, k, v)
        self._started(req, first)
        mem.keep_raw()
        mem.reads_done()
        return True

    def _may_admit(self, req: Request) -> bool:
        """Whether :meth:`_admit` could take ``req`` now, from the memory's counts alone (no device work, no prefill):
        a necessary condition of each admission path, checked before the engine waits for the steps in flight."""
        if self.restore is not None or self.compress == "none" or req.staged is not None:
            return self._admit_possible(req)
        return (self.memory.can_admit_packed(req.cached, req.remaining, reserve_ratio=self.reserve_ratio)
                or self.memory.can_admit(req.cached, req.remaining, reserve_ratio=self.reserve_ratio))

    def _admit_possible(self, req: Request) -> bool:
        if self.restore is not None:
            n_pages, tail = self._restore_split(req)
            return self.restore.fits(n_pages) and self.memory.can_admit(tail, req.remaining,
                                                                        reserve_ratio=self.reserve_ratio)
        packed = (self.compress != "none" and req.staged is not None
                  and self.memory.can_admit_packed(req.staged[0], req.remaining, reserve_ratio=self.reserve_ratio))
        return packed or self.memory.can_admit(req.cached, req.remaining, reserve_ratio=self.reserve_ratio)

    def _abandon(self):
        """Free every request still held when :meth:`generate` returns or stops on an exception (KeyboardInterrupt
        included; or unfinished after ``max_decode_steps``): the memory is as before it, so that the next
        :meth:`generate` starts clean. Steps still in flight finish first on the one
        stream that later work is queued on, so no page freed here is written again before they are done."""
        for rid in list(self.memory.requests):
            self._free(rid)
        self.memory.reads_done()

    def _free(self, rid):
        self.memory.free(rid)
        if self.restore is not None:
            self.restore.release(rid)

    def _stored_bits(self, rids) -> float:
        """Bits stored per cached K/V value of ``rids`` (pages' bytes, plus payload bytes for a restore baseline)."""
        mem = self.memory
        values = sum(mem.cache_len(r) for r in rids) * mem.num_layers * 2 * mem.kv_heads * mem.head_dim
        used = mem.used_bytes()
        if self.restore is not None:
            used += sum(self.restore.entries[r]["bytes"] for r in rids if r in self.restore.entries)
            values += sum(self.restore.entries[r]["n"] for r in rids if r in self.restore.entries) \
                * fmt.PAGE_TOKENS * mem.num_layers * 2 * mem.kv_heads * mem.head_dim
        return 8 * used / values

    def generate(self, prompts, max_new_tokens: int, sampling_params=None, *, temperature=None, top_p=None,
                 top_k=None, seed: int | None = None, stop=None, stop_token_ids=None, prefixes=None,
                 max_decode_steps: int | None = None, progress: bool | None = None) -> GenerateResult:
        """Generation for every prompt: greedy (the default), or sampled.

        prompts: token-id lists or 1-D tensors; or strings where the engine has a ``tokenizer``, as
        ``tokenizer(text).input_ids`` (special tokens as the tokenizer adds them; no chat template: for a chat model
        give ``tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``).
        sampling_params: a :class:`~zipkv.sampling.SamplingParams` for every request, or a list of one per prompt; or
        instead the keywords temperature, top_p, top_k, stop and stop_token_ids, its fields, for every request
        (temperature 0 or None: greedy, exactly the engine's greedy tokens). seed: the call's seed; a request without
        a seed of its own samples from the stream of (``seed``, its index among the prompts), so its tokens depend
        neither on the requests beside it in a step nor on retraction or overlap; None: a fresh seed, drawn from
        torch's default generator and returned in ``stats["seed"]``. Stop strings need the tokenizer; a request's
        tokens and text end before the first one that appears (its tokens before the token in which it begins).
        prefixes: optional list (one :class:`Prefix` or None per prompt). max_decode_steps: stop after this
        many decode steps (benchmarks; unfinished requests keep the tokens they have). progress: a tqdm bar of the
        tokens; None (default): shown once the run has taken a second, True: from the start, False: none.
        Returns :class:`GenerateResult`: ``outputs`` (list of token lists, in prompt order), ``texts`` (with a
        tokenizer: each request's text, special tokens left out; else None) and ``stats``:
        ``decode_tokens_per_s`` (tokens produced by the timed decode steps / their wall time; the first
        token of each request comes from its prefill and is not counted; with CUDA graphs the first, eager
        step of each batch composition -- kernel compilation, warm-up -- is not timed, and a graph's capture
        time is left out of its step), ``decode_seconds``, ``timed_steps``, ``graph_capture_seconds``,
        ``prefill_seconds``, ``steps`` (per decode step: ``batch``, ``seconds`` -- wall time from the previous step's
        tokens reaching the host to this step's, admission left out (an admission attempt first reads every step in
        flight, and a request that did not fit is tried again only once memory has given space back,
        ``KVMemory.space_returns``); overlapped, that interval holds the next step's
        preparation and launch, so the steps' seconds add up to the decode's wall time --, ``mode`` -- ``"warmup"``,
        ``"capture"``, ``"replay"`` or ``"eager"`` --, ``used_bytes`` per layer, ``chunks_free``, ``chunks_held``,
        ``reassigned``), ``overlap``, ``max_batch`` (the largest batch of a decode step: 0 when no step ran, e.g.
        ``max_new_tokens=1``, whose one token comes from the prefill), ``retracted``, ``admitted_raw`` (requests admitted with raw
        pages although compression is on: their packed pages found no room, their raw ones did), ``admitted_at``
        (decode steps run before each request was first admitted), ``frac_compressed_k`` / ``_v`` (blocks stored compressed in ZipFusion's
        format over the running requests' pages at the first decode step), ``stored_bits_per_value`` (bits
        stored per cached value then, payloads included), ``seed`` (the call's seed: None where none was given and no
        request needed one), ``kv_budget_bytes``, ``memory`` (final :meth:`KVMemory.stats`).
        """
        run = self._start(prompts, max_new_tokens, sampling_params, seed, prefixes, max_decode_steps, progress,
                          dict(temperature=temperature, top_p=top_p, top_k=top_k, stop=stop,
                               stop_token_ids=stop_token_ids), streaming=False)
        while True:
            try:
                next(run)
            except StopIteration as done:
                return done.value

    def stream(self, prompts, max_new_tokens: int, sampling_params=None, *, temperature=None, top_p=None,
               top_k=None, seed: int | None = None, stop=None, stop_token_ids=None, prefixes=None,
               max_decode_steps: int | None = None, progress: bool | None = False):
        """:meth:`generate` as an iterator of :class:`StreamOutput` ``(index, token_ids, text, finished)``, given out as
        the steps' tokens reach the host: per request, the deltas add up to :meth:`generate`'s tokens and text for the
        same arguments and seed. Text a stop string might still take back is held until it cannot (as many
        characters as the longest stop string, less one), and the tokens with it. Arguments as :meth:`generate`'s
        (checked when this is called, before any work), but ``progress`` is off by default. The iterator's return
        value (``StopIteration.value``, or ``result = yield from engine.stream(...)``) is :meth:`generate`'s
        :class:`GenerateResult`. Leaving it early (``break``, ``close()``) frees the run's pages; one call runs on an
        engine at a time."""
        return self._start(prompts, max_new_tokens, sampling_params, seed, prefixes, max_decode_steps, progress,
                           dict(temperature=temperature, top_p=top_p, top_k=top_k, stop=stop,
                                stop_token_ids=stop_token_ids), streaming=True)

    def _start(self, prompts, max_new_tokens, sampling_params, seed, prefixes, max_decode_steps, progress, keywords,
               streaming: bool):
        """Check a call's arguments, before any work, and return its run (:meth:`_run`, not started)."""
        if max_decode_steps is not None and (not _is_int(max_decode_steps) or max_decode_steps < 1):
            raise ValueError(f"max_decode_steps must be an int >= 1 or None, got {max_decode_steps!r}")
        if progress is not None and not isinstance(progress, bool):
            raise TypeError(f"progress must be a bool or None, got {type(progress).__name__} {progress!r}")
        if seed is not None and not _is_int(seed):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__} {seed!r}")
        requests = self._validate(prompts, max_new_tokens, prefixes)
        params = self._sampling_params(len(requests), sampling_params, keywords)
        sampled = any(not p.greedy for p in params)
        if seed is None and any(not p.greedy and p.seed is None for p in params):
            seed = int(torch.randint(2**62, ()))
        for r, p in zip(requests, params):
            r.stop_token_ids = frozenset(p.stop_token_ids)
            if sampled:
                r.sampling = p.step_column(stream_key(1, p.seed) if p.seed is not None else
                                           stream_key(0, seed or 0, r.rid))
        texts = {} if self.tokenizer is None else {r.rid: TextStream(self.tokenizer, r.prompt, p.stop, streaming)
                                                   for r, p in zip(requests, params)}
        return self._run(requests, int(max_new_tokens), max_decode_steps, progress, seed, texts)

    def _sampling_params(self, n: int, sampling_params, keywords: dict) -> list:
        """One :class:`~zipkv.sampling.SamplingParams` per request, from ``sampling_params`` or the keywords."""
        given = {k: v for k, v in keywords.items() if v is not None}
        if sampling_params is not None and given:
            raise ValueError(f"sampling settings go either in sampling_params or in keywords, not both: got "
                             f"sampling_params and {', '.join(given)}")
        if sampling_params is None:
            params = [SamplingParams(**given)] * n
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * n
        elif isinstance(sampling_params, (list, tuple)) and len(sampling_params) == n \
                and all(isinstance(p, SamplingParams) for p in sampling_params):
            params = list(sampling_params)
        else:
            raise TypeError(f"sampling_params must be a zipkv.sampling.SamplingParams or a list of one per prompt "
                            f"({n}), got {type(sampling_params).__name__}"
                            + (f" of {len(sampling_params)}" if isinstance(sampling_params, (list, tuple)) else ""))
        vocab = self.model.config.vocab_size
        for p in params:
            if p.stop and self.tokenizer is None:
                raise ValueError(f"stop={list(p.stop)!r}: stop strings need the tokenizer, "
                                 f"Engine(model, ..., tokenizer=tokenizer); or use stop_token_ids")
            bad = [t for t in p.stop_token_ids if t >= vocab]
            if bad:
                raise ValueError(f"stop_token_ids must be token ids in [0, {vocab}), got {bad[0]}")
        return params

    def _run(self, requests, max_new_tokens, max_decode_steps, progress, seed, texts, serving=None):
        """The loop of :meth:`generate` (module docstring), as a generator of :class:`StreamOutput`; returns the
        :class:`GenerateResult`. texts: a :class:`~zipkv.sampling.TextStream` per request index (none without a
        tokenizer). serving: a :class:`zipkv.serving.Recorder` when a trace is served (:meth:`serve`): requests
        arrive on its clock, which it advances and on which it records each token, admission, retraction and step."""
        if self.busy:
            raise RuntimeError("the engine is running another generate or stream call: finish it or close its stream "
                               "(stream.close()) first")
        self.busy = True
        self.admitted_raw = 0
        sched = Scheduler(requests, max_batch=self.max_batch, eos=self.eos,
                          arrivals=None if serving is None else serving.arrivals)
        mem, runner = self.memory, self.runner
        sampled = requests[0].sampling is not None
        steps, flights = [], []
        prefill_s = 0.0
        frac, bits = (float("nan"), float("nan")), float("nan")
        clock = None                                       # when the time of the next step to be read began
        bar = None
        if progress is not False:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(requests) * max_new_tokens, desc="generate", unit="tok", delay=0 if progress else 1)
        events = collections.deque()                       # StreamOutput not yet given out
        sent = dict.fromkeys(range(len(requests)), 0)      # tokens given out, per request
        shown = dict.fromkeys(range(len(requests)), 0)     # characters of text given out, per request

        def give_out(r, finished: bool, flush: bool):
            """``r``'s tokens and text not given out yet, but those a stop string might still take back (unless
            ``flush``)."""
            text = texts.get(r.rid)
            if text is None:
                n, delta = len(r.out), None
            else:
                end = len(text.text) if flush else text.streamable()
                n = len(r.out) if flush or not text.stop else text.tokens_before(end)
                delta, shown[r.rid] = text.text[shown[r.rid]:end], end
            if n > sent[r.rid] or delta or finished:
                events.append(StreamOutput(r.rid, r.out[sent[r.rid]:n], delta, finished))
                sent[r.rid] = n

        def stop_strings(r, final: bool):
            """``r``'s new tokens onto its text; a stop string there cuts its tokens and ends it."""
            if r.rid in texts and (cut := texts[r.rid].update(r.out, final)) is not None:
                del r.out[cut:]
                r.stopped = True

        def accept(r):
            """The host's side of a token appended to ``r.out``: stop strings, the bar, the stream."""
            if serving is not None:
                serving.token(r)
            produced, finished = len(r.out), r.finished(self.eos)
            stop_strings(r, finished)
            finished = finished or r.stopped
            if bar:
                bar.update(1)
                if finished and produced < r.max_new:     # stopped early: the bar's total loses what it won't make
                    bar.total -= r.max_new - produced
                    bar.refresh()
            give_out(r, finished, finished)

        def retire():
            for r in sched.retire():
                self._free(r.rid)
            mem.reads_done()                               # one stream: every read issued so far is ordered

        def read():
            """The oldest step in flight: its tokens onto its requests, its row of ``steps``."""
            nonlocal clock
            f = flights.pop(0)
            toks = f.read()
            if serving is not None:
                serving.step(len(f.rows), f.snapshot, sched)
            for (r, epoch), t in zip(f.rows, toks):
                if r.epoch == epoch:
                    r.pending -= 1
                    if not r.finished(self.eos):
                        r.out.append(t)
                        accept(r)
            now = time.perf_counter()
            steps.append(dict(batch=len(f.rows), seconds=now - clock, mode=f.mode, capture_seconds=f.capture_s,
                              **f.snapshot))
            clock = now

        try:
            while sched.has_work() or flights:
                while events:
                    yield events.popleft()
                if max_decode_steps is not None and len(steps) + len(flights) >= max_decode_steps:
                    if not flights:
                        break
                    read()
                    continue
                if serving is not None:                    # arrivals; an idle engine waits for the next one
                    serving.arrive(sched, idle=not (sched.running or sched.waiting or flights))
                retire()
                # a blocked request is checked again only once memory has given space back, first from the memory's
                # counts alone while the steps in flight run on; an attempt that passes prefills, which waits for
                # the device, so it runs with nothing in flight and the time left out of the steps is its own
                while (req := sched.next_to_admit(mem.space_returns)) is not None:
                    if not self._may_admit(req):           # host-only: the steps in flight keep running
                        sched.blocked(req, mem.space_returns)
                        break
                    while flights:
                        read()
                    t0 = time.perf_counter()
                    admitted = self._admit(req)
                    prefill_s += time.perf_counter() - t0
                    if clock is not None:
                        clock += time.perf_counter() - t0      # admission is prefill time, not a step's
                    if not admitted:
                        sched.blocked(req, mem.space_returns)
                        break
                    sched.admitted(req, len(steps) + len(flights))
                    if serving is not None:
                        serving.admitted(req, time.perf_counter() - t0)
                    accept(req)
                retire()
                batch = sched.decode_batch()
                if not batch:
                    if flights:
                        read()
                    elif sched.waiting and not mem.requests and not self._admit_possible(sched.waiting[0]):
                        raise RuntimeError("generate: a request does not fit an empty memory (internal error)")
                    continue
                t0 = time.perf_counter()
                for r in batch:
                    if r not in sched.running:
                        continue
                    while mem.alloc(r.rid, 1) is None:             # no room: retract by the scheduler's policy
                        victim = sched.retraction_victim()
                        self._free(victim.rid)
                        sched.requeue(victim)
                        if serving is not None:
                            serving.retracted(victim)
                        if victim is r:
                            break
                    else:
                        r.grown += 1
                batch = [r for r in batch if r in sched.running]
                if not batch:
                    continue
                rids = [r.rid for r in batch]
                if not steps and not flights:
                    frac, bits = mem.compressed_fraction(rids), self._stored_bits(rids)
                last = [mem.cache_len(rid) - 1 for rid in rids]                 # the new token's slot
                key = runner.plan(rids)
                if flights and not (self.overlap and runner.replays(key)):
                    pre = time.perf_counter() - t0             # a warm-up or capture runs with nothing in flight
                    while flights:
                        read()
                    steps[-1]["seconds"] -= pre                # this step's host work so far ran before that read
                    clock -= pre
                elif not flights:
                    clock = t0
                carry = None
                if flights:                                    # tokens still on the device: the step in flight's
                    at = {id(r): i for i, (r, _) in enumerate(flights[-1].rows)}
                    carry = (flights[-1].tokens, torch.tensor([at[id(r)] if r.pending else -1 for r in batch]))
                inp = torch.tensor([[0 if r.pending else r.out[-1] for r in batch], [r.position for r in batch],
                                    [mem.requests[rid].pages[t // fmt.PAGE_TOKENS] for rid, t in zip(rids, last)],
                                    [t % fmt.PAGE_TOKENS for t in last],
                                    *(zip(*(r.sampling for r in batch)) if sampled else ())], dtype=torch.int64)
                out, mode, capture_s = runner.launch(key, inp, carry)
                clock += capture_s
                for r in batch:
                    r.position, r.pending = r.position + 1, r.pending + 1
                if self.compress == "all":
                    mem.compress()                              # the pages this step filled, after its reads
                mem.keep_raw()
                st = mem.snapshot()                             # during the step, before finished requests leave
                flights.append(StepInFlight([(r, r.epoch) for r in batch], out, mode, capture_s,
                                            {k: st[k] for k in ("used_bytes", "chunks_free", "chunks_held", "reassigned")}))
                while len(flights) > (1 if self.overlap else 0):
                    read()
            for r in sched.running + sched.waiting:       # left unfinished by max_decode_steps: their held-back text
                if not r.finished(self.eos):
                    stop_strings(r, True)
                    give_out(r, r.stopped, True)
            while events:
                yield events.popleft()
        except BaseException:               # an interrupt, an error or a closed stream: the engine stays usable
            if bar:
                bar.close()
            self._abandon()
            raise
        finally:
            self.busy = False
        if bar:
            bar.close()
        outputs = sched.outputs(len(requests))
        self._abandon()                                    # requests max_decode_steps left unfinished give back their pages
        timed = [s for s in steps if s["mode"] != "warmup"] or steps
        decode_s = sum(s["seconds"] for s in timed)
        stats = dict(frac_compressed_k=frac[0], frac_compressed_v=frac[1], stored_bits_per_value=bits,
                     decode_tokens_per_s=sum(s["batch"] for s in timed) / decode_s if decode_s else float("nan"),
                     decode_seconds=decode_s, timed_steps=len(timed), cuda_graphs=runner.graphs.enabled,
                     overlap=self.overlap,
                     graph_error=runner.graphs.failed,
                     graph_capture_seconds=sum(s["capture_seconds"] for s in steps),
                     prefill_seconds=prefill_s, steps=steps,
                     max_batch=max((s["batch"] for s in steps), default=0), retracted=sched.retracted,
                     admitted_raw=self.admitted_raw,
                     admitted_at=[sched.admitted_at.get(i) for i in range(len(requests))],
                     seed=seed, kv_budget_bytes=self.kv_budget_bytes, memory=mem.stats())
        return GenerateResult(outputs, stats, [texts[i].text for i in range(len(requests))] if texts else None)

    def page_bytes(self) -> int:
        """Bytes of one uncompressed logical page over all layers (16 tokens of K and V)."""
        return self.memory.num_layers * self.memory.page_bytes


def kv_budget_for(model_config, requests: int, tokens_per_request: int, *, pages_per_chunk: int = 16) -> int:
    """The smallest KV budget (bytes) whose uncompressed capacity holds ``requests`` requests of
    ``tokens_per_request`` cached tokens each, in whole chunks per layer (rounding up to a chunk can make
    room for more requests when a request is smaller than a chunk; the engine measures its largest batch)."""
    for name, value in (("requests", requests), ("tokens_per_request", tokens_per_request),
                        ("pages_per_chunk", pages_per_chunk)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not all(hasattr(model_config, a) for a in ("num_key_value_heads", "num_hidden_layers", "num_attention_heads")):
        raise TypeError(f"model_config must be a Hugging Face model config (model.config), got {type(model_config).__name__}")
    H = model_config.num_key_value_heads
    D = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    layers = model_config.num_hidden_layers
    page = 2 * H * fmt.page_bytes(D)
    pages = requests * math.ceil(tokens_per_request / fmt.PAGE_TOKENS)
    return layers * math.ceil(pages / pages_per_chunk) * pages_per_chunk * page
