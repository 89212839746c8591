"""zipkv.study.experiments.compose: a KVSculpt prefix in ZipFusion pages -- its stored bits, and the engine serving it."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from conftest import tiny_llama  # noqa: E402
from zipkv.study.experiments import compose  # noqa: E402
from zipkv import format as fmt  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_prefix_stats_count_full_pages_packed_and_the_partial_page_raw():
    """Two layers of 2 KV heads × 40 pairs × 32 dims: keys all in one binade (every block fits: 12 bits), values
    spread over 2^-60..2^60 (none fits: 16 bits); pairs 32..39 (a partial page) stay raw in both."""
    gen = torch.Generator().manual_seed(0)
    k = (1 + torch.rand(2, 40, 32, generator=gen)).to(torch.bfloat16)
    v = torch.ldexp(torch.ones(2, 40, 32), torch.randint(-60, 60, (2, 40, 32), generator=gen)).to(torch.bfloat16)
    assert bool(fmt.eligible(fmt.to_pages(k)).all()) and not bool(fmt.eligible(fmt.to_pages(v)).any())
    s = compose.prefix_stats([(k, v), (k, v)], n_context=100)
    assert (s["pairs"], s["frac_compressed_k"], s["frac_compressed_v"]) == (40, 1.0, 0.0)
    full, partial = 32, 8                          # pairs per head in full pages, in the partial page
    bits = ((12 * full + 16 * partial) + 16 * 40) / (2 * 40)
    assert s["bits_per_value"] == pytest.approx(bits)
    assert s["memory_vs_raw_context"] == pytest.approx(40 / 100 * bits / 16)


def test_serve_distilled_rows_on_a_tiny_model():
    """Every cache is served losslessly (packed pages give the raw pages' tokens) and a distilled prefix keeps r·N
    pairs; the full context is the reference of the first difference."""
    from zipkv.data import Window
    model = tiny_llama(q_heads=4, kv_heads=2, head_dim=32, seed=5).to(torch.bfloat16)
    ids = torch.randint(0, 128, (97,), generator=torch.Generator().manual_seed(1))
    window = Window(input_ids=ids, context=96, continuation=1, pg_id=0, title="t", char_offset=0)
    table = compose.serve_distilled(model, [window], [0.5], m=8, n_synthetic=8, steps=2, new_tokens=6, progress=False)
    assert table.method.tolist() == ["full context", "kvsculpt r=0.5"]
    assert table.pairs.tolist() == [96, 48] and table.lossless.all()
    assert table.first_difference.between(0, 6).all()


@pytest.mark.parametrize("a, b, first", [([1, 2, 3], [1, 2, 4], 2), ([5, 2], [1, 2], 0), ([1, 2, 3], [1, 2, 3], 3),
                                         ([1, 2], [1, 2, 3], 2)])
def test_first_difference_is_the_first_token_where_two_generations_part(a, b, first):
    assert compose._first_difference(a, b) == first == compose._first_difference(b, a)


def test_chapter_verdict_names_each_ratio_and_says_when_not_lossless():
    import pandas as pd
    from zipkv.study.chapters import compose as chapter
    rows = [dict(window=w, pg_id=w, n_context=256, method=m, ratio=r, pairs=p, frac_compressed_k=0.8,
                 frac_compressed_v=0.9, bits_per_value=12.6, memory_vs_raw_context=p / 256 * 12.6 / 16,
                 lossless=ok, first_difference=f, new_tokens=16)
            for w in range(2) for m, r, p, ok, f in (("full context", 1.0, 256, True, 16),
                                                     ("kvsculpt r=0.3", 0.3, 77, w == 0, 3))]
    text, kind = chapter.verdict(pd.DataFrame(rows))
    assert "r = 0.3 (77 pairs per KV head)" in text and "**not lossless**" in text and "in 3 of 4 runs" in text
    assert kind == "warning" and "for the first 3.0 (r = 0.3) of 16 tokens, on average over 2 windows." in text
