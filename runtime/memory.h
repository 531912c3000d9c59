// cpfill/runtime/memory.h — memory checked before it is allocated: what a rank needs for its
// weights and a batch's activations, against what it has free, so that a model or a batch too
// large for the machine is refused with the numbers and the flag that would make it fit, rather
// than ending in std::bad_alloc or a failed cudaMalloc half-way.
//
//   CPFILL_RETURN_IF_ERROR(CheckFits("weights (fp32, this TP slice)", HostWeightBytes(c, tp),
//                                    *HostBytesAvailable(), "more TP ranks (--tp)"));
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "runtime/model_config.h"

namespace cpfill::runtime {

// This rank's share of the host's available memory: /proc/meminfo's MemAvailable divided among
// the ranks Open MPI started on this host.
absl::StatusOr<int64_t> HostBytesAvailable();

// Host bytes of one TP rank's weights in fp32 (weights.h): its slices of every layer, the whole
// embedding, its slice of the LM head, the norms.
int64_t HostWeightBytes(const ModelConfig& config, int tp_size);

// ResourceExhausted naming `what`, the bytes needed and free, and `remedy`, when need > free.
absl::Status CheckFits(const std::string& what, int64_t need_bytes, int64_t free_bytes,
                       const std::string& remedy);

}  // namespace cpfill::runtime
