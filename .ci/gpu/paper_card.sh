#!/usr/bin/env bash
# The paper's own card: ZipFusion's paper measured on an H100, which the `device` tool lends more often than the
# H200 that the chapters' committed numbers come from. On an H100 this tunes the decode kernels' launch options for
# it (`bench tune --write`: the card's entry in zipkv/kernels/decode_tuning.json), then times decode attention at
# Fig. 4's Llama-3.1-8B-shape points and runs Fig. 5's setting (zipkv.throughput.figure5) there, into
# results/paper/*_h100.csv. Started like job.sh: `bash .ci/gpu/start.sh <commit> paper_card`.
cd /root/run
export PYTHONPATH=/tmp/site:$PWD ZIPKV_GGUF=/root/zipkv/SmolLM2-135M-Instruct.Q4_1.gguf ZIPKV_PG19=$PWD/.gpu/pg19
export ZIPKV_COMMIT=$(cat COMMIT)
step() { echo "=== $(date -u +%H:%M:%S) $*"; "$@"; echo "=== rc=$? $(date -u +%H:%M:%S)"; }
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100; then echo "=== not an H100: nothing to do"; touch JOB-DONE; exit 0; fi
KV=results/paper/model_data_kv_cache.csv
mkdir -p results/paper/h100
step python3 -m zipkv bench tune --kernel gluon --shape llama3.1-8b --real-kv $KV --write --out results/paper/h100/tune_gluon_llama.csv
step python3 -m zipkv bench tune --kernel triton --shape llama3.1-8b --real-kv $KV --write --out results/paper/h100/tune_triton_llama.csv
cp zipkv/kernels/decode_tuning.json results/paper/h100/decode_tuning.json
step python3 -m zipkv bench attention --shape llama3.1-8b --real-kv $KV --out results/paper/h100/latency_llama.csv
step python3 - <<'PY'
from zipkv import book
from zipkv.throughput import figure5
out = "results/paper/h100/throughput.csv"
res = figure5(repeats=3, profile=True, mma_baseline=True, restore_timed_steps=64, progress_csv=out)
run = book.provenance("bench")
res["table"].assign(device=run["device"], commit=run["commit"], date=run["date"]).to_csv(out, index=False)
PY
touch JOB-DONE
