// bench_gemm --overlap: whether an epilogue's work hides under the other consumer's MMAs on the ping-pong
// tiles (gemm_bench.cuh).
#include <cuda_fp16.h>

#include "tests/bench/gemm_bench.cuh"

namespace coda::gemm_bench {

// Arithmetic alone: kSteps dependent instructions per value of one kind, no memory access (the compiler
// may not fold any of the chains): fp32 multiply-adds (FFMA), integer multiply-adds on the value's bits
// (IMAD), packed half-precision multiply-adds (HFMA2), tanh (MUFU). What the overlap rows below compare.
enum class Pipe { Fp32, Int, Half2, Sfu };
template <Pipe kPipe, int kSteps>
struct AluWork {
  CODA_HD float operator()(float x) const {
#if defined(__CUDA_ARCH__)
    if constexpr (kPipe == Pipe::Fp32) {
      for (int i = 0; i < kSteps; ++i) x = fmaf(x, 0.999f, 0.0001f);
    } else if constexpr (kPipe == Pipe::Int) {
      int v = __float_as_int(x);
      for (int i = 0; i < kSteps; ++i) v = v * v + 1;
      x += __int_as_float(v & 0x00800000);
    } else if constexpr (kPipe == Pipe::Half2) {
      __half2 h = __floats2half2_rn(x, 0.5f * x);
      const __half2 a = __floats2half2_rn(0.999f, 0.999f), b = __floats2half2_rn(0.0001f, 0.0001f);
      for (int i = 0; i < kSteps; ++i) h = __hfma2(h, a, b);
      x = __low2float(h) + __high2float(h);
    } else {
      for (int i = 0; i < kSteps; ++i) asm("tanh.approx.f32 %0, %0;" : "+f"(x));
    }
#endif
    return x;
  }
};

// One elementwise arithmetic program (Work per value) against the bare GEMM.
template <class Work>
void bench_arithmetic(const char* label, const Shape& s) {
  bench_epilogue<GemmLayout::Forward>(label, s,
                                      [](EpilogueInputs) { return epi::make_program(epi::Elementwise<Work>()); });
}

// Does an epilogue hide under the other consumer's MMAs on the ping-pong tiles? The same kinds of work
// alone (arithmetic only; column-vector loads from L1; a tile input from shared memory; the online
// log-sum-exp; the LayerNorm reparameterization) at gpt2's fc shape (K = 768: 12 k-blocks, the
// shortest mainloop of the programs), on every tile against its bare GEMM. On the ping-pong tiles fp32
// instructions (FFMA, FMUL, FADD) slow the other consumer's MMAs by about their issue cycles, integer and
// half2 ones do not (a clock64 timeline of the kernel, docs/LOG.md) but run at half rate, so their rows
// cost about as much in time; tanh hides.
void bench_overlap() {
  using namespace coda::epi;
  const Shape fc{"gpt2", "mlp_up", GemmLayout::Forward, 32768, 3072, 768};
  bench_arithmetic<AluWork<Pipe::Fp32, 16>>("overlap: 16 FMAs per value", fc);
  bench_arithmetic<AluWork<Pipe::Fp32, 48>>("overlap: 48 FMAs per value", fc);
  bench_arithmetic<AluWork<Pipe::Fp32, 8>>("overlap: 8 FMAs per value", fc);
  bench_arithmetic<AluWork<Pipe::Int, 8>>("overlap: 8 integer multiply-adds per value", fc);
  bench_arithmetic<AluWork<Pipe::Half2, 8>>("overlap: 8 half2 FMAs per value", fc);
  bench_arithmetic<AluWork<Pipe::Sfu, 2>>("overlap: 2 tanh per value", fc);
  bench_epilogue<GemmLayout::Forward>("overlap: two fp32 column vectors", fc, [](EpilogueInputs in) {
    return make_program(ColBroadcast<Add>(in.rstd), ColBroadcast<Mul>(in.rstd + 8));
  });
  bench_epilogue<GemmLayout::Forward>("overlap: one tile input", fc, [](EpilogueInputs in) {
    return make_program(TileLoad<Add>(in.gu, 3072));
  });
  bench_epilogue<GemmLayout::Forward>("overlap: log-sum-exp partials", fc, [](EpilogueInputs in) {
    return make_program(RowReduce<LogSumExp>(reinterpret_cast<LogSumExp::Out*>(in.partials)));
  });
  bench_epilogue<GemmLayout::Forward>("overlap: LayerNorm reparameterization", fc, [](EpilogueInputs in) {
    return make_program(RowBroadcast<Mul>(in.rstd), SubScaled<ColVector>(in.rstd, ColVector{in.rstd + 8}),
                        ColBroadcast<Add>(in.rstd + 16));
  });
}

}  // namespace coda::gemm_bench
