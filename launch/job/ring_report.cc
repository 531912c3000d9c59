#include "launch/job/ring_report.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "parallel/selector.h"

namespace cpfill::launch {

std::string Ms(double seconds) { return absl::StrFormat("%.2f", seconds * 1e3); }

std::string Bytes(int64_t b) {
  if (b >= (int64_t{1} << 30)) return absl::StrFormat("%.2f GiB", b / double(int64_t{1} << 30));
  if (b >= (int64_t{1} << 20)) return absl::StrFormat("%.2f MiB", b / double(1 << 20));
  if (b >= 1024) return absl::StrFormat("%.1f KiB", b / 1024.0);
  return absl::StrCat(b, " B");
}

namespace {

bool Ran(const parallel::RingTimings& t, parallel::RingAlgorithm a) {
  if (t.algorithm == a) return true;
  for (const auto& s : t.steps) {
    if (s.algorithm == a) return true;
  }
  return false;
}

}  // namespace

std::string RingStepTable(const parallel::RingTimings& t, int cp_rank) {
  // A mixed batch (one ring per algorithm) says which ring each step belongs to.
  bool mixed = false;
  for (const auto& s : t.steps) mixed |= s.algorithm != t.steps.front().algorithm;
  std::string out = absl::StrFormat("ring steps (cp_rank %d):\n", cp_rank);
  absl::StrAppendFormat(&out, "  %s%4s %6s %12s %12s %12s %14s %14s\n", mixed ? "ring     " : "",
                        "step", "source", "exchange", "transfer ms", "compute ms", "exposed wait",
                        "hidden pairs");
  for (const auto& s : t.steps) {
    absl::StrAppendFormat(
        &out, "  %s%4d %6d %12s %12s %12s %14s %14s\n",
        mixed ? absl::StrFormat("%-9s", parallel::RingAlgorithmName(s.algorithm)) : "", s.step,
        s.source_cp_rank, s.exchange_bytes ? Bytes(s.exchange_bytes) : "-", Ms(s.transfer_s),
        Ms(s.compute_s), Ms(s.wait_s),
        absl::StrCat(s.chunk_pairs_hidden, "/", s.chunk_pairs, " skipped"));
  }
  absl::StrAppendFormat(&out, "  pack/unpack %s ms", Ms(t.pack_s));
  if (Ran(t, parallel::RingAlgorithm::kAllGather)) {
    absl::StrAppendFormat(&out, ", all-gather %s ms", Ms(t.all_gather_s));
  }
  if (Ran(t, parallel::RingAlgorithm::kPassQ)) {
    absl::StrAppendFormat(&out, ", all-to-all %s ms (%s), merge %s ms", Ms(t.all_to_all_s),
                          Bytes(t.all_to_all_bytes), Ms(t.merge_s));
  }
  out += "\n";
  return out;
}

nlohmann::ordered_json RingTimingsJson(const parallel::RingTimings& t, double flops_per_pair) {
  nlohmann::ordered_json steps = nlohmann::ordered_json::array();
  for (const auto& s : t.steps) {
    steps.push_back({{"algorithm", parallel::RingAlgorithmName(s.algorithm)},
                     {"step", s.step},
                     {"source_cp_rank", s.source_cp_rank},
                     {"exchange_bytes", s.exchange_bytes},
                     {"transfer_ms", s.transfer_s * 1e3},
                     {"compute_ms", s.compute_s * 1e3},
                     {"exposed_wait_ms", s.wait_s * 1e3},
                     {"visible_pairs", s.visible_pairs},
                     {"chunk_pairs", s.chunk_pairs},
                     {"chunk_pairs_hidden_skipped", s.chunk_pairs_hidden}});
  }
  return {{"algorithm", parallel::RingAlgorithmName(t.algorithm)},
          {"steps", std::move(steps)},
          {"pack_ms", t.pack_s * 1e3},
          {"all_gather_ms", t.all_gather_s * 1e3},
          {"all_to_all_ms", t.all_to_all_s * 1e3},
          {"all_to_all_bytes", t.all_to_all_bytes},
          {"merge_ms", t.merge_s * 1e3},
          {"total_ms", t.total_s * 1e3},
          {"gflop", t.visible_pairs * flops_per_pair / 1e9}};
}

}  // namespace cpfill::launch
