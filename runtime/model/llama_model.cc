#include "runtime/model/llama_model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "parallel/mixed_ring.h"
#include "base/thread_pool.h"
#include "parallel/sparq_cp.h"
#include "runtime/model/memory.h"
#include "runtime/model/prompt_logprobs.h"

namespace cpfill::runtime {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The backend's scratch tensors of one prefill, by role.
enum Slot {
  kIds,
  kPositions,
  kX,
  kH,
  kQ,
  kK,
  kV,
  kKAll,
  kVAll,
  kAttn,
  kLse,
  kAttnCompute,
  kProj,
  kGate,
  kUp,
  kLast,
  kNormed,
  kLogits,
  kLogitsWhole,
  kBlockTable
};

// Prompt positions put through the LM head at once for prompt logprobs: the logits of a chunk
// (rows x vocab / tp fp32, 32 MB for Llama 3 on one rank) bound the memory they take.
constexpr int64_t kPromptChunkRows = 64;

// World rank 0 receives every rank's `mine` (its own first), one after another; the others an
// empty vector. Collective over `world`.
absl::StatusOr<std::vector<double>> GatherToRoot(const std::vector<double>& mine,
                                                 parallel::Communicator& world) {
  const int n = world.size();
  const bool root = world.rank() == 0;
  if (n == 1) return mine;
  int64_t my_bytes = static_cast<int64_t>(mine.size() * sizeof(double));
  std::vector<int64_t> all_bytes(n);
  CPFILL_RETURN_IF_ERROR(world.AllGather(&my_bytes, sizeof(int64_t), all_bytes.data()));
  std::vector<size_t> sb(n, 0), so(n, 0), rb(n, 0), ro(n, 0);
  if (!root) sb[0] = static_cast<size_t>(my_bytes);
  size_t total = root ? mine.size() * sizeof(double) : 0;
  for (int p = 1; root && p < n; ++p) {
    ro[p] = total;
    rb[p] = static_cast<size_t>(all_bytes[p]);
    total += rb[p];
  }
  std::vector<double> recv(total / sizeof(double));
  if (root) std::copy(mine.begin(), mine.end(), recv.begin());
  CPFILL_RETURN_IF_ERROR(world.AllToAll(mine.data(), sb, so, recv.data(), rb, ro));
  return recv;
}

// Of the last-position rows, those whose sequences want logits (no draw in place), their logits
// moved to the front of `logits` in that order: what GatherLastLogits sends.
std::vector<std::pair<int, int64_t>> KeepWantedRows(
    const std::vector<std::pair<int, int64_t>>& rows, const std::vector<bool>& wants_logits,
    int64_t vocab_slice, std::span<float>* logits) {
  std::vector<std::pair<int, int64_t>> kept;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (!wants_logits[rows[i].first]) continue;
    if (kept.size() < i) {
      std::copy_n(logits->begin() + i * vocab_slice, vocab_slice,
                  logits->begin() + kept.size() * vocab_slice);
    }
    kept.push_back(rows[i]);
  }
  *logits = logits->first(kept.size() * vocab_slice);
  return kept;
}

// A new span on t's timeline, filled in by the backend once its phase is timed.
parallel::RingSpan* AddSpan(StepTimings& t, std::string name, const char* lane) {
  return &t.spans.emplace_back(parallel::RingSpan{.name = std::move(name), .lane = lane});
}

}  // namespace

struct LlamaModel::Running {
  Clock::time_point start;  // the step's, for StepTimings::total_s and host_plan_s
  BatchPlan b;
  // Per request: the KV sequence it writes, the rows it held before (0 when new), and whether
  // the sequence was made for this batch.
  std::vector<KvCache::SeqId> seq;
  std::vector<int64_t> rows_before;
  std::vector<bool> made_here;
  std::vector<parallel::RingAlgorithm> algorithms;  // per sequence, in this plan's order
  std::unique_ptr<parallel::MixedRing> ring;
  Tensor ids, positions, x, h, q, k, v, k_all, v_all, attn, lse, attn_compute, proj, gate, up;
  std::vector<KvCache::Rows> new_rows, all_rows;  // the KV copies of every layer
  // Decode steps read each sequence's K/V in place from its blocks (no all_rows copy): the
  // batch's block tables, back to back, in the backend's memory, and where each sequence's
  // local rows and table entries begin (attention::PagedKv).
  bool kv_in_place = false;
  // Prefill steps over cached rows read them in place too (LlamaModel::PrefillReadsKvInPlace):
  // the ring gathers them, each shared block once.
  bool kv_gathered = false;
  // Their gathered copy would not fit in memory: the ring reads the blocks in place instead,
  // where it can (attention::PagedKv::prefill_in_place).
  bool prefill_in_place = false;
  Tensor block_table;
  std::vector<int32_t> host_block_table;  // the same on the host: who shares which blocks
  std::vector<int64_t> seq_kv_begin, seq_table_begin;
  // The tables' name for the ring's plan cache (attention::PagedKv::generation); 0 until built.
  uint64_t table_generation = 0;
  // Decode steps: each sequence's SparQ config (in this plan's order; unset: dense).
  std::vector<std::optional<attention::sparq::SparqConfig>> sparq;
  // Every sequence of this decode step attends with SparQ (SparqAttends): the dense ring is
  // skipped. The same on every rank (the configs and lengths travel with the step).
  bool every_sparq = false;
};

absl::StatusOr<KvCacheSpec> KvSpecFor(const ModelConfig& config, int tp_size, KvDtype dtype,
                                      const StepOptions& options, int64_t free_bytes) {
  KvCacheSpec spec{.num_layers = config.num_layers,
                   .kv_heads = config.num_kv_heads / tp_size,
                   .head_dim = config.head_dim,
                   .block_tokens = options.kv_block_tokens,
                   .capacity_tokens = options.kv_capacity_tokens,
                   .dtype = dtype};
  if (options.kv_capacity_tokens > 0) return spec;
  CPFILL_CHECK_ARG(options.kv_memory_fraction > 0,
                   "the KV cache needs a capacity: --kv-capacity-tokens or --kv-memory-fraction");
  CPFILL_ASSIGN_OR_RETURN(spec.capacity_tokens,
                          CapacityFromMemory(spec, options.kv_memory_fraction, free_bytes));
  CPFILL_CHECK_ARG(spec.capacity_tokens > 0, "--kv-memory-fraction ", options.kv_memory_fraction,
                   " of ", free_bytes, " free bytes holds no KV block of ", spec.block_bytes(),
                   " bytes per layer");
  return spec;
}

LlamaModel::LlamaModel(const ModelConfig& config, std::unique_ptr<ModelBackend> backend,
                       parallel::Communicator& world, const StepOptions& options,
                       std::unique_ptr<KvCache> kv)
    : config_(config),
      backend_(std::move(backend)),
      world_(world),
      options_(options),
      kv_(std::move(kv)) {}

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Create(
    const ModelConfig& config, std::unique_ptr<ModelBackend> backend, parallel::Communicator& world,
    const StepOptions& options) {
  CPFILL_CHECK_ARG(backend != nullptr, "the model needs a backend");
  const int tp = backend->tp().size();
  CPFILL_RETURN_IF_ERROR(config.ValidateForTp(tp));
  CPFILL_CHECK_ARG(static_cast<int>(backend->weights().layers.size()) == config.num_layers,
                   "weights have ", backend->weights().layers.size(), " layers, the config ",
                   config.num_layers);
  int64_t free_bytes = 0;
  if (options.kv_capacity_tokens <= 0) {
    CPFILL_ASSIGN_OR_RETURN(free_bytes, backend->FreeMemoryBytes());
  }
  CPFILL_ASSIGN_OR_RETURN(KvCacheSpec spec,
                          KvSpecFor(config, tp, backend->kv_dtype(), options, free_bytes));
  // Whole blocks, as KvCache::Create rounds; in double: a capacity near 2^31 tokens times a
  // large model's bytes per token passes int64 on the way.
  const double blocks = std::ceil(double(spec.capacity_tokens) / spec.block_tokens);
  CPFILL_RETURN_IF_ERROR(CheckFitsOnEveryRank(
      world, absl::StrCat("the KV cache (", spec.capacity_tokens, " tokens per rank)"),
      SaturatingBytes(blocks *
                      (spec.block_tokens * double(spec.bytes_per_token()) + HostBytesPerBlock(spec))),
      [&] { return backend->FreeMemoryBytes(); },
      "lower --kv-capacity-tokens or --kv-memory-fraction, send fewer or shorter prompts (each "
      "sequence holds whole blocks: --kv-block-tokens 16 wastes less on short ones), or use more "
      "CP ranks (each holds 1/N of every sequence)"));
  CPFILL_ASSIGN_OR_RETURN(std::unique_ptr<KvCache> kv,
                          KvCache::Create(spec, backend->MakeKvStorage()));
  return std::unique_ptr<LlamaModel>(
      new LlamaModel(config, std::move(backend), world, options, std::move(kv)));
}

int64_t LlamaModel::kv_tokens_held() const {
  int64_t held = 0;
  for (const auto& [name, s] : sessions_) held += kv_->length(s.seq);
  return held;
}

absl::Status LlamaModel::EndSession(const std::string& name) {
  auto it = sessions_.find(name);
  if (it == sessions_.end()) return absl::NotFoundError(absl::StrCat("no session '", name, "'"));
  kv_->Release(it->second.seq);
  sessions_.erase(it);
  return absl::OkStatus();
}

namespace {

// The runs of positions below `end`, in the same order.
std::vector<sharding::PositionRun> RunsBelow(const std::vector<sharding::PositionRun>& runs,
                                             int64_t end) {
  std::vector<sharding::PositionRun> kept;
  for (const sharding::PositionRun& run : runs) {
    const int64_t length = std::min(run.end(), end) - run.begin;
    if (length > 0) kept.push_back({run.begin, length});
  }
  return kept;
}

}  // namespace

absl::Status LlamaModel::ForkSession(const std::string& parent, const std::string& child,
                                     int64_t prefix_tokens) {
  auto it = sessions_.find(parent);
  if (it == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat("no session '", parent, "' to fork"));
  }
  const Session& p = it->second;
  CPFILL_CHECK_ARG(!sessions_.count(child), "session '", child, "' exists already");
  CPFILL_CHECK_ARG(prefix_tokens >= 1 && prefix_tokens <= p.where.tokens, "a fork of session '",
                   parent, "' at ", prefix_tokens, " tokens; it has ", p.where.tokens);
  // This rank's rows of the prefix: its rows are its positions in ascending order, so the prefix
  // is their first `rows`.
  const int cp_rank = backend_->cp().rank();
  const int64_t rows =
      sharding::TotalLength(RunsBelow(p.where.layout.runs[cp_rank][0], prefix_tokens));
  const int64_t block_tokens = kv_->spec().block_tokens;
  int64_t short_blocks = rows % block_tokens != 0 && kv_->free_blocks() == 0 ? 1 : 0;
  CPFILL_RETURN_IF_ERROR(
      world_.AllReduce(&short_blocks, 1, parallel::DataType::kInt64, parallel::ReduceOp::kMax));
  if (short_blocks > 0) {
    return KvCacheFullError(absl::StrCat("a fork of session '", parent,
                                         "' needs a free KV block on every rank for its partly "
                                         "filled last block, and some rank has none"));
  }
  const KvCache::SeqId seq = next_seq_++;
  CPFILL_RETURN_IF_ERROR(kv_->Fork(p.seq, seq, rows));
  Session forked{
      .seq = seq,
      .where = {.tokens = prefix_tokens, .layout = p.where.layout},
      .tokens = std::vector<int32_t>(p.tokens.begin(), p.tokens.begin() + prefix_tokens)};
  for (auto& rank_runs : forked.where.layout.runs) {
    rank_runs[0] = RunsBelow(rank_runs[0], prefix_tokens);
  }
  sessions_.emplace(child, std::move(forked));
  return absl::OkStatus();
}

std::optional<KvCache::SeqId> LlamaModel::SessionSequence(const std::string& name) const {
  auto it = sessions_.find(name);
  if (it == sessions_.end()) return std::nullopt;
  return it->second.seq;
}

std::optional<LlamaModel::SessionKvRows> LlamaModel::SessionRows(const std::string& name) const {
  auto it = sessions_.find(name);
  if (it == sessions_.end()) return std::nullopt;
  // The layout's runs of this CP rank are in the order Forward wrote the rows (each turn's new
  // runs after the cached ones, sharding::ShardPlan::KvRunsAfter), which is ascending: every
  // turn and decode step adds positions past all earlier ones.
  const Session& s = it->second;
  return SessionKvRows{.seq = s.seq,
                       .runs_in_row_order = s.where.layout.runs[backend_->cp().rank()][0],
                       .tokens = s.where.tokens};
}

// Step 0b: every request's KV rows on this rank get blocks, or the batch is refused on every
// rank alike before any work.
absl::Status LlamaModel::ReserveKv(Running& r) {
  const sharding::LocalLayout& layout = r.b.layout;
  const int n = r.b.plan.num_sequences();
  int64_t blocks_needed = 0;
  for (int s = 0; s < n; ++s) {
    const int64_t rows_before = layout.kv_len[s] - layout.q_len[s];
    const bool made_here = rows_before == 0 && !kv_->Contains(r.seq[s]);
    CPFILL_CHECK_INTERNAL(made_here || kv_->length(r.seq[s]) == rows_before, "KV sequence ",
                          r.seq[s], " holds ", kv_->length(r.seq[s]), " rows, the plan says ",
                          rows_before);
    r.rows_before.push_back(rows_before);
    r.made_here.push_back(made_here);
    blocks_needed += kv_->BlocksNeeded(r.seq[s], layout.kv_len[s]);
  }
  // Every rank refuses together, with the numbers of the fullest rank.
  int64_t worst[2] = {blocks_needed - kv_->free_blocks(), blocks_needed};
  CPFILL_RETURN_IF_ERROR(
      world_.AllReduce(worst, 2, parallel::DataType::kInt64, parallel::ReduceOp::kMax));
  if (worst[0] > 0) {
    const KvCacheSpec& spec = kv_->spec();
    const int64_t block_bytes = spec.block_bytes() * 2 * spec.num_layers;
    return KvCacheFullError(absl::StrCat(
        "KV cache: the batch needs ", worst[1], " more blocks of ", spec.block_tokens, " tokens (",
        worst[1] * block_bytes, " bytes) on its fullest rank, ", worst[0],
        " more than are free; the capacity is ", kv_->usage().blocks_total * spec.block_tokens,
        " tokens per rank (--kv-capacity-tokens / --kv-memory-fraction); ", n,
        " request(s) refused, nothing was changed"));
  }
  for (int s = 0; s < n; ++s) {
    absl::Status st = kv_->Reserve(r.seq[s], layout.kv_len[s]);
    if (st.ok()) st = kv_->Append(r.seq[s], layout.q_len[s]);
    if (!st.ok()) {
      RollBackKv(r);
      return st;
    }
  }
  return absl::OkStatus();
}

void LlamaModel::RollBackKv(const Running& r) {
  for (size_t s = 0; s < r.made_here.size(); ++s) {
    if (r.made_here[s]) {
      kv_->Release(r.seq[s]);
    } else {
      kv_->Truncate(r.seq[s], r.rows_before[s]).IgnoreError();
    }
  }
}

absl::StatusOr<std::vector<SequenceOutput>> LlamaModel::Prefill(
    const std::vector<PrefillRequest>& batch, StepTimings* timings,
    const std::function<void(int)>& progress) {
  return Step(batch, std::nullopt, timings, progress);
}

absl::StatusOr<std::vector<SequenceOutput>> LlamaModel::Decode(
    const std::vector<PrefillRequest>& batch, int64_t step, StepTimings* timings) {
  for (size_t i = 0; i < batch.size(); ++i) {
    // The SparQ kernels cannot read the paged KV pool on a GPU yet: refused, never dense instead.
    CPFILL_CHECK_ARG(!batch[i].sparq.has_value() || backend_->name() == "cpu",
                     "sparq needs the CPU backend for now (this one is ",
                     std::string(backend_->name()), ")");
    CPFILL_CHECK_ARG(batch[i].tokens.size() == 1, "decode: request ", i, " has ",
                     batch[i].tokens.size(), " tokens; a decode step takes one per sequence");
    if (!sessions_.count(batch[i].session)) {
      return absl::NotFoundError(
          absl::StrCat("decode: request ", i, ": no session '", batch[i].session, "'"));
    }
  }
  return Step(batch, step, timings, nullptr);
}

absl::StatusOr<std::vector<SequenceOutput>> LlamaModel::Step(
    const std::vector<PrefillRequest>& batch, std::optional<int64_t> decode_step,
    StepTimings* timings, const std::function<void(int)>& progress) {
  StepTimings local_t;
  StepTimings& t = timings ? *timings : local_t;
  t = StepTimings{};
  backend_->ResetPhases();
  const auto t_start = Clock::now();
  parallel::Communicator& cp = backend_->cp();

  // Step 0: the requests, their sessions and the plan (checked in the caller's order); the
  // selector's choice for each sequence (every rank computes the same); the KV blocks, agreed
  // by every rank.
  const auto plan = [&](const std::vector<PrefillRequest>& requests) {
    return PlanBatch(
        config_, requests, cp.size(), cp.rank(),
        [&](const std::string& name) -> const SessionLayout* {
          auto it = sessions_.find(name);
          return it == sessions_.end() ? nullptr : &it->second.where;
        },
        decode_step);
  };
  Running r;
  r.start = t_start;
  CPFILL_ASSIGN_OR_RETURN(r.b, plan(batch));
  CPFILL_RETURN_IF_ERROR(ChooseAlgorithms(options_, config_, backend_->tp().size(), cp.size(), r.b,
                                          decode_step.has_value(), &t));
  // Each algorithm's sequences side by side, so a mixed batch runs one fused ring per algorithm
  // (parallel::MixedRing); the outputs go back to the caller's order at the end.
  std::vector<int> order = parallel::GroupOrder(t.algorithms);
  if (!decode_step.has_value()) OrderBySharedHistory(batch, t.algorithms, &order);
  std::vector<PrefillRequest> grouped;
  for (int i : order) {
    grouped.push_back(batch[i]);
    r.algorithms.push_back(t.algorithms[i]);
  }
  if (!std::is_sorted(order.begin(), order.end())) {
    CPFILL_ASSIGN_OR_RETURN(r.b, plan(grouped));
  }
  for (const PrefillRequest& req : grouped) {
    auto it = sessions_.find(req.session);
    r.seq.push_back(req.session.empty() || it == sessions_.end() ? next_seq_++ : it->second.seq);
    if (decode_step.has_value()) r.sparq.push_back(req.sparq);
  }
  r.every_sparq = !r.sparq.empty();
  for (int s = 0; s < static_cast<int>(r.sparq.size()); ++s) {
    const sharding::SequenceRequest& q = r.b.sequences[s];
    r.every_sparq = r.every_sparq && SparqAttends(r.sparq[s], q.cached_tokens + q.new_tokens);
  }
  r.kv_gathered = !decode_step.has_value() && PrefillReadsKvInPlace(r);
  r.kv_in_place = decode_step.has_value() || r.kv_gathered;
  CPFILL_RETURN_IF_ERROR(CheckActivationMemory(r));
  CPFILL_RETURN_IF_ERROR(ReserveKv(r));
  if (absl::Status s = CheckGatheredMemory(r); !s.ok()) {
    RollBackKv(r);
    return s;
  }

  absl::Status status = Forward(r, t, progress);
  absl::StatusOr<std::vector<SequenceOutput>> out =
      status.ok() ? LastLogits(grouped, r, t) : absl::StatusOr<std::vector<SequenceOutput>>(status);
  if (out.ok()) {
    if (absl::Status scored = PromptLogprobs(grouped, r, t, &*out); !scored.ok()) out = scored;
  }
  if (!out.ok()) {
    RollBackKv(r);
    backend_->ResetPhases();
    return out.status();
  }
  Commit(grouped, r);
  std::vector<SequenceOutput> in_order(out->size());
  for (size_t i = 0; i < order.size(); ++i) in_order[order[i]] = std::move((*out)[i]);
  t.total_s = Since(t_start);
  return in_order;
}

// Within each algorithm's group of a prefill, requests whose sessions start with the same tokens
// side by side: prefix batching groups neighbours only (attention::FindSharedBlocks), so forks of
// one prompt that arrived apart still read it once. The order is the same on every rank
// (sessions are). Decode batches keep the engine's order (forks of a request are adjacent).
void LlamaModel::OrderBySharedHistory(const std::vector<PrefillRequest>& batch,
                                      const std::vector<parallel::RingAlgorithm>& algorithms,
                                      std::vector<int>* order) const {
  if (!options_.prefix_batching || options_.batch_invariant) return;
  constexpr size_t kCompared = 4096;  // tokens: enough to tell prefixes apart, cheap to compare
  const auto history = [&](int i) -> std::span<const int32_t> {
    auto it = batch[i].session.empty() ? sessions_.end() : sessions_.find(batch[i].session);
    if (it == sessions_.end()) return {};
    const std::vector<int32_t>& t = it->second.tokens;
    return {t.data(), std::min(t.size(), kCompared)};
  };
  for (auto begin = order->begin(); begin != order->end();) {
    const auto end = std::find_if(begin, order->end(),
                                  [&](int i) { return algorithms[i] != algorithms[*begin]; });
    std::stable_sort(begin, end, [&](int a, int b) {
      const std::span<const int32_t> x = history(a), y = history(b);
      return std::lexicographical_compare(x.begin(), x.end(), y.begin(), y.end());
    });
    begin = end;
  }
}

// A prefill whose sequences reuse cached rows reads them in place from their blocks, as decode
// does, when the KV stays where it is (one rank, or pass-Q for every sequence): the ring gathers
// each step's rows, the blocks sequences share once, and attends to the shared rows for all their
// queries in one pass (attention::PlanPagedGather). Questions about one cached document then read
// and hold it once, not once each. A batch of fresh prompts keeps the per-layer gather (a pass-Q
// ring would gather its rows again every step).
bool LlamaModel::PrefillReadsKvInPlace(const Running& r) const {
  if (!options_.prefix_batching || options_.batch_invariant) return false;
  if (KvDtypeBytes(kv_->spec().dtype) != ElemBytes(backend_->compute_type())) return false;
  const bool kv_stays =
      backend_->cp().size() == 1 ||
      std::all_of(r.algorithms.begin(), r.algorithms.end(),
                  [](parallel::RingAlgorithm a) { return a == parallel::RingAlgorithm::kPassQ; });
  return kv_stays &&
         std::any_of(r.b.sequences.begin(), r.b.sequences.end(),
                     [](const sharding::SequenceRequest& s) { return s.cached_tokens > 0; });
}

// Every activation of a batch: its tensor, scratch slot, element type and shape.
std::vector<LlamaModel::Activation> LlamaModel::Activations(Running& r) const {
  const ModelConfig& c = config_;
  const int tp = backend_->tp().size();
  const int64_t hq = c.num_heads / tp, hkv = c.num_kv_heads / tp, hd = c.head_dim;
  const int64_t D = c.hidden_size, I = c.intermediate_size / tp;
  const int64_t T = r.b.layout.q_rows(), R = r.kv_in_place ? 0 : r.b.layout.kv_rows();
  const ElemType f32 = ElemType::kF32, i32 = ElemType::kI32, ct = backend_->compute_type();
  return {{&r.ids, kIds, i32, T, 1},
          {&r.positions, kPositions, i32, T, 1},
          {&r.x, kX, f32, T, D},
          {&r.h, kH, ct, T, D},
          {&r.q, kQ, ct, T, hq * hd},
          {&r.k, kK, ct, T, hkv * hd},
          {&r.v, kV, ct, T, hkv * hd},
          {&r.k_all, kKAll, ct, R, hkv * hd},
          {&r.v_all, kVAll, ct, R, hkv * hd},
          {&r.attn, kAttn, f32, T, hq * hd},
          {&r.lse, kLse, f32, T, hq},
          {&r.attn_compute, kAttnCompute, ct, T, hq * hd},
          {&r.proj, kProj, f32, T, D},
          {&r.gate, kGate, ct, T, I},
          {&r.up, kUp, ct, T, I}};
}

// Step 0a: the batch's activations must fit beside what the backend already holds, on every
// rank (agreed), before anything is allocated: a batch too large is refused, not a bad_alloc.
absl::Status LlamaModel::CheckActivationMemory(Running& r) {
  // A slot that grows gets a new buffer while the old one stays until the device is done with
  // it: its whole new size is needed, whatever the other slots hold (they stay theirs).
  int64_t need = 0;
  for (const Activation& a : Activations(r)) {
    const int64_t bytes = a.rows * a.cols * ElemBytes(a.type);
    if (bytes > backend_->ScratchBytesHeld(a.slot)) need += bytes;
  }
  return CheckFitsOnEveryRank(
      world_, "the batch's activations", need, [&] { return backend_->FreeMemoryBytes(); },
      "use more ranks (CP splits the tokens) or send fewer tokens per batch");
}

// This rank's attention heads (TP shards them), causal.
attention::AttentionShape LlamaModel::AttentionShapeOf() const {
  const int tp = backend_->tp().size();
  const int hd = config_.head_dim;
  return {.num_heads = config_.num_heads / tp,
          .num_kv_heads = config_.num_kv_heads / tp,
          .head_dim = hd,
          .softmax_scale = 1.0f / std::sqrt(float(hd)),
          .causal = true};
}

// Steps 1-2: the embedding and the layers, then one wait for the device.
absl::Status LlamaModel::Forward(Running& r, StepTimings& t,
                                 const std::function<void(int)>& progress) {
  ModelBackend& be = *backend_;
  const sharding::LocalLayout& layout = r.b.layout;
  CPFILL_ASSIGN_OR_RETURN(
      r.ring, parallel::MixedRing::Create(be.cp(), r.b.plan, AttentionShapeOf(), &be.ring_ops()));

  // Buffers for this batch, kept by the backend and grown if this batch is the largest so far.
  for (const Activation& a : Activations(r)) {
    CPFILL_ASSIGN_OR_RETURN(*a.tensor, be.Scratch(a.slot, a.type, a.rows, a.cols));
  }
  CPFILL_RETURN_IF_ERROR(be.Upload(r.b.local_ids.data(), &r.ids));
  CPFILL_RETURN_IF_ERROR(be.Upload(layout.q_positions.data(), &r.positions));

  // Every layer copies the same rows: this batch's new K/V into each request's blocks (after the
  // rows it held), then each request's whole K/V into the local layout for the ring.
  for (int s = 0; s < r.b.plan.num_sequences(); ++s) {
    if (layout.q_len[s] > 0) {
      r.new_rows.push_back({r.seq[s], r.rows_before[s], layout.q_len[s],
                            r.k.Rows(layout.q_offset[s], 1).data,
                            r.v.Rows(layout.q_offset[s], 1).data});
    }
    if (layout.kv_len[s] > 0 && !r.kv_in_place) {
      r.all_rows.push_back({r.seq[s], 0, layout.kv_len[s],
                            r.k_all.Rows(layout.kv_offset[s], 1).data,
                            r.v_all.Rows(layout.kv_offset[s], 1).data});
    }
  }

  if (r.kv_in_place) CPFILL_RETURN_IF_ERROR(UploadBlockTables(r));

  const attention::PrefixBatchCounts batched_before = be.ring_ops().prefix_batch_counts();
  t.host_plan_s = Since(r.start);
  const auto enqueue_start = Clock::now();
  absl::Status enqueued = EnqueueLayers(r, t, progress);
  t.host_enqueue_s = Since(enqueue_start);
  t.prefix_batch = be.ring_ops().prefix_batch_counts() - batched_before;
  if (absl::Status s = enqueued; !s.ok()) {
    // The layers before the failure are enqueued and may still write the KV blocks that the
    // caller's roll-back frees: wait for them (each wait has its deadline) before returning.
    r.ring->Finish().IgnoreError();
    be.Finish().IgnoreError();
    return s;
  }
  // The one host wait of the forward: the rings' (CP, with its deadline), then the backend's.
  CPFILL_RETURN_IF_ERROR(r.ring->Finish());
  CPFILL_RETURN_IF_ERROR(be.Finish());
  t.spans_origin_unix_s = be.PhasesOriginUnixS();
  return absl::OkStatus();
}

// The embedding and every layer, enqueued on the backend without a host wait; `progress(l)`
// once layer l is enqueued.
absl::Status LlamaModel::EnqueueLayers(Running& r, StepTimings& t,
                                       const std::function<void(int)>& progress) {
  ModelBackend& be = *backend_;
  CPFILL_RETURN_IF_ERROR(be.BeginPhase());
  CPFILL_RETURN_IF_ERROR(be.Embed(r.ids, be.weights().embedding, &r.x));
  CPFILL_RETURN_IF_ERROR(be.EndPhase(
      &t.embed_s, options_.record_spans ? AddSpan(t, "embedding", "compute") : nullptr));
  for (int l = 0; l < config_.num_layers; ++l) {
    CPFILL_RETURN_IF_ERROR(Layer(l, r, t));
    if (progress) progress(l);
  }
  return absl::OkStatus();
}

// The block tables of the batch's sequences that hold rows here, back to back, uploaded once
// for every layer (a block id names the same slot in each layer's pool). Built once per forward
// (the memory check and the upload both need them), under a fresh generation.
absl::Status LlamaModel::BuildBlockTables(Running& r) {
  if (r.table_generation != 0) return absl::OkStatus();
  CPFILL_CHECK_INTERNAL(KvDtypeBytes(kv_->spec().dtype) == ElemBytes(backend_->compute_type()),
                        "the KV cache's elements must be the attention's to be read in place");
  const sharding::LocalLayout& layout = r.b.layout;
  const int64_t block_tokens = kv_->spec().block_tokens;
  std::vector<int32_t>& table = r.host_block_table;
  table.clear();
  r.seq_kv_begin.clear();
  r.seq_table_begin.clear();
  for (int s = 0; s < r.b.plan.num_sequences(); ++s) {
    if (layout.kv_len[s] == 0) continue;
    const std::span<const int32_t> blocks = kv_->BlockTable(r.seq[s]);
    const int64_t used = (layout.kv_len[s] + block_tokens - 1) / block_tokens;
    CPFILL_CHECK_INTERNAL(static_cast<int64_t>(blocks.size()) >= used, "KV sequence ", r.seq[s],
                          " has ", blocks.size(), " blocks for ", layout.kv_len[s], " rows");
    r.seq_kv_begin.push_back(layout.kv_offset[s]);
    r.seq_table_begin.push_back(static_cast<int64_t>(table.size()));
    table.insert(table.end(), blocks.begin(), blocks.begin() + used);
  }
  r.table_generation = ++table_generations_;
  return absl::OkStatus();
}

// The rows one ring step gathers for a prefill over cached rows: one rank, its step's plan (the
// shared blocks once); a CP ring, every sequence's rows (its steps see subsets of the batch,
// whose runs may break). A step the ring reads in place instead (InPlaceBeatsGather) gathers
// nothing: the count is then too high, and a batch that fails the check on it is read in place.
int64_t LlamaModel::GatheredRows(const Running& r) const {
  const sharding::LocalLayout& layout = r.b.layout;
  int64_t rows = 0;
  if (backend_->cp().size() == 1) {
    std::vector<attention::SequenceSlice> slices;
    for (int s = 0; s < r.b.plan.num_sequences(); ++s) {
      if (layout.q_len[s] == 0 || layout.kv_len[s] == 0) continue;
      slices.push_back({.q_begin = layout.q_offset[s],
                        .q_len = layout.q_len[s],
                        .kv_begin = layout.kv_offset[s],
                        .kv_len = layout.kv_len[s]});
    }
    const attention::PagedKv paged = HostPagedKv(r);
    const attention::AttentionShape shape = AttentionShapeOf();
    rows = attention::PlanPagedGather(
               attention::FindSharedBlocks(shape, slices, paged,
                                           backend_->ring_ops().StepRule(shape, slices, paged)),
               paged, r.host_block_table)
               .rows;
  } else {
    for (int s = 0; s < r.b.plan.num_sequences(); ++s) rows += layout.kv_len[s];
  }
  return rows;
}

// Step 0c (a prefill that reads cached rows in place): what the ring gathers in one step
// (GatheredRows) must fit too, agreed by every rank. Where it does not, every rank's ring reads
// the blocks in place instead if all can (the Hopper kernel; slower than the gathered rows at
// 64-token blocks), else the batch is refused and its blocks given back.
absl::Status LlamaModel::CheckGatheredMemory(Running& r) {
  if (!r.kv_gathered) return absl::OkStatus();
  CPFILL_RETURN_IF_ERROR(BuildBlockTables(r));
  const parallel::RingOps& ops = backend_->ring_ops();
  const attention::AttentionShape shape = AttentionShapeOf();
  // A rank that reads in place (CPFILL_PAGED_PREFILL=in-place) needs nothing, but still takes
  // part in the agreement below: every rank runs the same collectives.
  const bool gathers = ops.GathersPagedPrefill(shape, HostPagedKv(r));
  const int64_t rows = gathers ? GatheredRows(r) : 0;
  const KvCacheSpec& spec = kv_->spec();
  const int64_t row_bytes =
      int64_t{spec.kv_heads} * spec.head_dim * ElemBytes(backend_->compute_type());
  absl::Status fits = CheckFitsOnEveryRank(
      world_, "the batch's cached K/V gathered for attention", rows * (2 * row_bytes + 4),
      [&] { return backend_->FreeMemoryBytes(); },
      "send fewer requests per batch, or use more ranks (CP splits the rows)");
  if (!absl::IsResourceExhausted(fits)) return fits;
  // Every rank saw the same shortfall: each reads its blocks in place instead, if all can.
  int64_t in_place = ops.CanReadPagedPrefillInPlace(shape, HostPagedKv(r)) ? 1 : 0;
  CPFILL_RETURN_IF_ERROR(
      world_.AllReduce(&in_place, 1, parallel::DataType::kInt64, parallel::ReduceOp::kMin));
  if (in_place == 0) return fits;
  r.prefill_in_place = true;
  return absl::OkStatus();
}

absl::Status LlamaModel::UploadBlockTables(Running& r) {
  CPFILL_RETURN_IF_ERROR(BuildBlockTables(r));
  const std::vector<int32_t>& table = r.host_block_table;
  const int64_t entries = static_cast<int64_t>(table.size());
  // Sized for the whole pool at once: a table that grows a block at a time (every few decode
  // steps) would otherwise regrow the scratch each time.
  CPFILL_ASSIGN_OR_RETURN(
      r.block_table,
      backend_->Scratch(kBlockTable, ElemType::kI32, std::max(entries, kv_->num_blocks()), 1));
  r.block_table.rows = entries;
  return entries == 0 ? absl::OkStatus() : backend_->Upload(table.data(), &r.block_table);
}

// The batch's block tables as the ring reads them, with the table in host memory (what
// prefix batching and the gather plan read); `table` is the caller's to set.
attention::PagedKv LlamaModel::HostPagedKv(const Running& r) const {
  return {.table = r.host_block_table.data(),
          .block_tokens = kv_->spec().block_tokens,
          .block_stride_bytes = kv_->spec().block_bytes(),
          .seq_kv_begin = r.seq_kv_begin,
          .seq_table_begin = r.seq_table_begin,
          .host_table = r.host_block_table,
          .generation = r.table_generation,
          .pool_blocks = kv_->num_blocks(),
          .prefill_in_place = r.prefill_in_place};
}

// Layer l's attention over the CP ring, enqueued without a host wait (Forward waits once): K/V
// from the rows gathered out of the cache, or read in place from this layer's pools through the
// block tables (decode steps).
absl::Status LlamaModel::AttentionRing(int l, Running& r) {
  parallel::RunOptions run{.wait = false};
  const void* k = r.k_all.data;
  const void* v = r.v_all.data;
  attention::PagedKv paged = HostPagedKv(r);
  paged.table = r.block_table.As<int32_t>();
  if (!options_.prefix_batching || options_.batch_invariant) paged.host_table = {};
  if (r.kv_in_place) {
    k = kv_->BlockAddress(l, 0, 0);
    v = kv_->BlockAddress(l, 1, 0);
    run.paged_kv = &paged;
  }
  return r.ring->Run(r.algorithms, r.q.data, k, v, r.attn.As<float>(), r.lse.As<float>(), nullptr,
                     nullptr, run);
}

// Decode steps with SparQ (PrefillRequest::sparq): the dense ring has run for the batch unless
// every sequence takes SparQ (Running::every_sparq); the rows of the sequences longer than k + l
// are written with SparQ's output, one exchange per distinct config (SparqAttentionCp takes
// one). The same on every rank: the configs and lengths travel with the step.
absl::Status LlamaModel::SparqDecode(int l, Running& r) {
  using attention::sparq::SparqConfig;
  std::vector<std::pair<SparqConfig, std::vector<int>>> groups;
  for (int s = 0; s < static_cast<int>(r.sparq.size()); ++s) {
    const sharding::SequenceRequest& q = r.b.sequences[s];
    if (!SparqAttends(r.sparq[s], q.cached_tokens + q.new_tokens)) continue;  // dense
    const SparqConfig& c = *r.sparq[s];
    auto same = [&](const auto& g) {
      return g.first.r == c.r && g.first.k == c.k && g.first.local_window == c.local_window &&
             g.first.oracle == c.oracle;
    };
    auto it = std::find_if(groups.begin(), groups.end(), same);
    if (it == groups.end()) it = groups.insert(groups.end(), {c, {}});
    it->second.push_back(s);
  }
  for (const auto& [config, seqs] : groups) CPFILL_RETURN_IF_ERROR(SparqGroup(l, r, config, seqs));
  return absl::OkStatus();
}

// SparQ over the CP group for `seqs` (plan indices) of layer l: each query (on the one CP rank
// that holds it this step) is summed into every rank's copy, each rank passes its own K/V rows
// with their global positions and V sums, and the merged output replaces the holder's row.
absl::Status LlamaModel::SparqGroup(int l, Running& r,
                                    const attention::sparq::SparqConfig& config,
                                    const std::vector<int>& seqs) {
  static ThreadPool pool(1);  // groups are few per step on the CPU backend; BLAS has the cores
  const sharding::LocalLayout& layout = r.b.layout;
  const attention::AttentionShape shape = AttentionShapeOf();
  const int64_t q_width = int64_t{shape.num_heads} * shape.head_dim;
  const int64_t kv_width = int64_t{shape.num_kv_heads} * shape.head_dim;
  const int64_t n = static_cast<int64_t>(seqs.size());
  // Kept across layers and steps (the model steps on one thread): fresh vectors of a sequence's
  // K/V each layer cost more in page faults and zeroing than the SparQ stages themselves.
  struct Scratch {
    std::vector<float> q, o, k, v, v_sum;
    std::vector<int32_t> k_pos;
  };
  static thread_local Scratch scratch;
  std::vector<float>& q = scratch.q;
  std::vector<float>& o = scratch.o;
  q.assign(n * q_width, 0.0f);  // summed over the CP group: zero where this rank has no query
  o.resize(n * q_width);
  std::vector<int64_t> kv_begin, kv_len, seq_len;
  int64_t rows = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int s = seqs[i];
    if (layout.q_len[s] > 0) {
      const float* src = r.q.Rows(layout.q_offset[s], 1).As<float>();
      std::copy(src, src + q_width, q.begin() + i * q_width);
    }
    kv_begin.push_back(rows);
    kv_len.push_back(layout.kv_len[s]);
    seq_len.push_back(r.b.sequences[s].cached_tokens + r.b.sequences[s].new_tokens);
    rows += layout.kv_len[s];
  }
  parallel::Communicator& cp = backend_->cp();
  if (cp.size() > 1) {
    CPFILL_RETURN_IF_ERROR(
        cp.AllReduce(q.data(), q.size(), parallel::DataType::kFloat32, parallel::ReduceOp::kSum));
  }
  // This rank's rows of each sequence, as the cache holds them (ascending positions, the order
  // of the layout's runs), their positions, and their V sums.
  const std::vector<int32_t> all_pos = sharding::ExpandPositions(layout.kv_runs);
  // Every row below is written before it is read (a sequence without rows here: V sum 0).
  std::vector<float>& k = scratch.k;
  std::vector<float>& v = scratch.v;
  std::vector<float>& v_sum = scratch.v_sum;
  std::vector<int32_t>& k_pos = scratch.k_pos;
  k.resize(rows * kv_width);
  v.resize(rows * kv_width);
  v_sum.assign(n * kv_width, 0.0f);
  k_pos.resize(rows);
  std::vector<KvCache::Rows> reads;
  for (int64_t i = 0; i < n; ++i) {
    const int s = seqs[i];
    if (kv_len[i] == 0) continue;
    reads.push_back({r.seq[s], 0, kv_len[i], k.data() + kv_begin[i] * kv_width,
                     v.data() + kv_begin[i] * kv_width});
    std::copy_n(all_pos.begin() + layout.kv_offset[s], kv_len[i], k_pos.begin() + kv_begin[i]);
    CPFILL_ASSIGN_OR_RETURN(std::span<const float> sum, kv_->VSum(l, r.seq[s]));
    std::copy(sum.begin(), sum.end(), v_sum.begin() + i * kv_width);
  }
  CPFILL_RETURN_IF_ERROR(kv_->Read(l, reads));
  const attention::sparq::SparqBatch batch{
      .shape = {shape.num_heads, shape.num_kv_heads, shape.head_dim},
      .config = config,
      .q = q.data(),
      .k = k.data(),
      .v = v.data(),
      .kv_begin = kv_begin,
      .kv_len = kv_len,
      .k_pos = k_pos.data(),
      .seq_len = seq_len,
      .v_sum = v_sum.data()};
  CPFILL_RETURN_IF_ERROR(parallel::SparqAttentionCp(
      cp, batch, parallel::SparqCpSelection::kGlobalTopK, o.data(), nullptr, &pool));
  for (int64_t i = 0; i < n; ++i) {
    const int s = seqs[i];
    if (layout.q_len[s] == 0) continue;
    std::copy_n(o.begin() + i * q_width, q_width, r.attn.Rows(layout.q_offset[s], 1).As<float>());
  }
  return absl::OkStatus();
}

// One decoder layer on this rank's rows, each phase timed on its own.
absl::Status LlamaModel::Layer(int l, Running& r, StepTimings& t) {
  ModelBackend& be = *backend_;
  const LayerTensors& w = be.weights().layers[l];
  const double eps = config_.rms_norm_eps;
  const int tp = be.tp().size();
  // A timed phase of this layer, on the timeline too when spans are recorded.
  const auto phase = [&](double& acc, const char* what,
                         const std::function<absl::Status()>& fn) -> absl::Status {
    CPFILL_RETURN_IF_ERROR(be.BeginPhase());
    CPFILL_RETURN_IF_ERROR(fn());
    const bool exchange = &acc == &t.allreduce_s;
    if (!options_.record_spans) return be.EndPhase(&acc);
    return be.EndPhase(
        &acc, AddSpan(t, absl::StrCat("layer ", l, " ", what), exchange ? "exchange" : "compute"));
  };
  // Row-parallel outputs are partial sums over the TP group: add them up in fp32.
  const auto all_reduce = [&]() -> absl::Status {
    if (tp == 1) return absl::OkStatus();
    return phase(t.allreduce_s, "all-reduce", [&] {
      return be.tp().AllReduce(r.proj.data, r.proj.numel(), parallel::DataType::kFloat32,
                               parallel::ReduceOp::kSum);
    });
  };

  // Attention block.
  CPFILL_RETURN_IF_ERROR(
      phase(t.other_s, "input norm", [&] { return be.RmsNorm(r.x, w.input_norm, eps, &r.h); }));
  CPFILL_RETURN_IF_ERROR(phase(t.gemm_s, "qkv", [&]() -> absl::Status {
    CPFILL_RETURN_IF_ERROR(be.Linear(r.h, w.wq, &r.q));
    CPFILL_RETURN_IF_ERROR(be.Linear(r.h, w.wk, &r.k));
    return be.Linear(r.h, w.wv, &r.v);
  }));
  CPFILL_RETURN_IF_ERROR(phase(t.other_s, "rope", [&]() -> absl::Status {
    CPFILL_RETURN_IF_ERROR(be.Rope(r.positions, config_.num_heads / tp, &r.q));
    return be.Rope(r.positions, config_.num_kv_heads / tp, &r.k);
  }));
  CPFILL_RETURN_IF_ERROR(phase(t.kv_s, "kv cache", [&]() -> absl::Status {
    CPFILL_RETURN_IF_ERROR(kv_->Write(l, r.new_rows));
    return kv_->Read(l, r.all_rows);  // nothing when decode reads the blocks in place
  }));
  const bool convert = be.compute_type() != ElemType::kF32;
  CPFILL_RETURN_IF_ERROR(phase(t.attention_s, "attention ring", [&]() -> absl::Status {
    // A decode step whose every sequence attends with SparQ skips the dense ring: SparqDecode
    // writes every row of r.attn (r.lse is not read after decode). A mixed batch still runs the
    // ring for all (decode reads K/V in place, which MixedRing takes as one ring only).
    if (!r.every_sparq) CPFILL_RETURN_IF_ERROR(AttentionRing(l, r));
    CPFILL_RETURN_IF_ERROR(SparqDecode(l, r));
    return convert ? be.Convert(r.attn, &r.attn_compute) : absl::OkStatus();
  }));
  CPFILL_RETURN_IF_ERROR(phase(t.gemm_s, "o proj", [&] {
    return be.Linear(convert ? r.attn_compute : r.attn, w.wo, &r.proj);
  }));
  CPFILL_RETURN_IF_ERROR(all_reduce());

  // MLP block.
  CPFILL_RETURN_IF_ERROR(phase(t.other_s, "residual + post norm", [&]() -> absl::Status {
    CPFILL_RETURN_IF_ERROR(be.Add(r.proj, &r.x));
    return be.RmsNorm(r.x, w.post_norm, eps, &r.h);
  }));
  CPFILL_RETURN_IF_ERROR(phase(t.gemm_s, "gate/up", [&]() -> absl::Status {
    CPFILL_RETURN_IF_ERROR(be.Linear(r.h, w.w_gate, &r.gate));
    return be.Linear(r.h, w.w_up, &r.up);
  }));
  CPFILL_RETURN_IF_ERROR(phase(t.other_s, "swiglu", [&] { return be.SwiGlu(r.up, &r.gate); }));
  CPFILL_RETURN_IF_ERROR(
      phase(t.gemm_s, "down", [&] { return be.Linear(r.gate, w.w_down, &r.proj); }));
  CPFILL_RETURN_IF_ERROR(all_reduce());
  return phase(t.other_s, "residual", [&] { return be.Add(r.proj, &r.x); });
}

// Step 3: at the last positions, logits (this TP rank's vocabulary slice) or the tokens drawn
// from them in place (PrefillRequest::draw), on world rank 0.
absl::StatusOr<std::vector<SequenceOutput>> LlamaModel::LastLogits(
    const std::vector<PrefillRequest>& batch, const Running& r, StepTimings& t) {
  ModelBackend& be = *backend_;
  const auto t0 = Clock::now();
  const int64_t D = config_.hidden_size, V = config_.vocab_size / be.tp().size();
  const auto rows = LastPositionRows(r.b);
  // Every rank knows the whole batch, so all agree on which gathers run.
  std::vector<bool> wants_logits;
  for (const PrefillRequest& req : batch) wants_logits.push_back(!req.draw.has_value());
  const bool any_logits = std::count(wants_logits.begin(), wants_logits.end(), true) > 0;
  const bool any_draws = std::count(wants_logits.begin(), wants_logits.end(), false) > 0;
  std::span<float> logits;  // of the rows that want them, in logits_host_
  std::vector<std::pair<int, int64_t>> logit_rows, drawn;  // (sequence, row or token)
  if (!rows.empty()) {
    const int64_t n = static_cast<int64_t>(rows.size());
    std::vector<int64_t> row_index;
    for (const auto& [seq, row] : rows) row_index.push_back(row);
    CPFILL_ASSIGN_OR_RETURN(Tensor last, be.Scratch(kLast, ElemType::kF32, n, D));
    CPFILL_ASSIGN_OR_RETURN(Tensor normed, be.Scratch(kNormed, be.compute_type(), n, D));
    CPFILL_ASSIGN_OR_RETURN(Tensor out, be.Scratch(kLogits, ElemType::kF32, n, V));
    CPFILL_RETURN_IF_ERROR(be.GatherRows(r.x, row_index, &last));
    CPFILL_RETURN_IF_ERROR(
        be.RmsNorm(last, be.weights().final_norm, config_.rms_norm_eps, &normed));
    CPFILL_RETURN_IF_ERROR(be.Linear(normed, be.weights().lm_head, &out));
    CPFILL_ASSIGN_OR_RETURN(drawn, DrawInPlace(batch, rows, out));
    if (std::any_of(rows.begin(), rows.end(), [&](auto& row) { return wants_logits[row.first]; })) {
      // Kept between steps: a fresh buffer would fault in its pages on every decode step.
      logits_host_.resize(std::max(logits_host_.size(), rows.size() * V));
      logits = std::span<float>(logits_host_.data(), rows.size() * V);
      CPFILL_RETURN_IF_ERROR(be.Download(out, logits.data()));
      logit_rows = KeepWantedRows(rows, wants_logits, V, &logits);
    }
  }
  const int num_sequences = r.b.plan.num_sequences();
  std::vector<SequenceOutput> result(num_sequences);
  if (any_logits) {
    CPFILL_ASSIGN_OR_RETURN(
        result, GatherLastLogits(config_, num_sequences, logit_rows, logits, wants_logits,
                                 be.tp().rank(), be.tp().size(), world_));
  }
  if (any_draws) {
    CPFILL_RETURN_IF_ERROR(GatherDrawnTokens(be.tp().rank() == 0 ? drawn : decltype(drawn){},
                                             wants_logits, world_, &result));
  }
  t.lm_head_s += Since(t0);
  return result;
}

// After LastLogits (its scratch is free again): this rank's positions of the requests that ask
// for prompt logprobs, except each one's last (it scores no prompt token), through the final
// norm and the LM head a chunk at a time; their partial log-softmax records (prompt_logprobs.h)
// go to world rank 0, which merges the vocabulary slices. Every rank knows the batch, so all
// take part or none.
absl::Status LlamaModel::PromptLogprobs(const std::vector<PrefillRequest>& batch,
                                        const Running& r, StepTimings& t,
                                        std::vector<SequenceOutput>* out) {
  if (std::none_of(batch.begin(), batch.end(),
                   [](const PrefillRequest& q) { return q.prompt_logprobs >= 0; })) {
    return absl::OkStatus();
  }
  ModelBackend& be = *backend_;
  const auto t0 = Clock::now();
  const int64_t D = config_.hidden_size, V = config_.vocab_size / be.tp().size();
  std::vector<std::pair<int, int64_t>> rows;  // (sequence, local row)
  for (int s = 0; s < r.b.plan.num_sequences(); ++s) {
    if (batch[s].prompt_logprobs < 0) continue;
    const int64_t last = r.b.sequences[s].cached_tokens + r.b.sequences[s].new_tokens - 1;
    for (int64_t i = 0; i < r.b.layout.q_len[s]; ++i) {
      const int64_t row = r.b.layout.q_offset[s] + i;
      if (r.b.layout.q_positions[row] < last) rows.push_back({s, row});
    }
  }
  std::vector<double> mine;
  std::vector<float> host;
  for (size_t begin = 0; begin < rows.size(); begin += kPromptChunkRows) {
    const int64_t n = std::min<int64_t>(kPromptChunkRows, rows.size() - begin);
    std::vector<int64_t> row_index;
    for (int64_t i = 0; i < n; ++i) row_index.push_back(rows[begin + i].second);
    CPFILL_ASSIGN_OR_RETURN(Tensor last, be.Scratch(kLast, ElemType::kF32, n, D));
    CPFILL_ASSIGN_OR_RETURN(Tensor normed, be.Scratch(kNormed, be.compute_type(), n, D));
    CPFILL_ASSIGN_OR_RETURN(Tensor logits, be.Scratch(kLogits, ElemType::kF32, n, V));
    CPFILL_RETURN_IF_ERROR(be.GatherRows(r.x, row_index, &last));
    CPFILL_RETURN_IF_ERROR(
        be.RmsNorm(last, be.weights().final_norm, config_.rms_norm_eps, &normed));
    CPFILL_RETURN_IF_ERROR(be.Linear(normed, be.weights().lm_head, &logits));
    host.resize(static_cast<size_t>(n * V));
    CPFILL_RETURN_IF_ERROR(be.Download(logits, host.data()));
    for (int64_t i = 0; i < n; ++i) {
      const auto [seq, row] = rows[begin + i];
      const int64_t position = r.b.layout.q_positions[row];
      const int32_t target = batch[seq].tokens[position + 1 - r.b.sequences[seq].cached_tokens];
      AppendSliceScores(std::span<const float>(host).subspan(i * V, V), be.tp().rank() * V, seq,
                        position, target, batch[seq].prompt_logprobs, &mine);
    }
  }
  CPFILL_ASSIGN_OR_RETURN(std::vector<double> all, GatherToRoot(mine, world_));
  t.lm_head_s += Since(t0);
  if (world_.rank() != 0) return absl::OkStatus();
  std::vector<int64_t> cached;
  for (const sharding::SequenceRequest& q : r.b.sequences) cached.push_back(q.cached_tokens);
  return MergeSliceScores(all, batch, cached, out);
}

// The tokens of the rows whose requests draw in place, as (sequence, token): the TP group's
// vocabulary slices all-gathered first, so each TP rank draws from whole rows.
absl::StatusOr<std::vector<std::pair<int, int64_t>>> LlamaModel::DrawInPlace(
    const std::vector<PrefillRequest>& batch, const std::vector<std::pair<int, int64_t>>& rows,
    const Tensor& logits) {
  ModelBackend& be = *backend_;
  std::vector<int64_t> draw_rows;
  std::vector<TokenDraw> draws;
  std::vector<std::pair<int, int64_t>> drawn;
  for (size_t i = 0; i < rows.size(); ++i) {
    const std::optional<TokenDraw>& d = batch[rows[i].first].draw;
    if (!d.has_value()) continue;
    draw_rows.push_back(static_cast<int64_t>(i));
    draws.push_back(*d);
    drawn.push_back({rows[i].first, -1});
  }
  if (draws.empty()) return drawn;
  Tensor whole = logits;
  const int tp = be.tp().size();
  if (tp > 1) {
    CPFILL_ASSIGN_OR_RETURN(
        whole, be.Scratch(kLogitsWhole, ElemType::kF32, tp * logits.rows, logits.cols));
    CPFILL_RETURN_IF_ERROR(be.tp().AllGather(logits.data, logits.bytes(), whole.data));
  }
  std::vector<int32_t> ids;
  CPFILL_RETURN_IF_ERROR(be.DrawTokens(whole, tp, draw_rows, draws, &ids));
  for (size_t i = 0; i < drawn.size(); ++i) drawn[i].second = ids[i];
  return drawn;
}

// Step 4: the sessions now hold this turn too; requests without one give their blocks back.
void LlamaModel::Commit(const std::vector<PrefillRequest>& batch, const Running& r) {
  for (int s = 0; s < r.b.plan.num_sequences(); ++s) {
    if (batch[s].session.empty()) {
      kv_->Release(r.seq[s]);
      continue;
    }
    Session& session = sessions_[batch[s].session];
    session.seq = r.seq[s];
    session.where = SessionAfter(r.b, s);
    session.tokens.insert(session.tokens.end(), batch[s].tokens.begin(), batch[s].tokens.end());
  }
}

}  // namespace cpfill::runtime
