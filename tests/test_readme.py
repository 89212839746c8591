"""The README's Python examples run as written, each in a fresh interpreter (without a GPU: Triton's interpreter
and the engine's torch reference attention)."""
import os
import re
import subprocess
import sys

import pytest
import torch

from zipkv.study.book import REPO_ROOT

EXAMPLES = re.findall(r"```python\n(.*?)```", (REPO_ROOT / "README.md").read_text(), re.S)


def test_the_readme_examples_are_found():
    """The library's calls, in the order a user meets them: a distilled cache in generate, text in and answers out,
    the serving engine, the decode kernel, the format; then the captured cache."""
    assert len(EXAMPLES) == 6
    for example, call in zip(EXAMPLES, ("zipkv.compress(", "zipkv.answer(", "Engine(", "plan(", "zipkv.pack(",
                                        "capture(")):
        assert call in example


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_a_readme_example_runs_as_written(index, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", EXAMPLES[index]], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip() or "print(" not in EXAMPLES[index]
