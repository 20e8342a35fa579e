// CODA epilogue primitives: the vocabulary in which every non-attention operation of the trainer is
// written, as a short program that runs on a GEMM output tile while it is still in registers. The parts:
//   fragment.cuh    the fragment a primitive visits, the row context, the lanes, vector loads and stores
//   functions.cuh   fast math, the binary operators, activations and pairwise maps (SwiGLU, RoPE)
//   operands.cuh    row values, column vectors and tile inputs a primitive reads
//   primitives.cuh  the primitives that transform values
//   reductions.cuh  per-tile partial reductions and dots
//   program.cuh     Program<P...> and its host evaluation
// Details: docs/GEMM.md, "Epilogue primitives" and "Tile inputs through TMA".

#pragma once
#include "kernels/epilogue/fragment.cuh"
#include "kernels/epilogue/functions.cuh"
#include "kernels/epilogue/operands.cuh"
#include "kernels/epilogue/primitives.cuh"
#include "kernels/epilogue/program.cuh"
#include "kernels/epilogue/reductions.cuh"
