"""What a request of :class:`zipkv.engine.Engine` samples and where it stops, in vLLM's and SGLang's vocabulary.

* :class:`SamplingParams` -- one request's temperature, top-k, top-p, seed, stop strings and stop token ids.
* :func:`sample` -- the sampler at the end of the decode step (:meth:`zipkv.runner.StepRunner.decode_forward`), inside
  the step's CUDA graph: per-row tensors in the step's static input buffer, static shapes, no host sync.
* :class:`TextStream` -- a request's text as its tokens reach the host: incremental detokenization, stop strings, and
  how much of it a stream can give out without taking it back.

**Counter-based noise.** :func:`sample` draws by Gumbel-max, ``argmax(logits / T + g)`` over the tokens top-k and
top-p keep, where ``g`` is Gumbel noise made from a hash of (the request's stream key, the position of the token whose
logits are sampled, the vocabulary index): no generator state, and nothing from the step's other rows. A request
therefore samples the same tokens whatever shares its steps, with overlap on or off, and through retraction (its
prefill samples the same position with the same key). The stream key (:func:`stream_key`) names the request's own
seed, or the call's seed and the request's index among the prompts.
"""
from __future__ import annotations

import bisect
import math
import numbers
import struct
from dataclasses import dataclass

import torch

__all__ = ["SamplingParams", "sample", "gumbel_noise", "stream_key", "step_inputs", "TextStream", "SAMPLING_ROWS"]

SAMPLING_ROWS = 4
"""Rows the sampling inputs add to the decode step's int64 input buffer (:func:`step_inputs`): stream key, top-k,
and the float64 bits of temperature and top-p."""

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingParams:
    """How one request picks its tokens and where it stops.

    temperature: 0 (or None) is greedy -- the logits' argmax, exactly the engine's greedy tokens --; above 0, tokens
    are drawn from ``softmax(logits / temperature)``. top_k: keep the ``top_k`` largest logits (0: all). top_p: then
    keep the fewest largest of those whose probability, renormalised over them, reaches ``top_p`` (1: all; both keep
    every token tied with the last one kept). seed: this request's own random stream -- the same prompt, parameters
    and seed sample the same tokens in any call and any batch --; None: the call's ``seed`` and the request's index
    among the prompts name it. Seeds are taken mod ``2**64``. stop: strings that end the request (the engine's
    ``tokenizer`` decodes its output); its text ends right before the first one that appears, its tokens before the
    token in which it begins (with any tokens of no text of their own just before that). stop_token_ids: tokens that
    end the request, beside the engine's ``eos_token_id``; like it, the stop token is the last of the output.
    """
    temperature: float | None = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list | None = None
    stop_token_ids: list | None = None

    def __post_init__(self):
        t = self.temperature
        if t is None:
            t = 0.0
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 or None: greedy), got {self.temperature!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 < p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1] (1: no top-p), got {p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral):
            raise TypeError(f"top_k must be an int >= 0 (0: no top-k), got {type(self.top_k).__name__} {self.top_k!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0: no top-k), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)):
            raise TypeError(f"seed must be an int or None, got {type(self.seed).__name__} {self.seed!r}")
        if t == 0 and (p != 1 or self.top_k != 0):
            given = ", ".join(f"{k}={v!r}" for k, v in (("top_p", p), ("top_k", self.top_k)) if v != (1 if k == "top_p" else 0))
            raise ValueError(f"{given} with temperature={self.temperature!r}: greedy decoding (temperature 0 or None) takes "
                             f"the argmax, so top_p and top_k would be ignored; give a temperature > 0 to sample "
                             f"(e.g. temperature=1.0)")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is not None and (not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop)):
            raise TypeError(f"stop must be a str or a list of str, got {self.stop!r}")
        if stop is not None and not all(stop):
            raise ValueError(f"stop strings must not be empty, got {self.stop!r}")
        ids = [self.stop_token_ids] if _is_int(self.stop_token_ids) else self.stop_token_ids
        if ids is not None and (not isinstance(ids, (list, tuple, set)) or not all(_is_int(i) and i >= 0 for i in ids)):
            raise ValueError(f"stop_token_ids must be token ids (ints >= 0; an int or a list), "
                             f"got {self.stop_token_ids!r}")
        self.temperature, self.top_p, self.top_k = float(t), float(p), int(self.top_k)
        self.seed = None if self.seed is None else int(self.seed)
        self.stop = tuple(stop or ())
        self.stop_token_ids = tuple(int(i) for i in ids or ())

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def step_column(self, key: int) -> tuple:
        """This request's column of :func:`step_inputs`' rows (``key``: its :func:`stream_key`)."""
        bits = struct.unpack("<2q", struct.pack("<2d", self.temperature, self.top_p))
        return (key, self.top_k, *bits)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _mul32(x, c: int):
    """``x * c mod 2**32`` for words ``x`` in [0, 2**32) (int64 tensors or ints): ``c`` in 16-bit halves, so that no
    product leaves int64's range."""
    return ((((x * (c >> 16)) & 0xFFFF) << 16) + x * (c & 0xFFFF)) & _MASK32


def _mix32(x):
    """murmur3's 32-bit finalizer, a bijection of 32-bit words with full avalanche (int64 tensors or ints)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def stream_key(*words: int) -> int:
    """The stream key, in [0, 2**62), of a tuple of ints (each taken mod ``2**64``): two 32-bit hash lanes over the
    words' 32-bit halves. The engine keys a request by ``(1, its seed)`` or ``(0, the call's seed, its index)``."""
    lo, hi = 0x243F6A88, 0x85A308D3
    for w in words:
        w &= (1 << 64) - 1
        for part in (w & _MASK32, w >> 32):
            lo = _mix32(lo ^ part)
            hi = _mix32(hi ^ _mix32(part ^ lo))
    return (hi & 0x3FFFFFFF) << 32 | lo


def gumbel_noise(keys: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise, fp32 ``[B, vocab_size]``: entry ``(b, v)`` is a function of ``keys[b]``, ``positions[b]``
    and ``v`` alone. keys: int64 ``[B]`` in [0, 2**62); positions: int64 ``[B]``, >= 0."""
    row = _mix32((keys & _MASK32) ^ _mix32(positions & _MASK32))
    row2 = _mix32((keys >> 32) ^ _mix32(row ^ 0x9E3779B9))
    vocab = torch.arange(vocab_size, device=keys.device)
    bits = _mix32(_mix32(vocab ^ row[:, None]) ^ row2[:, None])
    # 23 bits: (n + 0.5) / 2**23 is exact in fp32 and lies in [2**-24, 1 - 2**-24], so neither log is infinite
    u = ((bits >> 9).float() + 0.5) * 2.0 ** -23
    return -torch.log(-torch.log(u))


def sample(logits: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, temperature: torch.Tensor,
           top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The next token of each row: the argmax of ``logits`` where ``temperature`` is 0 (the greedy step's arithmetic),
    else a draw from ``softmax(logits / temperature)`` restricted to the ``top_k`` largest logits (0: all), then to the
    fewest largest of those whose probability, renormalised over them, reaches ``top_p`` (1: all; vLLM's and Hugging
    Face's order) -- ``argmax(logits / T + g)`` over the tokens kept, ``g`` :func:`gumbel_noise` of
    ``(keys, positions)``.

    logits: ``[B, V]``, any float dtype. keys: int64 ``[B]`` (:func:`stream_key`). positions: int64 ``[B]``, the
    position of the token whose logits each row holds. temperature, top_p: float ``[B]``; top_k: int64 ``[B]``.
    Returns int64 ``[B]``. Static shapes and no host sync (a CUDA graph captures it), and every op is per row: a row's
    token depends on its own inputs only.
    """
    greedy = logits.argmax(-1)
    hot = temperature > 0
    x = logits.float()
    # shifted by the row's max first: a tiny temperature sends the others to -inf, never the max to +inf
    x = (x - x.amax(-1, keepdim=True)) / torch.where(hot, temperature, 1.0).float()[:, None]
    V = x.shape[-1]
    desc = x.sort(-1, descending=True).values
    rank = torch.arange(V, device=x.device)
    k = torch.where(top_k > 0, top_k.clamp(max=V), V)[:, None]
    desc = desc.masked_fill(rank >= k, float("-inf"))
    probs = desc.softmax(-1)
    before = probs.cumsum(-1) - probs                      # probability of the larger logits
    keep = (rank < k) & ((before < top_p[:, None]) | (top_p[:, None] >= 1))
    threshold = desc.gather(-1, keep.sum(-1, keepdim=True) - 1)
    x = x.masked_fill(x < threshold, float("-inf"))
    drawn = (x + gumbel_noise(keys, positions, V)).argmax(-1)
    return torch.where(hot, drawn, greedy)


def step_inputs(rows: torch.Tensor):
    """``(keys, top_k, temperature, top_p)`` of the sampling rows ``rows`` (int64 ``[SAMPLING_ROWS, B]``, contiguous;
    columns from :meth:`SamplingParams.step_column`): the float64 rows are reinterpreted, not converted."""
    temperature, top_p = rows[2:4].view(torch.float64)
    return rows[0], rows[1], temperature, top_p


class TextStream:
    """A request's text as its tokens reach the host, and the stop strings that end it.

    Incremental detokenization as TGI and vLLM do it: the text a new token adds is ``decode(window + token)`` past
    ``decode(window)`` over a short window of the tokens before it, so that a token's text is fixed once read (a
    token that ends inside a multi-byte character waits for the next; a SentencePiece token keeps its leading space),
    and no step decodes the whole output. Special tokens add no text.

    tokenizer: a Hugging Face tokenizer. prompt: the request's prompt ids (its last ones are the first window).
    stop: strings that end the request. incremental: False where nobody reads the text before the request ends (no
    stop strings, no stream): the whole output is then decoded once, at the end, after the same window.
    """
    WINDOW = 5

    def __init__(self, tokenizer, prompt, stop=(), incremental: bool = True):
        self.tokenizer, self.stop, self.incremental = tokenizer, tuple(stop), incremental or bool(stop)
        self.held = max(map(len, self.stop), default=1) - 1     # characters a stop string may still take back
        self.ids = list(prompt[-self.WINDOW:])
        self.n_prompt = len(self.ids)
        self.prefix_at, self.read_at = 0, self.n_prompt
        self.text = ""
        self.counts, self.ends = [], []          # after ``counts[i]`` output tokens the text was ``ends[i]`` long

    def update(self, out, final: bool) -> int | None:
        """Take the request's output tokens ``out`` (those past the ones seen are new). final: none will follow, so
        text held back for an unfinished character is decoded as it is. Returns the number of tokens whose text lies
        wholly before the first stop string when one appears -- :attr:`text` then ends right before it -- else None."""
        if not self.incremental:
            if final:
                self.text = self._decode_ids(self.ids + out)[len(self._decode_ids(self.ids)):]
            return None
        for j in range(len(self.ids) - self.n_prompt, len(out)):
            self.ids.append(out[j])
            cut = self._decode(False)
            if cut is not None:
                return cut
        return self._decode(True) if final else None

    def _decode_ids(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _decode(self, force: bool) -> int | None:
        before = self._decode_ids(self.ids[self.prefix_at:self.read_at])
        now = self._decode_ids(self.ids[self.prefix_at:])
        if len(now) <= len(before) or (now.endswith("\ufffd") and not force):
            return None
        start = max(0, len(self.text) - self.held)
        self.text += now[len(before):]
        self.prefix_at, self.read_at = self.read_at, len(self.ids)
        self.counts.append(len(self.ids) - self.n_prompt)
        self.ends.append(len(self.text))
        found = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if not found:
            return None
        self.text = self.text[:min(found)]
        return self.tokens_before(len(self.text))

    def tokens_before(self, chars: int) -> int:
        """Output tokens whose text lies within the first ``chars`` characters."""
        i = bisect.bisect_right(self.ends, chars)
        return self.counts[i - 1] if i else 0

    def streamable(self) -> int:
        """Characters of :attr:`text` no stop string can take back any more."""
        return max(0, len(self.text) - self.held) if self.stop else len(self.text)
