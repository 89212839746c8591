"""zipkv: KV-cache compression for LLM decoding (ZipFusion's lossless format, KVSculpt's distillation).

``zipkv.compress(model, context_ids, ratio=0.3)`` returns a :class:`zipkv.cache.DistilledCache` that
``model.generate(next_ids, past_key_values=cache)`` accepts (see :mod:`zipkv.cache`).
"""

__all__ = ["DistilledCache", "compress"]


def __getattr__(name):
    # transformers is imported on first use, not by `import zipkv`
    if name in __all__:
        from . import cache

        return getattr(cache, name)
    raise AttributeError(f"module 'zipkv' has no attribute {name!r}")
