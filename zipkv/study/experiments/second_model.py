"""A second real model for "Beyond the paper" (issue 17, item 4): :func:`zipkv.study.experiments.beyond.compare` on
Gemma-3-270M (or any model :func:`zipkv.models.load_model` loads), one window at a time, each window's rows
appended to a CSV as soon as it is done, with the run's provenance and settings in every row.

Gemma 3 has 15 sliding-window layers (a query at ``p`` sees keys at positions ``> p − 512``) and 3 global ones.
No distiller compresses a sliding layer (:attr:`zipkv.models.Capture.compressed_layers`): it keeps the model's
own window, the last ``W − 1`` context pairs, and the ratio ``r = (k + m)/N`` is that of each global layer. The
rows carry what :func:`kv_fraction` needs to state the whole cache's size against the KV the model itself
holds (sliding layers: ``W − 1`` pairs, not ``N``), so the pairs the model drops by itself are never counted
as compressed away.

Command line (writes ``--out``; ``--gguf`` a ``.gguf`` file, a model folder or a Hub id)::

    python -m zipkv.study.experiments.second_model --gguf /path/to/gemma-3-270m-q4_k_m.gguf \\
        --out results/paper/kvsculpt_beyond_gemma.csv --windows 3 --context 2048 --ratios 0.3
"""
from __future__ import annotations

import argparse
import datetime as dt
import time
from pathlib import Path
from typing import Sequence

from . import beyond

DEFAULT_METHODS = beyond.METHODS
"""Every method of :func:`zipkv.study.experiments.beyond.compare` (KVSculpt last: its L-BFGS steps dominate)."""

COLUMNS = ["model", "window", "ratio", "method", "kl", "seconds", "choice", "pg_id", "context", "continuation", "m",
           "n_synthetic", "steps", "probe_tokens", "layers", "sliding_layers", "sliding_window", "kv_fraction",
           "device", "commit", "date"]
"""Columns of the CSV: ``compare``'s table, the window's book, the settings, the cache shape, provenance."""


def kv_fraction(ratio: float, context: int, layers: int, sliding_layers: int, sliding_window: int | None) -> float:
    """Pairs the compressed cache holds over the pairs the model itself holds for an ``N = context`` context.

    Global layers hold ``round(r·N)`` pairs per KV head (of ``N``); a sliding-window layer holds its window
    ``min(N, W − 1)`` in both caches (it is not compressed). With no sliding layers this is ``round(r·N)/N``."""
    window = 0 if not sliding_layers else min(context, int(sliding_window) - 1)
    held = (layers - sliding_layers) * round(ratio * context) + sliding_layers * window
    return held / ((layers - sliding_layers) * context + sliding_layers * window)


def run(model_path: str | None, out: str | Path, *, n_windows: int = 3, context: int = 2048, continuation: int = 128,
        ratios: Sequence[float] = (0.3,), methods: Sequence[str] = DEFAULT_METHODS, m: int = 256,
        n_synthetic: int = 128, steps: int = 100, probe_tokens: int = 64, seed: int = 0, device: str = "cpu",
        first_window: int = 0, books_dir=None, progress: bool = True):
    """Run :func:`zipkv.study.experiments.beyond.compare` on windows ``first_window … n_windows − 1`` of
    :func:`zipkv.data.windows` (``seed``), one window per call (``window_offset``: window ``w``'s probe is sampled
    as a whole-study run samples it), appending each window's rows to ``out`` (created with a header when absent).

    Returns the ``pandas.DataFrame`` of the rows written by this call.
    """
    import pandas as pd
    import torch

    from zipkv import data, models, provenance

    if not 0 <= first_window < n_windows:
        raise ValueError(f"first_window={first_window}, n_windows={n_windows}: expected 0 ≤ first_window < n_windows")
    torch.manual_seed(seed)
    model, tokenizer = models.load_model(model_path, dtype=torch.float32, device=device)
    windows = data.windows(tokenizer, data.load_books(books_dir), n_windows, context=context,
                           continuation=continuation, seed=seed)
    slides = [w for w in models.sliding_windows(model) if w is not None]
    shape = dict(layers=model.config.num_hidden_layers, sliding_layers=len(slides),
                 sliding_window=slides[0] if slides else None)
    settings = dict(context=context, continuation=continuation, m=m, n_synthetic=n_synthetic, steps=steps,
                    probe_tokens=probe_tokens, **shape)
    out = Path(out)
    commit = provenance.git_commit()  # the code that runs: taken once, before any window
    written = []
    for w in range(first_window, n_windows):
        started = time.perf_counter()
        table, _ = beyond.compare(model, [windows[w]], list(ratios), list(methods), m=m, n_synthetic=n_synthetic,
                                  steps=steps, probe_tokens=probe_tokens, main_ratio=ratios[0], device=device,
                                  seed=seed, window_offset=w, progress=progress)
        table["pg_id"] = windows[w].pg_id
        for key, value in settings.items():
            table[key] = value
        table["kv_fraction"] = [kv_fraction(r, context, **shape) for r in table.ratio]
        table["device"] = provenance.device_name()
        table["commit"] = commit
        table["date"] = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
        table = table[COLUMNS]
        table.to_csv(out, mode="a", header=not out.exists(), index=False)
        written.append(table)
        if progress:
            print(f"window {w} done in {time.perf_counter() - started:.0f} s → {out}", flush=True)
    return pd.concat(written, ignore_index=True)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m zipkv.study.experiments.second_model``: run the comparison on ``--windows`` windows of a model and append the
    rows to ``--out``, one window at a time."""
    parser = argparse.ArgumentParser(prog="python -m zipkv.study.experiments.second_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default=None, help="a .gguf file, a model folder or a Hugging Face id (default: the "
                        "embedded SmolLM2-135M-Instruct, e.g. to extend the chapter's own table: --first-window, --ratios)")
    parser.add_argument("--out", required=True, help="CSV the rows are appended to")
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--first-window", type=int, default=0, help="resume: the first window to run")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--continuation", type=int, default=128)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.3])
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=beyond.METHODS)
    parser.add_argument("--m", type=int, default=256)
    parser.add_argument("--n-synthetic", type=int, default=128)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--probe-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    run(args.gguf, args.out, n_windows=args.windows, first_window=args.first_window, context=args.context,
        continuation=args.continuation, ratios=args.ratios, methods=args.methods, m=args.m,
        n_synthetic=args.n_synthetic, steps=args.steps, probe_tokens=args.probe_tokens, seed=args.seed,
        device=args.device)


if __name__ == "__main__":
    main()
