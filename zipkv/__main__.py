"""Command line: ``python -m zipkv book [--profile quick|paper] [--only NAME ...]``."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zipkv", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    book = commands.add_parser("book", help="execute the notebooks with papermill and build the HTML book")
    book.add_argument("--profile", default="quick", help="parameter profile: a file params/<profile>.yaml")
    book.add_argument("--only", nargs="+", metavar="NAME", help="run only these notebooks (file stems)")
    book.add_argument("--no-html", action="store_true", help="execute notebooks only; skip jupyter-book")
    book.add_argument("--html-only", action="store_true", help="build the HTML from the executed notebooks in book/")
    book.add_argument("--root", type=Path, default=None, help="project root (default: this repository)")
    args = parser.parse_args(argv)

    if args.command == "book":
        from zipkv import book as pipeline

        root = args.root or pipeline.REPO_ROOT
        try:
            if args.html_only:
                index = pipeline.build_html(Path(root).resolve())
            else:
                index = pipeline.build(args.profile, args.only, root, html=not args.no_html)
        except (ValueError, pipeline.NotebookFailed, RuntimeError) as err:
            print(f"zipkv book: {err}", file=sys.stderr)
            return 1
        if index:
            print(f"book: {index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
