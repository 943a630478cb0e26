#!/usr/bin/env bash
# One device call: build SmolLM2-shaped test models, run the GPU tests, profile, and the
# HF transformers baseline. Logs and JSON are written to /tmp/gpu_suite and packed into
# $OUT/gpu_suite.tgz at the end (the device tool brings back at most 8 files).
#   carry: [".whl"]  (the onnxruntime-genai cp312 wheel for the builder; see benchmarks/README.md)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
FINAL_OUT=$OUT; OUT=/tmp/gpu_suite; mkdir -p $OUT
trap 'tar czf "$FINAL_OUT/gpu_suite.tgz" -C "$OUT" . ; cp "$OUT"/tests_cuda.log "$FINAL_OUT"/ 2>/dev/null' EXIT
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD COLUMNS=200
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/onnxruntime_genai-*.whl || exit 1
M=/tmp/models; mkdir -p $M
for v in "fp16 cuda" "int4 cuda" "fp32 cpu"; do
  set -- $v
  python3 benchmarks/build_test_model.py $M/$1 --precision $1 --target $2 > /dev/null 2>&1 &
done
wait
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee $OUT/gpu.txt
STAGE=${STAGE:-all}
if [[ $STAGE == all || $STAGE == tests ]]; then
  LOCKSTEP_CUDA_MODELS=$M timeout ${TEST_TIMEOUT:-900} python3 -m pytest -q -p no:cacheprovider tests/cuda \
    -rsP 2>&1 | tee $OUT/tests_cuda.log | tail -25  # -rP: the parity reports (max errors) of passing tests
fi
if [[ $STAGE == all || $STAGE == bench ]]; then
  SWEEP=${SWEEP:-1,8,32,64,128,256}
  for v in fp16 int4; do
    python3 -m core profile $M/$v --provider cuda --batch-sweep $SWEEP --tokens 64 --context 128 \
      --json $OUT/profile_${v}_captured.json 2>&1 | tee $OUT/profile_${v}_captured.txt | tail -12
    python3 -m core profile $M/$v --provider cuda --batch-sweep $SWEEP --tokens 32 --context 128 \
      --no-capture --json $OUT/profile_${v}_eager.json 2>&1 | tail -12
  done
  python3 benchmarks/hf_decode.py --batches $SWEEP --prompt-len 16 --tokens 64 2>&1 | tee $OUT/hf.txt
  # where the time goes, node by node (synchronised per node: launch + kernel, not pure GPU time)
  python3 benchmarks/cuda_decode.py $M/fp16 --batches 1,32,256 --steps 16 --profile 1,32,256 2>&1 | tee $OUT/op_profile.txt | tail -40
fi
