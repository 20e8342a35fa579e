// The two OCP 8-bit float formats of the H200's tensor cores, named once for the kernels and the host
// reference (src/fp8.hpp): e4m3 (range 448, no infinity) and e5m2 (range 57344); and the scale rule of
// block scaling, which the host reference and the quantize kernels share.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define CODA_FP8_HD __host__ __device__ inline
#else
#define CODA_FP8_HD inline
#endif

namespace coda {

enum class Fp8Format { E4M3, E5M2 };

// The largest finite value of each format: 1.75 * 2^8 and 1.75 * 2^15.
constexpr float fp8_max_finite(Fp8Format format) { return format == Fp8Format::E4M3 ? 448.0f : 57344.0f; }

// A float's bits and back, on the host and the device alike (memcpy is a register move in device code).
CODA_FP8_HD uint32_t fp8_float_bits(float x) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  return bits;
}
CODA_FP8_HD float fp8_bits_float(uint32_t bits) {
  float x;
  memcpy(&x, &bits, sizeof x);
  return x;
}

// Block scaling: the block's scale is 2^k for the largest k with amax 2^k <= the format's largest value
// 1.75 2^L, read off amax's float bits (amax = 1.m 2^e: k = L - e, one less where 1.m > 1.75), clamped to
// [-126, 126]; k = 0 for an amax of 0, subnormal amax take 126, and a non-finite amax 0 (its block is
// reported, not used). Integer arithmetic, so host and device agree to the bit.
CODA_FP8_HD int fp8_block_scale_exponent(float amax, Fp8Format format) {
  const uint32_t bits = fp8_float_bits(amax);
  const int exponent_field = static_cast<int>((bits >> 23) & 0xFF), mantissa = static_cast<int>(bits & 0x7FFFFF);
  if ((bits & 0x7FFFFFFF) == 0 || exponent_field == 0xFF) return 0;
  if (exponent_field == 0) return 126;
  const int largest_exponent = format == Fp8Format::E4M3 ? 8 : 15;
  const int k = largest_exponent - (exponent_field - 127) - (mantissa > 0x600000 ? 1 : 0);
  return k < -126 ? -126 : (k > 126 ? 126 : k);
}
// 2^k as a float (k in [-126, 127]).
CODA_FP8_HD float fp8_power_of_two(int k) { return fp8_bits_float(static_cast<uint32_t>(k + 127) << 23); }

}  // namespace coda
