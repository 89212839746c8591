"""The distilled cache in Hugging Face generate: exact per-head lengths, positions at N, the logit bias (issue 18)."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from zipkv import cache as C
from zipkv.distill import evaluate as E
from zipkv.distill import kvsculpt as K
from conftest import tiny_llama
from test_evaluate import manual_logits

N, T, M = 30, 8, 6

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_llama(sharpen_logits=True)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 128, (N + T,), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def cap(model, ids):
    from zipkv.models import capture

    return capture(model, ids[:N])


def greedy(model, ids, **kw):
    return model.generate(ids[None], max_new_tokens=T, do_sample=False, **kw)[0, -T:]


def test_full_cache_generates_what_the_model_generates(model, ids, cap):
    cache = C.DistilledCache.from_compressed(K.CompressedCache.from_capture(cap), model, context_ids=ids[:N])
    plain = greedy(model, ids[:N + 1])
    assert torch.equal(greedy(model, ids[N:N + 1], past_key_values=cache), plain), "positions continue at N"
    assert cache.get_seq_length() == T and cache.next_position == N + T
    cache.reset()
    assert cache.get_seq_length() == 0 and torch.equal(cache.lengths, torch.full((2, 2), N))
    assert torch.equal(greedy(model, ids[N:N + 1], past_key_values=cache), plain), "reset: the same again"


def test_beam_search_and_several_samples_follow_the_model(model, ids, cap):
    full = K.CompressedCache.from_capture(cap)
    cache = C.DistilledCache.from_compressed(full, model)
    plain = model.generate(ids[None, :N + 1], max_new_tokens=T, do_sample=False, num_beams=3)[0, -T:]
    assert torch.equal(model.generate(ids[None, N:N + 1], past_key_values=cache, max_new_tokens=T, do_sample=False,
                                      num_beams=3)[0, -T:], plain)
    torch.manual_seed(0)
    plain = model.generate(ids[None, :N + 1], max_new_tokens=T, do_sample=True, num_return_sequences=2)[:, -T:]
    torch.manual_seed(0)
    ours = model.generate(ids[None, N:N + 1], past_key_values=C.DistilledCache.from_compressed(full, model),
                          max_new_tokens=T, do_sample=True, num_return_sequences=2)[:, -T:]
    assert torch.equal(ours, plain)
    # reset() returns to the one compressed context: the beams' rows go too (before, the next 1-row generate failed)
    cache.reset()
    assert cache.layers[0].keys.shape[0] == 1 and cache.get_seq_length() == 0
    assert torch.equal(greedy(model, ids[N:N + 1], past_key_values=cache), greedy(model, ids[:N + 1]))


def test_per_head_lengths_in_generate_equal_the_manual_forward(model, ids, cap):
    budget = torch.tensor([[1, 20], [9, 3]])
    compressed = K.compress(cap, 0.5, "select_fit", m=M, n_synthetic=8, budget=budget,
                            config=K.SculptConfig(progress=False))
    cache = C.DistilledCache.from_compressed(compressed, model)
    assert torch.equal(cache.lengths, budget + M)
    with torch.no_grad():
        logits = model(ids[None, N:], past_key_values=cache).logits[0]
    want = manual_logits(model, compressed, ids[N:])
    assert (logits - want).abs().max() < 1e-4 * want.abs().max()
    # the model's eager attention takes the same mask
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            eager = model(ids[None, N:], past_key_values=cache.fresh()).logits[0]
    finally:
        model.set_attn_implementation(previous)
    assert (eager - want).abs().max() < 1e-4 * want.abs().max()
    # one token at a time (generate's decode path) gives the same logits as the one-pass forward
    cache.reset()
    with torch.no_grad():
        steps = torch.cat([model(ids[None, N + t:N + t + 1], past_key_values=cache).logits[0] for t in range(T)])
    assert (steps - logits).abs().max() < 1e-4 * want.abs().max()


def with_bias(compressed, bias):
    return K.CompressedCache(compressed.keys, compressed.values, compressed.n_context, bias=bias)


def test_bias_enters_the_logits_exactly(model, ids, cap):
    full = K.CompressedCache.from_capture(cap)
    gen = torch.Generator().manual_seed(1)
    bias = [[2.0 * torch.randn(k.shape[0], generator=gen) for k in ks] for ks in full.keys]
    biased = with_bias(full, bias)
    run = E.teacher_force(model, biased, ids[N:])
    want = manual_logits(model, biased, ids[N:])
    assert (run.logits - want).abs().max() < 1e-4 * want.abs().max()
    plain = E.teacher_force(model, full, ids[N:])
    assert (run.logits - plain.logits).abs().max() > 1e-2 * want.abs().max(), "the bias changes the result"
    # every pair twice with bias −log 2 is the same attention as every pair once
    doubled = K.CompressedCache([[torch.cat([k, k]) for k in ks] for ks in full.keys],
                                [[torch.cat([v, v]) for v in vs] for vs in full.values], N,
                                bias=[[torch.full((2 * k.shape[0],), -math.log(2.0)) for k in ks] for ks in full.keys])
    again = E.teacher_force(model, doubled, ids[N:])
    assert (again.logits - plain.logits).abs().max() < 1e-5 * plain.logits.abs().max()
    # a zero bias is no bias
    zero = with_bias(full, [[torch.zeros(k.shape[0]) for k in ks] for ks in full.keys])
    assert torch.equal(E.teacher_force(model, zero, ids[N:]).logits, plain.logits)


def test_bias_survives_with_layers_and_is_checked(cap):
    full = K.CompressedCache.from_capture(cap)
    biased = with_bias(full, [[torch.ones(k.shape[0]) for k in ks] for ks in full.keys])
    mixed = full.with_layers(biased, [1])
    assert float(mixed.padded_bias(0).abs().max()) == 0 and bool((mixed.padded_bias(1) == 1).all())
    with pytest.raises(ValueError, match="bias"):
        with_bias(full, [[torch.ones(3) for _ in ks] for ks in full.keys])


def test_bad_uses_are_refused(model, ids, cap):
    full = K.CompressedCache.from_capture(cap)
    cache = C.DistilledCache.from_compressed(full, model, context_ids=ids[:N])
    with pytest.raises(ValueError, match="context tokens"):
        model.generate(ids[None], past_key_values=cache, max_new_tokens=1)
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 38\) and padding: expected \[1, 8\], one column "
                                         "per token after the context"):    # a mask over the context too
        model(ids[None, N:], attention_mask=torch.tensor([[0] * N + [1] * T]), past_key_values=cache)
    previous = model.config._attn_implementation
    model.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ValueError, match="attn_implementation"):
            model(ids[None, N:], past_key_values=cache.fresh())
    finally:
        model.config._attn_implementation = previous
    C.detach(model)
    try:
        with pytest.raises(RuntimeError, match="attach"):
            model(ids[None, N:], past_key_values=cache.fresh())
    finally:
        C.attach(model)
    with pytest.raises(ValueError, match="2 × 2"):
        C.DistilledCache.from_compressed(K.CompressedCache(full.keys[:1], full.values[:1], N), model)
    half = C.DistilledCache.from_compressed(full, dtype=torch.bfloat16)   # a cache made for a bf16 model
    with pytest.raises(ValueError, match=r"holds torch.bfloat16 on cpu, the model runs torch.float32 on cpu"):
        model(ids[None, N:], past_key_values=half)
    k, v, valid = full.padded(0)
    with pytest.raises(ValueError, match="at least one"):
        C.DistilledLayer(k, v, torch.zeros_like(valid))
    with pytest.raises(ValueError, match="bias"):
        C.DistilledLayer(k, v, valid, torch.full(valid.shape, float("nan")))
    with pytest.raises(ValueError, match=r"keys \(torch.float32 on cpu\) and values \(torch.bfloat16 on cpu\)"):
        C.DistilledLayer(k, v.bfloat16(), valid)
    with pytest.raises(TypeError, match="keys and values must be torch.Tensor, got list and list"):
        C.DistilledLayer(k.tolist(), v.tolist())
    with pytest.raises(TypeError, match="layers must be DistilledLayer objects, got Tensor"):
        C.DistilledCache([k], N)
    # hand-built caches that do not fit the model (2 layers of 2 KV heads, head_dim 16): refused before attention
    layer = C.DistilledLayer(k, v, valid)
    for layers, seen in (([layer], r"1 layers, KV heads \[2\], head_dim \[16\]"),
                         ([C.DistilledLayer(k[:1], v[:1], valid[:1])] * 2, r"2 layers, KV heads \[1\]"),
                         ([C.DistilledLayer(k[..., :8], v[..., :8], valid)] * 2, r"head_dim \[8\]")):
        with pytest.raises(ValueError, match=rf"the DistilledCache has .*{seen}.*; the model 2 layers of 2 KV heads of "
                                             "head_dim 16"):
            model.generate(ids[None, N:N + 1], past_key_values=C.DistilledCache(layers, N), max_new_tokens=1)


def test_compress_refuses_bad_arguments_before_running_the_model(model, ids):
    import zipkv

    kvsculpt = dict(method="kvsculpt")
    for kwargs, match in ((dict(method="h2o"), "method='h2o'"),
                          (dict(kept_fraction=0.1, m=6), r"m=6: expected an int, 0 ≤ m < 3 \(the pairs kept"),
                          (dict(kept_fraction=0.01), r"kept_fraction=0.01: expected the fraction of the context kept"),
                          (dict(kept_fraction=1.5), r"kept_fraction=1.5: expected the fraction of the context kept, "
                                                    r"in \(0, 1\].*kvpress's compression_ratio is the fraction removed"),
                          (dict(kept_tokens=40), r"kept_tokens=40: expected 2 ≤ kept_tokens ≤ N = 30"),
                          (dict(kept_fraction=0.3, kept_tokens=9), "give one budget"),
                          (dict(m="8"), "m='8': expected an int"),
                          (dict(m=6, steps=2, config=K.SculptConfig(), **kvsculpt), "one way"),
                          (dict(m=6, value_every=0, **kvsculpt), "value_every=0")):
        with pytest.raises(ValueError, match=match):
            zipkv.compress(model, ids[:N], **kwargs)
    with pytest.raises(ValueError, match=r"input_ids .* N ≥ 16"):
        zipkv.compress(model, torch.rand(N), m=6)
    with pytest.raises(ValueError, match=r"input_ids has shape \(8,\) .* N ≥ 16"):
        zipkv.compress(model, ids[:8])
    for args, kwargs, match in (((model, "hello world"), dict(m=6), "input_ids must be token ids .* got str"),
                                ((None, ids[:N]), dict(m=6), "model must be a loaded Hugging Face causal LM .* got NoneType"),
                                ((model, ids[:N]), dict(kept_fraction="0.3"), "kept_fraction='0.3': expected a number, "
                                                                              "the fraction of the context kept"),
                                ((model, ids[:N]), dict(kept_fraction=True), "kept_fraction=True: expected a number"),
                                ((model, ids[:N]), dict(kept_tokens=9.0), "kept_tokens=9.0: expected an int"),
                                ((model, ids[:N]), dict(ratio=0.3), "ratio= is now kept_fraction= .* kvpress's "
                                                                    "compression_ratio is the fraction removed"),
                                ((model, ids[:N]), dict(step=2, **kvsculpt), r"unexpected setting step=2 \(did you mean "
                                                                             r"steps=\?\)"),
                                ((model, ids[:N]), dict(steps=2), r"compress\(method='zipkv'\) got an unexpected "
                                                                  r"setting steps=2")):
        with pytest.raises(TypeError, match=match):
            zipkv.compress(*args, **kwargs)
    cache = zipkv.compress(model, ids[:N], kept_fraction=0.5, method="select_fit", m=6, n_synthetic=4)
    assert isinstance(cache, zipkv.DistilledCache) and torch.equal(cache.lengths, torch.full((2, 2), 15))
    # a second generate from the same cache without reset(): a clear error, not a reshape deep in the model
    first = model.generate(ids[None, N:N + 1], past_key_values=cache, max_new_tokens=3, do_sample=False)
    with pytest.raises(ValueError, match=r"still holds the 3 tokens .* call cache.reset\(\)"):
        model.generate(ids[None, N:N + 1], past_key_values=cache, max_new_tokens=3, do_sample=False)
    # a longer new prompt without reset(): generate would drop its first 3 tokens and continue the old ones
    with pytest.raises(ValueError, match=r"do not continue this DistilledCache: it still holds the 3 tokens"):
        model.generate(ids[None, N:N + 6], past_key_values=cache, max_new_tokens=3, do_sample=False)
    # the earlier output, continued: its first tokens are what the cache holds
    more = model.generate(first, past_key_values=cache, max_new_tokens=2, do_sample=False)
    twin = copy.deepcopy(model)                   # the check is bound to each model, a copy's to the copy
    assert twin.generate.__self__ is twin and model.generate.__self__ is model
    cache.reset()
    again = model.generate(ids[None, N:N + 1], past_key_values=cache, max_new_tokens=3, do_sample=False)
    assert torch.equal(first, again)
    assert torch.equal(more, model.generate(ids[None, N:N + 1], past_key_values=cache.fresh(), max_new_tokens=5,
                                            do_sample=False))


def test_every_row_of_a_batch_must_continue_its_own_sequence(model, ids, cap):
    """After a batched generate, a row that does not begin with its own appended tokens is refused (before, only the
    first row was checked, and a stale second row silently lost its first tokens)."""
    cache = C.DistilledCache.from_compressed(K.CompressedCache.from_capture(cap), model, context_ids=ids[:N])
    two = torch.stack([ids[N:N + 1], ids[N + 1:N + 2]])
    out = model.generate(two, past_key_values=cache, max_new_tokens=3, do_sample=False)
    other = torch.cat([out[1:, :1], ids[None, N + 2:N + 7]], dim=1)              # row 1: a new prompt, not its own
    with pytest.raises(ValueError, match=r"do not continue this DistilledCache \(rows \[1\]\)"):
        model.generate(torch.cat([torch.cat([out[:1], ids[None, N + 2:N + 4]], dim=1), other]), past_key_values=cache,
                       max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match="input_ids has 3 rows, and this DistilledCache holds the tokens an earlier "
                                         "generate appended for 2 sequences"):
        model.generate(torch.cat([out, out[:1]]), past_key_values=cache, max_new_tokens=2, do_sample=False)
    more = model.generate(out, past_key_values=cache, max_new_tokens=2, do_sample=False)   # both rows continue
    for row in range(2):                                        # each row as it would continue on its own
        alone = model.generate(two[row:row + 1], past_key_values=cache.fresh(), max_new_tokens=5, do_sample=False)
        assert torch.equal(more[row], alone[0])


@pytest.mark.parametrize("method", ["kvsculpt", "select_fit", "joint_opt"])
def test_keeping_every_pair_is_the_exact_cache(model, ids, cap, method):
    """ratio = 1 keeps the whole context: before, the fitting methods refit its values on a few training queries
    (logits off by up to 5.6 on the embedded model)."""
    import zipkv

    cache = zipkv.compress(model, ids[:N], kept_fraction=1.0, method=method, m=6, n_synthetic=4, steps=2)
    for layer, captured in zip(cache.layers, cap.layers):
        assert torch.equal(layer.keys[0], captured.keys) and torch.equal(layer.values[0], captured.values)
    assert torch.equal(greedy(model, ids[N:N + 1], past_key_values=cache), greedy(model, ids[:N + 1]))


def test_compress_settings_are_checked_before_the_work(model, ids):
    import numpy as np

    import zipkv
    from zipkv.models import capture

    for kwargs, match in ((dict(scale=0.0), "scale=0.0"), (dict(scale=float("nan")), "scale=nan"),
                          (dict(budget=torch.zeros(2, 2, dtype=torch.long)),
                           r"budget: compressed pairs per head must lie in \[1, ")):
        with pytest.raises(ValueError, match=match):
            zipkv.compress(model, ids[:N], m=6, n_synthetic=4, steps=1, method="kvsculpt", **kwargs)
    with pytest.raises(TypeError, match="seed=1.5: expected an int"):
        zipkv.compress(model, ids[:N], m=6, seed=1.5, method="kvsculpt")
    with pytest.raises(TypeError, match=r"SculptConfig\(dtype=torch.bfloat16\): expected torch.float32 or"):
        zipkv.compress(model, ids[:N], m=6, dtype=torch.bfloat16, method="kvsculpt")   # failed in the V-step
    with pytest.raises(TypeError, match="solver=3: expected"):
        zipkv.compress(model, ids[:N], m=6, solver=3, method="kvsculpt")
    full = C.DistilledCache.from_compressed(K.CompressedCache.from_capture(capture(model, ids[:N])), model)
    layers = [(layer.keys[0], layer.values[0], layer.valid) for layer in full.layers]
    assert C.DistilledCache.from_padded(layers, np.int64(N)).n_context == N      # was refused: "expected N ≥ 1"
    implementation = model.config._attn_implementation
    model.config._attn_implementation = "flex_attention"                    # refused before the capture, not at generate
    try:
        with pytest.raises(ValueError, match="attn_implementation='flex_attention': a DistilledCache needs one of"):
            zipkv.compress(model, ids[:N], m=6)
    finally:
        model.config._attn_implementation = implementation
    cache = zipkv.compress(model, ids[:N], kept_fraction=0.5, m=6, n_synthetic=4, steps=1, solver="reference",
                           method="kvsculpt")
    assert torch.equal(cache.lengths, torch.full((2, 2), 15))                    # a solver by name, as the CLI names it
    cache = zipkv.compress(model, ids[:N], kept_fraction=np.float32(0.5), method="select_fit", m=6, n_synthetic=4)
    assert torch.equal(cache.lengths, torch.full((2, 2), 15))                    # a numpy ratio is a ratio
    budget = torch.tensor([[4, 4], [4, 4]])
    cache = zipkv.compress(model, ids[:N], kept_fraction=0.9, budget=budget, method="select_fit", m=6, n_synthetic=4)
    assert cache.compressed.ratio == pytest.approx((4 + 6) / N)                 # what the budget keeps


@pytest.mark.parametrize("kwargs, match", [
    (dict(budget="pilot", alpha=-1.0), "alpha=-1.0: expected a finite exponent"),
    (dict(budget="pilot", pilot_steps=-1), "pilot_steps=-1: expected an integer ≥ 1"),
    (dict(budget="pilots"), "budget='pilots'"), (dict(strategy="sideways"), "strategy='sideways'"),
    (dict(scale=-2.0), "scale=-2.0"), (dict(n_synthetic=-1), "n_synthetic=-1"),
    (dict(m=0, n_synthetic=0), "m=0 and n_synthetic=0 leave no training queries"),
    (dict(budget=None), r"budget=None: expected one of \['uniform'"),
    (dict(budget=[[4, 4], [4, 4]]), r"budget=\[\[4, 4\], \[4, 4\]\]: expected one of")])
def test_settings_that_need_no_capture_fail_before_it(model, ids, monkeypatch, kwargs, match):
    """A bad pilot setting failed after the capture and the whole pilot solve (87 s at N = 256 on a laptop)."""
    import zipkv
    from zipkv import models

    def no_capture(*args, **kw):
        raise AssertionError("the capture ran before the settings were checked")
    monkeypatch.setattr(models, "capture", no_capture)
    with pytest.raises(ValueError, match=match):
        zipkv.compress(model, ids[:N], **{"m": 6, "steps": 1, "n_synthetic": 4, "method": "kvsculpt", **kwargs})


def test_numpy_integers_are_integers_and_a_bad_joint_config_fails_before_the_capture(model, ids, monkeypatch):
    """NumPy integer settings passed the early checks and then failed after the capture (m, n_synthetic, steps,
    pilot_steps, seed); now they give the cache that Python ints give."""
    import numpy as np

    import zipkv
    from zipkv import models

    kw = dict(kept_fraction=0.5, m=6, n_synthetic=4, steps=1, seed=1, budget="pilot", pilot_steps=1, method="kvsculpt")
    ours = zipkv.compress(model, ids[:N], **{k: np.int64(v) if isinstance(v, int) else v for k, v in kw.items()})
    plain = zipkv.compress(model, ids[:N], **kw)
    assert torch.equal(ours.lengths, plain.lengths)
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(ours.layers, plain.layers))
    monkeypatch.setattr(models, "capture", lambda *a, **k: pytest.fail("the capture ran before the settings"))
    with pytest.raises(TypeError, match="joint_config=5: expected a zipkv.distill.baselines.JointConfig"):
        zipkv.compress(model, ids[:N], method="joint_opt", m=6, joint_config=5)


def test_other_caches_are_untouched_by_the_hooks(model, ids):
    C.attach(model)
    C.attach(model)  # idempotent
    assert len(model._zipkv_cache_hooks) == 2 + model.config.num_hidden_layers
    with torch.no_grad():
        plain = model(ids[None]).logits
    C.detach(model)
    with torch.no_grad():
        assert torch.equal(model(ids[None]).logits, plain)
    C.attach(model)


def _stacked(caches):
    """Per layer, the padded (keys, values, valid, bias) of each of ``caches``, padded to one length and stacked:
    ``[B, H, P, d]`` twice and ``[B, H, P]`` twice."""
    layers = []
    for layer in range(caches[0].num_layers):
        parts = [c.padded(layer) + (c.padded_bias(layer),) for c in caches]
        P = max(p[0].shape[1] for p in parts)
        def pad(x, fill=0):
            return torch.nn.functional.pad(x, (0, 0, 0, P - x.shape[1]) if x.ndim == 3 else (0, P - x.shape[1]),
                                           value=fill)
        layers.append(tuple(torch.stack([pad(p[i], False if i == 2 else 0) for p in parts]) for i in range(4)))
    return layers


def test_per_sequence_layers_give_each_sequence_its_own_cache(model, ids, cap):
    """A cache whose layers hold B different compressed contexts ([B, H, P, d]) runs them as the B rows of one
    forward: row b's logits are those of cache b alone; a layer shared by every row (3-D keys) mixes with them."""
    full = K.CompressedCache.from_capture(cap)
    gen = torch.Generator().manual_seed(2)
    biased = with_bias(full, [[torch.randn(k.shape[0], generator=gen) for k in ks] for ks in full.keys])
    short = K.compress(cap, 0.5, "select_fit", m=M, n_synthetic=8, budget=torch.tensor([[2, 17], [9, 3]]),
                       config=K.SculptConfig(progress=False))
    caches = [full, biased, short]
    cache = C.DistilledCache([C.DistilledLayer(*layer) for layer in _stacked(caches)], N)
    assert torch.equal(cache.lengths, torch.stack([torch.stack([c.lengths[l] for c in caches]) for l in range(2)]))
    logits = E.teacher_force_batch(model, cache.fresh(), ids[N:])
    assert logits.shape == (3, T, model.config.vocab_size)
    assert torch.equal(E.teacher_force_batch(model, cache, ids[N:]), logits), "fresh: the same pairs, nothing appended"
    alone = [E.teacher_force(model, c, ids[N:]).logits for c in caches]
    for row, want in enumerate(alone):  # (to rounding: the rows are padded to the longest cache)
        assert (logits[row].float() - want).abs().max() < 1e-5 * want.abs().max(), row
    assert (alone[0] - alone[1]).abs().max() > 1e-2 and (alone[0] - alone[2]).abs().max() > 1e-2, "rows differ"
    # layer 0 shared (one context, broadcast to the rows), layer 1 per sequence
    k0, v0, valid0 = full.padded(0)
    mixed = C.DistilledCache([C.DistilledLayer(k0, v0, valid0), C.DistilledLayer(*_stacked(caches)[1])], N)
    again = E.teacher_force_batch(model, mixed, ids[N:])
    for row, c in enumerate(caches):
        want = E.teacher_force(model, full.with_layers(c, [1]), ids[N:]).logits
        assert (again[row].float() - want).abs().max() < 1e-5 * want.abs().max(), row
    # greedy generate continues each row from its own cache
    attached = C.DistilledCache([C.DistilledLayer(*layer) for layer in _stacked(caches)], N)
    C.attach(model)
    out = model.generate(ids[None, N:N + 1].expand(3, -1), past_key_values=attached, max_new_tokens=T,
                         do_sample=False)[:, -T:]
    for row, c in enumerate(caches):
        one = model.generate(ids[None, N:N + 1], past_key_values=C.DistilledCache.from_compressed(c, model),
                             max_new_tokens=T, do_sample=False)[0, -T:]
        assert torch.equal(out[row], one), row
    # several samples per sequence (generate repeats each row): each sample continues its own row's cache
    torch.manual_seed(0)
    samples = model.generate(ids[None, N:N + 1].expand(3, -1), past_key_values=attached.fresh(), max_new_tokens=T,
                             do_sample=True, num_return_sequences=2)[:, -T:]
    assert samples.shape == (6, T)
    beams = model.generate(ids[None, N:N + 1].expand(3, -1), past_key_values=attached.fresh(), max_new_tokens=T,
                           do_sample=False, num_beams=2)[:, -T:]
    for row, c in enumerate(caches):
        one = model.generate(ids[None, N:N + 1], past_key_values=C.DistilledCache.from_compressed(c, model),
                             max_new_tokens=T, do_sample=False, num_beams=2)[0, -T:]
        assert torch.equal(beams[row], one), row


def test_per_sequence_shapes_are_checked(model, ids, cap):
    full = K.CompressedCache.from_capture(cap)
    k, v, valid = full.padded(0)
    two = [k[None].expand(2, -1, -1, -1), v[None].expand(2, -1, -1, -1)]
    with pytest.raises(ValueError, match=r"valid has shape \(2, 30\).*expected \[2, 2, 30\]"):
        C.DistilledLayer(*two, valid)
    with pytest.raises(ValueError, match=r"bias has shape \(2, 30\).*expected \[2, 2, 30\]"):
        C.DistilledLayer(*two, valid[None].expand(2, -1, -1), torch.zeros(2, 30))
    with pytest.raises(ValueError, match=r"\[B, H, P, d\]"):
        C.DistilledLayer(k[None, None], v[None, None])
    three = C.DistilledLayer(k[None].expand(3, -1, -1, -1), v[None].expand(3, -1, -1, -1))
    with pytest.raises(ValueError, match=r"\[2, 3\] sequences"):
        C.DistilledCache([C.DistilledLayer(*two), three], N)
    with pytest.raises(ValueError, match="per-sequence"):
        E.teacher_force_batch(model, C.DistilledCache.from_compressed(full, model), ids[N:])
    cache = C.DistilledCache([C.DistilledLayer(*two), C.DistilledLayer(*two)], N)
    with pytest.raises(ValueError, match="teacher_force_batch"):
        E.teacher_force(model, cache, ids[N:])
    C.attach(model)
    with pytest.raises(ValueError, match="a batch of 1 sequences after a cache of 2"):
        model(ids[None, N:], past_key_values=cache)


# --- left-padded batches: questions of different lengths over one compressed context -----------------------------

def left_padded(rows, pad: int = 0):
    """``(ids [B, L], attention_mask [B, L])``: token rows of different lengths, left-padded with ``pad``."""
    width = max(len(row) for row in rows)
    batch = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        batch[i, width - len(row):], mask[i, width - len(row):] = row, 1
    return batch, mask


def generated(model, inputs, cache, new: int, attention_mask=None, **kwargs):
    """Greedy ``generate`` from ``cache`` without stopping at eos: ``(tokens [B, new], logits [B, new, vocab])``
    (no ``attention_mask``: all ones, not one that ``generate`` infers from the pad id)."""
    mask = torch.ones_like(inputs) if attention_mask is None else attention_mask
    out = model.generate(inputs, attention_mask=mask, past_key_values=cache, max_new_tokens=new, do_sample=False,
                         eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True, **kwargs)
    return out.sequences[:, inputs.shape[1]:], torch.stack(out.logits, dim=1)


def test_a_left_padded_batch_gives_each_row_what_it_gives_alone(model, ids, cap, monkeypatch):
    """Rows of 1, 7 and 3 tokens after one cache, left-padded into one generate: each row's greedy tokens and logits
    are those of the row alone (and of the model on context + row); a second generate that continues the batch's
    output (its mask extended by ones) continues each row as it would continue alone."""
    full = K.CompressedCache.from_capture(cap)
    rows = [ids[N:N + 1], ids[N + 1:N + 8], ids[N + 2:N + 5]]
    batch, mask = left_padded(rows)
    cache = C.DistilledCache.from_compressed(full, model, context_ids=ids[:N])
    tokens, logits = generated(model, batch, cache, T, attention_mask=mask)
    assert torch.equal(cache.padding, torch.cat([mask == 0, torch.zeros(3, T - 1, dtype=torch.bool)], dim=1))
    for i, row in enumerate(rows):
        alone, alone_logits = generated(model, row[None], C.DistilledCache.from_compressed(full, model), T)
        assert torch.equal(tokens[i], alone[0]), i
        torch.testing.assert_close(logits[i], alone_logits[0], atol=1e-4, rtol=1e-4)
        plain = model.generate(torch.cat([ids[:N], row])[None], attention_mask=torch.ones(1, N + len(row)),
                               max_new_tokens=T, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert torch.equal(tokens[i], plain[0, N + len(row):]), i
    more = torch.cat([mask, torch.ones(3, T, dtype=torch.long)], dim=1)
    again, _ = generated(model, torch.cat([batch, tokens], dim=1), cache, 4, attention_mask=more)
    for i, row in enumerate(rows):
        alone, _ = generated(model, row[None], C.DistilledCache.from_compressed(full, model), T + 4)
        assert torch.equal(torch.cat([tokens[i], again[i]]), alone[0]), i
    # the positions matter: rows run at the padded batch's positions (N + column) are not the rows alone
    monkeypatch.setattr(C, "_token_positions",
                        lambda padding, n: (n + torch.arange(padding.shape[1])).expand(padding.shape))
    _, wrong = generated(model, batch, C.DistilledCache.from_compressed(full, model), T, attention_mask=mask)
    assert (wrong[0] - logits[0]).abs().max() > 1e-2


def test_beam_search_and_per_sequence_pairs_over_a_padded_batch(model, ids, cap):
    """Beams reorder the rows' padding with their tokens; a cache of per-sequence pairs takes a padded batch too."""
    full = K.CompressedCache.from_capture(cap)
    rows = [ids[N:N + 6], ids[N + 6:N + 8]]
    batch, mask = left_padded(rows)
    beams = model.generate(batch, attention_mask=mask, past_key_values=C.DistilledCache.from_compressed(full, model),
                           max_new_tokens=T, do_sample=False, num_beams=3, eos_token_id=None, pad_token_id=0)
    short = K.compress(cap, 0.5, "select_fit", m=M, n_synthetic=8, config=K.SculptConfig(progress=False))
    per_sequence = C.DistilledCache([C.DistilledLayer(*layer) for layer in _stacked([full, short])], N)
    own = model.generate(batch, attention_mask=mask, past_key_values=per_sequence, max_new_tokens=T, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    for i, (row, c) in enumerate(zip(rows, (full, short))):
        alone = model.generate(row[None], past_key_values=C.DistilledCache.from_compressed(full, model),
                               max_new_tokens=T, do_sample=False, num_beams=3, eos_token_id=None)
        assert torch.equal(beams[i, -T:], alone[0, -T:]), i
        alone = model.generate(row[None], past_key_values=C.DistilledCache.from_compressed(c, model), max_new_tokens=T,
                               do_sample=False, eos_token_id=None)
        assert torch.equal(own[i, -T:], alone[0, -T:]), i


def test_padding_is_checked_and_an_all_ones_mask_changes_nothing(model, ids, cap):
    from zipkv.models import cache_keyword

    full = K.CompressedCache.from_capture(cap)
    cache = C.DistilledCache.from_compressed(full, model, context_ids=ids[:N])
    keyword = cache_keyword(model)
    with torch.no_grad():
        bare = model(ids[None, N:], **{keyword: cache}).logits
        cache.reset()
        ones = model(ids[None, N:], attention_mask=torch.ones(1, T, dtype=torch.long), **{keyword: cache}).logits
    assert torch.equal(ones, bare) and cache.padding is None, "the unpadded path as before"
    batch, mask = left_padded([ids[N:N + 2], ids[:N + 1]])                  # row 1 repeats the context
    with pytest.raises(ValueError, match="input_ids begin with the 30 context tokens"):
        model.generate(batch, attention_mask=mask, past_key_values=cache.fresh(), max_new_tokens=1)
    batch, mask = left_padded([ids[N:N + 2], ids[N:N + 5]])
    cache = C.DistilledCache.from_compressed(full, model, context_ids=ids[:N])
    out = model.generate(batch, attention_mask=mask, past_key_values=cache, max_new_tokens=3, do_sample=False)
    other = torch.ones_like(out)
    other[1, 0] = 0                                                          # row 1's first token, not row 0's
    with pytest.raises(ValueError, match=r"attention_mask marks other tokens among the 7 appended ones as padding than "
                                         "the earlier forwards' masks"):
        model.generate(out, attention_mask=other, past_key_values=cache, max_new_tokens=1)
    unpadded = C.DistilledCache.from_compressed(full, model, context_ids=ids[:N])
    first = model.generate(ids[None, N:N + 2], past_key_values=unpadded, max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match="attention_mask marks other tokens among the 3 appended ones"):
        model.generate(first, attention_mask=torch.tensor([[0, 1, 1, 1]]), past_key_values=unpadded, max_new_tokens=1)
    with pytest.raises(ValueError, match="a batch of 1 sequences after a DistilledCache that holds the padded tokens "
                                         r"of 2: call cache.reset\(\)"):
        model(ids[None, N:N + 1], **{keyword: cache})
    with pytest.raises(ValueError, match=r"padding has shape \(2, 3\) and dtype torch.bool: expected \[B, 8\] bool"):
        cache.layers[0].additive_mask(1, 2, torch.float32, padding=torch.zeros(2, 3, dtype=torch.bool))
    # continuing without the mask (all ones): the padding the cache holds goes on
    again = model.generate(out, attention_mask=torch.ones_like(out), past_key_values=cache, max_new_tokens=3,
                           do_sample=False)
    twin = C.DistilledCache.from_compressed(full, model, context_ids=ids[:N])
    model.generate(batch, attention_mask=mask, past_key_values=twin, max_new_tokens=3, do_sample=False)
    extended = torch.cat([mask, torch.ones(2, 3, dtype=torch.long)], dim=1)
    assert torch.equal(again, model.generate(out, attention_mask=extended, past_key_values=twin, max_new_tokens=3,
                                             do_sample=False))
    cache.reset()
    assert cache.padding is None and cache.get_seq_length() == 0

# --- the embedded model on a PG19 window (the bars of issue 18) ---------------------------------------------

CTX, NEW = 320, 16


@pytest.fixture(scope="module")
def window(embedded):
    from zipkv import data

    (w,) = data.windows(embedded[1], data.load_books(), 1, context=CTX, continuation=NEW, seed=3)
    return w


@pytest.mark.slow
def test_uncompressed_cache_generates_token_for_token(embedded, window):
    import zipkv

    model, _ = embedded
    context, nxt = window.context_ids, window.continuation_ids[:1]
    plain = model.generate(torch.cat([context, nxt])[None], max_new_tokens=NEW, do_sample=False)[0, -NEW:]
    cache = zipkv.compress(model, context, kept_fraction=1.0, method="attention_score", m=64)
    assert torch.equal(cache.lengths, torch.full(cache.lengths.shape, CTX)), "ratio 1 keeps every original pair"
    ours = model.generate(nxt[None], past_key_values=cache, max_new_tokens=NEW, do_sample=False)[0, -NEW:]
    assert torch.equal(ours, plain)


@pytest.mark.slow
def test_a_padded_batch_on_the_embedded_model_follows_each_row(embedded, window):
    """Three continuations of 1, 9 and 4 tokens over one compressed PG19 context (30 % kept), left-padded into one
    generate: each row's greedy tokens and logits are those it gives alone from the same cache (after reset())."""
    import zipkv

    model, _ = embedded
    cache = zipkv.compress(model, window.context_ids, kept_fraction=0.3, method="attention_score", m=32)
    cont = window.continuation_ids
    rows = [cont[:1], cont[1:10], cont[3:7]]
    batch, mask = left_padded(rows)
    tokens, logits = generated(model, batch, cache, NEW, attention_mask=mask)
    for i, row in enumerate(rows):
        cache.reset()
        alone, alone_logits = generated(model, row[None], cache, NEW)
        assert torch.equal(tokens[i], alone[0]), i
        torch.testing.assert_close(logits[i], alone_logits[0], atol=1e-3, rtol=1e-4)


class Force:
    """A logits processor that makes generate emit ``tokens`` one per step (teacher forcing through generate)."""

    def __init__(self, tokens, prompt_length: int):
        self.tokens, self.prompt_length = tokens, prompt_length

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, -math.inf)
        forced[:, self.tokens[input_ids.shape[1] - self.prompt_length]] = 0
        return forced


@pytest.mark.slow
def test_kvsculpt_cache_generates_and_its_kl_is_the_books(embedded, window):
    import zipkv
    from transformers import LogitsProcessorList

    model, _ = embedded
    context, cont = window.context_ids, window.continuation_ids
    cache = zipkv.compress(model, context, kept_fraction=0.3, method="kvsculpt", m=32, n_synthetic=32,
                           config=K.SculptConfig(steps=5, progress=False))
    assert cache.compressed.method == "kvsculpt" and torch.equal(cache.lengths, torch.full(cache.lengths.shape, 96))
    out = model.generate(cont[None, :1], past_key_values=cache, max_new_tokens=NEW, do_sample=False)
    assert out.shape == (1, 1 + NEW)

    def forced_logits(c):
        """generate's own per-step logits while it is forced to emit the continuation: positions N … N+C−1."""
        c.reset()
        res = model.generate(cont[None, :1], past_key_values=c, max_new_tokens=len(cont), do_sample=False,
                             logits_processor=LogitsProcessorList([Force(cont[1:].tolist() + [0], 1)]),
                             output_logits=True,
                             return_dict_in_generate=True)
        assert torch.equal(res.sequences[0, 1:-1], cont[1:]), "generate followed the continuation"
        return torch.cat(res.logits).float()

    full = zipkv.compress(model, context, kept_fraction=1.0, method="attention_score", m=32)
    kl_generate = float(E.kl_divergence(forced_logits(full), forced_logits(cache)).mean())
    book = E.evaluate(model, cache.compressed, cont, full.compressed)  # what the book's tables report
    assert kl_generate > 0
    print(f"KL through generate {kl_generate:.6g}, book evaluation {book.kl:.6g}")
    assert kl_generate == pytest.approx(book.kl, rel=1e-3)


# --- Gemma 3's sliding-window layers (a tiny random model: window 16, contexts longer than it) -----------------

GN, GC = 40, 16  # context and continuation: both sliding layers drop keys during the continuation


@pytest.fixture(scope="module")
def gemma():
    from tiny_gemma import tiny_gemma

    return tiny_gemma()


@pytest.fixture(scope="module")
def gemma_ids():
    return torch.randint(0, 97, (GN + GC,), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def gemma_cap(gemma, gemma_ids):
    from zipkv.models import capture

    return capture(gemma, gemma_ids[:GN])


def test_gemma_uncompressed_cache_reproduces_the_forward_beyond_the_window(gemma, gemma_ids, gemma_cap):
    """The evaluation path (DistilledCache, teacher forcing) on a 40-token context of a model with a 16-token
    window gives the plain forward's logits: each sliding layer sees only keys at positions > p − 16."""
    with torch.no_grad():
        plain = gemma(gemma_ids[None]).logits[0, GN:]
    forced = E.teacher_force(gemma, K.CompressedCache.from_capture(gemma_cap), gemma_ids[GN:])
    torch.testing.assert_close(forced.logits, plain, atol=1e-5, rtol=1e-5)
    # the same pairs under one global mask (the window ignored) are a different model: the test can fail
    windowless = C.DistilledLayer.additive_mask
    try:
        C.DistilledLayer.additive_mask = lambda self, T, g, dtype, **kw: windowless(self, T, g, dtype)
        wrong = E.teacher_force(gemma, K.CompressedCache.from_capture(gemma_cap), gemma_ids[GN:])
    finally:
        C.DistilledLayer.additive_mask = windowless
    assert (wrong.logits - plain).abs().max() > 1e-2


def test_gemma_cache_decodes_and_generates_like_the_model(gemma, gemma_ids, gemma_cap):
    """Appended tokens fall out of the window too: chunked decoding and greedy generate from the cache follow
    the model's own forward and generate."""
    with torch.no_grad():
        plain = gemma(gemma_ids[None]).logits[0, GN:]
        cache = C.DistilledCache.from_compressed(K.CompressedCache.from_capture(gemma_cap), gemma)
        chunks, at = [], GN
        for size in (5, 1, 7, 3):
            chunks.append(gemma(gemma_ids[None, at:at + size], past_key_values=cache).logits[0])
            at += size
    torch.testing.assert_close(torch.cat(chunks), plain, atol=1e-5, rtol=1e-5)
    new = 24  # generation runs past N + 16: the window slides over appended tokens as well
    expected = gemma.generate(gemma_ids[None, :GN + 1], max_new_tokens=new, do_sample=False)[0, -new:]
    cache = C.DistilledCache.from_compressed(K.CompressedCache.from_capture(gemma_cap), gemma)
    ours = gemma.generate(gemma_ids[None, GN:GN + 1], past_key_values=cache, max_new_tokens=new, do_sample=False)
    assert torch.equal(ours[0, -new:], expected)


def test_gemma_window_pairs_alone_give_the_same_logits(gemma, gemma_ids, gemma_cap):
    """A sliding layer that keeps only its last W − 1 context pairs (what the distillers keep) is exactly the
    layer with every pair: the older ones are never attended by a continuation query."""
    from tiny_gemma import WINDOW

    full = K.CompressedCache.from_capture(gemma_cap)
    keys = [ks if w is None else [k[GN - (WINDOW - 1):] for k in ks] for ks, w in zip(full.keys, gemma_cap.windows)]
    values = [vs if w is None else [v[GN - (WINDOW - 1):] for v in vs] for vs, w in zip(full.values, gemma_cap.windows)]
    windowed = K.CompressedCache(keys, values, n_context=GN)
    a = E.teacher_force(gemma, full, gemma_ids[GN:]).logits
    b = E.teacher_force(gemma, windowed, gemma_ids[GN:]).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for layer in (0, 2):  # Capture.kept_pairs is that window
        k, v = gemma_cap.kept_pairs(layer)
        assert torch.equal(k, torch.stack(keys[layer])) and torch.equal(v, torch.stack(values[layer]))
    # one pair fewer (W − 2) drops a key the first continuation query sees: not the same
    short = [ks if w is None else [k[1:] for k in ks] for ks, w in zip(keys, gemma_cap.windows)]
    shortv = [vs if w is None else [v[1:] for v in vs] for vs, w in zip(values, gemma_cap.windows)]
    c = E.teacher_force(gemma, K.CompressedCache(short, shortv, n_context=GN), gemma_ids[GN:]).logits
    assert (c - a).abs().max() > 1e-4


def test_mistral_style_window_masks_every_layer():
    """A ``sliding_window`` without ``layer_types`` (Mistral's config) masks every layer: the capture and the
    evaluation cache follow the model beyond the window, and ``zipkv.compress``, with no global layer left to
    distil, says so instead of returning an uncompressed cache."""
    from transformers import MistralConfig, MistralForCausalLM
    from zipkv import compress, models

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                             sliding_window=16, max_position_embeddings=256)).eval()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 97, (GN + GC,), generator=torch.Generator().manual_seed(7))
    cap = models.capture(model, ids[:GN])
    assert models.sliding_windows(model) == cap.windows == [16, 16]
    with torch.no_grad():
        plain = model(ids[None]).logits[0, GN:]
    forced = E.teacher_force(model, K.CompressedCache.from_capture(cap), ids[GN:])
    torch.testing.assert_close(forced.logits, plain, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"every layer attends within a sliding window \(\[16\] tokens"):
        compress(model, ids[:GN], kept_fraction=0.5, m=8)


def test_the_default_is_zipkvs_distiller_the_beyond_chapters_method(model, ids, monkeypatch):
    """zipkv.compress with every default is zipkv's own distiller exactly as the "Beyond the paper" chapter runs it
    (probe budget, cascade-aware fit, its probe of 64 sampled tokens): the same cache, bit for bit, as the
    chapter's calls on the same capture; its verbatim window scales with the budget."""
    import inspect

    import zipkv
    from zipkv import compression
    from zipkv.distill import generalise
    from zipkv.models import capture
    from zipkv.study.experiments import beyond

    ours = zipkv.compress(model, ids[:N])
    cap = capture(model, ids[:N])
    compare = inspect.signature(beyond.compare).parameters
    kept = compression.kept_pairs(N)
    probe = generalise.sample_probe(model, cap, ids[:N], tokens=compare["probe_tokens"].default, seed=0)
    chapter = generalise.compress(cap, kept / N, m=compression.verbatim_window(kept), budget=compare["zipkv_budget"].default,
                                  alpha=compare["alpha"].default, model=model, probe=probe,
                                  cascade=compare["cascade"].default)
    assert ours.compressed.method == chapter.method and torch.equal(ours.lengths, ours.compressed.budget + 4)
    for layer, (k, v, b) in zip(ours.layers, zip(chapter.keys, chapter.values, chapter.bias)):
        assert torch.equal(layer.keys[0][layer.valid], torch.cat(k)) and torch.equal(layer.values[0][layer.valid],
                                                                                       torch.cat(v))
        assert torch.equal(layer.bias[layer.valid], torch.cat(b).float()) and bool((layer.bias != 0).any())
    assert (compression.kept_pairs(N), compression.verbatim_window(compression.kept_pairs(N))) == (9, 4)
    assert compression.verbatim_window(compression.kept_pairs(2048)) == 256, "the papers' and the chapter's m at N = 2048"
    out = model.generate(ids[None, N:N + 1], past_key_values=ours, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 5)


def test_the_chapters_kl_puts_the_default_at_least_3x_below_the_best_select_fit():
    """The committed comparison (20 windows, r = 0.3, the paper profile: N = 2048, m = 256, 64 probe tokens, which
    are zipkv.compress's defaults there): zipkv's mean KL against the best Select+Fit variant's."""
    import pandas as pd

    from zipkv.study.book import REPO_ROOT
    from zipkv.study.experiments import beyond

    table = pd.read_csv(REPO_ROOT / "results" / "paper" / "kvsculpt_beyond.csv")
    at = table[table.ratio == 0.3]
    means = at.groupby("method").kl.mean()
    assert at[at.method == "zipkv"].window.nunique() == 20
    best_select_fit = means[list(beyond.SELECT_FIT_VARIANTS)].min()
    assert best_select_fit / means["zipkv"] >= 3


def test_memory_compares_the_cache_with_the_full_one(model, ids):
    import zipkv

    cache = zipkv.compress(model, ids[:N], kept_tokens=12, method="attention_score", m=4)
    mem = cache.memory()
    element = next(model.parameters()).element_size()
    assert mem["full_bytes"] == 2 * 2 * 2 * N * 16 * element                  # layers x K,V x KV heads x N x head_dim
    assert mem["bytes"] == 2 * 2 * 2 * 12 * 16 * element                      # no bias: the pairs alone
    biased = zipkv.compress(model, ids[:N], kept_tokens=12, m=4)              # zipkv's: a float32 bias per pair
    assert mem["fraction"] == pytest.approx(mem["bytes"] / mem["full_bytes"])
    assert biased.memory()["bytes"] == mem["bytes"] + 2 * 2 * 12 * 4
    assert "12 of 30 pairs per KV head" in repr(cache)


@pytest.mark.slow
def test_the_default_runs_on_a_256_token_context_of_the_embedded_model(embedded):
    """Every default on a short context: the verbatim window scales down with the budget (the papers' m = 256 would
    refuse any context under ~850 tokens at 0.3), and the cache generates."""
    import zipkv
    from zipkv import data

    model, tokenizer = embedded
    (w,) = data.windows(tokenizer, data.load_books(), 1, context=256, continuation=8, seed=4)
    cache = zipkv.compress(model, w.context_ids)
    assert cache.compressed.method == "zipkv_cascade" and int(cache.lengths.float().mean().round()) == round(0.3 * 256)
    assert 0.3 < cache.memory()["fraction"] < 0.4                     # 30 % of the pairs, and a bias per pair
    out = model.generate(w.continuation_ids[None, :1], past_key_values=cache, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 5)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(seed="a"), TypeError, "seed='a': expected an int"),                     # torch's manual_seed error, late
    (dict(seed=None), TypeError, "seed=None: expected an int"),
    (dict(seed=2**70), ValueError, r"seed=1180591620717411303424: expected an int in \[-2\*\*62, 2\*\*62\)"),
    (dict(progress="no"), TypeError, "progress='no': expected True .* or False"),    # read as True
    (dict(cascade="no"), TypeError, "cascade='no': expected True .* or False"),      # read as True
    (dict(cascade=None), TypeError, "cascade=None: expected True"),                  # read as False
    (dict(probe_tokens=10**6), ValueError, r"probe_tokens=1000000: expected at most the model's context window, "
                                           r"config.max_position_embeddings=512"),  # sampled for hours
])
def test_zipkvs_settings_are_checked_before_the_capture(model, ids, monkeypatch, kwargs, error, match):
    import zipkv
    from zipkv import models

    monkeypatch.setattr(models, "capture", lambda *a, **k: pytest.fail("the capture ran before the settings"))
    with pytest.raises(error, match=match):
        zipkv.compress(model, ids[:N], m=6, **kwargs)


def test_the_cache_checks_what_generate_and_its_callers_give_it(model, ids, cap):
    """Token ids past the vocabulary were an IndexError from the embedding; rows of a beam search or a batch
    selection out of range, torch's IndexError; a CompressedCache or layers of another kind, AttributeErrors."""
    cache = C.DistilledCache.from_compressed(K.CompressedCache.from_capture(cap), model, context_ids=ids[:N])
    with pytest.raises(ValueError, match=r"input_ids holds ids in \[500, 500\]: expected token ids in \[0, 127\]"):
        model.generate(torch.tensor([[500]]), past_key_values=cache, max_new_tokens=2)
    for call, match in ((lambda: cache.reorder_cache(torch.tensor([3])), r"beam_idx must hold rows in \[0, 1\)"),
                        (lambda: cache.batch_select_indices(torch.tensor([5])), r"indices must hold rows in \[0, 1\)"),
                        (lambda: cache.batch_repeat_interleave(0), "repeats must be an int >= 1, got 0")):
        with pytest.raises(ValueError, match=match):
            call()
    assert cache.layers[0].keys.shape[0] == 1
    out = model.generate(ids[None, N:N + 1], past_key_values=cache, max_new_tokens=2, do_sample=False)
    with pytest.raises(TypeError, match=r"input_ids must be token ids \[T\] or \[batch, T\] .* got str"):
        cache.check_continuation("abc")
    assert torch.equal(out, model.generate(ids[None, N:N + 1], past_key_values=cache.fresh(), max_new_tokens=2,
                                           do_sample=False))
    with pytest.raises(TypeError, match="compressed must be a zipkv.distill.kvsculpt.CompressedCache .* got str"):
        C.DistilledCache.from_compressed("cache")
    with pytest.raises(ValueError, match=r"layer 0: expected \(keys, values, valid\) or \(keys, values, valid, bias\) "
                                         r"tensors, got int"):
        C.DistilledCache.from_padded([1, 2], N)
