"""The decode and pack kernels under Nsight Compute (``python -m zipkv bench ncu``): the Gluon decode kernel
on all-compressible, uncompressed and measured-mix KV at the Llama-3.1-8B and SmolLM2-135M attention shapes, and
the pack kernel."""
from __future__ import annotations

import torch

from zipkv.bench.attention import attention_inputs, measured_compressible_fraction, mix_mask
from zipkv.bench.pack import pack_inputs

__all__ = ["nsight_targets", "nsight_report", "NCU_SECTIONS", "NCU_METRICS", "NCU_TARGETS", "NCU_KERNELS"]

NCU_SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "Occupancy", "WarpStateStats", "LaunchStats")
NCU_STALLS = ("long_scoreboard", "short_scoreboard", "wait", "selected", "not_selected", "mio_throttle", "barrier",
              "math_pipe_throttle", "dispatch_stall", "branch_resolving", "lg_throttle", "no_instructions")
"""Warp stall reasons sampled per kernel (``smsp__pcsamp_warps_issue_stalled_<reason>``)."""
NCU_METRICS = tuple(f"smsp__pcsamp_warps_issue_stalled_{r}" for r in NCU_STALLS) + (
    "smsp__inst_executed.sum", "smsp__inst_executed_op_shared_ld.sum",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum")
NCU_SHAPES = (("llama3.1-8b", ""), ("smollm2-135m", "SmolLM2 "))
"""Attention shapes (:data:`zipkv.bench.attention.ATTENTION_SHAPES`) the decode kernel is profiled at, with the
prefix of their targets' names."""
NCU_TARGETS = tuple(f"{prefix}decode {data}" for _, prefix in NCU_SHAPES
                    for data in ("all compressed", "uncompressed", "measured mix")) + ("pack",)
MIX_CSV = "results/paper/model_data_kv_cache.csv"
"""The first chapter's table: the measured mix's compressible-block fractions (repository-relative)."""
NCU_KERNELS = ("_pipelined_kernel", "_pack_kernel")
"""Kernel names profiled: the Gluon decode kernel's pipelined launch (the only one a uniform cache needs: it
merges its own splits) and the pack kernel."""


NCU_CTX, NCU_BATCH = 8192, 64
"""Tokens per request and batch of the decode kernels' targets."""


def nsight_targets(ctx: int = NCU_CTX, batch: int = NCU_BATCH):
    """Launch the kernels :func:`nsight_report` profiles, in the order of :data:`NCU_TARGETS`, each once inside
    the NVTX range ``zipkv`` after a warm-up call outside it: at each shape of :data:`NCU_SHAPES` the Gluon decode
    kernel (mma layouts, default launch options) on all-compressible KV, on the same KV uncompressed and on the
    measured mix (blocks compressed at :data:`MIX_CSV`'s fractions: its MIXED specialisation), and the pack
    kernel on 1 GiB of head_dim-128 pages."""
    from zipkv.provenance import SOURCE_ROOT
    from zipkv.kernels.decode_attention import plan
    from zipkv.kernels.pack import pack_pages
    from zipkv.paged import build_paged_cache

    gen = torch.Generator(device="cuda").manual_seed(0)
    calls = []
    for shape, _ in NCU_SHAPES:
        k, v, q = attention_inputs(shape, ctx, batch, gen)
        mix = mix_mask(k.shape[0], k.shape[1], ctx, k.shape[3], measured_compressible_fraction(SOURCE_ROOT / MIX_CSV), 0)
        for mode in ("eligible", "none", mix):
            cache, indptr, indices, last = build_paged_cache(k, v, compress=mode, k_layout="k_mma", v_layout="v_mma")
            calls.append(lambda run=plan(indptr, indices, last, cache, q.shape[1]).run, q=q: run(q))
    pages, out = pack_inputs(128, 1 << 30, gen)
    calls.append(lambda: pack_pages(pages, "token", out=out))
    for call in calls:
        call()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("zipkv")
        call()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()


def nsight_report(out, ncu: str = "ncu", timeout: float = 900) -> str:
    """Profile :func:`nsight_targets` under ``ncu --clock-control none`` (sections :data:`NCU_SECTIONS`, metrics
    :data:`NCU_METRICS`) in a subprocess and write the report to ``out`` behind a header with the device, driver,
    date, commit and the launch options in use. Returns the report text."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from zipkv.provenance import provenance
    from zipkv.kernels.decode_mma import MMA_LAUNCH

    cmd = [ncu, "--clock-control", "none", "--nvtx", "--nvtx-include", "zipkv/", "-k", "regex:" + "|".join(NCU_KERNELS)]
    for section in NCU_SECTIONS:
        cmd += ["--section", section]
    cmd += ["--metrics", ",".join(NCU_METRICS), sys.executable, "-m", "zipkv", "bench", "ncu-targets"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"ncu failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.strip()
    record = provenance("ncu")
    header = [f"# zipkv kernels under Nsight Compute: {' '.join(cmd[:7])} ..., sections {', '.join(NCU_SECTIONS)}; "
              f"stall reasons and shared-memory counters as metrics",
              f"# device: {record['device']} (driver {driver}); date: {record['date']}; commit: {record['commit']}",
              f"# launch options of the Gluon kernel: {json.dumps(MMA_LAUNCH)}",
              f"# kernels, in order: {'; '.join(NCU_TARGETS)} (zipkv.bench.nsight.nsight_targets: Llama-3.1-8B and "
              f"SmolLM2-135M attention shapes, ctx {NCU_CTX}, batch {NCU_BATCH}; pack: 1 GiB of head_dim-128 pages)"]
    text = "\n".join(header) + "\n" + done.stdout
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text)
    return text
