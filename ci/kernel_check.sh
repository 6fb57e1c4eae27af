#!/usr/bin/env bash
# Checks of the CUDA compaction kernel alone (contract D5), with nvcc only: no GPU, no CUDA build of torch.
#
# 1. compile: csrc/allgather_compact.cu for sm_80 and sm_90, every warning an error, register spills and
#    local memory use included (the .cu includes no torch headers: about 2-4 s);
# 2. host emulation: the kernel's per-block code is __host__ __device__, so a small driver runs it on
#    the CPU, block by block and thread by thread, on random layouts (element sizes 1-16 bytes,
#    unaligned addresses, empty shards, inline and device segment tables, capped grids) and compares
#    every byte with memcpy. This checks the indexing, not the GPU: ci/gpu.sh runs it on a device.
#
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

cat >"$out/emulate.cu" <<'DRIVER'
// Runs compact_block (the kernel's per-block code) on the host and compares with memcpy.
#include "allgather_compact.cu"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

namespace dk = dstest_impl;

template <class Table>
void run_grid(char* d, const char* s, int64_t esz, const Table& table, int64_t segments,
              int64_t total_bytes, int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b) {
    for (int t = 0; t < dk::kThreads; ++t) {
      dk::compact_block(d, s, esz, table, segments, total_bytes, b, blocks, dk::Lane{t, dk::kThreads});
    }
  }
}

int main() {
  std::mt19937_64 rng(20240601);
  const int64_t sizes[] = {1, 2, 4, 8, 16};
  int layouts = 0;
  for (int trial = 0; trial < 600; ++trial) {
    const int64_t esz = sizes[rng() % 5];
    const int tensors = 1 + static_cast<int>(rng() % 3);
    const int world = 1 + static_cast<int>(rng() % (trial % 5 == 0 ? 70 : 9));
    const int64_t max_count = trial % 9 == 0 ? 20000 : 300;
    std::vector<std::vector<int64_t>> counts(tensors, std::vector<int64_t>(world));
    std::vector<int64_t> shard(tensors), column(tensors);
    int64_t row = 0;
    for (int t = 0; t < tensors; ++t) {
      for (auto& c : counts[t]) c = rng() % 4 == 0 ? 0 : static_cast<int64_t>(rng() % max_count);
      shard[t] = *std::max_element(counts[t].begin(), counts[t].end()) + static_cast<int64_t>(rng() % 3);
      column[t] = row;
      row += shard[t];
    }
    std::vector<int64_t> src_off, dst_off;
    int64_t total = 0;
    for (int t = 0; t < tensors; ++t) {
      for (int r = 0; r < world; ++r) {
        src_off.push_back(r * row + column[t]);
        dst_off.push_back(total);
        total += counts[t][r];
      }
    }
    dst_off.push_back(total);
    const int64_t segments = static_cast<int64_t>(src_off.size());
    if (total == 0) continue;
    const size_t src_pad = rng() % 17, dst_pad = rng() % 17;
    std::vector<char> src(static_cast<size_t>(world * row * esz) + src_pad);
    for (auto& b : src) b = static_cast<char>(rng());
    std::vector<char> dst(static_cast<size_t>(total * esz) + dst_pad + 16, 0x5a);
    std::vector<char> want = dst;
    const char* s = src.data() + src_pad;
    for (int64_t i = 0; i < segments; ++i) {
      std::memcpy(want.data() + dst_pad + dst_off[i] * esz, s + src_off[i] * esz,
                  static_cast<size_t>((dst_off[i + 1] - dst_off[i]) * esz));
    }
    const int64_t total_bytes = total * esz;
    // The launcher's grid, or a tiny one that makes the grid-stride loop do the work.
    const int64_t blocks = trial % 3 == 0 ? 1 + static_cast<int64_t>(rng() % 3)
                                          : static_cast<int64_t>(dk::compact_grid_size(total_bytes));
    char* d = dst.data() + dst_pad;
    if (segments <= dk::kCompactInlineSegments && rng() % 2 == 0) {
      dk::InlineTable table{};
      std::copy(src_off.begin(), src_off.end(), table.src);
      std::copy(dst_off.begin(), dst_off.end(), table.dst);
      run_grid(d, s, esz, table, segments, total_bytes, blocks);
    } else {
      run_grid(d, s, esz, dk::DeviceTable{src_off.data(), dst_off.data()}, segments, total_bytes, blocks);
    }
    if (dst != want) {
      std::printf("MISMATCH: trial %d elem_size %lld ranks %d tensors %d total %lld blocks %lld\n", trial,
                  static_cast<long long>(esz), world, tensors, static_cast<long long>(total),
                  static_cast<long long>(blocks));
      return 1;
    }
    ++layouts;
  }
  // The launcher's argument checks return before touching the device.
  int64_t so[1] = {0}, dof[2] = {0, 1};
  char a[4], b[4];
  if (dk::compact_cuda(a, b, 1, so, dof, 1, 2, false, nullptr) != cudaErrorInvalidValue ||
      dk::compact_cuda(a, b, 0, so, dof, 1, 1, false, nullptr) != cudaErrorInvalidValue ||
      dk::compact_cuda(a, b, 1, so, dof, dk::kCompactInlineSegments + 1, 1, false, nullptr) !=
          cudaErrorInvalidValue ||
      dk::compact_cuda(a, b, 1, so, dof, 1, 0, false, nullptr) != cudaSuccess) {
    std::printf("launcher argument checks failed\n");
    return 1;
  }
  std::printf("%d layouts\n", layouts);
  return 0;
}
DRIVER

start_ns=$(date +%s%N)
"$nvcc" -std=c++17 -O2 -gencode arch=compute_90,code=sm_90 -Xcompiler -Wall,-Werror \
  -I"$root/csrc" "$out/emulate.cu" -o "$out/emulate"
if ! result="$("$out/emulate")"; then
  echo "kernel_check: FAILED: host emulation of the kernel differs from memcpy: $result"
  exit 1
fi
elapsed_ms=$(( ($(date +%s%N) - start_ns) / 1000000 ))
printf 'kernel_check: OK: host emulation of the kernel equals memcpy on %s (build and run %d.%02d s)\n' \
  "$result" $((elapsed_ms / 1000)) $((elapsed_ms % 1000 / 10))
