#include "parallel/cuda/device_ring_attention.h"

#include <chrono>

#include "base/status.h"

namespace cpfill::parallel {
namespace {

using attention::SequenceSlice;
using attention::cuda::CudaAttentionArgs;
using attention::cuda::OutputMode;
using Bf16 = __nv_bfloat16;
using Clock = std::chrono::steady_clock;

// Events recorded per Run: two per ring step plus a few around packing, all-to-all and merge.
constexpr size_t kEventsPerRun = 64;

}  // namespace

DeviceBuffer::~DeviceBuffer() { cudaFree(data_); }

absl::Status DeviceBuffer::Reserve(size_t bytes) {
  if (bytes <= capacity_) return absl::OkStatus();
  cudaFree(data_);
  data_ = nullptr;
  capacity_ = 0;
  CPFILL_CUDA_CHECK(cudaMalloc(&data_, bytes));
  capacity_ = bytes;
  return absl::OkStatus();
}

DeviceRingScratch::~DeviceRingScratch() {
  for (auto e : events) cudaEventDestroy(e);
}

DeviceRingAttention::DeviceRingAttention(NcclCommunicator& cp, const sharding::ShardPlan& plan,
                                         const attention::AttentionShape& shape,
                                         cudaStream_t stream, DeviceRingScratch* scratch)
    : cp_(cp),
      ring_plan_(plan, cp.rank(), shape.causal),
      shape_(shape),
      stream_(stream),
      own_scratch_(scratch ? nullptr : std::make_unique<DeviceRingScratch>()),
      s_(scratch ? *scratch : *own_scratch_) {}

absl::StatusOr<std::unique_ptr<DeviceRingAttention>> DeviceRingAttention::Create(
    NcclCommunicator& cp, const sharding::ShardPlan& plan, const attention::AttentionShape& shape,
    cudaStream_t stream, DeviceRingScratch* scratch) {
  CPFILL_CHECK_ARG(plan.cp_size == cp.size(), "the shard plan is for CP", plan.cp_size,
                   " but the CP ring has ", cp.size(), " ranks");
  CPFILL_CHECK_ARG(attention::cuda::SupportedHeadDim(shape.head_dim), "head_dim ", shape.head_dim,
                   " has no CUDA kernel (64, 128)");
  CPFILL_CHECK_ARG(plan.cp_size <= attention::cuda::kMaxMergeParts, "pass-Q merges at most ",
                   attention::cuda::kMaxMergeParts, " partials: CP", plan.cp_size, " is too large");
  std::unique_ptr<DeviceRingAttention> r(new DeviceRingAttention(cp, plan, shape, stream, scratch));
  CPFILL_RETURN_IF_ERROR(r->Init());
  return r;
}

absl::Status DeviceRingAttention::Init() {
  const sharding::LocalLayout& layout = ring_plan_.layout();
  CPFILL_RETURN_IF_ERROR(s_.q_pos.Reserve(std::max<size_t>(16, layout.q_rows() * 4)));
  CPFILL_RETURN_IF_ERROR(s_.kv_pos.Reserve(std::max<size_t>(16, layout.kv_rows() * 4)));
  CPFILL_CUDA_CHECK(cudaMemcpyAsync(s_.q_pos.As<void>(), layout.q_positions.data(),
                                    layout.q_rows() * 4, cudaMemcpyHostToDevice, stream_));
  CPFILL_CUDA_CHECK(cudaMemcpyAsync(s_.kv_pos.As<void>(), layout.kv_positions.data(),
                                    layout.kv_rows() * 4, cudaMemcpyHostToDevice, stream_));
  CPFILL_CUDA_CHECK(cudaStreamSynchronize(stream_));  // set-up, not the ring loop
  while (s_.events.size() < kEventsPerRun) {
    cudaEvent_t e;
    CPFILL_CUDA_CHECK(cudaEventCreate(&e));
    s_.events.push_back(e);
  }
  return absl::OkStatus();
}

cudaEvent_t DeviceRingAttention::Mark() {
  cudaEvent_t e = s_.events[s_.next_event];
  s_.next_event = (s_.next_event + 1) % s_.events.size();
  cudaEventRecord(e, stream_);
  return e;
}

double DeviceRingAttention::Seconds(cudaEvent_t a, cudaEvent_t b) const {
  float ms = 0;
  if (cudaEventElapsedTime(&ms, a, b) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return ms / 1e3;
}

MessageLayout DeviceRingAttention::KvMessage() const {
  const size_t row = static_cast<size_t>(shape_.num_kv_heads) * shape_.head_dim * sizeof(Bf16);
  return MessageLayout::Make(ring_plan_.kv_slots_total(), row, row);
}

MessageLayout DeviceRingAttention::QMessage() const {
  const size_t row = static_cast<size_t>(shape_.num_heads) * shape_.head_dim * sizeof(Bf16);
  return MessageLayout::Make(ring_plan_.q_slots_total(), row, 0);
}

// Copies this rank's rows into message slots; padding slots get zeros and position -1 (all
// bytes 0xFF), clearing whatever a peer's message left there.
absl::Status DeviceRingAttention::PackKv(const Bf16* k, const Bf16* v, const DeviceBuffer& msg) {
  const size_t row = static_cast<size_t>(shape_.num_kv_heads) * shape_.head_dim * sizeof(Bf16);
  const MessageLayout m = KvMessage();
  const sharding::LocalLayout& layout = ring_plan_.layout();
  for (int s = 0; s < ring_plan_.num_sequences(); ++s) {
    const int64_t n = layout.kv_len[s], src = layout.kv_offset[s];
    const int64_t dst = ring_plan_.kv_slot_offset(s), pad = ring_plan_.kv_slots(s) - n;
    char* mk = msg.As<char>(m.a_offset) + dst * row;
    char* mv = msg.As<char>(m.b_offset) + dst * row;
    int32_t* mpos = msg.As<int32_t>(m.pos_offset) + dst;
    if (n > 0) {
      CPFILL_CUDA_CHECK(cudaMemcpyAsync(mk, reinterpret_cast<const char*>(k) + src * row, n * row,
                                        cudaMemcpyDeviceToDevice, stream_));
      CPFILL_CUDA_CHECK(cudaMemcpyAsync(mv, reinterpret_cast<const char*>(v) + src * row, n * row,
                                        cudaMemcpyDeviceToDevice, stream_));
      CPFILL_CUDA_CHECK(cudaMemcpyAsync(mpos, s_.kv_pos.As<int32_t>() + src, n * 4,
                                        cudaMemcpyDeviceToDevice, stream_));
    }
    if (pad > 0) {
      CPFILL_CUDA_CHECK(cudaMemsetAsync(mk + n * row, 0, pad * row, stream_));
      CPFILL_CUDA_CHECK(cudaMemsetAsync(mv + n * row, 0, pad * row, stream_));
      CPFILL_CUDA_CHECK(cudaMemsetAsync(mpos + n, 0xFF, pad * 4, stream_));
    }
  }
  return absl::OkStatus();
}

absl::Status DeviceRingAttention::PackQ(const Bf16* q, const DeviceBuffer& msg) {
  const size_t row = static_cast<size_t>(shape_.num_heads) * shape_.head_dim * sizeof(Bf16);
  const MessageLayout m = QMessage();
  const sharding::LocalLayout& layout = ring_plan_.layout();
  for (int s = 0; s < ring_plan_.num_sequences(); ++s) {
    const int64_t n = layout.q_len[s], src = layout.q_offset[s];
    const int64_t dst = ring_plan_.q_slot_offset(s), pad = ring_plan_.q_slots(s) - n;
    char* mq = msg.As<char>(m.a_offset) + dst * row;
    int32_t* mpos = msg.As<int32_t>(m.pos_offset) + dst;
    if (n > 0) {
      CPFILL_CUDA_CHECK(cudaMemcpyAsync(mq, reinterpret_cast<const char*>(q) + src * row, n * row,
                                        cudaMemcpyDeviceToDevice, stream_));
      CPFILL_CUDA_CHECK(cudaMemcpyAsync(mpos, s_.q_pos.As<int32_t>() + src, n * 4,
                                        cudaMemcpyDeviceToDevice, stream_));
    }
    if (pad > 0) {
      CPFILL_CUDA_CHECK(cudaMemsetAsync(mq + n * row, 0, pad * row, stream_));
      CPFILL_CUDA_CHECK(cudaMemsetAsync(mpos + n, 0xFF, pad * 4, stream_));
    }
  }
  return absl::OkStatus();
}

absl::Status DeviceRingAttention::Attend(const CudaAttentionArgs& args) {
  const size_t need = attention::cuda::AttentionWorkspaceBytes(args);
  // Sized on the first run of a plan; later runs find it large enough.
  CPFILL_RETURN_IF_ERROR(s_.workspace.Reserve(std::max<size_t>(need, 256)));
  return attention::cuda::PartialAttentionCuda(args, s_.workspace.As<void>(), s_.workspace.capacity(),
                                               stream_);
}

// After the final synchronization: each step's kernel time from its events, its exchange's
// transfer time, and the exposed wait, i.e. the compute stream's idle gap before the next step.
void DeviceRingAttention::FillStepTimes(
    const std::vector<std::unique_ptr<PendingExchange>>& exchanges,
    const std::vector<cudaEvent_t>& c0, const std::vector<cudaEvent_t>& c1, RingTimings* t) const {
  const size_t n = t->steps.size();
  for (size_t j = 0; j < n; ++j) {
    RingStepTiming& step = t->steps[j];
    step.compute_s = Seconds(c0[j], c1[j]);
    if (exchanges[j]) step.transfer_s = exchanges[j]->transfer_s();
    if (j + 1 < n) step.wait_s = std::max(0.0, Seconds(c1[j], c0[j + 1]));
  }
}

// ---- pass-KV (Alg. 2) --------------------------------------------------------------------

absl::Status DeviceRingAttention::RunPassKV(const Bf16* q, const Bf16* k, const Bf16* v, float* o,
                                            float* lse, RingTimings* t) {
  const int n = ring_plan_.cp_size(), me = ring_plan_.cp_rank();
  const MessageLayout m = KvMessage();
  const sharding::LocalLayout& layout = ring_plan_.layout();
  CPFILL_RETURN_IF_ERROR(s_.msg[0].Reserve(m.bytes));
  CPFILL_RETURN_IF_ERROR(s_.msg[1].Reserve(m.bytes));

  cudaEvent_t pack0 = Mark();
  CPFILL_RETURN_IF_ERROR(PackKv(k, v, s_.msg[0]));
  cudaEvent_t pack1 = Mark();

  std::vector<SequenceSlice> slices;
  std::vector<std::unique_ptr<PendingExchange>> exchanges(n);
  std::vector<cudaEvent_t> c0(n), c1(n);
  int cur = 0;
  for (int j = 0; j < n; ++j) {
    RingStepTiming step;
    step.step = j;
    step.source_cp_rank = (me - j + n) % n;
    // Step j.1: enqueue the exchange (after this stream's work so far: the pack, or the
    // previous step's kernel, which read the buffer now being received into).
    if (j + 1 < n) {
      CPFILL_ASSIGN_OR_RETURN(
          exchanges[j],
          cp_.StartRingExchange(s_.msg[cur].As<void>(), s_.msg[1 - cur].As<void>(), m.bytes));
      step.exchange_bytes = static_cast<int64_t>(m.bytes);
    }
    // Step j.2: this step's keys, folded straight into the running (O, LSE).
    ring_plan_.PassKvSlices(step.source_cp_rank, &slices, &step);
    const CudaAttentionArgs a{
        .shape = shape_,
        .q = q,
        .q_pos = s_.q_pos.As<int32_t>(),
        .q_tokens = layout.q_rows(),
        .k = s_.msg[cur].As<Bf16>(m.a_offset),
        .v = s_.msg[cur].As<Bf16>(m.b_offset),
        .k_pos = s_.msg[cur].As<int32_t>(m.pos_offset),
        .kv_tokens = ring_plan_.kv_slots_total(),
        .slices = slices.data(),
        .num_slices = static_cast<int64_t>(slices.size()),
        .output = j == 0 ? OutputMode::kFloat32 : OutputMode::kMergeIntoFloat32,
        .o = o,
        .lse = lse,
        .communication_in_flight = exchanges[j] != nullptr};
    c0[j] = Mark();
    CPFILL_RETURN_IF_ERROR(Attend(a));
    c1[j] = Mark();
    // Step j.3: the next step computes on what this exchange brings: order it, on the device.
    if (exchanges[j]) CPFILL_RETURN_IF_ERROR(exchanges[j]->Wait());
    cur = 1 - cur;
    t->visible_pairs += step.visible_pairs;
    t->steps.push_back(step);
  }
  CPFILL_RETURN_IF_ERROR(cp_.Synchronize());
  t->pack_s += Seconds(pack0, pack1);
  FillStepTimes(exchanges, c0, c1, t);
  return absl::OkStatus();
}

// ---- pass-Q (Alg. 3) ---------------------------------------------------------------------

absl::Status DeviceRingAttention::RunPassQ(const Bf16* q, const Bf16* k, const Bf16* v, float* o,
                                           float* lse, RingTimings* t) {
  const int n = ring_plan_.cp_size(), me = ring_plan_.cp_rank();
  const int heads = shape_.num_heads;
  const MessageLayout m = QMessage();
  const sharding::LocalLayout& layout = ring_plan_.layout();
  const size_t q_row = static_cast<size_t>(heads) * shape_.head_dim;
  const int64_t slots = ring_plan_.q_slots_total();
  const size_t block_floats = slots * (q_row + heads);  // [O fp32 | LSE fp32]
  const size_t block_bytes = block_floats * sizeof(float);
  CPFILL_RETURN_IF_ERROR(s_.msg[0].Reserve(m.bytes));
  CPFILL_RETURN_IF_ERROR(s_.msg[1].Reserve(m.bytes));
  CPFILL_RETURN_IF_ERROR(s_.partials.Reserve(std::max<size_t>(16, n * block_bytes)));
  CPFILL_RETURN_IF_ERROR(s_.received.Reserve(std::max<size_t>(16, n * block_bytes)));
  CPFILL_RETURN_IF_ERROR(s_.merged.Reserve(std::max<size_t>(16, block_bytes)));
  float* partials = s_.partials.As<float>();
  float* received = s_.received.As<float>();

  cudaEvent_t pack0 = Mark();
  CPFILL_RETURN_IF_ERROR(PackQ(q, s_.msg[0]));
  cudaEvent_t pack1 = Mark();

  std::vector<SequenceSlice> slices;
  std::vector<std::unique_ptr<PendingExchange>> exchanges(n);
  std::vector<cudaEvent_t> c0(n), c1(n);
  int cur = 0;
  for (int j = 0; j < n; ++j) {
    RingStepTiming step;
    step.step = j;
    step.source_cp_rank = (me - j + n) % n;
    const int src = step.source_cp_rank;
    if (j + 1 < n) {
      CPFILL_ASSIGN_OR_RETURN(
          exchanges[j],
          cp_.StartRingExchange(s_.msg[cur].As<void>(), s_.msg[1 - cur].As<void>(), m.bytes));
      step.exchange_bytes = static_cast<int64_t>(m.bytes);
    }
    ring_plan_.PassQSlices(src, &slices, &step);
    float* block = partials + src * block_floats;
    const CudaAttentionArgs a{.shape = shape_,
                              .q = s_.msg[cur].As<Bf16>(m.a_offset),
                              .q_pos = s_.msg[cur].As<int32_t>(m.pos_offset),
                              .q_tokens = slots,
                              .k = k,
                              .v = v,
                              .k_pos = s_.kv_pos.As<int32_t>(),
                              .kv_tokens = layout.kv_rows(),
                              .slices = slices.data(),
                              .num_slices = static_cast<int64_t>(slices.size()),
                              .output = OutputMode::kFloat32,
                              .o = block,
                              .lse = block + slots * q_row,
                              .communication_in_flight = exchanges[j] != nullptr};
    c0[j] = Mark();
    CPFILL_RETURN_IF_ERROR(Attend(a));
    c1[j] = Mark();
    if (exchanges[j]) CPFILL_RETURN_IF_ERROR(exchanges[j]->Wait());
    cur = 1 - cur;
    t->visible_pairs += step.visible_pairs;
    t->steps.push_back(step);
  }

  // Step N: partials home by all-to-all; our own block stays.
  std::vector<size_t> send_bytes(n, block_bytes), offsets(n);
  for (int p = 0; p < n; ++p) offsets[p] = p * block_bytes;
  send_bytes[me] = 0;
  cudaEvent_t a0 = Mark();
  CPFILL_RETURN_IF_ERROR(
      cp_.AllToAll(partials, send_bytes, offsets, received, send_bytes, offsets));
  cudaEvent_t a1 = Mark();
  t->all_to_all_bytes = static_cast<int64_t>((n - 1) * block_bytes);

  // Step N+1: merge the N partials of our queries, then back to local row order.
  std::vector<const float*> po(n), pl(n);
  for (int p = 0; p < n; ++p) {
    const float* b = (p == me ? partials : received) + p * block_floats;
    po[p] = b;
    pl[p] = b + slots * q_row;
  }
  float* merged_o = s_.merged.As<float>();
  float* merged_lse = merged_o + slots * q_row;
  CPFILL_RETURN_IF_ERROR(attention::cuda::MergePartialsCuda(shape_, slots, po, pl, merged_o,
                                                            nullptr, merged_lse, stream_));
  cudaEvent_t m1 = Mark();
  for (int s = 0; s < ring_plan_.num_sequences(); ++s) {
    const int64_t rows = layout.q_len[s];
    if (rows == 0) continue;
    CPFILL_CUDA_CHECK(cudaMemcpyAsync(
        o + layout.q_offset[s] * q_row, merged_o + ring_plan_.q_slot_offset(s) * q_row,
        rows * q_row * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
    CPFILL_CUDA_CHECK(cudaMemcpyAsync(
        lse + layout.q_offset[s] * heads, merged_lse + ring_plan_.q_slot_offset(s) * heads,
        rows * heads * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
  }
  cudaEvent_t u1 = Mark();
  CPFILL_RETURN_IF_ERROR(cp_.Synchronize());
  t->pack_s += Seconds(pack0, pack1) + Seconds(m1, u1);
  t->all_to_all_s = Seconds(a0, a1);
  t->merge_s = Seconds(a1, m1);
  FillStepTimes(exchanges, c0, c1, t);
  return absl::OkStatus();
}

// ---- all-gather KV (baseline) ------------------------------------------------------------

absl::Status DeviceRingAttention::RunAllGather(const Bf16* q, const Bf16* k, const Bf16* v,
                                               float* o, float* lse, RingTimings* t) {
  const int n = ring_plan_.cp_size();
  const MessageLayout m = KvMessage();
  const sharding::LocalLayout& layout = ring_plan_.layout();
  const size_t kv_row = static_cast<size_t>(shape_.num_kv_heads) * shape_.head_dim * sizeof(Bf16);
  const MessageLayout g = MessageLayout::Make(n * ring_plan_.kv_slots_total(), kv_row, kv_row);
  CPFILL_RETURN_IF_ERROR(s_.msg[0].Reserve(m.bytes));
  CPFILL_RETURN_IF_ERROR(s_.gathered.Reserve(n * m.bytes));
  CPFILL_RETURN_IF_ERROR(s_.gathered_kv.Reserve(g.bytes));

  cudaEvent_t p0 = Mark();
  CPFILL_RETURN_IF_ERROR(PackKv(k, v, s_.msg[0]));
  cudaEvent_t g0 = Mark();
  CPFILL_RETURN_IF_ERROR(cp_.AllGather(s_.msg[0].As<void>(), m.bytes, s_.gathered.As<void>()));
  cudaEvent_t g1 = Mark();
  // Each sequence's keys from all ranks side by side (N * L^i slots at N * kv_slot_offset(i)).
  for (int p = 0; p < n; ++p) {
    for (int s = 0; s < ring_plan_.num_sequences(); ++s) {
      const int64_t src = ring_plan_.kv_slot_offset(s), len = ring_plan_.kv_slots(s);
      const int64_t dst = n * src + p * len;
      if (len == 0) continue;
      const size_t base = p * m.bytes;
      CPFILL_CUDA_CHECK(cudaMemcpyAsync(s_.gathered_kv.As<char>(g.a_offset) + dst * kv_row,
                                        s_.gathered.As<char>(base + m.a_offset) + src * kv_row,
                                        len * kv_row, cudaMemcpyDeviceToDevice, stream_));
      CPFILL_CUDA_CHECK(cudaMemcpyAsync(s_.gathered_kv.As<char>(g.b_offset) + dst * kv_row,
                                        s_.gathered.As<char>(base + m.b_offset) + src * kv_row,
                                        len * kv_row, cudaMemcpyDeviceToDevice, stream_));
      CPFILL_CUDA_CHECK(cudaMemcpyAsync(s_.gathered_kv.As<int32_t>(g.pos_offset) + dst,
                                        s_.gathered.As<int32_t>(base + m.pos_offset) + src, len * 4,
                                        cudaMemcpyDeviceToDevice, stream_));
    }
  }
  cudaEvent_t r1 = Mark();
  std::vector<SequenceSlice> slices;
  ring_plan_.AllGatherSlices(&slices);
  const CudaAttentionArgs a{.shape = shape_,
                            .q = q,
                            .q_pos = s_.q_pos.As<int32_t>(),
                            .q_tokens = layout.q_rows(),
                            .k = s_.gathered_kv.As<Bf16>(g.a_offset),
                            .v = s_.gathered_kv.As<Bf16>(g.b_offset),
                            .k_pos = s_.gathered_kv.As<int32_t>(g.pos_offset),
                            .kv_tokens = n * ring_plan_.kv_slots_total(),
                            .slices = slices.data(),
                            .num_slices = static_cast<int64_t>(slices.size()),
                            .output = OutputMode::kFloat32,
                            .o = o,
                            .lse = lse};
  CPFILL_RETURN_IF_ERROR(Attend(a));
  cudaEvent_t c1 = Mark();
  CPFILL_RETURN_IF_ERROR(cp_.Synchronize());
  RingStepTiming step;
  step.visible_pairs = ring_plan_.AllGatherVisiblePairs();
  t->visible_pairs += step.visible_pairs;
  step.compute_s = Seconds(r1, c1);
  t->steps.push_back(step);
  t->pack_s += Seconds(p0, g0) + Seconds(g1, r1);
  t->all_gather_s = Seconds(g0, g1);
  return absl::OkStatus();
}

absl::Status DeviceRingAttention::Run(RingAlgorithm algorithm, const Bf16* q, const Bf16* k,
                                      const Bf16* v, float* o, float* lse, RingTimings* timings) {
  RingTimings local;
  RingTimings* t = timings ? timings : &local;
  *t = RingTimings{};
  t->algorithm = algorithm;
  s_.next_event = 0;
  const auto t0 = Clock::now();
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
  t->total_s = std::chrono::duration<double>(Clock::now() - t0).count();
  return status;
}

}  // namespace cpfill::parallel
