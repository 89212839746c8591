"""zipkv: KV-cache compression for LLM decoding -- ZipFusion's lossless 12-bit BF16 format with its fused decode
attention and memory manager, and distillation of a long context into a few key/value pairs.

What users import (each name's own docstring says what it takes and returns):

* ``zipkv.load_model()`` -- a Hugging Face causal LM and its tokenizer (the embedded SmolLM2-135M by default, or any
  RoPE + GQA model path).
* ``zipkv.compress(model, context_ids, ...)`` -- distil the context's KV cache into a :class:`DistilledCache`, a
  ``transformers`` ``Cache`` that ``model.generate(next_ids, past_key_values=cache)`` accepts.
* ``zipkv.Engine(model, kv_budget_bytes)`` / ``zipkv.kv_budget_for(config, requests, tokens)`` -- batch decoding under
  a KV budget with ZipFusion's memory manager and fused kernel.
* ``zipkv.build_paged_cache(k, v)`` and ``zipkv.plan(indptr, indices, last_page_len, cache, q_heads).run(q)`` --
  the decode-attention kernel over a paged, partly compressed cache, with FlashInfer's page tables and plan/run.
* ``zipkv.pack(pages)`` / ``zipkv.unpack(payload, meta)`` -- the lossless block format, bit-exact, in plain torch.
* ``zipkv.answer(model, tokenizer, context, questions)`` -- text in, answers out: the context compressed once, every
  question answered after it in one batched ``generate`` (also the ``transformers`` pipeline task
  ``"zipkv-text-generation"`` once :mod:`zipkv.pipeline` is imported).

Submodules: :mod:`zipkv.format`, :mod:`zipkv.paged`, :mod:`zipkv.kernels`, :mod:`zipkv.memory`,
:mod:`zipkv.scheduler`, :mod:`zipkv.runner`, :mod:`zipkv.engine`, :mod:`zipkv.codecs`, :mod:`zipkv.compression`,
:mod:`zipkv.cache`, :mod:`zipkv.pipeline`,
:mod:`zipkv.distill`, :mod:`zipkv.models`, :mod:`zipkv.data`, :mod:`zipkv.bench`. The book's study is
:mod:`zipkv.study`, which the library never imports.
"""

__version__ = "0.1.0"

_PUBLIC = {
    "compress": "zipkv.compression", "DistilledCache": "zipkv.cache",
    "Engine": "zipkv.engine", "kv_budget_for": "zipkv.engine",
    "plan": "zipkv.kernels.decode_attention", "build_paged_cache": "zipkv.paged",
    "pack": "zipkv.format", "unpack": "zipkv.format",
    "load_model": "zipkv.models", "SamplingParams": "zipkv.sampling", "answer": "zipkv.pipeline",
}
__all__ = ["__version__", *_PUBLIC]


def __getattr__(name):
    # torch and transformers are imported on first use of a name, not by `import zipkv`
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'zipkv' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_PUBLIC])
