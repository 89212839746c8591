"""The study's commands on ``python -m zipkv`` (added through the ``zipkv.commands`` entry point, or by
``python -m zipkv.study``):

``python -m zipkv book [--profile quick|paper] [--only NAME ...] [--force] [--from-results] [--no-html | --html-only]
[--root DIR]`` — execute the notebooks, build the book.
``python -m zipkv engine-steps [--contexts N] [--splits S ...] [--out CSV]`` — where the throughput chapter's decode
steps go (:func:`zipkv.study.experiments.throughput.step_profile`; needs a CUDA GPU).
"""
from __future__ import annotations

import sys
from pathlib import Path

from zipkv.__main__ import out_problem, positive_int, save_table


def register(commands) -> dict:
    """Add the study's commands to ``commands`` (an argparse subparsers action): ``{name: run(args) -> status}``."""
    what = "execute the notebooks with papermill and build the HTML book"
    book = commands.add_parser("book", description=what)
    book.add_argument("--profile", default=None, help="parameter profile: a file params/<profile>.yaml (default quick)")
    book.add_argument("--only", nargs="+", metavar="NAME", help="run only these notebooks (file stems)")
    html = book.add_mutually_exclusive_group()
    html.add_argument("--no-html", action="store_true", help="execute notebooks only; skip jupyter-book")
    html.add_argument("--html-only", action="store_true",
                      help="build the HTML from the executed notebooks in book/ (runs none: no --profile, --only, "
                           "--force or --from-results)")
    book.add_argument("--root", type=Path, default=None, help="project root (default: this repository)")
    book.add_argument("--force", action="store_true",
                      help="replace executed notebooks in book/ that another profile made")
    book.add_argument("--from-results", action="store_true",
                      help="render the chapters that can be from their committed results tables, on the CPU "
                           "(from_results = True; no GPU needed)")
    what = "the throughput chapter's decode steps: GPU time per kernel kind, GPU idle and host time (CUDA GPU)"
    steps = commands.add_parser("engine-steps", description=what)
    steps.add_argument("--contexts", type=positive_int, nargs="+", default=None,
                       help="the prefixes' context length (default 8192; the first one given)")
    steps.add_argument("--splits", type=int, nargs="+", default=None,
                       help="the decode kernel's split-KV factors to run each engine with (0: the plan's choice)")
    steps.add_argument("--out", type=Path, default=None, help="save the table here (CSV, with the commit and date)")
    return {"book": run_book, "engine-steps": run_engine_steps}


def run_book(args) -> int:
    """``python -m zipkv book``."""
    try:
        import nbformat, papermill  # noqa: F401,E401 (the book extra)
    except ImportError as err:
        print(f"zipkv book: needs the book extra ({err.name} is missing): pip install 'zipkv[book]'", file=sys.stderr)
        return 1
    from zipkv.study import book as pipeline

    if args.html_only:
        runs = [f"--{o.replace('_', '-')}" for o in ("only", "force", "from_results") if getattr(args, o)]
        runs += ["--profile"] if args.profile is not None else []
        if runs:
            print(f"zipkv book: --html-only builds the HTML from book/ as it is and runs no notebook: "
                  f"{', '.join(runs)} would be ignored; drop them, or drop --html-only", file=sys.stderr)
            return 2
    root = args.root or pipeline.REPO_ROOT
    if not (Path(root) / "params").is_dir() or not (Path(root) / "notebooks").is_dir():
        print(f"zipkv book: --root {root}: not a zipkv project folder (expected params/ and notebooks/ in it)",
              file=sys.stderr)
        return 1
    try:
        if args.html_only:
            index = pipeline.build_html(Path(root).resolve())
        else:
            profile = "quick" if args.profile is None else args.profile
            index = pipeline.build(profile, args.only, root, html=not args.no_html, force=args.force,
                                   from_results=args.from_results)
    except (ValueError, pipeline.NotebookFailed, RuntimeError) as err:
        print(f"zipkv book: {err}", file=sys.stderr)
        return 1
    if index:
        print(f"book: {index}")
    return 0


def run_engine_steps(args) -> int:
    """``python -m zipkv engine-steps``."""
    import torch

    if (problem := out_problem(args.out)) is not None:
        print(f"zipkv engine-steps: {problem}", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("zipkv engine-steps: needs a CUDA GPU, and this machine has none", file=sys.stderr)
        return 1
    from zipkv.study.experiments.throughput import step_profile

    splits = [x or None for x in args.splits or [0]]            # 0: the plan's own choice
    try:
        table = step_profile(**({"context": args.contexts[0]} if args.contexts else {}), splits=splits)
    except ValueError as err:
        print(f"zipkv engine-steps: {err}", file=sys.stderr)
        return 1
    try:
        save_table(table, args.out)
    except OSError as err:
        print(f"zipkv engine-steps: --out {args.out}: {err.strerror or err}", file=sys.stderr)
        return 1
    return 0
