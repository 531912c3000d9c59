#include "base/knobs.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/string_view.h"

namespace cpfill::knobs {
namespace {

// The registry. Defaults are the measured best (bench/RESULTS.md); a knob that stops mattering
// is removed here, and the compiler then finds every reader.
constexpr KnobSpec kKnobs[] = {
    {kAttentionKernel, KnobType::kChoice, "auto", "auto|hopper|mma",
     "CUDA attention kernel: auto takes the Hopper wgmma kernel on sm_90, else the mma.sync one"},
    {kAttentionVariant, KnobType::kInt, "3", "0..3",
     "tile variant of the mma.sync kernel (3: 128 rows x 64 keys, fastest measured)"},
    {kAttentionKeySplit, KnobType::kChoice, "auto", "auto|off",
     "Hopper attention: a call of few query tiles over long keys runs its keys in parts that "
     "fill the GPU, merged exactly (off: one pass over all keys, for comparison)"},
    {kHopperPingPong, KnobType::kBool, "1", "0|1",
     "Hopper kernel: the two consumer warpgroups alternate GEMMs and softmax (ping-pong)"},
    {kHopperPersistent, KnobType::kBool, "1", "0|1",
     "Hopper kernel: one CTA per SM taking items in turn (0: a CTA per work item)"},
    {kHopperQBuffers, KnobType::kInt, "2", "1..2",
     "Hopper kernel: Q buffers; 2 loads the next item's Q while this item runs"},
    {kHopperMaxCtas, KnobType::kInt, "0", "0..1000000",
     "Hopper kernel: at most N persistent CTAs (0: one per SM); tests walk many items per CTA"},
    {kHopperSchedule, KnobType::kChoice, "dynamic", "dynamic|static",
     "Hopper kernel: items from a global counter, longest first (static: round-robin)"},
    {kHopperKeyTile, KnobType::kChoice, "auto", "auto|128|176",
     "Hopper kernel: keys per K/V tile (auto: 176 for head_dim 128 without the causal mask on "
     "contiguous K/V where every sequence has 32K keys or more, else 128; 176: wherever the "
     "kernel has them)"},
    {kCommunicationSms, KnobType::kInt, "4", "0..64",
     "CUDA attention beside a ring exchange: the SMs its kernels leave free for the exchange's "
     "NCCL kernel (0: none; the exchange may then wait for the attention kernel to end)"},
    {kCommunicationPriority, KnobType::kChoice, "default", "default|high",
     "Device ring: the priority of NCCL's stream (high: its kernels' CTAs are placed before "
     "the attention kernel's waiting ones; measured on 4 H200s: no change)"},
    {kRingExchangeCtas, KnobType::kChoice, "sms", "sms|nccl",
     "Device ring: the CTAs of a ring exchange's NCCL kernel (sms: at most "
     "CPFILL_COMMUNICATION_SMS, so it fits beside the attention kernel; nccl: NCCL's own "
     "count, whose CTAs beyond the free SMs waited for the kernel's end on 4 H200s)"},
    {kDecodeKernel, KnobType::kBool, "1", "0|1",
     "CUDA attention: calls with at most 4 query rows per slice take the split-KV decode "
     "kernel (0: the prefill kernel, for comparison; K/V read in place from the KV cache's "
     "blocks, as the model's decode steps do, always takes the decode kernel)"},
    {kDecodeGemv, KnobType::kBool, "1", "0|1",
     "CUDA linear layers: up to 8 token rows (decode steps) take the small-batch kernel, one "
     "warp per output feature (0: cuBLASLt, for comparison)"},
    {kDecodeSplitWaves, KnobType::kInt, "1", "1..16",
     "CUDA decode attention: the key splits aim at this many waves of the split kernel's CTAs "
     "(1: one wave, the fewest and longest splits; more: shorter splits, for measurement)"},
    {kDecodeCtasPerSm, KnobType::kInt, "0", "0..2",
     "CUDA decode attention: the key splits aim at this many split CTAs per SM (0: for "
     "contiguous K/V one, or two above 30 GB/s of DRAM bandwidth per SM (an H200); as many as "
     "fit (2) for paged K/V; 1, 2: for measurement)"},
    {kDecodeCombineParts, KnobType::kInt, "0", "0..4",
     "CUDA decode attention: the combine kernel's CTAs per output row, each a share of its "
     "columns (0: chosen by the launch; 1, 2, 4: for measurement)"},
    {kPrefixRoot, KnobType::kChoice, "auto", "auto|decode|split",
     "CUDA prefix-batched attention: the shared prefix's level on the decode kernel or split "
     "along its keys on the prefill kernels (auto: the decode kernel up to 128 packed query "
     "rows per slice; the others for tests and measurement)"},
    {kPrefixTree, KnobType::kChoice, "auto", "auto|always",
     "CUDA prefix batching: a step's shared-prefix roots only where they spare more K/V reads "
     "than their levels cost (auto: attention::kGpuTreeCosts), or wherever sequences share "
     "blocks (always: tests on small models, and measurement)"},
    {kDecodeWideRoots, KnobType::kChoice, "auto", "auto|in-place|gather",
     "CUDA paged decode steps: a shared prefix under many sequences' rows (a wide root) runs on "
     "the prefill kernel, reading its blocks in place where the Hopper kernel can (1.03x-1.88x "
     "faster on one H200), or over its rows gathered first; auto: in place on a ring of one "
     "rank, gathered on CP rings (one A/B on two H200s was mixed)"},
    {kPagedPrefill, KnobType::kChoice, "auto", "auto|in-place|gather",
     "CUDA paged prefill steps over cached rows: read the blocks in place (the Hopper kernel) "
     "where the gather would cost more (short prefills after long cached keys) or its copy does "
     "not fit in memory, else gather the keys first (auto); always in place where the GPU can "
     "(in-place); always gathered, a batch whose copy does not fit refused (gather)"},
    {kRanksPerNode, KnobType::kInt, "0", "0..1000000",
     "ranks per emulated node when --ranks-per-node is not given (0: the ranks of each host)"},
    {kTestExitRank, KnobType::kInt, "-1", "-1..1000000",
     "tests only: this world rank is killed (SIGKILL) just before the ring starts"},
    {kTestStallRank, KnobType::kInt, "-1", "-1..1000000",
     "tests only: this world rank stops answering just before the ring starts"},
    {kTestFaultAt, KnobType::kChoice, "start", "start|merge",
     "tests only: where the test fault strikes: before the ring, or (pass-Q, CPU) after the "
     "last ring step, while the others merge"},
    {kLocalRanks, KnobType::kInt, "1", "1..1000000",
     "set by Open MPI: ranks on this host, which share its cores", /*external=*/true},
    {kLaunchRankOmpi, KnobType::kInt, "-1", "-1..100000000",
     "set by mpirun: this process's world rank (before MPI starts: who prints a refusal)",
     /*external=*/true},
    {kLaunchRankPmix, KnobType::kInt, "-1", "-1..100000000",
     "set by srun --mpi=pmix: this process's world rank (as OMPI_COMM_WORLD_RANK)",
     /*external=*/true},
    {kSlurmStepTasks, KnobType::kInt, "0", "0..100000000",
     "set by srun: the job step's tasks (with SLURM_STEP_NUM_NODES: ranks per host)",
     /*external=*/true},
    {kSlurmStepNodes, KnobType::kInt, "0", "0..100000000", "set by srun: the job step's nodes",
     /*external=*/true},
    // NCCL's own transport switches (the GPU hosts emulate slower links with them): recorded in
    // a calibration's link, since they change the ring's bandwidth.
    {kNcclP2pDisable, KnobType::kText, "", "any",
     "NCCL's: 1 turns off peer-to-peer (NVLink/PCIe) transfers; part of a fit's link",
     /*external=*/true},
    {kNcclShmDisable, KnobType::kText, "", "any",
     "NCCL's: 1 turns off shared-memory transfers; part of a fit's link", /*external=*/true},
    {kNcclNet, KnobType::kText, "", "any",
     "NCCL's: the network plugin to use (IB, Socket); part of a fit's link", /*external=*/true},
};

const KnobSpec& Find(std::string_view name) {
  for (const KnobSpec& k : kKnobs) {
    if (k.name == name) return k;
  }
  std::fprintf(stderr, "cpfill: internal error: knob %.*s is not declared in base/knobs.cc\n",
               static_cast<int>(name.size()), name.data());
  std::abort();
}

// A decimal integer written plainly: an optional '-' and digits, nothing around them (no blanks,
// '+', leading "0x" or trailing text, which SimpleAtoi would skip or take), within int64.
bool ParsePlainInt(std::string_view text, int64_t* value) {
  const std::string_view digits = text.starts_with('-') ? text.substr(1) : text;
  if (digits.empty() || digits.find_first_not_of("0123456789") != std::string_view::npos) {
    return false;
  }
  return absl::SimpleAtoi(Sv(text), value);
}

// The checked value of `spec` from `text`; an error names the knob and what it allows. Every
// type takes its value exactly as written: " 3" or "1\n" is not 3 or 1, so a stray blank in a
// job script is refused rather than read as something else.
absl::Status Check(const KnobSpec& spec, std::string_view text) {
  const auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrCat("environment variable ", Sv(spec.name), "='",
                                                   Sv(text), "' is not valid: allowed ",
                                                   Sv(spec.allowed), " (", Sv(spec.why), ")"));
  };
  switch (spec.type) {
    case KnobType::kBool:
      return text == "0" || text == "1" ? absl::OkStatus() : bad();
    case KnobType::kInt: {
      std::vector<absl::string_view> range = absl::StrSplit(Sv(spec.allowed), "..");
      int64_t v = 0, lo = 0, hi = 0;
      if (!ParsePlainInt(text, &v) || !absl::SimpleAtoi(range[0], &lo) ||
          !absl::SimpleAtoi(range[1], &hi) || v < lo || v > hi) {
        return bad();
      }
      return absl::OkStatus();
    }
    case KnobType::kText:
      return absl::OkStatus();
    case KnobType::kChoice:
      for (absl::string_view choice : absl::StrSplit(Sv(spec.allowed), '|')) {
        if (choice == Sv(text)) return absl::OkStatus();
      }
      return bad();
  }
  return bad();
}

std::mutex& CacheMutex() {
  static std::mutex m;
  return m;
}
std::map<std::string_view, std::string>& Cache() {
  static std::map<std::string_view, std::string> cache;
  return cache;
}

// The value in effect as text: the environment's when valid, else the default.
const std::string& Text(const KnobSpec& spec) {
  std::lock_guard<std::mutex> lock(CacheMutex());
  auto [it, inserted] = Cache().try_emplace(spec.name);
  if (inserted) {
    const char* env = std::getenv(std::string(spec.name).c_str());
    it->second = env != nullptr && Check(spec, env).ok() ? std::string(env)
                                                         : std::string(spec.default_value);
  }
  return it->second;
}

const KnobSpec& Typed(std::string_view name, KnobType type) {
  const KnobSpec& spec = Find(name);
  if (spec.type != type) {
    std::fprintf(stderr, "cpfill: internal error: knob %.*s read as the wrong type\n",
                 static_cast<int>(name.size()), name.data());
    std::abort();
  }
  return spec;
}

}  // namespace

std::span<const KnobSpec> All() { return kKnobs; }

bool Bool(std::string_view name) { return Text(Typed(name, KnobType::kBool)) == "1"; }

int64_t Int(std::string_view name) {
  int64_t v = 0;
  const bool ok = absl::SimpleAtoi(Sv(Text(Typed(name, KnobType::kInt))), &v);
  return ok ? v : 0;
}

std::string Choice(std::string_view name) { return Text(Typed(name, KnobType::kChoice)); }

std::string Text(std::string_view name) { return Text(Typed(name, KnobType::kText)); }

int64_t LocalRanks() {
  if (IsSet(kLocalRanks)) return std::max<int64_t>(1, Int(kLocalRanks));
  const int64_t tasks = Int(kSlurmStepTasks), nodes = Int(kSlurmStepNodes);
  if (tasks > 0 && nodes > 0) return (tasks + nodes - 1) / nodes;
  return 1;
}

bool IsSet(std::string_view name) {
  return std::getenv(std::string(Find(name).name).c_str()) != nullptr;
}

absl::Status Validate() {
  for (const KnobSpec& k : kKnobs) {
    const char* env = std::getenv(std::string(k.name).c_str());
    if (env == nullptr) continue;
    if (absl::Status s = Check(k, env); !s.ok()) return s;
  }
  return absl::OkStatus();
}

std::vector<std::pair<std::string, std::string>> InEffect() {
  std::vector<std::pair<std::string, std::string>> out;
  for (const KnobSpec& k : kKnobs) {
    if (k.external && !IsSet(k.name)) continue;
    out.emplace_back(std::string(k.name), Text(k));
  }
  return out;
}

void ResetCacheForTests() {
  std::lock_guard<std::mutex> lock(CacheMutex());
  Cache().clear();
}

}  // namespace cpfill::knobs
