#!/usr/bin/env bash
# The GPU work of the open issues, in order of importance (in case the device time runs out). Started by
# `bash .ci/gpu/start.sh <commit>` after calls a and b of ../shared/DEVICE.md's recipe (the embedded model), then
# pack.sh until JOB-DONE; commit what comes back (book/, results/paper/) and re-render the findings page.
#  1. on the H200, `zipkv.compress` seconds at Llama-3.1-8B's shape and 32K tokens (~2 min; the row replaces that
#     point of the distillation-speed chapter's table); elsewhere after step 2, into a table of that card's
#  2. with ZIPKV_SERVING_TEST set, the serving test on the GPU (the fused kernel against generate, arrivals and
#     compression on; passed on an H100 at d71de87), then the memory manager's serving curves at Llama-3.1-8B shapes (wall clock; rows kept as measured; admission seconds per
#     request; at most 7 min; the rates bracket saturation: 24 requests at 1-2.5/s left uncompressed serving
#     unsaturated on an H100)
#  3. on the H200 the latency chapter (Fig. 4 grid, the few-requests panel, the engine's long requests; ~8 min)
#  4. the escape format's kernel and tokens/s (.ci/gpu/escape.sh, .ci/gpu/escape_throughput.py; carry .gpu/escape_kv)
#  5. with ZIPKV_MMA_TESTS set, the fused kernel's GPU tests (every page kind, >16 splits, CUDA graphs; ~5 min; 50 of
#     50 passed on an H100 at d71de87)
# Without calls a and b (no model) steps 1, 3-5 run; carry [".gpu/whl", ".gpu/pg19"] (+ ".gpu/escape_kv" where the
# working tree leaves room: 64 MiB in all).
cd /root/run
export PYTHONPATH=/tmp/site:$PWD ZIPKV_GGUF=/root/zipkv/SmolLM2-135M-Instruct.Q4_1.gguf ZIPKV_PG19=$PWD/.gpu/pg19
export ZIPKV_COMMIT=$(cat COMMIT)   # the tree here is no git checkout: the provenance boxes name the commit it is
step() { echo "=== $(date -u +%H:%M:%S) $*"; "$@"; echo "=== rc=$? $(date -u +%H:%M:%S)"; }
h200() { nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; }
llama32k() { step timeout 300 python3 -c "from zipkv.bench.distill import compress_speed; compress_speed(('llama3.1-8b',), (32768,), out='$1', progress=False)"; }
if h200 && [ -z "$ZIPKV_ONLY_SERVING" ]; then llama32k results/paper/distill_speed_compress_llama32k.csv; fi
if [ -f "$ZIPKV_GGUF" ]; then
  [ -n "$ZIPKV_SERVING_TEST" ] && step timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_serving.py -k "embedded_model and cuda"
  if [ -n "$ZIPKV_ONLY_SERVING" ]; then n=40 rates="1, 2, 4" top=4.0; else n=60 rates="1, 2, 3, 4, 6" top=6.0; fi
  step timeout 420 python3 -c "
from zipkv.study.experiments import memory_manager as e
r = e.run(device='cuda', shape='llama3.1-8b', requests=$n, prompt_lengths=(2048, 16384), output_lengths=(64, 256),
          rate=$top, rates=($rates), variants=('uncompressed', 'shared pool'), budget_requests=16, pages_per_chunk=16, reserve_ratio=0.5,
          ttft_limit_s=2.0, seed=0, progress_csv='results/paper/memory_manager_gpu_progress.csv')
e.save(r, 'results/paper/memory_manager_gpu_run.csv')"
fi
[ -n "$ZIPKV_ONLY_SERVING" ] && { touch JOB-DONE; exit 0; }     # a short device budget: the serving curves alone
h200 || llama32k results/paper/distill_speed_compress_other_card.csv
h200 && step python3 -m zipkv.study book --profile paper --force --no-html --only zipfusion_attention_latency
[ -f .gpu/escape_kv/blocks.pt ] && OUT=/root/run/results/escape_gpu step bash .ci/gpu/escape.sh
[ -f .gpu/escape_kv/blocks.pt ] && step timeout 300 python3 .ci/gpu/escape_throughput.py results/paper/escape_format_throughput.csv
[ -n "$ZIPKV_MMA_TESTS" ] && step timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_decode_mma.py
touch JOB-DONE
