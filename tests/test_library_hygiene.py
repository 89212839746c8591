"""Library hygiene: importing zipkv changes no environment variable (Triton's interpreter is the
caller's choice on a CPU), and the library imports without the book's dependencies (the `book` extra)."""
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
names = [m.name for m in pkgutil.walk_packages(zipkv.__path__, "zipkv.") if m.name != "zipkv.__main__"]
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
