// Shared declarations of the uneven-shard allgather compaction (SPEC D5, D6).
//
// The compaction turns the padded result of one uniform allgather into the exact concatenation of
// the ranks' valid elements. Its layout is a list of segments: segment s copies
// dst_off[s + 1] - dst_off[s] elements from element offset src_off[s] of the padded buffer to element
// offset dst_off[s] of the output (dst_off has one more entry than src_off; its last is the total).
// For one tensor gathered over W ranks with shard size P, segment r is rank r: src_off[r] = r * P,
// dst_off[r] = counts[0] + ... + counts[r - 1]. For T tensors gathered in one collective the padded
// buffer is W rows of (P_0 + ... + P_{T-1}) elements and segment t * W + r is tensor t's shard of
// rank r; the output holds tensor 0's concatenation, then tensor 1's, and so on.
//
// This header has three parts: the layout in plain C++ (every file), the CUDA launcher (only where
// the CUDA runtime API is included: the .cu and the CUDA registration), and the torch-facing
// argument check (only in host files, never in the .cu, which must stay free of torch headers: they
// cost ~25 s per compile against ~2 s without).
#pragma once

#include <cstdint>
#include <vector>

namespace dstest_impl {

// The layout of one compaction, in elements. See the comment at the top of this file.
struct CompactPlan {
  std::vector<int64_t> src_off;  // one entry per segment
  std::vector<int64_t> dst_off;  // one entry per segment, plus the total at the end

  int64_t num_segments() const { return static_cast<int64_t>(src_off.size()); }
  int64_t total() const { return dst_off.empty() ? 0 : dst_off.back(); }
};

// Copies the planned segments on the host; `dst` and `src` must not overlap. Uses torch's intra-op
// thread pool for large copies (defined in allgather_compact_cpu.cpp).
void compact_cpu_copy(void* dst, const void* src, int64_t elem_size, const CompactPlan& plan);

}  // namespace dstest_impl

#ifdef CUDART_VERSION  // defined by cuda_runtime_api.h
namespace dstest_impl {

// Segments up to this count travel by value in the kernel's parameters (no host-to-device copy and
// safe under CUDA graph capture); 2 * 129 int64 values stay well inside the 4 KiB parameter limit.
constexpr int64_t kCompactInlineSegments = 128;

// Launches the compaction on `stream`: one kernel launch for all segments, whatever their count.
// `src_off` / `dst_off` follow CompactPlan and `total` is dst_off[num_segments]. When `table_on_device` is false they are host arrays and
// `num_segments` must be at most kCompactInlineSegments; when true they are device arrays that must
// stay valid until the kernel has run on `stream`. Offsets are in elements of `elem_size` bytes.
// Returns the launch's error (cudaSuccess when nothing had to be copied), never throws.
cudaError_t compact_cuda(void* dst, const void* src, int64_t elem_size, const int64_t* src_off,
                         const int64_t* dst_off, int64_t num_segments, int64_t total,
                         bool table_on_device, cudaStream_t stream);

}  // namespace dstest_impl
#endif  // CUDART_VERSION

#ifndef __CUDACC__
#include <ATen/core/Tensor.h>

namespace dstest_impl {

// Validates the arguments of the compaction ops (every TORCH_CHECK names the op, the argument and
// its value) and returns the layout. `out` may be undefined, for the functional ops that allocate it
// after planning. Defined in binding.cpp.
CompactPlan plan_compaction(const char* op, const at::Tensor& padded, at::IntArrayRef counts,
                            at::IntArrayRef shard_sizes, const at::Tensor& out);

// Shard size of the single-tensor `compact`: padded.numel() / len(counts), checked to divide.
int64_t single_shard_size(const at::Tensor& padded, at::IntArrayRef counts);

}  // namespace dstest_impl
#endif  // __CUDACC__
