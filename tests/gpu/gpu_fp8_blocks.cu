// Block scaling on the GPU (fp8_scaling = "block", docs/FP8.md): the quantize kernel
// (unfused::quantize_fp8_blocks) against the host specification (fp8_block_copy): every copy's decoded
// values times their factors equal the host's block copy exactly, for 1 x 128 row blocks, 128 x 1 column
// blocks and 128 x 128 tiles, on rows whose magnitudes differ by many binades; a NaN flags the tensor.
// cuBLASLt's block-scaled FP8 GEMM (gemm_fp8 with Fp8Scales::Rows128 / Tiles128) against the host
// product of the decoded operands with their factors, which pins the factor layouts.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/common/cuda_check.cuh"
#include "kernels/gemm/cublaslt.cuh"
#include "kernels/unfused/unfused.cuh"
#include "src/fp8.hpp"
#include "src/rng.hpp"
#include "tests/gpu_test_util.cuh"

namespace {

using coda::Fp8Format;
using coda::kFp8Block;
using bf16 = __nv_bfloat16;

// x [rows, cols] as bf16 values (exact in fp32): row r scaled by 2^(r % 24 - 12), so blocks differ by up to
// 2^23 and a per-tensor scale would flush the small rows.
std::vector<float> spread_rows(int rows, int cols, uint64_t seed) {
  coda::Rng rng(seed);
  std::vector<float> x(static_cast<size_t>(rows) * cols);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c)
      x[static_cast<size_t>(r) * cols + c] =
          coda::test::round_bf16(static_cast<float>(rng.normal()) * std::ldexp(1.0f, r % 24 - 12));
  return x;
}

TEST(GpuFp8Blocks, QuantizeEqualsTheHostBlockCopy) {
  SKIP_WITHOUT_GPU();
  const int rows = 256, cols = 384;  // 2 and 3 blocks: the tile factors' rows are padded to 4
  const int q_tile_row = coda::unfused::fp8_tile_factor_row(cols / kFp8Block),
            qt_tile_row = coda::unfused::fp8_tile_factor_row(rows / kFp8Block);
  const size_t n = static_cast<size_t>(rows) * cols;
  std::vector<float> x = spread_rows(rows, cols, 4);
  coda::test::DeviceBuffer<bf16> dx(x);
  coda::test::DeviceBuffer<uint8_t> q(n), qt(n);
  coda::test::DeviceBuffer<float> q_dequant(n), qt_dequant(n);
  coda::test::DeviceBuffer<unsigned int> bad(1);
  CUDA_CHECK(cudaMemset(bad.get(), 0, sizeof(unsigned int)));
  std::vector<float> rows_copy(n), cols_copy(n);
  for (bool tile : {false, true}) {
    SCOPED_TRACE(tile ? "128 x 128 tiles" : "1 x 128 and 128 x 1 blocks");
    coda::unfused::quantize_fp8_blocks({q.get(), q_dequant.get(), qt.get(), qt_dequant.get(), bad.get(), 7}, dx.get(),
                                       rows, cols, tile, nullptr);
    const std::vector<uint8_t> got_q = q.download_raw(), got_qt = qt.download_raw();
    const std::vector<float> f_q = q_dequant.download(), f_qt = qt_dequant.download();
    ASSERT_TRUE(coda::fp8_block_copy(rows_copy.data(), x.data(), rows, cols, tile ? kFp8Block : 1, kFp8Block,
                                     Fp8Format::E4M3));
    ASSERT_TRUE(coda::fp8_block_copy(cols_copy.data(), x.data(), rows, cols, kFp8Block, tile ? kFp8Block : 1,
                                     Fp8Format::E4M3));
    int mismatches = 0;
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c) {
        const size_t i = static_cast<size_t>(r) * cols + c;
        const float row_factor = tile ? f_q[(r / kFp8Block) * q_tile_row + c / kFp8Block] : f_q[(c / kFp8Block) * rows + r];
        const float col_factor = tile ? f_qt[(c / kFp8Block) * qt_tile_row + r / kFp8Block] : f_qt[(r / kFp8Block) * cols + c];
        const float from_q = coda::fp8_decode(got_q[i], Fp8Format::E4M3) * row_factor;
        const float from_qt = coda::fp8_decode(got_qt[static_cast<size_t>(c) * rows + r], Fp8Format::E4M3) * col_factor;
        if ((from_q != rows_copy[i] || from_qt != cols_copy[i]) && ++mismatches <= 5)
          ADD_FAILURE() << "x[" << r << "][" << c << "] = " << x[i] << ": q gives " << from_q << " (host "
                        << rows_copy[i] << "), qt gives " << from_qt << " (host " << cols_copy[i] << ")";
      }
    EXPECT_EQ(mismatches, 0);
  }
  EXPECT_EQ(bad.download_raw()[0], 0u) << "finite input flagged";
  x[5 * cols + 200] = std::nanf("");
  dx.upload(x);
  coda::unfused::quantize_fp8_blocks({q.get(), q_dequant.get(), nullptr, nullptr, bad.get(), 7}, dx.get(), rows, cols,
                                     false, nullptr);
  EXPECT_EQ(bad.download_raw()[0], 7u) << "a NaN names its tensor";
}

// D[M, N] = sum over k of decode(A) fa(block) decode(B) fb(block), with A's factors per 1 x 128 row block and
// B's per 128 x 128 tile (the forward and dgrad) or per 1 x 128 row block (the weight gradient); factors
// random powers of two over 2^-12 .. 2^3. The limit is that of the hand-written FP8 GEMM (gpu_fp8.cu): the
// block-scaled kernel scales each 128-deep partial sum, which wgmma adds with fewer bits than fp32 (measured
// 2.0e-4 and 2.3e-4 on H100, K = 640); a factor read from the wrong place is off by a power of two, i.e.
// errors of order 1.
TEST(GpuFp8Blocks, CublasLtBlockScaledGemmEqualsTheDecodedProduct) {
  SKIP_WITHOUT_GPU();
  coda::CublasLt cublas;
  const int M = 256, N = 384, K = 640, kb = K / kFp8Block, tile_row = coda::unfused::fp8_tile_factor_row(kb);
  coda::Rng rng(21);
  const auto codes = [&](size_t count) {
    std::vector<uint8_t> q(count);
    for (auto& c : q) c = coda::fp8_encode(static_cast<float>(rng.normal()) * 100.0f, Fp8Format::E4M3);
    return q;
  };
  const auto factors = [&](size_t count) {
    std::vector<float> f(count);
    for (auto& v : f) v = std::ldexp(1.0f, static_cast<int>(rng.below(16)) - 12);
    return f;
  };
  const std::vector<uint8_t> a = codes(static_cast<size_t>(M) * K), b = codes(static_cast<size_t>(N) * K);
  const std::vector<float> fa = factors(static_cast<size_t>(kb) * M);
  coda::test::DeviceCopy<uint8_t> da(a), db(b);
  coda::test::DeviceBuffer<float> dfa(fa);
  for (coda::Fp8Scales b_scales : {coda::Fp8Scales::Tiles128, coda::Fp8Scales::Rows128}) {
    const bool tiles = b_scales == coda::Fp8Scales::Tiles128;
    SCOPED_TRACE(tiles ? "B in 128 x 128 tiles" : "B in 1 x 128 blocks");
    const std::vector<float> fb = factors(tiles ? static_cast<size_t>(N / kFp8Block) * tile_row : static_cast<size_t>(kb) * N);
    coda::test::DeviceBuffer<float> dfb(fb);
    std::vector<double> expected(static_cast<size_t>(M) * N, 0.0), magnitude(expected.size(), 0.0);
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < N; ++j)
        for (int k = 0; k < K; ++k) {
          const double b_factor = tiles ? fb[(j / kFp8Block) * tile_row + k / kFp8Block] : fb[(k / kFp8Block) * N + j];
          const double term = static_cast<double>(coda::fp8_decode(a[static_cast<size_t>(i) * K + k], Fp8Format::E4M3)) *
                              fa[(k / kFp8Block) * M + i] *
                              coda::fp8_decode(b[static_cast<size_t>(j) * K + k], Fp8Format::E4M3) * b_factor;
          expected[static_cast<size_t>(i) * N + j] += term;
          magnitude[static_cast<size_t>(i) * N + j] += std::fabs(term);
        }
    coda::test::DeviceBuffer<float> d(std::vector<float>(expected.size(), 0.5f));
    cublas.gemm_fp8(d.get(), da.get(), Fp8Format::E4M3, dfa.get(), db.get(), Fp8Format::E4M3, dfb.get(), M, N, K, true,
                    nullptr, coda::Fp8Scales::Rows128, b_scales);
    const std::vector<float> got = d.download();
    double worst = 0.0;
    for (size_t i = 0; i < got.size(); ++i) {
      const double e = std::fabs(got[i] - 0.5 - expected[i]) / (magnitude[i] + 1e-30);
      worst = std::isnan(e) ? INFINITY : std::fmax(worst, e);
    }
    EXPECT_LT(worst, 1e-3) << "relative to sum |terms|";
  }
  EXPECT_THROW(cublas.gemm_fp8(static_cast<float*>(nullptr), da.get(), Fp8Format::E4M3, dfa.get(), db.get(),
                               Fp8Format::E4M3, dfa.get(), 200, N, K, false, nullptr, coda::Fp8Scales::Rows128,
                               coda::Fp8Scales::Tiles128),
               std::invalid_argument)
      << "M = 200 is not a multiple of 128";
}

}  // namespace
