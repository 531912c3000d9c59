// cpfill/launch/commands/commands.h — the subcommands of the `cpfill` program.
//
// Each takes the full argv (argv[1] is the subcommand name) and returns the process exit code:
// the exit codes of launch/job/job.h. Distributed subcommands start MPI
// themselves; `select`, `plan`, `export`, `tokenize` and `env` need no MPI and run anywhere.
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
int RunPlanCommand(int argc, char** argv);

}  // namespace cpfill::launch
