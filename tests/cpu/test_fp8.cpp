// The host FP8 codecs against CUDA's own host conversions (cuda_fp8.h, satfinite) and against a brute-force
// nearest-code search, and delayed scaling: the scale follows the amax history, a non-finite amax is
// refused with the tensor and the step; block scaling: each block's power-of-two scale and copy.
#include <gtest/gtest.h>

#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "fp8.hpp"
#include "rng.hpp"

namespace {

using coda::Fp8Format;

constexpr Fp8Format kFormats[] = {Fp8Format::E4M3, Fp8Format::E5M2};

uint8_t cuda_encode(float x, Fp8Format format) {
  return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, format == Fp8Format::E4M3 ? __NV_E4M3 : __NV_E5M2);
}

float cuda_decode(uint8_t code, Fp8Format format) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(code, format == Fp8Format::E4M3 ? __NV_E4M3 : __NV_E5M2);
  return __half2float(__half(h));
}

// The nearest finite code of x's sign by search over all 256 (ties: the even code), for |x| <= largest.
uint8_t nearest_code(float x, Fp8Format format) {
  int best = -1;
  double best_distance = std::numeric_limits<double>::infinity();
  for (int code = 0; code < 256; ++code) {
    const float v = coda::fp8_decode(static_cast<uint8_t>(code), format);
    if (!std::isfinite(v) || std::signbit(v) != std::signbit(x)) continue;
    const double distance = std::fabs(static_cast<double>(v) - x);
    if (distance < best_distance || (distance == best_distance && code % 2 == 0)) best = code, best_distance = distance;
  }
  return static_cast<uint8_t>(best);
}

TEST(Fp8, EveryCodeDecodesAsCudaDoesAndEncodesBackToItself) {
  for (Fp8Format format : kFormats)
    for (int code = 0; code < 256; ++code) {
      const uint8_t c = static_cast<uint8_t>(code);
      const float ours = coda::fp8_decode(c, format), theirs = cuda_decode(c, format);
      if (std::isnan(theirs)) {
        EXPECT_TRUE(std::isnan(ours)) << coda::fp8_format_name(format) << " code " << code;
        continue;
      }
      EXPECT_EQ(ours, theirs) << coda::fp8_format_name(format) << " code " << code;
      if (std::isfinite(ours)) {
        EXPECT_EQ(coda::fp8_encode(ours, format), c) << coda::fp8_format_name(format) << " " << code;
      }
    }
  EXPECT_EQ(coda::fp8_largest(Fp8Format::E4M3), 448.0f);
  EXPECT_EQ(coda::fp8_largest(Fp8Format::E5M2), 57344.0f);
  for (Fp8Format format : kFormats)  // the largest code decodes to it, and the next finite value does not exist
    EXPECT_EQ(coda::fp8_decode(coda::fp8_encode(1e30f, format), format), coda::fp8_largest(format));
}

// Random magnitudes over every binade, the midpoints between neighbouring codes (ties), saturation and
// the specials: the same code as CUDA's satfinite conversion and as the nearest-code search.
TEST(Fp8, EncodeRoundsToNearestEvenAndSaturatesLikeCuda) {
  coda::Rng rng(5);
  for (Fp8Format format : kFormats) {
    std::vector<float> xs = {0.0f, -0.0f, INFINITY, -INFINITY, 1e-30f, -1e-30f, 1e30f, -1e30f};
    for (int code = 0; code < 255; ++code) {  // midpoints of neighbouring finite codes of one sign
      const float a = coda::fp8_decode(static_cast<uint8_t>(code), format);
      const float b = coda::fp8_decode(static_cast<uint8_t>(code + 1), format);
      if (std::isfinite(a) && std::isfinite(b) && std::signbit(a) == std::signbit(b)) xs.push_back((a + b) / 2);
    }
    for (int i = 0; i < 20000; ++i) {
      const float magnitude = std::ldexp(static_cast<float>(rng.uniform()) + 0.5f, static_cast<int>(rng.below(44)) - 24);
      xs.push_back(i % 2 ? magnitude : -magnitude);
    }
    for (float x : xs) {
      const uint8_t ours = coda::fp8_encode(x, format);
      EXPECT_EQ(ours, cuda_encode(x, format)) << coda::fp8_format_name(format) << " x = " << x;
      if (std::fabs(x) <= coda::fp8_largest(format)) {  // beyond: saturation, checked against CUDA above
        EXPECT_EQ(ours, nearest_code(x, format)) << coda::fp8_format_name(format) << " x = " << x;
      }
      const float rounded = coda::fp8_round(x, format), decoded = coda::fp8_decode(ours, format);
      EXPECT_EQ(rounded, decoded) << coda::fp8_format_name(format) << " fp8_round x = " << x;
      EXPECT_EQ(std::signbit(rounded), std::signbit(decoded)) << coda::fp8_format_name(format) << " x = " << x;
    }
    EXPECT_TRUE(std::isnan(coda::fp8_decode(coda::fp8_encode(std::nanf(""), format), format)));
    EXPECT_TRUE(std::isnan(coda::fp8_round(std::nanf(""), format)));
  }
}

TEST(Fp8, DelayedScaleFollowsTheAmaxHistoryAndRefusesOverflow) {
  coda::Fp8DelayedScale scale(Fp8Format::E4M3, 3, 1);
  EXPECT_EQ(scale.scale(), 1.0f);  // nothing seen yet
  const float amaxes[] = {2.0f, 8.0f, 1.0f, 0.5f, 0.25f};
  const float expected[] = {448.0f / 2 / 2, 448.0f / 8 / 2, 448.0f / 8 / 2, 448.0f / 8 / 2, 448.0f / 1 / 2};
  for (int step = 0; step < 5; ++step) {
    scale.record(amaxes[step], "layer 0 qkv input");
    scale.update(step);
    EXPECT_EQ(scale.scale(), expected[step]) << "step " << step;
    // This step's tensor, quantized with its own scale, stays inside the format.
    EXPECT_LE(amaxes[step] * scale.scale(), coda::fp8_largest(Fp8Format::E4M3));
  }
  // Several records of one step (gradient accumulation's micro-batches): the step's amax is their max.
  coda::Fp8DelayedScale accumulated(Fp8Format::E5M2, 2);
  for (float amax : {1.0f, 4.0f, 2.0f}) accumulated.record(amax, "dy");
  accumulated.update(0);
  EXPECT_EQ(accumulated.scale(), 57344.0f / 4.0f);
  accumulated.record(0.5f, "dy");  // a new step starts its slot afresh; the history still holds step 0
  accumulated.update(1);
  EXPECT_EQ(accumulated.scale(), 57344.0f / 4.0f);
  accumulated.record(0.5f, "dy");  // step 0 has left the two-step history
  accumulated.update(2);
  EXPECT_EQ(accumulated.scale(), 57344.0f / 0.5f);
  for (float bad : {INFINITY, std::nanf(""), -1.0f}) {
    try {
      scale.record(bad, "layer 3 mlp_down output gradient");
      ADD_FAILURE() << "amax " << bad << " was accepted";
    } catch (const std::runtime_error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("layer 3 mlp_down output gradient"), std::string::npos) << what;
    }
  }
  EXPECT_EQ(scale.scale(), expected[4]);  // a refused amax leaves the scale
  EXPECT_THROW(coda::Fp8DelayedScale(Fp8Format::E5M2, 0), std::invalid_argument);
  EXPECT_THROW(scale.update(-1), std::invalid_argument);
}

// A checkpoint keeps the history alone: a scale restored from it continues exactly as the original.
TEST(Fp8, DelayedScaleRestoredFromItsHistoryContinuesIdentically) {
  coda::Fp8DelayedScale original(Fp8Format::E5M2, 4, 2);
  coda::Rng rng(5);
  for (int step = 0; step < 6; ++step) {
    original.record(static_cast<float>(rng.uniform() * 3.0), "x");
    original.update(step);
  }
  coda::Fp8DelayedScale restored(Fp8Format::E5M2, 4, 2);
  restored.restore(original.history().data());
  EXPECT_EQ(restored.scale(), original.scale());
  for (int step = 6; step < 12; ++step) {
    const float amax = step == 8 ? 0.0f : static_cast<float>(rng.uniform() * 3.0);
    original.record(amax, "x");
    restored.record(amax, "x");
    original.update(step);
    restored.update(step);
    EXPECT_EQ(restored.scale(), original.scale()) << "step " << step;
  }
  EXPECT_EQ(restored.history(), original.history());
}

// The one order of the scaled tensors: roles, then layers, then linears; every index named once, the e4m3
// roles first. With the LM head in FP8 its three tensors are linear 0 of one more layer, and the three other
// slots of that layer are no tensor.
TEST(Fp8, TensorIndicesCoverEveryTensorOnce) {
  const int n_layer = 3;
  for (bool head : {false, true}) {
    const coda::Fp8Tensors tensors(n_layer, head);
    std::vector<int> seen(tensors.count(), 0);
    for (coda::Fp8Role role : {coda::Fp8Role::Input, coda::Fp8Role::Weight, coda::Fp8Role::OutputGrad}) {
      for (int layer = 0; layer < n_layer; ++layer)
        for (int linear = 0; linear < coda::kFp8Linears; ++linear) ++seen[tensors.index(role, layer, linear)];
      if (head) ++seen[tensors.index(role, 0, coda::kFp8Head)];
      const int first = tensors.index(role, 0, 0);
      EXPECT_EQ(tensors.format(first), coda::fp8_role_format(role)) << head;
      EXPECT_EQ(first < tensors.e4m3_count(), role != coda::Fp8Role::OutputGrad) << head;
    }
    int named = 0;
    for (int t = 0; t < tensors.count(); ++t) {
      EXPECT_LE(seen[t], 1) << t;
      if (seen[t] == 1) {
        ++named;
        EXPECT_NO_THROW(tensors.name(t)) << t;
      } else {
        EXPECT_THROW(tensors.name(t), std::out_of_range) << t;
      }
    }
    EXPECT_EQ(named, 3 * (coda::kFp8Linears * n_layer + (head ? 1 : 0)));
    EXPECT_EQ(tensors.name(tensors.index(coda::Fp8Role::OutputGrad, 2, 3)), "layer 2 mlp_down output gradient");
    EXPECT_EQ(tensors.name(tensors.index(coda::Fp8Role::Input, 1, 0)), "layer 1 qkv input");
    EXPECT_THROW(tensors.name(tensors.count()), std::out_of_range);
  }
  const coda::Fp8Tensors with_head(n_layer, true);
  EXPECT_EQ(with_head.name(with_head.index(coda::Fp8Role::Weight, 0, coda::kFp8Head)), "lm_head weight");
  EXPECT_EQ(with_head.name(with_head.index(coda::Fp8Role::OutputGrad, 0, coda::kFp8Head)), "lm_head output gradient");
  EXPECT_EQ(with_head.format(with_head.index(coda::Fp8Role::OutputGrad, 0, coda::kFp8Head)), Fp8Format::E5M2);
  EXPECT_EQ(coda::Fp8Tensors(n_layer, coda::Fp8Recipe{}).head, false) << "the LM head stays bf16 by default";
  EXPECT_EQ(coda::fp8_role_format(coda::Fp8Role::Weight), Fp8Format::E4M3);
  EXPECT_EQ(coda::fp8_role_format(coda::Fp8Role::OutputGrad), Fp8Format::E5M2);
}

// The block scale is the largest power of two that keeps the block's amax inside the format: exactly at the
// largest finite value it is 1, a hair above it 1/2, at half of it 2; amax 0 takes 1.
TEST(Fp8, BlockScaleIsTheLargestPowerOfTwoThatFits) {
  for (Fp8Format format : kFormats) {
    const float largest = coda::fp8_largest(format);
    EXPECT_EQ(coda::fp8_block_scale(largest, format), 1.0f);
    EXPECT_EQ(coda::fp8_block_scale(std::nextafter(largest, INFINITY), format), 0.5f);
    EXPECT_EQ(coda::fp8_block_scale(largest / 2, format), 2.0f);
    EXPECT_EQ(coda::fp8_block_scale(0.0f, format), 1.0f);
    coda::Rng rng(7);
    for (int i = 0; i < 1000; ++i) {
      const float amax = std::ldexp(static_cast<float>(0.5 + 0.5 * rng.uniform()), static_cast<int>(rng.below(80)) - 40);
      const float s = coda::fp8_block_scale(amax, format);
      int exponent = 0;
      EXPECT_EQ(std::frexp(s, &exponent), 0.5f) << "a power of two";
      EXPECT_LE(amax * s, largest) << amax;
      EXPECT_GT(amax * s * 2, largest) << amax;
    }
  }
}

// Each block of the copy is quantized with the scale of its own amax (tails partial): a block a thousand
// times smaller than its neighbour keeps e4m3's relative precision, where one scale for the whole tensor
// would flush it to zero. Rows and columns blocks alike; a non-finite value is refused.
TEST(Fp8, BlockCopyQuantizesEachBlockWithItsOwnScale) {
  const int rows = 5, cols = 200;
  std::vector<float> x(static_cast<size_t>(rows) * cols), copy(x.size());
  coda::Rng rng(3);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c)
      x[static_cast<size_t>(r) * cols + c] = static_cast<float>(rng.uniform() - 0.5) * (c < 128 ? 1e-3f : 1e3f);
  const auto expect_blocks = [&](int block_rows, int block_cols) {
    ASSERT_TRUE(coda::fp8_block_copy(copy.data(), x.data(), rows, cols, block_rows, block_cols, Fp8Format::E4M3));
    for (int r0 = 0; r0 < rows; r0 += block_rows)
      for (int c0 = 0; c0 < cols; c0 += block_cols) {
        float amax = 0.0f;
        for (int r = r0; r < std::min(rows, r0 + block_rows); ++r)
          for (int c = c0; c < std::min(cols, c0 + block_cols); ++c)
            amax = std::max(amax, std::fabs(x[static_cast<size_t>(r) * cols + c]));
        const float s = coda::fp8_block_scale(amax, Fp8Format::E4M3);
        for (int r = r0; r < std::min(rows, r0 + block_rows); ++r)
          for (int c = c0; c < std::min(cols, c0 + block_cols); ++c) {
            const size_t i = static_cast<size_t>(r) * cols + c;
            ASSERT_EQ(copy[i], coda::fp8_decode(coda::fp8_encode(x[i] * s, Fp8Format::E4M3), Fp8Format::E4M3) / s)
                << "block " << r0 << "," << c0 << " value " << r << "," << c;
            if (std::fabs(x[i]) > amax / 8) {
              EXPECT_NEAR(copy[i], x[i], std::fabs(x[i]) / 16) << r << "," << c;
            }
          }
      }
  };
  expect_blocks(1, coda::kFp8Block);  // 1 x 128: two blocks per row, the second of 72 columns
  expect_blocks(coda::kFp8Block, 1);  // 128 x 1: one partial block per column
  expect_blocks(coda::kFp8Block, coda::kFp8Block);
  // The small columns under one scale for the whole tensor: the amax of the large ones takes them below e4m3's
  // smallest subnormal.
  const float tensor_scale = coda::fp8_block_scale(500.0f, Fp8Format::E4M3);
  EXPECT_EQ(coda::fp8_round(x[3] * tensor_scale, Fp8Format::E4M3) / tensor_scale, 0.0f);
  ASSERT_TRUE(coda::fp8_block_copy(copy.data(), x.data(), rows, cols, 1, coda::kFp8Block, Fp8Format::E4M3));
  EXPECT_NE(copy[3], 0.0f);
  for (float bad : {INFINITY, std::nanf("")}) {
    x[7] = bad;
    EXPECT_FALSE(coda::fp8_block_copy(copy.data(), x.data(), rows, cols, 1, coda::kFp8Block, Fp8Format::E4M3));
  }
}

// fp8_scaling names the linears with block scales: none, all, or a list; the recipe's name says which.
TEST(Fp8, ScalingNamesTheBlockScaledLinears) {
  EXPECT_EQ(coda::parse_fp8_scaling("tensor"), 0u);
  EXPECT_EQ(coda::parse_fp8_scaling("block"), 0x1Fu) << "every linear FP8 covers, the LM head too";
  EXPECT_EQ(coda::parse_fp8_scaling("mlp_down"), 0x8u);
  EXPECT_EQ(coda::parse_fp8_scaling("mlp_down,qkv"), 0x9u);
  EXPECT_EQ(coda::parse_fp8_linears("qkv,lm_head"), 0x11u);
  EXPECT_EQ(coda::parse_fp8_scaling("lm_head"), 1u << coda::kFp8Head);
  try {
    coda::parse_fp8_scaling("row");
    ADD_FAILURE() << "an unknown scaling was accepted";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("fp8_scaling = \"row\""), std::string::npos) << what;
    EXPECT_NE(what.find("tensor or block"), std::string::npos) << what;
  }
  const coda::Fp8Recipe tensor{16, 0}, block{16, 0, 0xF, 0xF}, down{16, 0, 0xF, 0x8}, two{16, 0, 0xF, 0x9};
  EXPECT_EQ(tensor.name(), "fp8");
  EXPECT_EQ(block.name(), "fp8-block");
  EXPECT_EQ(down.name(), "fp8-block-mlp_down");
  EXPECT_EQ(two.name(), "fp8-block-qkv+mlp_down");
  EXPECT_TRUE(down.block(3));
  EXPECT_FALSE(down.block(2));
  EXPECT_TRUE(down.any_block() && down.any_tensor());
  EXPECT_FALSE(block.any_tensor());
  const coda::Fp8Recipe block_on_the_covered{16, 0, 0x8, 0xF};  // "block" over a subset: every FP8 linear
  EXPECT_EQ(block_on_the_covered.name(), "fp8-block");
  EXPECT_FALSE(block_on_the_covered.block(0)) << "a linear in bf16 has no scaling";
  const unsigned with_head = 0xFu | 1u << coda::kFp8Head;
  EXPECT_EQ((coda::Fp8Recipe{16, 0, with_head}.name()), "fp8-head");
  EXPECT_EQ((coda::Fp8Recipe{16, 0, with_head, 0x8}.name()), "fp8-block-mlp_down-head");
  EXPECT_EQ((coda::Fp8Recipe{16, 0, with_head, with_head}.name()), "fp8-block-head");
}

}  // namespace
