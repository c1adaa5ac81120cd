# Sourced by .ci/gpu_smoke.sh and scripts/bench/run_scaling.sh: the Python to run LiteGen with,
# as the array PY.
# LITEGEN_PYTHON wins (e.g. python3 on the GPU machine, which has no uv); else uv; else python3.
if [ -n "${LITEGEN_PYTHON:-}" ]; then
    PY=(${LITEGEN_PYTHON})
elif command -v uv >/dev/null 2>&1; then
    PY=(uv run --no-sync python)
else
    PY=(python3)
fi
