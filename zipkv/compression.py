"""The library's front door: :func:`compress` distils a context's KV cache into a :class:`zipkv.cache.DistilledCache`
that ``model.generate`` takes, with the distiller a user asks for (zipkv's own by default)::

    cache = zipkv.compress(model, context_ids, kept_fraction=0.3)
    out = model.generate(next_ids, past_key_values=cache, max_new_tokens=64)

It sits above both the cache (:mod:`zipkv.cache`, the ``transformers`` ``Cache``) and the distillers
(:mod:`zipkv.distill`), which use the cache for their own forward passes.
"""
from __future__ import annotations

import math
import numbers

import torch

from .cache import SUPPORTED_ATTENTION, DistilledCache

__all__ = ["METHODS", "MIN_CONTEXT", "compress", "kept_pairs", "verbatim_window"]


METHODS = ("zipkv", "attention_matching", "kvsculpt", "select_fit", "attention_score", "joint_opt", "random")
"""The methods of :func:`compress`, the default first: zipkv's own distiller (the lowest KL in the book's comparison,
"Beyond the paper"), Attention Matching (its three key constructions, the one with the lowest validation objective
kept), KVSculpt (the paper), then KVSculpt §4's baselines."""

MIN_CONTEXT = 16
"""The shortest context :func:`compress` takes: one page of tokens."""

_KVSCULPT_SETTINGS = ("n_synthetic", "strategy", "budget", "config", "joint_config", "pilot_steps", "alpha", "scale",
                      "solver", "problems")
_SETTINGS = {
    "zipkv": ("probe_tokens", "probe", "budget", "alpha", "cascade", "config"),
    "attention_matching": ("probe_tokens", "probe", "config"),
    **{name: _KVSCULPT_SETTINGS for name in ("kvsculpt", "select_fit", "attention_score", "joint_opt", "random")},
}
"""Each method's settings beyond ``kept_fraction``/``kept_tokens``, ``m`` and ``seed``."""


def verbatim_window(kept_pairs: int) -> int:
    """The default ``m``: the context's last tokens kept as they are, half the pairs kept per head, at most 256 (the
    papers' retain zone at N = 2048)."""
    return min(256, kept_pairs // 2)


def kept_pairs(n_context: int, kept_fraction=None, kept_tokens=None) -> int:
    """Pairs kept per KV head on average for a context of ``n_context`` tokens, from the fraction kept or a token
    budget (exactly one; neither: 0.3 of the context). A ``ValueError``/``TypeError`` naming the argument otherwise."""
    if kept_fraction is not None and kept_tokens is not None:
        raise ValueError(f"kept_fraction={kept_fraction!r} and kept_tokens={kept_tokens!r}: give one budget, the "
                         "fraction of the context kept or the number of tokens kept")
    if kept_tokens is not None:
        if isinstance(kept_tokens, bool) or not isinstance(kept_tokens, numbers.Integral):
            raise TypeError(f"kept_tokens={kept_tokens!r}: expected an int, the KV pairs kept per head")
        if not 2 <= kept_tokens <= n_context:
            raise ValueError(f"kept_tokens={kept_tokens}: expected 2 ≤ kept_tokens ≤ N = {n_context}, the context's "
                             "length (the pairs kept per head)")
        return int(kept_tokens)
    fraction = 0.3 if kept_fraction is None else kept_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) or not math.isfinite(fraction):
        raise TypeError(f"kept_fraction={fraction!r}: expected a number, the fraction of the context kept")
    kept = round(float(fraction) * n_context)
    if not 0 < fraction <= 1 or kept < 2:
        raise ValueError(f"kept_fraction={fraction!r}: expected the fraction of the context kept, in (0, 1], keeping "
                         f"at least 2 of the N = {n_context} tokens' pairs per head (kvpress's compression_ratio is "
                         "the fraction removed: kept_fraction = 1 - compression_ratio)")
    return kept


def _check_settings(method: str, settings: dict) -> None:
    """Settings :func:`compress` does not take for ``method``: a ``TypeError`` naming the nearest valid one."""
    import difflib

    from .distill.problem import SculptConfig

    solver_fields = tuple(SculptConfig.__dataclass_fields__) if _SETTINGS[method] == _KVSCULPT_SETTINGS else ()
    allowed = ("kept_fraction", "kept_tokens", "m", "seed", "progress") + _SETTINGS[method] + solver_fields
    for name in settings:
        if name in allowed:
            continue
        if name == "ratio":
            raise TypeError("ratio= is now kept_fraction= (the fraction of the context's KV pairs kept, r = (k + m)/N "
                            "in KVSculpt's notation; kvpress's compression_ratio is the fraction removed)")
        near = difflib.get_close_matches(name, allowed, n=1)
        hint = f" (did you mean {near[0]}=?)" if near else ""
        raise TypeError(f"compress(method={method!r}) got an unexpected setting {name}={settings[name]!r}{hint}; it "
                        f"takes {sorted(allowed)}")


def compress(model, input_ids: torch.Tensor, kept_fraction: float | None = None, *, kept_tokens: int | None = None,
             method: str = "zipkv", m: int | None = None, seed: int = 0, progress: bool = False,
             **settings) -> DistilledCache:
    """Compress the KV cache of the context ``input_ids`` into fewer pairs per KV head, for ``generate``.

    The default method is zipkv's own distiller (:mod:`zipkv.distill.generalise`, "Beyond the paper" in the book):
    the model samples ``probe_tokens`` tokens of its own continuation, the KL on them when one head alone is
    compressed splits the pairs over layers and heads, and each layer is fitted to future queries and the probe's
    on-policy queries -- old keys kept, a per-key logit bias matching the attention mass of the dropped ones,
    values by ridge regression.

    Cost (:func:`zipkv.bench.distill.compress_speed`, the book's distillation-speed chapter,
    ``results/paper/distill_speed_compress.csv``): on an H200 with every default, 7.3 s per 2,048-token context at
    SmolLM2-135M's shape, 14.5 s at Llama-3.1-8B's, 176 s for 32,768 tokens at Llama-3.1-8B's (the first run, before
    the query-space solves that long contexts now take); about half of it the probe's 64 sampled tokens and the
    two fits. On 2 CPU cores the embedded model takes about 30 s for a 256-token context. Every cost grows with the
    context's length and the model's layers and KV heads; the distiller's memory peaks at the ``[queries, N]``
    score matrix of one layer (:attr:`~zipkv.distill.generalise.ZipkvConfig.max_scores`).

    Args:
        model: a Hugging Face causal LM with rotary position embeddings (Llama, Mistral, Qwen, Gemma families).
        input_ids: ``[N]`` or ``[1, N]`` context token ids, ``N ≥`` :data:`MIN_CONTEXT`.
        kept_fraction: the fraction of the context's KV pairs kept per head on average (default 0.3): KVSculpt's
            ``r = (k + m)/N``. Not kvpress's ``compression_ratio``, the fraction removed.
        kept_tokens: instead, the number of pairs kept per head on average (a token budget).
        method: one of :data:`METHODS`.
        m: the context's last ``m`` tokens kept verbatim (default :func:`verbatim_window`: half the pairs kept, at
            most 256).
        seed: the probe's sampling seed (zipkv, Attention Matching) or KVSculpt's synthetic queries'.
        progress: a progress bar over the layers (zipkv's uniform fit).
        settings: the method's own (a ``TypeError`` names any other before any work):
            zipkv -- ``probe_tokens`` (64), ``probe`` (None: the sampled continuation; else token ids ``[P]``
            teacher-forced after the context instead, e.g. :func:`zipkv.pipeline.reconstruction_probe`'s
            repeat-the-context prompt, KVzip's queries, for questions about the context: P forward tokens per head
            variant, so it costs about P/64 times the default's head-sensitivity phase), ``budget``
            (``"probe"``, or ``"uniform"``/``"pilot"``), ``alpha``, ``cascade`` (True), ``config``
            (:class:`~zipkv.distill.generalise.ZipkvConfig`);
            attention_matching -- ``probe_tokens``, ``probe``, ``config`` (an
            :class:`~zipkv.distill.attention_matching.AttentionMatchingConfig`: that construction alone);
            KVSculpt and its baselines -- :func:`zipkv.distill.kvsculpt.compress`'s (``n_synthetic``, ``budget``,
            ``config``, …) or :class:`~zipkv.distill.SculptConfig`'s fields (``steps=20``, ``device=…``).

    Returns:
        A :class:`DistilledCache` in the model's dtype and device, for ``model.generate(next_ids,
        past_key_values=cache, ...)`` where ``next_ids`` are the tokens after the context; ``cache.memory()``
        compares its bytes with the full cache's.
    """
    from .distill import batched
    from .distill.kvsculpt import budget_for_ratio, check_settings, compress as compress_capture, solver_named
    from .distill.problem import SculptConfig
    from .models import capture, check_rope_model

    check_rope_model(model)
    ids = _token_tensor(input_ids, "input_ids")
    if ids.ndim != 1 or ids.numel() < MIN_CONTEXT or ids.is_floating_point():
        raise ValueError(f"input_ids has shape {tuple(torch.as_tensor(input_ids).shape)} and dtype {ids.dtype}: "
                         f"expected integer token ids [N] or [1, N], N ≥ {MIN_CONTEXT}")
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method={method!r} is not a compression method: expected one of {list(METHODS)}")
    _check_settings(method, settings)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed={seed!r}: expected an int")
    if not -2 ** 62 <= seed < 2 ** 62:
        raise ValueError(f"seed={seed}: expected an int in [-2**62, 2**62) (torch.Generator's seeds, with room for "
                         "the offsets per layer and head that the distillers add)")
    if not isinstance(progress, bool):
        raise TypeError(f"progress={progress!r}: expected True (a progress bar over the layers) or False")
    N = ids.numel()
    kept = kept_pairs(N, kept_fraction, kept_tokens)
    if m is None:
        m = verbatim_window(kept)
    elif isinstance(m, bool) or not isinstance(m, numbers.Integral) or not 0 <= m < kept:
        raise ValueError(f"m={m!r}: expected an int, 0 ≤ m < {kept} (the pairs kept per head), the last tokens "
                         "kept verbatim")
    ratio = kept / N
    budget_for_ratio(ratio, N, int(m))
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in SUPPORTED_ATTENTION:                  # else generate refuses the cache afterwards
        raise ValueError(f"attn_implementation={implementation!r}: a DistilledCache needs one of "
                         f"{list(SUPPORTED_ATTENTION)} (per-head masks); model.set_attn_implementation('sdpa')")
    if method in ("zipkv", "attention_matching"):
        compressed = _distil_with_probe(model, ids, ratio, method, int(m), seed, progress, **settings)
        return DistilledCache.from_compressed(compressed, model, context_ids=ids)
    check_settings(m=m, seed=seed, **settings)                     # the settings that need no capture
    if isinstance(settings.get("solver"), str):                   # a name, as kvsculpt_main's parameter takes it
        settings["solver"] = solver_named(settings["solver"])
    elif settings.get("solver") is not None and not callable(settings["solver"]):
        raise TypeError(f"solver={settings['solver']!r}: expected 'batched', 'reference' or a batch solver function")
    fields = {name: settings.pop(name) for name in list(settings) if name in SculptConfig.__dataclass_fields__}
    if fields:
        if settings.get("config") is not None:
            raise ValueError(f"{sorted(fields)} and config=: give the solver settings one way")
        settings["config"] = SculptConfig(**fields)
    settings.setdefault("solver", batched.solve)
    compressed = compress_capture(capture(model, ids), ratio, method, m=int(m), seed=seed, **settings)
    return DistilledCache.from_compressed(compressed, model, context_ids=ids)


def _token_tensor(value, name: str) -> torch.Tensor:
    """``value`` as a tensor, a leading batch of one dropped (``[1, N]`` → ``[N]``); a ``TypeError`` naming ``name``
    where it is no array of numbers."""
    try:
        ids = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{name} must be token ids (a tensor, list or array of ints), got {type(value).__name__}"
                        ) from None
    return ids[0] if ids.ndim == 2 and ids.shape[0] == 1 else ids


def _probe_ids(model, probe) -> torch.Tensor | None:
    """``probe`` checked: None, or integer token ids ``[P]`` (or ``[1, P]``) of the model's vocabulary."""
    if probe is None:
        return None
    if isinstance(probe, str):
        raise TypeError(f"probe={probe!r}: expected token ids; zipkv.pipeline.reconstruction_probe(tokenizer, "
                        "context_ids) gives the repeat-the-context probe's (zipkv.answer takes probe='reconstruction')")
    ids = _token_tensor(probe, "probe")
    vocab = getattr(model.config, "vocab_size", None)
    if ids.ndim != 1 or ids.numel() < 1 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"probe has shape {tuple(ids.shape)} and dtype {ids.dtype}: expected integer token ids [P], "
                         "P ≥ 1")
    if int(ids.min()) < 0 or (isinstance(vocab, int) and int(ids.max()) >= vocab):
        raise ValueError(f"probe holds ids from {int(ids.min())} to {int(ids.max())}: expected ids of the model's "
                         f"vocabulary, 0 … {vocab - 1 if isinstance(vocab, int) else 'vocab_size − 1'}")
    return ids.long()


def _distil_with_probe(model, ids, ratio: float, method: str, m: int, seed: int, progress: bool, *,
                       probe_tokens: int = 64, probe=None, budget: str = "probe", alpha: float | None = None,
                       cascade: bool = True, config=None):
    """zipkv's distiller or Attention Matching on the context ``ids``: capture, the probe (the model's sampled
    continuation, or the given ``probe`` ids teacher-forced), the fit."""
    from .distill import attention_matching, generalise
    from .models import capture

    probe_ids = _probe_ids(model, probe)

    if isinstance(probe_tokens, bool) or not isinstance(probe_tokens, numbers.Integral) or probe_tokens < 1:
        raise ValueError(f"probe_tokens={probe_tokens!r}: expected an int ≥ 1 (the model's sampled continuation)")
    window = getattr(model.config, "max_position_embeddings", None)
    if isinstance(window, int) and probe_tokens > window:
        raise ValueError(f"probe_tokens={probe_tokens}: expected at most the model's context window, "
                         f"config.max_position_embeddings={window} (the probe samples one token per forward pass)")
    if method == "zipkv":
        if not isinstance(cascade, bool):
            raise TypeError(f"cascade={cascade!r}: expected True (each layer fitted to the probe's queries as the "
                            "layers before it, compressed, produce them) or False")
        if budget not in generalise.BUDGETS:
            raise ValueError(f"budget={budget!r}: expected one of {list(generalise.BUDGETS)}")
        if config is not None and not isinstance(config, generalise.ZipkvConfig):
            raise TypeError(f"config={config!r}: expected a zipkv.distill.generalise.ZipkvConfig")
    elif config is not None and not isinstance(config, attention_matching.AttentionMatchingConfig):
        raise TypeError(f"config={config!r}: expected a zipkv.distill.attention_matching.AttentionMatchingConfig")
    clock = [generalise.synchronized_time()]

    def lap() -> float:
        clock.append(generalise.synchronized_time())
        return clock[-1] - clock[-2]

    cap = capture(model, ids)
    seconds = dict(capture=lap())
    probe = (generalise.sample_probe(model, cap, ids, tokens=int(probe_tokens), seed=seed) if probe_ids is None
             else generalise.forced_probe(model, cap, probe_ids))
    seconds["probe"] = lap()
    if method == "zipkv":
        cache = generalise.compress(cap, ratio, m=m, config=config, budget=budget, model=model, probe=probe,
                                    cascade=cascade, progress=progress,
                                    alpha=generalise.PROBE_ALPHA if alpha is None else alpha)
        cache.info["phase_seconds"] = {**seconds, **cache.info["phase_seconds"]}
        return cache
    import dataclasses

    if config is not None:
        return attention_matching.compress(cap, ratio, m=m, config=config, model=model, probe=probe)
    caches = {f"am_{keys}": attention_matching.compress(cap, ratio, m=m, model=model, probe=probe,
                                                        config=dataclasses.replace(
                                                            attention_matching.AttentionMatchingConfig(), keys=keys))
              for keys in attention_matching.KEY_METHODS}
    return caches[attention_matching.select_by_validation(caches)]
