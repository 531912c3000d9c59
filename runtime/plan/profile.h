// cpfill/runtime/plan/profile.h — what a cost model needs to know about hardware: a device
// profile (attention and GEMM rates as functions of shape, memory bandwidth) and a link profile
// (bandwidth and latency per transport, which transport joins GPUs of one node and of two).
//
// Both are JSON files. `cpfill calibrate --profile F` writes a device profile measured on the
// machine it runs on (and the ring link it measured, so F serves as a link profile as well);
// bench/plan/links-paper.json documents the paper's links as assumptions.
//
//   CPFILL_ASSIGN_OR_RETURN(DeviceProfile dev, ReadDeviceProfile("h100.json"));
//   double c = dev.AttentionTflops(/*pairs_per_head=*/8192.0 * 8192 / 2);
//   CPFILL_ASSIGN_OR_RETURN(LinkProfile links, ReadLinkProfile("links.json"));
//   const Link& ring = links.InterNode();
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace cpfill::runtime::plan {

// One measured rate: `tflops` (1e12 FLOP/s) at shape size `size` (see each table's unit).
struct RatePoint {
  double size = 0;
  double tflops = 0;
};

// Piecewise linear in ln(size) between points sorted by size, constant beyond the ends: rates
// rise with work per launch and saturate, and we never extrapolate a trend past what was measured.
double InterpolateRate(const std::vector<RatePoint>& points, double size);

struct DeviceProfile {
  std::string device;     // "NVIDIA H100 80GB HBM3", "cpu: AMD EPYC ..."
  std::string backend;    // "cpu" | "cuda"
  std::string source;     // the command or the derivation that made it
  double elem_bytes = 2;  // activations, KV and ring messages (bf16 2, the CPU backend's fp32 4)
  // Attention: size = visible (query, key) pairs per head of one launch (one ring step on one
  // rank); FLOPs = 4 * head_dim * heads * pairs.
  std::vector<RatePoint> attention;
  // GEMM: size = rows M (tokens) against a weight of the model's width; FLOPs = 2 * M * K * N.
  std::vector<RatePoint> gemm;
  double attention_launch_us = 0;  // fixed cost per attention launch (one per ring step)
  double memory_gbps = 0;          // streaming bandwidth: KV writes, merge, elementwise layers
  double device_memory_bytes = 0;  // what one GPU (or rank) holds; 0 = unknown, no verdict
  double weight_elem_bytes = 0;    // bytes per weight (FP8 FFN: about 1.2); 0 = elem_bytes

  double AttentionTflops(double pairs_per_head) const {
    return InterpolateRate(attention, pairs_per_head);
  }
  double GemmTflops(double rows) const { return InterpolateRate(gemm, rows); }
  nlohmann::ordered_json ToJson() const;
};

// InvalidArgument naming the key for a missing or non-positive rate, an empty attention table.
// An empty GEMM table is allowed (attention-only plans) and refused later by a plan that needs it.
absl::StatusOr<DeviceProfile> ParseDeviceProfile(const nlohmann::json& j);
absl::StatusOr<DeviceProfile> ReadDeviceProfile(const std::string& path);

struct Link {
  std::string name;       // "nvlink", "shm", "sockets", "roce", "measured", ...
  double gbps = 0;        // per GPU (rank), gigabytes (1e9 bytes) per second, one direction
  double latency_us = 0;  // per message
  std::string note;       // where the figure comes from: measured, a datasheet, an assumption

  double Seconds(double bytes) const {
    return bytes <= 0 ? 0 : latency_us * 1e-6 + bytes / (gbps * 1e9);
  }
};

struct LinkProfile {
  std::vector<Link> links;
  std::string intra_node;  // the link between GPUs of one node (TP all-reduce, CP inside a node)
  std::string inter_node;  // between nodes (the CP ring once it spans nodes)
  std::string source;

  absl::StatusOr<Link> Find(const std::string& name) const;
  const Link& IntraNode() const;  // valid after ParseLinkProfile
  const Link& InterNode() const;
  nlohmann::ordered_json ToJson() const;
};

// {"links": {"nvlink": {"gbps": 150, "latency_us": 3, "note": "..."}, ...},
//  "intra_node": "nvlink", "inter_node": "roce"}. InvalidArgument naming the key when a link is
// malformed or intra_node / inter_node names no link.
absl::StatusOr<LinkProfile> ParseLinkProfile(const nlohmann::json& j);
absl::StatusOr<LinkProfile> ReadLinkProfile(const std::string& path);

}  // namespace cpfill::runtime::plan
