#!/usr/bin/env bash
# GPU checks on a machine without network access: install the wheels carried in benchmarks/gpu/wheels/
# (megatron-core, liger-kernel; see README.md) into benchmarks/gpu/.site/, put that folder on
# PYTHONPATH, and run the one command with the arguments given here, e.g.
#   bash benchmarks/gpu/run_on_device.sh --out "$OUT"
# --target instead of a plain install: it needs no write access to the system Python, works where pip
# refuses to touch an externally managed environment, and leaves the machine as it was.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
wheels=benchmarks/gpu/wheels
site=benchmarks/gpu/.site
shopt -s nullglob
carried=("$wheels"/*.whl)
if ((${#carried[@]})); then
    python -m pip install --quiet --no-deps --no-index --upgrade --target "$site" "${carried[@]}"
    export PYTHONPATH="$PWD/$site${PYTHONPATH:+:$PYTHONPATH}"
    echo "installed into $site: ${carried[*]##*/}"
else
    echo "no wheels in $wheels: parts that need megatron-core or Liger will say they are not available"
fi
exec python -m benchmarks.gpu.run "$@"
