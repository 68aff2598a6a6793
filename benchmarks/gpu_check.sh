#!/usr/bin/env bash
# GPU readiness check: bf16 MFU of gpt3-1.3b at the largest micro-batch that fits, peak memory, tokens/s with
# --domino-chunks 1 vs 2 at TP=1, host syncs per iteration and a 20-step loss curve, printed as one JSON object
# (about 8 minutes on one H200 at most: --budget-s bounds the micro-batch search). Exit status 1 when the loss
# does not fall. `--dry-run` runs the same script on CPU with the tiny preset in seconds (CI runs it).
#
#   bash benchmarks/gpu_check.sh [--dry-run] [--preset NAME] [--max-micro-batch N] [--budget-s S]
#
# PYTHON selects the interpreter (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" benchmarks/gpu_check.py "$@"
