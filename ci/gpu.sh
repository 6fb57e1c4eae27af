#!/usr/bin/env bash
# One-shot checks for a machine with a GPU (contract D5, D6 and every `gpu`-marked test of the repo).
#
# Expects: a CUDA build of torch (2.11+, CUDA 13), nvcc (CUDA_HOME, default /usr/local/cuda), the
# project's Python dependencies installed; needs no network. Steps, each with its own time limit and
# log, all run even when one fails:
#
#   1. environment report        env.txt
#   2. ci/kernel_check.sh        kernel_check.log     the .cu alone, sm_80/sm_90, warnings as errors
#   3. extension build           build.log            csrc/ with TORCH_CUDA_ARCH_LIST (default 9.0)
#   4. pytest -m gpu             pytest-gpu.log, pytest-gpu.xml        the nccl world of one node: dstest
#                                                                     starts one process per GPU (threaded
#                                                                     CUDA world where GPUs < world size)
#   5. torchrun ... pytest -m gpu pytest-launched.log, pytest-launched.xml   the launched world: torchrun
#                                                                     starts one pytest per GPU, specs run on
#                                                                     the launched ranks over NCCL
#   6. benchmark --device cuda   bench-cuda.log, bench-cuda.json
#
# Everything lands in "${OUT:-./gpu-out}"; summary.txt lists each step's exit code and seconds. The
# script exits non-zero when any step failed.
#
# Usage: bash ci/gpu.sh          (OUT=/some/dir, TORCH_CUDA_ARCH_LIST="8.0;9.0", PYTHON=python3.12,
#                                 GPUS=8: the launched step's --nproc-per-node, default every visible GPU)
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

out="${OUT:-$root/gpu-out}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
python="${PYTHON:-python}"

export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export PATH="$CUDA_HOME/bin:$PATH"
# Without an arch list torch's arch detection needs a visible GPU; set it so the build never guesses.
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
# The build cache stays out of $OUT (which is fetched back); fresh per run unless given.
export DSTEST_EXT_DIR="${DSTEST_EXT_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/dstest-ext.XXXXXX")}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1

summary="$out/summary.txt"
: >"$summary"
failed=0

# step NAME LIMIT_SECONDS LOG -- COMMAND...: runs COMMAND with a time limit, logs it, records the result.
step() {
  local name="$1" limit="$2" log="$3"
  shift 4
  local start rc
  start=$(date +%s)
  echo "== $name: $*" >"$log"
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  local took=$(($(date +%s) - start))
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    echo "   (timed out after ${limit} s)" >>"$log"
  fi
  printf '%-14s rc=%-3d %4d s  %s\n' "$name" "$rc" "$took" "${log#"$out"/}" | tee -a "$summary"
  tail -n 5 "$log"
  if [[ $rc -ne 0 ]]; then failed=1; fi
  return 0
}

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)"
  echo "CUDA_HOME=$CUDA_HOME TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST DSTEST_EXT_DIR=$DSTEST_EXT_DIR"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  else
    echo "nvidia-smi: not found"
  fi
  "$CUDA_HOME/bin/nvcc" --version 2>&1 | tail -n 2 || echo "nvcc: unavailable"
  "$python" -c 'import sys, torch; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), "devices", torch.cuda.device_count())' 2>&1
} >"$out/env.txt"
cat "$out/env.txt"

step kernel_check 120 "$out/kernel_check.log" -- bash "$root/ci/kernel_check.sh"

step build 600 "$out/build.log" -- "$python" -c '
import time
import torch
t = time.perf_counter()
import impl.ops as ops
info = ops.load_extension()
print(info)
print(f"build+load {time.perf_counter() - t:.1f} s")
assert info.with_cuda, "the extension was built without CUDA: check CUDA_HOME and torch.version.cuda"
x = torch.arange(10.0, device="cuda")
got = ops.compact(x, [3, 0, 2, 5, 1])
want = ops.compact_reference(x.cpu(), [3, 0, 2, 5, 1])
assert torch.equal(got.cpu(), want), (got, want)
print("smoke: compact on cuda equals the reference")
'

# The dstest pytest plugin comes from the package's entry point when installed; from the checkout
# otherwise (loading it both ways would register it twice).
plugin=()
if ! "$python" -c 'import importlib.metadata as m; m.distribution("dstest")' >/dev/null 2>&1; then
  plugin=(-p dstest.pytest.plugin)
fi
step pytest_gpu 600 "$out/pytest-gpu.log" -- "$python" -m pytest -m gpu -p no:cacheprovider \
  "${plugin[@]}" -ra --junitxml="$out/pytest-gpu.xml" "$root/tests"

# The same specs on ranks a launcher started (what several nodes do, on this one): one pytest per GPU.
gpus="${GPUS:-$("$python" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)}"
if [[ "$gpus" -ge 1 ]]; then
  step pytest_launched 900 "$out/pytest-launched.log" -- "$python" -m torch.distributed.run --standalone \
    --nproc-per-node "$gpus" -m pytest -m gpu -p no:cacheprovider "${plugin[@]}" -ra \
    --junitxml="$out/pytest-launched.xml" "$root/tests"
else
  echo "pytest_launched skipped: no CUDA device" | tee -a "$summary"
fi

step bench_cuda 300 "$out/bench-cuda.log" -- "$python" "$root/benchmarks/bench_allgather.py" \
  --device cuda --json "$out/bench-cuda.json"

echo "== summary ($out)"
cat "$summary"
exit "$failed"
