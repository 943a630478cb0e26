#!/usr/bin/env bash
# One device call for the cuda provider: build fp16/int4 SmolLM2-shaped models, tests/cuda,
# cuda_decode (eager + captured + per-op profile).  carry: [".whl"].  Logs in $OUT.
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/onnxruntime_genai-0.18.0-cp312-cp312-manylinux_2_28_x86_64.whl || exit 1
M=/tmp/models; mkdir -p $M
for v in fp16 int4; do python3 benchmarks/build_test_model.py $M/$v --precision $v --target cuda > $OUT/build_$v.log 2>&1 & done
wait
LOCKSTEP_CUDA_MODELS=$M timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider tests/cuda 2>&1 | tail -30
for v in ${PRECISIONS:-fp16 int4}; do
  echo "== $v"; timeout 150 python3 benchmarks/cuda_decode.py $M/$v --batches ${BATCHES:-1,8,32,256} --steps 16 --profile ${PROFILE:-1,32,256} 2>&1 | tail -20
done
