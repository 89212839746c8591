"""Chapters re-rendered from their committed tables: the table as git holds it, and its origin."""
import pandas as pd
import pytest

from zipkv.study import book, committed
from zipkv.study.experiments import analysis

MAIN = book.REPO_ROOT / "results" / "paper" / "kvsculpt_main.csv"


def test_committed_table_is_the_file_bit_for_bit():
    table = committed.read_committed_csv(MAIN)
    assert table.equals(pd.read_csv(MAIN))
    assert table.to_csv(index=False) == MAIN.read_text()  # written back unchanged by a from_results run


def test_origin_names_the_run_that_measured_the_table():
    origin = committed.origin(MAIN)
    assert origin["table"] == "results/paper/kvsculpt_main.csv"
    assert len(origin["table_commit"]) == 12 and origin["table_committed"]
    # the GPU run that measured it (an H100 or H200), not a later re-rendering on a CPU
    assert "NVIDIA H" in origin["run_device"] and origin["run_date"]


def test_uncommitted_table_is_a_clear_error(tmp_path):
    stray = book.REPO_ROOT / "results" / "paper" / "not_a_committed_table.csv"
    with pytest.raises(ValueError, match="not committed at HEAD"):
        committed.read_committed_csv(stray)


def test_side_table_of_a_copy_outside_git_is_read_from_the_working_copy(tmp_path):
    main = tmp_path / "results" / "paper" / "chapter.csv"   # a copy of the project with no .git above it
    main.parent.mkdir(parents=True)
    pd.DataFrame({"a": [1]}).to_csv(main, index=False)
    pd.DataFrame({"b": [2.5]}).to_csv(committed.side_table(main, "task"), index=False)
    assert committed.read_committed_side(main, "task", at_head=False).b.tolist() == [2.5]
    assert committed.read_committed_side(main, "replies", at_head=False) is None
    with pytest.raises(ValueError, match="rev-parse"):   # as git holds it: there is no git here
        committed.read_committed_csv(main)


def test_table1_kvsculpt_joins_only_the_same_windows_under_the_same_evaluation():
    beyond = pd.DataFrame({"model": ["m"] * 4, "window": [0, 0, 1, 1], "ratio": [0.3] * 4,
                           "method": ["select_fit", "zipkv"] * 2, "kl": [0.05, 0.01, 0.04, 0.02],
                           "seconds": [1.0] * 4, "choice": [""] * 4})
    main = pd.DataFrame({"window": [0, 0, 2, 2], "ratio": [0.3] * 4, "method": ["select_fit", "kvsculpt"] * 2,
                         "kl": [0.05, 0.06, 0.03, 0.07], "seconds": [2.0] * 4})
    rows = committed.table1_kvsculpt(beyond, main)
    assert list(rows.columns) == list(beyond.columns)
    assert rows[["window", "method", "kl"]].values.tolist() == [[0, "kvsculpt", 0.06]]
    other = main.assign(kl=main.kl.where(main.method != "select_fit", 0.051))  # another evaluation or window
    assert committed.table1_kvsculpt(beyond, other).empty


SWEEP_CHAPTER = book.REPO_ROOT / "results" / "paper" / "kvsculpt_dampening.csv"
PAPER_SWEEP = dict(ratio=0.3, m=256, n_synthetic=128, steps=100, n_windows=5, alphas=[0.3, 0.5, 0.7, 1.0], alpha=0.5,
                   pilot_steps=60, head_pilot_steps=30, top_tokens=5, seed=0)


def test_a_budget_chapter_renders_the_committed_sweep_it_would_have_solved():
    """``from_results`` for the six budget chapters: the committed sweep's tables, and the chapter's table from them
    equals the committed one (the run that solved it wrote that table from the same sweep)."""
    sweep = analysis.committed_sweep(SWEEP_CHAPTER, **PAPER_SWEEP)
    assert sweep.runs.window.nunique() == 5 and sweep.params["solver_device"].startswith("cuda")
    table = analysis.dampening_table(sweep.runs)
    assert table.to_csv(index=False) == committed.read_committed_text(SWEEP_CHAPTER)


@pytest.mark.parametrize("change", [dict(ratio=0.5), dict(steps=60), dict(n_windows=3), dict(alphas=[0.5, 1.0])])
def test_a_budget_chapter_with_other_parameters_than_the_committed_sweep_is_an_error(change):
    name = next(iter(change))
    with pytest.raises(ValueError, match=rf"other parameters: {name}="):
        analysis.committed_sweep(SWEEP_CHAPTER, **{**PAPER_SWEEP, **change})


def test_the_optimizer_chapter_from_results_checks_its_layers_and_windows():
    args = dict(from_results=True, committed_csv=book.REPO_ROOT / "results" / "paper" / "kvsculpt_optimizer.csv",
                model_name=None, books_dir=None, n_windows=5, context=2048, continuation=128, m=256, n_synthetic=128,
                steps=100, seed=0, device="cpu", layers=[2, 15, 28], ratio=0.3, adam_lr=0.01, restarts=100,
                oracle_windows=1)
    table, kl, note = analysis.optimizer_chapter(**args)
    assert set(table.optimizer) == {"adam", "lbfgs", "oracle"} and "5 windows of N = 2048" in note
    assert kl is None or set(kl.optimizer) == {"adam", "lbfgs"}      # None until a run commits §5.2's side table
    with pytest.raises(ValueError, match="the chapter asks for"):
        analysis.optimizer_chapter(**{**args, "layers": [2, 14, 26]})
