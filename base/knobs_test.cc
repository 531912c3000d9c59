#include "base/knobs.h"

#include <cstdlib>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace cpfill::knobs {
namespace {

class KnobsTest : public ::testing::Test {
 protected:
  void TearDown() override {
    for (const char* n :
         {"CPFILL_HOPPER_MAX_CTAS", "CPFILL_HOPPER_PINGPONG", "CPFILL_HOPPER_SCHEDULE"}) {
      unsetenv(n);
    }
    ResetCacheForTests();
  }
};

TEST_F(KnobsTest, EveryNameIsDeclaredOnceWithADefaultThatPassesItsOwnCheck) {
  std::set<std::string_view> seen;
  for (const KnobSpec& k : All()) {
    EXPECT_TRUE(seen.insert(k.name).second) << k.name;
    EXPECT_FALSE(k.why.empty()) << k.name;
    setenv(std::string(k.name).c_str(), std::string(k.default_value).c_str(), 1);
    EXPECT_TRUE(Validate().ok()) << k.name << ": " << Validate();
    unsetenv(std::string(k.name).c_str());
  }
  for (std::string_view n : {kAttentionKernel, kAttentionVariant, kAttentionKeySplit,
                             kHopperPingPong,  kHopperPersistent, kHopperQBuffers,
                             kHopperMaxCtas,   kHopperSchedule,   kHopperKeyTile,
                             kDecodeKernel,    kDecodeCtasPerSm,  kDecodeCombineParts,
                             kPrefixRoot,      kPrefixTree,       kRanksPerNode,
                             kTestExitRank,    kTestStallRank,    kLocalRanks,
                             kSlurmStepTasks,  kSlurmStepNodes,   kNcclP2pDisable,
                             kNcclShmDisable,  kNcclNet}) {
    EXPECT_TRUE(seen.count(n)) << n;
  }
}

// mpirun's count first; under srun (no OMPI_ variables) tasks over nodes; alone, 1.
TEST_F(KnobsTest, LocalRanksFromEitherLauncher) {
  EXPECT_EQ(LocalRanks(), 1);
  setenv("SLURM_STEP_NUM_TASKS", "8", 1);
  setenv("SLURM_STEP_NUM_NODES", "2", 1);
  ResetCacheForTests();
  EXPECT_EQ(LocalRanks(), 4);
  setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "3", 1);
  ResetCacheForTests();
  EXPECT_EQ(LocalRanks(), 3);
  for (const char* name :
       {"SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_NODES", "OMPI_COMM_WORLD_LOCAL_SIZE"}) {
    unsetenv(name);
  }
  ResetCacheForTests();
}

// Another program's variable (NCCL's) is recorded as it is, whatever it holds.
TEST_F(KnobsTest, TextKnobsTakeAnyValue) {
  EXPECT_EQ(Text(kNcclNet), "");
  setenv("NCCL_NET", "Socket", 1);
  ResetCacheForTests();
  EXPECT_TRUE(Validate().ok());
  EXPECT_EQ(Text(kNcclNet), "Socket");
  unsetenv("NCCL_NET");
  ResetCacheForTests();
}

TEST_F(KnobsTest, DefaultsWhenUnsetAndEnvironmentWhenValid) {
  EXPECT_EQ(Int(kHopperMaxCtas), 0);
  EXPECT_TRUE(Bool(kHopperPingPong));
  EXPECT_EQ(Choice(kHopperSchedule), "dynamic");
  setenv("CPFILL_HOPPER_MAX_CTAS", "3", 1);
  setenv("CPFILL_HOPPER_PINGPONG", "0", 1);
  setenv("CPFILL_HOPPER_SCHEDULE", "static", 1);
  EXPECT_EQ(Int(kHopperMaxCtas), 0) << "values are cached after the first read";
  ResetCacheForTests();
  EXPECT_EQ(Int(kHopperMaxCtas), 3);
  EXPECT_FALSE(Bool(kHopperPingPong));
  EXPECT_EQ(Choice(kHopperSchedule), "static");
  EXPECT_TRUE(Validate().ok());
}

TEST_F(KnobsTest, MalformedValuesAreRefusedByName) {
  for (const char* bad : {"-1", "abc", "", "1e3", "99999999999"}) {
    setenv("CPFILL_HOPPER_MAX_CTAS", bad, 1);
    const absl::Status s = Validate();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("CPFILL_HOPPER_MAX_CTAS"), std::string::npos) << s;
    EXPECT_NE(s.message().find("0..1000000"), std::string::npos) << s;
  }
  unsetenv("CPFILL_HOPPER_MAX_CTAS");
  setenv("CPFILL_HOPPER_SCHEDULE", "fast", 1);
  EXPECT_NE(Validate().message().find("dynamic|static"), std::string::npos);
  setenv("CPFILL_HOPPER_PINGPONG", "yes", 1);
  EXPECT_FALSE(Validate().ok());
}

// A value is taken exactly as written, whatever the knob's type: blanks around it, a '+', a base
// prefix or trailing text are refused, not read as the value they surround.
TEST_F(KnobsTest, ValuesAreParsedWholeAndStrictly) {
  const std::vector<std::pair<const char*, std::vector<std::string>>> cases = {
      {"CPFILL_ATTENTION_VARIANT", {" 3", "3 ", "\t3", "3\n", "+3", "03x", "0x3", "3.0", "-", ""}},
      {"CPFILL_TEST_EXIT_RANK", {" -1", "-1 ", "--1", "- 1", "-+1"}},
      {"CPFILL_HOPPER_PINGPONG", {" 1", "1 ", "01", "true", "+1"}},
      {"CPFILL_HOPPER_SCHEDULE", {" static", "static ", "Static", "static\n"}},
  };
  for (const auto& [name, values] : cases) {
    for (const std::string& bad : values) {
      setenv(name, bad.c_str(), 1);
      const absl::Status s = Validate();
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << name << "='" << bad << "'";
      EXPECT_NE(s.message().find(absl::StrCat(name, "='", bad, "'")), std::string::npos) << s;
    }
    unsetenv(name);
  }
  // The same values written plainly are taken.
  for (const auto& [name, good] :
       std::vector<std::pair<const char*, const char*>>{{"CPFILL_ATTENTION_VARIANT", "3"},
                                                        {"CPFILL_ATTENTION_VARIANT", "03"},
                                                        {"CPFILL_TEST_EXIT_RANK", "-1"},
                                                        {"CPFILL_HOPPER_PINGPONG", "1"},
                                                        {"CPFILL_HOPPER_SCHEDULE", "static"}}) {
    setenv(name, good, 1);
    EXPECT_TRUE(Validate().ok()) << name << "='" << good << "': " << Validate();
    unsetenv(name);
  }
}

TEST_F(KnobsTest, InEffectListsUserKnobsAtTheirValues) {
  setenv("CPFILL_HOPPER_SCHEDULE", "static", 1);
  bool found = false;
  for (const auto& [name, value] : InEffect()) {
    if (name == "CPFILL_HOPPER_SCHEDULE") {
      found = true;
      EXPECT_EQ(value, "static");
    }
  }
  EXPECT_TRUE(found);
}

}  // namespace
}  // namespace cpfill::knobs
