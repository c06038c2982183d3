#!/usr/bin/env bash
# The GPU checks of issue 14 on one machine with an NVIDIA GPU, as one prepared run:
#   1. tests/test_cuda.py: the oracles on CUDA (skipped on machines without a GPU);
#   2. benchmarks/bench_gpu.py: the 14B and 1.3B-size models, eager and compiled (MODES, default both).
# Logs and the benchmark's JSON go to $OUT (default out/gpu). Wheels in .whl/ (the project's pins of the
# packages a GPU image may lack: diffusers, transformers, tokenizers, ftfy, ...) are installed to a
# private folder first; without .whl/ the machine's own packages are used.
#   SIZES=1.3b,14b MODES=eager,compiled BLOCKS=30 TESTS_S=150 BENCH_S=420 bash benchmarks/run_gpu_checks.sh
# (the log name carries SIZES and MODES, so several runs into one $OUT keep their logs apart)
set -u
OUT=${OUT:-out/gpu}
MODES=${MODES:-eager,compiled}
SIZES=${SIZES:-1.3b,14b}
BLOCKS=${BLOCKS:-30}
TESTS_S=${TESTS_S:-150}
BENCH_S=${BENCH_S:-420}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 GRADIO_ANALYTICS_ENABLED=False
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  [ -d /tmp/site/diffusers ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/gpu.txt" || true
python3 -c "import torch, diffusers, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'diffusers', diffusers.__version__, 'transformers', transformers.__version__)" 2>&1 | tee -a "$OUT/gpu.txt"
if [ "$TESTS_S" -gt 0 ]; then
  timeout "$TESTS_S" python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$OUT/tests.log"
fi
if [ "$BENCH_S" -gt 0 ]; then
  timeout "$BENCH_S" python3 benchmarks/bench_gpu.py --sizes "$SIZES" --modes "$MODES" --blocks "$BLOCKS" --deadline-s $((BENCH_S - 15)) \
    --json "$OUT/bench_gpu_${SIZES//,/_}_${MODES//,/_}.json" 2>&1 | tee "$OUT/bench_gpu_${SIZES//,/_}_${MODES//,/_}.log"
fi
