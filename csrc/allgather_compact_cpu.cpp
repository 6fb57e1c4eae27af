// CPU implementation of the dstest_impl compaction ops (SPEC D5, D6): plain memcpy per piece,
// split by bytes across torch's intra-op thread pool, the same shape as the CUDA kernel.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "allgather_compact.h"

namespace dstest_impl {

namespace {
// 64 KiB pieces; a parallel task covers at least 4 of them (256 KiB), below that one thread copies.
constexpr int64_t kChunkBytes = int64_t{1} << 16;
constexpr int64_t kChunksPerTask = 4;
}  // namespace

void compact_cpu_copy(void* dst, const void* src, int64_t elem_size, const CompactPlan& plan) {
  const int64_t total_bytes = plan.total() * elem_size;
  const int64_t num_segments = plan.num_segments();
  if (total_bytes == 0) return;
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const int64_t num_chunks = (total_bytes + kChunkBytes - 1) / kChunkBytes;

  at::parallel_for(0, num_chunks, kChunksPerTask, [&](int64_t first, int64_t last) {
    const int64_t begin = first * kChunkBytes;
    const int64_t end = std::min(last * kChunkBytes, total_bytes);
    // First segment whose destination ends after `begin`.
    const auto ends = plan.dst_off.begin() + 1;
    int64_t seg = std::partition_point(ends, plan.dst_off.end(),
                                       [&](int64_t e) { return e * elem_size <= begin; }) -
                  ends;
    for (; seg < num_segments; ++seg) {
      const int64_t seg_begin = plan.dst_off[static_cast<size_t>(seg)] * elem_size;
      if (seg_begin >= end) break;
      const int64_t seg_end = plan.dst_off[static_cast<size_t>(seg) + 1] * elem_size;
      const int64_t piece_begin = std::max(begin, seg_begin);
      const int64_t piece_end = std::min(end, seg_end);
      if (piece_end <= piece_begin) continue;  // an empty shard
      std::memcpy(d + piece_begin,
                  s + plan.src_off[static_cast<size_t>(seg)] * elem_size + (piece_begin - seg_begin),
                  static_cast<size_t>(piece_end - piece_begin));
    }
  });
}

namespace {

void compact_grouped_out_cpu(const at::Tensor& padded, at::IntArrayRef counts,
                             at::IntArrayRef shard_sizes, const at::Tensor& out) {
  const CompactPlan plan =
      plan_compaction("dstest_impl::compact_grouped_out", padded, counts, shard_sizes, out);
  const at::Tensor src = padded.contiguous();
  compact_cpu_copy(out.data_ptr(), src.const_data_ptr(), src.element_size(), plan);
}

at::Tensor compact_into_new(const char* op, const at::Tensor& padded, at::IntArrayRef counts,
                            at::IntArrayRef shard_sizes) {
  const CompactPlan plan = plan_compaction(op, padded, counts, shard_sizes, at::Tensor());
  at::Tensor out = at::empty({plan.total()}, padded.options());
  const at::Tensor src = padded.contiguous();
  compact_cpu_copy(out.data_ptr(), src.const_data_ptr(), src.element_size(), plan);
  return out;
}

at::Tensor compact_grouped_cpu(const at::Tensor& padded, at::IntArrayRef counts,
                               at::IntArrayRef shard_sizes) {
  return compact_into_new("dstest_impl::compact_grouped", padded, counts, shard_sizes);
}

at::Tensor compact_cpu(const at::Tensor& padded, at::IntArrayRef counts) {
  const int64_t shard = single_shard_size(padded, counts);
  return compact_into_new("dstest_impl::compact", padded, counts, at::IntArrayRef(shard));
}

}  // namespace
}  // namespace dstest_impl

TORCH_LIBRARY_IMPL(dstest_impl, CPU, m) {
  m.impl("compact", &dstest_impl::compact_cpu);
  m.impl("compact_grouped", &dstest_impl::compact_grouped_cpu);
  m.impl("compact_grouped_out", &dstest_impl::compact_grouped_out_cpu);
}
