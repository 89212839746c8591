"""Text in, answers out: one document compressed once, every question about it answered in one batched ``generate``.

The shape kvpress users know, as a ``transformers`` pipeline registered under :data:`TASK` when this module is
imported::

    import zipkv.pipeline
    from transformers import pipeline

    pipe = pipeline("zipkv-text-generation", model=model, tokenizer=tokenizer)
    pipe(context, question="Who wrote it?", kept_fraction=0.3)["answer"]
    pipe(context, questions=["Who?", "When?"], kept_fraction=0.3, max_new_tokens=32)["answers"]

or as a plain function, :func:`answer`. Both apply the tokenizer's chat template, where it has one, to ``context +
separator + question`` (one user turn, then the assistant's header), find where the questions begin in the templated
prompt (:func:`prompt_ids`), compress the templated context once with :func:`zipkv.compress` and answer every
question after it, left-padded in one ``generate`` call over the one :class:`~zipkv.cache.DistilledCache`: greedy,
up to ``max_new_tokens`` tokens, stopping at the model's end-of-sequence token.
"""
from __future__ import annotations

import contextlib
import numbers
from typing import Sequence

import torch
from transformers import AutoModelForCausalLM, Pipeline
from transformers.pipelines import PIPELINE_REGISTRY

from .compression import compress

__all__ = ["TASK", "ZipkvTextGenerationPipeline", "answer", "prompt_ids", "reconstruction_probe",
           "reconstruction_settings"]

TASK = "zipkv-text-generation"
"""The task name of :class:`ZipkvTextGenerationPipeline` for ``transformers.pipeline``."""

MAX_NEW_TOKENS = 50
"""The longest answer in tokens, by default (kvpress's)."""

SET_BY_ANSWER = ("input_ids", "inputs", "attention_mask", "past_key_values", "cache", "max_new_tokens",
                 "num_return_sequences", "return_dict_in_generate")
"""``generate`` arguments that :func:`answer` sets itself, one answer string per question (``generate_kwargs`` may
not)."""


def _check_tokenizer(tokenizer, chat_template) -> bool:
    """Whether the prompt is templated: ``chat_template`` (None: when the tokenizer has a template)."""
    if not callable(tokenizer) or not hasattr(tokenizer, "decode"):
        raise TypeError(f"tokenizer must be a Hugging Face tokenizer (the second value of zipkv.load_model), got "
                        f"{type(tokenizer).__name__}")
    if chat_template is not None and not isinstance(chat_template, bool):
        raise TypeError(f"chat_template={chat_template!r}: expected True (apply the tokenizer's chat template), "
                        "False (plain text) or None (the template when the tokenizer has one)")
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if chat_template and not has_template:
        raise ValueError(f"chat_template=True, but the tokenizer ({type(tokenizer).__name__}, "
                         f"{getattr(tokenizer, 'name_or_path', '') or 'unnamed'}) has no chat template: give it one "
                         "(tokenizer.chat_template = ...), or pass chat_template=False for a plain-text prompt")
    return has_template if chat_template is None else chat_template


def _check_questions(questions, expected: str = "a list of strings") -> list[str]:
    """``questions`` as a list of strings: a ``TypeError``/``ValueError`` naming it otherwise (``expected``: what the
    caller takes)."""
    if isinstance(questions, str) or not isinstance(questions, Sequence):
        raise TypeError(f"questions={questions!r}: expected {expected}")
    if not questions:
        raise ValueError("questions is empty: expected at least one question")
    wrong = next((i for i, q in enumerate(questions) if not isinstance(q, str)), None)
    if wrong is not None:
        raise TypeError(f"questions[{wrong}] is {type(questions[wrong]).__name__} {questions[wrong]!r}: expected a "
                        "string")
    return list(questions)


def _check_generation(max_new_tokens, generate_kwargs) -> dict:
    """``generate_kwargs`` as a dict, after checking it and ``max_new_tokens``."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: expected an int ≥ 1, the longest answer in tokens")
    if generate_kwargs is None:
        return {}
    if not isinstance(generate_kwargs, dict):
        raise TypeError(f"generate_kwargs={generate_kwargs!r}: expected a dict of model.generate's keyword arguments")
    taken = sorted(set(generate_kwargs) & set(SET_BY_ANSWER))
    if taken:
        raise ValueError(f"generate_kwargs sets {taken}: answer sets these itself (the questions, their mask and the "
                         "compressed cache in, one answer string per question out; max_new_tokens is its own "
                         "argument)")
    return dict(generate_kwargs)


def _check_generate_kwargs(model, generate_kwargs: dict) -> None:
    """``generate_kwargs`` that ``model.generate`` would refuse for its names -- neither a generation setting, nor one
    of ``generate``'s own arguments, nor an input of the model -- is a ``ValueError`` before the context is compressed
    (``generate`` itself checks only after the work; its own check does the judging, where the model has it)."""
    import copy
    import inspect

    config = getattr(model, "generation_config", None)
    validate = getattr(model, "_validate_model_kwargs", None)
    if config is None or validate is None or not generate_kwargs:
        return
    rest = copy.deepcopy(config).update(**generate_kwargs)             # the names that are no generation setting
    rest = {k: v for k, v in rest.items() if k not in inspect.signature(type(model).generate).parameters}
    try:
        validate(dict(rest))
    except ValueError as err:
        raise ValueError(f"generate_kwargs={generate_kwargs!r}: {err}") from None


def prompt_ids(tokenizer, context: str, questions: Sequence[str], *, chat_template: bool | None = None,
               separator: str = "\n\n") -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The token ids of each question's prompt, split where the questions begin.

    A question's prompt is ``context + separator + question`` as one user turn of the tokenizer's chat template,
    with the assistant's header after it (``chat_template=True``, or ``None`` where the tokenizer has a template), or
    that text alone (``False``). Each prompt is tokenized whole, as the model would see it without compression, and
    split after the templated context (the template's head, then the context): the questions part is the separator,
    the question and the template's tail. The split is the longest run of leading tokens that every prompt shares
    with the templated context tokenized alone, so ``context_ids`` is the templated context's tokens (less its last
    one where a merge carries it across the boundary: that token goes with the questions), and
    ``context_ids + question_ids[q]`` is exactly question ``q``'s prompt.

    Returns:
        ``(context_ids [N], [question_ids [T_q], …])`` int64 tensors, one per question.
    """
    templated = _check_tokenizer(tokenizer, chat_template)
    if not isinstance(context, str):
        raise TypeError(f"context must be a str (the document the questions are about), got {type(context).__name__}")
    if not context.strip():
        raise ValueError(f"context={context!r} is empty: expected the document the questions are about")
    questions = _check_questions(questions)
    if not isinstance(separator, str):
        raise TypeError(f"separator={separator!r}: expected a str, the text between the context and a question")
    if templated:
        def render(content: str) -> str:
            return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                 tokenize=False)

        marker = "\ue000"  # a private-use character: the template's text up to the context's end
        while marker in context:
            marker += "\ue000"
        rendered = render(context + marker)
        head = rendered[:rendered.index(marker)]
        prompts = [render(context + separator + q) for q in questions]
        stray = next((i for i, p in enumerate(prompts) if not p.startswith(head)), None)
        if stray is not None:
            raise ValueError(f"questions[{stray}]: the chat template does not put the question after the context "
                             "verbatim (it rewrites the user's message), so no part of the prompt is the context "
                             "alone; pass chat_template=False and template the text yourself")
    else:
        head = context
        prompts = [context + separator + q for q in questions]
    special = not templated  # a rendered template holds its special tokens as text already
    head_ids = tokenizer(head, add_special_tokens=special)["input_ids"]
    prompt_lists = [tokenizer(p, add_special_tokens=special)["input_ids"] for p in prompts]
    shared = len(head_ids)
    for ids in prompt_lists:
        shared = next((i for i, (a, b) in enumerate(zip(head_ids[:shared], ids)) if a != b), min(shared, len(ids)))
    empty = next((i for i, ids in enumerate(prompt_lists) if len(ids) == shared), None)
    if empty is not None:
        raise ValueError(f"questions[{empty}]={questions[empty]!r} adds no token after the context: expected a "
                         "question")
    return (torch.tensor(head_ids[:shared], dtype=torch.long),
            [torch.tensor(ids[shared:], dtype=torch.long) for ids in prompt_lists])


REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n"
"""The instruction before the context's own tokens in :func:`reconstruction_probe` (KVzip's, Kim et al. 2025, as
kvpress's ``KVzipPress`` words it)."""


def reconstruction_probe(tokenizer, context_ids) -> torch.Tensor:
    """Token ids ``[P]`` for :func:`zipkv.compress`'s ``probe``: :data:`REPEAT_PROMPT`, then the context ``[N]`` again,
    teacher-forced after it (P = N + the prompt's tokens). The distiller then fits and budgets on queries that re-read
    every part of the context, as KVzip scores pairs, instead of on the model's sampled continuation: for questions
    about the context asked after it (retrieval), not for continuing it. Its head-sensitivity phase runs P tokens
    instead of 64, so compression costs about N/64 times that phase's default."""
    repeat = tokenizer(REPEAT_PROMPT, add_special_tokens=False)["input_ids"]
    return torch.cat([torch.tensor(repeat, dtype=torch.long), torch.as_tensor(context_ids).flatten().long()])


def reconstruction_settings(tokenizer, context_ids, method: str = "zipkv") -> dict:
    """:func:`zipkv.compress`'s settings for retrieval questions about ``context_ids`` ``[N]``: the re-reading probe
    (:func:`reconstruction_probe`) and, for zipkv's distiller, old keys selected by their largest attention over the
    probe's queries (``ZipkvConfig(selection="max")``) rather than their mean: a fact is read by few of the
    re-reading queries, and the mean over all of them drowns it (the book's kvpress chapter measures both)."""
    settings = {"probe": reconstruction_probe(tokenizer, context_ids)}
    if method == "zipkv":
        from .distill.generalise import ZipkvConfig

        settings["config"] = ZipkvConfig(selection="max")
    return settings


def _special_ids(model, tokenizer) -> tuple[list[int], int]:
    """The model's end-of-sequence ids (its generation config's, else the tokenizer's) and the id that pads."""
    eos = model.generation_config.eos_token_id
    eos = tokenizer.eos_token_id if eos is None else eos
    eos = [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
    pad = next((p for p in (model.generation_config.pad_token_id, tokenizer.pad_token_id) if p is not None),
               eos[0] if eos else 0)
    return eos, int(pad)


def _generate_answers(model, tokenizer, context_ids: torch.Tensor, question_ids: list[torch.Tensor], *,
                      kept_fraction, method: str, max_new_tokens: int, generate_kwargs: dict,
                      settings: dict) -> list[str]:
    """Compress ``context_ids`` ``[N]`` once and answer every ``question_ids[q]`` ``[T_q]`` after it in one
    left-padded ``generate``."""
    _check_generate_kwargs(model, generate_kwargs)
    if isinstance(settings.get("probe"), str):
        if settings["probe"] != "reconstruction":
            raise ValueError(f"probe={settings['probe']!r}: expected 'reconstruction' (the context re-read after "
                             "a repeat instruction), token ids, or None (the sampled continuation)")
        chosen = reconstruction_settings(tokenizer, context_ids, method)
        settings = {**chosen, **{k: v for k, v in settings.items() if k != "probe"}}     # a given config wins
    cache = compress(model, context_ids, kept_fraction, method=method, **settings)
    eos, pad = _special_ids(model, tokenizer)
    device = next(model.parameters()).device
    width = max(len(q) for q in question_ids)
    batch = torch.full((len(question_ids), width), pad, dtype=torch.long)
    mask = torch.zeros(len(question_ids), width, dtype=torch.long)
    for row, ids in enumerate(question_ids):
        batch[row, width - len(ids):] = ids
        mask[row, width - len(ids):] = 1
    options = {"do_sample": False, "pad_token_id": pad, "eos_token_id": eos or None, **generate_kwargs}
    out = model.generate(batch.to(device), attention_mask=mask.to(device), past_key_values=cache,
                         max_new_tokens=max_new_tokens, **options)
    stop = options["eos_token_id"]
    stop = set() if stop is None else set(stop if isinstance(stop, (list, tuple)) else [stop])
    answers = []
    for row in out[:, width:].tolist():
        end = next((i for i, token in enumerate(row) if token in stop), len(row))
        answers.append(tokenizer.decode(row[:end], skip_special_tokens=True))
    return answers


def answer(model, tokenizer, context: str, questions: str | Sequence[str], *, kept_fraction: float | None = None,
           method: str = "zipkv", max_new_tokens: int = MAX_NEW_TOKENS, chat_template: bool | None = None,
           separator: str = "\n\n", generate_kwargs: dict | None = None, **settings) -> str | list[str]:
    """Answer ``questions`` about ``context`` from one compressed cache of it.

    Args:
        model, tokenizer: a Hugging Face causal LM that :func:`zipkv.compress` takes, and its tokenizer.
        context: the document.
        questions: one question (a string: the answer is a string) or a list of them (a list of answers).
        kept_fraction: the fraction of the templated context's KV pairs kept (default 0.3, :func:`zipkv.compress`'s).
        method: :func:`zipkv.compress`'s method.
        max_new_tokens: the longest answer, in tokens.
        chat_template: apply the tokenizer's chat template (None: where it has one), :func:`prompt_ids`.
        separator: the text between the context and each question.
        generate_kwargs: more keyword arguments of ``model.generate`` (sampling: ``dict(do_sample=True, …)``).
        settings: :func:`zipkv.compress`'s (``kept_tokens``, ``m``, ``seed``, the method's own); zipkv's and
            Attention Matching's ``probe`` also takes ``"reconstruction"`` (:func:`reconstruction_settings` of the
            templated context: for retrieval questions, at a higher compression cost).

    Every argument is checked before the model runs (:func:`zipkv.compress` checks its own).

    Returns:
        The answer (``questions`` a string) or the list of answers, one per question: greedy by default, each ending
        before the model's end-of-sequence token.
    """
    one = isinstance(questions, str)
    asked = _check_questions([questions] if one else questions, "a string or a list of strings")
    generate_kwargs = _check_generation(max_new_tokens, generate_kwargs)
    context_ids, question_ids = prompt_ids(tokenizer, context, asked, chat_template=chat_template, separator=separator)
    answers = _generate_answers(model, tokenizer, context_ids, question_ids, kept_fraction=kept_fraction,
                                method=method, max_new_tokens=max_new_tokens, generate_kwargs=generate_kwargs,
                                settings=settings)
    return answers[0] if one else answers


class ZipkvTextGenerationPipeline(Pipeline):
    """``pipe(context, question=..., **options)["answer"]`` or ``pipe(context, questions=[...], **options)["answers"]``
    (kvpress's ``KVPressTextGenerationPipeline`` convention), with :func:`answer`'s options: ``kept_fraction``,
    ``method``, ``max_new_tokens``, ``chat_template``, ``separator``, ``generate_kwargs`` and
    :func:`zipkv.compress`'s settings. Options given to ``transformers.pipeline(...)`` are every call's defaults."""

    _load_tokenizer = True

    def _sanitize_parameters(self, question=None, questions=None, chat_template=None, separator=None,
                             kept_fraction=None, method=None, max_new_tokens=None, generate_kwargs=None, **settings):
        if question is not None and questions is not None:
            raise ValueError(f"question={question!r} and questions={questions!r}: give one question as question= or "
                             "a list of them as questions=")
        preprocess, forward, postprocess = {}, {}, {}
        if question is not None:
            if not isinstance(question, str):
                raise TypeError(f"question={question!r}: expected a string (several questions: questions=[...])")
            preprocess["questions"], postprocess["single"] = [question], True
        if questions is not None:
            preprocess["questions"] = _check_questions(questions, "a list of strings (one question: question=...)")
            postprocess["single"] = False
        for name, value in (("chat_template", chat_template), ("separator", separator)):
            if value is not None:
                preprocess[name] = value
        for name, value in (("kept_fraction", kept_fraction), ("method", method), ("max_new_tokens", max_new_tokens),
                            ("generate_kwargs", generate_kwargs)):
            if value is not None:
                forward[name] = value
        if settings:
            forward["settings"] = settings
        if max_new_tokens is not None or generate_kwargs is not None:
            _check_generation(MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens, generate_kwargs)
        return preprocess, forward, postprocess

    def preprocess(self, context, questions=None, chat_template=None, separator="\n\n"):
        if questions is None:
            raise ValueError("no question: pass question='...' or questions=[...] (to the call or to "
                             "transformers.pipeline)")
        context_ids, question_ids = prompt_ids(self.tokenizer, context, questions, chat_template=chat_template,
                                               separator=separator)
        return {"context_ids": context_ids, "question_ids": question_ids}

    def get_inference_context(self):
        return contextlib.nullcontext  # some compress methods fit by gradient descent; generate sets no_grad itself

    def _forward(self, model_inputs, kept_fraction=None, method="zipkv", max_new_tokens=MAX_NEW_TOKENS,
                 generate_kwargs=None, settings=None):
        return _generate_answers(self.model, self.tokenizer, model_inputs["context_ids"], model_inputs["question_ids"],
                                 kept_fraction=kept_fraction, method=method, max_new_tokens=max_new_tokens,
                                 generate_kwargs=generate_kwargs or {}, settings=settings or {})

    def postprocess(self, model_outputs, single=True):
        return {"answer": model_outputs[0]} if single else {"answers": model_outputs}


PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=ZipkvTextGenerationPipeline, pt_model=AutoModelForCausalLM)
