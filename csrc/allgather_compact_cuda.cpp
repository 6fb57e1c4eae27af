// CUDA registration of the dstest_impl compaction ops (SPEC D5, D6). The kernel is in
// allgather_compact.cu (no torch headers); this file plans and checks on the host, then launches it
// once on the current stream. Compiled only when torch has CUDA (impl/ops/_build.py).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "allgather_compact.h"

namespace dstest_impl {
namespace {

void launch(const at::Tensor& src, const at::Tensor& out, const CompactPlan& plan) {
  if (plan.total() == 0) return;  // nothing to copy: no launch
  const int64_t num_segments = plan.num_segments();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(src.device().index()).stream();
  cudaError_t err = cudaSuccess;
  if (num_segments <= kCompactInlineSegments) {
    // The table rides in the kernel parameters: one launch and nothing else.
    err = compact_cuda(out.data_ptr(), src.const_data_ptr(), src.element_size(),
                       plan.src_off.data(), plan.dst_off.data(), num_segments, plan.total(),
                       /*table_on_device=*/false, stream);
  } else {
    // A captured graph would replay the host-to-device copy of the table from a pinned block that
    // the host allocator has long reused; refuse instead of replaying stale offsets.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    TORCH_CHECK(capture == cudaStreamCaptureStatusNone, "dstest_impl::compact: a layout of ",
                num_segments, " segments (ranks x tensors) cannot be captured in a CUDA graph; at most ",
                kCompactInlineSegments, " can, with the segment table in the kernel parameters");
    // Too many segments for the parameters: stage the table through pinned memory. The caching
    // host allocator keeps the pinned block alive until the copy has run, and the device table is
    // allocated on `stream`, so freeing it at scope exit is ordered after the kernel.
    at::Tensor host = at::empty({2 * num_segments + 1},
                                at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    int64_t* h = host.data_ptr<int64_t>();
    std::copy(plan.src_off.begin(), plan.src_off.end(), h);
    std::copy(plan.dst_off.begin(), plan.dst_off.end(), h + num_segments);
    const at::Tensor table = host.to(src.device(), /*non_blocking=*/true);
    const int64_t* t = table.const_data_ptr<int64_t>();
    err = compact_cuda(out.data_ptr(), src.const_data_ptr(), src.element_size(), t,
                       t + num_segments, num_segments, plan.total(), /*table_on_device=*/true,
                       stream);
  }
  TORCH_CHECK(err == cudaSuccess, "dstest_impl::compact: CUDA kernel launch failed: ",
              cudaGetErrorString(err), " (segments=", num_segments, ", total=", plan.total(),
              ", elem_size=", src.element_size(), ", device=", src.device(), ")");
}

void compact_grouped_out_cuda(const at::Tensor& padded, at::IntArrayRef counts,
                              at::IntArrayRef shard_sizes, const at::Tensor& out) {
  const CompactPlan plan =
      plan_compaction("dstest_impl::compact_grouped_out", padded, counts, shard_sizes, out);
  const c10::cuda::CUDAGuard guard(padded.device());
  launch(padded.contiguous(), out, plan);
}

at::Tensor compact_into_new(const char* op, const at::Tensor& padded, at::IntArrayRef counts,
                            at::IntArrayRef shard_sizes) {
  const CompactPlan plan = plan_compaction(op, padded, counts, shard_sizes, at::Tensor());
  const c10::cuda::CUDAGuard guard(padded.device());
  at::Tensor out = at::empty({plan.total()}, padded.options());
  launch(padded.contiguous(), out, plan);
  return out;
}

at::Tensor compact_grouped_cuda(const at::Tensor& padded, at::IntArrayRef counts,
                                at::IntArrayRef shard_sizes) {
  return compact_into_new("dstest_impl::compact_grouped", padded, counts, shard_sizes);
}

at::Tensor compact_cuda_op(const at::Tensor& padded, at::IntArrayRef counts) {
  const int64_t shard = single_shard_size(padded, counts);
  return compact_into_new("dstest_impl::compact", padded, counts, at::IntArrayRef(shard));
}

}  // namespace
}  // namespace dstest_impl

TORCH_LIBRARY_IMPL(dstest_impl, CUDA, m) {
  m.impl("compact", &dstest_impl::compact_cuda_op);
  m.impl("compact_grouped", &dstest_impl::compact_grouped_cuda);
  m.impl("compact_grouped_out", &dstest_impl::compact_grouped_out_cuda);
}
