#include "runtime/model/memory.h"

#include <sys/resource.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/knobs.h"
#include "base/status.h"

namespace cpfill::runtime {
namespace {

constexpr int64_t kUnlimited = std::numeric_limits<int64_t>::max();

std::string GiB(int64_t bytes) { return absl::StrFormat("%.2f GiB", bytes / double(1 << 30)); }

// The number after `key` on its line of a "Key: value [kB]" file such as /proc/meminfo or
// /proc/self/status, times `scale`; -1 when the key is absent.
int64_t FieldOf(const char* file, const std::string& key, int64_t scale) {
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) != 0) continue;
    try {
      return std::stoll(line.substr(key.size())) * scale;
    } catch (...) {
      return -1;
    }
  }
  return -1;
}

// One number from a cgroup v2 file ("max" = unlimited); -1 when unreadable.
int64_t CgroupValue(const char* file) {
  std::ifstream in(file);
  std::string text;
  if (!(in >> text)) return -1;
  if (text == "max") return kUnlimited;
  try {
    return std::stoll(text);
  } catch (...) {
    return -1;
  }
}

// Bytes the process may still map under RLIMIT_AS (ulimit -v), or kUnlimited.
int64_t AddressSpaceLeft() {
  rlimit limit{};
  if (getrlimit(RLIMIT_AS, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return kUnlimited;
  const int64_t used = std::max<int64_t>(0, FieldOf("/proc/self/status", "VmSize:", 1024));
  return std::max<int64_t>(0, static_cast<int64_t>(limit.rlim_cur) - used);
}

// Bytes the container may still use: cgroup v2 memory.max - memory.current, or kUnlimited.
int64_t CgroupMemoryLeft() {
  const int64_t max = CgroupValue("/sys/fs/cgroup/memory.max");
  const int64_t current = CgroupValue("/sys/fs/cgroup/memory.current");
  if (max < 0 || max == kUnlimited || current < 0) return kUnlimited;
  return std::max<int64_t>(0, max - current);
}

absl::Status Shortfall(const std::string& what, int64_t need_bytes, int64_t free_bytes,
                       const std::string& where, const std::string& remedy) {
  return absl::ResourceExhaustedError(absl::StrCat(what, " need ", GiB(need_bytes), " (",
                                                   need_bytes, " bytes) but ", GiB(free_bytes),
                                                   " are free on ", where, "; ", remedy));
}

}  // namespace

absl::StatusOr<int64_t> HostBytesAvailable() {
  const int64_t available = FieldOf("/proc/meminfo", "MemAvailable:", 1024);
  if (available < 0) {
    return absl::FailedPreconditionError("cannot read MemAvailable from /proc/meminfo");
  }
  // The host's and the container's share go to every rank on it; an address-space limit is
  // this process's own.
  const int64_t shared = std::min(available, CgroupMemoryLeft());
  return std::min(shared / knobs::LocalRanks(), AddressSpaceLeft());
}

int64_t HostWeightBytes(const ModelConfig& c, int tp_size) { return WeightBytes(c, tp_size, 4); }

int64_t WeightBytes(const ModelConfig& c, int tp_size, int64_t elem_bytes) {
  const int64_t d = c.hidden_size, tp = tp_size, inter = c.intermediate_size;
  const int64_t q = int64_t{c.num_heads} * c.head_dim, kv = int64_t{c.num_kv_heads} * c.head_dim;
  // Each projection: {module suffix, this rank's rows (its scales), elements on this rank}.
  const struct {
    const char* suffix;
    int64_t rows, elems;
  } projections[] = {
      {"self_attn.q_proj", q / tp, q * d / tp},      {"self_attn.k_proj", kv / tp, kv * d / tp},
      {"self_attn.v_proj", kv / tp, kv * d / tp},    {"self_attn.o_proj", d, d * q / tp},
      {"mlp.gate_proj", inter / tp, inter * d / tp}, {"mlp.up_proj", inter / tp, inter * d / tp},
      {"mlp.down_proj", d, d * inter / tp}};
  int64_t bytes = 0;
  for (int layer = 0; layer < c.num_layers; ++layer) {
    for (const auto& p : projections) {
      const bool fp8 = c.fp8.Quantizes(absl::StrCat("model.layers.", layer, ".", p.suffix));
      bytes += fp8 ? p.elems + 4 * p.rows : elem_bytes * p.elems;  // FP8: 1 byte + fp32 scales
    }
    bytes += elem_bytes * 2 * d;  // norms
  }
  const int64_t vocab = c.vocab_size;
  return bytes + elem_bytes * (vocab * d + vocab / tp * d + d);
}

int64_t SaturatingBytes(double bytes) {
  return bytes >= 9.2e18 ? kUnlimited : static_cast<int64_t>(std::max(0.0, bytes));
}

absl::Status CheckFits(const std::string& what, int64_t need_bytes, int64_t free_bytes,
                       const std::string& remedy) {
  if (need_bytes <= free_bytes) return absl::OkStatus();
  return Shortfall(what, need_bytes, free_bytes, "this rank", remedy);
}

absl::Status CheckFitsOnEveryRank(parallel::Communicator& world, const std::string& what,
                                  int64_t need_bytes,
                                  const std::function<absl::StatusOr<int64_t>()>& free_bytes,
                                  const std::string& remedy) {
  int64_t free = kUnlimited;  // a rank that cannot tell what is free does not refuse
  if (need_bytes > 0) {
    if (absl::StatusOr<int64_t> f = free_bytes(); f.ok()) free = *f;
  }
  int64_t worst = need_bytes > free ? need_bytes - free : 0;
  CPFILL_RETURN_IF_ERROR(
      world.AllReduce(&worst, 1, parallel::DataType::kInt64, parallel::ReduceOp::kMax));
  if (worst == 0) return absl::OkStatus();
  // The rank short by the most (the lowest such rank) tells everyone its numbers.
  const int64_t none = std::numeric_limits<int64_t>::min();
  const bool mine = need_bytes - free == worst;
  int64_t who[3] = {mine ? -world.rank() : none, none, none};
  CPFILL_RETURN_IF_ERROR(
      world.AllReduce(who, 1, parallel::DataType::kInt64, parallel::ReduceOp::kMax));
  if (who[0] == -world.rank()) who[1] = need_bytes, who[2] = free;
  CPFILL_RETURN_IF_ERROR(
      world.AllReduce(who + 1, 2, parallel::DataType::kInt64, parallel::ReduceOp::kMax));
  return Shortfall(what, who[1], who[2], absl::StrCat("rank ", -who[0], " of ", world.size()),
                   remedy);
}

}  // namespace cpfill::runtime
