// cpfill/runtime/llama_model.h — whole-model prefill of a Llama-3 family model with tensor
// parallelism inside a node and context parallelism across nodes (CPU backend, fp32).
//
// Every rank holds its TP slice of the weights and its CP share of the tokens (the shard plan's
// local layout). Per layer: RMSNorm; q/k/v column-parallel; RoPE at the tokens' global
// positions; ring attention over the CP group (pass-KV or pass-Q, chosen by the selector per
// batch); o projection row-parallel and an all-reduce over the TP group; the SwiGLU MLP
// column/row-parallel and an all-reduce. The LM head runs only at each sequence's last position.
// A request may name a session: its KV cache (every layer's K and V, on the ranks the plans put
// them) persists, and the session's next turn is a partial prefill on top of it.
//
//   CPFILL_ASSIGN_OR_RETURN(auto model, LlamaModel::Create(config, std::move(weights), *grid.tp,
//                                                          *grid.cp, *grid.world, options));
//   CPFILL_ASSIGN_OR_RETURN(auto out, model->Prefill({{.tokens = ids, .session = "chat-1"}},
//                                                    &timings, nullptr));
//   out[0].first_token   // on world rank 0
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "base/thread_pool.h"
#include "parallel/communicator.h"
#include "parallel/ring_attention.h"
#include "parallel/selector.h"
#include "runtime/cpu/layers.h"
#include "runtime/model_config.h"
#include "runtime/prefill_batch.h"
#include "runtime/weights.h"
#include "sharding/plan.h"

namespace cpfill::runtime {

// A model that prefills batches: the CPU model here, the CUDA one in cuda/llama_model_cuda.h.
class PrefillModel {
 public:
  virtual ~PrefillModel() = default;
  virtual absl::StatusOr<std::vector<SequenceOutput>> Prefill(
      const std::vector<PrefillRequest>& batch, PrefillTimings* timings,
      const std::function<void(int)>& progress) = 0;
  virtual int64_t kv_tokens_held() const = 0;
};

class LlamaModel : public PrefillModel {
 public:
  // `tp`, `cp` and `world` are this rank's groups (SelfCommunicators for a single rank).
  static absl::StatusOr<std::unique_ptr<LlamaModel>> Create(
      const ModelConfig& config, ModelWeights weights, parallel::Communicator& tp,
      parallel::Communicator& cp, parallel::Communicator& world, PrefillOptions options);

  // Collective over the world. InvalidArgument for token ids outside the vocabulary or
  // malformed requests; ResourceExhausted (on every rank, before any work) when the batch does
  // not fit the KV capacity of some rank. `progress(layer)` runs after each layer.
  absl::StatusOr<std::vector<SequenceOutput>> Prefill(
      const std::vector<PrefillRequest>& batch, PrefillTimings* timings,
      const std::function<void(int)>& progress) override;

  // Token slots this rank's KV cache holds (all sessions), and its capacity.
  int64_t kv_tokens_held() const override;
  int64_t kv_capacity_tokens() const { return options_.kv_capacity_tokens; }
  const ModelConfig& config() const { return config_; }

 private:
  // One session's cache on this rank: where every rank holds its tokens, and this rank's rows
  // of every layer in that order (post-RoPE K, V: [rows, local KV heads, head_dim]).
  struct Session {
    SessionLayout where;                   // cached tokens and the ranks that hold them
    std::vector<std::vector<float>> k, v;  // [layer]: this rank's rows
  };

  LlamaModel(const ModelConfig& config, ModelWeights weights, parallel::Communicator& tp,
             parallel::Communicator& cp, parallel::Communicator& world, PrefillOptions options);

  absl::Status CheckCapacity(const sharding::ShardPlan& plan,
                             const std::vector<PrefillRequest>& batch);
  absl::StatusOr<std::vector<SequenceOutput>> GatherLogits(const sharding::ShardPlan& plan,
                                                           const sharding::LocalLayout& layout,
                                                           const std::vector<float>& x,
                                                           PrefillTimings* t);

  ModelConfig config_;
  ModelWeights weights_;
  parallel::Communicator& tp_;
  parallel::Communicator& cp_;
  parallel::Communicator& world_;
  PrefillOptions options_;
  ThreadPool pool_;
  parallel::CpuAttentionKernels kernels_;
  cpu::RopeTable rope_;
  std::map<std::string, Session> sessions_;
};

}  // namespace cpfill::runtime
