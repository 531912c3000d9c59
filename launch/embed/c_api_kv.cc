// The KV hand-off's decode side in the C API (cpfill.h, CPFILL_0.3): handles parsed as untrusted
// JSON (runtime/handoff/kv_handle.h) and pulls through runtime::KvPuller. Each entry point turns
// statuses into codes and catches every exception.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/json_io.h"
#include "launch/embed/c_api_status.h"
#include "launch/embed/cpfill.h"
#include "runtime/handoff/kv_handle.h"
#include "runtime/handoff/kv_pull_plan.h"
#include "runtime/handoff/kv_puller.h"

struct cpfill_kv_handle {
  cpfill::runtime::KvHandle handle;
};

struct cpfill_kv_puller {
  std::unique_ptr<cpfill::runtime::KvPuller> puller;
};

namespace {

using cpfill::embed::Guarded;
using cpfill::runtime::KvContiguousDestination;
using cpfill::runtime::KvPagedDestination;
using cpfill::runtime::KvPullDestination;

// The first destination's size, through `bytes` (CPFILL_0.3): a later version may add fields at
// the end, and a struct_size below theirs means a caller built against this header.
constexpr size_t kDestinationV1Bytes = offsetof(cpfill_kv_destination, bytes) + sizeof(size_t);
static_assert(sizeof(void*) != 8 || kDestinationV1Bytes == 112,
              "cpfill_kv_destination's first version changed: grow it only at the end");

// Seconds from the caller, clamped: NaN and negatives are 0, and anything past a year a year
// (the conversion to milliseconds must not overflow).
cpfill::parallel::UcxDeadline DeadlineIn(double seconds) {
  const double s = std::isnan(seconds) ? 0.0 : std::clamp(seconds, 0.0, 365.0 * 86400);
  return cpfill::parallel::UcxDeadlineIn(std::chrono::milliseconds(static_cast<int64_t>(s * 1e3)));
}

absl::StatusOr<KvPullDestination> DestinationOf(const cpfill_kv_destination& d) {
  if (d.struct_size < kDestinationV1Bytes) {
    return absl::InvalidArgumentError(absl::StrCat("destination: struct_size is ", d.struct_size,
                                                   "; call cpfill_kv_destination_init first"));
  }
  KvPullDestination out{.tp_size = d.tp_size, .tp_rank = d.tp_rank};
  if (d.paged == 0) {
    out.layout = KvContiguousDestination{.capacity_tokens = d.capacity_tokens,
                                         .k_offset_bytes = d.k_offset_bytes,
                                         .v_offset_bytes = d.v_offset_bytes};
    return out;
  }
  if (d.block_table == nullptr && d.block_table_len > 0) {
    return absl::InvalidArgumentError("destination: block_table is NULL");
  }
  out.layout = KvPagedDestination{.block_tokens = d.block_tokens,
                                  .pool = {.bytes = static_cast<int64_t>(d.bytes),
                                           .num_blocks = d.num_blocks,
                                           .block_stride_bytes = d.block_stride_bytes,
                                           .layer_stride_bytes = d.layer_stride_bytes,
                                           .k_offset_bytes = d.k_offset_bytes,
                                           .v_offset_bytes = d.v_offset_bytes},
                                  .block_table = {d.block_table, d.block_table_len}};
  return out;
}

absl::Status Pull(cpfill_kv_puller* p, const cpfill_kv_handle* h, const cpfill_kv_destination* d,
                  double timeout_s, cpfill_kv_pull_stats* stats) {
  if (p == nullptr || h == nullptr || d == nullptr) {
    return absl::InvalidArgumentError("cpfill_kv_pull: puller, handle and destination are needed");
  }
  absl::StatusOr<KvPullDestination> dst = DestinationOf(*d);
  if (!dst.ok()) return dst.status();
  absl::StatusOr<cpfill::runtime::KvPullStats> s =
      p->puller->Pull(h->handle, *dst, d->base, d->bytes, DeadlineIn(timeout_s));
  if (!s.ok()) return s.status();
  if (stats != nullptr) {
    *stats = {
        .bytes = s->bytes, .gets = s->gets, .source_ranks = s->source_ranks, .seconds = s->seconds};
  }
  return absl::OkStatus();
}

}  // namespace

extern "C" {

int cpfill_kv_handle_parse(const char* json, size_t len, cpfill_kv_handle** out) {
  return Guarded([&]() -> absl::Status {
    if (json == nullptr || out == nullptr) {
      return absl::InvalidArgumentError("cpfill_kv_handle_parse: json and out are needed");
    }
    *out = nullptr;
    absl::StatusOr<nlohmann::json> v = cpfill::json::Parse(std::string_view(json, len));
    if (!v.ok())
      return absl::InvalidArgumentError(absl::StrCat("kv handle: ", v.status().message()));
    absl::StatusOr<cpfill::runtime::KvHandle> handle = cpfill::runtime::ParseKvHandle(*v);
    if (!handle.ok()) return handle.status();
    *out = new cpfill_kv_handle{*std::move(handle)};
    return absl::OkStatus();
  });
}

int cpfill_kv_handle_layout(const cpfill_kv_handle* h, cpfill_kv_layout* out) {
  return Guarded([&]() -> absl::Status {
    if (h == nullptr || out == nullptr) {
      return absl::InvalidArgumentError("cpfill_kv_handle_layout: handle and out are needed");
    }
    const cpfill::runtime::KvHandleLayout& l = h->handle.layout;
    *out = {.num_layers = l.num_layers,
            .kv_heads = l.kv_heads,
            .head_dim = l.head_dim,
            .dtype_bytes = static_cast<int32_t>(cpfill::runtime::KvDtypeBytes(l.dtype)),
            .tokens = l.tokens,
            .tp_size = l.tp_size,
            .cp_size = l.cp_size,
            .block_tokens = l.block_tokens};
    return absl::OkStatus();
  });
}

const char* cpfill_kv_handle_request_id(const cpfill_kv_handle* h) {
  return h == nullptr ? nullptr : h->handle.request_id.c_str();
}

void cpfill_kv_handle_free(cpfill_kv_handle* h) { delete h; }

int cpfill_kv_puller_create(const char* name, cpfill_kv_puller** out) {
  return Guarded([&]() -> absl::Status {
    if (out == nullptr) return absl::InvalidArgumentError("cpfill_kv_puller_create: out is NULL");
    *out = nullptr;
    auto puller = cpfill::runtime::KvPuller::Create({.name = name ? name : "cpfill kv puller"});
    if (!puller.ok()) return puller.status();
    *out = new cpfill_kv_puller{*std::move(puller)};
    return absl::OkStatus();
  });
}

void cpfill_kv_puller_destroy(cpfill_kv_puller* p) {
  try {
    delete p;
  } catch (...) {  // nothing crosses the C boundary
  }
}

void cpfill_kv_destination_init(cpfill_kv_destination* d) {
  if (d == nullptr) return;
  *d = cpfill_kv_destination{};
  d->struct_size = sizeof(cpfill_kv_destination);
  d->tp_size = 1;
}

int cpfill_kv_pull(cpfill_kv_puller* p, const cpfill_kv_handle* h, const cpfill_kv_destination* d,
                   double timeout_s, cpfill_kv_pull_stats* stats) {
  return Guarded([&] { return Pull(p, h, d, timeout_s, stats); });
}

int cpfill_kv_release(cpfill_kv_puller* p, const cpfill_kv_handle* h, double timeout_s) {
  return Guarded([&]() -> absl::Status {
    if (p == nullptr || h == nullptr) {
      return absl::InvalidArgumentError("cpfill_kv_release: puller and handle are needed");
    }
    return p->puller->Release(h->handle, DeadlineIn(timeout_s));
  });
}

}  // extern "C"
