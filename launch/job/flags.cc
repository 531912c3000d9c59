#include "launch/job/flags.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/status.h"

namespace cpfill::launch {
namespace {

absl::Status BadValue(const std::string& name, const std::string& value, const char* what) {
  return absl::InvalidArgumentError(absl::StrCat("--", name, ": '", value, "' is not ", what));
}

// A bound as a user writes it: integers in full (2147483647, not 2.14748e+09).
std::string BoundText(double x) {
  if (x == std::trunc(x) && std::fabs(x) < 1e15) return absl::StrCat(static_cast<int64_t>(x));
  return absl::StrCat(x);
}

absl::Status CheckRange(const std::string& name, const std::string& v, double x,
                        const Range& range) {
  if (range.Contains(x)) return absl::OkStatus();
  const char* what = x < 0 && range.min >= 0 ? "is negative" : "is out of range";
  return absl::InvalidArgumentError(
      absl::StrCat("--", name, ": ", v, " ", what, "; allowed ", range.ToString()));
}

absl::Status ParseInt64(const std::string& name, const std::string& v, const Range& range,
                        int64_t* out) {
  int64_t x = 0;
  // Plain decimal digits only: SimpleAtoi would also take surrounding blanks.
  const bool plain = !v.empty() && v.find_first_not_of("+-0123456789") == std::string::npos;
  if (!plain || !absl::SimpleAtoi(v, &x)) {
    const bool digits = !v.empty() && v.find_first_not_of("+-0123456789") == std::string::npos;
    return BadValue(name, v, digits ? "a 64-bit integer" : "an integer");
  }
  CPFILL_RETURN_IF_ERROR(CheckRange(name, v, static_cast<double>(x), range));
  *out = x;
  return absl::OkStatus();
}

absl::Status ParseDouble(const std::string& name, const std::string& v, const Range& range,
                         double* out) {
  double x = 0;
  // Decimal notation only: strtod would also take hexadecimal ("0x10") and blanks.
  const bool plain = !v.empty() && v.find_first_not_of("+-.0123456789eE") == std::string::npos;
  if (!absl::SimpleAtod(v, &x)) return BadValue(name, v, "a number");
  if (!std::isfinite(x)) return BadValue(name, v, "a finite number");
  if (!plain) return BadValue(name, v, "a decimal number");
  CPFILL_RETURN_IF_ERROR(CheckRange(name, v, x, range));
  *out = x;
  return absl::OkStatus();
}

// A comma-separated list flag: each element parsed and range-checked by `one`.
template <typename T>
std::function<absl::Status(const std::string&, const Range&)> ParseList(
    std::string name, std::vector<T>* target,
    absl::Status (*one)(const std::string&, const std::string&, const Range&, T*)) {
  return [name = std::move(name), target, one](const std::string& v, const Range& range) {
    target->clear();
    for (absl::string_view piece : absl::StrSplit(v, ',')) {
      T x{};
      CPFILL_RETURN_IF_ERROR(one(name, std::string(piece), range, &x));
      target->push_back(x);
    }
    return absl::OkStatus();
  };
}

}  // namespace

bool Range::Contains(double x) const {
  const bool above = min_open ? x > min : x >= min;
  const bool below = max_open ? x < max : x <= max;
  return above && below;
}

std::string Range::ToString() const {
  const bool has_min = std::isfinite(min), has_max = std::isfinite(max);
  if (has_min && has_max) {
    return absl::StrCat(min_open ? "(" : "[", BoundText(min), ", ", BoundText(max),
                        max_open ? ")" : "]");
  }
  if (has_min) return absl::StrCat(min_open ? "> " : ">= ", BoundText(min));
  if (has_max) return absl::StrCat(max_open ? "< " : "<= ", BoundText(max));
  return "any finite number";
}

absl::Status CheckWritable(const std::string& flag, const std::string& path) {
  std::error_code ec;
  const bool existed = std::filesystem::exists(path, ec);
  if (existed && std::filesystem::is_directory(path, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": '", path, "' is a directory, not a file"));
  }
  std::FILE* f = std::fopen(path.c_str(), "a");
  if (f == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": cannot write '", path, "': ", std::strerror(errno)));
  }
  std::fclose(f);
  if (!existed) std::filesystem::remove(path, ec);
  return absl::OkStatus();
}

FlagSet::FlagSet(std::string command, std::string summary)
    : command_(std::move(command)), summary_(std::move(summary)) {}

FlagSet& FlagSet::Add(Flag flag) {
  flags_.push_back(std::move(flag));
  return *this;
}

FlagSet& FlagSet::Within(Range range) {
  Flag& last = flags_.back();
  // Int flags bound to an int keep their 32-bit limit whatever range is asked for.
  last.range.min = std::max(last.range.min, range.min);
  last.range.max = std::min(last.range.max, range.max);
  last.range.min_open = range.min_open && last.range.min == range.min;
  last.range.max_open = range.max_open && last.range.max == range.max;
  return *this;
}

FlagSet& FlagSet::Output() {
  Flag& last = flags_.back();
  last.output = last.text != nullptr;  // only a String flag names a path
  return *this;
}

FlagSet& FlagSet::Requires(const std::string& other) {
  flags_.back().requires_flag = other;
  return *this;
}

absl::Status FlagSet::CheckRequirements() const {
  for (const Flag& f : flags_) {
    if (!f.set || f.requires_flag.empty()) continue;
    const auto on = std::find_if(flags_.begin(), flags_.end(),
                                 [&](const Flag& o) { return o.name == f.requires_flag; });
    if (on == flags_.end() || on->on == nullptr) {
      return absl::InternalError(absl::StrCat("--", f.name, " requires --", f.requires_flag,
                                              ", which is not a flag of 'cpfill ", command_,
                                              "' that can be on"));
    }
    if (!on->set || !*on->on) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--", f.name, " is a setting of --", f.requires_flag, ", which is off: give --",
          f.requires_flag, " too, or leave --", f.name, " out"));
    }
  }
  return absl::OkStatus();
}

std::vector<std::pair<std::string, std::string>> FlagSet::OutputPaths() const {
  std::vector<std::pair<std::string, std::string>> paths;
  for (const Flag& f : flags_) {
    if (f.output) paths.emplace_back(f.name, *f.text);
  }
  return paths;
}

FlagSet::Flag* FlagSet::Find(const std::string& name) {
  for (Flag& f : flags_) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

bool FlagSet::IsSet(const std::string& name) const {
  for (const Flag& f : flags_) {
    if (f.name == name) return f.set;
  }
  return false;
}

FlagSet& FlagSet::String(const std::string& name, std::string* target, const std::string& help,
                         bool required) {
  return Add({.name = name,
              .help = help,
              .default_text = *target,
              .required = required,
              .text = target,
              .parse = [target](const std::string& v, const Range&) {
                *target = v;
                return absl::OkStatus();
              }});
}

FlagSet& FlagSet::Int(const std::string& name, int64_t* target, const std::string& help,
                      bool required) {
  return Add({.name = name,
              .help = help,
              .default_text = absl::StrCat(*target),
              .required = required,
              .kind = "integer",
              .parse = [name, target](const std::string& v, const Range& range) {
                return ParseInt64(name, v, range, target);
              }});
}

FlagSet& FlagSet::Int(const std::string& name, int* target, const std::string& help,
                      bool required) {
  return Add({.name = name,
              .help = help,
              .default_text = absl::StrCat(*target),
              .required = required,
              .kind = "integer",
              .range = Range(INT32_MIN, INT32_MAX),
              .parse = [name, target](const std::string& v, const Range& range) {
                int64_t x = 0;
                CPFILL_RETURN_IF_ERROR(ParseInt64(name, v, range, &x));
                *target = static_cast<int>(x);
                return absl::OkStatus();
              }});
}

FlagSet& FlagSet::Double(const std::string& name, double* target, const std::string& help,
                         bool required) {
  return Add({.name = name,
              .help = help,
              .default_text = absl::StrCat(*target),
              .required = required,
              .kind = "number",
              .parse = [name, target](const std::string& v, const Range& range) {
                return ParseDouble(name, v, range, target);
              }});
}

FlagSet& FlagSet::Bool(const std::string& name, bool* target, const std::string& help) {
  return Add({.name = name,
              .help = help,
              .default_text = *target ? "true" : "false",
              .is_bool = true,
              .on = target,
              .parse = [name, target](const std::string& v, const Range&) {
                if (v == "true" || v == "1") {
                  *target = true;
                } else if (v == "false" || v == "0") {
                  *target = false;
                } else {
                  return BadValue(name, v, "true or false");
                }
                return absl::OkStatus();
              }});
}

FlagSet& FlagSet::IntList(const std::string& name, std::vector<int64_t>* target,
                          const std::string& help, bool required) {
  return Add({.name = name,
              .help = help,
              .default_text = absl::StrJoin(*target, ","),
              .required = required,
              .kind = "integers",
              .parse = ParseList<int64_t>(name, target, ParseInt64)});
}

FlagSet& FlagSet::DoubleList(const std::string& name, std::vector<double>* target,
                             const std::string& help, bool required) {
  return Add({.name = name,
              .help = help,
              .default_text = absl::StrJoin(*target, ","),
              .required = required,
              .kind = "numbers",
              .parse = ParseList<double>(name, target, ParseDouble)});
}

absl::Status FlagSet::Parse(int argc, char** argv, int first) {
  const std::string see = absl::StrCat(" (see 'cpfill ", command_, " --help')");
  for (int i = first; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      help_ = true;
      continue;
    }
    if (arg.rfind("--", 0) != 0 || arg.size() == 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected argument '", arg, "' for 'cpfill ", command_, "'", see));
    }
    std::string name = arg.substr(2), value;
    bool has_value = false;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    Flag* flag = Find(name);
    if (flag == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag --", name, " for 'cpfill ", command_, "'", see));
    }
    // The last of two values would win silently; which one the user meant is not ours to guess.
    if (flag->set) return absl::InvalidArgumentError(absl::StrCat("--", name, " given twice", see));
    if (!has_value) {
      if (flag->is_bool) {
        value = "true";
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value", see));
      }
    }
    // An empty text value would read as "not given" and quietly pick the default.
    if (value.empty() && flag->kind == nullptr && !flag->is_bool) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, ": empty value (leave the flag out for its default)", see));
    }
    absl::Status s = flag->parse(value, flag->range);
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat(s.message(), see));
    flag->set = true;
  }
  if (help_) return absl::OkStatus();
  for (const Flag& f : flags_) {
    if (f.required && !f.set) {
      return absl::InvalidArgumentError(absl::StrCat("--", f.name, " is required", see));
    }
  }
  if (absl::Status s = CheckRequirements(); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(s.message(), see));
  }
  return absl::OkStatus();
}

std::string FlagSet::Usage() const {
  std::string out = absl::StrCat("usage: cpfill ", command_, " [flags]\n  ", summary_, "\n\n");
  size_t width = 0;
  for (const Flag& f : flags_) width = std::max(width, f.name.size());
  for (const Flag& f : flags_) {
    absl::StrAppend(&out, "  --", f.name, std::string(width - f.name.size() + 2, ' '), f.help);
    if (!f.requires_flag.empty()) absl::StrAppend(&out, " (with --", f.requires_flag, ")");
    if (f.required) {
      absl::StrAppend(&out, " (required)");
    } else if (!f.default_text.empty()) {
      absl::StrAppend(&out, " [", f.default_text, "]");
    }
    if (f.kind != nullptr) absl::StrAppend(&out, " {", f.kind, ", ", f.range.ToString(), "}");
    absl::StrAppend(&out, "\n");
  }
  return out;
}

}  // namespace cpfill::launch
