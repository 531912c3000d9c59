// cpfill/launch/job/flags.h — strict command-line flags for cpfill's subcommands.
//
// Each subcommand declares its flags with a target variable and a help line; Parse() accepts
// `--name value` and `--name=value` (booleans: `--name`, `--name=true|false`), and rejects
// unknown flags, a flag given twice, missing values, malformed numbers, NaN and infinities,
// values outside a flag's range and stray arguments with one message that names the flag, the
// value and the allowed range. Numeric flags take their range by chaining Within(); the help
// text shows kind and range ("{integer, [1, 65536]}", "{numbers, (0, 1]}" for a list), so every
// numeric flag documents what it accepts (tests/fuzz/cli_fuzz.py reads it from there).
//
//   FlagSet flags("attention", "one fused batch of context-parallel attention");
//   flags.Int("heads", &heads, "query heads of the model").Within({1, 65536});
//   flags.IntList("seq-lens", &lens, "new tokens per sequence", /*required=*/true)
//       .Within({0, kMaxTokens});
//   flags.Double("timeout-s", &t, "deadline, seconds").Within(Range::LeftOpen(0, 1e6));
//   flags.String("json", &json_file, "write the report as JSON to this file").Output();
//   flags.Bool("kv-handoff", &handoff, "serve KV hand-offs");
//   flags.Double("kv-lease-s", &lease_s, "lease length").Requires("kv-handoff");
//   CPFILL_RETURN_IF_ERROR(flags.Parse(argc, argv, /*first=*/2));
//   if (flags.help()) { std::cout << flags.Usage(); return 0; }
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace cpfill::launch {

// The most tokens one length flag accepts: token positions and counts are int32 downstream.
inline constexpr int64_t kMaxTokens = 2147483647;

// The values a numeric flag accepts (every element, for lists). Bounds are doubles: every bound
// cpfill uses is exact in a double (integers below 2^53).
struct Range {
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
  bool min_open = false;  // min itself is refused
  bool max_open = false;

  Range() = default;
  Range(double lo, double hi) : min(lo), max(hi) {}  // [lo, hi]
  static Range AtLeast(double lo) { return Range(lo, std::numeric_limits<double>::infinity()); }
  static Range Above(double lo) {  // (lo, inf)
    Range r = AtLeast(lo);
    r.min_open = true;
    return r;
  }
  static Range LeftOpen(double lo, double hi) {  // (lo, hi]
    Range r(lo, hi);
    r.min_open = true;
    return r;
  }
  bool Contains(double x) const;
  std::string ToString() const;  // "[0, 4096]", "(0, 1000000]", ">= 0", "> 0"
};

// Whether `path` (given by --`flag`) can be written, tried before any work: opened for
// appending (an existing file is left as it was) or created and removed again. InvalidArgument
// naming the flag and the path otherwise: a bad output path is an input error, not a failure
// found after minutes of work.
absl::Status CheckWritable(const std::string& flag, const std::string& path);

class FlagSet {
 public:
  FlagSet(std::string command, std::string summary);

  FlagSet& String(const std::string& name, std::string* target, const std::string& help,
                  bool required = false);
  FlagSet& Int(const std::string& name, int64_t* target, const std::string& help,
               bool required = false);
  FlagSet& Int(const std::string& name, int* target, const std::string& help,
               bool required = false);
  FlagSet& Double(const std::string& name, double* target, const std::string& help,
                  bool required = false);
  FlagSet& Bool(const std::string& name, bool* target, const std::string& help);
  FlagSet& IntList(const std::string& name, std::vector<int64_t>* target, const std::string& help,
                   bool required = false);
  FlagSet& DoubleList(const std::string& name, std::vector<double>* target, const std::string& help,
                      bool required = false);

  // Narrows the values the flag declared last accepts (numeric flags). The default value is
  // not checked: a default outside the range means "not given" (e.g. 0 = automatic).
  FlagSet& Within(Range range);
  // Marks the flag declared last (a String) as a file the command writes: OutputPaths() lists it,
  // so that a job can try every output path before any work (Job::CheckOutputs).
  FlagSet& Output();
  // Marks the flag declared last as a setting of the Bool flag `other` (declared before or after
  // it): Parse refuses it, naming both, unless --`other` is given and true, since it would
  // otherwise be ignored without a word. The help line says "(with --other)".
  FlagSet& Requires(const std::string& other);

  // Parses argv[first..argc). InvalidArgument naming the flag on any problem (also a flag given
  // without the flag it Requires()).
  absl::Status Parse(int argc, char** argv, int first);
  bool help() const { return help_; }
  bool IsSet(const std::string& name) const;
  std::string Usage() const;
  // {flag name, path} of every Output() flag, in declaration order (a path not given is empty).
  std::vector<std::pair<std::string, std::string>> OutputPaths() const;

 private:
  struct Flag {
    std::string name;
    std::string help;
    std::string default_text;
    bool is_bool = false;
    bool required = false;
    bool set = false;
    const char* kind = nullptr;         // numeric flags: "integer", "number", "integers", "numbers"
    const std::string* text = nullptr;  // String flags: the target
    bool output = false;                // a path the command writes (Output())
    const bool* on = nullptr;           // Bool flags: the target
    std::string requires_flag;          // Requires(): the Bool flag that must be on
    Range range;
    std::function<absl::Status(const std::string&, const Range&)> parse;
  };
  FlagSet& Add(Flag flag);
  Flag* Find(const std::string& name);
  // InvalidArgument naming the first flag given without the flag it Requires() on.
  absl::Status CheckRequirements() const;

  std::string command_;
  std::string summary_;
  std::vector<Flag> flags_;
  bool help_ = false;
};

}  // namespace cpfill::launch
