// cpfill/runtime/model/llama_model.h — whole-model prefill of a Llama-3 family model with tensor
// parallelism inside a node and context parallelism across nodes, written once over a
// ModelBackend (cpu/cpu_backend.h: fp32; cuda/cuda_backend.h: bf16 on GPUs).
//
// Every rank holds its TP slice of the weights and its CP share of the tokens (the shard plan's
// local layout). Per layer: RMSNorm; q/k/v column-parallel; RoPE at the tokens' global
// positions; the new K/V rows into the KvCache, the sequence's whole K/V read back for ring
// attention over the CP group (pass-KV or pass-Q, chosen by the selector per sequence; a decode
// step's pass-Q reads the K/V in place from the cache's blocks instead); o
// projection row-parallel and an all-reduce over the TP group; the SwiGLU MLP column/row-parallel
// and an all-reduce. The LM head runs only at each sequence's last position, and at every position
// of a request that asks for prompt logprobs (prompt_logprobs.h).
//
// KV lives in one KvCache per rank, allocated at Create from a capacity in tokens or a fraction
// of free memory, never per request. Every sequence of a batch holds blocks while it is
// prefilled; a request that names a session keeps them, and its next turn is a partial prefill
// on top.
//
//   CPFILL_ASSIGN_OR_RETURN(auto backend, cpu::MakeCpuBackend(config, std::move(w), tp, cp, 8));
//   CPFILL_ASSIGN_OR_RETURN(auto model,
//                           LlamaModel::Create(config, std::move(backend), world, options));
//   CPFILL_ASSIGN_OR_RETURN(auto out, model->Prefill({{.tokens = ids, .session = "chat-1"}},
//                                                    &timings, nullptr));
//   out[0].first_token   // on world rank 0
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"
#include "runtime/kv/kv_cache.h"
#include "runtime/model/model_backend.h"
#include "runtime/model/model_config.h"
#include "runtime/model/prefill_batch.h"

namespace cpfill::runtime {

class LlamaModel {
 public:
  // `world` agrees on capacity and collects logits (MPI on every backend).
  static absl::StatusOr<std::unique_ptr<LlamaModel>> Create(const ModelConfig& config,
                                                            std::unique_ptr<ModelBackend> backend,
                                                            parallel::Communicator& world,
                                                            const StepOptions& options);

  // Collective over the world. InvalidArgument for token ids outside the vocabulary or
  // malformed requests; ResourceExhausted (on every rank, before any work) when the batch does
  // not fit the KV cache of some rank. On any error the KV cache and the sessions are as they
  // were. `progress(layer)` runs once each layer is issued (on a GPU, enqueued: the device may
  // still be running it; the call returns after all of them have run).
  absl::StatusOr<std::vector<SequenceOutput>> Prefill(const std::vector<PrefillRequest>& batch,
                                                      StepTimings* timings,
                                                      const std::function<void(int)>& progress);

  // One decode step, collective: every request is one token that continues an existing session
  // (NotFound for an unknown one) and the batch is planned by sharding::PlanDecode: request i's
  // token, its KV row and its layer work go to CP rank (i + step) mod N, so every rank's KV grows
  // at the same rate. Attention is batched ring pass-Q (paper Alg. 4: the batch's queries travel,
  // the KV stays). Same results, errors and rollback as Prefill.
  absl::StatusOr<std::vector<SequenceOutput>> Decode(const std::vector<PrefillRequest>& batch,
                                                     int64_t step, StepTimings* timings);

  // Forgets a session and frees its KV blocks (collective only in that every rank should call
  // it). NotFound for an unknown name.
  absl::Status EndSession(const std::string& name);

  // A new session `child` whose first `prefix_tokens` tokens are `parent`'s, sharing their KV
  // blocks on every rank (KvCache::Fork: a partly filled last block is copied); the next turn of
  // either prefills only its own tokens. The prefix keeps the placement it had over the CP ring,
  // and each later turn is sharded in 2N chunks of its own, so both stay balanced (the groundwork
  // of shared prefixes). Collective: every rank agrees before anything changes.
  // NotFound for an unknown parent; InvalidArgument for a child that exists or a prefix outside
  // [1, parent's tokens]; ResourceExhausted (every rank, nothing changed) when some rank has no
  // block for the copy.
  absl::Status ForkSession(const std::string& parent, const std::string& child,
                           int64_t prefix_tokens);

  // Token rows this rank's KV cache holds for sessions, and the cache's figures.
  int64_t kv_tokens_held() const;
  KvUsage kv_usage() const { return kv_->usage(); }
  // The rank's KV cache, read-only: its pool (BlockAddress(0, 0, 0), KvPoolLayout::OfKvCache)
  // is what a KV hand-off exposes; a session's rows are those of its sequence (nullopt for an
  // unknown session), in the order of its SessionLayout's runs for this CP rank.
  const KvCache& kv_cache() const { return *kv_; }
  // Checks read a session's rows through it (KvCache::Read keeps scratch); nothing else may change
  // the cache behind the model's back.
  KvCache& kv_cache_for_reading() { return *kv_; }
  std::optional<KvCache::SeqId> SessionSequence(const std::string& name) const;
  // A session's rows on this rank, as a KV hand-off describes them (runtime/handoff/kv_export.h):
  // its sequence, the global positions its rows hold in row order (this CP rank's runs) and the
  // session's tokens over every rank; nullopt for an unknown session.
  struct SessionKvRows {
    KvCache::SeqId seq = 0;
    std::vector<sharding::PositionRun> runs_in_row_order;
    int64_t tokens = 0;
  };
  std::optional<SessionKvRows> SessionRows(const std::string& name) const;
  const ModelConfig& config() const { return config_; }
  ModelBackend& backend() { return *backend_; }
  parallel::Communicator& world() { return world_; }

 private:
  // One conversation: its KV in the cache, where its tokens live across the CP ranks, and the
  // tokens themselves (the next turn's positions start at tokens.size()).
  struct Session {
    KvCache::SeqId seq = 0;
    SessionLayout where;
    std::vector<int32_t> tokens;
  };
  // A batch being prefilled: its plan and the KV sequence each request writes.
  struct Running;

  LlamaModel(const ModelConfig& config, std::unique_ptr<ModelBackend> backend,
             parallel::Communicator& world, const StepOptions& options,
             std::unique_ptr<KvCache> kv);

  struct Activation {
    Tensor* tensor;
    int slot;
    ElemType type;
    int64_t rows, cols;
  };
  std::vector<Activation> Activations(Running& r) const;
  absl::StatusOr<std::vector<SequenceOutput>> Step(const std::vector<PrefillRequest>& batch,
                                                   std::optional<int64_t> decode_step,
                                                   StepTimings* timings,
                                                   const std::function<void(int)>& progress);
  void OrderBySharedHistory(const std::vector<PrefillRequest>& batch,
                            const std::vector<parallel::RingAlgorithm>& algorithms,
                            std::vector<int>* order) const;
  bool PrefillReadsKvInPlace(const Running& r) const;
  absl::Status CheckActivationMemory(Running& r);
  absl::Status ReserveKv(Running& r);
  void RollBackKv(const Running& r);
  absl::Status BuildBlockTables(Running& r);
  absl::Status CheckGatheredMemory(Running& r);
  int64_t GatheredRows(const Running& r) const;
  absl::Status UploadBlockTables(Running& r);
  attention::PagedKv HostPagedKv(const Running& r) const;
  attention::AttentionShape AttentionShapeOf() const;
  absl::Status Forward(Running& r, StepTimings& t, const std::function<void(int)>& progress);
  absl::Status EnqueueLayers(Running& r, StepTimings& t, const std::function<void(int)>& progress);
  absl::Status Layer(int layer, Running& r, StepTimings& t);
  absl::Status AttentionRing(int layer, Running& r);
  absl::Status SparqDecode(int layer, Running& r);
  absl::Status SparqGroup(int layer, Running& r, const attention::sparq::SparqConfig& config,
                          const std::vector<int>& seqs);
  absl::StatusOr<std::vector<SequenceOutput>> LastLogits(const std::vector<PrefillRequest>& batch,
                                                         const Running& r, StepTimings& t);
  absl::Status PromptLogprobs(const std::vector<PrefillRequest>& batch, const Running& r,
                              StepTimings& t, std::vector<SequenceOutput>* out);
  absl::StatusOr<std::vector<std::pair<int, int64_t>>> DrawInPlace(
      const std::vector<PrefillRequest>& batch, const std::vector<std::pair<int, int64_t>>& rows,
      const Tensor& logits);
  void Commit(const std::vector<PrefillRequest>& batch, const Running& r);

  ModelConfig config_;
  std::unique_ptr<ModelBackend> backend_;
  parallel::Communicator& world_;
  StepOptions options_;
  std::unique_ptr<KvCache> kv_;
  std::map<std::string, Session> sessions_;
  std::vector<float> logits_host_;  // LastLogits' download, kept between steps
  KvCache::SeqId next_seq_ = 1;
  uint64_t table_generations_ = 0;  // the last Running::table_generation given
};

// The KV cache's shape for `config` on this rank, its capacity from `options`: tokens when
// given, else a fraction of `free_bytes`.
absl::StatusOr<KvCacheSpec> KvSpecFor(const ModelConfig& config, int tp_size, KvDtype dtype,
                                      const StepOptions& options, int64_t free_bytes);

}  // namespace cpfill::runtime
