// cpfill/base/knobs.h — every environment variable cpfill reads, declared once: name, type,
// default, allowed values and one line of why. Nothing else in the tree calls getenv.
//
// Knobs are measurement and test switches (the defaults are the measured best); flags are the
// user's interface. The registry lets `cpfill env` list them, every `--json` report record the
// values in effect, and start-up refuse a malformed value (exit 2) instead of running with a
// silent fallback.
//
//   if (knobs::Bool(knobs::kHopperPingPong)) ...;             // read once, cached
//   const int64_t cap = knobs::Int(knobs::kHopperMaxCtas);
//   CPFILL_RETURN_IF_ERROR(knobs::Validate());                 // at start-up, every rank
//   for (const auto& [name, value] : knobs::InEffect()) ...    // for reports
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace cpfill::knobs {

enum class KnobType { kBool, kInt, kChoice, kText };

struct KnobSpec {
  std::string_view name;
  KnobType type;
  std::string_view default_value;
  // kInt: "min..max" (inclusive); kChoice: values separated by '|'; kBool: "0|1"; kText:
  // anything (another program's variable, only recorded).
  std::string_view allowed;
  std::string_view why;
  // Another program's variable (the launcher's, NCCL's): reports list it only when it is set.
  bool external = false;
};

// The names; each is declared in knobs.cc's table (a unit test checks every one).
inline constexpr std::string_view kAttentionKernel = "CPFILL_ATTENTION_KERNEL";
inline constexpr std::string_view kAttentionVariant = "CPFILL_ATTENTION_VARIANT";
inline constexpr std::string_view kAttentionKeySplit = "CPFILL_ATTENTION_KEY_SPLIT";
inline constexpr std::string_view kHopperPingPong = "CPFILL_HOPPER_PINGPONG";
inline constexpr std::string_view kHopperPersistent = "CPFILL_HOPPER_PERSISTENT";
inline constexpr std::string_view kHopperQBuffers = "CPFILL_HOPPER_Q_BUFFERS";
inline constexpr std::string_view kHopperMaxCtas = "CPFILL_HOPPER_MAX_CTAS";
inline constexpr std::string_view kHopperSchedule = "CPFILL_HOPPER_SCHEDULE";
inline constexpr std::string_view kHopperKeyTile = "CPFILL_HOPPER_KEY_TILE";
inline constexpr std::string_view kCommunicationSms = "CPFILL_COMMUNICATION_SMS";
inline constexpr std::string_view kCommunicationPriority = "CPFILL_COMMUNICATION_PRIORITY";
inline constexpr std::string_view kRingExchangeCtas = "CPFILL_RING_EXCHANGE_CTAS";
inline constexpr std::string_view kDecodeKernel = "CPFILL_DECODE_KERNEL";
inline constexpr std::string_view kDecodeGemv = "CPFILL_DECODE_GEMV";
inline constexpr std::string_view kDecodeSplitWaves = "CPFILL_DECODE_SPLIT_WAVES";
inline constexpr std::string_view kDecodeCtasPerSm = "CPFILL_DECODE_CTAS_PER_SM";
inline constexpr std::string_view kDecodeCombineParts = "CPFILL_DECODE_COMBINE_PARTS";
inline constexpr std::string_view kPrefixRoot = "CPFILL_PREFIX_ROOT";
inline constexpr std::string_view kPrefixTree = "CPFILL_PREFIX_TREE";
inline constexpr std::string_view kDecodeWideRoots = "CPFILL_DECODE_WIDE_ROOTS";
inline constexpr std::string_view kPagedPrefill = "CPFILL_PAGED_PREFILL";
inline constexpr std::string_view kRanksPerNode = "CPFILL_RANKS_PER_NODE";
inline constexpr std::string_view kTestExitRank = "CPFILL_TEST_EXIT_RANK";
inline constexpr std::string_view kTestStallRank = "CPFILL_TEST_STALL_RANK";
inline constexpr std::string_view kTestFaultAt = "CPFILL_TEST_FAULT_AT";
inline constexpr std::string_view kLocalRanks = "OMPI_COMM_WORLD_LOCAL_SIZE";
inline constexpr std::string_view kLaunchRankOmpi = "OMPI_COMM_WORLD_RANK";
inline constexpr std::string_view kLaunchRankPmix = "PMIX_RANK";
inline constexpr std::string_view kSlurmStepTasks = "SLURM_STEP_NUM_TASKS";
inline constexpr std::string_view kSlurmStepNodes = "SLURM_STEP_NUM_NODES";
inline constexpr std::string_view kNcclP2pDisable = "NCCL_P2P_DISABLE";
inline constexpr std::string_view kNcclShmDisable = "NCCL_SHM_DISABLE";
inline constexpr std::string_view kNcclNet = "NCCL_NET";

// Every declared knob, in the order `cpfill env` lists them.
std::span<const KnobSpec> All();

// The value in effect (the environment's if set and valid, else the default), read on first
// use and cached. Asking for an undeclared name, or for the wrong type, is a programming error
// and aborts with the name.
bool Bool(std::string_view name);
int64_t Int(std::string_view name);
std::string Choice(std::string_view name);
std::string Text(std::string_view name);
// True when the environment sets the knob (to anything).
bool IsSet(std::string_view name);

// Ranks the launcher started on this host, known before MPI starts: mpirun's local size, else
// srun's tasks over nodes (the grid insists on the same count per host), else 1.
int64_t LocalRanks();

// InvalidArgument naming the first knob whose environment value is malformed or out of range,
// with the allowed values. Launch calls it on every rank before any work.
absl::Status Validate();

// (name, value in effect) for every knob the environment sets, plus every non-external knob at
// its default: what a report records.
std::vector<std::pair<std::string, std::string>> InEffect();

// Test hook: forget cached values so a test that changes the environment sees the change.
void ResetCacheForTests();

}  // namespace cpfill::knobs
