// The elementwise operations: bias add, residual add, GELU and SwiGLU, forward and backward.
// Each is a functor applied to one 16-byte packet (8 bf16 values) per thread by one generic launch, so
// each operation is exactly one read of its inputs and one write of its output.
// GELU (tanh form, GPT-2's): gelu(x) = x/2 (1 + tanh(a (x + b x^3))), a = sqrt(2/pi), b = 0.044715;
// gelu'(x) = (1 + t)/2 + x/2 (1 - t^2) a (1 + 3 b x^2), t = tanh(a (x + b x^3)). tanh is the hardware
// approximation (tanh.approx.f32, relative error about 2^-11, well under bf16's 2^-8), so the kernel stays
// memory-bound instead of paying for the libm tanh.
// SwiGLU over interleaved columns (model.hpp): y_j = silu(g_j) u_j with (g_j, u_j) = (gu[2j], gu[2j+1]);
// backward: dg = dy u s (1 + g (1 - s)), du = dy silu(g), s = sigmoid(g). Because the gu row is exactly
// twice the y row, output packet i reads gu packets 2i and 2i+1 whatever the row length.

#include <stdexcept>
#include <string>

#include "kernels/common/cuda_check.cuh"
#include "kernels/common/kernel_profile.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/vec.cuh"
#include "kernels/unfused/unfused.cuh"

namespace coda::unfused {

namespace {

template <typename Op>
__global__ void __launch_bounds__(256) packet_kernel(size_t packets, Op op) {
  start_after_previous_kernel();
  const size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < packets) op(i);
}

template <typename Op>
void launch_packets(const char* label, size_t packets, const Op& op, cudaStream_t stream) {
  if (packets == 0) return;
  const profile::Region region(label, profile::Work::Epilogue, stream);
  launch_kernel(packet_kernel<Op>, after_previous(blocks_for(packets, 256), 256), stream, packets, op);
}

void require_multiple_of_8(size_t n, const char* what) {
  if (n % 8 != 0) throw std::invalid_argument(std::string(what) + ": size " + std::to_string(n) + " must be a multiple of 8");
}

__device__ __forceinline__ float tanh_fast(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

constexpr float kGeluA = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluB = 0.044715f;

// One packet of out = a + b (fp32 sum, rounded once to bf16); out may alias a.
__device__ __forceinline__ void add_packet(bf16* out, const bf16* a, const bf16* b) {
  float va[8], vb[8];
  load_bf16x8(va, a);
  load_bf16x8(vb, b);
#pragma unroll
  for (int j = 0; j < 8; ++j) va[j] += vb[j];
  store_bf16x8(out, va);
}

struct BiasAdd {
  bf16* y;
  const bf16* b;
  int row_packets;
  __device__ void operator()(size_t i) const { add_packet(y + 8 * i, y + 8 * i, b + 8 * (i % row_packets)); }
};

struct ResidualAdd {
  bf16* out;
  const bf16 *a, *b;
  __device__ void operator()(size_t i) const { add_packet(out + 8 * i, a + 8 * i, b + 8 * i); }
};

struct GeluForward {
  bf16* y;
  const bf16* x;
  __device__ void operator()(size_t i) const {
    float v[8];
    load_bf16x8(v, x + 8 * i);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float t = tanh_fast(kGeluA * (v[j] + kGeluB * v[j] * v[j] * v[j]));
      v[j] = 0.5f * v[j] * (1.0f + t);
    }
    store_bf16x8(y + 8 * i, v);
  }
};

struct GeluBackward {
  bf16* dx;
  const bf16 *dy, *x;
  __device__ void operator()(size_t i) const {
    float v[8], d[8];
    load_bf16x8(v, x + 8 * i);
    load_bf16x8(d, dy + 8 * i);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float x2 = v[j] * v[j];
      const float t = tanh_fast(kGeluA * v[j] * (1.0f + kGeluB * x2));
      const float slope = 0.5f * (1.0f + t) + 0.5f * v[j] * (1.0f - t * t) * kGeluA * (1.0f + 3.0f * kGeluB * x2);
      d[j] *= slope;
    }
    store_bf16x8(dx + 8 * i, d);
  }
};

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

struct SwigluForward {
  bf16* y;
  const bf16* gu;
  __device__ void operator()(size_t i) const {
    float lo[8], hi[8], out[8];
    load_bf16x8(lo, gu + 16 * i);
    load_bf16x8(hi, gu + 16 * i + 8);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      out[j] = lo[2 * j] * sigmoid(lo[2 * j]) * lo[2 * j + 1];
      out[4 + j] = hi[2 * j] * sigmoid(hi[2 * j]) * hi[2 * j + 1];
    }
    store_bf16x8(y + 8 * i, out);
  }
};

struct SwigluBackward {
  bf16* dgu;
  const bf16 *dy, *gu;
  __device__ void operator()(size_t i) const {
    float d[8], pairs[2][8];
    load_bf16x8(d, dy + 8 * i);
    load_bf16x8(pairs[0], gu + 16 * i);
    load_bf16x8(pairs[1], gu + 16 * i + 8);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float g = pairs[h][2 * j], u = pairs[h][2 * j + 1], dout = d[4 * h + j];
        const float s = sigmoid(g);
        pairs[h][2 * j] = dout * u * s * (1.0f + g * (1.0f - s));
        pairs[h][2 * j + 1] = dout * g * s;
      }
    }
    store_bf16x8(dgu + 16 * i, pairs[0]);
    store_bf16x8(dgu + 16 * i + 8, pairs[1]);
  }
};

}  // namespace

void bias_add(bf16* y, const bf16* b, int N, int OC, cudaStream_t stream) {
  require_multiple_of_8(OC, "bias_add");
  launch_packets("bias add", static_cast<size_t>(N) * OC / 8, BiasAdd{y, b, OC / 8}, stream);
}

void residual_add(bf16* out, const bf16* a, const bf16* b, size_t n, cudaStream_t stream) {
  require_multiple_of_8(n, "residual_add");
  launch_packets("residual add", n / 8, ResidualAdd{out, a, b}, stream);
}

void gelu_forward(bf16* y, const bf16* x, size_t n, cudaStream_t stream) {
  require_multiple_of_8(n, "gelu_forward");
  launch_packets("gelu forward", n / 8, GeluForward{y, x}, stream);
}

void gelu_backward(bf16* dx, const bf16* dy, const bf16* x, size_t n, cudaStream_t stream) {
  require_multiple_of_8(n, "gelu_backward");
  launch_packets("gelu backward", n / 8, GeluBackward{dx, dy, x}, stream);
}

void swiglu_forward(bf16* y, const bf16* gu, int N, int F, cudaStream_t stream) {
  require_multiple_of_8(F, "swiglu_forward");
  launch_packets("swiglu forward", static_cast<size_t>(N) * F / 8, SwigluForward{y, gu}, stream);
}

void swiglu_backward(bf16* dgu, const bf16* dy, const bf16* gu, int N, int F, cudaStream_t stream) {
  require_multiple_of_8(F, "swiglu_backward");
  launch_packets("swiglu backward", static_cast<size_t>(N) * F / 8, SwigluBackward{dgu, dy, gu}, stream);
}

}  // namespace coda::unfused
