import pytest
import torch

from zipkv import models


@pytest.fixture(scope="module")
def sample_ids(tokenizer):
    text = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 4
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0][:61]


def test_shape_matches_config_and_capture(embedded, sample_ids):
    model, _ = embedded
    shape = models.model_shape(model)
    cfg = model.config
    assert (shape.layers, shape.q_heads, shape.kv_heads) == (
        cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads)
    assert shape.q_heads % shape.kv_heads == 0 and shape.group_size > 1, "the embedded model uses GQA"
    assert shape.rope_theta == cfg.rope_parameters["rope_theta"]
    cap = models.capture(model, sample_ids)
    assert len(cap.layers) == shape.layers
    T = sample_ids.shape[0]
    for layer in cap.layers:
        assert layer.keys.shape == (shape.kv_heads, T, shape.head_dim)
        assert layer.values.shape == (shape.kv_heads, T, shape.head_dim)
        assert layer.queries.shape == (shape.q_heads, T, shape.head_dim)
    assert torch.equal(cap.positions, torch.arange(T))


def test_captured_kv_equals_model_cache(embedded, sample_ids):
    model, _ = embedded
    cap = models.capture(model, sample_ids)
    with torch.no_grad():
        cache = model(sample_ids[None], use_cache=True).past_key_values
    for i, layer in enumerate(cap.layers):
        assert torch.equal(cache.layers[i].keys[0], layer.keys), f"layer {i} keys"
        assert torch.equal(cache.layers[i].values[0], layer.values), f"layer {i} values"
    assert model.config._attn_implementation != "zipkv_capture", "capture must restore the attention implementation"


def test_capture_does_not_change_logits(embedded, sample_ids):
    model, _ = embedded
    with torch.no_grad():
        before = model(sample_ids[None]).logits[0, -1]
    models.capture(model, sample_ids)
    with torch.no_grad():
        after = model(sample_ids[None]).logits[0, -1]
    assert torch.equal(before, after)


def test_queries_derotate_rerotate_roundtrip(embedded, sample_ids):
    model, _ = embedded
    cap = models.capture(model, sample_ids)
    q = cap.layers[5].queries
    restored = cap.rope.apply(cap.rope.invert(q, cap.positions), cap.positions)
    err = (restored - q).abs().max().item()
    assert err <= 1e-5 * q.abs().max().item(), f"max abs error {err}"
    # A rotation at the wrong positions must not round-trip.
    shifted = cap.rope.apply(cap.rope.invert(q, cap.positions), cap.positions + 7)
    assert (shifted - q).abs().max().item() > 1e-2


def test_rope_scores_depend_only_on_relative_position(embedded):
    model, _ = embedded
    rope = models.Rope.of(model)
    d = models.model_shape(model).head_dim
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, d, generator=gen), torch.randn(1, d, generator=gen)
    score = lambda pq, pk: (rope.apply(q, torch.tensor([pq])) @ rope.apply(k, torch.tensor([pk])).T).item()
    assert score(100, 40) == pytest.approx(score(1060, 1000), rel=1e-4, abs=1e-4)
    assert score(100, 40) != pytest.approx(score(100, 41), rel=1e-4, abs=1e-4)


def test_load_model_from_a_local_hugging_face_folder(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models as tk_models

    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    vocab = {f"t{i}": i for i in range(32)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tk_models.WordLevel(vocab, unk_token="t0"))).save_pretrained(tmp_path)
    model, _ = models.load_model(str(tmp_path))
    shape = models.model_shape(model)
    assert (shape.layers, shape.q_heads, shape.kv_heads, shape.head_dim) == (2, 4, 2, 8)
    cap = models.capture(model, torch.arange(10))
    assert cap.layers[1].queries.shape == (4, 10, 8)


def test_capture_rejects_batches_and_float_ids(embedded):
    model, _ = embedded
    with pytest.raises(ValueError, match="input_ids"):
        models.capture(model, torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids"):
        models.capture(model, torch.zeros(5))


def test_missing_gguf_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("ZIPKV_GGUF", str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError, match="ZIPKV_GGUF"):
        models.embedded_gguf_path()


PREFIX_RTOL = 1e-4
"""Relative RMS error per position allowed between two fp32 captures of the same tokens: summation
order (a longer sequence's kernels split sums differently) gives ~2e-6 here; one token at a wrong
position gives ~0.3 at that position (both measured on the embedded model)."""


def _worst_position_rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """max over positions t of ||a[:, t] - b[:, t]|| / ||b[:, t]|| for [heads, T, head_dim] tensors."""
    return ((a - b).pow(2).mean((0, 2)).sqrt() / b.pow(2).mean((0, 2)).sqrt()).max().item()


def _worst_layer_error(x, y) -> float:
    return max(_worst_position_rel_rms(getattr(a, f), getattr(b, f))
               for a, b in zip(x.layers, y.layers) for f in ("keys", "values", "queries"))


def test_prefix_of_a_capture_equals_capturing_the_prefix(embedded, sample_ids):
    model, _ = embedded
    whole = models.capture(model, sample_ids)
    part = whole.prefix(40)
    alone = models.capture(model, sample_ids[:40])
    assert torch.equal(part.positions, alone.positions)
    assert _worst_layer_error(part, alone) <= PREFIX_RTOL
    # The tolerance catches a real bug: the last token captured one position too far.
    shifted = torch.arange(40)
    shifted[-1] = 40
    assert _worst_layer_error(part, models.capture(model, sample_ids[:40], positions=shifted)) > 100 * PREFIX_RTOL
    with pytest.raises(ValueError, match="n=0"):
        whole.prefix(0)


def test_capture_rejects_ids_outside_the_vocabulary_and_empty_ids(embedded, monkeypatch):
    model, _ = embedded
    vocab = model.config.vocab_size
    forwards = []
    monkeypatch.setattr(model, "forward", lambda *a, **k: forwards.append(1))
    with pytest.raises(ValueError, match=rf"input_ids holds ids in \[0, {vocab}\]: expected token ids in \[0, {vocab - 1}\]"):
        models.capture(model, torch.tensor([0, 5, vocab]))
    with pytest.raises(ValueError, match=r"input_ids holds ids in \[-1, 3\]"):
        models.capture(model, torch.tensor([3, -1]))
    with pytest.raises(ValueError, match="input_ids is empty"):
        models.capture(model, torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids is empty"):
        models.capture(model, torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(TypeError, match="input_ids must be a torch.Tensor"):
        models.capture(model, [1, 2, 3])
    assert not forwards, "errors come before the forward pass"


def test_unknown_model_name_fails_at_once_offline(monkeypatch):
    import time

    monkeypatch.setattr(models, "_hub_reachable", lambda timeout=3.0: False)
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"name='zipkv-test/no-such-model' is neither a local path nor in the local "
                                         r"Hugging Face cache .*cannot be reached \(offline\)\. Point at a model with "
                                         r"load_model\('/path/to/model-folder'\)"):
        models.load_model("zipkv-test/no-such-model")
    with pytest.raises(ValueError, match="neither a local path nor a valid Hugging Face model id"):
        models.load_model("not/a/model/id")
    assert time.perf_counter() - started < 10, "no network retries"


def test_hub_offline_mode_is_seen_without_the_network(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert models._hub_reachable() is False


def test_a_local_folder_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="is a local path without config.json"):
        models.load_model(tmp_path)
