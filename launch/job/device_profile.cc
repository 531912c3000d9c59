#include "launch/job/device_profile.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status.h"
#include "runtime/model/cpu/layers.h"
#include "runtime/model/memory.h"

namespace cpfill::launch {
namespace {

using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The median of `repeat` timed calls after one warm-up, seconds.
template <typename F>
double TimeIt(int repeat, F&& f) {
  f();
  std::vector<double> s;
  for (int i = 0; i < repeat; ++i) {
    const auto t0 = Clock::now();
    f();
    s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return Median(s);
}

absl::StatusOr<double> Average(parallel::Communicator& world, double v) {
  CPFILL_RETURN_IF_ERROR(
      world.AllReduce(&v, 1, parallel::DataType::kFloat64, parallel::ReduceOp::kSum));
  return v / world.size();
}

absl::StatusOr<double> Slowest(parallel::Communicator& world, double v) {
  CPFILL_RETURN_IF_ERROR(
      world.AllReduce(&v, 1, parallel::DataType::kFloat64, parallel::ReduceOp::kMin));
  return v;
}

// sgemm through the model's own Linear: y[M, W] = x[M, W] w^T.
double CpuGemmTflops(int64_t rows, int64_t width, int repeat) {
  std::vector<float> x(rows * width, 0.5f), w(width * width, 0.25f), y(rows * width);
  const double s = TimeIt(
      repeat, [&] { runtime::cpu::Linear(x.data(), rows, width, w.data(), width, y.data()); });
  return 2.0 * rows * width * width / s / 1e12;
}

// Read + write of a buffer larger than the caches: what KV writes and merges stream at.
double CpuMemoryGbps(int repeat) {
  const size_t bytes = size_t{64} << 20;
  std::vector<char> a(bytes, 1), b(bytes, 2);
  const double s = TimeIt(repeat, [&] { std::memcpy(b.data(), a.data(), bytes); });
  return 2.0 * bytes / s / 1e9;
}

std::string CpuName() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) return "cpu: " + line.substr(line.find(':') + 2);
  }
  return "cpu";
}

absl::Status MeasureAttention(Backend& backend, parallel::Communicator& world,
                              const attention::AttentionShape& shape, const ProfileOptions& o,
                              runtime::plan::DeviceProfile* d) {
  for (int64_t t : o.attention_tokens) {
    CPFILL_ASSIGN_OR_RETURN(double tflops, backend.MeasureTflops(shape, t, o.repeat));
    CPFILL_ASSIGN_OR_RETURN(tflops, Average(world, tflops));
    d->attention.push_back({.size = double(t) * double(t + 1) / 2, .tflops = tflops});
  }
  return absl::OkStatus();
}

absl::Status MeasureLink(Backend& backend, parallel::Communicator& world, const ProfileOptions& o,
                         runtime::plan::LinkProfile* links) {
  // Bandwidth from a large message, latency from a small one (its time less its bytes' share).
  const int64_t big = int64_t{16} << 20, small = 4096;
  CPFILL_ASSIGN_OR_RETURN(double gbps, backend.MeasureRingGbps(big, o.repeat));
  CPFILL_ASSIGN_OR_RETURN(gbps, Slowest(world, gbps));
  CPFILL_ASSIGN_OR_RETURN(double small_gbps, backend.MeasureRingGbps(small, o.repeat));
  CPFILL_ASSIGN_OR_RETURN(small_gbps, Slowest(world, small_gbps));
  if (world.size() < 2 || !(gbps > 0) || !std::isfinite(gbps)) return absl::OkStatus();  // no ring
  const double latency_us = std::max(0.0, small / (small_gbps * 1e9) - small / (gbps * 1e9)) * 1e6;
  links->links.push_back({.name = o.link_name,
                          .gbps = gbps,
                          .latency_us = latency_us,
                          .note = absl::StrFormat("measured by cpfill calibrate --profile on %d "
                                                  "rank(s): ring exchange of %d and %d bytes",
                                                  world.size(), big, small)});
  links->intra_node = links->inter_node = o.link_name;
  links->source = "cpfill calibrate --profile";
  return absl::OkStatus();
}

}  // namespace

nlohmann::ordered_json MeasuredProfile::ToJson() const {
  nlohmann::ordered_json j = device.ToJson();
  if (links.links.empty()) return j;                // one rank: no ring was measured
  const nlohmann::ordered_json l = links.ToJson();  // named: items() refers into it
  for (const auto& [k, v] : l.items()) {
    if (k != "source") j[k] = v;
  }
  return j;
}

absl::StatusOr<MeasuredProfile> MeasureDeviceProfile(Backend& backend,
                                                     parallel::Communicator& world,
                                                     const attention::AttentionShape& shape,
                                                     const ProfileOptions& o) {
  MeasuredProfile p;
  runtime::plan::DeviceProfile& d = p.device;
  d.backend = backend.name();
  d.elem_bytes = o.elem_bytes;
  d.source = absl::StrFormat("cpfill calibrate --profile, %s backend, %d rank(s) measuring at once",
                             backend.name(), world.size());
  CPFILL_RETURN_IF_ERROR(MeasureAttention(backend, world, shape, o, &d));
  if (backend.name() == "cpu") {
    d.device = CpuName();
    runtime::cpu::SetBlasThreads(o.threads);
    for (int64_t rows : o.gemm_rows) {
      CPFILL_ASSIGN_OR_RETURN(double tflops,
                              Average(world, CpuGemmTflops(rows, o.gemm_width, o.repeat)));
      d.gemm.push_back({.size = double(rows), .tflops = tflops});
    }
    CPFILL_ASSIGN_OR_RETURN(d.memory_gbps, Average(world, CpuMemoryGbps(o.repeat)));
    if (auto free = runtime::HostBytesAvailable(); free.ok()) d.device_memory_bytes = double(*free);
  } else {
    // GEMM and memory rates of a GPU come from the benches (bench/plan/*.json shows how).
    d.device = backend.Description();
  }
  CPFILL_RETURN_IF_ERROR(MeasureLink(backend, world, o, &p.links));
  return p;
}

}  // namespace cpfill::launch
