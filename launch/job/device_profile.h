// cpfill/launch/job/device_profile.h — `cpfill calibrate --profile F`: measures the device
// profile that `cpfill plan` reads (runtime/plan/profile.h) on the backend the job runs:
// attention rates on causal squares of several lengths, GEMM rates at several row counts (CPU
// backend: the BLAS the model uses), memory bandwidth, and the CP ring link (bandwidth and
// small-message latency) as a link profile inside the same file.
//
//   CPFILL_ASSIGN_OR_RETURN(auto profile, MeasureDeviceProfile(backend, world, shape, grid, opts));
//   nlohmann::ordered_json j = profile.device.ToJson();  // + profile.links.ToJson()'s keys
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "attention/attention.h"
#include "launch/job/backend.h"
#include "parallel/communicator.h"
#include "runtime/plan/profile.h"

namespace cpfill::launch {

struct ProfileOptions {
  std::vector<int64_t> attention_tokens;  // causal squares measured
  std::vector<int64_t> gemm_rows;         // rows of the GEMMs measured (CPU backend)
  int64_t gemm_width = 2048;              // K = N of the GEMMs
  int repeat = 3;
  int threads = 1;        // BLAS threads of this rank
  double elem_bytes = 4;  // e of the backend's messages
  std::string link_name = "measured";
};

struct MeasuredProfile {
  runtime::plan::DeviceProfile device;
  runtime::plan::LinkProfile links;
  // One file holding both: a device profile with "links", "intra_node" and "inter_node" added,
  // so that it serves --device-profile and --link-profile alike.
  nlohmann::ordered_json ToJson() const;
};

// Collective over `world`: every rank measures at once (as a run loads the machine), rates are
// averaged over ranks, the link is the slowest rank's.
absl::StatusOr<MeasuredProfile> MeasureDeviceProfile(Backend& backend,
                                                     parallel::Communicator& world,
                                                     const attention::AttentionShape& shape,
                                                     const ProfileOptions& options);

}  // namespace cpfill::launch
