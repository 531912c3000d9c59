#include "parallel/ring_attention.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace cpfill::parallel {
namespace {

using attention::AttentionParams;
using attention::AttentionShape;
using attention::kPadPosition;
using attention::PartialView;
using attention::SequenceSlice;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

}  // namespace

// ---- CPU kernels -------------------------------------------------------------------------

absl::Status CpuAttentionKernels::Attend(const AttentionParams& p) {
  return attention::PartialAttentionCpu(p, pool_);
}

absl::Status CpuAttentionKernels::MergeInto(const AttentionShape& shape, int64_t rows, float* o_acc,
                                            float* lse_acc, const float* o, const float* lse) {
  return attention::MergeInto(shape, rows, o_acc, lse_acc, o, lse, pool_);
}

absl::Status CpuAttentionKernels::Merge(const AttentionShape& shape, int64_t rows,
                                        std::span<const PartialView> parts, float* o, float* lse) {
  return attention::MergePartials(shape, rows, parts, o, lse, pool_);
}

// ---- set-up ------------------------------------------------------------------------------

RingAttention::RingAttention(Communicator& cp, const sharding::ShardPlan& plan,
                             const AttentionShape& shape, AttentionKernels* kernels)
    : cp_(cp),
      ring_plan_(plan, cp.rank(), shape.causal),
      shape_(shape),
      kernels_(kernels),
      cp_rank_(cp.rank()),
      cp_size_(cp.size()) {}

absl::StatusOr<std::unique_ptr<RingAttention>> RingAttention::Create(
    Communicator& cp, const sharding::ShardPlan& plan, const AttentionShape& shape,
    AttentionKernels* kernels) {
  CPFILL_CHECK_ARG(kernels != nullptr, "ring attention needs attention kernels");
  CPFILL_CHECK_ARG(plan.cp_size == cp.size(), "the shard plan is for CP", plan.cp_size,
                   " but the CP ring has ", cp.size(), " ranks");
  CPFILL_CHECK_ARG(shape.num_heads > 0 && shape.num_kv_heads > 0 && shape.head_dim > 0 &&
                       shape.num_heads % shape.num_kv_heads == 0,
                   "attention shape: ", shape.num_heads, " query heads, ", shape.num_kv_heads,
                   " KV heads, head dim ", shape.head_dim,
                   " (heads must be positive and query heads a multiple of KV heads)");
  return std::unique_ptr<RingAttention>(new RingAttention(cp, plan, shape, kernels));
}

// ---- message packing ---------------------------------------------------------------------

MessageLayout RingAttention::KvMessage() const {
  const size_t row = static_cast<size_t>(shape_.num_kv_heads) * shape_.head_dim * sizeof(float);
  return MessageLayout::Make(ring_plan_.kv_slots_total(), row, row);
}

MessageLayout RingAttention::QMessage() const {
  const size_t row = static_cast<size_t>(shape_.num_heads) * shape_.head_dim * sizeof(float);
  return MessageLayout::Make(ring_plan_.q_slots_total(), row, 0);
}

void RingAttention::PackKv(const float* k, const float* v, HostBuffer& msg) const {
  const size_t row = static_cast<size_t>(shape_.num_kv_heads) * shape_.head_dim;
  const MessageLayout m = KvMessage();
  float* mk = msg.As<float>(m.a_offset);
  float* mv = msg.As<float>(m.b_offset);
  int32_t* mpos = msg.As<int32_t>(m.pos_offset);
  const sharding::LocalLayout& layout = ring_plan_.layout();
  for (int s = 0; s < ring_plan_.num_sequences(); ++s) {
    const int64_t n = layout.kv_len[s], src = layout.kv_offset[s];
    const int64_t dst = ring_plan_.kv_slot_offset(s), pad = ring_plan_.kv_slots(s) - n;
    std::memcpy(mk + dst * row, k + src * row, n * row * sizeof(float));
    std::memcpy(mv + dst * row, v + src * row, n * row * sizeof(float));
    std::memcpy(mpos + dst, layout.kv_positions.data() + src, n * sizeof(int32_t));
    // Padding slots may still hold a peer's keys from an earlier exchange: clear them.
    std::memset(mk + (dst + n) * row, 0, pad * row * sizeof(float));
    std::memset(mv + (dst + n) * row, 0, pad * row * sizeof(float));
    std::fill(mpos + dst + n, mpos + dst + n + pad, kPadPosition);
  }
}

void RingAttention::PackQ(const float* q, HostBuffer& msg) const {
  const size_t row = static_cast<size_t>(shape_.num_heads) * shape_.head_dim;
  const MessageLayout m = QMessage();
  float* mq = msg.As<float>(m.a_offset);
  int32_t* mpos = msg.As<int32_t>(m.pos_offset);
  const sharding::LocalLayout& layout = ring_plan_.layout();
  for (int s = 0; s < ring_plan_.num_sequences(); ++s) {
    const int64_t n = layout.q_len[s], src = layout.q_offset[s];
    const int64_t dst = ring_plan_.q_slot_offset(s), pad = ring_plan_.q_slots(s) - n;
    std::memcpy(mq + dst * row, q + src * row, n * row * sizeof(float));
    std::memcpy(mpos + dst, layout.q_positions.data() + src, n * sizeof(int32_t));
    std::memset(mq + (dst + n) * row, 0, pad * row * sizeof(float));
    std::fill(mpos + dst + n, mpos + dst + n + pad, kPadPosition);
  }
}

namespace {
void EnsureSize(HostBuffer& b, size_t bytes) {
  if (b.size() != bytes) b.Resize(bytes);
}
}  // namespace

// ---- the ring step's exchange, shared by pass-KV and pass-Q --------------------------------

absl::StatusOr<std::unique_ptr<PendingExchange>> RingAttention::StartExchange(
    int step_index, int cur, size_t bytes, RingStepTiming* step) {
  // After the last step every rank has seen every message: nothing more to pass on.
  if (step_index + 1 >= cp_size_) return std::unique_ptr<PendingExchange>();
  step->exchange_bytes = static_cast<int64_t>(bytes);
  return cp_.StartRingExchange(msg_[cur].data(), msg_[1 - cur].data(), bytes);
}

absl::Status RingAttention::FinishExchange(PendingExchange* exchange, RingStepTiming* step) {
  if (exchange == nullptr) return absl::OkStatus();
  auto w0 = Clock::now();
  CPFILL_RETURN_IF_ERROR(exchange->Wait());
  step->wait_s = Seconds(w0);  // exposed: compute had finished and waited this long
  step->transfer_s = exchange->transfer_s();
  return absl::OkStatus();
}

// ---- pass-KV (Alg. 2) --------------------------------------------------------------------

absl::Status RingAttention::RunPassKV(const float* q, const float* k, const float* v, float* o,
                                      float* lse, RingTimings* t) {
  const int n = cp_size_, me = cp_rank_;
  const MessageLayout m = KvMessage();
  const sharding::LocalLayout& layout = ring_plan_.layout();
  const size_t q_row = static_cast<size_t>(shape_.num_heads) * shape_.head_dim;
  const int64_t q_rows = layout.q_rows();
  EnsureSize(msg_[0], m.bytes);
  EnsureSize(msg_[1], m.bytes);
  EnsureSize(step_out_, q_rows * (q_row + shape_.num_heads) * sizeof(float));
  float* step_o = step_out_.As<float>(0);
  float* step_lse = step_o + q_rows * q_row;

  auto t0 = Clock::now();
  PackKv(k, v, msg_[0]);  // KV_k^k: this rank's KV, padded to L^i per sequence
  t->pack_s += Seconds(t0);

  std::vector<SequenceSlice> slices;
  int cur = 0;
  for (int j = 0; j < n; ++j) {
    RingStepTiming step;
    step.step = j;
    step.source_cp_rank = (me - j + n) % n;  // s: whose KV this rank holds at step j
    // Step j.1: pass the KV we hold to the next rank, receive the previous rank's (not after
    // the last step: every KV has then been seen).
    CPFILL_ASSIGN_OR_RETURN(std::unique_ptr<PendingExchange> exchange,
                            StartExchange(j, cur, m.bytes, &step));
    // Step j.2: O_k^s = GQA(Q_k, KV^s), overlapping the exchange; sequences whose keys the
    // causal mask hides from all of our queries are left out.
    auto c0 = Clock::now();
    ring_plan_.PassKvSlices(step.source_cp_rank, &slices, &step);
    AttentionParams p{.shape = shape_,
                      .q = q,
                      .q_pos = layout.q_positions.data(),
                      .q_tokens = q_rows,
                      .k = msg_[cur].As<float>(m.a_offset),
                      .v = msg_[cur].As<float>(m.b_offset),
                      .k_pos = msg_[cur].As<int32_t>(m.pos_offset),
                      .kv_tokens = ring_plan_.kv_slots_total(),
                      .slices = slices.data(),
                      .num_slices = static_cast<int64_t>(slices.size()),
                      .o = j == 0 ? o : step_o,
                      .lse = j == 0 ? lse : step_lse};
    CPFILL_RETURN_IF_ERROR(kernels_->Attend(p));
    // Step j.3: fold O_k^s into the running output (the merge of App. B, one part at a time).
    if (j > 0) {
      CPFILL_RETURN_IF_ERROR(kernels_->MergeInto(shape_, q_rows, o, lse, step_o, step_lse));
    }
    step.compute_s = Seconds(c0);
    // Step j.4: the next KV must have arrived before it is computed on.
    CPFILL_RETURN_IF_ERROR(FinishExchange(exchange.get(), &step));
    cur = 1 - cur;
    StepDone(t, step, n);
  }
  return absl::OkStatus();
}

// ---- pass-Q (Alg. 3) ---------------------------------------------------------------------

absl::Status RingAttention::RunPassQ(const float* q, const float* k, const float* v, float* o,
                                     float* lse, RingTimings* t) {
  const int n = cp_size_, me = cp_rank_;
  const int heads = shape_.num_heads;
  const MessageLayout m = QMessage();
  const sharding::LocalLayout& layout = ring_plan_.layout();
  const size_t q_row = static_cast<size_t>(heads) * shape_.head_dim;
  const int64_t slots = ring_plan_.q_slots_total();
  // A partial block: [O: q slots x H x D][LSE: q slots x H], all fp32.
  const size_t block_floats = slots * (q_row + heads);
  const size_t block_bytes = block_floats * sizeof(float);
  EnsureSize(msg_[0], m.bytes);
  EnsureSize(msg_[1], m.bytes);
  EnsureSize(partials_, n * block_bytes);
  EnsureSize(received_, n * block_bytes);
  EnsureSize(merged_, block_bytes);
  float* partials = partials_.As<float>(0);
  float* received = received_.As<float>(0);

  auto t0 = Clock::now();
  PackQ(q, msg_[0]);  // Q_k^k
  t->pack_s += Seconds(t0);

  std::vector<SequenceSlice> slices;
  int cur = 0;
  for (int j = 0; j < n; ++j) {
    RingStepTiming step;
    step.step = j;
    step.source_cp_rank = (me - j + n) % n;  // s: whose queries this rank holds at step j
    const int src = step.source_cp_rank;
    // Step j.1: pass the queries we hold on; receive the previous rank's.
    CPFILL_ASSIGN_OR_RETURN(std::unique_ptr<PendingExchange> exchange,
                            StartExchange(j, cur, m.bytes, &step));
    // Step j.2: O_s^k = GQA(Q^s, KV_k) into the partial block destined for rank s.
    auto c0 = Clock::now();
    ring_plan_.PassQSlices(src, &slices, &step);
    float* block = partials + src * block_floats;
    AttentionParams p{.shape = shape_,
                      .q = msg_[cur].As<float>(m.a_offset),
                      .q_pos = msg_[cur].As<int32_t>(m.pos_offset),
                      .q_tokens = slots,
                      .k = k,
                      .v = v,
                      .k_pos = layout.kv_positions.data(),
                      .kv_tokens = layout.kv_rows(),
                      .slices = slices.data(),
                      .num_slices = static_cast<int64_t>(slices.size()),
                      .o = block,
                      .lse = block + slots * q_row};
    CPFILL_RETURN_IF_ERROR(kernels_->Attend(p));
    step.compute_s = Seconds(c0);
    CPFILL_RETURN_IF_ERROR(FinishExchange(exchange.get(), &step));
    cur = 1 - cur;
    StepDone(t, step, n);
  }

  // Step N: every partial goes home. Block s of `partials` (our KV against rank s's queries)
  // goes to rank s; block p of `received` is our queries against rank p's KV. Our own block
  // stays where it is.
  auto a0 = Clock::now();
  std::vector<size_t> send_bytes(n, block_bytes), offsets(n);
  for (int p = 0; p < n; ++p) offsets[p] = p * block_bytes;
  send_bytes[me] = 0;
  CPFILL_RETURN_IF_ERROR(
      cp_.AllToAll(partials, send_bytes, offsets, received, send_bytes, offsets));
  t->all_to_all_s = Seconds(a0);
  t->all_to_all_bytes = static_cast<int64_t>((n - 1) * block_bytes);

  // Step N+1: O_k = merge over s of O_k^s (App. B eq. 4), then back to local row order.
  auto m0 = Clock::now();
  std::vector<PartialView> parts;
  for (int p = 0; p < n; ++p) {
    const float* b = (p == me ? partials : received) + p * block_floats;
    parts.push_back({.o = b, .lse = b + slots * q_row});
  }
  float* merged_o = merged_.As<float>(0);
  float* merged_lse = merged_o + slots * q_row;
  CPFILL_RETURN_IF_ERROR(kernels_->Merge(shape_, slots, parts, merged_o, merged_lse));
  t->merge_s = Seconds(m0);

  auto u0 = Clock::now();
  for (int s = 0; s < ring_plan_.num_sequences(); ++s) {
    const int64_t rows = layout.q_len[s];
    std::memcpy(o + layout.q_offset[s] * q_row, merged_o + ring_plan_.q_slot_offset(s) * q_row,
                rows * q_row * sizeof(float));
    std::memcpy(lse + layout.q_offset[s] * heads, merged_lse + ring_plan_.q_slot_offset(s) * heads,
                rows * heads * sizeof(float));
  }
  t->pack_s += Seconds(u0);
  return absl::OkStatus();
}

// ---- all-gather KV (baseline) ------------------------------------------------------------

absl::Status RingAttention::RunAllGather(const float* q, const float* k, const float* v, float* o,
                                         float* lse, RingTimings* t) {
  const int n = cp_size_;
  const MessageLayout m = KvMessage();
  const sharding::LocalLayout& layout = ring_plan_.layout();
  const size_t kv_row = static_cast<size_t>(shape_.num_kv_heads) * shape_.head_dim;
  EnsureSize(msg_[0], m.bytes);
  EnsureSize(gathered_, n * m.bytes);
  EnsureSize(gathered_kv_, n * m.bytes);

  auto t0 = Clock::now();
  PackKv(k, v, msg_[0]);
  t->pack_s += Seconds(t0);
  auto g0 = Clock::now();
  CPFILL_RETURN_IF_ERROR(cp_.AllGather(msg_[0].data(), m.bytes, gathered_.data()));
  t->all_gather_s = Seconds(g0);

  // Repack so each sequence's keys from all ranks sit side by side: sequence i occupies
  // N * L^i slots starting at N * kv_slot_offset(i); padding keeps position -1.
  auto r0 = Clock::now();
  const MessageLayout g = MessageLayout::Make(n * ring_plan_.kv_slots_total(),
                                              kv_row * sizeof(float), kv_row * sizeof(float));
  float* gk = gathered_kv_.As<float>(g.a_offset);
  float* gv = gathered_kv_.As<float>(g.b_offset);
  int32_t* gpos = gathered_kv_.As<int32_t>(g.pos_offset);
  for (int p = 0; p < n; ++p) {
    const float* bk = gathered_.As<float>(p * m.bytes + m.a_offset);
    const float* bv = gathered_.As<float>(p * m.bytes + m.b_offset);
    const int32_t* bpos = gathered_.As<int32_t>(p * m.bytes + m.pos_offset);
    for (int s = 0; s < ring_plan_.num_sequences(); ++s) {
      const int64_t src = ring_plan_.kv_slot_offset(s), len = ring_plan_.kv_slots(s);
      const int64_t dst = n * ring_plan_.kv_slot_offset(s) + p * len;
      std::memcpy(gk + dst * kv_row, bk + src * kv_row, len * kv_row * sizeof(float));
      std::memcpy(gv + dst * kv_row, bv + src * kv_row, len * kv_row * sizeof(float));
      std::memcpy(gpos + dst, bpos + src, len * sizeof(int32_t));
    }
  }
  t->pack_s += Seconds(r0);

  RingStepTiming step;
  auto c0 = Clock::now();
  std::vector<SequenceSlice> slices;
  ring_plan_.AllGatherSlices(&slices);
  AttentionParams p{.shape = shape_,
                    .q = q,
                    .q_pos = layout.q_positions.data(),
                    .q_tokens = layout.q_rows(),
                    .k = gk,
                    .v = gv,
                    .k_pos = gpos,
                    .kv_tokens = n * ring_plan_.kv_slots_total(),
                    .slices = slices.data(),
                    .num_slices = static_cast<int64_t>(slices.size()),
                    .o = o,
                    .lse = lse};
  step.visible_pairs = ring_plan_.AllGatherVisiblePairs();
  CPFILL_RETURN_IF_ERROR(kernels_->Attend(p));
  step.compute_s = Seconds(c0);
  StepDone(t, step, 1);
  return absl::OkStatus();
}

void RingAttention::StepDone(RingTimings* t, const RingStepTiming& step, int num_steps) {
  t->visible_pairs += step.visible_pairs;
  t->steps.push_back(step);
  if (on_step_) on_step_(step, num_steps);
}

absl::Status RingAttention::Run(RingAlgorithm algorithm, const float* q, const float* k,
                                const float* v, float* o, float* lse, RingTimings* timings,
                                StepCallback on_step) {
  on_step_ = std::move(on_step);
  RingTimings local;
  RingTimings* t = timings ? timings : &local;
  *t = RingTimings{};
  t->algorithm = algorithm;
  auto t0 = Clock::now();
  absl::Status status;
  switch (algorithm) {
    case RingAlgorithm::kPassKV:
      status = RunPassKV(q, k, v, o, lse, t);
      break;
    case RingAlgorithm::kPassQ:
      status = RunPassQ(q, k, v, o, lse, t);
      break;
    case RingAlgorithm::kAllGather:
      status = RunAllGather(q, k, v, o, lse, t);
      break;
  }
  t->total_s = Seconds(t0);
  return status;
}

absl::Status SingleRankAttention(const std::vector<sharding::SequenceRequest>& sequences,
                                 const AttentionShape& shape, const float* q, const float* k,
                                 const float* v, float* o, float* lse, AttentionKernels* kernels) {
  std::vector<SequenceSlice> slices;
  std::vector<int32_t> q_pos, k_pos;
  for (const auto& s : sequences) {
    slices.push_back({.q_begin = static_cast<int64_t>(q_pos.size()),
                      .q_len = s.new_tokens,
                      .kv_begin = static_cast<int64_t>(k_pos.size()),
                      .kv_len = s.cached_tokens + s.new_tokens});
    for (int64_t i = 0; i < s.new_tokens; ++i) q_pos.push_back(s.cached_tokens + i);
    for (int64_t i = 0; i < s.cached_tokens + s.new_tokens; ++i) k_pos.push_back(i);
  }
  AttentionParams p{.shape = shape,
                    .q = q,
                    .q_pos = q_pos.data(),
                    .q_tokens = static_cast<int64_t>(q_pos.size()),
                    .k = k,
                    .v = v,
                    .k_pos = k_pos.data(),
                    .kv_tokens = static_cast<int64_t>(k_pos.size()),
                    .slices = slices.data(),
                    .num_slices = static_cast<int64_t>(slices.size()),
                    .o = o,
                    .lse = lse};
  return kernels->Attend(p);
}

}  // namespace cpfill::parallel
