// cpfill/parallel/cuda/nccl_communicator.h — NCCL communicators bootstrapped from MPI, and the
// Communicator on device memory that the device ring runs on.
//
// Start-up (CreateNcclGrid): the GPU is picked by the rank's place on its host; every TP group
// is checked to sit on one host; world rank 0's ncclUniqueId travels over MPI (a broadcast with
// a deadline); the world communicator is created non-blocking and polled until ready or the
// deadline; TP and CP communicators come from ncclCommSplit with the MPI groups' colors and
// keys, so NCCL ranks equal MPI ranks in every group. A communicator that does not become ready
// in time is aborted (ncclCommAbort) and the error names the rank and the step. A CP ring of more
// than one rank gets a second communicator for its ring exchanges, whose kernels may use at most
// the SMs the attention kernel leaves free beside an exchange (CPFILL_COMMUNICATION_SMS):
// NCCL's own CTA count does not fit there, and on 4 H200s the CTAs left over waited for the
// attention kernel to end, so the SMs held back for the exchange never joined that kernel. The
// ring bandwidth the selector measures (launch/ MeasureRingGbps) goes through it too, as the
// ring's own exchanges do.
//
// Stream semantics (NcclCommunicator): every operation is enqueued on the communicator's own
// stream after the work already on the compute stream (an event), and the compute stream is made
// to wait for it (another event). The communicators are non-blocking: NCCL enqueues each call on a
// thread of its own and returns ncclInProgress, and the call is polled to completion of its
// enqueue, under the deadline, before the next call (a ring exchange's when it is waited for, so
// its enqueue overlaps the step's attention being enqueued). The host never waits for a transfer:
// calls return once enqueued, and PendingExchange::Wait() only orders the compute stream.
// Synchronize() is the one host wait: it polls the last event and NCCL's asynchronous error state
// until done or the deadline, and on a deadline aborts the communicator so no rank hangs.
//
//   CPFILL_ASSIGN_OR_RETURN(NcclGrid nccl, CreateNcclGrid(grid, options, compute_stream));
//   auto ex = nccl.cp->StartRingExchange(d_send, d_recv, bytes);   // enqueued
//   LaunchKernel(compute_stream);                                   // overlaps the exchange
//   (*ex)->Wait();                                                  // compute waits, host not
//   CPFILL_RETURN_IF_ERROR(nccl.cp->Synchronize());                 // host waits, with deadline
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"
#include "parallel/grid.h"

namespace cpfill::parallel {

class NcclCommunicator : public Communicator {
 public:
  ~NcclCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }

  // Device pointers. Enqueued; see the file comment for ordering.
  absl::StatusOr<std::unique_ptr<PendingExchange>> StartRingExchange(const void* send, void* recv,
                                                                     size_t bytes) override;
  absl::Status AllToAll(const void* send, std::span<const size_t> send_bytes,
                        std::span<const size_t> send_offsets, void* recv,
                        std::span<const size_t> recv_bytes,
                        std::span<const size_t> recv_offsets) override;
  absl::Status AllGather(const void* send, size_t bytes, void* recv) override;
  absl::Status AllReduce(void* data, size_t count, DataType type, ReduceOp op) override;
  absl::Status Broadcast(void* data, size_t bytes, int root) override;
  absl::Status Barrier() override;

  // Waits on the host until everything enqueued so far on the communication stream and on the
  // compute stream is done, within the deadline; on a deadline or an NCCL error the
  // communicator is aborted and the status names the last operation.
  absl::Status Synchronize();

  cudaStream_t comm_stream() const { return comm_stream_; }

 private:
  friend absl::StatusOr<struct NcclGrid> CreateNcclGrid(const ProcessGrid&, CommOptions);
  NcclCommunicator(ncclComm_t comm, std::string name, cudaStream_t compute, CommOptions options);
  // `ring_comm` (may be null): the same ranks, for ring exchanges only.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Make(ncclComm_t comm, std::string name,
                                                                cudaStream_t compute,
                                                                CommOptions options,
                                                                ncclComm_t ring_comm = nullptr);

  // Orders the communication stream after the compute stream's work so far.
  absl::Status BeginOp(const std::string& what);
  // Orders the compute stream after the communication stream's work so far.
  absl::Status EndOp();
  // Waits (deadline-bounded) until a non-blocking call on `comm` has been fully enqueued.
  absl::Status Settle(ncclComm_t comm);
  // Settles the last ring exchange, if it is not yet, and records its end event. A failure is
  // kept: SettleExchange returns it again, and so does every later call once the communicator
  // is aborted (AbortedError).
  absl::Status SettleExchange();
  // What a call on an aborted communicator returns: the settle failure that aborted it, else a
  // generic error.
  absl::Status AbortedError() const;
  friend class NcclExchange;
  // The first asynchronous error of either communicator (ncclInProgress counts as none).
  absl::Status AsyncError(ncclResult_t* state);
  // Aborts both communicators; every later call fails.
  void Abort();
  cudaEvent_t NextEvent();

  ncclComm_t comm_ = nullptr;
  ncclComm_t ring_comm_ = nullptr;  // ring exchanges, their CTAs capped; null: comm_
  std::string name_;
  int rank_ = 0, size_ = 1;
  cudaStream_t compute_ = nullptr;  // not owned
  cudaStream_t comm_stream_ = nullptr;
  CommOptions options_;
  std::vector<cudaEvent_t> events_;  // a ring of events reused in turn: no allocation per op
  size_t next_event_ = 0;
  int32_t* scratch_ = nullptr;  // device word for Barrier()
  std::string last_op_;
  bool aborted_ = false;
  // The ring exchange whose enqueue has not been settled yet (null: none), and its end event.
  ncclComm_t unsettled_ = nullptr;
  cudaEvent_t unsettled_end_ = nullptr;
  absl::Status settle_error_;
};

// An owned CUDA stream.
class CudaStream {
 public:
  CudaStream() = default;
  ~CudaStream() {
    if (stream_) cudaStreamDestroy(stream_);
  }
  CudaStream(CudaStream&& o) noexcept : stream_(o.stream_) { o.stream_ = nullptr; }
  CudaStream& operator=(CudaStream&& o) noexcept {
    std::swap(stream_, o.stream_);
    return *this;
  }
  absl::Status Create();
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// The NCCL side of a process grid. `compute` is the stream the rank's kernels run on; every
// communicator orders its work against it. Declared first, so it outlives the communicators.
struct NcclGrid {
  CudaStream compute;
  int device = 0;
  std::unique_ptr<NcclCommunicator> world, tp, cp;
};

// Collective over the process grid's world: picks the GPU, creates the compute stream and the
// communicators. FailedPrecondition when a TP group spans hosts or a rank sees no GPU;
// DeadlineExceeded when NCCL does not come up in time (the communicator is then aborted).
absl::StatusOr<NcclGrid> CreateNcclGrid(const ProcessGrid& grid, CommOptions options);

}  // namespace cpfill::parallel
