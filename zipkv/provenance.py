"""Provenance of a run: the device, library versions, git commit and date that a benchmark's table or an executed
notebook records beside its numbers."""
from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
from pathlib import Path

__all__ = ["SOURCE_ROOT", "device_name", "git_commit", "provenance"]

SOURCE_ROOT = Path(__file__).resolve().parent.parent
"""The folder holding the ``zipkv`` package: the repository in a checkout (its commit is the code that runs)."""


def git_commit(root: Path = SOURCE_ROOT) -> str:
    """The short commit of ``root``'s checkout (``ZIPKV_COMMIT`` if set), marked ``+uncommitted changes`` when its
    tracked files outside ``book/`` differ from it; a sentence where ``root`` is no git checkout."""
    if os.environ.get("ZIPKV_COMMIT"):
        return os.environ["ZIPKV_COMMIT"]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                                text=True, check=True).stdout.strip()
        # book/ holds this pipeline's executed notebooks: a batch's earlier chapters must not mark its later ones
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)book"],
                               cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        return commit + ("+uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout; set ZIPKV_COMMIT)"


def device_name() -> str:
    """The device a run computes on, for provenance: the GPU and its CUDA version, else the CPU's model and cores."""
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU: {cpu}, {os.cpu_count()} cores"


def provenance(profile: str, root: Path = SOURCE_ROOT) -> dict:
    """The provenance record of a run of ``profile``: device, library versions, git commit (marked when the tree has
    uncommitted changes outside ``book/``) and date."""
    import torch
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    return {
        "profile": profile,
        "device": device_name(),
        "torch": torch.__version__,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "commit": git_commit(root),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
