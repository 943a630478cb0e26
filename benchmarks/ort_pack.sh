#!/usr/bin/env bash
# Pack ONNX Runtime GenAI CUDA (the anchor of every speed table) for the GPU machine, which cannot
# download it. The two cp312 wheels come to 272 MB; a device call carries at most 64 MiB. Their
# installed tree, without what decoding does not load (the TensorRT provider, onnxruntime's
# transformers/quantization/tools, the genai model builder), is xz-compressed to about 215 MB
# and cut into parts: .ortx/x1 of 50 MB (carried with the 11 MB builder wheel in .whl) and
# x2, x3, ... of 55 MB, one per call while the machine stays warm.
#   bash benchmarks/ort_pack.sh            # downloads the wheels into .ort/ when missing
# On the GPU machine, after the last part: bash benchmarks/ort_pack.sh --unpack  (-> /tmp/ort;
# each call first copies its carried part to /tmp/ortx, since a later call removes it)
set -euo pipefail
if [ "${1:-}" = "--unpack" ]; then
  mkdir -p /tmp/ortx /tmp/ort; cp .ortx/x* /tmp/ortx/ 2>/dev/null || true
  [ -d /tmp/ort/onnxruntime_genai ] && exit 0
  ls /tmp/ortx/x* | sort -V | xargs cat | xz -dc -T0 | tar xf - -C /tmp/ort
  echo "ONNX Runtime GenAI CUDA in /tmp/ort (PYTHONPATH=/tmp/ort for the anchor process only)"
  exit 0
fi
mkdir -p .ort .ortx
grep -qx "/.ortx/" .git/info/exclude 2>/dev/null || printf '/.ort/\n/.ortx/\n' >> .git/info/exclude
for pkg in onnxruntime-gpu==1.31.1 onnxruntime-genai-cuda==0.18.0; do
  compgen -G ".ort/$(echo "${pkg%%==*}" | tr - _)-*.whl" >/dev/null ||
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 -d .ort "$pkg"
done
tree=$(mktemp -d); trap 'rm -rf "$tree"' EXIT
for w in .ort/onnxruntime_gpu-*.whl .ort/onnxruntime_genai_cuda-*.whl; do python3 -m zipfile -e "$w" "$tree"; done
rm -rf "$tree"/onnxruntime/capi/libonnxruntime_providers_tensorrt.so "$tree"/onnxruntime/{transformers,quantization,tools} \
  "$tree"/onnxruntime_genai/models
tar cf - -C "$tree" . | xz -T0 -7 > "$tree.txz"
rm -f .ortx/x*
head -c 50000000 "$tree.txz" > .ortx/x1
tail -c +50000001 "$tree.txz" | split -b 55000000 -a 1 --numeric-suffixes=2 - .ortx/x
rm -f "$tree.txz"
ls -l .ortx
