#!/usr/bin/env bash
# Models larger than the device (docs/large-models.md): in one device call, build the
# Llama-3.1-8B-architecture fp16 folder (random weights; benchmarks/build_test_model.py), then for
# each device budget: `lockstep plan` (sizes from the header), and `lockstep profile` under that
# budget with nvidia-smi polling the device's memory every 200 ms beside the profile's own driver
# meter (cudaMemGetInfo every 2 ms). Optionally the GPU tests of the feature first (TESTS=1).
#   carry: [".whl"] (the onnxruntime-genai cp312 wheel for the builder)
#   ARCH (llama-3.1-8b; build_test_model.py's --arch), PRECISION (fp16 or int4), M (model folder), BUDGETS ("8GiB 4GiB 12GiB"), BATCHES (1,8,32), TOKENS (32), DEADLINE (seconds
#   after which no new budget starts; default 480)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ARCH=${ARCH:-llama-3.1-8b}; PRECISION=${PRECISION:-fp16}
LOG=/tmp/large-$ARCH-$PRECISION; mkdir -p $LOG
trap 'tar czf "$OUT/large-$ARCH-$PRECISION.tgz" -C "$LOG" .' EXIT
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD COLUMNS=220
START=$SECONDS
M=${M:-/tmp/models/${ARCH}-${PRECISION}}
[ -d /tmp/site/onnxruntime_genai ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site \
  ${WHL:-.whl}/onnxruntime_genai-*.whl || exit 1
# the build runs in a session of its own, so it outlives this call when the call's limit comes first
# (a back-to-back call on the still-warm machine then finds it done or under way)
if [ ! -f $M/model.onnx ] && [ ! -f $LOG/build.started ]; then
  touch $LOG/build.started
  setsid nohup bash -c "python3 benchmarks/build_test_model.py $M --arch $ARCH --precision $PRECISION \
    --target cuda --hf-dtype float16 > $LOG/build.txt 2>&1; echo done > $LOG/build.done" > /dev/null 2>&1 &
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $LOG/gpu.txt
if [ "${TESTS:-0}" = 1 ]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_load_budget.py \
    "tests/cuda/test_cuda_streaming.py::test_streamed_steps_are_bitwise_the_resident_steps" -rsP -x 2>&1 \
    | tee $LOG/tests.log | tail -30
fi
while [ ! -f $M/model.onnx ] || { [ -f $LOG/build.started ] && [ ! -f $LOG/build.done ]; }; do
  if (( SECONDS - START > ${DEADLINE:-480} )); then echo "deadline: the build is still running"; exit 0; fi
  sleep 5
done
echo "model ready after $((SECONDS - START)) s"; tail -3 $LOG/build.txt 2>/dev/null
du -sh $M | tee $LOG/model_size.txt
for B in ${BUDGETS:-8GiB 4GiB 12GiB}; do
  if (( SECONDS - START > ${DEADLINE:-480} )); then echo "deadline: budget $B not run" | tee -a $LOG/skipped.txt; continue; fi
  python3 -m core plan $M --provider cuda --device-budget $B --batch ${BATCHES:-1,8,32} --context 512 --json \
    > $LOG/plan_$B.json 2> $LOG/plan_$B.err
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > $LOG/smi_$B.txt &
  SMI=$!
  sleep 1
  timeout ${RUN_TIMEOUT:-170} python3 -m core profile $M --provider cuda --device-budget $B --batch-sweep ${BATCHES:-1,8,32} \
    --tokens ${TOKENS:-32} --warmup 4 --context 512 --json $LOG/profile_$B.json > $LOG/profile_$B.txt 2>&1
  kill $SMI
  echo "budget $B: nvidia-smi first $(head -1 $LOG/smi_$B.txt) MiB, peak $(sort -n $LOG/smi_$B.txt | tail -1) MiB" \
    | tee -a $LOG/summary.txt
  tail -12 $LOG/profile_$B.txt
done

