// cpfill/parallel/ring_attention.h — context-parallel attention over a CP ring, written once for
// every backend.
//
// Three algorithms on the Communicator interface, the RingPlan (message layouts, step slices,
// skipped chunk pairs) and a RingOps backend (memory, compute, merge, timing):
//   pass-KV    (paper Alg. 2) each rank's KV, padded per sequence to L^i = max_j(P_j^i + T_j^i)
//              so every message has one size, travels the ring; the exchange for step j+1 is
//              started before step j computes; each step's partial output is folded into the
//              running (O, LSE) as it is computed.
//   pass-Q     (Alg. 3) queries and their positions travel, KV stays; each rank's partial outputs
//              for the other ranks' queries go back to their owners in one all-to-all, and every
//              rank merges the N partials of its own queries (App. B eq. 4). A message is its
//              source's local Q unpadded (a decode step's: that rank's B/N sequences), in slots
//              for the largest rank's rows, so the merge writes the local output directly.
//   all-gather the baseline: gather every rank's KV, then one attention per sequence.
// All three handle full prefill (P = 0) and partial prefill (P > 0) alike: the plan says where
// cached KV lives and every token carries its global position, so the causal mask is exact.
// A (sequence, step) pair whose keys the causal mask hides from every query is skipped.
//
// Backends (RingOps): CpuRingOps (below: host memory, fp32, the CPU kernel or any host
// attention, with an MpiCommunicator) and CudaRingOps (parallel/cuda/cuda_ring_ops.h: device
// memory, bf16, the CUDA kernel with its fused merge, with an NcclCommunicator). On CUDA nothing
// in a Run allocates (after the first run of the largest plan) or waits on the host until the
// one RingOps::Finish() at its end.
//
//   CpuRingOps ops(&pool);                        // long-lived: keeps its buffers between runs
//   CPFILL_ASSIGN_OR_RETURN(auto ring, RingAttention::Create(*grid.cp, plan, shape, &ops));
//   for (layer ...) CPFILL_RETURN_IF_ERROR(ring->Run(RingAlgorithm::kPassKV, q, k, v, o, lse,
//                                                   &timings));
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "attention/attention.h"
#include "attention/prefix_batched.h"
#include "base/host_buffer.h"
#include "base/thread_pool.h"
#include "parallel/communicator.h"
#include "parallel/ring_plan.h"
#include "parallel/selector.h"
#include "sharding/plan.h"

namespace cpfill::parallel {

class RingAttention;

// One partial attention of a ring step, in the ops' memory. q [q_tokens, H, D] and k/v
// [kv_tokens, H_kv, D] in the backend's element type (fp32 CPU, bf16 CUDA); positions int32;
// o [q_tokens, H, D] and lse [q_tokens, H] fp32. `slices` is host memory.
struct RingStepArgs {
  attention::AttentionShape shape;
  const void* q = nullptr;
  const int32_t* q_pos = nullptr;
  int64_t q_tokens = 0;
  const void* k = nullptr;
  const void* v = nullptr;
  const int32_t* k_pos = nullptr;
  int64_t kv_tokens = 0;
  std::span<const attention::SequenceSlice> slices;
  float* o = nullptr;
  float* lse = nullptr;
  // false: (o, lse) are written for every row (rows in no slice empty). true: this step's
  // result is merged into the running (o, lse) in place; rows in no slice keep their values.
  bool fold_into_output = false;
  // A ring exchange runs beside this step (CUDA: the kernel leaves SMs to NCCL; a prefill step's
  // kernel takes them back once the exchange ends, a decode step's does not).
  bool communication_in_flight = false;
  const PendingExchange* exchange = nullptr;  // that exchange, where there is one
  // Set: k/v are a KV cache's block pools, read in place through this table (attention.h).
  const attention::PagedKv* paged_kv = nullptr;
  // Query rows in no slice (a pass-Q message's sequences with no key on this rank): real
  // queries, not padding, so prefix batching's roots must not span them
  // (attention::FindSharedBlocks).
  std::span<const attention::SequenceSlice> keyless;
};

// How a run reads its keys and whether it waits.
struct RunOptions {
  // K/V read in place from a KV cache's blocks (k/v then point at the layer's pools): pass-Q
  // only, where the KV never travels, or a ring of one rank (InvalidArgument otherwise).
  const attention::PagedKv* paged_kv = nullptr;
  // false: enqueue only. No marks, no step times (steps are still reported, with zero times)
  // and no host wait: the caller calls RingAttention::Finish() before it reads o or lse. A
  // model runs its layers so and waits once per forward: a decode step's 32 layers would
  // otherwise each drain the GPU and pay the next kernels' launch latency in full.
  bool wait = true;
};

// What the ring needs from a backend. Everything is enqueued or done in order; nothing a call
// returns may be read on the host before Finish() (the CPU does everything at once).
class RingOps {
 public:
  virtual ~RingOps() = default;

  // Bytes of one Q/K/V element: 4 (fp32) or 2 (bf16).
  virtual size_t elem_bytes() const = 0;
  // InvalidArgument when this backend cannot run `shape` on a ring of `cp_size` ranks.
  virtual absl::Status CheckShape(const attention::AttentionShape& shape, int cp_size) const {
    return absl::OkStatus();
  }

  // Rings whose positions the ops hold at once: a mixed batch alternates two rings every layer
  // (parallel::MixedRing), and each keeps its slot instead of uploading again.
  static constexpr int kPositionSlots = 2;
  // Copies a plan's positions (host) into position slot `slot` of the ops' memory:
  // q_positions(slot), and kv_positions(slot) with one position per key row of `kv_runs`
  // (sharding::LocalLayout). Enqueued (the host spans may go once it returns).
  virtual absl::Status SetPositions(int slot, std::span<const int32_t> q_pos,
                                    std::span<const sharding::PositionRun> kv_runs) = 0;
  virtual const int32_t* q_positions(int slot) const = 0;
  virtual const int32_t* kv_positions(int slot) const = 0;

  // Scratch `slot`, at least `bytes` long, in the ops' memory. Owned by the ops and kept between
  // runs (and between rings), grown when too small: contents are not kept across a growth.
  virtual absl::StatusOr<void*> Buffer(int slot, size_t bytes) = 0;
  // In the ops' memory, ordered after everything before.
  virtual absl::Status Copy(void* dst, const void* src, size_t bytes) = 0;
  virtual absl::Status Fill(void* dst, uint8_t byte, size_t bytes) = 0;

  virtual absl::Status Attend(const RingStepArgs& args) = 0;
  // Exact merge of `parts` (fp32 [rows, H, D] and [rows, H]) into o, lse; these must not alias
  // a part.
  virtual absl::Status Merge(const attention::AttentionShape& shape, int64_t rows,
                             std::span<const attention::PartialView> parts, float* o,
                             float* lse) = 0;

  // Timing. BeginRun resets the marks and makes room for `max_marks` (outside the loop). Mark()
  // records the moment everything issued so far is done and returns its id; Seconds(a, b) is
  // the time from mark a to mark b, valid after Finish() — or at once when marks_on_host().
  virtual absl::Status BeginRun(int max_marks) = 0;
  virtual int Mark() = 0;
  virtual double Seconds(int a, int b) const = 0;
  virtual bool marks_on_host() const { return false; }
  // The one host wait of a run: everything issued (compute and communication) is done, within
  // the communicator's deadline. CPU: nothing to wait for.
  virtual absl::Status Finish() = 0;
  // Named ranges around what the ring issues, for profilers: CUDA opens NVTX ranges, so `nsys`
  // timelines carry the names of --trace's spans; the CPU needs none (its spans are exact).
  virtual void PushRange(const char* name) {}
  virtual void PopRange() {}

  // Prefix batching so far (paged K/V whose sequences share leading blocks,
  // attention/prefix_batched.h FindSharedBlocks): every backend's Attend does it.
  const attention::PrefixBatchCounts& prefix_batch_counts() const { return prefix_batch_counts_; }
  // Whether a paged prefill step copies its cached K/V out of the blocks first (rows in memory
  // the KV cache's sizing did not count), rather than reading them in place; and whether it can
  // read them in place instead when asked (attention::PagedKv::prefill_in_place).
  virtual bool GathersPagedPrefill(const attention::AttentionShape& shape,
                                   const attention::PagedKv& paged) const {
    return true;
  }
  virtual bool CanReadPagedPrefillInPlace(const attention::AttentionShape& shape,
                                          const attention::PagedKv& paged) const {
    return false;
  }
  // What prefix batching's levels cost here (attention::TreeCosts): none on the CPU.
  virtual attention::TreeCosts tree_costs() const { return {}; }
  // The rule a paged step's roots are found by (attention::RuleForStep under tree_costs()).
  virtual attention::SharedBlockRule StepRule(const attention::AttentionShape& shape,
                                              std::span<const attention::SequenceSlice> slices,
                                              const attention::PagedKv& paged) const {
    return attention::RuleForStep(slices, tree_costs());
  }

 protected:
  attention::PrefixBatchCounts prefix_batch_counts_;

  // A paged step's prefix batching (attention::FindSharedBlocks under StepRule: no roots
  // without the host table) and, when `gather`, its gather plan over `table` (the block table
  // in host memory); else, with `wide`, its wide roots' (attention::PlanWideRoots).
  // Kept for the later steps with the same slices, keyless rows and table (a nonzero
  // PagedKv::generation names the table): a forward plans each ring step once, not once per
  // layer. The reference is valid until the next call.
  struct PagedStepPlan {
    attention::SharedBlockTree tree;
    attention::PagedGather gather;
    attention::WideRootsPlan wide;
    uint64_t id = 0;          // unique among this ops' plans
    uint64_t generation = 0;  // the table's (0: planned for this call only)
  };
  const PagedStepPlan& PlanPagedStep(const RingStepArgs& a, std::span<const int32_t> table,
                                     bool gather, const attention::WideRootRule& wide = {});

 private:
  struct CachedStepPlan {
    uint64_t generation = 0;
    std::span<const int32_t> host_table, table;
    std::vector<attention::SequenceSlice> slices, keyless;
    bool gather = false;
    attention::WideRootRule wide;
    attention::AttentionShape shape;
    PagedStepPlan plan;
  };
  std::vector<CachedStepPlan> step_plans_;  // one generation's
  uint64_t last_plan_id_ = 0;
  friend class RingAttention;
  std::array<const RingAttention*, kPositionSlots> positions_of_{};  // whose plan each slot holds
  int next_position_slot_ = 0;  // the slot a new ring takes when none is free
};

// The host attention a CpuRingOps runs each step: fp32 tensors in host memory (attention.h).
using HostAttention = std::function<absl::Status(const attention::AttentionParams&)>;

// RingOps on host memory: fp32 tensors, the CPU kernel (or `attend`), merges on `pool`.
class CpuRingOps : public RingOps {
 public:
  explicit CpuRingOps(ThreadPool* pool);
  // `attend` runs every partial attention (e.g. the CUDA kernel staged from host memory).
  CpuRingOps(ThreadPool* pool, HostAttention attend);

  // One attention on this backend's kernel, outside any ring (checks, rate measurements).
  absl::Status AttendHost(const attention::AttentionParams& p) { return attend_(p); }

  size_t elem_bytes() const override { return sizeof(float); }
  absl::Status SetPositions(int slot, std::span<const int32_t> q_pos,
                            std::span<const sharding::PositionRun> kv_runs) override;
  const int32_t* q_positions(int slot) const override { return q_pos_[slot].data(); }
  const int32_t* kv_positions(int slot) const override { return kv_pos_[slot].data(); }
  absl::StatusOr<void*> Buffer(int slot, size_t bytes) override;
  absl::Status Copy(void* dst, const void* src, size_t bytes) override;
  absl::Status Fill(void* dst, uint8_t byte, size_t bytes) override;
  // fold_into_output: attention into a scratch block, then attention::MergeInto. Paged K/V:
  // the slices' rows are copied out of their blocks first (the CPU kernel reads rows in order),
  // and sequences that share leading blocks attend to them as one root, gathered once
  // (attention/prefix_batched.h FindSharedBlocks, PlanPagedGather; the rule the CUDA backend
  // uses for the step, so both count the same roots).
  absl::Status Attend(const RingStepArgs& args) override;
  absl::Status Merge(const attention::AttentionShape& shape, int64_t rows,
                     std::span<const attention::PartialView> parts, float* o, float* lse) override;
  absl::Status BeginRun(int max_marks) override;
  int Mark() override;
  double Seconds(int a, int b) const override;
  bool marks_on_host() const override { return true; }
  absl::Status Finish() override { return absl::OkStatus(); }

 private:
  ThreadPool* pool_;
  HostAttention attend_;
  std::array<std::vector<int32_t>, kPositionSlots> q_pos_, kv_pos_;
  std::vector<HostBuffer> buffers_;  // by slot
  // Paged K/V's rows for the CPU kernel, as `g` places them; p reads them there.
  void GatherRows(const RingStepArgs& a, const attention::PagedGather& g,
                  attention::AttentionParams* p);
  // p over `slices`: into p.o / p.lse, or merged into them (`fold`).
  absl::Status AttendSlices(attention::AttentionParams p,
                            std::span<const attention::SequenceSlice> slices, bool fold);

  HostBuffer step_out_;           // a folded step's [O | LSE] before the merge
  HostBuffer paged_k_, paged_v_;  // GatherRows' rows
  std::vector<int32_t> paged_pos_;  // and their positions
  std::vector<double> marks_s_;   // steady clock, seconds
};

class RingAttention {
 public:
  // `cp` must be the CP ring the plan is for (size and rank); `ops` outlives the ring and runs
  // on that ring's memory (host for MPI, the device for NCCL). Queries/keys follow
  // sharding::MakeLocalLayout(plan, cp.rank()). Several rings may share one ops object when
  // they run one after the other (a model creates a ring per prefill).
  static absl::StatusOr<std::unique_ptr<RingAttention>> Create(
      Communicator& cp, const sharding::ShardPlan& plan, const attention::AttentionShape& shape,
      RingOps* ops);
  ~RingAttention();
  RingAttention(const RingAttention&) = delete;
  RingAttention& operator=(const RingAttention&) = delete;

  // In the ops' memory and element type: q [layout.q_rows, H, D], k/v [layout.kv_rows, H_kv, D]
  // -> o [q_rows, H, D], lse [q_rows, H] in fp32. Returns after RingOps::Finish(): the outputs
  // are ready. `on_step`, when set, is called for every ring step (as it ends when the ops time
  // on the host, else after Finish()).
  using StepCallback = std::function<void(const RingStepTiming&, int num_steps)>;
  absl::Status Run(RingAlgorithm algorithm, const void* q, const void* k, const void* v, float* o,
                   float* lse, RingTimings* timings, StepCallback on_step = nullptr,
                   const RunOptions& options = {});
  // The host wait of runs made with options.wait = false (RingOps::Finish, with the
  // communicator's deadline).
  absl::Status Finish() { return ops_->Finish(); }

  const sharding::LocalLayout& layout() const { return ring_plan_.layout(); }

 private:
  // Scratch slots of the ops (RingOps::Buffer).
  enum Slot : int { kMsg0, kMsg1, kPartials, kReceived, kGathered, kGatheredKv };
  // Marks of one ring step: around its compute, and after its exchange was waited for.
  struct StepMarks {
    int c0 = 0, c1 = 0, w1 = 0;
  };

  RingAttention(Communicator& cp, const sharding::ShardPlan& plan,
                const attention::AttentionShape& shape, RingOps* ops);

  absl::Status RunPassKV(const void* q, const void* k, const void* v, float* o, float* lse,
                         RingTimings* t);
  absl::Status RunPassQ(const void* q, const void* k, const void* v, float* o, float* lse,
                        RingTimings* t);
  absl::Status RunAllGather(const void* q, const void* k, const void* v, float* o, float* lse,
                            RingTimings* t);
  // A ring of one rank, any algorithm: one attention on the local tensors (nothing to pack,
  // pass or merge).
  absl::Status RunLocal(RingAlgorithm algorithm, const void* q, const void* k, const void* v,
                        float* o, float* lse, RingTimings* t);

  // The ops' timing and host wait, or nothing when the run does not wait (RunOptions::wait).
  absl::Status BeginTimedRun(int num_steps);
  int Mark();
  double Seconds(int a, int b) const;
  absl::Status FinishTimedRun();

  // Message layouts (ring_plan.h): pass-KV [K][V][positions], pass-Q [Q][positions].
  MessageLayout KvMessage() const;
  MessageLayout QMessage() const;
  // Copies this rank's rows into message slots; padding slots get position -1 (all bytes 0xFF)
  // and, in KV messages, zeros, clearing whatever a peer's message left there.
  absl::Status PackKv(const void* k, const void* v, char* msg);
  absl::Status PackQ(const void* q, char* msg);
  // All-gather: each sequence's keys from all ranks side by side.
  absl::Status Repack(const char* gathered, char* gathered_kv);
  absl::StatusOr<char*> Scratch(Slot slot, size_t bytes);

  // Step j.1 of both rings: send msg[cur] to the next rank, receive into msg[1 - cur] (nothing
  // after the last step).
  absl::StatusOr<std::unique_ptr<PendingExchange>> StartExchange(int step_index, char* const msg[2],
                                                                 int cur, size_t bytes,
                                                                 RingStepTiming* step);
  // The steps of one run, reported (times filled in, on_step called) as each ends when the
  // ops time on the host, else all at once after Finish(). Keeps the exchanges, whose transfer
  // times are read then.
  struct StepLog {
    // `origin`: the run's first mark, from which spans are timed.
    StepLog(int num_steps, int origin) : num_steps(num_steps), origin(origin) {}
    void Add(RingAttention& ring, RingTimings* t, const RingStepTiming& step,
             const StepMarks& marks, std::unique_ptr<PendingExchange> exchange);
    void Report(RingAttention& ring, RingTimings* t);

    int num_steps;
    int origin;
    size_t reported = 0;
    std::vector<RingStepTiming> steps;
    std::vector<StepMarks> marks;
    std::vector<std::unique_ptr<PendingExchange>> exchanges;
  };
  // A span from mark a to mark b, timed from mark `origin` (after Finish, or at once on the host).
  void AddSpan(RingTimings* t, std::string name, const char* lane, int origin, int a, int b) const;
  absl::Status ComputeStep(const RingStepArgs& a, const RingStepTiming& step,
                           std::unique_ptr<PendingExchange> exchange, RingTimings* t, StepLog& log);
  // Makes the ops hold this ring's positions in a slot (another ring may have taken its slot).
  absl::Status BindPositions();

  Communicator& cp_;
  RingPlan ring_plan_;
  attention::AttentionShape shape_;
  RingOps* ops_;
  int cp_rank_;
  int cp_size_;
  StepCallback on_step_;
  RunOptions options_;     // of the run in progress
  int position_slot_ = 0;  // the ops' slot of this ring's positions (while positions_of_ says so)
};

// Single-rank attention of a whole batch, for checks and rate measurements, on `ops`'s host
// kernel: every sequence's new queries against its cached + new keys in position order. Tensors
// in global token order (q: new tokens of sequence 0, then 1, ...; k/v: cached then new of
// sequence 0, then 1, ...).
absl::Status SingleRankAttention(const std::vector<sharding::SequenceRequest>& sequences,
                                 const attention::AttentionShape& shape, const float* q,
                                 const float* k, const float* v, float* o, float* lse,
                                 CpuRingOps* ops);

}  // namespace cpfill::parallel
