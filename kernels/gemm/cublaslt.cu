// cuBLASLt wrapper; see cublaslt.cuh for the conventions.
#include "kernels/gemm/cublaslt.cuh"

#include <string>

#include "kernels/common/cuda_check.cuh"
#include "kernels/common/kernel_profile.cuh"

#define CUBLAS_CHECK(call)                                                                                  \
  do {                                                                                                      \
    const cublasStatus_t cublas_check_status_ = (call);                                                     \
    if (cublas_check_status_ != CUBLAS_STATUS_SUCCESS)                                                      \
      ::coda::cuda_fail(std::string("cuBLAS status ") + std::to_string(static_cast<int>(cublas_check_status_)), \
                        #call, __FILE__, __LINE__);                                                         \
  } while (0)

namespace coda {

namespace {
constexpr size_t kWorkspaceBytes = 32u << 20;
}

struct CublasLt::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

CublasLt::CublasLt() {
  CUBLAS_CHECK(cublasLtCreate(&handle_));
  CUDA_CHECK(cudaMalloc(&workspace_, kWorkspaceBytes));
}

CublasLt::~CublasLt() {
  for (auto& entry : plans_) {
    Plan* p = entry.second;
    cublasLtMatrixLayoutDestroy(p->a);
    cublasLtMatrixLayoutDestroy(p->b);
    cublasLtMatrixLayoutDestroy(p->d);
    cublasLtMatmulDescDestroy(p->desc);
    delete p;
  }
  cudaFree(workspace_);
  cublasLtDestroy(handle_);
}

const CublasLt::Plan& CublasLt::plan(const Key& key) {
  auto found = plans_.find(key);
  if (found != plans_.end()) return *found->second;
  const auto [M, N, K, op_a, op_b, d_type] = key;
  // Column-major view: D^T [N, M] = op(B)^T [N, K] * op(A)^T [K, M]; cuBLAS's first operand is our B.
  auto* p = new Plan;
  const cublasOperation_t trans_first = op_b == static_cast<int>(Op::T) ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t trans_second = op_a == static_cast<int>(Op::T) ? CUBLAS_OP_T : CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_first, sizeof(trans_first)));
  CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_second, sizeof(trans_second)));
  // Stored shapes in column-major terms (rows, cols, leading dimension).
  const bool b_t = trans_first == CUBLAS_OP_T, a_t = trans_second == CUBLAS_OP_T;
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16BF, b_t ? K : N, b_t ? N : K, b_t ? K : N));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16BF, a_t ? M : K, a_t ? K : M, a_t ? M : K));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->d, static_cast<cudaDataType_t>(d_type), N, M, N));
  cublasLtMatmulPreference_t preference;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference));
  const size_t workspace = kWorkspaceBytes;
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                    sizeof(workspace)));
  cublasLtMatmulHeuristicResult_t result{};
  int found_count = 0;
  CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle_, p->desc, p->b, p->a, p->d, p->d, preference, 1, &result,
                                              &found_count));
  cublasLtMatmulPreferenceDestroy(preference);
  if (found_count == 0)
    throw std::runtime_error("cuBLASLt has no algorithm for M=" + std::to_string(M) + " N=" + std::to_string(N) +
                             " K=" + std::to_string(K));
  p->algo = result.algo;
  plans_[key] = p;
  return *p;
}

void CublasLt::run(void* D, cudaDataType_t d_type, const __nv_bfloat16* A, Op op_a, const __nv_bfloat16* B, Op op_b,
                   int M, int N, int K, bool accumulate, cudaStream_t stream) {
  const Plan& p = plan(Key{M, N, K, static_cast<int>(op_a), static_cast<int>(op_b), static_cast<int>(d_type)});
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  const char* ops[] = {"N", "T"};
  const profile::Region region(profile::enabled() ? "cublaslt " + std::to_string(M) + "x" + std::to_string(N) + "x" +
                                                        std::to_string(K) + " " + ops[static_cast<int>(op_a)] +
                                                        ops[static_cast<int>(op_b)] + (accumulate ? " accumulate" : "")
                                                  : std::string(),
                               profile::Work::Gemm, stream);
  CUBLAS_CHECK(cublasLtMatmul(handle_, p.desc, &alpha, B, p.b, A, p.a, &beta, D, p.d, D, p.d, &p.algo, workspace_,
                              kWorkspaceBytes, stream));
}

void CublasLt::gemm(__nv_bfloat16* D, const __nv_bfloat16* A, Op op_a, const __nv_bfloat16* B, Op op_b, int M, int N,
                    int K, bool accumulate, cudaStream_t stream) {
  run(D, CUDA_R_16BF, A, op_a, B, op_b, M, N, K, accumulate, stream);
}

void CublasLt::gemm(float* D, const __nv_bfloat16* A, Op op_a, const __nv_bfloat16* B, Op op_b, int M, int N, int K,
                    bool accumulate, cudaStream_t stream) {
  run(D, CUDA_R_32F, A, op_a, B, op_b, M, N, K, accumulate, stream);
}

}  // namespace coda
