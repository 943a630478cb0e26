#!/usr/bin/env bash
# One device call: build the test models, run the GPU tests, profile (before/after when
# .before/before.tar is carried), and the streaming sweep. Logs land in /tmp/gpu_suite and are
# packed into $OUT/gpu_suite.tgz at the end (the device tool brings back at most 8 files).
#   carry: [".whl", ".before"]   (the onnxruntime-genai cp312 wheel for the builder; see README)
#   STAGE=models|tests|profile|sampling|stream|context|kernels|ort|schedules|pdl|all (comma list), TEST_TIMEOUT, SWEEP
#   context: the batch x prompt-length sweep (CSWEEP, LENS); kernels: --kernels at KSWEEP;
#   ort: ONNX Runtime GenAI CUDA on the same grid (needs it importable from /tmp/ort, or the
#   onnxruntime-gpu and onnxruntime-genai-cuda wheels in $ORT_WHEELS, or benchmarks/ort_pack.sh's parts), then the sweep with --anchor
#   schedules: the GEMM schedules (LOCKSTEP_CUDA_GEMM_PIPELINE / _WIDE) tested, profiled off / all / default, ncu
#   pdl: programmatic dependent launch by rows (on by default): tests/cuda with LOCKSTEP_CUDA_PDL=1, then off (=0) / on / off / on on six folders (SmolLM2, Qwen2.5-0.5B, Llama-3.2-1B;
#     fp16 and int4) at PDL_SWEEP, each rows cap in PDL_ROWS (the evidence for turning PDL on by default)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
FINAL_OUT=$OUT; LOG=/tmp/gpu_suite; mkdir -p $LOG
trap 'tar czf "$FINAL_OUT/gpu_suite.tgz" -C "$LOG" . ; cp "$LOG"/*.log "$FINAL_OUT"/ 2>/dev/null' EXIT
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD COLUMNS=200
STAGE=${STAGE:-all}
has() { [[ ",$STAGE," == *",$1,"* || $STAGE == all ]]; }
[ -d /tmp/site/onnxruntime_genai ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/onnxruntime_genai-*.whl || exit 1
M=/tmp/models; mkdir -p $M
if has models; then
  for v in "fp16 cuda" "int4 cuda" "fp32 cpu"; do
    set -- $v
    [ -f $M/$1/model.onnx ] || python3 benchmarks/build_test_model.py $M/$1 --precision $1 --target $2 > $LOG/build_$1.txt 2>&1 &
  done
  [ -f $M/qwen-fp16/model.onnx ] || python3 benchmarks/build_test_model.py $M/qwen-fp16 --arch qwen2.5-1.5b --precision fp16 --target cuda --keep-hf /tmp/qwen-hf > $LOG/build_qwen_fp16.txt 2>&1
  [ -f $M/qwen-int4/model.onnx ] || python3 benchmarks/build_test_model.py $M/qwen-int4 --arch qwen2.5-1.5b --precision int4 --target cuda --keep-hf /tmp/qwen-hf > $LOG/build_qwen_int4.txt 2>&1 &
  wait
  ls $M/*/model.onnx | tee $LOG/models.txt
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee $LOG/gpu.txt
if has tests; then
  LOCKSTEP_CUDA_MODELS=$M timeout ${TEST_TIMEOUT:-900} python3 -m pytest -q -p no:cacheprovider tests/cuda \
    -rsP -x ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tee $LOG/tests_cuda.log | tail -25
fi
if has profile; then
  SWEEP=${SWEEP:-1,32,256}
  if [ -f .before/before.tar ]; then
    rm -rf /tmp/before && mkdir -p /tmp/before && tar xf .before/before.tar -C /tmp/before
    (cd /tmp/before && PYTHONPATH=/tmp/site:/tmp/before python3 -m core profile $M/fp16 --provider cuda \
      --batch-sweep $SWEEP --tokens 64 --context 128 --json $LOG/profile_before.json 2>&1 | tee $LOG/profile_before.txt | tail -8)
  fi
  python3 -m core profile $M/fp16 --provider cuda --batch-sweep $SWEEP --tokens 64 --context 128 \
    --json $LOG/profile_after.json 2>&1 | tee $LOG/profile_after.txt | tail -8
  if [ -f .before/before.tar ]; then  # the same pair again: the spread between runs is the noise
    (cd /tmp/before && PYTHONPATH=/tmp/site:/tmp/before python3 -m core profile $M/fp16 --provider cuda \
      --batch-sweep $SWEEP --tokens 64 --context 128 --json $LOG/profile_before2.json 2>&1 | tail -6)
  fi
  python3 -m core profile $M/fp16 --provider cuda --batch-sweep $SWEEP --tokens 64 --context 128 \
    --json $LOG/profile_after2.json 2>&1 | tail -6
fi
if has sampling; then  # issue 13: device_sample's cost in the captured step (target <= 10% at batch 1 and 64)
  python3 benchmarks/sampling.py $M/fp16 --provider cuda --batches ${SAMPLING_BATCHES:-1,64} --steps 200 \
    --json $LOG/sampling.json 2>&1 | tee $LOG/sampling.txt | tail -14
fi
if has stream; then
  for v in ${STREAM_MODELS:-qwen-fp16 qwen-int4}; do
    python3 benchmarks/streaming.py $M/$v --offload ${OFFLOAD:-0,0.25,0.5,0.75} --batches ${SBATCH:-1,2,4,8,16,32,64} \
      ${HF:+--hf /tmp/qwen-hf} --json $LOG/stream_$v.json --plot $LOG/stream_$v.png 2>&1 | tee $LOG/stream_$v.txt | tail -30
  done
fi
LENS=${LENS:-32,512,1024,4096}
if has ort; then
  if [ ! -d /tmp/ort/onnxruntime_genai ] && [ -n "${ORT_WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/ort "$ORT_WHEELS"/*.whl
  elif [ ! -d /tmp/ort/onnxruntime_genai ]; then  # the parts of benchmarks/ort_pack.sh, carried call by call
    bash benchmarks/ort_pack.sh --unpack
  fi
  for v in ${ORT_MODELS:-fp16}; do
    PYTHONPATH=/tmp/ort python3 benchmarks/ort_genai_decode.py $M/$v --batches ${CSWEEP:-1,8,32} --prompt-len $LENS \
      --tokens 64 --graph --json $LOG/ort_$v.json 2>&1 | tee $LOG/ort_$v.txt | tail -20
  done
fi
if has context; then
  for v in ${CONTEXT_MODELS:-fp16}; do
    python3 -m core profile $M/$v --provider cuda --batch-sweep ${CSWEEP:-1,8,32} --prompt-len $LENS --tokens 64 \
      ${ORT_ANCHOR:+--anchor $LOG/ort_$v.json} --json $LOG/context_$v.json --plot $LOG/context_$v.png 2>&1 \
      | tee $LOG/context_$v.txt | tail -20
  done
fi
if has kernels; then
  for v in ${KERNEL_MODELS:-fp16 int4}; do
    python3 -m core profile $M/$v --provider cuda --kernels --batch-sweep ${KSWEEP:-1,8,32,256} --prompt-len 32 \
      --tokens 16 --tensor-tflops ${TFLOPS:-989} --json $LOG/kernels_$v.json 2>&1 | tee $LOG/kernels_$v.txt | tail -40
  done
fi
if has schedules; then  # the GEMM schedules: tests, then A/B
  SCHED_MODELS=${SCHED_MODELS:-llama-fp16 llama-int4}
  for v in $SCHED_MODELS; do  # the 1B architecture, built on first use
    [ -f $M/$v/model.onnx ] || python3 benchmarks/build_test_model.py $M/$v --arch llama-3.2-1b \
      --precision ${v#llama-} --target cuda > $LOG/build_$v.txt 2>&1
  done
  timeout ${TEST_TIMEOUT:-600} python3 -m pytest -q -p no:cacheprovider tests/cuda/test_gemm_pipeline.py 2>&1 \
    | tee $LOG/tests_schedules.log | tail -5
  for flags in "off off" "all off" "off all" "all all" "auto dense"; do
    set -- $flags
    for v in fp16 int4 $SCHED_MODELS; do
      LOCKSTEP_CUDA_GEMM_PIPELINE=$1 LOCKSTEP_CUDA_GEMM_WIDE=$2 python3 -m core profile $M/$v --provider cuda \
        --batch-sweep ${SCHED_SWEEP:-1,8,32,256} --prompt-len 32 --tokens 64 --json $LOG/sched_${v}_p$1w$2.json \
        2>&1 | tail -6 | tee -a $LOG/schedules.txt
    done
  done
  for w in off dense; do  # prefill: 8 x 1,024 prompt tokens are GEMMs of 8,192 rows
    LOCKSTEP_CUDA_GEMM_WIDE=$w python3 -m core profile $M/${SCHED_MODELS%% *} --provider cuda --batch-sweep 8 \
      --prompt-len 1024 --tokens 16 --json $LOG/prefill_w$w.json 2>&1 | tail -4 | tee -a $LOG/schedules.txt
  done
  command -v ncu >/dev/null && for b in 1 256; do
    timeout 300 python3 benchmarks/ncu_step.py \
      $M/llama-fp16 --batch $b 2>&1 | tee $LOG/ncu_llama_b$b.txt | head -30
  done
fi
if has pdl; then
  for v in "fp16 smollm2-135m" "int4 smollm2-135m" "qwen05-fp16 qwen2.5-0.5b" "qwen05-int4 qwen2.5-0.5b" \
           "llama-fp16 llama-3.2-1b" "llama-int4 llama-3.2-1b"; do
    set -- $v
    [ -f $M/$1/model.onnx ] || python3 benchmarks/build_test_model.py $M/$1 --arch $2 --precision ${1##*-} \
      --target cuda > $LOG/build_$1.txt 2>&1 &
  done
  wait
  LOCKSTEP_CUDA_PDL=1 LOCKSTEP_CUDA_MODELS=$M timeout ${TEST_TIMEOUT:-900} python3 -m pytest -q -p no:cacheprovider \
    tests/cuda -rs 2>&1 | tee $LOG/tests_cuda_pdl.log | tail -8
  for v in fp16 int4 qwen05-fp16 qwen05-int4 llama-fp16 llama-int4; do
    for run in 1 2; do
      LOCKSTEP_CUDA_PDL=0 python3 -m core profile $M/$v --provider cuda --batch-sweep ${PDL_SWEEP:-1,8,16,32,256} --prompt-len 32 \
        --tokens 64 --json $LOG/pdl_${v}_off$run.json 2>&1 | tail -7 | tee -a $LOG/pdl.txt
      for rows in ${PDL_ROWS:-16}; do
        LOCKSTEP_CUDA_PDL=1 LOCKSTEP_CUDA_PDL_ROWS=$rows python3 -m core profile $M/$v --provider cuda \
          --batch-sweep ${PDL_SWEEP:-1,8,16,32,256} --prompt-len 32 --tokens 64 \
          --json $LOG/pdl_${v}_r${rows}_$run.json 2>&1 | tail -7 | tee -a $LOG/pdl.txt
      done
    done
  done
fi
