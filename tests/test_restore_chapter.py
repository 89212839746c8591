"""The restore-before-attention chapter's numbers: per-step times from the CUDA-graph replays where the GPU run
has them (host launch time varies between runs), else from the Python-launched timings."""
import pandas as pd

from zipkv.study import book
from zipkv.study.chapters import restore

TABLE = pd.read_csv(book.REPO_ROOT / "results" / "paper" / "zipfusion_restore_baselines.csv")


def test_step_times_take_the_graph_replays_when_the_run_has_them():
    steps = TABLE[TABLE.tensor == "K+V"].set_index("codec")
    t = restore.step_times(TABLE)
    assert (t.timing == "CUDA-graph replay").all()
    assert t.restore_ms["splitzip"] == steps.restore_graph_ms_per_step["splitzip"]
    assert t.step_ms["huffman"] == steps.step_graph_ms["huffman"]
    assert t.restore_ms["zipfusion"] == 0.0 and t.restore_ms["flashinfer (bf16)"] == 0.0
    text, _ = restore.verdict(TABLE)
    assert f"{steps.restore_graph_ms_per_step['splitzip']:.2f} ms" in text
    best = min(steps.step_graph_ms[["splitzip", "huffman"]])
    assert f"{best / steps.step_graph_ms['zipfusion']:.2f}× faster" in text
    assert f"{steps.restore_ms_per_step['splitzip']:.2f} ms" in restore.details(TABLE)   # the launched time, beside


def test_step_times_fall_back_to_launched_timings():
    older = TABLE.drop(columns=["step_graph_ms", "restore_graph_ms_per_step"])
    steps = older[older.tensor == "K+V"].set_index("codec")
    t = restore.step_times(older)
    assert (t.timing == "launched from Python").all()
    assert t.restore_ms["splitzip"] == steps.restore_ms_per_step["splitzip"]
    assert t.step_ms["splitzip"] == steps.step_ms["splitzip"]
    assert f"{steps.restore_ms_per_step['huffman']:.2f} ms" in restore.verdict(older)[0]
