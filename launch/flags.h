// cpfill/launch/flags.h — strict command-line flags for cpfill's subcommands.
//
// Each subcommand declares its flags with a target variable and a help line; Parse() accepts
// `--name value` and `--name=value` (booleans: `--name`, `--name=true|false`), and rejects
// unknown flags, missing values, malformed numbers and stray arguments with one message that
// names the flag and says where to look.
//
//   FlagSet flags("attention", "one fused batch of context-parallel attention");
//   flags.Int("heads", &heads, "query heads of the model (all TP ranks together)");
//   flags.IntList("seq-lens", &lens, "new tokens per sequence, comma separated",
//   /*required=*/true); CPFILL_RETURN_IF_ERROR(flags.Parse(argc, argv, /*first=*/2)); if
//   (flags.help()) { std::cout << flags.Usage(); return 0; }
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace cpfill::launch {

class FlagSet {
 public:
  FlagSet(std::string command, std::string summary);

  void String(const std::string& name, std::string* target, const std::string& help,
              bool required = false);
  void Int(const std::string& name, int64_t* target, const std::string& help,
           bool required = false);
  void Int(const std::string& name, int* target, const std::string& help, bool required = false);
  void Double(const std::string& name, double* target, const std::string& help,
              bool required = false);
  void Bool(const std::string& name, bool* target, const std::string& help);
  void IntList(const std::string& name, std::vector<int64_t>* target, const std::string& help,
               bool required = false);
  void DoubleList(const std::string& name, std::vector<double>* target, const std::string& help,
                  bool required = false);

  // Parses argv[first..argc). InvalidArgument naming the flag on any problem.
  absl::Status Parse(int argc, char** argv, int first);
  bool help() const { return help_; }
  bool IsSet(const std::string& name) const;
  std::string Usage() const;

 private:
  struct Flag {
    std::string name;
    std::string help;
    std::string default_text;
    bool is_bool = false;
    bool required = false;
    bool set = false;
    std::function<absl::Status(const std::string&)> parse;
  };
  void Add(Flag flag);
  Flag* Find(const std::string& name);

  std::string command_;
  std::string summary_;
  std::vector<Flag> flags_;
  bool help_ = false;
};

}  // namespace cpfill::launch
