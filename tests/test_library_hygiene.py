"""Library hygiene: importing zipkv changes no environment variable (Triton's interpreter is the
caller's choice on a CPU), and the library imports without the book's dependencies (the `book` extra)."""
import json
import os
import subprocess
import sys

import torch

from zipkv import kernels

PROBE = """
import os, torch
import zipkv, zipkv.kernels, zipkv.kernels.pack as pack, zipkv.kernels.decode_attention
print("TRITON_INTERPRET" in os.environ)
try:
    pack.pack_pages(torch.zeros(2, 16, 64, dtype=torch.bfloat16))
except ValueError as err:
    print(err)
"""


def test_importing_the_kernels_sets_nothing_and_a_cpu_launch_says_how():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    changed, message = done.stdout.splitlines()
    assert changed == "False"
    assert message.startswith("dst is on cpu: zipkv's Triton kernels run on a CUDA GPU, or on the CPU in Triton's "
                              "interpreter") and "TRITON_INTERPRET=1" in message


def test_the_suite_runs_the_kernels_in_the_interpreter_only_without_a_gpu():
    """conftest.py chose the interpreter before anything imported triton where there is no GPU, and only there."""
    from zipkv.kernels import pack

    assert kernels.interpreted(pack._pack_kernel) == (not torch.cuda.is_available())


BLOCK_BOOK_EXTRA = """
import importlib, pkgutil, sys
BOOK = {"papermill", "ipykernel", "matplotlib", "jupyter_book", "jupyterlab", "nbformat", "IPython", "selenium"}

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BOOK:
            raise ImportError(f"blocked: {name} (the book extra)", name=name)

sys.meta_path.insert(0, Blocker())
import zipkv
names = [m.name for m in pkgutil.walk_packages(zipkv.__path__, "zipkv.") if not m.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
print(len(names))
"""


def test_the_library_imports_without_the_book_extra():
    done = subprocess.run([sys.executable, "-c", BLOCK_BOOK_EXTRA], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout) >= 10, "every zipkv module was imported"


def test_gpu_benchmarks_without_a_gpu_are_one_line():
    from zipkv.__main__ import GPU_BENCHMARKS

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    for what in GPU_BENCHMARKS[:2]:
        done = subprocess.run([sys.executable, "-m", "zipkv", "bench", what], capture_output=True, text=True, env=env)
        assert done.returncode == 1 and done.stderr == f"zipkv bench {what}: needs a CUDA GPU, and this machine has none\n"


def test_bad_command_lines_are_one_clear_line(tmp_path):
    """Bad numbers are argparse's usage error before any work; bad input a benchmark finds, and a --root that is no
    project, one line each (before: tracebacks, or "unknown profile 'quick': expected one of []")."""
    def run(*argv):
        return subprocess.run([sys.executable, "-m", "zipkv", *argv], capture_output=True, text=True,
                              env={**os.environ, "TRITON_INTERPRET": "1"})
    for argv, option in ((("bench", "distill", "--steps", "-1"), "--steps"),
                         (("bench", "distill", "--contexts", "0"), "--contexts")):
        done = run(*argv)
        assert done.returncode == 2 and f"argument {option}: expected an integer >= 1" in done.stderr, done.stderr
    done = run("book", "--root", str(tmp_path / "nope"), "--only", "model_data_kv_cache")
    assert done.returncode == 1 and done.stderr == (f"zipkv book: --root {tmp_path / 'nope'}: not a zipkv project folder "
                                                    "(expected params/ and notebooks/ in it)\n")
    done = run("bench", "distill", "--contexts", "64", "--steps", "1")     # shorter than the retain zone, m = 256
    assert done.returncode == 1 and done.stderr.startswith("zipkv bench distill: ") and \
        done.stderr.count("\n") == 1 and "m=256" in done.stderr, done.stderr


def test_an_out_path_that_cannot_be_written_is_one_line_before_the_run(tmp_path):
    """``--out`` naming a folder ran the whole benchmark, then ended in pandas' IsADirectoryError traceback."""
    (tmp_path / "file").write_text("x")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    folder = f"--out {tmp_path}: is a folder; expected the path of a file to write"
    for argv, says in ((("bench", "format", "--out", str(tmp_path)), folder),
                       (("bench", "attention", "--out", str(tmp_path)), folder),
                       (("bench", "format", "--out", str(tmp_path / "file" / "t.csv")),
                        f"--out {tmp_path / 'file' / 't.csv'}: {tmp_path / 'file'} is a file, not a folder")):
        done = subprocess.run([sys.executable, "-m", "zipkv", *argv], capture_output=True, text=True, env=env)
        assert done.returncode == 1 and done.stderr == f"zipkv bench {argv[1]}: {says}\n" and not done.stdout, \
            done.stderr[-2000:]


LIBRARY_SIDE_EFFECTS = """
import importlib, json, sys
from pathlib import Path
import zipkv
root = Path(zipkv.__file__).parent
# found from the files: pkgutil.walk_packages would import every package, the study's included, to list it
names = sorted(".".join(("zipkv",) + p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
               for p in root.rglob("*.py") if "study" not in p.relative_to(root).parts and p.stem != "__main__")
for name in names:
    importlib.import_module(name)
study = sorted(m for m in sys.modules if m.startswith("zipkv.study"))
tools = sorted(m for m in sys.modules if m.split(".")[0] in ("papermill", "jupyter_book", "matplotlib", "nbformat"))
print(json.dumps([names, study, tools]))
"""


def test_importing_every_library_module_loads_neither_the_study_nor_the_books_tools():
    done = subprocess.run([sys.executable, "-c", LIBRARY_SIDE_EFFECTS], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    names, study, tools = json.loads(done.stdout)
    assert len(names) >= 30 and "zipkv.memory.chunks" in names and "zipkv.kernels.decode_attention" in names
    assert study == [] and tools == [], (study, tools)


def import_graph() -> dict:
    """Every zipkv module's zipkv imports, lazy ones (inside functions) included: ``{module: {module, ...}}``."""
    import ast
    from pathlib import Path

    import zipkv

    root = Path(zipkv.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    found.add(t)
        graph[name] = found
    return graph


def test_no_library_module_imports_the_study_and_no_module_imports_in_a_circle():
    graph = import_graph()
    library = [m for m in graph if not m.startswith("zipkv.study")]
    assert len(library) >= 30 and any(m.startswith("zipkv.study.") for m in graph)
    upward = {m: sorted(t for t in graph[m] if t.startswith("zipkv.study")) for m in library}
    assert not {m: t for m, t in upward.items() if t}, "library modules importing the study"
    state, circles = {}, []

    def visit(m, path):
        state[m] = "open"
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                circles.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"
    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, circles


def test_the_import_graph_sees_lazy_and_relative_imports():
    """The checker itself: a function-level import and a relative import are edges."""
    graph = import_graph()
    assert "zipkv.study.book" in graph["zipkv.study.cli"]                     # inside a function
    assert "zipkv.distill.kvsculpt" in graph["zipkv.distill"]                  # from .kvsculpt import ...
