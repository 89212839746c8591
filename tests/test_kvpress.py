"""zipkv and kvpress (:mod:`zipkv.integrations.kvpress`): run by ``make test-kvpress`` in .venv-kvpress (kvpress pins
transformers<5.3); skipped where kvpress is not installed."""
import math

import pytest
import torch

kvpress = pytest.importorskip("kvpress")

from zipkv import data, models  # noqa: E402
from zipkv.distill.evaluate import kl_divergence, teacher_force  # noqa: E402
from zipkv.integrations import kvpress as integration  # noqa: E402

CONTEXT, CONTINUATION, PROBE = 64, 8, 2


@pytest.fixture(scope="module")
def loaded():
    model, tokenizer = models.load_model()
    (window,) = data.windows(tokenizer, data.load_books(), n=1, context=CONTEXT, continuation=CONTINUATION)
    return model, tokenizer, window


def test_zipkv_press_in_kvpress_pipeline_gives_zipkv_cache(loaded):
    """kvpress's pipeline with ZipkvPress leaves, after answering, the cache zipkv.compress gives without the bias on
    the pipeline's context (kept pairs bit for bit, every other slot masked by kvpress's head-wise mask), and the
    continuation's logits over it match zipkv's own DistilledCache's."""
    from transformers import DynamicCache, pipeline

    model, tokenizer, window = loaded
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    context = tokenizer.decode(window.context_ids)
    press = integration.ZipkvPress(compression_ratio=0.5, probe_tokens=PROBE)
    cache = DynamicCache()
    answer = pipe(context, question="Who is speaking?", press=press, cache=cache, max_new_tokens=2)["answer"]
    assert isinstance(answer, str) and answer
    ids = pipe.preprocess(context, questions=[""], answer_prefix="", max_context_length=10**6)["context_ids"][0]
    modules = integration._attention_modules(model)
    masks = [module.masked_key_indices for module in modules]       # reset by the next prefill (kvpress's patch)
    layers = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    theirs = integration._continuation_logits(model, cache, ids.numel(), window.continuation_ids)
    integration._clear_masks(model)
    expected = press.cache                          # zipkv.compress's no-bias cache of the context the press saw
    assert torch.equal(expected.context_ids, ids)
    lengths = set()
    for index, ((keys, values), mask, want) in enumerate(zip(layers, masks, expected.layers)):
        valid = torch.zeros(want.valid.shape[0], keys.shape[2], dtype=torch.bool)
        valid[:, :want.cached] = want.valid
        assert torch.equal(keys[0][valid], want.keys[0, :, :want.cached][want.valid]), index
        assert torch.equal(values[0][valid], want.values[0, :, :want.cached][want.valid]), index
        masked = torch.zeros_like(valid)
        if mask is not None:
            masked[mask[1], mask[2]] = True
        assert torch.equal(masked, ~valid), index
        lengths.add(tuple(want.valid.sum(-1).tolist()))
    assert len(lengths) > 1                        # the per-layer / per-head budget is really carried
    ours = teacher_force(model, expected, window.continuation_ids).logits
    assert float(kl_divergence(ours, theirs).max()) < 1e-6


def test_kl_table_runs_kvpress_presses_under_the_kl_protocol(loaded):
    """kl_table's rows come from kvpress's presses, with kvpress's version; StreamingLLM's KL equals the KL of the
    cache of its sinks and last tokens built by hand (positions and the reference are the protocol's)."""
    from transformers import DynamicCache

    model, tokenizer, window = loaded
    table = integration.kl_table(model, [window], [0.5], ["streaming_llm", "knorm", "adakv_knorm"])
    assert list(table.method) == ["streaming_llm", "knorm", "adakv_knorm"]
    assert (table.kvpress == kvpress_version()).all() and table.kl.notna().all() and (table.kl > 0).all()
    assert table.kept.tolist() == pytest.approx([0.5] * 3)
    N, ids = window.context, window.context_ids
    full = DynamicCache()
    model.model(input_ids=ids[None], past_key_values=full)
    reference = integration._continuation_logits(model, full, N, window.continuation_ids)
    kept = N // 2
    sinks = kvpress.StreamingLLMPress().n_sink
    recent = torch.cat([torch.arange(sinks), torch.arange(N - (kept - sinks), N)])
    for layer in full.layers:
        layer.keys, layer.values = layer.keys[:, :, recent], layer.values[:, :, recent]
    by_hand = float(kl_divergence(reference, integration._continuation_logits(model, full, N,
                                                                              window.continuation_ids)).mean())
    assert table.kl[0] == pytest.approx(by_hand, rel=1e-5)
    assert not math.isclose(table.kl[0], table.kl[1], rel_tol=1e-3)


def kvpress_version():
    from importlib.metadata import version

    return version("kvpress")


def test_bad_settings_are_refused_before_any_work(loaded):
    model, _, window = loaded
    with pytest.raises(ValueError, match="compression_ratio"):
        integration.ZipkvPress(compression_ratio=1.2)
    with pytest.raises(ValueError, match="snap_kv"):
        integration.kl_table(model, [window], [0.5], ["snap_kv"])
    with pytest.raises(ValueError, match="adakv_kvzip"):
        integration.kl_table(model, [window], [0.5], ["adakv_kvzip"])
    with pytest.raises(ValueError, match="kept_fraction"):
        integration.kl_table(model, [window], [1.5], ["knorm"])


def test_on_a_model_with_sliding_layers_a_press_that_drops_pairs_scores_as_its_masked_twin():
    """Gemma 3 keeps sliding-window layers, which no press shortens; transformers takes the new tokens' cache
    positions from the first layer, a sliding one. A press that drops pairs from the global layers is therefore padded
    back to their length, the padding masked: its KL equals AdaKV's around the same scorer, which keeps every pair
    and masks the dropped ones (one KV head: the same pairs), where the unpadded cache let each continuation token
    see the next one's key."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_gemma import tiny_gemma

    model = tiny_gemma(kv_heads=1)
    ids = torch.randint(97, (16,), generator=torch.Generator().manual_seed(0))
    window = data.Window(ids, context=12, continuation=4, pg_id=0, title="random", char_offset=0)
    table = integration.kl_table(model, [window], [0.5], ["knorm", "adakv_knorm"])
    assert table.kl.notna().all() and table.kl[0] > 1e-4
    assert table.kl[0] == pytest.approx(table.kl[1], rel=1e-4) and table.kept.tolist() == pytest.approx([0.5, 0.5])
