"""Chapters re-rendered from their committed tables: the table as git holds it, and its origin."""
import pandas as pd
import pytest

from zipkv import book, committed

MAIN = book.REPO_ROOT / "results" / "paper" / "kvsculpt_main.csv"


def test_committed_table_is_the_file_bit_for_bit():
    table = committed.read_committed_csv(MAIN)
    assert table.equals(pd.read_csv(MAIN))
    assert table.to_csv(index=False) == MAIN.read_text()  # written back unchanged by a from_results run


def test_origin_names_the_run_that_measured_the_table():
    origin = committed.origin(MAIN)
    assert origin["table"] == "results/paper/kvsculpt_main.csv"
    assert len(origin["table_commit"]) == 12 and origin["table_committed"]
    assert "H200" in origin["run_device"] and origin["run_date"]  # the GPU run, not a later re-rendering


def test_uncommitted_table_is_a_clear_error(tmp_path):
    stray = book.REPO_ROOT / "results" / "paper" / "not_a_committed_table.csv"
    with pytest.raises(ValueError, match="not committed at HEAD"):
        committed.read_committed_csv(stray)


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
