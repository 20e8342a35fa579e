// Which FP8 copy a normed GEMM's operand needs in the coda mode (docs/CODA.md, "FP8 operands from the
// epilogues"), measured on the host with the FP8 rounding of src/fp8.hpp. The coda GEMM after a norm reads
// O = h (.) gamma, not the norm's output u, and finishes the norm in its epilogue:
//   RMSNorm    z = u W^T = diag(r) (O W^T),                   r = 1 / rms(h) per row
//   LayerNorm  z = u W^T + b = r (O W^T - mu c) + b',         c = W gamma, b' = W beta + b
// so its FP8 copy is of O, where the unfused mode quantizes u. The weight stays fp32 here: only the operand's
// rounding is measured, as each output row's relative error against the fp32 z, for three copies:
//   u per tensor (the unfused mode's recipe), O per tensor (one delayed scale, the simplest epilogue store),
//   O in 1 x 128 blocks (a scale per block of a row, found inside the producing tile).
// What the measurements pin: O's rows keep the spread of ||h|| over tokens that u has normalized away, which
// a per-tensor scale absorbs while the smallest rows stay inside e4m3's range (Gaussian rows: no cost up to
// 2^12 of spread in norm, 1.8x the error at 2^14, 7x at 2^16) and pays for beyond it; block scales follow
// each row. For LayerNorm the GEMM multiplies the
// uncentered O and the correction removes the mean afterwards, so a row's error relative to ||h|| reaches z
// amplified by about ||h|| / ||h - mu||, whatever the scales: its copies must be of the centered u.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "fp8.hpp"
#include "rng.hpp"

namespace {

using coda::Fp8Format;

constexpr int kRows = 64, kWidth = 512, kOut = 64;

struct Matrix {
  int rows, cols;
  std::vector<float> v;
  Matrix(int r, int c) : rows(r), cols(c), v(static_cast<size_t>(r) * c, 0.0f) {}
  float& at(int r, int c) { return v[static_cast<size_t>(r) * cols + c]; }
  float at(int r, int c) const { return v[static_cast<size_t>(r) * cols + c]; }
};

Matrix gaussian(int rows, int cols, coda::Rng& rng, double scale = 1.0) {
  Matrix m(rows, cols);
  for (float& x : m.v) x = static_cast<float>(scale * rng.normal());
  return m;
}

// e4m3 copies: one scale for the tensor (its amax onto the largest finite value), or one per 1 x 128 block.
Matrix per_tensor_copy(const Matrix& x) {
  float amax = 0.0f;
  for (float value : x.v) amax = std::max(amax, std::fabs(value));
  const float s = coda::fp8_largest(Fp8Format::E4M3) / amax;
  Matrix copy = x;
  for (float& value : copy.v) value = coda::fp8_round(value * s, Fp8Format::E4M3) / s;
  return copy;
}

Matrix block_copy(const Matrix& x) {
  Matrix copy(x.rows, x.cols);
  EXPECT_TRUE(coda::fp8_block_copy(copy.v.data(), x.v.data(), x.rows, x.cols, 1, coda::kFp8Block, Fp8Format::E4M3));
  return copy;
}

// y = x W^T, rows scaled by row_scale, minus row_shift[r] * shift_cols[c], plus col_add[c] (each if given).
Matrix linear(const Matrix& x, const Matrix& w, const std::vector<double>& row_scale = {},
              const std::vector<double>& row_shift = {}, const std::vector<double>& shift_cols = {},
              const std::vector<double>& col_add = {}) {
  Matrix y(x.rows, w.rows);
  for (int r = 0; r < x.rows; ++r)
    for (int c = 0; c < w.rows; ++c) {
      double acc = 0.0;
      for (int k = 0; k < x.cols; ++k) acc += static_cast<double>(x.at(r, k)) * w.at(c, k);
      if (!row_shift.empty()) acc -= row_shift[r] * shift_cols[c];
      if (!row_scale.empty()) acc *= row_scale[r];
      if (!col_add.empty()) acc += col_add[c];
      y.at(r, c) = static_cast<float>(acc);
    }
  return y;
}

// The largest relative error of a row of got against want.
double worst_row_error(const Matrix& got, const Matrix& want) {
  double worst = 0.0;
  for (int r = 0; r < want.rows; ++r) {
    double err = 0.0, norm = 0.0;
    for (int c = 0; c < want.cols; ++c) {
      err += std::pow(static_cast<double>(got.at(r, c)) - want.at(r, c), 2);
      norm += std::pow(static_cast<double>(want.at(r, c)), 2);
    }
    worst = std::max(worst, std::sqrt(err / norm));
  }
  return worst;
}

struct RmsErrors {
  double u_tensor, o_tensor, o_blocks;
};

// RMSNorm rows whose norms spread over 2^spread_binades (row r scaled by 2^(r * spread / rows)).
RmsErrors rmsnorm_operand_errors(double spread_binades) {
  coda::Rng rng(71);
  Matrix h = gaussian(kRows, kWidth, rng), w = gaussian(kOut, kWidth, rng, 1.0 / std::sqrt(kWidth));
  std::vector<double> gamma(kWidth), r(kRows);
  for (double& g : gamma) g = 1.0 + 0.2 * rng.normal();
  for (int row = 0; row < kRows; ++row) {
    const double s = std::exp2(spread_binades * row / (kRows - 1));
    double sum = 0.0;
    for (int k = 0; k < kWidth; ++k) sum += std::pow(h.at(row, k) *= static_cast<float>(s), 2);
    r[row] = 1.0 / std::sqrt(sum / kWidth + 1e-6);
  }
  Matrix o(kRows, kWidth), u(kRows, kWidth);
  for (int row = 0; row < kRows; ++row)
    for (int k = 0; k < kWidth; ++k) {
      o.at(row, k) = static_cast<float>(h.at(row, k) * gamma[k]);
      u.at(row, k) = static_cast<float>(r[row] * o.at(row, k));
    }
  const Matrix z = linear(u, w);
  return {worst_row_error(linear(per_tensor_copy(u), w), z), worst_row_error(linear(per_tensor_copy(o), w, r), z),
          worst_row_error(linear(block_copy(o), w, r), z)};
}

TEST(CodaFp8Operands, RmsNormOperandTakesOneScaleUntilItsRowsSpreadBeyondTheNormalRange) {
  for (double binades : {6.0, 10.0, 12.0, 14.0, 16.0}) {
    const RmsErrors e = rmsnorm_operand_errors(binades);
    std::printf("  row norms over 2^%.0f: u per tensor %.4f  O per tensor %.4f  O in blocks %.4f\n", binades,
                e.u_tensor, e.o_tensor, e.o_blocks);
    // e4m3 keeps 3 mantissa bits: up to 2^-4 of relative error per value, about 0.036 in RMS.
    EXPECT_LT(e.u_tensor, 0.05) << binades;
    EXPECT_LT(e.o_blocks, 1.25 * e.u_tensor) << binades << ": a scale per block follows every row";
    if (binades <= 12.0) {
      EXPECT_LT(e.o_tensor, 1.25 * e.u_tensor) << binades << ": inside e4m3's range a spread costs one scale nothing";
    }
    if (binades >= 16.0) {
      EXPECT_GT(e.o_tensor, 4.0 * e.u_tensor) << "the smallest rows fall below the normal range";
    }
  }
}

// LayerNorm rows h = mean + deviation with ||h|| / ||h - mu|| = `ratio`: the coda form z = r (O W^T - mu c) + b'
// on a block copy of O against the unfused form on a per-tensor copy of u.
TEST(CodaFp8Operands, LayerNormOperandMustBeCentered) {
  for (double ratio : {1.0, 8.0}) {
    coda::Rng rng(72);
    Matrix h = gaussian(kRows, kWidth, rng), w = gaussian(kOut, kWidth, rng, 1.0 / std::sqrt(kWidth));
    std::vector<double> gamma(kWidth), beta(kWidth), mu(kRows), r(kRows), c(kOut, 0.0), b(kOut, 0.0);
    for (int k = 0; k < kWidth; ++k) gamma[k] = 1.0 + 0.2 * rng.normal(), beta[k] = 0.1 * rng.normal();
    const double offset = std::sqrt(ratio * ratio - 1.0);  // rows of unit deviation, mean offset * sign
    Matrix o(kRows, kWidth), u(kRows, kWidth);
    for (int row = 0; row < kRows; ++row) {
      const double shift = (row % 2 == 0 ? 1.0 : -1.0) * offset;
      double sum = 0.0, sq = 0.0;
      for (int k = 0; k < kWidth; ++k) sum += h.at(row, k) += static_cast<float>(shift);
      mu[row] = sum / kWidth;
      for (int k = 0; k < kWidth; ++k) sq += std::pow(h.at(row, k) - mu[row], 2);
      r[row] = 1.0 / std::sqrt(sq / kWidth + 1e-5);
      for (int k = 0; k < kWidth; ++k) {
        o.at(row, k) = static_cast<float>(h.at(row, k) * gamma[k]);
        u.at(row, k) = static_cast<float>((h.at(row, k) - mu[row]) * r[row] * gamma[k] + beta[k]);
      }
    }
    for (int out = 0; out < kOut; ++out)
      for (int k = 0; k < kWidth; ++k) c[out] += w.at(out, k) * gamma[k], b[out] += w.at(out, k) * beta[k];
    const Matrix z = linear(u, w);
    const double unfused = worst_row_error(linear(per_tensor_copy(u), w), z);
    const double coda_blocks = worst_row_error(linear(block_copy(o), w, r, mu, c, b), z);
    std::printf("  ||h|| / ||h - mu|| = %.0f: u per tensor %.4f  O in blocks %.4f\n", ratio, unfused, coda_blocks);
    if (ratio == 1.0) {
      EXPECT_LT(coda_blocks, 1.25 * unfused) << "centered rows: the two forms round alike";
    } else {
      EXPECT_GT(coda_blocks, 0.5 * ratio * unfused) << "the mean's share of O comes back as error in z";
    }
  }
}

}  // namespace
