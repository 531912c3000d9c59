// cpfill/parallel/selector.cc — the pass-KV / pass-Q rules of the paper and a roofline model.
//
// Alg. 1 and Alg. 5 are implemented literally, comparisons included: pass-KV when
// T >= eq. 2's threshold OR T/(T+P) >= the miss-rate threshold (a tie goes to pass-KV).
// Units: C = tflops * 1e12 FLOP/s, BW = gbps * 1e9 bytes/s, e bytes per element; N_H and N_KV
// are used as given (per GPU or per model: only their ratio enters the rules).
//
// The fitted rule (App. D) uses the natural log. The paper writes "log" without a base; with
// log10 and the published coefficients h > 0 (pass-KV) for every T >= 1 unless P exceeds ~1e10
// tokens, so the rule could never pick pass-Q, contradicting Table 4 (pass-Q wins at T=1280,
// 1% miss rate). With ln the boundary moves with T as App. D describes. Caveat: even with ln
// the published fit picks pass-Q at T=12800/10% and T=128000/0% cached, where Table 4 measured
// pass-KV faster: the fit came from other measurements; calibrate for the cluster at hand.
//
// Roofline model behind Predict (one attention layer, one rank; D = N_H * D_H):
//   attention FLOPs of the request     4 * T * D * (T + P)            (Table 3)
//   per ring step (pass-KV and pass-Q) 4 * T * D * (T + P) / (N * N * C)
//       N ranks share the work and each does it in N steps. Causal masking of the new-new
//       block (about half of 4*T*D*T) is ignored: it matters only when P is small, where
//       pass-KV wins anyway, and the paper's eq. 2/3 ignore it too.
//   pass-KV exchange per step          2 * ((T + P) / N) * D * e * (N_KV / N_H) / BW
//       each rank forwards its K and V shard: (T+P)/N tokens, N_KV * D_H values each.
//   pass-Q exchange per step           (T / N) * D * e / BW
//   pass-Q all-to-all                  (N - 1) * (T / N) * (D + N_H) * 4 / BW
//       after the ring a rank holds partial outputs for every rank's T/N queries and returns
//       the N-1 foreign ones; each row carries D output values plus one LSE per head, in fp32
//       (merging needs full precision). App. C writes (N-1)*(D+1)*T*e/BW instead: it counts
//       all T rows, one LSE per row and e-byte elements; ours follows what the ring actually
//       sends from one rank.
//   totals: N * compute + (N - 1) * max(0, exchange - compute)   [+ all-to-all for pass-Q]
//       the exchange of step j+1 overlaps the compute of step j; the last step sends nothing.
// With N = 1 nothing is communicated: exchanges and the all-to-all are 0.
#include "parallel/selector.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/json_io.h"
#include "base/status.h"
#include "base/string_view.h"

namespace cpfill::parallel {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Model and request checks shared by every rule; `need_system` adds C and BW.
absl::Status ValidateInputs(const SelectorInputs& in, bool need_system) {
  CPFILL_CHECK_ARG(in.new_tokens > 0, "selector: new tokens T must be > 0, got ", in.new_tokens);
  CPFILL_CHECK_ARG(in.cached_tokens >= 0, "selector: cached tokens P must be >= 0, got ",
                   in.cached_tokens);
  CPFILL_CHECK_ARG(in.cp_size >= 1, "selector: CP size N must be >= 1, got ", in.cp_size);
  CPFILL_CHECK_ARG(in.model.num_heads > 0 && in.model.num_kv_heads > 0,
                   "selector: heads must be positive, got N_H=", in.model.num_heads,
                   " N_KV=", in.model.num_kv_heads);
  CPFILL_CHECK_ARG(in.model.num_heads % in.model.num_kv_heads == 0, "selector: N_H (",
                   in.model.num_heads, ") is not divisible by N_KV (", in.model.num_kv_heads, ")");
  CPFILL_CHECK_ARG(in.model.head_dim > 0, "selector: head_dim must be > 0, got ",
                   in.model.head_dim);
  CPFILL_CHECK_ARG(in.system.elem_bytes > 0 && std::isfinite(in.system.elem_bytes),
                   "selector: element size e must be > 0, got ", in.system.elem_bytes);
  if (need_system) {
    CPFILL_CHECK_ARG(in.system.tflops > 0 && std::isfinite(in.system.tflops),
                     "selector: compute rate C must be > 0 TFLOP/s, got ", in.system.tflops);
    CPFILL_CHECK_ARG(in.system.gbps > 0 && std::isfinite(in.system.gbps),
                     "selector: bandwidth BW must be > 0 GB/s, got ", in.system.gbps);
  }
  return absl::OkStatus();
}

std::string Percent(double fraction) { return absl::StrFormat("%.2f%%", 100 * fraction); }

nlohmann::ordered_json NumberOrNull(double x, bool present) {
  return present ? nlohmann::ordered_json(x) : nlohmann::ordered_json();
}

// A calibration file's "made_on" (RingContext::ToJson).
absl::StatusOr<RingContext> ParseRingContext(const nlohmann::json& v) {
  CPFILL_CHECK_ARG(v.is_object(), "not a JSON object");
  RingContext c;
  CPFILL_ASSIGN_OR_RETURN(c.backend, json::GetString(v, "backend"));
  CPFILL_ASSIGN_OR_RETURN(c.link, json::GetString(v, "link"));
  for (auto [key, field] : {std::pair<const char*, int*>{"cp_size", &c.cp_size},
                            {"tp_size", &c.tp_size},
                            {"num_nodes", &c.num_nodes}}) {
    CPFILL_ASSIGN_OR_RETURN(int64_t x, json::GetInt(v, key));
    CPFILL_CHECK_ARG(x >= 1 && x <= (1 << 24), "\"", key, "\" is ", x, ", not in [1, 2^24]");
    *field = static_cast<int>(x);
  }
  return c;
}

}  // namespace

std::string_view RingAlgorithmName(RingAlgorithm algo) {
  switch (algo) {
    case RingAlgorithm::kPassKV:
      return "pass-kv";
    case RingAlgorithm::kPassQ:
      return "pass-q";
    case RingAlgorithm::kAllGather:
      return "all-gather";
  }
  return "?";
}

absl::StatusOr<RingAlgorithm> ParseRingAlgorithm(std::string_view name) {
  for (RingAlgorithm a :
       {RingAlgorithm::kPassKV, RingAlgorithm::kPassQ, RingAlgorithm::kAllGather}) {
    if (RingAlgorithmName(a) == name) return a;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown ring algorithm \"", Sv(name),
                                                 "\" (valid: pass-kv, pass-q, all-gather)"));
}

std::string_view SelectorRuleName(SelectorRule rule) {
  switch (rule) {
    case SelectorRule::kAlg1:
      return "alg1";
    case SelectorRule::kAlg5:
      return "alg5";
    case SelectorRule::kFitted:
      return "fitted";
  }
  return "?";
}

absl::StatusOr<SelectorRule> ParseSelectorRule(std::string_view name) {
  for (SelectorRule r : {SelectorRule::kAlg1, SelectorRule::kAlg5, SelectorRule::kFitted}) {
    if (SelectorRuleName(r) == name) return r;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown selector rule \"", Sv(name), "\" (valid: alg1, alg5, fitted)"));
}

PredictedTimes Predict(const SelectorInputs& in) {
  // Without C and BW (e.g. the fitted rule run with no system spec) there is nothing to
  // predict; NaN is written as null in JSON, where 0 would read as "free".
  if (!ValidateInputs(in, /*need_system=*/true).ok()) {
    return {kNaN, kNaN, kNaN, kNaN, kNaN, kNaN, kNaN};
  }
  const double n = in.cp_size;
  const double t = static_cast<double>(in.new_tokens);
  const double p = static_cast<double>(in.cached_tokens);
  const double c = in.system.tflops * 1e12;
  const double bw = in.system.gbps * 1e9;
  const double e = in.system.elem_bytes;
  const double n_h = in.model.num_heads;
  const double kv_ratio = static_cast<double>(in.model.num_kv_heads) / n_h;
  const double d = n_h * in.model.head_dim;

  PredictedTimes out;
  const double compute = 4 * t * d * (t + p) / (n * n * c);
  out.pass_kv_compute_s = compute;
  out.pass_q_compute_s = compute;
  if (in.cp_size > 1) {
    out.pass_kv_exchange_s = 2 * ((t + p) / n) * d * e * kv_ratio / bw;
    out.pass_q_exchange_s = (t / n) * d * e / bw;
    out.pass_q_all_to_all_s = (n - 1) * (t / n) * (d + n_h) * 4 / bw;
  }
  out.pass_kv_total_s = n * compute + (n - 1) * std::max(0.0, out.pass_kv_exchange_s - compute);
  out.pass_q_total_s = n * compute + (n - 1) * std::max(0.0, out.pass_q_exchange_s - compute) +
                       out.pass_q_all_to_all_s;
  return out;
}

absl::StatusOr<Selection> Select(const SelectorInputs& in, SelectorRule rule,
                                 const FittedCoefficients& fitted) {
  CPFILL_RETURN_IF_ERROR(ValidateInputs(in, /*need_system=*/rule != SelectorRule::kFitted));
  Selection s;
  s.rule = rule;
  s.new_tokens = in.new_tokens;
  s.cached_tokens = in.cached_tokens;
  s.cp_size = in.cp_size;
  const double t = static_cast<double>(in.new_tokens);
  s.miss_rate = t / (t + static_cast<double>(in.cached_tokens));
  s.predicted = Predict(in);

  if (rule == SelectorRule::kFitted) {
    CPFILL_CHECK_ARG(std::isfinite(fitted.a) && std::isfinite(fitted.b) && std::isfinite(fitted.c),
                     "selector: fitted coefficients must be finite (a=", fitted.a, " b=", fitted.b,
                     " c=", fitted.c, ")");
    s.fitted = fitted;
    s.h = fitted.a * std::log(t) + fitted.b * std::log(s.miss_rate) + fitted.c;
    s.choice = s.h > 0 ? RingAlgorithm::kPassKV : RingAlgorithm::kPassQ;
    s.reason = absl::StrFormat(
        "h = a*ln(T) + b*ln(T/(T+P)) + c = %.6g*ln(%d) + %.6g*ln(%.6g) + %.6g = %.4g %s 0 -> %s "
        "(coefficients: %s)",
        fitted.a, in.new_tokens, fitted.b, s.miss_rate, fitted.c, s.h,
        s.h > 0 ? ">" : "<=", RingAlgorithmName(s.choice), fitted.source);
    return s;
  }

  const double n = in.cp_size;
  const double c = in.system.tflops * 1e12;
  const double bw = in.system.gbps * 1e9;
  const double e = in.system.elem_bytes;
  const double n_h = in.model.num_heads;
  const double n_kv = in.model.num_kv_heads;
  // Eq. 2: below this T the per-step KV exchange is longer than the per-step attention.
  s.new_tokens_threshold = n * c * n_kv * e / (2 * n_h * bw);
  // Eq. 1 (Alg. 1): pass-Q sends fewer bytes below this miss rate. Eq. 5 (Alg. 5) lowers it
  // by the all-to-all that pass-Q pays at the end.
  s.miss_rate_threshold = 2 * n_kv / n_h;
  std::string miss_expr = "2*N_KV/N_H";
  if (rule == SelectorRule::kAlg5) {
    s.miss_rate_threshold -= 4 * t * bw / (n * c * e);
    miss_expr = "2*N_KV/N_H - 4*T*BW/(N*C*e)";
  }

  const std::string t_part =
      absl::StrFormat("T=%d %s N*C*N_KV*e/(2*N_H*BW)=%.6g", in.new_tokens,
                      t >= s.new_tokens_threshold ? ">=" : "<", s.new_tokens_threshold);
  if (t >= s.new_tokens_threshold) {
    s.choice = RingAlgorithm::kPassKV;
    s.reason = absl::StrCat(t_part, " -> pass-kv (KV exchange hides under attention)");
  } else if (s.miss_rate >= s.miss_rate_threshold) {
    s.choice = RingAlgorithm::kPassKV;
    s.reason = absl::StrCat(t_part, " but miss rate ", Percent(s.miss_rate), " >= ", miss_expr, "=",
                            Percent(s.miss_rate_threshold), " -> pass-kv");
  } else {
    s.choice = RingAlgorithm::kPassQ;
    s.reason = absl::StrCat(t_part, " and miss rate ", Percent(s.miss_rate), " < ", miss_expr, "=",
                            Percent(s.miss_rate_threshold), " -> pass-q");
  }
  return s;
}

// Keys are always present so a reader can rely on them; those that do not apply to the rule
// (h, a, b, c, coefficients_source for Alg. 1/5; the thresholds for the fitted rule) are null.
nlohmann::ordered_json Selection::ToJson() const {
  const bool is_fitted = rule == SelectorRule::kFitted;
  // Predict's NaN means "C or BW unknown", which null says; any other value is written as is.
  const auto time = [](double s) { return NumberOrNull(s, !std::isnan(s)); };
  return {{"choice", RingAlgorithmName(choice)},
          {"rule", SelectorRuleName(rule)},
          {"reason", reason},
          {"miss_rate", miss_rate},
          {"new_tokens", new_tokens},
          {"cached_tokens", cached_tokens},
          {"cp_size", cp_size},
          {"new_tokens_threshold", NumberOrNull(new_tokens_threshold, !is_fitted)},
          {"miss_rate_threshold", NumberOrNull(miss_rate_threshold, !is_fitted)},
          {"h", NumberOrNull(h, is_fitted)},
          {"a", NumberOrNull(fitted.a, is_fitted)},
          {"b", NumberOrNull(fitted.b, is_fitted)},
          {"c", NumberOrNull(fitted.c, is_fitted)},
          {"coefficients_source",
           is_fitted ? nlohmann::ordered_json(fitted.source) : nlohmann::ordered_json()},
          {"predicted",
           {{"pass_kv_compute_s", time(predicted.pass_kv_compute_s)},
            {"pass_kv_exchange_s", time(predicted.pass_kv_exchange_s)},
            {"pass_kv_total_s", time(predicted.pass_kv_total_s)},
            {"pass_q_compute_s", time(predicted.pass_q_compute_s)},
            {"pass_q_exchange_s", time(predicted.pass_q_exchange_s)},
            {"pass_q_all_to_all_s", time(predicted.pass_q_all_to_all_s)},
            {"pass_q_total_s", time(predicted.pass_q_total_s)}}}};
}

// Weighted, L2-regularized logistic regression by Newton's method with backtracking.
// Features are standardized first (ln T spans ~5-14, ln miss ~-7-0) so one λ suits both and the
// Hessian is well conditioned; the fit is mapped back to raw features at the end. The tiny λ
// keeps the optimum finite on separable data (otherwise the coefficients grow without bound)
// while staying far too small to move the boundary.
absl::StatusOr<FittedCoefficients> FitCoefficients(const std::vector<CalibrationPoint>& points) {
  CPFILL_CHECK_ARG(points.size() >= 3, "selector: fitting needs at least 3 points, got ",
                   points.size());
  const size_t m = points.size();
  std::vector<double> x1(m), x2(m), y(m), w(m);
  double total_w = 0;
  for (size_t i = 0; i < m; ++i) {
    const CalibrationPoint& pt = points[i];
    CPFILL_CHECK_ARG(pt.new_tokens > 0 && pt.cached_tokens >= 0, "selector: calibration point ", i,
                     " has T=", pt.new_tokens, " P=", pt.cached_tokens, " (need T > 0, P >= 0)");
    CPFILL_CHECK_ARG(pt.pass_kv_s > 0 && pt.pass_q_s > 0 && std::isfinite(pt.pass_kv_s) &&
                         std::isfinite(pt.pass_q_s),
                     "selector: calibration point ", i,
                     " has non-positive time (pass_kv_s=", pt.pass_kv_s, " pass_q_s=", pt.pass_q_s,
                     ")");
    const double t = static_cast<double>(pt.new_tokens);
    x1[i] = std::log(t);
    x2[i] = std::log(t / (t + static_cast<double>(pt.cached_tokens)));
    y[i] = pt.pass_kv_s < pt.pass_q_s ? 1 : 0;
    w[i] = std::fabs(std::log(pt.pass_kv_s / pt.pass_q_s));
    total_w += w[i];
  }
  CPFILL_CHECK_ARG(total_w > 0,
                   "selector: every calibration point is an exact tie; nothing to fit");
  for (double& wi : w) wi /= total_w;

  auto standardize = [&](std::vector<double>& x, double& mu, double& sigma) {
    mu = 0;
    for (size_t i = 0; i < m; ++i) mu += w[i] * x[i];
    double var = 0;
    for (size_t i = 0; i < m; ++i) var += w[i] * (x[i] - mu) * (x[i] - mu);
    sigma = std::sqrt(var);
    if (sigma < 1e-12) sigma = 1;  // constant feature: the bias absorbs it
    for (double& xi : x) xi = (xi - mu) / sigma;
  };
  double mu1, s1, mu2, s2;
  standardize(x1, mu1, s1);
  standardize(x2, mu2, s2);

  constexpr double kLambda = 1e-6;
  auto loss = [&](const double beta[3]) {
    double l = 0;
    for (size_t i = 0; i < m; ++i) {
      const double z = beta[0] + beta[1] * x1[i] + beta[2] * x2[i];
      // log(1 + e^z) - y z, computed without overflow.
      const double softplus = z > 0 ? z + std::log1p(std::exp(-z)) : std::log1p(std::exp(z));
      l += w[i] * (softplus - y[i] * z);
    }
    return l + 0.5 * kLambda * (beta[0] * beta[0] + beta[1] * beta[1] + beta[2] * beta[2]);
  };

  double beta[3] = {0, 0, 0};
  double current = loss(beta);
  for (int iter = 0; iter < 500; ++iter) {
    double g[3] = {kLambda * beta[0], kLambda * beta[1], kLambda * beta[2]};
    double h[3][3] = {{kLambda, 0, 0}, {0, kLambda, 0}, {0, 0, kLambda}};
    for (size_t i = 0; i < m; ++i) {
      const double xi[3] = {1, x1[i], x2[i]};
      const double z = beta[0] + beta[1] * x1[i] + beta[2] * x2[i];
      const double p = 1 / (1 + std::exp(-z));
      for (int r = 0; r < 3; ++r) {
        g[r] += w[i] * (p - y[i]) * xi[r];
        for (int c = 0; c < 3; ++c) h[r][c] += w[i] * p * (1 - p) * xi[r] * xi[c];
      }
    }
    // Solve H step = g by Gaussian elimination with partial pivoting (H is SPD, 3x3).
    double a[3][4];
    for (int r = 0; r < 3; ++r) {
      for (int c = 0; c < 3; ++c) a[r][c] = h[r][c];
      a[r][3] = g[r];
    }
    for (int col = 0; col < 3; ++col) {
      int pivot = col;
      for (int r = col + 1; r < 3; ++r) {
        if (std::fabs(a[r][col]) > std::fabs(a[pivot][col])) pivot = r;
      }
      std::swap(a[col], a[pivot]);
      for (int r = col + 1; r < 3; ++r) {
        const double f = a[r][col] / a[col][col];
        for (int c = col; c < 4; ++c) a[r][c] -= f * a[col][c];
      }
    }
    double step[3];
    for (int r = 2; r >= 0; --r) {
      double v = a[r][3];
      for (int c = r + 1; c < 3; ++c) v -= a[r][c] * step[c];
      step[r] = v / a[r][r];
    }
    // Backtracking: Newton's full step can overshoot where the loss is far from quadratic.
    double t = 1;
    double next[3];
    double next_loss = current;
    for (int k = 0; k < 60; ++k, t *= 0.5) {
      for (int r = 0; r < 3; ++r) next[r] = beta[r] - t * step[r];
      next_loss = loss(next);
      if (next_loss <= current) break;
    }
    const double moved =
        std::max({std::fabs(t * step[0]), std::fabs(t * step[1]), std::fabs(t * step[2])});
    if (next_loss > current) break;  // no descent possible: at the optimum to rounding
    for (int r = 0; r < 3; ++r) beta[r] = next[r];
    current = next_loss;
    if (moved < 1e-12 * (1 + std::fabs(beta[0]) + std::fabs(beta[1]) + std::fabs(beta[2]))) {
      break;
    }
  }

  FittedCoefficients out;
  out.a = beta[1] / s1;
  out.b = beta[2] / s2;
  out.c = beta[0] - out.a * mu1 - out.b * mu2;
  out.source = absl::StrCat("fitted to ", m, " calibration points");
  return out;
}

nlohmann::ordered_json RingContext::ToJson() const {
  return {{"backend", backend},
          {"cp_size", cp_size},
          {"tp_size", tp_size},
          {"num_nodes", num_nodes},
          {"link", link}};
}

std::vector<std::string> Differences(const RingContext& fit, const RingContext& run) {
  std::vector<std::string> out;
  const auto differ = [&out](std::string_view what, const auto& a, const auto& b) {
    if (a != b) out.push_back(absl::StrCat(Sv(what), " ", a, " (the fit) vs ", b, " (this run)"));
  };
  differ("backend", fit.backend, run.backend);
  differ("CP", fit.cp_size, run.cp_size);
  differ("TP", fit.tp_size, run.tp_size);
  differ("nodes", fit.num_nodes, run.num_nodes);
  differ("link", absl::StrCat("'", fit.link, "'"), absl::StrCat("'", run.link, "'"));
  return out;
}

FittedCoefficients RescaleFit(const CalibrationFile& file, int run_cp_size,
                              const SystemSpec& run_system) {
  FittedCoefficients out = file.fitted;
  const int fit_cp = file.made_on ? file.made_on->cp_size : run_cp_size;
  double ratio = static_cast<double>(run_cp_size) / std::max(fit_cp, 1);
  if (file.tflops > 0 && run_system.tflops > 0) ratio *= run_system.tflops / file.tflops;
  if (file.gbps > 0 && run_system.gbps > 0) ratio *= file.gbps / run_system.gbps;
  if (file.elem_bytes > 0 && run_system.elem_bytes > 0) {
    ratio *= run_system.elem_bytes / file.elem_bytes;
  }
  out.c = file.fitted.c - file.fitted.a * std::log(ratio);
  out.source = absl::StrFormat("%s, rescaled to CP%d (eq. 2 threshold x %.4g)", file.fitted.source,
                               run_cp_size, ratio);
  return out;
}

absl::StatusOr<CalibrationFile> ReadCalibrationFile(const std::string& path) {
  CPFILL_ASSIGN_OR_RETURN(nlohmann::json v, json::ReadFile(path));  // errors name the path
  const std::string where = absl::StrCat("calibration file '", path, "': ");
  auto wrap = [&](const absl::Status& s, std::string_view context = "") {
    return absl::InvalidArgumentError(absl::StrCat(where, Sv(context), s.message()));
  };
  CPFILL_CHECK_ARG(v.is_object(), where, "not a JSON object");
  if (const nlohmann::json* rule = json::Find(v, "rule"); rule != nullptr) {
    CPFILL_CHECK_ARG(rule->is_string() && rule->get_ref<const std::string&>() == "fitted", where,
                     "\"rule\" must be \"fitted\", got ", json::Show(*rule));
  }
  CalibrationFile file;
  for (auto [key, field] : {std::pair<const char*, double*>{"a", &file.fitted.a},
                            {"b", &file.fitted.b},
                            {"c", &file.fitted.c}}) {
    absl::StatusOr<double> x = json::GetNumber(v, key);
    if (!x.ok()) return wrap(x.status());
    *field = *x;
  }
  file.fitted.source = absl::StrCat("calibration file ", path);
  if (json::Find(v, "source") != nullptr) {
    absl::StatusOr<std::string> s = json::GetString(v, "source");
    if (!s.ok()) return wrap(s.status());
    file.fitted.source = *s;
  }
  for (auto [key, field] : {std::pair<const char*, double*>{"tflops", &file.tflops},
                            {"gbps", &file.gbps},
                            {"elem_bytes", &file.elem_bytes}}) {
    if (json::Find(v, key) == nullptr) continue;
    absl::StatusOr<double> x = json::GetNumber(v, key);
    if (!x.ok()) return wrap(x.status());
    // 0 means "not measured" (BW on one CP rank); a negative rate is no measurement at all.
    CPFILL_CHECK_ARG(*x >= 0, where, "\"", key, "\" is ", *x, ", must be >= 0");
    *field = *x;
  }
  if (const nlohmann::json* made_on = json::Find(v, "made_on"); made_on != nullptr) {
    absl::StatusOr<RingContext> context = ParseRingContext(*made_on);
    if (!context.ok()) return wrap(context.status(), "made_on: ");
    file.made_on = *std::move(context);
  }
  if (const nlohmann::json* points = json::Find(v, "points"); points != nullptr) {
    CPFILL_CHECK_ARG(points->is_array(), where, "\"points\" is not an array");
    for (size_t i = 0; i < points->size(); ++i) {
      const nlohmann::json& p = (*points)[i];
      const std::string context = absl::StrCat("points[", i, "]: ");
      CPFILL_CHECK_ARG(p.is_object(), where, context, "not an object");
      CalibrationPoint point;
      absl::StatusOr<int64_t> t = json::GetInt(p, "new_tokens");
      if (!t.ok()) return wrap(t.status(), context);
      absl::StatusOr<int64_t> cached = json::GetInt(p, "cached_tokens");
      if (!cached.ok()) return wrap(cached.status(), context);
      absl::StatusOr<double> kv = json::GetNumber(p, "pass_kv_s");
      if (!kv.ok()) return wrap(kv.status(), context);
      absl::StatusOr<double> q = json::GetNumber(p, "pass_q_s");
      if (!q.ok()) return wrap(q.status(), context);
      point.new_tokens = *t;
      point.cached_tokens = *cached;
      point.pass_kv_s = *kv;
      point.pass_q_s = *q;
      file.points.push_back(point);
    }
  }
  return file;
}

absl::Status WriteCalibrationFile(const std::string& path, const CalibrationFile& file) {
  nlohmann::ordered_json points = nlohmann::ordered_json::array();
  for (const CalibrationPoint& p : file.points) {
    points.push_back({{"new_tokens", p.new_tokens},
                      {"cached_tokens", p.cached_tokens},
                      {"pass_kv_s", p.pass_kv_s},
                      {"pass_q_s", p.pass_q_s}});
  }
  nlohmann::ordered_json v = {
      {"rule", "fitted"},   {"a", file.fitted.a},           {"b", file.fitted.b},
      {"c", file.fitted.c}, {"source", file.fitted.source}, {"tflops", file.tflops},
      {"gbps", file.gbps},  {"elem_bytes", file.elem_bytes}};
  if (file.made_on) v["made_on"] = file.made_on->ToJson();
  v["points"] = std::move(points);
  if (absl::Status s = json::WriteFile(path, v); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("calibration file: ", s.message()));
  }
  return absl::OkStatus();
}

}  // namespace cpfill::parallel
