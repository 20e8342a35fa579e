// What every step runner shares; see step_runner.hpp.
#include "step_runner.hpp"

#include "kernels/unfused/unfused.cuh"

namespace coda {

StepRunner::StepRunner(DeviceState& state, bool deterministic)
    : state_(state), config_(state.config()), layout_(state.layout()), stream_(state.stream()),
      deterministic_(deterministic) {}

void StepRunner::plan(ArenaPlan& plan) {
  const size_t N = max_rows();
  const std::string batch = "batch and loss";
  plan.reserve(&io.tokens, N, batch);
  plan.reserve(&io.targets, N, batch);
  plan.reserve(&io.token_buckets, 3 * N + 1, batch);
  plan.reserve(&io.logits, N * config_.padded_vocab(), "logits / dlogits");
  plan.reserve(&io.losses, N, batch);
  plan.reserve(&io.logits_lse, N, batch);
  plan_buffers(plan);
}

void StepRunner::embedding_backward_from(const bf16* d_residual, int B, int T) {
  unfused::embedding_backward(grad(layout_.wte), grad(layout_.wpe), d_residual, io.token_buckets,
                              io.num_token_buckets, B, T, config_.d_model, stream_);
}

}  // namespace coda
