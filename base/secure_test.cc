#include "base/secure.h"

#include <set>
#include <string>

#include "gtest/gtest.h"

namespace cpfill {
namespace {

TEST(Secure, RandomHexIsFreshEveryTime) {
  std::set<std::string> seen;
  for (int i = 0; i < 1000; ++i) {
    const std::string h = RandomHex(16);
    ASSERT_EQ(h.size(), 32u);
    ASSERT_EQ(h.find_first_not_of("0123456789abcdef"), std::string::npos);
    seen.insert(h);
  }
  EXPECT_EQ(seen.size(), 1000u);
}

TEST(Secure, Sha256MatchesTheStandardVectors) {
  auto hex = [](const Sha256Digest& d) {
    std::string s;
    for (uint8_t b : d) s += "0123456789abcdef"[b >> 4], s += "0123456789abcdef"[b & 15];
    return s;
  };
  EXPECT_EQ(hex(Sha256("")), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(hex(Sha256("abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(Secure, ConstantTimeEqualComparesWholeStrings) {
  EXPECT_TRUE(ConstantTimeEqual("", ""));
  EXPECT_TRUE(ConstantTimeEqual("key-123", "key-123"));
  EXPECT_FALSE(ConstantTimeEqual("key-123", "key-124"));
  EXPECT_FALSE(ConstantTimeEqual("key-123", "key-12"));
  EXPECT_FALSE(ConstantTimeEqual("key", std::string("key\0", 4)));
  EXPECT_FALSE(ConstantTimeEqual("", "x"));
}

}  // namespace
}  // namespace cpfill
