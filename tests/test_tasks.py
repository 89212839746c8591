"""zipkv.tasks: RULER-style retrieval prompts from PG19 haystacks, and their greedy-answer accuracy."""
import re

import pytest
import torch

from zipkv import data, tasks


NEEDLE = (r"VAR \w+ = [^.]+\.", r"One of the special magic numbers for \S+ is: \d+\.")


@pytest.fixture(scope="module")
def books():
    return data.load_books(limit=3)


@pytest.mark.parametrize("kind", tasks.KINDS)
def test_tasks_are_seeded_hold_their_needles_at_their_depth_and_have_the_length_asked(tokenizer, books, kind):
    made = tasks.make_tasks(tokenizer, books, 4, 200, kind, depths=(0.2, 0.8), seed=3)
    again = tasks.make_tasks(tokenizer, books, 4, 200, kind, depths=(0.2, 0.8), seed=3)
    other = tasks.make_tasks(tokenizer, books, 4, 200, kind, depths=(0.2, 0.8), seed=4)
    assert made == again and made != other
    for task in made:
        assert abs(len(tokenizer.encode(task.context, add_special_tokens=False)) - 200) <= 8
        assert all(answer in task.context for answer in task.answers)
        needle = NEEDLE[kind != "variable_tracking"]
        first = re.search(needle, task.context).start()

        def tokens(text):
            return len(tokenizer.encode(re.sub(needle, "", text), add_special_tokens=False))
        assert abs(tokens(task.context[:first]) / tokens(task.context) - task.depth) < 0.05   # depth in tokens
    assert [t.depth for t in made] == [0.2, 0.8, 0.2, 0.8]


def test_question_comes_after_the_context_and_a_full_cache_answers_as_the_uncompressed_model(embedded, books):
    """The compress path (context prefilled, question after it) gives the uncompressed model's replies when the
    "compression" keeps every pair."""
    from transformers import DynamicCache

    model, tokenizer = embedded
    made = tasks.make_tasks(tokenizer, books, 2, 96, "niah_single", seed=0)
    context, question = tasks.prompt_ids(tokenizer, made[0])
    assert tokenizer.decode(question).strip().startswith(made[0].question[:20])

    def keep_all(model, ids):
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=ids[None], past_key_values=cache)
        return cache

    plain = tasks.accuracy(model, tokenizer, made, max_new_tokens=6)
    cached = tasks.accuracy(model, tokenizer, made, compress=keep_all, max_new_tokens=6)
    assert list(plain.reply) == list(cached.reply) and plain.reply.str.len().min() > 0
    assert plain.correct.dtype == bool


def test_greedy_agreement_is_full_for_the_uncompressed_cache_and_counts_the_prefix_before_a_difference(embedded, books):
    """Where the model cannot solve a task, compression is scored by how many greedy reply tokens match the
    uncompressed model's before the first difference: the model's own cache agrees to the end; a cache missing most
    of the context does not."""
    from transformers import DynamicCache

    model, tokenizer = embedded
    made = tasks.make_tasks(tokenizer, books, 2, 96, "niah_single", seed=1)
    reference = tasks.greedy_replies(model, tokenizer, made, None, 8)

    def keep_all(model, ids):
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=ids[None], past_key_values=cache)
        return cache

    def keep_last(model, ids):
        return keep_all(model, ids[-4:])
    assert tasks.prefix_agreement(tasks.greedy_replies(model, tokenizer, made, keep_all, 8), reference, 8) == [8, 8]
    lost = tasks.prefix_agreement(tasks.greedy_replies(model, tokenizer, made, keep_last, 8), reference, 8)
    assert sum(lost) < 16
    eos = tokenizer.eos_token_id
    assert tasks.prefix_agreement([torch.tensor([1, 2, 3])], [torch.tensor([1, 2, 4, 5])], 4) == [2]
    # the same reply ending at the same EOS agrees on every token; ending early where the other goes on does not
    assert tasks.prefix_agreement([torch.tensor([1, 2, eos])] * 2, [torch.tensor([1, 2, eos]),
                                                                    torch.tensor([1, 2, 7, eos])], 128) == [128, 2]
    with pytest.raises(ValueError, match="replies"):
        tasks.prefix_agreement([], reference, 8)


def test_bad_arguments_name_themselves(tokenizer, books):
    with pytest.raises(ValueError, match="kind"):
        tasks.make_tasks(tokenizer, books, 1, 100, "needle")
    with pytest.raises(ValueError, match="length"):
        tasks.make_tasks(tokenizer, books, 1, 10)
    with pytest.raises(ValueError, match="depths"):
        tasks.make_tasks(tokenizer, books, 1, 100, depths=(1.5,))
