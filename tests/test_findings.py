"""The findings scorecard: verdicts, every claim computed from the results tables, chapters that have
not landed yet lighting up when their CSVs appear, and the page following a changed CSV value."""
import re
import shutil

import nbformat
import pandas as pd
import pytest

from zipkv.study import book, findings
from zipkv.study.settings import THROUGHPUT_MMA_BASELINE_MODEL

PAPER_RESULTS = book.REPO_ROOT / "results" / "paper"

# Tables the chapters being written now will commit, with exactly their columns (synthetic values).
SYNTHETIC = {
    "zipfusion_restore_baselines": pd.DataFrame({
        "codec": ["huffman", "splitzip"], "tensor": ["K+V", "K+V"], "bits_per_value": [12.5, 13.0],
        "encode_gbps": [50.0, 80.0], "decode_gbps": [60.0, 90.0], "restore_ms_per_step": [20.0, 6.0],
        "attention_ms_per_step": [10.0, 11.0], "step_ms": [30.0, 17.0], "ctx": [2048, 2048], "batch": [32, 32]}),
    "zipfusion_throughput": pd.DataFrame({   # an older table's model name, and the mma-layout side run
        "model": ["llama3.1-8b"] * 7 + [THROUGHPUT_MMA_BASELINE_MODEL],
        "method": ["uncompressed", "uncompressed", "zipfusion", "zipfusion", "splitzip", "splitzip", "huffman",
                   "uncompressed"],
        "batch": [32, 46, 32, 57, 32, 40, 40, 46], "max_batch": [46, 46, 57, 57, 40, 40, 40, 46],
        "tokens_per_s": [1770.0, 2000.0, 2040.0, 2530.0, 800.0, 900.0, 700.0, 2050.0], "kv_budget_bytes": [1e10] * 8,
        "frac_compressed_k": [0, 0] + [0.78] * 5 + [0], "frac_compressed_v": [0, 0] + [0.92] * 5 + [0]}),
    "kvsculpt_optimizer": pd.DataFrame({   # the oracle on window 0 only (the chapter's oracle_windows = 1)
        "window": [0] * 6 + [1] * 4, "layer": [2, 2, 2, 14, 14, 14, 2, 2, 14, 14],
        "optimizer": ["adam", "lbfgs", "oracle"] * 2 + ["adam", "lbfgs"] * 2,
        "mse_train": [2e-3, 1e-4, 9.5e-5, 5e-2, 1e-3, 9.6e-4, 2e-3, 3e-4, 5e-2, 3e-3],
        "mse_heldout": [3e-3, 2e-4, 2e-4, 6e-2, 2e-3, 2e-3, 3e-3, 2e-4, 6e-2, 2e-3]}),
    "kvsculpt_queries": pd.DataFrame({
        "strategy": ["bootstrap", "uniform", "bootstrap", "uniform"], "horizon": ["near", "near", "far", "far"],
        "cosine": [0.95, 0.94, 0.70, 0.76]}),
    "kvsculpt_static_budget": pd.DataFrame({"window": [0, 1], "uniform_kl": [0.1, 0.2], "static_kl": [0.12, 0.26],
                                            "vs_uniform": [1.2, 1.3]}),
    "kvsculpt_pilot_budget": pd.DataFrame({"window": [0, 1], "uniform_kl": [0.1, 0.2], "pilot_kl": [0.05, 0.1],
                                           "vs_uniform": [0.5, 0.5]}),
    "kvsculpt_head_asymmetry": pd.DataFrame({"window": [0, 1], "mean_ratio": [5.0, 8.0], "max_ratio": [300.0, 400.0],
                                             "layer_of_max": [0, 15]}),
    "kvsculpt_head_budget": pd.DataFrame({"window": [0, 1], "per_layer_vs_uniform": [1.0, 1.5],
                                          "per_layer_head_vs_uniform": [0.9, 2.0], "uniform_kl": [0.1, 0.01],
                                          "per_layer_kl": [0.1, 0.015], "per_layer_head_kl": [0.09, 0.02]}),
    "kvsculpt_dampening": pd.DataFrame({
        "signal": ["vnorm"] * 3 + ["pilot"] * 2, "alpha": [0.0, 0.5, 1.0, 0.5, 1.0],
        "kl": [0.117, 0.088, 0.093, 0.09, 0.11], "vs_uniform": [1.0, 0.75, 0.79, 0.76, 0.97],
        "k_min": [358, 231, 140, 200, 100], "k_max": [358, 578, 880, 600, 900]}),
    "kvsculpt_error_propagation": pd.DataFrame({
        "window": [0, 1, 2], "label": ["easy", "hard", "hard"], "growth_first_to_last": [200.0, 5000.0, 900.0],
        "top5_kl_share": [0.3, 0.8, 0.95], "max_over_mean_kl": [10.0, 60.0, 90.0],
        "layer_mse_kl_correlation": [0.1, 0.2, 0.3], "kl": [0.005, 0.3, 0.1]}),
    "kvsculpt_beyond": pd.DataFrame({"model": ["smollm2"] * 8, "window": [0, 0, 1, 1] * 2, "ratio": [0.3] * 4 + [0.5] * 4,
                                     "method": ["kvsculpt", "ours", "kvsculpt", "ours", "select_fit", "zipkv"] + ["select_fit", "zipkv"],
                                     "kl": [0.06, 0.03, 0.05, 0.02, 0.04, 0.02, 0.03, 0.01],
                                     "seconds": [5.0, 7.0] * 4}),
}
# Second tables a chapter writes beside its main one (same run, same commit).
SIDE_TABLES = {
    "kvsculpt_optimizer": {"kvsculpt_optimizer_kl": pd.DataFrame({   # window 0 easy (L-BFGS KL < 0.01), window 1 hard
        "window": [0, 0, 1, 1], "optimizer": ["lbfgs", "adam"] * 2, "kl": [0.005, 0.06, 0.05, 0.1],
        "label": ["easy", "easy", "hard", "hard"]})},
    "kvsculpt_queries": {"kvsculpt_queries_stats": pd.DataFrame({
        "window": [0, 0], "layer": [0, 1], "consecutive_cosine": [0.9, 0.92], "decode_captured": [0.8, 0.84]})},
}


def _results_copy(tmp_path, extra=(), drop=()):
    root = tmp_path / "results" / "paper"
    shutil.copytree(PAPER_RESULTS, root)
    for stem in drop:  # as before that chapter's table landed
        for name in [stem, *SIDE_TABLES.get(stem, {})]:
            (root / f"{name}.csv").unlink(missing_ok=True)
    for stem in extra:
        SYNTHETIC[stem].to_csv(root / f"{stem}.csv", index=False)
        for name, table in SIDE_TABLES.get(stem, {}).items():
            table.to_csv(root / f"{name}.csv", index=False)
    return root


def test_judge():
    assert findings.judge((1.23, 1.25), (1.26, 1.31), "higher", 1.02) == "reproduced"  # 1.26 within 1.25 × 1.02
    assert findings.judge((1.23, 1.25), (1.30, 1.31), "higher", 1.02) == "exceeded"
    assert findings.judge((1.23, 1.25), (0.42, 1.31), "higher", 1.02) == "not reproduced"  # judged by its worse end
    assert findings.judge(0.75, 0.70, "lower", 1.05) == "exceeded"
    assert findings.judge(0.75, 0.77, "lower", 1.05) == "reproduced"
    assert findings.judge(0.75, 0.80, "lower", 1.05) == "not reproduced"
    assert findings.judge(220.0, 700.0, None, 3.0) == "not reproduced"
    assert findings.judge(220.0, 600.0, None, 3.0) == "reproduced"
    assert findings.judge("uniform", "bootstrap", None, 1.0) == "not reproduced"
    assert findings.judge(4.1, None, "higher", 1.05) == "not yet run"
    assert findings.judge(None, 3.0, "higher", 1.05) == findings.BEYOND


def test_columns_and_one_row_per_claim():
    table = findings.findings(PAPER_RESULTS)
    assert list(table.columns) == findings.COLUMNS == ["paper", "item", "claim", "paper_value", "our_value",
                                                       "verdict", "tolerance", "chapter"]
    assert len(table) == len(findings.CLAIMS)
    assert set(table.verdict) <= set(findings.VERDICTS)
    assert not table.our_value.str.contains("table incomplete").any(), table[table.our_value.str.contains("incomplete")]
    same = re.compile(r"(?<![\d.])(\d+(?:\.\d+)?)–\1(?![\d.])")                  # "2.2–2.2 ms" reads as one value
    same_ends = table.our_value.map(lambda text: same.search(text) is not None)
    assert not same_ends.any(), table[same_ends].our_value.tolist()


def test_committed_findings_csv_is_current():
    committed = pd.read_csv(PAPER_RESULTS / "findings.csv", keep_default_na=False)
    fresh = findings.findings(PAPER_RESULTS)
    assert committed.astype(str).equals(fresh.astype(str)), (
        "results/paper/findings.csv is stale: re-execute the findings page "
        "(python -m zipkv book --profile paper --only findings)")


def test_chapters_yet_to_land_light_up(tmp_path):
    before = findings.findings(_results_copy(tmp_path / "a", drop=SYNTHETIC))
    after = findings.findings(_results_copy(tmp_path / "b", extra=SYNTHETIC))
    for stem in SYNTHETIC:
        claims = [c for c in findings.CLAIMS if c.chapter == stem]
        assert claims, f"no findings row for the chapter {stem}"
        rows_before, rows_after = before[before.chapter == stem], after[after.chapter == stem]
        assert (rows_before.verdict == "not yet run").all(), stem
        computable = [c.ours is not None for c in claims]
        lit = (rows_after.verdict != "not yet run").tolist()
        assert lit == computable, (stem, rows_after[["claim", "our_value", "verdict"]])
        assert not rows_after.our_value.str.contains("table incomplete").any(), rows_after
    def row(claim):
        (found,) = after[after.claim.str.startswith(claim)].itertuples()
        return found
    assert (row("adaptive (pilot) allocation").our_value, row("adaptive (pilot) allocation").verdict) == (
        "2.00×", "exceeded")  # 1 / mean(0.5, 0.5)
    row = row("largest supported batch, ZipFusion over uncompressed (same memory budget")
    assert row.our_value.startswith("llama3.1-8b: 46 → 57") and row.verdict == "reproduced"


def test_each_number_is_computed_as_its_chapter_computes_it(tmp_path):
    """The statistics the chapters and the papers use: the oracle gap only on the windows the oracle ran, the
    Table 8 means as ratios of mean KLs (the paper's "Mean" row), §6's concentration on the hardest window."""
    rows = findings.findings(_results_copy(tmp_path, extra=SYNTHETIC)).set_index("claim")
    assert rows.loc["one L-BFGS run above the 100-restart oracle (gap)"].our_value == "4–5%"   # window 0's runs only
    assert rows.loc["Adam's per-layer MSE over L-BFGS's"].our_value == "10.0–25.0×"           # means over both windows
    assert rows.loc["per-layer allocation: mean KL vs uniform"].our_value == "1.05×"          # 0.0575 / 0.055
    assert rows.loc["per-layer + per-head allocation: mean KL vs uniform"].our_value == "1.00×"
    assert rows.loc["share of the KL in the top 5 of 128 tokens (hard sequence)"].our_value == "80%"  # window 1: KL 0.3
    assert rows.loc["per-token KL, max over mean (hard sequence)"].our_value == "60×"
    starting = lambda claim: rows.loc[rows.index.str.startswith(claim)].iloc[0]               # noqa: E731
    assert starting("Adam's end-to-end KL").our_value == "12.00× (1 easy window)"             # window 0 only: 0.06 / 0.005
    share = starting("decompression's share of the decode step")                          # 6 / 17 and 20 / 30
    assert (share.our_value, share.verdict) == ("35.3–66.7 % of restore + attention (2 codecs)", "not comparable")
    layer = starting("one layer is the most asymmetric")                                   # layers 0 and 15: a tie
    assert (layer.our_value, layer.verdict) == ("layer 0 on 1 of 2 windows", "not reproduced")  # paper: 4 of 5
    assert rows.loc["best query strategy at the near horizon (128 tokens)"].our_value == "bootstrap (0.950)"
    undamped = rows.loc["pilot-MSE^1 allocation (undampened): KL vs uniform"]
    assert (undamped.our_value, undamped.verdict) == ("0.97×", "reproduced")


def test_tolerances_are_shown_and_other_quantities_are_not_judged():
    table = findings.findings(PAPER_RESULTS).set_index("claim")
    assert table.loc["KL reduction over Select+Fit at r = 0.3"].tolerance == "±5 %"
    assert table.loc["hidden-state MSE growth, first to last layer, easy sequences"].tolerance == "within 3×"
    assert table.loc["easy sequences (KVSculpt KL < 0.01)"].tolerance == "exact"
    row = table.loc["the rest of the decode step beside the restore: ms per step"]
    assert (row.verdict, row.tolerance) == (findings.NOT_COMPARABLE, "")
    page = findings.markdown_table(findings.findings(PAPER_RESULTS), {})
    assert "`reproduced` (±5 %)" in page or "`not reproduced` (±5 %)" in page


def test_a_table_missing_a_column_reads_incomplete_not_wrong(tmp_path):
    root = _results_copy(tmp_path)
    SYNTHETIC["kvsculpt_pilot_budget"].drop(columns="pilot_kl").to_csv(root / "kvsculpt_pilot_budget.csv", index=False)
    row = findings.findings(root).set_index("claim").loc["pilot-MSE^0.5 allocation: mean KL vs uniform"]
    assert row.verdict == "not yet run" and "table incomplete" in row.our_value


def _findings_page(root) -> str:
    book.build("paper", only=["findings"], root=root, html=False)
    nb = nbformat.read(root / "book" / "findings" / "findings.ipynb", as_version=4)
    return "\n".join(o.get("data", {}).get("text/markdown", "") for c in nb.cells if c.cell_type == "code"
                     for o in c.get("outputs", []))


def test_the_page_follows_a_changed_csv_value(tmp_path):
    root = tmp_path / "root"
    shutil.copytree(book.REPO_ROOT / "notebooks" / "findings", root / "notebooks" / "findings")
    shutil.copy(book.REPO_ROOT / "_toc.yml", root / "_toc.yml")
    (root / "params").mkdir()
    (root / "params" / "paper.yaml").write_text("findings: {}\n")
    shutil.copytree(PAPER_RESULTS, root / "results" / "paper")
    page = _findings_page(root)
    main = pd.read_csv(root / "results" / "paper" / "kvsculpt_main.csv")
    main.loc[(main.method == "kvsculpt") & (main.ratio == 0.3), "kl"] /= 10  # KVSculpt 10× better at r = 0.3
    main.to_csv(root / "results" / "paper" / "kvsculpt_main.csv", index=False)
    changed = _findings_page(root)
    assert page != changed
    table = pd.read_csv(root / "results" / "paper" / "findings.csv")
    row = table.set_index("claim").loc["KL reduction over Select+Fit at r = 0.3"]
    assert float(row.our_value.rstrip("×")) > 5 and row.verdict == "exceeded"
    assert row.our_value in changed and row.our_value not in page


@pytest.mark.parametrize("bad", ["nope", None])
def test_bad_results_dir_is_a_clear_error(tmp_path, bad):
    with pytest.raises((ValueError, TypeError)):
        findings.findings(tmp_path / "missing" if bad else bad)



def test_every_claim_links_to_a_chapter_of_the_book():
    """The page links each row to the chapter that shows it; a row naming no chapter of ``_toc.yml`` would read
    "(no chapter yet)"."""
    docs = findings.chapter_docs(book.REPO_ROOT / "_toc.yml")
    assert sorted({c.chapter for c in findings.CLAIMS} - set(docs)) == []


def test_the_pack_row_waits_for_the_pack_table_beside_the_kernel_appendix(tmp_path):
    claim = [c for c in findings.CLAIMS if c.ours is findings._pack]
    pd.DataFrame({"shape": ["llama3.1-8b"]}).to_csv(tmp_path / "zipfusion_kernel_engineering.csv", index=False)
    assert findings.findings(tmp_path, claim).iloc[0].verdict == "not yet run"
    pd.DataFrame({"head_dim": [64, 128], "input_tbps": [2.5, 2.25]}).to_csv(
        tmp_path / "zipfusion_pack_throughput.csv", index=False)
    row = findings.findings(tmp_path, claim).iloc[0]
    assert row.verdict == findings.BEYOND and row.our_value.startswith("2.25 TB/s of input, slowest head size")


def test_the_read_identity_row_waits_for_a_gpu_run_of_the_lossless_chapter(tmp_path):
    """The row reads the lossless chapter's side table; a CPU run (reference attention only, no same-kernel
    comparison) leaves it "not yet run"; a GPU run's counts appear as they are, a changed bit included."""
    claim = [c for c in findings.CLAIMS if c.ours is findings._read_identity]
    pd.DataFrame({"layer": [0]}).to_csv(tmp_path / "zipfusion_lossless_format.csv", index=False)
    side = tmp_path / "zipfusion_lossless_identity.csv"
    reads = pd.DataFrame({"check": ["read"] * 2, "kernel": ["gluon", "triton"], "outputs": [576, 576],
                          "identical": [576, 575]})
    cpu = pd.DataFrame({"check": ["generation"], "comparison": ["uncompressed, reference attention"], "identical": [True]})
    pd.concat([reads, cpu]).to_csv(side, index=False)
    assert findings.findings(tmp_path, claim).iloc[0].verdict == "not yet run"
    gpu = pd.DataFrame({"check": ["generation"] * 3, "comparison": ["uncompressed, same kernel"] * 2 + ["uncompressed, Triton kernel"],
                        "identical": [True, True, False]})
    pd.concat([reads, gpu]).to_csv(side, index=False)
    row = findings.findings(tmp_path, claim).iloc[0]
    assert row.verdict == findings.BEYOND
    assert row.our_value == ("1,151 of 1,152 attention outputs bit-identical (Gluon, Triton); greedy tokens identical "
                             "in 2 of 2 requests")


def test_the_mma_baseline_row_waits_for_a_throughput_run_that_timed_it(tmp_path):
    """ZipFusion's tokens/s at its largest batch over the uncompressed engine in the mma layouts: "not yet run" for a
    table without those rows (the committed run before them); the ratio of the two largest-batch rows once there."""
    from zipkv.study.settings import THROUGHPUT_PAPER_MODEL

    claim = [c for c in findings.CLAIMS if c.ours is findings._vs_mma_baseline]
    fig5 = pd.DataFrame({"model": THROUGHPUT_PAPER_MODEL, "method": ["uncompressed", "zipfusion", "zipfusion"],
                         "batch": [46, 32, 57], "max_batch": [46, 57, 57], "tokens_per_s": [2600.0, 2400.0, 3250.0]})
    fig5.to_csv(tmp_path / "zipfusion_throughput.csv", index=False)
    pd.DataFrame({"method": []}).to_csv(tmp_path / "zipfusion_throughput_engineering.csv", index=False)  # its appendix page
    assert findings.findings(tmp_path, claim).iloc[0].verdict == "not yet run"
    mma = pd.DataFrame({"model": [THROUGHPUT_MMA_BASELINE_MODEL], "method": ["uncompressed"], "batch": [46],
                        "max_batch": [46], "tokens_per_s": [2650.0]})
    pd.concat([fig5, mma]).to_csv(tmp_path / "zipfusion_throughput.csv", index=False)
    row = findings.findings(tmp_path, claim).iloc[0]
    assert row.verdict == findings.BEYOND and row.our_value == "1.226× (3,250 tokens/s at batch 57 over 2,650 at batch 46)"


def test_the_run_to_run_row_waits_for_two_gpu_runs_of_the_throughput_chapter(tmp_path):
    """The throughput chapter's table of GPU runs: "not yet run" without it or with one run; with more, the range of
    the tokens/s ratio, of ZipFusion's SM clock, and in how many runs the project's bar holds."""
    claim = [c for c in findings.CLAIMS if c.ours is findings._throughput_runs]
    pd.DataFrame({"model": ["x"]}).to_csv(tmp_path / "zipfusion_throughput.csv", index=False)
    pd.DataFrame({"method": []}).to_csv(tmp_path / "zipfusion_throughput_engineering.csv", index=False)  # its appendix page
    assert findings.findings(tmp_path, claim).iloc[0].verdict == "not yet run"
    runs = pd.DataFrame({"tokens_per_s_ratio": [1.2505, 1.2068, 1.231], "zipfusion_sm_clock_mhz": [1935.0, 1830.0, 1900.0]})
    runs.iloc[:1].to_csv(tmp_path / "zipfusion_throughput_runs.csv", index=False)
    assert findings.findings(tmp_path, claim).iloc[0].verdict == "not yet run"
    runs.to_csv(tmp_path / "zipfusion_throughput_runs.csv", index=False)
    row = findings.findings(tmp_path, claim).iloc[0]
    assert row.verdict == findings.BEYOND
    assert row.our_value == ("1.207–1.250× over 3 runs (ZipFusion's SM clock 1830–1935 MHz); project target ≥ 1.25× "
                             "held in 1")


def test_the_summary_counts_the_papers_claims_only():
    """A beyond-the-paper row not yet run reads "not yet run" in the table but is no claim of the paper."""
    table = pd.DataFrame({"paper": ["ZipFusion"] * 3, "item": ["Fig. 4", "beyond", "beyond"], "claim": ["a", "b", "c"],
                          "verdict": ["reproduced", "not yet run", findings.BEYOND]})
    assert findings.summary(table) == "**ZipFusion**: of 1 claims, 1 reproduced."


def test_a_chapter_judges_its_claim_as_the_findings_page_does():
    claim = next(c for c in findings.CLAIMS if c.chapter == "kvsculpt_static_budget")
    lo = claim.paper_value
    assert findings.verdict_for("kvsculpt_static_budget", "static", lo) == "reproduced"
    assert findings.verdict_for("kvsculpt_static_budget", "static", 1.0013) == findings.judge(lo, 1.0013, None, claim.slack)
    assert findings.verdict_for("kvsculpt_static_budget", "static", 1.0013) == "not reproduced"
    with pytest.raises(ValueError, match="expected one claim"):
        findings.verdict_for("kvsculpt_static_budget", "nothing like this", 1.0)


# ---------------------------------------------------------------- the verdict rules, one test each

def test_rule_a_claim_that_a_beats_b_is_reproduced_only_if_ours_has_a_beat_b():
    """"Joint Opt marginally better than Select+Fit" (1.04×) is not reproduced by 0.99×, although 0.99 lies within
    the tolerance; 1.01× reproduces it; a range of ours must hold the direction at its worse end."""
    assert findings.judge(1.04, 0.99, None, 1.1) == "reproduced"                        # the tolerance alone
    assert findings.judge(1.04, 0.99, None, 1.1, holds=(">", 1.0)) == "not reproduced"
    assert findings.judge(1.04, 1.01, None, 1.1, holds=(">", 1.0)) == "reproduced"
    assert findings.judge(0.75, (0.74, 1.01), "lower", 1.05, holds=("<", 1.0)) == "not reproduced"
    assert findings.judge(0.258, -0.01, "higher", 10.0, holds=(">", 0.0)) == "not reproduced"   # a gain below 0
    with pytest.raises(ValueError, match="holds"):
        findings.judge(1.0, 1.0, None, 1.1, holds=("≫", 1.0))
    table = findings.findings(PAPER_RESULTS).set_index("claim")
    for start, stem in (("eviction to Joint Optimization", "kvsculpt_main"), ("Joint Opt marginally better", "kvsculpt_appendix")):
        claim = findings.claim_of(start)
        assert claim.holds == (">", 1.0), start
        kl = pd.read_csv(PAPER_RESULTS / f"{stem}.csv").groupby(["method", "ratio"]).kl.mean()
        ours = float((kl["select_fit"] / kl["joint_opt"]).mean())
        expected = "not reproduced" if ours <= 1 else findings.judge(claim.paper_value, ours, None, claim.slack)
        assert table.loc[claim.claim].verdict == expected, (start, ours)


def test_rule_exceeded_only_against_the_papers_own_baseline():
    """Beyond the paper's range on the better side: "exceeded" against the paper's own baseline, "reproduced"
    against a stand-in (this study's SplitZip-style codec) or for a property of the model, which has no better side."""
    assert findings.judge((2.61, 2.76), 3.33, "higher", 1.1) == "exceeded"
    assert findings.judge((2.61, 2.76), 3.33, "higher", 1.1, exceedable=False) == "reproduced"
    assert findings.judge(0.75, 0.5, "lower", 1.05, exceedable=False) == "reproduced"
    assert findings.judge((2.61, 2.76), 1.5, "higher", 1.1, exceedable=False) == "not reproduced"
    for start in ("tokens/s at the largest batch over the best lossless restore baseline",
                  "tokens/s at batch 32 over SplitZip", "per-layer pilot MSE varies across layers",
                  "uniform spread: attention cosine at the far horizon"):
        assert not findings.claim_of(start).exceedable, start
    assert findings.claim_of("uniform spread: attention cosine at the far horizon").better is None
    for start in ("decode attention over FlashInfer (TC), real-KV mix of compressible blocks",
                  "KL reduction over Select+Fit, r ∈ {0.3, 0.5, 0.7}"):
        assert findings.claim_of(start).exceedable, start
    table = findings.findings(PAPER_RESULTS)
    exceeded = table[table.verdict == "exceeded"]
    assert all(findings.claim_of(c).exceedable for c in exceeded.claim), exceeded.claim.tolist()


def test_rule_counts_never_count_a_claim_twice():
    """The groups name existing claims, each in one group; the counts keep each group's first row only: a claim
    reproduced on the H100 and not on the H200 counts once, as reproduced."""
    seen = {}
    for group, members in findings.CLAIM_GROUPS.items():
        assert len(members) >= 2, group
        for start in members:
            claim = findings.claim_of(start).claim
            assert claim not in seen, (claim, group, seen.get(claim))
            seen[claim] = group
    table = findings.findings(PAPER_RESULTS)
    counted = findings.counted(table)
    assert len(counted) == len(table[(table.verdict != findings.BEYOND) & (table["item"] != "beyond")]) - sum(
        len(m) - 1 for m in findings.CLAIM_GROUPS.values())
    assert not counted.claim.duplicated().any()
    card, h200 = findings.CLAIM_GROUPS["decode attention over FlashInfer, real-KV mix"]
    two = pd.DataFrame({"paper": ["ZipFusion"] * 2, "item": ["Fig. 4"] * 2, "claim": [findings.claim_of(card).claim,
                        findings.claim_of(h200).claim], "verdict": ["reproduced", "not reproduced"]})
    assert findings.summary(two) == "**ZipFusion**: of 1 claims, 1 reproduced."
    for paper, n in findings.counted(table).groupby("paper").size().items():
        assert f"**{paper}**: of {n} claims" in findings.summary(table)


def test_labels_replace_method_ids_on_the_page():
    table = findings.findings(PAPER_RESULTS)
    text = " ".join(table.claim) + " " + " ".join(table.our_value) + " " + " ".join(table.paper_value)
    assert not [m for m in findings.METHOD_LABELS if "_" in m and m in text]


# ---------------------------------------------------------------- the headline and the landing page

def _words(markdown: str) -> int:
    text = re.sub(r"\{doc\}`([^<`]*)<[^>]*>`", r"\1", markdown)       # a link reads as its text
    return len(re.findall(r"[\w%×.–-]+", re.sub(r"[|*#:-]{3,}", " ", text)))


def test_the_headline_holds_at_most_ten_claims_in_plain_words():
    table = findings.findings(PAPER_RESULTS)
    head = findings.headline(PAPER_RESULTS, table)
    assert 1 <= len(head) <= 10 and list(head.columns) == findings.HEADLINE_COLUMNS
    docs = findings.chapter_docs(book.REPO_ROOT / "_toc.yml")
    assert all(stem in docs for stems in head.chapters for stem in stems), head.chapters.tolist()
    page = findings.headline_text(table) + "\n" + findings.headline_markdown(head, docs)
    assert _words(page) <= 600, _words(page)
    shown = " ".join(head.claim) + " ".join(head.ours) + " ".join(head.verdict)
    assert not re.search(r"\b[a-z]{2,}_[a-z_]+\b|\.csv|\bbar\b|\bissue\b", shown), shown
    # the two-card row says what the scorecard's two rows say
    card, h200 = (table.set_index("claim").loc[findings.claim_of(s).claim].verdict
                  for s in findings.CLAIM_GROUPS["decode attention over FlashInfer, real-KV mix"])
    words = head.iloc[0].verdict
    assert "H100" in head.iloc[0].ours and "H200" in head.iloc[0].ours
    if card == "reproduced" and h200 == "not reproduced":
        assert words.startswith("reproduced on the paper's H100, not on the H200 (")


def test_the_headline_follows_the_results(tmp_path):
    """The H200's speedups 5 % higher: the attention row then reads reproduced on both cards."""
    root = _results_copy(tmp_path)
    t = pd.read_csv(root / "zipfusion_attention_latency.csv")
    t["speedup_vs_flashinfer_tc"] *= 1.05
    t.to_csv(root / "zipfusion_attention_latency.csv", index=False)
    before = findings.headline(PAPER_RESULTS).iloc[0]
    after = findings.headline(root).iloc[0]
    assert after.ours != before.ours
    assert after.verdict == "reproduced on the paper's H100 and on the H200"


def test_the_landing_page_opens_with_five_to_eight_computed_sentences():
    text, sentences = findings.landing(PAPER_RESULTS)
    assert 5 <= len(sentences) <= 8 and list(sentences.columns) == ["topic", "sentence"]
    assert {"attention", "throughput", "lossless", "kvsculpt", "beyond"} <= set(sentences.topic)
    nb = nbformat.read(book.REPO_ROOT / "notebooks" / "index.ipynb", as_version=4)
    prose = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    from zipkv.study.chapters import paper_card
    _, caption = paper_card.landing_figure(PAPER_RESULTS)
    assert _words(text + "\n" + caption + "\n" + prose) <= 400
    assert "computed from the committed results" in text
    head = findings.headline(PAPER_RESULTS).set_index("claim")
    speedup = head.iloc[0].ours                                  # the same numbers as the findings page's
    assert speedup.split("H100 (the paper's card): ")[1].split(";")[0] in text
