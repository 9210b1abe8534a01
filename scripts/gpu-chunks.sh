#!/usr/bin/env bash
# Run here (with network) before the GPU lane when it should run ONNX Runtime's CUDA provider and the
# trained model: what the H200 lacks and a device call cannot carry in one piece (64 MiB a call,
# the working tree included) is split into chunk folders .chunks/0, .chunks/1, ... (ignored by git):
#   - onnxruntime-gpu (a CUDA 13.0 build for cp312, ~244 MiB; the H200 has torch's CUDA 13 and cuDNN
#     libraries, see scripts/gpu-lane.sh), unless ORT=0;
#   - onnxruntime-genai-cuda (cp312, ~17 MiB: ORT GenAI's CUDA build, the ort-genai-cuda engine), unless GENAI=0;
#   - the SmolLM2-135M-Instruct GGUF (98 MiB, the trained golden model's source), unless SMOLLM2=0.
# Chunks are CHUNK_MB (default 36) MiB: a call carries the working tree too (~23 MiB with golden/exports).
# Then make one device call per folder, back to back while the machine is warm (30 s), each with
#   carry: [".chunks/<i>"]   command: mkdir -p /tmp/parts && mv .chunks/<i>/* /tmp/parts/
# and run the lane (carry .whl, after scripts/gpu-prepare.sh; this script runs second): the lane
# assembles what it finds in /tmp/parts, sha256-checked against .whl/CHUNKS.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .git/info
grep -qx '/.chunks/' .git/info/exclude 2>/dev/null || echo '/.chunks/' >> .git/info/exclude
rm -rf .chunks && mkdir -p .chunks/parts
tmp=$(mktemp -d)
: > .chunks/MANIFEST
chunk() {  # kind file: split the file into chunk parts, its name and sha256 into the manifest
  (cd .chunks/parts && split -b "${CHUNK_MB:-36}M" -d -a 2 "$2" "$1.p")
  echo "$1 $(basename "$2") $(sha256sum "$2" | cut -d' ' -f1)" >> .chunks/MANIFEST
}
wheel() {  # kind requirement glob: the cp312 manylinux wheel of the requirement, chunked
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$tmp" "$2"
  chunk "$1" "$(ls "$tmp"/$3)"
}
[ "${ORT:-1}" = 1 ] && wheel ort "onnxruntime-gpu==${ORT_VERSION:-1.31.1}" 'onnxruntime_gpu-*.whl'
[ "${GENAI:-1}" = 1 ] && wheel genai "onnxruntime-genai-cuda==${GENAI_VERSION:-0.18.0}" 'onnxruntime_genai_cuda-*.whl'
if [ "${SMOLLM2:-1}" = 1 ]; then
  chunk gguf "$(python3 -c "from lockstep.golden.smollm2 import locate_gguf; print(locate_gguf())")"
fi
i=0
for f in .chunks/parts/*; do mkdir -p ".chunks/$i"; mv "$f" ".chunks/$i/"; i=$((i + 1)); done
rmdir .chunks/parts
rm -rf "$tmp"
mkdir -p .whl && cp .chunks/MANIFEST .whl/CHUNKS  # travels with the lane call (carry .whl)
cat .chunks/MANIFEST
ls -la .chunks/*/
echo "$i chunk calls (carry .chunks/<i> each), then the lane"
