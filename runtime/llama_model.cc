#include "runtime/llama_model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <set>

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
  for (const auto& [name, s] : sessions_) held += s.layout.tokens(cp_.rank(), 0);
  return held;
}

absl::Status LlamaModel::CheckCapacity(const sharding::ShardPlan& plan,
                                       const std::vector<PrefillRequest>& batch) {
  // Token slots this rank needs once the batch is in: what it holds plus its new tokens (a
  // sequence without a session needs its slots during the prefill too).
  int64_t need = kv_tokens_held();
  for (int s = 0; s < plan.num_sequences(); ++s) need += plan.shard(cp_.rank(), s).new_tokens();
  int64_t worst[2] = {need, -need};
  CPFILL_RETURN_IF_ERROR(world_.AllReduce(worst, 2, DataType::kInt64, ReduceOp::kMax));
  // Every rank refuses together, before any work, with the same numbers.
  if (worst[0] > options_.kv_capacity_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "KV cache: the batch needs ", worst[0],
        " token slots on its fullest CP rank (what the "
        "rank holds plus its share of the batch's new tokens), but a rank holds at most ",
        options_.kv_capacity_tokens, " (--kv-capacity-tokens); ", batch.size(),
        " request(s) refused, nothing was changed"));
  }
  return absl::OkStatus();
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

  // Step 0: the requests, their sessions and the plan. Checks that every rank makes alike.
  std::vector<sharding::SequenceRequest> seqs;
  sharding::KvLayout cache;
  cache.cp_size = n_cp;
  cache.runs.assign(n_cp, {});
  std::set<std::string> seen;
  for (size_t i = 0; i < batch.size(); ++i) {
    const PrefillRequest& r = batch[i];
    CPFILL_CHECK_ARG(!r.tokens.empty(), "request ", i, " has no tokens");
    for (int32_t id : r.tokens) {
      CPFILL_CHECK_ARG(id >= 0 && id < c.vocab_size, "request ", i, ": token id ", id,
                       " is outside the vocabulary [0, ", c.vocab_size, ")");
    }
    CPFILL_CHECK_ARG(r.session.empty() || seen.insert(r.session).second, "session '", r.session,
                     "' appears twice in one batch");
    auto it = r.session.empty() ? sessions_.end() : sessions_.find(r.session);
    const int64_t cached = it == sessions_.end() ? 0 : it->second.tokens;
    CPFILL_CHECK_ARG(cached + static_cast<int64_t>(r.tokens.size()) <= c.max_position_embeddings,
                     "request ", i, ": ", cached + r.tokens.size(), " tokens exceed the model's ",
                     c.max_position_embeddings, " positions");
    seqs.push_back({.new_tokens = static_cast<int64_t>(r.tokens.size()), .cached_tokens = cached});
    for (int rank = 0; rank < n_cp; ++rank) {
      cache.runs[rank].push_back(it == sessions_.end() ? std::vector<sharding::PositionRun>{}
                                                       : it->second.layout.runs[rank][0]);
    }
  }
  CPFILL_ASSIGN_OR_RETURN(sharding::ShardPlan plan, sharding::PlanPrefill(seqs, n_cp, &cache));
  CPFILL_RETURN_IF_ERROR(CheckCapacity(plan, batch));
  const sharding::LocalLayout layout = sharding::MakeLocalLayout(plan, me);
  const int64_t T = layout.q_rows(), R = layout.kv_rows();

  // The selector's choice for the whole batch (every rank computes the same).
  for (const auto& s : seqs) t.new_tokens += s.new_tokens, t.cached_tokens += s.cached_tokens;
  CPFILL_ASSIGN_OR_RETURN(
      t.selection,
      parallel::Select({.system = options_.system,
                        .model = {.num_heads = hq, .num_kv_heads = hkv, .head_dim = hd},
                        .cp_size = n_cp,
                        .new_tokens = t.new_tokens,
                        .cached_tokens = t.cached_tokens},
                       options_.rule, options_.fitted));
  t.algorithm = options_.auto_algorithm ? t.selection.choice : options_.algorithm;
  double pairs = 0;
  for (const auto& s : seqs) {
    pairs += double(s.new_tokens) * s.cached_tokens + double(s.new_tokens) * (s.new_tokens + 1) / 2;
  }
  t.model_flops =
      2.0 * c.ParameterCount() * t.new_tokens + 4.0 * hd * c.num_heads * pairs * c.num_layers;

  const attention::AttentionShape shape{.num_heads = hq,
                                        .num_kv_heads = hkv,
                                        .head_dim = hd,
                                        .softmax_scale = 1.0f / std::sqrt(float(hd)),
                                        .causal = true};
  CPFILL_ASSIGN_OR_RETURN(auto ring, parallel::RingAttention::Create(cp_, plan, shape, &kernels_));

  // Step 1: the embedding of this rank's tokens.
  std::vector<int32_t> ids(T);
  for (int s = 0; s < plan.num_sequences(); ++s) {
    for (int64_t i = 0; i < layout.q_len[s]; ++i) {
      const int64_t row = layout.q_offset[s] + i;
      ids[row] = batch[s].tokens[layout.q_positions[row] - seqs[s].cached_tokens];
    }
  }
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

  // Step 3: logits at the last positions, gathered on world rank 0.
  CPFILL_ASSIGN_OR_RETURN(std::vector<SequenceOutput> out, GatherLogits(plan, layout, x, &t));

  // Step 4: the sessions' caches now hold this turn too.
  const sharding::KvLayout after = plan.KvLayoutAfter();
  for (int s = 0; s < plan.num_sequences(); ++s) {
    if (batch[s].session.empty()) continue;
    Session& session = pending[s];
    session.tokens = seqs[s].cached_tokens + seqs[s].new_tokens;
    session.layout.cp_size = n_cp;
    session.layout.runs.assign(n_cp, {});
    for (int rank = 0; rank < n_cp; ++rank) session.layout.runs[rank] = {after.runs[rank][s]};
    sessions_[batch[s].session] = std::move(session);
  }
  t.total_s = Since(t_start);
  return out;
}

absl::StatusOr<std::vector<SequenceOutput>> LlamaModel::GatherLogits(
    const sharding::ShardPlan& plan, const sharding::LocalLayout& layout,
    const std::vector<float>& x, PrefillTimings* t) {
  auto t0 = Clock::now();
  const ModelConfig& c = config_;
  const int64_t D = c.hidden_size, V = c.vocab_size / tp_.size();
  // The rows of this rank that are a sequence's last position.
  std::vector<int32_t> seq_ids;
  std::vector<float> logits;
  std::vector<float> normed(D);
  for (int s = 0; s < plan.num_sequences(); ++s) {
    const int64_t last = plan.sequences[s].cached_tokens + plan.sequences[s].new_tokens - 1;
    for (int64_t i = 0; i < layout.q_len[s]; ++i) {
      const int64_t row = layout.q_offset[s] + i;
      if (layout.q_positions[row] != last) continue;
      cpu::RmsNorm(&x[row * D], weights_.final_norm.data(), 1, D, c.rms_norm_eps, normed.data(),
                   nullptr);
      logits.resize(logits.size() + V);
      cpu::Linear(normed.data(), 1, D, weights_.lm_head.data(), V, &logits[logits.size() - V]);
      seq_ids.push_back(s);
    }
  }
  // Message to world rank 0: [count, tp_rank, seq ids..., logits (count x V)] as 4-byte words.
  std::vector<uint32_t> msg(2 + seq_ids.size() + logits.size());
  msg[0] = static_cast<uint32_t>(seq_ids.size());
  msg[1] = static_cast<uint32_t>(tp_.rank());
  std::memcpy(&msg[2], seq_ids.data(), seq_ids.size() * 4);
  std::memcpy(&msg[2 + seq_ids.size()], logits.data(), logits.size() * 4);
  const int n = world_.size();
  int64_t my_bytes = static_cast<int64_t>(msg.size() * 4);
  std::vector<int64_t> all_bytes(n);
  CPFILL_RETURN_IF_ERROR(world_.AllGather(&my_bytes, sizeof(int64_t), all_bytes.data()));
  std::vector<size_t> sb(n, 0), so(n, 0), rb(n, 0), ro(n, 0);
  sb[0] = my_bytes;
  size_t total = 0;
  if (world_.rank() == 0) {
    for (int p = 0; p < n; ++p) {
      ro[p] = total;
      rb[p] = all_bytes[p];
      total += all_bytes[p];
    }
  }
  std::vector<uint32_t> recv(total / 4);
  CPFILL_RETURN_IF_ERROR(world_.AllToAll(msg.data(), sb, so, recv.data(), rb, ro));
  std::vector<SequenceOutput> out(plan.num_sequences());
  if (world_.rank() == 0) {
    for (auto& o : out) o.logits.assign(c.vocab_size, std::nanf(""));
    for (int p = 0; p < n; ++p) {
      const uint32_t* b = recv.data() + ro[p] / 4;
      const uint32_t count = b[0], slice = b[1];
      const float* lg = reinterpret_cast<const float*>(b + 2 + count);
      for (uint32_t i = 0; i < count; ++i) {
        std::memcpy(&out[b[2 + i]].logits[slice * V], lg + i * V, V * sizeof(float));
      }
    }
    for (auto& o : out) {
      o.first_token = static_cast<int32_t>(std::max_element(o.logits.begin(), o.logits.end()) -
                                           o.logits.begin());
    }
  }
  t->lm_head_s += Since(t0);
  return out;
}

}  // namespace cpfill::runtime
