#!/usr/bin/env bash
# The GPU check of the engine builds (issue 7), in one go on a machine with a CUDA GPU and a CUDA build of torch:
# install TensorRT, export the demo's stages to ONNX, build TensorRT plans (fp32, fp16, bf16), run the GPU parity
# tests and engine_speed, print a short table. Everything lands in $OUT_DIR (default artifacts/gpu_check).
#
#   bash scripts/gpu_check.sh                 # PYTHON=python3 by default: the machine's own (CUDA) torch is kept
#   WHEELS=DIR bash scripts/gpu_check.sh      # no package index there: install from a folder of wheels
#
# Not run yet: no GPU was lent to the task that wrote it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT_DIR:-artifacts/gpu_check}
mkdir -p "$OUT"

"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else
          f"torch {torch.__version__} sees no CUDA GPU: run this on a GPU machine with a CUDA build of torch")'
PIP=("$PY" -m pip install --quiet --disable-pip-version-check)
if [ -n "${WHEELS:-}" ]; then PIP+=(--no-index --find-links "$WHEELS"); fi
# The project without its CPU torch pin, then what the tests import, then TensorRT.
"${PIP[@]}" --no-deps -e .
"${PIP[@]}" "transformers>=5.0,<6" "peft>=0.17" safetensors tokenizers tqdm matplotlib onnx onnxruntime onnxscript pytest
"${PIP[@]}" tensorrt
TRT_MAJOR=$("$PY" -c 'import tensorrt; print(tensorrt.__version__.split(".")[0])')
if [ "$TRT_MAJOR" -ge 11 ]; then  # no fp16/bf16 builder flags any more: the graphs are rewritten by AutoCast
  "${PIP[@]}" "nvidia-modelopt[onnx]"
fi
"$PY" -c 'import tensorrt, torch; print(f"TensorRT {tensorrt.__version__}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name(0)}")' | tee "$OUT/versions.txt"

status=0
"$PY" -m engine_build onnx --model models/demo/model --out "$OUT/onnx"
for precision in fp32 fp16 bf16; do
  "$PY" -m engine_build tensorrt --onnx "$OUT/onnx" --out "$OUT/trt-$precision" --precision "$precision" \
    || { echo "TensorRT $precision build FAILED"; status=1; }
done
"$PY" -m pytest tests/test_tensorrt_gpu.py tests/test_onnx_export.py tests/test_onnx_engine.py -q -rs \
  2>&1 | tee "$OUT/pytest.log" || status=1
for precision in fp16 fp32; do
  if [ -f "$OUT/trt-$precision/engine.json" ]; then
    "$PY" -m benchmarks.engine_speed --threads 8 --trt-dir "$OUT/trt-$precision" \
      --json "$OUT/engine_speed_$precision.json" --plot "$OUT/engine_speed_$precision.png" || status=1
  fi
done

"$PY" - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print(f"\n{'plans':<6} {'engine':<12} {'phase':<8} {'tokens/s':>10} {'vs torch':>9}")
for path in sorted(out.glob("engine_speed_*.json")):
    for row in json.loads(path.read_text()):
        print(f"{path.stem.split('_')[-1]:<6} {row['engine']:<12} {row['phase']:<8} {row['tokens_per_s']:>10.1f} "
              f"{row['speedup_vs_torch']:>8.2f}x")
EOF
tail -n 3 "$OUT/pytest.log"
exit $status
