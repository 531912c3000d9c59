// cpfill/runtime/serving/step_plan.h — what every rank does next: the scheduler's decision for
// one step, which world rank 0 broadcasts (step_wire.h) and every rank executes (engine.h).
//
//   StepPlan plan = scheduler.Plan(now);              // rank 0
//   std::vector<char> bytes = StepToWire(plan);       // -> Broadcast -> StepFromWire on the others
//
// The order of work in a step, on every rank: drop `end_sessions`; then by kind: a heartbeat ends
// in a barrier; a prefill forks `forks`, prefills `batch`, forks `keeps` (the prefix cache's
// entries), exports and publishes `publish`; a decode step runs `batch`, one token each.
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "runtime/model/prefill_batch.h"
#include "runtime/serving/request.h"

namespace cpfill::runtime {

struct StepPlan {
  enum Kind : uint32_t {
    kHeartbeat = 0,
    kPrefill = 1,
    kEndSessions = 2,
    kDecode = 3,
    kShutdown = 4
  };
  Kind kind = kHeartbeat;
  uint64_t step = 0;                      // kDecode: the decode step (PlanDecode's offset)
  std::vector<std::string> end_sessions;  // sessions to end, evict or drop first
  std::vector<PrefillRequest> batch;
  // kPrefill: KV every rank exports and publishes after the batch, under lease record `slot`.
  struct Publish {
    std::string kv_name, request_id;
    uint32_t slot = 0;
    KvNonce nonce;
  };
  std::vector<Publish> publish;
  // kPrefill: prefix cache forks: `forks` before the batch (a request reuses an entry), `keeps`
  // after it (a prompt's KV kept as an entry).
  struct Fork {
    std::string parent, child;
    uint64_t tokens = 0;
  };
  std::vector<Fork> forks, keeps;

  // World rank 0 only, never on the wire: the keeps that held (the engine fills it), and the
  // requests this step answers, in batch order.
  std::set<std::string> kept;
  std::vector<std::unique_ptr<PendingRequest>> items;
};

}  // namespace cpfill::runtime
