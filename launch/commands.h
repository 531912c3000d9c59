// cpfill/launch/commands.h — the subcommands of the `cpfill` program.
//
// Each takes the full argv (argv[1] is the subcommand name) and returns the process exit code:
// 0 success, 1 a failed check, 2 bad input (flags, config). Distributed subcommands start MPI
// themselves; `select`, `export`, `tokenize` and `env` need no MPI and run anywhere.
#pragma once

namespace cpfill::launch {

int RunAttentionCommand(int argc, char** argv);
int RunSelectCommand(int argc, char** argv);
int RunCalibrateCommand(int argc, char** argv);
int RunPrefillCommand(int argc, char** argv);
int RunServeCommand(int argc, char** argv);
int RunGenerateCommand(int argc, char** argv);
int RunExportCommand(int argc, char** argv);
int RunEnvCommand(int argc, char** argv);
int RunTokenizeCommand(int argc, char** argv);
int RunKvPullCommand(int argc, char** argv);

inline constexpr int kExitOk = 0;
inline constexpr int kExitCheckFailed = 1;
inline constexpr int kExitBadInput = 2;
inline constexpr int kExitRuntimeError = 3;

}  // namespace cpfill::launch
