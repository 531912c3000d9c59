// cpfill/base/json_io.cc — see json_io.h.
//
// nlohmann throws; cpfill returns absl::Status. Every call into nlohmann that can throw on bad
// input (parse, dump) sits in a try block here, so no exception reaches a command's Run().
#include "base/json_io.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "base/string_view.h"

namespace cpfill::json {
namespace {

constexpr int kMaxDepth = 256;
constexpr size_t kShowChars = 200;

// nlohmann's what() without its "[json.exception.parse_error.101] parse error at " prefix:
// "line 1, column 6: syntax error while parsing value - unexpected end of input; ...".
std::string Problem(const nlohmann::json::exception& e) {
  std::string_view what = e.what();
  if (const size_t close = what.find("] ");
      what.starts_with("[json.exception.") && close != std::string_view::npos) {
    what.remove_prefix(close + 2);
  }
  constexpr std::string_view kAt = "parse error at ";
  if (what.starts_with(kAt)) what.remove_prefix(kAt.size());
  return absl::StrCat("json: ", Sv(what));
}

bool HasNonFinite(const nlohmann::ordered_json& v) {
  if (v.is_number_float()) return !std::isfinite(v.get<double>());
  if (!v.is_structured()) return false;
  for (const auto& item : v) {
    if (HasNonFinite(item)) return true;
  }
  return false;
}

void NonFiniteToStrings(nlohmann::ordered_json& v) {
  if (v.is_number_float()) {
    const double x = v.get<double>();
    if (std::isnan(x)) v = "NaN";
    if (std::isinf(x)) v = x > 0 ? "Infinity" : "-Infinity";
    return;
  }
  if (!v.is_structured()) return;
  for (auto& item : v) NonFiniteToStrings(item);
}

absl::Status NotFound(std::string_view key) {
  return absl::InvalidArgumentError(absl::StrCat("json: missing key \"", Sv(key), "\""));
}

absl::Status WrongType(std::string_view key, const nlohmann::json& v, std::string_view wanted) {
  return absl::InvalidArgumentError(
      absl::StrCat("json: key \"", Sv(key), "\" is ", Sv(TypeName(v)), ", expected ", Sv(wanted)));
}

}  // namespace

absl::StatusOr<nlohmann::json> Parse(std::string_view text,
                                     std::vector<std::string>* top_level_keys) {
  // The callback sees every key before nlohmann stores it; one key set per open object. It
  // always answers true (keep): a discarded object gets no object_end event, which would
  // unbalance the stack. The first violation is remembered and reported after the parse.
  std::vector<std::unordered_set<std::string>> open_objects;
  std::string problem;
  const auto callback = [&](int depth, nlohmann::json::parse_event_t event,
                            nlohmann::json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if ((event == Event::object_start || event == Event::array_start) && depth >= kMaxDepth &&
        problem.empty()) {
      problem = absl::StrCat("json: nesting deeper than ", kMaxDepth, " arrays/objects");
    }
    if (event == Event::object_start) open_objects.emplace_back();
    if (event == Event::object_end) open_objects.pop_back();
    if (event == Event::key) {
      const auto& key = parsed.get_ref<const std::string&>();
      if (!open_objects.back().insert(key).second && problem.empty()) {
        problem = absl::StrCat("json: object key \"", key, "\" appears twice");
      }
      if (depth == 1 && top_level_keys != nullptr) top_level_keys->push_back(key);
    }
    return true;
  };
  if (top_level_keys != nullptr) top_level_keys->clear();
  nlohmann::json v;
  try {
    v = nlohmann::json::parse(text.begin(), text.end(), callback);
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(Problem(e));
  }
  if (!problem.empty()) return absl::InvalidArgumentError(problem);
  return v;
}

absl::StatusOr<nlohmann::json> ReadFile(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  // A file that cannot be read is bad input (the user named it): NotFound when it is missing,
  // InvalidArgument for the rest (permissions, a directory, an I/O error), with the reason.
  if (f == nullptr) {
    const int err = errno;
    const std::string message = absl::StrCat("cannot open '", path, "': ", std::strerror(err));
    return err == ENOENT ? absl::NotFoundError(message) : absl::InvalidArgumentError(message);
  }
  std::string text;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, n);
  const bool failed = std::ferror(f) != 0;
  const int err = errno;
  std::fclose(f);
  if (failed) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read '", path, "': ", std::strerror(err)));
  }
  absl::StatusOr<nlohmann::json> v = Parse(text);
  if (!v.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", v.status().message()));
  return v;
}

absl::StatusOr<std::string> Dump(const nlohmann::ordered_json& v, int indent) {
  try {
    if (!HasNonFinite(v)) return v.dump(indent);
    nlohmann::ordered_json copy = v;
    NonFiniteToStrings(copy);
    return copy.dump(indent);
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(Problem(e), " (JSON strings must be valid UTF-8)"));
  }
}

absl::Status WriteFile(const std::string& path, const nlohmann::ordered_json& v) {
  absl::StatusOr<std::string> dumped = Dump(v, 2);
  if (!dumped.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot write '", path, "': ", dumped.status().message()));
  }
  const std::string text = *dumped + "\n";
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) return absl::ErrnoToStatus(errno, absl::StrCat("cannot create '", tmp, "'"));
  const bool wrote = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const int write_err = errno;
  const bool closed = std::fclose(f) == 0;
  const int close_err = errno;
  if (!wrote || !closed) {
    std::remove(tmp.c_str());
    return absl::ErrnoToStatus(!wrote ? write_err : close_err, absl::StrCat("writing '", tmp, "'"));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    return absl::ErrnoToStatus(err, absl::StrCat("renaming '", tmp, "' to '", path, "'"));
  }
  return absl::OkStatus();
}

std::optional<int64_t> AsInt64(const nlohmann::json& v) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  return std::nullopt;
}

const nlohmann::json* Find(const nlohmann::json& obj, std::string_view key) {
  if (!obj.is_object()) return nullptr;
  const auto it = obj.find(key);
  return it == obj.end() ? nullptr : &*it;
}

absl::StatusOr<double> GetNumber(const nlohmann::json& obj, std::string_view key) {
  const nlohmann::json* v = Find(obj, key);
  if (v == nullptr) return NotFound(key);
  if (!v->is_number()) return WrongType(key, *v, "a number");
  return v->get<double>();
}

absl::StatusOr<int64_t> GetInt(const nlohmann::json& obj, std::string_view key) {
  const nlohmann::json* v = Find(obj, key);
  if (v == nullptr) return NotFound(key);
  if (!v->is_number()) return WrongType(key, *v, "an integer");
  const std::optional<int64_t> i = AsInt64(*v);
  if (!i.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat("json: key \"", Sv(key), "\" is ", Show(*v),
                                                   ", expected an integer within int64"));
  }
  return *i;
}

absl::StatusOr<std::string> GetString(const nlohmann::json& obj, std::string_view key) {
  const nlohmann::json* v = Find(obj, key);
  if (v == nullptr) return NotFound(key);
  if (!v->is_string()) return WrongType(key, *v, "a string");
  return v->get<std::string>();
}

std::string_view TypeName(const nlohmann::json& v) {
  switch (v.type()) {
    case nlohmann::json::value_t::null:
      return "null";
    case nlohmann::json::value_t::boolean:
      return "a boolean";
    case nlohmann::json::value_t::number_integer:
    case nlohmann::json::value_t::number_unsigned:
    case nlohmann::json::value_t::number_float:
      return "a number";
    case nlohmann::json::value_t::string:
      return "a string";
    case nlohmann::json::value_t::array:
      return "an array";
    case nlohmann::json::value_t::object:
      return "an object";
    case nlohmann::json::value_t::binary:
      return "binary";
    case nlohmann::json::value_t::discarded:
      return "discarded";
  }
  return "?";
}

std::string Show(const nlohmann::json& v) {
  std::string text = v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (text.size() > kShowChars) text = absl::StrCat(text.substr(0, kShowChars), "...");
  return text;
}

}  // namespace cpfill::json
