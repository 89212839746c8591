"""The KL between two runs' next-token distributions under each reading of KVSculpt's metric (§4).

KVSculpt §4 states its metric in one sentence: "KL divergence between the output logits under compressed KV and
the ground-truth logits under the full cache, computed over the 128 continuation tokens with teacher forcing". It
names neither the log base, nor the direction, nor whether the per-token values are averaged or summed, nor which
positions' logits count. :func:`kl_divergence` (:mod:`.evaluate`) is this project's reading: KL(full ‖ compressed)
in nats, averaged over the continuation's tokens. :func:`kl_under` computes one reading given as a
:class:`KLDefinition`; :data:`KL_DEFINITIONS` names the readings that the text leaves open, so that one pair of
teacher-forced runs can be scored under all of them (:func:`kl_table`).

§6.2 pins one of them down: on its hardest sequence it gives "the maximum per-token KL is 7.17, while the mean is
0.117", and 0.117 is that sequence's KVSculpt KL in its Table 2, so the tables hold per-token means.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["KL_DEFINITIONS", "KLDefinition", "TOKENS", "kl_table", "kl_under", "per_token_kl"]

DIRECTIONS = ("forward", "reverse")
"""``forward``: KL(full ‖ compressed), the reference first; ``reverse``: KL(compressed ‖ full)."""
TOKENS = ("all", "without_first", "first_half", "second_half")
"""Which of the ``C`` continuation tokens count: all, all but the first, the first ``C // 2``, the rest."""
REDUCTIONS = ("mean", "sum")
"""Over the chosen tokens: their mean (nats per token) or their sum (nats per continuation)."""
BASES = {"e": 1.0, "2": 1.0 / math.log(2.0)}
"""Log base → factor on a value in nats (bits = nats / ln 2)."""


@dataclass(frozen=True)
class KLDefinition:
    """One reading of "the KL over the continuation tokens".

    Attributes:
        direction: one of :data:`DIRECTIONS`.
        reduce: one of :data:`REDUCTIONS`.
        base: ``"e"`` (nats) or ``"2"`` (bits).
        tokens: which continuation tokens count, one of :data:`TOKENS`.
        label: how a page names it.
    """

    direction: str = "forward"
    reduce: str = "mean"
    base: str = "e"
    tokens: str = "all"
    label: str = "KL(full ‖ compressed), nats, mean over every token"

    def __post_init__(self):
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction={self.direction!r}: expected one of {DIRECTIONS}")
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"reduce={self.reduce!r}: expected one of {REDUCTIONS}")
        if self.base not in BASES:
            raise ValueError(f"base={self.base!r}: expected one of {tuple(BASES)}")
        if self.tokens not in TOKENS:
            raise ValueError(f"tokens={self.tokens!r}: expected one of {TOKENS}")

    def span(self, C: int) -> slice:
        """The counted tokens of a ``C``-token continuation."""
        return {"all": slice(0, C), "without_first": slice(1, C), "first_half": slice(0, C // 2),
                "second_half": slice(C // 2, C)}[self.tokens]


KL_DEFINITIONS: dict[str, KLDefinition] = {
    "ours": KLDefinition(),
    "bits": KLDefinition(base="2", label="the same in bits"),
    "sum": KLDefinition(reduce="sum", label="summed over the continuation, not averaged"),
    "reverse": KLDefinition(direction="reverse", label="KL(compressed ‖ full)"),
    "without_first": KLDefinition(tokens="without_first", label="without the first continuation token"),
    "first_half": KLDefinition(tokens="first_half", label="the first half of the continuation only"),
    "second_half": KLDefinition(tokens="second_half", label="the second half of the continuation only"),
}
"""The readings of §4's metric the text leaves open, each changing one thing against ``"ours"``
(:func:`zipkv.distill.evaluate.kl_divergence` averaged over the tokens)."""


def _check_logits(reference_logits: torch.Tensor, logits: torch.Tensor) -> None:
    for name, x in (("reference_logits", reference_logits), ("logits", logits)):
        if not isinstance(x, torch.Tensor) or x.ndim != 2 or not x.is_floating_point() or 0 in x.shape:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} is {shape}: expected floating-point logits [C, vocab] with C, vocab ≥ 1")
    if reference_logits.shape != logits.shape:
        raise ValueError(f"logits have shape {tuple(logits.shape)}, reference_logits {tuple(reference_logits.shape)}: "
                         "expected the same [C, vocab] (one row per teacher-forced continuation token)")


def per_token_kl(reference_logits: torch.Tensor, logits: torch.Tensor, direction: str = "forward") -> torch.Tensor:
    """``[C]`` float64 KL per row of ``[C, vocab]`` logits in nats: KL(p_ref ‖ p) (``"forward"``) or
    KL(p ‖ p_ref) (``"reverse"``)."""
    _check_logits(reference_logits, logits)
    if direction not in DIRECTIONS:
        raise ValueError(f"direction={direction!r}: expected one of {DIRECTIONS}")
    log_p = torch.log_softmax(reference_logits.double(), dim=-1)
    log_q = torch.log_softmax(logits.double(), dim=-1)
    if direction == "reverse":
        log_p, log_q = log_q, log_p
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1).clamp_min(0.0)


def kl_under(reference_logits: torch.Tensor, logits: torch.Tensor, definition: KLDefinition | str = "ours") -> float:
    """One number: the KL of ``logits`` ``[C, vocab]`` against ``reference_logits`` (the full cache's run) under
    ``definition`` (a :class:`KLDefinition` or a name from :data:`KL_DEFINITIONS`).

    Raises ``ValueError`` when the definition's token range selects no token of the ``C``.
    """
    if isinstance(definition, str):
        if definition not in KL_DEFINITIONS:
            raise ValueError(f"definition={definition!r}: expected a KLDefinition or one of {list(KL_DEFINITIONS)}")
        definition = KL_DEFINITIONS[definition]
    if not isinstance(definition, KLDefinition):
        raise TypeError(f"definition={type(definition).__name__}: expected a KLDefinition or a name from "
                        f"{list(KL_DEFINITIONS)}")
    kl = per_token_kl(reference_logits, logits, definition.direction)[definition.span(logits.shape[0])]
    if not kl.numel():
        raise ValueError(f"definition counts the tokens {definition.tokens!r} of a {logits.shape[0]}-token "
                         "continuation: none (expected at least 2 tokens for a half or all but the first)")
    total = kl.mean() if definition.reduce == "mean" else kl.sum()
    return float(total) * BASES[definition.base]


def kl_table(reference_logits: torch.Tensor, logits: torch.Tensor,
             definitions: dict[str, KLDefinition] | None = None) -> dict[str, float]:
    """``{name: KL}`` of one compressed run against the full cache's under every definition (default
    :data:`KL_DEFINITIONS`), the per-token KL computed once per direction."""
    _check_logits(reference_logits, logits)
    definitions = definitions or KL_DEFINITIONS
    per_direction = {d: per_token_kl(reference_logits, logits, d) for d in {x.direction for x in definitions.values()}}
    out = {}
    for name, definition in definitions.items():
        kl = per_direction[definition.direction][definition.span(logits.shape[0])]
        if not kl.numel():
            raise ValueError(f"definition {name!r} counts the tokens {definition.tokens!r} of a "
                             f"{logits.shape[0]}-token continuation: none (expected at least 2 tokens)")
        out[name] = float(kl.mean() if definition.reduce == "mean" else kl.sum()) * BASES[definition.base]
    return out
