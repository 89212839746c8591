"""The book pipeline: profile and parameter checks, failures that name the notebook, and the
published book opened in a real (headless Chromium) browser."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from zipkv.provenance import git_commit
from zipkv.study import book

REPO = book.REPO_ROOT
ARTIFACTS = REPO / "test-artifacts"


def _tiny_root(tmp_path, cells, params_yaml="tiny:\n  x: 2\n"):
    root = tmp_path / "root"
    (root / "notebooks" / "part").mkdir(parents=True)
    (root / "params").mkdir()
    (root / "params" / "quick.yaml").write_text(params_yaml)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Tiny"),
                                         nbformat.v4.new_code_cell("x = 1\nresults_csv = None", metadata={"tags": ["parameters"]}),
                                         *[nbformat.v4.new_code_cell(c) for c in cells]],
                                  metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    nbformat.write(nb, root / "notebooks" / "part" / "tiny.ipynb")
    return root


def test_every_notebook_declares_parameters_and_results_csv():
    sources = book.notebook_sources()
    assert sources, "the book has notebooks"
    for name, path in sources.items():
        declared = book.declared_parameters(path)  # raises unless the first code cell is tagged
        assert book.RESULTS_PARAMETER in declared, name


def test_every_profile_matches_the_notebooks():
    for profile in book.profiles():
        jobs = book.plan(profile)
        assert {j.name for j in jobs} == set(book.notebook_sources())


def test_unknown_profile_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown profile 'nope': expected one of \['paper', 'quick'\]"):
        book.plan("nope")


def test_unknown_notebook_parameter_is_a_clear_error(tmp_path):
    root = _tiny_root(tmp_path, [], params_yaml="tiny:\n  y: 2\n")
    with pytest.raises(ValueError, match=r"notebook 'tiny' has no parameter\(s\) \['y'\]"):
        book.plan("quick", root=root)


def test_unknown_only_name_is_a_clear_error():
    with pytest.raises(ValueError, match="no such notebook"):
        book.plan("quick", only=["not_a_notebook"])


def test_failing_notebook_names_itself_and_the_cell(tmp_path):
    root = _tiny_root(tmp_path, ["raise RuntimeError('boom from the tiny notebook')"])
    with pytest.raises(book.NotebookFailed, match=r"notebook 'tiny' failed in cell \d+: RuntimeError: boom"):
        book.build("quick", root=root, html=False)


@pytest.mark.parametrize("profile", ["../params/quick", "quick/../quick", "/tmp/quick", ""])
def test_a_profile_is_a_name_in_params_not_a_path(profile):
    with pytest.raises(ValueError, match="unknown profile"):
        book.plan(profile)


@pytest.mark.parametrize("argv, says", [
    (["--html-only", "--no-html"], "argument --no-html: not allowed with argument --html-only"),
    (["--html-only", "--force", "--only", "findings"], "--html-only builds the HTML from book/ as it is and runs no "
                                                       "notebook: --only, --force would be ignored"),
    (["--html-only", "--profile", "paper"], "--profile would be ignored"),
])
def test_contradictory_book_options_are_refused_before_anything_runs(argv, says):
    done = subprocess.run([sys.executable, "-m", "zipkv", "book", *argv], capture_output=True, text=True)
    assert done.returncode == 2 and says in done.stderr and not done.stdout, done.stderr


def test_cli_exit_code_and_message(tmp_path):
    done = subprocess.run([sys.executable, "-m", "zipkv", "book", "--profile", "nope"], capture_output=True, text=True)
    assert done.returncode == 1 and "unknown profile 'nope'" in done.stderr


def test_notebook_gets_parameters_results_and_provenance(tmp_path):
    root = _tiny_root(tmp_path, ["import pandas as pd\npd.DataFrame({'x': [x]}).to_csv(results_csv, index=False)"])
    book.build("quick", root=root, html=False)
    executed = nbformat.read(root / "book" / "part" / "tiny.ipynb", as_version=4)
    record = executed.metadata["zipkv"]
    assert record["profile"] == "quick" and record["device"] and record["commit"] and record["wall_time_s"] >= 0
    assert "Provenance" in executed.cells[1].source
    assert (root / "results" / "quick" / "tiny.csv").read_text().splitlines() == ["x", "2"]


# --- no data lost: runs go to a temporary place; book/ and results/ change only on success ---------

@pytest.fixture(autouse=True)
def _scratch_in_tmp_path(tmp_path, monkeypatch):
    """Notebooks run in a temporary folder (a failed one stays there for reading): keep the tests' in tmp_path."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "scratch"))
    (tmp_path / "scratch").mkdir()


def _executed_by_hand(root, profile, text="published"):
    """Stand in for a committed run: an executed tiny notebook made by ``profile`` and its table."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(f"# {text}")],
                                  metadata={"zipkv": {"profile": profile}})
    (root / "book" / "part").mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, root / "book" / "part" / "tiny.ipynb")
    (root / "results" / profile).mkdir(parents=True, exist_ok=True)
    (root / "results" / profile / "tiny.csv").write_text(f"x\n{text}\n")


def _snapshot(root):
    return {p.relative_to(root): p.read_bytes() for d in ("book", "results") for p in sorted((root / d).rglob("*"))
            if p.is_file()}


def test_failing_run_leaves_book_and_results_as_they_were(tmp_path):
    root = _tiny_root(tmp_path, ["import pandas as pd\npd.DataFrame({'x': [x]}).to_csv(results_csv, index=False)",
                                 "raise RuntimeError('fails after writing its table')"])
    _executed_by_hand(root, "quick")
    before = _snapshot(root)
    with pytest.raises(book.NotebookFailed, match=r"failed in cell \d+: RuntimeError: .*book/ and results/ unchanged"):
        book.build("quick", root=root, html=False)
    assert _snapshot(root) == before


def test_refuses_to_replace_another_profiles_notebook_unless_forced(tmp_path):
    """... and, forced, runs beside the profile's other tables (reads one, writes another) like in place."""
    root = _tiny_root(tmp_path, ["import pandas as pd\nfrom pathlib import Path\n"
                                 "y = pd.read_csv(Path(results_csv).with_name('other.csv')).y[0]\n"
                                 "pd.DataFrame({'x': [x + y]}).to_csv(results_csv, index=False)\n"
                                 "pd.DataFrame({'z': [1]}).to_csv(Path(results_csv).with_name('extra.csv'), index=False)"])
    _executed_by_hand(root, "paper")
    (root / "results" / "quick").mkdir()
    (root / "results" / "quick" / "other.csv").write_text("y\n5\n")
    before = _snapshot(root)
    with pytest.raises(ValueError, match=r"refusing to replace notebooks executed with another profile: "
                                         r"book/part/tiny.ipynb \(paper\); pass --force"):
        book.preflight(book.plan("quick", root=root), "quick", root)
    done = subprocess.run([sys.executable, "-m", "zipkv", "book", "--profile", "quick", "--no-html", "--root", str(root)],
                          capture_output=True, text=True)
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "pass --force" in done.stderr, done.stderr
    assert _snapshot(root) == before
    book.build("quick", root=root, html=False, force=True)
    executed = nbformat.read(root / "book" / "part" / "tiny.ipynb", as_version=4)
    assert executed.metadata["zipkv"]["profile"] == "quick"
    injected = next(c.source for c in executed.cells if "injected-parameters" in c.metadata.get("tags", []))
    assert '"../../results/quick/tiny.csv"' in injected, injected  # the final place, not the temporary one
    assert executed.metadata["papermill"]["parameters"]["results_csv"] == "../../results/quick/tiny.csv"
    assert executed.metadata["papermill"]["output_path"] == str(root / "book" / "part" / "tiny.ipynb")
    assert (root / "results" / "quick" / "tiny.csv").read_text().splitlines() == ["x", "7"]
    assert (root / "results" / "quick" / "extra.csv").read_text().splitlines() == ["z", "1"]
    assert (root / "results" / "quick" / "other.csv").read_text() == "y\n5\n"
    assert (root / "results" / "paper" / "tiny.csv").read_bytes() == before[Path("results/paper/tiny.csv")]
    assert not list(root.rglob("*.partial"))


def test_gpu_only_profile_without_a_gpu_is_one_line_before_anything_runs(tmp_path, monkeypatch):
    root = _tiny_root(tmp_path, ["raise RuntimeError('must not run')"], params_yaml="tiny:\n  x: 3\n  device: cuda\n")
    path = root / "notebooks" / "part" / "tiny.ipynb"
    nb = nbformat.read(path, as_version=4)
    nb.cells[1].source = "x = 1\ndevice = 'cpu'\nresults_csv = None"
    nbformat.write(nb, path)
    monkeypatch.setattr(book, "cuda_available", lambda: False)
    with pytest.raises(ValueError, match=r"notebook tiny \(--profile quick, device: cuda\) needs a CUDA GPU"):
        book.build("quick", root=root, html=False)
    assert not (root / "book").exists() and not (root / "results").exists()
    monkeypatch.setattr(book, "cuda_available", lambda: True)
    assert book.plan("quick", root=root)[0].device == "cuda"
    (root / "params" / "quick.yaml").write_text("tiny:\n  x: 3\n")
    assert book.plan("quick", root=root)[0].device == "cpu"          # the notebook's default


def test_the_commit_stamp_ignores_executed_notebooks_but_not_code(tmp_path):
    """A batch's earlier chapters rewrite book/; the later ones' provenance must still name a clean commit, while a
    changed source file marks it."""
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)
    (tmp_path / "book").mkdir()
    (tmp_path / "book" / "a.ipynb").write_text("{}")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qam", "x", "--allow-empty")
    git("add", ".")
    git("-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "y")
    (tmp_path / "book" / "a.ipynb").write_text('{"changed": 1}')
    assert not git_commit(tmp_path).endswith("uncommitted changes")
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_commit(tmp_path).endswith("+uncommitted changes")


def test_from_results_renders_the_gpu_chapters_that_can_on_a_cpu(monkeypatch):
    """``--from-results``: the chapters that declare ``from_results`` get it, on the CPU, under the profile's other
    parameters (before, re-rendering meant editing params/paper.yaml); a chapter that cannot is named."""
    monkeypatch.setattr(book, "cuda_available", lambda: False)
    jobs = {j.name: j for j in book.plan("paper", from_results=True)}
    assert {"zipfusion_attention_latency", "kvsculpt_optimizer", "kvsculpt_dampening"} <= set(jobs)
    assert "zipfusion_lossless_format" not in jobs
    for job in jobs.values():
        assert job.parameters["from_results"] is True and job.device in (None, "cpu"), job
    assert jobs["model_data_kv_cache"].parameters["context"] == 2048                # the paper profile's setting
    book.preflight(list(jobs.values()), "paper", force=True)                       # no "needs a CUDA GPU"
    with pytest.raises(ValueError, match=r"--from-results: \['zipfusion_lossless_format'\] cannot be rendered"):
        book.plan("paper", ["zipfusion_lossless_format", "kvsculpt_main"], from_results=True)


def test_paper_profile_on_a_cpu_machine_is_one_line_and_leaves_git_clean():
    """The issue's bar: `python -m zipkv book --profile paper --only model_data_kv_cache` without a GPU."""
    def status():
        done = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True)
        return done.stdout if done.returncode == 0 else None

    before = status()
    done = subprocess.run([sys.executable, "-m", "zipkv", "book", "--profile", "paper", "--only", "model_data_kv_cache"],
                          capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("\n") == 1 and "needs a CUDA GPU" in done.stderr and not done.stdout, done.stderr
    assert status() == before


@pytest.mark.parametrize("text, says", [
    ("tiny:\n  x: [1, 2\n", r"is not valid YAML at line \d+"),
    ("- tiny\n", "holds a YAML list"),
    ("tiny: 3\n", r"section 'tiny' is 3"),
    ("tiny:\n  x: 1\n  x: 2\n", r"is not valid YAML at line 3 \(duplicate key 'x' \(first at line 2\)\)"),
    ("tiny: {}\ntiny: {}\n", r"duplicate key 'tiny'"),
])
def test_malformed_params_yaml_names_the_file(tmp_path, text, says):
    root = _tiny_root(tmp_path, [], params_yaml=text)
    with pytest.raises(ValueError, match=rf"{root / 'params' / 'quick.yaml'}.*{says}"):
        book.plan("quick", root=root)


def test_yaml_merge_keys_merge_and_the_sections_own_keys_win(tmp_path):
    """``params/paper.yaml`` shares settings through merge keys (``<<: *kvsculpt_paper``); the duplicate-key loader
    refused them ("could not determine a constructor for the tag 'tag:yaml.org,2002:merge'"), so every paper-profile
    run stopped on the YAML. A key given twice in one section is still refused."""
    root = _tiny_root(tmp_path, [], params_yaml="base: &b\n  x: 1\n  y: 2\ntiny:\n  <<: *b\n  x: 3\n")
    assert book.load_profile("quick", root) == {"base": {"x": 1, "y": 2}, "tiny": {"x": 3, "y": 2}}
    (root / "params" / "quick.yaml").write_text("base: &b\n  x: 1\ntiny:\n  <<: *b\n  x: 3\n  x: 4\n")
    with pytest.raises(ValueError, match=r"duplicate key 'x'"):
        book.load_profile("quick", root)
    paper = book.load_profile("paper")
    assert paper["kvsculpt_appendix"]["n_windows"] == 20 and paper["kvsculpt_appendix"]["steps"] == 100


@pytest.mark.slow
def test_quick_book_builds_and_renders_in_chromium(tmp_path):
    """Run the whole quick profile in a copy of the project, build the HTML, open it in Chromium."""
    root = tmp_path / "project"
    root.mkdir()
    for item in ("_config.yml", "_toc.yml", "book", "notebooks", "params", "results/paper"):  # findings reads results/paper
        src = REPO / item
        (shutil.copytree(src, root / item, ignore=shutil.ignore_patterns("_build")) if src.is_dir()
         else shutil.copy(src, root / item))
    index = book.build("quick", root=root, force=True)  # the copy holds the published paper-profile runs
    for job in book.plan("quick", root=root):
        record = nbformat.read(job.executed, as_version=4).metadata["zipkv"]
        assert record["profile"] == "quick", job.name
        assert job.results_csv.is_file(), job.name

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1400,2400", f"--user-data-dir={tmp_path / 'chrome'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"), options=options)
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        html = index.parent
        # The top-level index.html redirects to the root page: wait for the page each visit ends on.
        pages = {"index": (html / "index.html", "book/index.html"),
                 "model_data_kv_cache": (html / "book" / "intro" / "model_data_kv_cache.html", "model_data_kv_cache.html")}
        for name, (page, lands_on) in pages.items():
            driver.get(page.as_uri())
            WebDriverWait(driver, 30).until(lambda d: d.current_url.endswith(lands_on)
                                            and d.execute_script("return document.readyState") == "complete")
            body = WebDriverWait(driver, 30).until(lambda d: d.find_element("tag name", "body")).text
            assert "Traceback" not in body and "Error" not in driver.title, f"{name} shows an error"
            driver.save_screenshot(str(ARTIFACTS / f"book_{name}.png"))
        images = driver.execute_script(
            "return Array.from(document.images).filter(i => i.closest('.cell_output'))"
            ".map(i => [i.src, i.complete, i.naturalWidth]);")
        assert len(images) >= 2, f"the first chapter shows its figures: {images}"
        assert all(complete and width > 0 for _, complete, width in images), images
        body = driver.find_element("tag name", "body").text
        assert "Provenance" in body and "The model, the data and the KV cache" in body
    finally:
        driver.quit()


def test_unparseable_parameter_line_is_a_clear_error(tmp_path):
    root = _tiny_root(tmp_path, [])
    path = root / "notebooks" / "part" / "tiny.ipynb"
    nb = nbformat.read(path, as_version=4)
    nb.cells[1].source = "x = 1  # a comment with r = 0.3 inside\nresults_csv = None"
    nbformat.write(nb, path)
    with pytest.raises(ValueError, match="cannot parse the parameter line 'x = 1"):
        book.plan("quick", root=root)


def _chromium(tmp_path, width=1280, height=1000):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--hide-scrollbars", f"--window-size={width},{height}",
                 f"--user-data-dir={tmp_path / 'chrome'}"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"), options=options)


def _chapters() -> list[str]:
    from zipkv.study import findings

    return list(findings.chapter_docs(REPO / "_toc.yml").values())


def _toc_pages() -> tuple[list[str], set[str]]:
    """Every page of ``_toc.yml`` (the root first, hand-written pages included) and those of its appendix parts."""
    import yaml

    toc = yaml.safe_load((REPO / "_toc.yml").read_text())
    pages, appendix = [toc["root"]], set()

    def walk(node, in_appendix):
        if isinstance(node, dict):
            in_appendix = in_appendix or "appendix" in str(node.get("caption", "")).lower()
            if "file" in node:
                pages.append(node["file"])
                if in_appendix:
                    appendix.add(node["file"])
            for value in node.values():
                walk(value, in_appendix)
        elif isinstance(node, list):
            for value in node:
                walk(value, in_appendix)

    walk(toc.get("parts", toc.get("chapters", [])), False)
    return pages, appendix


# Reading bars, measured on the built HTML. Prose is what a reader reads as text on the page: the article's
# rendered text (innerText: what is shown, so folded cells and hidden code are out) without code cells, tables,
# printed outputs (<pre>), the table of contents a page lists, and the show-code toggles; headings, figure captions,
# verdict boxes and markdown a cell displays count. A word is a whitespace-separated token with a letter or a digit.
RESULT_CHAPTER_WORDS = 1500      # every page outside the appendix part, but the landing and findings pages
LANDING_WORDS = 400
FINDINGS_HEADLINE_WORDS = 600    # the findings page before its first section (the headline table's words count)

PROSE_JS = r"""
const article = document.querySelector('article.bd-article') || document.querySelector('main');
const copy = article.cloneNode(true);
const drop = '.cell_input, pre, script, style, .headerlink, .toctree-wrapper, .admonition.hide, button';
copy.querySelectorAll(drop).forEach(e => e.remove());
const headline = copy.cloneNode(true);                  // the page before its first section
headline.querySelectorAll('section section').forEach(e => e.remove());
copy.querySelectorAll('table').forEach(e => e.remove());
const words = node => {
    node.style.position = 'absolute'; node.style.left = '-20000px'; node.style.width = '900px';
    document.body.appendChild(node);
    const text = node.innerText; node.remove();
    return text.split(/\s+/).filter(w => /[A-Za-z0-9]/.test(w)).length;
};
const bare = article.cloneNode(true);                  // the page without its inline and block code
bare.querySelectorAll('code, pre').forEach(e => e.remove());
bare.style.position = 'absolute'; bare.style.left = '-20000px'; bare.style.width = '900px';
document.body.appendChild(bare);
const outsideCode = bare.innerText; bare.remove();
return {prose: words(copy), headline: words(headline),
        text: article.innerText, text_outside_code: outsideCode,
        cells: Array.from(article.querySelectorAll('td, th')).map(c => c.innerText.trim())};"""

# What no page may show: notebook and Python debris, pandas' padded floats, and this project's internal names.
SHOWN_DEBRIS = {
    "a notebook object's repr": r"<IPython|object at 0x",
    "a traceback": r"Traceback",
    "a float padded to six decimals (pandas' default)": r"(?<![\w.])-?\d+\.\d{5}0(?![\d])",
    "a Python list printed raw": r"\[(?:-?\d+(?:\.\d+)?, ){2,}-?\d+(?:\.\d+)?\]",
}
INTERNAL_NAMES = {  # what a reader never needs: the words of this project's tracker, its code and its files
    "a method id": r"\b(?:select_fit\w*|joint_opt|am_(?:highest|omp|lbfgs)|attention_(?:score|matching)|"
                   r"zipkv_\w+|probe_signal|kvsculpt_\w+)\b",
    "a module path": r"\bzipkv\.[a-z_]",
    "a file path": r"(?:\.ci/|results/|params/)|\b[\w-]+\.(?:csv|json|py|sh|yaml|ipynb)\b",
    "a code identifier": r"(?<![\w/.])[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b",
    "a call with keywords": r"\b[A-Za-z_][\w.]*\([a-z_]+=",
    "a class or constant of the code": r"\b(?:ColdTimer|[A-Z]+_[A-Z_]+)\b",
    "the tracker's words": r"(?i)\b(?:issues?|bar|device tool)\b",
}
NOTATION = {"n_s", "q_c", "head_dim"}  # the papers' symbols for synthetic queries and content queries, the head size
"""Snake-case words that are the papers' notation (or the head size's common name), not this project's code."""


FOREIGN_API_PAGES = {"memory_manager_engines"}
"""Pages that map zipkv onto other projects' code (SGLang's and vLLM's classes, fields and functions, named so that a
port finds them): there, what inline code shows is the other project's API, which the reader needs verbatim, not
this project's internals; the page's text outside code is checked like any other's."""

COMMAND = r"python -m zipkv book[^\t\n]*"
"""A command the reader types to rerun a page ("Reproduce it"): it names the page's notebook, as the command line wants,
so its words are no internal names (up to the end of its table cell or line)."""


def shown_defects(text: str, cells: list[str]) -> list[str]:
    """What a page's rendered text shows that it must not: debris, bare NaN cells, internal names (outside the
    commands that rerun a page, :data:`COMMAND`)."""
    import re

    found = [f"{what}: {m.group(0)!r}" for what, pattern in SHOWN_DEBRIS.items()
             for m in re.finditer(pattern, text)]
    found += [f"a bare {c!r} in a table" for c in cells if c in ("NaN", "nan", "<NA>", "NaT", "None")]
    text = re.sub(COMMAND, "", text)
    for what, pattern in INTERNAL_NAMES.items():
        found += [f"{what}: {m.group(0)!r} in '…{text[max(0, m.start() - 40):m.end() + 20]}…'"
                  for m in re.finditer(pattern, text) if m.group(0) not in NOTATION]
    return list(dict.fromkeys(found))


@pytest.mark.parametrize("text, says", [
    ("<IPython.core.display.Markdown object>", "repr"), ("ratio 0.200000 here", "six decimals"),
    ("runs [1686.0, 1741.6, 1742.0]", "list"), ("Select+Fit (select_fit_dense)", "method id"),
    ("see zipkv.engine", "module path"), ("the decode_tuning.json file", "file path"),
    ("this project's bar", "tracker"), ("as the issue asks", "tracker"), ("the device tool", "tracker"),
    ("the kv_data column", "code identifier"), ("Engine(overlap=True) runs", "call"),
])
def test_shown_defects_are_caught(text, says):
    assert any(says in d for d in shown_defects(text, [])), shown_defects(text, [])


@pytest.mark.parametrize("text", ["KL 0.000123 and 0.0115 at r = 0.3", "Select+Fit, n_s = N", "head_dim 64",
                                  "rerun\tpython -m zipkv book --profile paper --only kvsculpt_main\tNVIDIA H200",
                                  "error bars from the lowest", "interval [0.003, 0.0055]", "Gemma-3-270M, a Q4_K_M GGUF"])
def test_shown_defects_spare_prose(text):
    assert shown_defects(text, []) == []


AWAITING_GPU_RENDER: dict[str, tuple[str, ...]] = {}
"""Items a page still shows although its display code no longer makes them: pages measured on a GPU whose executed
notebook only a GPU run can re-render (no from-results path). Each must still be shown -- the test fails once it is
not, so that the entry goes with the re-render."""


@pytest.mark.slow
def test_published_book_every_chapter_in_chromium(tmp_path):
    """Build the HTML of the published (committed, executed) book in a copy and open every chapter at
    1280 px: figures loaded, no traceback, warning or error in an output cell, a verdict before the first
    figure, the findings page linking every chapter; a first-screen screenshot of each into test-artifacts/. Every
    page of the toc: no debris or internal name shown (:func:`shown_defects`), and the reading bars (prose words,
    :data:`PROSE_JS`; the counts into test-artifacts/book_words.txt)."""
    from selenium.webdriver.support.ui import WebDriverWait

    root = tmp_path / "project"
    root.mkdir()
    for item in ("_config.yml", "_toc.yml", "book"):
        src = REPO / item
        (shutil.copytree(src, root / item, ignore=shutil.ignore_patterns("_build")) if src.is_dir()
         else shutil.copy(src, root / item))
    html = book.build_html(root).parent
    driver = _chromium(tmp_path)
    ARTIFACTS.mkdir(exist_ok=True)
    problems = []
    pages, appendix = _toc_pages()
    chapters = _chapters()
    words = {}
    try:
        for doc in pages:                      # every page: what it shows, and its length where a bar holds
            driver.get((html / f"{doc}.html").as_uri())
            WebDriverWait(driver, 30).until(lambda d: d.execute_script("return document.readyState") == "complete")
            measured = driver.execute_script(PROSE_JS)
            shown = measured["text_outside_code" if Path(doc).name in FOREIGN_API_PAGES else "text"]
            found = [d for d in shown_defects(shown, measured["cells"])]
            pending = AWAITING_GPU_RENDER.get(Path(doc).name, ())
            problems += [f"{Path(doc).name}: {d}" for d in found if not any(f"'{p}'" in d for p in pending)]
            problems += [f"{Path(doc).name}: '{p}' is no longer shown: drop it from AWAITING_GPU_RENDER"
                         for p in pending if not any(f"'{p}'" in d for d in found)]
            words[doc] = measured["headline"] if doc.endswith("findings") else measured["prose"]
            limit = (LANDING_WORDS if doc == pages[0] else FINDINGS_HEADLINE_WORDS if doc.endswith("findings")
                     else None if doc in appendix else RESULT_CHAPTER_WORDS)
            if limit is not None and words[doc] > limit:
                problems.append(f"{Path(doc).name}: {words[doc]} words of prose, more than {limit}")
        (ARTIFACTS / "book_words.txt").write_text("".join(f"{n:6d}  {d}{'  (appendix)' if d in appendix else ''}\n"
                                                          for d, n in words.items()))
        for doc in chapters:
            name = Path(doc).name
            driver.get((html / f"{doc}.html").as_uri())
            WebDriverWait(driver, 30).until(lambda d: d.execute_script("return document.readyState") == "complete")
            WebDriverWait(driver, 30).until(lambda d: d.execute_script(
                "return Array.from(document.images).every(i => i.complete)"))
            driver.save_screenshot(str(ARTIFACTS / f"chapter_{name}.png"))
            state = driver.execute_script("""
                const outputs = Array.from(document.querySelectorAll('.cell_output'));
                const text = outputs.map(o => o.innerText).join('\\n');
                const images = Array.from(document.images).filter(i => i.closest('.cell_output'));
                const verdict = document.querySelector('.cell_output .admonition');
                const figure = document.querySelector('.cell_output img') || document.querySelector('.cell_output table');
                return {text: text, images: images.map(i => [i.src, i.naturalWidth]),
                        verdict_top: verdict ? verdict.getBoundingClientRect().top : null,
                        figure_top: figure ? figure.getBoundingClientRect().top : null,
                        headline_bottom: figure ? figure.getBoundingClientRect().bottom : null,
                        links: Array.from(document.querySelectorAll('a')).map(a => a.href)};""")
            for word in ("Traceback", "Warning", "Error"):
                if word in state["text"]:
                    problems.append(f"{name}: '{word}' in an output cell")
            if any(width == 0 for _, width in state["images"]):
                problems.append(f"{name}: an image did not load: {state['images']}")
            if name != "findings" and not state["images"]:
                problems.append(f"{name}: no figure")
            if state["verdict_top"] is None or state["figure_top"] is None or state["verdict_top"] > state["figure_top"]:
                problems.append(f"{name}: no verdict before the headline figure or table")
            else:
                screen = driver.execute_script("return window.innerHeight")
                end = state["figure_top"] + 150 if name == "findings" else state["headline_bottom"]  # a long table: its head
                if end > screen:
                    problems.append(f"{name}: the headline ends at {end:.0f} px, below the first screen ({screen} px)")
            if name == "findings":
                missing = [d for d in _chapters() if d != doc and not any(l.split("#")[0].endswith(d + ".html")
                                                                           for l in state["links"])]
                if missing:
                    problems.append(f"findings: no link to {missing}")
    finally:
        driver.quit()
    assert not problems, "\n".join(problems)


def test_a_side_table_beside_results_csv_is_moved_after_success(tmp_path):
    """A notebook writes a side table beside its results_csv (the latency chapter's pack and mix sweeps): the run's
    copy of results/<profile>/ must not put the old table back over it."""
    root = _tiny_root(tmp_path, ["import pandas as pd\nfrom pathlib import Path\n"
                                 "pd.DataFrame({'z': [x]}).to_csv(Path(results_csv).with_name('side.csv'), index=False)\n"
                                 "pd.DataFrame({'x': [x]}).to_csv(results_csv, index=False)"])
    (root / "results" / "quick").mkdir(parents=True)
    (root / "results" / "quick" / "side.csv").write_text("z\nold\n")
    book.build("quick", root=root, html=False)
    assert (root / "results" / "quick" / "side.csv").read_text().splitlines() == ["z", "2"]


STRAIGHT_INTO_RESULTS = ("import pandas as pd\n"
                         "pd.DataFrame({'z': [x]}).to_csv('../../results/quick/side.csv', index=False)\n"
                         "pd.DataFrame({'x': [x]}).to_csv(results_csv, index=False)")


def _git_root(root):
    """``root`` as a git checkout with everything committed: ``git status`` then shows what a run changed."""
    for args in (["init", "-q"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"]):
        subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)
    return root


def _git_status(root):
    return subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True,
                          check=True).stdout.split("\n")[:-1]


def test_a_notebook_writing_straight_into_results_fails_and_its_file_is_put_back(tmp_path):
    """What the latency chapter once did (a committed table replaced from a cell, bypassing the scratch folder) is
    refused: the run fails, naming what it wrote, and results/ is as it was."""
    root = _tiny_root(tmp_path, [STRAIGHT_INTO_RESULTS])
    _executed_by_hand(root, "quick")
    (root / "results" / "quick" / "side.csv").write_text("z\nold\n")
    _git_root(root)
    with pytest.raises(book.NotebookFailed, match=r"wrote \['results/quick/side.csv'\] itself.*put back"):
        book.build("quick", root=root, html=False, force=True)
    assert _git_status(root) == []


def test_a_run_interrupted_mid_notebook_changes_nothing(tmp_path):
    """Ctrl-C in the middle of a notebook that has already written into results/ itself: git status is clean."""
    import signal
    import time

    root = _tiny_root(tmp_path, [STRAIGHT_INTO_RESULTS.replace("pd.DataFrame({'x'", "import time\n"
                                                               "open('../../started', 'w').close()\n"
                                                               "time.sleep(60)\npd.DataFrame({'x'")])
    _executed_by_hand(root, "quick")
    (root / "results" / "quick" / "side.csv").write_text("z\nold\n")
    (root / ".gitignore").write_text("started\n")
    _git_root(root)
    # Under pytest-xdist the worker ignores SIGINT and a child would inherit that: give the run Python's own Ctrl-C.
    run = subprocess.Popen([sys.executable, "-m", "zipkv.study", "book", "--root", str(root), "--no-html", "--force"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "TMPDIR": str(tmp_path / "scratch")},
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while not (root / "started").exists() and time.time() < deadline and run.poll() is None:
        time.sleep(0.2)
    assert (root / "started").exists(), run.communicate()[0]
    run.send_signal(signal.SIGINT)
    out, _ = run.communicate(timeout=120)
    assert run.returncode != 0
    assert "stopped in tiny (KeyboardInterrupt): its book/ and results/ files unchanged" in out, out
    assert _git_status(root) == []


def test_a_batch_failing_in_its_second_notebook_says_what_the_first_replaced(tmp_path):
    root = _tiny_root(tmp_path, ["import pandas as pd\npd.DataFrame({'x': [x]}).to_csv(results_csv, index=False)"],
                      params_yaml="tiny:\n  x: 2\nworse: {}\n")
    shutil.copy(root / "notebooks" / "part" / "tiny.ipynb", root / "notebooks" / "part" / "worse.ipynb")
    nb = nbformat.read(root / "notebooks" / "part" / "worse.ipynb", as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("raise RuntimeError('the second notebook fails')"))
    nbformat.write(nb, root / "notebooks" / "part" / "worse.ipynb")
    _executed_by_hand(root, "quick")
    _git_root(root)
    with pytest.raises(book.NotebookFailed, match=r"notebook 'worse' failed .* this run's earlier notebooks replaced "
                                                  r"\['results/quick/tiny.csv', 'book/part/tiny.ipynb'\]"):
        book.build("quick", root=root, html=False, force=True)
    assert sorted(_git_status(root)) == [" M book/part/tiny.ipynb", " M results/quick/tiny.csv"]
