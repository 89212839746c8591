"""GPU benchmarks, one module per thing measured:

* :mod:`~zipkv.bench.timing`: cold-L2 medians (:class:`ColdTimer`) and the copy bandwidth of the same run;
* :mod:`~zipkv.bench.baselines`: FlashInfer's paged decode (tensor-core and CUDA-core paths), torch SDPA and the
  fp32 reference;
* :mod:`~zipkv.bench.attention`: decode-attention latency of every method (ZipFusion Fig. 4);
* :mod:`~zipkv.bench.pack`: the pack kernel's throughput;
* :mod:`~zipkv.bench.nsight`: the kernels under Nsight Compute;
* :mod:`~zipkv.bench.tune`: launch tuning of the decode kernels (Triton, and Gluon with ``--kernel gluon``);
* :mod:`~zipkv.bench.engine`: a captured decode step's GPU time by kernel kind;
* :mod:`~zipkv.bench.distill`: KVSculpt's one-problem-at-a-time solver against the batched one (seconds per context);
* :mod:`~zipkv.bench.power`: the GPU's SM clock, power draw and power-cap share during a run;
* :mod:`~zipkv.bench.kv_fp8`: what an FP8 KV cache costs the model's next-token distributions (runs on the CPU).

Every timing is reported with the bytes it moved and its fraction of the copy bandwidth measured in the same
process, never against a typed-in constant. The names below are re-exported (``from zipkv import bench;
bench.attention_benchmark(...)``).
"""
from zipkv.bench.attention import (ATTENTION_SHAPES, KERNEL_LAYOUTS, METHODS, attention_benchmark,
                                   measured_compressible_fraction, mix_sweep, sweep_fractions)
from zipkv.bench.baselines import FlashInferDecode, sdpa_decode
from zipkv.bench.nsight import (NCU_KERNELS, NCU_METRICS, NCU_SECTIONS, NCU_STALLS, NCU_TARGETS, nsight_report,
                                nsight_targets)
from zipkv.bench.pack import pack_benchmark
from zipkv.bench.timing import L2_FLUSH_BYTES, ColdTimer, copy_bandwidth
from zipkv.bench.tune import TUNE_GRID, TUNE_PROGRAMS_PER_SM, choose_best, tune_decode_attention, write_tuning

__all__ = ["ATTENTION_SHAPES", "KERNEL_LAYOUTS", "METHODS", "attention_benchmark", "measured_compressible_fraction",
           "mix_sweep", "sweep_fractions",
           "FlashInferDecode", "sdpa_decode", "NCU_KERNELS", "NCU_METRICS", "NCU_SECTIONS", "NCU_STALLS",
           "NCU_TARGETS", "nsight_report", "nsight_targets", "pack_benchmark", "L2_FLUSH_BYTES", "ColdTimer",
           "copy_bandwidth", "TUNE_GRID", "TUNE_PROGRAMS_PER_SM", "tune_decode_attention", "choose_best", "write_tuning"]
