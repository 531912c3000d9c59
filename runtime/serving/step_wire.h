// cpfill/runtime/serving/step_wire.h — the broadcast form of a StepPlan: little-endian 32- and
// 64-bit words and length-prefixed strings and id lists, in the order of StepPlan's fields
// (kind, step, end_sessions, batch {session, tokens, draw}, publish, forks, keeps). World rank 0
// is trusted, but a reader still checks every length against what is left.
//
//   std::vector<char> bytes = StepToWire(plan);                          // rank 0
//   CPFILL_ASSIGN_OR_RETURN(StepPlan same, StepFromWire(bytes));        // every other rank
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "runtime/serving/step_plan.h"

namespace cpfill::runtime {

// Every field but the rank-0-only ones (kept, items).
std::vector<char> StepToWire(const StepPlan& plan);
// Internal for bytes that are not a whole plan (a truncated or overlong message, a bad kind).
absl::StatusOr<StepPlan> StepFromWire(const std::vector<char>& bytes);

}  // namespace cpfill::runtime
