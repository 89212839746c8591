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
