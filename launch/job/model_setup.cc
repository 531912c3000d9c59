#include "launch/job/model_setup.h"

#include <limits>
#include <optional>

#include "absl/strings/str_cat.h"
#include "base/json_io.h"
#include "base/random.h"
#include "base/status.h"
#include "runtime/model/cpu/cpu_backend.h"
#include "runtime/model/memory.h"
#if CPFILL_HAVE_CUDA
#include "parallel/cuda/nccl_communicator.h"
#include "runtime/kv/cuda/kv_storage_cuda.h"
#include "runtime/model/cuda/cuda_backend.h"
#endif

namespace cpfill::launch {

std::vector<runtime::PrefillRequest> SyntheticPrompts(const std::vector<int64_t>& lens, int vocab,
                                                      uint64_t seed) {
  std::vector<runtime::PrefillRequest> out;
  for (size_t s = 0; s < lens.size(); ++s) {
    runtime::PrefillRequest r;
    r.tokens.reserve(lens[s]);  // growing by doubling would briefly need 1.5x the memory
    for (int64_t i = 0; i < lens[s]; ++i) {
      r.tokens.push_back(static_cast<int32_t>(Mix64(Mix64(seed ^ 0x70ull) ^ (s << 40) ^ i) %
                                              static_cast<uint64_t>(vocab)));
    }
    out.push_back(std::move(r));
  }
  return out;
}

absl::StatusOr<std::vector<runtime::PrefillRequest>> ReadTokensFile(const std::string& path) {
  CPFILL_ASSIGN_OR_RETURN(nlohmann::json v, json::ReadFile(path));
  CPFILL_CHECK_ARG(v.is_array() && !v.empty(), path,
                   ": --tokens wants a JSON list of lists of token ids");
  std::vector<runtime::PrefillRequest> out;
  for (size_t s = 0; s < v.size(); ++s) {
    const nlohmann::json& seq = v[s];
    CPFILL_CHECK_ARG(seq.is_array(), path, ": sequence ", s, " is not a list");
    runtime::PrefillRequest r;
    for (const nlohmann::json& id : seq) {
      const std::optional<int64_t> token = json::AsInt64(id);
      CPFILL_CHECK_ARG(token.has_value() && *token >= std::numeric_limits<int32_t>::min() &&
                           *token <= std::numeric_limits<int32_t>::max(),
                       path, ": sequence ", s, " holds ", json::Show(id),
                       ", which is not an integer token id (int32)");
      r.tokens.push_back(static_cast<int32_t>(*token));
    }
    out.push_back(std::move(r));
  }
  return out;
}

absl::StatusOr<runtime::ModelWeights> MakeWeights(const runtime::ModelConfig& config,
                                                  const std::string& model, uint64_t seed,
                                                  int tp_rank, int tp_size) {
  if (runtime::IsPreset(model)) return runtime::SyntheticWeights(config, seed, tp_rank, tp_size);
  return runtime::LoadWeights(config, model, tp_rank, tp_size);
}

absl::Status WeightsFit(const runtime::ModelConfig& config, int tp_size) {
  CPFILL_ASSIGN_OR_RETURN(const int64_t free, runtime::HostBytesAvailable());
  return runtime::CheckFits(
      absl::StrCat("the weights of ", config.name, " (fp32, one TP slice of ", tp_size, ")"),
      runtime::HostWeightBytes(config, tp_size), free,
      "use more tensor-parallel ranks (--tp) or fewer layers (--layers)");
}

absl::StatusOr<runtime::ModelWeights> LoadWeightsAgreed(const runtime::ModelConfig& config,
                                                        const std::string& model, uint64_t seed,
                                                        const parallel::ProcessGrid& grid) {
  const absl::Status fits = WeightsFit(config, grid.tp_size);
  absl::StatusOr<runtime::ModelWeights> weights =
      fits.ok() ? MakeWeights(config, model, seed, grid.tp_rank, grid.tp_size)
                : absl::StatusOr<runtime::ModelWeights>(fits);
  // The lowest failing world rank's error goes to every rank, so one message is printed (by
  // rank 0, like any bad input), however many ranks read the same bad file.
  int64_t first_failed = weights.ok() ? std::numeric_limits<int64_t>::max() : grid.world_rank;
  int64_t failed = weights.ok() ? 0 : 1;
  CPFILL_RETURN_IF_ERROR(grid.world->AllReduce(&first_failed, 1, parallel::DataType::kInt64,
                                               parallel::ReduceOp::kMin));
  CPFILL_RETURN_IF_ERROR(
      grid.world->AllReduce(&failed, 1, parallel::DataType::kInt64, parallel::ReduceOp::kSum));
  if (failed == 0) return weights;
  const int root = static_cast<int>(first_failed);
  int32_t code = weights.ok() ? 0 : static_cast<int32_t>(weights.status().code());
  std::string message = weights.ok() ? "" : std::string(weights.status().message());
  CPFILL_RETURN_IF_ERROR(grid.world->Broadcast(&code, sizeof(code), root));
  int64_t size = static_cast<int64_t>(message.size());
  CPFILL_RETURN_IF_ERROR(grid.world->Broadcast(&size, sizeof(size), root));
  message.resize(static_cast<size_t>(size));
  CPFILL_RETURN_IF_ERROR(grid.world->Broadcast(message.data(), message.size(), root));
  const std::string who = failed == 1 ? absl::StrCat("world rank ", root)
                                      : absl::StrCat(failed, " ranks failed; world rank ", root);
  return absl::Status(static_cast<absl::StatusCode>(code), absl::StrCat(who, ": ", message));
}

LoadedModel::LoadedModel() = default;
LoadedModel::LoadedModel(LoadedModel&&) noexcept = default;
LoadedModel& LoadedModel::operator=(LoadedModel&&) noexcept = default;
LoadedModel::~LoadedModel() {
  model.reset();  // before the communicators it uses
}

absl::StatusOr<LoadedModel> BuildModel(const runtime::ModelConfig& config,
                                       runtime::ModelWeights weights, const std::string& backend,
                                       const parallel::ProcessGrid& grid,
                                       parallel::CommOptions comm_options,
                                       const runtime::StepOptions& options) {
  LoadedModel m;
  std::unique_ptr<runtime::ModelBackend> be;
  if (backend == "cuda") {
#if CPFILL_HAVE_CUDA
    CPFILL_ASSIGN_OR_RETURN(parallel::NcclGrid nccl, parallel::CreateNcclGrid(grid, comm_options));
    auto shared = std::make_shared<parallel::NcclGrid>(std::move(nccl));
    m.device = shared;
    // The bf16 slice goes to the GPU (row-wise FP8 projections at a byte an element).
    CPFILL_RETURN_IF_ERROR(runtime::CheckFitsOnEveryRank(
        *grid.world,
        absl::StrCat("the weights of ", config.name, " on the GPU (bf16, one TP slice of ",
                     grid.tp_size, ")"),
        runtime::WeightBytes(config, grid.tp_size, 2), runtime::cuda::FreeDeviceBytes,
        "use more tensor-parallel ranks (--tp) or fewer layers (--layers)"));
    CPFILL_ASSIGN_OR_RETURN(be, runtime::cuda::MakeCudaBackend(config, weights, *shared));
    weights = runtime::ModelWeights{};  // on the GPU now: free the host's fp32 copy
#else
    return absl::FailedPreconditionError("this build has no CUDA backend");
#endif
  } else {
    CPFILL_CHECK_ARG(backend == "cpu", "--backend: unknown backend '", backend,
                     "' (resolve auto first: cpu or cuda)");
    CPFILL_ASSIGN_OR_RETURN(
        be, runtime::cpu::MakeCpuBackend(config, std::move(weights), *grid.tp, *grid.cp,
                                         options.threads, options.batch_invariant));
  }
  CPFILL_ASSIGN_OR_RETURN(m.model,
                          runtime::LlamaModel::Create(config, std::move(be), *grid.world, options));
  return m;
}

}  // namespace cpfill::launch
