#include <cmath>
#include <cub/block/block_scan.cuh>

#include "absl/strings/str_cat.h"
#include "attention/sparq/cuda/sparq_cuda.h"
#include "base/status.h"

namespace cpfill::attention::sparq::cuda {
namespace {

constexpr int kScoreThreads = 256;
constexpr int kTopKThreads = 1024;
constexpr int kAttendThreads = 128;
constexpr uint32_t kWindowBit = 0x80000000u;  // window positions rank above every key

// One kernel parameter block for all three kernels (pointers, strides, scalars).
struct SparqParams {
  int num_heads, num_kv_heads, head_dim, r, top_k, local_window, chunks;
  int64_t kv_rows;
  const __nv_bfloat16 *q, *k, *v;
  const int64_t *kv_begin, *kv_len;
  const float* v_sum;
  float* o;
  float* logits;       // [num_heads, kv_rows]
  uint32_t* keys;      // [num_kv_heads, kv_rows]
  float2* chunk_norm;  // [num_seqs, num_heads, chunks]: (max, sum of exp(x - max))
  float* lse;          // [num_seqs, num_heads]
  float* alpha;        // [num_seqs, num_heads]
  int32_t* sel;        // [num_seqs, num_kv_heads, k]
};

struct Layout {
  size_t logits = 0, keys = 0, norms = 0, lse = 0, alpha = 0, sel = 0, total = 0;
};
size_t Align256(size_t x) { return (x + 255) / 256 * 256; }
int Chunks(int64_t max_kv_len) {
  return static_cast<int>(std::max<int64_t>(1, (max_kv_len + kScoreChunk - 1) / kScoreChunk));
}
Layout MakeLayout(const SparqCudaArgs& a) {
  Layout l;
  const SparqShape& sh = a.shape;
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t o = at;
    at += Align256(bytes);
    return o;
  };
  l.logits = take(sizeof(float) * sh.num_heads * a.kv_rows);
  l.keys = take(sizeof(uint32_t) * sh.num_kv_heads * a.kv_rows);
  l.norms = take(sizeof(float2) * a.num_seqs * sh.num_heads * Chunks(a.max_kv_len));
  l.lse = take(sizeof(float) * a.num_seqs * sh.num_heads);
  l.alpha = take(sizeof(float) * a.num_seqs * sh.num_heads);
  l.sel = take(sizeof(int32_t) * a.num_seqs * sh.num_kv_heads * a.config.k);
  l.total = at;
  return l;
}

__device__ __forceinline__ float2 MergeNorm(float2 a, float2 b) {
  if (b.x == -INFINITY) return a;
  if (a.x == -INFINITY) return b;
  return b.x > a.x ? make_float2(b.x, b.y + a.y * expf(a.x - b.x))
                   : make_float2(a.x, a.y + b.y * expf(b.x - a.x));
}
__device__ __forceinline__ float WarpSum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float WarpMax(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// i1 in ascending component order and q_g[i1] / tau_g, as PrepareGroupQuery (sparq_cpu.cc).
// Shared: mass/flag [head_dim], comp [head_dim], tau [G], q_hat [G][head_dim].
template <int G>
__device__ void PrepareQuery(const SparqParams& p, const __nv_bfloat16* q, float* mass, int* comp,
                             float* tau, float* q_hat) {
  const int d = p.head_dim;
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    float m = 0;
    for (int g = 0; g < G; ++g) m += fabsf(__bfloat162float(q[g * d + c]));
    mass[c] = m;
  }
  __syncthreads();
  unsigned chosen = 0;  // bit i: this thread's i-th component is in i1 (a mask, not an array:
                        // a dynamically indexed array went to the stack)
  for (int c = threadIdx.x, i = 0; c < d; c += blockDim.x, ++i) {
    int rank = 0;  // larger mass first, lower index on ties
    for (int o = 0; o < d; ++o) rank += mass[o] > mass[c] || (mass[o] == mass[c] && o < c);
    if (rank < p.r) chosen |= 1u << i;
  }
  __syncthreads();
  for (int c = threadIdx.x, i = 0; c < d; c += blockDim.x, ++i) mass[c] = (chosen >> i) & 1u;
  __syncthreads();
  for (int c = threadIdx.x, i = 0; c < d; c += blockDim.x, ++i) {
    if (((chosen >> i) & 1u) == 0) continue;
    int slot = 0;
    for (int o = 0; o < c; ++o) slot += mass[o] != 0.f;
    comp[slot] = c;
  }
  __syncthreads();
  if (threadIdx.x < G) {
    const int g = threadIdx.x;
    float l1_all = 0, l1_hat = 0;
    for (int c = 0; c < d; ++c) l1_all += fabsf(__bfloat162float(q[g * d + c]));
    for (int t = 0; t < p.r; ++t) l1_hat += fabsf(__bfloat162float(q[g * d + comp[t]]));
    tau[g] = sqrtf(d * (l1_all > 0 ? l1_hat / l1_all : 1.0f));
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * p.r; i += blockDim.x) {
    const int g = i / p.r, t = i % p.r;
    q_hat[g * d + t] = __bfloat162float(q[g * d + comp[t]]) / tau[g];
  }
  __syncthreads();
}

// Kernel 1: approximate logits of one chunk of one group, and the chunk's normaliser per head.
template <int G>
__global__ void __launch_bounds__(kScoreThreads)
    ApproxScoresKernel(const __grid_constant__ SparqParams p) {
  __shared__ float mass[256], tau[G], q_hat[G * 256];
  __shared__ int comp[256];
  __shared__ float2 warp_norm[kScoreThreads / 32][G];
  const int seq = blockIdx.y / p.num_kv_heads, kvh = blockIdx.y % p.num_kv_heads;
  const int64_t n = p.kv_len[seq], begin = p.kv_begin[seq];
  const int64_t start = static_cast<int64_t>(blockIdx.x) * kScoreChunk;
  const int64_t end = min(n, start + kScoreChunk);
  const int d = p.head_dim;
  PrepareQuery<G>(p, p.q + (static_cast<int64_t>(seq) * p.num_heads + kvh * G) * d, mass, comp, tau,
                  q_hat);
  float2 norm[G];
  for (int g = 0; g < G; ++g) norm[g] = make_float2(-INFINITY, 0.f);
  for (int64_t j = start + threadIdx.x; j < end; j += kScoreThreads) {
    const __nv_bfloat16* krow = p.k + ((begin + j) * p.num_kv_heads + kvh) * d;
    float acc[G] = {};
    for (int t = 0; t < p.r; ++t) {
      const float kv = __bfloat162float(krow[comp[t]]);
      for (int g = 0; g < G; ++g) acc[g] = fmaf(q_hat[g * d + t], kv, acc[g]);
    }
    for (int g = 0; g < G; ++g) {
      p.logits[static_cast<int64_t>(kvh * G + g) * p.kv_rows + begin + j] = acc[g];
      norm[g] = MergeNorm(norm[g], make_float2(acc[g], 1.f));
    }
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int g = 0; g < G; ++g) {
    for (int o = 16; o > 0; o >>= 1) {
      const float2 other = make_float2(__shfl_xor_sync(0xffffffffu, norm[g].x, o),
                                       __shfl_xor_sync(0xffffffffu, norm[g].y, o));
      norm[g] = MergeNorm(norm[g], other);
    }
    if (lane == 0) warp_norm[warp][g] = norm[g];
  }
  __syncthreads();
  if (threadIdx.x < G) {
    float2 total = make_float2(-INFINITY, 0.f);
    for (int w = 0; w < kScoreThreads / 32; ++w)
      total = MergeNorm(total, warp_norm[w][threadIdx.x]);
    const int64_t head = static_cast<int64_t>(seq) * p.num_heads + kvh * G + threadIdx.x;
    p.chunk_norm[head * p.chunks + blockIdx.x] = total;
  }
}

// Kernel 2, step 1: the k-th largest key bits among the group's n keys and how many keys equal
// to it are taken (the rest are larger). 8 bits a pass from the top, as the sampler's radix.
__device__ uint2 RadixSelect(const uint32_t* keys, int64_t n, int k, unsigned* hist,
                             uint2* chosen) {
  uint32_t prefix = 0, mask = 0;
  int remaining = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const uint32_t bits = keys[j];
      if ((bits & mask) == prefix) atomicAdd(&hist[(bits >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int above = 0;
      for (int b = 255; b >= 0; --b) {
        if (above + static_cast<int>(hist[b]) >= remaining) {
          *chosen = make_uint2(prefix | (static_cast<uint32_t>(b) << shift), remaining - above);
          break;
        }
        above += hist[b];
      }
    }
    __syncthreads();
    prefix = chosen->x;
    remaining = static_cast<int>(chosen->y);
    mask |= 255u << shift;
    __syncthreads();
  }
  return make_uint2(prefix, remaining);
}

// Kernel 2: global LSE per head, ranking keys, radix select, ordered collection and alpha.
template <int G>
__global__ void __launch_bounds__(kTopKThreads) TopKKernel(const __grid_constant__ SparqParams p) {
  using Scan = cub::BlockScan<int, kTopKThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ float lse[G], warp_alpha[kTopKThreads / 32][G];
  __shared__ unsigned hist[256];
  __shared__ uint2 chosen;
  const int seq = blockIdx.x / p.num_kv_heads, kvh = blockIdx.x % p.num_kv_heads;
  const int64_t n = p.kv_len[seq], begin = p.kv_begin[seq];
  const int64_t head0 = static_cast<int64_t>(seq) * p.num_heads + kvh * G;
  int32_t* sel = p.sel + static_cast<int64_t>(blockIdx.x) * p.top_k;
  if (threadIdx.x < G) {
    float2 total = make_float2(-INFINITY, 0.f);
    const int chunks = static_cast<int>((n + kScoreChunk - 1) / kScoreChunk);
    for (int c = 0; c < chunks; ++c)
      total = MergeNorm(total, p.chunk_norm[(head0 + threadIdx.x) * p.chunks + c]);
    lse[threadIdx.x] = total.x + logf(total.y);
    p.lse[head0 + threadIdx.x] = lse[threadIdx.x];
  }
  __syncthreads();
  if (n <= p.top_k) {  // every position: dense attention, alpha 1 (v_bar unused)
    for (int t = threadIdx.x; t < p.top_k; t += blockDim.x) sel[t] = t < n ? t : -1;
    if (threadIdx.x < G) p.alpha[head0 + threadIdx.x] = 1.f;
    return;
  }
  const float* logits = p.logits + static_cast<int64_t>(kvh * G) * p.kv_rows + begin;
  uint32_t* keys = p.keys + static_cast<int64_t>(kvh) * p.kv_rows + begin;
  const int64_t window_begin = n - min(static_cast<int64_t>(p.local_window), n);
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    float key = 0;
    for (int g = 0; g < G; ++g) key += expf(logits[g * p.kv_rows + j] - lse[g]);
    keys[j] = __float_as_uint(key) | (j >= window_begin ? kWindowBit : 0u);  // key >= 0
  }
  __syncthreads();
  const uint2 kth = RadixSelect(keys, n, p.top_k, hist, &chosen);
  // Collect in position order: every key above the k-th, and the first kth.y equal to it.
  int taken_eq = 0, taken = 0;
  float alpha[G] = {};
  for (int64_t base = 0; base < n; base += blockDim.x) {
    const int64_t j = base + threadIdx.x;
    const uint32_t bits = j < n ? keys[j] : 0u;
    const int eq = j < n && bits == kth.x;
    int eq_rank, eq_total, take_rank, take_total;
    Scan(scan).ExclusiveSum(eq, eq_rank, eq_total);
    __syncthreads();
    const int take =
        (j < n && bits > kth.x) || (eq && taken_eq + eq_rank < static_cast<int>(kth.y));
    Scan(scan).ExclusiveSum(take, take_rank, take_total);
    __syncthreads();
    if (take) {
      sel[taken + take_rank] = static_cast<int32_t>(j);
      for (int g = 0; g < G; ++g) alpha[g] += expf(logits[g * p.kv_rows + j] - lse[g]);
    }
    taken_eq += eq_total;
    taken += take_total;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int g = 0; g < G; ++g) {
    const float s = WarpSum(alpha[g]);
    if (lane == 0) warp_alpha[warp][g] = s;
  }
  __syncthreads();
  if (threadIdx.x < G) {
    float s = 0;
    for (int w = 0; w < kTopKThreads / 32; ++w) s += warp_alpha[w][threadIdx.x];
    p.alpha[head0 + threadIdx.x] = s;
  }
}

// Kernel 3: exact attention over the chosen rows, interpolated with v_bar. Dynamic shared:
// q [G][D], scores [G][k], rows [k].
template <int G, int D>
__global__ void __launch_bounds__(kAttendThreads)
    GatherAttendKernel(const __grid_constant__ SparqParams p) {
  extern __shared__ float smem[];
  float* qs = smem;
  float* sc = qs + G * D;
  int64_t* rows = reinterpret_cast<int64_t*>(sc + G * p.top_k + (G * p.top_k) % 2);
  __shared__ float inv_sum[G];
  const int seq = blockIdx.x / p.num_kv_heads, kvh = blockIdx.x % p.num_kv_heads;
  const int64_t n = p.kv_len[seq], begin = p.kv_begin[seq];
  const int64_t head0 = static_cast<int64_t>(seq) * p.num_heads + kvh * G;
  const int cnt = static_cast<int>(min(static_cast<int64_t>(p.top_k), n));
  const int64_t stride = static_cast<int64_t>(p.num_kv_heads) * D;
  for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
    qs[i] = __bfloat162float(p.q[head0 * D + i]) / sqrtf(static_cast<float>(D));
  }
  for (int t = threadIdx.x; t < cnt; t += blockDim.x) {
    rows[t] = (begin + p.sel[static_cast<int64_t>(blockIdx.x) * p.top_k + t]) * stride + kvh * D;
  }
  __syncthreads();
  constexpr int kPerLane = D / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int t = warp; t < cnt; t += kAttendThreads / 32) {
    float kv[kPerLane];
    for (int e = 0; e < kPerLane; ++e) kv[e] = __bfloat162float(p.k[rows[t] + lane * kPerLane + e]);
    for (int g = 0; g < G; ++g) {
      float s = 0;
      for (int e = 0; e < kPerLane; ++e) s = fmaf(qs[g * D + lane * kPerLane + e], kv[e], s);
      s = WarpSum(s);
      if (lane == 0) sc[g * p.top_k + t] = s;
    }
  }
  __syncthreads();
  for (int g = warp; g < G; g += kAttendThreads / 32) {
    float mx = -INFINITY, sum = 0;
    for (int t = lane; t < cnt; t += 32) mx = fmaxf(mx, sc[g * p.top_k + t]);
    mx = WarpMax(mx);
    for (int t = lane; t < cnt; t += 32)
      sum += (sc[g * p.top_k + t] = expf(sc[g * p.top_k + t] - mx));
    sum = WarpSum(sum);
    if (lane == 0) inv_sum[g] = sum > 0 ? 1.f / sum : 0.f;
  }
  __syncthreads();
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    float acc[G] = {};
    for (int t = 0; t < cnt; ++t) {
      const float v = __bfloat162float(p.v[rows[t] + c]);
      for (int g = 0; g < G; ++g) acc[g] = fmaf(sc[g * p.top_k + t], v, acc[g]);
    }
    const float v_bar =
        n > 0 ? p.v_sum[(static_cast<int64_t>(seq) * p.num_kv_heads + kvh) * D + c] / n : 0.f;
    for (int g = 0; g < G; ++g) {
      const float a = n > 0 ? p.alpha[head0 + g] : 0.f;
      p.o[(head0 + g) * D + c] = a * acc[g] * inv_sum[g] + (1.f - a) * v_bar;
    }
  }
}

size_t AttendSharedBytes(int group, int head_dim, int k) {
  return sizeof(float) * (group * head_dim + group * k + (group * k) % 2) + sizeof(int64_t) * k;
}

template <int G, int D>
absl::Status LaunchAttend(const SparqParams& p, int blocks, cudaStream_t stream) {
  const size_t smem = AttendSharedBytes(G, D, p.top_k);
  CPFILL_CUDA_CHECK(cudaFuncSetAttribute(GatherAttendKernel<G, D>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem)));
  GatherAttendKernel<G, D><<<blocks, kAttendThreads, smem, stream>>>(p);
  return absl::OkStatus();
}

template <int G>
absl::Status LaunchGroup(const SparqParams& p, int64_t num_seqs, cudaStream_t stream) {
  const int groups = static_cast<int>(num_seqs * p.num_kv_heads);
  ApproxScoresKernel<G><<<dim3(p.chunks, groups), kScoreThreads, 0, stream>>>(p);
  TopKKernel<G><<<groups, kTopKThreads, 0, stream>>>(p);
  const absl::Status attend = p.head_dim == 64 ? LaunchAttend<G, 64>(p, groups, stream)
                                               : LaunchAttend<G, 128>(p, groups, stream);
  CPFILL_RETURN_IF_ERROR(attend);
  CPFILL_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateSparqCudaArgs(const SparqCudaArgs& a) {
  const SparqShape& sh = a.shape;
  CPFILL_CHECK_ARG(sh.num_kv_heads > 0 && sh.num_heads % sh.num_kv_heads == 0,
                   "sparq cuda: ", sh.num_heads, " heads over ", sh.num_kv_heads, " kv heads");
  const int g = sh.group_size();
  CPFILL_CHECK_ARG(g == 1 || g == 2 || g == 4 || g == 8 || g == 16, "sparq cuda: group size ", g,
                   " not compiled (1, 2, 4, 8, 16)");
  CPFILL_CHECK_ARG(sh.head_dim == 64 || sh.head_dim == 128, "sparq cuda: head dim ", sh.head_dim,
                   " not compiled (64, 128)");
  const int r = a.config.effective_r(sh.head_dim);
  CPFILL_CHECK_ARG(a.config.oracle || (a.config.r >= 1 && a.config.r <= sh.head_dim),
                   "sparq cuda: r = ", a.config.r, " outside [1, ", sh.head_dim, "]");
  CPFILL_CHECK_ARG(r >= 1 && a.config.k >= 1 && a.config.k <= kMaxK && a.config.local_window >= 0,
                   "sparq cuda: k = ", a.config.k, " outside [1, ", kMaxK, "] or l < 0");
  CPFILL_CHECK_ARG(a.num_seqs >= 0 && a.max_kv_len < (int64_t{1} << 31) && a.kv_rows >= 0,
                   "sparq cuda: bad sizes");
  CPFILL_CHECK_ARG(
      a.num_seqs == 0 || (a.q && a.k && a.v && a.kv_begin && a.kv_len && a.v_sum && a.o),
      "sparq cuda: a null tensor");
  return absl::OkStatus();
}

size_t SparqWorkspaceBytes(const SparqCudaArgs& a) { return MakeLayout(a).total; }

absl::Status LaunchSparqAttention(const SparqCudaArgs& a, void* workspace, size_t workspace_bytes,
                                  cudaStream_t stream) {
  CPFILL_RETURN_IF_ERROR(ValidateSparqCudaArgs(a));
  const Layout l = MakeLayout(a);
  CPFILL_CHECK_ARG(workspace != nullptr && workspace_bytes >= l.total, "sparq cuda: workspace of ",
                   workspace_bytes, " bytes, need ", l.total);
  if (a.num_seqs == 0) return absl::OkStatus();
  char* ws = static_cast<char*>(workspace);
  const SparqShape& sh = a.shape;
  const SparqParams p{
      .num_heads = sh.num_heads,
      .num_kv_heads = sh.num_kv_heads,
      .head_dim = sh.head_dim,
      .r = a.config.effective_r(sh.head_dim),
      .top_k = a.config.k,
      .local_window = a.config.local_window,
      .chunks = Chunks(a.max_kv_len),
      .kv_rows = a.kv_rows,
      .q = a.q,
      .k = a.k,
      .v = a.v,
      .kv_begin = a.kv_begin,
      .kv_len = a.kv_len,
      .v_sum = a.v_sum,
      .o = a.o,
      .logits = reinterpret_cast<float*>(ws + l.logits),
      .keys = reinterpret_cast<uint32_t*>(ws + l.keys),
      .chunk_norm = reinterpret_cast<float2*>(ws + l.norms),
      .lse = reinterpret_cast<float*>(ws + l.lse),
      .alpha = reinterpret_cast<float*>(ws + l.alpha),
      .sel = a.selected != nullptr ? a.selected : reinterpret_cast<int32_t*>(ws + l.sel)};
  switch (sh.group_size()) {
    case 1:
      return LaunchGroup<1>(p, a.num_seqs, stream);
    case 2:
      return LaunchGroup<2>(p, a.num_seqs, stream);
    case 4:
      return LaunchGroup<4>(p, a.num_seqs, stream);
    case 8:
      return LaunchGroup<8>(p, a.num_seqs, stream);
    case 16:
      return LaunchGroup<16>(p, a.num_seqs, stream);
    default:
      return absl::InternalError("sparq cuda: group size passed validation uncompiled");
  }
}

SparqBytes ModelSparqBytes(const SparqShape& sh, const SparqConfig& c, int64_t seq_len,
                           int64_t num_seqs) {
  const double d = sh.head_dim, s = static_cast<double>(seq_len), g = sh.group_size();
  const double r = c.effective_r(sh.head_dim), k = std::min<double>(c.k, s);
  const double groups = static_cast<double>(num_seqs) * sh.num_kv_heads;
  // A 32-byte sector holds 16 bf16 components; it is fetched unless none of the r is in it:
  // P(miss) = C(d - 16, r) / C(d, r).
  double p_miss = 1.0;
  for (int i = 0; i < r; ++i) p_miss *= std::max(0.0, (d - 16 - i) / (d - i));
  const double sectors_per_row = d / 16 * (1 - p_miss);
  const double chosen_rows = 2 * k * d * 2 + 4 * d;  // K and V rows, v_sum (fp32)
  SparqBytes b;
  b.paper = groups * 2 * (s * r + 2 * k * d + 4 * d);
  b.sectors = groups * (s * sectors_per_row * 32 + chosen_rows);
  b.workspace = groups * s * (g * 4 * 2 + 4 + 4 * 4 + 4);
  b.dense = groups * s * 2 * d * 2;
  return b;
}

}  // namespace cpfill::attention::sparq::cuda
