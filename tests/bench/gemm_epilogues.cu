// bench_gemm's program rows: the three-primitive programs, each primitive of the short-K one alone, and
// SwiGLU backward, each against the bare mainloop of its shape on every tile (gemm_bench.cuh).
#include "tests/bench/gemm_bench.cuh"

namespace coda::gemm_bench {

// The three-primitive programs (row scale + pairwise map + partial row reduction), each primitive of the short-K one alone (where the cost comes from),
// and SwiGLU backward (1 -> 2, reads the saved gate/up pairs: 3x the bare GEMM's output traffic).
void bench_epilogues() {
  using namespace coda::epi;
  const Shape gate_up{"llama", "gate_up", GemmLayout::Forward, 16384, 16384, 2048};
  const Shape qkv{"llama", "qkv", GemmLayout::Forward, 16384, 3072, 2048};
  const Shape fc{"gpt2", "mlp_up", GemmLayout::Forward, 32768, 3072, 768};
  const Shape down_dgrad{"llama", "down", GemmLayout::Dgrad, 16384, 8192, 2048};
  const Rope<64> rope{2048, 2560, 13.287712f};
  bench_epilogue<GemmLayout::Forward>("llama gate_up: rstd * acc, SwiGLU, sum sq", gate_up, [](EpilogueInputs in) {
    return make_program(RowBroadcast<Mul>(in.rstd), Pairwise<SwiGlu>(), RowReduce<SumSquares>(in.partials));
  });
  bench_epilogue<GemmLayout::Forward>("llama qkv: rstd * acc, RoPE, sum sq", qkv, [&](EpilogueInputs in) {
    return make_program(RowBroadcast<Mul>(in.rstd), Pairwise<Rope<64>>(rope), RowReduce<SumSquares>(in.partials));
  });
  bench_epilogue<GemmLayout::Forward>("gpt2 mlp_up: rstd * acc, SwiGLU, sum sq", fc, [](EpilogueInputs in) {
    return make_program(RowBroadcast<Mul>(in.rstd), Pairwise<SwiGlu>(), RowReduce<SumSquares>(in.partials));
  });
  bench_epilogue<GemmLayout::Forward>("  gpt2 mlp_up: aux store (bf16) only", fc, [](EpilogueInputs in) {
    return make_program(StoreAux<__nv_bfloat16>(in.aux, 3072));
  });
  bench_epilogue<GemmLayout::Forward>("  llama gate_up: rstd * acc, aux (g, u), SwiGLU", gate_up, [](EpilogueInputs in) {
    return make_program(RowBroadcast<Mul>(in.rstd), StoreAux<__nv_bfloat16>(in.aux, 16384), Pairwise<SwiGlu>());
  });
  bench_epilogue<GemmLayout::Forward>("  gpt2 mlp_up: rstd * acc only", fc,
                                      [](EpilogueInputs in) { return make_program(RowBroadcast<Mul>(in.rstd)); });
  bench_epilogue<GemmLayout::Forward>("  gpt2 mlp_up: SwiGLU only", fc,
                                      [](EpilogueInputs) { return make_program(Pairwise<SwiGlu>()); });
  bench_epilogue<GemmLayout::Forward>("  gpt2 mlp_up: sum sq only", fc, [](EpilogueInputs in) {
    return make_program(RowReduce<SumSquares>(in.partials));
  });
  bench_epilogue<GemmLayout::Forward>("  llama qkv: RoPE only", qkv,
                                      [&](EpilogueInputs) { return make_program(Pairwise<Rope<64>>(rope)); });
  bench_epilogue<GemmLayout::Dgrad>("llama down dgrad: SwiGLU bwd, <dz,z>, rstd", down_dgrad, [](EpilogueInputs in) {
    return make_program(SwiGluBackward<__nv_bfloat16>(in.gu, 2 * 8192, nullptr, 8192),
                        RowDot<Tile>(Tile{in.gu, 2 * 8192}, in.partials), RowBroadcast<Mul>(in.rstd));
  });
}

}  // namespace coda::gemm_bench
