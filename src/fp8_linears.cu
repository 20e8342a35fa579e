// The FP8 block linears of the unfused mode; see fp8_linears.hpp.
#include "fp8_linears.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/common/cuda_check.cuh"
#include "kernels/unfused/unfused.cuh"

namespace coda {

namespace {

// (IC, OC) of linear 0 qkv, 1 attention output, 2 MLP up, 3 MLP down, kFp8Head the LM head.
std::pair<int, int> linear_shape(const ModelConfig& c, int linear) {
  switch (linear) {
    case 0: return {c.d_model, c.qkv_dim()};
    case 1: return {c.d_model, c.d_model};
    case 2: return {c.d_model, c.mlp_up_rows()};
    case 3: return {c.d_ff, c.d_model};
    default: return {c.d_model, c.padded_vocab()};
  }
}

}  // namespace

Fp8Linears::Fp8Linears(DeviceState& state, CublasLt& cublas, const Fp8Recipe& recipe)
    : state_(state), cublas_(cublas), recipe_(recipe), tensors_(state.config().n_layer, recipe), count_(tensors_.count()) {
  for (int linear = 0; linear <= kFp8Head; ++linear) {
    const int multiple = recipe.block(linear) ? kFp8Block : 16;
    const auto [IC, OC] = linear_shape(state.config(), linear);
    if (covers(linear) && (IC % multiple != 0 || OC % multiple != 0))
      throw std::invalid_argument("precision = fp8: the FP8 GEMMs" +
                                  std::string(recipe.block(linear) ? " with block scales" : "") +
                                  " need the widths of each linear in FP8 to be multiples of " +
                                  std::to_string(multiple) + "; " + fp8_linear_name(linear) + " is " +
                                  std::to_string(OC) + " x " + std::to_string(IC));
  }
  CUDA_CHECK(cudaMallocHost(&host_bad_, 2 * sizeof(unsigned int)));
}

void Fp8Linears::plan(ArenaPlan& plan) {
  const ModelConfig& c = state_.config();
  const size_t N = static_cast<size_t>(state_.max_batch()) * state_.max_seq_len();
  const std::string scaling = "fp8 scaling", weights = "fp8 weight copies", saved = "activations saved for backward",
                    scratch = "scratch";
  if (recipe_.any_tensor()) {
    plan.reserve(&scales_, count_, scaling);
    plan.reserve(&dequants_, static_cast<size_t>(count_) * unfused::kFp8DequantSlot, scaling);
    plan.reserve(&history_, static_cast<size_t>(count_) * recipe_.history, scaling);
    plan.reserve(&amax_, count_, scaling);
    plan.reserve(&eval_amax_, count_, scaling);
  }
  plan.reserve(&bad_, 1, scaling);
  if (recipe_.any_block()) plan.reserve(&block_bad_, 1, scaling);
  linears_.assign(kFp8Linears * tensors_.layers(), Linear{});
  size_t max_ic = 0, max_oc = 0;
  const auto reserve = [&](int layer, int linear) {
    if (!covers(linear)) return;
    const auto [IC, OC] = linear_shape(c, linear);
    Linear& l = linears_[tensors_.slot(layer, linear)];
    plan.reserve(&l.wq, static_cast<size_t>(OC) * IC, weights);
    plan.reserve(&l.wqT, static_cast<size_t>(OC) * IC, weights);
    plan.reserve(&l.xqT, N * IC, saved);
    if (recipe_.block(linear)) {
      plan.reserve(&l.wq_dequant, static_cast<size_t>(OC / kFp8Block) * unfused::fp8_tile_factor_row(IC / kFp8Block),
                   weights);
      plan.reserve(&l.wqT_dequant, static_cast<size_t>(IC / kFp8Block) * unfused::fp8_tile_factor_row(OC / kFp8Block),
                   weights);
      plan.reserve(&l.xqT_dequant, N / kFp8Block * IC, saved);
    }
    max_ic = std::max<size_t>(max_ic, IC);
    max_oc = std::max<size_t>(max_oc, OC);
  };
  for (int layer = 0; layer < c.n_layer; ++layer)
    for (int linear = 0; linear < kFp8Linears; ++linear) reserve(layer, linear);
  reserve(0, kFp8Head);
  plan.reserve(&xq_, N * max_ic, scratch);
  plan.reserve(&dyq_, N * max_oc, scratch);
  plan.reserve(&dyqT_, N * max_oc, scratch);
  if (recipe_.any_block()) {
    plan.reserve(&xq_dequant_, N * (max_ic / kFp8Block), scratch);
    plan.reserve(&dyq_dequant_, N * (max_oc / kFp8Block), scratch);
    plan.reserve(&dyqT_dequant_, N / kFp8Block * max_oc, scratch);
  }
}

void Fp8Linears::upload_initial_scales() {
  const cudaStream_t stream = state_.stream();
  CUDA_CHECK(cudaMemsetAsync(bad_, 0, sizeof(unsigned int), stream));
  // The block-scaled linears have nothing to calibrate: every block's scale comes from its own values.
  if (recipe_.any_block()) CUDA_CHECK(cudaMemsetAsync(block_bad_, 0, sizeof(unsigned int), stream));
  if (recipe_.any_tensor()) {
    const std::vector<float> ones(static_cast<size_t>(count_) * unfused::kFp8DequantSlot, 1.0f);
    CUDA_CHECK(cudaMemcpyAsync(scales_, ones.data(), count_ * sizeof(float), cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaMemcpyAsync(dequants_, ones.data(), ones.size() * sizeof(float), cudaMemcpyHostToDevice, stream));
  }
  state_.wait_stream();
  calibrated_ = false;
}

Fp8Linears::~Fp8Linears() { cudaFreeHost(host_bad_); }

void Fp8Linears::forward(bf16* y, const bf16* x, int layer, int linear, size_t w, int N, int IC, int OC,
                         bool training) {
  if (recipe_.block(linear)) return forward_blocks(y, x, layer, linear, w, N, IC, OC, training);
  const cudaStream_t stream = state_.stream();
  Linear& l = linears_[tensors_.slot(layer, linear)];
  const int tx = tensor(Fp8Role::Input, layer, linear), tw = tensor(Fp8Role::Weight, layer, linear);
  if (training && N % 16 != 0)
    throw std::invalid_argument("precision = fp8: a training micro-batch needs B*T a multiple of 16, got " +
                                std::to_string(N));
  unfused::quantize_fp8_transposed(l.wqT, l.wq, amax(tw, training), state_.weight(w), OC, IC, scale(tw),
                                   Fp8Format::E4M3, stream);
  if (training)
    unfused::quantize_fp8_transposed(l.xqT, xq_, amax(tx, true), x, N, IC, scale(tx), Fp8Format::E4M3, stream);
  else
    unfused::quantize_fp8(xq_, amax(tx, false), x, static_cast<size_t>(N) * IC, scale(tx), Fp8Format::E4M3, stream);
  if (calibrated_)
    cublas_.gemm_fp8(y, xq_, Fp8Format::E4M3, dequant(tx), l.wq, Fp8Format::E4M3, dequant(tw), N, OC, IC, false,
                     stream);
  else
    cublas_.gemm(y, x, Op::N, state_.weight(w), Op::T, N, OC, IC, false, stream);
}

void Fp8Linears::backward(bf16* dx, const bf16* dy, const bf16* x, int layer, int linear, size_t w, int N, int IC,
                          int OC) {
  if (recipe_.block(linear)) return backward_blocks(dx, dy, layer, linear, w, N, IC, OC);
  const cudaStream_t stream = state_.stream();
  const Linear& l = linears_[tensors_.slot(layer, linear)];
  const int tx = tensor(Fp8Role::Input, layer, linear), tw = tensor(Fp8Role::Weight, layer, linear),
            tdy = tensor(Fp8Role::OutputGrad, layer, linear);
  unfused::quantize_fp8_transposed(dyqT_, dyq_, amax(tdy, true), dy, N, OC, scale(tdy), Fp8Format::E5M2, stream);
  if (!calibrated_) {
    cublas_.gemm(dx, dy, Op::N, state_.weight(w), Op::N, N, IC, OC, false, stream);
    cublas_.gemm(state_.grad(w), dy, Op::T, x, Op::N, OC, IC, N, true, stream);
    return;
  }
  cublas_.gemm_fp8(dx, dyq_, Fp8Format::E5M2, dequant(tdy), l.wqT, Fp8Format::E4M3, dequant(tw), N, IC, OC, false,
                   stream);
  cublas_.gemm_fp8(state_.grad(w), dyqT_, Fp8Format::E5M2, dequant(tdy), l.xqT, Fp8Format::E4M3, dequant(tx), OC, IC,
                   N, true, stream);
}

namespace {

// The flag value of tensor t under block scaling: the bits of the float t + 1 (an atomic max on the bits of
// positive floats is the max of the values, and a float flag is what all_reduce_max takes).
unsigned int block_flag(int t) { return fp8_float_bits(static_cast<float>(t + 1)); }

}  // namespace

void Fp8Linears::forward_blocks(bf16* y, const bf16* x, int layer, int linear, size_t w, int N, int IC, int OC,
                                bool training) {
  const cudaStream_t stream = state_.stream();
  Linear& l = linears_[tensors_.slot(layer, linear)];
  if (N % kFp8Block != 0) {
    if (training)
      throw std::invalid_argument("precision = fp8 with block scales (fp8_scaling): a training micro-batch needs "
                                  "B*T a multiple of 128, got " + std::to_string(N));
    cublas_.gemm(y, x, Op::N, state_.weight(w), Op::T, N, OC, IC, false, stream);  // an evaluation of a few tokens
    return;
  }
  const int tx = tensor(Fp8Role::Input, layer, linear), tw = tensor(Fp8Role::Weight, layer, linear);
  unfused::quantize_fp8_blocks({l.wq, l.wq_dequant, training ? l.wqT : nullptr, l.wqT_dequant, block_bad_,
                                block_flag(tw)},
                               state_.weight(w), OC, IC, true, stream);
  unfused::quantize_fp8_blocks({xq_, xq_dequant_, training ? l.xqT : nullptr, l.xqT_dequant, block_bad_, block_flag(tx)},
                               x, N, IC, false, stream);
  cublas_.gemm_fp8(y, xq_, Fp8Format::E4M3, xq_dequant_, l.wq, Fp8Format::E4M3, l.wq_dequant, N, OC, IC, false, stream,
                   Fp8Scales::Rows128, Fp8Scales::Tiles128);
}

void Fp8Linears::backward_blocks(bf16* dx, const bf16* dy, int layer, int linear, size_t w, int N, int IC, int OC) {
  const cudaStream_t stream = state_.stream();
  const Linear& l = linears_[tensors_.slot(layer, linear)];
  const int tdy = tensor(Fp8Role::OutputGrad, layer, linear);
  unfused::quantize_fp8_blocks({dyq_, dyq_dequant_, dyqT_, dyqT_dequant_, block_bad_, block_flag(tdy)}, dy, N, OC,
                               false, stream);
  cublas_.gemm_fp8(dx, dyq_, Fp8Format::E4M3, dyq_dequant_, l.wqT, Fp8Format::E4M3, l.wqT_dequant, N, IC, OC, false,
                   stream, Fp8Scales::Rows128, Fp8Scales::Tiles128);
  cublas_.gemm_fp8(state_.grad(w), dyqT_, Fp8Format::E4M3, dyqT_dequant_, l.xqT, Fp8Format::E4M3, l.xqT_dequant, OC,
                   IC, N, true, stream, Fp8Scales::Rows128, Fp8Scales::Rows128);
}

void Fp8Linears::close_step(int step, Communicator* comm) {
  const cudaStream_t stream = state_.stream();
  // Both flags come back with one host sync: the block-scaled tensors' and the scale update's.
  if (recipe_.any_block()) {
    if (comm != nullptr) state_.all_reduce_max(*comm, reinterpret_cast<float*>(block_bad_), 1);
    CUDA_CHECK(cudaMemcpyAsync(&host_bad_[1], block_bad_, sizeof(unsigned int), cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaMemsetAsync(block_bad_, 0, sizeof(unsigned int), stream));
  }
  if (recipe_.any_tensor()) {
    if (comm != nullptr) state_.all_reduce_max(*comm, amax_, count_);
    CUDA_CHECK(cudaMemsetAsync(bad_, 0, sizeof(unsigned int), stream));
    unfused::fp8_update_scales(scales_, dequants_, history_, amax_, count_, tensors_.e4m3_count(), recipe_.history,
                               step, recipe_.margin, bad_, stream);
    CUDA_CHECK(cudaMemcpyAsync(&host_bad_[0], bad_, sizeof(unsigned int), cudaMemcpyDeviceToHost, stream));
  }
  state_.wait_stream();
  const std::string in_step = " in step " + std::to_string(step + 1) +
                              " (an overflow or NaN upstream); the step is not applied";
  if (recipe_.any_block() && host_bad_[1] != 0)
    throw std::runtime_error("fp8 block scaling: " +
                             tensors_.name(static_cast<int>(fp8_bits_float(host_bad_[1])) - 1) +
                             " held a value that is not finite" + in_step);
  if (!recipe_.any_tensor()) return;
  calibrated_ = true;
  if (host_bad_[0] != 0)
    throw std::runtime_error("fp8: " + tensors_.name(static_cast<int>(host_bad_[0]) - 1) +
                             " had a non-finite amax" + in_step);
}

Fp8ScalingState Fp8Linears::read_state() {
  Fp8ScalingState state;
  if (!calibrated_ || !recipe_.any_tensor()) return state;
  state.history = recipe_.history;
  state.amax.resize(static_cast<size_t>(count_) * recipe_.history);
  CUDA_CHECK(cudaMemcpyAsync(state.amax.data(), history_, state.amax.size() * sizeof(float), cudaMemcpyDeviceToHost,
                             state_.stream()));
  state_.wait_stream();
  return state;
}

void Fp8Linears::load_state(const Fp8ScalingState& loaded) {
  if (!recipe_.any_tensor()) {
    if (!loaded.empty())
      throw std::invalid_argument("fp8 scaling state of delayed scaling given to a run with fp8_scaling = block");
    return;
  }
  check_fp8_state(loaded, recipe_.history, tensors_);
  if (loaded.empty()) return;
  // The scales follow from the history as the host's Fp8DelayedScale::restore computes them.
  std::vector<float> scales(count_), dequants(static_cast<size_t>(count_) * unfused::kFp8DequantSlot);
  for (int t = 0; t < count_; ++t) {
    Fp8DelayedScale scale(tensors_.format(t), recipe_.history, recipe_.margin);
    scale.restore(loaded.amax.data() + static_cast<size_t>(t) * recipe_.history);
    scales[t] = scale.scale();
    dequants[t * unfused::kFp8DequantSlot] = 1.0f / scales[t];
  }
  const cudaStream_t stream = state_.stream();
  CUDA_CHECK(cudaMemcpyAsync(history_, loaded.amax.data(), loaded.amax.size() * sizeof(float), cudaMemcpyHostToDevice,
                             stream));
  CUDA_CHECK(cudaMemcpyAsync(scales_, scales.data(), count_ * sizeof(float), cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaMemcpyAsync(dequants_, dequants.data(), dequants.size() * sizeof(float), cudaMemcpyHostToDevice,
                             stream));
  CUDA_CHECK(cudaMemsetAsync(amax_, 0, count_ * sizeof(float), stream));
  state_.wait_stream();
  calibrated_ = true;
}

}  // namespace coda
