#!/usr/bin/env bash
# The accelerator check (issue 17): kernels vs references, plain-decode HBM bandwidth, speculative speed-up,
# compiles after warmup, written as one JSON under $OUT. Sized for one H200 in under 8 minutes on a fresh
# machine; models are random (nothing is downloaded from a model hub).
#
#   bash benchmarks/device_check.sh            # on the device: writes $OUT/device_check.json (+ log)
#   bash benchmarks/device_check.sh --tiny     # anywhere (CPU): tiny models, interpret-mode kernels
#
# Environment: a python3 whose jax sees the GPU is used as is (the lent H200 image has jax with CUDA and
# no network); otherwise `pip install "jax[cuda12]"` is tried. The project is installed without its
# dependencies (the image has them), falling back to PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/benchmarks/results/device_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
start=$(date +%s)

if [[ " $* " != *" --tiny "* ]]; then
  if ! "$PY" -c "import jax, sys; sys.exit(0 if jax.default_backend() == 'gpu' else 1)" 2>/dev/null; then
    echo "jax sees no GPU here: installing jax[cuda12]"
    "$PY" -m pip install -q "jax[cuda12]" || echo "pip install jax[cuda12] failed (no network?)"
  fi
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv 2>/dev/null | tee "$OUT/nvidia_smi.txt"
fi
# Install the project unless this checkout is already what `import specjax` finds.
if ! "$PY" -c "import specjax, pathlib, sys; sys.exit(0 if pathlib.Path(specjax.__file__).resolve().parent.parent == pathlib.Path.cwd().resolve() else 1)" 2>/dev/null; then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed; using PYTHONPATH"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import jax; print('jax', jax.__version__, jax.default_backend(), jax.devices())"

# The python driver starts no new part after --budget-s; the timeout is the hard stop. On the H200 the
# whole call must stay under 8 minutes (setup above takes seconds); a 2-core CPU needs far longer.
if [[ " $* " == *" --tiny "* ]]; then limit=3000; budget=2400; else limit=440; budget=330; fi
timeout "$limit" "$PY" benchmarks/device_check.py --out "$OUT/device_check.json" --budget-s "$budget" "$@" 2>&1 \
  | tee "$OUT/device_check.log"
rc=${PIPESTATUS[0]}
echo "device_check: exit $rc after $(( $(date +%s) - start ))s; JSON at $OUT/device_check.json"
exit "$rc"
