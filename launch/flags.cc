#include "launch/flags.h"

#include <algorithm>
#include <cmath>

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

absl::Status ParseInt64(const std::string& name, const std::string& v, int64_t* out) {
  if (!absl::SimpleAtoi(v, out)) return BadValue(name, v, "an integer");
  return absl::OkStatus();
}

absl::Status ParseDouble(const std::string& name, const std::string& v, double* out) {
  if (!absl::SimpleAtod(v, out) || !std::isfinite(*out)) return BadValue(name, v, "a number");
  return absl::OkStatus();
}

}  // namespace

FlagSet::FlagSet(std::string command, std::string summary)
    : command_(std::move(command)), summary_(std::move(summary)) {}

void FlagSet::Add(Flag flag) { flags_.push_back(std::move(flag)); }

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

void FlagSet::String(const std::string& name, std::string* target, const std::string& help,
                     bool required) {
  Add({.name = name,
       .help = help,
       .default_text = *target,
       .required = required,
       .parse = [target](const std::string& v) {
         *target = v;
         return absl::OkStatus();
       }});
}

void FlagSet::Int(const std::string& name, int64_t* target, const std::string& help,
                  bool required) {
  Add({.name = name,
       .help = help,
       .default_text = absl::StrCat(*target),
       .required = required,
       .parse = [name, target](const std::string& v) { return ParseInt64(name, v, target); }});
}

void FlagSet::Int(const std::string& name, int* target, const std::string& help, bool required) {
  Add({.name = name,
       .help = help,
       .default_text = absl::StrCat(*target),
       .required = required,
       .parse = [name, target](const std::string& v) {
         int64_t x;
         CPFILL_RETURN_IF_ERROR(ParseInt64(name, v, &x));
         if (x < INT32_MIN || x > INT32_MAX) return BadValue(name, v, "a 32-bit integer");
         *target = static_cast<int>(x);
         return absl::OkStatus();
       }});
}

void FlagSet::Double(const std::string& name, double* target, const std::string& help,
                     bool required) {
  Add({.name = name,
       .help = help,
       .default_text = absl::StrCat(*target),
       .required = required,
       .parse = [name, target](const std::string& v) { return ParseDouble(name, v, target); }});
}

void FlagSet::Bool(const std::string& name, bool* target, const std::string& help) {
  Add({.name = name,
       .help = help,
       .default_text = *target ? "true" : "false",
       .is_bool = true,
       .parse = [name, target](const std::string& v) {
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

void FlagSet::IntList(const std::string& name, std::vector<int64_t>* target,
                      const std::string& help, bool required) {
  Add({.name = name,
       .help = help,
       .default_text = absl::StrJoin(*target, ","),
       .required = required,
       .parse = [name, target](const std::string& v) {
         target->clear();
         for (absl::string_view piece : absl::StrSplit(v, ',')) {
           int64_t x;
           CPFILL_RETURN_IF_ERROR(ParseInt64(name, std::string(piece), &x));
           target->push_back(x);
         }
         return absl::OkStatus();
       }});
}

void FlagSet::DoubleList(const std::string& name, std::vector<double>* target,
                         const std::string& help, bool required) {
  Add({.name = name,
       .help = help,
       .default_text = absl::StrJoin(*target, ","),
       .required = required,
       .parse = [name, target](const std::string& v) {
         target->clear();
         for (absl::string_view piece : absl::StrSplit(v, ',')) {
           double x;
           CPFILL_RETURN_IF_ERROR(ParseDouble(name, std::string(piece), &x));
           target->push_back(x);
         }
         return absl::OkStatus();
       }});
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
    if (!has_value) {
      if (flag->is_bool) {
        value = "true";
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value", see));
      }
    }
    absl::Status s = flag->parse(value);
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat(s.message(), see));
    flag->set = true;
  }
  if (help_) return absl::OkStatus();
  for (const Flag& f : flags_) {
    if (f.required && !f.set) {
      return absl::InvalidArgumentError(absl::StrCat("--", f.name, " is required", see));
    }
  }
  return absl::OkStatus();
}

std::string FlagSet::Usage() const {
  std::string out = absl::StrCat("usage: cpfill ", command_, " [flags]\n  ", summary_, "\n\n");
  size_t width = 0;
  for (const Flag& f : flags_) width = std::max(width, f.name.size());
  for (const Flag& f : flags_) {
    absl::StrAppend(&out, "  --", f.name, std::string(width - f.name.size() + 2, ' '), f.help);
    if (f.required) {
      absl::StrAppend(&out, " (required)");
    } else if (!f.default_text.empty()) {
      absl::StrAppend(&out, " [", f.default_text, "]");
    }
    absl::StrAppend(&out, "\n");
  }
  return out;
}

}  // namespace cpfill::launch
