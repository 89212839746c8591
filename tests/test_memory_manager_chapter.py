"""The memory manager chapter's modules on hand-made tables (the serving itself: tests/test_serving.py): the steps
table, the verdict's branches, the ablation table's units, the findings row, and the table of contents' design page
left out of the chapters the book's checks open."""
from pathlib import Path

import matplotlib
import pandas as pd

from zipkv.serving import ServeResult
from zipkv.study import findings
from zipkv.study.chapters import memory_manager as chapter
from zipkv.study.experiments import memory_manager as experiment

matplotlib.use("Agg")
REPO = Path(__file__).resolve().parents[1]
VARIANTS = list(experiment.VARIANTS)


def _ablation(reassigned=3, batches=(4, 5, 5, 4), tokens=(900.0, 1000.0, 1010.0, 950.0)):
    rows = [dict(variant=v, rate=1000.0, requests=40, duration_s=0.1, output_tokens=1338, tokens_per_s=t,
                 requests_per_s=400.0, max_batch=b, queue_median_s=0.01, queue_p99_s=0.03, ttft_median_s=0.012,
                 ttft_p99_s=0.031, tpot_median_s=2e-4, tpot_p99_s=3e-4, retractions=1,
                 chunks_reassigned=reassigned if v == "shared pool" else 0, model="SmolLM2-135M", device="cpu",
                 clock="simulated", prompt_lengths_min=64, prompt_lengths_max=192, output_lengths_min=16,
                 output_lengths_max=48, chunks=240) for v, b, t in zip(VARIANTS, batches, tokens)]
    return pd.DataFrame(rows)


def _result(reassigned_at=(2, 4)):
    steps = [dict(time=1e-3 * i, batch=1 + i % 3, used_bytes=[1000 * (i + 1), 900 * (i + 1), 1100 * (i + 1)],
                  chunks_free=max(0, 5 - i), chunks_held=0, reassigned=sum(i >= s for s in reassigned_at),
                  retracted=int(i >= 3), waiting=max(0, 3 - i)) for i in range(6)]
    return ServeResult([], [], steps, {}, "simulated")


def test_steps_table_has_one_row_per_step_and_a_column_per_layer(tmp_path):
    t = experiment.steps_table(_result())
    assert len(t) == 6 and [c for c in t if c.startswith("used_bytes_")] == ["used_bytes_0", "used_bytes_1",
                                                                               "used_bytes_2"]
    written = experiment.save(dict(ablation=_ablation(), timeline=_result(), curve=pd.DataFrame()),
                              tmp_path / "memory_manager.csv")
    assert (tmp_path / "memory_manager_steps.csv").is_file() and not (tmp_path / "memory_manager_curve.csv").exists()
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "memory_manager_steps.csv"), written["steps"],
                                  check_dtype=False)


def test_verdict_counts_reassignments_and_says_why_when_there_are_none():
    steps = experiment.steps_table(_result())
    text, kind = chapter.verdict(_ablation(), pd.DataFrame(), steps)
    assert kind == "tip" and "**2** chunks" in text and "2 of 6 decode steps" in text and "**5**" in text
    none = experiment.steps_table(_result(reassigned_at=()))
    text, kind = chapter.verdict(_ablation(reassigned=0), pd.DataFrame(), none)
    assert kind == "warning" and "No chunk moved" in text and "ran out" in text
    f = chapter.reassignment_facts(steps, dict(chunks=240))
    assert f == dict(reassigned=2, first_ms=2.0, steps_with=2, least_free=0, chunks=240, steps=6)
    assert abs(chapter.layer_spread(steps) - 200 / 1100) < 1e-12


def test_shared_pool_behind_per_layer_pools_is_a_warning():
    text, kind = chapter.verdict(_ablation(batches=(4, 5, 4, 4)), pd.DataFrame(), experiment.steps_table(_result()))
    assert kind == "warning"


def test_ablation_table_shows_times_in_ms_and_rates_as_they_are():
    t = chapter.ablation_table(_ablation())
    assert list(t["output tokens/s"]) == [900.0, 1000.0, 1010.0, 950.0]
    assert list(t["TTFT median (ms)"]) == [12.0] * 4 and list(t["TPOT p99 (ms)"]) == [0.3] * 4
    fig = chapter.plot_timeline(experiment.steps_table(_result()), "simulated")
    assert all(a.get_xlabel() or a.get_ylabel() for a in fig.axes)


def test_findings_row_reads_the_committed_table(tmp_path):
    _ablation().to_csv(tmp_path / "memory_manager.csv", index=False)
    m = findings._memory_manager(findings.Results(tmp_path))
    assert m.value is None and m.text.startswith("3 chunks reassigned between layers, 1 retraction(s)")
    assert "shared pool 5 at 1010 tokens/s" in m.text and "GPU" not in m.text
    _gpu_table().to_csv(tmp_path / "memory_manager_gpu.csv", index=False)
    m = findings._memory_manager(findings.Results(tmp_path))
    assert m.text.endswith("ZipFusion none of the rates tried (time per output token 2.5×)"), m.text


def test_the_design_page_is_in_the_toc_but_no_results_chapter():
    docs = findings.chapter_docs(REPO / "_toc.yml")
    assert docs["memory_manager"] == "book/zipfusion/memory_manager"
    assert "memory_manager_engines" not in docs and "memory_manager_engines" in (REPO / "_toc.yml").read_text()


def test_a_run_appends_each_row_as_it_is_measured(tmp_path):
    """progress_csv holds every ablation and curve row of the run, in the order measured, tagged by table: a GPU run
    cut short keeps what it had measured."""
    progress = tmp_path / "progress.csv"
    r = experiment.run(requests=2, prompt_lengths=(8, 16), output_lengths=(2, 3), rate=1000.0, rates=(1000.0, 500.0),
                       budget_requests=3, variants=["uncompressed", "shared pool"], progress_csv=progress)
    kept = pd.read_csv(progress)
    assert kept.table.tolist() == ["ablation"] * 2 + ["curve"] * 4
    for table, frame, key in (("ablation", r["ablation"], "variant"), ("curve", r["curve"], "method")):
        got = kept[kept.table == table].reset_index(drop=True)
        assert got[key].tolist() == frame[key].tolist()
        assert got.tokens_per_s.tolist() == frame.tokens_per_s.tolist() and got.rate.tolist() == frame.rate.tolist()
    assert set(kept.requests) == {2} and set(kept.prompt_lengths_max) == {16} and set(kept.clock) == {"simulated"}
    assert set(kept.device) == {"cpu"} and kept.commit.notna().all() and kept.date.notna().all()
    assert r["ablation"]["rate"].tolist() == [1000.0, 1000.0]     # the setting's rate never overwrites a row's


def _gpu_table(zipfusion_p99=(4.4, 12.2, 6.9)):
    base = dict(requests=24, duration_s=20.0, output_tokens=3369, requests_per_s=1.0, queue_median_s=0.01,
                queue_p99_s=0.1, ttft_median_s=0.1, tpot_p99_s=0.02, retractions=0, chunks_reassigned=0,
                model="llama3.1-8b", device="NVIDIA H100 80GB HBM3 (CUDA 13.0)", clock="wall", commit="abc1234",
                prompt_lengths_min=2048, prompt_lengths_max=16384, output_lengths_min=64, output_lengths_max=256,
                budget_requests=16, pages_per_chunk=16, reserve_ratio=0.5, ttft_limit_s=2.0, seed=0)
    rows = [dict(base, table="curve", run="curve", method="uncompressed", rate=r, ttft_p99_s=0.4, tpot_median_s=0.010,
                 tokens_per_s=100 * r, max_batch=3) for r in (1.0, 1.5, 2.5)]
    rows += [dict(base, table="curve", run="curve", method="zipfusion", rate=r, ttft_p99_s=p, tpot_median_s=0.025,
                  tokens_per_s=80 * r, max_batch=10) for r, p in zip((1.0, 1.5, 2.5), zipfusion_p99)]
    rows += [dict(base, table="ablation", run="saturated", variant=v, rate=32.0, requests=80, ttft_p99_s=40.0,
                  tpot_median_s=0.05, tokens_per_s=t, max_batch=b) for v, b, t in zip(VARIANTS, (19, 22, 22, 20),
                                                                                     (227, 154, 213, 229))]
    return pd.DataFrame(rows)


def test_gpu_section_gives_each_method_s_sustained_rate_and_the_step_time_behind_it(tmp_path):
    gpu = _gpu_table()
    g = chapter.gpu_sustained(gpu)
    assert g["ratio"] == 0.0 and g["tpot_ratio"] == 2.5 and g["zipfusion"] == "none of the rates tried"
    assert g["uncompressed"] == "every rate tried (up to 2.5 requests/s)"
    text = chapter.gpu_text(gpu)
    assert "**25.0 ms** against uncompressed's **10.0 ms** (2.5×)" in text and "shared pool **22**" in text
    one_run = _gpu_table().drop(columns="run")       # a single run's table: ablation and curve rows told by table
    assert {k: chapter.gpu_sustained(one_run)[k] for k in ("uncompressed", "zipfusion", "ratio", "tpot_ratio")} == \
        {k: g[k] for k in ("uncompressed", "zipfusion", "ratio", "tpot_ratio")}
    assert chapter.gpu_text(one_run) == chapter.gpu_text(gpu)
    later = chapter.gpu_sustained(_gpu_table(zipfusion_p99=(0.5, 1.9, 6.9)))
    assert later["zipfusion"] == "rates up to 1.5 requests/s" and later["ratio"] == 0.6
    text, kind = chapter.verdict(_ablation(), pd.DataFrame(), experiment.steps_table(_result()), None, gpu)
    assert kind == "warning" and "ZipFusion none of the rates tried: its time per output token is 2.5× higher" in text
    gpu.to_csv(tmp_path / "gpu.csv", index=False)
    assert chapter.read_table(tmp_path / "gpu.csv").equals(pd.read_csv(tmp_path / "gpu.csv"))
    assert chapter.read_table(tmp_path / "absent.csv") is None


def test_gpu_section_sets_the_engine_s_decode_step_beside_the_serving_time():
    engine = pd.DataFrame([dict(model="Llama-3.1-8B shape", context=32768, batch=1, method=m, step_ms=s)
                           for m, s in (("uncompressed", 8.5), ("zipfusion", 8.2))]
                          + [dict(model="Llama-3.1-8B shape", context=131072, batch=4, method=m, step_ms=float("nan"))
                             for m in ("uncompressed", "zipfusion")])
    assert chapter.engine_steps(engine) == {(32768, 1): (8.2, 8.5)}
    text = chapter.gpu_text(_gpu_table(), engine)
    assert "1 request of 32K tokens 8.2 ms per step compressed against 8.5 ms uncompressed" in text
    assert "does not yet split" in chapter.gpu_text(_gpu_table()) and chapter.engine_steps(None) == {}


def test_a_run_s_own_curves_are_said_when_no_gpu_run_is_committed():
    curve = pd.DataFrame([dict(method=m, rate=r, ttft_p99_s=p) for m, r, p in
                          (("uncompressed", 200, .003), ("uncompressed", 400, .012), ("zipfusion", 200, .0026),
                           ("zipfusion", 400, .009))])
    assert chapter.curve_text(curve, 0.01) == ("Of the rates tried (200, 400 requests/s), with p99 TTFT at most 10 ms, "
                                               "ZipFusion sustains 400 requests/s (2.00× uncompressed's) and "
                                               "uncompressed serving 200 requests/s.")
    text, kind = chapter.verdict(_ablation(), curve, experiment.steps_table(_result()), 0.01)
    assert text.endswith(chapter.curve_text(curve, 0.01)) and kind == "tip"
    worse = curve.assign(ttft_p99_s=[.003, .012, .02, .03])
    assert "ZipFusion sustains none of the rates tried" in chapter.curve_text(worse, 0.01)
    assert chapter.verdict(_ablation(), worse, experiment.steps_table(_result()), 0.01)[1] == "warning"
