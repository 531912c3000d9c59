// The JSON of cost_model.h's results: the field names of `cpfill attention --json` where the two
// report the same quantity (steps, exchange_bytes, visible_pairs, ...), so a run and its
// prediction compare key by key.
#include "runtime/plan/cost_model.h"

namespace cpfill::runtime::plan {
namespace {

nlohmann::ordered_json StepJson(const RingStepCost& s, parallel::RingAlgorithm a) {
  return {{"algorithm", parallel::RingAlgorithmName(a)},
          {"step", s.step},
          {"source_cp_rank", s.source_cp_rank},
          {"exchange_bytes", s.exchange_bytes},
          {"transfer_ms", s.transfer_s * 1e3},
          {"compute_ms", s.compute_s * 1e3},
          {"exposed_wait_ms", s.wait_s * 1e3},
          {"visible_pairs", s.visible_pairs},
          {"chunk_pairs", s.chunk_pairs},
          {"chunk_pairs_hidden_skipped", s.chunk_pairs_hidden}};
}

std::string AlgorithmName(parallel::RingAlgorithm a) {
  return std::string(parallel::RingAlgorithmName(a));
}

}  // namespace

nlohmann::ordered_json RingCost::ToJson() const {
  nlohmann::ordered_json jr = nlohmann::ordered_json::array();
  for (const RankRingCost& r : ranks) {
    nlohmann::ordered_json steps = nlohmann::ordered_json::array();
    for (const RingStepCost& s : r.steps) steps.push_back(StepJson(s, algorithm));
    jr.push_back({{"cp_rank", r.cp_rank},
                  {"steps", std::move(steps)},
                  {"all_to_all_bytes", r.all_to_all_bytes},
                  {"all_to_all_ms", r.all_to_all_s * 1e3},
                  {"merge_ms", r.merge_s * 1e3},
                  {"total_ms", r.total_s * 1e3}});
  }
  return {{"algorithm", AlgorithmName(algorithm)},
          {"sequences", sequences},
          {"total_ms", total_s * 1e3},
          {"ranks", std::move(jr)}};
}

nlohmann::ordered_json Prediction::ToJson() const {
  const PlanInput& in = input;
  nlohmann::ordered_json reqs = nlohmann::ordered_json::array();
  for (size_t i = 0; i < in.requests.size(); ++i) {
    reqs.push_back({{"new_tokens", in.requests[i].new_tokens},
                    {"cached_tokens", in.requests[i].cached_tokens},
                    {"algorithm", AlgorithmName(algorithms[i])},
                    {"selection", selections[i].ToJson()}});
  }
  nlohmann::ordered_json jrings = nlohmann::ordered_json::array();
  for (const RingCost& r : rings) jrings.push_back(r.ToJson());
  return {
      {"model", in.model.name},
      {"layers", in.model.layers},
      {"gpus_per_node", in.gpus_per_node},
      {"nodes", in.nodes},
      {"tp", in.tp},
      {"cp", in.cp},
      {"tp_link", tp_link},
      {"ring_link", ring_link},
      {"ttft_ms", ttft_s * 1e3},
      {"decode_step_ms", in.model.config ? nlohmann::ordered_json(decode_step_s * 1e3) : nullptr},
      {"per_layer_ms",
       {{"gemm", layer.gemm_s * 1e3},
        {"all_reduce", layer.all_reduce_s * 1e3},
        {"attention", layer.attention_s * 1e3},
        {"kv_write", layer.kv_write_s * 1e3},
        {"elementwise", layer.elementwise_s * 1e3},
        {"total", layer.total_s() * 1e3}}},
      {"lm_head_ms", lm_head_s * 1e3},
      {"memory_per_gpu",
       {{"weights_bytes", memory.weight_bytes},
        {"kv_bytes", memory.kv_bytes},
        {"activation_bytes", memory.activation_bytes},
        {"total_bytes", memory.total_bytes()},
        {"fits", memory.fits},
        {"verdict", memory.verdict}}},
      {"requests", std::move(reqs)},
      {"rings", std::move(jrings)},
      {"assumptions", assumptions}};
}

}  // namespace cpfill::runtime::plan
