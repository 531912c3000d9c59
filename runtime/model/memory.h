// cpfill/runtime/model/memory.h — memory checked before it is allocated: what a rank needs for its
// weights and a batch's activations, against what it has free, so that a model or a batch too
// large for the machine is refused with the numbers and the flag that would make it fit, rather
// than ending in std::bad_alloc or a failed cudaMalloc half-way.
//
//   CPFILL_RETURN_IF_ERROR(CheckFits("weights (fp32, this TP slice)", HostWeightBytes(c, tp),
//                                    *HostBytesAvailable(), "more TP ranks (--tp)"));
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"
#include "runtime/model/model_config.h"

namespace cpfill::runtime {

// This rank's share of the host's available memory: /proc/meminfo's MemAvailable, or what the
// cgroup (memory.max - memory.current: a container or a Slurm job) leaves if less, divided among
// the ranks Open MPI started on this host; at most what RLIMIT_AS (ulimit -v) still allows.
absl::StatusOr<int64_t> HostBytesAvailable();

// Host bytes of one TP rank's weights in fp32 (weights.h): its slices of every layer, the whole
// embedding, its slice of the LM head, the norms.
int64_t HostWeightBytes(const ModelConfig& config, int tp_size);
// The same with `elem_bytes` per high-precision element (2 for the GPU's bf16), row-wise FP8
// projections (config.fp8) at 1 byte an element plus a 4-byte scale per row.
int64_t WeightBytes(const ModelConfig& config, int tp_size, int64_t elem_bytes);

// A byte count computed in double (products of flags that may overflow int64), as int64,
// saturated at INT64_MAX: such a count is only compared with what is free.
int64_t SaturatingBytes(double bytes);

// ResourceExhausted naming `what`, the bytes needed and free, and `remedy`, when need > free.
absl::Status CheckFits(const std::string& what, int64_t need_bytes, int64_t free_bytes,
                       const std::string& remedy);

// CheckFits agreed over `world` (collective): every rank compares its own `need_bytes` with
// what `free_bytes` reports (asked only when it needs something), and every rank returns the
// same verdict: ResourceExhausted naming the rank short by the most bytes, its need and its free
// bytes, when any rank is short.
absl::Status CheckFitsOnEveryRank(parallel::Communicator& world, const std::string& what,
                                  int64_t need_bytes,
                                  const std::function<absl::StatusOr<int64_t>()>& free_bytes,
                                  const std::string& remedy);

}  // namespace cpfill::runtime
