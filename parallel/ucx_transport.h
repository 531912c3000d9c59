// cpfill/parallel/ucx_transport.h — UCX (ucp) transport of the KV hand-off to a decode worker
// (runtime/handoff/kv_handoff.md): one-sided gets from a peer's registered memory, and small
// active messages.
//
// Main types:
//   UcxTransport     one UCX context and worker for the process (features RMA and AM). Exports
//                    its worker address, registers memory, connects to peers, receives messages.
//   UcxMemoryRegion  memory registered with ucp_mem_map; exports its packed remote key.
//   UcxPeer          an endpoint to a remote worker: unpacks that worker's keys, gets runs of its
//                    memory, sends it messages.
//
// Bytes that cross processes (worker address, memory key) are framed (ucx_transport.cc: magic,
// format version, kind, body length, checksum) and the frame is checked before UCX sees the body:
// UCX trusts its own packed formats and may crash on truncated or random bytes, so such input is
// refused with InvalidArgument instead. The frame detects corruption, not a deliberate forgery
// (a handle is trusted as far as the prefill server that issued it).
//
// Every wait has a deadline; errors name the operation, this worker and the peer. UCX's own
// error texts (ucs_status_string) are kept in the message.
//
// Prefill side (registers its KV pool once, publishes, serves releases between engine steps):
//   CPFILL_ASSIGN_OR_RETURN(auto ucx, UcxTransport::Create({.name = "prefill rank 3"}));
//   CPFILL_ASSIGN_OR_RETURN(auto pool, ucx->RegisterMemory(base, bytes, UcxMemoryKind::kHost));
//   handle: ucx->worker_address(), pool->packed_key(), pool->address()   (caller base64s them)
//   ucx->Progress();  for (UcxMessage& m : ucx->PollMessages()) Release(m);
// Decode side:
//   CPFILL_ASSIGN_OR_RETURN(auto peer, ucx->Connect(address_bytes, "prefill rank 3"));
//   CPFILL_ASSIGN_OR_RETURN(const UcxRemoteKey* key, peer->UnpackKey(key_bytes));
//   std::vector<UcxGetRun> runs = {{.remote_address = pool_address + offset, .key = key,
//                                   .local = dst, .bytes = n}, ...};
//   CPFILL_RETURN_IF_ERROR(peer->Get(runs, UcxDeadlineIn(std::chrono::seconds(30))));
//   CPFILL_RETURN_IF_ERROR(peer->SendMessage(kReleaseId, "cmpl-7", UcxDeadlineIn(5s)));
//
// Threads: by default one thread uses a transport and everything made from it. With
// `multi_threaded`, the worker is thread-safe (UCS_THREAD_MODE_MULTI): a dedicated thread may call
// Progress() while others get and send (each peer used by one thread at a time).
//
// Over transports that emulate RMA in software (tcp), a get completes only while the *remote*
// worker is progressed too: the prefill side must call Progress() often enough (or from its own
// thread) for pulls to move.
//
// Known UCX 1.13 hazard (Debian's build, assertions on): a worker that still holds a wire-up reply
// it has not sent (a peer connected, and this worker was not progressed before it was destroyed,
// or before the peer's connection failed) aborts the process in an assertion
// (ucp_request_send_state_ff: "got REP message"). Seen in this file's tests about one run in
// five until every endpoint they open completes its wire-up; progressing and flushing the worker
// before destroying it did not help (the reply then fails inside ucp_worker_progress). A prefill
// server must progress its worker continually (its own thread) so replies leave at once; whether
// a peer that connects and vanishes within that window can still abort it, and whether newer UCX
// fixes this, is not yet known.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace cpfill::parallel {

namespace internal {
struct UcxWorkerState;
struct UcxInFlightRequest;
}  // namespace internal

using UcxDeadline = std::chrono::steady_clock::time_point;
inline UcxDeadline UcxDeadlineIn(std::chrono::steady_clock::duration timeout) {
  return std::chrono::steady_clock::now() + timeout;
}

struct UcxTransportOptions {
  std::string name = "ucx";  // this worker in error messages, e.g. "prefill rank 3"
  // UCX settings for this context only, without the UCX_ prefix ({"TLS", "tcp"},
  // {"NET_DEVICES", "lo"}); they take precedence over the environment's UCX_* variables.
  std::vector<std::pair<std::string, std::string>> ucx_config;
  bool multi_threaded = false;  // see "Threads" above
  // Endpoints detect a dead peer (UCP_ERR_HANDLING_MODE_PEER): its requests then fail with
  // Unavailable instead of waiting for their deadline. UCX 1.13's shared-memory transports cannot;
  // unless this is set, an endpoint that only they reach is made without detection (UCX logs
  // "no peer failure handler" once per such Connect), and a dead peer there meets the deadline.
  bool require_peer_failure_detection = false;
  size_t max_queued_messages = 1 << 16;     // received, not yet polled; beyond it, dropped
  size_t max_message_payload_bytes = 4096;  // sent eagerly, copied on receipt
};

enum class UcxMemoryKind { kHost, kCuda };

// A received active message. `payload` is bytes (not necessarily text).
struct UcxMessage {
  uint64_t id = 0;
  std::string payload;
};

class UcxPeer;
class UcxRemoteKey;

// One contiguous run of a batched get: `bytes` from the peer's `remote_address` (inside the region
// of `key`) to `local`.
struct UcxGetRun {
  uint64_t remote_address = 0;
  const UcxRemoteKey* key = nullptr;
  void* local = nullptr;
  uint64_t bytes = 0;
};

// Memory registered with the transport's context; unregistered on destruction. Keeps the context
// alive, so it may outlive its UcxTransport.
class UcxMemoryRegion {
 public:
  ~UcxMemoryRegion();
  UcxMemoryRegion(const UcxMemoryRegion&) = delete;
  UcxMemoryRegion& operator=(const UcxMemoryRegion&) = delete;

  void* address() const { return address_; }
  uint64_t bytes() const { return bytes_; }
  UcxMemoryKind kind() const { return kind_; }
  // Framed bytes of the remote key, with this region's address and size (UcxPeer::UnpackKey).
  const std::string& packed_key() const { return packed_key_; }

 private:
  friend class UcxTransport;
  UcxMemoryRegion(std::shared_ptr<internal::UcxWorkerState> worker, void* memory_handle,
                  void* address, uint64_t bytes, UcxMemoryKind kind, std::string packed_key);

  std::shared_ptr<internal::UcxWorkerState> worker_;
  void* memory_handle_;  // ucp_mem_h
  void* address_;
  uint64_t bytes_;
  UcxMemoryKind kind_;
  std::string packed_key_;
};

// A peer's memory key, unpacked on (and owned by) one UcxPeer; valid while that peer lives.
class UcxRemoteKey {
 public:
  uint64_t region_address() const { return region_address_; }
  uint64_t region_bytes() const { return region_bytes_; }

 private:
  friend class UcxPeer;
  const UcxPeer* owner_ = nullptr;
  void* handle_ = nullptr;  // ucp_rkey_h; null once the peer's endpoint is closed
  uint64_t region_address_ = 0;
  uint64_t region_bytes_ = 0;
};

// An endpoint to a remote worker. After a failure (an error from UCX, or a deadline that passed
// with operations outstanding) the endpoint is closed and every later call returns
// FailedPrecondition naming the first failure: connect again to retry.
class UcxPeer {
 public:
  ~UcxPeer();  // destroys the keys, force-closes the endpoint (bounded)
  UcxPeer(const UcxPeer&) = delete;
  UcxPeer& operator=(const UcxPeer&) = delete;

  const std::string& name() const { return name_; }
  // Whether UCX reports this peer's death (see require_peer_failure_detection).
  bool detects_peer_failure() const { return detects_peer_failure_; }

  // Unpacks UcxMemoryRegion::packed_key() bytes from this peer. InvalidArgument on bytes that
  // are not a memory key frame (truncated, corrupted, an address frame, another format version).
  absl::StatusOr<const UcxRemoteKey*> UnpackKey(std::string_view packed_key);

  // Gets every run (ucp_get_nbx; at most a window of them in flight), then waits for all of them,
  // progressing this worker and backing off while nothing moves. InvalidArgument, before anything
  // is issued, for a run outside its key's region or a key of another peer. DeadlineExceeded
  // (returned within about 100 ms of the deadline) names the bytes still outstanding and the
  // peer; the endpoint is then force-closed, which cancels them, so nothing is written into
  // `local` after Get returns. (Without peer failure detection UCX allows no forced close: an
  // abandoned get could still land in `local` while this worker is progressed later, so keep
  // the destination until the transport is gone.)
  absl::Status Get(std::span<const UcxGetRun> runs, UcxDeadline deadline);

  // Sends one active message (eager) and flushes the endpoint, so the message has left this
  // worker when it returns and the peer may be destroyed right after. Delivery is not
  // acknowledged (the receiver answers with its own message if it must).
  absl::Status SendMessage(uint64_t id, std::string_view payload, UcxDeadline deadline);

 private:
  friend class UcxTransport;
  UcxPeer(std::shared_ptr<internal::UcxWorkerState> worker, std::string name);

  std::string Describe(std::string_view operation) const;
  absl::Status CheckOpen(std::string_view operation);
  absl::Status ValidateRuns(std::span<const UcxGetRun> runs) const;
  // Force-closes the endpoint (UCX then cancels its outstanding requests), waits a bounded grace
  // for `in_flight` (may be null) to finish and frees it, then destroys the keys.
  void CloseEndpoint(std::string reason, std::vector<internal::UcxInFlightRequest>* in_flight);
  void DestroyKeys();

  std::shared_ptr<internal::UcxWorkerState> worker_;
  std::string name_;
  void* endpoint_ = nullptr;            // ucp_ep_h; null once closed
  std::atomic<int> endpoint_error_{0};  // ucs_status_t, set by UCX's error callback
  bool detects_peer_failure_ = false;
  std::string closed_reason_;
  std::vector<std::unique_ptr<UcxRemoteKey>> keys_;
};

class UcxTransport {
 public:
  static absl::StatusOr<std::unique_ptr<UcxTransport>> Create(UcxTransportOptions options);
  ~UcxTransport();
  UcxTransport(const UcxTransport&) = delete;
  UcxTransport& operator=(const UcxTransport&) = delete;

  const std::string& name() const;
  // Framed bytes of this worker's address (Connect on the other side).
  const std::string& worker_address() const;
  // Whether this UCX build registers CUDA memory (a CUDA transport is loaded). Debian's and
  // Ubuntu's UCX have none: GPU memory is then staged through host memory by the caller.
  bool supports_cuda_memory() const;
  // "1.13.1": the library loaded at run time, which may be newer than the headers.
  static std::string LibraryVersion();

  // Registers [address, address + bytes). kCuda passes UCS_MEMORY_TYPE_CUDA to ucp_mem_map and
  // is refused (FailedPrecondition) where supports_cuda_memory() is false.
  absl::StatusOr<std::unique_ptr<UcxMemoryRegion>> RegisterMemory(void* address, uint64_t bytes,
                                                                  UcxMemoryKind kind);

  // An endpoint to the worker whose framed address this is; `peer_name` labels it in errors.
  // Returns at once: the connection is established by the first operations' progress.
  // Unavailable where no enabled transport reaches the peer.
  absl::StatusOr<std::unique_ptr<UcxPeer>> Connect(std::string_view worker_address,
                                                   std::string peer_name);

  // Progresses the worker once without blocking (receives messages, serves remote gets that
  // need this side, completes sends). Returns whether anything happened.
  bool Progress();
  // The messages received so far, oldest first; non-blocking.
  std::vector<UcxMessage> PollMessages();
  // Messages dropped because the queue was full or their header was malformed.
  uint64_t dropped_messages() const;

 private:
  explicit UcxTransport(std::shared_ptr<internal::UcxWorkerState> worker);
  std::shared_ptr<internal::UcxWorkerState> worker_;
};

}  // namespace cpfill::parallel
