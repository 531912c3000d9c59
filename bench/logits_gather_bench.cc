// The host side of a decode step's logits on CP > 1 (LlamaModel::Decode; the n samples of a prompt
// decode together, runtime/serving/prefix_cache.md): every rank's last-position logits go to world
// rank 0 (runtime::GatherLastLogits), which places them per sequence and takes each argmax. On a
// GPU the logits are downloaded first; this times what follows, on host memory. At n = 64 samples
// on CP2 with Llama 3's vocabulary each rank holds 32 rows: 16 MB a step.
//
//   mpirun -np 2 build/bench/logits_gather_bench [ROWS_PER_RANK...]   (default 16 32 128)
//
// Prints, per row count, the median and the spread of 30 gathers (after 3 warm-ups) on rank 0,
// and the same for the transfer alone (one all-to-all of every other rank's logits to rank 0).

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>

#include "parallel/mpi_communicator.h"
#include "runtime/model/model_config.h"
#include "runtime/model/prefill_batch.h"

namespace cpfill {
namespace {

constexpr int kVocab = 128256;  // Llama 3
constexpr int kWarmups = 3, kRuns = 30;

// One gather of `rows` sequences per rank; returns rank 0's wall time in ms.
double TimeOneGather(parallel::Communicator& world, const runtime::ModelConfig& config, int rows,
                     const std::vector<float>& logits) {
  const int n = world.size(), me = world.rank();
  std::vector<std::pair<int, int64_t>> last;
  for (int i = 0; i < rows; ++i) last.push_back({i * n + me, i});  // round-robin, as decode
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<bool> wanted(rows * n, true);
  auto out = runtime::GatherLastLogits(config, rows * n, last, logits, wanted, /*tp_rank=*/0,
                                       /*tp_size=*/1, world);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (!out.ok()) {
    std::fprintf(stderr, "logits_gather_bench: %s\n", out.status().ToString().c_str());
    std::exit(1);
  }
  return ms;
}

// The transfer alone: every other rank's `bytes` to rank 0 in one all-to-all.
double TimeOneTransfer(parallel::Communicator& world, const std::vector<float>& send,
                       std::vector<float>& recv) {
  const int n = world.size();
  const size_t bytes = send.size() * sizeof(float);
  std::vector<size_t> sb(n, 0), so(n, 0), rb(n, 0), ro(n, 0);
  if (world.rank() != 0) sb[0] = bytes;
  for (int p = 1; world.rank() == 0 && p < n; ++p) rb[p] = bytes, ro[p] = (p - 1) * bytes;
  const auto t0 = std::chrono::steady_clock::now();
  const absl::Status s = world.AllToAll(send.data(), sb, so, recv.data(), rb, ro);
  if (!s.ok()) {
    std::fprintf(stderr, "logits_gather_bench: %s\n", s.ToString().c_str());
    std::exit(1);
  }
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// Median, min and max of `f`'s times over kRuns calls after kWarmups.
template <typename F>
std::vector<double> Times(F f) {
  std::vector<double> ms;
  for (int r = 0; r < kWarmups + kRuns; ++r) {
    const double t = f();
    if (r >= kWarmups) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms.front(), ms.back()};
}

int Run(int argc, char** argv) {
  auto mpi = parallel::MpiRuntime::Create(&argc, &argv, parallel::CommOptions{});
  if (!mpi.ok()) {
    std::fprintf(stderr, "logits_gather_bench: %s\n", mpi.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<parallel::Communicator> world = (*mpi)->World();
  runtime::ModelConfig config;
  config.vocab_size = kVocab;
  std::vector<int> row_counts;
  for (int i = 1; i < argc; ++i) row_counts.push_back(std::atoi(argv[i]));
  if (row_counts.empty()) row_counts = {16, 32, 128};
  for (int rows : row_counts) {
    std::vector<float> logits(static_cast<size_t>(rows) * kVocab);
    for (size_t i = 0; i < logits.size(); ++i) logits[i] = static_cast<float>(i % 9973) * 1e-3f;
    std::vector<float> recv(logits.size() * (world->size() - 1));
    const std::vector<double> gather =
        Times([&] { return TimeOneGather(*world, config, rows, logits); });
    const std::vector<double> transfer =
        Times([&] { return TimeOneTransfer(*world, logits, recv); });
    if (world->rank() == 0) {
      std::printf(
          "%d ranks x %d rows (%.1f MB a rank): gather median %.2f ms (min %.2f, max %.2f); "
          "the transfer alone %.2f ms (min %.2f, max %.2f)\n",
          world->size(), rows, rows * kVocab * 4.0 / 1e6, gather[0], gather[1], gather[2],
          transfer[0], transfer[1], transfer[2]);
    }
  }
  return 0;
}

}  // namespace
}  // namespace cpfill

int main(int argc, char** argv) { return cpfill::Run(argc, argv); }
