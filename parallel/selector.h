// cpfill/parallel/selector.h — chooses ring pass-KV or ring pass-Q per request.
//
// Three rules from the paper (§3.4, App. C, App. D):
//   kAlg1   pass-KV if T >= N*C*N_KV*e / (2*N_H*BW)           (eq. 2: KV exchange hides)
//           or T/(T+P) >= 2*N_KV/N_H                            (eq. 1: KV message smaller)
//   kAlg5   as Alg. 1 with the miss-rate threshold lowered by 4*T*BW / (N*C*e)   (eq. 5:
//           pass-Q pays an all-to-all of partial outputs)
//   kFitted h = a*ln(T) + b*ln(T/(T+P)) + c; pass-KV when h > 0. The paper's fit by default
//           (a = -1.059, b = 1.145, c = 12.112), or coefficients measured by `cpfill calibrate`.
// C is the attention compute rate per rank (FLOP/s), BW the ring link bandwidth per rank
// (bytes/s), e the element size, N the CP size, N_H/N_KV the query/KV heads per rank (their
// ratio is what matters), T new tokens, P cached tokens.
//
//   SelectorInputs in{.system = {.tflops = 800, .gbps = 3, .elem_bytes = 2},
//                     .model = {.num_heads = 128, .num_kv_heads = 8, .head_dim = 128},
//                     .cp_size = 4, .new_tokens = 6400, .cached_tokens = 121600};
//   Selection s = Select(in, SelectorRule::kAlg5, FittedCoefficients::Paper());
//   s.choice == RingAlgorithm::kPassQ; s.ToJson() has the rule's quantities.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace cpfill::parallel {

enum class RingAlgorithm { kPassKV, kPassQ, kAllGather };
std::string_view RingAlgorithmName(RingAlgorithm algo);  // "pass-kv", "pass-q", "all-gather"
absl::StatusOr<RingAlgorithm> ParseRingAlgorithm(std::string_view name);

enum class SelectorRule { kAlg1, kAlg5, kFitted };
std::string_view SelectorRuleName(SelectorRule rule);  // "alg1", "alg5", "fitted"
absl::StatusOr<SelectorRule> ParseSelectorRule(std::string_view name);

struct SystemSpec {
  double tflops = 0;      // C, attention compute per rank, TFLOP/s (1e12 FLOP/s)
  double gbps = 0;        // BW, per-rank ring bandwidth, gigabytes (1e9 bytes) per second
  double elem_bytes = 2;  // e
};

struct ModelSpec {
  int num_heads = 0;     // N_H
  int num_kv_heads = 0;  // N_KV
  int head_dim = 128;    // D_H; enters the predicted times, not the decision of Alg. 1/5
};

struct SelectorInputs {
  SystemSpec system;
  ModelSpec model;
  int cp_size = 1;            // N
  int64_t new_tokens = 0;     // T (summed over the batch)
  int64_t cached_tokens = 0;  // P (summed over the batch)
};

// h = a ln T + b ln(T/(T+P)) + c. Paper() gives the published fit.
struct FittedCoefficients {
  double a = -1.059;
  double b = 1.145;
  double c = 12.112;
  std::string source = "paper (App. D)";
  static FittedCoefficients Paper() { return {}; }
};

// Roofline predictions (seconds) for one attention layer on one rank; see selector.cc for the
// model. They are logged beside the decision so a user can see why, and compared with measured
// times by `cpfill calibrate`.
struct PredictedTimes {
  double pass_kv_compute_s = 0;   // per ring step
  double pass_kv_exchange_s = 0;  // per ring step
  double pass_kv_total_s = 0;     // N steps, exposed exchange included
  double pass_q_compute_s = 0;
  double pass_q_exchange_s = 0;
  double pass_q_all_to_all_s = 0;
  double pass_q_total_s = 0;
};

struct Selection {
  RingAlgorithm choice = RingAlgorithm::kPassKV;
  SelectorRule rule = SelectorRule::kAlg5;
  std::string reason;    // one line: which condition decided, with the numbers
  double miss_rate = 0;  // T/(T+P)
  // The inputs decided on (T, P, N), copied by Select so that ToJson is self-contained.
  int64_t new_tokens = 0;
  int64_t cached_tokens = 0;
  int cp_size = 1;
  double new_tokens_threshold = 0;  // eq. 2 right-hand side: N*C*N_KV*e/(2*N_H*BW)
  double miss_rate_threshold = 0;   // eq. 1 (Alg. 1) or eq. 5 (Alg. 5) right-hand side
  double h = 0;                     // fitted rule only
  FittedCoefficients fitted;        // fitted rule only
  PredictedTimes predicted;
  // One JSON object with every field above; null for what does not apply to the rule, and for
  // predicted times when C or BW is unknown (Predict's NaN).
  nlohmann::ordered_json ToJson() const;
};

// InvalidArgument for T <= 0, P < 0, N < 1, heads not positive or not divisible, C or BW <= 0
// (Alg. 1/5 only), e <= 0.
absl::StatusOr<Selection> Select(const SelectorInputs& in, SelectorRule rule,
                                 const FittedCoefficients& fitted);

PredictedTimes Predict(const SelectorInputs& in);

// One measured point of a calibration grid.
struct CalibrationPoint {
  int64_t new_tokens = 0;
  int64_t cached_tokens = 0;
  double pass_kv_s = 0;
  double pass_q_s = 0;
};

// Fits a, b, c so that h > 0 exactly where pass-KV was faster: logistic regression on
// (ln T, ln(T/(T+P))), each point weighted by how much the choice matters
// (|ln(pass_kv_s / pass_q_s)|), so near-ties do not pull the boundary. InvalidArgument with
// fewer than 3 points or non-positive times.
absl::StatusOr<FittedCoefficients> FitCoefficients(const std::vector<CalibrationPoint>& points);

// What a calibration was measured on, and what a run runs on. A fit carries over only where the
// two agree: elsewhere it is refused, or rescaled when the user asks (RescaleFit).
struct RingContext {
  std::string backend;  // "cpu", "cuda", "cuda-staged"
  int cp_size = 0;
  int tp_size = 0;
  int num_nodes = 0;
  std::string link;  // the CP ring's path, e.g. "nccl within a node, NCCL_P2P_DISABLE=1"
  nlohmann::ordered_json ToJson() const;
};
// What differs, one entry per field: "CP 2 (the fit) vs 4 (this run)"; empty when all agree.
std::vector<std::string> Differences(const RingContext& fit, const RingContext& run);

// Calibration file (written by `cpfill calibrate`, read by `--fit`): JSON object with at least
// "a", "b", "c"; optional "tflops", "gbps" (measured C and BW), "made_on" (a RingContext;
// absent in a hand-written fit, whose coefficients are taken as given, as the paper's are) and
// "points".
struct CalibrationFile {
  FittedCoefficients fitted;
  double tflops = 0;  // 0 when absent
  double gbps = 0;
  double elem_bytes = 0;  // e the fit's C and BW go with; 0 when absent
  std::optional<RingContext> made_on;
  std::vector<CalibrationPoint> points;
};

// The fit moved to another ring: the boundary h = 0 shifts along ln T as the eq. 2 threshold
// T* = N*C*N_KV*e / (2*N_H*BW) shifts from the fit's (N, C, e, BW) to the run's, that is
// c' = c - a ln(T*_run / T*_fit). A C, e or BW unknown on either side (0) counts as unchanged.
// The source names the rescaling.
FittedCoefficients RescaleFit(const CalibrationFile& file, int run_cp_size,
                              const SystemSpec& run_system);
absl::StatusOr<CalibrationFile> ReadCalibrationFile(const std::string& path);
absl::Status WriteCalibrationFile(const std::string& path, const CalibrationFile& file);

}  // namespace cpfill::parallel
