#!/usr/bin/env bash
# The GPU checks in one run, on a CUDA host whose python has torch and triton (the project's other dependencies
# are not needed for these parts): the CUDA tests (tests/gpu), the Triton kernels against torch
# (benchmarks/gpu_kernels.py), the engine on CUDA (CUDA graphs vs eager vs transformers) and speculative decoding
# on CUDA. Each part has a time limit so that one hang cannot eat the others; its whole output is in $OUT/<part>.log.
#
#     OUT=/tmp/strata-gpu bash scripts/gpu_check.sh
set -u
OUT=${OUT:-/tmp/strata-gpu}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

part() {
  local name=$1 limit=$2 start rc
  shift 2
  echo "=== $name (limit ${limit} s): $*"
  start=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "=== $name: exit $rc after $(($(date +%s) - start)) s"
  tail -n "${TAIL:-30}" "$OUT/$name.log"
}

nvidia-smi -L 2>&1 | head -4
"$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, \
'| transformers', transformers.__version__, '| cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"
# NOTE: one process ran 26 of the 46 tests in 210 s on an H200 (compiles are CPU-bound): with pytest-xdist (in the
# image there), the files run side by side, each file's tests in one process (its module fixtures built once).
XDIST=()
"$PY" -c "import xdist" 2>/dev/null && XDIST=(-n "${TEST_PROCS:-4}" --dist loadfile)
part tests "${TESTS_S:-220}" "$PY" -m pytest -m gpu tests/gpu -q -p no:cacheprovider -rfEs --timeout 150 "${XDIST[@]}"
part kernels "${KERNELS_S:-80}" "$PY" benchmarks/gpu_kernels.py --json
part engine "${ENGINE_S:-170}" "$PY" benchmarks/engine_throughput.py --device cuda --dtype bfloat16 \
  --concurrency 1,32 --rounds 3 --json
part spec "${SPEC_S:-90}" "$PY" benchmarks/spec_bench.py --device cuda --drafters ngram,eagle --batches 1,32 \
  --temperatures 0 --workloads heldout --rounds 2 --json
