#include "parallel/cuda/nccl_communicator.h"

#include <sched.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "attention/cuda/attention_cuda.h"
#include "base/knobs.h"
#include "base/status.h"
#include "parallel/mpi_communicator.h"

namespace cpfill::parallel {
namespace {

using Clock = std::chrono::steady_clock;

// Events reused in turn (2 per operation). Each is waited on right after it is recorded, and a
// wait holds the record it saw, so reusing one whose work is still queued is safe: a forward
// enqueued without host waits (hundreds of operations) may wrap around.
constexpr size_t kEventRing = 256;
// How long NcclCommunicator::Settle spins before it sleeps between polls.
constexpr auto kSettleSpin = std::chrono::milliseconds(1);

#define CPFILL_NCCL_CHECK(call)                                                                 \
  do {                                                                                          \
    const ncclResult_t cpfill_nccl_rc_ = (call);                                                \
    if (cpfill_nccl_rc_ != ncclSuccess && cpfill_nccl_rc_ != ncclInProgress)                    \
      return absl::InternalError(absl::StrCat("NCCL call ", #call,                              \
                                              " failed: ", ncclGetErrorString(cpfill_nccl_rc_), \
                                              " (", __FILE__, ":", __LINE__, ")"));             \
  } while (0)

// Polls a non-blocking communicator until it is ready; aborts it on an error or the deadline.
absl::Status WaitReady(ncclComm_t comm, std::chrono::milliseconds timeout,
                       const std::string& what) {
  const auto deadline = Clock::now() + timeout;
  while (true) {
    ncclResult_t state = ncclSuccess;
    CPFILL_NCCL_CHECK(ncclCommGetAsyncError(comm, &state));
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) {
      ncclCommAbort(comm);
      return absl::InternalError(absl::StrCat(what, " failed: ", ncclGetErrorString(state)));
    }
    if (Clock::now() > deadline) {
      ncclCommAbort(comm);
      return absl::DeadlineExceededError(absl::StrCat(
          what, " did not complete within ", std::chrono::duration<double>(timeout).count(),
          " s (a peer is dead or stuck); the communicator was aborted"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

ncclDataType_t ToNccl(DataType t) {
  switch (t) {
    case DataType::kFloat32:
      return ncclFloat32;
    case DataType::kFloat64:
      return ncclFloat64;
    case DataType::kInt32:
      return ncclInt32;
    case DataType::kInt64:
      return ncclInt64;
  }
  return ncclUint8;
}

ncclRedOp_t ToNccl(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kMin:
      return ncclMin;
  }
  return ncclSum;
}

}  // namespace

// A ring exchange whose enqueue may still be under way on NCCL's thread (SettleExchange).
class NcclExchange : public PendingExchange {
 public:
  NcclExchange(NcclCommunicator* owner, cudaEvent_t start, cudaEvent_t end, cudaStream_t compute)
      : owner_(owner), start_(start), end_(end), compute_(compute) {}
  // Orders the compute stream after the exchange; the host does not wait for the transfer.
  absl::Status Wait() override {
    CPFILL_RETURN_IF_ERROR(owner_->SettleExchange());
    CPFILL_CUDA_CHECK(cudaStreamWaitEvent(compute_, end_, 0));
    return absl::OkStatus();
  }
  // Valid once the exchange has completed (after the communicator's Synchronize()).
  double transfer_s() const override {
    float ms = 0;
    if (cudaEventElapsedTime(&ms, start_, end_) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return ms / 1e3;
  }
  // Recorded once the exchange is enqueued: a failure to settle shows again in Wait().
  void* device_event() const override {
    owner_->SettleExchange().IgnoreError();
    return end_;
  }

 private:
  NcclCommunicator* owner_;
  cudaEvent_t start_, end_;
  cudaStream_t compute_;
};

namespace {

// The communication stream's priority (CPFILL_COMMUNICATION_PRIORITY): the device's highest
// for "high", else the default (0). Measured on 4 H200s at CP4: no change.
absl::StatusOr<int> CommunicationStreamPriority() {
  if (knobs::Choice(knobs::kCommunicationPriority) != "high") return 0;
  int least = 0, greatest = 0;
  CPFILL_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  return greatest;
}

}  // namespace

NcclCommunicator::NcclCommunicator(ncclComm_t comm, std::string name, cudaStream_t compute,
                                   CommOptions options)
    : comm_(comm), name_(std::move(name)), compute_(compute), options_(options) {}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Make(ncclComm_t comm,
                                                                         std::string name,
                                                                         cudaStream_t compute,
                                                                         CommOptions options,
                                                                         ncclComm_t ring_comm) {
  std::unique_ptr<NcclCommunicator> c(
      new NcclCommunicator(comm, std::move(name), compute, options));
  c->ring_comm_ = ring_comm;
  CPFILL_NCCL_CHECK(ncclCommUserRank(comm, &c->rank_));
  CPFILL_NCCL_CHECK(ncclCommCount(comm, &c->size_));
  CPFILL_ASSIGN_OR_RETURN(const int priority, CommunicationStreamPriority());
  CPFILL_CUDA_CHECK(
      cudaStreamCreateWithPriority(&c->comm_stream_, cudaStreamNonBlocking, priority));
  CPFILL_CUDA_CHECK(cudaMalloc(&c->scratch_, 16));
  c->events_.resize(kEventRing);
  for (auto& e : c->events_) CPFILL_CUDA_CHECK(cudaEventCreate(&e));
  return c;
}

NcclCommunicator::~NcclCommunicator() {
  // Synchronize() aborts both communicators itself on an NCCL error or its deadline; abort here
  // only what it left (a CUDA error, or a Make() that failed before its events existed).
  if (comm_ != nullptr && !aborted_) {
    if (!events_.empty() && Synchronize().ok()) {
      ncclCommDestroy(comm_);
      if (ring_comm_ != nullptr) ncclCommDestroy(ring_comm_);
    } else if (!aborted_) {
      Abort();
    }
  }
  for (auto e : events_) cudaEventDestroy(e);
  cudaFree(scratch_);
  if (comm_stream_) cudaStreamDestroy(comm_stream_);
}

cudaEvent_t NcclCommunicator::NextEvent() {
  cudaEvent_t e = events_[next_event_];
  next_event_ = (next_event_ + 1) % events_.size();
  return e;
}

absl::Status NcclCommunicator::BeginOp(const std::string& what) {
  if (aborted_) return AbortedError();
  CPFILL_RETURN_IF_ERROR(SettleExchange());  // no NCCL call may follow an unsettled one
  last_op_ = what;
  cudaEvent_t ready = NextEvent();
  CPFILL_CUDA_CHECK(cudaEventRecord(ready, compute_));
  CPFILL_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, ready, 0));
  return absl::OkStatus();
}

void NcclCommunicator::Abort() {
  ncclCommAbort(comm_);
  if (ring_comm_ != nullptr) ncclCommAbort(ring_comm_);
  aborted_ = true;
}

absl::Status NcclCommunicator::AsyncError(ncclResult_t* state) {
  *state = ncclSuccess;
  for (ncclComm_t c : {comm_, ring_comm_}) {
    if (c == nullptr) continue;
    CPFILL_NCCL_CHECK(ncclCommGetAsyncError(c, state));
    if (*state != ncclSuccess && *state != ncclInProgress) break;
  }
  return absl::OkStatus();
}

absl::Status NcclCommunicator::Settle(ncclComm_t comm) {
  // A non-blocking communicator's call returns ncclInProgress while NCCL enqueues it on a thread
  // of its own (NCCL 2.28 does so for every group; older versions while peers connect); no other
  // call may follow until the state is ncclSuccess again. This waits for the enqueue only, not
  // for the transfer, and under the same deadline.
  const auto start = Clock::now(), deadline = start + options_.timeout;
  while (true) {
    ncclResult_t state = ncclSuccess;
    CPFILL_NCCL_CHECK(ncclCommGetAsyncError(comm, &state));
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) {
      Abort();
      return absl::InternalError(absl::StrCat("NCCL error on ", name_, " rank ", rank_, ": ",
                                              ncclGetErrorString(state), " (", last_op_, ")"));
    }
    const auto now = Clock::now();
    if (now > deadline) {
      Abort();
      return absl::DeadlineExceededError(
          absl::StrCat(last_op_, " could not be enqueued within ",
                       std::chrono::duration<double>(options_.timeout).count(),
                       " s (a peer is dead or stuck); NCCL communicator aborted"));
    }
    // A steady-state enqueue ends within tens of microseconds: spin for it, since a sleep of
    // 20 us lasts 70 or more (the timer's slack) and a decode step makes two calls per layer.
    // Only a long wait (peers connecting) sleeps.
    if (now - start < kSettleSpin) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

absl::Status NcclCommunicator::AbortedError() const {
  if (!settle_error_.ok()) return settle_error_;  // the failure that aborted it, if it was ours
  return absl::FailedPreconditionError(
      absl::StrCat("NCCL communicator ", name_, " was aborted after an earlier failure"));
}

absl::Status NcclCommunicator::SettleExchange() {
  if (unsettled_ == nullptr) return settle_error_;
  const ncclComm_t comm = unsettled_;
  unsettled_ = nullptr;
  settle_error_ = Settle(comm);
  if (settle_error_.ok() && cudaEventRecord(unsettled_end_, comm_stream_) != cudaSuccess) {
    settle_error_ = absl::InternalError(absl::StrCat("recording the end of ", last_op_, ": ",
                                                     cudaGetErrorString(cudaGetLastError())));
  }
  return settle_error_;
}

absl::Status NcclCommunicator::EndOp() {
  cudaEvent_t done = NextEvent();
  CPFILL_CUDA_CHECK(cudaEventRecord(done, comm_stream_));
  CPFILL_CUDA_CHECK(cudaStreamWaitEvent(compute_, done, 0));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<PendingExchange>> NcclCommunicator::StartRingExchange(
    const void* send, void* recv, size_t bytes) {
  const int next = next_rank(), prev = prev_rank();
  CPFILL_RETURN_IF_ERROR(BeginOp(absl::StrCat("ring exchange on ", name_, " (rank ", rank_, " of ",
                                              size_, "): send ", bytes, " bytes to rank ", next,
                                              ", receive ", bytes, " bytes from rank ", prev)));
  cudaEvent_t start = NextEvent(), end = NextEvent();
  CPFILL_CUDA_CHECK(cudaEventRecord(start, comm_stream_));
  // Step 1: one group, so the send and the receive progress together.
  ncclComm_t comm = ring_comm_ != nullptr ? ring_comm_ : comm_;
  CPFILL_NCCL_CHECK(ncclGroupStart());
  CPFILL_NCCL_CHECK(ncclSend(send, bytes, ncclUint8, next, comm, comm_stream_));
  CPFILL_NCCL_CHECK(ncclRecv(recv, bytes, ncclUint8, prev, comm, comm_stream_));
  CPFILL_NCCL_CHECK(ncclGroupEnd());
  // Settled (and `end` recorded) when the exchange is waited for or the next call begins: in
  // between, NCCL's thread enqueues the transfer while this one enqueues the step's attention.
  unsettled_ = comm;
  unsettled_end_ = end;
  return std::unique_ptr<PendingExchange>(
      std::make_unique<NcclExchange>(this, start, end, compute_));
}

absl::Status NcclCommunicator::AllToAll(const void* send, std::span<const size_t> send_bytes,
                                        std::span<const size_t> send_offsets, void* recv,
                                        std::span<const size_t> recv_bytes,
                                        std::span<const size_t> recv_offsets) {
  const size_t n = static_cast<size_t>(size_);
  CPFILL_CHECK_ARG(send_bytes.size() == n && send_offsets.size() == n && recv_bytes.size() == n &&
                       recv_offsets.size() == n,
                   "all-to-all on ", name_, ": size arrays must have ", n, " entries");
  size_t total = 0;
  for (size_t p = 0; p < n; ++p) total += send_bytes[p];
  CPFILL_RETURN_IF_ERROR(BeginOp(absl::StrCat("all-to-all on ", name_, " (rank ", rank_, " of ",
                                              size_, "): send ", total, " bytes")));
  if (send_bytes[rank_] > 0) {
    CPFILL_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(recv) + recv_offsets[rank_],
                                      static_cast<const char*>(send) + send_offsets[rank_],
                                      send_bytes[rank_], cudaMemcpyDeviceToDevice, comm_stream_));
  }
  CPFILL_NCCL_CHECK(ncclGroupStart());
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    if (send_bytes[p] > 0) {
      CPFILL_NCCL_CHECK(ncclSend(static_cast<const char*>(send) + send_offsets[p], send_bytes[p],
                                 ncclUint8, p, comm_, comm_stream_));
    }
    if (recv_bytes[p] > 0) {
      CPFILL_NCCL_CHECK(ncclRecv(static_cast<char*>(recv) + recv_offsets[p], recv_bytes[p],
                                 ncclUint8, p, comm_, comm_stream_));
    }
  }
  CPFILL_NCCL_CHECK(ncclGroupEnd());
  CPFILL_RETURN_IF_ERROR(Settle(comm_));
  return EndOp();
}

absl::Status NcclCommunicator::AllGather(const void* send, size_t bytes, void* recv) {
  CPFILL_RETURN_IF_ERROR(BeginOp(absl::StrCat("all-gather on ", name_, " (rank ", rank_, " of ",
                                              size_, "): ", bytes, " bytes each")));
  CPFILL_NCCL_CHECK(ncclAllGather(send, recv, bytes, ncclUint8, comm_, comm_stream_));
  CPFILL_RETURN_IF_ERROR(Settle(comm_));
  return EndOp();
}

absl::Status NcclCommunicator::AllReduce(void* data, size_t count, DataType type, ReduceOp op) {
  CPFILL_RETURN_IF_ERROR(BeginOp(absl::StrCat("all-reduce on ", name_, " (rank ", rank_, " of ",
                                              size_, "): ", count, " elements")));
  CPFILL_NCCL_CHECK(
      ncclAllReduce(data, data, count, ToNccl(type), ToNccl(op), comm_, comm_stream_));
  CPFILL_RETURN_IF_ERROR(Settle(comm_));
  return EndOp();
}

absl::Status NcclCommunicator::Broadcast(void* data, size_t bytes, int root) {
  CPFILL_CHECK_ARG(root >= 0 && root < size_, "broadcast root ", root, " outside ", name_);
  CPFILL_RETURN_IF_ERROR(
      BeginOp(absl::StrCat("broadcast on ", name_, " of ", bytes, " bytes from rank ", root)));
  CPFILL_NCCL_CHECK(ncclBroadcast(data, data, bytes, ncclUint8, root, comm_, comm_stream_));
  CPFILL_RETURN_IF_ERROR(Settle(comm_));
  return EndOp();
}

absl::Status NcclCommunicator::Barrier() {
  // NCCL has no barrier: an all-reduce of one value waits for every rank, then the host waits.
  CPFILL_RETURN_IF_ERROR(AllReduce(scratch_, 1, DataType::kInt32, ReduceOp::kSum));
  return Synchronize();
}

absl::Status NcclCommunicator::Synchronize() {
  if (aborted_) return AbortedError();
  CPFILL_RETURN_IF_ERROR(SettleExchange());
  // Both streams: the compute stream's last kernels as well as the communication. (Waiting for
  // the communication stream alone let a caller read O while the last merge still ran.)
  cudaEvent_t computed = NextEvent(), done = NextEvent();
  CPFILL_CUDA_CHECK(cudaEventRecord(computed, compute_));
  CPFILL_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, computed, 0));
  CPFILL_CUDA_CHECK(cudaEventRecord(done, comm_stream_));
  const auto deadline = Clock::now() + options_.timeout;
  // While this host waits, a census another rank takes counts it as communicating.
  NoteWaitOutsideMpi(absl::StrCat("NCCL: ", last_op_));
  struct EndWait {
    ~EndWait() { EndWaitOutsideMpi(); }
  } end_wait;
  while (true) {
    const cudaError_t e = cudaEventQuery(done);
    if (e == cudaSuccess) return absl::OkStatus();
    if (e != cudaErrorNotReady) {
      CPFILL_CUDA_CHECK(e);
    }
    ncclResult_t state = ncclSuccess;
    CPFILL_RETURN_IF_ERROR(AsyncError(&state));
    if (state != ncclSuccess && state != ncclInProgress) {
      Abort();
      return absl::InternalError(absl::StrCat("NCCL error on ", name_, " rank ", rank_, ": ",
                                              ncclGetErrorString(state),
                                              " (last operation: ", last_op_, ")"));
    }
    if (Clock::now() > deadline) {
      // Abort so the kernels waiting for a dead peer end and this rank can report and exit.
      Abort();
      return absl::DeadlineExceededError(
          absl::StrCat(last_op_, " did not complete within ",
                       std::chrono::duration<double>(options_.timeout).count(),
                       " s (a peer is dead, stuck or much slower); NCCL communicator aborted. ",
                       CensusOfWorld(std::chrono::seconds(5))));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

absl::Status CudaStream::Create() {
  CPFILL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  return absl::OkStatus();
}

namespace {

// NCCL's proxy thread (and its socket threads over TCP) run beside the rank's own thread; bound
// to one core they wait for it: measured on two GPUs of one host over sockets, a CP2 decode
// step's ring took 2.0x as long and a 128K prefill 2.1x as long as with `--bind-to none`.
// mpirun binds each rank to one core by default when it starts two or fewer.
void WarnIfBoundToOneCore(const ProcessGrid& grid) {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (grid.world_size < 2 || grid.world_rank != 0 || sched_getaffinity(0, sizeof(set), &set) != 0 ||
      CPU_COUNT(&set) != 1) {
    return;
  }
  std::fprintf(stderr,
               "cpfill: warning: world rank 0 may run on one CPU core only (its affinity mask), "
               "and NCCL's proxy threads share it: communication between hosts (sockets, "
               "InfiniBand) slows severalfold. Launch with `mpirun --bind-to none`, or give each "
               "rank several cores (`--map-by ppr:N:node:pe=K`).\n");
}

// Splits `parent` (non-blocking, as every communicator here) by color and key, waiting for both
// under the deadline. `max_ctas` > 0 caps the new communicator's kernels at that many CTAs.
absl::StatusOr<ncclComm_t> SplitComm(ncclComm_t parent, int color, int key, int max_ctas,
                                     std::chrono::milliseconds timeout, const std::string& what) {
  ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
  c.blocking = 0;
  if (max_ctas > 0) {
    c.minCTAs = 1;
    c.maxCTAs = max_ctas;
  }
  ncclComm_t comm = nullptr;
  CPFILL_NCCL_CHECK(ncclCommSplit(parent, color, key, &comm, &c));
  CPFILL_RETURN_IF_ERROR(WaitReady(parent, timeout, absl::StrCat(what, ": the split")));
  CPFILL_RETURN_IF_ERROR(WaitReady(comm, timeout, what));
  return comm;
}

// The CP ring's communicator for ring exchanges: the same ranks, its kernels capped at the SMs
// the attention kernel leaves free (CPFILL_RING_EXCHANGE_CTAS, CPFILL_COMMUNICATION_SMS). Null
// where there is no ring or no cap. The knobs are read alike on every rank, so every member
// splits or none does.
absl::StatusOr<ncclComm_t> SplitRingExchanges(ncclComm_t cp, const ProcessGrid& grid,
                                              std::chrono::milliseconds timeout) {
  const int ctas = attention::cuda::SmsForCommunication();
  if (grid.cp_size < 2 || ctas < 1 || knobs::Choice(knobs::kRingExchangeCtas) != "sms") {
    return nullptr;
  }
  return SplitComm(cp, 0, grid.cp_rank, ctas, timeout,
                   absl::StrCat("NCCL cp ring of world rank ", grid.world_rank));
}

}  // namespace

absl::StatusOr<NcclGrid> CreateNcclGrid(const ProcessGrid& grid, CommOptions options) {
  WarnIfBoundToOneCore(grid);
  NcclGrid out;
  // Step 0: a GPU for every rank, picked by the rank's place on its host.
  const int devices = attention::cuda::DeviceCount();
  int32_t have = devices > 0 ? 1 : 0;
  CPFILL_RETURN_IF_ERROR(grid.world->AllReduce(&have, 1, DataType::kInt32, ReduceOp::kMin));
  if (!have) {
    return absl::FailedPreconditionError("NCCL: a rank sees no CUDA device");
  }
  out.device = grid.host_rank % devices;
  CPFILL_CUDA_CHECK(cudaSetDevice(out.device));
  CPFILL_RETURN_IF_ERROR(out.compute.Create());
  const cudaStream_t compute_stream = out.compute.get();

  // Step 1: every TP group sits on one host (TP all-reduces are meant for NVLink). The verdict
  // is made global, so every rank fails alike instead of some waiting in NCCL's init.
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  int64_t hash[2] = {static_cast<int64_t>(std::hash<std::string>{}(host) >> 1), 0};
  hash[1] = -hash[0];
  CPFILL_RETURN_IF_ERROR(grid.tp->AllReduce(hash, 2, DataType::kInt64, ReduceOp::kMax));
  int32_t tp_on_one_host = hash[0] == -hash[1] ? 1 : 0;
  CPFILL_RETURN_IF_ERROR(
      grid.world->AllReduce(&tp_on_one_host, 1, DataType::kInt32, ReduceOp::kMin));
  if (!tp_on_one_host) {
    return absl::FailedPreconditionError(
        "a TP group spans several hosts; launch the ranks of a node contiguously (--map-by "
        "slot) with --tp dividing the ranks per host");
  }

  // Step 2: the world communicator from rank 0's id, non-blocking, polled with a deadline.
  ncclUniqueId id;
  if (grid.world_rank == 0) CPFILL_NCCL_CHECK(ncclGetUniqueId(&id));
  CPFILL_RETURN_IF_ERROR(grid.world->Broadcast(&id, sizeof(id), 0));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t world = nullptr;
  CPFILL_NCCL_CHECK(ncclCommInitRankConfig(&world, grid.world_size, id, grid.world_rank, &config));
  CPFILL_RETURN_IF_ERROR(
      WaitReady(world, options.timeout, absl::StrCat("NCCL init of world rank ", grid.world_rank)));

  // Step 3: TP and CP by splitting the world with the MPI groups' colors and keys.
  auto split = [&](int color, const std::string& name) {
    return SplitComm(world, color, grid.world_rank, /*max_ctas=*/0, options.timeout,
                     absl::StrCat("NCCL ", name, " of world rank ", grid.world_rank));
  };
  // A TP group's color is its lowest world rank: unique, and known to every member through MPI.
  int64_t tp_leader = grid.world_rank;
  CPFILL_RETURN_IF_ERROR(grid.tp->AllReduce(&tp_leader, 1, DataType::kInt64, ReduceOp::kMin));
  CPFILL_ASSIGN_OR_RETURN(ncclComm_t tp, split(static_cast<int>(tp_leader), "tp"));
  CPFILL_ASSIGN_OR_RETURN(ncclComm_t cp, split(grid.tp_rank, "cp"));
  CPFILL_ASSIGN_OR_RETURN(ncclComm_t cp_ring, SplitRingExchanges(cp, grid, options.timeout));
  CPFILL_ASSIGN_OR_RETURN(out.world,
                          NcclCommunicator::Make(world, "world", compute_stream, options));
  CPFILL_ASSIGN_OR_RETURN(out.tp, NcclCommunicator::Make(tp, "tp", compute_stream, options));
  CPFILL_ASSIGN_OR_RETURN(out.cp,
                          NcclCommunicator::Make(cp, "cp", compute_stream, options, cp_ring));
  CPFILL_CHECK_INTERNAL(out.cp->rank() == grid.cp_rank && out.cp->size() == grid.cp_size &&
                            out.tp->rank() == grid.tp_rank && out.tp->size() == grid.tp_size,
                        "NCCL groups differ from MPI's: cp ", out.cp->rank(), "/", out.cp->size(),
                        " vs ", grid.cp_rank, "/", grid.cp_size);
  return out;
}

}  // namespace cpfill::parallel
