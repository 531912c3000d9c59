#include "base/json_io.h"

#include <cmath>
#include <fstream>
#include <limits>
#include <string>

#include "gtest/gtest.h"

namespace cpfill::json {
namespace {

std::string ParseError(std::string_view text) {
  absl::StatusOr<nlohmann::json> v = Parse(text);
  EXPECT_FALSE(v.ok()) << "parsed: " << text;
  if (v.ok()) return "";
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << v.status();
  return std::string(v.status().message());
}

TEST(JsonParse, ReadsScalarsAndContainers) {
  absl::StatusOr<nlohmann::json> v = Parse(R"({"a": 1, "b": [true, null], "c": "x\u00e9"})");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*GetInt(*v, "a"), 1);
  EXPECT_TRUE((*v)["b"][0].get<bool>());
  EXPECT_TRUE((*v)["b"][1].is_null());
  EXPECT_EQ(*GetString(*v, "c"), "x\xc3\xa9");
  EXPECT_EQ(Find(*v, "missing"), nullptr);
  EXPECT_EQ(Find((*v)["b"], "a"), nullptr) << "not an object";
}

TEST(JsonParse, RefusesMalformedTextNamingLineAndColumn) {
  EXPECT_EQ(ParseError("{\n  \"a\": 1,\n  \"b\": ]\n}").rfind("json: line 3, column 8: ", 0), 0u);
  for (const char* bad :
       {"[1, 2,]", R"({"a": 1,})", "01", "[1] x", "\"a\tb\"", "", "[\"\xff\"]", R"("\ud800")"}) {
    EXPECT_EQ(ParseError(bad).rfind("json: line ", 0), 0u) << bad;
  }
  EXPECT_NE(ParseError("1e999").find("overflow"), std::string::npos);
}

TEST(JsonParse, RefusesDuplicateKeysAtAnyDepth) {
  EXPECT_NE(ParseError(R"({"a": 1, "a": 2})").find("\"a\" appears twice"), std::string::npos);
  EXPECT_NE(ParseError(R"({"x": [{"k": 1, "k": 1}]})").find("\"k\" appears twice"),
            std::string::npos);
  // The same key in sibling objects, or in an object and its parent, is fine.
  EXPECT_TRUE(Parse(R"({"k": {"k": 1}, "j": [{"k": 1}, {"k": 2}]})").ok());
}

TEST(JsonParse, CapsNesting) {
  EXPECT_TRUE(Parse(std::string(256, '[') + std::string(256, ']')).ok());
  EXPECT_NE(ParseError(std::string(257, '[') + std::string(257, ']')).find("deeper than 256"),
            std::string::npos);
  EXPECT_FALSE(Parse(std::string(100000, '[')).ok());
}

TEST(JsonParse, ReportsTopLevelKeysInFileOrder) {
  std::vector<std::string> keys = {"stale"};
  ASSERT_TRUE(Parse(R"({"z": {"inner": 1}, "a": 2, "m": 3})", &keys).ok());
  EXPECT_EQ(keys, (std::vector<std::string>{"z", "a", "m"}));
}

TEST(JsonGet, ChecksTypesAndRangesNamingTheKey) {
  absl::StatusOr<nlohmann::json> v = Parse(
      R"({"f": 2.5, "n": -9223372036854775808, "big": 9223372036854775808, "s": "x", "i": 8.0})");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*GetNumber(*v, "f"), 2.5);
  EXPECT_EQ(*GetNumber(*v, "n"), -9223372036854775808.0);
  EXPECT_EQ(*GetInt(*v, "n"), std::numeric_limits<int64_t>::min());
  EXPECT_NE(GetInt(*v, "f").status().message().find("\"f\" is 2.5, expected an integer"),
            std::string::npos);
  EXPECT_NE(GetInt(*v, "big").status().message().find("within int64"), std::string::npos);
  EXPECT_FALSE(GetInt(*v, "i").ok()) << "8.0 is a float in the file, not an integer";
  EXPECT_NE(GetNumber(*v, "missing").status().message().find("missing key \"missing\""),
            std::string::npos);
  EXPECT_NE(GetString(*v, "f").status().message().find("\"f\" is a number, expected a string"),
            std::string::npos);
  EXPECT_NE(GetNumber(*v, "s").status().message().find("is a string, expected a number"),
            std::string::npos);
  EXPECT_FALSE(GetNumber(nlohmann::json(1), "a").ok()) << "not an object";
}

TEST(JsonDump, KeepsInsertionOrderAndWritesNonFiniteAsStrings) {
  nlohmann::ordered_json v = {{"z", 1}, {"a", 0.5}, {"nan", std::nan("")}};
  v["inf"] = {std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity()};
  absl::StatusOr<std::string> text = Dump(v);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text, R"({"z":1,"a":0.5,"nan":"NaN","inf":["Infinity","-Infinity"]})");
  EXPECT_EQ(*Dump(nlohmann::ordered_json{{"a", 1}}, 2), "{\n  \"a\": 1\n}");
}

TEST(JsonDump, RefusesInvalidUtf8) {
  absl::StatusOr<std::string> text = Dump(nlohmann::ordered_json{{"a", "\xff"}});
  ASSERT_FALSE(text.ok());
  EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(text.status().message().find("UTF-8"), std::string::npos) << text.status();
}

TEST(JsonFile, WritesReadsAndNamesThePath) {
  const std::string path = ::testing::TempDir() + "/json_io_test.json";
  nlohmann::ordered_json v = {{"b", {1, 2}}, {"third", 1.0 / 3}, {"tiny", 5e-324}};
  ASSERT_TRUE(WriteFile(path, v).ok());
  absl::StatusOr<nlohmann::json> back = ReadFile(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ((*back)["b"], nlohmann::json({1, 2}));
  EXPECT_EQ(*GetNumber(*back, "third"), 1.0 / 3);
  EXPECT_EQ(*GetNumber(*back, "tiny"), 5e-324);

  std::ofstream(path, std::ios::trunc) << R"({"a": [1, 2,]})";
  absl::StatusOr<nlohmann::json> bad = ReadFile(path);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find(path + ": json: line 1, column 13"), std::string::npos)
      << bad.status();

  const std::string missing = ::testing::TempDir() + "/json_io_test_missing.json";
  EXPECT_EQ(ReadFile(missing).status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(ReadFile(missing).status().message().find(missing), std::string::npos);
  const absl::Status unwritable = WriteFile(::testing::TempDir() + "/no/such/dir/x.json", v);
  EXPECT_FALSE(unwritable.ok());
  EXPECT_NE(unwritable.message().find("no/such/dir/x.json"), std::string::npos) << unwritable;
}

}  // namespace
}  // namespace cpfill::json
