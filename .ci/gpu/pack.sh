#!/usr/bin/env bash
# Waits up to $1 seconds for job.sh to finish, then packs what it wrote (executed notebooks, result
# tables, its log) into $OUT/out.tar; run it again while it prints "still running".
cd /root/run || exit 1
end=$((SECONDS + ${1:-0}))
while [ ! -f JOB-DONE ] && [ $SECONDS -lt $end ]; do sleep 5; done
[ -f JOB-DONE ] && echo JOB-DONE || echo "still running"
tar cf "$OUT/out.tar" job.log $(find book results -newer COMMIT -type f \( -name '*.ipynb' -o -name '*.csv' -o -name '*.json' \) 2>/dev/null)
cp job.log "$OUT/"; tail -25 job.log
