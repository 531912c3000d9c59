#include "runtime/model/prefill_batch.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace cpfill::runtime {

void StepTimings::AddPhases(const StepTimings& step) {
  total_s += step.total_s;
  embed_s += step.embed_s;
  gemm_s += step.gemm_s;
  attention_s += step.attention_s;
  allreduce_s += step.allreduce_s;
  lm_head_s += step.lm_head_s;
  other_s += step.other_s;
  kv_s += step.kv_s;
  host_plan_s += step.host_plan_s;
  host_enqueue_s += step.host_enqueue_s;
}

absl::StatusOr<BatchPlan> PlanBatch(
    const ModelConfig& config, const std::vector<PrefillRequest>& batch, int cp_size, int cp_rank,
    const std::function<const SessionLayout*(const std::string&)>& session,
    std::optional<int64_t> decode_step) {
  BatchPlan b;
  sharding::KvLayout cache;
  cache.cp_size = cp_size;
  cache.runs.assign(cp_size, {});
  std::set<std::string> seen;
  for (size_t i = 0; i < batch.size(); ++i) {
    const PrefillRequest& r = batch[i];
    CPFILL_CHECK_ARG(!r.tokens.empty(), "request ", i, " has no tokens");
    for (int32_t id : r.tokens) {
      CPFILL_CHECK_ARG(id >= 0 && id < config.vocab_size, "request ", i, ": token id ", id,
                       " is outside the vocabulary [0, ", config.vocab_size, ")");
    }
    CPFILL_CHECK_ARG(r.session.empty() || seen.insert(r.session).second, "session '", r.session,
                     "' appears twice in one batch");
    const SessionLayout* s = r.session.empty() ? nullptr : session(r.session);
    const int64_t cached = s ? s->tokens : 0;
    CPFILL_CHECK_ARG(
        cached + static_cast<int64_t>(r.tokens.size()) <= config.max_position_embeddings,
        "request ", i, ": ", cached + r.tokens.size(), " tokens exceed the model's ",
        config.max_position_embeddings, " positions");
    b.sequences.push_back(
        {.new_tokens = static_cast<int64_t>(r.tokens.size()), .cached_tokens = cached});
    for (int rank = 0; rank < cp_size; ++rank) {
      cache.runs[rank].push_back(s ? s->layout.runs[rank][0]
                                   : std::vector<sharding::PositionRun>{});
    }
  }
  if (decode_step) {
    CPFILL_ASSIGN_OR_RETURN(b.plan,
                            sharding::PlanDecode(b.sequences, cp_size, *decode_step, &cache));
  } else {
    CPFILL_ASSIGN_OR_RETURN(b.plan, sharding::PlanPrefill(b.sequences, cp_size, &cache));
  }
  b.layout = sharding::MakeLocalLayout(b.plan, cp_rank);
  b.local_ids.resize(b.layout.q_rows());
  for (int s = 0; s < b.plan.num_sequences(); ++s) {
    for (int64_t i = 0; i < b.layout.q_len[s]; ++i) {
      const int64_t row = b.layout.q_offset[s] + i;
      b.local_ids[row] = batch[s].tokens[b.layout.q_positions[row] - b.sequences[s].cached_tokens];
    }
  }
  return b;
}

int64_t KvTokensForBatch(const std::vector<PrefillRequest>& batch, int cp_size, int block_tokens) {
  int64_t tokens = 0;
  for (const PrefillRequest& r : batch) {
    const int64_t n = static_cast<int64_t>(r.tokens.size());
    const int64_t chunk = (n + 2 * cp_size - 1) / (2 * cp_size);  // two chunks per rank
    tokens += 2 * chunk + block_tokens;
  }
  return tokens;
}

double ModelFlops(const ModelConfig& config, const std::vector<sharding::SequenceRequest>& seqs) {
  // The matmuls actually done: every layer's linear weights for every new token, the LM head for
  // each sequence's last position only (the embedding is a lookup), and causal attention.
  const double d = config.hidden_size, q = double(config.num_heads) * config.head_dim,
               kv = double(config.num_kv_heads) * config.head_dim;
  const double layer_weights = d * q * 2 + d * kv * 2 + 3.0 * d * config.intermediate_size;
  double pairs = 0, tokens = 0;
  for (const auto& s : seqs) {
    pairs += double(s.new_tokens) * s.cached_tokens + double(s.new_tokens) * (s.new_tokens + 1) / 2;
    tokens += s.new_tokens;
  }
  return 2.0 * layer_weights * config.num_layers * tokens +
         2.0 * d * config.vocab_size * double(seqs.size()) +
         4.0 * config.head_dim * config.num_heads * pairs * config.num_layers;
}

std::vector<std::pair<int, int64_t>> LastPositionRows(const BatchPlan& b) {
  std::vector<std::pair<int, int64_t>> rows;
  for (int s = 0; s < b.plan.num_sequences(); ++s) {
    const int64_t last = b.sequences[s].cached_tokens + b.sequences[s].new_tokens - 1;
    for (int64_t i = 0; i < b.layout.q_len[s]; ++i) {
      const int64_t row = b.layout.q_offset[s] + i;
      if (b.layout.q_positions[row] == last) rows.push_back({s, row});
    }
  }
  return rows;
}

absl::StatusOr<std::vector<SequenceOutput>> GatherLastLogits(
    const ModelConfig& config, int num_sequences, const std::vector<std::pair<int, int64_t>>& rows,
    std::span<const float> logits, const std::vector<bool>& wants_logits, int tp_rank, int tp_size,
    parallel::Communicator& world) {
  const int64_t V = config.vocab_size / tp_size;
  const bool root = world.rank() == 0;
  std::vector<SequenceOutput> out(num_sequences);
  // Into sequence `seq`'s logits on world rank 0, at vocabulary slice `slice`. A decode step of
  // 256 samples moves 128 MB of Llama 3 logits: one copy each, none through a message on rank 0.
  const auto place = [&](uint32_t seq, uint32_t slice, const float* from) {
    std::vector<float>& to = out[seq].logits;
    if (tp_size == 1) return to.assign(from, from + V);
    if (to.empty()) to.assign(config.vocab_size, std::nanf(""));  // a slice never sent stays NaN
    std::memcpy(&to[slice * V], from, V * sizeof(float));
  };
  if (world.size() > 1) {
    // Message to world rank 0: [count, tp_rank, seq ids..., logits (count x V)] as 4-byte words;
    // rank 0's own rows stay where they are.
    std::vector<uint32_t> msg(2 + rows.size() + (root ? 0 : logits.size()));
    msg[0] = static_cast<uint32_t>(rows.size());
    msg[1] = static_cast<uint32_t>(tp_rank);
    for (size_t i = 0; i < rows.size(); ++i) msg[2 + i] = static_cast<uint32_t>(rows[i].first);
    if (!root && !logits.empty()) {  // no last positions: no logits (and a null data())
      std::memcpy(&msg[2 + rows.size()], logits.data(), logits.size() * 4);
    }
    const int n = world.size();
    int64_t my_bytes = static_cast<int64_t>(msg.size() * 4);
    std::vector<int64_t> all_bytes(n);
    CPFILL_RETURN_IF_ERROR(world.AllGather(&my_bytes, sizeof(int64_t), all_bytes.data()));
    std::vector<size_t> sb(n, 0), so(n, 0), rb(n, 0), ro(n, 0);
    sb[0] = root ? 0 : my_bytes;
    size_t total = 0;
    if (root) {
      for (int p = 1; p < n; ++p) {
        ro[p] = total;
        rb[p] = all_bytes[p];
        total += all_bytes[p];
      }
    }
    std::vector<uint32_t> recv(total / 4);
    CPFILL_RETURN_IF_ERROR(world.AllToAll(msg.data(), sb, so, recv.data(), rb, ro));
    if (!root) return out;
    for (int p = 1; p < n; ++p) {
      const uint32_t* b = recv.data() + ro[p] / 4;
      const uint32_t count = b[0], slice = b[1];
      const float* lg = reinterpret_cast<const float*>(b + 2 + count);
      for (uint32_t i = 0; i < count; ++i) place(b[2 + i], slice, lg + i * V);
    }
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    place(static_cast<uint32_t>(rows[i].first), static_cast<uint32_t>(tp_rank),
          logits.data() + i * V);
  }
  for (int seq = 0; seq < num_sequences; ++seq) {
    if (!wants_logits[seq]) continue;
    std::vector<float>& z = out[seq].logits;
    if (z.empty()) z.assign(config.vocab_size, std::nanf(""));
    out[seq].first_token = static_cast<int32_t>(std::max_element(z.begin(), z.end()) - z.begin());
  }
  return out;
}

absl::Status GatherDrawnTokens(const std::vector<std::pair<int, int64_t>>& drawn,
                               const std::vector<bool>& wants_logits, parallel::Communicator& world,
                               std::vector<SequenceOutput>* out) {
  // A slot per sequence from every rank: a few bytes each, where logits were 0.5 MB a sequence.
  const size_t n = wants_logits.size();
  std::vector<int32_t> mine(n, -1), all(n * world.size());
  for (const auto& [seq, token] : drawn) mine[seq] = static_cast<int32_t>(token);
  CPFILL_RETURN_IF_ERROR(world.AllGather(mine.data(), n * sizeof(int32_t), all.data()));
  if (world.rank() != 0) return absl::OkStatus();
  for (size_t seq = 0; seq < n; ++seq) {
    if (wants_logits[seq]) continue;
    int32_t token = -1;
    for (int p = 0; p < world.size(); ++p) token = std::max(token, all[p * n + seq]);
    CPFILL_CHECK_INTERNAL(token >= 0, "no rank drew a token for sequence ", seq);
    (*out)[seq].first_token = token;
  }
  return absl::OkStatus();
}

absl::Status ChooseAlgorithms(const StepOptions& options, const ModelConfig& config, int tp_size,
                              int cp_size, const BatchPlan& b, bool decode, StepTimings* t) {
  const auto select = [&](int64_t new_tokens, int64_t cached_tokens) {
    return parallel::Select({.system = options.system,
                             .model = {.num_heads = config.num_heads / tp_size,
                                       .num_kv_heads = config.num_kv_heads / tp_size,
                                       .head_dim = config.head_dim},
                             .cp_size = cp_size,
                             .new_tokens = std::max<int64_t>(new_tokens, 1),
                             .cached_tokens = cached_tokens},
                            options.rule, options.fitted);
  };
  for (const auto& s : b.sequences) {
    t->new_tokens += s.new_tokens;
    t->cached_tokens += s.cached_tokens;
  }
  CPFILL_ASSIGN_OR_RETURN(t->selection, select(t->new_tokens, t->cached_tokens));
  for (const auto& s : b.sequences) {
    CPFILL_ASSIGN_OR_RETURN(parallel::Selection one, select(s.new_tokens, s.cached_tokens));
    // A decode step's queries are one row per sequence, held whole by one rank: passing them
    // (Alg. 4) moves B rows where passing KV would move every cached token. On one rank nothing
    // travels, so the batch stays one ring.
    parallel::RingAlgorithm a = options.auto_algorithm ? one.choice : options.algorithm;
    if (options.auto_algorithm && cp_size == 1) a = t->selection.choice;
    if (decode && cp_size > 1) a = parallel::RingAlgorithm::kPassQ;
    t->selections.push_back(std::move(one));
    t->algorithms.push_back(a);
  }
  std::vector<parallel::RingAlgorithm> kinds = t->algorithms;
  std::sort(kinds.begin(), kinds.end());
  t->rings = std::max<int>(1, std::unique(kinds.begin(), kinds.end()) - kinds.begin());
  t->model_flops = ModelFlops(config, b.sequences);
  return absl::OkStatus();
}

SessionLayout SessionAfter(const BatchPlan& b, int seq) {
  // Only this sequence's runs: Commit calls this for every session of a batch, so building the
  // whole KvLayoutAfter here made a batch of S sessions cost O(S^2).
  SessionLayout s;
  s.tokens = b.sequences[seq].cached_tokens + b.sequences[seq].new_tokens;
  s.layout.cp_size = b.plan.cp_size;
  s.layout.runs.assign(b.plan.cp_size, {});
  for (int rank = 0; rank < b.plan.cp_size; ++rank) {
    s.layout.runs[rank] = {b.plan.KvRunsAfter(rank, seq)};
  }
  return s;
}

}  // namespace cpfill::runtime
