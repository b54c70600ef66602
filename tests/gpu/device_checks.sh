#!/bin/bash
# The device checks of the GPU issue as one script for a lent GPU machine: what it ran on (card, driver, CUDA,
# torch), the native parts built for that torch, the CUDA tests (tests/gpu), then the GPU benchmark
# (tests/perf/bench_gpu.py) in the time left.  Everything it writes goes under $OUT when set (else a new folder).
#
#   bash tests/gpu/device_checks.sh [all|tests|bench]     # all: about 9.5 minutes (DEADLINE_S=570 from the start)
#   BENCH_ARGS="--compile" bash tests/gpu/device_checks.sh bench          # more options for bench_gpu.py
#
# One command of the device tool runs 600 s at most: "all" fits one; or run "tests" and "bench" as two.
# The machine has no network.  Missing Python packages (its image lacks watchdog and OpenTelemetry, which obs
# needs) travel as wheels in .whl/ (see the device tool's README), installed here into /tmp/site:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl \
#     watchdog opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-proto \
#     opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-proto-http \
#     opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-prometheus importlib-metadata zipp
# Exit status: the tests' (or the benchmark's when only it runs).
set -u -o pipefail
cd "$(dirname "$0")/../.."
START=$(date +%s)
PART=${1:-all}
DEADLINE_S=${DEADLINE_S:-570}
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-$(command -v python3 || command -v python)}
export PYTHONUNBUFFERED=1
echo "writing under $OUT"

if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1 || true
    "$PY" - <<'PY'
import importlib.util, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "cudnn", torch.backends.cudnn.version(), "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
missing = [m for m in ("watchdog", "opentelemetry.sdk", "rich", "numpy") if importlib.util.find_spec(m) is None]
print("missing python packages:", missing or "none", "(carry them as wheels in .whl/)" if missing else "")
PY
} 2>&1 | tee "$OUT/versions.txt"

# The C hot paths (setup.py) and the C++ extensions for this torch (obs native build): the shipping configuration.
# SKIP_BUILD=1: use what is built already.
if [ -z "${SKIP_BUILD:-}" ]; then
    { "$PY" setup.py -q build_ext --inplace && "$PY" -m obs native build; } > "$OUT/build.log" 2>&1 \
        || echo "native build incomplete: see build.log (the Python paths are used where a part is missing)"
fi
"$PY" -m obs native status 2>&1 | tee -a "$OUT/build.log"

status=0
if [ "$PART" != bench ]; then
    timeout 270 "$PY" -m pytest -q -p no:cacheprovider tests/gpu -rs 2>&1 | tee "$OUT/tests_gpu.log"
    status=$?
fi
if [ "$PART" != tests ]; then
    left=$(( DEADLINE_S - ($(date +%s) - START) ))
    budget=$(( left - 75 ))  # model builds, warm-ups and the parent's margin
    if [ "$budget" -lt 60 ]; then
        echo "no time left for the benchmark ($left s): run it alone with: bash tests/gpu/device_checks.sh bench"
    else
        # shellcheck disable=SC2086  # BENCH_ARGS: more options, word-split on purpose (--compile, --models gpt2)
        timeout $(( left - 10 )) "$PY" tests/perf/bench_gpu.py --budget-s "$budget" --out "$OUT/bench-gpu.json" \
            ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_gpu.log"
        bench=$?
        [ "$PART" = bench ] && status=$bench
    fi
fi
echo "device checks done in $(( $(date +%s) - START )) s, status $status"
exit $status
