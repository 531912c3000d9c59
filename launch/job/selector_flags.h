// cpfill/launch/job/selector_flags.h — the flags that steer the pass-KV / pass-Q choice, shared by
// the subcommands that run attention (`attention`, `prefill`).
//
//   SelectorFlags sf;  AddSelectorFlags(flags, &sf);
//   ...parse...
//   CPFILL_ASSIGN_OR_RETURN(SelectorChoice choice,
//                           ResolveSelector(sf, flags, RingContextOf(backend_name, grid)));
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "launch/job/flags.h"
#include "parallel/grid.h"
#include "parallel/selector.h"
#include "runtime/model/prefill_batch.h"

namespace cpfill::launch {

struct SelectorFlags {
  std::string algo = "auto";
  std::string rule;  // "": fitted with --fit, else alg5
  std::string fit_file;
  bool fit_rescale = false;
  double tflops = 0;  // 0: the backend's default (SystemDefaults)
  double gbps = 0;
  double elem_bytes = 0;  // 0: the backend's
};

// C and BW when neither a flag nor a fit gives them, per backend. CPU: measured on the
// development VM (launch/job/selector_flags.cc says when and how). CUDA: C is the Hopper kernel's
// measured rate on one H100 (bench/RESULTS.md); BW is 50 GB/s, one 400 Gb/s NIC per GPU as on the
// paper's RDMA hosts, an assumption: `cpfill calibrate` measures a cluster's own.
parallel::SystemSpec SystemDefaults(std::string_view backend);

// This run's ring, as a calibration records it: backend, CP and TP sizes, nodes, and the link
// (transport, within or across nodes, NCCL's transport switches when set).
parallel::RingContext RingContextOf(std::string_view backend, const parallel::ProcessGrid& grid);

struct SelectorChoice {
  bool auto_algorithm = true;  // the selector decides; else `algorithm` is forced
  parallel::RingAlgorithm algorithm = parallel::RingAlgorithm::kPassKV;
  parallel::SelectorRule rule = parallel::SelectorRule::kAlg5;
  parallel::SystemSpec system;
  parallel::FittedCoefficients fitted = parallel::FittedCoefficients::Paper();
};

void AddSelectorFlags(FlagSet& flags, SelectorFlags* sf);

// Parses the algorithm and rule names and reads --fit: its measured C applies on the backend it was
// made on and its BW on the same link, unless --tflops / --gbps were given; else the backend's
// defaults. A fit made on another ring than `run` is refused (InvalidArgument naming each
// difference) unless --fit-rescale asks for parallel::RescaleFit. InvalidArgument or NotFound
// naming the flag or file.
absl::StatusOr<SelectorChoice> ResolveSelector(const SelectorFlags& sf, const FlagSet& flags,
                                               const parallel::RingContext& run);

// A model's options with the selector's decision in them; the KV cache and threads are left at
// their defaults for the caller (prefill, serve) to set.
runtime::StepOptions ModelOptions(const SelectorChoice& choice);

}  // namespace cpfill::launch
