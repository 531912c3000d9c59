// libFuzzer target: any bytes as a config.json. Parsing and ParseHfConfig must refuse what is
// malformed or unimplemented with a status, and a config they accept must give a geometry whose
// derived numbers (parameter count, TP checks) do not overflow or divide by zero.
//
//   tests/fuzz/run_libfuzzer.sh (CI) builds it with clang -fsanitize=fuzzer,address,undefined.
#include <cstddef>
#include <cstdint>
#include <string>

#include "base/json_io.h"
#include "runtime/model/model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto json = cpfill::json::Parse(std::string(reinterpret_cast<const char*>(data), size));
  if (!json.ok()) return 0;
  auto config = cpfill::runtime::ParseHfConfig(*json, "fuzz");
  if (!config.ok()) return 0;
  for (int tp : {1, 2, 8}) {
    if (config->ValidateForTp(tp).ok() && config->ParameterCount() <= 0) __builtin_trap();
  }
  return 0;
}
