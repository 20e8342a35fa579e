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

#pragma once
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <map>
#include <tuple>

namespace coda {

enum class Op { N, T };

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

 private:
  struct Plan;
  using Key = std::tuple<int, int, int, int, int, int>;  // M, N, K, op_a, op_b, D type
  void run(void* D, cudaDataType_t d_type, const __nv_bfloat16* A, Op op_a, const __nv_bfloat16* B, Op op_b, int M,
           int N, int K, bool accumulate, cudaStream_t stream);
  const Plan& plan(const Key& key);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  std::map<Key, Plan*> plans_;
};

}  // namespace coda
