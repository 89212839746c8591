"""zipkv and NVIDIA's kvpress (``pip install kvpress``, its ``BasePress`` presses run as forward hooks during prefill).

* :class:`ZipkvPress` -- zipkv's distiller as a kvpress press: ``with ZipkvPress(0.7)(model): model.model(ids,
  past_key_values=cache)``, or ``pipeline("kv-press-text-generation", ...)(context, question=..., press=press)``.
* :func:`kl_table` -- kvpress's own presses (the package's code, :data:`PRESSES`) beside zipkv's distillers under the
  KL protocol of the book's "Beyond the paper" chapter: the context compressed during prefill, the continuation
  teacher-forced at its original positions ``N … N+C−1``, KL(full ‖ compressed) of the next-token distributions.

What kvpress's cache cannot carry, and what the press does instead:

* **the per-key logit bias β** (a term added to a cached key's logits whatever the query; kvpress's cache holds only
  keys and values): :class:`ZipkvPress` fits zipkv's distiller with ``ZipkvConfig(bias=False)`` -- the same kept
  keys, values refitted by ridge regression without β. Its KL against zipkv's own cache is the method
  ``zipkv_press`` beside ``zipkv`` in :func:`kl_table`.
* **per-head and per-layer lengths**: carried exactly, as kvpress's AdaKV carries per-head ones: every compressed
  layer is padded to the longest layer's longest head (transformers builds one mask for all of them) and the padding
  masked by kvpress's attention patch (``module.masked_key_indices``, a key whose weight underflows to 0); the padded
  pairs still take memory, as AdaKV's do.

kvpress pins ``transformers<5.3``: this module runs in ``make venv-kvpress``'s environment (README, "zipkv and
kvpress"); zipkv's own calls run there too (transformers 5.2 passes a tensor to ``get_mask_sizes``, which
:class:`zipkv.cache.DistilledCache` takes).
"""
from __future__ import annotations

import functools
import inspect
import math
import numbers
from importlib import metadata as _metadata
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Sequence

import torch

try:
    import kvpress
    from kvpress import AdaKVPress, BasePress, KVzipPress, ScorerPress
    KVPRESS_VERSION = _metadata.version("kvpress")
    """The installed kvpress's version, recorded in every row of :func:`kl_table` (``None`` without kvpress)."""
    _MISSING = None
except ImportError as err:     # the module imports (the library's import checks walk it); every entry point refuses
    kvpress = AdaKVPress = KVzipPress = ScorerPress = KVPRESS_VERSION = None
    BasePress = object
    _MISSING = err


def _require() -> None:
    if _MISSING is not None:
        raise ImportError("zipkv.integrations.kvpress needs kvpress (pip install kvpress==0.5.5, which pins "
                          "transformers<5.3): `make venv-kvpress` builds .venv-kvpress with it") from _MISSING


__all__ = ["KVPRESS_VERSION", "PRESSES", "ZIPKV_METHODS", "ZipkvPress", "kl_table", "press_cache", "summary"]


PRESSES = {
    "kvzip": "KVzipPress", "expected_attention": "ExpectedAttentionPress", "snapkv": "SnapKVPress",
    "tova": "TOVAPress", "keydiff": "KeyDiffPress", "compactor": "CompactorPress", "streaming_llm": "StreamingLLMPress",
    "knorm": "KnormPress",
}
"""kvpress's presses of :func:`kl_table` (their kvpress class names), each made with ``compression_ratio = 1 −
kept_fraction`` and
kvpress's defaults; ``"adakv_<name>"`` wraps a :class:`kvpress.ScorerPress` among them in :class:`kvpress.AdaKVPress`
(head-wise budgets)."""

ZIPKV_METHODS = ("zipkv", "zipkv_press", "attention_matching", "kvsculpt", "select_fit", "select_fit_dense")
"""zipkv's methods of :func:`kl_table`: :func:`zipkv.compress`'s ``zipkv``, ``attention_matching``, ``kvsculpt`` and
``select_fit`` (KVSculpt's queries), ``select_fit_dense`` (Select+Fit with ``n_synthetic = N``), and ``zipkv_press``:
:class:`ZipkvPress` (no bias) run by kvpress's hooks."""


def _kept_fraction(value, name: str = "kept_fraction") -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= 1:
        raise ValueError(f"{name}={value!r}: expected the fraction of the context's KV pairs kept, in (0, 1]")
    return float(value)


def _attention_modules(model):
    base = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return [layer.self_attn for layer in base.layers]


def _clear_masks(model) -> None:
    """Forget kvpress's head-wise masks (``masked_key_indices``): kvpress's attention patch applies them to every
    later forward whose keys outnumber its queries, whatever cache it runs on."""
    for module in _attention_modules(model):
        module.masked_key_indices = None


@dataclass
class ZipkvPress(BasePress):
    """zipkv's distiller (:func:`zipkv.compress`, ``method="zipkv"``) as a kvpress press, without the per-key bias.

    The press is a whole-context press, as kvpress's ``KVzipPress`` is: a hook after the decoder's prefill forward
    distils the context (zipkv's probe samples the model's own continuation, which needs the whole model) and writes
    each compressed layer into kvpress's cache, padded to its longest head with the padding masked as AdaKV's.
    Sliding-window layers (Gemma 3's local ones) are left as the model's cache holds them, as zipkv leaves them.

    Attributes:
        compression_ratio: kvpress's convention, the fraction of the context's pairs removed (``1 −`` zipkv's
            ``kept_fraction``).
        probe_tokens, seed, m: :func:`zipkv.compress`'s (``m``: ``None`` for its default verbatim window).
        cache: the :class:`zipkv.cache.DistilledCache` (no bias) of the last context compressed.
    """

    compression_ratio: float = 0.0
    probe_tokens: int = 64
    seed: int = 0
    m: int | None = None
    cache: object = field(default=None, init=False, repr=False)

    def __post_init__(self):
        _require()
        ratio = self.compression_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not 0 <= ratio < 1:
            raise ValueError(f"compression_ratio={ratio!r}: expected kvpress's fraction of the pairs removed, in "
                             "[0, 1) (zipkv's kept_fraction = 1 − compression_ratio)")
        if isinstance(self.probe_tokens, bool) or not isinstance(self.probe_tokens, numbers.Integral) \
                or self.probe_tokens < 1:
            raise ValueError(f"probe_tokens={self.probe_tokens!r}: expected an int ≥ 1")
        self._busy = False

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        raise NotImplementedError("ZipkvPress compresses the whole context after the decoder's prefill (its probe "
                                  "runs the model), not one layer inside its forward: use `with press(model):`")

    def distil(self, model, context_ids: torch.Tensor):
        """zipkv's no-bias :class:`~zipkv.cache.DistilledCache` of ``context_ids`` ``[N]`` (what the press writes)."""
        import zipkv
        from zipkv.distill.generalise import ZipkvConfig

        return zipkv.compress(model, context_ids, kept_fraction=1.0 - self.compression_ratio, m=self.m,
                              seed=self.seed, probe_tokens=self.probe_tokens, config=ZipkvConfig(bias=False))

    def _after_decoder(self, decoder, args, kwargs, output):
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("past_key_values")
        if self._busy or self.compression_ratio == 0 or ids is None or cache is None:
            return output
        if ids.shape[0] != 1 or cache.get_seq_length() != ids.shape[1]:
            return output                          # not a prefill of one context (kvpress's presses: batch 1)
        self._busy = True                          # zipkv's own forwards below run through this hook too
        try:
            self.cache = distilled = self.distil(self._model, ids[0])
        finally:
            self._busy = False
        write(cache, distilled, self._model)
        return output

    @contextmanager
    def __call__(self, model):
        self._model = model
        decoder = model.model.language_model if hasattr(model.model, "language_model") else model.model
        hook = decoder.register_forward_hook(self._after_decoder, with_kwargs=True)
        try:
            yield
        finally:
            hook.remove()


def write(cache, distilled, model) -> None:
    """Write a :class:`zipkv.cache.DistilledCache`'s compressed layers into kvpress's ``DynamicCache`` (batch 1),
    all padded to the longest layer's longest head with the padding masked by kvpress's head-wise mask. A ``ValueError`` if the
    distilled cache carries a logit bias (kvpress's cache cannot)."""
    from zipkv.models import sliding_windows

    windows = sliding_windows(model)
    compressed = [index for index, window in enumerate(windows) if window is None]
    # transformers builds one attention mask for all global layers from the first one's length: every layer is
    # padded to the longest (zipkv's budget differs per layer too), the padding masked like a head's
    P = max(distilled.layers[index].cached for index in compressed)
    # and where the model keeps sliding-window layers (Gemma 3), to their length: transformers takes the new tokens'
    # cache positions from the first layer, a sliding one, for every layer's causal mask (a shorter global layer would
    # let each new token see the next one's key)
    P = max([P] + [cache.layers[index].keys.shape[2] for index, window in enumerate(windows) if window is not None])
    modules = _attention_modules(model)
    for index in compressed:
        layer, target = distilled.layers[index], cache.layers[index]
        if bool((layer.bias[layer.valid] != 0).any()):
            raise ValueError(f"layer {index} of the distilled cache has a nonzero logit bias: kvpress's cache holds "
                             "keys and values only (fit with ZipkvConfig(bias=False))")
        valid = torch.zeros(layer.valid.shape[0], P, dtype=torch.bool, device=layer.valid.device)
        valid[:, :layer.cached] = layer.valid
        pad = (0, 0, 0, P - layer.cached)
        target.keys = torch.nn.functional.pad(layer.keys[:, :, :layer.cached], pad).to(target.keys.dtype)
        target.values = torch.nn.functional.pad(layer.values[:, :, :layer.cached], pad).to(target.values.dtype)
        heads, seq = (~valid).nonzero(as_tuple=True)
        modules[index].masked_key_indices = (torch.zeros_like(heads), heads, seq) if heads.numel() else None


def _press(name: str, kept_fraction: float):
    ratio = 1.0 - kept_fraction
    if name.startswith("adakv_"):
        inner = _press(name[len("adakv_"):], kept_fraction)
        if not isinstance(inner, ScorerPress):
            raise ValueError(f"method {name!r}: AdaKV wraps a kvpress ScorerPress, {type(inner).__name__} is not one")
        return AdaKVPress(inner)
    if name not in PRESSES:
        raise ValueError(f"method {name!r}: expected one of {sorted(PRESSES)}, 'adakv_<press>', or {ZIPKV_METHODS}")
    return getattr(kvpress, PRESSES[name])(compression_ratio=ratio)


@contextmanager
def _applied(press, model):
    """``press(model)``; on a model with sliding-window layers other than kvpress's Gemma 3 class, its hooks on the
    global layers only (kvpress's own rule for ``Gemma3ForConditionalGeneration``; zipkv leaves them as well)."""
    from zipkv.models import sliding_windows

    windows = sliding_windows(model)
    if press is None:
        yield
        return
    if all(w is None for w in windows) or isinstance(press, (ZipkvPress, KVzipPress)):
        with press(model):
            yield
        return
    press.post_init_from_model(model)
    base = model.model.language_model if hasattr(model.model, "language_model") else model.model
    rope = base.rotary_emb
    if "layer_type" in inspect.signature(rope.forward).parameters:   # Gemma 3: one RoPE per layer type; the
        rope = functools.partial(rope, layer_type="full_attention")   # presses' own calls name none
    hooks = []
    try:
        for layer, window in zip(base.layers, windows):
            if window is None:
                layer.self_attn.rotary_emb = rope
                hooks.append(layer.self_attn.register_forward_hook(press.forward_hook, with_kwargs=True))
        yield
    finally:
        for hook in hooks:
            hook.remove()


@torch.no_grad()
def press_cache(model, press, context_ids: torch.Tensor, tokenizer=None):
    """kvpress's ``DynamicCache`` of ``context_ids`` ``[N]`` prefilled under ``press`` (as kvpress's pipeline does;
    ``None``: uncompressed), and the seconds it took (the prefill and the compression). KVzip needs ``tokenizer``
    (its repeat prompt)."""
    from transformers import DynamicCache

    _require()
    _clear_masks(model)
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)   # layer types known: the global layers set the full mask (Gemma 3)
    ids = torch.as_tensor(context_ids).reshape(1, -1).to(device)
    if isinstance(press, KVzipPress):
        if tokenizer is None:
            raise ValueError("KVzip needs tokenizer= (kvpress's KVzip loads it from model.config.name_or_path, which "
                             "zipkv's embedded models do not point at)")
        import tempfile

        name = model.config.name_or_path
        with tempfile.TemporaryDirectory() as folder:
            tokenizer.save_pretrained(folder)
            model.config.name_or_path = folder
            try:
                # kvpress's KVzip takes the first tokens of the context for the chat template's prefix, whose
                # scores it leaves at 0; the KL protocol's contexts are plain book text, so it is told there is none.
                with _applied(press, model):
                    press.prefix_length = 0
                    started = time.perf_counter()
                    model.model(input_ids=ids, past_key_values=cache)
            finally:
                model.config.name_or_path = name
    else:
        with _applied(press, model):
            started = time.perf_counter()
            model.model(input_ids=ids, past_key_values=cache)
    seconds = time.perf_counter() - started
    if press is not None and not isinstance(press, ZipkvPress):
        _align(cache, model)
    return cache, seconds


def _align(cache, model) -> None:
    """Pad a press's shortened global layers to the sliding-window layers' length, the padding masked by kvpress's
    head-wise mask (merged with the press's own), on a model that has both kinds of layer (Gemma 3): transformers
    takes the new tokens' cache positions from the first layer, a sliding one, for every layer's causal mask, so a
    shorter global layer would let each new token see the next one's key. Models without sliding layers: unchanged."""
    from zipkv.models import sliding_windows

    windows = sliding_windows(model)
    target = max([cache.layers[i].keys.shape[2] for i, window in enumerate(windows) if window is not None], default=0)
    for index, (module, window) in enumerate(zip(_attention_modules(model), windows)):
        layer = cache.layers[index]
        length = layer.keys.shape[2]
        if window is not None or length >= target:
            continue
        pad = (0, 0, 0, target - length)
        layer.keys = torch.nn.functional.pad(layer.keys, pad)
        layer.values = torch.nn.functional.pad(layer.values, pad)
        batch, heads = layer.keys.shape[:2]
        seq = torch.arange(length, target, device=layer.keys.device).repeat(batch * heads)
        head = torch.arange(heads, device=seq.device).repeat_interleave(target - length).repeat(batch)
        row = torch.arange(batch, device=seq.device).repeat_interleave(heads * (target - length))
        masked = getattr(module, "masked_key_indices", None)
        if masked is not None:
            row, head, seq = (torch.cat([a, b.to(a.device)]) for a, b in zip(masked, (row, head, seq)))
        module.masked_key_indices = (row, head, seq)


@torch.no_grad()
def _continuation_logits(model, cache, n_context: int, continuation_ids: torch.Tensor) -> torch.Tensor:
    """``[C, vocab]`` float32 logits of the continuation teacher-forced after ``cache`` at positions ``N … N+C−1``."""
    device = next(model.parameters()).device
    ids = torch.as_tensor(continuation_ids).reshape(1, -1).to(device)
    positions = torch.arange(n_context, n_context + ids.shape[1], device=device)[None]
    return model(input_ids=ids, past_key_values=cache, position_ids=positions).logits[0].float()


def _kept(cache, model, n_context: int) -> float:
    """The mean fraction of the context's pairs a kvpress cache keeps per KV head over the compressed layers (a
    head-wise mask counts as removed)."""
    from zipkv.models import sliding_windows

    kept, count = 0.0, 0
    for index, (module, window) in enumerate(zip(_attention_modules(model), sliding_windows(model))):
        if window is not None:
            continue
        keys = cache.layers[index].keys
        heads = keys.shape[1]
        masked = getattr(module, "masked_key_indices", None)
        removed = 0 if masked is None else masked[0].numel()
        kept += (keys.shape[2] * heads - removed) / (n_context * heads)
        count += 1
    return kept / count


def _kept_distilled(distilled, model, n_context: int) -> float:
    """:func:`_kept` for a :class:`zipkv.cache.DistilledCache`."""
    from zipkv.models import sliding_windows

    shares = [float(layer.valid.sum()) / (layer.valid.shape[-2] * n_context)
              for layer, window in zip(distilled.layers, sliding_windows(model)) if window is None]
    return sum(shares) / len(shares)


def kl_table(model, windows: Sequence, kept_fractions: Sequence[float], methods: Sequence[str] | None = None, *,
             tokenizer=None, probe_tokens: int = 64, steps: int = 100, n_synthetic: int = 128, seed: int = 0,
             progress: bool = False):
    """KL(full ‖ compressed) and seconds of kvpress's presses and zipkv's distillers on the same windows.

    Each window's context is compressed (a kvpress press during the prefill, as its pipeline does; zipkv's methods
    through :func:`zipkv.compress`) and its continuation teacher-forced at its original positions; the KL of the
    next-token distributions is averaged over the continuation (the "Beyond the paper" chapter's protocol; one full
    reference per window through the same ``DynamicCache`` path as the presses).

    Args:
        model: a Hugging Face causal LM kvpress supports (Llama, Qwen, Mistral, Phi-3; Gemma 3 without KVzip).
        windows: :class:`zipkv.data.Window` objects (context ``N`` + continuation ``C``).
        kept_fractions: fractions of the context's pairs kept per KV head, each in (0, 1).
        methods: names from :data:`PRESSES`, ``"adakv_<press>"`` and :data:`ZIPKV_METHODS` (default: all of
            them with AdaKV around every ScorerPress, KVSculpt left out: its 100 L-BFGS steps cost most of a run).
        tokenizer: the model's (KVzip's repeat prompt; without it KVzip's rows hold its error).
        probe_tokens: zipkv's and Attention Matching's sampled continuation.
        steps, n_synthetic: KVSculpt's and Select+Fit's (the paper: 100 steps, 128 synthetic queries).
        seed: every method's seed (zipkv's probe: ``seed + window``).
        progress: print one line per row.

    Returns:
        A ``pandas.DataFrame``: ``model, window, N, C, kept_fraction, method, kl, seconds, kept, kvpress,
        transformers`` (``kept``: the mean fraction of pairs each compressed layer's heads really keep; ``kvpress``:
        the version that ran the presses; a method kvpress does not run on the model gets ``kl`` NaN and its error in
        ``note``).
    """
    _require()
    import pandas as pd
    import transformers

    import zipkv
    from zipkv.distill.evaluate import kl_divergence, teacher_force
    from zipkv.models import model_shape

    fractions = [_kept_fraction(f) for f in kept_fractions]
    if not fractions or any(f >= 1 for f in fractions):
        raise ValueError(f"kept_fractions={list(kept_fractions)!r}: expected a non-empty list of fractions in (0, 1)")
    def scorer(name):
        return issubclass(getattr(kvpress, PRESSES[name]), ScorerPress)

    if methods is None:
        methods = [*PRESSES, *(f"adakv_{n}" for n in PRESSES if scorer(n)),
                   *(m for m in ZIPKV_METHODS if m != "kvsculpt")]
    for name in methods:
        base = name[len("adakv_"):] if isinstance(name, str) and name.startswith("adakv_") else name
        if name not in ZIPKV_METHODS and (base not in PRESSES or base != name and not scorer(base)):
            raise ValueError(f"methods has {name!r}: expected names from {sorted(PRESSES)}, 'adakv_<press>' of a "
                             f"ScorerPress among them, or {list(ZIPKV_METHODS)}")
    if not len(windows):
        raise ValueError("windows is empty: expected zipkv.data.Window objects")
    name = model_shape(model).name
    rows = []
    for w, window in enumerate(windows):
        N, continuation = window.context, window.continuation_ids
        full, _ = press_cache(model, None, window.context_ids)
        reference = _continuation_logits(model, full, N, continuation)
        for fraction in fractions:
            for method in methods:
                note = ""
                try:
                    if method in ZIPKV_METHODS and method != "zipkv_press":
                        settings = dict(kept_fraction=fraction, seed=seed + w)
                        if method in ("zipkv", "attention_matching"):
                            settings["probe_tokens"] = probe_tokens
                        elif method == "select_fit_dense":
                            settings.update(method="select_fit", n_synthetic=N, steps=steps)
                        else:
                            settings.update(n_synthetic=n_synthetic, steps=steps)
                        settings.setdefault("method", method)
                        started = time.perf_counter()
                        distilled = zipkv.compress(model, window.context_ids, **settings)
                        seconds = time.perf_counter() - started
                        logits = teacher_force(model, distilled, continuation).logits
                        kept = _kept_distilled(distilled, model, N)
                    else:
                        press = (ZipkvPress(1.0 - fraction, probe_tokens=probe_tokens, seed=seed + w)
                                 if method == "zipkv_press" else _press(method, fraction))
                        cache, seconds = press_cache(model, press, window.context_ids, tokenizer)
                        kept = _kept(cache, model, N)
                        logits = _continuation_logits(model, cache, N, continuation)
                        _clear_masks(model)
                    kl = float(kl_divergence(reference, logits).mean())
                except (ValueError, AssertionError, NotImplementedError, RuntimeError, AttributeError, TypeError) as err:
                    _clear_masks(model)
                    kl, seconds, kept, note = math.nan, math.nan, math.nan, f"{type(err).__name__}: {err}"[:200]
                rows.append(dict(model=name, window=w, N=N, C=int(continuation.numel()), kept_fraction=fraction,
                                 method=method, kl=kl, seconds=seconds, kept=kept, kvpress=KVPRESS_VERSION,
                                 transformers=transformers.__version__, note=note))
                if progress:
                    print(f"window {w} kept {fraction:g} {method}: KL {kl:.4g}, {seconds:.1f} s", flush=True)
    return pd.DataFrame(rows)


def summary(table):
    """Per model, kept fraction and method: mean and median KL, mean seconds, windows; ``best press`` rows pick,
    per model and kept fraction, kvpress's press with the lowest mean KL (and the best under AdaKV); ``ratio to best
    press`` divides each method's mean KL by that press's."""
    import pandas as pd

    ok = table.dropna(subset=["kl"])
    stats = (ok.groupby(["model", "kept_fraction", "method"])
             .agg(mean_kl=("kl", "mean"), median_kl=("kl", "median"), seconds=("seconds", "mean"),
                  windows=("window", "nunique")).reset_index())
    presses = stats[~stats.method.isin(ZIPKV_METHODS)]
    best = presses.loc[presses.groupby(["model", "kept_fraction"]).mean_kl.idxmin(), ["model", "kept_fraction",
                                                                                       "method", "mean_kl"]]
    best = best.rename(columns={"method": "best_press", "mean_kl": "best_press_kl"})
    stats = stats.merge(best, on=["model", "kept_fraction"], how="left")
    stats["ratio_to_best_press"] = stats.mean_kl / stats.best_press_kl
    return pd.DataFrame(stats).sort_values(["model", "kept_fraction", "mean_kl"]).reset_index(drop=True)
