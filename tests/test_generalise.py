"""zipkv's distiller, Attention Matching and the biased-cache evaluation (issue 17), on a tiny random Llama."""
import math

import pytest
import torch

from conftest import tiny_llama
from zipkv.distill import attention_matching, bias, evaluate, generalise, kvsculpt
from zipkv.models import capture

pytestmark = pytest.mark.usefixtures("one_thread")

N, M, C = 48, 8, 6


@pytest.fixture(scope="module")
def model():
    return tiny_llama(sharpen_logits=True)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 128, (N + C,), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def whole(model, ids):
    return capture(model, ids)


@pytest.fixture(scope="module")
def cap(whole):
    return whole.prefix(N)


@pytest.fixture(scope="module")
def full(cap):
    return bias.BiasedCache.from_capture(cap)


@pytest.fixture(scope="module")
def reference(model, full, ids):
    return bias.teacher_force(model, full, ids[N:])


def test_zero_bias_full_cache_equals_the_plain_forward(model, cap, ids):
    """The full cache with β = 0, through bias.teacher_force, gives the logits of one plain forward over
    context + continuation (the model's own attention and positions)."""
    ours = bias.teacher_force(model, bias.BiasedCache.from_capture(cap), ids[N:]).logits
    with torch.no_grad():
        plain = model(ids[None]).logits[0, N:].float()
    torch.testing.assert_close(ours, plain, rtol=0, atol=1e-4)


def _per_head(cache, edit):
    """A copy of ``cache`` with ``edit(layer, head, k, v, b) -> (k, v, b)`` applied to every head."""
    keys, values, biases = [], [], []
    for layer, (ks, vs, bs) in enumerate(zip(cache.keys, cache.values, cache.bias)):
        edited = [edit(layer, h, k, v, b) for h, (k, v, b) in enumerate(zip(ks, vs, bs))]
        keys.append([e[0] for e in edited])
        values.append([e[1] for e in edited])
        biases.append([e[2] for e in edited])
    return bias.BiasedCache(keys, values, biases, cache.n_context)


def test_bias_log_c_weighs_as_c_copies_and_minus_inf_removes(model, full, ids):
    """β_j = log 2 is exactly two copies of pair j; β_j = −inf is pair j removed (one j per head)."""
    picks = torch.randint(0, N - M, (full.num_layers, full.num_heads), generator=torch.Generator().manual_seed(3))

    def with_bias(value):
        def edit(layer, h, k, v, b):
            b = b.clone()
            b[picks[layer, h]] = value
            return k, v, b
        return edit

    def duplicated(layer, h, k, v, b):
        j = int(picks[layer, h])
        return torch.cat([k, k[j:j + 1]]), torch.cat([v, v[j:j + 1]]), torch.zeros(k.shape[0] + 1)

    def removed(layer, h, k, v, b):
        keep = torch.arange(k.shape[0]) != picks[layer, h]
        return k[keep], v[keep], b[keep]

    def logits(cache):
        return bias.teacher_force(model, cache, ids[N:]).logits

    weighted = logits(_per_head(full, with_bias(math.log(2.0))))
    torch.testing.assert_close(weighted, logits(_per_head(full, duplicated)), rtol=0, atol=1e-4)
    assert (weighted - logits(full)).abs().max() > 1e-3  # the bias changed something
    torch.testing.assert_close(logits(_per_head(full, with_bias(-math.inf))), logits(_per_head(full, removed)),
                               rtol=0, atol=1e-4)


def test_uncompressed_cache_gives_kl_exactly_zero(model, full, ids, reference):
    assert bias.evaluate(model, full, ids[N:], reference) == 0.0


def test_full_budget_reproduces_attention(model, cap, ids, reference):
    """k + m = N: every old key is kept, w = e^β = 1 matches the mass exactly and the values anchored to the
    originals are the originals, so the model's logits are the full cache's (to float rounding)."""
    cache = generalise.compress(cap, 1.0, m=M)
    assert cache.memory_ratio == 1.0
    for layer in range(cache.num_layers):
        for h in range(cache.num_heads):
            torch.testing.assert_close(cache.keys[layer][h], cap.layers[layer].keys[h], rtol=0, atol=0)
            torch.testing.assert_close(cache.values[layer][h], cap.layers[layer].values[h], rtol=1e-4, atol=1e-4)
            assert float(cache.bias[layer][h].abs().max()) < 1e-4
    run = bias.teacher_force(model, cache, ids[N:])
    torch.testing.assert_close(run.logits, reference.logits, rtol=0, atol=1e-3)
    assert bias.evaluate(model, cache, ids[N:], reference) < 1e-6


def test_attention_matching_full_budget_matches_the_mass_exactly(cap):
    """Attention Matching with every old key kept: its NNLS bias reproduces every training query's
    log-sum-exp (its least-squares values need not be the originals: more keys than the queries' rank)."""
    lc = cap.layers[0]
    H, _, d = lc.keys.shape
    train, val = generalise.future_queries(lc.queries.view(H, -1, N, d), cap.positions, cap.rope, M)
    out = attention_matching.compact_layer(lc.keys, lc.values, train, val, M, N - M)
    t = generalise.HeadTargets.of(train, lc.keys, lc.values, M, 1 / math.sqrt(d))
    _, lse_mse = generalise.objective(t, out["keys"], out["values"], out["bias"], lc.values[:, N - M:])
    assert float(lse_mse.max()) < 1e-8
    few = attention_matching.compact_layer(lc.keys, lc.values, train, val, M, (N - M) // 4)
    assert float(generalise.objective(t, few["keys"], few["values"], few["bias"], lc.values[:, N - M:])[1].max()) > 1e-6


def test_future_queries_split_and_positions(cap):
    lc = cap.layers[0]
    H, _, d = lc.keys.shape
    g = lc.queries.shape[0] // H
    train, val = generalise.future_queries(lc.queries.view(H, g, N, d), cap.positions, cap.rope, M, horizon=16,
                                           validation_every=4)
    per_head = N + M  # every position's content vector, plus the retain zone's real queries
    assert train.shape[1] + val.shape[1] == g * per_head
    assert val.shape[1] == g * (N // 4 + M // 4)
    # the retain queries are the real ones, at their own positions
    retain = lc.queries.view(H, g, N, d)[:, :, N - M:].float()
    assert torch.equal(train.view(H, g, -1, d)[:, :, -(M - M // 4):], retain[:, :, [i for i in range(M)
                                                                                     if (N - M + i) % 4 != 3]])


def test_bad_arguments_raise(cap):
    with pytest.raises(ValueError, match="ratio"):
        generalise.compress(cap, 0.1, m=M)
    with pytest.raises(ValueError, match="budget"):
        generalise.compress(cap, 0.5, m=M, budget="equal")
    with pytest.raises(ValueError, match="probe"):
        generalise.compress(cap, 0.5, m=M, budget="probe")
    with pytest.raises(ValueError, match="bias"):
        bias.BiasedCache([[torch.zeros(3, 4)]], [[torch.zeros(3, 4)]], [[torch.zeros(2)]], 3)


def test_batched_teacher_forcing_equals_one_at_a_time(model, cap, full, ids):
    caches = [full, generalise.compress(cap, 0.5, m=M), bias.as_biased(kvsculpt.compress(cap, 0.3, "select_fit", m=M))]
    for cache, run in zip(caches, bias.teacher_force_many(model, caches, ids[N:])):
        torch.testing.assert_close(run.logits, bias.teacher_force(model, cache, ids[N:]).logits, rtol=0, atol=1e-4)


def test_probe_budget_moves_pairs_to_the_heads_that_move_the_probe_kl(model, cap, ids):
    probe = generalise.sample_probe(model, cap, ids[:N], 8)
    assert probe.ids.shape == (8,)
    cache = generalise.compress(cap, 0.5, m=M, budget="probe", model=model, probe=probe)
    k = round(0.5 * N) - M
    assert int(cache.budget.sum()) == k * cache.budget.numel()  # the same total memory as uniform
    signal = cache.info["signal"]
    assert signal.shape == cache.budget.shape and bool((signal >= 0).all())
    most, least = int(signal.argmax()), int(signal.argmin())
    assert cache.budget.flatten()[most] >= cache.budget.flatten()[least]


def reference_head_sensitivity(model, full, compressed, probe, layers):
    """The per-head loop head_sensitivity batches: one teacher-forced forward per (layer, head), each over a
    BiasedCache in which only that head holds its compressed pairs."""
    kl = torch.zeros(full.num_layers, full.num_heads, dtype=torch.float64)
    for layer in layers:
        for h in range(full.num_heads):
            keys, values, b = ([list(x) for x in cache] for cache in (full.keys, full.values, full.bias))
            keys[layer][h] = compressed.keys[layer][h]
            values[layer][h] = compressed.values[layer][h]
            b[layer][h] = compressed.bias[layer][h]
            kl[layer, h] = bias.evaluate(model, bias.BiasedCache(keys, values, b, full.n_context), probe.ids,
                                         probe.reference)
    return kl


def test_head_sensitivity_batched_equals_one_forward_per_head(model, cap, full, ids):
    probe = generalise.sample_probe(model, cap, ids[:N], 8)
    compressed = generalise.compress(cap, 0.5, m=M)
    want = reference_head_sensitivity(model, full, compressed, probe, [0, 1])
    assert bool((want > 1e-4).all()) and want.unique().numel() == want.numel()
    for batch in (1, 3, 4, None):  # one per forward, forwards that split a layer's heads, all in one
        got = generalise.head_sensitivity(model, full, compressed, probe, batch=batch)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0, msg=f"batch={batch}")
    one = generalise.head_sensitivity(model, full, compressed, probe, layers=[1], batch=2)
    assert float(one[0].abs().sum()) == 0 and torch.equal(one[1], generalise.head_sensitivity(
        model, full, compressed, probe, layers=[1], batch=1)[1])
    for batch in (0, 2.0, True):
        with pytest.raises(ValueError, match="batch"):
            generalise.head_sensitivity(model, full, compressed, probe, batch=batch)
    with pytest.raises(ValueError, match="layers"):
        generalise.head_sensitivity(model, full, compressed, probe, layers=[2])
    longer = bias.BiasedCache([[torch.cat([k, k[:1]]) for k in ks] for ks in full.keys],
                              [[torch.cat([v, v[:1]]) for v in vs] for vs in full.values],
                              [[torch.zeros(k.shape[0] + 1) for k in ks] for ks in full.keys], N)
    with pytest.raises(ValueError, match=r"more pairs than the full cache"):
        generalise.head_sensitivity(model, full, longer, probe)


def test_head_sensitivity_default_batch_fits_the_memory_budget(model, cap, full, ids, monkeypatch):
    """batch=None: as many of a layer's heads per forward as SENSITIVITY_MEMORY holds by _variant_bytes of the
    layers that forward computes (layer 0's heads: both layers; layer 1's: one, so more fit), spread evenly."""
    probe = generalise.sample_probe(model, cap, ids[:N], 8)
    compressed = generalise.compress(cap, 0.5, m=M)
    rows = []
    run = evaluate.teacher_force_batch
    monkeypatch.setattr(evaluate, "teacher_force_batch", lambda m, cache, c: rows.append(max(x.keys.shape[0] for x in cache.layers))
                        or run(m, cache, c))
    per_variant = generalise._variant_bytes(model, N, 8)
    assert generalise._variant_bytes(model, N, 8, layers=1) < per_variant < 2 * generalise._variant_bytes(
        model, N, 8, layers=1) <= 1.8 * per_variant
    for fit, forwards in ((1.5, [1, 1, 1, 1]), (1.8, [1, 1, 2]), (3.5, [2, 2]), (100, [2, 2])):
        monkeypatch.setitem(generalise.SENSITIVITY_MEMORY, "cpu", int(fit * per_variant))
        rows.clear()
        generalise.head_sensitivity(model, full, compressed, probe)
        assert rows == forwards, fit


@pytest.mark.slow
def test_head_sensitivity_batched_equals_the_loop_on_the_embedded_model(embedded):
    """SmolLM2-135M on a 256-token PG19 context, three layers' heads in batches of 4 (more than a layer's 3 heads:
    one forward per layer, the layers below replayed): the KL per (layer, head) is the per-head loop's to 1e-6
    relative."""
    from zipkv import data

    model, tokenizer = embedded
    (window,) = data.windows(tokenizer, data.load_books(), 1, context=256, continuation=16, seed=3)
    cap = capture(model, window.context_ids)
    probe = generalise.sample_probe(model, cap, window.context_ids, 16)
    full = bias.BiasedCache.from_capture(cap)
    compressed = generalise.compress(cap, 0.3, m=32)
    layers = [0, 13, 29]
    want = reference_head_sensitivity(model, full, compressed, probe, layers)
    got = generalise.head_sensitivity(model, full, compressed, probe, layers=layers, batch=4)
    assert bool((want[layers] > 0).all())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the launch-bound per-head loop is a GPU question")
def test_head_sensitivity_on_cuda_equals_the_loop_and_takes_less_time():
    """SmolLM2-135M in float32 on the GPU, the study's window 9 (N = 2048, its probe's seed), all 90 heads: the
    batched signal is the per-head loop's (to the rounding of other kernel shapes) in less time; prints both times,
    the peak memory and the phases of zipkv's whole compression."""
    import time

    from zipkv import data
    from zipkv.models import load_model

    model, tokenizer = load_model(device="cuda")
    window = data.windows(tokenizer, data.load_books(), 10, context=2048, continuation=128)[9]
    cap = capture(model, window.context_ids)
    probe = generalise.sample_probe(model, cap, window.context_ids, 64, seed=9)
    full = bias.BiasedCache.from_capture(cap)
    config = generalise.ZipkvConfig(device="cuda")
    compressed = generalise.compress(cap, 0.3, config=config)

    def timed(run):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        out = run()
        torch.cuda.synchronize()
        return out, time.perf_counter() - started, torch.cuda.max_memory_allocated() / 2**30

    for repeat in range(2):  # the first is a warm-up
        want, loop_s, _ = timed(lambda: reference_head_sensitivity(model, full, compressed, probe, range(30)))
        got, batched_s, peak = timed(lambda: generalise.head_sensitivity(model, full, compressed, probe))
        print(f"head_sensitivity, 90 heads: loop {loop_s:.3f} s, batched {batched_s:.3f} s ({loop_s / batched_s:.1f}x), "
              f"peak {peak:.2f} GiB, max relative difference {float(((got - want).abs() / want.clamp_min(1e-30)).max()):.2e}")
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-9)
    assert batched_s < loop_s
    for repeat in range(2):
        cache = generalise.compress(cap, 0.3, config=config, budget="probe", model=model, probe=probe, cascade=True)
        print("zipkv phases (s):", {name: round(t, 3) for name, t in cache.info["phase_seconds"].items()},
              f"total {cache.seconds:.3f} s")


def test_cascade_on_an_uncompressed_budget_is_a_no_op(model, cap, ids, reference):
    probe = generalise.sample_probe(model, cap, ids[:N], 6)
    cache = generalise.compress_cascade(model, cap, 1.0, probe, m=M)
    assert cache.memory_ratio == 1.0
    assert bias.evaluate(model, cache, ids[N:], reference) < 1e-6


def test_cascade_uses_the_compressed_models_queries(model, cap, ids, reference):
    """Layer 0 (nothing upstream) is distilled with the full model's probe queries; layer 1 with the queries of
    the model whose layer 0 is compressed, so it differs from the same fit on the full model's queries."""
    probe = generalise.sample_probe(model, cap, ids[:N], 6)
    cascade = generalise.compress_cascade(model, cap, 0.5, probe, m=M)
    assert cascade.memory_ratio == pytest.approx(0.5, abs=1e-9)
    assert 0 < bias.evaluate(model, cascade, ids[N:], reference) < 10
    off_policy = capture(model, torch.cat([ids[:N], probe.ids]))  # the full model's queries on the probe
    k = round(0.5 * N) - M
    for layer, same in ((0, True), (1, False)):
        lc = cap.layers[layer]
        H, _, d = lc.keys.shape
        train, val = generalise.future_queries(lc.queries.view(H, -1, N, d), cap.positions, cap.rope, M)
        probe_q = off_policy.layers[layer].queries[:, N:].float().reshape(H, -1, d)
        train = torch.cat([train, probe_q], dim=1)
        fitted = [generalise.distil_layer(lc.keys[h:h + 1], lc.values[h:h + 1], train[h:h + 1], val[h:h + 1], M, k)
                  for h in range(H)]
        diff = max(float((f["values"][0] - cascade.values[layer][h][:k]).abs().max()) for h, f in enumerate(fitted))
        assert (diff < 1e-3) if same else (diff > 1e-3), (layer, diff)
    with pytest.raises(ValueError, match="budget"):
        generalise.compress_cascade(model, cap, 0.5, probe, m=M, budget=torch.ones(2, 2, dtype=torch.long))


def test_probe_budget_with_cascade_keeps_the_allocation(model, cap, ids, reference):
    probe = generalise.sample_probe(model, cap, ids[:N], 6)
    plain = generalise.compress(cap, 0.5, m=M, budget="probe", model=model, probe=probe)
    cascade = generalise.compress(cap, 0.5, m=M, budget="probe", model=model, probe=probe, cascade=True)
    assert torch.equal(plain.budget, cascade.budget)
    assert cascade.method == "zipkv_cascade"
    for cache, last in ((plain, "refit"), (cascade, "cascade")):
        phases = cache.info["phase_seconds"]
        assert list(phases) == ["distil", "head_sensitivity", "allocation", last]
        assert all(t > 0 for t in phases.values()) and sum(phases.values()) <= cache.seconds
    assert 0 < bias.evaluate(model, cascade, ids[N:], reference) < 10


def _layer0(cap):
    lc = cap.layers[0]
    H, _, d = lc.keys.shape
    train, val = generalise.future_queries(lc.queries.view(H, -1, N, d), cap.positions, cap.rope, M)
    return lc, train, val, generalise.HeadTargets.of(train, lc.keys, lc.values, M, 1 / math.sqrt(d))


def _mass_error(t, out):
    """Mean squared error of the compacted old zone's log-sum-exp against the full old zone's, per head."""
    lse_c = torch.logsumexp(torch.baddbmm(out["bias"][:, None, :], t.q, out["keys"].transpose(1, 2)), dim=-1)
    return (lse_c - torch.logsumexp(t.s_old, dim=-1)).square().mean(dim=1)


def test_attention_matching_omp_keeps_all_keys_at_full_budget_and_beats_highest_on_the_mass(cap):
    lc, train, val, t = _layer0(cap)
    full = attention_matching.compact_layer(lc.keys, lc.values, train, val, M, N - M,
                                            attention_matching.AttentionMatchingConfig(keys="omp"))
    assert torch.equal(full["index"], torch.arange(N - M).expand(lc.keys.shape[0], -1))
    assert float(_mass_error(t, full).max()) < 1e-8
    k = (N - M) // 4
    omp, highest = (attention_matching.compact_layer(lc.keys, lc.values, train, val, M, k,
                                                     attention_matching.AttentionMatchingConfig(keys=name))
                    for name in ("omp", "highest"))
    assert not torch.equal(omp["index"], highest["index"])
    assert float(_mass_error(t, omp).mean()) < float(_mass_error(t, highest).mean())


def test_attention_matching_omp_batched_over_heads_equals_one_head_at_a_time(cap):
    lc, train, val, t = _layer0(cap)
    cfg = attention_matching.AttentionMatchingConfig(keys="omp", omp_rounds=5)
    batched = attention_matching.compact_layer(lc.keys, lc.values, train, val, M, 9, cfg)
    for h in range(lc.keys.shape[0]):
        one = attention_matching.compact_layer(lc.keys[h:h + 1], lc.values[h:h + 1], train[h:h + 1], val[h:h + 1], M, 9,
                                               cfg)
        assert torch.equal(one["index"][0], batched["index"][h])
        torch.testing.assert_close(one["values"][0], batched["values"][h], rtol=1e-4, atol=1e-5)


def test_attention_matching_lbfgs_refines_the_highest_keys_on_the_log_sum_exp_match(cap):
    lc, train, val, t = _layer0(cap)
    k = (N - M) // 4
    start, refined = (attention_matching.compact_layer(lc.keys, lc.values, train, val, M, k,
                                                       attention_matching.AttentionMatchingConfig(keys=name))
                      for name in ("highest", "lbfgs"))
    assert torch.equal(start["index"], refined["index"])
    assert float((refined["keys"] - start["keys"]).abs().max()) > 1e-4  # the free keys moved
    assert bool((_mass_error(t, refined) < 0.5 * _mass_error(t, start)).all())


def test_attention_matching_on_policy_and_selection_by_validation(model, cap, ids, reference):
    probe = generalise.sample_probe(model, cap, ids[:N], 6)
    caches = {name: attention_matching.compress(cap, 0.5, m=M, model=model, probe=probe,
                                                config=attention_matching.AttentionMatchingConfig(keys=name))
              for name in attention_matching.KEY_METHODS}
    assert [c.method for c in caches.values()] == [f"am_{x}" for x in attention_matching.KEY_METHODS]
    for cache in caches.values():
        assert cache.memory_ratio == pytest.approx(0.5, abs=1e-9)
        assert 0 < bias.evaluate(model, cache, ids[N:], reference) < 10
    means = {name: float(c.info["validation"].mean()) for name, c in caches.items()}
    assert attention_matching.select_by_validation(caches) == min(means, key=means.get)
    assert len(set(means.values())) == 3  # three different fits
    with pytest.raises(ValueError, match="keys"):
        attention_matching.compress(cap, 0.5, m=M, config=attention_matching.AttentionMatchingConfig(keys="random"))
    with pytest.raises(ValueError, match="probe"):
        attention_matching.compress(cap, 0.5, m=M, model=model)


def test_compare_runs_the_bars_ratio_everywhere_first_and_picks_attention_matching_on_validation(model):
    from zipkv.data import Window
    from zipkv.study.experiments import beyond

    gen = torch.Generator().manual_seed(5)
    windows = [Window(torch.randint(0, 128, (N + C,), generator=gen), N, C, i, "t", 0) for i in range(2)]
    table, objectives = beyond.compare(model, windows, [0.3, 0.5], m=M, n_synthetic=8, steps=2, probe_tokens=4,
                                       kvsculpt_windows=1, ratio_windows=1, progress=False)
    ran = table.groupby(["method", "ratio"]).window.apply(sorted)
    assert ran[("zipkv", 0.3)] == [0, 1] and ran[("attention_matching", 0.3)] == [0, 1]
    assert ran[("zipkv", 0.5)] == [0] and ran[("kvsculpt", 0.3)] == [0] and ran[("kvsculpt", 0.5)] == [0]
    assert set(objectives.method) == set(beyond.METHODS)
    for (w, r), rows in table.groupby(["window", "ratio"]):
        am = rows.set_index("method")
        pick = am.loc["attention_matching", "choice"]
        assert pick in beyond.AM_VARIANTS and am.loc["attention_matching", "kl"] == am.loc[pick, "kl"]
    cut, _ = beyond.compare(model, windows, [0.3], methods=["select_fit", "zipkv"], m=M, probe_tokens=4,
                            time_budget_s=0.0, progress=False)
    assert len(cut) == 0  # nothing fits in no time
    # a run over windows[1:] (window_offset=1) gives the rows a whole run gives there: the same probe, the same labels
    whole = table[(table.window == 1) & table.method.isin(["select_fit", "zipkv"]) & (table.ratio == 0.3)]
    part, _ = beyond.compare(model, windows[1:], [0.3], methods=["select_fit", "zipkv"], m=M, n_synthetic=8, steps=2,
                             probe_tokens=4, window_offset=1, progress=False)
    assert part.window.tolist() == [1, 1]
    assert part.set_index("method").kl.to_dict() == whole.set_index("method").kl.to_dict()


def test_chapter_verdict_names_ratios_a_time_budget_left_out_and_compares_equal_window_sets():
    import pandas as pd

    from zipkv.study.chapters import beyond as chapter
    from zipkv.study.experiments import beyond

    rows = [dict(model="m", window=w, ratio=r, method=x, kl=kl, seconds=1.0, choice="am_omp" * (x == "attention_matching"))
            for r, windows in ((0.3, range(4)), (0.5, range(2)))
            for w in windows for x, kl in zip(beyond.METHODS, (0.09, 0.05, 0.04, 0.045, 0.001, 0.03, 0.02, 0.025, 0.02, 0.01))
            if x != "kvsculpt" or (r == 0.3 and w == 0)]
    table = pd.DataFrame(rows)
    stats = chapter.kl_stats(table)
    assert "kvsculpt" not in chapter.comparable(stats, 0.3)  # one window against four: not compared by its mean
    text, kind = chapter.verdict(stats, table, [0.2, 0.3, 0.5], model="m", n_windows=4, scaled=False)
    assert "not run here (the run's time budget left them out): r = 0.2" in text and "**not all met**" in text and kind == "warning"
    assert "**4.00× below the best Select+Fit**" in text and "lower on 4 of 4 windows" in text
    assert "at r = 0.5 (2 windows) its mean KL is 2× below the best baseline's, below every baseline on 2 of 2 windows" in text
    met, _ = chapter.verdict(stats, table, [0.3, 0.5], model="m", n_windows=4, scaled=False)
    assert met.endswith(": met.") and "per context" not in met                # no H200: no speed bar
    fast, kind = chapter.verdict(stats, table, [0.3, 0.5], model="m", n_windows=4, scaled=False, device="NVIDIA H200")
    assert "1.0 s per context at r = 0.3 (median; max 1.0 s; target ≤ 10 s on the H200: met)" in fast and kind == "tip"
    slow = table.copy()
    slow.loc[(slow.method == "zipkv") & (slow.ratio == 0.3) & (slow.window == 2), "seconds"] = 10.5
    text, kind = chapter.verdict(stats, slow, [0.3, 0.5], model="m", n_windows=4, scaled=False, device="NVIDIA H200")
    assert "max 10.5 s; target ≤ 10 s on the H200: **missed**" in text and "**not all met**" in text and kind == "warning"
    worse = table.copy()                     # one window where a baseline beats zipkv at r = 0.5
    worse.loc[(worse.method == "select_fit_dense") & (worse.ratio == 0.5) & (worse.window == 1), "kl"] = 0.001
    text, _ = chapter.verdict(chapter.kl_stats(worse), worse, [0.3, 0.5], model="m", n_windows=4, scaled=False)
    assert "below every baseline on 1 of 2 windows" in text


def test_extra_rows_join_only_this_model_and_settings_and_what_the_run_lacks(tmp_path):
    import pandas as pd

    from zipkv.study.chapters import beyond as chapter

    table = pd.DataFrame({"model": ["m"] * 2, "window": [0, 0], "ratio": [0.3, 0.3], "method": ["zipkv", "select_fit"],
                          "kl": [0.01, 0.05], "seconds": [1.0, 1.0], "choice": ["", ""]})
    extra = pd.DataFrame({"model": ["m", "m", "other", "m"], "window": [0, 1, 1, 1], "ratio": [0.3, 0.5, 0.5, 0.5],
                          "method": ["zipkv", "zipkv", "zipkv", "select_fit"], "kl": [0.9, 0.02, 0.03, 0.04],
                          "seconds": [2.0] * 4, "choice": [""] * 4, "context": [2048, 2048, 2048, 1024],
                          "device": ["H200"] * 4, "commit": ["abc"] * 4, "date": ["2026-12-01"] * 4})
    extra.to_csv(tmp_path / "x.csv", index=False)
    out, text = chapter.with_extra_rows(table, tmp_path / "x.csv", context=2048)
    assert out[["window", "ratio", "method", "kl"]].values.tolist()[-1] == [1, 0.5, "zipkv", 0.02] and len(out) == 3
    assert "H200, commit abc" in text and "r = 0.5 on 1 windows" in text
    assert chapter.with_extra_rows(table, None)[1] == "" and "absent" in chapter.with_extra_rows(table, tmp_path / "y")[1]
    # seconds compare only within this run: the separate run's rows (2.0 s each) stay out of the speed column
    assert out.separate.tolist() == [False, False, True] and chapter.own_rows(out).seconds.tolist() == [1.0, 1.0]
    stats = chapter.kl_stats(out)
    shown = chapter.summary(out, stats, [0.3, 0.5])
    from zipkv.study.experiments.beyond import LABELS
    assert shown.loc[LABELS["zipkv"], "seconds per context (this run, mean over its ratios)"] == 1.0


@pytest.mark.parametrize("ratios", ["[0.3, 0.5]", [], [0.3, 1.5], [0.3, True], 0.3])
def test_compare_refuses_ratios_that_are_not_a_list_of_fractions_before_any_work(model, ratios):
    from zipkv.study.experiments import beyond
    with pytest.raises(TypeError, match="ratios must be a non-empty list of numbers in"):
        beyond.compare(model, [], ratios, progress=False)


@pytest.mark.parametrize("field, value, error, match", [
    ("horizon", 2.5, ValueError, r"ZipkvConfig\(horizon=2.5\): expected an int ≥ 1"),   # "positions must be an integer"
    ("selection", "median", ValueError, r"ZipkvConfig\(selection='median'\): expected 'mean' or 'max'"),
    ("bias", "no", TypeError, r"ZipkvConfig\(bias='no'\): expected True"),                   # read as True
    ("mass_ridge", -1.0, ValueError, r"ZipkvConfig\(mass_ridge=-1.0\): expected a finite number ≥ 0"),  # a Cholesky error
    ("bias_bound", -1.0, ValueError, r"ZipkvConfig\(bias_bound=-1.0\): expected a number ≥ 0"),         # silently used
    ("value_ridges", (), ValueError, r"ZipkvConfig\(value_ridges=\(\)\): expected a non-empty tuple"),  # torch.stack's
    ("value_ridges", 0.1, ValueError, r"ZipkvConfig\(value_ridges=0.1\)"),                  # "'float' object is not iterable"
    ("max_scores", 0, ValueError, r"ZipkvConfig\(max_scores=0\): expected an int ≥ 1 or None"),
    ("dtype", torch.int32, TypeError, r"ZipkvConfig\(dtype=torch.int32\): expected torch.float32 or torch.float64"),
    ("device", "nodevice", ValueError, r"ZipkvConfig\(device='nodevice'\): expected a torch device"),
])
def test_zipkv_config_is_checked_when_made(field, value, error, match):
    """A bad setting of zipkv's distiller failed deep in the solve (or not at all): now when the config is made."""
    with pytest.raises(error, match=match):
        generalise.ZipkvConfig(**{field: value})
    assert generalise.ZipkvConfig(horizon=8, max_scores=None, value_ridges=(math.inf,), bias_bound=math.inf).horizon == 8


def test_replayed_layers_give_back_the_forward_they_found(model):
    """A layer's own instance forward (accelerate's hooks set one) is restored after the replay, and a layer without
    one is back to its class's."""
    layers = model.model.layers
    marker = layers[1].forward

    def own(*args, **kwargs):
        return marker(*args, **kwargs)

    layers[1].forward = own
    try:
        with generalise._replayed_layers(model, [torch.zeros(1, 2, 3), torch.ones(1, 2, 3)], 2, rows=3):
            assert torch.equal(layers[1](), torch.ones(3, 2, 3)) and layers[0](torch.ones(1)).shape == (3, 2, 3)
        assert layers[1].forward is own and "forward" not in layers[0].__dict__
    finally:
        del layers[1].forward
