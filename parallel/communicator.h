// cpfill/parallel/communicator.h — the one communication interface the ring algorithms use.
//
// Implementations: MpiCommunicator (host memory, parallel/mpi_communicator.h) and, with the CUDA
// backend, an NCCL one (device memory). Ring algorithms are written once against this interface.
//
// Every operation has a deadline (CommOptions::timeout). A peer that does not answer in time
// turns into DeadlineExceeded naming this rank, the peer, the operation and the byte count; the
// caller ends the job (launch/ aborts all ranks), so a dead or stuck rank never hangs the others.
//
//   auto ex = comm.StartRingExchange(send, recv, bytes);   // to next, from previous; async
//   Compute();                                             // overlaps the exchange
//   CPFILL_RETURN_IF_ERROR((*ex)->Wait());
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace cpfill::parallel {

enum class DataType { kFloat32, kFloat64, kInt32, kInt64 };
enum class ReduceOp { kSum, kMax, kMin };
size_t DataTypeSize(DataType type);

struct CommOptions {
  // Deadline of every wait. Generous by default: a slow rank (a long reference computation, a
  // loaded CI machine) must not be mistaken for a dead one.
  std::chrono::milliseconds timeout{std::chrono::seconds(600)};
};

// An exchange in flight. Wait() blocks until both the send and the receive completed.
class PendingExchange {
 public:
  virtual ~PendingExchange() = default;
  virtual absl::Status Wait() = 0;
  // Seconds from posting to completion as seen by the progress side; valid after Wait().
  virtual double transfer_s() const = 0;
  // A device exchange: the CUDA event (cudaEvent_t) recorded when it has ended, which device work
  // may wait for; null for a host exchange. Asking for it may hold the host until the exchange
  // is enqueued (NCCL's non-blocking enqueue, within the communicator's deadline).
  virtual void* device_event() const { return nullptr; }
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "world", "tp" or "cp": names the group in error messages.
  virtual const std::string& name() const = 0;

  // Step of a ring: sends `bytes` from `send` to rank+1 and receives `bytes` into `recv` from
  // rank-1 (mod size). Returns at once; the transfer progresses while the caller computes.
  // `send` and `recv` must stay valid and untouched until Wait() returns. Equal sizes on every
  // rank (the ring algorithms pad to make it so).
  virtual absl::StatusOr<std::unique_ptr<PendingExchange>> StartRingExchange(const void* send,
                                                                             void* recv,
                                                                             size_t bytes) = 0;

  // Rank r sends send_bytes[p] bytes at send + send_offsets[p] to every peer p, and receives
  // recv_bytes[p] bytes from p at recv + recv_offsets[p]. Sizes may differ per peer (and be 0);
  // what r sends to p must equal what p expects from r.
  virtual absl::Status AllToAll(const void* send, std::span<const size_t> send_bytes,
                                std::span<const size_t> send_offsets, void* recv,
                                std::span<const size_t> recv_bytes,
                                std::span<const size_t> recv_offsets) = 0;

  // recv holds size() blocks of `bytes`, block p from rank p.
  virtual absl::Status AllGather(const void* send, size_t bytes, void* recv) = 0;
  virtual absl::Status AllReduce(void* data, size_t count, DataType type, ReduceOp op) = 0;
  virtual absl::Status Broadcast(void* data, size_t bytes, int root) = 0;
  virtual absl::Status Barrier() = 0;

  int next_rank() const { return (rank() + 1) % size(); }
  int prev_rank() const { return (rank() + size() - 1) % size(); }
};

// Agrees on a verdict: true on every rank iff `ok` on every rank. Used by multi-rank tests and
// by --check so all ranks exit with the same code.
absl::StatusOr<bool> AllRanksOk(Communicator& comm, bool ok);

// Every rank's `text`, in rank order, on every rank (two all-gathers: the lengths, then the
// texts padded to the longest). For reports that show every rank, not one.
absl::StatusOr<std::vector<std::string>> AllGatherText(Communicator& comm, const std::string& text);

}  // namespace cpfill::parallel
