#!/usr/bin/env bash
# The GPU check, in one go on a lent machine (one H100/H200; ~5 minutes, each section under a timeout), everything
# written under $OUT. It ran on one H200 on 2026-12-04 in 287 s (bench/README.md, "On a GPU").
#   bash bench/gpu_check.sh            (from the repo root; OUT defaults to ./gpu-check-out)
# That machine reaches no package registry: what its image lacks travels as wheels in ./.whl (make them here with
# `bash bench/gpu_wheels.sh`), installed into /tmp/site; the repo runs from its root (no `pip install -e`).
# 1. the opt-in GPU tests (pytest -m gpu): attention backends against the torch reference, decode CUDA graphs and
#    the engine against transformers on the GPU, memory profiling;
# 2. bench/engine.py --device cuda on the `small` preset and on LLaVA-1.5-7B's shape with random weights, bf16
#    (ours vs transformers' generate);
# 3. a goodput smoke run of a one-process server on the GPU (textcaps, 8–64 req/s: 16 held every SLO on an H200);
# 4. the same small-preset bench with the decode CUDA graphs off (what they save), and the 7B shape's batch 32 with
#    prompt chunks one SDPA call each instead of torch's varlen flash kernel (what one call a layer saves).
# PACK=1 leaves one archive, gpu-check.tgz, in $OUT; PROFILE=1 adds torch.profiler tables of the small preset's
# runs. STEPS (default "tests engine engine7b ablation goodput") picks sections.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-check-out}; mkdir -p "$OUT"
STEPS=${STEPS:-tests engine engine7b ablation goodput}
export PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo EPDMESH_HOME=${EPDMESH_HOME:-/tmp/epdmesh-home}
PY=${PY:-python3}
started=$(date +%s)
section() { echo "== $1 ($(( $(date +%s) - started )) s)"; }
section setup
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
if ls .whl/*.whl > /dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/install.log" 2>&1 || { echo "wheel install failed"; tail -5 "$OUT/install.log"; }
  export PYTHONPATH=/tmp/site:$PWD
else
  $PY -m pip install -q -e ".[dev]" > "$OUT/install.log" 2>&1 || { echo "install failed"; tail "$OUT/install.log"; }
fi
$PY -c "import torch, transformers, grpc; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name(0), 'transformers', transformers.__version__, 'grpc', grpc.__version__)" 2>&1 \
  | tee "$OUT/versions.txt"
for step in $STEPS; do
  case $step in
  tests)
    section "GPU tests"
    files="tests/kernels/test_attention.py tests/common/test_memory_profile.py tests/common/test_engine_parity.py"
    timeout 120 $PY -m pytest -q -p no:cacheprovider -m gpu $files 2>&1 | tee "$OUT/gpu-tests.log" | tail -15
    ;;
  engine)
    section "engine, small preset"
    timeout 90 $PY -m bench.engine --device cuda --preset small --dtype bfloat16 --batch-sizes 1,8,32 \
      --workload uniform --out "$OUT/engine-small-cuda.json" ${PROFILE:+--profile "$OUT/profile-small"} 2>&1 | grep -v "^bench" | tee "$OUT/engine.log" | tail -12
    ;;
  engine7b)
    section "engine, LLaVA-1.5-7B shape (random weights)"
    timeout 150 $PY -m bench.engine --device cuda --preset llava-1.5-7b --dtype bfloat16 --batch-sizes 1,8,32 \
      --repeats 2 --workload uniform --out "$OUT/engine-7b-cuda.json" 2>&1 | grep -v "^bench" \
      | tee "$OUT/engine-7b.log" | tail -12
    ;;
  ablation)
    section "engine, small preset, decode CUDA graphs off"
    timeout 70 $PY -m bench.engine --device cuda --preset small --dtype bfloat16 --batch-sizes 1,8,32 \
      --workload uniform --without cuda-graphs --out "$OUT/engine-small-cuda-eager.json" 2>&1 | grep -v "^bench" \
      | tee "$OUT/engine-eager.log" | tail -6
    section "engine, LLaVA-1.5-7B shape, batch 32, prompt chunks one call each"
    timeout 90 $PY -m bench.engine --device cuda --preset llava-1.5-7b --dtype bfloat16 --batch-sizes 32 \
      --repeats 2 --workload uniform --without prefill-varlen --out "$OUT/engine-7b-cuda-no-varlen.json" 2>&1 \
      | grep -v "^bench" | tee "$OUT/engine-7b-no-varlen.log" | tail -6
    ;;
  goodput)
    section "goodput smoke"
    timeout 120 $PY -m bench.goodput --config "local=--topology local --device cuda --dtype bfloat16" \
      --workload textcaps --arrival poisson --rates 8,16,32,64 --num-prompts 80 --out "$OUT/goodput-cuda.json" 2>&1 \
      | tail -8 | tee "$OUT/goodput.log"
    ;;
  esac
done
section done
ls -la "$OUT"
if [ -n "${PACK:-}" ]; then  # one archive (the device tool brings back at most 8 files)
  tar czf /tmp/gpu-check.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/gpu-check.tgz "$OUT/"
fi
