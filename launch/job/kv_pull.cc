#include "launch/job/kv_pull.h"

#include <httplib.h>
#if CPFILL_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"
#include "base/bfloat16.h"
#include "base/json_io.h"
#include "base/status.h"
#include "parallel/self_communicator.h"
#include "runtime/model/cpu/cpu_backend.h"
#include "runtime/model/prefill_batch.h"

namespace cpfill::launch {
namespace {

std::unique_ptr<httplib::Client> ClientFor(const std::string& url, double timeout_s,
                                           const std::string& api_key) {
  auto client = std::make_unique<httplib::Client>(url);
  if (!api_key.empty()) client->set_bearer_token_auth(api_key);
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1e3));
  client->set_connection_timeout(std::chrono::duration_cast<std::chrono::seconds>(timeout) +
                                 std::chrono::seconds(1));
  client->set_read_timeout(timeout);
  client->set_write_timeout(timeout);
  return client;
}

// The JSON body of a 200 answer, or the server's error (its message when it sent one).
absl::StatusOr<nlohmann::json> JsonAnswer(const httplib::Result& result, const std::string& url,
                                          const std::string& what) {
  if (!result) {
    return absl::UnavailableError(
        absl::StrCat(what, ": cannot reach ", url, " (", httplib::to_string(result.error()), ")"));
  }
  absl::StatusOr<nlohmann::json> body = json::Parse(result->body);
  if (result->status != 200) {
    std::string message = result->body.substr(0, 500);
    if (body.ok() && body->is_object() && body->contains("error") && (*body)["error"].is_object() &&
        (*body)["error"].value("message", nlohmann::json()).is_string()) {
      message = (*body)["error"]["message"].get<std::string>();
    }
    const std::string text = absl::StrCat(what, ": HTTP ", result->status, ": ", message);
    return result->status >= 400 && result->status < 500 ? absl::InvalidArgumentError(text)
                                                         : absl::UnavailableError(text);
  }
  CPFILL_CHECK_ARG(body.ok(), what, ": the server's answer is not JSON: ", body.status().message());
  return body;
}

}  // namespace

absl::StatusOr<runtime::KvHandle> RequestHandoff(const std::string& url,
                                                 const std::vector<int32_t>& prompt,
                                                 double timeout_s, const std::string& api_key) {
  const nlohmann::json request = {
      {"prompt", prompt}, {"max_tokens", 1}, {"kv_transfer_params", {{"do_remote_decode", true}}}};
  auto client = ClientFor(url, timeout_s, api_key);
  CPFILL_ASSIGN_OR_RETURN(
      nlohmann::json body,
      JsonAnswer(client->Post("/v1/completions", request.dump(), "application/json"), url,
                 "the prefill request"));
  CPFILL_CHECK_ARG(body.is_object() && body.contains("kv_transfer_params"),
                   "the prefill's answer has no kv_transfer_params (is the server running with "
                   "--kv-handoff?)");
  return runtime::ParseKvHandle(body["kv_transfer_params"]);
}

absl::StatusOr<int64_t> ServedVocabulary(const std::string& url, double timeout_s,
                                         const std::string& api_key) {
  auto client = ClientFor(url, timeout_s, api_key);
  CPFILL_ASSIGN_OR_RETURN(nlohmann::json body,
                          JsonAnswer(client->Get("/v1/models"), url, "GET /v1/models"));
  const nlohmann::json* vocab = nullptr;
  if (body.is_object() && body.contains("data") && body["data"].is_array() &&
      !body["data"].empty() && body["data"][0].is_object()) {
    vocab = json::Find(body["data"][0], "vocab_size");
  }
  const std::optional<int64_t> n = vocab ? json::AsInt64(*vocab) : std::nullopt;
  CPFILL_CHECK_ARG(n && *n > 0, "GET /v1/models: no vocab_size in the answer");
  return *n;
}

absl::StatusOr<PulledKv> MakeDestination(const runtime::KvHandleLayout& layout,
                                         const DestinationSpec& spec) {
  CPFILL_CHECK_ARG(spec.tp_size >= 1 && layout.kv_heads % spec.tp_size == 0, "--decode-tp ",
                   spec.tp_size, " does not divide the model's ", layout.kv_heads, " KV heads");
  CPFILL_CHECK_ARG(spec.tp_rank >= 0 && spec.tp_rank < spec.tp_size, "--decode-tp-rank ",
                   spec.tp_rank, " is outside [0, ", spec.tp_size, ")");
  PulledKv kv{.layout = layout, .spec = spec, .kv_heads_per_rank = layout.kv_heads / spec.tp_size};
  const int64_t row_bytes = int64_t{kv.kv_heads_per_rank} * layout.head_dim *
                            static_cast<int64_t>(runtime::KvDtypeBytes(layout.dtype));
  kv.destination.tp_size = spec.tp_size;
  kv.destination.tp_rank = spec.tp_rank;
  if (!spec.paged) {
    const int64_t kind_bytes = int64_t{layout.num_layers} * layout.tokens * row_bytes;
    kv.bytes.resize(static_cast<size_t>(2 * kind_bytes));
    kv.destination.layout = runtime::KvContiguousDestination{.v_offset_bytes = kind_bytes};
  } else {
    const int64_t needed = (layout.tokens + spec.block_tokens - 1) / spec.block_tokens;
    const int64_t num_blocks = needed + 3;  // spare blocks the pull must leave alone
    const runtime::KvCacheSpec cache{.num_layers = layout.num_layers,
                                     .kv_heads = kv.kv_heads_per_rank,
                                     .head_dim = layout.head_dim,
                                     .block_tokens = spec.block_tokens,
                                     .dtype = layout.dtype};
    const runtime::KvPoolLayout pool = runtime::KvPoolLayout::OfKvCache(cache, num_blocks);
    std::vector<int32_t> ids(static_cast<size_t>(num_blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937_64(spec.seed));
    kv.block_table.assign(ids.begin(), ids.begin() + needed);
    kv.bytes.resize(static_cast<size_t>(pool.bytes));
    kv.destination.layout = runtime::KvPagedDestination{
        .block_tokens = spec.block_tokens, .pool = pool, .block_table = kv.block_table};
  }
  // Poison: NaN in fp32, 0xFFFF (a NaN) in bf16; a byte the pull misses shows as infinite error.
  std::memset(kv.bytes.data(), 0xFF, kv.bytes.size());
  return kv;
}

float PulledKv::At(int layer, int kind, int64_t position, int head, int dim) const {
  const size_t esz = runtime::KvDtypeBytes(layout.dtype);
  const int64_t row_bytes = int64_t{kv_heads_per_rank} * layout.head_dim * esz;
  const int64_t in_row = (int64_t{head} * layout.head_dim + dim) * esz;
  int64_t offset = 0;
  if (const auto* c = std::get_if<runtime::KvContiguousDestination>(&destination.layout)) {
    offset = (kind == 0 ? c->k_offset_bytes : c->v_offset_bytes) +
             (int64_t{layer} * layout.tokens + position) * row_bytes + in_row;
  } else {
    const auto& p = std::get<runtime::KvPagedDestination>(destination.layout);
    offset = p.pool.BlockOffset(layer, kind, block_table[position / spec.block_tokens]) +
             (position % spec.block_tokens) * row_bytes + in_row;
  }
  if (layout.dtype == runtime::KvDtype::kFloat32) {
    float x;
    std::memcpy(&x, bytes.data() + offset, sizeof(x));
    return x;
  }
  uint16_t bits;
  std::memcpy(&bits, bytes.data() + offset, sizeof(bits));
  return Bfloat16BitsToFloat(bits);
}

#if CPFILL_HAVE_CUDA
absl::StatusOr<std::unique_ptr<DeviceDestination>> DeviceDestination::Create(int device,
                                                                             size_t bytes) {
  void* data = nullptr;
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) e = cudaMalloc(&data, bytes);
  if (e == cudaSuccess) e = cudaMemset(data, 0xFF, bytes);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    if (data != nullptr) cudaFree(data);
    return absl::FailedPreconditionError(
        absl::StrCat("--dst-cuda-device ", device, ": ", bytes, " bytes: ", cudaGetErrorString(e)));
  }
  return std::unique_ptr<DeviceDestination>(new DeviceDestination(device, data, bytes));
}

DeviceDestination::~DeviceDestination() { cudaFree(data_); }

absl::Status DeviceDestination::CopyTo(std::vector<uint8_t>& host) const {
  host.resize(bytes_);
  const cudaError_t e = cudaMemcpy(host.data(), data_, bytes_, cudaMemcpyDeviceToHost);
  if (e != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("copying the pulled KV from device ", device_, ": ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}
#else
absl::StatusOr<std::unique_ptr<DeviceDestination>> DeviceDestination::Create(int, size_t) {
  return absl::FailedPreconditionError("--dst-cuda-device: this build has no CUDA");
}
DeviceDestination::~DeviceDestination() = default;
absl::Status DeviceDestination::CopyTo(std::vector<uint8_t>&) const {
  return absl::FailedPreconditionError("this build has no CUDA");
}
#endif

absl::StatusOr<ReferenceKv> ComputeReferenceKv(const runtime::ModelConfig& config,
                                               runtime::ModelWeights weights,
                                               const std::vector<int32_t>& prompt, int threads) {
  parallel::SelfCommunicator tp("tp"), cp("cp"), world("world");
  const std::vector<runtime::PrefillRequest> batch = {{.tokens = prompt, .session = "reference"}};
  runtime::StepOptions options;
  options.kv_block_tokens = 16;
  options.threads = threads;
  options.kv_capacity_tokens = runtime::KvTokensForBatch(batch, 1, options.kv_block_tokens);
  CPFILL_ASSIGN_OR_RETURN(
      auto model, runtime::cpu::CreateCpuModel(config, std::move(weights), tp, cp, world, options));
  CPFILL_RETURN_IF_ERROR(model->Prefill(batch, nullptr, nullptr).status());
  const std::optional<runtime::KvCache::SeqId> seq = model->SessionSequence("reference");
  CPFILL_CHECK_INTERNAL(seq.has_value(), "the reference prefill kept no session");
  const int64_t n = static_cast<int64_t>(prompt.size());
  const size_t row = static_cast<size_t>(config.num_kv_heads) * config.head_dim;
  ReferenceKv ref(config.num_layers, std::vector<std::vector<float>>(2));
  for (int layer = 0; layer < config.num_layers; ++layer) {
    ref[layer][0].resize(n * row);
    ref[layer][1].resize(n * row);
    const runtime::KvCache::Rows rows{.seq = *seq,
                                      .token_begin = 0,
                                      .count = n,
                                      .k = ref[layer][0].data(),
                                      .v = ref[layer][1].data()};
    CPFILL_RETURN_IF_ERROR(model->kv_cache_for_reading().Read(layer, {&rows, 1}));
  }
  return ref;
}

KvComparison CompareKv(const PulledKv& kv, const ReferenceKv& reference, double tolerance) {
  KvComparison c;
  const runtime::KvHandleLayout& l = kv.layout;
  const int first_head = kv.spec.tp_rank * kv.kv_heads_per_rank;
  double scale = 0;
  for (int layer = 0; layer < l.num_layers; ++layer) {
    for (int kind = 0; kind < 2; ++kind) {
      const std::vector<float>& ref = reference[layer][kind];
      for (int64_t t = 0; t < l.tokens; ++t) {
        for (int h = 0; h < kv.kv_heads_per_rank; ++h) {
          for (int d = 0; d < l.head_dim; ++d) {
            const float want = ref[(t * l.kv_heads + first_head + h) * l.head_dim + d];
            const float got = kv.At(layer, kind, t, h, d);
            const double diff = std::fabs(double(got) - want);
            c.max_abs_diff = std::isnan(diff) ? INFINITY : std::max(c.max_abs_diff, diff);
            c.differing += std::memcmp(&got, &want, sizeof(got)) != 0;
            scale = std::max(scale, std::fabs(double(want)));
            ++c.elements;
          }
        }
      }
    }
  }
  c.allowed = tolerance * std::max(1.0, scale);
  c.pass = c.max_abs_diff <= c.allowed;
  return c;
}

}  // namespace cpfill::launch
