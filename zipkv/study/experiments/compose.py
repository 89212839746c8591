"""The two papers together: KVSculpt's distilled prefix (§3) stored in ZipFusion's 12-bit format (§III-B) and served by
the engine (§III-D) -- beyond both papers, which each leave the other's cache as it is.

Per PG19 window of ``N`` context tokens, :func:`serve_distilled` measures

* how compressible the stored pairs are: the model's own KV (the full context) against KVSculpt's ``k + m`` pairs per
  KV head (free keys fitted by L-BFGS, values by ridge regression, the last ``m`` kept), as the share of 512-value
  blocks whose exponents fit ``[b, b + 15]`` and the bits stored per value (full pages; the partial last page raw);
* the bytes of the stored prefix against the raw BF16 bytes of the full context (``pairs/N · bits/16``);
* what the engine generates from it (greedy, ``new_tokens`` after the continuation's first token): the same tokens
  with its pages packed as without (the format is lossless), and how far they follow the full context's tokens.
"""
from __future__ import annotations

import torch

from zipkv import format as fmt

__all__ = ["prefix_stats", "serve_distilled"]


def prefix_stats(kv: list, n_context: int) -> dict:
    """Compressibility of a prefix's pairs ``kv`` (per layer ``(keys, values)``, bf16 ``[kv_heads, P, head_dim]``)
    standing for ``n_context`` tokens, as the engine stores them (full pages packed where they fit, the partial last
    page raw): ``frac_compressed_k`` / ``_v`` (blocks of full pages), ``bits_per_value`` (all ``P`` pairs) and
    ``memory_vs_raw_context`` (the stored bytes over ``n_context`` raw BF16 tokens)."""
    stats = {}
    for name, i in (("k", 0), ("v", 1)):
        pages = torch.cat([fmt.to_pages(layer[i].to(torch.bfloat16)).reshape(-1, fmt.PAGE_TOKENS, layer[i].shape[-1])
                           for layer in kv])
        stats[name] = fmt.cache_stats(pages.cpu())
    pairs = kv[0][0].shape[1]
    values = 2 * pairs * sum(layer[0].shape[0] * layer[0].shape[-1] for layer in kv)
    full_values = sum(s.n_blocks for s in stats.values()) * fmt.BLOCK_VALUES
    stored_bits = 8 * sum(s.packed_bytes for s in stats.values()) + 16 * (values - full_values)
    return dict(pairs=pairs, frac_compressed_k=stats["k"].frac_blocks, frac_compressed_v=stats["v"].frac_blocks,
                bits_per_value=stored_bits / values, memory_vs_raw_context=stored_bits / (16 * values * n_context / pairs))


def _first_difference(a: list, b: list) -> int:
    """Index of the first position where ``a`` and ``b`` differ (``min(len)`` when one starts the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def serve_distilled(model, windows, ratios, *, m: int, n_synthetic: int, steps: int, new_tokens: int,
                    progress: bool = True):
    """One row per window and cache (``"full context"``, then KVSculpt at each ratio of ``ratios``): :func:`prefix_stats`
    of the pairs, and the engine's greedy tokens from them (``new_tokens`` after the window's first continuation token,
    no stop token): ``first_difference`` from the full context's tokens (``new_tokens`` where none), ``lossless``
    (the tokens with every page packed equal those with none packed; the engine's torch reference attention, which
    decodes each page with :func:`zipkv.format.unpack`). ``model``: bf16, on the device the distiller and the engine
    run on. Returns a DataFrame."""
    import pandas as pd
    from tqdm.auto import tqdm

    from zipkv.cache import DistilledCache
    from zipkv.distill import batched, kvsculpt
    from zipkv.engine import Engine, Prefix, kv_budget_for
    from zipkv.models import capture

    config = kvsculpt.SculptConfig(steps=steps, progress=False)

    rows = []
    for index, w in enumerate(tqdm(windows, desc="windows", disable=not progress)):
        ids, first = w.context_ids, w.continuation_ids[:1].tolist()
        n_context = int(ids.numel())
        budget = kv_budget_for(model.config, requests=1, tokens_per_request=n_context + new_tokens + 1)

        # the torch reference attention reads every page through the format's decoder, the same arithmetic for packed
        # and raw pages: equal tokens mean the stored bytes decode to the pairs bit for bit
        engines = {compress: Engine(model, budget, compress=compress, attention="reference", cuda_graphs=False,
                                    eos_token_id=None) for compress in ("all", "none")}

        def generate(prompt, prefix, compress):
            return engines[compress].generate([prompt], new_tokens, prefixes=[prefix], progress=False).outputs[0]

        cap = capture(model, ids)                          # one forward: the full context's KV, and what each ratio distils
        caches = [("full context", 1.0, None)] + [
            (f"kvsculpt r={r}", r, DistilledCache.from_compressed(
                kvsculpt.compress(cap, r, "kvsculpt", m=m, n_synthetic=n_synthetic, config=config, solver=batched.solve),
                model, context_ids=ids)) for r in ratios]     # zipkv.compress's cache, without a capture per ratio
        reference = None
        for method, ratio, cache in caches:
            if cache is None:
                kv = [(layer.keys, layer.values) for layer in cap.layers]
                prompt, prefix = ids.tolist() + first, None
            else:
                prefix = Prefix.from_cache(cache)
                kv = [prefix.layer(l) for l in range(model.config.num_hidden_layers)]
                prompt = first
            packed, raw = generate(prompt, prefix, "all"), generate(prompt, prefix, "none")
            reference = packed if reference is None else reference
            rows.append(dict(window=index, pg_id=w.pg_id, n_context=n_context, method=method, ratio=ratio,
                             **prefix_stats(kv, n_context), lossless=packed == raw,
                             first_difference=_first_difference(packed, reference), new_tokens=new_tokens))
    return pd.DataFrame(rows)

