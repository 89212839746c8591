"""The readings of KVSculpt's KL metric (zipkv.distill.kl_definitions) and the "why it does not reproduce" experiment
loop on a tiny random Llama."""
import math

import pandas as pd
import pytest
import torch

from conftest import tiny_llama
from zipkv.data import Window
from zipkv.distill import evaluate
from zipkv.distill.kl_definitions import KL_DEFINITIONS, KLDefinition, kl_table, kl_under, per_token_kl

C, VOCAB = 10, 37


@pytest.fixture(scope="module")
def logits():
    g = torch.Generator().manual_seed(3)
    reference = 3 * torch.randn(C, VOCAB, generator=g)
    return reference, reference + torch.randn(C, VOCAB, generator=g)


def test_ours_is_the_books_kl(logits):
    """The default reading is the chapters' metric: evaluate.kl_divergence averaged over the tokens."""
    ref, run = logits
    assert kl_under(ref, run) == pytest.approx(float(evaluate.kl_divergence(ref, run).mean()), rel=1e-12)


def test_a_two_word_vocabulary_against_the_formula():
    """p = (1/2, 1/2) against q = (9/10, 1/10): KL(p ‖ q) and KL(q ‖ p) from their definitions."""
    p, q = torch.tensor([[0.5, 0.5]], dtype=torch.float64).log(), torch.tensor([[0.9, 0.1]], dtype=torch.float64).log()
    forward = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    reverse = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    assert kl_under(p, q) == pytest.approx(forward, rel=1e-12)
    assert kl_under(p, q, "reverse") == pytest.approx(reverse, rel=1e-12)
    assert kl_under(p, q, "bits") == pytest.approx(forward / math.log(2), rel=1e-12)


def test_each_reading_changes_one_thing(logits):
    ref, run = logits
    per_token = per_token_kl(ref, run)
    table = kl_table(ref, run)
    assert set(table) == set(KL_DEFINITIONS)
    assert table["bits"] == pytest.approx(table["ours"] / math.log(2), rel=1e-12)
    assert table["sum"] == pytest.approx(table["ours"] * C, rel=1e-12)
    assert table["reverse"] == pytest.approx(kl_under(run, ref), rel=1e-12)
    assert table["reverse"] != pytest.approx(table["ours"], rel=1e-3)         # KL is not symmetric here
    assert table["without_first"] == pytest.approx(float(per_token[1:].mean()), rel=1e-12)
    assert (table["first_half"] + table["second_half"]) / 2 == pytest.approx(table["ours"], rel=1e-12)
    for name, value in table.items():                                           # one path, two entry points
        assert kl_under(ref, run, name) == pytest.approx(value, rel=1e-12)


def test_identical_runs_score_zero_under_every_reading(logits):
    ref, _ = logits
    assert all(v == 0.0 for v in kl_table(ref, ref.clone()).values())


def test_bad_input_is_refused_by_name(logits):
    ref, run = logits
    with pytest.raises(ValueError, match="reference_logits"):
        kl_under(ref[:3], run)
    with pytest.raises(ValueError, match="logits is"):
        kl_under(ref, run.long())
    with pytest.raises(ValueError, match="definition='nats'"):
        kl_under(ref, run, "nats")
    with pytest.raises(TypeError, match="definition=int"):
        kl_under(ref, run, 3)
    with pytest.raises(ValueError, match="direction='both'"):
        KLDefinition(direction="both")
    with pytest.raises(ValueError, match="tokens='last'"):
        KLDefinition(tokens="last")
    with pytest.raises(ValueError, match="1-token continuation"):
        kl_under(ref[:1], run[:1], "without_first")


def test_the_experiment_loop_on_a_tiny_model(one_thread):
    """Both experiments on one window of a tiny random Llama: every (method, queries) row, the n_s = N rows trained
    on N synthetic queries, an uncompressed-equivalent sanity check through the definitions table, and the page's
    ratio table in the one direction (Select+Fit's KL over the method's)."""
    from zipkv.study.chapters import kvsculpt_why as page
    from zipkv.study.experiments import kvsculpt_why as why

    model = tiny_llama(sharpen_logits=True)
    N, M, CONT = 40, 8, 6
    ids = torch.randint(0, 128, (N + CONT,), generator=torch.Generator().manual_seed(1))
    window = Window(ids, N, CONT, 0, "tiny", 0)
    table, definitions = why.measure(model, [window], [0.5], m=M, n_synthetic=4, steps=2, progress=False)
    assert len(table) == len(why.METHODS)
    assert set(table[table.queries == "dense"].n_synthetic) == {N}
    assert (table.kl > 0).all() and (table.heldout > 0).all()
    assert len(definitions) == len(why.METHODS) * len(KL_DEFINITIONS)
    ours = definitions[definitions.definition == "ours"].set_index(["method", "queries"]).kl
    assert ours.to_dict() == pytest.approx(table.set_index(["method", "queries"]).kl.to_dict(), rel=1e-12)
    # KVSculpt starts at Select+Fit's solution and keeps its best iterate: never a higher training objective
    by = table.set_index(["method", "queries"])
    assert by.loc[("kvsculpt", "paper"), "train"] <= by.loc[("select_fit", "paper"), "train"] * (1 + 1e-6)
    gains = page.gains(table)
    sf = by.loc[("select_fit", "paper"), "kl"]
    assert gains.loc[0.5, "KVSculpt, n_s = N"] == pytest.approx(sf / by.loc[("kvsculpt", "dense"), "kl"], rel=1e-12)
    shown = page.definitions_table(definitions, 0.5)
    assert shown.loc[KL_DEFINITIONS["sum"].label, "× ours"] == pytest.approx(CONT, rel=1e-9)
    with pytest.raises(ValueError, match="methods"):
        why.measure(model, [window], [0.5], m=M, n_synthetic=4, steps=2, methods=[("kvsculpt", "all")])


def test_queries_per_head_counts_equations_and_unknowns():
    from zipkv.models import EMBEDDED_NAME, EMBEDDED_SHAPE
    from zipkv.study.chapters import kvsculpt_why as page

    t = page.queries_per_head(2048, 256, 128, ratios=(0.5,))
    g = EMBEDDED_SHAPE.q_heads // EMBEDDED_SHAPE.kv_heads
    assert t.loc[EMBEDDED_NAME, "queries, n_s = 128"] == g * (256 + 128)
    assert t.loc[EMBEDDED_NAME, "queries, n_s = N"] == g * (256 + 2048)
    assert t.loc[EMBEDDED_NAME, "queries per pair, r = 0.5"] == pytest.approx(g * (256 + 128) / (round(0.5 * 2048) - 256))
    assert isinstance(t, pd.DataFrame) and len(t) == 2


def test_committed_rows_join_only_on_the_same_windows():
    """Table 1's and the beyond chapter's committed rows join a run on the same windows (Select+Fit's KL agrees), at
    Table 1's ratios; a run whose Select+Fit disagrees (other windows) gets none."""
    from pathlib import Path

    from zipkv.study.chapters import kvsculpt_why as page

    results = Path(__file__).resolve().parents[1] / "results" / "paper"
    main = pd.read_csv(results / "kvsculpt_main.csv")
    run = main[(main.ratio == 0.3) & (main.method == "select_fit") & (main.window < 2)].assign(queries="paper")
    joined = page.with_committed(run, results)
    added = joined[joined.committed.fillna(False).astype(bool)]
    assert set(added.window) == {0, 1} and set(added.ratio) == set(main.ratio)
    assert {("kvsculpt", "paper"), ("select_fit", "dense")} <= set(zip(added.method, added.queries))
    assert not ((added.method == "select_fit") & (added.queries == "paper") & (added.ratio == 0.3)).any()
    other = run.assign(kl=run.kl * 1.01)
    assert len(page.with_committed(other, results)) == len(other)


def test_kvsculpt_with_n_s_n_at_fewer_ratios_is_said_at_its_own_ratios():
    """KVSculpt with n_s = N run at r = 0.3 only, beside committed rows at 0.3/0.5/0.7: its gain, its ratio to
    Select+Fit and its wins are stated at r = 0.3 and counted over the runs that have both."""
    from zipkv.study.chapters import kvsculpt_why as page

    rows = []
    for w in range(2):
        for r in (0.3, 0.5, 0.7):
            rows += [dict(window=w, ratio=r, method="select_fit", queries="paper", kl=0.04),
                     dict(window=w, ratio=r, method="kvsculpt", queries="paper", kl=0.05),
                     dict(window=w, ratio=r, method="select_fit", queries="dense", kl=0.01)]
        rows.append(dict(window=w, ratio=0.3, method="kvsculpt", queries="dense", kl=0.008 if w == 0 else 0.02))
    table = pd.DataFrame(rows).assign(train=float("nan"), heldout=float("nan"))
    text = page.dense_text(table)
    assert "KVSculpt trained on them gains 2.86× at r = 0.3," in text, text
    assert "lower KL on 1 of 2 (window, ratio) runs" in text, text
