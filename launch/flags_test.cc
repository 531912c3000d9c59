#include "launch/flags.h"

#include <string>
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
    flags.Int("heads", &heads, "heads");
    flags.Int("seed", &seed, "seed");
    flags.Double("gbps", &gbps, "bandwidth");
    flags.Bool("check", &check, "check");
    flags.String("algo", &algo, "algorithm");
    flags.IntList("seq-lens", &lens, "lengths", /*required=*/true);
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
           {{"--seq-lens", "1", "--gbps", "nan"}, "not a number"},
           {{"--seq-lens", "1", "--heads", "99999999999"}, "32-bit"},
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
}

}  // namespace
}  // namespace cpfill::launch
