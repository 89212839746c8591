"""Launch options measured per GPU model, stored beside the kernels in ``decode_tuning.json``.

``python -m zipkv bench tune [--kernel gluon] --write`` (:func:`zipkv.bench.tune.tune_decode_attention`) times
every launch configuration of each specialisation and stores the fastest; a kernel's own defaults apply
wherever the file has no entry (another GPU model, a path or head_dim not tuned). The file::

    {"NVIDIA H200": {"compressed": {...}, "raw": {...}, "mixed": {...},           # the Triton kernel
                     "gluon": {"128": {"compressed": {...}, "mixed": {...}}}}}    # the Gluon kernel, per head_dim
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

__all__ = ["TUNING_FILE", "store", "tuned"]

TUNING_FILE = Path(__file__).with_name("decode_tuning.json")

KERNELS = ("triton", "gluon")


def _key(kernel: str, head_dim: int | None) -> str | None:
    """The Gluon kernel's head_dim key (``None`` for the Triton kernel, whose entries sit at the top)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "triton":
        return None
    if head_dim is None:
        raise ValueError("the Gluon kernel's options are tuned per head_dim: pass head_dim=")
    return str(int(head_dim))


def tuned(gpu_name: str | None, path: str, *, kernel: str = "triton", head_dim: int | None = None) -> dict:
    """The stored options of ``kernel``'s ``path`` specialisation on ``gpu_name`` (``{}`` when none)."""
    key = _key(kernel, head_dim)
    file = TUNING_FILE
    if not gpu_name or not file.exists():
        return {}
    entry = _parsed(file, file.stat().st_mtime_ns).get(gpu_name, {})
    if key is not None:
        entry = entry.get("gluon", {}).get(key, {})
    return dict(entry.get(path, {}))


def store(gpu_name: str, options: dict, *, kernel: str = "triton", head_dim: int | None = None,
          file: Path | None = None) -> dict:
    """Store ``options`` (``{path: {option: value}}``) for ``kernel`` on ``gpu_name``, keeping every other
    entry of the file (other GPUs, the other kernel, other head_dims and paths); returns the stored section."""
    key = _key(kernel, head_dim)
    file = Path(file or TUNING_FILE)
    stored = json.loads(file.read_text()) if file.exists() else {}
    section = stored.setdefault(gpu_name, {})
    if key is not None:
        section = section.setdefault("gluon", {}).setdefault(key, {})
    section.update({path: dict(opts) for path, opts in options.items()})
    file.write_text(json.dumps(stored, indent=2, sort_keys=True) + "\n")
    return section


@functools.lru_cache(maxsize=4)
def _parsed(file: Path, mtime_ns: int) -> dict:
    """The file's entries, parsed once per version of the file (not on every plan)."""
    return json.loads(file.read_text())
