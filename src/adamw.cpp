// CPU AdamW; the update rule is written out in adamw.hpp.
#include "adamw.hpp"

#include <cmath>
#include <stdexcept>
#include <string>

namespace coda {

void adamw_update(const ParamLayout& layout, float* params, const float* grads, float* m, float* v,
                  const AdamWHyper& hyper, int step, float grad_scale) {
  if (step < 1) throw std::invalid_argument("adamw_update: step must be >= 1 (1-based), got " + std::to_string(step));
  const float m_correction = static_cast<float>(1.0 - std::pow(static_cast<double>(hyper.beta1), step));
  const float v_correction = static_cast<float>(1.0 - std::pow(static_cast<double>(hyper.beta2), step));
  for (const ParamTensor& tensor : layout.tensors) {
    const float decay = tensor.weight_decay ? hyper.weight_decay : 0.0f;
    const long long begin = static_cast<long long>(tensor.offset), end = begin + static_cast<long long>(tensor.numel);
#pragma omp parallel for if (tensor.numel >= (size_t{1} << 16))  // threads pay off on large tensors only
    for (long long i = begin; i < end; ++i) {
      const float g = grad_scale * grads[i];
      m[i] = hyper.beta1 * m[i] + (1.0f - hyper.beta1) * g;
      v[i] = hyper.beta2 * v[i] + (1.0f - hyper.beta2) * g * g;
      const float m_hat = m[i] / m_correction, v_hat = v[i] / v_correction;
      params[i] -= hyper.lr * (m_hat / (std::sqrt(v_hat) + hyper.eps) + decay * params[i]);
    }
  }
}

}  // namespace coda
