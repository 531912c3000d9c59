#include "runtime/cuda/llama_model_cuda.h"

#include <chrono>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/bfloat16.h"
#include "base/status.h"
#include "runtime/cpu/layers.h"
#include "runtime/cuda/layer_kernels.h"

namespace cpfill::runtime::cuda {
namespace {

using Bf16 = __nv_bfloat16;
using Clock = std::chrono::steady_clock;

}  // namespace

absl::Status LlamaModelCuda::Upload(parallel::DeviceBuffer& dst, const std::vector<float>& host) {
  const std::vector<uint16_t> bits = ToBfloat16(host);
  CPFILL_RETURN_IF_ERROR(dst.Reserve(std::max<size_t>(16, bits.size() * 2)));
  CPFILL_CUDA_CHECK(cudaMemcpyAsync(dst.As<void>(), bits.data(), bits.size() * 2,
                                    cudaMemcpyHostToDevice, nccl_.compute.get()));
  CPFILL_CUDA_CHECK(cudaStreamSynchronize(nccl_.compute.get()));  // `bits` is a temporary
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<LlamaModelCuda>> LlamaModelCuda::Create(
    const ModelConfig& config, const ModelWeights& weights, parallel::NcclGrid& nccl,
    parallel::Communicator& world, PrefillOptions options) {
  CPFILL_RETURN_IF_ERROR(config.ValidateForTp(nccl.tp->size()));
  CPFILL_CHECK_ARG(weights.tp_size == nccl.tp->size() && weights.tp_rank == nccl.tp->rank(),
                   "weights are TP slice ", weights.tp_rank, " of ", weights.tp_size,
                   ", this rank is TP rank ", nccl.tp->rank(), " of ", nccl.tp->size());
  CPFILL_CHECK_ARG(attention::cuda::SupportedHeadDim(config.head_dim), "head_dim ", config.head_dim,
                   " has no CUDA attention kernel (64, 128)");
  std::unique_ptr<LlamaModelCuda> m(new LlamaModelCuda(config, nccl, world, options));
  CPFILL_RETURN_IF_ERROR(m->gemm_.Init(nccl.compute.get()));
  m->layers_.resize(config.num_layers);
  for (int l = 0; l < config.num_layers; ++l) {
    const LayerWeights& w = weights.layers[l];
    LayerDevice& d = m->layers_[l];
    for (auto [dst, src] : {std::pair{&d.input_norm, &w.input_norm},
                            {&d.wq, &w.wq},
                            {&d.wk, &w.wk},
                            {&d.wv, &w.wv},
                            {&d.wo, &w.wo},
                            {&d.post_norm, &w.post_norm},
                            {&d.w_gate, &w.w_gate},
                            {&d.w_up, &w.w_up},
                            {&d.w_down, &w.w_down}}) {
      CPFILL_RETURN_IF_ERROR(m->Upload(*dst, *src));
    }
  }
  CPFILL_RETURN_IF_ERROR(m->Upload(m->embedding_, weights.embedding));
  CPFILL_RETURN_IF_ERROR(m->Upload(m->final_norm_, weights.final_norm));
  CPFILL_RETURN_IF_ERROR(m->Upload(m->lm_head_, weights.lm_head));
  const cpu::RopeTable rope = cpu::RopeTable::Make(config);
  CPFILL_RETURN_IF_ERROR(m->inv_freq_.Reserve(rope.inv_freq().size() * sizeof(double)));
  CPFILL_CUDA_CHECK(cudaMemcpy(m->inv_freq_.As<void>(), rope.inv_freq().data(),
                               rope.inv_freq().size() * sizeof(double), cudaMemcpyHostToDevice));
  return m;
}

LlamaModelCuda::PhaseEvents::~PhaseEvents() {
  for (cudaEvent_t e : pool_) cudaEventDestroy(e);
}

absl::StatusOr<cudaEvent_t> LlamaModelCuda::PhaseEvents::Next() {
  if (used_ == pool_.size()) {
    cudaEvent_t e;
    CPFILL_CUDA_CHECK(cudaEventCreate(&e));
    pool_.push_back(e);
  }
  return pool_[used_++];
}

absl::Status LlamaModelCuda::PhaseEvents::Begin(cudaStream_t stream) {
  CPFILL_ASSIGN_OR_RETURN(open_, Next());
  CPFILL_CUDA_CHECK(cudaEventRecord(open_, stream));
  return absl::OkStatus();
}

absl::Status LlamaModelCuda::PhaseEvents::End(cudaStream_t stream, double* seconds) {
  CPFILL_ASSIGN_OR_RETURN(cudaEvent_t end, Next());
  CPFILL_CUDA_CHECK(cudaEventRecord(end, stream));
  pending_.emplace_back(seconds, open_, end);
  return absl::OkStatus();
}

void LlamaModelCuda::PhaseEvents::Collect() {
  for (auto [seconds, begin, end] : pending_) {
    float ms = 0;
    if (cudaEventElapsedTime(&ms, begin, end) == cudaSuccess) *seconds += ms / 1e3;
  }
  Reset();
}

void LlamaModelCuda::PhaseEvents::Reset() {
  pending_.clear();
  used_ = 0;
}

int64_t LlamaModelCuda::kv_tokens_held() const {
  int64_t held = 0;
  for (const auto& [name, s] : sessions_) held += s.where.layout.tokens(nccl_.cp->rank(), 0);
  return held;
}

absl::StatusOr<std::vector<SequenceOutput>> LlamaModelCuda::Prefill(
    const std::vector<PrefillRequest>& batch, PrefillTimings* timings,
    const std::function<void(int)>& progress) {
  PrefillTimings local_t;
  PrefillTimings& t = timings ? *timings : local_t;
  t = PrefillTimings{};
  phases_.Reset();
  const auto t_start = Clock::now();
  const ModelConfig& c = config_;
  const cudaStream_t stream = nccl_.compute.get();
  parallel::NcclCommunicator& tp = *nccl_.tp;
  const int n_tp = tp.size(), n_cp = nccl_.cp->size(), me = nccl_.cp->rank();
  const int hq = c.num_heads / n_tp, hkv = c.num_kv_heads / n_tp, hd = c.head_dim;
  const int64_t D = c.hidden_size, I = c.intermediate_size / n_tp, V = c.vocab_size / n_tp;
  const int64_t qw = int64_t{hq} * hd, kvw = int64_t{hkv} * hd;
  const float eps = static_cast<float>(c.rms_norm_eps);

  // Each phase is bracketed by events on the compute stream: its GPU time is its own, and the
  // host runs ahead enqueueing the next phase (the ring and the LM head still wait on the host).
  auto phase = [&](double& acc, const std::function<absl::Status()>& fn) -> absl::Status {
    CPFILL_RETURN_IF_ERROR(phases_.Begin(stream));
    CPFILL_RETURN_IF_ERROR(fn());
    return phases_.End(stream, &acc);
  };

  // Step 0: plan, capacity and algorithm, exactly as the CPU model.
  CPFILL_ASSIGN_OR_RETURN(
      BatchPlan b,
      PlanBatch(c, batch, n_cp, me, [&](const std::string& name) -> const SessionLayout* {
        auto it = sessions_.find(name);
        return it == sessions_.end() ? nullptr : &it->second.where;
      }));
  CPFILL_RETURN_IF_ERROR(
      CheckKvCapacity(b, kv_tokens_held(), options_.kv_capacity_tokens, batch.size(), world_));
  const sharding::LocalLayout& layout = b.layout;
  const int64_t T = layout.q_rows(), R = layout.kv_rows();
  // The selector's choice for the whole batch (every rank computes the same).
  CPFILL_RETURN_IF_ERROR(ChooseAlgorithm(options_, c, n_tp, n_cp, b, &t));
  const attention::AttentionShape shape{.num_heads = hq,
                                        .num_kv_heads = hkv,
                                        .head_dim = hd,
                                        .softmax_scale = 1.0f / std::sqrt(float(hd)),
                                        .causal = true};
  CPFILL_ASSIGN_OR_RETURN(auto ring,
                          parallel::DeviceRingAttention::Create(*nccl_.cp, b.plan, shape, stream,
                                                                       &work_.ring));

  // Buffers for this batch (device), grown if this batch is the largest so far.
  Workspace& w = work_;
  const auto reserve = [](parallel::DeviceBuffer& buf, int64_t bytes) {
    return buf.Reserve(std::max<int64_t>(16, bytes));
  };
  for (auto [buf, bytes] : {std::pair{&w.ids, T * 4},
                            {&w.qpos, T * 4},
                            {&w.x, T * D * 4},
                            {&w.h, T * D * 2},
                            {&w.q, T * qw * 2},
                            {&w.kn, T * kvw * 2},
                            {&w.vn, T * kvw * 2},
                            {&w.k_all, R * kvw * 2},
                            {&w.v_all, R * kvw * 2},
                            {&w.attn, T * qw * 4},
                            {&w.lse, T * hq * 4},
                            {&w.attn16, T * qw * 2},
                            {&w.proj, T * D * 4},
                            {&w.gate, T * I * 2},
                            {&w.up, T * I * 2}}) {
    CPFILL_RETURN_IF_ERROR(reserve(*buf, bytes));
  }
  // Aliases, so the layer code reads as the math.
  parallel::DeviceBuffer &ids = w.ids, &qpos = w.qpos, &x = w.x, &h = w.h, &q = w.q, &kn = w.kn,
                         &vn = w.vn, &k_all = w.k_all, &v_all = w.v_all, &attn = w.attn,
                         &lse = w.lse, &attn16 = w.attn16, &proj = w.proj, &gate = w.gate,
                         &up = w.up;
  CPFILL_CUDA_CHECK(
      cudaMemcpyAsync(ids.As<void>(), b.local_ids.data(), T * 4, cudaMemcpyHostToDevice, stream));
  CPFILL_CUDA_CHECK(cudaMemcpyAsync(qpos.As<void>(), layout.q_positions.data(), T * 4,
                                    cudaMemcpyHostToDevice, stream));
  CPFILL_RETURN_IF_ERROR(phase(t.embed_s, [&] {
    return EmbedToF32(ids.As<int32_t>(), T, embedding_.As<Bf16>(), D, x.As<float>(), stream);
  }));

  // New cache rows of each session, committed only when the whole prefill succeeded.
  std::vector<Session> pending(b.plan.num_sequences());
  for (int s = 0; s < b.plan.num_sequences(); ++s) {
    if (batch[s].session.empty()) continue;
    pending[s].k.resize(c.num_layers);
    pending[s].v.resize(c.num_layers);
    pending[s].rows.assign(c.num_layers, 0);
  }

  for (int l = 0; l < c.num_layers; ++l) {
    const LayerDevice& lw = layers_[l];
    CPFILL_RETURN_IF_ERROR(phase(t.other_s, [&] {
      return RmsNormToBf16(x.As<float>(), lw.input_norm.As<Bf16>(), T, D, eps, h.As<Bf16>(), stream);
    }));
    CPFILL_RETURN_IF_ERROR(phase(t.gemm_s, [&]() -> absl::Status {
      CPFILL_RETURN_IF_ERROR(
          gemm_.Linear(h.As<Bf16>(), T, D, lw.wq.As<Bf16>(), qw, q.As<void>(), OutType::kBfloat16));
      CPFILL_RETURN_IF_ERROR(gemm_.Linear(h.As<Bf16>(), T, D, lw.wk.As<Bf16>(), kvw, kn.As<void>(),
                                          OutType::kBfloat16));
      return gemm_.Linear(h.As<Bf16>(), T, D, lw.wv.As<Bf16>(), kvw, vn.As<void>(),
                          OutType::kBfloat16);
    }));
    CPFILL_RETURN_IF_ERROR(phase(t.other_s, [&]() -> absl::Status {
      CPFILL_RETURN_IF_ERROR(
          RopeBf16(q.As<Bf16>(), qpos.As<int32_t>(), T, hq, hd, inv_freq_.As<double>(), stream));
      CPFILL_RETURN_IF_ERROR(
          RopeBf16(kn.As<Bf16>(), qpos.As<int32_t>(), T, hkv, hd, inv_freq_.As<double>(), stream));
      // K/V rows of every sequence in the local layout: its cached rows, then the new ones.
      for (int s = 0; s < b.plan.num_sequences(); ++s) {
        const int64_t dst = layout.kv_offset[s], n_new = layout.q_len[s];
        const int64_t n_cached = layout.kv_len[s] - n_new;
        if (n_cached > 0) {
          const Session& old = sessions_.at(batch[s].session);
          CPFILL_CHECK_INTERNAL(old.rows[l] == n_cached, "session '", batch[s].session, "' holds ",
                                old.rows[l], " rows, the plan says ", n_cached);
          CPFILL_CUDA_CHECK(cudaMemcpyAsync(k_all.As<char>(dst * kvw * 2), old.k[l]->As<void>(),
                                            n_cached * kvw * 2, cudaMemcpyDeviceToDevice, stream));
          CPFILL_CUDA_CHECK(cudaMemcpyAsync(v_all.As<char>(dst * kvw * 2), old.v[l]->As<void>(),
                                            n_cached * kvw * 2, cudaMemcpyDeviceToDevice, stream));
        }
        if (n_new > 0) {
          CPFILL_CUDA_CHECK(cudaMemcpyAsync(k_all.As<char>((dst + n_cached) * kvw * 2),
                                            kn.As<char>(layout.q_offset[s] * kvw * 2),
                                            n_new * kvw * 2, cudaMemcpyDeviceToDevice, stream));
          CPFILL_CUDA_CHECK(cudaMemcpyAsync(v_all.As<char>((dst + n_cached) * kvw * 2),
                                            vn.As<char>(layout.q_offset[s] * kvw * 2),
                                            n_new * kvw * 2, cudaMemcpyDeviceToDevice, stream));
        }
        if (!batch[s].session.empty()) {
          const int64_t rows = layout.kv_len[s];
          pending[s].rows[l] = rows;
          for (auto* kv : {&pending[s].k[l], &pending[s].v[l]}) {
            *kv = std::make_unique<parallel::DeviceBuffer>();
            CPFILL_RETURN_IF_ERROR((*kv)->Reserve(std::max<int64_t>(16, rows * kvw * 2)));
          }
          CPFILL_CUDA_CHECK(cudaMemcpyAsync(pending[s].k[l]->As<void>(),
                                            k_all.As<char>(dst * kvw * 2), rows * kvw * 2,
                                            cudaMemcpyDeviceToDevice, stream));
          CPFILL_CUDA_CHECK(cudaMemcpyAsync(pending[s].v[l]->As<void>(),
                                            v_all.As<char>(dst * kvw * 2), rows * kvw * 2,
                                            cudaMemcpyDeviceToDevice, stream));
        }
      }
      return absl::OkStatus();
    }));
    CPFILL_RETURN_IF_ERROR(phase(t.attention_s, [&]() -> absl::Status {
      parallel::RingTimings rt;
      CPFILL_RETURN_IF_ERROR(ring->Run(t.algorithm, q.As<Bf16>(), k_all.As<Bf16>(),
                                       v_all.As<Bf16>(), attn.As<float>(), lse.As<float>(), &rt));
      return F32ToBf16(attn.As<float>(), T * qw, attn16.As<Bf16>(), stream);
    }));
    // o projection, row-parallel: partial sums in fp32, added up over the TP group.
    CPFILL_RETURN_IF_ERROR(phase(t.gemm_s, [&] {
      return gemm_.Linear(attn16.As<Bf16>(), T, qw, lw.wo.As<Bf16>(), D, proj.As<void>(),
                          OutType::kFloat32);
    }));
    if (n_tp > 1) {
      CPFILL_RETURN_IF_ERROR(phase(t.allreduce_s, [&] {
        return tp.AllReduce(proj.As<float>(), T * D, parallel::DataType::kFloat32,
                            parallel::ReduceOp::kSum);
      }));
    }
    CPFILL_RETURN_IF_ERROR(phase(t.other_s, [&]() -> absl::Status {
      CPFILL_RETURN_IF_ERROR(AddF32(x.As<float>(), proj.As<float>(), T * D, stream));
      return RmsNormToBf16(x.As<float>(), lw.post_norm.As<Bf16>(), T, D, eps, h.As<Bf16>(), stream);
    }));
    CPFILL_RETURN_IF_ERROR(phase(t.gemm_s, [&]() -> absl::Status {
      CPFILL_RETURN_IF_ERROR(gemm_.Linear(h.As<Bf16>(), T, D, lw.w_gate.As<Bf16>(), I,
                                          gate.As<void>(), OutType::kBfloat16));
      CPFILL_RETURN_IF_ERROR(gemm_.Linear(h.As<Bf16>(), T, D, lw.w_up.As<Bf16>(), I, up.As<void>(),
                                          OutType::kBfloat16));
      CPFILL_RETURN_IF_ERROR(
          SwiGluBf16(gate.As<Bf16>(), up.As<Bf16>(), T * I, gate.As<Bf16>(), stream));
      return gemm_.Linear(gate.As<Bf16>(), T, I, lw.w_down.As<Bf16>(), D, proj.As<void>(),
                          OutType::kFloat32);
    }));
    if (n_tp > 1) {
      CPFILL_RETURN_IF_ERROR(phase(t.allreduce_s, [&] {
        return tp.AllReduce(proj.As<float>(), T * D, parallel::DataType::kFloat32,
                            parallel::ReduceOp::kSum);
      }));
    }
    CPFILL_RETURN_IF_ERROR(
        phase(t.other_s, [&] { return AddF32(x.As<float>(), proj.As<float>(), T * D, stream); }));
    if (progress) progress(l);
  }
  CPFILL_RETURN_IF_ERROR(tp.Synchronize());
  phases_.Collect();

  // Step 3: logits at the last positions (this TP rank's vocabulary slice), on world rank 0.
  const auto lm0 = Clock::now();
  const auto rows = LastPositionRows(b);
  std::vector<float> logits(rows.size() * V);
  if (!rows.empty()) {
    parallel::DeviceBuffer &last = w.last, &normed = w.normed, &dev_logits = w.logits;
    CPFILL_RETURN_IF_ERROR(last.Reserve(rows.size() * D * 4));
    CPFILL_RETURN_IF_ERROR(normed.Reserve(rows.size() * D * 2));
    CPFILL_RETURN_IF_ERROR(dev_logits.Reserve(rows.size() * V * 4));
    for (size_t i = 0; i < rows.size(); ++i) {
      CPFILL_CUDA_CHECK(cudaMemcpyAsync(last.As<char>(i * D * 4),
                                        x.As<char>(rows[i].second * D * 4), D * 4,
                                        cudaMemcpyDeviceToDevice, stream));
    }
    CPFILL_RETURN_IF_ERROR(RmsNormToBf16(last.As<float>(), final_norm_.As<Bf16>(), rows.size(), D,
                                         eps, normed.As<Bf16>(), stream));
    CPFILL_RETURN_IF_ERROR(gemm_.Linear(normed.As<Bf16>(), rows.size(), D, lm_head_.As<Bf16>(), V,
                                        dev_logits.As<void>(), OutType::kFloat32));
    CPFILL_CUDA_CHECK(cudaMemcpyAsync(logits.data(), dev_logits.As<void>(), logits.size() * 4,
                                      cudaMemcpyDeviceToHost, stream));
    CPFILL_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  CPFILL_ASSIGN_OR_RETURN(
      std::vector<SequenceOutput> out,
      GatherLastLogits(c, b.plan.num_sequences(), rows, logits, tp.rank(), n_tp, world_));
  t.lm_head_s += std::chrono::duration<double>(Clock::now() - lm0).count();

  // Step 4: the sessions' caches now hold this turn too.
  for (int s = 0; s < b.plan.num_sequences(); ++s) {
    if (batch[s].session.empty()) continue;
    pending[s].where = SessionAfter(b, s);
    sessions_[batch[s].session] = std::move(pending[s]);
  }
  t.total_s = std::chrono::duration<double>(Clock::now() - t_start).count();
  return out;
}

}  // namespace cpfill::runtime::cuda
