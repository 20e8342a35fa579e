// cuBLASLt GEMMs in the trainer's row-major conventions: the GEMMs of the unfused mode and the competitor every
// hand-written GEMM is benchmarked against (no epilogue fusion: that is what the CODA kernels are compared to).
// D[M, N] = op(A) op(B) (+ D when accumulating), all row-major, bf16 operands, fp32 accumulation, D in bf16 or
// fp32. op(A) is [M, K]: A is stored [M, K] (Op::N) or [K, M] (Op::T); op(B) is [K, N]: B is stored [K, N]
// (Op::N) or [N, K] (Op::T). The three GEMMs of a linear layer y = x W^T:
//   forward  Y  = X W^T      gemm(Y,  X, N,  W, T)
//   dgrad    dX = dY W       gemm(dX, dY, N, W, N)
//   wgrad    dW += dY^T X    gemm(dW, dY, T, X, N, accumulate)
// cuBLAS is column-major, so the row-major product is computed as D^T = op(B)^T op(A)^T with the operands
// swapped. Algorithms come from cuBLASLt's heuristic once per shape and are cached; the workspace is 32 MiB.
// FP8 (gemm_fp8): Hopper's FP8 tensor cores take both operands K-major, which is the forward layout
// D[M, N] = A[M, K] B[N, K]^T, so a dgrad or wgrad operand comes as a transposed FP8 copy
// (unfused::quantize_fp8_transposed); D = a_dequant b_dequant (A B^T) (+ D), the dequantization factors
// (1 / the quantization scales) read from the device. e5m2 x e5m2 is not a Hopper format pair.

#pragma once
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <tuple>

#include "kernels/common/fp8_format.cuh"

namespace coda {

enum class Op { N, T };

// How an FP8 operand's dequantization factors cover it: one for the tensor (a 16-byte aligned float), one
// per 1 x 128 block of each row along K (Rows128: [K / 128, rows] row-major, the row index fastest), or one
// per 128 x 128 tile (Tiles128: [rows / 128, K / 128 rounded up to a multiple of 4] row-major, the padding
// unread). These are the layouts of cuBLASLt's VEC128_32F and BLK128x128_32F (Hopper, cuBLAS >= 12.9; the
// block-scaled GEMM test pins them), which need M, N and K multiples of 128.
enum class Fp8Scales { Tensor, Rows128, Tiles128 };

class CublasLt {
 public:
  CublasLt();
  ~CublasLt();
  CublasLt(const CublasLt&) = delete;
  CublasLt& operator=(const CublasLt&) = delete;

  void gemm(__nv_bfloat16* D, const __nv_bfloat16* A, Op op_a, const __nv_bfloat16* B, Op op_b, int M, int N, int K,
            bool accumulate, cudaStream_t stream);
  void gemm(float* D, const __nv_bfloat16* A, Op op_a, const __nv_bfloat16* B, Op op_b, int M, int N, int K,
            bool accumulate, cudaStream_t stream);
  // D[M, N] (bf16 or fp32) = a_dequant b_dequant (A[M, K] B[N, K]^T) (+ D), A and B FP8 of the given formats;
  // each factor array 16-byte aligned, laid out as its Fp8Scales says.
  template <typename OutT>
  void gemm_fp8(OutT* D, const uint8_t* A, Fp8Format a_format, const float* a_dequant, const uint8_t* B,
                Fp8Format b_format, const float* b_dequant, int M, int N, int K, bool accumulate, cudaStream_t stream,
                Fp8Scales a_scales = Fp8Scales::Tensor, Fp8Scales b_scales = Fp8Scales::Tensor);

 private:
  struct Plan;
  struct Operand {
    const void* data;
    Op op;
    cudaDataType_t type;
    const float* dequant;  // FP8 only: its factors on the device
    Fp8Scales scales = Fp8Scales::Tensor;
  };
  using Key = std::tuple<int, int, int, int, int, int, int, int, int, int>;  // M, N, K, op_a, op_b, D, A, B types,
                                                                            // A, B Fp8Scales
  void run(void* D, cudaDataType_t d_type, const Operand& A, const Operand& B, int M, int N, int K, bool accumulate,
           cudaStream_t stream);
  const Plan& plan(const Key& key);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  std::map<Key, Plan*> plans_;
};

}  // namespace coda
