#include "runtime/memory.h"

#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/knobs.h"

namespace cpfill::runtime {
namespace {

std::string GiB(int64_t bytes) { return absl::StrFormat("%.2f GiB", bytes / double(1 << 30)); }

}  // namespace

absl::StatusOr<int64_t> HostBytesAvailable() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  while (meminfo >> key >> kib) {
    if (key == "MemAvailable:") return kib * 1024 / knobs::Int(knobs::kLocalRanks);
    meminfo.ignore(256, '\n');
  }
  return absl::FailedPreconditionError("cannot read MemAvailable from /proc/meminfo");
}

int64_t HostWeightBytes(const ModelConfig& c, int tp_size) {
  const int64_t d = c.hidden_size, tp = tp_size;
  const int64_t q = int64_t{c.num_heads} * c.head_dim, kv = int64_t{c.num_kv_heads} * c.head_dim;
  const int64_t per_layer = ((q + 2 * kv) * d + d * q + 3 * d * c.intermediate_size) / tp + 2 * d;
  const int64_t vocab = c.vocab_size;
  return 4 * (c.num_layers * per_layer + vocab * d + vocab / tp * d + d);
}

absl::Status CheckFits(const std::string& what, int64_t need_bytes, int64_t free_bytes,
                       const std::string& remedy) {
  if (need_bytes <= free_bytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(what, " need ", GiB(need_bytes), " (",
                                                   need_bytes, " bytes) but ", GiB(free_bytes),
                                                   " are free on this rank; ", remedy));
}

}  // namespace cpfill::runtime
