"""Command line.

``python -m zipkv book [--profile quick|paper] [--only NAME ...] [--force] [--from-results] [--no-html | --html-only]
[--root DIR]`` — execute the notebooks, build the book.
``python -m zipkv bench attention|pack [...] [--out CSV]`` — GPU benchmarks (ZipFusion Fig. 4, pack throughput; zipkv.bench).
``python -m zipkv bench tune [--kernel gluon] [--write]`` — time decode-attention launch options per specialisation, keep the best.
``python -m zipkv bench distill [--contexts N ...] [--steps S] [--out CSV]`` — KVSculpt solvers, reference vs batched.
``python -m zipkv bench ncu --out TXT`` — the decode and pack kernels under Nsight Compute (needs ``ncu``).
``python -m zipkv bench format [--out CSV]`` — the plain-torch format reference (eligible, pack, unpack) vs a plain scan.
``python -m zipkv bench engine [--out CSV]`` — where the throughput chapter's decode steps go (zipkv.throughput.step_profile).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


GPU_BENCHMARKS = ("attention", "pack", "tune", "ncu", "ncu-targets", "engine")
"""Benchmarks that time GPU kernels (``distill`` and ``format`` also run on the CPU)."""


def _positive(text: str) -> int:
    """An argparse type: an int ≥ 1 (a bad one is argparse's one-line usage error, before any work)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    """``python -m zipkv``: parse ``argv`` (default ``sys.argv``) and run the command; the exit status (0: done)."""
    parser = argparse.ArgumentParser(prog="python -m zipkv", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    book = commands.add_parser("book", help="execute the notebooks with papermill and build the HTML book")
    book.add_argument("--profile", default="quick", help="parameter profile: a file params/<profile>.yaml")
    book.add_argument("--only", nargs="+", metavar="NAME", help="run only these notebooks (file stems)")
    book.add_argument("--no-html", action="store_true", help="execute notebooks only; skip jupyter-book")
    book.add_argument("--html-only", action="store_true", help="build the HTML from the executed notebooks in book/")
    book.add_argument("--root", type=Path, default=None, help="project root (default: this repository)")
    book.add_argument("--force", action="store_true",
                      help="replace executed notebooks in book/ that another profile made")
    book.add_argument("--from-results", action="store_true",
                      help="render the chapters that can be from their committed results tables, on the CPU "
                           "(from_results = True; no GPU needed)")
    bench = commands.add_parser("bench", help="GPU benchmarks; print the table and optionally save it as CSV")
    bench.add_argument("what", choices=["attention", "pack", "tune", "distill", "ncu", "ncu-targets", "format", "engine"])
    bench.add_argument("--shape", default="llama3.1-8b", help="attention shape (see zipkv.bench.ATTENTION_SHAPES)")
    bench.add_argument("--contexts", type=_positive, nargs="+", default=None,
                       help="context lengths (attention: 2048 8192; distill: 1024 2048 4096 8192; tune: 8192, engine: "
                            "8192, the first one given)")
    bench.add_argument("--batches", type=_positive, nargs="+", default=None, help="attention: 32 64 96; tune: 64")
    bench.add_argument("--real-kv", type=Path, default=None,
                       help="first chapter's results CSV: also time the measured mix of compressed blocks")
    bench.add_argument("--reps", type=_positive, default=30, help="attention, tune: timed calls per point (median)")
    bench.add_argument("--steps", type=_positive, default=100, help="distill: outer L-BFGS steps (paper: 100)")
    bench.add_argument("--reference-limit", type=_positive, default=4,
                       help="distill: problems the reference solver runs per timed context (scaled to the context)")
    bench.add_argument("--kernel", choices=["triton", "gluon"], default="triton",
                       help="tune: which decode kernel's launch options (gluon: the mma layouts)")
    bench.add_argument("--write", action="store_true",
                       help="tune: store the best launch options in zipkv/kernels/decode_tuning.json")
    bench.add_argument("--splits", type=int, nargs="+", default=None,
                       help="attention, engine: the decode kernels' split-KV factors to run each row with "
                            "(0: the plan's choice, the default)")
    bench.add_argument("--maxnreg", type=int, nargs="+", default=None,
                       help="attention: register caps per thread to run zipkv's kernels with (0: none; default: theirs)")
    bench.add_argument("--stages", type=int, nargs="+", default=None,
                       help="attention: pipeline depths (launch option 'stages') to run zipkv's kernels with "
                            "(default: theirs)")
    bench.add_argument("--methods", nargs="+", default=None, metavar="METHOD",
                       help="attention: the methods to time (names of zipkv.bench.attention.METHODS; default all)")
    bench.add_argument("--kernels", nargs="+", choices=["triton", "gluon"], default=None,
                       help="attention: zipkv's decode kernels to time (default: every one the head_dim has)")
    bench.add_argument("--out", type=Path, default=None,
                       help="save the table here (CSV, with the commit and date of the run; ncu: the report)")
    args = parser.parse_args(argv)
    if args.command == "bench" and args.what in GPU_BENCHMARKS:
        import torch

        if not torch.cuda.is_available():
            print(f"zipkv bench {args.what}: needs a CUDA GPU, and this machine has none", file=sys.stderr)
            return 1

    if args.command == "bench":
        try:
            return _bench(args)
        except (ValueError, FileNotFoundError) as err:              # bad input found by the benchmark: one line
            print(f"zipkv bench {args.what}: {err}", file=sys.stderr)
            return 1

    if args.command == "book":
        try:
            import nbformat, papermill  # noqa: F401,E401 (the book extra)
        except ImportError as err:
            print(f"zipkv book: needs the book extra ({err.name} is missing): pip install 'zipkv[book]'", file=sys.stderr)
            return 1
        from zipkv import book as pipeline

        root = args.root or pipeline.REPO_ROOT
        if not (Path(root) / "params").is_dir() or not (Path(root) / "notebooks").is_dir():
            print(f"zipkv book: --root {root}: not a zipkv project folder (expected params/ and notebooks/ in it)",
                  file=sys.stderr)
            return 1
        try:
            if args.html_only:
                index = pipeline.build_html(Path(root).resolve())
            else:
                index = pipeline.build(args.profile, args.only, root, html=not args.no_html, force=args.force,
                                      from_results=args.from_results)
        except (ValueError, pipeline.NotebookFailed, RuntimeError) as err:
            print(f"zipkv book: {err}", file=sys.stderr)
            return 1
        if index:
            print(f"book: {index}")
    return 0


def _bench(args) -> int:
    """``python -m zipkv bench``: run the benchmark ``args.what``, print its table, save it with ``--out``."""
    import pandas as pd

    splits = [x or None for x in args.splits or [0]]            # 0: the plan's own choice

    from zipkv import bench as benchmarks

    if args.what == "ncu-targets":                 # what `bench ncu` runs under ncu
        benchmarks.nsight_targets()
        return 0
    if args.what == "ncu":
        print(benchmarks.nsight_report(args.out or Path("results/paper/zipfusion_decode_ncu.txt")))
        return 0
    if args.what == "attention":
        fraction = benchmarks.measured_compressible_fraction(args.real_kv) if args.real_kv else None
        table = benchmarks.attention_benchmark(args.shape, args.contexts or [2048, 8192],
                                              args.batches or [32, 64, 96], fraction, reps=args.reps,
                                              splits=splits,
                                              maxnregs=args.maxnreg or (None,), stages=args.stages or (None,),
                                              **({"methods": args.methods} if args.methods else {}),
                                              kernels=args.kernels)
    elif args.what == "tune":
        fraction = benchmarks.measured_compressible_fraction(args.real_kv) if args.real_kv else None
        contexts = args.contexts or [8192]
        table = benchmarks.tune_decode_attention(args.shape, contexts[0], (args.batches or [64])[0], fraction,
                                               reps=args.reps, kernel=args.kernel)
        if args.write:
            print("stored:", benchmarks.write_tuning(table))
    elif args.what == "format":
        import torch

        from zipkv.format_bench import format_benchmark

        device = "cuda" if torch.cuda.is_available() else "cpu"
        table = pd.concat([format_benchmark(head_dim=d, device=device) for d in (64, 128)], ignore_index=True)
    elif args.what == "engine":
        from zipkv.throughput import step_profile

        table = step_profile(**({"context": args.contexts[0]} if args.contexts else {}),
                             splits=splits)
    elif args.what == "pack":
        table = pd.DataFrame([benchmarks.pack_benchmark(head_dim=d) for d in (64, 128)])
    else:
        import torch

        from zipkv import data, models
        from zipkv.bench.distill import speed_sweep
        from zipkv.distill import SculptConfig

        device = "cuda" if torch.cuda.is_available() else "cpu"
        model, tokenizer = models.load_model(dtype=torch.float32, device=device)
        table, _ = speed_sweep(model, tokenizer, data.load_books(), contexts=args.contexts or [1024, 2048, 4096, 8192],
                               config=SculptConfig(steps=args.steps, progress=False),
                               reference_limit=args.reference_limit)
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print(table.to_string(index=False))
    if args.out:
        from zipkv.book import provenance

        run = provenance("bench")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        table.assign(commit=run["commit"], date=run["date"]).to_csv(args.out, index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
