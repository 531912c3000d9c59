// cpfill/launch/job/backend.h — where attention runs, chosen once per command: the CPU, the CUDA
// kernel inside the host ring ("cuda-staged"), or the device ring on NCCL ("cuda").
//
// A Backend is created once per process (NCCL comes up once), then makes a Runner per shard
// plan and measures the two numbers the selector needs: compute rate C and ring bandwidth BW.
//
//   CPFILL_ASSIGN_OR_RETURN(auto backend, Backend::Create("cuda", grid, options, threads));
//   CPFILL_ASSIGN_OR_RETURN(auto runner, backend->MakeRunner(plan, shape, batch, slice));
//   CPFILL_RETURN_IF_ERROR(runner->Run(RingAlgorithm::kPassKV, &timings, nullptr));
#pragma once

#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attention/attention.h"
#include "launch/job/synthetic_attention.h"
#include "parallel/grid.h"
#include "parallel/mixed_ring.h"
#include "parallel/ring_attention.h"
#include "sharding/plan.h"

namespace cpfill::launch {

// One shard plan's attention on one backend. Inputs are made at construction; Run() may repeat.
class Runner {
 public:
  virtual ~Runner() = default;
  // One algorithm per sequence of the plan (parallel::MixedRing: a ring per run of equal ones).
  virtual absl::Status Run(std::span<const parallel::RingAlgorithm> per_sequence,
                           parallel::RingTimings* t,
                           parallel::RingAttention::StepCallback progress) = 0;
  // This rank's O [q_rows, heads, head_dim] and LSE [q_rows, heads] in fp32, on the host.
  virtual absl::Status Fetch(std::vector<float>* o, std::vector<float>* lse) = 0;
};

// Resolves a --backend name to one of `valid` (which lists the names this command takes besides
// auto), agreed over the world: "auto" becomes cuda when every rank sees a GPU, else cpu.
// InvalidArgument for a name not in `valid`; FailedPrecondition, on every rank alike, when a
// CUDA backend is asked for and some rank has no GPU.
absl::StatusOr<std::string> ResolveBackendName(std::string name,
                                               const std::vector<std::string>& valid,
                                               parallel::Communicator& world);

class Backend {
 public:
  // `name`: cpu | cuda | cuda-staged | auto (cuda when every rank sees a GPU). Collective over
  // the world. FailedPrecondition, the same on every rank, when a rank has no GPU for a CUDA
  // backend or a TP group spans hosts.
  static absl::StatusOr<std::unique_ptr<Backend>> Create(std::string name,
                                                         const parallel::ProcessGrid& grid,
                                                         parallel::CommOptions options,
                                                         int threads);
  virtual ~Backend() = default;

  const std::string& name() const { return name_; }
  bool bf16() const { return name_ != "cpu"; }  // inputs are rounded to bf16
  std::string Description() const;

  virtual absl::StatusOr<std::unique_ptr<Runner>> MakeRunner(const sharding::ShardPlan& plan,
                                                             const attention::AttentionShape& shape,
                                                             const SyntheticAttention& batch,
                                                             const HeadSlice& slice) = 0;
  // C: one rank's attention rate on a causal square of `tokens`, TFLOP/s (median of `repeat`).
  virtual absl::StatusOr<double> MeasureTflops(const attention::AttentionShape& shape,
                                               int64_t tokens, int repeat) = 0;
  // BW: one ring exchange of `bytes` on the CP ring, GB/s per rank (median of `repeat`).
  virtual absl::StatusOr<double> MeasureRingGbps(int64_t bytes, int repeat) = 0;
  // Free memory on this rank's GPU (a host ring has none to run out of: unlimited).
  virtual absl::StatusOr<int64_t> FreeDeviceBytes() { return std::numeric_limits<int64_t>::max(); }
  // Whether the ring's buffers live on the GPU (memory checks count them there).
  virtual bool on_device() const { return false; }

 protected:
  explicit Backend(std::string name) : name_(std::move(name)) {}
  std::string name_;
};

}  // namespace cpfill::launch
