// cpfill/base/json.cc — strict recursive-descent JSON parser and writer (see json.h).
//
// Parser choices beyond RFC 8259's grammar, all made so that a malformed config or safetensors
// header fails loudly instead of being half-read:
//   - duplicate object keys are rejected (RFC 8259 only says they SHOULD be unique; accepting
//     them would make "which value wins" an accident of the implementation);
//   - numbers whose magnitude overflows a double are rejected (JSON has no infinity); numbers
//     that underflow become 0;
//   - columns count bytes, not code points, from 1.
// Strings are byte strings: UTF-8 passes through unvalidated, \uXXXX escapes are decoded to
// UTF-8 and unpaired surrogates are rejected.
#include "base/json.h"

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <system_error>
#include <unordered_set>

#include "absl/strings/str_cat.h"

namespace cpfill::json {
namespace {

constexpr int kMaxDepth = 256;

// Debian's Abseil is built with its own absl::string_view (ABSL_OPTION_USE_STD_STRING_VIEW 0),
// which StrCat cannot take from a std::string_view directly.
absl::string_view Sv(std::string_view s) { return absl::string_view(s.data(), s.size()); }

}  // namespace

class JsonParser {
 public:
  explicit JsonParser(std::string_view text) : text_(text) {}

  absl::StatusOr<Value> ParseDocument() {
    SkipWhitespace();
    Value value;
    if (absl::Status s = ParseValue(value, 0); !s.ok()) return s;
    SkipWhitespace();
    if (pos_ != text_.size()) return Error("expected end of input after the top-level value");
    return value;
  }

 private:
  bool AtEnd() const { return pos_ >= text_.size(); }
  char Peek() const { return AtEnd() ? '\0' : text_[pos_]; }

  // Line and column of `at` (1-based), computed on error only so the hot path stays a scan.
  absl::Status ErrorAt(size_t at, std::string_view what) const {
    int line = 1;
    size_t line_start = 0;
    for (size_t i = 0; i < at && i < text_.size(); ++i) {
      if (text_[i] == '\n') {
        ++line;
        line_start = i + 1;
      }
    }
    const size_t column = at - line_start + 1;
    std::string found;
    if (at >= text_.size()) {
      found = "end of input";
    } else {
      const unsigned char c = static_cast<unsigned char>(text_[at]);
      if (c >= 0x20 && c < 0x7f) {
        found = absl::StrCat("'", std::string(1, static_cast<char>(c)), "'");
      } else {
        char buf[8];
        std::snprintf(buf, sizeof(buf), "0x%02x", c);
        found = absl::StrCat("byte ", buf);
      }
    }
    return absl::InvalidArgumentError(
        absl::StrCat("json: line ", line, " column ", column, ": ", Sv(what), ", found ", found));
  }
  absl::Status Error(std::string_view what) const { return ErrorAt(pos_, what); }

  void SkipWhitespace() {
    while (!AtEnd()) {
      const char c = text_[pos_];
      if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
      ++pos_;
    }
  }

  bool ConsumeLiteral(std::string_view literal) {
    if (text_.substr(pos_, literal.size()) != literal) return false;
    pos_ += literal.size();
    return true;
  }

  absl::Status ParseValue(Value& out, int depth) {
    switch (Peek()) {
      case '{':
        return ParseObject(out, depth + 1);
      case '[':
        return ParseArray(out, depth + 1);
      case '"': {
        std::string s;
        if (absl::Status st = ParseString(s); !st.ok()) return st;
        out = Value(std::move(s));
        return absl::OkStatus();
      }
      case 't':
        if (ConsumeLiteral("true")) {
          out = Value(true);
          return absl::OkStatus();
        }
        break;
      case 'f':
        if (ConsumeLiteral("false")) {
          out = Value(false);
          return absl::OkStatus();
        }
        break;
      case 'n':
        if (ConsumeLiteral("null")) {
          out = Value();
          return absl::OkStatus();
        }
        break;
      default:
        if (Peek() == '-' || (Peek() >= '0' && Peek() <= '9')) return ParseNumber(out);
        break;
    }
    return Error("expected a value (object, array, string, number, true, false or null)");
  }

  absl::Status ParseObject(Value& out, int depth) {
    if (depth > kMaxDepth) {
      return Error(absl::StrCat("expected at most ", kMaxDepth, " nested arrays/objects"));
    }
    ++pos_;  // '{'
    out = Value::Object();
    std::vector<std::pair<std::string, Value>> members;
    // Views into `members` keys would dangle on reallocation, so the set owns copies; objects
    // are small except safetensors headers, where this keeps duplicate detection linear.
    std::unordered_set<std::string> seen;
    SkipWhitespace();
    if (Peek() == '}') {
      ++pos_;
      return absl::OkStatus();
    }
    while (true) {
      SkipWhitespace();
      if (Peek() != '"') return Error("expected '\"' to start an object key");
      const size_t key_pos = pos_;
      std::string key;
      if (absl::Status s = ParseString(key); !s.ok()) return s;
      if (!seen.insert(key).second) {
        return ErrorAt(key_pos,
                       absl::StrCat("expected unique object keys (\"", key, "\" appears twice)"));
      }
      SkipWhitespace();
      if (Peek() != ':') return Error("expected ':' after object key");
      ++pos_;
      SkipWhitespace();
      Value value;
      if (absl::Status s = ParseValue(value, depth); !s.ok()) return s;
      members.emplace_back(std::move(key), std::move(value));
      SkipWhitespace();
      if (Peek() == ',') {
        ++pos_;
        SkipWhitespace();
        if (Peek() == '}') return Error("expected another member after ',' (trailing comma)");
        continue;
      }
      if (Peek() == '}') {
        ++pos_;
        break;
      }
      return Error("expected ',' or '}' after object member");
    }
    out.members_ = std::move(members);
    return absl::OkStatus();
  }

  absl::Status ParseArray(Value& out, int depth) {
    if (depth > kMaxDepth) {
      return Error(absl::StrCat("expected at most ", kMaxDepth, " nested arrays/objects"));
    }
    ++pos_;  // '['
    out = Value::Array();
    SkipWhitespace();
    if (Peek() == ']') {
      ++pos_;
      return absl::OkStatus();
    }
    while (true) {
      SkipWhitespace();
      Value item;
      if (absl::Status s = ParseValue(item, depth); !s.ok()) return s;
      out.Push(std::move(item));
      SkipWhitespace();
      if (Peek() == ',') {
        ++pos_;
        SkipWhitespace();
        if (Peek() == ']') return Error("expected another element after ',' (trailing comma)");
        continue;
      }
      if (Peek() == ']') {
        ++pos_;
        return absl::OkStatus();
      }
      return Error("expected ',' or ']' after array element");
    }
  }

  static void AppendUtf8(uint32_t cp, std::string& out) {
    if (cp < 0x80) {
      out.push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out.push_back(static_cast<char>(0xc0 | (cp >> 6)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    } else if (cp < 0x10000) {
      out.push_back(static_cast<char>(0xe0 | (cp >> 12)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    } else {
      out.push_back(static_cast<char>(0xf0 | (cp >> 18)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3f)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    }
  }

  // Reads the 4 hex digits after "\u" (pos_ at the first digit).
  absl::Status ParseHex4(uint32_t& cp) {
    cp = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = Peek();
      uint32_t digit;
      if (c >= '0' && c <= '9') {
        digit = c - '0';
      } else if (c >= 'a' && c <= 'f') {
        digit = c - 'a' + 10;
      } else if (c >= 'A' && c <= 'F') {
        digit = c - 'A' + 10;
      } else {
        return Error("expected 4 hex digits after \\u");
      }
      cp = cp * 16 + digit;
      ++pos_;
    }
    return absl::OkStatus();
  }

  absl::Status ParseString(std::string& out) {
    ++pos_;  // opening quote
    while (true) {
      if (AtEnd()) return Error("expected '\"' to close the string");
      const char c = text_[pos_];
      if (c == '"') {
        ++pos_;
        return absl::OkStatus();
      }
      if (static_cast<unsigned char>(c) < 0x20) {
        return Error("expected no raw control characters in a string (escape them)");
      }
      if (c != '\\') {
        out.push_back(c);
        ++pos_;
        continue;
      }
      ++pos_;  // backslash
      const char e = Peek();
      ++pos_;
      switch (e) {
        case '"':
          out.push_back('"');
          break;
        case '\\':
          out.push_back('\\');
          break;
        case '/':
          out.push_back('/');
          break;
        case 'b':
          out.push_back('\b');
          break;
        case 'f':
          out.push_back('\f');
          break;
        case 'n':
          out.push_back('\n');
          break;
        case 'r':
          out.push_back('\r');
          break;
        case 't':
          out.push_back('\t');
          break;
        case 'u': {
          const size_t escape_pos = pos_ - 2;
          uint32_t cp;
          if (absl::Status s = ParseHex4(cp); !s.ok()) return s;
          if (cp >= 0xdc00 && cp <= 0xdfff) {
            return ErrorAt(escape_pos, "expected a high surrogate before a low one");
          }
          if (cp >= 0xd800 && cp <= 0xdbff) {
            if (!ConsumeLiteral("\\u")) {
              return Error("expected \\u low surrogate after a high surrogate");
            }
            uint32_t low;
            if (absl::Status s = ParseHex4(low); !s.ok()) return s;
            if (low < 0xdc00 || low > 0xdfff) {
              return ErrorAt(pos_ - 6, "expected a low surrogate (\\udc00-\\udfff)");
            }
            cp = 0x10000 + ((cp - 0xd800) << 10) + (low - 0xdc00);
          }
          AppendUtf8(cp, out);
          break;
        }
        default:
          --pos_;
          return Error("expected one of \" \\ / b f n r t u after a backslash");
      }
    }
  }

  absl::Status ParseNumber(Value& out) {
    const size_t start = pos_;
    auto is_digit = [this] { return Peek() >= '0' && Peek() <= '9'; };
    bool negative_exponent = false;
    if (Peek() == '-') ++pos_;
    if (Peek() == '0') {
      ++pos_;
      if (is_digit()) return Error("expected no leading zeros in a number");
    } else if (is_digit()) {
      while (is_digit()) ++pos_;
    } else {
      return Error("expected a digit");
    }
    if (Peek() == '.') {
      ++pos_;
      if (!is_digit()) return Error("expected a digit after the decimal point");
      while (is_digit()) ++pos_;
    }
    if (Peek() == 'e' || Peek() == 'E') {
      ++pos_;
      if (Peek() == '+' || Peek() == '-') {
        negative_exponent = Peek() == '-';
        ++pos_;
      }
      if (!is_digit()) return Error("expected a digit in the exponent");
      while (is_digit()) ++pos_;
    }
    double value = 0;
    const char* first = text_.data() + start;
    const char* last = text_.data() + pos_;
    const auto [ptr, ec] = std::from_chars(first, last, value);
    if (ec == std::errc::result_out_of_range) {
      if (!negative_exponent) {
        return ErrorAt(start, "expected a number within the range of a double");
      }
      value = text_[start] == '-' ? -0.0 : 0.0;  // underflow: the nearest double is zero
    } else if (ec != std::errc() || ptr != last) {
      return ErrorAt(start, "expected a number");  // unreachable after the grammar check
    }
    out = Value(value);
    return absl::OkStatus();
  }

  std::string_view text_;
  size_t pos_ = 0;
};

namespace {

void AppendEscaped(std::string_view s, std::string& out) {
  out.push_back('"');
  for (const char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned char>(c));
          out += buf;
        } else {
          out.push_back(c);
        }
    }
  }
  out.push_back('"');
}

void AppendNumber(double x, std::string& out) {
  if (!std::isfinite(x)) {
    out += "null";
    return;
  }
  constexpr double kTwo53 = 9007199254740992.0;
  char buf[32];
  if (x == std::trunc(x) && std::fabs(x) < kTwo53) {
    const auto r = std::to_chars(buf, buf + sizeof(buf), static_cast<int64_t>(x));
    out.append(buf, r.ptr);
    return;
  }
  // Shortest representation that parses back to the same double.
  const auto r = std::to_chars(buf, buf + sizeof(buf), x);
  out.append(buf, r.ptr);
}

void AppendNewline(int indent, int depth, std::string& out) {
  out.push_back('\n');
  out.append(static_cast<size_t>(indent) * depth, ' ');
}

void DumpTo(const Value& v, int indent, int depth, std::string& out) {
  switch (v.type()) {
    case Value::Type::kNull:
      out += "null";
      return;
    case Value::Type::kBool:
      out += v.as_bool() ? "true" : "false";
      return;
    case Value::Type::kNumber:
      AppendNumber(v.as_number(), out);
      return;
    case Value::Type::kString:
      AppendEscaped(v.as_string(), out);
      return;
    case Value::Type::kArray: {
      if (v.items().empty()) {
        out += "[]";
        return;
      }
      out.push_back('[');
      bool first = true;
      for (const Value& item : v.items()) {
        if (!first) out.push_back(',');
        first = false;
        if (indent >= 0) AppendNewline(indent, depth + 1, out);
        DumpTo(item, indent, depth + 1, out);
      }
      if (indent >= 0) AppendNewline(indent, depth, out);
      out.push_back(']');
      return;
    }
    case Value::Type::kObject: {
      if (v.members().empty()) {
        out += "{}";
        return;
      }
      out.push_back('{');
      bool first = true;
      for (const auto& [key, value] : v.members()) {
        if (!first) out.push_back(',');
        first = false;
        if (indent >= 0) AppendNewline(indent, depth + 1, out);
        AppendEscaped(key, out);
        out += indent >= 0 ? ": " : ":";
        DumpTo(value, indent, depth + 1, out);
      }
      if (indent >= 0) AppendNewline(indent, depth, out);
      out.push_back('}');
      return;
    }
  }
}

const char* TypeName(Value::Type t) {
  switch (t) {
    case Value::Type::kNull:
      return "null";
    case Value::Type::kBool:
      return "a boolean";
    case Value::Type::kNumber:
      return "a number";
    case Value::Type::kString:
      return "a string";
    case Value::Type::kArray:
      return "an array";
    case Value::Type::kObject:
      return "an object";
  }
  return "?";
}

}  // namespace

const Value* Value::Find(std::string_view key) const {
  if (type_ != Type::kObject) return nullptr;
  for (const auto& [k, v] : members_) {
    if (k == key) return &v;
  }
  return nullptr;
}

// Set and Push on a value of another type turn it into an object / array first: building a
// report from a default (null) Value is the common case, and anything else is a caller bug that
// the resulting output makes visible.
Value& Value::Set(std::string_view key, Value value) {
  if (type_ != Type::kObject) *this = Object();
  for (auto& [k, v] : members_) {
    if (k == key) {
      v = std::move(value);
      return *this;
    }
  }
  members_.emplace_back(std::string(key), std::move(value));
  return *this;
}

Value& Value::Push(Value value) {
  if (type_ != Type::kArray) *this = Array();
  items_.push_back(std::move(value));
  return *this;
}

absl::StatusOr<double> Value::GetNumber(std::string_view key) const {
  const Value* v = Find(key);
  if (v == nullptr)
    return absl::InvalidArgumentError(absl::StrCat("json: missing key \"", Sv(key), "\""));
  if (!v->is_number()) {
    return absl::InvalidArgumentError(absl::StrCat("json: key \"", Sv(key), "\" is ",
                                                   TypeName(v->type()), ", expected a number"));
  }
  return v->as_number();
}

absl::StatusOr<int64_t> Value::GetInt(std::string_view key) const {
  absl::StatusOr<double> d = GetNumber(key);
  if (!d.ok()) return d.status();
  // Integral and inside int64 (2^63 itself is representable as a double but not as int64).
  if (*d != std::trunc(*d) || std::fabs(*d) >= 9223372036854775808.0) {
    return absl::InvalidArgumentError(
        absl::StrCat("json: key \"", Sv(key), "\" is ", *d, ", expected an integer"));
  }
  return static_cast<int64_t>(*d);
}

absl::StatusOr<std::string> Value::GetString(std::string_view key) const {
  const Value* v = Find(key);
  if (v == nullptr)
    return absl::InvalidArgumentError(absl::StrCat("json: missing key \"", Sv(key), "\""));
  if (!v->is_string()) {
    return absl::InvalidArgumentError(absl::StrCat("json: key \"", Sv(key), "\" is ",
                                                   TypeName(v->type()), ", expected a string"));
  }
  return v->as_string();
}

std::string Value::Dump(int indent) const {
  std::string out;
  DumpTo(*this, indent, 0, out);
  return out;
}

absl::StatusOr<Value> Parse(std::string_view text) { return JsonParser(text).ParseDocument(); }

absl::StatusOr<Value> ParseFile(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    // NotFound for a missing file, PermissionDenied for EACCES, and so on.
    return absl::ErrnoToStatus(errno, absl::StrCat("json: cannot open '", path, "'"));
  }
  std::string text;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, n);
  const bool failed = std::ferror(f) != 0;
  const int err = errno;
  std::fclose(f);
  if (failed) return absl::ErrnoToStatus(err, absl::StrCat("json: error reading '", path, "'"));
  absl::StatusOr<Value> v = Parse(text);
  if (!v.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", v.status().message()));
  }
  return v;
}

}  // namespace cpfill::json
