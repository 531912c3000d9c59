#include "launch/job/flags.h"

#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace cpfill::launch {
namespace {

absl::Status ParseArgs(FlagSet& flags, std::vector<std::string> args) {
  std::vector<char*> argv = {const_cast<char*>("cpfill"), const_cast<char*>("test")};
  for (auto& a : args) argv.push_back(a.data());
  return flags.Parse(static_cast<int>(argv.size()), argv.data(), 2);
}

struct Fixture {
  int heads = 16;
  int64_t seed = 1;
  double gbps = 3;
  bool check = false;
  std::string algo = "auto";
  std::vector<int64_t> lens;
  FlagSet flags{"test", "a test"};
  Fixture() {
    flags.Int("heads", &heads, "heads").Within({1, 64});
    flags.Int("seed", &seed, "seed");
    flags.Double("gbps", &gbps, "bandwidth").Within(Range::LeftOpen(0, 1e6));
    flags.Bool("check", &check, "check");
    flags.String("algo", &algo, "algorithm");
    flags.IntList("seq-lens", &lens, "lengths", /*required=*/true).Within({0, kMaxTokens});
  }
};

TEST(FlagSet, ParsesBothFormsListsAndBooleans) {
  Fixture f;
  ASSERT_TRUE(ParseArgs(f.flags, {"--heads", "8", "--seed=7", "--gbps", "2.5", "--check",
                                  "--algo=pass-q", "--seq-lens", "32768,8192,1"})
                  .ok());
  EXPECT_EQ(f.heads, 8);
  EXPECT_EQ(f.seed, 7);
  EXPECT_DOUBLE_EQ(f.gbps, 2.5);
  EXPECT_TRUE(f.check);
  EXPECT_EQ(f.algo, "pass-q");
  EXPECT_EQ(f.lens, (std::vector<int64_t>{32768, 8192, 1}));
  EXPECT_TRUE(f.flags.IsSet("gbps"));
}

TEST(FlagSet, RejectsWithAMessageNamingTheFlag) {
  struct Case {
    std::vector<std::string> args;
    std::string needle;
  };
  for (const Case& c : std::vector<Case>{
           {{"--seq-lens", "1", "--bogus", "3"}, "unknown flag --bogus"},
           {{"--seq-lens", "1", "--heads", "x"}, "--heads: 'x' is not an integer"},
           {{"--seq-lens", "1,a"}, "--seq-lens: 'a' is not an integer"},
           {{"--seq-lens", "1", "--heads"}, "--heads needs a value"},
           {{"--seq-lens", "1", "stray"}, "unexpected argument 'stray'"},
           {{"--heads", "4"}, "--seq-lens is required"},
           {{"--seq-lens", "1", "--check=maybe"}, "true or false"},
           {{"--seq-lens", "1", "--gbps", "nan"}, "'nan' is not a finite number"},
           {{"--seq-lens", "1", "--heads", "99999999999"}, "--heads: 99999999999 is out of range"},
           {{"--seq-lens", "1", "--seed", "99999999999999999999"}, "not a 64-bit integer"},
           {{"--seq-lens", "1", "--gbps", "inf"}, "--gbps: 'inf' is not a finite number"},
           {{"--seq-lens", "1", "--seq-lens", "2"}, "--seq-lens given twice"},
           {{"--seq-lens", "1", "--check", "--check=false"}, "--check given twice"},
           {{"--seq-lens", "1,-3"}, "--seq-lens: -3 is negative; allowed [0, 2147483647]"},
           {{"--seq-lens", "1", "--heads", "0"}, "--heads: 0 is out of range; allowed [1, 64]"},
           {{"--seq-lens", "1", "--gbps", "0"}, "--gbps: 0 is out of range; allowed (0, 1000000]"},
           {{"--seq-lens", "1", "--gbps", "1e18"}, "--gbps: 1e18 is out of range"},
       }) {
    Fixture f;
    absl::Status s = ParseArgs(f.flags, c.args);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.needle;
    EXPECT_NE(s.message().find(c.needle), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("cpfill test --help"), std::string::npos) << s.message();
  }
}

TEST(FlagSet, HelpSkipsRequiredChecksAndListsFlags) {
  Fixture f;
  ASSERT_TRUE(ParseArgs(f.flags, {"--help"}).ok());
  EXPECT_TRUE(f.flags.help());
  const std::string usage = f.flags.Usage();
  EXPECT_NE(usage.find("--seq-lens"), std::string::npos);
  EXPECT_NE(usage.find("(required)"), std::string::npos);
  EXPECT_NE(usage.find("{number, (0, 1000000]}"), std::string::npos) << usage;
  EXPECT_NE(usage.find("{integers, [0, 2147483647]}"), std::string::npos) << usage;
}

TEST(FlagSet, BoundsAreInclusiveUnlessOpen) {
  Fixture f;
  ASSERT_TRUE(
      ParseArgs(f.flags, {"--seq-lens", "0,2147483647", "--heads", "64", "--gbps", "1e6"}).ok());
  EXPECT_EQ(f.lens, (std::vector<int64_t>{0, 2147483647}));
  EXPECT_EQ(f.heads, 64);
  EXPECT_FALSE(ParseArgs(f.flags, {"--seq-lens", "2147483648"}).ok());
  EXPECT_EQ(Range::AtLeast(0).ToString(), ">= 0");
  EXPECT_EQ(Range::Above(0).ToString(), "> 0");
  EXPECT_FALSE(Range::Above(0).Contains(0));
  EXPECT_TRUE(Range::AtLeast(0).Contains(0));
}

TEST(FlagSet, OutputPathsListsTheOutputFlagsInOrderAsParsed) {
  std::string json, trace, out = "fit.json", algo = "auto";
  FlagSet flags("test", "a test");
  flags.String("json", &json, "report").Output();
  flags.String("algo", &algo, "algorithm");
  flags.String("out", &out, "calibration").Output();
  flags.String("trace", &trace, "timeline").Output();
  ASSERT_TRUE(ParseArgs(flags, {"--trace", "t.json", "--algo", "pass-q"}).ok());
  using Paths = std::vector<std::pair<std::string, std::string>>;
  EXPECT_EQ(flags.OutputPaths(), (Paths{{"json", ""}, {"out", "fit.json"}, {"trace", "t.json"}}));
}

// A setting of an optional feature given without the feature would be ignored: refused,
// naming both flags, whether the feature is left out or given as false.
TEST(FlagSet, RefusesASettingWithoutTheFlagItRequires) {
  struct Flags {
    bool handoff = false, staging = false;
    double lease_s = 30;
    FlagSet flags{"test", "a test"};
    Flags() {
      flags.Double("lease-s", &lease_s, "lease").Within(Range::Above(0)).Requires("handoff");
      flags.Bool("handoff", &handoff, "hand-offs");
      flags.Bool("staging", &staging, "staging").Requires("handoff");
    }
  };
  for (const auto& [args, named] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--lease-s", "5"}, "--lease-s"},
           {{"--lease-s=5", "--handoff=false"}, "--lease-s"},
           {{"--staging"}, "--staging"},
           {{"--handoff=0", "--staging=false"}, "--staging"}}) {
    Flags f;
    const absl::Status s = ParseArgs(f.flags, args);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << named;
    EXPECT_NE(s.message().find(named + " is a setting of --handoff, which is off"),
              std::string::npos)
        << s;
  }
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {}, {"--handoff"}, {"--lease-s", "5", "--handoff"}, {"--handoff", "--staging"}}) {
    Flags f;
    const absl::Status s = ParseArgs(f.flags, args);
    EXPECT_TRUE(s.ok()) << s;
  }
  Flags f;
  EXPECT_NE(f.flags.Usage().find("lease (with --handoff) [30] {number, > 0}"), std::string::npos)
      << f.flags.Usage();
  // --help is answered whatever else is given.
  Flags h;
  EXPECT_TRUE(ParseArgs(h.flags, {"--staging", "--help"}).ok());
}

}  // namespace
}  // namespace cpfill::launch
