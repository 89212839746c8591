"""The escape-format chapter's module: its run's round trips, summary, verdict, figure and layout texts on
synthetic captures (the survey itself: tests/test_format_escape.py)."""
from types import SimpleNamespace

import matplotlib
import pandas as pd
import pytest
import torch

from zipkv import escape as E
from zipkv.study.chapters import escape as chapter
from zipkv.study.settings import PROJECT_TARGETS

matplotlib.use("Agg")


def _kv(seed, tokens, d, tail):
    """bf16 [2, tokens, d]; ``tail`` 0: magnitudes in [1, 2) (every block fits ZipFusion's window), else a
    log-normal spread of that width (tiny values: escapes)."""
    g = torch.Generator().manual_seed(seed)
    if tail == 0:
        return (torch.sign(torch.randn(2, tokens, d, generator=g)) * (1 + torch.rand(2, tokens, d, generator=g))).to(
            torch.bfloat16)
    x = torch.randn(2, tokens, d, generator=g) * torch.exp(tail * torch.randn(2, tokens, d, generator=g))
    return x.to(torch.bfloat16)


def _table(tail_k=1.5, tail_v=0):
    """The chapter's table for two toy models: survey rows joined with their round trips, as ``run`` makes it."""
    tables = []
    for model, d in (("SmolLM2-135M-Instruct", 64), ("gemma-3-270m-q4_k_m", 256)):
        captures = [SimpleNamespace(layers=[SimpleNamespace(keys=_kv(10 * w + i, 37, d, tail_k),
                                                            values=_kv(100 + 10 * w + i, 37, d, tail_v))
                                            for i in range(2)]) for w in range(2)]
        t = E.survey(captures, model=model)
        tables.append(t.merge(chapter.round_trips(captures), on=["window", "layer", "tensor"]).assign(context=37))
    return pd.concat(tables, ignore_index=True)


def test_round_trips_are_exact_and_pack_leaves_raw_the_blocks_the_survey_counts():
    table = _table()
    assert table.round_trip_exact.all()
    s = chapter.summary(table)
    assert list(s.index) == [("SmolLM2-135M", "keys"), ("SmolLM2-135M", "values"), ("Gemma-3-270M", "keys"),
                             ("Gemma-3-270M", "values")]
    assert s["packed = counted (blocks raw)"].all()
    assert (s["read back bit for bit (layers × windows)"] == "4 of 4").all()
    shares = s[["blocks with 0", "with 1", "with 2", "with 3 or more"]].sum(axis=1)
    assert shares.to_numpy() == pytest.approx(1.0)
    assert (s["unbounded list (bits/value)"] >= 12).all() and (s["ZipFusion (bits/value)"] <= 16.1).all()


def test_the_stored_format_is_the_list_sized_per_page():
    table = _table()
    stored = chapter._default_area(table)
    assert set(stored.capacity) == {E.PAGE_CAPACITY} and len(stored) == 16
    free = table[(table.layout == chapter.FORMAT) & (table.anchor == chapter.ANCHOR) & (table.capacity == 0)]
    # no block of the toy data needs more than 127 escapes: the stored list is the unbounded one
    assert stored.bits.sum() == free.bits.sum() and stored.raw_blocks.sum() == 0


@pytest.mark.parametrize("tail_k, kind", [(0, "tip"), (3.0, "warning")])
def test_the_verdict_follows_the_numbers_against_the_target(tail_k, kind):
    table = _table(tail_k=tail_k)
    text, got = chapter.verdict(table, 37)
    s = chapter.summary(table)
    over = s["escape format (bits/value)"] > PROJECT_TARGETS.escape_bits_per_value
    assert got == ("warning" if over.any() else "tip") == kind
    assert "2 PG19 windows of 37 tokens" in text and "read back bit for bit" in text
    assert f"{s.loc[('Gemma-3-270M', 'keys'), 'escape format (bits/value)']:.2f}" in text
    assert ("miss it by" in text) == over.any()
    assert ("no fixed area reaches" in chapter.layouts_text(table)) == (
        chapter.layouts(table).loc["escape+zero, top anchor, 1 per block"] > PROJECT_TARGETS.escape_bits_per_value
    ).any()


def test_a_failed_round_trip_turns_the_verdict():
    table = _table(tail_k=0).copy()
    table.loc[0, "round_trip_exact"] = False
    text, kind = chapter.verdict(table, 37)
    assert kind == "warning" and "did not read back bit for bit" in text


def test_figure_and_tables_render():
    table = _table()
    fig = chapter.figure(table)
    assert [ax.get_xlabel() for ax in fig.axes] == ["stored bits per value (metadata and list included)",
                                                    "blocks by escapes they need (% of blocks)"]
    layouts = chapter.layouts(table)
    assert "ZipFusion's format" in layouts.index and layouts.shape[1] == 4
    assert chapter.shown(table).shape[0] == 4


def test_model_names_are_checked_and_passed_on():
    assert chapter.model_source(None) is None and chapter.model_source("some/model") == "some/model"
    with pytest.raises(TypeError, match="model_names must be a non-empty list"):
        chapter.run("gemma-3-270m", n_windows=1, context=16)


def _latency(esc_speedup, exact="True", commit="new"):
    """A latency side table of two runs: an older one, then the one the chapter shows (``commit``)."""
    rows = []
    for run, speed in (("old", 0.2), (commit, esc_speedup)):
        for method, us, by in (("flashinfer_tc", 700.0, 2.15e9), ("zipkv_zipfusion", 550.0, 1.70e9),
                               ("zipkv_escape", 700.0 / speed, 1.64e9), ("pack_escape_token", 600.0, 1.07e9),
                               ("pack_zipfusion_token", 600.0, 1.07e9)):
            rows.append(dict(ctx=8192, batch=64, method=method, latency_us=us, bytes_read=by, commit=run,
                             speedup_vs_flashinfer_tc=700.0 / us, tbps=2.5 if "escape" in method else 1.7,
                             equal_raw_bits=exact if method == "zipkv_escape" else None, device="GPU X"))
    return pd.DataFrame(rows)


@pytest.mark.parametrize("speed,met", [(1.35, True), (0.24, False)])
def test_the_kernel_section_shows_the_latest_run_against_its_targets(speed, met):
    lat = _latency(speed)
    text = chapter.kernel_text(lat)
    assert f"**{speed:.2f}× FlashInfer's tensor-core decode**" in text and "GPU X" in text
    kernel = text.split("Packing")[0]
    assert ("(met)." in kernel) == met and ("short)." in kernel) == (not met)
    assert "bit for bit" in text and "2.50 TB/s in the escape format" in text
    table = chapter.kernel_table(lat)
    assert list(table.index) == ["8,192 × 64"] and table.iloc[0]["escape format vs FlashInfer"] == f"{speed:.2f}×"
    assert "differs" in chapter.kernel_text(_latency(speed, exact="False"))
    assert "no run is committed" in chapter.kernel_text(None)


def test_the_capacity_sentence_reads_the_side_table():
    cap = pd.DataFrame([dict(block_format="zipfusion", max_batch=57, bits_per_value=12.6),
                        dict(block_format="escape", max_batch=PROJECT_TARGETS.escape_max_batch - 1, bits_per_value=12.06)])
    text = chapter.capacity_text(cap)
    assert f"**{PROJECT_TARGETS.escape_max_batch - 1} requests**" in text and "missed by 1" in text
    assert "none is committed" in chapter.capacity_text(None)


def test_the_capacity_sentence_gives_the_engines_tokens_per_second_where_a_gpu_run_is_committed():
    cap = pd.DataFrame([dict(block_format="zipfusion", max_batch=57, bits_per_value=12.6),
                        dict(block_format="escape", max_batch=60, bits_per_value=12.06)])
    tp = pd.DataFrame([dict(block_format=f, batch=b, tokens_per_s=s, device="GPU X", timed_steps=24)
                       for f, b, s in (("raw", 46, 1000.0), ("zipfusion", 57, 1200.0), ("escape", 60, 1300.0))])
    text = chapter.capacity_text(cap, tp)
    assert "**1.30× uncompressed**" in text and "(ZipFusion's format 1.20×" in text and ", met)." in text
    assert "60 requests at 1,300 tokens/s" in text and "not measured yet" not in text
    assert "not measured yet" in chapter.capacity_text(cap)


def test_the_kernel_section_says_where_the_time_goes_from_the_compiled_resources():
    res = pd.DataFrame([dict(kernel="zipfusion", ptx_instructions=1500, registers=128),
                        dict(kernel="escape", ptx_instructions=13500, registers=218)])
    text = chapter.kernel_text(_latency(0.2), res)
    assert "13,500 instructions and 218 registers per thread against 1,500 and 128" in text and "(9.0× the code)" in text
    assert "it reads at 2.50 TB/s at the point above, ZipFusion's format at 1.70)." in text
    assert "Where the time goes" not in chapter.kernel_text(_latency(0.2))
