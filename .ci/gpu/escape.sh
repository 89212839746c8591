#!/usr/bin/env bash
# The escape format on the GPU (issue 66): its kernels' GPU tests, then its decode latency on real KV beside ZipFusion's
# format, the same pages raw and FlashInfer TC (.ci/gpu/escape_probe.py: 8192 x 64 and the few-requests points,
# Llama-3.1-8B shape), about 4 minutes on an H100 or H200. No model on the machine: the real KV blocks come prepared.
#   Here, once:  python .ci/gpu/escape_kv.py              (writes .gpu/escape_kv/blocks.pt, 12 MB; ../shared/tools/gpu-pack
#                                                          or .ci/gpu/prepare.sh for .gpu/whl)
#   Device call: carry [".gpu/whl", ".gpu/escape_kv"], command   ZIPKV_COMMIT=<git rev-parse --short HEAD> bash .ci/gpu/escape.sh
# Writes to $OUT: escape_tests.log (pytest), escape_latency.csv (one row per point and method), escape_probe.log.
# Append escape_latency.csv's rows to results/paper/escape_format_latency.csv (the chapter "Beyond the format" shows the latest run).
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-/tmp/escape_out}; mkdir -p "$OUT"
if [ ! -d /tmp/site/flashinfer ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
export ZIPKV_COMMIT=${ZIPKV_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader | tee "$OUT/escape_device.txt"
step() { echo "=== $(date -u +%H:%M:%S) $*"; "$@"; echo "=== rc=$? $(date -u +%H:%M:%S)"; }
# 1. the GPU tests: the kernel (bit for bit vs raw pages, reference, CUDA graph, engine) and the pack kernel on the device
step timeout 110 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode_escape.py tests/test_pack_escape_kernel.py \
  2>&1 | tail -40 | tee "$OUT/escape_tests.log"
# 2. the latency probe: writes its CSV after every point; stops starting points after --budget-s
step timeout 125 python3 .ci/gpu/escape_probe.py "$OUT/escape_latency.csv" --budget-s 85 2>&1 \
  | grep -v Warning | tee "$OUT/escape_probe.log" | tail -30
ls -la "$OUT"
