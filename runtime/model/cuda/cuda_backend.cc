#include "runtime/model/cuda/cuda_backend.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "attention/cuda/attention_cuda.h"
#include "base/bfloat16.h"
#include "base/status.h"
#include "base/wall_clock.h"
#include "parallel/cuda/cuda_ring_ops.h"
#include "parallel/cuda/device_buffer.h"
#include "runtime/kv/cuda/kv_storage_cuda.h"
#include "runtime/model/cpu/layers.h"
#include "runtime/model/cuda/fp8_gemm.h"
#include "runtime/model/cuda/gemm.h"
#include "runtime/model/cuda/layer_kernels.h"
#include "runtime/model/cuda/token_draw.h"
#include "runtime/model/sampling_draw.h"

namespace cpfill::runtime::cuda {
namespace {

using Bf16 = __nv_bfloat16;
using parallel::DeviceBuffer;

// Phases timed with CUDA events on the compute stream, so phases need no host synchronization of
// their own; Collect() adds each phase's GPU time once the stream is idle.
class PhaseEvents {
 public:
  ~PhaseEvents() {
    for (cudaEvent_t e : pool_) cudaEventDestroy(e);
  }
  absl::Status Begin(cudaStream_t stream) {
    CPFILL_ASSIGN_OR_RETURN(open_, Next());
    CPFILL_CUDA_CHECK(cudaEventRecord(open_, stream));
    if (used_ == 1) origin_unix_s_ = UnixSecondsNow();  // the first event since Reset
    return absl::OkStatus();
  }
  absl::Status End(cudaStream_t stream, double* seconds, parallel::RingSpan* span) {
    CPFILL_ASSIGN_OR_RETURN(cudaEvent_t end, Next());
    CPFILL_CUDA_CHECK(cudaEventRecord(end, stream));
    pending_.push_back({seconds, span, open_, end});
    return absl::OkStatus();
  }
  // After the stream is done: every phase's time into its accumulator, and its span.
  void Collect() {
    for (const Pending& p : pending_) {
      float ms = 0, from_origin = 0;
      if (cudaEventElapsedTime(&ms, p.begin, p.end) != cudaSuccess) continue;
      *p.seconds += ms / 1e3;
      if (p.span && cudaEventElapsedTime(&from_origin, pool_[0], p.begin) == cudaSuccess) {
        p.span->start_s = from_origin / 1e3;
        p.span->duration_s = ms / 1e3;
      }
    }
    Reset();
  }
  void Reset() {
    pending_.clear();
    used_ = 0;
  }
  double origin_unix_s() const { return origin_unix_s_; }

 private:
  absl::StatusOr<cudaEvent_t> Next() {
    if (used_ == pool_.size()) {
      cudaEvent_t e;
      CPFILL_CUDA_CHECK(cudaEventCreate(&e));
      pool_.push_back(e);
    }
    return pool_[used_++];
  }
  std::vector<cudaEvent_t> pool_;
  size_t used_ = 0;
  struct Pending {
    double* seconds;
    parallel::RingSpan* span;
    cudaEvent_t begin, end;
  };
  cudaEvent_t open_ = nullptr;
  std::vector<Pending> pending_;
  double origin_unix_s_ = 0;  // host wall clock when the first event was issued
};

class CudaBackend : public ModelBackend {
 public:
  explicit CudaBackend(parallel::NcclGrid& nccl) : nccl_(nccl), stream_(nccl.compute.get()) {}

  absl::Status Init(const ModelConfig& config, const ModelWeights& weights);

  std::string_view name() const override { return "cuda"; }
  ElemType compute_type() const override { return ElemType::kBf16; }
  const ModelTensors& weights() const override { return tensors_; }
  parallel::Communicator& tp() override { return *nccl_.tp; }
  parallel::Communicator& cp() override { return *nccl_.cp; }

  absl::StatusOr<Tensor> Scratch(int slot, ElemType type, int64_t rows, int64_t cols) override {
    if (slot >= static_cast<int>(scratch_.size())) scratch_.resize(slot + 1);
    Tensor t{nullptr, type, rows, cols};
    CPFILL_RETURN_IF_ERROR(scratch_[slot].Reserve(std::max<size_t>(16, t.bytes())));
    t.data = scratch_[slot].As<void>();
    return t;
  }
  int64_t ScratchBytesHeld(int slot) const override {
    return slot < static_cast<int>(scratch_.size())
               ? static_cast<int64_t>(scratch_[slot].capacity())
               : 0;
  }
  // Pageable host memory: the call returns once the bytes are staged, so the caller may reuse it.
  absl::Status Upload(const void* host, Tensor* dst) override {
    CPFILL_CUDA_CHECK(
        cudaMemcpyAsync(dst->data, host, dst->bytes(), cudaMemcpyHostToDevice, stream_));
    return absl::OkStatus();
  }
  absl::Status Download(const Tensor& src, void* host) override {
    CPFILL_CUDA_CHECK(
        cudaMemcpyAsync(host, src.data, src.bytes(), cudaMemcpyDeviceToHost, stream_));
    CPFILL_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

  absl::Status Embed(const Tensor& ids, const Tensor& table, Tensor* x) override {
    return EmbedToF32(ids.As<int32_t>(), ids.rows, table.As<Bf16>(), table.cols, x->As<float>(),
                      stream_);
  }
  absl::Status RmsNorm(const Tensor& x, const Tensor& weight, double eps, Tensor* y) override {
    CPFILL_CHECK_INTERNAL(y->type == ElemType::kBf16, "RMSNorm writes bf16 on the GPU");
    return RmsNormToBf16(x.As<float>(), weight.As<Bf16>(), x.rows, x.cols, static_cast<float>(eps),
                         y->As<Bf16>(), stream_);
  }
  absl::Status Linear(const Tensor& x, const Tensor& w, Tensor* y) override {
    if (w.type == ElemType::kF8E4M3) return LinearFp8(x, w, y);
    return gemm_.Linear(x.As<Bf16>(), x.rows, x.cols, w.As<Bf16>(), w.rows, y->data,
                        y->type == ElemType::kF32 ? OutType::kFloat32 : OutType::kBfloat16);
  }
  absl::Status Rope(const Tensor& positions, int heads, Tensor* x) override {
    return RopeBf16(x->As<Bf16>(), positions.As<int32_t>(), x->rows, heads, x->cols / heads,
                    inv_freq_.As<double>(), stream_);
  }
  absl::Status SwiGlu(const Tensor& up, Tensor* gate) override {
    return SwiGluBf16(gate->As<Bf16>(), up.As<Bf16>(), gate->numel(), gate->As<Bf16>(), stream_);
  }
  absl::Status Add(const Tensor& y, Tensor* x) override {
    return AddF32(x->As<float>(), y.As<float>(), x->numel(), stream_);
  }
  absl::Status Convert(const Tensor& in, Tensor* out) override {
    CPFILL_CHECK_INTERNAL(in.type == ElemType::kF32 && out->type == ElemType::kBf16,
                          "the GPU converts fp32 to bf16 only");
    return F32ToBf16(in.As<float>(), in.numel(), out->As<Bf16>(), stream_);
  }
  absl::Status GatherRows(const Tensor& x, std::span<const int64_t> rows, Tensor* out) override {
    const size_t row_bytes = x.cols * ElemBytes(x.type);
    for (size_t i = 0; i < rows.size(); ++i) {
      CPFILL_CUDA_CHECK(cudaMemcpyAsync(out->Rows(i, 1).data, x.Rows(rows[i], 1).data, row_bytes,
                                        cudaMemcpyDeviceToDevice, stream_));
    }
    return absl::OkStatus();
  }

  // Drawn in place: only the ids come back (a decode step of 64 Llama 3 sequences downloaded
  // 33 MB of logits and drew from them on the host).
  absl::Status DrawTokens(const Tensor& logits, int slices, std::span<const int64_t> rows,
                          std::span<const TokenDraw> draws, std::vector<int32_t>* ids) override {
    const size_t n = draws.size();
    std::vector<DeviceTokenDraw> specs(n);
    for (size_t i = 0; i < n; ++i) {
      const SamplingParams& p = draws[i].params;
      specs[i] = {.scale = p.temperature > 0 ? 1.0 / p.temperature : 0.0,
                  .top_p = p.top_p,
                  .top_k = p.top_k,
                  .key = DrawKey(p.seed, draws[i].step),
                  .row = rows[i]};
    }
    CPFILL_RETURN_IF_ERROR(draw_specs_.Reserve(std::max<size_t>(16, n * sizeof(DeviceTokenDraw))));
    CPFILL_RETURN_IF_ERROR(drawn_ids_.Reserve(std::max<size_t>(16, n * sizeof(int32_t))));
    CPFILL_CUDA_CHECK(cudaMemcpyAsync(draw_specs_.As<void>(), specs.data(),
                                      n * sizeof(DeviceTokenDraw), cudaMemcpyHostToDevice,
                                      stream_));
    CPFILL_RETURN_IF_ERROR(cuda::DrawTokens(
        logits.As<float>(), logits.rows / slices, logits.cols, slices,
        draw_specs_.As<DeviceTokenDraw>(), static_cast<int>(n), drawn_ids_.As<int32_t>(), stream_));
    ids->resize(n);
    CPFILL_CUDA_CHECK(cudaMemcpyAsync(ids->data(), drawn_ids_.As<void>(), n * sizeof(int32_t),
                                      cudaMemcpyDeviceToHost, stream_));
    CPFILL_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

  parallel::RingOps& ring_ops() override { return *ring_ops_; }
  absl::Status BeginPhase() override { return phases_.Begin(stream_); }
  absl::Status EndPhase(double* acc, parallel::RingSpan* span) override {
    return phases_.End(stream_, acc, span);
  }
  double PhasesOriginUnixS() const override { return phases_.origin_unix_s(); }
  // The TP communicator's Synchronize is the host wait with a deadline (NCCL errors included);
  // after it nothing enqueued can read the buffers that growths retired.
  absl::Status Finish() override {
    CPFILL_RETURN_IF_ERROR(nccl_.tp->Synchronize());
    DeviceBuffer::FreeRetired();
    phases_.Collect();
    return absl::OkStatus();
  }
  void ResetPhases() override { phases_.Reset(); }

  std::unique_ptr<KvStorage> MakeKvStorage() override { return MakeDeviceKvStorage(stream_); }
  absl::StatusOr<int64_t> FreeMemoryBytes() override { return FreeDeviceBytes(); }

 private:
  absl::StatusOr<Tensor> UploadWeight(const std::vector<float>& host, int64_t rows, int64_t cols);
  // A projection: its row-wise FP8 twin (codes and scales on the device) when it has one.
  absl::StatusOr<Tensor> UploadProjection(const std::vector<float>& host, const Fp8Matrix& fp8,
                                          int64_t rows, int64_t cols);
  // x quantized per token on the GPU, then the FP8 GEMM with both sides' scales (fp8_gemm.h).
  absl::Status LinearFp8(const Tensor& x, const Tensor& w, Tensor* y);

  parallel::NcclGrid& nccl_;
  cudaStream_t stream_;
  Gemm gemm_;
  Fp8Gemm fp8_gemm_;
  float activation_scale_ub_ = 0;
  // FP8 activations of the current Linear: codes [T, in], scales [T], and the epilogue mode's
  // fp32 accumulators [T, out]; grown to the largest batch, like the scratch slots.
  DeviceBuffer fp8_codes_, fp8_scales_, fp8_acc_;
  std::vector<DeviceBuffer> weight_buffers_;  // owns what tensors_ points at
  ModelTensors tensors_;
  DeviceBuffer inv_freq_;
  std::vector<DeviceBuffer> scratch_;
  std::unique_ptr<parallel::CudaRingOps> ring_ops_;  // its buffers live across prefills
  PhaseEvents phases_;
  DeviceBuffer draw_specs_, drawn_ids_;  // DrawTokens's, kept between steps
};

absl::StatusOr<Tensor> CudaBackend::UploadWeight(const std::vector<float>& host, int64_t rows,
                                                 int64_t cols) {
  const std::vector<uint16_t> bits = ToBfloat16(host);
  DeviceBuffer& dst = weight_buffers_.emplace_back();
  CPFILL_RETURN_IF_ERROR(dst.Reserve(std::max<size_t>(16, bits.size() * 2)));
  CPFILL_CUDA_CHECK(cudaMemcpyAsync(dst.As<void>(), bits.data(), bits.size() * 2,
                                    cudaMemcpyHostToDevice, stream_));
  CPFILL_CUDA_CHECK(cudaStreamSynchronize(stream_));  // `bits` is a temporary
  return Tensor{dst.As<void>(), ElemType::kBf16, rows, cols};
}

absl::StatusOr<Tensor> CudaBackend::UploadProjection(const std::vector<float>& host,
                                                     const Fp8Matrix& fp8, int64_t rows,
                                                     int64_t cols) {
  if (fp8.empty()) return UploadWeight(host, rows, cols);
  // One buffer: codes, then the scales 16-byte aligned (cuBLASLt's FP8 operands need that).
  const size_t codes_bytes = (fp8.codes.size() + 15) / 16 * 16;
  DeviceBuffer& dst = weight_buffers_.emplace_back();
  CPFILL_RETURN_IF_ERROR(dst.Reserve(codes_bytes + fp8.row_scale.size() * sizeof(float)));
  CPFILL_CUDA_CHECK(cudaMemcpyAsync(dst.As<void>(), fp8.codes.data(), fp8.codes.size(),
                                    cudaMemcpyHostToDevice, stream_));
  float* scales = dst.As<float>(codes_bytes);
  CPFILL_CUDA_CHECK(cudaMemcpyAsync(scales, fp8.row_scale.data(),
                                    fp8.row_scale.size() * sizeof(float), cudaMemcpyHostToDevice,
                                    stream_));
  CPFILL_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return Tensor{dst.As<void>(), ElemType::kF8E4M3, rows, cols, scales};
}

absl::Status CudaBackend::LinearFp8(const Tensor& x, const Tensor& w, Tensor* y) {
  const int64_t tokens = x.rows, in = x.cols, out = w.rows;
  if (tokens == 0) return absl::OkStatus();
  CPFILL_RETURN_IF_ERROR(fp8_codes_.Reserve(std::max<size_t>(16, tokens * in)));
  CPFILL_RETURN_IF_ERROR(fp8_scales_.Reserve(std::max<size_t>(16, tokens * sizeof(float))));
  auto* codes = fp8_codes_.As<uint8_t>();
  auto* scales = fp8_scales_.As<float>();
  CPFILL_RETURN_IF_ERROR(
      QuantizeRowsFp8(x.As<Bf16>(), tokens, in, activation_scale_ub_, codes, scales, stream_));
  const OutType out_type = y->type == ElemType::kF32 ? OutType::kFloat32 : OutType::kBfloat16;
  const Fp8GemmArgs args{codes, scales, w.As<uint8_t>(), w.row_scale, tokens, in, out};
  const Fp8ScaleMode mode = fp8_gemm_.ModeFor(args, out_type);
  float* acc = nullptr;
  if (mode == Fp8ScaleMode::kEpilogue) {
    if (out_type == OutType::kFloat32) {
      acc = y->As<float>();  // scaled in place
    } else {
      CPFILL_RETURN_IF_ERROR(fp8_acc_.Reserve(std::max<size_t>(16, tokens * out * 4)));
      acc = fp8_acc_.As<float>();
    }
  }
  return fp8_gemm_.Linear(args, y->data, out_type, mode, acc);
}

absl::Status CudaBackend::Init(const ModelConfig& c, const ModelWeights& weights) {
  CPFILL_RETURN_IF_ERROR(gemm_.Init(stream_));
  CPFILL_RETURN_IF_ERROR(fp8_gemm_.Init(stream_));
  activation_scale_ub_ = c.fp8.activation_scale_ub;
  CPFILL_ASSIGN_OR_RETURN(ring_ops_, parallel::CudaRingOps::Create(*nccl_.cp, stream_));
  const int tp = nccl_.tp->size();
  const int64_t D = c.hidden_size, I = c.intermediate_size / tp, V = c.vocab_size / tp;
  const int64_t qw = int64_t{c.num_heads / tp} * c.head_dim;
  const int64_t kvw = int64_t{c.num_kv_heads / tp} * c.head_dim;
  for (const LayerWeights& w : weights.layers) {
    LayerTensors& t = tensors_.layers.emplace_back();
    CPFILL_ASSIGN_OR_RETURN(t.input_norm, UploadWeight(w.input_norm, 1, D));
    CPFILL_ASSIGN_OR_RETURN(t.post_norm, UploadWeight(w.post_norm, 1, D));
    for (auto [dst, src, fp8, rows, cols] : {std::tuple{&t.wq, &w.wq, &w.wq_fp8, qw, D},
                                             {&t.wk, &w.wk, &w.wk_fp8, kvw, D},
                                             {&t.wv, &w.wv, &w.wv_fp8, kvw, D},
                                             {&t.wo, &w.wo, &w.wo_fp8, D, qw},
                                             {&t.w_gate, &w.w_gate, &w.w_gate_fp8, I, D},
                                             {&t.w_up, &w.w_up, &w.w_up_fp8, I, D},
                                             {&t.w_down, &w.w_down, &w.w_down_fp8, D, I}}) {
      CPFILL_ASSIGN_OR_RETURN(*dst, UploadProjection(*src, *fp8, rows, cols));
    }
  }
  CPFILL_ASSIGN_OR_RETURN(tensors_.embedding, UploadWeight(weights.embedding, c.vocab_size, D));
  CPFILL_ASSIGN_OR_RETURN(tensors_.final_norm, UploadWeight(weights.final_norm, 1, D));
  CPFILL_ASSIGN_OR_RETURN(tensors_.lm_head, UploadWeight(weights.lm_head, V, D));
  const cpu::RopeTable rope = cpu::RopeTable::Make(c);
  CPFILL_RETURN_IF_ERROR(inv_freq_.Reserve(rope.inv_freq().size() * sizeof(double)));
  CPFILL_CUDA_CHECK(cudaMemcpy(inv_freq_.As<void>(), rope.inv_freq().data(),
                               rope.inv_freq().size() * sizeof(double), cudaMemcpyHostToDevice));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ModelBackend>> MakeCudaBackend(const ModelConfig& config,
                                                              const ModelWeights& weights,
                                                              parallel::NcclGrid& nccl) {
  CPFILL_RETURN_IF_ERROR(config.ValidateForTp(nccl.tp->size()));
  CPFILL_CHECK_ARG(weights.tp_size == nccl.tp->size() && weights.tp_rank == nccl.tp->rank(),
                   "weights are TP slice ", weights.tp_rank, " of ", weights.tp_size,
                   ", this rank is TP rank ", nccl.tp->rank(), " of ", nccl.tp->size());
  CPFILL_CHECK_ARG(attention::cuda::SupportedHeadDim(config.head_dim), "head_dim ", config.head_dim,
                   " has no CUDA attention kernel (64, 128)");
  auto backend = std::make_unique<CudaBackend>(nccl);
  CPFILL_RETURN_IF_ERROR(backend->Init(config, weights));
  return std::unique_ptr<ModelBackend>(std::move(backend));
}

}  // namespace cpfill::runtime::cuda
