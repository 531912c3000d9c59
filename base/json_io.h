// cpfill/base/json_io.h — nlohmann::json at cpfill's boundaries: untrusted text in, reports out,
// with absl::Status instead of exceptions.
//
// Two value types, chosen by direction:
//   nlohmann::json          what Parse returns: keys sorted, lookup O(log n) (safetensors
//                           headers and index files hold thousands of keys);
//   nlohmann::ordered_json  what cpfill writes: keys in insertion order, so a report reads in
//                           the order it was built.
// Nothing here throws: nlohmann's exceptions are caught and become InvalidArgument.
//
//   CPFILL_ASSIGN_OR_RETURN(nlohmann::json v, json::ReadFile(path));   // errors name the path
//   CPFILL_ASSIGN_OR_RETURN(int64_t n, json::GetInt(v, "new_tokens"));
//   nlohmann::ordered_json report = {{"command", "attention"}, {"ms", 1.5}};
//   CPFILL_RETURN_IF_ERROR(json::WriteFile(out_path, report));
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace cpfill::json {

// Parses RFC 8259 text (nlohmann's parser: UTF-8 validated, numbers that overflow a double
// refused) and, stricter than nlohmann, refuses duplicate object keys (nlohmann would keep the
// last: which value wins would be an accident) and nesting deeper than 256. InvalidArgument
// "json: line L, column C: ..." on failure. `top_level_keys`, when given, receives the keys of
// a top-level object in file order (the parsed object itself is sorted).
absl::StatusOr<nlohmann::json> Parse(std::string_view text,
                                     std::vector<std::string>* top_level_keys = nullptr);

// Reads and parses a file. A missing file is NotFound; any other open or read failure (a
// directory, permissions, I/O) and any parse failure is InvalidArgument: the file is the user's
// input. Messages name the path and the reason.
absl::StatusOr<nlohmann::json> ReadFile(const std::string& path);

// The text of `v`; indent < 0: compact, one line. JSON has no NaN or infinity, and nlohmann
// would write them as null, hiding the fault: they are written as the strings "NaN",
// "Infinity" and "-Infinity" instead (a reader expecting a number then fails loudly). A string
// that is not valid UTF-8 is InvalidArgument naming where it sits.
absl::StatusOr<std::string> Dump(const nlohmann::ordered_json& v, int indent = -1);

// Dump(v, 2) plus a newline, written beside `path` and renamed over it, so a reader never sees
// half a file. Errors name the path.
absl::Status WriteFile(const std::string& path, const nlohmann::ordered_json& v);

// The value of an integer that fits int64 (a JSON integer, not 8.0); nullopt otherwise.
std::optional<int64_t> AsInt64(const nlohmann::json& v);

// Typed reads of obj[key]; InvalidArgument `json: missing key "k"` when absent (or obj is not
// an object), `json: key "k" is a string, expected a number` for another type. GetInt refuses
// non-integers and integers outside int64, naming the value.
absl::StatusOr<double> GetNumber(const nlohmann::json& obj, std::string_view key);
absl::StatusOr<int64_t> GetInt(const nlohmann::json& obj, std::string_view key);
absl::StatusOr<std::string> GetString(const nlohmann::json& obj, std::string_view key);

// obj[key] or nullptr when absent or obj is not an object (nlohmann's const operator[] on a
// missing key is undefined behaviour, its at() throws).
const nlohmann::json* Find(const nlohmann::json& obj, std::string_view key);

// For messages: "a string", "an object", ...; and `v` as compact JSON, cut to about 200
// characters, never throwing (invalid UTF-8 replaced).
std::string_view TypeName(const nlohmann::json& v);
std::string Show(const nlohmann::json& v);

}  // namespace cpfill::json
