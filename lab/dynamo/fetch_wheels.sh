#!/usr/bin/env bash
# Download every wheel the lab's Dynamo 1.6.1 needs into DIR, for the lab's local
# wheel source (lab hosts: Debian bookworm, CPython 3.11, x86_64). Wheels only, the
# exact pins of requirements.txt, no resolver: ai-dynamo's own requirements name
# aisimulate, which PyPI cannot serve. Afterwards build.py --out DIR adds the lab
# build of ai-dynamo next to them.
#   lab/dynamo/fetch_wheels.sh DIR
set -euo pipefail
dir=${1:?usage: fetch_wheels.sh DIR}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$dir"
# pip does not widen a given manylinux tag to older glibc levels: name them all
# (bookworm's glibc is 2.36).
platforms=(--platform any --platform manylinux2014_x86_64)
for minor in $(seq 17 36); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
"${PYTHON:-python3}" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version 3.11 --implementation cp --abi cp311 --abi abi3 --abi none \
    "${platforms[@]}" \
    -r "$here/requirements.txt" -d "$dir"
du -sh "$dir"
