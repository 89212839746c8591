"""Command line: ``python -m zipkv COMMAND``.

The library's commands (benchmarks a user runs on their own GPU):

``python -m zipkv bench attention|pack [...] [--out CSV]`` — decode attention (ZipFusion Fig. 4) and the pack kernel.
``python -m zipkv bench tune [--kernel gluon] [--write]`` — time decode-attention launch options per specialisation, keep the best.
``python -m zipkv bench distill [--contexts N ...] [--steps S] [--out CSV]`` — KVSculpt solvers, reference vs batched.
``python -m zipkv bench ncu --out TXT`` — the decode and pack kernels under Nsight Compute (needs ``ncu``).
``python -m zipkv bench format [--out CSV]`` — the plain-torch format reference (eligible, pack, unpack) vs a plain scan.

The study's commands (the book: ``zipkv.study``) are added through the ``zipkv.commands`` entry points of the installed
package (``pip install -e .``); ``python -m zipkv.study`` runs the same command line from a checkout that is not installed.
The library itself never imports the study.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

GPU_BENCHMARKS = ("attention", "pack", "tune", "ncu", "ncu-targets")
"""Benchmarks that time GPU kernels (``distill`` and ``format`` also run on the CPU)."""

EXTENSIONS = "zipkv.commands"
"""The entry-point group of command-line extensions: each names a module with ``register(commands) -> {name: run}``
(``commands``: the parser's subparsers; ``run(args) -> exit status``)."""


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an int ≥ 1 (a bad one is argparse's one-line usage error, before any work)."""
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    """An argparse type: an int ≥ 0."""
    return _int_at_least(text, 0)


BENCH_OPTIONS = {
    "shape": ("attention", "tune"), "contexts": ("attention", "tune", "distill"), "batches": ("attention", "tune"),
    "real_kv": ("attention", "tune"), "reps": ("attention", "tune"), "steps": ("distill",),
    "reference_limit": ("distill",), "kernel": ("tune",), "write": ("tune",), "splits": ("attention",),
    "maxnreg": ("attention",), "stages": ("attention",), "methods": ("attention",), "kernels": ("attention",),
    "out": ("attention", "pack", "tune", "distill", "ncu", "format"),
}
"""The benchmarks each ``bench`` option applies to: an option given to another one is an error, not ignored."""
BENCH_DEFAULTS = dict(shape="llama3.1-8b", reps=30, steps=100, reference_limit=4, kernel="triton")


def installed_extensions() -> list:
    """The modules of the installed ``zipkv.commands`` entry points (none where the package is not installed)."""
    from importlib.metadata import entry_points

    return [ep.load() for ep in entry_points(group=EXTENSIONS)]


def _add_bench(commands) -> None:
    what = "benchmarks of the kernels, the format and the distiller: print the table, save it with --out"
    bench = commands.add_parser("bench", description=what)
    bench.add_argument("what", choices=["attention", "pack", "tune", "distill", "ncu", "ncu-targets", "format"])
    bench.add_argument("--shape", default=None, help="attention, tune: attention shape (see zipkv.bench.ATTENTION_SHAPES; "
                                                     "default llama3.1-8b)")
    bench.add_argument("--contexts", type=positive_int, nargs="+", default=None,
                       help="context lengths (attention: 2048 8192; distill: 1024 2048 4096 8192; tune: 8192, the "
                            "first one given)")
    bench.add_argument("--batches", type=positive_int, nargs="+", default=None, help="attention: 32 64 96; tune: 64")
    bench.add_argument("--real-kv", type=Path, default=None,
                       help="first chapter's results CSV: also time the measured mix of compressed blocks")
    bench.add_argument("--reps", type=positive_int, default=None,
                       help="attention, tune: timed calls per point (median; default 30)")
    bench.add_argument("--steps", type=positive_int, default=None, help="distill: outer L-BFGS steps (default and paper: 100)")
    bench.add_argument("--reference-limit", type=positive_int, default=None,
                       help="distill: problems the reference solver runs per timed context (scaled to the context; "
                            "default 4)")
    bench.add_argument("--kernel", choices=["triton", "gluon"], default=None,
                       help="tune: which decode kernel's launch options (default triton; gluon: the mma layouts)")
    bench.add_argument("--write", action="store_true",
                       help="tune: store the best launch options in zipkv/kernels/decode_tuning.json")
    bench.add_argument("--splits", type=nonnegative_int, nargs="+", default=None,
                       help="attention: the decode kernels' split-KV factors to run each row with "
                            "(0: the plan's choice, the default)")
    bench.add_argument("--maxnreg", type=nonnegative_int, nargs="+", default=None,
                       help="attention: register caps per thread to run zipkv's kernels with (0: none; default: theirs)")
    bench.add_argument("--stages", type=positive_int, nargs="+", default=None,
                       help="attention: pipeline depths (launch option 'stages') to run zipkv's kernels with "
                            "(default: theirs)")
    bench.add_argument("--methods", nargs="+", default=None, metavar="METHOD",
                       help="attention: the methods to time (names of zipkv.bench.attention.METHODS; default all)")
    bench.add_argument("--kernels", nargs="+", choices=["triton", "gluon"], default=None,
                       help="attention: zipkv's decode kernels to time (default: every one the head_dim has)")
    bench.add_argument("--out", type=Path, default=None,
                       help="save the table here (CSV, with the commit and date of the run; ncu: the report, default ./zipfusion_decode_ncu.txt)")


def main(argv: list[str] | None = None, extensions: list | None = None) -> int:
    """``python -m zipkv``: parse ``argv`` (default ``sys.argv``) and run the command; the exit status (0: done).
    extensions: modules adding commands (default: :func:`installed_extensions`)."""
    parser = argparse.ArgumentParser(prog="python -m zipkv", usage="python -m zipkv [-h] COMMAND ...",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help=argparse.SUPPRESS,
                                     prog="python -m zipkv")
    _add_bench(commands)
    library = dict(commands.choices)
    runs = {"bench": _bench}
    for module in installed_extensions() if extensions is None else extensions:
        runs.update(module.register(commands))
    listing = lambda names: "\n".join(f"  {n:<14}{commands.choices[n].description or ''}" for n in names)  # noqa: E731
    study = [n for n in commands.choices if n not in library]
    parser.description = ("library commands:\n" + listing(library) + "\n\nstudy commands (the book, zipkv.study):\n"
                          + (listing(study) if study else "  none: install the package (pip install -e .) or run "
                                                          "python -m zipkv.study"))
    args = parser.parse_args(argv)
    return runs[args.command](args)


def out_problem(out: Path | None) -> str | None:
    """Why ``--out`` cannot be written (a folder, a parent that is a file), found before the run; None when it can."""
    if out is None:
        return None
    if out.is_dir():
        return f"--out {out}: is a folder; expected the path of a file to write"
    parent = next((p for p in out.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        return f"--out {out}: {parent} is a file, not a folder"
    return None


def bench_problem(args) -> str | None:
    """Why the ``bench`` options cannot run, found before any work (and before the GPU check): an option that another
    benchmark takes, an unknown shape or method, a missing ``--real-kv`` file, distill contexts too short for the
    benchmark's budget; None when they can. Fills the defaults of the options not given."""
    wrong = [name for name, takes in BENCH_OPTIONS.items()
             if getattr(args, name) not in (None, False) and args.what not in takes]
    if wrong:
        return "; ".join(f"--{n.replace('_', '-')} applies to bench {' / '.join(BENCH_OPTIONS[n])} only, not "
                         f"{args.what}" for n in wrong)
    for name, value in BENCH_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.what in ("attention", "tune"):
        from zipkv.bench.attention import ATTENTION_SHAPES, METHODS

        if args.shape not in ATTENTION_SHAPES:
            return f"--shape {args.shape}: expected one of {sorted(ATTENTION_SHAPES)}"
        bad = [m for m in args.methods or () if m not in METHODS]
        if bad:
            return f"--methods {' '.join(bad)}: expected names from {list(METHODS)}"
        if args.real_kv is not None and not args.real_kv.is_file():
            return f"--real-kv {args.real_kv}: no such file (the first chapter's results CSV)"
    if args.what == "distill":
        from zipkv.bench.distill import speed_sweep
        from zipkv.distill.kvsculpt import budget_for_ratio
        import inspect

        defaults = inspect.signature(speed_sweep).parameters
        m, ratios = defaults["m"].default, defaults["ratios"].default
        for n in args.contexts or ():
            try:
                for r in ratios:
                    budget_for_ratio(r, n, m)
            except ValueError as err:
                return f"--contexts {n}: too short for the benchmark's budget (ratio {ratios[0]}, m = {m} verbatim tokens): {err}"
    return None


def _bench(args) -> int:
    """``python -m zipkv bench``: run the benchmark ``args.what``, print its table, save it with ``--out``."""
    for problem in (out_problem(args.out), bench_problem(args)):
        if problem is not None:
            print(f"zipkv bench {args.what}: {problem}", file=sys.stderr)
            return 1
    if args.what in GPU_BENCHMARKS:
        import torch

        if not torch.cuda.is_available():
            print(f"zipkv bench {args.what}: needs a CUDA GPU, and this machine has none", file=sys.stderr)
            return 1
    try:
        table = _bench_table(args)
    except (ValueError, FileNotFoundError) as err:              # bad input found by the benchmark: one line
        print(f"zipkv bench {args.what}: {err}", file=sys.stderr)
        return 1
    if table is None:
        return 0
    try:
        save_table(table, args.out)
    except OSError as err:                                      # e.g. no permission: the table was printed
        print(f"zipkv bench {args.what}: --out {args.out}: {err.strerror or err}", file=sys.stderr)
        return 1
    return 0


def save_table(table, out: Path | None) -> None:
    """Print ``table``; with ``out``, save it there as CSV with the run's commit and date."""
    import pandas as pd

    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print(table.to_string(index=False))
    if out:
        from zipkv.provenance import provenance

        run = provenance("bench")
        out.parent.mkdir(parents=True, exist_ok=True)
        table.assign(commit=run["commit"], date=run["date"]).to_csv(out, index=False)


def _bench_table(args):
    """The table of benchmark ``args.what`` (None for the commands that print their own report)."""
    import pandas as pd

    splits = [x or None for x in args.splits or [0]]            # 0: the plan's own choice

    from zipkv import bench as benchmarks

    if args.what == "ncu-targets":                 # what `bench ncu` runs under ncu
        benchmarks.nsight_targets()
        return None
    if args.what == "ncu":
        print(benchmarks.nsight_report(args.out or Path("zipfusion_decode_ncu.txt")))   # a committed file only if told
        return None
    if args.what == "attention":
        fraction = benchmarks.measured_compressible_fraction(args.real_kv) if args.real_kv else None
        return benchmarks.attention_benchmark(args.shape, args.contexts or [2048, 8192],
                                              args.batches or [32, 64, 96], fraction, reps=args.reps,
                                              splits=splits,
                                              maxnregs=args.maxnreg or (None,), stages=args.stages or (None,),
                                              **({"methods": args.methods} if args.methods else {}),
                                              kernels=args.kernels)
    if args.what == "tune":
        fraction = benchmarks.measured_compressible_fraction(args.real_kv) if args.real_kv else None
        contexts = args.contexts or [8192]
        table = benchmarks.tune_decode_attention(args.shape, contexts[0], (args.batches or [64])[0], fraction,
                                                 reps=args.reps, kernel=args.kernel)
        if args.write:
            print("stored:", benchmarks.write_tuning(table))
        return table
    if args.what == "format":
        import torch

        from zipkv.bench.format import format_benchmark

        device = "cuda" if torch.cuda.is_available() else "cpu"
        return pd.concat([format_benchmark(head_dim=d, device=device) for d in (64, 128)], ignore_index=True)
    if args.what == "pack":
        return pd.DataFrame([benchmarks.pack_benchmark(head_dim=d) for d in (64, 128)])
    import torch

    from zipkv import data, models
    from zipkv.bench.distill import speed_sweep
    from zipkv.distill import SculptConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = models.load_model(dtype=torch.float32, device=device)
    table, _ = speed_sweep(model, tokenizer, data.load_books(), contexts=args.contexts or [1024, 2048, 4096, 8192],
                           config=SculptConfig(steps=args.steps, progress=False),
                           reference_limit=args.reference_limit)
    return table


if __name__ == "__main__":
    sys.exit(main())
