// cpfill/launch/selector_flags.h — the flags that steer the pass-KV / pass-Q choice, shared by
// the subcommands that run attention (`attention`, `prefill`).
//
//   SelectorFlags sf;  AddSelectorFlags(flags, &sf);
//   ...parse...
//   CPFILL_ASSIGN_OR_RETURN(SelectorChoice choice, ResolveSelector(sf, flags));
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "launch/flags.h"
#include "parallel/selector.h"
#include "runtime/prefill_batch.h"

namespace cpfill::launch {

struct SelectorFlags {
  std::string algo = "auto";
  std::string rule;  // "": fitted with --fit, else alg5
  std::string fit_file;
  double tflops = 800;
  double gbps = 50;
  double elem_bytes = 2;
};

struct SelectorChoice {
  bool auto_algorithm = true;  // the selector decides; else `algorithm` is forced
  parallel::RingAlgorithm algorithm = parallel::RingAlgorithm::kPassKV;
  parallel::SelectorRule rule = parallel::SelectorRule::kAlg5;
  parallel::SystemSpec system;
  parallel::FittedCoefficients fitted = parallel::FittedCoefficients::Paper();
};

void AddSelectorFlags(FlagSet& flags, SelectorFlags* sf);

// Parses the algorithm and rule names and reads --fit (its measured C and BW apply unless
// --tflops / --gbps were given). InvalidArgument or NotFound naming the flag or file.
absl::StatusOr<SelectorChoice> ResolveSelector(const SelectorFlags& sf, const FlagSet& flags);

// A model's options with the selector's decision in them; the KV cache and threads are left at
// their defaults for the caller (prefill, serve) to set.
runtime::PrefillOptions ModelOptions(const SelectorChoice& choice);

}  // namespace cpfill::launch
