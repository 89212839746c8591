"""End-to-end evaluation of compressed caches in a tiny random Llama (KVSculpt §4 metric, §6.1)."""
from __future__ import annotations

import pytest
import torch

from zipkv.distill import evaluate as E
from zipkv.distill import kvsculpt as K
from conftest import tiny_llama

N, C, M = 40, 12, 8


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_llama(sharpen_logits=True)  # larger logits too, so KL differences show


@pytest.fixture(scope="module")
def window():
    ids = torch.randint(0, 128, (N + C,), generator=torch.Generator().manual_seed(2))
    return ids[:N], ids[N:]


@pytest.fixture(scope="module")
def cap(model, window):
    from zipkv.models import capture

    return capture(model, window[0])


@pytest.fixture(scope="module")
def full(cap):
    return K.CompressedCache.from_capture(cap)


@pytest.fixture(scope="module")
def reference(model, full, window):
    return E.teacher_force(model, full, window[1])


@torch.no_grad()
def manual_logits(model, cache: K.CompressedCache, ids: torch.Tensor) -> torch.Tensor:
    """An independent Llama forward over ``cache`` with each head's own length (no padding, no masks),
    adding ``cache.bias`` (when set) to the cached pairs' logits."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    x = model.model.embed_tokens(ids[None])
    pos = torch.arange(cache.n_context, cache.n_context + ids.shape[0])[None]
    cos, sin = model.model.rotary_emb(x, pos)
    d, Hq = 16, model.config.num_attention_heads
    group = Hq // model.config.num_key_value_heads
    causal = torch.ones(ids.shape[0], ids.shape[0], dtype=torch.bool).tril()
    for l, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(1, -1, Hq, d).transpose(1, 2)
        k = attn.k_proj(h).view(1, -1, Hq // group, d).transpose(1, 2)
        v = attn.v_proj(h).view(1, -1, Hq // group, d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        heads = []
        for qh in range(Hq):
            kv = qh // group
            keys = torch.cat([cache.keys[l][kv], k[0, kv]])
            values = torch.cat([cache.values[l][kv], v[0, kv]])
            n = cache.keys[l][kv].shape[0]
            s = q[0, qh] @ keys.T * d ** -0.5
            if cache.bias is not None:
                s[:, :n] = s[:, :n] + cache.bias[l][kv]
            s[:, n:] = s[:, n:].masked_fill(~causal, float("-inf"))
            heads.append(torch.softmax(s, dim=-1) @ values)
        x = x + attn.o_proj(torch.stack(heads, 1).reshape(1, ids.shape[0], -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.model.norm(x))[0]


def test_uncompressed_cache_gives_exactly_zero(model, full, window, reference):
    ev = E.evaluate(model, full, window[1], reference)
    assert ev.kl == 0.0 and torch.equal(ev.kl_per_token, torch.zeros(C, dtype=torch.float64))
    assert torch.equal(ev.hidden_error, torch.zeros(2, dtype=torch.float64))
    assert reference.logits.shape == (C, 128) and reference.hidden.shape == (2, C, 64)
    # the same as running the whole window through the model in one pass
    with torch.no_grad():
        plain = model(torch.cat(window)[None]).logits[0, N:]
    assert (plain - reference.logits).abs().max() < 1e-4
    # the model keeps its own attention implementation
    assert model.config._attn_implementation in ("sdpa", "eager")


def test_padding_with_masked_keys_gives_zero(model, full, window, reference):
    """Garbage keys anywhere in the padded cache, masked per head, change nothing."""
    gen = torch.Generator().manual_seed(3)
    layers = []
    for layer in range(full.num_layers):
        k, v, valid = full.padded(layer)
        H, P, d = k.shape
        pad = 7
        # insert 7 huge garbage pairs at the front of head 0 and the back of head 1
        gk = 50.0 * torch.randn(H, P + pad, d, generator=gen)
        gv = 50.0 * torch.randn(H, P + pad, d, generator=gen)
        ok = torch.zeros(H, P + pad, dtype=torch.bool)
        gk[0, pad:], gv[0, pad:], ok[0, pad:] = k[0], v[0], True
        gk[1, :P], gv[1, :P], ok[1, :P] = k[1], v[1], True
        layers.append((gk, gv, ok))
    run = E.teacher_force_padded(model, layers, full.n_context, window[1])
    kl = E.kl_divergence(reference.logits, run.logits)
    assert float(kl.max()) < 1e-10
    assert float(E.hidden_state_error(reference.hidden, run.hidden).max()) < 1e-5


def test_per_head_lengths_are_exact(model, cap, window):
    budget = torch.tensor([[2, 25], [13, 5]])  # every layer's heads differ in length
    cache = K.compress(cap, 0.5, "select_fit", m=M, n_synthetic=8, budget=budget,
                       config=K.SculptConfig(progress=False))
    assert torch.equal(cache.lengths, budget + M)
    run = E.teacher_force(model, cache, window[1])
    want = manual_logits(model, cache, window[1])
    assert (run.logits - want).abs().max() < 1e-4 * want.abs().max()
    # and the manual forward agrees with the model on the full cache too
    full = K.CompressedCache.from_capture(cap)
    assert (manual_logits(model, full, window[1]) - E.teacher_force(model, full, window[1]).logits).abs().max() < 1e-4


def test_compressed_cache_kl_and_hidden_error(model, cap, full, window, reference):
    cfg = K.SculptConfig(steps=3, progress=False)
    evs = {}
    for method in ("random", "select_fit", "kvsculpt"):
        cache = K.compress(cap, 0.4, method, m=M, n_synthetic=8, config=cfg)
        evs[method] = E.evaluate(model, cache, window[1], reference)
    for ev in evs.values():
        assert ev.kl_per_token.shape == (C,) and (ev.kl_per_token >= 0).all()
        assert ev.kl > 0 and ev.hidden_error.shape == (2,) and (ev.hidden_error > 0).all()
    # a full-cache object as the reference gives the same numbers as a precomputed reference
    again = E.evaluate(model, K.compress(cap, 0.4, "random", m=M, n_synthetic=8, config=cfg), window[1], full)
    assert again.kl == pytest.approx(evs["random"].kl, rel=1e-12)


def test_single_layer_kl(model, cap, full, window, reference):
    cache = K.compress(cap, 0.4, "attention_score", m=M, n_synthetic=8)
    table = E.single_layer_kl(model, full, cache, window[1], reference)
    assert list(table["layer"]) == [0, 1, -1]
    assert (table["kl"] >= 0).all() and table["kl"].iloc[-1] > 0
    mixed = full.with_layers(cache, [1])
    assert torch.equal(mixed.lengths[0], torch.full((2,), N)) and torch.equal(mixed.lengths[1], cache.lengths[1])


def test_compare_methods_one_call_per_table(model, window):
    out = E.compare_methods(model, [window, torch.cat(window)], [0.5], ["select_fit", "kvsculpt"], m=M,
                            n_synthetic=8, config=K.SculptConfig(steps=2, progress=False), n_context=N,
                            progress=False)
    table = out.table
    assert list(table.columns[:4]) == ["window", "ratio", "method", "kl"]
    assert len(table) == 4 and set(table["method"]) == {"select_fit", "kvsculpt"}
    # both windows are the same tokens, so identical results
    a, b = table[table.window == 0].kl.to_numpy(), table[table.window == 1].kl.to_numpy()
    assert abs(a - b).max() < 1e-9
    ks = out.layers[out.layers.method == "kvsculpt"].reset_index()
    sf = out.layers[out.layers.method == "select_fit"].reset_index()
    assert len(ks) == 2 * 2
    # KVSculpt starts where Select+Fit ends, on the same (shared) training queries, layer by layer
    assert (abs(ks.initial_loss - sf.loss) <= 1e-5 * sf.loss).all()
    assert len(out.tokens) == 4 * C


def test_evaluate_errors(model, cap, full, window):
    with pytest.raises(ValueError, match="continuation_ids"):
        E.teacher_force(model, full, torch.randn(4))
    with pytest.raises(ValueError, match="cache has 1 layers"):
        E.teacher_force(model, K.CompressedCache(full.keys[:1], full.values[:1], N), window[1])
    one_head = K.CompressedCache([ks[:1] for ks in full.keys], [vs[:1] for vs in full.values], N)
    with pytest.raises(ValueError, match="2 KV heads"):
        E.teacher_force(model, one_head, window[1])
    with pytest.raises(ValueError, match="window"):
        E.compare_methods(model, [torch.cat(window)], [0.5], ["select_fit"], m=M)
    with pytest.raises(ValueError, match="values"):
        K.CompressedCache([[torch.zeros(3, 4)]], [[torch.zeros(2, 4)]], 3)


def test_late_errors_of_the_distillation_api_come_first_and_name_the_argument(model, cap, full, window, monkeypatch):
    """Each of these raised a raw AttributeError, IndexError or 'str' object is not callable after seconds of work,
    or returned an empty table."""
    monkeypatch.setattr(E, "teacher_force", lambda *a, **k: pytest.fail("work ran before the arguments were checked"))
    with pytest.raises(TypeError, match="reference=NoneType: expected the full cache"):
        E.evaluate(model, full, window[1], None)
    with pytest.raises(TypeError, match="cache=str: expected a zipkv.distill.CompressedCache"):
        E.evaluate(model, "cache", window[1], full)
    with pytest.raises(ValueError, match=r"continuation_ids holds ids in \[0, 500\]: expected token ids in \[0, 127\]"):
        E.evaluate(model, full, torch.tensor([0, 500]), full)
    for name, kwargs in (("windows", dict(windows=[], ratios=[0.5], methods=["select_fit"])),
                         ("ratios", dict(windows=[window], ratios=[], methods=["select_fit"])),
                         ("methods", dict(windows=[window], ratios=[0.5], methods=[]))):
        with pytest.raises(ValueError, match=rf"{name}=.*expected a non-empty list"):
            E.compare_methods(model, **kwargs, m=M)
    with pytest.raises(ValueError, match=r"methods \['h2o'\]"):
        E.compare_methods(model, [window], [0.5], ["h2o"], m=M)
    monkeypatch.setattr(K, "build_problems", lambda *a, **k: pytest.fail("problems were built first"))
    with pytest.raises(TypeError, match="solver=3: expected 'batched', 'reference'"):
        K.compress(cap, 0.5, "kvsculpt", m=M, solver=3)
    with pytest.raises(ValueError, match="solver='fast': expected 'reference' or 'batched'"):
        K.compress(cap, 0.5, "kvsculpt", m=M, solver="fast")


def test_the_capture_level_compress_takes_a_solver_by_name(cap):
    """zipkv.compress took solver='batched' and the capture-level compress failed on it ('str' is not callable)."""
    named = K.compress(cap, 0.5, "kvsculpt", m=M, n_synthetic=4, solver="batched", config=K.SculptConfig(steps=1))
    assert named.method == "kvsculpt"


def test_compare_methods_prints_one_line_per_run_with_seconds(model, window, capsys):
    E.compare_methods(model, [window], [0.5], ["random", "select_fit"], m=M, n_synthetic=8,
                      config=K.SculptConfig(steps=1, progress=False), n_context=N, progress=True)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 + 2, "one line per window (capture), then one per (window, ratio, method)"
    assert lines[0].startswith("window 0: capture")
    for line, method in zip(lines[1:], ["random", "select_fit"]):
        assert line.startswith(f"window 0 r=0.5 {method}") and "compress" in line and "evaluate" in line
        assert line.rstrip().endswith("s)")


def test_heldout_objective_is_zero_for_the_full_cache_and_positive_when_compressed(model, window, cap, full):
    from zipkv.models import capture

    whole = capture(model, torch.cat(window))
    evicted = K.compress(cap, 0.5, "random", m=M, n_synthetic=8, config=K.SculptConfig(steps=1, progress=False))
    table = E.heldout_objective(whole, N, {"full": full, "random": evicted}, M)
    per = table.groupby("method").heldout
    assert len(table) == 2 * len(cap.layers) * cap.layers[0].keys.shape[0]
    assert per.max()["full"] < 1e-10, "the uncompressed cache reproduces attention on any query"
    assert per.min()["random"] > 1e-6, "evicting half the old pairs must cost something on held-out queries"


def test_solver_agreement_reports_both_solvers_on_every_problem(model, window):
    from zipkv.distill import batched

    config = K.SculptConfig(steps=3, dtype=torch.float64, progress=False)
    problems, summary = E.solver_agreement(model, window, 0.5, m=M, n_synthetic=8, config=config, n_context=N,
                                           progress=False)
    assert list(summary.solver) == ["select_fit", "reference", "batched"]
    assert len(problems) == 2 * 2 and {"select_fit", "reference", "batched"} <= set(problems.columns)
    assert (problems.reference < 0.99 * problems.select_fit).any(), "the solver moved somewhere"
    row = summary.set_index("solver")
    assert abs(row.loc["batched", "median_loss_ratio"] - 1) < 1e-6, "float64: the same trajectories"
    assert abs(row.loc["batched", "kl_ratio"] - 1) < 1e-4
    same, _ = E.solver_agreement(model, window, 0.5, solvers={"a": batched.solve, "b": batched.solve}, m=M,
                                 n_synthetic=8, config=config, n_context=N, concurrent=True, progress=False)
    assert (same.a == same.b).all() and (same.a == problems.batched).all(), "threads change nothing"
