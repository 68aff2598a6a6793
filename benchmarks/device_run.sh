#!/usr/bin/env bash
# The device check for a short loan (at most 8 minutes, every stage in a time box, every result kept): run it as
# the device tool's one command, carrying the wheel bundle, e.g. run(command="bash benchmarks/device_run.sh",
# carry=[".gpu-bundle"], timeout_s=540). Prepare the bundle here first (benchmarks/README.md says how).
#
#   1. install what the machine lacks from .gpu-bundle (offline; refuses a torch outside pyproject's range)  40 s
#   2. the smoke stage in its own process: versions, one-rank NCCL, GEMM and SDPA ceilings, one compile      75 s
#   3. the training stages (search, main, chunks_2, llama, cp_2), each in its SIGALRM time box inside      335 s
#      (--budget-s 320: 256 s of boxes, the rest for imports and engine set-up)
# 450 s of boxes, plus at most 10 s per step between timeout's TERM and KILL: 480 s at most.
#
# Each stage writes $OUT/<stage>.json as it ends (gpu_check_stages.run_stage), so a later failure, a hang
# killed by `timeout` or the loan ending keeps what finished; $OUT/device_run.log has every line of stderr.
# Exit status: the worst of the steps (124 when a step ran past its box).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT="${OUT:-$PWD/device-run-out}"
mkdir -p "$OUT"
export OUT
# The micro-batch search runs at the memory edge; recorded by the check (alloc_conf).
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
log="$OUT/device_run.log"
status=0
step() {  # step NAME SECONDS COMMAND...: one time-boxed step, its status kept, the next one still runs
  local name=$1 box=$2
  shift 2
  echo "device_run: $name (time box ${box} s)" | tee -a "$log" >&2
  timeout --kill-after=10 "$box" "$@" 2> >(tee -a "$log" >&2)
  local rc=$?
  echo "device_run: $name exited $rc" | tee -a "$log" >&2
  (( rc > status )) && status=$rc
  return $rc
}
if [[ " $* " != *" --dry-run "* ]]; then
  step install 40 "$PY" benchmarks/gpu_check_bundle.py install --bundle .gpu-bundle --target .gpu-bundle/site || exit $?
  export PYTHONPATH="$PWD/.gpu-bundle/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
step smoke 75 "$PY" benchmarks/gpu_check.py --stages smoke "$@" > "$OUT/smoke_stdout.json"
step training 335 "$PY" benchmarks/gpu_check.py --stages search,main,chunks_2,llama,cp_2 --budget-s 320 "$@" > "$OUT/training_stdout.json"
exit $status
