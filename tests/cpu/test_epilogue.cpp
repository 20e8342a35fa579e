// Epilogue programs evaluated on the host (the same __host__ __device__ hooks the GEMM runs) against the
// plain math they stand for: each test writes the formula out independently, loop by loop.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <random>
#include <stdexcept>
#include <vector>

#include "kernels/epilogue/epilogue.cuh"
#include "src/fp8.hpp"

namespace {

using namespace coda::epi;

std::vector<float> random_vector(size_t n, float lo, float hi, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

double gelu_reference(double x) { return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x))); }

// Shapes with N not a multiple of the tile width, so the last N tile is partial.
constexpr int kM = 23, kN = 200, kTile = 64;
constexpr int kTiles = (kN + kTile - 1) / kTile;

TEST(Epilogue, RowScaleColumnBiasGelu) {
  const auto acc = random_vector(kM * kN, -3.0f, 3.0f, 1);
  const auto r = random_vector(kM, 0.5f, 2.0f, 2);
  const auto b = random_vector(kN, -1.0f, 1.0f, 3);
  auto program = make_program(RowBroadcast<Mul>(r.data()), ColBroadcast<Add>(b.data()), Elementwise<Gelu>());
  std::vector<float> out(kM * kN, NAN);
  evaluate_on_host(program, acc.data(), kM, kN, kTile, out.data());
  for (int i = 0; i < kM; ++i)
    for (int j = 0; j < kN; ++j)
      ASSERT_NEAR(out[i * kN + j], gelu_reference(double(r[i]) * acc[i * kN + j] + b[j]), 1e-5) << i << "," << j;
}

TEST(Epilogue, SwiGluPairwiseHalvesTheWidth) {
  const auto acc = random_vector(kM * kN, -4.0f, 4.0f, 4);
  auto program = make_program(Pairwise<SwiGlu>());
  static_assert(decltype(program)::kColsPerOut == 2, "2 -> 1 map halves the output");
  std::vector<float> out(kM * kN / 2, NAN);
  evaluate_on_host(program, acc.data(), kM, kN, kTile, out.data());
  for (int i = 0; i < kM; ++i)
    for (int j = 0; j < kN / 2; ++j) {
      const double g = acc[i * kN + 2 * j], u = acc[i * kN + 2 * j + 1];
      ASSERT_NEAR(out[i * kN / 2 + j], g / (1.0 + std::exp(-g)) * u, 1e-5) << i << "," << j;
    }
}

TEST(Epilogue, RopeRotatesAdjacentPairsOfQueryAndKeyHeads) {
  // Rows are tokens of sequences of length T; columns: 2 q heads, 1 k head, 1 v head of width hd.
  constexpr int T = 5, hd = 16, rot_cols = 3 * hd, N = 4 * hd, M = 2 * T + 3;
  const float theta = 10000.0f;
  const auto acc = random_vector(M * N, -2.0f, 2.0f, 5);
  auto program = make_program(Pairwise<Rope<hd>>(Rope<hd>{T, rot_cols, std::log2(theta)}));
  std::vector<float> out(M * N, NAN);
  evaluate_on_host(program, acc.data(), M, N, 32, out.data());
  for (int i = 0; i < M; ++i)
    for (int c = 0; c < N; c += 2) {
      const double a = acc[i * N + c], b = acc[i * N + c + 1];
      double ea = a, eb = b;
      if (c < rot_cols) {
        const double angle = (i % T) * std::pow(theta, -double(c % hd) / hd);
        ea = a * std::cos(angle) - b * std::sin(angle);
        eb = a * std::sin(angle) + b * std::cos(angle);
      }
      ASSERT_NEAR(out[i * N + c], ea, 1e-4) << i << "," << c;
      ASSERT_NEAR(out[i * N + c + 1], eb, 1e-4) << i << "," << c;
    }
}

TEST(Epilogue, RowSumOfSquaresPartialsAddUpToTheRow) {
  const auto acc = random_vector(kM * kN, -2.0f, 2.0f, 6);
  std::vector<float> partials(kM * kTiles, NAN), out(kM * kN);
  evaluate_on_host(make_program(RowReduce<SumSquares>(partials.data())), acc.data(), kM, kN, kTile, out.data());
  for (int i = 0; i < kM; ++i) {
    double row = 0.0, sum_of_partials = 0.0;
    for (int t = 0; t < kTiles; ++t) {
      double tile = 0.0;
      for (int j = t * kTile; j < std::min(kN, (t + 1) * kTile); ++j) tile += double(acc[i * kN + j]) * acc[i * kN + j];
      EXPECT_NEAR(partials[i * kTiles + t], tile, 1e-4 * tile);
      sum_of_partials += partials[i * kTiles + t];
      row += tile;
    }
    EXPECT_NEAR(sum_of_partials, row, 1e-5 * row);
    for (int j = 0; j < kN; ++j) ASSERT_EQ(out[i * kN + j], acc[i * kN + j]) << "a reduction leaves the values";
  }
}

// The FP8 store (fp8(v * scale), satfinite, from the device's scale) against the host codec of src/fp8.hpp,
// with its amax partials per (row, N tile), in both formats; the scale pushes the largest values past e4m3's
// range (saturation); a NaN makes its tile's amax NaN; the values pass on unchanged.
TEST(Epilogue, Fp8StoreEqualsTheHostCodecAndAmaxPartialsTakeTheLargestMagnitude) {
  auto acc = random_vector(kM * kN, -3.0f, 3.0f, 16);
  acc[5 * kN + 70] = NAN;  // row 5, tile 1
  const float scale = 200.0f;
  std::vector<uint8_t> e4m3(kM * kN, 0xAA), e5m2(kM * kN, 0xAA);
  std::vector<float> amax(kM * kTiles, -1.0f), out(kM * kN);
  const auto program = make_program(StoreFp8<coda::Fp8Format::E4M3>(e4m3.data(), kN, &scale),
                                    StoreFp8<coda::Fp8Format::E5M2>(e5m2.data(), kN, &scale),
                                    RowReduce<AbsMax>(amax.data()));
  evaluate_on_host(program, acc.data(), kM, kN, kTile, out.data());
  for (int i = 0; i < kM; ++i) {
    for (int j = 0; j < kN; ++j) {
      const float v = acc[i * kN + j];
      ASSERT_EQ(e4m3[i * kN + j], coda::fp8_encode(v * scale, coda::Fp8Format::E4M3)) << i << "," << j;
      ASSERT_EQ(e5m2[i * kN + j], coda::fp8_encode(v * scale, coda::Fp8Format::E5M2)) << i << "," << j;
      if (std::isnan(v))
        EXPECT_TRUE(std::isnan(out[i * kN + j]));
      else
        ASSERT_EQ(out[i * kN + j], v) << "the store leaves the values";
    }
    for (int t = 0; t < kTiles; ++t) {
      float want = 0.0f;
      bool nan = false;
      for (int j = t * kTile; j < std::min(kN, (t + 1) * kTile); ++j) {
        nan |= std::isnan(acc[i * kN + j]);
        want = std::max(want, std::fabs(acc[i * kN + j]));
      }
      if (nan)
        EXPECT_TRUE(std::isnan(amax[i * kTiles + t])) << "row " << i << " tile " << t;
      else
        EXPECT_EQ(amax[i * kTiles + t], want) << "row " << i << " tile " << t;
    }
  }
  EXPECT_EQ(coda::fp8_decode(coda::fp8_encode(3.0f * scale, coda::Fp8Format::E4M3), coda::Fp8Format::E4M3), 448.0f)
      << "the test's scale saturates e4m3";
}

// The transposed FP8 store: byte (column, row) of the copy is the host codec's fp8(v * scale), after a 2 -> 1
// map too (output columns, not accumulator columns); the copy's padding rows (ld > M) stay as they were; a
// row length that is not a multiple of 16 is refused.
TEST(Epilogue, TransposedFp8StoreWritesEachOutputColumnAsARow) {
  const auto acc = random_vector(kM * kN, -3.0f, 3.0f, 17);
  const float scale = 30.0f;
  constexpr int kLd = 32;  // >= kM, a multiple of 16
  alignas(16) static uint8_t plain[kN * kLd], paired[kN / 2 * kLd];
  std::fill(std::begin(plain), std::end(plain), 0xAA);
  std::fill(std::begin(paired), std::end(paired), 0xAA);
  std::vector<float> out(kM * kN), out_paired(kM * kN / 2);
  evaluate_on_host(make_program(StoreFp8Transposed<coda::Fp8Format::E5M2>(plain, kLd, &scale)), acc.data(), kM, kN,
                   kTile, out.data());
  evaluate_on_host(make_program(Pairwise<SwiGlu>(), StoreFp8Transposed<coda::Fp8Format::E4M3>(paired, kLd, &scale)),
                   acc.data(), kM, kN, kTile, out_paired.data());
  for (int j = 0; j < kN; ++j)
    for (int i = 0; i < kLd; ++i) {
      const uint8_t want = i < kM ? coda::fp8_encode(acc[i * kN + j] * scale, coda::Fp8Format::E5M2) : 0xAA;
      ASSERT_EQ(plain[j * kLd + i], want) << "column " << j << ", row " << i;
      if (i < kM) {
        ASSERT_EQ(out[i * kN + j], acc[i * kN + j]) << "the store leaves the values";
      }
    }
  for (int j = 0; j < kN / 2; ++j)
    for (int i = 0; i < kLd; ++i) {
      const uint8_t want = i < kM ? coda::fp8_encode(out_paired[i * kN / 2 + j] * scale, coda::Fp8Format::E4M3) : 0xAA;
      ASSERT_EQ(paired[j * kLd + i], want) << "output column " << j << ", row " << i;
    }
  EXPECT_THROW(StoreFp8Transposed<coda::Fp8Format::E4M3>(plain, 24, &scale), std::invalid_argument);
  EXPECT_THROW(StoreFp8Transposed<coda::Fp8Format::E4M3>(plain + 8, kLd, &scale), std::invalid_argument);
}

TEST(Epilogue, OnlineLogSumExpPartialsMergeToTheFullRow) {
  // Large logits: a naive sum of exp would overflow float.
  const int N = 1000;
  const int tiles = (N + kTile - 1) / kTile;
  const auto acc = random_vector(kM * N, -60.0f, 95.0f, 7);
  std::vector<LogSumExp::Out> partials(kM * tiles);
  std::vector<float> out(kM * N);
  evaluate_on_host(make_program(RowReduce<LogSumExp>(partials.data())), acc.data(), kM, N, kTile, out.data());
  for (int i = 0; i < kM; ++i) {
    double mx = -INFINITY;
    for (int j = 0; j < N; ++j) mx = std::max(mx, double(acc[i * N + j]));
    double s = 0.0;
    for (int j = 0; j < N; ++j) s += std::exp(acc[i * N + j] - mx);
    const double lse = mx + std::log(s);
    EXPECT_NEAR(merge_lse(&partials[i * tiles], tiles), lse, 1e-4 * std::abs(lse)) << "row " << i;
  }
}

// The GPU's batched log-sum-exp (RowReduce hands it four groups of a row at once) against the per-value
// online form and the exact fp64 value: batches with masked (-inf) values, a batch with every value masked
// first (the state must stay empty), a new maximum in a later batch, and logits far outside exp's range.
TEST(Epilogue, LogSumExpBatchesEqualTheOnlineForm) {
  const auto x = random_vector(8 * 64, -60.0f, 95.0f, 12);
  float m_batch = -INFINITY, s_batch = 0.0f, m_online = -INFINITY, s_online = 0.0f;
  std::vector<double> kept;
  for (int b = 0; b < 64; ++b) {
    float batch[8];
    for (int i = 0; i < 8; ++i) {
      const bool masked = b == 0 || (b * 8 + i) % 5 == 0;
      batch[i] = masked ? -INFINITY : x[b * 8 + i] + (b > 32 ? 40.0f : 0.0f);
      if (!masked) kept.push_back(batch[i]);
    }
    LogSumExp::add_batch(m_batch, s_batch, batch);
    LogSumExp::add(m_online, s_online, batch, 4);  // a fragment's values at most: two calls
    LogSumExp::add(m_online, s_online, batch + 4, 4);
    if (b == 0) {
      EXPECT_EQ(m_batch, -INFINITY);
      EXPECT_EQ(s_batch, 0.0f);
    }
  }
  const double mx = *std::max_element(kept.begin(), kept.end());
  double s = 0.0;
  for (double v : kept) s += std::exp(v - mx);
  const double lse = mx + std::log(s);
  EXPECT_EQ(m_batch, m_online);
  EXPECT_NEAR(s_batch, s_online, 1e-5 * s_online);
  EXPECT_NEAR(m_batch + std::log(double(s_batch)), lse, 1e-5 * std::abs(lse));
}

TEST(Epilogue, RowPickFindsTheTargetColumn) {
  const auto acc = random_vector(kM * kN, -5.0f, 5.0f, 8);
  std::vector<int32_t> target(kM);
  std::mt19937 rng(9);
  for (auto& t : target) t = static_cast<int32_t>(rng() % kN);
  std::vector<float> picked(kM, NAN), out(kM * kN);
  evaluate_on_host(make_program(RowPick(target.data(), picked.data())), acc.data(), kM, kN, kTile, out.data());
  for (int i = 0; i < kM; ++i) EXPECT_EQ(picked[i], acc[i * kN + target[i]]) << "row " << i;
}

TEST(Epilogue, TileLoadAuxStoreThenMap) {
  // Residual add, keep the pre-activation, then GELU: out = gelu(acc + res), aux = acc + res.
  const auto acc = random_vector(kM * kN, -2.0f, 2.0f, 10);
  const auto res_f = random_vector(kM * kN, -2.0f, 2.0f, 11);
  std::vector<__nv_bfloat16> res(kM * kN);
  for (size_t i = 0; i < res.size(); ++i) res[i] = __float2bfloat16(res_f[i]);
  std::vector<float> aux(kM * kN, NAN), out(kM * kN, NAN);
  auto program = make_program(TileLoad<Add>(res.data(), kN), StoreAux<float>(aux.data(), kN), Elementwise<Gelu>());
  evaluate_on_host(program, acc.data(), kM, kN, kTile, out.data());
  for (int i = 0; i < kM * kN; ++i) {
    const double pre = acc[i] + double(__bfloat162float(res[i]));
    ASSERT_NEAR(aux[i], pre, 1e-6) << i;
    ASSERT_NEAR(out[i], gelu_reference(pre), 1e-5) << i;
  }
}

TEST(Epilogue, ReductionAfterATwoToOneMapSeesTheHalfWidthValues) {
  const auto acc = random_vector(kM * kN, -3.0f, 3.0f, 12);
  const auto r = random_vector(kM, 0.5f, 2.0f, 13);
  std::vector<float> partials(kM * kTiles, NAN), out(kM * kN / 2, NAN);
  auto program =
      make_program(RowBroadcast<Mul>(r.data()), Pairwise<SwiGlu>(), RowReduce<SumSquares>(partials.data()));
  evaluate_on_host(program, acc.data(), kM, kN, kTile, out.data());
  for (int i = 0; i < kM; ++i) {
    for (int t = 0; t < kTiles; ++t) {
      double expected = 0.0;
      for (int j = t * kTile / 2; j < std::min(kN, (t + 1) * kTile) / 2; ++j) {
        const double g = r[i] * double(acc[i * kN + 2 * j]), u = r[i] * double(acc[i * kN + 2 * j + 1]);
        const double y = g / (1.0 + std::exp(-g)) * u;
        ASSERT_NEAR(out[i * kN / 2 + j], y, 1e-4 * (1.0 + std::abs(y)));
        expected += y * y;
      }
      EXPECT_NEAR(partials[i * kTiles + t], expected, 1e-4 * (1.0 + expected)) << i << "," << t;
    }
  }
}

// Column partials per 16-row group (kM = 23: one full group, one partial) after a 2->1 map, row dots
// against a column vector, and the scaled subtraction of a bf16 tile.
TEST(Epilogue, ColumnPartialsRowDotsAndScaledSubtraction) {
  const int out_cols = kN / 2, groups = (kM + 15) / 16;
  const auto acc = random_vector(kM * kN, -3.0f, 3.0f, 14);
  const auto alpha = random_vector(kM, -1.5f, 1.5f, 15), c = random_vector(out_cols, -1.0f, 1.0f, 16);
  const auto t = random_vector(kM * out_cols, -2.0f, 2.0f, 17);
  std::vector<__nv_bfloat16> tile(t.size());
  for (size_t i = 0; i < t.size(); ++i) tile[i] = __float2bfloat16_rn(t[i]);
  std::vector<float> col_p(groups * out_cols, NAN), row_p(kM * kTiles, NAN), out(kM * out_cols, NAN);
  auto program = make_program(Pairwise<SwiGlu>(), SubScaled<Tile>(alpha.data(), Tile{tile.data(), out_cols}),
                              ColDot<Ones>(Ones{}, col_p.data(), out_cols),
                              RowDot<ColVector>(ColVector{c.data()}, row_p.data()));
  evaluate_on_host(program, acc.data(), kM, kN, kTile, out.data());
  std::vector<double> col_sum(groups * out_cols, 0.0), row_dot(kM * kTiles, 0.0);
  for (int i = 0; i < kM; ++i)
    for (int j = 0; j < out_cols; ++j) {
      const double g = acc[i * kN + 2 * j], u = acc[i * kN + 2 * j + 1];
      const double y = g / (1.0 + std::exp(-g)) * u - alpha[i] * double(__bfloat162float(tile[i * out_cols + j]));
      ASSERT_NEAR(out[i * out_cols + j], y, 1e-4 * (1.0 + std::abs(y))) << i << "," << j;
      col_sum[(i / 16) * out_cols + j] += y;
      row_dot[i * kTiles + 2 * j / kTile] += y * c[j];
    }
  for (size_t k = 0; k < col_sum.size(); ++k) EXPECT_NEAR(col_p[k], col_sum[k], 1e-4 * (1.0 + std::abs(col_sum[k])));
  for (size_t k = 0; k < row_dot.size(); ++k) EXPECT_NEAR(row_p[k], row_dot[k], 1e-4 * (1.0 + std::abs(row_dot[k])));
}

// GELU and its gradient as the programs evaluate them, against the tanh formula and a central difference.
TEST(Epilogue, GeluAndGeluGradientMatchTheFormula) {
  for (double x = -6.0; x <= 6.0; x += 0.01) {
    const double h = 1e-4, slope = (gelu_reference(x + h) - gelu_reference(x - h)) / (2 * h);
    EXPECT_NEAR(Gelu()(static_cast<float>(x)), gelu_reference(x), 1e-5 * (1.0 + std::abs(x))) << x;
    EXPECT_NEAR(GeluGradMul()(2.0f, static_cast<float>(x)), 2.0 * slope, 1e-4) << x;
  }
}

}  // namespace

// The GEMM runs its interior chunk body (masks folded) only on N tiles before every column end of the
// program, in accumulator columns: the LM head's vocabulary bound, scaled through a 2 -> 1 map.
TEST(Epilogue, ProgramColumnEndIsItsReductionBoundInAccumulatorColumns) {
  float rstd[1] = {1.0f};
  LogSumExp::Out lse[1];
  float sums[1];
  EXPECT_EQ(make_program(RowBroadcast<Mul>(rstd)).acc_column_end(), kNoColumnEnd);
  EXPECT_EQ(make_program(RowBroadcast<Mul>(rstd), RowReduce<LogSumExp>(lse, 50257)).acc_column_end(), 50257);
  EXPECT_EQ(make_program(Pairwise<SwiGlu>(), RowReduce<Sum>(sums, 100)).acc_column_end(), 200);
  EXPECT_EQ(make_program(RowReduce<Sum>(sums, 300), Pairwise<SwiGlu>(), RowReduce<Sum>(sums, 100)).acc_column_end(),
            200);
  EXPECT_EQ(make_program(RowReduce<Sum>(sums)).acc_column_end(), kNoColumnEnd);
}

// The bytes per accumulator column of a program's column vectors (what the GPU stages per tile in shared
// memory): each vector's element size, halved after a 2->1 map and doubled after a 1->2 map.
TEST(Epilogue, ProgramColumnBytesCountEachColumnVectorAtItsWidth) {
  float rstd[1] = {1.0f}, c[4] = {}, dots[1];
  __nv_bfloat16 bias[4] = {};
  using Gpt2Head = decltype(make_program(SubScaled<ColVector>(rstd, ColVector{c}), RowBroadcast<Mul>(rstd),
                                         ColBroadcast<Add>(c), RowReduce<LogSumExp>(nullptr, 4)));
  EXPECT_EQ(Gpt2Head::column_bytes(), 8);
  using Residual = decltype(make_program(ColBroadcast<Add, __nv_bfloat16>(bias), RowReduce<Sum>(dots),
                                         ColBroadcast<Mul, __nv_bfloat16>(bias)));
  EXPECT_EQ(Residual::column_bytes(), 4);
  using AfterSwiGlu = decltype(make_program(RowDot<ColVector>(ColVector{c}, dots), Pairwise<SwiGlu>(),
                                            ColBroadcast<Add>(c)));
  EXPECT_EQ(AfterSwiGlu::column_bytes(), 4 + 2);
  EXPECT_EQ(decltype(make_program(RowBroadcast<Mul>(rstd), Pairwise<SwiGlu>()))::column_bytes(), 0);
}

// bf16 aux rows must be 16-byte aligned: the GPU stores 8 values of a row at once.
TEST(Epilogue, Bf16AuxStoreRejectsUnalignedRows) {
  alignas(16) __nv_bfloat16 rows[64];
  EXPECT_NO_THROW(StoreAux<__nv_bfloat16>(rows, 16));
  EXPECT_THROW(StoreAux<__nv_bfloat16>(rows, 12), std::invalid_argument);
  EXPECT_THROW(StoreAux<__nv_bfloat16>(rows + 1, 16), std::invalid_argument);
  EXPECT_NO_THROW(StoreAux<float>(reinterpret_cast<float*>(rows) + 1, 3));  // fp32 aux: stored per fragment
}
