// `cpfill env`: every environment variable cpfill reads (base/knobs.h), with its type, default,
// allowed values, the value in effect and why it exists; --json writes the same. No MPI.
// Exits 2 after the listing when a variable set in the environment is malformed, as every
// other command would refuse to start.
#include <cstdio>
#include <string>

#include "base/json_io.h"
#include "base/knobs.h"
#include "launch/commands/commands.h"
#include "launch/job/flags.h"
#include "launch/job/job.h"

namespace cpfill::launch {
namespace {

std::string TypeName(knobs::KnobType type) {
  switch (type) {
    case knobs::KnobType::kBool:
      return "bool";
    case knobs::KnobType::kInt:
      return "int";
    case knobs::KnobType::kChoice:
      return "choice";
    case knobs::KnobType::kText:
      return "text";
  }
  return "?";
}

// The value in effect as text, by the knob's own type (knobs reads it once and caches it).
std::string InEffect(const knobs::KnobSpec& k) {
  const std::string_view name = k.name;
  switch (k.type) {
    case knobs::KnobType::kBool:
      return knobs::Bool(name) ? "1" : "0";
    case knobs::KnobType::kInt:
      return std::to_string(knobs::Int(name));
    case knobs::KnobType::kChoice:
      return knobs::Choice(name);
    case knobs::KnobType::kText:
      return knobs::Text(name);
  }
  return "?";
}

std::string Where(const knobs::KnobSpec& k) {
  if (!knobs::IsSet(k.name)) return "default";
  return k.external ? "set for another program" : "set in the environment";
}

nlohmann::ordered_json EnvJson() {
  nlohmann::ordered_json variables = nlohmann::ordered_json::array();
  for (const knobs::KnobSpec& k : knobs::All()) {
    variables.push_back({{"name", k.name},
                         {"type", TypeName(k.type)},
                         {"default", k.default_value},
                         {"allowed", k.allowed},
                         {"value", InEffect(k)},
                         {"set", knobs::IsSet(k.name)},
                         {"external", k.external},
                         {"why", k.why}});
  }
  return {{"command", "env"}, {"variables", std::move(variables)}, {"knobs", KnobsJson()}};
}

}  // namespace

int RunEnvCommand(int argc, char** argv) {
  std::string json_file;
  FlagSet flags("env",
                "list every environment variable cpfill reads: type, default, allowed values, "
                "the value in effect and why (no MPI)");
  flags.String("json", &json_file, "also write the list as JSON to this file");
  if (absl::Status s = flags.Parse(argc, argv, 2); !s.ok()) {
    return RefuseInput(s);
  }
  if (flags.help()) {
    std::fputs(flags.Usage().c_str(), stdout);
    return kExitOk;
  }
  if (!json_file.empty()) {
    if (absl::Status s = CheckWritable("json", json_file); !s.ok()) {
      return RefuseInput(s);
    }
  }
  for (const knobs::KnobSpec& k : knobs::All()) {
    std::printf("%s=%s  (%s; %s, default %s, allowed %s)\n    %s\n", std::string(k.name).c_str(),
                InEffect(k).c_str(), Where(k).c_str(), TypeName(k.type).c_str(),
                std::string(k.default_value).c_str(), std::string(k.allowed).c_str(),
                std::string(k.why).c_str());
  }
  if (!json_file.empty()) {
    if (absl::Status s = json::WriteFile(json_file, EnvJson()); !s.ok()) {
      std::fprintf(stderr, "cpfill: error: --json: %s\n", std::string(s.message()).c_str());
      return kExitRuntimeError;
    }
  }
  // A malformed value reads as its default above; say so and refuse, as the other commands do.
  if (absl::Status s = knobs::Validate(); !s.ok()) {
    return RefuseInput(s);
  }
  return kExitOk;
}

}  // namespace cpfill::launch
