"""End-to-end evaluation of a compressed cache: KL and hidden-state error (KVSculpt §4 metric, §6).

:func:`teacher_force` puts a :class:`~zipkv.distill.kvsculpt.CompressedCache` into a Hugging Face
Llama-family model as a :class:`zipkv.cache.DistilledCache` — the cache users generate from — and
feeds the continuation tokens at their *original* positions N … N+C−1 in one forward pass. Each
layer may hold its own number of pairs per KV head (masked per head inside the model's own
attention), so the result is attention over the exact per-head lengths. The reference run uses the
uncompressed captured cache through the same path, so an uncompressed cache gives KL exactly 0.

:func:`evaluate` returns KL(full ‖ compressed) per continuation token and its mean (the paper's
metric), plus the relative L2 error of every decoder layer's output hidden states (§6.1).
:func:`compare_methods` produces the rows of the chapter tables in one call;
:func:`single_layer_kl` the KL when only one layer is compressed at a time.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import torch

from zipkv.models import cache_keyword

from .baselines import JointConfig
from .kvsculpt import METHODS, CompressedCache, SculptConfig, Solver, compress

def _decoder_layers(model):
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"model {type(model).__name__} has no .model.layers: expected a Llama-family causal LM")
    return layers


@dataclass
class TeacherForced:
    """Outputs of one teacher-forced continuation.

    Attributes:
        logits: ``[C, vocab]`` float32 next-token logits at positions N … N+C−1.
        hidden: ``[L, C, hidden]`` float32 output hidden states of every decoder layer.
    """

    logits: torch.Tensor
    hidden: torch.Tensor


@dataclass
class Evaluation:
    """KL(full ‖ compressed) and hidden-state error of one compressed cache.

    Attributes:
        kl_per_token: ``[C]`` KL per continuation token (nats).
        kl: their mean (the paper's metric).
        hidden_error: ``[L]`` relative L2 error ‖h − h_full‖/‖h_full‖ of each layer's output on the continuation.
    """

    kl_per_token: torch.Tensor
    kl: float
    hidden_error: torch.Tensor


def _as_ids(ids: torch.Tensor) -> torch.Tensor:
    ids = torch.as_tensor(ids)
    if ids.ndim == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.ndim != 1 or ids.numel() == 0 or ids.is_floating_point():
        raise ValueError(f"continuation_ids has shape {tuple(ids.shape)} and dtype {ids.dtype}: expected "
                         "integer token ids [C] (or [1, C]), C ≥ 1")
    return ids.long()


def teacher_force(model, cache, continuation_ids: torch.Tensor) -> TeacherForced:
    """Feed ``continuation_ids`` ``[C]`` after ``cache`` at positions N … N+C−1 (teacher forcing).

    ``cache`` is a :class:`CompressedCache` or a :class:`zipkv.cache.DistilledCache` (used through
    :meth:`~zipkv.cache.DistilledCache.fresh`: the caller's cache is not appended to).
    """
    from zipkv.cache import DistilledCache

    if isinstance(cache, DistilledCache):
        if any(layer.per_sequence for layer in cache.layers):
            raise ValueError("cache has per-sequence layers (keys [B, H, P, d]): teacher_force_batch runs them")
        _check_layers(model, len(cache.layers), cache.layers[0].heads)
        return _run(model, cache.fresh(), continuation_ids)
    _check_layers(model, cache.num_layers, cache.num_heads)
    return _run(model, DistilledCache.from_compressed(cache, model), continuation_ids)


@torch.no_grad()
def teacher_force_batch(model, cache, continuation_ids: torch.Tensor) -> torch.Tensor:
    """``[B, C, vocab]`` logits (the model's dtype) of ``continuation_ids`` ``[C]`` fed at positions N … N+C−1 after
    each of the ``B`` sequences of a :class:`zipkv.cache.DistilledCache` whose layers hold per-sequence pairs, in
    one forward (row ``b`` is what :func:`teacher_force` gives for sequence ``b``'s cache alone). ``cache`` is
    appended to; no hidden states are kept."""
    from zipkv.cache import DistilledCache, attach

    if not isinstance(cache, DistilledCache) or not any(layer.per_sequence for layer in cache.layers):
        raise ValueError(f"cache ({type(cache).__name__}) has no per-sequence layers: expected a DistilledCache with "
                         "keys [B, H, P, d] on some layer (teacher_force takes one compressed context)")
    _check_layers(model, len(cache.layers), cache.layers[0].heads)
    ids = _as_ids(continuation_ids)
    B = next(layer.keys.shape[0] for layer in cache.layers if layer.per_sequence)
    attach(model)
    device = next(model.parameters()).device
    return model(input_ids=ids[None].expand(B, -1).to(device), use_cache=True, **{cache_keyword(model): cache}).logits


def teacher_force_padded(model, layers: Sequence[tuple], n_context: int,
                         continuation_ids: torch.Tensor) -> TeacherForced:
    """Teacher forcing over a padded cache: ``layers[l] = (keys, values, valid)`` (or with a ``bias``).

    Args:
        model: a Hugging Face Llama-family causal LM.
        layers: per layer ``keys``, ``values`` ``[H, P_l, d]`` post-RoPE and ``valid`` ``[H, P_l]`` bool
            (False entries are masked out for that head, wherever they are), optionally ``bias`` ``[H, P_l]``.
        n_context: ``N``: the continuation runs at positions N … N+C−1.
        continuation_ids: ``[C]`` token ids.
    """
    from zipkv.cache import DistilledCache

    kv_heads = _check_layers(model, len(layers), None)
    param = next(model.parameters())
    for index, layer in enumerate(layers):
        k, v, valid = layer[:3]
        if k.ndim != 3 or k.shape[0] != kv_heads or v.shape != k.shape or tuple(valid.shape) != tuple(k.shape[:2]):
            raise ValueError(f"layer {index}: keys {tuple(k.shape)}, values {tuple(v.shape)}, valid "
                             f"{tuple(valid.shape)}; expected [{kv_heads}, P, d] twice and [{kv_heads}, P] "
                             f"(the model has {kv_heads} KV heads)")
    cache = DistilledCache.from_padded(layers, n_context, dtype=param.dtype, device=param.device)
    return _run(model, cache, continuation_ids)


def _check_layers(model, layers: int, kv_heads: int | None) -> int:
    decoder = _decoder_layers(model)
    want = getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads
    if layers != len(decoder):
        raise ValueError(f"cache has {layers} layers, the model {len(decoder)}")
    if kv_heads is not None and kv_heads != want:
        raise ValueError(f"cache has {kv_heads} KV heads per layer, the model has {want} KV heads")
    return want


@torch.no_grad()
def _run(model, cache, continuation_ids: torch.Tensor) -> TeacherForced:
    """One forward of ``continuation_ids`` over a fresh :class:`~zipkv.cache.DistilledCache`, every layer's output kept."""
    from zipkv.cache import attach

    ids = _as_ids(continuation_ids)
    decoder = _decoder_layers(model)
    device = next(model.parameters()).device
    hidden: list[torch.Tensor | None] = [None] * len(decoder)

    def hook(index):
        def record(module, args, output):
            hidden[index] = (output[0] if isinstance(output, tuple) else output)[0].float()
        return record

    attach(model)
    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(decoder)]
    try:
        out = model(input_ids=ids[None].to(device), use_cache=True, **{cache_keyword(model): cache})
    finally:
        for h in handles:
            h.remove()
    return TeacherForced(logits=out.logits[0].float(), hidden=torch.stack(hidden))


def kl_divergence(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``[C]`` KL(p_ref ‖ p) per row of ``[C, vocab]`` logits, in nats (float32 → float64 internally)."""
    if reference_logits.shape != logits.shape:
        raise ValueError(f"logits have shape {tuple(logits.shape)}, the reference {tuple(reference_logits.shape)}")
    log_p = torch.log_softmax(reference_logits.double(), dim=-1)
    log_q = torch.log_softmax(logits.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1).clamp_min(0.0)


def hidden_state_error(reference_hidden: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """``[L]`` relative L2 error per layer of ``[L, C, hidden]`` hidden states."""
    diff = (hidden.double() - reference_hidden.double()).flatten(1).norm(dim=1)
    return diff / reference_hidden.double().flatten(1).norm(dim=1).clamp_min(1e-30)


def evaluate(model, cache: CompressedCache, continuation_ids: torch.Tensor,
             reference: TeacherForced | CompressedCache) -> Evaluation:
    """KL(full ‖ compressed) per token and mean, and per-layer hidden-state error (§4, §6.1).

    Args:
        model: the Hugging Face causal LM the cache was captured from.
        cache: the compressed cache.
        continuation_ids: ``[C]`` continuation tokens (paper: 128).
        reference: the full cache (:meth:`CompressedCache.from_capture`) or its
            :func:`teacher_force` result, computed once and reused across methods.
    """
    if not isinstance(cache, CompressedCache):
        raise TypeError(f"cache={type(cache).__name__}: expected a zipkv.distill.CompressedCache (a DistilledCache's "
                        "is its .compressed)")
    if not isinstance(reference, (CompressedCache, TeacherForced)):
        raise TypeError(f"reference={type(reference).__name__}: expected the full cache (CompressedCache.from_capture) "
                        "or its teacher_force result")
    _check_ids(model, continuation_ids, "continuation_ids")
    if isinstance(reference, CompressedCache):
        if reference.n_context != cache.n_context:
            raise ValueError(f"reference has N={reference.n_context}, the cache N={cache.n_context}")
        reference = teacher_force(model, reference, continuation_ids)
    run = teacher_force(model, cache, continuation_ids)
    kl = kl_divergence(reference.logits, run.logits)
    return Evaluation(kl_per_token=kl, kl=float(kl.mean()), hidden_error=hidden_state_error(reference.hidden, run.hidden))


def _check_ids(model, ids, name: str) -> None:
    """``ids`` must be integer token ids ``[C]`` in the model's vocabulary, C ≥ 1: a ``ValueError`` naming ``name``
    (an id past the vocabulary was a raw IndexError from the embedding, after the reference's forward)."""
    ids = torch.as_tensor(ids)
    vocab = model.get_input_embeddings().num_embeddings
    if ids.ndim != 1 or not ids.numel() or ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"{name} has shape {tuple(ids.shape)} and dtype {ids.dtype}: expected token ids [C], C ≥ 1")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"{name} holds ids in [{lo}, {hi}]: expected token ids in [0, {vocab - 1}] (the model's "
                         f"vocabulary of {vocab})")


def _split_window(window, n_context: int | None):
    if hasattr(window, "context_ids") and hasattr(window, "continuation_ids"):
        return window.context_ids, window.continuation_ids
    if isinstance(window, (tuple, list)) and len(window) == 2:
        return window[0], window[1]
    ids = torch.as_tensor(window)
    if n_context is None or ids.ndim != 1 or not 0 < n_context < ids.shape[0]:
        raise ValueError("window: expected a zipkv.data.Window, a (context_ids, continuation_ids) pair, or "
                         f"ids [N + C] with n_context=N (got shape {tuple(ids.shape)}, n_context={n_context})")
    return ids[:n_context], ids[n_context:]


@dataclass
class Comparison:
    """Results of :func:`compare_methods`, as long tables.

    Attributes:
        table: one row per (window, ratio, method): ``kl`` (mean over tokens), ``kl_max``,
            ``loss`` and ``initial_loss`` (means over layers and heads of the training objective;
            KVSculpt's ``initial_loss`` is Select+Fit's), ``memory_ratio``, ``seconds`` (compression).
        layers: one row per (window, ratio, method, layer): ``loss``, ``initial_loss`` (means over
            heads), ``loss_ratio`` (= loss / initial_loss), ``hidden_error``.
        tokens: one row per (window, ratio, method, token): ``kl``.
    """

    table: "object"
    layers: "object"
    tokens: "object"


def compare_methods(model, windows: Sequence, ratios: Sequence[float], methods: Sequence[str], *,
                    m: int = 256, n_synthetic: int = 128, strategy: str = "uniform", budget="uniform",
                    config: SculptConfig | None = None, joint_config: JointConfig | None = None,
                    seed: int = 0, n_context: int | None = None, solver: Solver | None = None,
                    progress: bool = True) -> Comparison:
    """Compress every window at every ratio with every method and measure KL (Tables 1, 2, A).

    Each window is captured once (:func:`zipkv.models.capture`); the full-cache reference is
    teacher-forced once per window; each (ratio, method) is compressed with :func:`compress` and
    evaluated with :func:`evaluate`.

    Args:
        model: a Hugging Face Llama-family causal LM.
        windows: :class:`zipkv.data.Window` objects, ``(context_ids, continuation_ids)`` pairs, or
            ``[N + C]`` id tensors with ``n_context=N``.
        ratios: compression ratios ``r = (k + m)/N``.
        methods: names from :data:`zipkv.distill.kvsculpt.METHODS`.
        m, n_synthetic, strategy, budget, config, joint_config, seed, solver: passed to :func:`compress`.
        progress: print one line per (window, ratio, method).
    """
    import pandas as pd

    from zipkv.models import capture as capture_fn

    from .kvsculpt import build_problems

    for name, given in (("windows", windows), ("ratios", ratios), ("methods", methods)):
        if isinstance(given, (str, bytes)) or not hasattr(given, "__len__") or not len(given):
            raise ValueError(f"{name}={given!r}: expected a non-empty list (the comparison would be empty)")
    unknown = [x for x in methods if x not in METHODS]
    if unknown:
        raise ValueError(f"methods {unknown}: expected names from {list(METHODS)}")
    rows, layer_rows, token_rows = [], [], []
    for w, window in enumerate(windows):
        started = time.perf_counter()
        context, continuation = _split_window(window, n_context)
        cap = capture_fn(model, torch.as_tensor(context))
        reference = teacher_force(model, CompressedCache.from_capture(cap), continuation)
        # training queries do not depend on the ratio or the method: build them once per window
        problems = build_problems(cap, 1, m=m, n_synthetic=n_synthetic, strategy=strategy, seed=seed)
        if progress:
            print(f"window {w}: capture, full-cache reference and training queries ({time.perf_counter() - started:.1f} s)",
                  flush=True)
        for ratio in ratios:
            for method in methods:
                started = time.perf_counter()
                cache = compress(cap, ratio, method, m=m, n_synthetic=n_synthetic, strategy=strategy, budget=budget,
                                 config=config, joint_config=joint_config, seed=seed, solver=solver,
                                 problems=problems)
                seconds = time.perf_counter() - started
                ev = evaluate(model, cache, continuation, reference)
                eval_seconds = time.perf_counter() - started - seconds
                rows.append(dict(window=w, ratio=ratio, method=method, kl=ev.kl, kl_max=float(ev.kl_per_token.max()),
                                 loss=float(cache.loss.mean()), initial_loss=float(cache.initial_loss.mean()),
                                 memory_ratio=cache.memory_ratio, seconds=seconds))
                loss_l = cache.loss.mean(dim=1)
                init_l = cache.initial_loss.mean(dim=1)
                for layer in range(cache.num_layers):
                    layer_rows.append(dict(window=w, ratio=ratio, method=method, layer=layer,
                                           loss=float(loss_l[layer]), initial_loss=float(init_l[layer]),
                                           loss_ratio=float(loss_l[layer] / init_l[layer]) if init_l[layer] > 0 else float("nan"),
                                           hidden_error=float(ev.hidden_error[layer])))
                for t, value in enumerate(ev.kl_per_token.tolist()):
                    token_rows.append(dict(window=w, ratio=ratio, method=method, token=t, kl=value))
                if progress:
                    print(f"window {w} r={ratio} {method:16s} KL={ev.kl:.4g} (compress {seconds:.1f} s, "
                          f"evaluate {eval_seconds:.1f} s)", flush=True)
    return Comparison(table=pd.DataFrame(rows), layers=pd.DataFrame(layer_rows), tokens=pd.DataFrame(token_rows))


def single_layer_kl(model, full: CompressedCache, compressed: CompressedCache, continuation_ids: torch.Tensor,
                    reference: TeacherForced | None = None) -> "object":
    """KL when only one layer is compressed at a time (§6: where the end-to-end KL comes from).

    Returns a ``pandas.DataFrame`` with columns ``layer, kl`` (KL with layer ``l`` from ``compressed``
    and all other layers from ``full``), plus a final row ``layer = -1`` with every layer compressed.
    """
    import pandas as pd

    if reference is None:
        reference = teacher_force(model, full, continuation_ids)
    rows = []
    for layer in range(full.num_layers):
        ev = evaluate(model, full.with_layers(compressed, [layer]), continuation_ids, reference)
        rows.append(dict(layer=layer, kl=ev.kl))
    rows.append(dict(layer=-1, kl=evaluate(model, compressed, continuation_ids, reference).kl))
    return pd.DataFrame(rows)


def heldout_objective(capture_full, n_context: int, caches: dict, m: int) -> "object":
    """The §3.2 objective of each compressed cache on queries it was NOT trained on: the real
    queries of the continuation tokens (positions ``N … N+C−1``), against the full context cache.

    A method whose training objective falls far below Select+Fit's but whose held-out objective
    does not has fitted its training queries (retain zone + synthetic), not the future ones.

    Args:
        capture_full: :func:`zipkv.models.capture` of the whole window (context + continuation); its
            keys ``[:N]`` equal the context's own capture up to float rounding (causal attention).
        n_context: ``N``: keys ``[:N]`` are the cache, queries ``[N:]`` the held-out set.
        caches: method name → :class:`CompressedCache` of the context (``budget`` gives each ``k``; the
            uncompressed cache, without a budget, keeps all ``N − m`` old pairs and scores 0).
        m: the retain zone the caches kept.

    Returns:
        ``pandas.DataFrame`` with ``method, layer, head, heldout`` (objective on continuation queries).
    """
    import pandas as pd

    from .baselines import Problem, problem_loss

    rows = []
    for layer_idx, layer in enumerate(capture_full.layers):
        H = layer.keys.shape[0]
        g = layer.queries.shape[0] // H
        for h in range(H):
            queries = layer.queries[h * g:(h + 1) * g, n_context:].float()  # [g, C, d]
            for method, cache in caches.items():
                k = n_context - m if cache.budget is None else int(cache.budget[layer_idx, h])  # full cache: all old pairs
                problem = Problem(keys=layer.keys[h, :n_context].float(), values=layer.values[h, :n_context].float(),
                                  queries=queries, m=m, k=k, layer=layer_idx, head=h)
                loss = problem_loss(problem, cache.keys[layer_idx][h][:k].float(), cache.values[layer_idx][h][:k].float())
                rows.append(dict(method=method, layer=layer_idx, head=h, heldout=loss))
    return pd.DataFrame(rows)


def solver_agreement(model, window, ratio: float = 0.3, *, solvers: dict[str, Solver] | None = None, m: int = 256,
                     n_synthetic: int = 128, config: SculptConfig | None = None, seed: int = 0,
                     n_context: int | None = None, concurrent: bool = False, progress: bool = True):
    """KVSculpt with each solver on every (layer, KV head) problem of one window: per-problem final loss and
    end-to-end KL of each (issue: the batched solver has the reference's quality).

    Args:
        solvers: name → solver (default ``{"reference": kvsculpt.solve, "batched": batched.solve}``).
        concurrent: run the solvers at the same time in threads (for the CPU, where each is bound to one
            core); their ``seconds`` then overlap.
        other arguments: as :func:`compare_methods`.

    Returns:
        ``(problems, summary)``. ``problems``: one row per (layer, head) with ``select_fit`` (the common
        starting loss) and each solver's final loss. ``summary``: one row per solver with ``kl``, ``seconds``
        (compression), ``median_loss`` and, against the first solver, ``median_loss_ratio`` (median over
        problems of the per-problem ratio) and ``kl_ratio``; plus a ``select_fit`` row (its KL).
    """
    import pandas as pd

    from zipkv.models import capture as capture_fn

    from . import batched
    from .kvsculpt import solve as reference_solve

    solvers = solvers or {"reference": reference_solve, "batched": batched.solve}
    context, continuation = _split_window(window, n_context)
    cap = capture_fn(model, torch.as_tensor(context))
    reference = teacher_force(model, CompressedCache.from_capture(cap), continuation)
    def run(job):
        name, solver = job
        started = time.perf_counter()
        method = "select_fit" if solver is None else "kvsculpt"
        cache = compress(cap, ratio, method, m=m, n_synthetic=n_synthetic, config=config, seed=seed, solver=solver)
        return name, cache, time.perf_counter() - started

    jobs = [("select_fit", None), *solvers.items()]
    with ThreadPoolExecutor(max_workers=len(jobs) if concurrent else 1) as pool:
        done = list(pool.map(run, jobs))
    caches, rows = {}, []
    for name, cache, seconds in done:
        caches[name] = cache
        kl = evaluate(model, cache, continuation, reference).kl
        rows.append(dict(solver=name, ratio=ratio, kl=kl, seconds=seconds, median_loss=float(cache.loss.median())))
        if progress:
            print(f"{name}: KL={kl:.4g}, median loss {rows[-1]['median_loss']:.4g} ({seconds:.1f} s)", flush=True)
    first = next(iter(solvers))
    L, H = caches[first].loss.shape
    problems = pd.DataFrame([dict(layer=l, head=h, select_fit=float(caches["select_fit"].loss[l, h]),
                                  **{name: float(caches[name].loss[l, h]) for name in solvers})
                             for l in range(L) for h in range(H)])
    summary = pd.DataFrame(rows)
    for name in solvers:
        at = summary.solver == name
        summary.loc[at, "median_loss_ratio"] = float((problems[name] / problems[first]).median())
        summary.loc[at, "kl_ratio"] = float(summary.loc[at, "kl"].iloc[0] / summary.loc[summary.solver == first, "kl"].iloc[0])
    return problems, summary
