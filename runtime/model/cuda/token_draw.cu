#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "base/status.h"
#include "runtime/model/cuda/token_draw.h"
#include "runtime/model/sampling_draw.h"

namespace cpfill::runtime::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 256;             // radix selection takes 8 bits of a logit at a time
constexpr double kMassOne = 0x1.0p52;  // a probability of 1 in fixed point
constexpr size_t kHistogramBytes = size_t{kWarps} * kBins * (sizeof(uint64_t) + sizeof(uint32_t));

// The logits of one row: id v lives in part v / slice_vocab.
struct RowLogits {
  const float* base;    // part 0 of the row
  int64_t part_stride;  // from part s to part s + 1 of the same row, less slice_vocab
  int64_t slice_vocab;
  bool one_part;
  __device__ float operator()(int64_t v) const {
    return one_part ? base[v] : base[v + (v / slice_vocab) * part_stride];
  }
};

// Block-wide reductions; every thread gets the result. `scratch` holds kWarps values.
template <typename T, typename Op>
__device__ T BlockReduce(T x, Op op, T* scratch) {
  for (int o = 16; o > 0; o >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = scratch[0];
  for (int w = 1; w < kWarps; ++w) x = op(x, scratch[w]);
  return x;
}

// The larger score, the lower id on a tie; id < 0 is "none".
struct Best {
  double score;
  int64_t id;
};
__device__ bool Before(const Best& a, const Best& b) {
  if (a.id < 0) return false;
  if (b.id < 0) return true;
  return a.score > b.score || (a.score == b.score && a.id < b.id);
}
__device__ Best BlockBest(Best x, Best* scratch) {
  for (int o = 16; o > 0; o >>= 1) {
    Best y{__shfl_xor_sync(0xffffffffu, x.score, o), __shfl_xor_sync(0xffffffffu, x.id, o)};
    if (Before(y, x)) x = y;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = scratch[0];
  for (int w = 1; w < kWarps; ++w) {
    if (Before(scratch[w], x)) x = scratch[w];
  }
  return x;
}

// The kept tokens: logits whose bits exceed `bits`, and those equal to it with id < tie_limit.
struct Cut {
  uint32_t bits = 0;
  int64_t tie_limit = 0;
};

struct Shared {
  double d[kWarps];
  int64_t i[kWarps];
  Best best[kWarps];
  uint32_t total_count[kBins];
  uint64_t total_mass[kBins];
  uint32_t chosen_bin;
  int64_t k_left;
  uint64_t mass_left;
  bool keep_rest;
};

__device__ uint64_t Fixed(double w) { return static_cast<uint64_t>(w * kMassOne); }

// One radix level: the count and mass of the tokens matching `prefix` under `mask`, by their
// next 8 bits (below `shift`), summed over per-warp histograms (an order-free sum).
__device__ void Histogram(const RowLogits& z, int64_t vocab, uint32_t prefix, uint32_t mask,
                          int shift, bool nucleus, double scale, double log_z, char* dynamic,
                          Shared& sh) {
  uint64_t* mass = reinterpret_cast<uint64_t*>(dynamic);
  uint32_t* count = reinterpret_cast<uint32_t*>(mass + kWarps * kBins);
  for (int b = threadIdx.x; b < kWarps * kBins; b += kThreads) {
    mass[b] = 0;
    count[b] = 0;
  }
  __syncthreads();
  const int warp = threadIdx.x / 32;
  for (int64_t v = threadIdx.x; v < vocab; v += kThreads) {
    const float x = z(v);
    const uint32_t bits = OrderedBits(x);
    if ((bits & mask) != prefix) continue;
    const int bin = warp * kBins + ((bits >> shift) & 0xffu);
    atomicAdd(&count[bin], 1u);
    if (nucleus) {
      atomicAdd(reinterpret_cast<unsigned long long*>(&mass[bin]),
                static_cast<unsigned long long>(Fixed(exp(double(x) * scale - log_z))));
    }
  }
  __syncthreads();
  for (int b = threadIdx.x; b < kBins; b += kThreads) {
    uint32_t c = 0;
    uint64_t m = 0;
    for (int w = 0; w < kWarps; ++w) {
      c += count[w * kBins + b];
      m += mass[w * kBins + b];
    }
    sh.total_count[b] = c;
    sh.total_mass[b] = m;
  }
  __syncthreads();
}

// Thread 0: the bin holding the last kept token, from the most likely bin down: the first where
// the count reaches k_left or the mass reaches mass_left; none (rounding left the mass just
// short): every token left is kept, down to the lowest bin.
__device__ void ChooseBin(Shared& sh) {
  if (threadIdx.x != 0) return;
  uint32_t before = 0;
  uint64_t mass_before = 0;
  int lowest = -1, chosen = -1;
  for (int b = kBins - 1; b >= 0 && chosen < 0; --b) {
    const uint32_t c = sh.total_count[b];
    if (c == 0) continue;
    lowest = b;
    const bool enough =
        sh.keep_rest ? false
                     : before + c >= sh.k_left || mass_before + sh.total_mass[b] >= sh.mass_left;
    if (enough) {
      chosen = b;
    } else {
      before += c;
      mass_before += sh.total_mass[b];
    }
  }
  if (chosen < 0) {  // keep everything: the lowest bin holds the last kept token
    chosen = lowest;
    sh.keep_rest = true;
    before -= sh.total_count[lowest];
  }
  sh.chosen_bin = static_cast<uint32_t>(chosen);
  sh.k_left -= before;
  sh.mass_left = sh.mass_left >= mass_before ? sh.mass_left - mass_before : 0;
}

// The cut of top-k and top-p (the first of the two to be reached, in order of likelihood).
__device__ Cut FindCut(const RowLogits& z, int64_t vocab, const DeviceTokenDraw& d, char* dynamic,
                       Shared& sh) {
  const bool nucleus = d.top_p < 1.0;
  double log_z = 0;
  if (nucleus) {
    double m = -INFINITY;
    for (int64_t v = threadIdx.x; v < vocab; v += kThreads) m = fmax(m, double(z(v)) * d.scale);
    m = BlockReduce(
        m, [](double a, double b) { return fmax(a, b); }, sh.d);
    double s = 0;
    for (int64_t v = threadIdx.x; v < vocab; v += kThreads) s += exp(double(z(v)) * d.scale - m);
    s = BlockReduce(
        s, [](double a, double b) { return a + b; }, sh.d);
    log_z = m + log(s);
  }
  if (threadIdx.x == 0) {
    sh.k_left = d.top_k > 0 && d.top_k < vocab ? d.top_k : vocab;
    sh.mass_left = nucleus ? Fixed(d.top_p) : UINT64_MAX;
    sh.keep_rest = false;
  }
  uint32_t prefix = 0, mask = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    Histogram(z, vocab, prefix, mask, shift, nucleus, d.scale, log_z, dynamic, sh);
    ChooseBin(sh);
    __syncthreads();
    prefix |= sh.chosen_bin << shift;
    mask |= 0xffu << shift;
  }
  // `prefix` is one logit's bits now; of its ties (equal weights) keep the fewest that reach
  // k_left or mass_left, lowest ids first.
  const long long ties = sh.total_count[sh.chosen_bin];
  long long keep = ties;
  if (!sh.keep_rest) {
    keep = sh.k_left;
    if (nucleus) {
      float x;
      const uint32_t raw = (prefix & 0x80000000u) ? (prefix & 0x7fffffffu) : ~prefix;
      x = __uint_as_float(raw);
      const uint64_t w = Fixed(exp(double(x) * d.scale - log_z));
      if (w > 0) keep = llmin(keep, static_cast<long long>((sh.mass_left + w - 1) / w));
    }
    keep = llmax(1, llmin(keep, ties));
  }
  Cut cut{prefix, vocab};
  if (keep == ties) return cut;
  // The id below which exactly `keep` ties lie: bisection, each probe a count over the row.
  int64_t lo = 0, hi = vocab;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    int64_t below = 0;
    for (int64_t v = threadIdx.x; v < mid; v += kThreads) below += OrderedBits(z(v)) == prefix;
    below = BlockReduce(
        below, [](int64_t a, int64_t b) { return a + b; }, sh.i);
    if (below >= keep) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  cut.tie_limit = lo;
  return cut;
}

__global__ void __launch_bounds__(kThreads)
    DrawKernel(const float* logits, int64_t rows, int64_t slice_vocab, int slices,
               const DeviceTokenDraw* draws, int32_t* ids) {
  extern __shared__ __align__(16) char dynamic[];
  __shared__ Shared sh;
  const DeviceTokenDraw d = draws[blockIdx.x];
  const RowLogits z{logits + d.row * slice_vocab, (rows - 1) * slice_vocab, slice_vocab,
                    slices == 1};
  const int64_t vocab = slice_vocab * slices;
  Best best{0, -1};
  if (d.scale == 0 || d.top_k == 1) {  // greedy: the argmax
    for (int64_t v = threadIdx.x; v < vocab; v += kThreads) {
      const Best c{double(z(v)), v};
      if (Before(c, best)) best = c;
    }
  } else {
    const bool keep_all = d.top_p >= 1.0 && (d.top_k <= 0 || d.top_k >= vocab);
    const Cut cut = keep_all ? Cut{0, vocab} : FindCut(z, vocab, d, dynamic, sh);
    for (int64_t v = threadIdx.x; v < vocab; v += kThreads) {
      const float x = z(v);
      const uint32_t bits = OrderedBits(x);
      if (bits < cut.bits || (bits == cut.bits && v >= cut.tie_limit)) continue;
      const Best c{DrawScore(x, d.scale, d.key, v), v};
      if (Before(c, best)) best = c;
    }
  }
  best = BlockBest(best, sh.best);
  if (threadIdx.x == 0) ids[blockIdx.x] = static_cast<int32_t>(best.id);
}

}  // namespace

absl::Status DrawTokens(const float* logits, int64_t rows, int64_t slice_vocab, int slices,
                        const DeviceTokenDraw* draws, int n, int32_t* ids, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  static const cudaError_t opted_in = cudaFuncSetAttribute(
      DrawKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kHistogramBytes));
  CPFILL_CUDA_CHECK(opted_in);
  DrawKernel<<<n, kThreads, kHistogramBytes, stream>>>(logits, rows, slice_vocab, slices, draws,
                                                       ids);
  CPFILL_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace cpfill::runtime::cuda
