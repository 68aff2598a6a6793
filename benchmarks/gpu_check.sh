#!/usr/bin/env bash
# GPU readiness check: bf16 MFU of gpt3-1.3b at the largest micro-batch that fits, peak memory, tokens/s with
# --domino-chunks 1 vs 2 at TP=1, host syncs per iteration and a 20-step loss curve, then the loss curve, tokens/s
# and MFU of a LLaMA-architecture model (llama2-7b cut to 4 layers), printed as one JSON object (--budget-s bounds
# the micro-batch search; estimated at ~8 minutes on one H200 before the LLaMA steps; never run on a GPU yet).
# Exit status 1 when a loss does not fall. `--dry-run` runs the same script on CPU with the tiny and tiny-llama
# presets in seconds (CI runs it).
#
#   bash benchmarks/gpu_check.sh [--dry-run] [--preset NAME] [--llama-preset NAME] [--llama-layers N]
#                                [--max-micro-batch N] [--budget-s S]
#
# PYTHON selects the interpreter (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" benchmarks/gpu_check.py "$@"
