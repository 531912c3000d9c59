// cpfill — context-parallel prefill of long-context LLM requests.
//
//   mpirun -np 4 cpfill attention --seq-lens 32768,8192,1024 --heads 16 --kv-heads 1 --check
//   cpfill select --heads 128 --kv-heads 8 --cp 4 --tflops 800 --gbps 3 --new-tokens 6400
//       --cached-tokens 121600
//   mpirun -np 4 cpfill calibrate --out fit.json
//   mpirun -np 4 cpfill prefill --model tiny --tp 2 --prompt-lens 4096,1000 --check
//   cpfill tokenize --model ckpt --text "Hello world"
//   cpfill kv-pull --url http://127.0.0.1:8000 --prompt-tokens 512 --model tiny
//   cpfill env
#include <cstdio>
#include <cstring>
#include <string>

#include "launch/commands/commands.h"
#include "launch/job/job.h"

namespace {

constexpr char kUsage[] =
    "usage: cpfill <command> [flags]   ('cpfill <command> --help' for its flags)\n"
    "\n"
    "commands:\n"
    "  attention   run one fused batch of context-parallel attention (under mpirun); --check\n"
    "              compares with a single-rank computation\n"
    "  select      choose ring pass-KV or pass-Q for a request (Alg. 1, Alg. 5, fitted); JSON\n"
    "  calibrate   time pass-KV and pass-Q on a (T, P) grid (under mpirun), measure compute\n"
    "              rate and link bandwidth, fit the selector; writes the JSON --fit reads\n"
    "  prefill     prefill a Llama-3 family model, TP inside nodes and CP across (under\n"
    "              mpirun); first tokens and time to first token; --check against one rank\n"
    "  generate    prefill and generate tokens (decode as batched ring pass-Q, under mpirun);\n"
    "              tokens, TTFT and time per output token; --check against one rank\n"
    "  serve       a long-running prefill and generation service (under mpirun): rank 0\n"
    "              serves HTTP (OpenAI-compatible completions, streaming, sessions, /health,\n"
    "              /metrics, KV hand-off to decode workers over UCX with --kv-handoff)\n"
    "  kv-pull     a stand-in decode worker: pull a request's KV from `serve --kv-handoff`\n"
    "              over UCX, release it, check it against one rank; bytes, time, GB/s\n"
    "  plan        predict TTFT, its breakdown, memory per GPU and the best TP x CP of a\n"
    "              cluster from device and link profiles (no MPI, no GPU)\n"
    "  export      write a preset's synthetic weights as a Hugging Face checkpoint directory\n"
    "  tokenize    encode texts and decode token ids with a checkpoint's tokenizer.json; JSON\n"
    "  env         list the environment variables cpfill reads, their defaults and values\n";

}  // namespace

int main(int argc, char** argv) {
  using namespace cpfill::launch;
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0 ||
      std::strcmp(argv[1], "help") == 0) {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? kExitBadInput : kExitOk;
  }
  const std::string command = argv[1];
  if (command == "attention") return RunAttentionCommand(argc, argv);
  if (command == "select") return RunSelectCommand(argc, argv);
  if (command == "calibrate") return RunCalibrateCommand(argc, argv);
  if (command == "prefill") return RunPrefillCommand(argc, argv);
  if (command == "serve") return RunServeCommand(argc, argv);
  if (command == "generate") return RunGenerateCommand(argc, argv);
  if (command == "export") return RunExportCommand(argc, argv);
  if (command == "env") return RunEnvCommand(argc, argv);
  if (command == "tokenize") return RunTokenizeCommand(argc, argv);
  if (command == "kv-pull") return RunKvPullCommand(argc, argv);
  if (command == "plan") return RunPlanCommand(argc, argv);
  std::fprintf(stderr, "cpfill: unknown command '%s'\n\n%s", command.c_str(), kUsage);
  return kExitBadInput;
}
