#!/usr/bin/env bash
# The GPU work of the open issues, in order of importance (in case the device time runs out). Started by
# `bash .ci/gpu/start.sh <commit>` after calls a and b of ../shared/DEVICE.md's recipe (the embedded model), then
# pack.sh until JOB-DONE; commit what comes back (book/, results/paper/) and re-render the findings page.
#  1. the latency chapter (Fig. 4 grid, the few-requests panel with FlashInfer FP8, the engine's long requests; ~8 min);
#     on another card the same points through `bench attention` into a table of their own (ratios only)
#  2. the escape format's kernel (.ci/gpu/escape.sh; carry .gpu/escape_kv into the tree's .gpu/)
#  3. the decode kernels' GPU tests (every page kind, >16 splits, CUDA graphs, validate mode; ~5 min)
#  4. `zipkv.compress` seconds at the three shapes x 2K/8K/32K (the distillation-speed chapter's table; ~4 min)
#  5. the memory manager's serving curves at Llama-3.1-8B shapes (wall clock; ~5 min)
cd /root/run
export PYTHONPATH=/tmp/site:$PWD ZIPKV_GGUF=/root/zipkv/SmolLM2-135M-Instruct.Q4_1.gguf ZIPKV_PG19=$PWD/.gpu/pg19
export ZIPKV_COMMIT=$(cat COMMIT)   # the tree here is no git checkout: the provenance boxes name the commit it is
step() { echo "=== $(date -u +%H:%M:%S) $*"; "$@"; echo "=== rc=$? $(date -u +%H:%M:%S)"; }
h200() { nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; }
KV=results/paper/model_data_kv_cache.csv
if h200; then
  step python3 -m zipkv.study book --profile paper --force --no-html --only zipfusion_attention_latency
else   # the committed chapter is the H200's (its kernels' tuning): here only the ratios, in a table of this card's
  step python3 -m zipkv bench attention --contexts 8192 32768 131072 --batches 1 4 16 --real-kv $KV \
    --out results/paper/zipfusion_few_requests_other_card.csv
  step python3 -c "from zipkv.study.experiments import throughput; throughput.few_requests().to_csv('results/paper/zipfusion_few_requests_engine_other_card.csv', index=False)"
fi
OUT=/root/run/results/escape_gpu step bash .ci/gpu/escape.sh   # the escape format's kernel: tests and latency (~4 min)
step python3 -m pytest -q -p no:cacheprovider tests/test_decode_mma.py tests/test_decode_attention.py tests/test_format_faults.py
if h200; then
  step python3 -c "from zipkv.bench.distill import compress_speed; compress_speed(out='results/paper/distill_speed_compress.csv', progress=False)"
fi
step python3 -c "
from zipkv.study.experiments import memory_manager as e
r = e.run(device='cuda', shape='llama3.1-8b', requests=80, prompt_lengths=(2048, 16384), output_lengths=(64, 256),
          rate=32.0, rates=(6, 8, 10, 12, 14, 16, 20, 32), budget_requests=16, pages_per_chunk=16, reserve_ratio=0.5,
          ttft_limit_s=2.0, seed=0)
e.save(r, 'results/paper/memory_manager_gpu.csv')"
touch JOB-DONE
