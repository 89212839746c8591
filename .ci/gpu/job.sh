#!/usr/bin/env bash
# The GPU work of the open issues, in order of importance (essentials first, in case the device time runs
# out): the GPU-only tests, then the paper-profile chapters whose executed notebooks and CSVs are committed.
cd /root/run
export PYTHONPATH=/tmp/site:$PWD ZIPKV_GGUF=/root/zipkv/SmolLM2-135M-Instruct.Q4_1.gguf ZIPKV_PG19=$PWD/.gpu/pg19
step() { echo "=== $(date -u +%H:%M:%S) $*"; "$@"; echo "=== rc=$? $(date -u +%H:%M:%S)"; }
step python3 -m pytest -q -p no:cacheprovider tests/test_decode_mma.py tests/test_lossless_chapter.py tests/test_engine.py \
  -k "packed_pages or lossless or reads or sentences or changed or same_kernel or fused_kernel_greedy"
step python3 -m zipkv book --profile paper --force --no-html --only zipfusion_lossless_format
step python3 -m zipkv book --profile paper --force --no-html --only zipfusion_throughput
step python3 -m zipkv book --profile paper --force --no-html --only kvsculpt_dampening kvsculpt_static_budget \
  kvsculpt_head_asymmetry kvsculpt_pilot_budget kvsculpt_optimizer zipfusion_restore_baselines
step python3 -m zipkv book --profile paper --force --no-html --only kvsculpt_kl_sources   # its held-out side table
touch JOB-DONE
