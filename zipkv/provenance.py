"""Provenance of a run: the device, library versions, git commit and date that a benchmark's table or an executed
notebook records beside its numbers; on a GPU, also the CUDA runtime, the driver, the board's power limit and its
highest SM clock (from ``nvidia-smi``), so that a timing can be read with the stack and the card that made it."""
from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
from pathlib import Path

__all__ = ["SOURCE_ROOT", "device_name", "git_commit", "gpu_details", "package_version", "provenance"]

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


def package_version(*names: str) -> str:
    """The installed version of the first of ``names`` (distribution names) that is installed, without importing it;
    ``"not installed"`` when none is."""
    from importlib import metadata

    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


GPU_QUERY = {"driver": "driver_version", "power_limit_w": "power.limit", "sm_clock_max_mhz": "clocks.max.sm"}
"""What :func:`gpu_details` asks ``nvidia-smi --query-gpu`` for: provenance key -> query field."""


def gpu_details() -> dict:
    """On a CUDA GPU: ``cuda`` (torch's CUDA runtime), and from ``nvidia-smi``, where it answers, the ``driver``, the
    board's ``power_limit_w`` and its highest SM clock ``sm_clock_max_mhz``; empty without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return {}
    out = {"cuda": str(torch.version.cuda)}
    try:
        done = subprocess.run(["nvidia-smi", "-i", str(torch.cuda.current_device()),
                               f"--query-gpu={','.join(GPU_QUERY.values())}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return out
    values = [v.strip() for v in done.stdout.strip().split(",")] if done.returncode == 0 else []
    if len(values) == len(GPU_QUERY):
        out.update({k: v for k, v in zip(GPU_QUERY, values) if v and not v.startswith("[")})  # "[N/A]": unrecorded
    return out


def provenance(profile: str, root: Path = SOURCE_ROOT) -> dict:
    """The provenance record of a run of ``profile``: device, library versions (FlashInfer's where it is installed),
    git commit (marked when the tree has uncommitted changes outside ``book/``) and date, and on a GPU
    :func:`gpu_details`."""
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
        "flashinfer": package_version("flashinfer-python", "flashinfer"),
        "python": platform.python_version(),
        **gpu_details(),
        "commit": git_commit(root),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
