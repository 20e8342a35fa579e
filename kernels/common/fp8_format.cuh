// The two OCP 8-bit float formats of the H200's tensor cores, named once for the kernels and the host
// reference (src/fp8.hpp): e4m3 (range 448, no infinity) and e5m2 (range 57344).
#pragma once

namespace coda {

enum class Fp8Format { E4M3, E5M2 };

// The largest finite value of each format: 1.75 * 2^8 and 1.75 * 2^15.
constexpr float fp8_max_finite(Fp8Format format) { return format == Fp8Format::E4M3 ? 448.0f : 57344.0f; }

}  // namespace coda
