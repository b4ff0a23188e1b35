#!/usr/bin/env bash
# The GPU check, in one go on a lent machine (one H100/H200; budget: 8 minutes). Writes everything under $OUT.
#   bash bench/gpu_check.sh            (from the repo root; OUT defaults to ./gpu-check-out)
# 1. the opt-in GPU tests (pytest -m gpu: attention backends against the torch reference, memory profiling);
# 2. bench/engine.py --device cuda on the `small` preset, bf16 (ours vs transformers' generate);
# 3. a goodput smoke run of a one-process server on the GPU (textcaps, 3 rates).
# Not yet in it: CUDA graphs for decode and a random-weight LLaVA-1.5-7B shape (neither is built).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-check-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo EPDMESH_HOME=${EPDMESH_HOME:-/tmp/epdmesh-home}
PY=${PY:-python3}
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
$PY -m pip install -q -e ".[dev]" > "$OUT/install.log" 2>&1 || { echo "install failed"; tail "$OUT/install.log"; }
$PY -m pip install -q flash-attn xformers >> "$OUT/install.log" 2>&1 || echo "flash-attn/xformers not installed (tests skip them)"
timeout 180 $PY -m pytest -q -m gpu tests 2>&1 | tee "$OUT/gpu-tests.log" | tail -5
timeout 150 $PY -m bench.engine --device cuda --preset small --dtype bfloat16 --batch-sizes 1,8,32 \
  --workload uniform --out "$OUT/engine-small-cuda.json" 2>&1 | grep -v "^bench" | tee "$OUT/engine.log" | tail -8
timeout 150 $PY -m bench.goodput --config "local=--topology local --device cuda --dtype bfloat16" \
  --workload textcaps --arrival poisson --rates 2,4,8 --num-prompts 40 --out "$OUT/goodput-cuda.json" 2>&1 \
  | tail -5 | tee "$OUT/goodput.log"
ls -la "$OUT"
