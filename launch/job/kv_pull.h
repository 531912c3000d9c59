// cpfill/launch/job/kv_pull.h — the pieces of `cpfill kv-pull`, a stand-in decode worker: ask a
// running `cpfill serve --kv-handoff` to prefill a prompt for remote decode, pull the KV it hands
// off into a destination laid out as a decode worker would (contiguous or paged, any decode TP
// size), and check it against the KV a single-rank fp32 prefill of the same prompt makes.
//
//   CPFILL_ASSIGN_OR_RETURN(KvHandle handle, RequestHandoff("http://127.0.0.1:8000", ids, 60));
//   CPFILL_ASSIGN_OR_RETURN(PulledKv kv, MakeDestination(handle.layout, {.tp_size = 1}));
//   CPFILL_ASSIGN_OR_RETURN(KvPullStats s, puller->Pull(handle, kv.destination, kv.bytes.data(),
//                                                        kv.bytes.size(), deadline));
//   CPFILL_ASSIGN_OR_RETURN(auto ref, ReferenceKv(config, std::move(weights), ids));
//   KvComparison c = CompareKv(kv, ref, 1e-4);
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/handoff/kv_handle.h"
#include "runtime/handoff/kv_pull_plan.h"
#include "runtime/model/model_config.h"
#include "runtime/model/weights.h"

namespace cpfill::launch {

// POST /v1/completions with the prompt and kv_transfer_params {"do_remote_decode": true}; the
// handle of the response (parsed as untrusted input). Unavailable when the server cannot be
// reached; the server's error (its HTTP status and message) otherwise. `api_key` ("" none) goes
// as "Authorization: Bearer" to a server started with --api-key.
absl::StatusOr<runtime::KvHandle> RequestHandoff(const std::string& url,
                                                 const std::vector<int32_t>& prompt,
                                                 double timeout_s, const std::string& api_key);
// GET /v1/models: the vocabulary size of the served model (for random prompts).
absl::StatusOr<int64_t> ServedVocabulary(const std::string& url, double timeout_s,
                                         const std::string& api_key);

struct DestinationSpec {
  int tp_size = 1, tp_rank = 0;
  bool paged = false;
  int block_tokens = 16;  // paged: the destination's blocks
  uint64_t seed = 1;      // paged: the block table is a shuffle of the pool's ids
};

// Host memory for one decode rank's part of a handle's KV, poisoned (NaN, or 0xFFFF for bf16),
// with the destination a pull plan takes.
struct PulledKv {
  runtime::KvHandleLayout layout;  // the handle's
  DestinationSpec spec;
  int kv_heads_per_rank = 0;
  std::vector<uint8_t> bytes;
  std::vector<int32_t> block_table;  // paged
  // Borrows block_table's buffer, which moving a PulledKv keeps (copying one does not).
  runtime::KvPullDestination destination;
  // Element (layer, kind 0 K / 1 V, position, this rank's head, dim) as float.
  float At(int layer, int kind, int64_t position, int head, int dim) const;
};
absl::StatusOr<PulledKv> MakeDestination(const runtime::KvHandleLayout& layout,
                                         const DestinationSpec& spec);

// GPU memory for a pull into a device (`kv-pull --dst-cuda-device`): poisoned like PulledKv's
// host bytes, copied back into them for the check. FailedPrecondition in a build without CUDA.
class DeviceDestination {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceDestination>> Create(int device, size_t bytes);
  ~DeviceDestination();
  DeviceDestination(const DeviceDestination&) = delete;
  DeviceDestination& operator=(const DeviceDestination&) = delete;
  void* data() const { return data_; }
  absl::Status CopyTo(std::vector<uint8_t>& host) const;

 private:
  DeviceDestination(int device, void* data, size_t bytes)
      : device_(device), data_(data), bytes_(bytes) {}
  int device_;
  void* data_;
  size_t bytes_;
};

// The KV of `prompt` on a single-rank fp32 CPU model with `weights` (TP 1) on `threads` threads
// (0: every core): [layer][kind] of [position][kv_head][head_dim] floats. The CPU kernels' rounding
// depends on their thread count: a one-rank server with the same --threads gives the same bits.
using ReferenceKv = std::vector<std::vector<std::vector<float>>>;
absl::StatusOr<ReferenceKv> ComputeReferenceKv(const runtime::ModelConfig& config,
                                               runtime::ModelWeights weights,
                                               const std::vector<int32_t>& prompt, int threads);

struct KvComparison {
  int64_t elements = 0;
  int64_t differing = 0;    // elements not bit-identical to the reference (as float)
  double max_abs_diff = 0;  // NaN poison left unwritten counts as infinite
  double allowed = 0;       // tolerance * max(1, largest |reference|)
  bool pass = false;
};
KvComparison CompareKv(const PulledKv& kv, const ReferenceKv& reference, double tolerance);

}  // namespace cpfill::launch
