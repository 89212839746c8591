"""zipkv's hooks against the installed transformers' calling convention (issue: transformers 5.24 renamed the cache
argument of every forward from ``past_key_values=`` to ``cache=``; the mask hook read only the old name, never fired,
and every DistilledCache failed with advice to call ``attach``). These tests read the installed version's own
signatures, so they check whichever transformers runs them: the pinned one, and the newest in ``.venv-latest``."""
from __future__ import annotations

import inspect
import re
import warnings

import pytest
import torch
import transformers

from zipkv import cache as C
from zipkv.distill import kvsculpt as K
from zipkv.models import attention_window, cache_keyword, capture
from conftest import tiny_llama
from tiny_gemma import tiny_gemma

N, T = 30, 6

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():                     # sharper than the 0.02-std init: greedy tokens far from ties
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.weight.mul_(20.0)
        model.lm_head.weight.mul_(20.0)
    return model


MODELS = {"llama": lambda: tiny_llama(sharpen_logits=True), "gemma3": tiny_gemma, "qwen2": _tiny_qwen2}


@pytest.fixture(scope="module", params=sorted(MODELS))
def setup(request):
    """``(model, ids [N + T], its uncompressed CompressedCache)`` per model family, hooks attached."""
    model = MODELS[request.param]()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, model.config.vocab_size, (N + T,), generator=torch.Generator().manual_seed(3))
    full = K.CompressedCache.from_capture(capture(model, ids[:N]))
    C.attach(model)
    return model, ids, full


def _cache_parameter(function) -> str:
    """The parameter of the installed transformers' ``function`` that takes the KV cache: the one annotated
    ``Cache`` (whatever its name)."""
    names = [name for name, p in inspect.signature(function).parameters.items() if "Cache" in str(p.annotation)]
    assert len(names) == 1, f"{function.__qualname__}: cache parameters {names}"
    return names[0]


def test_cache_keyword_is_the_installed_forward_s_and_does_not_warn(setup):
    """zipkv's own forwards (evaluate, generalise) pass the cache under the name the installed forward declares, so
    transformers' deprecation of the other name never warns (and its removal never breaks them)."""
    model, ids, full = setup
    keyword = cache_keyword(model)
    assert keyword == _cache_parameter(type(model).forward)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with torch.no_grad():
            model(ids[None, N:], **{keyword: C.DistilledCache.from_compressed(full, model)})


def test_mask_hook_fires_for_the_installed_attention_signature(setup):
    """The mask hook called as the installed transformers calls an attention module (the cache under the keyword its
    forward declares), and under a keyword no release uses: it replaces the mask and arms the layer either way."""
    model, ids, full = setup
    attention = model.model.layers[0].self_attn
    installed = _cache_parameter(type(attention).forward)
    hidden = torch.zeros(1, T, model.config.hidden_size)
    for keyword in (installed, "past_key_values", "some_future_name"):
        cache = C.DistilledCache.from_compressed(full, model)
        out = C._mask_hook(attention, (), {"hidden_states": hidden, "attention_mask": None, keyword: cache})
        assert out is not None, f"the mask hook did not fire for {keyword}="
        mask = out[1]["attention_mask"]
        group = model.config.num_attention_heads // cache.layers[0].heads
        assert mask.shape == (1, model.config.num_attention_heads, T, cache.layers[0].cached + T)
        assert torch.equal(mask, cache.layers[0].additive_mask(T, group, hidden.dtype, window=attention_window(attention),
                                                               n_context=N))
        assert cache.layers[0].armed
    assert C._mask_hook(attention, (), {"hidden_states": hidden, installed: None}) is None


@pytest.mark.parametrize("keyword", ["installed", "past_key_values"])
def test_every_attention_module_gets_the_cache_s_mask(setup, keyword):
    """A forward with a DistilledCache (under the installed name and the old one): each layer's attention module is
    called with its layer's additive mask (seen by a pre-hook after zipkv's), and the logits equal the plain forward
    over the whole sequence."""
    model, ids, full = setup
    keyword = cache_keyword(model) if keyword == "installed" else keyword
    seen = {}

    def spy(module, args, kwargs):
        seen[module.layer_idx] = kwargs.get("attention_mask")

    cache = C.DistilledCache.from_compressed(full, model)
    group = model.config.num_attention_heads // cache.layers[0].heads
    want = [cache.layers[index].additive_mask(T, group, torch.float32, window=attention_window(layer.self_attn),
                                              n_context=N) for index, layer in enumerate(model.model.layers)]
    handles = [layer.self_attn.register_forward_pre_hook(spy, with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            logits = model(ids[None, N:], **{keyword: cache}).logits[0]
    finally:
        for handle in handles:
            handle.remove()
    for index, mask in enumerate(want):
        assert seen.get(index) is not None and torch.equal(seen[index], mask), f"layer {index}"
    with torch.no_grad():
        plain = model(ids[None]).logits[0, N:]
    torch.testing.assert_close(logits, plain, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])
def test_generate_takes_the_cache_under_either_keyword_without_a_deprecation(setup, keyword):
    """``model.generate(..., past_key_values=cache)`` (the README's) and ``cache=cache`` both continue the context as
    the model does on every transformers version, with no FutureWarning (zipkv's wrapper of generate passes the
    cache on under the installed name), and the continuation check finds the cache under either."""
    model, ids, full = setup
    cache = C.DistilledCache.from_compressed(full, model, context_ids=ids[:N])
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        ours = model.generate(ids[None, N:N + 1], max_new_tokens=4, do_sample=False, **{keyword: cache})
    plain = model.generate(ids[None, :N + 1], max_new_tokens=4, do_sample=False)
    assert torch.equal(ours[0], plain[0, N:])
    with pytest.raises(ValueError, match="do not continue this DistilledCache"):
        model.generate(ids[None, N + 2:N + 3], max_new_tokens=2, do_sample=False, **{keyword: cache})


@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])
def test_a_left_padded_batch_runs_each_row_as_the_model_does(setup, keyword):
    """Rows of 1, 5 and 2 tokens after one cache, left-padded into one ``generate`` under either keyword: each row's
    greedy tokens are the model's own on context + row, past the sliding window too, on the installed transformers
    (each row's positions and padding come from its ``attention_mask`` row, in the prompt and every decode step)."""
    model, ids, full = setup
    rows = [ids[N:N + 1], ids[N + 1:N + T], ids[N + 2:N + 4]]
    width, new = T - 1, 20
    batch = torch.stack([torch.cat([torch.zeros(width - len(row), dtype=torch.long), row]) for row in rows])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(row) for row in rows])[:, None]).long()
    cache = C.DistilledCache.from_compressed(full, model, context_ids=ids[:N])
    greedy = dict(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = model.generate(batch, attention_mask=mask, **greedy, **{keyword: cache})
    for i, row in enumerate(rows):
        plain = model.generate(torch.cat([ids[:N], row])[None], attention_mask=torch.ones(1, N + len(row)), **greedy)
        assert torch.equal(out[i, width:], plain[0, N + len(row):]), i


def test_an_unmasked_update_names_its_reason(monkeypatch):
    """A layer updated without its mask says why: no hooks on the model (attach it); hooks whose decoder call had no
    DistilledCache among its arguments (what a transformers that passes the cache some other way looks like: attach
    does not help); a decoder that saw the cache but a layer whose mask hook did not (its hook removed)."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (N + T,), generator=torch.Generator().manual_seed(4))
    full = K.CompressedCache.from_capture(capture(model, ids[:N]))
    cache = C.DistilledCache.from_compressed(full, dtype=torch.float32)
    keyword = cache_keyword(model)
    version = re.escape(f"transformers {transformers.__version__}")
    with pytest.raises(RuntimeError, match=r"has no zipkv hooks: call zipkv\.cache\.attach\(model\)"):
        model(ids[None, N:], **{keyword: cache.fresh()})
    C.attach(model)
    with monkeypatch.context() as patch:
        patch.setattr(C, "_distilled_cache", lambda args, kwargs: None)
        with pytest.raises(RuntimeError, match=rf"hooks are on the model, but its decoder's forward was called without "
                                               rf"the DistilledCache .* {version} passes the cache some other way"):
            model(ids[None, N:], **{keyword: cache.fresh()})
    with pytest.raises(ValueError, match="padding"):            # a hook raising: the count still goes back to 0
        model(ids[None, N:], attention_mask=torch.tensor([[0] + [1] * T]), **{keyword: cache.fresh()})
    assert C._hooked_forwards() == 0
    model._zipkv_cache_hooks[3].remove()                           # layer 1's mask hook
    with pytest.raises(RuntimeError, match=rf"on layer 1: zipkv's hooks are on the model and its decoder got the "
                                           rf"cache, but the mask hook on model\.model\.layers\[1\]\.self_attn did "
                                           rf"not see it .* {version}") as error:
        model(ids[None, N:], **{keyword: cache.fresh()})
    assert "call zipkv.cache.attach(model) once" not in str(error.value) and C._hooked_forwards() == 0
    C.detach(model)
    with pytest.raises(RuntimeError, match="has no zipkv hooks"):
        model(ids[None, N:], **{keyword: cache.fresh()})
    C.attach(model)
    with torch.no_grad():
        model(ids[None, N:], **{keyword: cache.fresh()})


def test_attach_refuses_attention_modules_that_take_no_attention_mask():
    model = tiny_llama()
    attention = model.model.layers[1].self_attn
    attention.forward = lambda hidden_states, position_embeddings=None, **kwargs: None
    with pytest.raises(TypeError, match=r"forward takes \['hidden_states', 'position_embeddings', 'kwargs'\]: "
                                        "expected an attention_mask parameter"):
        C.attach(model)
    assert not getattr(model, "_zipkv_cache_hooks", None)
