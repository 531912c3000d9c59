#include "runtime/llama_model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace cpfill::runtime {
namespace {

using Clock = std::chrono::steady_clock;
using parallel::DataType;
using parallel::ReduceOp;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Adds `s` seconds since `t0` to `acc` and restarts the clock.
void Lap(Clock::time_point& t0, double& acc) {
  const auto now = Clock::now();
  acc += std::chrono::duration<double>(now - t0).count();
  t0 = now;
}

void AddInPlace(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

}  // namespace

LlamaModel::LlamaModel(const ModelConfig& config, ModelWeights weights, parallel::Communicator& tp,
                       parallel::Communicator& cp, parallel::Communicator& world,
                       PrefillOptions options)
    : config_(config),
      weights_(std::move(weights)),
      tp_(tp),
      cp_(cp),
      world_(world),
      options_(options),
      pool_(options.threads),
      kernels_(&pool_),
      rope_(cpu::RopeTable::Make(config)) {
  cpu::SetBlasThreads(pool_.num_threads());
}

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Create(
    const ModelConfig& config, ModelWeights weights, parallel::Communicator& tp,
    parallel::Communicator& cp, parallel::Communicator& world, PrefillOptions options) {
  CPFILL_RETURN_IF_ERROR(config.ValidateForTp(tp.size()));
  CPFILL_CHECK_ARG(weights.tp_size == tp.size() && weights.tp_rank == tp.rank(),
                   "weights are TP slice ", weights.tp_rank, " of ", weights.tp_size,
                   ", this rank is TP rank ", tp.rank(), " of ", tp.size());
  CPFILL_CHECK_ARG(static_cast<int>(weights.layers.size()) == config.num_layers, "weights have ",
                   weights.layers.size(), " layers, the config ", config.num_layers);
  CPFILL_CHECK_ARG(options.kv_capacity_tokens > 0, "KV capacity must be positive");
  return std::unique_ptr<LlamaModel>(
      new LlamaModel(config, std::move(weights), tp, cp, world, options));
}

int64_t LlamaModel::kv_tokens_held() const {
  int64_t held = 0;
  for (const auto& [name, s] : sessions_) held += s.where.layout.tokens(cp_.rank(), 0);
  return held;
}

absl::StatusOr<std::vector<SequenceOutput>> LlamaModel::Prefill(
    const std::vector<PrefillRequest>& batch, PrefillTimings* timings,
    const std::function<void(int)>& progress) {
  PrefillTimings local_t;
  PrefillTimings& t = timings ? *timings : local_t;
  t = PrefillTimings{};
  const auto t_start = Clock::now();
  auto t0 = t_start;
  const ModelConfig& c = config_;
  const int tp = tp_.size(), n_cp = cp_.size(), me = cp_.rank();
  const int hq = c.num_heads / tp, hkv = c.num_kv_heads / tp, hd = c.head_dim;
  const int64_t D = c.hidden_size, I = c.intermediate_size / tp;
  const int64_t qw = static_cast<int64_t>(hq) * hd, kvw = static_cast<int64_t>(hkv) * hd;

  // Step 0: the requests, their sessions and the plan; the capacity, agreed by every rank.
  CPFILL_ASSIGN_OR_RETURN(
      BatchPlan b,
      PlanBatch(c, batch, n_cp, me, [&](const std::string& name) -> const SessionLayout* {
        auto it = sessions_.find(name);
        return it == sessions_.end() ? nullptr : &it->second.where;
      }));
  CPFILL_RETURN_IF_ERROR(
      CheckKvCapacity(b, kv_tokens_held(), options_.kv_capacity_tokens, batch.size(), world_));
  const sharding::ShardPlan& plan = b.plan;
  const sharding::LocalLayout& layout = b.layout;
  const int64_t T = layout.q_rows(), R = layout.kv_rows();

  // The selector's choice for the whole batch (every rank computes the same).
  CPFILL_RETURN_IF_ERROR(ChooseAlgorithm(options_, c, tp_.size(), n_cp, b, &t));

  const attention::AttentionShape shape{.num_heads = hq,
                                        .num_kv_heads = hkv,
                                        .head_dim = hd,
                                        .softmax_scale = 1.0f / std::sqrt(float(hd)),
                                        .causal = true};
  CPFILL_ASSIGN_OR_RETURN(auto ring, parallel::RingAttention::Create(cp_, plan, shape, &kernels_));

  // Step 1: the embedding of this rank's tokens.
  const std::vector<int32_t>& ids = b.local_ids;
  std::vector<float> x(T * D), h(T * D), q(T * qw), kn(T * kvw), vn(T * kvw), k_all(R * kvw),
      v_all(R * kvw), attn(T * qw), lse(T * hq), proj(T * D), gate(T * I), up(T * I);
  cpu::Embed(ids.data(), T, weights_.embedding.data(), D, x.data());
  Lap(t0, t.embed_s);

  // New cache rows of each session, committed only when the whole prefill succeeded.
  std::vector<Session> pending(plan.num_sequences());
  for (int s = 0; s < plan.num_sequences(); ++s) {
    if (batch[s].session.empty()) continue;
    pending[s].k.resize(c.num_layers);
    pending[s].v.resize(c.num_layers);
  }

  // Step 2: the layers.
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& w = weights_.layers[l];
    cpu::RmsNorm(x.data(), w.input_norm.data(), T, D, c.rms_norm_eps, h.data(), &pool_);
    Lap(t0, t.other_s);
    cpu::Linear(h.data(), T, D, w.wq.data(), qw, q.data());
    cpu::Linear(h.data(), T, D, w.wk.data(), kvw, kn.data());
    cpu::Linear(h.data(), T, D, w.wv.data(), kvw, vn.data());
    Lap(t0, t.gemm_s);
    rope_.Apply(q.data(), layout.q_positions.data(), T, hq, hd);
    rope_.Apply(kn.data(), layout.q_positions.data(), T, hkv, hd);
    // K/V rows of every sequence in the local layout: its cached rows, then the new ones.
    for (int s = 0; s < plan.num_sequences(); ++s) {
      const int64_t dst = layout.kv_offset[s], n_new = layout.q_len[s];
      const int64_t n_cached = layout.kv_len[s] - n_new;
      if (n_cached > 0) {
        const Session& old = sessions_.at(batch[s].session);
        CPFILL_CHECK_INTERNAL(static_cast<int64_t>(old.k[l].size()) == n_cached * kvw, "session '",
                              batch[s].session, "' holds ", old.k[l].size() / kvw,
                              " rows on this rank, the plan says ", n_cached);
        std::memcpy(&k_all[dst * kvw], old.k[l].data(), n_cached * kvw * sizeof(float));
        std::memcpy(&v_all[dst * kvw], old.v[l].data(), n_cached * kvw * sizeof(float));
      }
      std::memcpy(&k_all[(dst + n_cached) * kvw], &kn[layout.q_offset[s] * kvw],
                  n_new * kvw * sizeof(float));
      std::memcpy(&v_all[(dst + n_cached) * kvw], &vn[layout.q_offset[s] * kvw],
                  n_new * kvw * sizeof(float));
      if (!batch[s].session.empty()) {
        pending[s].k[l].assign(&k_all[dst * kvw], &k_all[(dst + layout.kv_len[s]) * kvw]);
        pending[s].v[l].assign(&v_all[dst * kvw], &v_all[(dst + layout.kv_len[s]) * kvw]);
      }
    }
    Lap(t0, t.other_s);
    parallel::RingTimings rt;
    CPFILL_RETURN_IF_ERROR(
        ring->Run(t.algorithm, q.data(), k_all.data(), v_all.data(), attn.data(), lse.data(), &rt));
    Lap(t0, t.attention_s);
    // o projection: row-parallel, partial sums of every TP rank add up.
    cpu::Linear(attn.data(), T, qw, w.wo.data(), D, proj.data());
    Lap(t0, t.gemm_s);
    if (tp > 1)
      CPFILL_RETURN_IF_ERROR(tp_.AllReduce(proj.data(), T * D, DataType::kFloat32, ReduceOp::kSum));
    Lap(t0, t.allreduce_s);
    AddInPlace(x.data(), proj.data(), T * D);
    cpu::RmsNorm(x.data(), w.post_norm.data(), T, D, c.rms_norm_eps, h.data(), &pool_);
    Lap(t0, t.other_s);
    cpu::Linear(h.data(), T, D, w.w_gate.data(), I, gate.data());
    cpu::Linear(h.data(), T, D, w.w_up.data(), I, up.data());
    Lap(t0, t.gemm_s);
    cpu::SwiGlu(gate.data(), up.data(), T * I, gate.data());
    Lap(t0, t.other_s);
    cpu::Linear(gate.data(), T, I, w.w_down.data(), D, proj.data());
    Lap(t0, t.gemm_s);
    if (tp > 1)
      CPFILL_RETURN_IF_ERROR(tp_.AllReduce(proj.data(), T * D, DataType::kFloat32, ReduceOp::kSum));
    Lap(t0, t.allreduce_s);
    AddInPlace(x.data(), proj.data(), T * D);
    Lap(t0, t.other_s);
    if (progress) progress(l);
  }

  // Step 3: logits at the last positions (this TP rank's vocabulary slice), on world rank 0.
  const int64_t V = c.vocab_size / tp;
  const auto rows = LastPositionRows(b);
  std::vector<float> logits(rows.size() * V), normed(D);
  for (size_t i = 0; i < rows.size(); ++i) {
    cpu::RmsNorm(&x[rows[i].second * D], weights_.final_norm.data(), 1, D, c.rms_norm_eps,
                 normed.data(), nullptr);
    cpu::Linear(normed.data(), 1, D, weights_.lm_head.data(), V, &logits[i * V]);
  }
  CPFILL_ASSIGN_OR_RETURN(
      std::vector<SequenceOutput> out,
      GatherLastLogits(c, plan.num_sequences(), rows, logits, tp_.rank(), tp, world_));
  Lap(t0, t.lm_head_s);

  // Step 4: the sessions' caches now hold this turn too.
  for (int s = 0; s < plan.num_sequences(); ++s) {
    if (batch[s].session.empty()) continue;
    pending[s].where = SessionAfter(b, s);
    sessions_[batch[s].session] = std::move(pending[s]);
  }
  t.total_s = Since(t_start);
  return out;
}

}  // namespace cpfill::runtime
