#!/usr/bin/env bash
# The chapter "On the paper's card" (notebooks/zipfusion/zipfusion_paper_card.ipynb): ZipFusion's Fig. 4 points and
# Fig. 5 setting on an H100, the GPU of its paper, which the `device` tool lends (`nvidia-h100-x1`) more often than
# the H200 of the other chapters. The card's launch options are tuned first where zipkv/kernels/decode_tuning.json
# has none for it (`bench tune --write`; commit the file and results/paper/zipfusion_paper_card_tuning.csv).
# Started like job.sh: `bash .ci/gpu/start.sh <commit> paper_card`, then pack.sh; commit book/ and results/paper/.
cd /root/run
export PYTHONPATH=/tmp/site:$PWD ZIPKV_GGUF=/root/zipkv/SmolLM2-135M-Instruct.Q4_1.gguf ZIPKV_PG19=$PWD/.gpu/pg19
export ZIPKV_COMMIT=$(cat COMMIT)
step() { echo "=== $(date -u +%H:%M:%S) $*"; "$@"; echo "=== rc=$? $(date -u +%H:%M:%S)"; }
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100; then echo "=== not an H100: nothing to do"; touch JOB-DONE; exit 0; fi
KV=results/paper/model_data_kv_cache.csv
if ! python3 -c "import sys, torch; from zipkv.kernels import tuning; sys.exit(0 if tuning.tuned(torch.cuda.get_device_name(), 'raw') else 1)"; then
  step python3 -m zipkv bench tune --kernel gluon --shape llama3.1-8b --real-kv $KV --write --out /tmp/tune_gluon.csv
  step python3 -m zipkv bench tune --kernel triton --shape llama3.1-8b --real-kv $KV --write --out /tmp/tune_triton.csv
  python3 -c "import pandas as pd; pd.concat([pd.read_csv('/tmp/tune_gluon.csv'), pd.read_csv('/tmp/tune_triton.csv')]).to_csv('results/paper/zipfusion_paper_card_tuning.csv', index=False)"
  cp zipkv/kernels/decode_tuning.json results/paper/decode_tuning.json   # packed back: copy it to zipkv/kernels/
fi
step python3 -m zipkv.study book --profile paper --force --no-html --only zipfusion_paper_card   # ~4 min (210 s at 5c6bdd9)
touch JOB-DONE
