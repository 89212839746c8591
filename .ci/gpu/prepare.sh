#!/usr/bin/env bash
# Here, in the project root, before a GPU session: ../shared/tools/gpu-pack (wheels + model), plus what
# job.sh needs beyond it: the test runner's wheels and a copy of the PG19 books (../shared does not travel).
set -euo pipefail
../shared/tools/gpu-pack
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .gpu/whl \
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 hypothesis==6.170.15 sortedcontainers==2.4.0 attrs==26.1.0
rm -rf .gpu/pg19 && cp -r ../shared/data/pg19 .gpu/pg19
du -sh .gpu/whl .gpu/pg19
