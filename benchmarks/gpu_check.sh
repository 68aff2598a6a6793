#!/usr/bin/env bash
# GPU readiness check, one command on an offline GPU machine that has a CUDA build of torch: unpacks what the
# machine lacks from .gpu-bundle (prepared here by `python benchmarks/gpu_check_bundle.py prepare`; refuses a
# torch outside pyproject's range or a Python the bundle has no wheels for), then runs benchmarks/gpu_check.py:
# bf16 tokens/s, MFU and memory (allocated and reserved) of gpt3-1.3b at the largest micro-batch that fits,
# --domino-chunks 1 vs 2, host syncs per iteration (including explicit synchronize calls) and a 20-step loss
# curve, then a LLaMA-architecture model (llama2-7b cut to 4 layers) at TP=1; one JSON object on stdout, also
# written to $OUT/gpu_check.json when OUT is set (the device tool's output folder). Every stage halves its
# micro-batch on out-of-memory; every stage has a time box (shares of --budget-s, default 420 s, printed) and
# writes $OUT/<stage>.json as it ends. For a short loan prefer benchmarks/device_run.sh (benchmarks/README.md).
# Exit status 1 when a loss does not fall, 2 when the machine cannot run the check, 3 when a stage was skipped,
# 4 when a stage failed (its one-line error in the JSON's "errors").
#
#   bash benchmarks/gpu_check.sh [--dry-run] [--preset NAME] [--llama-preset NAME] [--llama-layers N]
#                                [--max-micro-batch N] [--budget-s S]
#
# `--dry-run` runs the same script on CPU with the tiny presets in seconds, from this checkout's environment
# (CI runs it). Then record the result here: python benchmarks/gpu_check_bundle.py record gpu_check.json
#
# PYTHON selects the interpreter (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
# The micro-batch search runs at the memory edge; recorded in the result (alloc_conf).
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
if [[ " $* " != *" --dry-run "* ]]; then
  if [[ ! -f .gpu-bundle/manifest.json ]]; then
    echo "gpu_check: no .gpu-bundle here: run 'python benchmarks/gpu_check_bundle.py prepare' on a machine with a" \
         "registry and carry .gpu-bundle along" >&2
    exit 2
  fi
  "$PY" benchmarks/gpu_check_bundle.py install --bundle .gpu-bundle --target .gpu-bundle/site || exit 2
  export PYTHONPATH="$PWD/.gpu-bundle/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$PY" benchmarks/gpu_check.py "$@"
