#include "base/json.h"

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

#include "gtest/gtest.h"

namespace cpfill::json {
namespace {

// Parses `text`, expecting failure; returns the message.
std::string ParseError(std::string_view text) {
  absl::StatusOr<Value> v = Parse(text);
  EXPECT_FALSE(v.ok()) << "parsed: " << text;
  if (v.ok()) return "";
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << v.status();
  return std::string(v.status().message());
}

TEST(JsonParse, ScalarsAndContainers) {
  absl::StatusOr<Value> v =
      Parse(R"( {"a": 1, "b": [true, false, null], "c": "x", "d": -2.5e3, "e": {}} )");
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_TRUE(v->is_object());
  EXPECT_EQ(v->members().size(), 5u);
  EXPECT_EQ(v->Find("a")->as_number(), 1);
  ASSERT_TRUE(v->Find("b")->is_array());
  EXPECT_TRUE(v->Find("b")->items()[0].as_bool());
  EXPECT_FALSE(v->Find("b")->items()[1].as_bool());
  EXPECT_TRUE(v->Find("b")->items()[2].is_null());
  EXPECT_EQ(v->Find("c")->as_string(), "x");
  EXPECT_EQ(v->Find("d")->as_number(), -2500);
  EXPECT_TRUE(v->Find("e")->is_object());
  EXPECT_EQ(v->Find("missing"), nullptr);
  EXPECT_EQ(v->Find("b")->Find("a"), nullptr);  // not an object
}

TEST(JsonParse, KeepsInsertionOrder) {
  absl::StatusOr<Value> v = Parse(R"({"z": 1, "a": 2, "m": 3})");
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->members()[0].first, "z");
  EXPECT_EQ(v->members()[1].first, "a");
  EXPECT_EQ(v->members()[2].first, "m");
  EXPECT_EQ(v->Dump(), R"({"z":1,"a":2,"m":3})");
}

TEST(JsonParse, Numbers) {
  const std::pair<const char*, double> cases[] = {
      {"0", 0},
      {"-0", 0},
      {"12", 12},
      {"-7", -7},
      {"0.5", 0.5},
      {"1e3", 1000},
      {"1E+3", 1000},
      {"25e-2", 0.25},
      {"1e-400", 0},
      {"9007199254740993", 9007199254740992.0},
      {"123456789012", 123456789012.0},
  };
  for (const auto& [text, expect] : cases) {
    absl::StatusOr<Value> v = Parse(text);
    ASSERT_TRUE(v.ok()) << text << ": " << v.status();
    EXPECT_EQ(v->as_number(), expect) << text;
  }
}

TEST(JsonParse, StringEscapes) {
  absl::StatusOr<Value> v = Parse(R"("a\"b\\c\/d\b\f\n\r\t\u0041\u00e9\u20ac\ud83d\ude00")");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->as_string(), "a\"b\\c/d\b\f\n\r\tA\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80");
  // Raw UTF-8 passes through.
  v = Parse("\"caf\xc3\xa9\"");
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->as_string(), "caf\xc3\xa9");
}

TEST(JsonParse, RejectsMalformedInputWithPosition) {
  EXPECT_NE(ParseError("[1, 2,]").find("trailing comma"), std::string::npos);
  EXPECT_NE(ParseError(R"({"a": 1,})").find("trailing comma"), std::string::npos);
  EXPECT_NE(ParseError("01").find("leading zeros"), std::string::npos);
  EXPECT_NE(ParseError("-01").find("leading zeros"), std::string::npos);
  EXPECT_NE(ParseError("[1] x").find("expected end of input"), std::string::npos);
  EXPECT_NE(ParseError("\"a\tb\"").find("control characters"), std::string::npos);
  EXPECT_NE(ParseError("\"a\nb\"").find("control characters"), std::string::npos);
  EXPECT_NE(ParseError("1e999").find("range"), std::string::npos);
  EXPECT_NE(ParseError(R"({"a": 1, "a": 2})").find("appears twice"), std::string::npos);
  for (const char* bad : {"",
                          " ",
                          "1.",
                          ".5",
                          "+1",
                          "1e",
                          "-",
                          "tru",
                          "nul",
                          "[1 2]",
                          "{1: 2}",
                          R"({"a" 1})",
                          R"({"a":})",
                          "[",
                          "{",
                          "\"abc",
                          R"("\x")",
                          R"("\u12G4")",
                          R"("\ud800")",
                          R"("\ud800\u0041")",
                          R"("\udc00")",
                          "NaN",
                          "Infinity",
                          "'a'",
                          "[1,,2]"}) {
    const std::string msg = ParseError(bad);
    EXPECT_EQ(msg.rfind("json: line ", 0), 0u) << bad << " -> " << msg;
    EXPECT_NE(msg.find("expected"), std::string::npos) << bad << " -> " << msg;
  }
}

TEST(JsonParse, ErrorNamesLineAndColumn) {
  EXPECT_EQ(ParseError("{\n  \"a\": 1,\n  \"b\": ]\n}"),
            "json: line 3 column 8: expected a value (object, array, string, number, true, "
            "false or null), found ']'");
  EXPECT_EQ(ParseError("[1,\n2,\n]"),
            "json: line 3 column 1: expected another element after ',' (trailing comma), found "
            "']'");
}

TEST(JsonParse, DepthIsCapped) {
  const std::string ok = std::string(256, '[') + std::string(256, ']');
  EXPECT_TRUE(Parse(ok).ok());
  const std::string too_deep = std::string(257, '[') + std::string(257, ']');
  EXPECT_NE(ParseError(too_deep).find("at most 256 nested"), std::string::npos);
  // Hostile input far deeper than the cap fails cleanly instead of overflowing the stack.
  EXPECT_FALSE(Parse(std::string(100000, '[')).ok());
}

TEST(JsonDump, CompactAndIntegers) {
  Value v = Value::Object();
  v.Set("i", 42)
      .Set("neg", int64_t{-9007199254740991})
      .Set("u", uint64_t{7})
      .Set("half", 0.5)
      .Set("big", 1e300)  // beyond 2^53: shortest round-trip form
      .Set("inf", std::numeric_limits<double>::infinity())
      .Set("nan", std::nan(""))
      .Set("s", "q\"\\\n\x01")
      .Set("t", true)
      .Set("n", nullptr)
      .Set("arr", Value::Array().Push(1).Push("x"))
      .Set("empty_a", Value::Array())
      .Set("empty_o", Value::Object());
  EXPECT_EQ(v.Dump(),
            R"({"i":42,"neg":-9007199254740991,"u":7,"half":0.5,"big":1e+300,)"
            R"("inf":null,"nan":null,"s":"q\"\\\n\u0001","t":true,"n":null,"arr":[1,"x"],)"
            R"("empty_a":[],"empty_o":{}})");
}

TEST(JsonDump, SetReplacesExistingKey) {
  Value v;
  v.Set("a", 1).Set("b", 2).Set("a", 3);
  EXPECT_EQ(v.Dump(), R"({"a":3,"b":2})");
}

TEST(JsonDump, Indented) {
  Value v = Value::Object();
  v.Set("a", 1).Set("b", Value::Array().Push(1).Push(Value::Object().Set("c", "d")));
  v.Set("e", Value::Array());
  EXPECT_EQ(v.Dump(2),
            "{\n  \"a\": 1,\n  \"b\": [\n    1,\n    {\n      \"c\": \"d\"\n    }\n  ],\n"
            "  \"e\": []\n}");
  EXPECT_EQ(Value(3).Dump(2), "3");
}

TEST(JsonDump, RoundTripsThroughParse) {
  Value v = Value::Object();
  v.Set("pi", 3.141592653589793)
      .Set("tiny", 5e-324)
      .Set("huge", 1.7976931348623157e308)
      .Set("third", 1.0 / 3)
      .Set("text", "tab\there \xe2\x82\xac")
      .Set("nested", Value::Array().Push(Value::Array().Push(-0.125)));
  for (int indent : {-1, 0, 2}) {
    const std::string s = v.Dump(indent);
    absl::StatusOr<Value> back = Parse(s);
    ASSERT_TRUE(back.ok()) << s << ": " << back.status();
    EXPECT_EQ(back->Dump(), v.Dump()) << "indent " << indent;
    EXPECT_EQ(back->Find("third")->as_number(), 1.0 / 3);
    EXPECT_EQ(back->Find("tiny")->as_number(), 5e-324);
  }
}

TEST(JsonTypedLookup, NamesTheKey) {
  absl::StatusOr<Value> v = Parse(R"({"n": 2, "f": 2.5, "s": "x", "big": 1e300})");
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v->GetNumber("f"), 2.5);
  EXPECT_EQ(*v->GetInt("n"), 2);
  EXPECT_EQ(*v->GetString("s"), "x");

  absl::StatusOr<int64_t> i = v->GetInt("f");
  EXPECT_EQ(i.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(i.status().message().find("\"f\""), std::string::npos);
  EXPECT_FALSE(v->GetInt("big").ok());
  absl::StatusOr<double> d = v->GetNumber("missing");
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(d.status().message().find("missing key \"missing\""), std::string::npos);
  absl::StatusOr<std::string> s = v->GetString("n");
  EXPECT_NE(s.status().message().find("is a number, expected a string"), std::string::npos);
  EXPECT_FALSE(Value(1).GetNumber("a").ok());  // not an object
}

TEST(JsonParseFile, ReadsAndNamesThePath) {
  const std::string path = ::testing::TempDir() + "/json_test_file.json";
  std::FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  std::fputs("{\"a\": [1, 2]}\n", f);
  std::fclose(f);
  absl::StatusOr<Value> v = ParseFile(path);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->Dump(), R"({"a":[1,2]})");

  f = std::fopen(path.c_str(), "wb");
  std::fputs("{\"a\": [1, 2,]}", f);
  std::fclose(f);
  v = ParseFile(path);
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(v.status().message().find(path), std::string::npos);
  EXPECT_NE(v.status().message().find("line 1 column 13"), std::string::npos) << v.status();
  std::remove(path.c_str());

  v = ParseFile(path);
  EXPECT_EQ(v.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(v.status().message().find(path), std::string::npos);
}

}  // namespace
}  // namespace cpfill::json
