#include "runtime/model/cpu/cpu_backend.h"

#include <chrono>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "base/host_buffer.h"
#include "base/status.h"
#include "base/thread_pool.h"
#include "base/wall_clock.h"
#include "runtime/model/cpu/fp8_linear.h"
#include "runtime/model/cpu/layers.h"
#include "runtime/model/memory.h"

namespace cpfill::runtime::cpu {
namespace {

using Clock = std::chrono::steady_clock;

Tensor Wrap(std::vector<float>& v, int64_t rows, int64_t cols) {
  return {v.data(), ElemType::kF32, rows, cols};
}

// A projection: its row-wise FP8 twin when the weights have one, else the fp32 matrix.
Tensor WrapProjection(std::vector<float>& v, Fp8Matrix& q, int64_t rows, int64_t cols) {
  if (q.empty()) return Wrap(v, rows, cols);
  return {q.codes.data(), ElemType::kF8E4M3, rows, cols, q.row_scale.data()};
}

class CpuBackend : public ModelBackend {
 public:
  CpuBackend(const ModelConfig& config, ModelWeights weights, parallel::Communicator& tp,
             parallel::Communicator& cp, int threads, bool batch_invariant)
      : batch_invariant_(batch_invariant),
        weights_(std::move(weights)),
        tp_(tp),
        cp_(cp),
        pool_(threads),
        ring_ops_(&pool_),
        rope_(RopeTable::Make(config)),
        activation_scale_ub_(config.fp8.activation_scale_ub) {
    SetBlasThreads(pool_.num_threads());
    WrapWeights(config, tp.size());
  }

  std::string_view name() const override { return "cpu"; }
  ElemType compute_type() const override { return ElemType::kF32; }
  const ModelTensors& weights() const override { return tensors_; }
  parallel::Communicator& tp() override { return tp_; }
  parallel::Communicator& cp() override { return cp_; }

  absl::StatusOr<Tensor> Scratch(int slot, ElemType type, int64_t rows, int64_t cols) override {
    if (slot >= static_cast<int>(scratch_.size())) scratch_.resize(slot + 1);
    Tensor t{nullptr, type, rows, cols};
    if (scratch_[slot].size() < t.bytes()) scratch_[slot].Resize(t.bytes());
    t.data = scratch_[slot].data();
    return t;
  }
  int64_t ScratchBytesHeld(int slot) const override {
    return slot < static_cast<int>(scratch_.size()) ? static_cast<int64_t>(scratch_[slot].size())
                                                    : 0;
  }
  // A rank may hold no rows of a batch (a 1-token prompt on CP > 1): its tensors are empty and
  // their data null, which memcpy may not be given even for 0 bytes.
  absl::Status Upload(const void* host, Tensor* dst) override {
    if (dst->bytes() > 0) std::memcpy(dst->data, host, dst->bytes());
    return absl::OkStatus();
  }
  absl::Status Download(const Tensor& src, void* host) override {
    if (src.bytes() > 0) std::memcpy(host, src.data, src.bytes());
    return absl::OkStatus();
  }

  absl::Status Embed(const Tensor& ids, const Tensor& table, Tensor* x) override {
    cpu::Embed(ids.As<int32_t>(), ids.rows, table.As<float>(), table.cols, x->As<float>());
    return absl::OkStatus();
  }
  absl::Status RmsNorm(const Tensor& x, const Tensor& weight, double eps, Tensor* y) override {
    cpu::RmsNorm(x.As<float>(), weight.As<float>(), x.rows, x.cols, eps, y->As<float>(), &pool_);
    return absl::OkStatus();
  }
  absl::Status Linear(const Tensor& x, const Tensor& w, Tensor* y) override {
    if (w.type == ElemType::kF8E4M3) {
      LinearFp8Rowwise(x.As<float>(), x.rows, x.cols, w.As<uint8_t>(), w.row_scale, w.rows,
                       activation_scale_ub_, batch_invariant_, y->As<float>(), &fp8_scratch_);
      return absl::OkStatus();
    }
    if (batch_invariant_ && x.cols > 0) {
      cpu::LinearPerRow(x.As<float>(), x.rows, x.cols, w.As<float>(), w.rows, y->As<float>());
    } else {
      cpu::Linear(x.As<float>(), x.rows, x.cols, w.As<float>(), w.rows, y->As<float>());
    }
    return absl::OkStatus();
  }
  absl::Status Rope(const Tensor& positions, int heads, Tensor* x) override {
    rope_.Apply(x->As<float>(), positions.As<int32_t>(), x->rows, heads, x->cols / heads);
    return absl::OkStatus();
  }
  absl::Status SwiGlu(const Tensor& up, Tensor* gate) override {
    cpu::SwiGlu(gate->As<float>(), up.As<float>(), gate->numel(), gate->As<float>());
    return absl::OkStatus();
  }
  absl::Status Add(const Tensor& y, Tensor* x) override {
    float* a = x->As<float>();
    const float* b = y.As<float>();
    for (int64_t i = 0; i < x->numel(); ++i) a[i] += b[i];
    return absl::OkStatus();
  }
  absl::Status Convert(const Tensor& in, Tensor* out) override {
    CPFILL_CHECK_INTERNAL(in.type == out->type, "the CPU backend computes in fp32 only");
    if (in.bytes() > 0) std::memcpy(out->data, in.data, in.bytes());
    return absl::OkStatus();
  }
  absl::Status GatherRows(const Tensor& x, std::span<const int64_t> rows, Tensor* out) override {
    const size_t row_bytes = x.cols * ElemBytes(x.type);
    for (size_t i = 0; i < rows.size(); ++i) {
      std::memcpy(out->Rows(i, 1).data, x.Rows(rows[i], 1).data, row_bytes);
    }
    return absl::OkStatus();
  }

  parallel::RingOps& ring_ops() override { return ring_ops_; }
  // The CPU runs each operation when it is issued: a phase is host time.
  absl::Status BeginPhase() override {
    open_ = Clock::now();
    if (!origin_) {
      origin_ = open_;
      origin_unix_s_ = UnixSecondsNow();
    }
    return absl::OkStatus();
  }
  absl::Status EndPhase(double* acc, parallel::RingSpan* span) override {
    const auto now = Clock::now();
    *acc += std::chrono::duration<double>(now - open_).count();
    if (span) {
      span->start_s = std::chrono::duration<double>(open_ - *origin_).count();
      span->duration_s = std::chrono::duration<double>(now - open_).count();
    }
    return absl::OkStatus();
  }
  double PhasesOriginUnixS() const override { return origin_unix_s_; }
  absl::Status Finish() override { return absl::OkStatus(); }
  void ResetPhases() override { origin_.reset(); }

  std::unique_ptr<KvStorage> MakeKvStorage() override { return MakeHostKvStorage(); }
  absl::StatusOr<int64_t> FreeMemoryBytes() override { return HostBytesAvailable(); }

 private:
  void WrapWeights(const ModelConfig& c, int tp) {
    const int64_t D = c.hidden_size, I = c.intermediate_size / tp, V = c.vocab_size / tp;
    const int64_t qw = int64_t{c.num_heads / tp} * c.head_dim;
    const int64_t kvw = int64_t{c.num_kv_heads / tp} * c.head_dim;
    for (LayerWeights& w : weights_.layers) {
      tensors_.layers.push_back({.input_norm = Wrap(w.input_norm, 1, D),
                                 .wq = WrapProjection(w.wq, w.wq_fp8, qw, D),
                                 .wk = WrapProjection(w.wk, w.wk_fp8, kvw, D),
                                 .wv = WrapProjection(w.wv, w.wv_fp8, kvw, D),
                                 .wo = WrapProjection(w.wo, w.wo_fp8, D, qw),
                                 .post_norm = Wrap(w.post_norm, 1, D),
                                 .w_gate = WrapProjection(w.w_gate, w.w_gate_fp8, I, D),
                                 .w_up = WrapProjection(w.w_up, w.w_up_fp8, I, D),
                                 .w_down = WrapProjection(w.w_down, w.w_down_fp8, D, I)});
    }
    tensors_.embedding = Wrap(weights_.embedding, c.vocab_size, D);
    tensors_.final_norm = Wrap(weights_.final_norm, 1, D);
    tensors_.lm_head = Wrap(weights_.lm_head, V, D);
  }

  bool batch_invariant_;  // Linear one row at a time (StepOptions::batch_invariant)
  ModelWeights weights_;
  ModelTensors tensors_;
  parallel::Communicator& tp_;
  parallel::Communicator& cp_;
  ThreadPool pool_;
  parallel::CpuRingOps ring_ops_;
  RopeTable rope_;
  float activation_scale_ub_;  // FP8 projections' per-token bound (fp8.h)
  Fp8LinearScratch fp8_scratch_;
  std::vector<HostBuffer> scratch_;
  Clock::time_point open_;
  std::optional<Clock::time_point> origin_;  // the first phase since ResetPhases()
  double origin_unix_s_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ModelBackend>> MakeCpuBackend(const ModelConfig& config,
                                                             ModelWeights weights,
                                                             parallel::Communicator& tp,
                                                             parallel::Communicator& cp,
                                                             int threads, bool batch_invariant) {
  CPFILL_RETURN_IF_ERROR(config.ValidateForTp(tp.size()));
  CPFILL_CHECK_ARG(weights.tp_size == tp.size() && weights.tp_rank == tp.rank(),
                   "weights are TP slice ", weights.tp_rank, " of ", weights.tp_size,
                   ", this rank is TP rank ", tp.rank(), " of ", tp.size());
  CPFILL_CHECK_ARG(static_cast<int>(weights.layers.size()) == config.num_layers, "weights have ",
                   weights.layers.size(), " layers, the config ", config.num_layers);
  return std::unique_ptr<ModelBackend>(
      new CpuBackend(config, std::move(weights), tp, cp, threads, batch_invariant));
}

absl::StatusOr<std::unique_ptr<LlamaModel>> CreateCpuModel(
    const ModelConfig& config, ModelWeights weights, parallel::Communicator& tp,
    parallel::Communicator& cp, parallel::Communicator& world, const StepOptions& options) {
  CPFILL_ASSIGN_OR_RETURN(auto backend, MakeCpuBackend(config, std::move(weights), tp, cp,
                                                       options.threads, options.batch_invariant));
  return LlamaModel::Create(config, std::move(backend), world, options);
}

}  // namespace cpfill::runtime::cpu
