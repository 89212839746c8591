#!/usr/bin/env bash
# After a change to the Gluon decode kernel (zipkv/kernels/decode_mma.py), on the H200: the latency chapter (Fig. 4,
# the mix sweep, the pack table; about 3 min), the all-compressible bar's ceiling probe (1 min), the stream-rate
# variants of the all-compressed path (stream_variants.py, 1 min; appended to zipfusion_kernel_stream_ab.csv), the
# timeline probe (timeline_probe.py, 1.5 min; appended to zipfusion_kernel_timeline*.csv) and the context sweep that the
# chapter fits, then the kernel's GPU tests (about 3 min; on another card only these). Started like job.sh
# (`bash .ci/gpu/start.sh <commit> kernel`, then pack.sh; no model needed: calls a and b of the recipe can be
# skipped); commit book/ and results/paper/ (the ceiling run is appended to zipfusion_descriptor_ceiling.csv here),
# re-render the latency chapter with --from-results (its bar cites the new ceiling run), then the findings page.
cd /root/run
export PYTHONPATH=/tmp/site:$PWD
export ZIPKV_COMMIT=$(cat COMMIT)
step() { echo "=== $(date -u +%H:%M:%S) $*"; "$@"; echo "=== rc=$? $(date -u +%H:%M:%S)"; }
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  echo "=== not an H200: timings skipped"
else
  step python3 -m zipkv.study book --profile paper --force --no-html --only zipfusion_attention_latency
  step python3 .ci/gpu/descriptor_ceiling.py /tmp/ceiling.csv
  python3 -c "import pandas as pd; c = 'results/paper/zipfusion_descriptor_ceiling.csv'; pd.concat([pd.read_csv(c), pd.read_csv('/tmp/ceiling.csv')]).to_csv(c, index=False)"
  step python3 .ci/gpu/stream_variants.py /tmp/stream.csv
  python3 -c "import pandas as pd; c = 'results/paper/zipfusion_kernel_stream_ab.csv'; t = pd.concat([pd.read_csv(c), pd.read_csv('/tmp/stream.csv')]); t['run'] = t['run'].fillna(t['run'].max() + 1).astype(int); t.to_csv(c, index=False)"
  step python3 .ci/gpu/timeline_probe.py /tmp/timeline
  for t in "" _programs _fits; do
    python3 -c "import pandas as pd, sys; c = sys.argv[1]; pd.concat([pd.read_csv(c), pd.read_csv(sys.argv[2])]).to_csv(c, index=False)" \
      results/paper/zipfusion_kernel_timeline$t.csv /tmp/timeline$t.csv
  done
  for shape in llama3.1-8b smollm2-135m; do
    step python3 -m zipkv bench attention --shape $shape --contexts 1024 2048 4096 8192 16384 --batches 64 \
      --kernels gluon --out /tmp/context_$shape.csv
  done
  python3 -c "import pandas as pd; pd.concat([pd.read_csv(f'/tmp/context_{s}.csv') for s in ('llama3.1-8b', 'smollm2-135m')]).to_csv('results/paper/zipfusion_latency_context_sweep.csv', index=False)"
fi
step python3 -m pytest -q -p no:cacheprovider tests/test_decode_mma.py
touch JOB-DONE
