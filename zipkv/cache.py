"""A distilled KV cache as a Hugging Face ``transformers`` ``Cache``: generate from it (KVSculpt §3, §4).

:func:`zipkv.compress` (:mod:`zipkv.compression`) captures a context, compresses it and returns a
:class:`DistilledCache` that ``model.generate`` accepts::

    cache = zipkv.compress(model, context_ids, kept_fraction=0.3)   # k + m pairs per KV head
    out = model.generate(continuation_ids, past_key_values=cache, max_new_tokens=64)

(transformers 5.24 and later name the argument ``cache=``, and warn on ``past_key_values=``; the ``generate`` of a
model with zipkv's hooks takes a DistilledCache under either name on every version, and
:func:`zipkv.models.cache_keyword` gives the installed one's name for the model's own forward.)

* **Exact per-head lengths.** Adaptive budgets (§3.5) give every KV head its own ``k``. A layer is
  stored padded to its longest head, ``[1, H, P, d]``, with ``valid`` ``[H, P]`` marking real pairs;
  the padding is masked per head, so attention equals attention over each head's own pairs.
* **Per-sequence pairs** (optional): a layer may hold ``B`` different compressed contexts at once, keys
  ``[B, H, P, d]`` with ``valid``/``bias`` ``[B, H, P]``, one per sequence of a ``B``-row forward (e.g. the
  ``(layer, head)`` variants of :func:`zipkv.distill.generalise.head_sensitivity`, one forward for many); the
  other layers of the same cache may hold one context shared by all ``B`` sequences.
* **Positions continue at N.** The continuation runs at positions ``N, N+1, …`` (``N`` the original
  context length), not at the number of cached pairs.
* **Left-padded batches.** Continuations of different lengths run as one batch with a 2-D ``attention_mask``
  (``0`` on a row's padding, one column per token after the context): each row's padding is masked out of its
  attention, and its real tokens run at ``N, N+1, …`` exactly as if it ran alone, in the prompt and in every
  decode step after it (:attr:`DistilledCache.padding`)::

      batch = tokenizer(questions, padding=True, padding_side="left", return_tensors="pt")
      model.generate(**batch, past_key_values=cache, max_new_tokens=64)
* **A per-key logit bias** ``β`` ``[H, P]`` per layer (zero by default) is added to the attention
  logits of the cached pairs: pairs that stand for several tokens (Attention Matching) need it.
* **Sliding-window layers** (Gemma 3's: the attention module's ``sliding_window`` ``W``) keep the model's
  own rule: a query at position ``p`` sees only the keys at positions ``> p − W``, the cached pairs taken
  as the context's last positions (:meth:`DistilledLayer.additive_mask`), so the uncompressed cache
  reproduces the model's own forward on contexts longer than the window.

The masks and positions come from two forward pre-hooks that :func:`attach` registers on the model
(once; :func:`compress` and :mod:`zipkv.distill.evaluate` call it): one on the decoder sets the
positions, one per attention module replaces the attention mask by the layer's additive mask
``[B, q_heads, T, P + past + T]`` (``β`` or ``−inf`` on the cached pairs, ``0``/``−inf`` causal on the
new tokens). Both do nothing unless one of the forward's arguments is a :class:`DistilledCache` (found by its type,
not by its keyword: transformers passes the cache down as ``past_key_values=`` before 5.24, as ``cache=`` since),
and the model keeps its own attention implementation (``sdpa`` or ``eager``), so what runs is the
model's attention with a mask. Nothing is kept outside the cache: each layer's lengths and bias live
in its :class:`DistilledLayer` (a third hook, after the decoder's forward, only counts the hooked forwards running,
for the error of a layer updated without its mask).

The cache follows ``transformers``' convention of appending: after ``generate`` it holds the
generated tokens too (:meth:`DistilledCache.reset` drops them). Its ``get_seq_length()`` counts the
tokens appended after the compressed context (what ``generate`` compares the inputs with), so pass
only the tokens that follow the context; inputs that repeat the context are refused, and so is a ``generate``
input that does not begin with the tokens an earlier ``generate`` appended (``generate`` would drop that many
of its first tokens): :func:`attach` also wraps the model's ``generate`` for this check.
"""
from __future__ import annotations

import inspect
import numbers
import threading
import types
from typing import Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer
from .models import CACHE_KEYWORDS, attention_window, cache_keyword

__all__ = ["DistilledCache", "DistilledLayer", "attach", "detach"]

SUPPORTED_ATTENTION = ("sdpa", "eager")
"""Attention implementations that take the per-head additive mask (flash attention takes no mask)."""


class DistilledLayer(DynamicLayer):
    """One layer of a :class:`DistilledCache`: padded cached pairs, then the appended tokens.

    Attributes:
        keys, values: ``[B, H, P + appended, d]`` (``B = 1`` until several sequences continue the context).
        cached: ``P``, the padded number of cached pairs.
        valid: ``[H, P]`` bool, True on real pairs (one compressed context for every sequence), or ``[B, H, P]``
            (each of the ``B`` sequences its own cached pairs: the layer was made from ``[B, H, P, d]`` keys).
        bias: float32 logit bias of the cached pairs (``0`` where none was given), shaped like ``valid``.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None):
        super().__init__()
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            raise TypeError(f"keys and values must be torch.Tensor, got {type(keys).__name__} and "
                            f"{type(values).__name__}")
        if not keys.is_floating_point() or values.dtype != keys.dtype or values.device != keys.device:
            raise ValueError(f"keys ({keys.dtype} on {keys.device}) and values ({values.dtype} on {values.device}): "
                             "expected one floating-point dtype and one device")
        if keys.ndim not in (3, 4) or values.shape != keys.shape:
            raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)}: expected equal [H, P, d] "
                             "(one context) or [B, H, P, d] (one per sequence)")
        pairs = tuple(keys.shape[:-1])  # (H, P) or (B, H, P)
        wanted = ", ".join(map(str, pairs))
        valid = torch.ones(pairs, dtype=torch.bool) if valid is None else torch.as_tensor(valid)
        if tuple(valid.shape) != pairs or valid.dtype != torch.bool:
            raise ValueError(f"valid has shape {tuple(valid.shape)} and dtype {valid.dtype}: expected [{wanted}] bool")
        if not bool(valid.any(dim=-1).all()):
            raise ValueError("valid: every head needs at least one cached pair")
        bias = torch.zeros(pairs) if bias is None else torch.as_tensor(bias)
        if (tuple(bias.shape) != pairs or not bias.is_floating_point()
                or bool((torch.isnan(bias) | (bias == float("inf"))).any())):
            raise ValueError(f"bias has shape {tuple(bias.shape)} and dtype {bias.dtype}: expected [{wanted}] floats, "
                             "finite or −inf (a −inf pair is never attended)")
        self.keys, self.values = (keys[None], values[None]) if keys.ndim == 3 else (keys, values)
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self.cached = pairs[-1]
        self.valid = valid.to(keys.device)
        self.bias = bias.to(device=keys.device, dtype=torch.float32)
        self.armed = False      # set by the mask hook of this layer's attention, for its next update
        self.entered = False    # set by the decoder's positions hook at the start of each forward
        self.layer_idx: int | None = None   # set by the DistilledCache that holds it
        self._start = (self.keys, self.values, self.valid, self.bias)   # what restart() returns to (no copies)

    def restart(self) -> None:
        """Back to the compressed context: no appended tokens and its own batch rows (``generate`` with beams or
        several sequences grows the rows; appending and reordering make new tensors, never writing these)."""
        self.keys, self.values, self.valid, self.bias = self._start

    @property
    def heads(self) -> int:
        """``H``, the KV heads."""
        return self.valid.shape[-2]

    @property
    def per_sequence(self) -> bool:
        """Whether each sequence holds its own cached pairs (``valid`` ``[B, H, P]``)."""
        return self.valid.ndim == 3

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.armed:
            raise RuntimeError(self._unmasked_reason())
        self.armed = self.entered = False
        B = key_states.shape[0]
        if self.keys.shape[0] != B:  # several sequences (beams, samples) continue the one compressed context
            if self.keys.shape[0] != 1:
                raise ValueError(f"a batch of {B} sequences after a cache of {self.keys.shape[0]}: expected equal")
            # a view: DynamicLayer.update's torch.cat writes the one [B, H, P + T, d] copy
            self.keys = self.keys.expand(B, -1, -1, -1)
            self.values = self.values.expand(B, -1, -1, -1)
        return super().update(key_states, value_states, *args, **kwargs)

    def _unmasked_reason(self) -> str:
        """Why this layer is being updated without its mask: the model has no zipkv hooks, or its hooks did not see
        the cache (in the decoder's call, or in this layer's attention module's call)."""
        import transformers

        unmasked = "a DistilledCache ran through a model without zipkv's attention mask"
        version = f"transformers {transformers.__version__}"
        if self.entered:
            where = "a layer" if self.layer_idx is None else f"layer {self.layer_idx}"
            module = "its self_attn" if self.layer_idx is None else f"model.model.layers[{self.layer_idx}].self_attn"
            return (f"{unmasked} on {where}: zipkv's hooks are on the model and its decoder got the cache, but the mask "
                    f"hook on {module} did not see it before the layer's cache was updated: that module was replaced, "
                    "or its hook removed, after zipkv.cache.attach(model) (zipkv.cache.detach(model), then attach "
                    f"again), or {version} updates the cache from another module or passes it to the attention "
                    "module some other way than as a call argument")
        if _hooked_forwards() > 0:
            return (f"{unmasked}: zipkv's hooks are on the model, but its decoder's forward was called without the "
                    "DistilledCache among its arguments (the hooks look for it there under any keyword, "
                    f"past_key_values= or cache=): {version} passes the cache some other way, which zipkv does not "
                    "support (calling zipkv.cache.attach again does not help)")
        return (f"{unmasked}: the model has no zipkv hooks: call zipkv.cache.attach(model) once before using it "
                "(zipkv.compress and DistilledCache.from_compressed(..., model) do)")

    def get_seq_length(self) -> int:
        """Tokens appended after the compressed context."""
        return self.keys.shape[-2] - self.cached

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        # the size of the mask transformers builds from the 2-D attention mask; the hook replaces it. transformers
        # < 5.4 (kvpress's range) passes the new tokens' cache_position tensor instead of their number.
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        return self.get_seq_length() + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:  # transformers' legacy form: the length to keep (here: appended tokens)
            tokens_to_remove = min(0, tokens_to_remove - self.get_seq_length())
        tokens_to_remove = min(-tokens_to_remove, self.get_seq_length())
        if tokens_to_remove:
            self.keys = self.keys[..., :-tokens_to_remove, :]
            self.values = self.values[..., :-tokens_to_remove, :]

    def _select(self, pick) -> None:
        """``pick`` (a function of a tensor with the sequences on dim 0) on the keys, values and per-sequence masks."""
        self.keys, self.values = pick(self.keys), pick(self.values)
        if self.per_sequence:
            self.valid, self.bias = pick(self.valid), pick(self.bias)

    # DynamicLayer skips these while get_seq_length() is 0; here the cached pairs are there from the start
    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(lambda x: x[indices, ...])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def additive_mask(self, query_length: int, group: int, dtype: torch.dtype, *, window: int | None = None,
                      n_context: int | None = None, padding: torch.Tensor | None = None) -> torch.Tensor:
        """``[B', H·group, T, P + appended + T]`` additive attention mask for ``T`` new tokens (``B' = 1``, broadcast
        over the sequences, unless the layer holds per-sequence pairs or ``padding`` is given: then ``B' = B``).

        Cached pairs: ``β`` where valid, ``−inf`` on padding (per KV head, repeated over its ``group``
        query heads, as ``repeat_kv``); appended tokens: ``0``; the new tokens: causal.

        ``padding`` ``[B, appended + T]`` bool: True on the appended and new tokens that are a row's padding (a
        left-padded batch), ``−inf`` as keys for every query of that row; each row's real tokens run at ``N``,
        ``N + 1``, … in order.

        ``window`` ``W`` (a sliding-window layer, Gemma 3's): the model's own rule on top, a query at position
        ``p`` sees only keys at positions ``> p − W`` (transformers' ``sliding_window_overlay``). It needs
        ``n_context`` ``N`` (the new tokens run at ``N + appended + t``, or their row's under ``padding``) and the
        cached pairs' original positions: on such a layer each head's valid pairs are taken as the context's last
        ``n_h`` positions ``N − n_h … N − 1``, in order (the uncompressed cache, or the window that zipkv's distillers
        keep on sliding layers: they never compress one, :attr:`zipkv.models.Capture.compressed_layers`).
        """
        H, T, past = self.heads, query_length, self.get_seq_length()
        valid = self.valid if self.per_sequence else self.valid[None]  # [B', H, P]
        bias = self.bias if self.per_sequence else self.bias[None]
        cached = bias.masked_fill(~valid, float("-inf"))  # [B', H, P]
        causal = torch.ones(T, T, dtype=torch.bool, device=self.device).tril()
        visible = torch.cat([torch.ones(T, past, dtype=torch.bool, device=self.device), causal], dim=1)[None]
        if padding is not None:
            if padding.ndim != 2 or padding.shape[1] != past + T or padding.dtype != torch.bool:
                raise ValueError(f"padding has shape {tuple(padding.shape)} and dtype {padding.dtype}: expected "
                                 f"[B, {past + T}] bool, the {past} appended tokens and the {T} new ones")
            padding = padding.to(self.device)
            visible = visible & ~padding[:, None, :]  # [B, T, past+T]
        if window is not None:
            if n_context is None:
                raise ValueError("window= needs n_context= (the original context length N)")
            rank = valid.long().cumsum(dim=-1) - 1  # [B', H, P] index among the head's valid pairs
            position = n_context - valid.sum(dim=-1, keepdim=True) + rank  # [B', H, P] original positions
            if padding is None:
                later = (n_context + torch.arange(past + T, device=self.device))[None]  # [1, past+T]
            else:
                later = _token_positions(padding, n_context)  # [B, past+T]
            query = later[:, past:]  # [1 or B, T]
            seen = position[:, :, None, :] > query[:, None, :, None] - window  # [B', H, T, P]
            cached = cached[:, :, None, :].masked_fill(~seen, float("-inf"))  # [B', H, T, P]
            visible = visible & (later[:, None, :] > query[:, :, None] - window)
        else:
            cached = cached[:, :, None, :].expand(-1, -1, T, -1)
        cached = cached.repeat_interleave(group, dim=1)  # [B', Hq, T, P]
        rows = max(cached.shape[0], visible.shape[0])
        new = torch.zeros(visible.shape, device=self.device).masked_fill_(visible.logical_not(), float("-inf"))
        mask = torch.cat([cached.expand(rows, -1, -1, -1), new[:, None].expand(rows, H * group, -1, -1)], dim=-1)
        return mask.to(dtype)


def _token_positions(padding: torch.Tensor, n_context: int) -> torch.Tensor:
    """``[B, S]`` int64 positions of ``S`` tokens after a context of ``N = n_context`` tokens, from ``padding``
    ``[B, S]`` (True on a row's padding): each row's real tokens at ``N, N + 1, …`` in order, as if the row ran alone;
    a padded token at ``N`` (never attended: any finite position does)."""
    real = ~padding
    return (n_context + real.long().cumsum(dim=1) - 1).masked_fill(padding, n_context)


class DistilledCache(Cache):
    """A compressed KV cache that ``model.generate`` and ``model(...)`` accept as ``past_key_values`` (or ``cache``).

    Attributes:
        layers: one :class:`DistilledLayer` per decoder layer.
        n_context: ``N``, the original context length: new tokens run at positions ``N + appended + t``.
        context_ids: ``[N]`` the context's token ids when known (to refuse inputs that repeat it).
        compressed: the :class:`~zipkv.distill.kvsculpt.CompressedCache` it was made from (method,
            ratio, budget, losses), when made from one.
    """

    def __init__(self, layers: Sequence[DistilledLayer], n_context: int, *, context_ids: torch.Tensor | None = None,
                 compressed=None):
        if not layers:
            raise ValueError("a DistilledCache needs at least one layer")
        wrong = next((layer for layer in layers if not isinstance(layer, DistilledLayer)), None)
        if wrong is not None:
            raise TypeError(f"layers must be DistilledLayer objects, got {type(wrong).__name__} "
                            "(DistilledCache.from_padded builds them from tensors)")
        if isinstance(n_context, bool) or not isinstance(n_context, numbers.Integral) or n_context < 1:
            raise ValueError(f"n_context={n_context!r}: expected the original context length N ≥ 1")
        n_context = int(n_context)
        sequences = sorted({layer.keys.shape[0] for layer in layers if layer.per_sequence})
        if len(sequences) > 1:
            raise ValueError(f"layers hold per-sequence pairs for {sequences} sequences: expected one batch size")
        super().__init__(layers=list(layers))
        for index, layer in enumerate(self.layers):
            layer.layer_idx = index
        self.n_context = n_context
        self.context_ids = None if context_ids is None else torch.as_tensor(context_ids).reshape(-1).cpu()
        self.compressed = compressed
        self.fed_ids: torch.Tensor | None = torch.zeros(1, 0, dtype=torch.long)
        """``[rows, appended]`` the token ids fed after the context so far, one row per sequence (one row: every
        sequence's), ``None`` once an input came as embeddings or the rows could not be followed: what
        :meth:`check_continuation` compares a later ``generate``'s input with."""
        self.padding: torch.Tensor | None = None
        """``[rows, appended]`` bool, True on the appended tokens that are a row's padding (a left-padded batch: its
        row never attends them, and its real tokens run at ``N, N + 1, …``), ``None`` while no appended token is; during
        a forward it covers that forward's tokens too. Set from each forward's 2-D ``attention_mask``."""

    @classmethod
    def from_padded(cls, layers: Sequence[tuple], n_context: int, *, dtype=None, device=None,
                    **kwargs) -> "DistilledCache":
        """From per-layer ``(keys, values, valid)`` or ``(keys, values, valid, bias)``: ``[H, P_l, d]`` twice,
        ``[H, P_l]`` bool (False entries are masked out for that head, wherever they are), ``[H, P_l]`` float."""
        built = []
        if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
            raise TypeError(f"layers must be a list of per-layer (keys, values, valid[, bias]) tensors, got "
                            f"{type(layers).__name__}")
        for index, layer in enumerate(layers):
            if not isinstance(layer, (tuple, list)) or len(layer) not in (3, 4) \
                    or not all(isinstance(t, torch.Tensor) for t in layer):
                raise ValueError(f"layer {index}: expected (keys, values, valid) or (keys, values, valid, bias) tensors, "
                                 f"got {type(layer).__name__}"
                                 + (f" of {[type(t).__name__ for t in layer]}" if isinstance(layer, (tuple, list))
                                    else ""))
            k, v, valid = layer[:3]
            bias = layer[3] if len(layer) == 4 else None
            k = k.to(device=device or k.device, dtype=dtype or k.dtype)
            v = v.to(device=k.device, dtype=k.dtype)
            try:
                built.append(DistilledLayer(k, v, valid.to(k.device), None if bias is None else bias.to(k.device)))
            except ValueError as error:
                raise ValueError(f"layer {index}: {error}") from None
        return cls(built, n_context, **kwargs)

    @classmethod
    def from_compressed(cls, compressed, model=None, *, dtype=None, device=None,
                        context_ids: torch.Tensor | None = None) -> "DistilledCache":
        """From a :class:`~zipkv.distill.kvsculpt.CompressedCache`, in ``model``'s dtype and device (when
        given; the model also gets :func:`attach`'s hooks and is checked against the cache's shape)."""
        if not all(hasattr(compressed, a) for a in ("num_layers", "num_heads", "n_context", "padded", "padded_bias")):
            raise TypeError(f"compressed must be a zipkv.distill.kvsculpt.CompressedCache (a distiller's result), got "
                            f"{type(compressed).__name__}")
        if model is not None:
            param = next(model.parameters())
            dtype, device = dtype or param.dtype, device or param.device
            _check_shape(model, compressed.num_layers, compressed.num_heads)
            attach(model)
        layers = []
        for layer in range(compressed.num_layers):
            k, v, valid = compressed.padded(layer, dtype=dtype, device=device)
            layers.append((k, v, valid, compressed.padded_bias(layer, device=device)))
        return cls.from_padded(layers, compressed.n_context, context_ids=context_ids, compressed=compressed)

    def memory(self) -> dict:
        """The cache's bytes against the full cache's: ``bytes`` (the compressed context's pairs, padding left out,
        and its float32 logit bias where it has one), ``full_bytes`` (the uncompressed context's keys and values in
        the same dtype, every layer and KV head: ``2·L·H·N·d`` elements) and ``fraction`` (their ratio)."""
        pairs = int(self.lengths.sum())
        layer = self.layers[0]
        element = layer.keys.element_size()
        d = layer.keys.shape[-1]
        biased = any(bool((lay.bias != 0).any()) for lay in self.layers)
        stored = pairs * 2 * d * element + (pairs * 4 if biased else 0)
        full = 2 * len(self.layers) * layer.heads * self.n_context * d * element
        return dict(bytes=stored, full_bytes=full, fraction=stored / full)

    def __repr__(self) -> str:
        lengths, mem = self.lengths.float(), self.memory()
        method = getattr(self.compressed, "method", None)
        return (f"DistilledCache({len(self.layers)} layers, {lengths.mean():.0f} of {self.n_context} pairs per KV head "
                f"on average{'' if method is None else f', {method}'}, {mem['bytes'] / 2**20:.2f} MiB against "
                f"{mem['full_bytes'] / 2**20:.2f} MiB uncompressed, {self.get_seq_length()} tokens appended)")

    @property
    def lengths(self) -> torch.Tensor:
        """``[L, H]`` int64 cached pairs per layer and KV head (the compressed context, not appended tokens);
        ``[L, B, H]`` when layers hold per-sequence pairs."""
        return torch.stack(torch.broadcast_tensors(*[layer.valid.sum(dim=-1).cpu() for layer in self.layers]))

    @property
    def next_position(self) -> int:
        """The position of the next token fed to a row without padding: ``N`` plus the tokens appended so far (a padded
        row's: ``N`` plus its real tokens, :attr:`padding`)."""
        return self.n_context + self.get_seq_length()

    def reset(self) -> None:
        """Drop every appended token and every row ``generate`` added (beams, a batch of continuations): back to the
        compressed context (before another ``generate``)."""
        for layer in self.layers:
            layer.restart()
        self.fed_ids = torch.zeros(1, 0, dtype=torch.long)
        self.padding = None

    def check_continuation(self, input_ids) -> None:
        """Refuse a ``generate`` input that does not continue what this cache holds: ``generate`` feeds only the
        input beyond the cache's appended tokens, so an input whose rows do not each begin with their sequence's
        appended tokens (a new prompt after an earlier ``generate``, without :meth:`reset`) would silently lose its
        first tokens."""
        held = self.get_seq_length()
        if held == 0 or input_ids is None or self.fed_ids is None:
            return
        try:
            ids = torch.as_tensor(input_ids)
        except (TypeError, ValueError, RuntimeError):
            ids = None
        if ids is None or ids.is_floating_point() or ids.dtype == torch.bool or ids.ndim not in (1, 2):
            raise TypeError(f"input_ids must be token ids [T] or [batch, T] (a tensor of ints), got "
                            f"{type(input_ids).__name__} {getattr(ids, 'dtype', '')} {tuple(getattr(ids, 'shape', ()))}")
        ids = ids.reshape(1, -1) if ids.ndim == 1 else ids
        fed = self.fed_ids.expand(ids.shape[0], -1) if self.fed_ids.shape[0] == 1 else self.fed_ids
        if fed.shape[0] != ids.shape[0]:
            raise ValueError(f"input_ids has {ids.shape[0]} rows, and this DistilledCache holds the tokens an earlier "
                             f"generate appended for {fed.shape[0]} sequences: call cache.reset() to generate from the "
                             "context again, or pass that generate's output to continue it")
        same = ((ids[:, :held].cpu().long() == fed).all(dim=1) if ids.shape[1] > held
                else torch.zeros(len(ids), dtype=torch.bool))
        if not bool(same.all()):
            rows = f" (rows {[i for i, ok in enumerate(same.tolist()) if not ok]})" if len(ids) > 1 else ""
            raise ValueError(f"input_ids do not continue this DistilledCache{rows}: it still holds the {held} "
                             f"tokens an earlier generate appended after the context, and generate would feed only "
                             f"the input beyond its first {held} tokens: call cache.reset() to generate from the "
                             "context again, or pass that generate's output (its tokens first) to continue it")

    def _follow_rows(self, pick) -> None:
        """Apply ``pick`` (a reordering or repeat of the sequences, as on the layers) to the rows of :attr:`fed_ids`
        and :attr:`padding`."""
        if self.padding is not None:
            self.padding = pick(self.padding)
        if self.fed_ids is None or self.fed_ids.shape[1] == 0:
            return
        rows = self.layers[0].keys.shape[0]
        fed = self.fed_ids.expand(rows, -1) if self.fed_ids.shape[0] == 1 else self.fed_ids
        self.fed_ids = pick(fed) if fed.shape[0] == rows else None

    def _check_rows(self, indices, name: str) -> None:
        """``indices`` (``generate``'s choice of rows: beams, kept sequences) a 1-D integer tensor of rows in
        ``[0, rows)``; its values are read only where it is on the CPU (no device sync inside ``generate``)."""
        rows = self.layers[0].keys.shape[0]
        if not isinstance(indices, torch.Tensor) or indices.dim() != 1 or indices.is_floating_point() \
                or indices.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor of rows, got "
                             f"{getattr(indices, 'dtype', type(indices).__name__)} {tuple(getattr(indices, 'shape', ()))}")
        if indices.device.type == "cpu" and indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= rows):
            raise ValueError(f"{name} must hold rows in [0, {rows}) (the cache holds {rows} sequences), got range "
                             f"[{int(indices.min())}, {int(indices.max())}]")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._check_rows(beam_idx, "beam_idx")
        self._follow_rows(lambda x: x.index_select(0, beam_idx.to(x.device)))
        super().reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if isinstance(repeats, bool) or not isinstance(repeats, numbers.Integral) or repeats < 1:
            raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
        self._follow_rows(lambda x: x.repeat_interleave(repeats, dim=0))
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._check_rows(indices, "indices")
        self._follow_rows(lambda x: x[indices.to(x.device)])
        super().batch_select_indices(indices)

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if self.padding is not None:
            kept = self.padding[:, :self.get_seq_length()]
            self.padding = kept if bool(kept.any()) else None

    def fresh(self) -> "DistilledCache":
        """A new cache over the same compressed context (shared tensors), with nothing appended."""
        layers = []
        for layer in self.layers:
            P = layer.cached
            first = slice(None) if layer.per_sequence else 0  # one shared context: any row of a batch is it
            new = DistilledLayer(layer.keys[first, :, :P], layer.values[first, :, :P], layer.valid, layer.bias)
            layers.append(new)
        return DistilledCache(layers, self.n_context, context_ids=self.context_ids, compressed=self.compressed)


def _decoder(model):
    base = getattr(model, "model", model)
    if getattr(base, "layers", None) is None:
        raise ValueError(f"model {type(model).__name__} has no .model.layers: expected a Llama-family causal LM")
    return base


def _check_shape(model, layers: int, kv_heads: int) -> None:
    config = model.config
    want = (config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    if (layers, kv_heads) != want:
        raise ValueError(f"cache has {layers} layers × {kv_heads} KV heads, the model {want[0]} × {want[1]}")


def _check_layers(config, cache: "DistilledCache") -> None:
    """The cache's layers, KV heads and head_dim against the model's ``config`` (a hand-built cache failed deep in
    the attention, or with an IndexError past its last layer)."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    seen = (len(cache.layers), sorted({layer.heads for layer in cache.layers}),
            sorted({layer.keys.shape[-1] for layer in cache.layers}))
    if seen != (config.num_hidden_layers, [heads], [head_dim]):
        raise ValueError(f"the DistilledCache has {seen[0]} layers, KV heads {seen[1]}, head_dim {seen[2]}; the "
                         f"model {config.num_hidden_layers} layers of {heads} KV heads of head_dim {head_dim}: make "
                         "the cache for this model (zipkv.compress(model, ...))")


def _distilled_cache(args, kwargs) -> "DistilledCache | None":
    """The :class:`DistilledCache` among a call's arguments, or ``None``: found by its type, not its keyword (a
    forward pre-hook sees the caller's keywords, before transformers' ``deprecate_kwarg`` renames an old one)."""
    for name in CACHE_KEYWORDS:
        if isinstance(kwargs.get(name), DistilledCache):
            return kwargs[name]
    return next((value for value in (*kwargs.values(), *args) if isinstance(value, DistilledCache)), None)


def _parameters(function) -> dict:
    """The parameters of ``function`` behind transformers' decorators (``inspect.signature`` follows ``__wrapped__``)."""
    try:
        return dict(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return {}


def _check_hookable(base) -> None:
    """Refuse a decoder whose forward calls do not take the arguments the hooks replace: ``position_ids`` on the
    decoder, ``attention_mask`` on every layer's ``self_attn`` (else the mask would be dropped or passed twice)."""
    import transformers

    version = f"transformers {transformers.__version__}"
    if "position_ids" not in _parameters(base.forward):
        raise TypeError(f"{type(base).__name__}.forward takes {list(_parameters(base.forward))}: expected a "
                        f"position_ids parameter, which zipkv's positions hook sets ({version})")
    for index, layer in enumerate(base.layers):
        attention = getattr(layer, "self_attn", None)
        if not isinstance(attention, torch.nn.Module):
            raise TypeError(f"model.model.layers[{index}] ({type(layer).__name__}) has no self_attn module: expected "
                            "a Llama-family decoder layer, whose attention module zipkv's mask hook goes on")
        parameters = _parameters(attention.forward)
        if "attention_mask" not in parameters:
            raise TypeError(f"{type(attention).__name__}.forward takes {list(parameters)}: expected an attention_mask "
                            f"parameter, which zipkv's mask hook replaces ({version})")


_running = threading.local()
"""``depth``: the forwards of decoders with zipkv's hooks now running in this thread, whatever their cache: an
unmasked update outside all of them comes from a model without hooks."""


def _hooked_forwards() -> int:
    return getattr(_running, "depth", 0)


def _leave_hook(module, args, output):
    _running.depth = max(_hooked_forwards() - 1, 0)


def _positions_hook(module, args, kwargs):
    _running.depth = _hooked_forwards() + 1           # _leave_hook (always called, also on errors) takes it back
    cache = _distilled_cache(args, kwargs)
    if cache is None:
        return None
    _check_layers(module.config, cache)
    for layer in cache.layers:     # a forward starts: no layer is masked yet (an aborted forward may have left one)
        layer.entered, layer.armed = True, False
    ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    tokens = ids if ids is not None else embeds
    B, T = tokens.shape[:2]
    if T == 0:    # generate sliced away every input token: the cache still holds an earlier generate's tokens
        raise ValueError(f"no new input tokens: the DistilledCache still holds the {cache.get_seq_length()} tokens an "
                         "earlier generate appended after the context, and generate feeds only the input beyond them; "
                         "call cache.reset() before generating from the context again")
    padding = _padding(cache, kwargs.get("attention_mask"), B, T)
    ctx = cache.context_ids
    if ids is not None and ctx is not None and cache.get_seq_length() == 0 and _repeats_context(ids, ctx, padding):
        raise ValueError(f"input_ids begin with the {ctx.numel()} context tokens the cache already holds: pass only "
                         "the tokens after the context (positions continue at N by themselves)")
    start = cache.next_position
    if padding is None:
        kwargs["position_ids"] = torch.arange(start, start + T, device=tokens.device)[None].expand(B, -1)
    else:
        kwargs["position_ids"] = _token_positions(padding, cache.n_context)[:, -T:].to(tokens.device)
    cache.padding = padding
    fed = cache.fed_ids
    if fed is not None and start - cache.n_context == fed.shape[1] and ids is not None and fed.shape[0] in (1, B):
        cache.fed_ids = torch.cat([fed.expand(B, -1), ids.cpu().long()], dim=1)
    else:                                  # rows were fed another way (embeddings, or tokens not through this hook)
        cache.fed_ids = None
    return args, kwargs


def _padding(cache: "DistilledCache", mask, rows: int, new: int) -> torch.Tensor | None:
    """``[rows, appended + new]`` bool, True on the padded tokens of a forward of ``new`` tokens after ``cache``: from
    its 2-D ``attention_mask`` where that has zeros (one column per token after the context: the appended ones, then
    the new ones), else the padding the cache holds and none among the new tokens (an all-ones mask of any width, or
    none: ``generate`` builds one, or drops one, where the caller gave none); ``None`` where no token is padding."""
    held, past = cache.padding, cache.get_seq_length()
    if held is not None and held.shape[0] != rows:
        raise ValueError(f"a batch of {rows} sequences after a DistilledCache that holds the padded tokens of "
                         f"{held.shape[0]}: call cache.reset() to start again from the context, or continue those "
                         f"{held.shape[0]} sequences")
    if isinstance(mask, torch.Tensor) and mask.ndim == 2 and not bool(mask.bool().all()):
        if tuple(mask.shape) != (rows, past + new):
            raise ValueError(f"attention_mask has shape {tuple(mask.shape)} and padding: expected [{rows}, "
                             f"{past + new}], one column per token after the context (the {past} tokens the "
                             f"DistilledCache appended, then the {new} new ones); the context itself has no column")
        padding = mask.logical_not()
        earlier = padding.new_zeros(rows, past) if held is None else held.to(padding.device)
        if not torch.equal(padding[:, :past], earlier):
            raise ValueError(f"attention_mask marks other tokens among the {past} appended ones as padding than the "
                             "earlier forwards' masks: pass the mask they had, extended by ones for the tokens "
                             "generated since")
    elif held is not None:
        padding = torch.cat([held, held.new_zeros(rows, new)], dim=1)
    else:
        return None
    return padding if bool(padding.any()) else None


def _repeats_context(ids: torch.Tensor, context: torch.Tensor, padding: torch.Tensor | None) -> bool:
    """Whether a row of ``ids`` ``[B, T]`` begins with the ``context`` ids (a padded row: its tokens where
    ``padding`` ``[B, T]`` is False)."""
    n = context.numel()
    rows = ids.cpu() if padding is None else [row[~pad] for row, pad in zip(ids.cpu(), padding.cpu())]
    return any(len(row) >= n and bool((row[:n] == context).all()) for row in rows)


def _checked_generate(self, *args, **kwargs):
    """The model class's ``generate``, refusing an input that does not continue a :class:`DistilledCache` it is given
    (:meth:`DistilledCache.check_continuation`); bound to the model by :func:`attach` (a copy of the model rebinds it).
    A DistilledCache given as ``past_key_values=`` or ``cache=`` goes on under the name the installed transformers
    takes (:func:`zipkv.models.cache_keyword`), so either spelling runs on every version without a deprecation."""
    cache = _distilled_cache((), kwargs)
    if cache is not None:
        ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
        embedding = self.get_input_embeddings() if hasattr(self, "get_input_embeddings") else None
        vocab = getattr(embedding, "num_embeddings", None) or getattr(self.config, "vocab_size", None)
        if isinstance(ids, torch.Tensor) and ids.numel() and not ids.is_floating_point() and isinstance(vocab, int) \
                and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(f"input_ids holds ids in [{int(ids.min())}, {int(ids.max())}]: expected token ids in "
                             f"[0, {vocab - 1}] (the model's vocabulary of {vocab})")
        cache.check_continuation(ids)
        keyword = cache_keyword(self)
        given = [name for name in CACHE_KEYWORDS if kwargs.get(name) is cache]
        if given and keyword not in kwargs:
            kwargs[keyword] = kwargs.pop(given[0])
    return type(self).generate(self, *args, **kwargs)


def _generate_checked(model) -> bool:
    bound = vars(model).get("generate")
    return isinstance(bound, types.MethodType) and bound.__func__ is _checked_generate


def _mask_hook(module, args, kwargs):
    cache = _distilled_cache(args, kwargs)
    if cache is None:
        return None
    implementation = module.config._attn_implementation
    if implementation not in SUPPORTED_ATTENTION:
        raise ValueError(f"attn_implementation={implementation!r}: a DistilledCache needs one of "
                         f"{list(SUPPORTED_ATTENTION)} (per-head masks); model.set_attn_implementation('sdpa')")
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    layer = cache.layers[module.layer_idx]
    if layer.keys.dtype != hidden.dtype or layer.keys.device != hidden.device:
        raise ValueError(f"the DistilledCache holds {layer.keys.dtype} on {layer.keys.device}, the model runs "
                         f"{hidden.dtype} on {hidden.device}: make the cache for this model, "
                         "DistilledCache.from_compressed(cache.compressed, model)")
    rows, batch = layer.keys.shape[0], hidden.shape[0]
    if layer.per_sequence and rows != batch:   # generate repeats each sequence (num_return_sequences, num_beams)
        if batch % rows:
            raise ValueError(f"a batch of {batch} sequences after a cache of {rows} sequences' own pairs: expected a "
                             "multiple (generate repeats each sequence for num_return_sequences or num_beams)")
        layer.batch_repeat_interleave(batch // rows)
    group = module.config.num_attention_heads // layer.heads
    kwargs["attention_mask"] = layer.additive_mask(hidden.shape[1], group, hidden.dtype,
                                                   window=attention_window(module),
                                                   n_context=cache.n_context, padding=cache.padding)
    layer.armed = True
    return args, kwargs


def attach(model):
    """Register the hooks a :class:`DistilledCache` needs on ``model`` (once; idempotent): the two pre-hooks, and a
    hook after the decoder's forward that tells an unmasked update's error whether it ran inside a hooked model.

    They act only on forwards given a :class:`DistilledCache` (as ``past_key_values=`` or ``cache=``); every other
    forward runs exactly as before. Returns ``model``. :func:`detach` removes them. A ``TypeError`` where the
    decoder's or its attention modules' forward lacks the argument a hook sets (``position_ids``, ``attention_mask``).
    """
    if getattr(model, "_zipkv_cache_hooks", None):
        return model
    base = _decoder(model)
    _check_hookable(base)
    handles = [base.register_forward_pre_hook(_positions_hook, with_kwargs=True),
               base.register_forward_hook(_leave_hook, always_call=True)]
    for layer in base.layers:
        handles.append(layer.self_attn.register_forward_pre_hook(_mask_hook, with_kwargs=True))
    model._zipkv_cache_hooks = handles
    if not _generate_checked(model):
        model.generate = types.MethodType(_checked_generate, model)
    return model


def detach(model) -> None:
    """Remove :func:`attach`'s hooks from ``model``."""
    for handle in getattr(model, "_zipkv_cache_hooks", None) or []:
        handle.remove()
    model._zipkv_cache_hooks = None
    if _generate_checked(model):
        del model.generate                                    # the class's own generate again
