// Schemas of the dstest_impl ops (declared once, here) and the device-independent argument checks.
// Implementations: allgather_compact_cpu.cpp (CPU), allgather_compact_cuda.cpp (CUDA); the fake
// (meta) implementations and the pure-torch references are in impl/ops/allgather.py (SPEC D5, D6).
#include <ATen/core/Tensor.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>

#include "allgather_compact.h"

namespace dstest_impl {

int64_t single_shard_size(const at::Tensor& padded, at::IntArrayRef counts) {
  const auto world = static_cast<int64_t>(counts.size());
  TORCH_CHECK(world >= 1, "dstest_impl::compact: counts needs one entry per rank (at least one), got "
              "counts=", counts);
  TORCH_CHECK(padded.numel() % world == 0, "dstest_impl::compact: padded.numel()=", padded.numel(),
              " must be a multiple of len(counts)=", world,
              " (padded holds one equal-size shard per rank)");
  return padded.numel() / world;
}

CompactPlan plan_compaction(const char* op, const at::Tensor& padded, at::IntArrayRef counts,
                            at::IntArrayRef shard_sizes, const at::Tensor& out) {
  const auto num_tensors = static_cast<int64_t>(shard_sizes.size());
  const auto num_counts = static_cast<int64_t>(counts.size());
  TORCH_CHECK(num_tensors >= 1, op, ": shard_sizes needs one entry per "
              "tensor (at least one), got shard_sizes=", shard_sizes);
  TORCH_CHECK(num_counts >= num_tensors && num_counts % num_tensors == 0,
              op, ": len(counts)=", num_counts,
              " must be len(shard_sizes)=", num_tensors, " times the number of ranks (>= 1)");
  const int64_t world = num_counts / num_tensors;

  // Columns of one rank's row in the padded buffer: tensor t starts at column[t].
  std::vector<int64_t> column(static_cast<size_t>(num_tensors));
  int64_t row = 0;
  for (int64_t t = 0; t < num_tensors; ++t) {
    const int64_t p = shard_sizes[t];
    TORCH_CHECK(p >= 0, op, ": shard_sizes[", t, "]=", p, " must be >= 0");
    TORCH_CHECK(row <= std::numeric_limits<int64_t>::max() - p,
                op, ": sum(shard_sizes) overflows int64, shard_sizes=",
                shard_sizes);
    column[static_cast<size_t>(t)] = row;
    row += p;
  }
  TORCH_CHECK(row == 0 || world <= std::numeric_limits<int64_t>::max() / row,
              op, ": ranks * sum(shard_sizes) overflows int64 (ranks=", world,
              ", sum(shard_sizes)=", row, ")");
  TORCH_CHECK(padded.numel() == world * row, op, ": padded.numel()=",
              padded.numel(), " must equal ranks * sum(shard_sizes) = ", world, " * ", row, " = ",
              world * row);

  CompactPlan plan;
  plan.src_off.reserve(static_cast<size_t>(num_counts));
  plan.dst_off.reserve(static_cast<size_t>(num_counts + 1));
  int64_t total = 0;
  for (int64_t t = 0; t < num_tensors; ++t) {
    for (int64_t r = 0; r < world; ++r) {
      const int64_t i = t * world + r;
      const int64_t c = counts[i];
      TORCH_CHECK(c >= 0 && c <= shard_sizes[t], op, ": counts[", i, "]=", c,
                  " (tensor ", t, ", rank ", r, ") must be between 0 and that tensor's shard size ",
                  shard_sizes[t]);
      plan.src_off.push_back(r * row + column[static_cast<size_t>(t)]);
      plan.dst_off.push_back(total);
      total += c;  // <= padded.numel(): cannot overflow
    }
  }
  plan.dst_off.push_back(total);

  if (out.defined()) {
    TORCH_CHECK(out.scalar_type() == padded.scalar_type(), op, ": out.dtype=", out.scalar_type(),
                " must equal padded.dtype=", padded.scalar_type());
    TORCH_CHECK(out.device() == padded.device(), op, ": out.device=",
                out.device(), " must equal padded.device=", padded.device());
    TORCH_CHECK(out.numel() == total, op, ": out.numel()=", out.numel(),
                " must equal sum(counts)=", total);
    TORCH_CHECK(out.is_contiguous(), op, ": out must be contiguous, got "
                "sizes=", out.sizes(), " strides=", out.strides());
    at::assert_no_overlap(out, padded);
  }
  return plan;
}

}  // namespace dstest_impl

TORCH_LIBRARY(dstest_impl, m) {
  // The exact concatenation of the valid prefixes of len(counts) equal shards of `padded`.
  m.def("compact(Tensor padded, int[] counts) -> Tensor");
  // Several tensors gathered in one collective: `padded` is W rows of sum(shard_sizes) elements,
  // counts[t * W + r] is tensor t's count on rank r; the result holds tensor 0's concatenation,
  // then tensor 1's, ...
  m.def("compact_grouped(Tensor padded, int[] counts, int[] shard_sizes) -> Tensor");
  m.def("compact_grouped_out(Tensor padded, int[] counts, int[] shard_sizes, Tensor(a!) out) -> ()");
}
