"""The book pipeline: execute every notebook with papermill under a profile, record provenance,
collect each notebook's main table, and build the HTML with Jupyter Book 1.x.

Layout (relative to ``root``, the repository by default)::

    notebooks/<part>/<name>.ipynb   source notebooks (first code cell tagged ``parameters``)
    params/<profile>.yaml           one section per notebook name: its papermill parameters
    book/<part>/<name>.ipynb        executed notebooks, read by Jupyter Book
    results/<profile>/<name>.csv    each notebook's main table
    _config.yml, _toc.yml           Jupyter Book 1.x configuration (execute_notebooks: off)
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from zipkv.provenance import SOURCE_ROOT, provenance

REPO_ROOT = SOURCE_ROOT
"""The project folder: notebooks, params, book, results (the checkout that holds the package)."""
RESULTS_PARAMETER = "results_csv"
"""Injected into every notebook: where to write its main table."""


@dataclass(frozen=True)
class NotebookJob:
    name: str
    source: Path
    executed: Path
    results_csv: Path
    parameters: dict
    device: str | None = None
    """The notebook's ``device`` parameter (the profile's value, else its default), if it has one."""


class NotebookFailed(RuntimeError):
    """A notebook raised: carries the notebook's name and the failing cell's error."""


def profiles(root: Path = REPO_ROOT) -> list[str]:
    """The profile names under ``root/params`` (``params/<profile>.yaml``)."""
    return sorted(p.stem for p in (root / "params").glob("*.yaml"))


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader refusing a mapping that names a key twice (PyYAML keeps the last silently). Merge keys
    (``<<: *anchor``) still merge: the keys a mapping writes itself override the merged ones, as YAML says."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"duplicate key {key!r} (first at line {seen[key] + 1})", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load_profile(profile: str, root: Path = REPO_ROOT) -> dict:
    """``params/<profile>.yaml`` as {notebook name: {parameter: value}}; a malformed file is a
    ``ValueError`` naming it."""
    path = root / "params" / f"{profile}.yaml"
    if not isinstance(profile, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", profile) or not path.is_file():
        raise ValueError(f"unknown profile {profile!r}: expected one of {profiles(root)} (files in {root / 'params'})")
    expected = "expected a mapping of notebook names to mappings of parameters"
    try:
        settings = yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ValueError(f"{path} is not valid YAML{line} ({problem}): {expected}") from None
    if not isinstance(settings, dict):
        raise ValueError(f"{path} holds a YAML {type(settings).__name__}: {expected}")
    for name, section in settings.items():
        if section is not None and not isinstance(section, dict):
            raise ValueError(f"{path}: section {name!r} is {section!r}: {expected} (e.g. '{name}:\\n  context: 1024')")
    return settings


def notebook_sources(root: Path = REPO_ROOT) -> dict[str, Path]:
    """Notebook name (file stem) → source path, for every notebook under ``notebooks/``."""
    sources = {}
    for path in sorted((root / "notebooks").rglob("*.ipynb")):
        if ".ipynb_checkpoints" in path.parts:
            continue
        if path.stem in sources:
            raise ValueError(f"two notebooks are named {path.stem!r}: {sources[path.stem]} and {path}")
        sources[path.stem] = path
    return sources


def declared_parameters(source: Path) -> dict:
    """The names declared in a notebook's ``parameters`` cell (which must be its first code cell)."""
    import nbformat
    import papermill

    nb = nbformat.read(source, as_version=4)
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    if not code_cells or "parameters" not in code_cells[0].metadata.get("tags", []):
        raise ValueError(f"notebook {source.name}: its first code cell must be tagged 'parameters'")
    declared = papermill.inspect_notebook(str(source))
    # papermill skips (with only a log warning) an assignment it cannot parse, e.g. one whose
    # comment holds "=": the parameter would then be rejected later as unknown. Say so here.
    for line in code_cells[0].source.splitlines():
        name = re.match(r"^([A-Za-z_]\w*)\s*=", line)
        if name and name.group(1) not in declared:
            raise ValueError(f"notebook {source.name}: papermill cannot parse the parameter line {line!r} "
                             "(keep '=' out of its comment)")
    return declared


FROM_RESULTS = "from_results"
"""The parameter of a chapter that can be re-rendered from its committed results table (:mod:`zipkv.study.committed`)."""


def plan(profile: str, only: list[str] | None = None, root: Path = REPO_ROOT, *,
         from_results: bool = False) -> list[NotebookJob]:
    """Check the profile against the notebooks and return what to run, before running anything.

    from_results: render the chapters that declare :data:`FROM_RESULTS` from their committed tables, on the CPU
    (``from_results = True``, ``device = "cpu"``): all of them, or those of ``only``, which must all declare it."""
    settings = load_profile(profile, root)
    sources = notebook_sources(root)
    unknown_sections = sorted(set(settings) - set(sources))
    if unknown_sections:
        raise ValueError(f"params/{profile}.yaml has sections {unknown_sections} that name no notebook; "
                         f"notebooks are {sorted(sources)}")
    names = list(sources)
    if only:
        missing = [n for n in only if n not in sources]
        if missing:
            raise ValueError(f"--only {missing}: no such notebook; expected names from {sorted(sources)}")
        names = [n for n in names if n in only]
    if from_results:
        cannot = [n for n in names if FROM_RESULTS not in declared_parameters(sources[n])]
        if only and cannot:
            raise ValueError(f"--from-results: {cannot} cannot be rendered from committed results (no "
                             f"{FROM_RESULTS!r} parameter); those that can: "
                             f"{sorted(n for n, s in sources.items() if FROM_RESULTS in declared_parameters(s))}")
        names = [n for n in names if n not in cannot]
    jobs = []
    for name in names:
        source = sources[name]
        declared = declared_parameters(source)
        given = dict(settings.get(name) or {})
        unknown = sorted(set(given) - set(declared))
        if unknown:
            raise ValueError(f"notebook {name!r} has no parameter(s) {unknown} (given in params/{profile}.yaml); "
                             f"it declares {sorted(declared)}")
        if from_results:
            given[FROM_RESULTS] = True
            if "device" in declared:
                given["device"] = "cpu"
        if RESULTS_PARAMETER not in declared:
            raise ValueError(f"notebook {name!r} must declare the parameter {RESULTS_PARAMETER!r} "
                             "(where it saves its main table)")
        part = source.parent.relative_to(root / "notebooks")
        results_csv = root / "results" / profile / f"{name}.csv"
        # Relative to the notebook's working directory (its own folder), so the executed copy reads well.
        given[RESULTS_PARAMETER] = os.path.relpath(results_csv, source.parent)
        jobs.append(NotebookJob(name, source, root / "book" / part / source.name, results_csv, given,
                                {**declared_defaults(declared), **given}.get("device")))
    return jobs


def preflight(jobs: list[NotebookJob], profile: str, root: Path = REPO_ROOT, *, force: bool = False) -> None:
    """Refuse, in one line and before anything runs, a notebook whose parameters say ``device: cuda``
    on a machine without a CUDA GPU, and replacing an executed notebook in ``book/`` that another
    profile made (unless ``force``)."""
    _check_devices(jobs, profile)
    if not force:
        _check_overwrites(jobs, profile, Path(root))


def declared_defaults(declared: dict) -> dict:
    """The default values of a notebook's parameters, where papermill can read them as literals."""
    import ast

    values = {}
    for name, info in declared.items():
        try:
            values[name] = ast.literal_eval(info["default"])
        except (ValueError, SyntaxError, KeyError, TypeError):
            pass
    return values


def cuda_available() -> bool:
    """Whether this process sees a CUDA GPU (a function, so tests can stand in for a GPU machine)."""
    import torch

    return torch.cuda.is_available()


def _check_devices(jobs: list[NotebookJob], profile: str) -> None:
    gpu_only = [j.name for j in jobs if str(j.device or "").startswith("cuda")]
    if gpu_only and not cuda_available():
        which = f"notebook {gpu_only[0]}" if len(gpu_only) == 1 else f"notebooks {', '.join(gpu_only)}"
        instead = "use --profile quick" if profile != "quick" else f"set device: cpu in params/{profile}.yaml"
        raise ValueError(f"{which} (--profile {profile}, device: cuda) {'needs' if len(gpu_only) == 1 else 'need'} "
                         f"a CUDA GPU, and this machine has none: run it on a GPU machine, or {instead}")


def executed_profile(executed: Path) -> str | None:
    """The profile recorded in an executed notebook's metadata (``None`` if there is none)."""
    import nbformat

    if not executed.is_file():
        return None
    try:
        return nbformat.read(executed, as_version=4).metadata.get("zipkv", {}).get("profile")
    except (OSError, ValueError):  # not a readable notebook: it records no run to keep
        return None


def _check_overwrites(jobs: list[NotebookJob], profile: str, root: Path) -> None:
    others = [(j, p) for j in jobs if (p := executed_profile(j.executed)) not in (None, profile)]
    if others:
        listed = ", ".join(f"{os.path.relpath(j.executed, root)} ({p})" for j, p in others)
        raise ValueError(f"refusing to replace notebooks executed with another profile: {listed}; pass --force "
                         f"to replace them with --profile {profile} runs (git checkout book results brings "
                         "committed ones back)")


def _parameters_used(nb) -> dict:
    """Every parameter of an executed notebook: its parameters cell's defaults, then what papermill injected."""
    import ast

    used = {}
    for cell in nb.cells:
        tags = cell.metadata.get("tags", [])
        if cell.cell_type == "code" and {"parameters", "injected-parameters"} & set(tags):
            for node in ast.parse(cell.source).body:
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    used[node.targets[0].id] = ast.get_source_segment(cell.source, node.value)
    return used


def _shows_figure(cell) -> bool:
    """Whether an executed code cell's outputs hold an image (shown directly or glued for a captioned figure)."""
    return cell.cell_type == "code" and any(
        any(k.endswith("image/png") for k in o.get("data", {})) for o in cell.get("outputs", []))


def _stamp(executed: Path, record: dict) -> None:
    """Write provenance into the notebook's metadata and as a box under the chapter's verdict and
    headline (else under its title), with the parameters the run used and, for a chapter rebuilt from
    its committed table, that table's origin; remove from the page the code cells that show nothing
    (parameters, cells whose output is removed) and fold the other code cells."""
    import ast

    import nbformat

    nb = nbformat.read(executed, as_version=4)
    used = _parameters_used(nb)
    if used.get("from_results") == "True" and "committed_csv" in used:
        from zipkv.study import committed

        # relative to the notebook's working directory: its source's folder (papermill records the source)
        source_dir = Path(nb.metadata.get("papermill", {}).get("input_path") or executed).parent
        record["results_from"] = committed.origin(source_dir / ast.literal_eval(used["committed_csv"]))
    nb.metadata["zipkv"] = record
    src = record.get("results_from")
    lines = [f"- **{k.replace('_', ' ')}**: {v}" for k, v in record.items() if k != "results_from"]
    if src:
        lines.append(f"- **rebuilt from**: `{src['table']}` as committed in {src['table_commit']} "
                     f"({src['table_committed']}), measured on {src.get('run_device', 'an unrecorded device')}"
                     + (f" on {src['run_date']} at commit {src['run_commit']}" if "run_date" in src else "")
                     + "; this page's numbers are that run's, only the rendering ran here")
    lines.append("- **parameters**: " + ", ".join(f"`{k} = {v}`" for k, v in used.items() if k != RESULTS_PARAMETER))
    title = (f"Provenance: {record['profile']} profile, measured on {src.get('run_device', '?').split(' (')[0]} "
             f"{src.get('run_date', src.get('table_committed', '?'))[:10]}, rendered on {record['device'].split(':')[0]} "
             f"{record['date'][:10]}" if src else
             f"Provenance: {record['profile']} profile, {record['device'].split(' (')[0]}, {record['date'][:10]}")
    text = f"```{{admonition}} {title}\n:class: dropdown\n" + "\n".join(lines) + "\n```"
    cell = nbformat.v4.new_markdown_cell(text, metadata={"tags": ["zipkv-provenance"]})
    nb.cells = [c for c in nb.cells if "zipkv-provenance" not in c.metadata.get("tags", [])]
    verdict = next((i for i, c in enumerate(nb.cells) if c.cell_type == "code" and any(
        str(o.get("data", {}).get("text/markdown", "")).startswith(":::{admonition}") for o in c.get("outputs", []))), None)
    at = verdict + 1 if verdict is not None else 1 if nb.cells and nb.cells[0].cell_type == "markdown" else 0
    if verdict is not None and at < len(nb.cells) and _shows_figure(nb.cells[at]):
        at += 1  # the headline figure's own cell follows the verdict's
    nb.cells.insert(at, cell)  # under the verdict and headline, else under the title
    for c in nb.cells:  # the book shows results first; code stays one click away, parameters are in the box
        tags = c.metadata.setdefault("tags", [])
        if c.cell_type != "code":
            continue
        if {"parameters", "injected-parameters", "remove-output"} & set(tags):  # nothing on the page but code
            if "remove-cell" not in tags:
                tags.append("remove-cell")
        elif "hide-input" not in tags:
            tags.append("hide-input")
    nbformat.write(nb, executed)


def _published(root: Path) -> dict[Path, bytes]:
    """Every file under ``book/`` (but its HTML build) and ``results/``: what only :func:`execute`'s moves may change."""
    return {p: p.read_bytes() for d in ("book", "results") for p in sorted((root / d).rglob("*"))
            if p.is_file() and "_build" not in p.relative_to(root).parts}


def _put_back(root: Path, before: dict[Path, bytes]) -> list[str]:
    """Restore ``book/`` and ``results/`` to ``before`` (:func:`_published`): the files a notebook wrote there
    itself, as paths relative to ``root`` (empty when it wrote none)."""
    now = _published(root)
    strays = sorted(set(now) ^ set(before) | {p for p in now.keys() & before.keys() if now[p] != before[p]})
    for path in strays:
        if path in before:
            path.write_bytes(before[path])
        else:
            path.unlink()
    return [os.path.relpath(p, root) for p in strays]


def execute(job: NotebookJob, profile: str, root: Path = REPO_ROOT) -> dict:
    """Run one notebook with papermill in a temporary folder; only when it succeeded, move the
    executed notebook into ``book/`` and the tables it wrote beside its ``results_csv`` into ``results/<profile>/``.
    A failure (or an interrupt) raises naming the failing cell and leaves ``book/`` and ``results/`` as they were
    (the failed copy stays in the temporary folder, named in the message). A notebook that wrote into ``book/`` or
    ``results/`` itself, not through its ``results_csv`` folder, fails too, and what it wrote there is put back.
    The record's ``replaced`` lists what the moves wrote, relative to ``root``."""
    before = _published(root)
    try:
        return _execute(job, profile, root, before)
    except BaseException as err:                      # a failure or Ctrl-C: nothing published changes
        strays = _put_back(root, before)
        if strays and isinstance(err, NotebookFailed):
            raise NotebookFailed(f"{err} (it also wrote {strays} itself: put back)") from None
        raise


def _execute(job: NotebookJob, profile: str, root: Path, before: dict) -> dict:
    import papermill
    from papermill.exceptions import PapermillExecutionError

    record = provenance(profile, root)  # before the run and its own outputs: the commit that runs
    scratch = Path(tempfile.mkdtemp(prefix=f"zipkv-book-{job.name}-"))
    executed, results = scratch / job.executed.name, scratch / "results"
    # The profile's other tables sit beside results_csv, as in results/<profile>/: notebooks read them
    # (a chapter built on another's table) and may write more tables there.
    if job.results_csv.parent.is_dir():
        shutil.copytree(job.results_csv.parent, results)
    results.mkdir(exist_ok=True)
    copied = {p: p.read_bytes() for p in results.rglob("*") if p.is_file()}
    results_csv = results / job.results_csv.name
    results_csv.unlink(missing_ok=True)
    parameters = {**job.parameters, RESULTS_PARAMETER: str(results_csv)}
    started = time.perf_counter()
    try:
        with _triton_interpreter_without_gpu():
            papermill.execute_notebook(str(job.source), str(executed), parameters=parameters,
                                       kernel_name="python3", progress_bar=False, cwd=str(job.source.parent))
    except PapermillExecutionError as err:
        raise NotebookFailed(f"notebook {job.name!r} failed in cell {err.exec_count}: {err.ename}: {err.evalue} "
                             f"(executed copy with the traceback: {executed}; book/ and results/ unchanged)") from None
    if not results_csv.is_file():
        raise NotebookFailed(f"notebook {job.name!r} ran but wrote no main table to its {RESULTS_PARAMETER} "
                             f"(executed copy: {executed}; book/ and results/ unchanged)")
    record["wall_time_s"] = round(time.perf_counter() - started, 1)
    strays = _put_back(root, before)
    if strays:
        raise NotebookFailed(f"notebook {job.name!r} wrote {strays} itself: a notebook writes its tables beside its "
                             f"{RESULTS_PARAMETER} (the pipeline moves them after success); put back, so book/ and "
                             f"results/ are unchanged (executed copy: {executed})")
    _relocate(executed, job)
    installed = []
    for table in sorted(p for p in results.rglob("*") if p.is_file()):   # what the run wrote or changed here
        if copied.get(table) != table.read_bytes():
            installed.append(job.results_csv.parent / table.relative_to(results))
            _install(table, installed[-1])
    _install(executed, job.executed, lambda partial: _stamp(partial, record))  # stamped beside its final place
    installed.append(job.executed)
    shutil.rmtree(scratch, ignore_errors=True)
    record["replaced"] = [os.path.relpath(p, root) for p in installed]
    return record


def _install(src: Path, dst: Path, finish=None) -> None:
    """Copy ``src`` to ``dst`` (another file system, maybe) so that ``dst`` is never half-written:
    through ``dst.partial``, which ``finish(partial)`` may still edit in place."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    partial = dst.with_name(dst.name + ".partial")
    try:
        shutil.copyfile(src, partial)
        if finish is not None:
            finish(partial)
        os.replace(partial, dst)
    finally:
        partial.unlink(missing_ok=True)


def _relocate(executed: Path, job: NotebookJob) -> None:
    """The notebook ran in a temporary folder: make its injected ``results_csv`` and papermill's record
    name the places ``job`` moves the table and the notebook to."""
    import nbformat

    nb = nbformat.read(executed, as_version=4)
    final = job.parameters[RESULTS_PARAMETER]
    ran = nb.metadata.get("papermill", {})
    scratch = ran.get("parameters", {}).get(RESULTS_PARAMETER)
    if not scratch:
        return
    for c in nb.cells:
        if "injected-parameters" in c.metadata.get("tags", []):
            c.source = c.source.replace(f'"{scratch}"', f'"{final}"').replace(repr(scratch), repr(final))
    ran["parameters"][RESULTS_PARAMETER] = final
    ran["output_path"] = str(job.executed)
    nbformat.write(nb, executed)


@contextlib.contextmanager
def _triton_interpreter_without_gpu():
    """Without a CUDA GPU, Triton kernels run only in Triton's interpreter, chosen by
    ``TRITON_INTERPRET=1`` before triton is imported: set it for the notebook kernels started here
    (unless the caller chose), and give this process its environment back afterwards."""
    if "TRITON_INTERPRET" in os.environ or cuda_available():
        yield
        return
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        os.environ.pop("TRITON_INTERPRET", None)


def build_html(root: Path = REPO_ROOT) -> Path:
    """Build the HTML with Jupyter Book 1.x into ``book/_build/html``; return its index.html."""
    command = [sys.executable, "-c", "from jupyter_book.cli.main import main; main()", "build", str(root), "--path-output", str(root / "book"),
               "--config", str(root / "_config.yml"), "--toc", str(root / "_toc.yml")]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"jupyter-book build failed (exit {done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    index = root / "book" / "_build" / "html" / "index.html"
    if not index.is_file():
        raise RuntimeError(f"jupyter-book build finished but wrote no {index}")
    return index


def build(profile: str = "quick", only: list[str] | None = None, root: Path = REPO_ROOT,
          html: bool = True, *, force: bool = False, from_results: bool = False) -> Path | None:
    """Execute the notebooks of ``profile`` (all, or those named in ``only``), then build the HTML.

    ``force`` replaces executed notebooks that another profile made (each replacement is printed);
    ``from_results`` renders the chapters that can be from their committed tables (:func:`plan`)."""
    from tqdm.auto import tqdm

    root = Path(root).resolve()
    jobs = plan(profile, only, root, from_results=from_results)
    preflight(jobs, profile, root, force=force)
    replaced = {j.name: p for j in jobs if (p := executed_profile(j.executed)) not in (None, profile)}
    written = []                                       # what this batch's earlier notebooks replaced
    with tqdm(jobs, desc=f"notebooks ({profile})", unit="notebook") as bar:
        for job in bar:
            bar.set_postfix_str(job.name)
            try:
                record = execute(job, profile, root)
            except BaseException as err:
                done = (f"; this run's earlier notebooks replaced {written}" if written
                        else "; no earlier notebook of this run replaced anything")
                if isinstance(err, NotebookFailed):
                    raise NotebookFailed(f"{err}{done}") from None
                bar.write(f"stopped in {job.name} ({type(err).__name__}): its book/ and results/ files unchanged{done}")
                raise
            written += record["replaced"]
            was = f" (replaced the {replaced[job.name]}-profile run)" if job.name in replaced else ""
            bar.write(f"{job.name}: {record['wall_time_s']} s on {record['device']}{was}")
    return build_html(root) if html else None
