#include "runtime/plan/profile.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/json_io.h"
#include "base/status.h"

namespace cpfill::runtime::plan {
namespace {

absl::StatusOr<std::vector<RatePoint>> ParseRates(const nlohmann::json& j, const char* key,
                                                  const char* size_key) {
  std::vector<RatePoint> out;
  const nlohmann::json* table = json::Find(j, key);
  if (table == nullptr) return out;
  CPFILL_CHECK_ARG(table->is_array(), "device profile: \"", key, "\" must be an array, not ",
                   std::string(json::TypeName(*table)));
  for (const nlohmann::json& p : *table) {
    CPFILL_ASSIGN_OR_RETURN(const double size, json::GetNumber(p, size_key));
    CPFILL_ASSIGN_OR_RETURN(const double tflops, json::GetNumber(p, "tflops"));
    CPFILL_CHECK_ARG(size > 0 && tflops > 0 && std::isfinite(size) && std::isfinite(tflops),
                     "device profile: \"", key, "\": ", json::Show(p),
                     " needs a positive size and rate");
    out.push_back({size, tflops});
  }
  std::sort(out.begin(), out.end(),
            [](const RatePoint& a, const RatePoint& b) { return a.size < b.size; });
  return out;
}

nlohmann::ordered_json RatesJson(const std::vector<RatePoint>& points, const char* size_key) {
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (const RatePoint& p : points) out.push_back({{size_key, p.size}, {"tflops", p.tflops}});
  return out;
}

double NumberOr(const nlohmann::json& j, const char* key, double fallback) {
  const nlohmann::json* v = json::Find(j, key);
  return v != nullptr && v->is_number() ? v->get<double>() : fallback;
}

std::string StringOr(const nlohmann::json& j, const char* key) {
  const nlohmann::json* v = json::Find(j, key);
  return v != nullptr && v->is_string() ? v->get<std::string>() : "";
}

}  // namespace

double InterpolateRate(const std::vector<RatePoint>& points, double size) {
  if (points.empty()) return 0;
  if (size <= points.front().size) return points.front().tflops;
  if (size >= points.back().size) return points.back().tflops;
  const auto hi = std::upper_bound(points.begin(), points.end(), size,
                                   [](double s, const RatePoint& p) { return s < p.size; });
  const RatePoint& b = *hi;
  const RatePoint& a = *(hi - 1);
  const double f = std::log(size / a.size) / std::log(b.size / a.size);
  return a.tflops + f * (b.tflops - a.tflops);
}

nlohmann::ordered_json DeviceProfile::ToJson() const {
  return {{"kind", "cpfill device profile"},
          {"device", device},
          {"backend", backend},
          {"source", source},
          {"elem_bytes", elem_bytes},
          {"attention_launch_us", attention_launch_us},
          {"memory_gbps", memory_gbps},
          {"device_memory_bytes", device_memory_bytes},
          {"weight_elem_bytes", weight_elem_bytes},
          {"attention", RatesJson(attention, "pairs_per_head")},
          {"gemm", RatesJson(gemm, "rows")}};
}

absl::StatusOr<DeviceProfile> ParseDeviceProfile(const nlohmann::json& j) {
  CPFILL_CHECK_ARG(j.is_object(), "device profile: expected a JSON object, not ",
                   std::string(json::TypeName(j)));
  DeviceProfile d;
  d.device = StringOr(j, "device");
  d.backend = StringOr(j, "backend");
  d.source = StringOr(j, "source");
  d.elem_bytes = NumberOr(j, "elem_bytes", 2);
  d.attention_launch_us = NumberOr(j, "attention_launch_us", 0);
  d.memory_gbps = NumberOr(j, "memory_gbps", 0);
  d.device_memory_bytes = NumberOr(j, "device_memory_bytes", 0);
  d.weight_elem_bytes = NumberOr(j, "weight_elem_bytes", 0);
  CPFILL_CHECK_ARG(d.elem_bytes > 0 && d.attention_launch_us >= 0 && d.memory_gbps >= 0 &&
                       d.device_memory_bytes >= 0 && d.weight_elem_bytes >= 0,
                   "device profile: elem_bytes must be positive, attention_launch_us, "
                   "memory_gbps and device_memory_bytes not negative");
  CPFILL_ASSIGN_OR_RETURN(d.attention, ParseRates(j, "attention", "pairs_per_head"));
  CPFILL_ASSIGN_OR_RETURN(d.gemm, ParseRates(j, "gemm", "rows"));
  CPFILL_CHECK_ARG(!d.attention.empty(),
                   "device profile: \"attention\" needs at least one {pairs_per_head, tflops}");
  return d;
}

absl::StatusOr<DeviceProfile> ReadDeviceProfile(const std::string& path) {
  CPFILL_ASSIGN_OR_RETURN(const nlohmann::json j, json::ReadFile(path));
  absl::StatusOr<DeviceProfile> d = ParseDeviceProfile(j);
  if (!d.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", d.status().message()));
  return d;
}

absl::StatusOr<Link> LinkProfile::Find(const std::string& name) const {
  for (const Link& l : links) {
    if (l.name == name) return l;
  }
  return absl::InvalidArgumentError(absl::StrCat("link profile: no link named \"", name, "\""));
}

const Link& LinkProfile::IntraNode() const {
  for (const Link& l : links) {
    if (l.name == intra_node) return l;
  }
  return links.front();
}

const Link& LinkProfile::InterNode() const {
  for (const Link& l : links) {
    if (l.name == inter_node) return l;
  }
  return links.front();
}

nlohmann::ordered_json LinkProfile::ToJson() const {
  nlohmann::ordered_json jl = nlohmann::ordered_json::object();
  for (const Link& l : links) {
    jl[l.name] = {{"gbps", l.gbps}, {"latency_us", l.latency_us}, {"note", l.note}};
  }
  return {
      {"links", jl}, {"intra_node", intra_node}, {"inter_node", inter_node}, {"source", source}};
}

absl::StatusOr<LinkProfile> ParseLinkProfile(const nlohmann::json& j) {
  const nlohmann::json* links = json::Find(j, "links");
  CPFILL_CHECK_ARG(links != nullptr && links->is_object() && !links->empty(),
                   "link profile: needs \"links\": {name: {gbps, latency_us}}");
  LinkProfile p;
  for (const auto& [name, v] : links->items()) {
    Link l{.name = name};
    CPFILL_ASSIGN_OR_RETURN(l.gbps, json::GetNumber(v, "gbps"));
    l.latency_us = NumberOr(v, "latency_us", 0);
    l.note = StringOr(v, "note");
    CPFILL_CHECK_ARG(l.gbps > 0 && std::isfinite(l.gbps) && l.latency_us >= 0,
                     "link profile: link \"", name, "\" needs gbps > 0 and latency_us >= 0");
    p.links.push_back(std::move(l));
  }
  p.intra_node = StringOr(j, "intra_node");
  p.inter_node = StringOr(j, "inter_node");
  p.source = StringOr(j, "source");
  if (p.intra_node.empty()) p.intra_node = p.links.front().name;
  if (p.inter_node.empty()) p.inter_node = p.intra_node;
  CPFILL_RETURN_IF_ERROR(p.Find(p.intra_node).status());
  CPFILL_RETURN_IF_ERROR(p.Find(p.inter_node).status());
  return p;
}

absl::StatusOr<LinkProfile> ReadLinkProfile(const std::string& path) {
  CPFILL_ASSIGN_OR_RETURN(const nlohmann::json j, json::ReadFile(path));
  absl::StatusOr<LinkProfile> p = ParseLinkProfile(j);
  if (!p.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", p.status().message()));
  return p;
}

}  // namespace cpfill::runtime::plan
