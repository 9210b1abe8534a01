#!/usr/bin/env bash
# Run here (with network) before a GPU lane call: puts into .whl/ (ignored by git, carried with
# `carry: [".whl"]`) what the H200 lacks: this tree's lockstep wheel, and the pure-Python wheels
# the H200 image does not have (syrupy, platformdirs, gguf, tokenizers: the real exports' tokenizer.json). scripts/gpu-lane.sh installs them into
# a private target and refuses to run if the wheel is not this tree's. Run scripts/gpu-chunks.sh after
# this one for ONNX Runtime's CUDA build and the SmolLM2 GGUF.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .git/info
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
# build/ is setuptools' in-tree scratch folder: a stale one fails the next wheel build (the packaging
# test's: 'File exists: build/bdist...'), so none is left behind
rm -rf build
python3 -m pip wheel -q --no-deps -w .whl . 2>&1 | grep -v -i warning || true
rm -rf build
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl "syrupy>=4" "platformdirs>=3" "gguf>=0.10" "tokenizers>=0.19"
# nxrt (the seeds' runtime) and its CUDA execution provider as a plugin EP, unless NXRT=0: the lane's nxrt
# step (nxrt-cuda, nxrt-ep-cuda; nxrt-ep-cpu is CI's); --no-deps: the CUDA 13 libraries are torch's on the
# device (gpu-lane.sh). 15 MiB: with the tree (~27 MiB) and the rest of .whl, just under a call's 64 MiB
if [ "${NXRT:-1}" = 1 ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d .whl "nxrt==${NXRT_VERSION:-0.1.0.dev6}" \
    "nxrt-ep-cuda==${NXRT_VERSION:-0.1.0.dev6}"
fi
git rev-parse HEAD > .whl/COMMIT
# chunks made earlier by scripts/gpu-chunks.sh stay usable: their manifest travels with the wheels
[ -f .chunks/MANIFEST ] && cp .chunks/MANIFEST .whl/CHUNKS
git diff --quiet HEAD -- . ':!docs' || echo "note: the tree has uncommitted changes; the wheel holds them" >&2
ls -la .whl
