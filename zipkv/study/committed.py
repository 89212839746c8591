"""Committed results: a chapter rebuilt from the table its GPU run committed, and where that table came from.

A chapter whose paper-profile run needs a GPU can be re-rendered on any machine from its committed
main table (parameter ``from_results = True``): :func:`read_committed_csv` reads the table as git
holds it at ``HEAD`` (the pipeline clears the working copy before a run), and :func:`origin` names
the commit that last changed it and the run that measured it: the table's own ``device``, ``date`` and
``commit`` columns where it has them, else the provenance of the executed notebook committed with it.
:func:`read_committed_side` reads a second table a chapter keeps beside its main one (:func:`side_table`);
:func:`table1_kvsculpt` takes one chapter's rows from another's committed table where both ran the same windows.
"""
from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import pandas as pd


def _git(args: list[str], cwd: Path) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"git {' '.join(args)} failed in {cwd}: {done.stderr.strip()}")
    return done.stdout


def _in_repo(path: str | Path) -> tuple[Path, str]:
    """(repository root, path relative to it) for a path given relative to the working directory."""
    path = Path(path).resolve()
    top = Path(_git(["rev-parse", "--show-toplevel"], path.parent).strip())
    return top, path.relative_to(top).as_posix()


def read_committed_text(path: str | Path) -> str:
    """The file at ``path`` as committed at ``HEAD``, whatever the working copy holds."""
    top, rel = _in_repo(path)
    try:
        return _git(["show", f"HEAD:{rel}"], top)
    except ValueError:
        raise ValueError(f"from_results: {rel} is not committed at HEAD; run the chapter instead") from None


def read_committed_csv(path: str | Path) -> pd.DataFrame:
    """The CSV at ``path`` as committed at ``HEAD`` (exact floats), whatever the working copy holds."""
    return pd.read_csv(io.StringIO(read_committed_text(path)))  # pandas 3 parses floats exactly (round trip)


def side_table(main_csv: str | Path, name: str) -> Path:
    """Where a chapter keeps a second table beside its main one: ``<main stem>_<name>.csv`` (a run writes it beside
    its ``results_csv``; ``from_results`` reads it beside ``committed_csv``)."""
    main_csv = Path(main_csv)
    return main_csv.with_name(f"{main_csv.stem}_{name}.csv")


def read_committed_side(main_csv: str | Path, name: str, at_head: bool = True) -> pd.DataFrame | None:
    """The side table ``name`` of the committed table ``main_csv`` as committed at ``HEAD`` (``at_head=False``: as the
    working copy holds it, for a copy of the project outside git), or ``None`` where no run has committed one (the
    chapter then says that part needs a run)."""
    if not at_head:
        path = side_table(main_csv, name)
        return pd.read_csv(path) if path.is_file() else None
    try:
        return read_committed_csv(side_table(main_csv, name))
    except ValueError:
        return None


def origin(path: str | Path) -> dict:
    """Where the committed table at ``path`` came from: the commit that last changed it, and the
    provenance (``metadata.zipkv``) of the executed chapter notebook as of that commit, if any."""
    top, rel = _in_repo(path)
    commit, date = _git(["log", "-1", "--format=%H %cs", "--", rel], top).split()
    record = {"table": rel, "table_commit": commit[:12], "table_committed": date}
    table = read_committed_csv(top / rel)
    if {"device", "date", "commit"} <= set(table.columns):  # the run wrote its own provenance into the table
        for key in ("device", "date", "commit"):
            values = table[key].dropna().astype(str).unique()
            record[f"run_{key}"] = ", ".join(sorted(values)) if len(values) else "unrecorded"
        return record
    stem = Path(rel).stem
    for nb_path in _git(["ls-tree", "-r", "--name-only", commit, "book"], top).split():
        if nb_path.endswith(f"/{stem}.ipynb"):
            run = json.loads(_git(["show", f"{commit}:{nb_path}"], top)).get("metadata", {}).get("zipkv", {})
            if "results_from" in run:  # that copy was itself rebuilt from the table: its origin is the run's
                return run["results_from"]
            record.update({f"run_{k}": run[k] for k in ("device", "date", "commit") if k in run})
    return record


def table1_kvsculpt(beyond: pd.DataFrame, main: pd.DataFrame) -> pd.DataFrame:
    """KVSculpt's rows (paper setting) from Table 1's table ``main`` on the (window, ratio) pairs that the beyond
    chapter's table ``beyond`` also ran, in ``beyond``'s columns, provided the two runs are the same windows under the
    same evaluation: both tables' Select+Fit (paper's queries) KLs agree there to 1e-4 relative. Empty otherwise."""
    keys = ["window", "ratio"]
    sf = beyond[beyond.method == "select_fit"].merge(main[main.method == "select_fit"], on=keys, suffixes=("", "_t1"))
    if sf.empty or not ((sf.kl - sf.kl_t1).abs() <= 1e-4 * sf.kl_t1.abs()).all():
        return beyond.iloc[:0]
    rows = main[main.method == "kvsculpt"].merge(sf[keys], on=keys)
    return rows.assign(model=beyond.model.iloc[0], choice="")[list(beyond.columns)]
