#!/usr/bin/env bash
# The GPU lane: everything lockstep claims about CUDA, run in one go on a machine with a GPU.
#   scripts/gpu-lane.sh LOGDIR            (LANE_STEPS="contracts node-suite" runs only those steps)
# Runs (each step's full log in LOGDIR/<step>.log):
#   contracts   contract tests on sim and cupy (cupy required: absent GPU = failure)
#   parity      the sim-vs-CUDA parity scenarios on both devices, plus observations as JSON
#   mutants     `lockstep mutants` on sim (must have no survivor) and on cupy (recorded)
#   all-tests   the whole test suite but the node suite, both devices (ONNX Runtime here is another
#               version than CI's, whose expectations the node suite's ort entries record)
#   node-suite  ONNX's node cases on ref-sim and ref-cuda, with a JSON/markdown report
#   golden      golden token locks and tripwires on ref-sim and ref-cuda, capture on/off identity
#   bench       scripts/bench_decode.py on the GPU (eager per-op sync / deferred / captured, ort-cpu)
#   paging      scripts/paging_check.py (the seeds' use-after-unmap through the pager, child processes)
#               and scripts/bench_paging.py (decode under paging vs resident)
# and prints a summary table last. Uses the preinstalled python3 packages plus .whl/ (made here by
# scripts/gpu-prepare.sh and carried): lockstep's wheel of this tree, syrupy and platformdirs,
# installed into a private target. The suite runs as installed (`pytest --pyargs lockstep.conformance`,
# `python3 -m lockstep`), the unit tests from tests/ against that install.
set -u
out=${1:?usage: scripts/gpu-lane.sh LOGDIR}
mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 2
if ! compgen -G ".whl/lockstep_conformance-*.whl" >/dev/null; then
  echo "no .whl/lockstep_conformance-*.whl: run scripts/gpu-prepare.sh first and carry .whl" >&2; exit 2
fi
rm -rf /tmp/lockstep-site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/lockstep-site .whl/*.whl || exit 2
# PYTHONSAFEPATH: no working directory on sys.path, so `lockstep` is the installed package, never
# the tree's lockstep/ folder (which holds only the namespace's own modules)
export PYTHONPATH="/tmp/lockstep-site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
# the installed package must be this tree (a stale wheel would verify other code)
site=/tmp/lockstep-site/lockstep
subs="reference_runtime kernels contracts golden conformance"
stale=""
for d in $subs; do diff -rq -x __pycache__ -x README.md "$d" "$site/$d" >/dev/null || stale="$stale $d"; done
diff -rq -x __pycache__ -x README.md $(printf -- '-x %s ' $subs) lockstep "$site" >/dev/null || stale="$stale lockstep"
if [ -n "$stale" ]; then
  echo "the wheel in .whl/ is not this tree (differs:$stale): run scripts/gpu-prepare.sh again" >&2; exit 2
fi
{
  date -u +%Y-%m-%dT%H:%M:%SZ
  echo "commit: ${LOCKSTEP_COMMIT:-$(git rev-parse HEAD 2>/dev/null || cat .whl/COMMIT 2>/dev/null || echo 'unknown (pass LOCKSTEP_COMMIT)')}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, numpy, cupy, onnx; print('python', sys.version.split()[0], '| numpy', numpy.__version__, '| cupy', cupy.__version__, '| cuda runtime', cupy.cuda.runtime.runtimeGetVersion(), '| onnx', onnx.__version__)"
  python3 -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())"
} > "$out/device.txt" 2>&1

rows=()
step() {
  local name=$1; shift
  if [ -n "${LANE_STEPS:-}" ] && [[ " $LANE_STEPS " != *" $name "* ]]; then
    rows+=("$(printf '%-14s skipped (LANE_STEPS)' "$name")"); return
  fi
  local t0=$SECONDS
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  local last
  last=$(grep -E "(passed|failed|PASS:|FAIL:|scenarios match|^\| .* \| captured \||^paging check|^\| paged, captured)" "$out/$name.log" | tail -n 1)
  rows+=("$(printf '%-14s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$last")")
}

export LOCKSTEP_REQUIRE_DEVICES=cupy LOCKSTEP_REQUIRE_ENGINES=ref-cuda
step spin-check    timeout 60  python3 scripts/spin_check.py
step contracts     timeout 120 python3 -m pytest --pyargs lockstep.conformance.contracts -m contract -p no:cacheprovider -v --devices=sim,cupy
step all-tests     timeout 240 python3 -m pytest tests --pyargs lockstep.conformance -p no:cacheprovider -v --devices=sim,cupy --engines=ref-sim,ref-cuda -m "not node_suite and not golden and not capture and not paging and not packaging"
step node-suite    timeout 330 python3 -m pytest --pyargs lockstep.conformance -m node_suite -p no:cacheprovider -q -n 12 --engines=ref-sim,ref-cuda --lockstep-report-dir "$out/node-report"
step golden        timeout 300 python3 -m pytest --pyargs lockstep.conformance.golden -m "golden or capture or paging" -p no:cacheprovider -v --engines=ref-sim,ref-cuda --lockstep-report-dir "$out/golden-report"
step bench         timeout 300 python3 scripts/bench_decode.py --device cupy --json "$out/bench-decode.json"
step paging        timeout 200 python3 scripts/paging_check.py --device cupy --json "$out/paging.json"
step bench-paging  timeout 200 python3 scripts/bench_paging.py --device cupy
step parity-json   timeout 150 python3 -m lockstep parity --device cupy --json "$out/parity-cupy.json"
step mutants-sim   timeout 120 python3 -m lockstep mutants --device sim
step mutants-cupy  timeout 300 python3 -m lockstep mutants --device cupy --jobs 6 --timeout 150

echo
echo "== lockstep GPU lane =="
cat "$out/device.txt"
printf '%s\n' "${rows[@]}"
