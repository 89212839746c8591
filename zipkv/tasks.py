"""Long-context retrieval tasks generated offline from PG19 haystacks (RULER's synthetic tasks, Hsieh et al. 2024,
arXiv 2404.06654 §3), and their accuracy with greedy answers.

:func:`make_tasks` builds, from a seed, prompts whose haystack is PG19 book text cut to ``length`` tokens, with facts
("needles") inserted at a relative ``depth``; the question comes after the context, so a query-agnostic compression
of the context (kvpress's protocol) cannot know it. Kinds (RULER's names):

* ``"niah_single"`` -- one needle, "One of the special magic numbers for {key} is: {value}."; the answer its value;
* ``"niah_multikey"`` -- the same with three more needles of other keys (distractors);
* ``"niah_multivalue"`` -- four needles of one key, each its own value; the answer all four;
* ``"variable_tracking"`` -- a chain "VAR A = 12345", "VAR B = VAR A", ... spread over the haystack; the answer
  every variable that holds the value.

:func:`accuracy` scores greedy answers by RULER's string match: an answer is right when every expected string
occurs in the generated text.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

__all__ = ["KINDS", "Task", "accuracy", "greedy_replies", "make_tasks", "prefix_agreement", "prompt_ids"]

KINDS = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking")

_WORDS = ("amber", "basalt", "cedar", "delta", "ember", "falcon", "garnet", "harbor", "indigo", "juniper", "kestrel",
          "lantern", "meadow", "nickel", "orchid", "pebble", "quartz", "raven", "saffron", "thistle", "umber",
          "velvet", "willow", "yarrow", "zephyr", "anchor", "bramble", "cobalt", "dune", "fjord", "glacier", "heron")
_QUESTIONS = {
    "niah_single": "What is the special magic number for {key} mentioned in the provided text? Answer with the number.",
    "niah_multikey": "What is the special magic number for {key} mentioned in the provided text? Answer with the "
                     "number.",
    "niah_multivalue": "What are all the special magic numbers for {key} mentioned in the provided text? Answer with "
                       "the numbers.",
    "variable_tracking": "Find all variables that are assigned the value {key} in the text above. Answer with the "
                         "variable names.",
}


@dataclass
class Task:
    """One prompt: ``context`` (haystack with needles, ``length`` tokens of the model's tokenizer), ``question``
    (asked after it) and ``answers`` (every string the reply must contain)."""

    kind: str
    length: int
    depth: float
    context: str
    question: str
    answers: tuple


def _needles(kind: str, rng: np.random.Generator):
    """``(needle sentences, the question's key, expected answers)`` of one task."""
    def number():
        return str(int(rng.integers(1_000_000, 10_000_000)))

    keys = [f"{a}-{b}" for a, b in zip(rng.choice(_WORDS, 4, replace=False), rng.choice(_WORDS, 4, replace=False))]
    fact = "One of the special magic numbers for {} is: {}."
    if kind == "niah_single":
        value = number()
        return [fact.format(keys[0], value)], keys[0], (value,)
    if kind == "niah_multikey":
        values = [number() for _ in keys]
        return [fact.format(k, v) for k, v in zip(keys, values)], keys[0], (values[0],)
    if kind == "niah_multivalue":
        values = [number() for _ in range(4)]
        return [fact.format(keys[0], v) for v in values], keys[0], tuple(values)
    value = str(int(rng.integers(10_000, 100_000)))
    names = ["".join(rng.choice(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"), 5)) for _ in range(5)]
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    return chain, value, tuple(names)


def make_tasks(tokenizer, books: Sequence, n: int, length: int, kind: str = "niah_single",
               depths: Sequence[float] = (0.1, 0.3, 0.5, 0.7, 0.9), seed: int = 0) -> list[Task]:
    """``n`` tasks of ``kind`` whose contexts are ``length`` tokens (``tokenizer``'s) of PG19 text with the needles
    at relative depths cycling through ``depths`` (several needles: spread evenly from that depth to the end).

    Args:
        tokenizer: the model's tokenizer (lengths are counted in its tokens).
        books: :class:`zipkv.data.Book` objects (:func:`zipkv.data.load_books`), each long enough for ``length``.
        n, length, kind, depths, seed: as above; the same arguments give the same tasks.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {list(KINDS)}")
    for name, value, least in (("n", n, 1), ("length", length, 64)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
            raise ValueError(f"{name}={value!r}: expected an int ≥ {least}")
    if not len(depths) or any(isinstance(d, bool) or not isinstance(d, numbers.Real) or not 0 <= d <= 1
                              for d in depths):
        raise ValueError(f"depths={depths!r}: expected relative depths in [0, 1]")
    if not len(books):
        raise ValueError("books is empty: expected zipkv.data.Book objects (zipkv.data.load_books())")
    rng = np.random.default_rng(seed)
    tasks = []
    for i in range(n):
        needles, key, answers = _needles(kind, rng)
        room = length - sum(len(tokenizer.encode(" " + s, add_special_tokens=False)) for s in needles)
        book = books[int(rng.integers(len(books)))]
        chars = 8 * room + 64                      # a piece of the book that holds room tokens (PG19: ~4 chars a token)
        start = int(rng.integers(0, max(1, len(book.text) - chars)))
        hay = tokenizer.encode(book.text[start:start + chars], add_special_tokens=False)[1:room + 1]
        if len(hay) < room:                        # [1:]: the first token may be a word cut in two
            raise ValueError(f"book {book.pg_id} is too short for length={length} tokens")
        depth = float(depths[i % len(depths)])
        cuts = [round(room * (depth + (1 - depth) * j / len(needles))) for j in range(len(needles))]
        pieces, last = [], 0
        for cut, needle in zip(cuts, needles):
            pieces += [tokenizer.decode(hay[last:cut]), " " + needle + " "]
            last = cut
        pieces.append(tokenizer.decode(hay[last:]))
        tasks.append(Task(kind, length, depth, "".join(pieces), _QUESTIONS[kind].format(key=key), answers))
    return tasks


def prompt_ids(tokenizer, task: Task) -> tuple[torch.Tensor, torch.Tensor]:
    """``(context_ids [N], question_ids [Q])``: the chat template's user turn holding the context, split where the
    context ends (as kvpress's pipeline splits it), so that the context can be compressed before the question."""
    separator = "\u2063" * 3 + "####" + "\u2063" * 3
    if tokenizer.chat_template is None:
        context, suffix = (tokenizer.bos_token or "") + task.context, "\n"
    else:
        text = tokenizer.apply_chat_template([{"role": "user", "content": task.context + separator}],
                                             add_generation_prompt=True, tokenize=False)
        context, suffix = text.split(separator)
    question = "\n\n" + task.question + suffix
    encode = lambda s: torch.tensor(tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
    return encode(context), encode(question)


def _greedy_after(model, cache, n_context: int, question: torch.Tensor, max_new_tokens: int, eos, keyword: str):
    """Greedy tokens after ``question`` fed on ``cache`` at positions ``N, N+1, …`` (kvpress's pipeline's loop: a
    cache shorter than the context, as a press leaves it, cannot go through ``generate``)."""
    device = next(model.parameters()).device
    ids, position, out = question[None].to(device), n_context, []
    for _ in range(max_new_tokens):
        positions = torch.arange(position, position + ids.shape[1], device=device)[None]
        token = model(input_ids=ids, position_ids=positions, **{keyword: cache}).logits[0, -1].argmax()
        position += ids.shape[1]
        out.append(int(token))
        if out[-1] == eos:
            break
        ids = token.view(1, 1)
    return torch.tensor(out)


@torch.no_grad()
def accuracy(model, tokenizer, tasks: Sequence[Task], compress: Callable | None = None, max_new_tokens: int = 48):
    """Greedy answers to ``tasks`` and their RULER string-match score.

    Args:
        model, tokenizer: a Hugging Face causal LM and its tokenizer.
        tasks: from :func:`make_tasks`.
        compress: ``compress(model, context_ids) -> cache`` (e.g. ``lambda m, ids: zipkv.compress(m, ids, 0.25)``,
            or a kvpress press's cache), the question and reply fed after it at positions ``N, N+1, …`` by a greedy
            loop; ``None``: the uncompressed model through ``generate``.
        max_new_tokens: the reply's length (48: a sentence and a 7-digit number spelt one token a digit, as
            SmolLM2's tokenizer does).

    Returns:
        A ``pandas.DataFrame``: ``kind, length, depth, correct, reply, answers`` per task.
    """
    import pandas as pd

    from .models import cache_keyword

    device = next(model.parameters()).device
    rows = []
    for task in tasks:
        context, question = prompt_ids(tokenizer, task)
        if compress is None:
            ids = torch.cat([context, question])[None].to(device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=tokenizer.eos_token_id)[0, ids.shape[1]:]
        else:
            out = _greedy_after(model, compress(model, context), context.numel(), question, max_new_tokens,
                                tokenizer.eos_token_id, cache_keyword(model))
        reply = tokenizer.decode(out, skip_special_tokens=True)
        rows.append(dict(kind=task.kind, length=task.length, depth=task.depth,
                         correct=all(a in reply for a in task.answers), reply=reply, answers=" ".join(task.answers)))
    return pd.DataFrame(rows)


@torch.no_grad()
def greedy_replies(model, tokenizer, tasks: Sequence[Task], compress: Callable | None = None,
                   max_new_tokens: int = 128) -> list[torch.Tensor]:
    """Each task's greedy reply token ids (at most ``max_new_tokens``, stopping at the tokenizer's EOS), the question
    and reply fed after the context's cache at positions ``N, N+1, …``: ``compress(model, context_ids)``'s cache, or
    with ``compress=None`` the model's own uncompressed cache of the context -- the same loop either way, so that a
    difference is the compression's, not a summation order's."""
    from .models import cache_keyword

    device = next(model.parameters()).device
    out = []
    for task in tasks:
        context, question = prompt_ids(tokenizer, task)
        cache = (model(input_ids=context[None].to(device), use_cache=True, logits_to_keep=1).past_key_values
                 if compress is None else compress(model, context))
        out.append(_greedy_after(model, cache, context.numel(), question, max_new_tokens, tokenizer.eos_token_id,
                                 cache_keyword(model)).cpu())
    return out


def prefix_agreement(replies: Sequence[torch.Tensor], reference: Sequence[torch.Tensor], tokens: int) -> list[int]:
    """Per reply of at most ``tokens`` greedy tokens (:func:`greedy_replies`), how many of the first ``tokens`` equal
    the reference reply's before the first difference, a reply counting as EOS after its EOS: one equal to the
    reference throughout (ending at the same EOS, or both ``tokens`` long) agrees on all ``tokens``."""
    if len(replies) != len(reference):
        raise ValueError(f"replies: expected one per reference reply ({len(reference)}), got {len(replies)}")
    counts = []
    for a, b in zip(replies, reference):
        n = min(a.numel(), b.numel())           # the shorter ends at EOS, where the longer holds another token
        differ = (a[:n] != b[:n]).nonzero()
        counts.append(int(differ[0]) if len(differ) else tokens)
    return counts
