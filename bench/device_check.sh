#!/usr/bin/env bash
# The prepared GPU check: Tandem against mlx_lm.server on a lent device machine.
#
#   bash bench/device_check.sh [--dry-run] [--stage-only] [ARGS for `tandem bench device`]
#
# On a fresh device machine (no network; run from the device tool, which sets $OUT):
#   1. stages the wheel part it was carried with (.device-wheels/pN, made here by
#      `python -m bench.device_wheels pack`); mlx-cuda-13 alone is larger than one call
#      may carry, so the parts travel one call each, and every call but the last stops
#      here (`--stage-only`, or when pieces are still missing: exit 3);
#   2. installs MLX's CUDA backend, mlx-lm and the project from those wheels into the
#      image's Python (no mlx-cpu, no mkl: pip --no-index, the project --no-deps);
#   3. runs `tandem bench device` (bench/device.py): every stage bounded in time, the
#      summary, JSON and plots written to $OUT.
# --dry-run installs nothing and runs the toy sizes on this machine's CPU with the
# checkout's .venv (tests/test_device_check.py runs it).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/device-out}"
export OUT
mkdir -p "$OUT"

dry=""
stage_only=""
args=()
for arg in "$@"; do
    case "$arg" in
        --dry-run) dry=1; args+=("$arg") ;;
        --stage-only) stage_only=1 ;;
        *) args+=("$arg") ;;
    esac
done

if [ -n "$dry" ]; then
    PY="${DEVICE_PYTHON:-$PWD/.venv/bin/python}"
    [ -x "$PY" ] || PY=python3
else
    PY="${DEVICE_PYTHON:-python3}"
    WHEELS="${DEVICE_WHEELS:-/tmp/tandem-device-wheels}"
    "$PY" -m bench.device_wheels stage --src .device-wheels --dest "$WHEELS"
    staged=$?
    if [ -n "$stage_only" ] || [ "$staged" -ne 0 ]; then
        exit "$staged"
    fi
    echo "[device_check] installing from $WHEELS/wheels"
    started=$(date +%s)
    "$PY" -m pip uninstall -q -y mlx-cpu >/dev/null 2>&1  # both write mlx/lib/libmlx.so
    mapfile -t reqs < <("$PY" -m bench.device_wheels requirements)
    "$PY" -m pip install -q --no-index --find-links "$WHEELS/wheels" "${reqs[@]}" || {
        echo "[device_check] pip install failed: a wheel the image lacks was not carried"
        exit 4
    }
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . \
        || "$PY" -m pip install -q --no-index --no-deps --no-build-isolation . || exit 4
    echo "[device_check] installed in $(( $(date +%s) - started )) s"
    "$PY" -c "import mlx.core as mx; print('[device_check] MLX computes on', mx.default_device())"
fi

"$PY" -m bench.device --out "$OUT" ${args[@]+"${args[@]}"} 2>&1 | tee "$OUT/run.log"
exit "${PIPESTATUS[0]}"
