// The optimizer's kernels over the flat parameter buffer: fused AdamW, the global gradient sum of
// squares (for the norm and clipping) and the fp32 -> bf16 conversion of the working copy.
// AdamW (decoupled weight decay), one pass: read p, g, m, v (fp32), write p, m, v and the bf16 copy of p
// that the GEMMs read: 30 bytes per parameter, the minimum for this state. Bias corrections are folded
// on the host. Whether a parameter decays is a property of its tensor; tensors start at multiples of 64
// elements (model.hpp), so one byte per 64 elements says it (a 4-element packet never straddles two).
// The sum of squares is deterministic: every block reduces a grid-stride share in a fixed order and
// writes its partial; the block that draws the last integer ticket (ticket_add in kernels/common/vec.cuh) sums the
// partials in block order.

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "kernels/common/cuda_check.cuh"
#include "kernels/common/kernel_profile.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/vec.cuh"
#include "kernels/unfused/unfused.cuh"

namespace coda::unfused {

namespace {

constexpr int kSumsqThreads = 512;
constexpr int kMaxSumsqBlocks = 1024;

struct AdamWConstants {
  float lr, beta1, beta2, eps, weight_decay, grad_scale, bias_correction1, bias_correction2;
};

__global__ void __launch_bounds__(256) adamw_kernel(float* params, bf16* params_bf16, float* m, float* v,
                                                   const float* grads, const uint8_t* decay, size_t packets,
                                                   AdamWConstants k) {
  start_after_previous_kernel();
  const size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= packets) return;
  const float4 p4 = reinterpret_cast<const float4*>(params)[i], m4 = reinterpret_cast<const float4*>(m)[i];
  const float4 v4 = reinterpret_cast<const float4*>(v)[i], g4 = reinterpret_cast<const float4*>(grads)[i];
  float pj[4] = {p4.x, p4.y, p4.z, p4.w}, mj[4] = {m4.x, m4.y, m4.z, m4.w}, vj[4] = {v4.x, v4.y, v4.z, v4.w};
  const float gj[4] = {g4.x, g4.y, g4.z, g4.w};
  const float wd = decay[i / 16] ? k.weight_decay : 0.0f;  // 16 packets of 4 per 64-element block
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float g = gj[j] * k.grad_scale;
    mj[j] = k.beta1 * mj[j] + (1.0f - k.beta1) * g;
    vj[j] = k.beta2 * vj[j] + (1.0f - k.beta2) * g * g;
    const float update = (mj[j] / k.bias_correction1) / (sqrtf(vj[j] / k.bias_correction2) + k.eps);
    pj[j] -= k.lr * (update + wd * pj[j]);
  }
  reinterpret_cast<float4*>(params)[i] = make_float4(pj[0], pj[1], pj[2], pj[3]);
  reinterpret_cast<float4*>(m)[i] = make_float4(mj[0], mj[1], mj[2], mj[3]);
  reinterpret_cast<float4*>(v)[i] = make_float4(vj[0], vj[1], vj[2], vj[3]);
  const __nv_bfloat162 lo = __floats2bfloat162_rn(pj[0], pj[1]), hi = __floats2bfloat162_rn(pj[2], pj[3]);
  uint2 packed;
  packed.x = *reinterpret_cast<const unsigned int*>(&lo);
  packed.y = *reinterpret_cast<const unsigned int*>(&hi);
  reinterpret_cast<uint2*>(params_bf16)[i] = packed;
}

__global__ void __launch_bounds__(kSumsqThreads) sumsq_kernel(float* result, const float* g, size_t packets,
                                                             float* partials, unsigned int* ticket) {
  start_after_previous_kernel();
  __shared__ float scratch[32];
  __shared__ bool last_block;
  float sum = 0.0f;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < packets;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float4 x = reinterpret_cast<const float4*>(g)[i];
    sum += x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w;
  }
  sum = block_sum(sum, scratch);
  if (threadIdx.x == 0) {
    partials[blockIdx.x] = sum;
    last_block = ticket_add(ticket, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last_block) return;
  float total = 0.0f;
  for (int b = threadIdx.x; b < static_cast<int>(gridDim.x); b += blockDim.x) total += __ldcg(partials + b);
  total = block_sum(total, scratch);
  if (threadIdx.x == 0) {
    *result = total;
    *ticket = 0u;
  }
}

__global__ void __launch_bounds__(256) convert_kernel(bf16* dst, const float* src, size_t packets) {
  start_after_previous_kernel();
  const size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= packets) return;
  float v[8];
  load_f32x8(v, src + 8 * i);
  store_bf16x8(dst + 8 * i, v);
}

}  // namespace

size_t grad_sumsq_partials_floats() { return kMaxSumsqBlocks; }

void grad_sumsq(float* result, const float* g, size_t n, float* partials, unsigned int* ticket, cudaStream_t stream) {
  if (n % 4 != 0) throw std::invalid_argument("grad_sumsq: n = " + std::to_string(n) + " must be a multiple of 4");
  const size_t packets = n / 4;
  const int blocks = static_cast<int>(std::max<size_t>(
      1, std::min<size_t>({static_cast<size_t>(sm_count()) * 4, static_cast<size_t>(kMaxSumsqBlocks),
                           (packets + kSumsqThreads - 1) / kSumsqThreads})));
  const profile::Region region("gradient sum of squares", profile::Work::Other, stream);
  launch_kernel(sumsq_kernel, after_previous(blocks, kSumsqThreads), stream, result, g, packets, partials, ticket);
}

void adamw(float* params, bf16* params_bf16, float* m, float* v, const float* grads, const uint8_t* decay, size_t n,
           const AdamWStep& step, cudaStream_t stream) {
  if (n % 64 != 0) throw std::invalid_argument("adamw: n = " + std::to_string(n) + " must be a multiple of 64");
  if (step.step < 1) throw std::invalid_argument("adamw: step must be >= 1, got " + std::to_string(step.step));
  const AdamWConstants k{step.lr,
                         step.beta1,
                         step.beta2,
                         step.eps,
                         step.weight_decay,
                         step.grad_scale,
                         static_cast<float>(1.0 - std::pow(static_cast<double>(step.beta1), step.step)),
                         static_cast<float>(1.0 - std::pow(static_cast<double>(step.beta2), step.step))};
  const size_t packets = n / 4;
  const profile::Region region("adamw", profile::Work::Other, stream);
  launch_kernel(adamw_kernel, after_previous(blocks_for(packets, 256), 256), stream, params, params_bf16, m, v, grads,
                decay, packets, k);
}

void convert_to_bf16(bf16* dst, const float* src, size_t n, cudaStream_t stream) {
  if (n % 8 != 0) throw std::invalid_argument("convert_to_bf16: n = " + std::to_string(n) + " must be a multiple of 8");
  if (n == 0) return;
  const profile::Region region("convert to bf16", profile::Work::Other, stream);
  launch_kernel(convert_kernel, after_previous(blocks_for(n / 8, 256), 256), stream, dst, src, n / 8);
}

}  // namespace coda::unfused
