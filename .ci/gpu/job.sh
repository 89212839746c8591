#!/usr/bin/env bash
# The GPU work of the open issues, in order of importance (in case the device time runs out): the throughput
# chapter (each H200 run adds a row to its table of runs: the spread from board to board), then the GPU-only
# tests. (Every other chapter's committed run is current: distill speed and lossless at 547aa61 on an H200, the
# optimizer, KL-sources and Table 1 chapters at 9b2c071 / 0b588f5 on an H100; add a chapter here when its code changes.)
cd /root/run
export PYTHONPATH=/tmp/site:$PWD ZIPKV_GGUF=/root/zipkv/SmolLM2-135M-Instruct.Q4_1.gguf ZIPKV_PG19=$PWD/.gpu/pg19
export ZIPKV_COMMIT=$(cat COMMIT)   # the tree here is no git checkout: the provenance boxes name the commit it is
step() { echo "=== $(date -u +%H:%M:%S) $*"; "$@"; echo "=== rc=$? $(date -u +%H:%M:%S)"; }
# timed chapters run only on the H200: their committed numbers and the kernels' tuning (decode_tuning.json) are
# from it; on another card the job runs what measures quality or bits, not speed
timed() { if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then step "$@"; else echo "=== skipped (not an H200): $*"; fi; }
# ~6 min, plus its capacity table (zipkv.study.experiments.throughput.packed_capacity: host work, 75 s on an H100 machine at 7f9282c)
timed python3 -m zipkv.study book --profile paper --force --no-html --only zipfusion_throughput
step python3 -m pytest -q -p no:cacheprovider tests/test_decode_mma.py tests/test_lossless_chapter.py tests/test_engine.py \
  -k "packed_pages or lossless or reads or sentences or changed or same_kernel or fused_kernel_greedy"
touch JOB-DONE
