// What the kernels' PyTorch operators share: their members' fields as the arrays the
// launchers take, torch's current stream, and a failed launch as a Python error. The
// schemas and fake implementations are defined in Python (nvfp4_gemv.py, nvfp4_gemm.py),
// so torch.compile and fake tensors see the operators on any machine; a library built from
// a .cu file registers their CUDA implementations when it is loaded.

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/List.h>
#include <ATen/ops/empty.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <optional>
#include <vector>

// A torch built with CUDA has c10's CUDA headers (and library); one without builds these
// libraries only to be tested on the CPU, and never hands their operators a CUDA tensor.
#if __has_include(<c10/cuda/impl/cuda_cmake_macros.h>)
#include <c10/cuda/CUDAStream.h>
#define QERL_TORCH_HAS_CUDA 1
#endif

namespace qerl {

inline std::vector<const void*> pointers(at::TensorList tensors) {
  std::vector<const void*> out;
  for (const at::Tensor& t : tensors) out.push_back(t.data_ptr());
  return out;
}

// An absent optional tensor (no bias) is a null pointer.
inline std::vector<const void*> pointers(const c10::List<std::optional<at::Tensor>>& tensors) {
  std::vector<const void*> out;
  for (const std::optional<at::Tensor>& t : tensors) {
    out.push_back(t.has_value() ? t->data_ptr() : nullptr);
  }
  return out;
}

inline std::vector<long long> row_strides(at::TensorList tensors) {
  std::vector<long long> out;
  for (const at::Tensor& t : tensors) out.push_back(t.stride(0));
  return out;
}

// The weights one launch multiplies side by side, their fields as the arrays the launchers
// take (member g's are element g), checked one of each a weight; ``width``, the rows of
// all (the output's columns).
struct Weights {
  Weights(const char* op, at::TensorList pairs_, at::TensorList scale_,
          at::TensorList global_scale_, const c10::List<std::optional<at::Tensor>>& bias_)
      : pairs(pointers(pairs_)), scale(pointers(scale_)),
        global_scale(pointers(global_scale_)), bias(pointers(bias_)),
        stride_p(row_strides(pairs_)), stride_s(row_strides(scale_)) {
    TORCH_CHECK(scale_.size() == pairs_.size() && global_scale_.size() == pairs_.size() &&
                    bias_.size() == pairs_.size(),
                op, " takes one scale, global scale and bias (or None) per weight");
    for (const at::Tensor& s : scale_) {
      rows.push_back(static_cast<int>(s.size(0)));
      width += s.size(0);
    }
  }
  int count() const { return static_cast<int>(pairs.size()); }

  std::vector<const void*> pairs, scale, global_scale, bias;
  std::vector<long long> stride_p, stride_s;
  std::vector<int> rows;
  int64_t width = 0;
};

// torch's current stream on the tensor's device: a launch is ordered, and captured in a
// CUDA graph, like torch's own kernels.
inline cudaStream_t stream_of(const at::Tensor& t) {
#ifdef QERL_TORCH_HAS_CUDA
  return c10::cuda::getCurrentCUDAStream(t.get_device()).stream();
#else
  TORCH_CHECK(false, "this torch was built without CUDA: no CUDA tensor reaches qerl's kernels");
  return nullptr;
#endif
}

inline void check_launch(int error, const char* kernel) {
  TORCH_CHECK(error == cudaSuccess, kernel, " failed to launch: ",
              cudaGetErrorString(static_cast<cudaError_t>(error)));
}

}  // namespace qerl
