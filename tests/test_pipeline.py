"""Text in, answers out (zipkv.pipeline): a document compressed once, several questions of different lengths answered
after it in one left-padded generate, as a function and as kvpress's pipeline shape."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers

from zipkv import cache as C
from zipkv import compression
from zipkv import pipeline as P

QUESTIONS = ["Who is the main character?", "In one sentence of your own words, say what happens in this passage, which "
             "people take part in it, what they want from each other, and where and when it takes place.", "Where?"]
"""Prompts of 14, 45 and 10 tokens after the templated context: padded so far that rows run at the padded width's
positions answer otherwise (the bar's test checks it)."""
NEW = 24


@pytest.fixture(scope="module")
def context(tokenizer):
    """512 tokens of a PG19 book, decoded to text."""
    from zipkv import data

    (w,) = data.windows(tokenizer, data.load_books(), 1, context=512, continuation=0, seed=0)
    return tokenizer.decode(w.context_ids)


@pytest.fixture(scope="module")
def plain_tokenizer(tokenizer):
    """The embedded tokenizer without its chat template."""
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    return bare


def templated(tokenizer, context, question):
    return tokenizer.apply_chat_template([{"role": "user", "content": context + "\n\n" + question}],
                                         add_generation_prompt=True, return_tensors="pt", return_dict=True)


def test_prompt_ids_split_each_whole_prompt_after_the_templated_context(tokenizer, plain_tokenizer, context):
    """Each question's prompt is the tokenizer's own tokenization of the whole templated prompt; the part before the
    split is the templated context's tokens, the same for every question; a token merged across the boundary (plain
    text, no separator) goes with the questions."""
    context_ids, question_ids = P.prompt_ids(tokenizer, context, QUESTIONS)
    for question, ids in zip(QUESTIONS, question_ids):
        assert torch.equal(torch.cat([context_ids, ids]), templated(tokenizer, context, question)["input_ids"][0])
        assert tokenizer.decode(ids).startswith("\n\n" + question)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": context}], tokenize=False)
    head = rendered[:rendered.index(context) + len(context)]
    assert context_ids.tolist() == tokenizer(head, add_special_tokens=False)["input_ids"]
    assert len({len(ids) for ids in question_ids}) > 1, "questions of different lengths: the batch is padded"
    context_ids, (ids,) = P.prompt_ids(plain_tokenizer, "the cat sat on the m", ["at by the door"], separator="")
    assert torch.cat([context_ids, ids]).tolist() == plain_tokenizer("the cat sat on the mat by the door")["input_ids"]
    assert tokenizer.decode(context_ids) == "the cat sat on the" and tokenizer.decode(ids) == " mat by the door"
    assert P.prompt_ids(tokenizer, context, QUESTIONS[:1], chat_template=False)[0].tolist() == \
        tokenizer(context)["input_ids"], "chat_template=False: the plain text"


@pytest.mark.slow
def test_three_questions_in_one_batched_call_are_the_uncompressed_models_answers(embedded, context, monkeypatch):
    """The bar: three questions over one PG19 context, compressed once at kept_fraction=1.0 and answered in one
    generate, give exactly the greedy answers of the model's own generate on each whole templated prompt; the
    registered pipeline gives the same."""
    model, tokenizer = embedded
    C.attach(model)
    compressed, batches = [], []
    monkeypatch.setattr(P, "compress", lambda *a, **k: compressed.append(a[1]) or compression.compress(*a, **k))
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda ids, **kwargs: batches.append(ids.shape) or generate(ids, **kwargs))
    answers = P.answer(model, tokenizer, context, QUESTIONS, kept_fraction=1.0, method="attention_score",
                       max_new_tokens=NEW)
    assert len(compressed) == 1 and len(batches) == 1 and batches[0][0] == 3, "one compression, one batched generate"
    eos = model.generation_config.eos_token_id
    for question, ours in zip(QUESTIONS, answers):
        prompt = templated(tokenizer, context, question)
        out = generate(**prompt, max_new_tokens=NEW, do_sample=False)[0, prompt["input_ids"].shape[1]:].tolist()
        want = tokenizer.decode(out[:out.index(eos)] if eos in out else out, skip_special_tokens=True)
        assert ours == want and ours, question
    monkeypatch.undo()
    assert "zipkv-text-generation" in transformers.pipelines.get_supported_tasks()
    pipe = transformers.pipeline(P.TASK, model=model, tokenizer=tokenizer, kept_fraction=1.0,
                                 method="attention_score", max_new_tokens=NEW)
    assert isinstance(pipe, P.ZipkvTextGenerationPipeline)
    assert pipe(context, questions=QUESTIONS) == {"answers": answers}
    assert pipe(context, question=QUESTIONS[1]) == {"answer": answers[1]}
    assert P.answer(model, tokenizer, context, QUESTIONS[2], kept_fraction=1.0, method="attention_score",
                    max_new_tokens=NEW) == answers[2], "one question as a string: its answer as a string"
    monkeypatch.setattr(C, "_token_positions",
                        lambda padding, n: (n + torch.arange(padding.shape[1])).expand(padding.shape))
    assert P.answer(model, tokenizer, context, QUESTIONS, kept_fraction=1.0, method="attention_score",
                    max_new_tokens=NEW) != answers, "each row's own positions matter: the test can fail"


@pytest.mark.slow
def test_the_default_method_answers_three_questions(embedded, context):
    model, tokenizer = embedded
    answers = P.answer(model, tokenizer, context, QUESTIONS, kept_fraction=0.3, max_new_tokens=8)
    assert len(answers) == 3 and all(isinstance(a, str) and a.strip() for a in answers), answers


class Untouchable:
    """A model that fails the test when anything reads it: the argument checks come before any work."""

    def __getattr__(self, name):
        raise AssertionError(f"the model was used (.{name}) before the arguments were checked")


def test_bad_input_is_refused_before_any_work(tokenizer, plain_tokenizer, context):
    model = Untouchable()
    for args, kwargs, error, match in (
            ((tokenizer, context, []), {}, ValueError, "questions is empty: expected at least one question"),
            ((tokenizer, context, None), {}, TypeError, "questions=None: expected a string or a list of strings"),
            ((tokenizer, context, ["Who?", 3]), {}, TypeError, r"questions\[1\] is int 3: expected a string"),
            ((tokenizer, b"text", QUESTIONS), {}, TypeError, "context must be a str .* got bytes"),
            ((tokenizer, ["a", "list"], QUESTIONS), {}, TypeError, "context must be a str .* got list"),
            ((plain_tokenizer, context, QUESTIONS), dict(chat_template=True), ValueError,
             r"chat_template=True, but the tokenizer .* has no chat template: .* chat_template=False"),
            ((tokenizer, context, QUESTIONS), dict(chat_template="yes"), TypeError, "chat_template='yes': expected"),
            ((None, context, QUESTIONS), {}, TypeError, "tokenizer must be a Hugging Face tokenizer .* got NoneType"),
            ((tokenizer, context, QUESTIONS), dict(max_new_tokens=0), ValueError, "max_new_tokens=0: expected an int"),
            ((tokenizer, context, QUESTIONS), dict(generate_kwargs=dict(attention_mask=None, num_beams=2)), ValueError,
             r"generate_kwargs sets \['attention_mask'\]"),
            ((tokenizer, context, QUESTIONS), dict(separator=None), TypeError, "separator=None: expected a str"),
            ((tokenizer, "", QUESTIONS), {}, ValueError, "context='' is empty: expected the document"),  # was answered
            ((tokenizer, " \n", QUESTIONS), {}, ValueError, r"context=' \\n' is empty")):
        with pytest.raises(error, match=match):
            P.answer(model, *args, **kwargs)


def test_the_pipeline_refuses_bad_input_before_any_work(embedded, plain_tokenizer, context, monkeypatch):
    """kvpress's pipeline shape, its mistakes named: both question and questions, none, a non-string context; and
    zipkv.compress's own checks of its settings (before the capture)."""
    from zipkv import models

    model, tokenizer = embedded
    C.attach(model)
    monkeypatch.setattr(models, "capture", lambda *args, **kwargs: pytest.fail("the capture ran before the checks"))
    monkeypatch.setattr(model, "generate", lambda *args, **kwargs: pytest.fail("generate ran before the checks"))
    pipe = transformers.pipeline(P.TASK, model=model, tokenizer=tokenizer)
    for args, kwargs, error, match in (
            ((context,), dict(question="Who?", questions=["When?"]), ValueError,
             r"question='Who\?' and questions=\['When\?'\]: give one"),
            ((context,), {}, ValueError, r"no question: pass question='...' or questions=\[...\]"),
            ((context,), dict(questions="Who?"), TypeError, r"questions='Who\?': expected a list of strings \(one "
                                                           r"question: question=...\)"),
            ((context,), dict(question=["Who?"]), TypeError, r"question=\['Who\?'\]: expected a string"),
            ((context,), dict(questions=[]), ValueError, "questions is empty"),
            ((42,), dict(question="Who?"), TypeError, "context must be a str .* got int"),
            ((context,), dict(question="Who?", max_new_tokens=-1), ValueError, "max_new_tokens=-1"),
            ((context,), dict(question="Who?", kept_fraction=1.5), ValueError,
             r"kept_fraction=1.5: expected the fraction of the context kept, in \(0, 1\]"),
            ((context,), dict(question="Who?", kept_fracton=0.5), TypeError,
             r"unexpected setting kept_fracton=0.5 \(did you mean kept_fraction=\?\)"),
            ((context,), dict(question="Who?", generate_kwargs=dict(num_beam=2)), ValueError,   # after the compression
             r"generate_kwargs=\{'num_beam': 2\}: The following `model_kwargs` are not used by the model: \['num_beam'\]")):
        with pytest.raises(error, match=match):
            pipe(*args, **kwargs)
    bare = transformers.pipeline(P.TASK, model=model, tokenizer=plain_tokenizer, chat_template=True)
    with pytest.raises(ValueError, match="chat_template=True, but the tokenizer"):
        bare(context, question="Who?")


@pytest.mark.slow
def test_a_probe_given_as_ids_is_the_sampled_probe_when_the_ids_are_the_same(embedded, context):
    """``probe=`` ids teacher-forced after the context take the sampled continuation's place: given the very ids the
    default samples, the cache is the default's, pair for pair (so the forced path feeds them where sampling would)."""
    from zipkv import models
    from zipkv.distill import generalise

    model, tokenizer = embedded
    ids = torch.tensor(tokenizer(context)["input_ids"][:96])
    sampled = generalise.sample_probe(model, models.capture(model, ids), ids, tokens=8, seed=3).ids
    default = compression.compress(model, ids, 0.5, probe_tokens=8, seed=3)
    given = compression.compress(model, ids, 0.5, probe=sampled, seed=3)
    other = compression.compress(model, ids, 0.5, probe=sampled.flip(0), seed=3)
    for a, b in zip(default.layers, given.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) and torch.equal(a.bias, b.bias)
    assert any(not torch.equal(a.values, b.values) for a, b in zip(default.layers, other.layers)), "can fail"


def test_the_reconstruction_probe_is_the_repeat_prompt_then_the_context(tokenizer):
    ids = torch.arange(100, 140)
    probe = P.reconstruction_probe(tokenizer, ids[None])
    repeat = tokenizer(P.REPEAT_PROMPT, add_special_tokens=False)["input_ids"]
    assert probe.tolist() == repeat + ids.tolist() and probe.dtype == torch.long


def test_the_reconstruction_settings_select_keys_by_their_largest_attention(tokenizer, monkeypatch):
    from zipkv.distill.generalise import ZipkvConfig

    ids = torch.arange(100, 140)
    chosen = P.reconstruction_settings(tokenizer, ids)
    assert torch.equal(chosen["probe"], P.reconstruction_probe(tokenizer, ids))
    assert chosen["config"] == ZipkvConfig(selection="max")
    assert set(P.reconstruction_settings(tokenizer, ids, "attention_matching")) == {"probe"}
    seen = {}

    def fake_compress(model, context_ids, kept_fraction, *, method, **settings):
        seen.update(settings)
        raise RuntimeError("stop")
    monkeypatch.setattr(P, "compress", fake_compress)
    monkeypatch.setattr(P, "_check_generate_kwargs", lambda *args: None)
    mine = ZipkvConfig(horizon=64)
    for given, config in (({}, ZipkvConfig(selection="max")), ({"config": mine}, mine)):
        seen.clear()
        with pytest.raises(RuntimeError, match="stop"):
            P._generate_answers(None, tokenizer, ids, [ids[:2]], kept_fraction=0.5, method="zipkv", max_new_tokens=4,
                                generate_kwargs={}, settings={"probe": "reconstruction", **given})
        assert seen["config"] == config and torch.equal(seen["probe"], chosen["probe"])


def test_bad_probes_are_refused_before_the_capture(embedded, context, monkeypatch):
    from zipkv import models

    model, tokenizer = embedded
    ids = torch.tensor(tokenizer(context)["input_ids"][:64])
    monkeypatch.setattr(models, "capture", lambda *args, **kwargs: pytest.fail("the capture ran before the checks"))
    vocab = model.config.vocab_size
    for probe, error, match in (("reconstruction", TypeError, r"probe='reconstruction': expected token ids; .*"
                                                              r"reconstruction_probe\(tokenizer, context_ids\)"),
                                (torch.ones(4), ValueError, r"probe has shape \(4,\) and dtype torch.float32"),
                                (torch.ones(2, 3, dtype=torch.long), ValueError, r"probe has shape \(2, 3\)"),
                                (torch.tensor([], dtype=torch.long), ValueError, r"probe has shape \(0,\)"),
                                (torch.tensor([5, vocab]), ValueError, f"probe holds ids from 5 to {vocab}: .* 0 … "
                                                                       f"{vocab - 1}"),
                                (torch.tensor([-1, 2]), ValueError, "probe holds ids from -1 to 2"),
                                (object(), TypeError, r"probe must be token ids \(a tensor, list or array of "
                                                      r"ints\), got object")):
        with pytest.raises(error, match=match):
            compression.compress(model, ids, 0.5, probe=probe)
    with pytest.raises(ValueError, match=r"probe='recon': expected 'reconstruction'"):
        P.answer(model, tokenizer, context, "Who?", probe="recon")
