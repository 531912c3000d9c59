#include "runtime/plan/cost_model.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status.h"
#include "runtime/model/memory.h"

namespace cpfill::runtime::plan {
namespace {

using parallel::RingAlgorithm;

constexpr int kMaxCp = 1024;
constexpr int64_t kMaxBatchTokens = 2147483647;

// (query, key) pairs between query positions [a, a + lq) and key positions [b, b + lk) that the
// causal mask leaves visible, in closed form (as parallel/ring_plan.cc counts them).
int64_t RunPairs(int64_t a, int64_t lq, int64_t b, int64_t lk) {
  if (lq <= 0 || lk <= 0) return 0;
  const int64_t q_end = a + lq - 1;
  int64_t pairs = 0;
  const int64_t r0 = std::max(a, b), r1 = std::min(q_end, b + lk - 2);  // the ramp
  if (r1 >= r0) pairs += (r0 - b + 1 + r1 - b + 1) * (r1 - r0 + 1) / 2;
  const int64_t p0 = std::max(a, b + lk - 1);  // the plateau: every key visible
  if (q_end >= p0) pairs += (q_end - p0 + 1) * lk;
  return pairs;
}

// Adds to `step` the pairs of `q_rank`'s new tokens of `seq` against `kv_rank`'s keys.
void CountPairs(const sharding::ShardPlan& plan, int seq, int q_rank, int kv_rank,
                RingStepCost* step) {
  const sharding::RankSequenceShard& qs = plan.shard(q_rank, seq);
  const sharding::RankSequenceShard& ks = plan.shard(kv_rank, seq);
  bool any_visible = false;
  for (const sharding::PositionRun& q : qs.new_runs) {
    for (const auto* key_runs : {&ks.cached_runs, &ks.new_runs}) {
      for (const sharding::PositionRun& k : *key_runs) {
        if (q.length == 0 || k.length == 0) continue;
        ++step->chunk_pairs;
        step->visible_pairs += RunPairs(q.begin, q.length, k.begin, k.length);
        if (k.begin > q.end() - 1) {
          ++step->chunk_pairs_hidden;
        } else {
          any_visible = true;
        }
      }
    }
  }
  if (any_visible) step->key_rows += ks.kv_tokens();
}

// Bytes of one ring message (parallel/ring_plan.h MessageLayout): token rows plus an int32
// position per slot; pass-KV pads each sequence to L^i slots, pass-Q sends max-rank-rows slots.
int64_t MessageBytes(const sharding::ShardPlan& plan, RingAlgorithm algorithm,
                     const AttentionGeometry& g, double e) {
  const auto row = [&](int heads) { return static_cast<int64_t>(heads * g.head_dim * e); };
  if (algorithm == RingAlgorithm::kPassQ) {
    const int64_t slots = plan.MaxRankNewTokens();
    return slots * (row(g.heads) + 4);
  }
  int64_t slots = 0;
  for (int s = 0; s < plan.num_sequences(); ++s) slots += plan.PaddedKvTokens(s);
  return slots * (2 * row(g.kv_heads) + 4);
}

// One step's attention: the FLOPs at the profile's rate for this much work, or the keys streamed
// at memory bandwidth where that is longer (decode), plus the launch cost. No pairs: no launch.
double StepComputeSeconds(const RingStepCost& step, const AttentionGeometry& g, double e,
                          const DeviceProfile& device) {
  if (step.visible_pairs == 0) return 0;
  const double pairs = static_cast<double>(step.visible_pairs);
  const double flops = 4.0 * g.head_dim * g.heads * pairs;
  const double compute = flops / (device.AttentionTflops(pairs) * 1e12);
  const double streamed = device.memory_gbps > 0 ? step.key_rows * 2.0 * g.kv_heads * g.head_dim *
                                                       e / (device.memory_gbps * 1e9)
                                                 : 0;
  return device.attention_launch_us * 1e-6 + std::max(compute, streamed);
}

// Step 1 of the ring model: every rank's steps, their work and bytes.
std::vector<RankRingCost> RingSteps(const sharding::ShardPlan& plan, RingAlgorithm algorithm,
                                    const AttentionGeometry& g, double e,
                                    const DeviceProfile& device, const Link& link) {
  const int n = plan.cp_size;
  const int64_t bytes = MessageBytes(plan, algorithm, g, e);
  std::vector<RankRingCost> ranks(n);
  for (int k = 0; k < n; ++k) {
    ranks[k].cp_rank = k;
    for (int j = 0; j < n; ++j) {
      RingStepCost step{.step = j, .source_cp_rank = (k - j + n) % n};
      const bool kv = algorithm == RingAlgorithm::kPassKV;
      for (int s = 0; s < plan.num_sequences(); ++s) {
        CountPairs(plan, s, kv ? k : step.source_cp_rank, kv ? step.source_cp_rank : k, &step);
      }
      step.exchange_bytes = j + 1 < n ? bytes : 0;
      step.compute_s = StepComputeSeconds(step, g, e, device);
      step.transfer_s = step.exchange_bytes > 0 ? link.Seconds(step.exchange_bytes) : 0;
      ranks[k].steps.push_back(step);
    }
  }
  return ranks;
}

// Step 2: the timeline. Step j's exchange is posted when its compute starts and brings the
// previous rank's message, posted at that rank's step j start; step j+1 starts when this rank's
// compute and that message are both done. The difference is the exposed wait.
std::vector<double> RingTimeline(std::vector<RankRingCost>& ranks) {
  const int n = static_cast<int>(ranks.size());
  std::vector<double> start(n, 0.0), next(n, 0.0);
  for (int j = 0; j < n; ++j) {
    for (int k = 0; k < n; ++k) {
      RingStepCost& step = ranks[k].steps[j];
      const double done = start[k] + step.compute_s;
      next[k] = done;
      if (j + 1 < n) {
        const double arrived = std::max(start[k], start[(k - 1 + n) % n]) + step.transfer_s;
        next[k] = std::max(done, arrived);
        step.wait_s = next[k] - done;
      }
    }
    start = next;
  }
  return start;
}

// Step 3 (pass-Q): the all-to-all of fp32 partials (O and LSE of every source's queries) once
// every rank is done, then the merge of N partials at memory bandwidth.
void PassQTail(const sharding::ShardPlan& plan, const AttentionGeometry& g,
               const DeviceProfile& device, const Link& link, std::vector<RankRingCost>& ranks,
               double ring_end_s) {
  const int n = plan.cp_size;
  const double row_bytes = 4.0 * (g.heads * g.head_dim + g.heads);
  std::vector<int64_t> q_rows(n, 0);
  for (int p = 0; p < n; ++p) {
    for (int s = 0; s < plan.num_sequences(); ++s) q_rows[p] += plan.shard(p, s).new_tokens();
  }
  double slowest_all_to_all = 0;
  for (int k = 0; k < n; ++k) {
    for (int p = 0; p < n; ++p) {
      if (p != k) ranks[k].all_to_all_bytes += static_cast<int64_t>(q_rows[p] * row_bytes);
    }
    ranks[k].all_to_all_s = link.Seconds(ranks[k].all_to_all_bytes);
    slowest_all_to_all = std::max(slowest_all_to_all, ranks[k].all_to_all_s);
    const double merged = n * q_rows[k] * row_bytes;
    ranks[k].merge_s = device.memory_gbps > 0 ? merged / (device.memory_gbps * 1e9) : 0;
  }
  for (RankRingCost& r : ranks) r.total_s = ring_end_s + slowest_all_to_all + r.merge_s;
}

double AllReduceSeconds(double bytes, int tp, const Link& link) {
  if (tp <= 1 || bytes <= 0) return 0;
  return 2.0 * (tp - 1) / tp * bytes / (link.gbps * 1e9) + 2.0 * (tp - 1) * link.latency_us * 1e-6;
}

double GemmSeconds(double flops, double rows, const DeviceProfile& device) {
  return flops <= 0 ? 0 : flops / (device.GemmTflops(rows) * 1e12);
}

double MemorySeconds(double bytes, const DeviceProfile& device) {
  return device.memory_gbps > 0 ? bytes / (device.memory_gbps * 1e9) : 0;
}

// Weights of one layer (every TP rank together): QKV, O, gate, up, down.
double LayerWeights(const ModelConfig& c) {
  const double q = double(c.num_heads) * c.head_dim, kv = double(c.num_kv_heads) * c.head_dim;
  return (q + 2 * kv) * c.hidden_size + c.hidden_size * q +
         3.0 * c.hidden_size * c.intermediate_size;
}

absl::Status Validate(const PlanInput& in) {
  const PlanModel& m = in.model;
  CPFILL_CHECK_ARG(in.gpus_per_node >= 1 && in.nodes >= 1,
                   "--gpus-per-node and --nodes must be >= 1");
  CPFILL_CHECK_ARG(
      in.tp >= 1 && in.cp >= 1 && int64_t{in.tp} * in.cp == int64_t{in.gpus_per_node} * in.nodes,
      "--tp ", in.tp, " x --cp ", in.cp, " must equal --gpus-per-node ", in.gpus_per_node,
      " x --nodes ", in.nodes);
  // The ring is modelled rank by rank and step by step: CP^2 steps.
  CPFILL_CHECK_ARG(in.cp <= kMaxCp, "CP ", in.cp, " is more than the ", kMaxCp,
                   " ranks a ring is modelled for (fewer --nodes or a larger --tp)");
  CPFILL_CHECK_ARG(m.heads > 0 && m.kv_heads > 0 && m.head_dim > 0 && m.heads % m.kv_heads == 0,
                   "heads ", m.heads, " must be a positive multiple of KV heads ", m.kv_heads);
  CPFILL_CHECK_ARG(m.heads % in.tp == 0 && m.kv_heads % in.tp == 0, "--tp ", in.tp,
                   " must divide the ", m.heads, " heads and ", m.kv_heads, " KV heads");
  if (m.config) CPFILL_RETURN_IF_ERROR(m.config->ValidateForTp(in.tp));
  CPFILL_CHECK_ARG(m.layers >= 1, "layers must be >= 1");
  CPFILL_CHECK_ARG(!in.requests.empty(), "--prompt-lens: no requests");
  int64_t total = 0;
  for (const sharding::SequenceRequest& r : in.requests) {
    CPFILL_CHECK_ARG(r.new_tokens >= 1 && r.cached_tokens >= 0, "--prompt-lens: ", r.new_tokens,
                     " new tokens after ", r.cached_tokens, " cached (need >= 1 and >= 0)");
    total += std::min<int64_t>(r.new_tokens + r.cached_tokens, kMaxBatchTokens + 1);
  }
  // Pair counts are int64: (2^31)^2 still fits.
  CPFILL_CHECK_ARG(total <= kMaxBatchTokens, "--prompt-lens and --cached-lens: ", total,
                   " tokens in the batch, more than ", kMaxBatchTokens);
  return absl::OkStatus();
}

// The selector's decision for each request, with the profile's attention rate for the request's
// per-step work (its queries on one rank against one rank's keys) and the ring link.
absl::Status Choose(const PlanInput& in, const AttentionGeometry& g, double e,
                    const DeviceProfile& device, const Link& ring, Prediction* p) {
  for (const sharding::SequenceRequest& r : in.requests) {
    const double per_step_pairs =
        double(r.new_tokens) / in.cp * double(r.new_tokens + r.cached_tokens) / in.cp;
    parallel::SelectorInputs s{
        .system = {.tflops = device.AttentionTflops(per_step_pairs),
                   .gbps = ring.gbps,
                   .elem_bytes = e},
        .model = {.num_heads = g.heads, .num_kv_heads = g.kv_heads, .head_dim = g.head_dim},
        .cp_size = in.cp,
        .new_tokens = r.new_tokens,
        .cached_tokens = r.cached_tokens};
    CPFILL_ASSIGN_OR_RETURN(parallel::Selection sel, parallel::Select(s, in.rule, in.fitted));
    p->algorithms.push_back(
        in.algorithm.value_or(in.cp == 1 ? RingAlgorithm::kPassKV : sel.choice));
    p->selections.push_back(std::move(sel));
  }
  return absl::OkStatus();
}

// The attention of one layer: one fused ring per algorithm (pass-KV's requests, then pass-Q's,
// as parallel/mixed_ring.h groups them), run one after the other.
absl::Status Rings(const PlanInput& in, const AttentionGeometry& g, double e,
                   const DeviceProfile& device, const Link& ring, Prediction* p) {
  for (RingAlgorithm a : {RingAlgorithm::kPassKV, RingAlgorithm::kPassQ}) {
    std::vector<sharding::SequenceRequest> group;
    std::vector<int> which;
    for (size_t i = 0; i < in.requests.size(); ++i) {
      if (p->algorithms[i] == a) {
        group.push_back(in.requests[i]);
        which.push_back(static_cast<int>(i));
      }
    }
    if (group.empty()) continue;
    CPFILL_ASSIGN_OR_RETURN(sharding::ShardPlan shards, sharding::PlanPrefill(group, in.cp));
    CPFILL_ASSIGN_OR_RETURN(RingCost cost, PredictRing(shards, a, g, e, device, ring));
    cost.sequences = which;
    p->layer.attention_s += cost.total_s;
    p->rings.push_back(std::move(cost));
  }
  return absl::OkStatus();
}

// The linear layers, KV writes and elementwise work of one layer on the rank with the most
// rows; the LM head on each request's last token.
void LinearLayers(const PlanInput& in, const ModelConfig& c, int64_t rows, double e,
                  const DeviceProfile& device, const Link& tp_link, Prediction* p) {
  const double r = static_cast<double>(rows), tp = in.tp;
  p->layer.gemm_s = GemmSeconds(2.0 * r * LayerWeights(c) / tp, r, device);
  p->layer.all_reduce_s = 2 * AllReduceSeconds(r * c.hidden_size * e, in.tp, tp_link);
  p->layer.kv_write_s = MemorySeconds(r * 2.0 * c.num_kv_heads / tp * c.head_dim * e, device);
  p->layer.elementwise_s =
      MemorySeconds(r * (8.0 * c.hidden_size + 3.0 * c.intermediate_size / tp) * e, device);
  const double b = static_cast<double>(in.requests.size());
  p->lm_head_s = GemmSeconds(2.0 * b * c.hidden_size * c.vocab_size / tp, b, device);
}

// One decode step of the batch after the prefill: every request's next token, ring pass-Q
// (§3.6), GEMMs bound by reading the TP slice of the weights.
absl::Status DecodeStep(const PlanInput& in, const ModelConfig& c, const AttentionGeometry& g,
                        double e, const DeviceProfile& device, const Link& ring,
                        const Link& tp_link, Prediction* p) {
  std::vector<sharding::SequenceRequest> next;
  for (const auto& r : in.requests)
    next.push_back({.new_tokens = 1, .cached_tokens = r.new_tokens + r.cached_tokens});
  CPFILL_ASSIGN_OR_RETURN(sharding::ShardPlan shards, sharding::PlanDecode(next, in.cp, 0));
  CPFILL_ASSIGN_OR_RETURN(RingCost attn,
                          PredictRing(shards, RingAlgorithm::kPassQ, g, e, device, ring));
  const double rows = static_cast<double>(shards.MaxRankNewTokens());
  const double w = LayerWeights(c) / in.tp;
  const double gemm =
      std::max(GemmSeconds(2.0 * rows * w, rows, device), MemorySeconds(w * e, device));
  const double all_reduce = 2 * AllReduceSeconds(rows * c.hidden_size * e, in.tp, tp_link);
  p->decode_step_s = c.num_layers * (gemm + all_reduce + attn.total_s) + p->lm_head_s;
  return absl::OkStatus();
}

// Memory per GPU: the weights as the project's planner counts them (fp32 bytes, scaled to the
// device's element size as the CUDA backend's check does), the KV the prefill leaves on the
// fullest rank, and the working set of a step (estimate).
void Memory(const PlanInput& in, const sharding::ShardPlan& all, const AttentionGeometry& g,
            double e, const DeviceProfile& device, Prediction* p) {
  MemoryEstimate& m = p->memory;
  int64_t kv_tokens = 0;
  for (int k = 0; k < all.cp_size; ++k) {
    int64_t t = 0;
    for (int s = 0; s < all.num_sequences(); ++s) t += all.shard(k, s).kv_tokens();
    kv_tokens = std::max(kv_tokens, t);
  }
  m.kv_bytes =
      SaturatingBytes(double(kv_tokens) * 2 * g.kv_heads * g.head_dim * e * in.model.layers);
  const double rows = static_cast<double>(all.MaxRankNewTokens());
  if (const auto& c = in.model.config) {
    const double w = device.weight_elem_bytes > 0 ? device.weight_elem_bytes : e;
    m.weight_bytes = SaturatingBytes(double(HostWeightBytes(*c, in.tp)) * w / 4);
    m.activation_bytes =
        SaturatingBytes(rows * (4.0 * c->hidden_size + 3.0 * c->intermediate_size / in.tp) * e +
                        rows * (g.heads + 2.0 * g.kv_heads) * g.head_dim * e);
  }
  if (device.device_memory_bytes <= 0) {
    m.verdict = "unknown (the device profile gives no device_memory_bytes)";
    return;
  }
  const absl::Status fits =
      CheckFits("weights, KV and activations on one GPU", m.total_bytes(),
                SaturatingBytes(device.device_memory_bytes), "more TP or CP ranks");
  m.fits = fits.ok();
  m.verdict = fits.ok() ? "fits" : std::string(fits.message());
}

void Assumptions(const PlanInput& in, const DeviceProfile& device, const LinkProfile& links,
                 Prediction* p) {
  auto& a = p->assumptions;
  a.push_back(absl::StrFormat("device: %s (%s backend, e = %g bytes); profile: %s", device.device,
                              device.backend, device.elem_bytes, device.source));
  a.push_back(absl::StrFormat("TP all-reduce over %s, CP ring over %s (%s)", p->tp_link,
                              p->ring_link, links.source));
  for (const Link& l : links.links) {
    a.push_back(absl::StrFormat("link %s: %g GB/s per GPU, %g us%s%s", l.name, l.gbps, l.latency_us,
                                l.note.empty() ? "" : "; ", l.note));
  }
  a.push_back("TP groups fill nodes first; a CP ring crosses nodes when there is more than one");
  a.push_back("pass-Q partials travel in fp32; the merge and KV writes run at memory_gbps");
  if (in.model.config) {
    a.push_back("elementwise layers: (8 D + 3 I/TP) e bytes per token at memory_gbps");
  } else {
    a.push_back("attention only: one layer, no linear layers (as `cpfill attention`)");
  }
}

}  // namespace

absl::StatusOr<RingCost> PredictRing(const sharding::ShardPlan& shards, RingAlgorithm algorithm,
                                     const AttentionGeometry& g, double elem_bytes,
                                     const DeviceProfile& device, const Link& link) {
  CPFILL_CHECK_ARG(algorithm != RingAlgorithm::kAllGather, "the all-gather ring is not modelled");
  CPFILL_CHECK_ARG(g.heads > 0 && g.kv_heads > 0 && g.head_dim > 0, "attention geometry: no heads");
  RingCost ring{.algorithm = algorithm};
  ring.ranks = RingSteps(shards, algorithm, g, elem_bytes, device, link);
  const std::vector<double> end = RingTimeline(ring.ranks);
  for (size_t k = 0; k < end.size(); ++k) ring.ranks[k].total_s = end[k];
  if (algorithm == RingAlgorithm::kPassQ && shards.cp_size > 1) {
    PassQTail(shards, g, device, link, ring.ranks, *std::max_element(end.begin(), end.end()));
  }
  for (const RankRingCost& r : ring.ranks) ring.total_s = std::max(ring.total_s, r.total_s);
  return ring;
}

PlanModel PlanModelOf(const ModelConfig& c) {
  return {.config = c,
          .heads = c.num_heads,
          .kv_heads = c.num_kv_heads,
          .head_dim = c.head_dim,
          .layers = c.num_layers,
          .name = c.name};
}

absl::StatusOr<Prediction> PredictPrefill(const PlanInput& in, const DeviceProfile& device,
                                          const LinkProfile& links) {
  CPFILL_RETURN_IF_ERROR(Validate(in));
  CPFILL_CHECK_ARG(
      !in.model.config || !device.gemm.empty(),
      "--device-profile: a model plan needs \"gemm\" rates (attention-only plans do not)");
  Prediction p{.input = in};
  const double e = device.elem_bytes;
  const AttentionGeometry g{.heads = in.model.heads / in.tp,
                            .kv_heads = in.model.kv_heads / in.tp,
                            .head_dim = in.model.head_dim};
  const Link& ring = in.nodes > 1 ? links.InterNode() : links.IntraNode();
  const Link& tp_link = in.tp <= in.gpus_per_node ? links.IntraNode() : links.InterNode();
  p.ring_link = ring.name;
  p.tp_link = tp_link.name;
  CPFILL_RETURN_IF_ERROR(Choose(in, g, e, device, ring, &p));
  CPFILL_RETURN_IF_ERROR(Rings(in, g, e, device, ring, &p));
  CPFILL_ASSIGN_OR_RETURN(sharding::ShardPlan all, sharding::PlanPrefill(in.requests, in.cp));
  if (const auto& c = in.model.config) {
    LinearLayers(in, *c, all.MaxRankNewTokens(), e, device, tp_link, &p);
    CPFILL_RETURN_IF_ERROR(DecodeStep(in, *c, g, e, device, ring, tp_link, &p));
  }
  p.ttft_s = in.model.layers * p.layer.total_s() + p.lm_head_s;
  Memory(in, all, g, e, device, &p);
  Assumptions(in, device, links, &p);
  return p;
}

absl::StatusOr<std::vector<Prediction>> SearchGrids(const PlanInput& input,
                                                    const DeviceProfile& device,
                                                    const LinkProfile& links) {
  std::vector<Prediction> out;
  const int gpus = input.gpus_per_node * input.nodes;
  for (int tp = 1; tp <= gpus; tp *= 2) {
    PlanInput in = input;
    in.tp = tp;
    in.cp = gpus / tp;
    if (gpus % tp != 0 || !Validate(in).ok()) continue;
    CPFILL_ASSIGN_OR_RETURN(Prediction p, PredictPrefill(in, device, links));
    out.push_back(std::move(p));
  }
  CPFILL_CHECK_ARG(!out.empty(), "--search: no TP x CP over ", gpus,
                   " GPUs suits the model's heads");
  std::stable_sort(out.begin(), out.end(), [](const Prediction& a, const Prediction& b) {
    if (a.memory.fits != b.memory.fits) return a.memory.fits;
    return a.ttft_s < b.ttft_s;
  });
  return out;
}

}  // namespace cpfill::runtime::plan
