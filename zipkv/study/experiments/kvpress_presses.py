"""zipkv among kvpress's presses: the KL table (:func:`zipkv.integrations.kvpress.kl_table`, kvpress's own presses
beside zipkv's distillers) and the long-context task (:mod:`zipkv.tasks`), run window by window and setting by
setting, each finished part appended to its CSV so that a long CPU run can stop and resume where it left off.

Runs where kvpress imports (``make venv-kvpress``: kvpress pins ``transformers<5.3``); elsewhere the chapter shows
the committed tables. As a script::

    .venv-kvpress/bin/python -m zipkv.study.experiments.kvpress_presses kl --model gemma-3-270m --windows 20 \\
        --context 128 --out results/paper/kvpress_presses.csv
    .venv-kvpress/bin/python -m zipkv.study.experiments.kvpress_presses task --length 512 --prompts 100 \\
        --out results/paper/kvpress_presses_task.csv
    .venv-kvpress/bin/python -m zipkv.study.experiments.kvpress_presses retention --settings niah_single:256 \
        --methods kvzip tova zipkv zipkv_reconstruction --fractions 0.25 --prompts 8 \
        --out results/paper/kvpress_presses_retention.csv
"""
from __future__ import annotations

import argparse
import math
import time
import warnings
from pathlib import Path
from typing import Sequence

import pandas as pd
import torch

warnings.filterwarnings("ignore", message="IProgress not found")   # tqdm's notebook bar without ipywidgets

KEPT_FRACTIONS = (0.5, 0.3, 0.25, 0.125, 0.0625)
"""The chapter's kept fractions: 2× to 16× (kvpress's ``compression_ratio`` is 1 − these) and 0.3, the KVSculpt
chapters' ratio."""

ZIPKV_SIDE = ("zipkv", "zipkv_press", "attention_matching", "kvsculpt", "select_fit", "select_fit_dense")
"""zipkv's methods in the table (:data:`zipkv.integrations.kvpress.ZIPKV_METHODS`)."""
RECONSTRUCTION = "zipkv_reconstruction"
"""zipkv's distiller with the re-reading probe and max-attention key selection
(:func:`zipkv.pipeline.reconstruction_settings`), a task method."""


def load_model(name: str | None = None):
    """``(model, tokenizer)`` in float32: ``None`` the embedded SmolLM2-135M-Instruct, ``"gemma-3-270m"`` the embedded
    Gemma-3-270M (its GGUF package), else a Hugging Face path or id."""
    from zipkv import models
    from zipkv.study.chapters.escape import model_source

    return models.load_model(model_source(name), dtype=torch.float32)


def press_methods() -> list[str]:
    """kvpress's presses of the KL table: every press of :data:`zipkv.integrations.kvpress.PRESSES`, and AdaKV
    around each of them that is a scorer press (AdaKV wraps scorers only)."""
    import kvpress

    from zipkv.integrations import kvpress as integration

    scorers = [n for n, c in integration.PRESSES.items() if issubclass(getattr(kvpress, c), kvpress.ScorerPress)]
    return [*integration.PRESSES, *(f"adakv_{n}" for n in scorers)]


def _append(out: Path | None, rows: pd.DataFrame, kept: list[pd.DataFrame]) -> None:
    """Stamp ``rows`` with the run's device, date and commit (the committed table's own provenance), keep them and
    append them to ``out``."""
    import datetime as dt

    from zipkv.provenance import device_name, git_commit

    rows = rows.assign(device=device_name(), date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                       commit=git_commit())
    kept.append(rows)
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        have = pd.read_csv(out, nrows=0).columns.tolist() if Path(out).is_file() else None
        if have is None or have == list(rows.columns):
            rows.to_csv(out, mode="a", header=have is None, index=False)
        else:                        # other columns than the file's: rewrite it with both (an append would misalign)
            pd.concat([pd.read_csv(out), rows], ignore_index=True).to_csv(out, index=False)


def measure_kl(model, tokenizer, windows: Sequence, kept_fractions: Sequence[float] = KEPT_FRACTIONS,
               methods: Sequence[str] | None = None, *, slow_windows: int | None = None,
               slow: Sequence[str] = ("kvsculpt", "zipkv_press"), probe_tokens: int = 64, steps: int = 100,
               n_synthetic: int = 128, seed: int = 0, out: str | Path | None = None,
               progress: bool = False) -> pd.DataFrame:
    """The KL table of ``methods`` (default: :func:`press_methods` and :data:`ZIPKV_SIDE`) on ``windows``.

    Args:
        slow_windows: run the methods of ``slow`` (KVSculpt: 100 L-BFGS steps) on the first ``slow_windows``
            windows only (``None``: on all).
        out: a CSV the rows of each finished window are appended to; the (window, method, kept fraction) rows it
            already holds (same model) are not run again, so an interrupted run resumes and a later run adds methods.
        the rest: :func:`zipkv.integrations.kvpress.kl_table`'s.

    Returns:
        ``kl_table``'s rows of every window (those read back from ``out`` included).
    """
    from zipkv.integrations import kvpress as integration
    from zipkv.models import model_shape

    methods = list(methods) if methods is not None else [*press_methods(), *ZIPKV_SIDE]
    name = model_shape(model).name
    have = pd.read_csv(out) if out is not None and Path(out).is_file() else None
    parts = [] if have is None else [have[have.model == name]]
    done = set() if have is None else {(r.window, r.method, r.kept_fraction) for r in parts[0].itertuples()}
    for w, window in enumerate(windows):
        chosen = [m for m in methods if slow_windows is None or w < slow_windows or m not in slow]
        chosen = [m for m in chosen if any((w, m, f) not in done for f in kept_fractions)]
        if not chosen:
            continue
        rows = integration.kl_table(model, [window], kept_fractions, chosen, tokenizer=tokenizer,
                                    probe_tokens=probe_tokens, steps=steps, n_synthetic=n_synthetic, seed=seed + w,
                                    progress=progress)
        rows["window"] = w
        rows["probe_tokens"] = probe_tokens
        rows = rows[[(w, m, f) not in done for m, f in zip(rows.method, rows.kept_fraction)]]
        _append(out, rows, parts)
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def compressor(method: str, kept_fraction: float, tokenizer, *, probe_tokens: int = 64, seed: int = 0):
    """``compress(model, context_ids) -> cache`` of one method at one kept fraction, for :func:`zipkv.tasks.accuracy`:
    a kvpress press's cache (kvpress's prefill, its head-wise mask left on the model for the answer), or zipkv's
    :func:`zipkv.compress`. ``"none"``: ``None`` (the uncompressed model)."""
    import zipkv
    from zipkv.integrations import kvpress as integration

    if method == "none":
        return None
    if method == RECONSTRUCTION:
        from zipkv.pipeline import reconstruction_settings

        return lambda model, ids: zipkv.compress(model, ids, kept_fraction, seed=seed,
                                                 **reconstruction_settings(tokenizer, ids))
    if method in ZIPKV_SIDE and method != "zipkv_press":
        settings = dict(kept_fraction=kept_fraction, seed=seed, method="select_fit" if method.startswith(
            "select_fit") else method)
        if method in ("zipkv", "attention_matching"):
            settings["probe_tokens"] = probe_tokens
        return lambda model, ids: zipkv.compress(model, ids, **settings)

    def by_press(model, ids):
        press = (integration.ZipkvPress(1.0 - kept_fraction, probe_tokens=probe_tokens, seed=seed)
                 if method == "zipkv_press" else integration._press(method, kept_fraction))
        return integration.press_cache(model, press, ids, tokenizer)[0]
    return by_press


def measure_task(model, tokenizer, books, settings: Sequence[tuple[str, int]], methods: Sequence[str],
                 kept_fractions: Sequence[float] = (0.25, 0.125), *, prompts: int = 100,
                 method_prompts: dict | None = None, first_prompt: dict | None = None, gate: float = 0.8, max_new_tokens: int = 40,
                 agreement_tokens: int = 128, probe_tokens: int = 64, seed: int = 0, out: str | Path | None = None,
                 progress: bool = False) -> pd.DataFrame:
    """Task accuracy: first the uncompressed model on every ``(kind, length)`` setting, then, on the settings it
    answers at ≥ ``gate``, each method × kept fraction on the same prompts. On a setting the model does not solve,
    each method's greedy-token agreement with the uncompressed model instead (``agreement_tokens`` > 0): how many of
    the ``agreement_tokens`` greedy reply tokens equal the uncompressed model's before the first difference
    (:func:`zipkv.tasks.prefix_agreement`), as a fraction.

    Args:
        settings: ``(kind, length)`` pairs (:data:`zipkv.tasks.KINDS`, context tokens).
        methods: kvpress's presses and zipkv's methods (as :func:`compressor` names them).
        prompts: prompts per setting (seeded; the same for every method).
        method_prompts: fewer prompts for some methods (e.g. ``{"zipkv": 30}``: the first 30 of the setting's),
            where their compression costs too long on the machine.
        first_prompt: for some methods, the setting's prompt they start at (e.g. ``{"zipkv_reconstruction": 20}``:
            prompts 20, 21, …), to measure a setting on prompts it was not chosen on.
        out: a CSV every finished (setting, method, fraction) is appended to; those it holds are skipped.

    Returns:
        One row per (model, kind, length, method, kept fraction): ``prompts``, ``correct``, ``accuracy`` (or, on a
        setting below the gate, ``agreement`` and ``agreement_tokens``), ``seconds`` (mean per prompt, compression
        and answer), ``gate_passed`` (the uncompressed accuracy's), and the kvpress/transformers versions.
    """
    import transformers

    from zipkv import tasks
    from zipkv.integrations import kvpress as integration
    from zipkv.models import model_shape

    late = {m: i for m, i in (first_prompt or {}).items() if not 0 <= i < prompts}
    if late:
        raise ValueError(f"first_prompt={late}: expected prompt indices in [0, {prompts}) (prompts={prompts})")
    name = model_shape(model).name
    have = pd.read_csv(out) if out is not None and Path(out).is_file() else None
    parts = [] if have is None else [have[have.model == name]]
    done = set() if have is None else {(r.kind, r.length, r.method, r.kept_fraction)
                                        for r in have[have.model == name].itertuples()}
    method_prompts = method_prompts or {}
    first_prompt = first_prompt or {}

    def run(kind, length, made, method, fraction):
        key = (kind, length, method, 1.0 if method == "none" else fraction)
        if key in done:
            if method != "none":
                return None
            t = pd.concat(parts, ignore_index=True)
            return float(t[(t.kind == kind) & (t.length == length) & (t.method == "none")].accuracy.iloc[0])
        first = first_prompt.get(method, 0)
        n = min(len(made) - first, method_prompts.get(method, len(made)))
        started = time.perf_counter()
        scored = tasks.accuracy(model, tokenizer, made[first:first + n], compressor(method, fraction, tokenizer,
                                probe_tokens=probe_tokens, seed=seed), max_new_tokens=max_new_tokens)
        integration._clear_masks(model)
        seconds = (time.perf_counter() - started) / n
        row = dict(model=name, kind=kind, length=length, method=method, kept_fraction=key[3], first_prompt=first, prompts=n,
                   correct=int(scored.correct.sum()), accuracy=float(scored.correct.mean()), seconds=seconds,
                   kvpress=integration.KVPRESS_VERSION, transformers=transformers.__version__)
        _append(out, pd.DataFrame([row]), parts)
        if progress:
            print(f"{name} {kind} {length} {method} {key[3]:g}: {row['accuracy']:.2f} on {n}, {seconds:.1f} s/prompt",
                  flush=True)
        return row["accuracy"]

    def agree(kind, length, made, method, fraction, reference):
        if (kind, length, method, fraction) in done:
            return
        first = first_prompt.get(method, 0)
        n = min(len(made) - first, method_prompts.get(method, len(made)))
        missing = [i for i in range(first, first + n) if i not in reference]   # uncompressed replies, once each
        if missing:
            reference.update(zip(missing, tasks.greedy_replies(model, tokenizer, [made[i] for i in missing], None,
                                                               agreement_tokens)))
        started = time.perf_counter()
        got = tasks.greedy_replies(model, tokenizer, made[first:first + n], compressor(
            method, fraction, tokenizer, probe_tokens=probe_tokens, seed=seed), agreement_tokens)
        integration._clear_masks(model)
        seconds = (time.perf_counter() - started) / n
        same = tasks.prefix_agreement(got, [reference[i] for i in range(first, first + n)], agreement_tokens)
        row = dict(model=name, kind=kind, length=length, method=method, kept_fraction=fraction, first_prompt=first,
                   prompts=n, agreement=sum(same) / (n * agreement_tokens), agreement_tokens=agreement_tokens,
                   seconds=seconds, kvpress=integration.KVPRESS_VERSION, transformers=transformers.__version__)
        _append(out, pd.DataFrame([row]), parts)
        if progress:
            print(f"{name} {kind} {length} {method} {fraction:g}: agreement {row['agreement']:.3f} on {n}, "
                  f"{seconds:.1f} s/prompt", flush=True)

    for kind, length in settings:
        made = tasks.make_tasks(tokenizer, books, prompts, length, kind, seed=seed)
        if run(kind, length, made, "none", 1.0) < gate:
            reference = {}
            for fraction in kept_fractions if agreement_tokens else ():
                for method in methods:
                    agree(kind, length, made, method, fraction, reference)
            continue
        for fraction in kept_fractions:
            for method in methods:
                run(kind, length, made, method, fraction)
    table = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    if len(table):
        base = table[table.method == "none"].set_index(["model", "kind", "length"]).accuracy
        table["gate_passed"] = [base.get((r.model, r.kind, r.length), math.nan) >= gate for r in table.itertuples()]
    return table


def replies(model, tokenizer, books, methods: Sequence[str], kept_fraction: float, *, kind: str = "niah_single",
            length: int = 256, prompts: int = 8, max_new_tokens: int = 40, probe_tokens: int = 64,
            seed: int = 0) -> pd.DataFrame:
    """Each method's greedy reply to the first ``prompts`` prompts of a setting (the task run's seeded prompts), beside
    the expected number and how many of its leading digits the reply's first number gets right: where a wrong
    answer goes wrong.

    Returns:
        ``model, kind, length, method, kept_fraction, prompt, expected, reply, number, leading_digits`` per prompt.
    """
    import re

    from zipkv import tasks
    from zipkv.integrations import kvpress as integration
    from zipkv.models import model_shape

    made = tasks.make_tasks(tokenizer, books, prompts, length, kind, seed=seed)
    rows = []
    for method in methods:
        scored = tasks.accuracy(model, tokenizer, made, compressor(method, kept_fraction, tokenizer,
                                probe_tokens=probe_tokens, seed=seed), max_new_tokens=max_new_tokens)
        integration._clear_masks(model)
        for i, (task, reply) in enumerate(zip(made, scored.reply)):
            expected = task.answers[0]
            found = re.search(r"\d+", reply)
            number = found.group(0) if found else ""
            lead = next((j for j, (a, b) in enumerate(zip(number, expected)) if a != b), min(len(number), len(expected)))
            rows.append(dict(model=model_shape(model).name, kind=kind, length=length, method=method,
                             kept_fraction=kept_fraction, prompt=i, expected=expected, reply=reply.strip(),
                             number=number, leading_digits=lead))
    return pd.DataFrame(rows)


def _kept_positions(cache, capture, positions: Sequence[int], model) -> torch.Tensor:
    """``[L, H, len(positions)]`` 1.0 where head ``(l, h)`` of ``cache`` still holds the context's own key at that
    position (a kvpress cache, its head-wise mask applied, or a :class:`zipkv.cache.DistilledCache`; zipkv keeps the
    keys it selects as they are). Keys are matched to the captured ones to 1e-3 of their largest entry: a press's
    prefill and the capture compute them in separate passes."""
    from zipkv.cache import DistilledCache
    from zipkv.integrations import kvpress as integration

    L, (H, _, _) = len(capture.layers), capture.layers[0].keys.shape
    kept = torch.zeros(L, H, len(positions))
    modules = None if isinstance(cache, DistilledCache) else integration._attention_modules(model)
    for layer in range(L):
        if isinstance(cache, DistilledCache):
            held = cache.layers[layer]
            heads = [held.keys[0, h][held.valid[0, h]] for h in range(H)]
        else:
            keys = cache.layers[layer].keys[0]
            masked = getattr(modules[layer], "masked_key_indices", None)
            heads = []
            for h in range(H):
                ok = torch.ones(keys.shape[1], dtype=torch.bool, device=keys.device)
                if masked is not None:
                    ok[masked[2][masked[1] == h]] = False
                heads.append(keys[h][ok])
        for h, held_keys in enumerate(heads):
            for j, p in enumerate(positions):
                ref = capture.layers[layer].keys[h, p].float()
                gap = (held_keys.float().to(ref.device) - ref).abs().amax(dim=-1)
                kept[layer, h, j] = float(bool((gap <= 1e-3 * ref.abs().max()).any()))
    return kept


def needle_retention(model, tokenizer, books, methods: Sequence[str], kept_fraction: float, *,
                     kind: str = "niah_single", length: int = 256, prompts: int = 8, probe_tokens: int = 64,
                     seed: int = 0) -> pd.DataFrame:
    """Which KV heads still hold the needle's number after each method's compression, on the first ``prompts`` prompts
    of a task setting (the task run's seeded prompts): why a method answers or not, measured in the cache itself.

    Returns:
        per (method, prompt): ``digits`` (the number's tokens), ``heads`` (layers × KV heads), ``digit_kept`` (mean
        share of heads holding each of the number's tokens), ``first_digit_kept``, ``heads_with_every_digit``,
        ``context_kept`` (the share of every context pair kept, for scale), ``model, kind, length, kept_fraction``.
    """
    from zipkv import models, tasks
    from zipkv.cache import DistilledCache
    from zipkv.integrations import kvpress as integration

    made = tasks.make_tasks(tokenizer, books, prompts, length, kind, seed=seed)
    rows = []
    for i, task in enumerate(made):
        context, _ = tasks.prompt_ids(tokenizer, task)
        value = task.answers[0]
        digits = tokenizer.encode(" is: " + value, add_special_tokens=False)[-len(value):]
        ids = context.tolist()
        start = next((p for p in range(len(ids)) if ids[p:p + len(digits)] == digits), None)
        if start is None:
            raise ValueError(f"prompt {i}: the number {value} is not one token a digit in the context")
        positions = list(range(start, start + len(digits)))
        capture = models.capture(model, context)
        for method in methods:
            cache = compressor(method, kept_fraction, tokenizer, probe_tokens=probe_tokens, seed=seed)(model, context)
            kept = _kept_positions(cache, capture, positions, model)
            share = (integration._kept_distilled(cache, model, len(ids)) if isinstance(cache, DistilledCache)
                     else integration._kept(cache, model, len(ids)))
            integration._clear_masks(model)
            rows.append(dict(model=models.model_shape(model).name, kind=kind, length=length, method=method,
                             kept_fraction=kept_fraction, prompt=i, digits=len(positions), heads=kept[..., 0].numel(),
                             digit_kept=float(kept.mean()), first_digit_kept=float(kept[..., 0].mean()),
                             heads_with_every_digit=int((kept.min(dim=-1).values > 0).sum()), context_kept=share))
    return pd.DataFrame(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("kl", "task", "replies", "retention"))
    parser.add_argument("--model", default=None, help="None: the embedded SmolLM2-135M; gemma-3-270m: the second")
    parser.add_argument("--windows", type=int, default=20)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--continuation", type=int, default=32)
    parser.add_argument("--fractions", type=float, nargs="+", default=list(KEPT_FRACTIONS))
    parser.add_argument("--methods", nargs="+", default=None)
    parser.add_argument("--slow-windows", type=int, default=None)
    parser.add_argument("--probe-tokens", type=int, default=64)
    parser.add_argument("--settings", nargs="+", default=["niah_single:512"], help="kind:length")
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--agreement-tokens", type=int, default=128)
    parser.add_argument("--method-prompts", nargs="*", default=[], help="method:n")
    parser.add_argument("--method-first", nargs="*", default=[], help="method:i (the prompt it starts at)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    from zipkv import data

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, tokenizer = load_model(args.model)
    books = data.load_books()
    if args.what == "kl":
        windows = data.windows(tokenizer, books, args.windows, context=args.context,
                               continuation=args.continuation, seed=0)
        measure_kl(model, tokenizer, windows, args.fractions, args.methods, slow_windows=args.slow_windows,
                   probe_tokens=args.probe_tokens, out=args.out, progress=True)
    elif args.what == "retention":
        kind, length = args.settings[0].split(":")
        for fraction in args.fractions:
            table = needle_retention(model, tokenizer, books, args.methods or ["zipkv"], fraction, kind=kind,
                                     length=int(length), prompts=args.prompts, probe_tokens=args.probe_tokens)
            _append(args.out, table, [])
    elif args.what == "replies":
        kind, length = args.settings[0].split(":")
        table = replies(model, tokenizer, books, args.methods or ["zipkv"], args.fractions[0], kind=kind,
                        length=int(length), prompts=args.prompts, probe_tokens=args.probe_tokens)
        _append(args.out, table, [])
    else:
        settings = [(s.split(":")[0], int(s.split(":")[1])) for s in args.settings]
        measure_task(model, tokenizer, books, settings, args.methods or ["zipkv"], args.fractions,
                     prompts=args.prompts, method_prompts={m.split(":")[0]: int(m.split(":")[1])
                                                           for m in args.method_prompts},
                     first_prompt={m.split(":")[0]: int(m.split(":")[1]) for m in args.method_first},
                     agreement_tokens=args.agreement_tokens, probe_tokens=args.probe_tokens, out=args.out,
                     progress=True)


if __name__ == "__main__":
    main()
