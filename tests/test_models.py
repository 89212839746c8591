import os

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
    ids = torch.tensor([1, 2, 3])
    for bad, got in ((torch.arange(3.0) + 0.5, r"torch.float32 \(3,\)"), (torch.arange(2), r"torch.int64 \(2,\)"),
                     (torch.arange(3)[None], r"torch.int64 \(1, 3\)"), (list(range(3)), "list")):
        with pytest.raises(ValueError, match=rf"positions must be an integer tensor \[T\] = \[3\] .* got {got}"):
            models.capture(model, ids, positions=bad)           # fractional positions would rotate what invert cannot
    with pytest.raises(TypeError, match="model must be a loaded Hugging Face causal LM .* got NoneType"):
        models.capture(None, ids)
    layers = model.config.num_hidden_layers
    with pytest.raises(ValueError, match=rf"layer=999: expected None or an int in \[0, {layers}\)"):
        models.Rope.of(model, 999)                              # was accepted on a model with one RoPE
    with pytest.raises(TypeError, match="model must be a loaded Hugging Face causal LM, got str"):
        models.Rope.of("model")
    with pytest.raises(TypeError, match="positions must be an integer tensor \\[T\\], got list"):
        models.Rope.of(model).invert(torch.zeros(1, 3, 64), [0, 1, 2])
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


def test_a_folder_gguf_or_dtype_that_cannot_load_is_named_before_loading(tmp_path):
    """A folder with config.json alone failed in the tokenizer ("Couldn't instantiate the backend tokenizer ... You
    need to have sentencepiece"), a file that is no GGUF after "converting ... once" was announced, an integer dtype
    after the tokenizer loaded (transformers' "cannot be instantiated under dtype=torch.int8")."""
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match=r"a local folder with config.json but no tokenizer file \(one of "
                                         r"tokenizer.json, .*\) and no weights file \(one of \*.safetensors"):
        models.load_model(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"but no weights file \(one of"):
        models.load_model(tmp_path)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model")
    with pytest.raises(ValueError, match=r"gguf='.*junk.gguf' is not a GGUF file \(it starts with b'not ', not the "
                                         r"magic bytes b'GGUF'\)"):
        models.converted_gguf(junk)
    for dtype in (torch.int8, torch.bool, torch.complex64):
        with pytest.raises(TypeError, match=rf"dtype={dtype}: expected a floating-point torch.dtype"):
            models.load_model(dtype=dtype)


# --- Gemma 3: one RoPE per layer type, sliding-window layers, query scaling (a tiny random model) ----------------

@pytest.fixture(scope="module")
def gemma():
    from tiny_gemma import tiny_gemma

    return tiny_gemma()


def _per_layer(model, ids, module, *, before: bool):
    """Per layer, what ``module(layer)`` takes (``before``: its first input) or gives (its output) in one forward
    of ``ids``, batch element 0."""
    seen = {}
    hooks = [module(layer).register_forward_pre_hook(lambda mod, args, i=i: seen.__setitem__(i, args[0][0])) if before
             else module(layer).register_forward_hook(lambda mod, args, out, i=i: seen.__setitem__(i, out[0]))
             for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(ids[None])
    finally:
        for h in hooks:
            h.remove()
    return [seen[i] for i in range(len(model.model.layers))]


def _model_attention(model, ids):
    """Per layer, the model's own attention output (the input of o_proj) ``[T, q_heads·d]``."""
    return _per_layer(model, ids, lambda layer: layer.self_attn.o_proj, before=True)


def test_gemma_capture_reproduces_its_attention_beyond_the_window(gemma):
    """softmax(q·k/√d) over the keys a sliding layer sees (positions > p − W), times the values, is the
    model's attention output on every layer: capture keeps post-norm post-RoPE q/k, scales the queries by
    query_pre_attn_scalar and, on a 40-token context (window 16), runs the sliding layers' own masks."""
    from tiny_gemma import WINDOW

    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(3))
    cap = models.capture(gemma, ids)
    assert cap.windows == [WINDOW, None, WINDOW] and cap.compressed_layers == [1]
    outputs = _model_attention(gemma, ids)
    T = ids.shape[0]
    p = torch.arange(T)
    for layer, (lc, out) in enumerate(zip(cap.layers, outputs)):
        H, _, d = lc.keys.shape
        g = lc.queries.shape[0] // H
        seen = p[None, :] <= p[:, None]
        if lc.window is not None:
            seen &= p[None, :] > p[:, None] - lc.window
        k, v = lc.keys.repeat_interleave(g, 0), lc.values.repeat_interleave(g, 0)
        s = (lc.queries @ k.transpose(1, 2) / d ** 0.5).masked_fill(~seen, float("-inf"))
        mine = (torch.softmax(s, dim=-1) @ v).transpose(0, 1).reshape(T, -1)
        torch.testing.assert_close(mine, out, atol=1e-5, rtol=1e-4, msg=f"layer {layer}")


def test_gemma_rope_is_per_layer_type_and_the_shared_one_is_refused(gemma, embedded):
    ids = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(4))
    cap = models.capture(gemma, ids)
    assert cap.rope is None and [r.layer_type for r in cap.ropes] == ["sliding_attention", "full_attention",
                                                                      "sliding_attention"]
    with pytest.raises(ValueError, match="Rope.of\\(model, layer\\)"):
        models.Rope.of(gemma)
    x = torch.randn(24, 16, generator=torch.Generator().manual_seed(5))
    local, glob = models.Rope.of(gemma, 0), models.Rope.of(gemma, 1)
    for rope, base in ((local, 1e4), (glob, 1e6)):  # the model's own bases: rotation of pair i by p·base^(−2i/d)
        angle = cap.positions[:, None].double() * base ** (-torch.arange(0, 16, 2).double() / 16)
        cos = torch.cat([angle.cos(), angle.cos()], dim=-1).float()
        sin = torch.cat([angle.sin(), angle.sin()], dim=-1).float()
        expected = x * cos + torch.cat([-x[:, 8:], x[:, :8]], dim=-1) * sin
        torch.testing.assert_close(rope.apply(x, cap.positions), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rope.invert(rope.apply(x, cap.positions), cap.positions), x, atol=1e-5, rtol=1e-5)
    # each layer's captured keys are its own RoPE applied to the model's pre-RoPE (post-norm) keys
    pre = _per_layer(gemma, ids, lambda layer: layer.self_attn.k_norm, before=False)
    for layer in range(3):
        keys = pre[layer]  # [kv_heads, T, d] post-norm, pre-RoPE
        torch.testing.assert_close(cap.rope_of(layer).apply(keys, cap.positions), cap.layers[layer].keys,
                                   atol=1e-5, rtol=1e-5)
        assert not torch.allclose(cap.rope_of(1 - layer % 2).apply(keys, cap.positions), cap.layers[layer].keys,
                                  atol=1e-3)
    # Llama-family: one RoPE, the same object for every layer
    model, _ = embedded
    assert models.Rope.of(model, 3).layer_type is None and models.sliding_windows(model) == [None] * 30


def test_soft_capped_attention_is_refused(gemma):
    gemma.config.attn_logit_softcapping = 50.0
    try:
        with pytest.raises(ValueError, match="attn_logit_softcapping"):
            models.capture(gemma, torch.arange(5))
    finally:
        gemma.config.attn_logit_softcapping = None


def test_load_model_takes_a_gguf_path(embedded):
    """A .gguf path is converted once (here the embedded SmolLM2 GGUF, whose conversion is cached) and loads
    without any download; a path that is not a .gguf file is a ValueError naming it."""
    model, _ = models.load_model(str(models.embedded_gguf_path()))
    reference, _ = embedded
    assert model.config.name_or_path == models.embedded_gguf_path().stem
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="gguf="):
        models.load_model("/nonexistent/model.gguf")


GEMMA_GGUF = os.environ.get("ZIPKV_GEMMA_GGUF", "/tmp/gemma_dl/gemma-3-270m-q4_k_m.gguf")


@pytest.mark.skipif(not os.path.isfile(GEMMA_GGUF), reason="the Gemma-3-270M GGUF is not on this machine "
                    "(set ZIPKV_GEMMA_GGUF); it is never downloaded by the tests")
def test_real_gemma_3_270m_loads_from_its_gguf():
    model, tokenizer = models.load_model(GEMMA_GGUF)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    windows = models.sliding_windows(model)
    assert windows.count(None) == 3 and windows.count(512) == 15
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "tied embeddings"
    assert model.config.final_logit_softcapping is None and model.config.attn_logit_softcapping is None


def _tiny_family(model_type, **extra):
    """A 2-layer random fp32 ``model_type`` model (4 query / 2 KV heads of 32 dims) with Q/K weights × 10, so that
    attention is far from uniform."""
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for name in ("q_proj", "k_proj", "qkv_proj"):
                if hasattr(layer.self_attn, name):
                    getattr(layer.self_attn, name).weight.mul_(10.0)
    return model


FAMILIES = {"granite": dict(attention_multiplier=0.1, embedding_multiplier=12.0, residual_multiplier=0.22),
            "phi3": dict(partial_rotary_factor=0.5),            # RoPE on the first half of each head only
            "cohere": {}}                                       # RoPE pairs neighbouring dimensions


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_captured_queries_keys_values_give_the_models_attention_output(model_type):
    """softmax(q·k/√d)·v over the captured tensors equals what each layer's attention hands its output projection,
    for a model whose logit scale is not 1/√d (Granite), one with a partial rotary embedding (Phi-3) and one that
    rotates neighbouring dimensions (Cohere)."""
    import math
    model = _tiny_family(model_type, **FAMILIES[model_type])
    seen = []
    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(lambda mod, args: seen.append(args[0][0].clone()))
             for layer in model.model.layers]
    cap = models.capture(model, torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(0)))
    for h in hooks:
        h.remove()
    for lc, out in zip(cap.layers, seen):
        H, T, D = lc.keys.shape
        q = lc.queries.view(H, -1, T, D)
        s = torch.einsum("hgtd,hsd->hgts", q, lc.keys) / math.sqrt(D) + torch.full((T, T), float("-inf")).triu(1)
        o = torch.einsum("hgts,hsd->thgd", s.softmax(-1), lc.values).reshape(T, -1)
        assert torch.allclose(o, out, rtol=1e-4, atol=1e-5), (o - out).abs().max()


@pytest.mark.parametrize("model_type", ["phi3", "cohere"])
def test_rope_is_the_models_own_rotation(model_type):
    """``Rope.apply`` equals the modeling file's ``apply_rotary_pos_emb`` (Phi-3: only the leading half of each
    head turns; Cohere: dimensions 2i and 2i + 1 pair), and ``invert`` undoes it."""
    import sys
    model = _tiny_family(model_type, **FAMILIES[model_type])
    rope = models.Rope.of(model)
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(100, 109)
    cos, sin = model.model.rotary_emb(x, pos[None])
    want, _ = sys.modules[type(model).__module__].apply_rotary_pos_emb(x[None], x[None], cos, sin)
    assert torch.allclose(rope.apply(x, pos), want[0], atol=1e-5)
    assert torch.allclose(rope.invert(rope.apply(x, pos), pos), x, atol=1e-5)


def test_a_model_whose_layers_capture_cannot_reach_is_refused():
    """StableLM's layers do not pass the forward's keyword arguments on to its attention: capture would see no
    layer at all, and says so."""
    model = _tiny_family("stablelm")
    with pytest.raises(ValueError, match="in 0 of its 2 layers"):
        models.capture(model, torch.arange(3, 20))


def test_a_gguf_is_converted_once_wherever_it_is_installed(tmp_path, monkeypatch):
    """The conversion is keyed by the file's content: a reinstalled package or another virtualenv (same bytes, another
    path or mtime) reuses the copy (before, every fresh virtualenv converted again and left a 540 MB copy behind)."""
    monkeypatch.setenv("ZIPKV_CACHE", str(tmp_path / "cache"))
    a, b, other = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c" / "m.gguf"
    for path, data in ((a, b"GGUF same bytes"), (b, b"GGUF same bytes"), (other, b"GGUF other bytes")):
        path.parent.mkdir()
        path.write_bytes(data)
    key = models._content_key(a)
    assert models._content_key(b) == key != models._content_key(other)
    target = tmp_path / "cache" / f"m-{key}"
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_text("")
    assert models.converted_gguf(b) == target                  # found, nothing converted (the bytes are no model)
    assert str(b.resolve()) in (tmp_path / "cache" / "gguf-keys.json").read_text()


def test_load_model_checks_its_arguments_before_loading_weights():
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda': this machine has no CUDA GPU"):
            models.load_model(device="cuda")
    with pytest.raises(ValueError, match="device='bogus': expected a torch device"):
        models.load_model(device="bogus")
    for other in ("meta", "mps"):                              # meta gave a model without weights, mps failed late
        with pytest.raises(ValueError, match=f"device='{other}': expected 'cpu' or a CUDA device"):
            models.load_model(device=other)
    with pytest.raises(TypeError, match="name=123: expected None"):
        models.load_model(123)


def test_decoding_with_the_embedded_tokenizer_prints_no_warning(tokenizer, sample_ids, capsys):
    """Every decode in the README's examples printed transformers' "Ignoring clean_up_tokenization_spaces=True for
    BPE tokenizer" first: the GGUF's tokenizer came back with that WordPiece switch on."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        text = tokenizer.decode(sample_ids)
    finally:
        logger.removeHandler(handler)
    assert text.startswith("It was the best of times") and not records
    assert "clean_up_tokenization" not in capsys.readouterr().err


def test_two_processes_converting_one_gguf_convert_it_once(tmp_path, monkeypatch):
    """Test workers or notebooks started together on a fresh machine each found no converted copy; both converted
    into the same ``.partial`` folder. Now the second waits for the first's lock and reuses its folder."""
    import threading
    import time

    monkeypatch.setenv("ZIPKV_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    calls = []

    def fake_convert(source, target):
        calls.append(target)
        time.sleep(0.5)                                    # the other thread arrives while this one converts
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")
        (target / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(models, "_convert", fake_convert)
    found = []
    threads = [threading.Thread(target=lambda: found.append(models.converted_gguf(gguf))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and found == [calls[0], calls[0]]
