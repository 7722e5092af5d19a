#!/usr/bin/env bash
# The GPU check: stoker's cuda-marked tests and its GPU figures, in under 5 minutes,
# on any machine with an NVIDIA GPU, without network access.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]        (default OUT_DIR: gpu-check-out)
#
# Uses the system python3 (or $PYTHON), which must already have PyTorch with CUDA.
# Nothing is fetched: stoker runs from src/ through PYTHONPATH. If a dependency stoker
# needs is missing there (pydantic, say), put its wheels in $WHEELS (default: .whl/
# in the repository) and they are installed from that folder with --no-index.
# GPU_CHECK_CPU_SMOKE=1 runs the same flow tiny on the CPU, to check the script itself.
# Writes OUT_DIR/pytest.log, OUT_DIR/gpu_check.log and OUT_DIR/gpu_check.json, and
# prints a short table last. Exit status: 0 all good; 1 no GPU, stoker not importable,
# a cuda test failed or a measurement failed.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT=${1:-gpu-check-out}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
die() { echo "gpu_check: $*" >&2; exit 1; }

# 1. A GPU, seen by PyTorch.
"$PY" -c "import torch" 2>/dev/null \
  || die "$PY cannot import torch; this check needs a Python that already has PyTorch with CUDA (set PYTHON=...)"
SMOKE=()
if [ "${GPU_CHECK_CPU_SMOKE:-0}" = 1 ]; then
  # Checks this script's own flow on a machine without a GPU: tiny, CPU, no figures.
  echo "gpu_check: GPU_CHECK_CPU_SMOKE=1: running the flow on the CPU; the figures mean nothing"
  SMOKE=(--cpu-smoke)
elif ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  "$PY" -c "import torch; print(f'torch {torch.__version__}, built for CUDA {torch.version.cuda}')" >&2
  command -v nvidia-smi >/dev/null && nvidia-smi -L >&2
  die "no NVIDIA GPU is visible to PyTorch: run this on a machine with one (and a CUDA build of torch)"
fi

# 2. stoker from src/, without installing anything from the network.
export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import stoker" 2>/dev/null && compgen -G "$WHEELS/*.whl" >/dev/null; then
  echo "gpu_check: installing the wheels in $WHEELS (offline)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/stoker-gpu-check-site \
    "$WHEELS"/*.whl || die "could not install the wheels in $WHEELS"
  export PYTHONPATH="$PYTHONPATH:/tmp/stoker-gpu-check-site"
fi
if ! missing=$("$PY" -c "import stoker" 2>&1); then
  echo "$missing" | tail -3 >&2
  die "stoker cannot be imported with $PY; a required package is missing (see above): carry its wheels in $WHEELS/ (pip download --no-deps --only-binary=:all: ... -d $WHEELS NAME)"
fi

# 3. The cuda-marked tests: only the modules that hold some, so a test module that needs
#    an optional package this machine lacks (mlflow, say) cannot fail the collection.
mapfile -t cuda_modules < <(grep -rlE "mark\.cuda" tests --include='*.py' | sort)
echo "gpu_check: pytest -m cuda (${#cuda_modules[@]} modules)"
if [ "${#cuda_modules[@]}" = 0 ]; then
  echo "no cuda-marked tests found" >"$OUT/pytest.log"
  tests_status=0
else
  timeout 90 "$PY" -m pytest -m cuda -q -p no:cacheprovider "${cuda_modules[@]}" \
    >"$OUT/pytest.log" 2>&1
  tests_status=$?
fi
tail -5 "$OUT/pytest.log"

# 4. The figures (about 3 minutes).
echo "gpu_check: measuring"
PYTHONUNBUFFERED=1 timeout 200 "$PY" benchmarks/gpu_check.py --out "$OUT" "${SMOKE[@]}" 2>&1 \
  | tee "$OUT/gpu_check.log" | grep -v '^\[gpu_check\]' | tail -16
measure_status=${PIPESTATUS[0]}

echo
echo "pytest -m cuda: $([ "$tests_status" = 0 ] && echo passed || echo "FAILED (exit $tests_status, $OUT/pytest.log)")"
echo "measurements:   $([ "$measure_status" = 0 ] && echo complete || echo "INCOMPLETE (exit $measure_status, $OUT/gpu_check.log)")"
[ "$tests_status" = 0 ] && [ "$measure_status" = 0 ]
