// cpfill/base/json.h — a small JSON value type with a strict parser and a writer.
//
// Used for Hugging Face config.json, safetensors headers, calibration files and --json reports.
// Objects keep insertion order (reports read in the order they were written). Numbers are
// doubles; integers up to 2^53 round-trip exactly.
//
//   CPFILL_ASSIGN_OR_RETURN(json::Value v, json::Parse(text));
//   const json::Value* a = v.Find("a");            // nullptr when absent or v is not an object
//   json::Value out = json::Value::Object();
//   out.Set("choice", "pass-kv").Set("h", 0.25);
//   std::string s = out.Dump(/*indent=*/2);
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace cpfill::json {

class Value {
 public:
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };

  Value() = default;  // null
  Value(std::nullptr_t) {}
  Value(bool b) : type_(Type::kBool), bool_(b) {}
  Value(int v) : type_(Type::kNumber), number_(v) {}
  Value(int64_t v) : type_(Type::kNumber), number_(static_cast<double>(v)) {}
  Value(uint64_t v) : type_(Type::kNumber), number_(static_cast<double>(v)) {}
  Value(double v) : type_(Type::kNumber), number_(v) {}
  Value(const char* s) : type_(Type::kString), string_(s) {}
  Value(std::string s) : type_(Type::kString), string_(std::move(s)) {}
  Value(std::string_view s) : type_(Type::kString), string_(s) {}
  static Value Array() {
    Value v;
    v.type_ = Type::kArray;
    return v;
  }
  static Value Object() {
    Value v;
    v.type_ = Type::kObject;
    return v;
  }

  Type type() const { return type_; }
  bool is_null() const { return type_ == Type::kNull; }
  bool is_bool() const { return type_ == Type::kBool; }
  bool is_number() const { return type_ == Type::kNumber; }
  bool is_string() const { return type_ == Type::kString; }
  bool is_array() const { return type_ == Type::kArray; }
  bool is_object() const { return type_ == Type::kObject; }

  bool as_bool() const { return bool_; }
  double as_number() const { return number_; }
  const std::string& as_string() const { return string_; }
  const std::vector<Value>& items() const { return items_; }                              // array
  const std::vector<std::pair<std::string, Value>>& members() const { return members_; }  // object

  // Object access. Find returns nullptr when absent or when this is not an object.
  const Value* Find(std::string_view key) const;
  Value& Set(std::string_view key, Value value);  // replaces an existing key; returns *this
  // Array append; returns *this.
  Value& Push(Value value);

  // Typed lookups with errors that name the key: InvalidArgument when absent or of another type.
  absl::StatusOr<double> GetNumber(std::string_view key) const;
  absl::StatusOr<int64_t> GetInt(std::string_view key) const;  // must be integral
  absl::StatusOr<std::string> GetString(std::string_view key) const;

  // indent < 0: compact, one line. Non-finite numbers are written as null (JSON has no inf).
  std::string Dump(int indent = -1) const;

 private:
  // The parser fills objects directly: it has already rejected duplicate keys, and going
  // through Set (a linear scan per key) would make parsing quadratic in the number of keys.
  friend class JsonParser;

  Type type_ = Type::kNull;
  bool bool_ = false;
  double number_ = 0;
  std::string string_;
  std::vector<Value> items_;
  std::vector<std::pair<std::string, Value>> members_;
};

// Strict RFC 8259 parser (UTF-8 passed through, \uXXXX escapes incl. surrogate pairs decoded).
// Errors are InvalidArgument naming line:column and what was expected. Nesting depth is capped
// (256) so hostile input cannot overflow the stack.
absl::StatusOr<Value> Parse(std::string_view text);

// Reads and parses a file; errors name the path.
absl::StatusOr<Value> ParseFile(const std::string& path);

}  // namespace cpfill::json
