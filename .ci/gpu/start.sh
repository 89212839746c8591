#!/usr/bin/env bash
# On the GPU machine (the `device` tool), third call of ../shared/DEVICE.md's recipe, carrying
# [".gpu/whl", ".gpu/pg19"]: installs the wheels, copies this tree to /root/run (later calls re-copy the
# working tree, which would overwrite what the job writes here) and starts job.sh there, detached.
# Usage: bash .ci/gpu/start.sh <commit> [job]   (job: job.sh's name without .sh, default job; paper_card on an
# H100), then   bash .ci/gpu/pack.sh <seconds>   until it says JOB-DONE.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl
PYTHONPATH=/tmp/site python3 -m ipykernel install --user --name python3 >/dev/null
rm -rf /root/run && mkdir -p /root/run && cp -r . /root/run && rm -rf /root/run/.gpu/whl
cd /root/run
echo "${1:-unknown}" > COMMIT
setsid nohup bash ".ci/gpu/${2:-job}.sh" > /root/run/job.log 2>&1 < /dev/null &
sleep 2; echo "started ${2:-job}.sh at $(date -u +%H:%M:%S) in /root/run"; nvidia-smi --query-gpu=name,memory.used --format=csv
