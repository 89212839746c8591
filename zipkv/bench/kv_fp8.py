"""What an FP8 KV cache costs in quality, beside ZipFusion's lossless 12-bit format (which costs nothing).

Serving engines offer an 8-bit KV cache (FlashInfer ``kv_data_type=torch.float8_e4m3fn``, SGLang
``--kv-cache-dtype fp8_e4m3``, vLLM ``kv_cache_dtype="fp8"``): keys (after RoPE) and values are stored as e4m3 --
4 exponent bits, 3 mantissa bits, largest finite value 448 -- optionally divided by a per-layer scale first. This
module measures what that does to the model's next-token distributions, with the protocol of KVSculpt §4: a PG19
context is captured once, its cache is round-tripped through e4m3 at every layer, the continuation is
teacher-forced after it, and KL(bf16 cache ‖ fp8 cache) is averaged over the continuation's tokens.

Scalings (:data:`SCALINGS`):

* ``"unit"`` -- scale 1, values clamped to ±448 first (the engines' default without calibration: FlashInfer's
  ``k_scale``/``v_scale`` of 1.0, SGLang's and vLLM's default scales);
* ``"per_layer"`` -- each layer's keys and values divided by their own ``amax / 448`` (vLLM's
  ``calculate_kv_scales``, computed here on the context itself: the most favourable calibration).

The reference is the same cache rounded to bf16 -- what the serving cache holds before any compression. ZipFusion's
format is measured the same way (the bf16 cache packed into 16-token pages with :func:`zipkv.format.pack` and
unpacked): its KL is 0 because the values read back are the same bits, which the row checks.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch

__all__ = ["E4M3_MAX", "SCALINGS", "fp8_round_trip", "zipfusion_round_trip", "fp8_cache_kl"]

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
"""Largest finite e4m3 value (448)."""
SCALINGS = ("unit", "per_layer")
"""How values are scaled before the cast to e4m3 (module docstring)."""


def fp8_round_trip(x: torch.Tensor, scaling: str = "unit") -> torch.Tensor:
    """``x`` (any float tensor, one layer's keys or values) stored as e4m3 and read back, in ``x``'s dtype: divided
    by its scale (1, or ``amax / 448`` for ``"per_layer"``), clamped to ±448 (torch's cast turns what overflows into
    NaN; the engines' quantizers saturate), cast to ``float8_e4m3fn`` (round to nearest even), cast back and
    multiplied by the scale."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point torch.Tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if scaling not in SCALINGS:
        raise ValueError(f"scaling={scaling!r}: expected one of {list(SCALINGS)}")
    wide = x.float()
    scale = 1.0
    if scaling == "per_layer":
        amax = float(wide.abs().max())
        scale = amax / E4M3_MAX if amax > 0 else 1.0
    stored = (wide / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (stored.float() * scale).to(x.dtype)


def zipfusion_round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., N, head_dim]`` (one layer's keys or values) rounded to bf16, stored in ZipFusion's format
    (:func:`zipkv.format.pack`, token layout, pages of 16 tokens, the last one zero-padded) and unpacked, in ``x``'s
    dtype."""
    from zipkv import format as fmt

    n, d = x.shape[-2], x.shape[-1]
    pad = -n % fmt.PAGE_TOKENS
    wide = torch.nn.functional.pad(x.to(torch.bfloat16), (0, 0, 0, pad))
    pages = wide.reshape(*x.shape[:-2], -1, fmt.PAGE_TOKENS, d)
    back = fmt.unpack(*fmt.pack(pages))
    return back.reshape(*x.shape[:-2], n + pad, d)[..., :n, :].to(x.dtype)


def fp8_cache_kl(model, windows: Sequence, scalings: Sequence[str] = SCALINGS, *, progress: bool = True):
    """KL(bf16 cache ‖ e4m3 cache) of the next-token distributions on each window's continuation.

    Args:
        model: a Hugging Face causal LM with RoPE (e.g. :func:`zipkv.models.load_model`'s).
        windows: :class:`zipkv.data.Window` objects (or ``(context_ids, continuation_ids)`` pairs): the context is
            cached, the continuation teacher-forced at positions N … N+C−1.
        scalings: names from :data:`SCALINGS`.
        progress: a tqdm bar over the windows.

    Returns:
        A ``pandas.DataFrame``, one row per (window, format): ``window``, ``format`` (``"zipfusion"``: the bf16
        cache through ZipFusion's format; ``"fp8_e4m3 unit"``, ``"fp8_e4m3 per_layer"``),
        ``kl`` (mean over the continuation's tokens, nats), ``kl_max``, ``top1_agreement`` (share of continuation
        positions where both caches give the same most likely token), ``rel_error_k`` / ``rel_error_v`` (relative
        L2 error of the stored keys / values against bf16, all layers), ``n_context``, ``n_continuation`` and
        ``seconds``.
    """
    import pandas as pd
    from tqdm.auto import tqdm

    from zipkv.distill.evaluate import _split_window, kl_divergence, teacher_force
    from zipkv.distill.kvsculpt import CompressedCache
    from zipkv.models import capture

    if isinstance(scalings, str) or not scalings or any(s not in SCALINGS for s in scalings):
        raise ValueError(f"scalings={scalings!r}: expected a non-empty list of names from {list(SCALINGS)}")
    if isinstance(windows, (str, bytes)) or not hasattr(windows, "__len__") or not len(windows):
        raise ValueError(f"windows={windows!r}: expected a non-empty list of zipkv.data.Window")
    pairs = [_split_window(w, None) for w in windows]
    rows = []
    for w, (context, continuation) in enumerate(tqdm(pairs, desc="fp8 cache KL", disable=not progress)):
        started = time.perf_counter()
        cap = capture(model, torch.as_tensor(context))
        full = CompressedCache.from_capture(cap)
        bf16 = [[x.to(torch.bfloat16).to(x.dtype) for x in layer] for layer in full.keys], \
               [[x.to(torch.bfloat16).to(x.dtype) for x in layer] for layer in full.values]
        reference = teacher_force(model, CompressedCache(*bf16, n_context=full.n_context), continuation)
        base = dict(window=w, n_context=full.n_context, n_continuation=len(continuation))
        formats = {"zipfusion": zipfusion_round_trip}
        # one scale per layer over all its heads (the engines keep one k_scale and one v_scale per layer)
        formats.update({f"fp8_e4m3 {s}": (lambda x, s=s: fp8_round_trip(x, s)) for s in scalings})
        for name, round_trip in formats.items():
            started = time.perf_counter()
            stored = [[list(round_trip(torch.stack(layer)).unbind(0)) for layer in side] for side in bf16]
            run = teacher_force(model, CompressedCache(*stored, n_context=full.n_context), continuation)
            kl = kl_divergence(reference.logits, run.logits)
            errors = []
            for side, approx in zip(bf16, stored):
                exact = torch.cat([torch.stack(layer).flatten() for layer in side]).float()
                got = torch.cat([torch.stack(layer).flatten() for layer in approx]).float()
                errors.append(float((got - exact).norm() / exact.norm()))
            agree = float((reference.logits.argmax(-1) == run.logits.argmax(-1)).float().mean())
            rows.append(dict(base, format=name, kl=float(kl.mean()), kl_max=float(kl.max()),
                             top1_agreement=agree, rel_error_k=errors[0], rel_error_v=errors[1],
                             seconds=time.perf_counter() - started))
    return pd.DataFrame(rows)
