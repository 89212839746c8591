"""The reader's pages after the results: what the study does not show ("Limitations"), each chapter's command,
device and wall time with the device-hours per part ("Reproduce it"), and the software and hardware of each run
("Software and hardware").

Everything is read, never typed: the runs from the executed chapters' provenance (``metadata.zipkv``, written by
:mod:`zipkv.study.book`), the numbers from the committed results tables (through :mod:`zipkv.study.findings`). A chapter
rebuilt from its committed table (``results_from``) was measured by an earlier run of the same notebook: its record is
the latest version of the executed notebook in git's history that ran the chapter itself, on the device and at the
date (or commit) the table names. Where no such version is found, or no git checkout is at hand (a copy of the
project), that run's versions and wall time read :data:`NOT_RECORDED`.
"""
from __future__ import annotations

import io
import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd

NOT_RECORDED = "not recorded"
"""What a page shows for a field that the run's provenance does not hold."""
NO_GPU = "none (CPU run)"
"""What a page shows for a GPU field of a run on the CPU."""
PAGES = ("limitations", "reproduce", "software")
"""This part's own pages: left out of the runs they describe."""
LANDING = "Landing page"
"""The part name given to the book's root page."""
VERSIONS = {"python": "Python", "torch": "torch", "triton": "Triton", "transformers": "transformers",
            "flashinfer": "FlashInfer"}
"""Provenance key -> label of the library versions a run records."""
GPU_FIELDS = {"cuda": "CUDA", "driver": "driver", "power_limit_w": "power limit (W)",
              "sm_clock_max_mhz": "highest SM clock (MHz)"}
"""Provenance key -> label of a GPU run's fields (recorded by runs since provenance asked ``nvidia-smi``)."""
CLOCK_COLUMNS = ("sm_clock_mhz", "power_w", "power_w_max", "frac_power_capped")
"""Columns of a results table that sampled the GPU while it was timed (:mod:`zipkv.bench.power`)."""
RUN_COLUMNS = ["part", "stem", "title", "doc", "profile", "rebuilt", "found", "shares", "device", "date", "commit",
               "wall_time_s", *VERSIONS, *GPU_FIELDS, "rendered_on", "rendered_date"]


class Source:
    """The project's files, either as the working tree holds them or, with ``committed``, as git holds them at
    ``HEAD``; :meth:`history` walks a file's committed versions where ``root`` is a git checkout's top."""

    def __init__(self, root: Path, committed: bool = False):
        self.root, self.committed = Path(root).resolve(), committed
        self.git = self._is_checkout()
        if committed and not self.git:
            raise ValueError(f"from_results: {self.root} is no git checkout; render without it")

    def _run(self, *args: str) -> str | None:
        done = subprocess.run(["git", *args], cwd=self.root, capture_output=True, text=True)
        return done.stdout if done.returncode == 0 else None

    def _is_checkout(self) -> bool:
        try:
            top = self._run("rev-parse", "--show-toplevel")
        except OSError:
            return False
        return top is not None and Path(top.strip()).resolve() == self.root

    def text(self, rel: str) -> str | None:
        """The file ``rel`` (relative to the root), or None where it is not there."""
        if self.committed:
            return self._run("show", f"HEAD:{rel}")
        path = self.root / rel
        return path.read_text() if path.is_file() else None

    def files(self, folder: str) -> list[str]:
        """The files directly in ``folder`` (relative paths)."""
        if self.committed:
            listed = self._run("ls-tree", "--name-only", "HEAD", f"{folder.rstrip('/')}/") or ""
            return sorted(listed.split())
        return sorted(p.relative_to(self.root).as_posix() for p in (self.root / folder).glob("*") if p.is_file())

    def history(self, rel: str):
        """``rel``'s committed versions, newest first (nothing outside a git checkout)."""
        if not self.git:
            return
        for commit in (self._run("log", "--format=%H", "--", rel) or "").split():
            text = self._run("show", f"{commit}:{rel}")
            if text is not None:
                yield text


def _record(text: str | None) -> dict:
    """An executed notebook's provenance (``metadata.zipkv``), empty where it has none."""
    if not text:
        return {}
    try:
        return json.loads(text).get("metadata", {}).get("zipkv", {}) or {}
    except ValueError:
        return {}


def _board(device) -> str:
    return str(device).split(" (")[0]


def is_gpu(device) -> bool:
    """Whether a provenance ``device`` names a GPU (not the CPU, not unrecorded)."""
    return isinstance(device, str) and device not in ("", NOT_RECORDED) and not device.startswith("CPU")


def card(device) -> str:
    """A device's short name: ``H100``, ``H200``, ``CPU`` (or the board's name)."""
    if not is_gpu(device):
        return "CPU" if str(device).startswith("CPU") else NOT_RECORDED
    name = _board(device).removeprefix("NVIDIA ").split()
    return name[0] if name else _board(device)


def _same_run(version: dict, origin: dict) -> bool:
    """Whether an executed notebook's ``version`` is the run that measured the table ``origin`` names."""
    if not version or "results_from" in version or _board(version.get("device")) != _board(origin.get("run_device")):
        return False
    if version.get("date") and version.get("date") == origin.get("run_date"):
        return True
    mine, theirs = str(version.get("commit", ""))[:7], str(origin.get("run_commit", ""))[:7]
    return len(mine) == 7 and mine == theirs


def measuring_run(record: dict, source: Source, rel: str) -> tuple[dict, bool]:
    """(the record of the run that measured a chapter's numbers, whether it was found). A chapter rendered from its
    own run is its record; one rebuilt from a committed table is the history's version of that run, else only what
    the table names (device, date, commit)."""
    origin = record.get("results_from")
    if not origin:
        return record, bool(record)
    for text in source.history(rel):
        version = _record(text)
        if _same_run(version, origin):
            return version, True
    return {"device": origin.get("run_device", NOT_RECORDED), "date": origin.get("run_date", NOT_RECORDED),
            "commit": origin.get("run_commit", NOT_RECORDED), "profile": record.get("profile")}, False


def toc_pages(toc: Path) -> pd.DataFrame:
    """The book's executed pages in the order of ``_toc.yml``: ``part``, ``doc`` (``book/part/name``), ``stem``; the
    root page first (part :data:`LANDING`), pages written by hand (``.md``) and this part's own pages left out."""
    import yaml

    toc = Path(toc)
    spec = yaml.safe_load(toc.read_text())
    rows = [(LANDING, spec["root"])] if spec.get("root") else []

    def walk(part, nodes):
        for node in nodes or []:
            if "file" in node:
                rows.append((part, node["file"]))
            walk(part, node.get("sections"))

    for part in spec.get("parts", []):
        walk(part.get("caption", ""), part.get("chapters"))
    rows = [(p, d) for p, d in rows if not (toc.parent / f"{d}.md").is_file() and Path(d).name not in PAGES]
    return pd.DataFrame([(p, d, Path(d).name) for p, d in rows], columns=["part", "doc", "stem"])


def runs(toc: Path, notebooks: Path, *, committed: bool = False) -> pd.DataFrame:
    """One row per executed page of the book (:func:`toc_pages`; columns :data:`RUN_COLUMNS`): the run that measured
    its numbers (device, date, commit, wall time in seconds, library versions, GPU fields) and the run that rendered
    it; fields its provenance does not hold read :data:`NOT_RECORDED` (GPU fields of a CPU run: :data:`NO_GPU`). A page
    rebuilt from another page's table (the engineering appendix from the latency chapter's) ``shares`` that page's run
    (its stem; else empty): its record is that page's, its time counted there.
    ``committed``: the executed notebooks as git holds them at ``HEAD``, not as the working tree does."""
    from zipkv.study import findings

    toc = Path(toc)
    source = Source(toc.parent, committed)
    titles = findings.chapter_titles(notebooks)
    pages = toc_pages(toc)
    docs = dict(zip(pages.stem, pages.doc))
    rows = []
    for page in pages.itertuples():
        rel = f"{page.doc}.ipynb"
        record = _record(source.text(rel))
        table = Path(record.get("results_from", {}).get("table", "")).stem
        shares = table if table in docs and table != page.stem else ""
        if shares:                                   # the other page's record: its run measured this one
            other = _record(source.text(f"{docs[shares]}.ipynb"))
            run, found = measuring_run(other, source, f"{docs[shares]}.ipynb")
        else:
            run, found = measuring_run(record, source, rel)
        device = run.get("device", NOT_RECORDED)
        row = {"part": page.part, "stem": page.stem, "title": titles.get(page.stem, page.stem), "doc": page.doc,
               "profile": record.get("profile", NOT_RECORDED), "rebuilt": "results_from" in record, "found": found, "shares": shares,
               "device": device, "date": run.get("date", NOT_RECORDED), "commit": run.get("commit", NOT_RECORDED),
               "wall_time_s": float(run["wall_time_s"]) if found and not shares and "wall_time_s" in run else np.nan,
               "rendered_on": record.get("device", NOT_RECORDED), "rendered_date": record.get("date", NOT_RECORDED)}
        row.update({k: str(run.get(k, NOT_RECORDED)) for k in VERSIONS})
        cuda = re.search(r"\(CUDA ([^)]+)\)", str(device))
        for key in GPU_FIELDS:
            value = run.get(key) or (cuda.group(1) if key == "cuda" and cuda else None)
            row[key] = str(value) if value else (NO_GPU if not is_gpu(device) and device != NOT_RECORDED else NOT_RECORDED)
        rows.append(row)
    return pd.DataFrame(rows, columns=RUN_COLUMNS)


# ---------------------------------------------------------------- reproduce it: commands, time and cost

def command(row) -> str:
    """The command that reruns a page under its run's profile (on a GPU where its profile says so)."""
    profile = row.profile if row.profile != NOT_RECORDED else "paper"
    return f"python -m zipkv book --profile {profile} --only {row.stem}"


def rerender(row) -> str:
    """The command that re-renders a page rebuilt from its committed table on any machine, or '–'."""
    return f"python -m zipkv book --profile {row.profile} --from-results --force --only {row.stem}" if row.rebuilt else "–"


def hours(runs: pd.DataFrame) -> pd.DataFrame:
    """Device-hours per part of the book and in total, from the measuring runs' wall times: ``GPU-hours`` (by card),
    ``CPU-hours``, the pages and those whose measuring time is not recorded (a lower bound where there are any)."""
    t = runs.assign(card=runs.device.map(card), hours=runs.wall_time_s / 3600,
                    missing=runs.wall_time_s.isna() & (runs.shares == ""))
    parts = list(dict.fromkeys(t.part))
    cards = sorted({c for c in t.card if c not in ("CPU", NOT_RECORDED)})
    out = pd.DataFrame(index=pd.Index(parts + ["total"], name="part"))
    for c in cards:
        per = t[t.card == c].groupby("part").hours.sum()
        out[f"{c} GPU-hours"] = per.reindex(parts).fillna(0.0).tolist() + [per.sum()]
    gpu = t[t.card.isin(cards)].groupby("part").hours.sum()
    out["GPU-hours"] = gpu.reindex(parts).fillna(0.0).tolist() + [gpu.sum()]
    cpu = t[t.card == "CPU"].groupby("part").hours.sum()
    out["CPU-hours"] = cpu.reindex(parts).fillna(0.0).tolist() + [cpu.sum()]
    pages = t.groupby("part").size()
    out["pages"] = pages.reindex(parts).tolist() + [len(t)]
    missing = t[t.missing].groupby("part").size()
    out["time not recorded"] = missing.reindex(parts).fillna(0).astype(int).tolist() + [int(t.missing.sum())]
    return out


def hours_figure(hours_table: pd.DataFrame):
    """Horizontal stacked bars: minutes of each card's and of the CPU per part of the book."""
    import matplotlib.pyplot as plt

    t = hours_table.drop(index="total")
    stacks = [c for c in t.columns if c.endswith(" GPU-hours")] + ["CPU-hours"]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(t) + 1.2))
    left = np.zeros(len(t))
    colours = {"CPU-hours": "#9e9e9e"}
    palette = iter(["#2a6db0", "#c77700", "#1b8a3a", "#7a3fb0"])
    for column in stacks:
        minutes = t[column].to_numpy() * 60
        ax.barh(t.index, minutes, left=left, color=colours.get(column) or next(palette),
                label=column.replace("-hours", "").replace(" GPU", ""))
        left += minutes
    for y, (total, missing) in enumerate(zip(left, t["time not recorded"])):
        if missing:
            ax.annotate(f"+ {missing} not recorded", (total, y), xytext=(4, 0), textcoords="offset points",
                        va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("wall time of the runs that measured the pages (minutes)")
    ax.set_xlim(0, max(left.max() * 1.3, 1))
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    return fig


def _duration(seconds, shares: str = "", titles: dict | None = None) -> str:
    if shares:
        return f"counted with {(titles or {}).get(shares, shares)}"
    if pd.isna(seconds):
        return NOT_RECORDED
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def cost_verdict(runs: pd.DataFrame, hours_table: pd.DataFrame) -> str:
    """The reproduce page's opening: total GPU-hours by card, CPU-hours, the pages whose time is not recorded."""
    total = hours_table.loc["total"]
    cards = [c.removesuffix(" GPU-hours") for c in hours_table.columns if c.endswith(" GPU-hours")]
    by_card = ", ".join(f"{total[f'{c} GPU-hours']:.2f} on the {c}" for c in cards)
    gpu_pages = runs[runs.device.map(is_gpu)]
    text = (f"Rerunning every page as published takes **{total['GPU-hours']:.2f} GPU-hours** ({by_card}; "
            f"{len(gpu_pages)} of {len(runs)} pages were measured on a GPU) and {total['CPU-hours']:.2f} CPU-hours, "
            f"by the wall time each measuring run recorded.")
    missing = int(total["time not recorded"])
    if missing:
        text += (f" {missing} page{'s' if missing != 1 else ''} did not record the measuring run's time (it "
                 f"predates this record or ran outside the book's pipeline): the totals are a lower bound.")
    rebuilt = int((runs.rebuilt & runs.device.map(is_gpu)).sum())
    if rebuilt:
        text += (f" {rebuilt} of the GPU pages re-render from their committed tables on any machine, without a GPU, "
                 "in seconds.")
    return text + " Probes run outside the chapters (the engineering appendix's) are not counted."


def commands_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per page: the command that reruns it, its profile, the device and date of the run that measured it, its wall
    time, and the command that re-renders it without a GPU."""
    return pd.DataFrame({
        "part": runs.part, "page": runs.title, "rerun": runs.apply(command, axis=1), "profile": runs.profile,
        "measured on": runs.device.map(_board), "date": runs.date.str[:10],
        "wall time": [_duration(s, o, dict(zip(runs.stem, runs.title))) for s, o in zip(runs.wall_time_s, runs.shares)],
        "re-render without a GPU": runs.apply(rerender, axis=1)})


# ---------------------------------------------------------------- software and hardware

def _span(values, fmt: str, unit: str = "") -> str | None:
    values = [v for v in values if pd.notna(v)]
    if not values:
        return None
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return (lo if lo == hi else f"{lo}–{hi}") + unit


def clocks(source: Source, stem: str, profile: str) -> dict:
    """What the page's committed results tables sampled while the GPU was timed (its main table and those beside it):
    the SM clock, the power draw (median and largest) and the share of samples held at the power cap, as ranges over
    the timed runs; empty where no table of the page sampled them."""
    folder = f"results/{profile}"
    tables = [f for f in source.files(folder) if re.fullmatch(rf"{re.escape(folder)}/{re.escape(stem)}(_.+)?\.csv", f)]
    frames = []
    for rel in tables:
        text = source.text(rel)
        head = text.split("\n", 1)[0] if text else ""
        if text and all(c in head.split(",") for c in CLOCK_COLUMNS):
            frames.append(pd.read_csv(io.StringIO(text), usecols=list(CLOCK_COLUMNS)))
    if not frames:
        return {}
    t = pd.concat(frames).dropna(how="all")
    if t.empty:
        return {}
    return {"SM clock while timed (MHz)": _span(t.sm_clock_mhz, "{:.0f}"),
            "power draw while timed (W)": _span(t.power_w_max, "{:.0f}"),
            "share of samples at the power cap": _span(t.frac_power_capped * 100, "{:.0f}", " %")}


def software_table(runs: pd.DataFrame, root: Path, *, committed: bool = False) -> pd.DataFrame:
    """Per page: the device, CUDA, driver, the library versions and the GPU's clocks and power of the run that
    measured it; every field its provenance or tables do not hold reads :data:`NOT_RECORDED`."""
    source = Source(root, committed)
    rows = []
    for r in runs.itertuples():
        gpu = is_gpu(r.device)
        row = {"page": r.title, "measured on": r.device, **{label: getattr(r, k) for k, label in VERSIONS.items()},
               **{label: getattr(r, k) for k, label in GPU_FIELDS.items()}}
        sampled = clocks(source, r.stem, r.profile) if gpu and r.profile != NOT_RECORDED else {}
        for label in ("SM clock while timed (MHz)", "power draw while timed (W)", "share of samples at the power cap"):
            row[label] = sampled.get(label) or (NOT_RECORDED if gpu else NO_GPU)
        rows.append(row)
    return pd.DataFrame(rows)


def stacks(runs: pd.DataFrame) -> pd.DataFrame:
    """The software stacks that measured the pages: one row per (device, Python, torch, Triton, transformers) with the
    pages it measured, the most first."""
    keys = ["device", "python", "torch", "triton", "transformers"]
    return (runs.groupby(keys, sort=False).title.agg(["size", list]).rename(columns={"size": "pages", "list": "titles"})
            .sort_values("pages", ascending=False).reset_index())


def stacks_figure(stack_table: pd.DataFrame):
    """Horizontal bars: pages measured per software stack, coloured by card."""
    import matplotlib.pyplot as plt

    t = stack_table
    labels = [f"{card(r.device)} · Python {r.python} · torch {r.torch} · Triton {r.triton} · transformers "
              f"{r.transformers}" for r in t.itertuples()]
    colours = {"H100": "#2a6db0", "H200": "#c77700", "CPU": "#9e9e9e"}
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(t) + 1.0))
    ax.barh(labels, t.pages, color=[colours.get(card(d), "#7a3fb0") for d in t.device])
    ax.invert_yaxis()
    ax.set_xlabel("pages whose numbers this stack measured")
    ax.grid(axis="x", alpha=0.3)
    return fig


def software_verdict(runs: pd.DataFrame, table: pd.DataFrame, root: Path | None = None, *,
                     committed: bool = False) -> str:
    """The software page's opening: the stacks, the cards, what every run records and what none or few did; with
    ``root``, the driver that a committed report of another run names (:func:`recorded_drivers`)."""
    st = stacks(runs)
    gpus = sorted({r.device for r in runs.itertuples() if is_gpu(r.device)})
    known = runs[runs.python != NOT_RECORDED]
    text = (f"The pages were measured by {len(st)} software stacks on "
            + (", ".join(sorted({_board(d) for d in gpus})) + " and " if gpus else "") + "the CPU; "
            f"{len(known)} of {len(runs)} measuring runs recorded their Python, torch, Triton and transformers versions.")
    gpu_runs = runs[runs.device.map(is_gpu)]
    if len(gpu_runs):
        fields = {"FlashInfer's version": (gpu_runs.flashinfer != NOT_RECORDED).sum(),
                  "the driver": (gpu_runs.driver != NOT_RECORDED).sum(),
                  "the board's power limit": (gpu_runs.power_limit_w != NOT_RECORDED).sum(),
                  "the clocks while timed": (table.loc[gpu_runs.index, "SM clock while timed (MHz)"] != NOT_RECORDED).sum()}
        text += " Of the " + f"{len(gpu_runs)} GPU runs, " + "; ".join(
            f"{'none' if n == 0 else n} recorded {what}" for what, n in fields.items()) + (
            ".")
        drivers = recorded_drivers(Source(root, committed)) if root is not None else None
        if drivers is not None and len(drivers):
            d = drivers.iloc[0]
            text += (f" The one driver on record is that of the Nsight Compute report in the engineering appendix, "
                     f"another run: {d.driver} on an {card(d.device)}, {d.date[:10]}.")
        text += (" Runs made from now on record FlashInfer, CUDA, the driver, the power limit and the highest SM "
                 "clock; a field a run did not record reads *not recorded* below.")
    return text


def recorded_drivers(source: Source, profile: str = "paper") -> pd.DataFrame:
    """Driver versions that a committed report of ``profile`` names in its header (the Nsight Compute report's
    ``# device: ... (driver X); date: ...`` line): ``report``, ``device``, ``driver``, ``date``."""
    rows = []
    for rel in source.files(f"results/{profile}"):
        if not rel.endswith(".txt"):
            continue
        head = "\n".join((source.text(rel) or "").splitlines()[:5])
        found = re.search(r"# device: (.+?) \(driver ([^)]+)\); date: ([^;]+);", head)
        if found:
            rows.append((Path(rel).stem, *found.groups()))
    return pd.DataFrame(rows, columns=["report", "device", "driver", "date"])


# ---------------------------------------------------------------- limitations

def nominal_size(name: str) -> float | None:
    """A model's nominal parameter count from its name (``Qwen2.5-1.5B-Instruct`` -> 1.5e9, ``SmolLM2-135M`` ->
    1.35e8), None where the name gives none."""
    found = re.search(r"(?<![\d.])(\d+(?:\.\d+)?)([MB])(?![A-Za-z])", name, re.IGNORECASE)
    if not found:
        return None
    return float(found.group(1)) * (1e9 if found.group(2).upper() == "B" else 1e6)


def models(results_dir: Path) -> pd.DataFrame:
    """The papers' models and this study's: ``model``, ``used by`` (KVSculpt, ZipFusion, this study) and ``parameters``
    (nominal, from the name); this study's second model where its committed table is there."""
    from zipkv.models import EMBEDDED_NAME
    from zipkv.study import paper_values as pv
    from zipkv.study.chapters.escape import LABELS

    rows = [(pv.KVSCULPT_MODEL, "KVSculpt")] + [(m, "ZipFusion") for m in pv.ZIPFUSION_MAX_BATCH]
    rows.append((EMBEDDED_NAME, "this study"))
    second = Path(results_dir) / "kvsculpt_beyond_gemma.csv"
    if second.is_file():
        rows += [(LABELS.get(m, m), "this study, second model") for m in pd.read_csv(second).model.unique()]
    return pd.DataFrame([(m, who, nominal_size(m)) for m, who in rows], columns=["model", "used by", "parameters"])


def models_figure(table: pd.DataFrame):
    """Horizontal bars, log scale: nominal parameters of the papers' models and this study's."""
    import matplotlib.pyplot as plt

    colours = {"KVSculpt": "#7a3fb0", "ZipFusion": "#2a6db0"}
    fig, ax = plt.subplots(figsize=(8, 0.42 * len(table) + 1.0))
    ax.barh([f"{r.model} ({r._2})" for r in table.itertuples()], table.parameters / 1e9,
            color=[colours.get(w, "#c77700") for w in table["used by"]])
    for y, v in enumerate(table.parameters / 1e9):
        ax.annotate(f"{v:g} B", (v, y), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("parameters (billions, nominal, log scale)")
    ax.set_xlim(right=(table.parameters.max() / 1e9) * 3)
    ax.grid(axis="x", alpha=0.3)
    return fig


def _claim(table: pd.DataFrame, start: str) -> pd.Series | None:
    """The findings row of the claim ``start`` names, None where its chapter has not run."""
    from zipkv.study import findings

    row = table.set_index("claim").loc[findings.claim_of(start).claim]
    return None if row.verdict == "not yet run" else row


def _ours(row, what: str = "") -> str:
    """``what`` and a findings row's number (its first part, without the details and the card it names), the paper's
    and the verdict; "not yet run" without a row."""
    if row is None:
        return f"{what}not yet run"
    short = re.split(r" \(|, H\d00\b", str(row.our_value))[0]
    return f"{what}{short} (the paper: {row.paper_value}; {row.verdict})"


def limitations(results_dir: Path, runs: pd.DataFrame, table: pd.DataFrame | None = None) -> pd.DataFrame:
    """What this study does not show, one row each: ``limit``, ``not shown``, ``why``, ``instead`` (what it shows in
    its place, with the number computed from ``results_dir``'s committed tables as the findings page judges them) and
    ``pages`` (the stems of the pages with the numbers)."""
    from zipkv.study import findings
    from zipkv.study import paper_values as pv
    from zipkv.study.chapters import latency

    results_dir = Path(results_dir)
    table = findings.findings(results_dir) if table is None else table
    rows = []

    def add(limit, not_shown, why, instead, pages):
        rows.append(dict(limit=limit, not_shown=not_shown, why=why, instead=instead, pages=list(pages)))

    m = models(results_dir)
    ours = m[m["used by"].str.startswith("this study")]
    theirs = m[~m["used by"].str.startswith("this study")]
    small = ours.parameters.min()
    add("The papers' models",
        f"any result on {', '.join(theirs.model)}",
        "this study runs offline, on models that ship inside Python packages; the papers' models are downloads from a "
        "model hub",
        f"{' and '.join(ours.model)}, {theirs.parameters.min() / small:.0f}–{theirs.parameters.max() / small:.0f}× "
        "smaller by nominal size; the same code runs any Hugging Face model with rotary embeddings and grouped-query "
        "attention for a reader who has one", ["kvsculpt_why"])

    main = results_dir / "kvsculpt_main.csv"
    scale = ""
    if main.is_file():
        t = pd.read_csv(main)
        kl = t[t.ratio == 0.3].groupby("method").kl.mean()
        base = [b for b in ("random", "select_fit") if b in kl]
        scale = "; " + ", ".join(f"{findings.label(b)}'s KL at r = 0.3 is {pv.KVSCULPT_TABLE1[b][0.3] / kl[b]:.1f}× "
                                 f"below the paper's ({kl[b]:.3g} against {pv.KVSCULPT_TABLE1[b][0.3]:.3g})" for b in base)
    add("KVSculpt's main claim on its own model",
        f"KVSculpt's lower KL than Select+Fit on {pv.KVSCULPT_MODEL}",
        f"that model is not run (the row above); on {findings.EMBEDDED_MODEL} the claim does not reproduce, and the "
        "KL of every method is on another scale than the paper's",
        _ours(_claim(table, "KL reduction over Select+Fit, r ∈"), "KVSculpt over Select+Fit: ") + scale,
        ["kvsculpt_main", "kvsculpt_why"])

    h100 = _claim(table, "decode attention over FlashInfer (TC), real-KV mix of compressible blocks, on the paper's card")
    h200 = _claim(table, "decode attention over FlashInfer (TC), real-KV mix of compressible blocks")
    speed = _claim(table, "seconds to compress a 2048-token context")
    cards = sorted({card(d) for d in runs.device if is_gpu(d)})
    add("The papers' GPUs",
        f"KVSculpt's timings on its {pv.KVSCULPT_GPU}; most ZipFusion timings on its {pv.ZIPFUSION_GPU}",
        f"the study borrowed GPUs ({' and '.join(cards) if cards else 'none yet'}); speed depends on the card, so "
        "each timing names its own",
        "attention speedup: " + _ours(h100, f"{pv.ZIPFUSION_GPU}, ") + "; " + _ours(h200, "H200, ")
        + "; KVSculpt's solver, one problem at a time: " + _ours(speed),
        ["zipfusion_paper_card", "zipfusion_attention_latency", "distill_speed"])

    add("SGLang",
        "ZipFusion's throughput against SGLang, the paper's serving engine",
        "SGLang does not run the study's kernels; both sides run in this project's engine, with and without "
        "compression, under one memory budget",
        "tokens/s gain at the largest batch: " + _ours(_claim(table, "tokens/s at each method's largest batch over "
                                                                     "uncompressed (gain), the paper's"), "H200, ")
        + "; " + _ours(_claim(table, "tokens/s at each method's largest batch over uncompressed (gain), on the "
                                     "paper's card"), "H100, "),
        ["zipfusion_throughput", "zipfusion_paper_card"])

    add("Real weights in the speed runs",
        "attention and throughput timed on the papers' trained models",
        "a timing depends on the shapes and on the share of compressible blocks, not on the weights' values; the "
        "8B models are not available offline",
        "the papers' attention shapes with random weights, their KV compressible in the share measured on a real "
        "cache: " + _ours(_claim(table, "real KV cache: share of compressible blocks")).split(" (the paper")[0]
        .removeprefix("compressible blocks: "),
        ["model_data_kv_cache", "zipfusion_attention_latency", "zipfusion_throughput"])

    lat = results_dir / "zipfusion_attention_latency.csv"
    grid = latency.few_requests(pd.read_csv(lat)) if lat.is_file() else None
    probe = results_dir / "zipfusion_kernel_merge_tree_ab.csv"
    ran = grid is not None and not grid.empty
    if ran:
        mix = grid[latency.FEW_REQUESTS[("zipkv_compressed", "measured mix")]]
        few = (f"the latency chapter's panel: the real-KV mix at {mix.min():.2f}–{mix.max():.2f}× FlashInfer's speed "
               f"with {int(grid.index.get_level_values('batch').max())} requests or fewer")
    else:
        few = "the latency chapter's few-requests panel has no committed GPU run yet"
    if probe.is_file():
        p = pd.read_csv(probe)
        p = p[p.plan_default.astype(str) == "True"]
        mix = p[p.kind == "measured mix"]
        if len(mix):
            few += (f"; a probe of the kernel's two-level merge ({_board(mix.device.iloc[0])}, "
                    f"{mix.batch.min()}–{mix.batch.max()} requests, {mix.ctx.min():,}–{mix.ctx.max():,} tokens) "
                    f"measured the real-KV mix at {mix.tree_ratio.min():.2f}–{mix.tree_ratio.max():.2f}× "
                    "FlashInfer's speed")
    add("Few requests with long contexts",
        "the fused kernel's speed with one to sixteen requests, where the paper reports none",
        "the paper times 32 to 96 requests only" if ran else
        "the panel, and the kernel's merge for many splits, came after the chapter's last GPU run",
        few, ["zipfusion_attention_latency", "zipfusion_kernel_engineering"])

    mm = results_dir / "memory_manager.csv"
    if mm.is_file():
        t = pd.read_csv(mm).set_index("variant")
        shared = t.loc["shared pool"] if "shared pool" in t.index else t.iloc[0]
        instead = (f"the same manager in this project's engine, on {shared.model} on the {str(shared.device).upper()} "
                   f"with a {shared.clock} clock: {int(shared.chunks_reassigned)} chunks reassigned between layers, "
                   f"largest batch {int(shared.max_batch)}")
    else:
        instead = "not yet run"
    add("The memory manager on a GPU",
        "the shared pool's effect on a GPU serving a real model",
        "its behaviour (which chunk goes where) does not depend on the device; its timings do, and were not measured",
        instead, ["memory_manager"])

    add("SplitZip and Huffman themselves",
        "the published restore codecs",
        "neither ships as a package the study can run; it implements their methods",
        "tokens/s over the best restore codec: "
        + _ours(_claim(table, "tokens/s at the largest batch over the best lossless restore baseline")),
        ["zipfusion_restore_baselines", "zipfusion_throughput"])

    queries = results_dir / "kvsculpt_queries.csv"
    if queries.is_file():
        n = pd.read_csv(queries).window.nunique()
        if n < pv.KVSCULPT_TABLE1_SEQUENCES:
            add("Every window of every table",
                "some KVSculpt analyses on as many sequences as the paper",
                "GPU time per session",
                f"the query-strategy analysis on {n} windows (the paper's tables average over "
                f"{pv.KVSCULPT_TABLE1_SEQUENCES} sequences)", ["kvsculpt_queries"])

    missing = int((runs.wall_time_s.isna() & (runs.shares == "")).sum())
    add("The full cost",
        "the device time of the probes and reruns behind the published runs",
        "only each page's last run records its wall time",
        "the published runs' own time, " + (f"{missing} page{'s' if missing != 1 else ''} without it" if missing else
                                            "recorded for every page"), ["reproduce"])

    gpu = runs[runs.device.map(is_gpu)]
    add("The whole software stack of past runs",
        "FlashInfer's version, the driver and the power limit of the GPU runs",
        "provenance recorded them only from this edition on",
        f"{int((gpu.flashinfer != NOT_RECORDED).sum())} of {len(gpu)} GPU runs record FlashInfer's version, "
        f"{int((gpu.driver != NOT_RECORDED).sum())} the driver", ["software"])
    return pd.DataFrame(rows)


def limitations_verdict(results_dir: Path, limits: pd.DataFrame, runs: pd.DataFrame) -> str:
    """The limitations page's opening: the models' scale, the cards, the engine, and how many limits follow."""
    from zipkv.study import paper_values as pv

    m = models(results_dir)
    ours, theirs = m[m["used by"].str.startswith("this study")], m[~m["used by"].str.startswith("this study")]
    small = ours.parameters.min()
    cards = sorted({card(d) for d in runs.device if is_gpu(d)})
    cpu = int((runs.device.map(card) == "CPU").sum())
    return (f"Every quality result here comes from models {theirs.parameters.min() / small:.0f} to "
            f"{theirs.parameters.max() / small:.0f} times smaller than the papers' (nominal sizes); the timings come "
            f"from {' and '.join(f'an {c}' for c in cards) if cards else 'no GPU yet'} where the papers used an "
            f"{pv.ZIPFUSION_GPU} "
            f"(ZipFusion) and an {pv.KVSCULPT_GPU} (KVSculpt), and {cpu} of {len(runs)} pages were measured on the CPU; "
            f"throughput is compared within this project's engine, not SGLang. The {len(limits)} limits below say what "
            "each leaves unshown, why, and what stands in its place, with the page that has the numbers.")


def pages_markdown(stems, docs: dict[str, str], titles: dict[str, str]) -> str:
    """Links to the pages ``stems`` (their titles), those not in the book by name."""
    return ", ".join(f"{{doc}}`{titles.get(s, s)} </{docs[s]}>`" if s in docs else titles.get(s, s) for s in stems)


def markdown_table(frame: pd.DataFrame, columns: dict[str, str]) -> str:
    """``frame``'s ``columns`` (column -> header) as a MyST table; cells as they are (links stay links)."""
    def cell(v) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(columns.values()) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r[c]) for c in columns) + " |" for _, r in frame.iterrows()]
    return "\n".join(lines)


def _table(markdown: str, caption: str, name: str) -> str:
    return f"```{{table}} {caption}\n:name: {name}\n\n{markdown}\n```"


def limits_markdown(limits: pd.DataFrame, docs: dict[str, str], titles: dict[str, str]) -> str:
    """The limits as a captioned MyST table, each with links to the pages that have its numbers."""
    t = limits.assign(limit=[f"**{x}**" for x in limits.limit],
                      pages=[pages_markdown(p, docs, titles) for p in limits.pages])
    return _table(markdown_table(t, {"limit": "limit", "not_shown": "not shown", "why": "why",
                                     "instead": "what stands in, and its number", "pages": "the numbers"}),
                  "What this study does not show: each limit, why, what stands in its place (ours; the paper's; the "
                  "findings page's verdict) and the pages with the numbers.", "tbl-limits")


def _without_gpu(row) -> str:
    if not is_gpu(row.device):
        return "runs on the CPU"
    return "add `--from-results --force` to re-render" if row.rebuilt else "needs a GPU"


def commands_markdown(runs: pd.DataFrame, docs: dict[str, str]) -> str:
    """Per page: its link, the command that reruns it, the device and date of the run that measured it, that run's
    wall time, and what a machine without a GPU can do."""
    titles = dict(zip(runs.stem, runs.title))
    docs = {**dict(zip(runs.stem, runs.doc)), **docs}
    t = pd.DataFrame({
        "part": runs.part, "page": [pages_markdown([s], docs, titles) for s in runs.stem],
        "rerun": [f"`{command(r)}`" for r in runs.itertuples()], "measured on": runs.device.map(_board),
        "date": runs.date.str[:10],
        "wall time": [_duration(s, o, titles) for s, o in zip(runs.wall_time_s, runs.shares)],
        "without a GPU": [_without_gpu(r) for r in runs.itertuples()]})
    profiles = sorted(set(runs.profile) - {NOT_RECORDED})
    return _table(markdown_table(t, {c: c for c in t.columns}),
                  f"Each page's command ({', '.join(profiles)} profile), the device and date of the run that measured "
                  "its numbers and that run's wall time; a page rebuilt from its committed table re-renders without a "
                  "GPU.", "tbl-reproduce-commands")


def hours_markdown(hours_table: pd.DataFrame) -> str:
    """The device-hours per part as a captioned MyST table."""
    t = hours_table.reset_index()
    cols = {"part": "part", **{c: c for c in t.columns if c.endswith("GPU-hours")}, "CPU-hours": "CPU-hours",
            "pages": "pages", "time not recorded": "pages without a recorded time"}
    shown = t.assign(**{c: t[c].map("{:.2f}".format) for c in t.columns if c.endswith("-hours")},
                     part=[f"**{p}**" if p == "total" else p for p in t.part])
    return _table(markdown_table(shown, cols), "Device-hours per part of the book: the wall time of the runs that "
                  "measured its pages, by card, and of those measured on the CPU.", "tbl-reproduce-hours")


def software_markdown(table: pd.DataFrame, runs: pd.DataFrame) -> str:
    """Two captioned MyST tables: the library versions of every run, and the GPU fields of the GPU runs."""
    versions = table.assign(**{"measured on": table["measured on"].map(_board), "date": runs.date.str[:10].tolist()})
    first = _table(markdown_table(versions, {c: c for c in ["page", "measured on", "date", *VERSIONS.values()]}),
                   "The library versions of the run that measured each page.", "tbl-software-versions")
    gpu = table[runs.device.map(is_gpu).tolist()]
    if gpu.empty:
        return first
    gpu = gpu.assign(card=gpu["measured on"].map(_board))
    cols = ["page", "card", *GPU_FIELDS.values(), "SM clock while timed (MHz)", "power draw while timed (W)",
            "share of samples at the power cap"]
    return first + "\n\n" + _table(markdown_table(gpu, {c: c for c in cols}),
                                    "The GPU of each GPU run: CUDA, the driver, the board's power limit and highest SM "
                                    "clock as its provenance recorded them, and the clock and power sampled while "
                                    "timed where a results table of the page holds them.", "tbl-software-gpu")
