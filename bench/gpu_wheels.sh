#!/usr/bin/env bash
# The wheels the GPU check needs on a lent machine that reaches no registry (its image has torch, numpy, tokenizers,
# huggingface-hub, pillow, pytest...): this project's runtime packages it lacks, at this venv's versions, into ./.whl.
#   bash bench/gpu_wheels.sh           (from the repo root, after `make .venv/.installed`; ~30 MB)
set -euo pipefail
PY=${PY:-.venv/bin/python}
version() { $PY -c "import importlib.metadata as m; print(m.version('$1'))"; }
names="grpcio grpcio-health-checking protobuf transformers cffi cryptography pycparser googleapis-common-protos
  httptools opentelemetry-api opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-proto-grpc
  opentelemetry-instrumentation opentelemetry-instrumentation-grpc opentelemetry-proto opentelemetry-sdk
  opentelemetry-semantic-conventions pybase64 redis starlette uvicorn llguidance"
pins=$(for n in $names; do echo "$n==$(version "$n")"; done)
mkdir -p .whl
platforms=""
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
  platforms="$platforms --platform ${p}_x86_64"
done
# shellcheck disable=SC2086
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms -d .whl \
  $pins "xformers==0.0.35"
# xformers 0.0.35 is built for torch 2.10 / CUDA 12.8 and has no kernel on the H200 image's torch 2.11 / CUDA 13
# (2026-12-04): it travels so the check sees `auto` leave a broken library out. flash-attn has no wheel (sdist only).
# (.whl/ is in .gitignore: it travels to the device only as a `carry`)
du -sh .whl
