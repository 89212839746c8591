#!/usr/bin/env bash
# The paper's own card: ZipFusion's paper measured on an H100, which the `device` tool lends more often than the
# H200 that the other chapters' numbers come from. On an H100 this times decode attention at Fig. 4's
# Llama-3.1-8B-shape points and runs Fig. 5's setting there (without the restore baselines, whose buffers at their
# largest batch do not fit the H100's memory beside the budget), into the tables of the chapter "On the paper's
# card" (results/paper/zipfusion_paper_card*.csv). The card's launch options are tuned first when
# zipkv/kernels/decode_tuning.json has none for it (`bench tune --write`; commit the file and the tuning table).
# Started like job.sh: `bash .ci/gpu/start.sh <commit> paper_card`.
cd /root/run
export PYTHONPATH=/tmp/site:$PWD ZIPKV_GGUF=/root/zipkv/SmolLM2-135M-Instruct.Q4_1.gguf ZIPKV_PG19=$PWD/.gpu/pg19
export ZIPKV_COMMIT=$(cat COMMIT)
step() { echo "=== $(date -u +%H:%M:%S) $*"; "$@"; echo "=== rc=$? $(date -u +%H:%M:%S)"; }
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100; then echo "=== not an H100: nothing to do"; touch JOB-DONE; exit 0; fi
KV=results/paper/model_data_kv_cache.csv OUT=results/paper/zipfusion_paper_card
if ! python3 -c "import sys, torch; from zipkv.kernels import tuning; sys.exit(0 if tuning.tuned(torch.cuda.get_device_name(), 'raw') else 1)"; then
  step python3 -m zipkv bench tune --kernel gluon --shape llama3.1-8b --real-kv $KV --write --out /tmp/tune_gluon.csv
  step python3 -m zipkv bench tune --kernel triton --shape llama3.1-8b --real-kv $KV --write --out /tmp/tune_triton.csv
  python3 -c "import pandas as pd; pd.concat([pd.read_csv('/tmp/tune_gluon.csv'), pd.read_csv('/tmp/tune_triton.csv')]).to_csv('${OUT}_tuning.csv', index=False)"
  cp zipkv/kernels/decode_tuning.json results/paper/decode_tuning.json
fi
step python3 -m zipkv bench attention --shape llama3.1-8b --real-kv $KV --out $OUT.csv
step python3 - <<PY
from zipkv import book
from zipkv.throughput import REPEATED, figure5
out = "${OUT}_throughput.csv"
res = figure5(methods=REPEATED, repeats=3, profile=True, mma_baseline=True, progress_csv=out)
run = book.provenance("bench")
res["table"].assign(device=run["device"], commit=run["commit"], date=run["date"]).to_csv(out, index=False)
PY
touch JOB-DONE
