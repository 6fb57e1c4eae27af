#!/usr/bin/env bash
# Compile check of the CUDA compaction kernel alone (SPEC D5): csrc/allgather_compact.cu for sm_80 and
# sm_90 with every warning an error, register spills and local memory use included. The .cu includes
# no torch headers, so this takes about 2-4 s and needs nvcc only, no GPU and no CUDA build of torch.
# Skips (exit 0) when nvcc is absent.
#
# Usage: ci/kernel_check.sh            (NVCC=/path/to/nvcc to choose the compiler)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
src="$root/csrc/allgather_compact.cu"

nvcc="${NVCC:-}"
if [[ -z "$nvcc" ]]; then
  if command -v nvcc >/dev/null 2>&1; then
    nvcc="$(command -v nvcc)"
  elif [[ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]]; then
    nvcc="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"
  fi
fi
if [[ -z "$nvcc" || ! -x "$nvcc" ]]; then
  echo "kernel_check: SKIPPED: nvcc not found (set NVCC or CUDA_HOME, or put nvcc on PATH)"
  exit 0
fi

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

echo "kernel_check: $("$nvcc" --version | tail -n 1)"
start_ns=$(date +%s%N)
"$nvcc" -std=c++17 \
  -gencode arch=compute_80,code=sm_80 \
  -gencode arch=compute_90,code=sm_90 \
  -Xcompiler -Wall,-Werror -Werror all-warnings \
  -Xptxas -warn-spills,-warn-lmem-usage \
  -c "$src" -o "$out/allgather_compact.o"
elapsed_ms=$(( ($(date +%s%N) - start_ns) / 1000000 ))
printf 'kernel_check: OK: %s compiled for sm_80 and sm_90 in %d.%02d s\n' \
  "${src#"$root"/}" $((elapsed_ms / 1000)) $((elapsed_ms % 1000 / 10))
