// cpfill/runtime/model/model_backend.h — what the Llama forward (llama_model.h) needs from a
// device: tensors in its memory, the layer operations, the attention ring, timing and the KV
// storage. The forward is written once over this interface; cpu/cpu_backend.h (fp32, OpenBLAS, MPI)
// and cuda/cuda_backend.h (bf16 operands with fp32 accumulation and residual stream, cuBLASLt,
// NCCL) implement it.
//
//   CPFILL_ASSIGN_OR_RETURN(auto backend, cpu::MakeCpuBackend(config, std::move(w), tp, cp, 8));
//   CPFILL_ASSIGN_OR_RETURN(Tensor h, backend->Scratch(kSlotH, backend->compute_type(), T, D));
//   CPFILL_RETURN_IF_ERROR(backend->RmsNorm(x, weights.layers[0].input_norm, eps, &h));
//   CPFILL_RETURN_IF_ERROR(backend->Linear(h, weights.layers[0].wq, &q));
//   auto ring = parallel::RingAttention::Create(backend->cp(), plan, shape, &backend->ring_ops());
//
// Every operation is ordered on the backend's one compute stream (the CPU runs it at once), so
// a caller may reuse a tensor as soon as the next operation that reads it has been issued.
// Nothing is synchronized with the host except Download() and Finish().
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "attention/attention.h"
#include "parallel/communicator.h"
#include "parallel/ring_attention.h"
#include "runtime/kv/kv_cache.h"
#include "runtime/model/sampling.h"
#include "sharding/plan.h"

namespace cpfill::runtime {

// kF8E4M3: row-wise FP8 weights only (fp8.h), never an activation or a scratch tensor.
enum class ElemType { kF32, kBf16, kI32, kF8E4M3 };
size_t ElemBytes(ElemType type);

// A row-major matrix [rows, cols] in the backend's memory (host or device). Not owning.
struct Tensor {
  void* data = nullptr;
  ElemType type = ElemType::kF32;
  int64_t rows = 0, cols = 0;
  // kF8E4M3 weights: [rows] fp32 per-output-row scales in the same memory as `data` (fp8.h).
  const float* row_scale = nullptr;

  int64_t numel() const { return rows * cols; }
  size_t bytes() const { return static_cast<size_t>(numel()) * ElemBytes(type); }
  template <typename T>
  T* As() const {
    return static_cast<T*>(data);
  }
  // Rows [begin, begin + count) as a tensor of their own.
  Tensor Rows(int64_t begin, int64_t count) const {
    return {static_cast<char*>(data) + begin * cols * ElemBytes(type), type, count, cols,
            row_scale ? row_scale + begin : nullptr};
  }
};

// One layer's weights in the backend's memory (shapes as runtime/model/weights.h documents them).
struct LayerTensors {
  Tensor input_norm, wq, wk, wv, wo, post_norm, w_gate, w_up, w_down;
};
struct ModelTensors {
  std::vector<LayerTensors> layers;
  Tensor embedding, final_norm, lm_head;
};

class ModelBackend {
 public:
  virtual ~ModelBackend() = default;

  virtual std::string_view name() const = 0;  // "cpu", "cuda"
  // Element type of GEMM operands, attention inputs and the KV cache (the residual stream, the
  // attention output and row-parallel GEMM outputs are always fp32).
  virtual ElemType compute_type() const = 0;
  virtual const ModelTensors& weights() const = 0;
  virtual parallel::Communicator& tp() = 0;
  virtual parallel::Communicator& cp() = 0;

  // Scratch tensor `slot`, kept between calls and grown to the largest size asked: a prefill
  // allocates nothing once a batch as large has run (on a GPU a fresh cudaMalloc/cudaFree of the
  // activations cost milliseconds of TTFT and synchronized the device).
  virtual absl::StatusOr<Tensor> Scratch(int slot, ElemType type, int64_t rows, int64_t cols) = 0;
  // Bytes scratch tensor `slot` holds now (a batch no larger reuses them; 0 if never asked).
  virtual int64_t ScratchBytesHeld(int slot) const = 0;
  // Host -> tensor (the host memory may be reused when this returns); tensor -> host (waits).
  virtual absl::Status Upload(const void* host, Tensor* dst) = 0;
  virtual absl::Status Download(const Tensor& src, void* host) = 0;

  // ---- the layer operations ----
  // x [T, D] fp32 = table rows of ids [T, 1] (int32).
  virtual absl::Status Embed(const Tensor& ids, const Tensor& table, Tensor* x) = 0;
  // y = x / sqrt(mean(x^2) + eps) * weight, per row; x fp32, y fp32 or compute_type().
  virtual absl::Status RmsNorm(const Tensor& x, const Tensor& weight, double eps, Tensor* y) = 0;
  // y [T, out] = x [T, in] * w^T (w [out, in]); y's type chooses the output precision.
  virtual absl::Status Linear(const Tensor& x, const Tensor& w, Tensor* y) = 0;
  // Rotate-half RoPE in place on x [T, heads * head_dim] at positions [T, 1] (int32).
  virtual absl::Status Rope(const Tensor& positions, int heads, Tensor* x) = 0;
  // gate = silu(gate) * up.
  virtual absl::Status SwiGlu(const Tensor& up, Tensor* gate) = 0;
  // x += y (fp32).
  virtual absl::Status Add(const Tensor& y, Tensor* x) = 0;
  // out = in, converted to out's type.
  virtual absl::Status Convert(const Tensor& in, Tensor* out) = 0;
  // out row i = x row rows[i].
  virtual absl::Status GatherRows(const Tensor& x, std::span<const int64_t> rows, Tensor* out) = 0;
  // ids[i] = the token draws[i] picks, as SampleToken would (sampling.h), from row rows[i] of
  // `logits` [slices * n, V / slices] fp32: the vocabulary in `slices` parts (a TP group's
  // all-gathered slices), part s of row r at row s * n + r. Waits for the result. Here: the
  // logits downloaded and drawn on the host; the GPU draws in place (cuda/token_draw.h).
  virtual absl::Status DrawTokens(const Tensor& logits, int slices, std::span<const int64_t> rows,
                                  std::span<const TokenDraw> draws, std::vector<int32_t>* ids);

  // ---- attention, timing, KV storage ----
  // What the CP ring (parallel::RingAttention, written once) runs on here: attention kernel,
  // buffers kept between prefills, merge, timing marks. Its inputs are compute_type().
  virtual parallel::RingOps& ring_ops() = 0;
  // Phases: the time between BeginPhase() and EndPhase(acc) is added to *acc once Finish()
  // returned (on a GPU, events on the stream: the host runs ahead). `span`, when given, gets the
  // phase's place on the timeline (start_s from the first phase since ResetPhases(), duration_s)
  // by then too, for --trace; PhasesOriginUnixS() is the wall clock at that first phase (on a GPU,
  // when the host issued it).
  virtual absl::Status BeginPhase() = 0;
  virtual absl::Status EndPhase(double* acc, parallel::RingSpan* span = nullptr) = 0;
  virtual double PhasesOriginUnixS() const = 0;
  // Waits for all issued work, with the communicators' deadline; collects the phase times.
  virtual absl::Status Finish() = 0;
  // Forgets phases issued by a prefill that failed half-way.
  virtual void ResetPhases() = 0;

  virtual std::unique_ptr<KvStorage> MakeKvStorage() = 0;
  KvDtype kv_dtype() const {
    return compute_type() == ElemType::kBf16 ? KvDtype::kBfloat16 : KvDtype::kFloat32;
  }
  // Memory this rank may still allocate (device memory on a GPU; the host's available memory
  // divided among the ranks on it on the CPU).
  virtual absl::StatusOr<int64_t> FreeMemoryBytes() = 0;
};

}  // namespace cpfill::runtime
