// CUDA compaction of a padded allgather into the exact concatenation (SPEC D5, D6).
//
// Plain CUDA C++: no torch headers here (they make this file's compile ~25 s instead of ~2 s); the
// torch registration lives in allgather_compact_cuda.cpp and calls compact_cuda() below.
//
// One launch covers every segment. The output bytes are cut into fixed chunks; each block takes
// chunks in a grid-stride loop, finds the first segment overlapping its chunk by binary search over
// the destination offsets, and copies each overlapping piece. Work is thus balanced by bytes, not by
// segments: a layout with one huge shard and many empty ones keeps every block busy, and zero-size
// segments cost nothing. Each piece is copied with the widest vector (16, 8, 4, 2 or 1 bytes) that
// the source and destination addresses share, with a scalar head up to alignment and a scalar tail.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "allgather_compact.h"

namespace dstest_impl {
namespace {

constexpr int kThreads = 256;
// Vectors in flight per thread. With 4 blocks per SM this keeps 64 KiB of loads in flight per SM;
// 8 spills registers once all five vector widths are inlined (ptxas -v).
constexpr int kUnroll = 4;
// 16 KiB: one pass of 256 threads x 4 x 16-byte vectors.
constexpr int64_t kChunkBytes = int64_t{kThreads} * kUnroll * 16;
// 4 blocks of 256 threads per SM: at most 64 registers per thread, no spills (ptxas -v).
constexpr int kMinBlocksPerSm = 4;
constexpr int64_t kMaxBlocks = int64_t{1} << 16;  // beyond this the grid-stride loop takes over

// Everything a block does is in __host__ __device__ functions of the block and thread index, so
// ci/kernel_check.sh can run the very same code on the host (thread by thread, no GPU) against
// memcpy; the __global__ kernel only supplies blockIdx/threadIdx.
#define DSTEST_HD __host__ __device__ __forceinline__
#ifdef __CUDA_ARCH__
#define DSTEST_UNROLL _Pragma("unroll")
#else
#define DSTEST_UNROLL  // the host compiler does not know the pragma (and -Werror)
#endif

// The segment table travels by value in the kernel parameters (constant bank, indexable).
struct InlineTable {
  int64_t src[kCompactInlineSegments];
  int64_t dst[kCompactInlineSegments + 1];
  DSTEST_HD int64_t src_at(int64_t s) const { return src[s]; }
  DSTEST_HD int64_t dst_at(int64_t s) const { return dst[s]; }
};

// The segment table lives in device memory, for layouts with more segments than fit inline.
struct DeviceTable {
  const int64_t* src;
  const int64_t* dst;
  DSTEST_HD int64_t src_at(int64_t s) const { return src[s]; }
  DSTEST_HD int64_t dst_at(int64_t s) const { return dst[s]; }
};

// One thread's place in its block.
struct Lane {
  int tid;
  int nthreads;
};

// Copies n bytes from s to d with the whole block; d and s must be congruent modulo sizeof(V).
// A piece never exceeds one chunk, so 32-bit indices suffice here (and keep register use low).
template <typename V>
DSTEST_HD void copy_piece(char* d, const char* s, int n, Lane lane) {
  constexpr int kV = static_cast<int>(sizeof(V));
  const int misalign = static_cast<int>(reinterpret_cast<uintptr_t>(d) % kV);
  const int align_head = (kV - misalign) % kV;
  const int head = align_head < n ? align_head : n;
  const int nvec = (n - head) / kV;
  const int tail = head + nvec * kV;

  for (int i = lane.tid; i < head; i += lane.nthreads) d[i] = s[i];

  V* dv = reinterpret_cast<V*>(d + head);
  const V* sv = reinterpret_cast<const V*>(s + head);
  for (int base = lane.tid; base < nvec; base += lane.nthreads * kUnroll) {
    V buf[kUnroll];
DSTEST_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * lane.nthreads;
      if (i < nvec) buf[u] = sv[i];
    }
DSTEST_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * lane.nthreads;
      if (i < nvec) dv[i] = buf[u];
    }
  }

  for (int i = tail + lane.tid; i < n; i += lane.nthreads) d[i] = s[i];
}

DSTEST_HD void copy_bytes(char* d, const char* s, int n, Lane lane) {
  const uintptr_t rel = reinterpret_cast<uintptr_t>(d) ^ reinterpret_cast<uintptr_t>(s);
  if (rel % 16 == 0) {
    copy_piece<uint4>(d, s, n, lane);
  } else if (rel % 8 == 0) {
    copy_piece<uint2>(d, s, n, lane);
  } else if (rel % 4 == 0) {
    copy_piece<unsigned int>(d, s, n, lane);
  } else if (rel % 2 == 0) {
    copy_piece<unsigned short>(d, s, n, lane);
  } else {
    copy_piece<unsigned char>(d, s, n, lane);
  }
}

// First segment whose destination range ends after `byte` (exists: byte < total bytes).
template <class Table>
DSTEST_HD int64_t first_segment_after(const Table& table, int64_t num_segments, int64_t elem_size,
                                      int64_t byte) {
  int64_t lo = 0;
  int64_t hi = num_segments - 1;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (table.dst_at(mid + 1) * elem_size > byte) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

// The work of block `block` out of `num_blocks`: its chunks, grid-stride.
template <class Table>
DSTEST_HD void compact_block(char* dst, const char* src, int64_t elem_size, const Table& table,
                             int64_t num_segments, int64_t total_bytes, int64_t block,
                             int64_t num_blocks, Lane lane) {
  const int64_t num_chunks = (total_bytes + kChunkBytes - 1) / kChunkBytes;
  for (int64_t chunk = block; chunk < num_chunks; chunk += num_blocks) {
    const int64_t begin = chunk * kChunkBytes;
    const int64_t end = begin + kChunkBytes < total_bytes ? begin + kChunkBytes : total_bytes;
    for (int64_t s = first_segment_after(table, num_segments, elem_size, begin); s < num_segments;
         ++s) {
      const int64_t seg_begin = table.dst_at(s) * elem_size;
      if (seg_begin >= end) break;
      const int64_t seg_end = table.dst_at(s + 1) * elem_size;
      const int64_t piece_begin = begin > seg_begin ? begin : seg_begin;
      const int64_t piece_end = end < seg_end ? end : seg_end;
      if (piece_end <= piece_begin) continue;  // an empty shard
      copy_bytes(dst + piece_begin, src + table.src_at(s) * elem_size + (piece_begin - seg_begin),
                 static_cast<int>(piece_end - piece_begin), lane);
    }
  }
}

template <class Table>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    compact_kernel(char* __restrict__ dst, const char* __restrict__ src, int64_t elem_size,
                   const Table table, int64_t num_segments, int64_t total_bytes) {
  compact_block(dst, src, elem_size, table, num_segments, total_bytes, blockIdx.x, gridDim.x,
                Lane{static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x)});
}

// Blocks for `total_bytes` of output: one per chunk, capped (the grid-stride loop covers the rest).
inline unsigned int compact_grid_size(int64_t total_bytes) {
  const int64_t num_chunks = (total_bytes + kChunkBytes - 1) / kChunkBytes;
  return static_cast<unsigned int>(num_chunks < kMaxBlocks ? num_chunks : kMaxBlocks);
}

}  // namespace

cudaError_t compact_cuda(void* dst, const void* src, int64_t elem_size, const int64_t* src_off,
                         const int64_t* dst_off, int64_t num_segments, int64_t total,
                         bool table_on_device, cudaStream_t stream) {
  if (elem_size <= 0 || num_segments < 0 || total < 0) return cudaErrorInvalidValue;
  if (!table_on_device && num_segments > kCompactInlineSegments) return cudaErrorInvalidValue;
  if (total == 0 || num_segments == 0) return cudaSuccess;  // nothing to copy, nothing launched
  if (dst == nullptr || src == nullptr || src_off == nullptr || dst_off == nullptr) {
    return cudaErrorInvalidValue;
  }

  const int64_t total_bytes = total * elem_size;
  const dim3 grid(compact_grid_size(total_bytes));
  const dim3 block(kThreads);
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);

  if (table_on_device) {
    const DeviceTable table{src_off, dst_off};
    compact_kernel<DeviceTable>
        <<<grid, block, 0, stream>>>(d, s, elem_size, table, num_segments, total_bytes);
  } else {
    if (dst_off[num_segments] != total) return cudaErrorInvalidValue;
    InlineTable table{};
    for (int64_t i = 0; i < num_segments; ++i) {
      table.src[i] = src_off[i];
      table.dst[i] = dst_off[i];
    }
    table.dst[num_segments] = dst_off[num_segments];
    compact_kernel<InlineTable>
        <<<grid, block, 0, stream>>>(d, s, elem_size, table, num_segments, total_bytes);
  }
  return cudaGetLastError();
}

}  // namespace dstest_impl
