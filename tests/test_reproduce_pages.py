"""The pages after the results -- limitations, how to reproduce and what it cost, software and hardware: their tables
come from the executed pages' provenance and the committed results, a field no run recorded says so, and the pages
are notebooks in the book's table of contents."""
import json
import re
import subprocess

import nbformat
import numpy as np
import pandas as pd
import pytest
import yaml

from zipkv import provenance
from zipkv.study import book, findings
from zipkv.study.chapters import reproduce

REPO = book.REPO_ROOT
PAPER_RESULTS = REPO / "results" / "paper"

H200 = {"profile": "paper", "device": "NVIDIA H200 (CUDA 13.0)", "torch": "2.11.0+cu130", "triton": "3.6.0",
        "transformers": "5.17.0", "python": "3.12.3", "commit": "aaaaaaa", "date": "2026-12-01 09:00 UTC",
        "wall_time_s": 1800.0}
CPU = {"profile": "paper", "device": "CPU: AMD EPYC, 2 cores", "torch": "2.13.0+cpu", "triton": "3.6.0",
       "transformers": "5.17.0", "python": "3.11.7", "commit": "bbbbbbb", "date": "2026-12-02 10:00 UTC",
       "wall_time_s": 5.0}


def _page(root, doc, record, title):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(f"# {title}")], metadata={"zipkv": record})
    path = root / f"{doc}.ipynb"
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    source = root / "notebooks" / "part" / f"{path.stem}.ipynb"
    source.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, source)


def _book(root, pages):
    """A tiny project: ``pages`` = [(part, stem, record, title)], in the toc in that order."""
    parts = {}
    for part, stem, record, title in pages:
        _page(root, f"book/part/{stem}", record, title)
        parts.setdefault(part, []).append({"file": f"book/part/{stem}"})
    (root / "_toc.yml").write_text(yaml.safe_dump({"format": "jb-book", "root": "book/part/index", "parts": [
        {"caption": c, "chapters": files} for c, files in parts.items()]}, sort_keys=False))
    _page(root, "book/part/index", CPU, "Landing")
    return root / "_toc.yml", root / "notebooks"


def _git(root, *args):
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)


def _commit(root, message):
    _git(root, "add", ".")
    _git(root, "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", message)


def test_the_runs_are_the_pages_provenance_and_the_hours_add_up(tmp_path):
    toc, notebooks = _book(tmp_path, [("GPU part", "gpu_page", H200, "A GPU page"),
                                      ("CPU part", "cpu_page", CPU, "A CPU page")])
    runs = reproduce.runs(toc, notebooks)
    assert list(runs.stem) == ["index", "gpu_page", "cpu_page"]
    gpu = runs.set_index("stem").loc["gpu_page"]
    for key in ("device", "date", "commit", "python", "torch", "triton", "transformers"):
        assert gpu[key] == H200[key], key
    assert gpu.wall_time_s == 1800.0 and gpu.cuda == "13.0" and gpu.title == "A GPU page"
    assert gpu.flashinfer == gpu.driver == gpu.power_limit_w == reproduce.NOT_RECORDED   # this record predates them
    assert runs.set_index("stem").loc["cpu_page"].driver == reproduce.NO_GPU
    hours = reproduce.hours(runs)
    assert hours.loc["GPU part", "H200 GPU-hours"] == pytest.approx(0.5)
    assert hours.loc["total", "GPU-hours"] == pytest.approx(0.5)
    assert hours.loc["total", "CPU-hours"] == pytest.approx(10 / 3600)
    assert hours.loc["total", "time not recorded"] == 0
    text = reproduce.cost_verdict(runs, hours)
    assert "0.50 GPU-hours" in text and "1 of 3 pages" in text
    table = reproduce.commands_table(runs).set_index("page")
    assert table.loc["A GPU page", "rerun"] == "python -m zipkv book --profile paper --only gpu_page"
    assert table.loc["A GPU page", "wall time"] == "30.0 min"


def test_a_rebuilt_page_without_its_run_in_history_says_not_recorded(tmp_path):
    rebuilt = {**CPU, "results_from": {"table": "results/paper/gpu_page.csv", "run_device": H200["device"],
                                       "run_date": H200["date"], "run_commit": H200["commit"]}}
    toc, notebooks = _book(tmp_path, [("GPU part", "gpu_page", rebuilt, "A GPU page")])
    run = reproduce.runs(toc, notebooks).set_index("stem").loc["gpu_page"]
    assert run.rebuilt and not run.found
    assert run.device == H200["device"] and run.date == H200["date"] and run.commit == H200["commit"]
    assert np.isnan(run.wall_time_s) and run.python == run.torch == reproduce.NOT_RECORDED
    assert run.rendered_on == CPU["device"]
    runs = reproduce.runs(toc, notebooks)
    hours = reproduce.hours(runs)
    assert hours.loc["total", "time not recorded"] == 1 and hours.loc["total", "GPU-hours"] == 0
    assert "lower bound" in reproduce.cost_verdict(runs, hours)
    assert reproduce.commands_table(runs).set_index("page").loc["A GPU page", "wall time"] == reproduce.NOT_RECORDED


def test_a_rebuilt_page_finds_the_run_that_measured_it_in_git_history(tmp_path):
    """The GPU run is committed, then the page is rebuilt on the CPU from its table: the page's run is the GPU one,
    its versions and wall time included, and the committed view ignores an uncommitted working copy."""
    toc, notebooks = _book(tmp_path, [("GPU part", "gpu_page", H200, "A GPU page")])
    _git(tmp_path, "init", "-q")
    _commit(tmp_path, "the GPU run")
    rebuilt = {**CPU, "results_from": {"table": "results/paper/gpu_page.csv", "run_device": H200["device"],
                                       "run_date": H200["date"], "run_commit": H200["commit"]}}
    _page(tmp_path, "book/part/gpu_page", rebuilt, "A GPU page")
    _commit(tmp_path, "rebuilt on the CPU")
    _page(tmp_path, "book/part/gpu_page", {**CPU, "device": "CPU: elsewhere"}, "A GPU page")     # not committed
    for committed in (True, False):
        run = reproduce.runs(toc, notebooks, committed=committed).set_index("stem").loc["gpu_page"]
        if committed:
            assert run.rebuilt and run.found and run.wall_time_s == 1800.0 and run.python == "3.12.3"
            assert run.rendered_on == CPU["device"]
        else:
            assert run.device == "CPU: elsewhere" and not run.rebuilt


def test_a_page_rebuilt_from_another_pages_table_shares_its_run(tmp_path):
    appendix = {**CPU, "results_from": {"table": "results/paper/gpu_page.csv", "run_device": H200["device"],
                                        "run_date": H200["date"], "run_commit": H200["commit"]}}
    toc, notebooks = _book(tmp_path, [("GPU part", "gpu_page", H200, "A GPU page"),
                                      ("Appendix", "appendix_page", appendix, "Its appendix")])
    runs = reproduce.runs(toc, notebooks)
    row = runs.set_index("stem").loc["appendix_page"]
    assert row.shares == "gpu_page" and row.device == H200["device"] and row.python == H200["python"]
    hours = reproduce.hours(runs)
    assert hours.loc["total", "GPU-hours"] == pytest.approx(0.5) and hours.loc["total", "time not recorded"] == 0
    assert reproduce.commands_table(runs).set_index("page").loc["Its appendix", "wall time"] == "counted with A GPU page"


def test_gpu_fields_come_from_provenance_and_the_tables_else_not_recorded(tmp_path):
    recorded = {**H200, "flashinfer": "0.6.1", "driver": "580.1", "power_limit_w": "700.00", "sm_clock_max_mhz": "1980"}
    toc, notebooks = _book(tmp_path, [("GPU part", "new_run", recorded, "A new run"),
                                      ("GPU part", "old_run", H200, "An old run"),
                                      ("CPU part", "cpu_page", CPU, "A CPU page")])
    side = tmp_path / "results" / "paper"
    side.mkdir(parents=True)
    pd.DataFrame({"method": ["a", "b"], "sm_clock_mhz": [1830.0, 1980.0], "power_w": [600.0, 650.0],
                  "power_w_max": [640.0, 697.0], "frac_power_capped": [0.0, 0.6]}).to_csv(side / "new_run_side.csv",
                                                                                              index=False)
    runs = reproduce.runs(toc, notebooks)
    table = reproduce.software_table(runs, tmp_path).set_index("page")
    assert table.loc["A new run", "FlashInfer"] == "0.6.1" and table.loc["A new run", "driver"] == "580.1"
    assert table.loc["A new run", "power limit (W)"] == "700.00"
    assert table.loc["A new run", "SM clock while timed (MHz)"] == "1830–1980"
    assert table.loc["A new run", "share of samples at the power cap"] == "0–60 %"
    old = table.loc["An old run"]
    assert old["FlashInfer"] == old["driver"] == old["SM clock while timed (MHz)"] == reproduce.NOT_RECORDED
    assert table.loc["A CPU page", "driver"] == reproduce.NO_GPU
    text = reproduce.software_verdict(runs, table.reset_index())
    assert "1 recorded FlashInfer's version" in text and "1 recorded the driver" in text
    page = reproduce.software_markdown(table.reset_index(), runs)
    assert page.count("```{table}") == 2 and "not recorded" in page and not re.search(r"\bnan\b", page, re.IGNORECASE)


def test_provenance_records_flashinfer_and_the_gpu_fields(monkeypatch):
    record = provenance.provenance("quick")
    assert "flashinfer" in record and set(record) >= {"device", "torch", "triton", "transformers", "python"}
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.version, "cuda", "13.0")

    def smi(cmd, **kwargs):
        assert cmd[0] == "nvidia-smi" and "--query-gpu=driver_version,power.limit,clocks.max.sm" in cmd
        return subprocess.CompletedProcess(cmd, 0, stdout="580.159.04, 700.00, 1980\n", stderr="")

    monkeypatch.setattr(provenance.subprocess, "run", smi)
    assert provenance.gpu_details() == {"cuda": "13.0", "driver": "580.159.04", "power_limit_w": "700.00",
                                        "sm_clock_max_mhz": "1980"}
    monkeypatch.setattr(provenance.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 0, stdout="580.159.04, [N/A], 1980\n", stderr=""))
    assert "power_limit_w" not in provenance.gpu_details()              # unrecorded, never invented


def test_nominal_sizes_from_model_names():
    assert reproduce.nominal_size("Qwen2.5-1.5B-Instruct") == 1.5e9
    assert reproduce.nominal_size("Llama-3.1-8B") == 8e9
    assert reproduce.nominal_size("SmolLM2-135M-Instruct") == 135e6
    assert reproduce.nominal_size("gemma-3-270m-q4_k_m") == 270e6
    assert reproduce.nominal_size("no size") is None


def test_the_limits_numbers_come_from_the_committed_results(tmp_path):
    runs = reproduce.runs(REPO / "_toc.yml", REPO / "notebooks")
    table = findings.findings(PAPER_RESULTS)
    limits = reproduce.limitations(PAPER_RESULTS, runs, table)
    assert len(limits) >= 8 and limits.pages.map(len).min() >= 1
    main = table.set_index("claim").loc[findings.claim_of("KL reduction over Select+Fit, r ∈").claim]
    kvsculpt = limits.set_index("limit").loc["KVSculpt's main claim on its own model"].instead
    assert main.our_value in kvsculpt and main.paper_value in kvsculpt
    t = pd.read_csv(PAPER_RESULTS / "kvsculpt_main.csv")
    random = t[(t.ratio == 0.3) & (t.method == "random")].kl.mean()
    assert f"{random:.3g}" in kvsculpt
    docs = {**findings.chapter_docs(REPO / "_toc.yml")}
    assert all(s in docs for pages in limits.pages for s in pages), limits.pages.tolist()
    text = " ".join(limits[["limit", "not_shown", "why", "instead"]].to_numpy().ravel())
    assert not re.search(r"\b[a-z]{2,}_[a-z_]+\b|\.csv|\bbar\b|\bissue\b|nan\b", text), text
    verdict = reproduce.limitations_verdict(PAPER_RESULTS, limits, runs)
    sizes = reproduce.models(PAPER_RESULTS)
    assert f"{sizes.parameters[0] / sizes.parameters.min():.0f} to" in verdict or "times smaller" in verdict


def test_the_pages_are_thin_notebooks_in_the_toc_after_the_results():
    toc = yaml.safe_load((REPO / "_toc.yml").read_text())
    captions = [p["caption"] for p in toc["parts"]]
    files = {p["caption"]: [c["file"] for c in p["chapters"]] for p in toc["parts"]}
    part = next(c for c in captions if "book/reproduce/limitations" in files[c])
    assert files[part] == [f"book/reproduce/{s}" for s in reproduce.PAGES]
    assert captions.index(part) > captions.index("KVSculpt") and captions.index(part) < captions.index("Engineering appendix")
    docs = findings.chapter_docs(REPO / "_toc.yml")
    sources = book.notebook_sources()
    for stem in reproduce.PAGES:
        assert stem in docs and stem in sources
        declared = book.declared_parameters(sources[stem])
        assert {"from_results", "results_csv"} <= set(declared)
        nb = nbformat.read(sources[stem], as_version=4)
        code = [line for c in nb.cells if c.cell_type == "code" for line in c.source.splitlines() if line.strip()]
        assert len(code) <= 60, (stem, len(code))
        prose = " ".join(c.source for c in nb.cells if c.cell_type == "markdown")
        assert not re.search(r"\b[a-z]{2,}_[a-z_]+\b|\.csv|\bbar\b|\bissue\b", prose), stem
    for profile in ("quick", "paper"):
        assert {j.name for j in book.plan(profile, list(reproduce.PAGES))} == set(reproduce.PAGES)
    assert all(j.parameters["from_results"] for j in book.plan("paper", list(reproduce.PAGES)))


def test_the_published_pages_read_their_runs_from_provenance():
    """The committed executed pages: their tables name each page's device and versions as its provenance does."""
    runs = reproduce.runs(REPO / "_toc.yml", REPO / "notebooks", committed=True)
    for row in runs.itertuples():
        shown = subprocess.run(["git", "show", f"HEAD:{row.doc}.ipynb"], cwd=REPO, capture_output=True, text=True)
        if shown.returncode != 0:                    # a page in the working toc, not yet committed: nothing recorded
            assert row.profile == row.device == reproduce.NOT_RECORDED, row.stem
            continue
        nb = json.loads(shown.stdout)
        record = nb["metadata"]["zipkv"]
        origin = record.get("results_from")
        if origin is None:
            assert row.device == record["device"] and row.python == record["python"], row.stem
            assert row.wall_time_s == record["wall_time_s"], row.stem
        elif not row.shares:
            assert reproduce.card(row.device) == reproduce.card(origin["run_device"]), row.stem
        assert row.flashinfer == record.get("flashinfer", reproduce.NOT_RECORDED) or origin, row.stem
