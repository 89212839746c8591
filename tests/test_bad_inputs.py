"""Regressions from a new user's bad-input sweep (issue 61): each bad argument is a TypeError/ValueError that names
it, what was seen and what was expected, raised before any work -- not a raw error from inside torch, not a value
silently read another way (a string ``"no"`` taken as true)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from zipkv import format as F  # noqa: E402
from zipkv.paged import build_paged_cache  # noqa: E402
from zipkv.kernels.decode_attention import plan  # noqa: E402

PAGES = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(0)).bfloat16()


@pytest.mark.parametrize("flag", ["no", None, 1, 0.0])
def test_flags_take_true_or_false_only(flag):
    payload, meta = F.pack(PAGES)
    with pytest.raises(TypeError, match=rf"validate must be True or False, got {type(flag).__name__}"):
        F.unpack(payload, meta, validate=flag)
    k = v = PAGES.reshape(1, 1, 48, 64)
    for name in ("shuffle", "compact"):
        with pytest.raises(TypeError, match=rf"{name} must be True or False"):
            build_paged_cache(k, v, **{name: flag})
    cache, indptr, indices, last = build_paged_cache(k, v)
    with pytest.raises(TypeError, match="validate must be True or False"):
        plan(indptr, indices, last, cache, 2, validate=flag)
    for call in (lambda: cache.read_pages(validate=flag), lambda: cache.export_pages(indices.long(), checksum=flag),
                 lambda: cache.export_pages(indices.long(), validate=flag),
                 lambda: cache.import_pages(cache.export_pages(indices.long()), indices.long(), validate=flag)):
        with pytest.raises(TypeError, match="(validate|checksum) must be True or False"):
            call()


def test_page_meta_is_checked_when_made():
    _, meta = F.pack(PAGES)
    with pytest.raises(TypeError, match=r"PageMeta.head_dim: head_dim must be an int, .* got str '64'"):
        F.PageMeta("token", "64", meta.compressed, meta.base)
    with pytest.raises(TypeError, match="PageMeta.compressed must be a bool tensor, got torch.int32"):
        F.PageMeta("token", 64, meta.compressed.int(), meta.base)
    with pytest.raises(TypeError, match="PageMeta.base must be a uint8 tensor, got torch.float32"):
        F.PageMeta("token", 64, meta.compressed, meta.base.float())
    with pytest.raises(ValueError, match=r"PageMeta.compressed/PageMeta.base must have shape \[..., 2\]"):
        F.PageMeta("token", 64, meta.compressed, meta.base[:2])
    with pytest.raises(ValueError, match="PageMeta.check must be None or a uint8 tensor"):
        F.PageMeta("token", 64, meta.compressed, meta.base, meta.check.long())
    with pytest.raises(ValueError, match="PageMeta.compressed, .base and .check must share a device, got cpu, meta"):
        F.PageMeta("token", 64, meta.compressed, meta.base.to("meta"))


def test_payload_and_metadata_on_different_devices_is_named():
    payload, meta = F.pack(PAGES)
    with pytest.raises(ValueError, match="payload is on meta, meta on cpu: they must share a device"):
        F.unpack(payload.to("meta"), meta)


def test_greedy_sampling_with_top_p_or_top_k_is_refused_not_ignored():
    from zipkv.sampling import SamplingParams

    with pytest.raises(ValueError, match=r"top_p=0.5 with temperature=0.0: greedy decoding .* give a temperature > 0"):
        SamplingParams(top_p=0.5)
    with pytest.raises(ValueError, match=r"top_k=5 with temperature=None"):
        SamplingParams(temperature=None, top_k=5)
    assert SamplingParams(temperature=0.7, top_p=0.5, top_k=5).top_k == 5


def test_a_trace_of_strings_is_refused_and_summarize_names_its_argument():
    from zipkv.serving import Trace, summarize

    with pytest.raises(TypeError, match=r"Trace.arrivals\[0\] must be a number .* got str '0'"):
        Trace(("0", "1"), ([1], [2]), (1, 1))
    with pytest.raises(TypeError, match=r"Trace.prompts\[0\] must be a sequence of int token ids, got str 'abc'"):
        Trace((0.0, 1.0), ("abc", [2]), (1, 1))
    with pytest.raises(TypeError, match=r"Trace.prompts\[1\] must be a sequence of int token ids, got list"):
        Trace((0.0, 1.0), ([1], [2.5]), (1, 1))
    with pytest.raises(TypeError, match="result must be a zipkv.serving.ServeResult"):
        summarize({"requests": []})


def _cli(*argv):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "zipkv", *argv], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""})


@pytest.mark.parametrize("argv, says", [
    (("bench", "format", "--steps", "3"), "zipkv bench format: --steps applies to bench distill only, not format\n"),
    (("bench", "pack", "--write"), "zipkv bench pack: --write applies to bench tune only, not pack\n"),
    (("bench", "attention", "--shape", "bogus"),
     "zipkv bench attention: --shape bogus: expected one of ['llama3.1-8b', 'smollm2-135m']\n"),
    (("bench", "attention", "--methods", "fast"), "zipkv bench attention: --methods fast: expected names from"),
    (("bench", "tune", "--real-kv", "/nonexistent.csv"), "zipkv bench tune: --real-kv /nonexistent.csv: no such file"),
    (("bench", "distill", "--contexts", "300"), "zipkv bench distill: --contexts 300: too short for the benchmark's budget"),
    (("book", "--html-only", "--profile", "quick"), "zipkv book: --html-only builds the HTML from book/ as it is and runs "
                                                    "no notebook: --profile would be ignored"),
    (("book", "--profile", "", "--no-html"), "zipkv book: unknown profile '': expected one of"),
])
def test_options_of_another_command_or_out_of_range_are_one_line_before_any_work(argv, says):
    """Before: ignored (``bench format --steps 3``, ``bench pack --write``, ``book --html-only --profile quick`` built the
    HTML), or hidden behind the GPU check / found after loading the model."""
    done = _cli(*argv)
    assert done.returncode in (1, 2) and done.stderr.startswith(says) and done.stderr.count("\n") == 1, done.stderr
    for bad in (("bench", "attention", "--splits", "-1"), ("bench", "attention", "--stages", "0")):
        done = _cli(*bad)
        assert done.returncode == 2 and f"argument {bad[2]}: expected an integer" in done.stderr, done.stderr


def test_the_distillers_name_a_model_passed_where_a_capture_goes():
    """Before: ``AttributeError: 'LlamaForCausalLM' object has no attribute 'layers'`` from inside the distiller."""
    from conftest import tiny_llama
    from zipkv.distill import attention_matching, generalise, kvsculpt

    model = tiny_llama()
    for compress in (kvsculpt.compress, generalise.compress, attention_matching.compress):
        with pytest.raises(TypeError, match=r"capture must be a zipkv.models.Capture, got LlamaForCausalLM: .* "
                                            r"zipkv.compress\(model, context_ids, ...\) takes the model itself"):
            compress(model, 0.5, m=4)
    with pytest.raises(TypeError, match=r"capture must be a zipkv.models.Capture, got list$"):
        kvsculpt.compress([], 0.5, m=4)
    from zipkv.distill import SculptConfig
    from zipkv.models import capture

    cap = capture(model, torch.arange(40) % 100)
    with pytest.raises(TypeError, match="config must be a zipkv.distill.attention_matching.AttentionMatchingConfig or "
                                        "None, got SculptConfig"):      # was AttributeError: ... no attribute 'keys'
        attention_matching.compress(cap, 0.5, m=4, config=SculptConfig())


def test_plan_refuses_a_split_count_far_past_the_page_count():
    """A million splits reserved a million partial results (about 2 GB) for a few pages; now a clear error."""
    import pytest
    import torch
    from zipkv.kernels import decode_attention as da
    k = torch.randn(1, 1, 32, 64).to(torch.bfloat16)
    cache, indptr, indices, last = da.build_paged_cache(k, k.clone())
    da.plan(indptr, indices, last, cache, 1, num_splits=2)
    with pytest.raises(ValueError, match="num_splits must be at most"):
        da.plan(indptr, indices, last, cache, 1, num_splits=10**6)


def test_the_distillers_name_the_nearest_keyword_before_any_work():
    """Python gave a bare TypeError for a misspelt keyword; every distiller entry point now suggests the nearest."""
    import pytest
    from zipkv.distill import attention_matching, generalise, kvsculpt
    with pytest.raises(TypeError, match=r"did you mean n_synthetic=\?"):
        kvsculpt.compress(object(), 0.3, n_synthetics=2)
    with pytest.raises(TypeError, match=r"did you mean m=\?|did you mean config="):
        generalise.compress(object(), 0.3, mm=2)
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        attention_matching.compress(object(), 0.3, confg=None)
