// AdamW on the CPU, the reference of the GPU optimizer kernels. Per element, with g = grad_scale * grad
// and t the 1-based step:
//   m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2
//   param -= lr * ( (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + wd * param )
// where the decoupled decay term wd * param is present only for tensors with ParamTensor::weight_decay.
// Only the elements of tensors are touched; the alignment padding between them stays as it is (zero).
#pragma once
#include "backend.hpp"
#include "model.hpp"

namespace coda {

void adamw_update(const ParamLayout& layout, float* params, const float* grads, float* m, float* v,
                  const AdamWHyper& hyper, int step, float grad_scale);

}  // namespace coda
