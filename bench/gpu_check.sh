#!/usr/bin/env bash
# The GPU check in one command (bench/gpu_check.py says what it runs and writes):
#   bench/gpu_check.sh --out gpu_check.json [--model DIR_OR_GGUF | --random-weights DIR] [--sections ...]
# A GPU machine needs CUDA torch, Triton and transformers (and pytest for the kernel tests);
# whatever else it lacks comes as wheels in $WHEELS (a directory), installed into a private
# target first, nothing fetched.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${WHEELS:-}" && -d "$WHEELS" ]] && compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu_check_site "$WHEELS"/*.whl
  export PYTHONPATH="/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec python3 -m bench.gpu_check "$@"
