#include "parallel/ring_attention.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "base/wall_clock.h"

namespace cpfill::parallel {
namespace {

using attention::AttentionParams;
using attention::AttentionShape;
using attention::PartialView;
using attention::SequenceSlice;
using Clock = std::chrono::steady_clock;

// A row of K or V on the CPU backend (fp32).
int64_t RowBytes(const AttentionShape& shape) {
  return int64_t{shape.num_kv_heads} * shape.head_dim * static_cast<int64_t>(sizeof(float));
}

// The CPU's block table (host memory) as far as a step's slices read it.
std::span<const int32_t> TableSpan(const attention::PagedKv& paged,
                                   std::span<const SequenceSlice> slices) {
  int64_t end = 0;
  for (const SequenceSlice& s : slices) {
    if (s.q_len == 0 || s.kv_len == 0) continue;
    end = std::max(end, paged.TableBegin(s.kv_begin) +
                            (s.kv_len + paged.block_tokens - 1) / paged.block_tokens);
  }
  return {paged.table, static_cast<size_t>(end)};
}

// A profiler range for the life of a scope (RingOps::PushRange).
class ProfilerRange {
 public:
  ProfilerRange(RingOps& ops, const std::string& name) : ops_(ops) { ops_.PushRange(name.c_str()); }
  ~ProfilerRange() { ops_.PopRange(); }
  ProfilerRange(const ProfilerRange&) = delete;
  ProfilerRange& operator=(const ProfilerRange&) = delete;

 private:
  RingOps& ops_;
};

double SecondsSince(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// Marks a run takes: three per ring step and a few around packing, exchanges and merges.
int MarksFor(int num_steps) { return 3 * num_steps + 8; }

// Position -1 (kPadPosition) as a byte pattern, so a fill can write it.
constexpr uint8_t kPadPositionByte = 0xFF;
static_assert(attention::kPadPosition == -1, "padding positions are filled with 0xFF bytes");

bool SameSlices(std::span<const SequenceSlice> a, std::span<const SequenceSlice> b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end());
}

bool SameSpan(std::span<const int32_t> a, std::span<const int32_t> b) {
  return a.data() == b.data() && a.size() == b.size();
}

// Plans one generation keeps: a CP ring's distinct steps (a pass-Q step per source rank).
constexpr size_t kMaxStepPlans = 16;

}  // namespace

// ---- Prefix batching's plans -------------------------------------------------------------

const RingOps::PagedStepPlan& RingOps::PlanPagedStep(const RingStepArgs& a,
                                                     std::span<const int32_t> table, bool gather,
                                                     const attention::WideRootRule& wide) {
  const attention::PagedKv& paged = *a.paged_kv;
  const uint64_t generation = paged.generation;
  if (generation != 0) {
    for (const CachedStepPlan& c : step_plans_) {
      if (c.generation == generation && c.gather == gather && c.wide == wide &&
          c.shape == a.shape && SameSpan(c.table, table) &&
          SameSpan(c.host_table, paged.host_table) && SameSlices(c.slices, a.slices) &&
          SameSlices(c.keyless, a.keyless)) {
        return c.plan;
      }
    }
  }
  if (step_plans_.size() >= kMaxStepPlans ||
      (!step_plans_.empty() && step_plans_.front().generation != generation)) {
    step_plans_.clear();
  }
  CachedStepPlan& c = step_plans_.emplace_back();
  c.generation = generation;
  c.host_table = paged.host_table;
  c.table = table;
  c.slices.assign(a.slices.begin(), a.slices.end());
  c.keyless.assign(a.keyless.begin(), a.keyless.end());
  c.gather = gather;
  c.wide = wide;
  c.shape = a.shape;
  c.plan.id = ++last_plan_id_;
  c.plan.generation = generation;
  c.plan.tree = attention::FindSharedBlocks(a.shape, a.slices, paged,
                                            StepRule(a.shape, a.slices, paged), a.keyless);
  if (gather) {
    c.plan.gather = attention::PlanPagedGather(c.plan.tree, paged, table);
  } else if (wide.max_rows > 0) {
    c.plan.wide = attention::PlanWideRoots(a.shape, c.plan.tree, paged, table, wide);
  }
  return c.plan;
}

// ---- CPU ops -----------------------------------------------------------------------------

CpuRingOps::CpuRingOps(ThreadPool* pool)
    : CpuRingOps(pool, [pool](const AttentionParams& p) {
        return attention::PartialAttentionCpu(p, pool);
      }) {}

CpuRingOps::CpuRingOps(ThreadPool* pool, HostAttention attend)
    : pool_(pool), attend_(std::move(attend)) {}

absl::Status CpuRingOps::SetPositions(int slot, std::span<const int32_t> q_pos,
                                      std::span<const sharding::PositionRun> kv_runs) {
  q_pos_[slot].assign(q_pos.begin(), q_pos.end());
  kv_pos_[slot] = sharding::ExpandPositions(kv_runs);
  return absl::OkStatus();
}

absl::StatusOr<void*> CpuRingOps::Buffer(int slot, size_t bytes) {
  if (slot >= static_cast<int>(buffers_.size())) buffers_.resize(slot + 1);
  HostBuffer& b = buffers_[slot];
  if (b.size() < bytes) b.Resize(bytes);
  return static_cast<void*>(b.data());
}

absl::Status CpuRingOps::Copy(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

absl::Status CpuRingOps::Fill(void* dst, uint8_t byte, size_t bytes) {
  if (bytes > 0) std::memset(dst, byte, bytes);
  return absl::OkStatus();
}

absl::Status CpuRingOps::Attend(const RingStepArgs& a) {
  AttentionParams p{.shape = a.shape,
                    .q = static_cast<const float*>(a.q),
                    .q_pos = a.q_pos,
                    .q_tokens = a.q_tokens,
                    .k = static_cast<const float*>(a.k),
                    .v = static_cast<const float*>(a.v),
                    .k_pos = a.k_pos,
                    .kv_tokens = a.kv_tokens,
                    .slices = a.slices.data(),
                    .num_slices = static_cast<int64_t>(a.slices.size()),
                    .o = a.o,
                    .lse = a.lse};
  if (a.paged_kv == nullptr) return AttendSlices(p, a.slices, a.fold_into_output);
  const attention::PagedKv& paged = *a.paged_kv;
  CPFILL_RETURN_IF_ERROR(
      paged.Validate(RowBytes(a.shape), a.slices.data(), static_cast<int64_t>(a.slices.size())));
  // Without the host table (batching off) every sequence reads its own keys (no roots): the
  // table is in host memory here anyway.
  const std::span<const int32_t> table =
      paged.host_table.empty() ? TableSpan(paged, a.slices) : paged.host_table;
  const PagedStepPlan& plan = PlanPagedStep(a, table, /*gather=*/true);
  prefix_batch_counts_ += plan.tree.counts;
  const attention::PagedGather& g = plan.gather;
  GatherRows(a, g, &p);
  for (size_t l = 0; l < g.levels.size(); ++l) {
    CPFILL_RETURN_IF_ERROR(AttendSlices(p, g.levels[l], l == 0 ? a.fold_into_output : true));
  }
  return absl::OkStatus();
}

absl::Status CpuRingOps::AttendSlices(AttentionParams p, std::span<const SequenceSlice> slices,
                                      bool fold) {
  p.slices = slices.data();
  p.num_slices = static_cast<int64_t>(slices.size());
  if (!fold) return attend_(p);
  // Merging an empty result changes nothing.
  if (slices.empty()) return absl::OkStatus();
  const size_t o_floats = static_cast<size_t>(p.q_tokens) * p.shape.num_heads * p.shape.head_dim;
  const size_t bytes = (o_floats + static_cast<size_t>(p.q_tokens) * p.shape.num_heads) * 4;
  if (step_out_.size() < bytes) step_out_.Resize(bytes);
  float* o = p.o;
  float* lse = p.lse;
  p.o = step_out_.As<float>(0);
  p.lse = p.o + o_floats;
  CPFILL_RETURN_IF_ERROR(attend_(p));
  return attention::MergeInto(p.shape, p.q_tokens, o, lse, p.o, p.lse, pool_);
}

void CpuRingOps::GatherRows(const RingStepArgs& a, const attention::PagedGather& g,
                            AttentionParams* p) {
  const int64_t row = RowBytes(a.shape);
  const size_t bytes = static_cast<size_t>(g.rows * row);
  if (paged_k_.size() < bytes) paged_k_.Resize(bytes);
  if (paged_v_.size() < bytes) paged_v_.Resize(bytes);
  paged_pos_.resize(g.rows);
  const char* k_pool = static_cast<const char*>(a.k);
  const char* v_pool = static_cast<const char*>(a.v);
  // One copy per block: the rows of a block are contiguous.
  for (const attention::PagedGather::Copy& c : g.copies) {
    const int64_t src = c.block * a.paged_kv->block_stride_bytes;
    std::memcpy(paged_k_.data() + c.to_row * row, k_pool + src, c.rows * row);
    std::memcpy(paged_v_.data() + c.to_row * row, v_pool + src, c.rows * row);
    std::copy_n(a.k_pos + c.from_row, c.rows, paged_pos_.begin() + c.to_row);
  }
  p->k = paged_k_.As<float>(0);
  p->v = paged_v_.As<float>(0);
  p->k_pos = paged_pos_.data();
  p->kv_tokens = g.rows;
}

absl::Status CpuRingOps::Merge(const AttentionShape& shape, int64_t rows,
                               std::span<const PartialView> parts, float* o, float* lse) {
  return attention::MergePartials(shape, rows, parts, o, lse, pool_);
}

absl::Status CpuRingOps::BeginRun(int max_marks) {
  marks_s_.clear();
  marks_s_.reserve(max_marks);
  return absl::OkStatus();
}

int CpuRingOps::Mark() {
  marks_s_.push_back(std::chrono::duration<double>(Clock::now().time_since_epoch()).count());
  return static_cast<int>(marks_s_.size()) - 1;
}

double CpuRingOps::Seconds(int a, int b) const { return marks_s_[b] - marks_s_[a]; }

// ---- set-up ------------------------------------------------------------------------------

RingAttention::RingAttention(Communicator& cp, const sharding::ShardPlan& plan,
                             const AttentionShape& shape, RingOps* ops)
    : cp_(cp),
      ring_plan_(plan, cp.rank(), shape.causal),
      shape_(shape),
      ops_(ops),
      cp_rank_(cp.rank()),
      cp_size_(cp.size()) {}

RingAttention::~RingAttention() {
  // A later ring may be allocated at this address: it must not take these positions for its own.
  if (ops_->positions_of_[position_slot_] == this) ops_->positions_of_[position_slot_] = nullptr;
}

absl::StatusOr<std::unique_ptr<RingAttention>> RingAttention::Create(
    Communicator& cp, const sharding::ShardPlan& plan, const AttentionShape& shape, RingOps* ops) {
  CPFILL_CHECK_ARG(ops != nullptr, "ring attention needs ring ops (a backend)");
  CPFILL_CHECK_ARG(plan.cp_size == cp.size(), "the shard plan is for CP", plan.cp_size,
                   " but the CP ring has ", cp.size(), " ranks");
  CPFILL_CHECK_ARG(shape.num_heads > 0 && shape.num_kv_heads > 0 && shape.head_dim > 0 &&
                       shape.num_heads % shape.num_kv_heads == 0,
                   "attention shape: ", shape.num_heads, " query heads, ", shape.num_kv_heads,
                   " KV heads, head dim ", shape.head_dim,
                   " (heads must be positive and query heads a multiple of KV heads)");
  CPFILL_RETURN_IF_ERROR(ops->CheckShape(shape, cp.size()));
  std::unique_ptr<RingAttention> ring(new RingAttention(cp, plan, shape, ops));
  CPFILL_RETURN_IF_ERROR(ring->BindPositions());
  return ring;
}

absl::Status RingAttention::BindPositions() {
  auto& owners = ops_->positions_of_;
  if (owners[position_slot_] == this) return absl::OkStatus();
  // A free slot, else the one taken longest ago.
  const auto free = std::find(owners.begin(), owners.end(), nullptr);
  int slot = static_cast<int>(free - owners.begin());
  if (free == owners.end()) {
    slot = ops_->next_position_slot_;
    ops_->next_position_slot_ = (slot + 1) % RingOps::kPositionSlots;
  }
  const sharding::LocalLayout& layout = ring_plan_.layout();
  owners[slot] = nullptr;  // a failed copy leaves the slot holding no ring's positions
  CPFILL_RETURN_IF_ERROR(ops_->SetPositions(slot, layout.q_positions, layout.kv_runs));
  owners[slot] = this;
  position_slot_ = slot;
  return absl::OkStatus();
}

absl::StatusOr<char*> RingAttention::Scratch(Slot slot, size_t bytes) {
  CPFILL_ASSIGN_OR_RETURN(void* p, ops_->Buffer(slot, bytes));
  return static_cast<char*>(p);
}

// ---- message packing ---------------------------------------------------------------------

MessageLayout RingAttention::KvMessage() const {
  const size_t row =
      static_cast<size_t>(shape_.num_kv_heads) * shape_.head_dim * ops_->elem_bytes();
  return MessageLayout::Make(ring_plan_.kv_slots_total(), row, row);
}

MessageLayout RingAttention::QMessage() const {
  const size_t row = static_cast<size_t>(shape_.num_heads) * shape_.head_dim * ops_->elem_bytes();
  return MessageLayout::Make(ring_plan_.q_message_slots(), row, 0);
}

absl::Status RingAttention::PackKv(const void* k, const void* v, char* msg) {
  const size_t row =
      static_cast<size_t>(shape_.num_kv_heads) * shape_.head_dim * ops_->elem_bytes();
  const MessageLayout m = KvMessage();
  const sharding::LocalLayout& layout = ring_plan_.layout();
  for (int s = 0; s < ring_plan_.num_sequences(); ++s) {
    const int64_t n = layout.kv_len[s], src = layout.kv_offset[s];
    const int64_t dst = ring_plan_.kv_slot_offset(s), pad = ring_plan_.kv_slots(s) - n;
    char* mk = msg + m.a_offset + dst * row;
    char* mv = msg + m.b_offset + dst * row;
    char* mpos = msg + m.pos_offset + dst * sizeof(int32_t);
    if (n > 0) {
      CPFILL_RETURN_IF_ERROR(ops_->Copy(mk, static_cast<const char*>(k) + src * row, n * row));
      CPFILL_RETURN_IF_ERROR(ops_->Copy(mv, static_cast<const char*>(v) + src * row, n * row));
      CPFILL_RETURN_IF_ERROR(
          ops_->Copy(mpos, ops_->kv_positions(position_slot_) + src, n * sizeof(int32_t)));
    }
    // Padding slots may still hold a peer's keys from an earlier exchange: clear them.
    if (pad > 0) {
      CPFILL_RETURN_IF_ERROR(ops_->Fill(mk + n * row, 0, pad * row));
      CPFILL_RETURN_IF_ERROR(ops_->Fill(mv + n * row, 0, pad * row));
      CPFILL_RETURN_IF_ERROR(
          ops_->Fill(mpos + n * sizeof(int32_t), kPadPositionByte, pad * sizeof(int32_t)));
    }
  }
  return absl::OkStatus();
}

// The message is this rank's local Q as it is (RingPlan::q_message_slots): one copy each of
// the rows and their positions, whatever the batch's sequence count.
absl::Status RingAttention::PackQ(const void* q, char* msg) {
  const size_t row = static_cast<size_t>(shape_.num_heads) * shape_.head_dim * ops_->elem_bytes();
  const MessageLayout m = QMessage();
  const int64_t rows = ring_plan_.layout().q_rows(), pad = ring_plan_.q_message_slots() - rows;
  char* mpos = msg + m.pos_offset;
  if (rows > 0) {
    CPFILL_RETURN_IF_ERROR(ops_->Copy(msg + m.a_offset, q, rows * row));
    CPFILL_RETURN_IF_ERROR(
        ops_->Copy(mpos, ops_->q_positions(position_slot_), rows * sizeof(int32_t)));
  }
  // The rows past ours are in no slice; position -1 keeps them masked all the same, should a
  // kernel's tile read past its slice.
  if (pad > 0) {
    CPFILL_RETURN_IF_ERROR(
        ops_->Fill(mpos + rows * sizeof(int32_t), kPadPositionByte, pad * sizeof(int32_t)));
  }
  return absl::OkStatus();
}

// Sequence i of the result occupies N * L^i slots starting at N * kv_slot_offset(i), rank p's
// keys at offset p * L^i; padding keeps position -1.
absl::Status RingAttention::Repack(const char* gathered, char* gathered_kv) {
  const int n = cp_size_;
  const MessageLayout m = KvMessage();
  const size_t kv_row =
      static_cast<size_t>(shape_.num_kv_heads) * shape_.head_dim * ops_->elem_bytes();
  const MessageLayout g = MessageLayout::Make(n * ring_plan_.kv_slots_total(), kv_row, kv_row);
  for (int p = 0; p < n; ++p) {
    const char* block = gathered + p * m.bytes;
    for (int s = 0; s < ring_plan_.num_sequences(); ++s) {
      const int64_t src = ring_plan_.kv_slot_offset(s), len = ring_plan_.kv_slots(s);
      const int64_t dst = n * src + p * len;
      if (len == 0) continue;
      CPFILL_RETURN_IF_ERROR(ops_->Copy(gathered_kv + g.a_offset + dst * kv_row,
                                        block + m.a_offset + src * kv_row, len * kv_row));
      CPFILL_RETURN_IF_ERROR(ops_->Copy(gathered_kv + g.b_offset + dst * kv_row,
                                        block + m.b_offset + src * kv_row, len * kv_row));
      CPFILL_RETURN_IF_ERROR(ops_->Copy(gathered_kv + g.pos_offset + dst * sizeof(int32_t),
                                        block + m.pos_offset + src * sizeof(int32_t),
                                        len * sizeof(int32_t)));
    }
  }
  return absl::OkStatus();
}

// ---- the ring step's exchange and timing, shared by pass-KV and pass-Q ---------------------

absl::StatusOr<std::unique_ptr<PendingExchange>> RingAttention::StartExchange(
    int step_index, char* const msg[2], int cur, size_t bytes, RingStepTiming* step) {
  // After the last step every rank has seen every message: nothing more to pass on.
  if (step_index + 1 >= cp_size_) return std::unique_ptr<PendingExchange>();
  step->exchange_bytes = static_cast<int64_t>(bytes);
  return cp_.StartRingExchange(msg[cur], msg[1 - cur], bytes);
}

void RingAttention::AddSpan(RingTimings* t, std::string name, const char* lane, int origin, int a,
                            int b) const {
  t->spans.push_back({.name = std::move(name),
                      .lane = lane,
                      .start_s = Seconds(origin, a),
                      .duration_s = std::max(0.0, Seconds(a, b))});
}

// A step's attention between two marks, then the wait for the exchange that overlapped it (on a
// GPU the compute stream waits, not the host), marked too.
absl::Status RingAttention::ComputeStep(const RingStepArgs& a, const RingStepTiming& step,
                                        std::unique_ptr<PendingExchange> exchange, RingTimings* t,
                                        StepLog& log) {
  StepMarks marks;
  const std::string name = absl::StrCat("step ", step.step);
  marks.c0 = Mark();
  {
    ProfilerRange range(*ops_, absl::StrCat(name, " attention"));
    CPFILL_RETURN_IF_ERROR(ops_->Attend(a));
  }
  marks.c1 = Mark();
  if (exchange) {
    ProfilerRange range(*ops_, absl::StrCat(name, " wait"));
    CPFILL_RETURN_IF_ERROR(exchange->Wait());
  }
  marks.w1 = Mark();
  log.Add(*this, t, step, marks, std::move(exchange));
  return absl::OkStatus();
}

void RingAttention::StepLog::Add(RingAttention& ring, RingTimings* t, const RingStepTiming& step,
                                 const StepMarks& marks,
                                 std::unique_ptr<PendingExchange> exchange) {
  steps.push_back(step);
  this->marks.push_back(marks);
  exchanges.push_back(std::move(exchange));
  if (ring.ops_->marks_on_host()) Report(ring, t);
}

// The compute time of a step runs between its c0 and c1 marks; its exposed wait from c1 to the
// mark after the exchange's Wait(): on the CPU the host blocked that long, on a GPU the compute
// stream idled that long waiting for the exchange.
void RingAttention::StepLog::Report(RingAttention& ring, RingTimings* t) {
  for (; reported < steps.size(); ++reported) {
    RingStepTiming& step = steps[reported];
    const StepMarks& mk = marks[reported];
    step.compute_s = ring.Seconds(mk.c0, mk.c1);
    const std::string name = absl::StrCat("step ", step.step);
    ring.AddSpan(t, absl::StrCat(name, " attention"), "compute", origin, mk.c0, mk.c1);
    if (const PendingExchange* ex = exchanges[reported].get()) {
      step.transfer_s = ring.options_.wait ? ex->transfer_s() : 0.0;
      step.wait_s = std::max(0.0, ring.Seconds(mk.c1, mk.w1));
      ring.AddSpan(t, absl::StrCat(name, " wait"), "compute", origin, mk.c1, mk.w1);
      t->spans.push_back({.name = absl::StrCat(name, " exchange"),
                          .lane = "exchange",
                          .start_s = ring.Seconds(origin, mk.c0),
                          .duration_s = step.transfer_s});
    }
    t->visible_pairs += step.visible_pairs;
    t->steps.push_back(step);
    if (ring.on_step_) ring.on_step_(step, num_steps);
  }
}

// ---- pass-KV (Alg. 2) --------------------------------------------------------------------

absl::Status RingAttention::RunPassKV(const void* q, const void* k, const void* v, float* o,
                                      float* lse, RingTimings* t) {
  const int n = cp_size_, me = cp_rank_;
  const MessageLayout m = KvMessage();
  const sharding::LocalLayout& layout = ring_plan_.layout();
  char* msg[2];
  CPFILL_ASSIGN_OR_RETURN(msg[0], Scratch(kMsg0, m.bytes));
  CPFILL_ASSIGN_OR_RETURN(msg[1], Scratch(kMsg1, m.bytes));
  CPFILL_RETURN_IF_ERROR(BeginTimedRun(n));
  const int p0 = Mark();
  t->start_unix_s = UnixSecondsNow();  // the spans' origin (on a GPU: when p0 was enqueued)
  StepLog log(n, p0);
  CPFILL_RETURN_IF_ERROR(PackKv(k, v, msg[0]));  // KV_k^k: this rank's KV, padded to L^i
  const int p1 = Mark();

  std::vector<SequenceSlice> slices;
  int cur = 0;
  for (int j = 0; j < n; ++j) {
    RingStepTiming step;
    step.algorithm = RingAlgorithm::kPassKV;
    step.step = j;
    step.source_cp_rank = (me - j + n) % n;  // s: whose KV this rank holds at step j
    // Step j.1: pass the KV we hold to the next rank, receive the previous rank's (after this
    // rank's work so far: the pack, or the previous step, which read the buffer received into).
    CPFILL_ASSIGN_OR_RETURN(std::unique_ptr<PendingExchange> exchange,
                            StartExchange(j, msg, cur, m.bytes, &step));
    // Step j.2: O_k^s = GQA(Q_k, KV^s), overlapping the exchange, and step j.3: folded into the
    // running output (the merge of App. B, one part at a time). Sequences whose keys the causal
    // mask hides from all of our queries are left out.
    ring_plan_.PassKvSlices(step.source_cp_rank, &slices, &step);
    const RingStepArgs a{.shape = shape_,
                         .q = q,
                         .q_pos = ops_->q_positions(position_slot_),
                         .q_tokens = layout.q_rows(),
                         .k = msg[cur] + m.a_offset,
                         .v = msg[cur] + m.b_offset,
                         .k_pos = reinterpret_cast<const int32_t*>(msg[cur] + m.pos_offset),
                         .kv_tokens = ring_plan_.kv_slots_total(),
                         .slices = slices,
                         .o = o,
                         .lse = lse,
                         .fold_into_output = j > 0,
                         .communication_in_flight = exchange != nullptr,
                         .exchange = exchange.get()};
    // Step j.4: the next KV must have arrived before it is computed on.
    CPFILL_RETURN_IF_ERROR(ComputeStep(a, step, std::move(exchange), t, log));
    cur = 1 - cur;
  }
  CPFILL_RETURN_IF_ERROR(FinishTimedRun());
  t->pack_s += Seconds(p0, p1);
  AddSpan(t, "pack", "compute", p0, p0, p1);
  log.Report(*this, t);
  return absl::OkStatus();
}

// ---- pass-Q (Alg. 3) ---------------------------------------------------------------------

absl::Status RingAttention::RunPassQ(const void* q, const void* k, const void* v, float* o,
                                     float* lse, RingTimings* t) {
  const int n = cp_size_, me = cp_rank_;
  const int heads = shape_.num_heads;
  const MessageLayout m = QMessage();
  const sharding::LocalLayout& layout = ring_plan_.layout();
  const size_t q_row = static_cast<size_t>(heads) * shape_.head_dim;
  // Partial block s: [O: rows x H x D][LSE: rows x H], fp32, for rank s's rows in its own
  // order (RingPlan::source_q_rows(s)), at s times the largest block's size.
  const size_t row_floats = q_row + heads;
  const size_t block_floats = ring_plan_.q_message_slots() * row_floats;
  const size_t block_bytes = block_floats * sizeof(float);
  char* msg[2];
  CPFILL_ASSIGN_OR_RETURN(msg[0], Scratch(kMsg0, m.bytes));
  CPFILL_ASSIGN_OR_RETURN(msg[1], Scratch(kMsg1, m.bytes));
  CPFILL_ASSIGN_OR_RETURN(char* partials_bytes, Scratch(kPartials, n * block_bytes));
  CPFILL_ASSIGN_OR_RETURN(char* received_bytes, Scratch(kReceived, n * block_bytes));
  float* partials = reinterpret_cast<float*>(partials_bytes);
  float* received = reinterpret_cast<float*>(received_bytes);
  CPFILL_RETURN_IF_ERROR(BeginTimedRun(n));
  const int p0 = Mark();
  t->start_unix_s = UnixSecondsNow();  // the spans' origin (on a GPU: when p0 was enqueued)
  StepLog log(n, p0);
  CPFILL_RETURN_IF_ERROR(PackQ(q, msg[0]));  // Q_k^k
  const int p1 = Mark();

  std::vector<SequenceSlice> slices, keyless;
  int cur = 0;
  for (int j = 0; j < n; ++j) {
    RingStepTiming step;
    step.algorithm = RingAlgorithm::kPassQ;
    step.step = j;
    step.source_cp_rank = (me - j + n) % n;  // s: whose queries this rank holds at step j
    const int src = step.source_cp_rank;
    // Step j.1: pass the queries we hold on; receive the previous rank's.
    CPFILL_ASSIGN_OR_RETURN(std::unique_ptr<PendingExchange> exchange,
                            StartExchange(j, msg, cur, m.bytes, &step));
    // Step j.2: O_s^k = GQA(Q^s, KV_k) into the partial block destined for rank s.
    ring_plan_.PassQSlices(src, &slices, &step, &keyless);
    float* block = partials + src * block_floats;
    const int64_t rows = ring_plan_.source_q_rows(src);
    const RingStepArgs a{.shape = shape_,
                         .q = msg[cur] + m.a_offset,
                         .q_pos = reinterpret_cast<const int32_t*>(msg[cur] + m.pos_offset),
                         .q_tokens = rows,
                         .k = k,
                         .v = v,
                         .k_pos = ops_->kv_positions(position_slot_),
                         .kv_tokens = layout.kv_rows(),
                         .slices = slices,
                         .o = block,
                         .lse = block + rows * q_row,
                         .communication_in_flight = exchange != nullptr,
                         .exchange = exchange.get(),
                         .paged_kv = options_.paged_kv,
                         .keyless = keyless};
    // Step j.3: the next queries must have arrived before they are computed on.
    CPFILL_RETURN_IF_ERROR(ComputeStep(a, step, std::move(exchange), t, log));
    cur = 1 - cur;
  }

  // Step N: every partial goes home. Block s of `partials` (our KV against rank s's queries)
  // goes to rank s; block p of `received` is our queries against rank p's KV. Our own block
  // stays where it is.
  const int64_t my_rows = layout.q_rows();
  std::vector<size_t> send_bytes(n), recv_bytes(n), offsets(n);
  for (int p = 0; p < n; ++p) {
    offsets[p] = p * block_bytes;
    send_bytes[p] = p == me ? 0 : ring_plan_.source_q_rows(p) * row_floats * sizeof(float);
    recv_bytes[p] = p == me ? 0 : my_rows * row_floats * sizeof(float);
  }
  const int a0 = Mark();
  {
    ProfilerRange range(*ops_, "all-to-all");
    CPFILL_RETURN_IF_ERROR(
        cp_.AllToAll(partials, send_bytes, offsets, received, recv_bytes, offsets));
  }
  const int a1 = Mark();
  t->all_to_all_bytes = 0;
  for (size_t b : send_bytes) t->all_to_all_bytes += static_cast<int64_t>(b);

  // Step N+1: O_k = merge over s of O_k^s (App. B eq. 4). The blocks are already in local row
  // order (the message was our local Q), so the merge writes o and lse directly.
  std::vector<PartialView> parts(n);
  for (int p = 0; p < n; ++p) {
    const float* b = (p == me ? partials : received) + p * block_floats;
    parts[p] = {.o = b, .lse = b + my_rows * q_row};
  }
  if (my_rows > 0) {
    ProfilerRange range(*ops_, "merge");
    CPFILL_RETURN_IF_ERROR(ops_->Merge(shape_, my_rows, parts, o, lse));
  }
  const int m1 = Mark();

  CPFILL_RETURN_IF_ERROR(FinishTimedRun());
  t->pack_s += Seconds(p0, p1);
  t->all_to_all_s = Seconds(a0, a1);
  t->merge_s = Seconds(a1, m1);
  AddSpan(t, "pack", "compute", p0, p0, p1);
  AddSpan(t, "all-to-all", "exchange", p0, a0, a1);
  AddSpan(t, "merge", "compute", p0, a1, m1);
  log.Report(*this, t);
  return absl::OkStatus();
}

// ---- all-gather KV (baseline) ------------------------------------------------------------

absl::Status RingAttention::RunAllGather(const void* q, const void* k, const void* v, float* o,
                                         float* lse, RingTimings* t) {
  const int n = cp_size_;
  const MessageLayout m = KvMessage();
  const sharding::LocalLayout& layout = ring_plan_.layout();
  const size_t kv_row =
      static_cast<size_t>(shape_.num_kv_heads) * shape_.head_dim * ops_->elem_bytes();
  const MessageLayout g = MessageLayout::Make(n * ring_plan_.kv_slots_total(), kv_row, kv_row);
  CPFILL_ASSIGN_OR_RETURN(char* msg, Scratch(kMsg0, m.bytes));
  CPFILL_ASSIGN_OR_RETURN(char* gathered, Scratch(kGathered, n * m.bytes));
  CPFILL_ASSIGN_OR_RETURN(char* gathered_kv, Scratch(kGatheredKv, g.bytes));
  CPFILL_RETURN_IF_ERROR(BeginTimedRun(1));

  // Step 1: every rank's KV message, to every rank.
  const int p0 = Mark();
  t->start_unix_s = UnixSecondsNow();  // the spans' origin (on a GPU: when p0 was enqueued)
  CPFILL_RETURN_IF_ERROR(PackKv(k, v, msg));
  const int g0 = Mark();
  CPFILL_RETURN_IF_ERROR(cp_.AllGather(msg, m.bytes, gathered));
  const int g1 = Mark();
  // Step 2: each sequence's keys from all ranks side by side.
  CPFILL_RETURN_IF_ERROR(Repack(gathered, gathered_kv));
  const int r1 = Mark();

  // Step 3: one attention over the whole batch.
  std::vector<SequenceSlice> slices;
  ring_plan_.AllGatherSlices(&slices);
  const RingStepArgs a{.shape = shape_,
                       .q = q,
                       .q_pos = ops_->q_positions(position_slot_),
                       .q_tokens = layout.q_rows(),
                       .k = gathered_kv + g.a_offset,
                       .v = gathered_kv + g.b_offset,
                       .k_pos = reinterpret_cast<const int32_t*>(gathered_kv + g.pos_offset),
                       .kv_tokens = n * ring_plan_.kv_slots_total(),
                       .slices = slices,
                       .o = o,
                       .lse = lse};
  CPFILL_RETURN_IF_ERROR(ops_->Attend(a));
  const int c1 = Mark();
  CPFILL_RETURN_IF_ERROR(FinishTimedRun());

  RingStepTiming step;
  step.algorithm = RingAlgorithm::kAllGather;
  step.visible_pairs = ring_plan_.AllGatherVisiblePairs();
  step.compute_s = Seconds(r1, c1);
  t->visible_pairs += step.visible_pairs;
  t->steps.push_back(step);
  t->pack_s += Seconds(p0, g0) + Seconds(g1, r1);
  t->all_gather_s = Seconds(g0, g1);
  AddSpan(t, "pack", "compute", p0, p0, g0);
  AddSpan(t, "all-gather", "exchange", p0, g0, g1);
  AddSpan(t, "repack", "compute", p0, g1, r1);
  AddSpan(t, "attention", "compute", p0, r1, c1);
  if (on_step_) on_step_(step, 1);
  return absl::OkStatus();
}

// ---- a ring of one rank --------------------------------------------------------------------

absl::Status RingAttention::RunLocal(RingAlgorithm algorithm, const void* q, const void* k,
                                     const void* v, float* o, float* lse, RingTimings* t) {
  const sharding::LocalLayout& layout = ring_plan_.layout();
  CPFILL_RETURN_IF_ERROR(BeginTimedRun(1));
  const int p0 = Mark();
  t->start_unix_s = UnixSecondsNow();  // the spans' origin (on a GPU: when p0 was enqueued)
  StepLog log(1, p0);
  RingStepTiming step;
  step.algorithm = algorithm;
  std::vector<SequenceSlice> slices;
  ring_plan_.LocalSlices(&slices, &step);
  const RingStepArgs a{.shape = shape_,
                       .q = q,
                       .q_pos = ops_->q_positions(position_slot_),
                       .q_tokens = layout.q_rows(),
                       .k = k,
                       .v = v,
                       .k_pos = ops_->kv_positions(position_slot_),
                       .kv_tokens = layout.kv_rows(),
                       .slices = slices,
                       .o = o,
                       .lse = lse,
                       .paged_kv = options_.paged_kv};
  CPFILL_RETURN_IF_ERROR(ComputeStep(a, step, nullptr, t, log));
  CPFILL_RETURN_IF_ERROR(FinishTimedRun());
  log.Report(*this, t);
  return absl::OkStatus();
}

absl::Status RingAttention::BeginTimedRun(int num_steps) {
  return options_.wait ? ops_->BeginRun(MarksFor(num_steps)) : absl::OkStatus();
}

int RingAttention::Mark() { return options_.wait ? ops_->Mark() : 0; }

double RingAttention::Seconds(int a, int b) const {
  return options_.wait ? ops_->Seconds(a, b) : 0.0;
}

absl::Status RingAttention::FinishTimedRun() {
  return options_.wait ? ops_->Finish() : absl::OkStatus();
}

absl::Status RingAttention::Run(RingAlgorithm algorithm, const void* q, const void* k,
                                const void* v, float* o, float* lse, RingTimings* timings,
                                StepCallback on_step, const RunOptions& options) {
  CPFILL_CHECK_ARG(
      options.paged_kv == nullptr || algorithm == RingAlgorithm::kPassQ || cp_size_ == 1,
      "ring attention: K/V read in place from a KV cache's blocks needs pass-Q (the "
      "KV stays) or a ring of one rank, not ",
      std::string(RingAlgorithmName(algorithm)), " on CP", cp_size_);
  on_step_ = std::move(on_step);
  options_ = options;
  RingTimings local;
  RingTimings* t = timings ? timings : &local;
  *t = RingTimings{};
  t->algorithm = algorithm;
  const auto t0 = Clock::now();
  // Another ring may have used the ops since this one was created.
  ProfilerRange range(*ops_, "ring " + std::string(RingAlgorithmName(algorithm)));
  absl::Status status = BindPositions();
  if (status.ok() && cp_size_ == 1) {
    status = RunLocal(algorithm, q, k, v, o, lse, t);
  } else if (status.ok()) {
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
  }
  t->total_s = SecondsSince(t0);
  options_.paged_kv = nullptr;  // the caller's, valid during the call only (`wait` is kept)
  return status;
}

absl::Status SingleRankAttention(const std::vector<sharding::SequenceRequest>& sequences,
                                 const AttentionShape& shape, const float* q, const float* k,
                                 const float* v, float* o, float* lse, CpuRingOps* ops) {
  CPFILL_CHECK_ARG(ops != nullptr, "single-rank attention needs CPU ring ops");
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
  return ops->AttendHost(p);
}

}  // namespace cpfill::parallel
