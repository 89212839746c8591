#!/usr/bin/env bash
# The GPU work of the open issues, in order of importance (in case the device time runs out). Started by
# `bash .ci/gpu/start.sh <commit>` after calls a and b of ../shared/DEVICE.md's recipe (the embedded model), then
# pack.sh until JOB-DONE; commit what comes back (book/, results/paper/) and re-render the findings page.
#  1. the escape format's kernel (.ci/gpu/escape.sh: its GPU tests, then latency on real KV; carry .gpu/escape_kv)
#  2. the decode API's and the format faults' GPU tests (plan/run, validate mode, CUDA graphs; ~3 min)
#  3. tokens/s under Fig. 5's budget with escape pages beside ZipFusion's format and uncompressed (~4 min)
#  4. the paper's grid: on the H200 the latency chapter (Fig. 4 grid, the few-requests panel, the engine's long
#     requests; ~8 min), on an H100 the grid's points (~2 min) to set beside the committed H100 chapter's
#  5. `zipkv.compress` seconds (the distillation-speed chapter's table; ~4 min on the H200; elsewhere Llama-3.1-8B's
#     shape at 32K tokens only, into a table of that card's)
#  6. the fused kernel's GPU tests (every page kind, >16 splits, CUDA graphs; ~3 min)
#  7. the memory manager's serving curves at Llama-3.1-8B shapes (wall clock; at most 7 min; needs the model)
# Without calls a and b (no model) steps 1-4 run; carry [".gpu/whl", ".gpu/escape_kv"] (+ ".gpu/pg19" with the model).
cd /root/run
export PYTHONPATH=/tmp/site:$PWD ZIPKV_GGUF=/root/zipkv/SmolLM2-135M-Instruct.Q4_1.gguf ZIPKV_PG19=$PWD/.gpu/pg19
export ZIPKV_COMMIT=$(cat COMMIT)   # the tree here is no git checkout: the provenance boxes name the commit it is
step() { echo "=== $(date -u +%H:%M:%S) $*"; "$@"; echo "=== rc=$? $(date -u +%H:%M:%S)"; }
h200() { nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; }
OUT=/root/run/results/escape_gpu step bash .ci/gpu/escape.sh
step timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_decode_attention.py tests/test_format_faults.py
step timeout 300 python3 .ci/gpu/escape_throughput.py results/paper/escape_format_throughput.csv
if h200; then
  step python3 -m zipkv.study book --profile paper --force --no-html --only zipfusion_attention_latency
  step python3 -c "from zipkv.bench.distill import compress_speed; compress_speed(out='results/paper/distill_speed_compress.csv', progress=False)"
else   # the latency chapter is the H200's (its kernels' tuning); on an H100 the paper's grid against the committed
       # H100 chapter "On the paper's card" (results/paper/zipfusion_paper_card.csv), ratios from the same run
  step python3 -m zipkv bench attention --contexts 2048 8192 --batches 32 64 96 --real-kv results/paper/model_data_kv_cache.csv \
    --kernels gluon --methods flashinfer_tc zipkv_compressed --out results/paper/zipfusion_paper_grid_check.csv
  step python3 -c "from zipkv.bench.distill import compress_speed; compress_speed(('llama3.1-8b',), (32768,), out='results/paper/distill_speed_compress_other_card.csv', progress=False)"
fi
step timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_decode_mma.py
[ -f "$ZIPKV_GGUF" ] && step timeout 420 python3 -c "
from zipkv.study.experiments import memory_manager as e
r = e.run(device='cuda', shape='llama3.1-8b', requests=80, prompt_lengths=(2048, 16384), output_lengths=(64, 256),
          rate=32.0, rates=(6, 8, 10, 12, 14, 16, 20, 32), budget_requests=16, pages_per_chunk=16, reserve_ratio=0.5,
          ttft_limit_s=2.0, seed=0)
e.save(r, 'results/paper/memory_manager_gpu.csv')"
touch JOB-DONE
