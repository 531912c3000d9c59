// cpfill/parallel/self_communicator.h — a Communicator of one rank.
//
// Lets code written for TP and CP groups run as a single rank without MPI in the loop: a ring
// exchange copies send to receive, collectives are copies or no-ops. The single-rank reference
// of `--check` is the same model code on SelfCommunicators.
//
//   SelfCommunicator self("cp");
//   auto ring = RingAttention::Create(self, plan_for_cp1, shape, &ops);  // ops: a CpuRingOps
#pragma once

#include <cstring>
#include <string>

#include "parallel/communicator.h"

namespace cpfill::parallel {

class SelfCommunicator : public Communicator {
 public:
  explicit SelfCommunicator(std::string name) : name_(std::move(name)) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const std::string& name() const override { return name_; }

  absl::StatusOr<std::unique_ptr<PendingExchange>> StartRingExchange(const void* send, void* recv,
                                                                     size_t bytes) override {
    if (send != recv) std::memmove(recv, send, bytes);
    return std::unique_ptr<PendingExchange>(std::make_unique<Done>());
  }
  absl::Status AllToAll(const void* send, std::span<const size_t> send_bytes,
                        std::span<const size_t> send_offsets, void* recv,
                        std::span<const size_t> recv_bytes,
                        std::span<const size_t> recv_offsets) override {
    if (send_bytes.size() != 1 || recv_bytes.size() != 1 || send_bytes[0] != recv_bytes[0]) {
      return absl::InvalidArgumentError("all-to-all on a single rank: sizes must match");
    }
    std::memmove(static_cast<char*>(recv) + recv_offsets[0],
                 static_cast<const char*>(send) + send_offsets[0], send_bytes[0]);
    return absl::OkStatus();
  }
  absl::Status AllGather(const void* send, size_t bytes, void* recv) override {
    if (send != recv) std::memmove(recv, send, bytes);
    return absl::OkStatus();
  }
  absl::Status AllReduce(void*, size_t, DataType, ReduceOp) override { return absl::OkStatus(); }
  absl::Status Broadcast(void*, size_t, int root) override {
    return root == 0 ? absl::OkStatus()
                     : absl::InvalidArgumentError("broadcast root outside a single rank");
  }
  absl::Status Barrier() override { return absl::OkStatus(); }

 private:
  struct Done : PendingExchange {
    absl::Status Wait() override { return absl::OkStatus(); }
    double transfer_s() const override { return 0; }
  };
  std::string name_;
};

}  // namespace cpfill::parallel
