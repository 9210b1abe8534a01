#!/usr/bin/env bash
# The GPU lane: everything lockstep claims about CUDA, run in one go on a machine with a GPU.
#   scripts/gpu-lane.sh LOGDIR            (LANE_STEPS="contracts node-suite" runs only those steps;
#                                          ALL_TESTS_K="expr" narrows all-tests to a -k expression;
#                                          GOLDEN_K="expr" narrows the golden step likewise)
# Runs (each step's full log in LOGDIR/<step>.log):
#   contracts   contract tests on sim and cupy (cupy required: absent GPU = failure)
#   parity      the sim-vs-CUDA parity scenarios on both devices, plus observations as JSON
#   mutants     `lockstep mutants` on sim (must have no survivor) and on cupy (recorded);
#               mutants-layers: every layer's source mutants on cupy, with scores (JSON)
#   all-tests   the whole test suite but the node suite, both devices (ONNX Runtime here is another
#               version than CI's, whose expectations the node suite's ort entries record)
#   node-suite  ONNX's node cases on ref-sim and ref-cuda (and ort-cuda, ort-cuda-tf32), with a report
#   ort-expect  ort-cuda's failing node cases as expectation entries to review (with ONNX Runtime CUDA)
#   ort-divergence where ort-cuda first departs from ort-cpu in the findings' cases (with ONNX Runtime CUDA)
#   smollm2-build  the SmolLM2 exports from the carried GGUF (with it)
#   ort-genai   ORT GenAI (CUDA) on the builder's exports: ids, CUDA graphs on/off, locks (with its wheel)
#   golden      golden token locks, tripwires, capture on/off identity and paging on every engine,
#               the trained SmolLM2 exports included when their GGUF came along
#   bench       scripts/bench_decode.py on the GPU (eager per-op sync / deferred / captured, ort-cpu,
#               ort-cuda eager and with CUDA graphs)
#   profile     where an eager and a captured decode step's host time goes (scripts/profile_decode.py
#               --by-op, cProfile; scripts/step_parts.py: per part, us per step) and the host cost of
#               CuPy call forms (scripts/host_costs.py)
#   capture-probe what CuPy does with each host-read form inside a stream capture (scripts/capture_probe.py)
#   nxrt        nxrt's engines when its wheels came along (nxrt, nxrt-ep-cuda): what nxrt reports here, then
#               ONNX's node cases, the golden locks and capture identity on nxrt-cuda and nxrt-ep-cuda
#               (torch's CUDA 13 libraries; ONNX Runtime's CUDA build when carried), with a report
#   scale       scripts/bench_scale.py on an 8B model built here (SCALE_MODELS, default 8b:int4): golden add, and
#               the check on ref-cuda and ort-cuda (SCALE_ENGINES), time and peak host memory (only when LANE_STEPS
#               names it: it builds an 8B model)
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
# the commit every step reports (bench conditions too): the wheel's, unless given
export LOCKSTEP_COMMIT=${LOCKSTEP_COMMIT:-$(cat .whl/COMMIT 2>/dev/null || echo unknown)}
# ONNX Runtime's CUDA build and the SmolLM2 GGUF, when scripts/gpu-chunks.sh's parts were moved
# into /tmp/parts by the chunk calls: assembled, checked against .whl/CHUNKS, installed/exported.
ORT_CUDA=0 SMOLLM2=0
assemble() {  # kind -> the assembled file's path, or nothing
  local kind=$1 name sha
  [ -f .whl/CHUNKS ] && compgen -G "/tmp/parts/$kind.p*" >/dev/null || return 1
  read -r name sha < <(awk -v k="$kind" '$1 == k {print $2, $3}' .whl/CHUNKS)
  [ -n "$name" ] || return 1
  cat $(ls /tmp/parts/$kind.p* | sort) > "/tmp/$name"
  if [ "$(sha256sum "/tmp/$name" | cut -d' ' -f1)" != "$sha" ]; then echo "$kind: sha256 mismatch" >&2; return 1; fi
  echo "/tmp/$name"
}
if whl=$(assemble ort); then
  N=/opt/torch/.venv/lib/python3.12/site-packages/nvidia  # torch's CUDA 13 and cuDNN libraries
  rm -rf /tmp/ortsite
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ortsite "$whl" \
    && export PYTHONPATH="/tmp/lockstep-site:/tmp/ortsite${PYTHONPATH#/tmp/lockstep-site}" \
              LD_LIBRARY_PATH="$N/cu13/lib:$N/cudnn/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" && ORT_CUDA=1
fi
# ORT GenAI's CUDA build beside ONNX Runtime's (it loads the libonnxruntime of /tmp/ortsite)
GENAI=0
if [ "$ORT_CUDA" = 1 ] && whl=$(assemble genai); then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ortsite "$whl" && GENAI=1
fi
# nxrt's CUDA plugin EP loads the CUDA 13 user-space libraries from the loader's path: torch's
NXRT=0
if compgen -G ".whl/nxrt_ep_cuda-*.whl" >/dev/null; then
  N=/opt/torch/.venv/lib/python3.12/site-packages/nvidia
  case ":${LD_LIBRARY_PATH:-}:" in *":$N/cu13/lib:"*) ;; *) export LD_LIBRARY_PATH="$N/cu13/lib:$N/cudnn/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;; esac
  NXRT=1
fi
if gguf=$(assemble gguf); then
  export LOCKSTEP_SMOLLM2_GGUF=$gguf LOCKSTEP_CACHE_DIR=/tmp/lockstep-cache && SMOLLM2=1
fi

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  echo "commit: $LOCKSTEP_COMMIT (the wheel's: the device's copy of .git, if any, may be stale)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, numpy, cupy, onnx; print('python', sys.version.split()[0], '| numpy', numpy.__version__, '| cupy', cupy.__version__, '| cuda runtime', cupy.cuda.runtime.runtimeGetVersion(), '| onnx', onnx.__version__)"
  python3 -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers(), o.__file__)"
  echo "ort-cuda carried: $ORT_CUDA; ort-genai-cuda carried: $GENAI; smollm2 gguf carried: $SMOLLM2; nxrt carried: $NXRT"
  [ "$GENAI" = 1 ] && python3 -c "import onnxruntime_genai as g; print('onnxruntime-genai', g.__version__, g.__file__)"
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
  last=$(grep -E "(passed|failed|PASS:|FAIL:|scenarios match|as expected, |^\| .* \| captured \||^paging check|^\| paged, captured)" "$out/$name.log" | tail -n 1)
  rows+=("$(printf '%-14s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$last")")
}

# engines: the reference runtime on both devices, and ONNX Runtime's CUDA provider when it came along
ref=ref-sim,ref-cuda
engines=$ref
export LOCKSTEP_REQUIRE_DEVICES=cupy LOCKSTEP_REQUIRE_ENGINES=ref-cuda LOCKSTEP_REQUIRE_MODELS=
if [ "$ORT_CUDA" = 1 ]; then
  engines=$ref,ort-cuda,ort-cuda-tf32 LOCKSTEP_REQUIRE_ENGINES=ref-cuda,ort-cuda,ort-cuda-tf32
fi
[ "$SMOLLM2" = 1 ] && LOCKSTEP_REQUIRE_MODELS=all
step spin-check    timeout 60  python3 scripts/spin_check.py
step contracts     timeout 120 python3 -m pytest --pyargs lockstep.contracts.suite.runtime -m contract -p no:cacheprovider -v --devices=sim,cupy
# the unit tests select the reference engines only: ORT CUDA, when carried, is not required there
# (tests/test_architecture.py is deselected: ruff and import-linter, device-independent, are CI's and not on the device)
step all-tests     env LOCKSTEP_REQUIRE_ENGINES=ref-cuda timeout 400 python3 -m pytest tests --pyargs lockstep.conformance lockstep.contracts.suite -p no:cacheprovider -v -n 12 --devices=sim,cupy --engines=$ref -m "not node_suite and not golden and not capture and not paging and not packaging" -k "not smollm2 and not test_architecture${ALL_TESTS_K:+ and ($ALL_TESTS_K)}"
LOCKSTEP_REQUIRE_ENGINES=${LOCKSTEP_REQUIRE_ENGINES%,ort-cuda-tf32} \
step node-suite    timeout 330 python3 -m pytest --pyargs lockstep.conformance -m node_suite -p no:cacheprovider -q -n 12 --engines=${engines%,ort-cuda-tf32} --lockstep-report-dir "$out/node-report"
if [ "$ORT_CUDA" = 1 ]; then
  # every failing or erroring ort-cuda case, as expectation entries to review (not applied here)
  step ort-expect  timeout 200 bash -c "python3 -m lockstep cases --engine ort-cuda --emit-expectations --engine-field > '$out/ort-cuda-expectations.toml'"
fi
# lockstep locate: ORT CUDA's findings located by the command (F2: the first node leaving its band is a
# ReduceMax), clean engines locating nothing on golden models and exports (scripts/locate_lane.py)
step locate        timeout 300 python3 scripts/locate_lane.py --json "$out/locate.json"
[ "$SMOLLM2" = 1 ] && step smollm2-build timeout 400 python3 -m lockstep.golden.smollm2 --build
step golden        timeout ${GOLDEN_TIMEOUT:-420} python3 -m pytest --pyargs lockstep.conformance.golden lockstep.contracts.suite -m "golden or capture or paging" ${GOLDEN_K:+-k "$GOLDEN_K"} -p no:cacheprovider -q -rfE -n 8 --engines=$engines --lockstep-report-dir "$out/golden-report"
# a call brings back 8 files at most, two folders down: the plots go three down so report.{json,md} come back
mkdir -p "$out/golden-report/plots/png" && mv "$out"/golden-report/*.png "$out/golden-report/plots/png/" 2>/dev/null || true
# ORT GenAI's Generator on the CUDA provider: the builder's exports to transformers' ids, CUDA graphs on/off,
# the golden locks (tests/test_ort_genai.py; ort-genai on CPU too)
[ "$GENAI" = 1 ] && step ort-genai env LOCKSTEP_REQUIRE_ENGINES=ort-genai,ort-genai-cuda timeout 300 python3 -m pytest tests/test_ort_genai.py -p no:cacheprovider -v -rs -n 4
# nxrt (the seeds' runtime): its engines on the GPU, each with its own report; never required (an engine
# nxrt cannot offer here is a counted skip whose reason the report and nxrt-probe.txt keep)
if [ "$NXRT" = 1 ]; then
  # the node suite and the decoders in processes of their own: a case that poisons the engine's CUDA context
  # fails every later call in its process, and the golden results must not depend on the node suite's
  step nxrt        timeout ${NXRT_TIMEOUT:-420} bash -c "python3 scripts/nxrt_probe.py > '$out/nxrt-probe.txt' 2>&1; cat '$out/nxrt-probe.txt'; \
    for part in node_suite 'golden or capture'; do LOCKSTEP_REQUIRE_ENGINES= LOCKSTEP_REQUIRE_DEVICES= python3 -m pytest --pyargs lockstep.conformance \
      -m \"\$part\" -p no:cacheprovider -q -rfE -n 8 --engines=nxrt-cuda,nxrt-ep-cuda --lockstep-report-dir '$out/nxrt-report-'\${part%% *}; done"
  # NXRT_ORDER=1: the node suite in one process, in order, again and again, each time without the case that first
  # left a sticky CUDA error (every later case in its process fails with it): the cases that poison the context,
  # and the suite's results without them (nxrt-order/report.json)
  if [ "${NXRT_ORDER:-0}" = 1 ]; then
    step nxrt-order timeout 400 bash -c "des=''; for i in 1 2 3 4 5 6 7 8; do LOCKSTEP_REQUIRE_ENGINES= LOCKSTEP_REQUIRE_DEVICES= python3 -m pytest --pyargs lockstep.conformance -m node_suite -p no:cacheprovider -q -n 0 --engines=nxrt-ep-cuda --junitxml '$out/nxrt-order.xml' --lockstep-report-dir '$out/nxrt-order' \$des > '$out/nxrt-order-run.log' 2>&1; first=\$(python3 scripts/nxrt_poison.py '$out/nxrt-order.xml' --engine nxrt-ep-cuda --first); [ -z \"\$first\" ] && break; echo \"poisons the context: \$first\"; des=\"\$des --deselect node_suite/test_node_cases.py::test_node_case[nxrt-ep-cuda-\$first]\"; done; tail -n 1 '$out/nxrt-order-run.log'"
  fi
fi
# issue 51: a model of the size runtime teams ship (random-init, scale_export: 8b:int4, 8b:fp16), built here,
# locked (golden add: ort-cuda proposes the greedy prefix, the oracle vouches in one prefill on the CPU) and
# checked on ref-cuda and ort-cuda, each step timed with its peak host memory (scripts/bench_scale.py)
[[ " ${LANE_STEPS:-} " == *" scale "* ]] && step scale env LOCKSTEP_REQUIRE_ENGINES= LOCKSTEP_REQUIRE_MODELS= LOCKSTEP_REQUIRE_DEVICES= LOCKSTEP_COMMIT="$(cat .whl/COMMIT 2>/dev/null)" timeout ${SCALE_TIMEOUT:-560} python3 scripts/bench_scale.py --models "${SCALE_MODELS:-8b:int4}" --steps add,check --engines "${SCALE_ENGINES:-ref-cuda,ort-cuda}" --propose "${SCALE_PROPOSE:-ort-cuda}" --work /tmp/lockstep-scale --json "$out/scale.json"
# BENCH_MODELS="a,b" (golden models, genai/<export>, optimum/<export>) instead of the script's default pair
step bench         timeout ${BENCH_TIMEOUT:-300} python3 scripts/bench_decode.py --device cupy ${BENCH_MODELS:+--models "$BENCH_MODELS"} --json "$out/bench-decode.json"
# where an eager and a captured step's host time goes (per op type, cProfile): a diagnostic, not a benchmark
step profile       timeout 240 bash -c "for m in small-fp32-standard-kv64 small-fp32-standard; do python3 scripts/profile_decode.py --device cupy --model \$m --by-op --steps 16 --top 30; done; python3 scripts/profile_decode.py --device cupy --capture on --steps 32 --top 25; python3 scripts/step_parts.py --device cupy --capture on; python3 scripts/step_parts.py --device cupy --capture off --steps 16; python3 scripts/host_costs.py"
step paging        timeout 200 python3 scripts/paging_check.py --device cupy --json "$out/paging.json"
step bench-paging  timeout 200 python3 scripts/bench_paging.py --device cupy
step parity-json   timeout 150 python3 -m lockstep parity --device cupy --json "$out/parity-cupy.json"
step capture-probe timeout 120 python3 scripts/capture_probe.py --json "$out/capture-probe.json"
step mutants-sim   timeout 120 python3 -m lockstep mutants --device sim
step mutants-cupy  timeout 300 python3 -m lockstep mutants --device cupy --jobs 6 --timeout 150
# the source-mutant layers whose tests run on the device, on cupy (the kernels' CUDA-source mutants are judged only
# here); sim, golden and audit are device-independent (the simulated device itself, host-side oracle, static audit)
step mutants-layers timeout 420 python3 -m lockstep mutants --layer runtime,executor,capture_plan,segments,sync_debug,pager,kernels --device cupy --jobs 12 --timeout 240 --json "$out/mutants-layers-cupy.json" --markdown "$out/mutants-layers-cupy.md"

echo
echo "== lockstep GPU lane =="
cat "$out/device.txt"
printf '%s\n' "${rows[@]}"
