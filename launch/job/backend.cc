#include "launch/job/backend.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/bfloat16.h"
#include "base/status.h"
#include "base/thread_pool.h"
#include "parallel/cuda/staged_attention.h"
#if CPFILL_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "attention/cuda/attention_cuda.h"
#include "parallel/cuda/cuda_ring_ops.h"
#include "parallel/cuda/device_buffer.h"
#include "parallel/cuda/nccl_communicator.h"
#endif

namespace cpfill::launch {
namespace {

using parallel::RingAlgorithm;
using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

double CausalFlops(const attention::AttentionShape& shape, int64_t tokens) {
  return 4.0 * shape.head_dim * shape.num_heads * (double(tokens) * (tokens + 1) / 2);
}

// ---- the host ring: CPU kernels, or the CUDA kernel staged from host memory ----------------

class HostRunner : public Runner {
 public:
  HostRunner(std::unique_ptr<parallel::MixedRing> ring, std::vector<float> q, std::vector<float> k,
             std::vector<float> v, int64_t lse_elems)
      : ring_(std::move(ring)), q_(std::move(q)), k_(std::move(k)), v_(std::move(v)) {
    o_.assign(q_.size(), std::nanf(""));  // poisoned: a row the ring misses stays NaN
    lse_.assign(lse_elems, std::nanf(""));
  }
  absl::Status Run(std::span<const RingAlgorithm> per_sequence, parallel::RingTimings* t,
                   parallel::RingAttention::StepCallback progress) override {
    return ring_->Run(per_sequence, q_.data(), k_.data(), v_.data(), o_.data(), lse_.data(), t,
                      std::move(progress));
  }
  absl::Status Fetch(std::vector<float>* o, std::vector<float>* lse) override {
    *o = o_;
    *lse = lse_;
    return absl::OkStatus();
  }

 private:
  std::unique_ptr<parallel::MixedRing> ring_;
  std::vector<float> q_, k_, v_, o_, lse_;
};

class HostBackend : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<Backend>> Make(std::string name,
                                                       const parallel::ProcessGrid& grid,
                                                       int threads) {
    std::unique_ptr<HostBackend> b(new HostBackend(std::move(name), grid, threads));
    if (b->name_ == "cuda-staged") {
      CPFILL_ASSIGN_OR_RETURN(b->staged_, parallel::CudaStagedAttention::Create(grid.host_rank));
      b->ops_ = std::make_unique<parallel::CpuRingOps>(
          &b->pool_, [staged = b->staged_.get()](const attention::AttentionParams& p) {
            return staged->Attend(p);
          });
    } else {
      b->ops_ = std::make_unique<parallel::CpuRingOps>(&b->pool_);
    }
    return std::unique_ptr<Backend>(std::move(b));
  }

  absl::StatusOr<std::unique_ptr<Runner>> MakeRunner(const sharding::ShardPlan& plan,
                                                     const attention::AttentionShape& shape,
                                                     const SyntheticAttention& batch,
                                                     const HeadSlice& slice) override {
    CPFILL_ASSIGN_OR_RETURN(auto ring,
                            parallel::MixedRing::Create(*grid_.cp, plan, shape, ops_.get()));
    const sharding::LocalLayout& layout = ring->layout();
    std::vector<float> q(layout.q_rows() * shape.num_heads * shape.head_dim);
    std::vector<float> k(layout.kv_rows() * shape.num_kv_heads * shape.head_dim), v(k.size());
    batch.FillLocal(layout, slice, q.data(), k.data(), v.data());
    const int64_t lse_elems = layout.q_rows() * shape.num_heads;
    return std::unique_ptr<Runner>(std::make_unique<HostRunner>(
        std::move(ring), std::move(q), std::move(k), std::move(v), lse_elems));
  }

  absl::StatusOr<double> MeasureTflops(const attention::AttentionShape& shape, int64_t tokens,
                                       int repeat) override {
    const std::vector<sharding::SequenceRequest> one = {{.new_tokens = tokens}};
    const SyntheticAttention batch{.sequences = one,
                                   .num_heads = shape.num_heads,
                                   .num_kv_heads = shape.num_kv_heads,
                                   .head_dim = shape.head_dim};
    std::vector<float> q(tokens * shape.num_heads * shape.head_dim),
        k(tokens * shape.num_kv_heads * shape.head_dim), v(k.size()), o(q.size()),
        lse(tokens * shape.num_heads);
    batch.FillGlobal(q.data(), k.data(), v.data());
    std::vector<double> rates;
    for (int r = 0; r <= repeat; ++r) {
      const auto t0 = Clock::now();
      CPFILL_RETURN_IF_ERROR(parallel::SingleRankAttention(one, shape, q.data(), k.data(), v.data(),
                                                           o.data(), lse.data(), ops_.get()));
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (r > 0) rates.push_back(CausalFlops(shape, tokens) / s / 1e12);  // run 0: warm-up
    }
    return Median(rates);
  }

  absl::StatusOr<double> MeasureRingGbps(int64_t bytes, int repeat) override {
    if (grid_.cp_size == 1) return 0.0;
    std::vector<char> send(bytes, 1), recv(bytes);
    std::vector<double> rates;
    for (int r = 0; r <= repeat; ++r) {
      CPFILL_RETURN_IF_ERROR(grid_.cp->Barrier());
      const auto t0 = Clock::now();
      CPFILL_ASSIGN_OR_RETURN(auto ex,
                              grid_.cp->StartRingExchange(send.data(), recv.data(), send.size()));
      CPFILL_RETURN_IF_ERROR(ex->Wait());
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (r > 0) rates.push_back(bytes / s / 1e9);
    }
    return Median(rates);
  }

 private:
  HostBackend(std::string name, const parallel::ProcessGrid& grid, int threads)
      : Backend(std::move(name)), grid_(grid), pool_(threads) {}
  const parallel::ProcessGrid& grid_;
  ThreadPool pool_;
  std::unique_ptr<parallel::CudaStagedAttention> staged_;  // cuda-staged only
  std::unique_ptr<parallel::CpuRingOps> ops_;  // one for every runner: buffers kept between plans
};

#if CPFILL_HAVE_CUDA
// ---- the device ring on NCCL ---------------------------------------------------------------

class DeviceRunner : public Runner {
 public:
  static absl::StatusOr<std::unique_ptr<Runner>> Make(parallel::NcclGrid& nccl,
                                                      parallel::CudaRingOps* ops,
                                                      const sharding::ShardPlan& plan,
                                                      const attention::AttentionShape& shape,
                                                      const SyntheticAttention& batch,
                                                      const HeadSlice& slice) {
    std::unique_ptr<DeviceRunner> r(new DeviceRunner(nccl.compute.get()));
    CPFILL_ASSIGN_OR_RETURN(r->ring_, parallel::MixedRing::Create(*nccl.cp, plan, shape, ops));
    const sharding::LocalLayout& layout = r->ring_->layout();
    std::vector<float> q(layout.q_rows() * shape.num_heads * shape.head_dim);
    std::vector<float> k(layout.kv_rows() * shape.num_kv_heads * shape.head_dim), v(k.size());
    batch.FillLocal(layout, slice, q.data(), k.data(), v.data());
    CPFILL_RETURN_IF_ERROR(r->Upload(r->q_, ToBfloat16(q)));
    CPFILL_RETURN_IF_ERROR(r->Upload(r->k_, ToBfloat16(k)));
    CPFILL_RETURN_IF_ERROR(r->Upload(r->v_, ToBfloat16(v)));
    r->o_elems_ = q.size();
    r->lse_elems_ = layout.q_rows() * shape.num_heads;
    CPFILL_RETURN_IF_ERROR(r->o_.Reserve(std::max<size_t>(16, r->o_elems_ * 4)));
    CPFILL_RETURN_IF_ERROR(r->lse_.Reserve(std::max<size_t>(16, r->lse_elems_ * 4)));
    // Poisoned (NaN bytes), so a row the ring misses shows. Everything on the compute stream:
    // it does not synchronize with the legacy default stream.
    CPFILL_CUDA_CHECK(cudaMemsetAsync(r->o_.As<void>(), 0xFF, r->o_elems_ * 4, r->stream_));
    CPFILL_CUDA_CHECK(cudaMemsetAsync(r->lse_.As<void>(), 0xFF, r->lse_elems_ * 4, r->stream_));
    CPFILL_CUDA_CHECK(cudaStreamSynchronize(r->stream_));
    return std::unique_ptr<Runner>(std::move(r));
  }
  absl::Status Run(std::span<const RingAlgorithm> per_sequence, parallel::RingTimings* t,
                   parallel::RingAttention::StepCallback progress) override {
    // The device ring reports its steps once the run is done.
    return ring_->Run(per_sequence, q_.As<void>(), k_.As<void>(), v_.As<void>(), o_.As<float>(),
                      lse_.As<float>(), t, std::move(progress));
  }
  absl::Status Fetch(std::vector<float>* o, std::vector<float>* lse) override {
    o->resize(o_elems_);
    lse->resize(lse_elems_);
    CPFILL_CUDA_CHECK(
        cudaMemcpyAsync(o->data(), o_.As<void>(), o_elems_ * 4, cudaMemcpyDeviceToHost, stream_));
    CPFILL_CUDA_CHECK(cudaMemcpyAsync(lse->data(), lse_.As<void>(), lse_elems_ * 4,
                                      cudaMemcpyDeviceToHost, stream_));
    CPFILL_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

 private:
  explicit DeviceRunner(cudaStream_t stream) : stream_(stream) {}
  absl::Status Upload(parallel::DeviceBuffer& dst, const std::vector<uint16_t>& bits) {
    CPFILL_RETURN_IF_ERROR(dst.Reserve(std::max<size_t>(16, bits.size() * 2)));
    CPFILL_CUDA_CHECK(cudaMemcpyAsync(dst.As<void>(), bits.data(), bits.size() * 2,
                                      cudaMemcpyHostToDevice, stream_));
    CPFILL_CUDA_CHECK(cudaStreamSynchronize(stream_));  // `bits` is a temporary
    return absl::OkStatus();
  }
  cudaStream_t stream_;
  std::unique_ptr<parallel::MixedRing> ring_;
  parallel::DeviceBuffer q_, k_, v_, o_, lse_;
  size_t o_elems_ = 0, lse_elems_ = 0;
};

class DeviceBackend : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<Backend>> Make(const parallel::ProcessGrid& grid,
                                                       parallel::CommOptions options) {
    std::unique_ptr<DeviceBackend> b(new DeviceBackend());
    CPFILL_ASSIGN_OR_RETURN(b->nccl_, parallel::CreateNcclGrid(grid, options));
    CPFILL_ASSIGN_OR_RETURN(b->ops_,
                            parallel::CudaRingOps::Create(*b->nccl_.cp, b->nccl_.compute.get()));
    return std::unique_ptr<Backend>(std::move(b));
  }

  absl::StatusOr<std::unique_ptr<Runner>> MakeRunner(const sharding::ShardPlan& plan,
                                                     const attention::AttentionShape& shape,
                                                     const SyntheticAttention& batch,
                                                     const HeadSlice& slice) override {
    return DeviceRunner::Make(nccl_, ops_.get(), plan, shape, batch, slice);
  }

  absl::StatusOr<double> MeasureTflops(const attention::AttentionShape& shape, int64_t tokens,
                                       int repeat) override {
    const cudaStream_t stream = nccl_.compute.get();
    parallel::DeviceBuffer q, kv, pos, o, lse, ws;
    const size_t qn = tokens * shape.num_heads * shape.head_dim;
    const size_t kvn = tokens * shape.num_kv_heads * shape.head_dim;
    std::vector<uint16_t> hq(qn), hkv(kvn);
    const SyntheticAttention batch{.sequences = {{.new_tokens = tokens}},
                                   .num_heads = shape.num_heads,
                                   .num_kv_heads = shape.num_kv_heads,
                                   .head_dim = shape.head_dim};
    std::vector<float> fq(qn), fk(kvn), fv(kvn);
    batch.FillGlobal(fq.data(), fk.data(), fv.data());
    std::vector<int32_t> hpos(tokens);
    for (int64_t i = 0; i < tokens; ++i) hpos[i] = static_cast<int32_t>(i);
    CPFILL_RETURN_IF_ERROR(q.Reserve(qn * 2));
    CPFILL_RETURN_IF_ERROR(kv.Reserve(2 * kvn * 2));
    CPFILL_RETURN_IF_ERROR(pos.Reserve(tokens * 4));
    CPFILL_RETURN_IF_ERROR(o.Reserve(qn * 2));
    CPFILL_RETURN_IF_ERROR(lse.Reserve(tokens * shape.num_heads * 4));
    const std::vector<uint16_t> bq = ToBfloat16(fq), bk = ToBfloat16(fk), bv = ToBfloat16(fv);
    // On the compute stream (non-blocking: not ordered after the legacy default stream).
    CPFILL_CUDA_CHECK(
        cudaMemcpyAsync(q.As<void>(), bq.data(), qn * 2, cudaMemcpyHostToDevice, stream));
    CPFILL_CUDA_CHECK(
        cudaMemcpyAsync(kv.As<void>(), bk.data(), kvn * 2, cudaMemcpyHostToDevice, stream));
    CPFILL_CUDA_CHECK(
        cudaMemcpyAsync(kv.As<char>(kvn * 2), bv.data(), kvn * 2, cudaMemcpyHostToDevice, stream));
    CPFILL_CUDA_CHECK(
        cudaMemcpyAsync(pos.As<void>(), hpos.data(), tokens * 4, cudaMemcpyHostToDevice, stream));
    CPFILL_CUDA_CHECK(cudaStreamSynchronize(stream));
    const attention::SequenceSlice slice{0, tokens, 0, tokens};
    const attention::cuda::CudaAttentionArgs a{.shape = shape,
                                               .q = q.As<__nv_bfloat16>(),
                                               .q_pos = pos.As<int32_t>(),
                                               .q_tokens = tokens,
                                               .k = kv.As<__nv_bfloat16>(),
                                               .v = kv.As<__nv_bfloat16>(kvn * 2),
                                               .k_pos = pos.As<int32_t>(),
                                               .kv_tokens = tokens,
                                               .slices = &slice,
                                               .num_slices = 1,
                                               .output = attention::cuda::OutputMode::kBfloat16,
                                               .o = o.As<void>(),
                                               .lse = lse.As<float>()};
    const size_t ws_bytes = std::max<size_t>(256, attention::cuda::AttentionWorkspaceBytes(a));
    CPFILL_RETURN_IF_ERROR(ws.Reserve(ws_bytes));
    cudaEvent_t e0, e1;
    CPFILL_CUDA_CHECK(cudaEventCreate(&e0));
    CPFILL_CUDA_CHECK(cudaEventCreate(&e1));
    std::vector<double> rates;
    absl::Status status;
    for (int r = 0; r <= repeat && status.ok(); ++r) {
      cudaEventRecord(e0, stream);
      status = attention::cuda::PartialAttentionCuda(a, ws.As<void>(), ws_bytes, stream);
      cudaEventRecord(e1, stream);
      if (cudaEventSynchronize(e1) != cudaSuccess) status = absl::InternalError("CUDA failure");
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      if (r > 0 && ms > 0) rates.push_back(CausalFlops(shape, tokens) / (ms / 1e3) / 1e12);
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    CPFILL_RETURN_IF_ERROR(status);
    return Median(rates);
  }

  absl::StatusOr<int64_t> FreeDeviceBytes() override {
    size_t free = 0, total = 0;
    CPFILL_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return static_cast<int64_t>(free);
  }
  bool on_device() const override { return true; }

  absl::StatusOr<double> MeasureRingGbps(int64_t bytes, int repeat) override {
    if (nccl_.cp->size() == 1) return 0.0;
    parallel::DeviceBuffer send, recv;
    CPFILL_RETURN_IF_ERROR(send.Reserve(bytes));
    CPFILL_RETURN_IF_ERROR(recv.Reserve(bytes));
    std::vector<double> rates;
    for (int r = 0; r <= repeat; ++r) {
      CPFILL_RETURN_IF_ERROR(nccl_.cp->Barrier());
      CPFILL_ASSIGN_OR_RETURN(auto ex,
                              nccl_.cp->StartRingExchange(send.As<void>(), recv.As<void>(), bytes));
      CPFILL_RETURN_IF_ERROR(ex->Wait());
      CPFILL_RETURN_IF_ERROR(nccl_.cp->Synchronize());
      const double s = ex->transfer_s();
      if (r > 0 && s > 0) rates.push_back(bytes / s / 1e9);
    }
    return Median(rates);
  }

 private:
  DeviceBackend() : Backend("cuda") {}
  parallel::NcclGrid nccl_;
  std::unique_ptr<parallel::CudaRingOps> ops_;  // one for every runner: buffers kept between plans
};
#endif  // CPFILL_HAVE_CUDA

}  // namespace

std::string Backend::Description() const {
  if (name_ == "cuda") return "CUDA (device ring on NCCL, bf16)";
  if (name_ == "cuda-staged") return "CUDA kernels in the host ring (staged, bf16)";
  return "CPU (fp32)";
}

absl::StatusOr<std::string> ResolveBackendName(std::string name,
                                               const std::vector<std::string>& valid,
                                               parallel::Communicator& world) {
  if (name != "auto" && std::find(valid.begin(), valid.end(), name) == valid.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--backend: unknown backend '", name, "' (valid: auto, ", absl::StrJoin(valid, ", "), ")"));
  }
  // Every rank must see a GPU for a CUDA backend: agree on it before anything starts, so a
  // missing GPU is one clean message rather than one rank's abort.
  int32_t have = parallel::CudaBackendAvailable() ? 1 : 0;
  CPFILL_RETURN_IF_ERROR(
      world.AllReduce(&have, 1, parallel::DataType::kInt32, parallel::ReduceOp::kMin));
  if (name == "auto") name = have ? "cuda" : "cpu";
  if (name != "cpu" && !have) {
    return absl::FailedPreconditionError(
        absl::StrCat("--backend ", name,
                     ": a rank sees no CUDA device (or this cpfill was built "
                     "without the CUDA backend); use --backend cpu"));
  }
  return name;
}

absl::StatusOr<std::unique_ptr<Backend>> Backend::Create(std::string name,
                                                         const parallel::ProcessGrid& grid,
                                                         parallel::CommOptions options,
                                                         int threads) {
  CPFILL_ASSIGN_OR_RETURN(name,
                          ResolveBackendName(name, {"cpu", "cuda", "cuda-staged"}, *grid.world));
#if CPFILL_HAVE_CUDA
  if (name == "cuda") return DeviceBackend::Make(grid, options);
#endif
  return HostBackend::Make(std::move(name), grid, threads);
}

}  // namespace cpfill::launch
