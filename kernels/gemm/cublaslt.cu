// cuBLASLt wrapper; see cublaslt.cuh for the conventions.
#include "kernels/gemm/cublaslt.cuh"

#include <stdexcept>
#include <string>
#include <type_traits>

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
  const auto [M, N, K, op_a, op_b, d_type, a_type, b_type, a_scales, b_scales] = key;
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
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->b, static_cast<cudaDataType_t>(b_type), b_t ? K : N, b_t ? N : K,
                                          b_t ? K : N));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->a, static_cast<cudaDataType_t>(a_type), a_t ? M : K, a_t ? K : M,
                                          a_t ? M : K));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->d, static_cast<cudaDataType_t>(d_type), N, M, N));
  if (static_cast<cudaDataType_t>(a_type) != CUDA_R_16BF) {
    // An FP8 plan is chosen with its scale pointers set (to the workspace, 16-byte aligned as a run's
    // factors must be, until a run sets the operands' own), so the heuristic sees the descriptor the runs use.
    for (const auto attribute : {CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER})
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, attribute, &workspace_, sizeof(workspace_)));
    // cuBLAS's A is our B and its B our A; the factor layouts are the same for either operand.
    const auto mode = [](int scales) -> int32_t {
      switch (static_cast<Fp8Scales>(scales)) {
        case Fp8Scales::Rows128: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
        case Fp8Scales::Tiles128: return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
        case Fp8Scales::Tensor: break;
      }
      return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    };
    const int32_t first_mode = mode(b_scales), second_mode = mode(a_scales);
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &first_mode,
                                                sizeof(first_mode)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &second_mode,
                                                sizeof(second_mode)));
  }
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

void CublasLt::run(void* D, cudaDataType_t d_type, const Operand& A, const Operand& B, int M, int N, int K,
                   bool accumulate, cudaStream_t stream) {
  const Plan& p = plan(Key{M, N, K, static_cast<int>(A.op), static_cast<int>(B.op), static_cast<int>(d_type),
                           static_cast<int>(A.type), static_cast<int>(B.type), static_cast<int>(A.scales),
                           static_cast<int>(B.scales)});
  if (A.dequant != nullptr) {  // cuBLAS's A is our B (the operands are swapped, above)
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &B.dequant,
                                                sizeof(B.dequant)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &A.dequant,
                                                sizeof(A.dequant)));
  }
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  const char* ops[] = {"N", "T"};
  const profile::Region region(profile::enabled() ? std::string(A.dequant != nullptr ? "cublaslt fp8 " : "cublaslt ") +
                                                        std::to_string(M) + "x" + std::to_string(N) + "x" +
                                                        std::to_string(K) + " " + ops[static_cast<int>(A.op)] +
                                                        ops[static_cast<int>(B.op)] + (accumulate ? " accumulate" : "")
                                                  : std::string(),
                               profile::Work::Gemm, stream);
  CUBLAS_CHECK(cublasLtMatmul(handle_, p.desc, &alpha, B.data, p.b, A.data, p.a, &beta, D, p.d, D, p.d, &p.algo,
                              workspace_, kWorkspaceBytes, stream));
}

void CublasLt::gemm(__nv_bfloat16* D, const __nv_bfloat16* A, Op op_a, const __nv_bfloat16* B, Op op_b, int M, int N,
                    int K, bool accumulate, cudaStream_t stream) {
  run(D, CUDA_R_16BF, {A, op_a, CUDA_R_16BF, nullptr}, {B, op_b, CUDA_R_16BF, nullptr}, M, N, K, accumulate, stream);
}

void CublasLt::gemm(float* D, const __nv_bfloat16* A, Op op_a, const __nv_bfloat16* B, Op op_b, int M, int N, int K,
                    bool accumulate, cudaStream_t stream) {
  run(D, CUDA_R_32F, {A, op_a, CUDA_R_16BF, nullptr}, {B, op_b, CUDA_R_16BF, nullptr}, M, N, K, accumulate, stream);
}

namespace {
cudaDataType_t fp8_type(Fp8Format format) { return format == Fp8Format::E4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }
}  // namespace

template <typename OutT>
void CublasLt::gemm_fp8(OutT* D, const uint8_t* A, Fp8Format a_format, const float* a_dequant, const uint8_t* B,
                        Fp8Format b_format, const float* b_dequant, int M, int N, int K, bool accumulate,
                        cudaStream_t stream, Fp8Scales a_scales, Fp8Scales b_scales) {
  if (a_format == Fp8Format::E5M2 && b_format == Fp8Format::E5M2)
    throw std::invalid_argument("cuBLASLt FP8: e5m2 x e5m2 is not a Hopper format pair (one operand must be e4m3)");
  if (a_dequant == nullptr || b_dequant == nullptr)
    throw std::invalid_argument("cuBLASLt FP8: both dequantization factors are required");
  if (K % 16 != 0) throw std::invalid_argument("cuBLASLt FP8: K=" + std::to_string(K) + " must be a multiple of 16");
  if (reinterpret_cast<uintptr_t>(a_dequant) % 16 != 0 || reinterpret_cast<uintptr_t>(b_dequant) % 16 != 0)
    throw std::invalid_argument("cuBLASLt FP8: the dequantization factors must be 16-byte aligned (cublasLtMatmul "
                                "refuses others as not supported)");
  if ((a_scales != Fp8Scales::Tensor || b_scales != Fp8Scales::Tensor) && (M % 128 != 0 || N % 128 != 0 || K % 128 != 0))
    throw std::invalid_argument("cuBLASLt FP8 with block scales: M=" + std::to_string(M) + ", N=" +
                                std::to_string(N) + " and K=" + std::to_string(K) + " must be multiples of 128");
  const cudaDataType_t d_type = std::is_same_v<OutT, float> ? CUDA_R_32F : CUDA_R_16BF;
  run(D, d_type, {A, Op::N, fp8_type(a_format), a_dequant, a_scales}, {B, Op::T, fp8_type(b_format), b_dequant, b_scales},
      M, N, K, accumulate, stream);
}
template void CublasLt::gemm_fp8<__nv_bfloat16>(__nv_bfloat16*, const uint8_t*, Fp8Format, const float*,
                                                const uint8_t*, Fp8Format, const float*, int, int, int, bool,
                                                cudaStream_t, Fp8Scales, Fp8Scales);
template void CublasLt::gemm_fp8<float>(float*, const uint8_t*, Fp8Format, const float*, const uint8_t*, Fp8Format,
                                        const float*, int, int, int, bool, cudaStream_t, Fp8Scales, Fp8Scales);

}  // namespace coda
