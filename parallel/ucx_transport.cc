#include "parallel/ucx_transport.h"

#include <ucp/api/ucp.h>

#include <algorithm>
#include <deque>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/random.h"
#include "base/status.h"
#include "base/string_view.h"

namespace cpfill::parallel {

namespace internal {

// What a transport, its peers and its memory regions share. Destroyed with the last of them, so
// the worker outlives every endpoint and the context every registration, whatever order the
// owners go in.
struct UcxWorkerState {
  ~UcxWorkerState() {
    if (worker != nullptr) ucp_worker_destroy(worker);
    if (context != nullptr) ucp_cleanup(context);
  }

  std::string name;
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  std::string worker_address;  // framed
  bool supports_cuda_memory = false;
  size_t max_queued_messages = 0;
  size_t max_message_payload_bytes = 0;
  bool require_peer_failure_detection = false;

  // The active-message callback runs on whichever thread progresses the worker.
  std::mutex messages_mutex;
  std::deque<UcxMessage> messages;
  std::atomic<uint64_t> dropped_messages{0};
};

// A request UCX returned, with the bytes it moves (for the deadline's message).
struct UcxInFlightRequest {
  void* request = nullptr;
  uint64_t bytes = 0;
};

}  // namespace internal

namespace {

using internal::UcxInFlightRequest;
using internal::UcxWorkerState;

// ---- Frames around the bytes that cross processes ----------------------------------------------
//
// Little-endian, 24-byte header then the body:
//   [0, 4)    magic "CPUX"
//   [4, 6)    format version (kFrameVersion)
//   [6, 8)    kind (FrameKind)
//   [8, 12)   body bytes
//   [12, 16)  UCX version of the packing side, major << 16 | minor (for messages only)
//   [16, 24)  FNV-1a 64 of the body
// Bodies: a worker address is ucp_worker_get_address's bytes; a memory key is the region's
// address (u64) and size (u64), then ucp_rkey_pack's bytes.
constexpr uint32_t kFrameMagic = 0x58555043;  // "CPUX" read as little-endian
constexpr uint16_t kFrameVersion = 1;
constexpr size_t kFrameHeaderBytes = 24;
static_assert(kFrameHeaderBytes == 4 + 2 + 2 + 4 + 4 + 8, "frame header layout");
// runtime/handoff/kv_handle.h bounds a handle's decoded worker address and rkey at 64 KiB.
constexpr size_t kMaxFrameBytes = 64 * 1024;
constexpr size_t kMemoryKeyPrefixBytes = 16;  // region address, region size

enum class FrameKind : uint16_t { kWorkerAddress = 1, kMemoryKey = 2 };

const char* FrameKindName(FrameKind kind) {
  return kind == FrameKind::kWorkerAddress ? "worker address" : "memory key";
}

template <typename T>
void AppendLittleEndian(std::string& out, T value) {
  for (size_t i = 0; i < sizeof(T); ++i)
    out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

template <typename T>
T ReadLittleEndian(std::string_view bytes, size_t offset) {
  T value = 0;
  for (size_t i = 0; i < sizeof(T); ++i) {
    value |= static_cast<T>(static_cast<uint8_t>(bytes[offset + i])) << (8 * i);
  }
  return value;
}

uint32_t LoadedUcxVersion() {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  return (major << 16) | minor;
}

std::string UcxVersionText(uint32_t packed) {
  return absl::StrCat(packed >> 16, ".", packed & 0xffff);
}

absl::StatusOr<std::string> Frame(FrameKind kind, std::string_view body) {
  if (kFrameHeaderBytes + body.size() > kMaxFrameBytes) {
    return absl::FailedPreconditionError(absl::StrCat(
        "UCX ", FrameKindName(kind), " of ", body.size(), " bytes exceeds the handle's limit of ",
        kMaxFrameBytes, " bytes: restrict UCX_NET_DEVICES / UCX_TLS"));
  }
  std::string frame;
  frame.reserve(kFrameHeaderBytes + body.size());
  AppendLittleEndian<uint32_t>(frame, kFrameMagic);
  AppendLittleEndian<uint16_t>(frame, kFrameVersion);
  AppendLittleEndian<uint16_t>(frame, static_cast<uint16_t>(kind));
  AppendLittleEndian<uint32_t>(frame, static_cast<uint32_t>(body.size()));
  AppendLittleEndian<uint32_t>(frame, LoadedUcxVersion());
  AppendLittleEndian<uint64_t>(frame, Fnv1a64(body));
  frame.append(body);
  return frame;
}

// The body of `frame` after checking every header field, copied so that UCX reads it from an
// allocation of its own (aligned, exactly body-sized). `whose` names the frame in errors.
absl::StatusOr<std::string> Unframe(std::string_view frame, FrameKind expected,
                                    std::string_view whose) {
  const std::string what = absl::StrCat("UCX ", FrameKindName(expected), " ", Sv(whose));
  CPFILL_CHECK_ARG(frame.size() >= kFrameHeaderBytes, what, ": ", frame.size(),
                   " bytes, shorter than the ", kFrameHeaderBytes, "-byte frame header");
  CPFILL_CHECK_ARG(frame.size() <= kMaxFrameBytes, what, ": ", frame.size(),
                   " bytes exceeds the limit of ", kMaxFrameBytes);
  CPFILL_CHECK_ARG(ReadLittleEndian<uint32_t>(frame, 0) == kFrameMagic, what,
                   ": not a cpfill UCX frame (bad magic)");
  const uint16_t version = ReadLittleEndian<uint16_t>(frame, 4);
  CPFILL_CHECK_ARG(version == kFrameVersion, what, ": frame format version ", version,
                   ", this build reads version ", kFrameVersion);
  const uint16_t kind = ReadLittleEndian<uint16_t>(frame, 6);
  CPFILL_CHECK_ARG(kind == static_cast<uint16_t>(expected), what, ": the frame holds a ",
                   kind == static_cast<uint16_t>(FrameKind::kWorkerAddress) ? "worker address"
                   : kind == static_cast<uint16_t>(FrameKind::kMemoryKey)   ? "memory key"
                                                                          : "frame of unknown kind",
                   ", not a ", FrameKindName(expected));
  const uint32_t body_bytes = ReadLittleEndian<uint32_t>(frame, 8);
  CPFILL_CHECK_ARG(body_bytes == frame.size() - kFrameHeaderBytes, what, ": the header says ",
                   body_bytes, " body bytes, ", frame.size() - kFrameHeaderBytes,
                   " follow it (truncated or padded)");
  const std::string_view body = frame.substr(kFrameHeaderBytes);
  CPFILL_CHECK_ARG(ReadLittleEndian<uint64_t>(frame, 16) == Fnv1a64(body), what,
                   ": checksum mismatch (corrupted; packed by UCX ",
                   UcxVersionText(ReadLittleEndian<uint32_t>(frame, 12)), ")");
  CPFILL_CHECK_ARG(!body.empty(), what, ": empty body");
  return std::string(body);
}

// ---- UCX status -> absl::Status ----------------------------------------------------------------

absl::StatusCode CodeForUcxStatus(ucs_status_t status) {
  if (UCS_IS_ENDPOINT_ERROR(status) || UCS_IS_LINK_ERROR(status)) {
    return absl::StatusCode::kUnavailable;  // the peer or the path to it is gone
  }
  switch (status) {
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
    case UCS_ERR_OUT_OF_RANGE:
      return absl::StatusCode::kInvalidArgument;
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_EXCEEDS_LIMIT:
      return absl::StatusCode::kResourceExhausted;
    case UCS_ERR_TIMED_OUT:
      return absl::StatusCode::kDeadlineExceeded;
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_NO_DEVICE:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_REJECTED:
    case UCS_ERR_CANCELED:
    case UCS_ERR_IO_ERROR:
      return absl::StatusCode::kUnavailable;
    case UCS_ERR_UNSUPPORTED:
    case UCS_ERR_NOT_IMPLEMENTED:
      return absl::StatusCode::kFailedPrecondition;
    default:
      return absl::StatusCode::kInternal;
  }
}

absl::Status UcxError(ucs_status_t status, std::string_view operation) {
  return absl::Status(CodeForUcxStatus(status),
                      absl::StrCat(Sv(operation), ": ", ucs_status_string(status), " (UCX ",
                                   UcxVersionText(LoadedUcxVersion()), ")"));
}

// ---- Waiting -----------------------------------------------------------------------------------

// Waits that make no progress spin a few rounds (a fast peer costs little latency), then sleep,
// doubling up to a cap (a slow or stuck peer costs little CPU), never past the deadline.
class IdleBackoff {
 public:
  void Reset() {
    idle_rounds_ = 0;
    sleep_ = kFirstSleep;
  }
  void Idle(UcxDeadline deadline) {
    if (++idle_rounds_ <= kSpinRounds) return;
    std::this_thread::sleep_until(std::min(std::chrono::steady_clock::now() + sleep_, deadline));
    sleep_ = std::min(sleep_ * 2, kMaxSleep);
  }

 private:
  static constexpr int kSpinRounds = 64;
  static constexpr std::chrono::microseconds kFirstSleep{10};
  static constexpr std::chrono::microseconds kMaxSleep{1000};
  int idle_rounds_ = 0;
  std::chrono::microseconds sleep_ = kFirstSleep;
};

// Frees the requests of `in_flight` that completed, keeping the first error in `first_error`.
// Returns whether any completed.
bool ReapCompleted(std::vector<UcxInFlightRequest>& in_flight, ucs_status_t& first_error) {
  const size_t before = in_flight.size();
  std::erase_if(in_flight, [&](const UcxInFlightRequest& op) {
    const ucs_status_t status = ucp_request_check_status(op.request);
    if (status == UCS_INPROGRESS) return false;
    if (status != UCS_OK && first_error == UCS_OK) first_error = status;
    ucp_request_free(op.request);
    return true;
  });
  return in_flight.size() != before;
}

// Progresses `worker` until at most `max_in_flight` requests remain. False when the deadline
// passed first (the remaining requests are still in flight).
bool ProgressUntilAtMost(ucp_worker_h worker, std::vector<UcxInFlightRequest>& in_flight,
                         size_t max_in_flight, UcxDeadline deadline, ucs_status_t& first_error) {
  IdleBackoff backoff;
  while (in_flight.size() > max_in_flight) {
    const bool progressed = ucp_worker_progress(worker) != 0;
    const bool completed = ReapCompleted(in_flight, first_error);
    if (in_flight.size() <= max_in_flight) break;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    if (progressed || completed) {
      backoff.Reset();
    } else {
      backoff.Idle(deadline);
    }
  }
  return true;
}

void TrackRequest(ucs_status_ptr_t request, uint64_t bytes,
                  std::vector<UcxInFlightRequest>& in_flight, ucs_status_t& first_error) {
  if (UCS_PTR_IS_ERR(request)) {
    if (first_error == UCS_OK) first_error = UCS_PTR_STATUS(request);
  } else if (request != nullptr) {  // null: completed in place
    in_flight.push_back({request, bytes});
  }
}

uint64_t InFlightBytes(const std::vector<UcxInFlightRequest>& in_flight) {
  uint64_t bytes = 0;
  for (const UcxInFlightRequest& op : in_flight) bytes += op.bytes;
  return bytes;
}

// Gets beyond this many in flight wait for earlier ones: bounds UCX's request memory and the
// scan of each progress round for a batch of many small runs.
constexpr size_t kMaxGetsInFlight = 256;
// After an endpoint close, how long it and its cancelled requests get to complete before they
// are freed unfinished (UCX then releases them when they do).
constexpr std::chrono::milliseconds kCloseGrace{100};
// The one active-message handler cpfill registers; a message's own id travels in its header.
constexpr unsigned kMessageAmId = 7;
constexpr size_t kMessageHeaderBytes = sizeof(uint64_t);

ucs_status_t OnActiveMessage(void* arg, const void* header, size_t header_bytes, void* data,
                             size_t payload_bytes, const ucp_am_recv_param_t* param) {
  auto* state = static_cast<UcxWorkerState*>(arg);
  // Senders force eager data (SendMessage); a rendezvous descriptor, a foreign header or an
  // oversized payload is not ours to receive: count it and let UCX release it.
  const bool is_rendezvous = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  if (is_rendezvous || header_bytes != kMessageHeaderBytes ||
      payload_bytes > state->max_message_payload_bytes) {
    state->dropped_messages.fetch_add(1);
    return UCS_OK;
  }
  UcxMessage message;
  message.id = ReadLittleEndian<uint64_t>(
      std::string_view(static_cast<const char*>(header), kMessageHeaderBytes), 0);
  message.payload.assign(static_cast<const char*>(data), payload_bytes);
  std::lock_guard<std::mutex> lock(state->messages_mutex);
  if (state->messages.size() >= state->max_queued_messages) {
    state->dropped_messages.fetch_add(1);
    return UCS_OK;
  }
  state->messages.push_back(std::move(message));
  return UCS_OK;  // the payload was copied: UCX may release its buffer
}

void OnEndpointError(void* arg, ucp_ep_h /*endpoint*/, ucs_status_t status) {
  // Only recorded here (UCX is inside progress); the peer closes the endpoint on its next call.
  static_cast<std::atomic<int>*>(arg)->store(status);
}

// ---- Creation steps ----------------------------------------------------------------------------

absl::StatusOr<ucp_context_h> CreateContext(const UcxTransportOptions& options) {
  ucp_config_t* config = nullptr;
  ucs_status_t status = ucp_config_read(nullptr, nullptr, &config);
  if (status != UCS_OK) return UcxError(status, "ucp_config_read");
  for (const auto& [setting, value] : options.ucx_config) {
    status = ucp_config_modify(config, setting.c_str(), value.c_str());
    if (status != UCS_OK) {
      ucp_config_release(config);
      return absl::InvalidArgumentError(absl::StrCat("UCX setting ", setting, "=", value, " for '",
                                                     options.name,
                                                     "': ", ucs_status_string(status)));
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM;
  // A multi-threaded worker also makes the context's calls (ucp_mem_map) safe next to progress.
  params.mt_workers_shared = options.multi_threaded ? 1 : 0;
  ucp_context_h context = nullptr;
  status = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (status != UCS_OK) return UcxError(status, absl::StrCat("ucp_init for '", options.name, "'"));
  return context;
}

absl::Status CreateWorker(const UcxTransportOptions& options, UcxWorkerState& state) {
  ucs_thread_mode_t thread_mode = UCS_THREAD_MODE_SINGLE;
  if (options.multi_threaded) {
    ucp_lib_attr_t lib{};
    lib.field_mask = UCP_LIB_ATTR_FIELD_MAX_THREAD_LEVEL;
    if (ucp_lib_query(&lib) != UCS_OK || lib.max_thread_level < UCS_THREAD_MODE_MULTI) {
      return absl::FailedPreconditionError(absl::StrCat(
          "UCX worker '", options.name, "': this UCX build has no multi-threaded workers"));
    }
    thread_mode = UCS_THREAD_MODE_MULTI;
  }
  ucp_worker_params_t params{};
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  params.thread_mode = thread_mode;
  const ucs_status_t status = ucp_worker_create(state.context, &params, &state.worker);
  if (status != UCS_OK) {
    state.worker = nullptr;
    return UcxError(status, absl::StrCat("ucp_worker_create for '", options.name, "'"));
  }
  return absl::OkStatus();
}

absl::Status ExportWorkerAddress(UcxWorkerState& state) {
  ucp_address_t* address = nullptr;
  size_t address_bytes = 0;
  const ucs_status_t status = ucp_worker_get_address(state.worker, &address, &address_bytes);
  if (status != UCS_OK) {
    return UcxError(status, absl::StrCat("ucp_worker_get_address of '", state.name, "'"));
  }
  auto framed = Frame(FrameKind::kWorkerAddress,
                      std::string_view(reinterpret_cast<const char*>(address), address_bytes));
  ucp_worker_release_address(state.worker, address);
  CPFILL_RETURN_IF_ERROR(framed.status());
  state.worker_address = *std::move(framed);
  return absl::OkStatus();
}

absl::Status SetMessageHandler(UcxWorkerState& state) {
  ucp_am_handler_param_t params{};
  params.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  params.id = kMessageAmId;
  params.cb = OnActiveMessage;
  params.arg = &state;
  params.flags = UCP_AM_FLAG_WHOLE_MSG;  // a fragmented message arrives once, reassembled
  const ucs_status_t status = ucp_worker_set_am_recv_handler(state.worker, &params);
  if (status != UCS_OK) {
    return UcxError(status, absl::StrCat("ucp_worker_set_am_recv_handler of '", state.name, "'"));
  }
  return absl::OkStatus();
}

bool ContextSupportsCudaMemory(ucp_context_h context) {
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  return ucp_context_query(context, &attr) == UCS_OK &&
         (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
}

}  // namespace

// ---- UcxTransport ------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<UcxTransport>> UcxTransport::Create(UcxTransportOptions options) {
  CPFILL_CHECK_ARG(options.max_queued_messages > 0, "UCX transport '", options.name,
                   "': max_queued_messages must be positive");
  auto state = std::make_shared<UcxWorkerState>();
  state->name = options.name;
  state->max_queued_messages = options.max_queued_messages;
  state->max_message_payload_bytes = options.max_message_payload_bytes;
  state->require_peer_failure_detection = options.require_peer_failure_detection;
  CPFILL_ASSIGN_OR_RETURN(state->context, CreateContext(options));
  CPFILL_RETURN_IF_ERROR(CreateWorker(options, *state));
  CPFILL_RETURN_IF_ERROR(ExportWorkerAddress(*state));
  CPFILL_RETURN_IF_ERROR(SetMessageHandler(*state));
  state->supports_cuda_memory = ContextSupportsCudaMemory(state->context);
  return std::unique_ptr<UcxTransport>(new UcxTransport(std::move(state)));
}

UcxTransport::UcxTransport(std::shared_ptr<UcxWorkerState> worker) : worker_(std::move(worker)) {}
UcxTransport::~UcxTransport() = default;

const std::string& UcxTransport::name() const { return worker_->name; }
const std::string& UcxTransport::worker_address() const { return worker_->worker_address; }
bool UcxTransport::supports_cuda_memory() const { return worker_->supports_cuda_memory; }

std::string UcxTransport::LibraryVersion() {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  return absl::StrCat(major, ".", minor, ".", release);
}

absl::StatusOr<std::unique_ptr<UcxMemoryRegion>> UcxTransport::RegisterMemory(void* address,
                                                                              uint64_t bytes,
                                                                              UcxMemoryKind kind) {
  CPFILL_CHECK_ARG(address != nullptr && bytes > 0, "UCX memory registration on '", name(),
                   "': empty region");
  // Debian's UCX (1.13) and Ubuntu's (1.16) load no CUDA transport (cuda_copy, cuda_ipc): there
  // the caller stages GPU memory through registered host buffers. A UCX with them (the
  // libucx-cu13 wheel) registers device memory directly.
  if (kind == UcxMemoryKind::kCuda && !supports_cuda_memory()) {
    return absl::FailedPreconditionError(
        absl::StrCat("UCX ", LibraryVersion(), " on '", name(),
                     "' has no CUDA memory support: stage GPU memory through host memory"));
  }
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  params.address = address;
  params.length = bytes;
  params.memory_type = kind == UcxMemoryKind::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
  const std::string what = absl::StrFormat("of %d bytes at %p on '%s'", bytes, address, name());
  ucp_mem_h memh = nullptr;
  ucs_status_t status = ucp_mem_map(worker_->context, &params, &memh);
  if (status != UCS_OK) return UcxError(status, absl::StrCat("ucp_mem_map ", what));

  void* packed = nullptr;
  size_t packed_bytes = 0;
  status = ucp_rkey_pack(worker_->context, memh, &packed, &packed_bytes);
  if (status != UCS_OK) {
    ucp_mem_unmap(worker_->context, memh);
    return UcxError(status, absl::StrCat("ucp_rkey_pack ", what));
  }
  std::string body;
  AppendLittleEndian<uint64_t>(body, reinterpret_cast<uintptr_t>(address));
  AppendLittleEndian<uint64_t>(body, bytes);
  body.append(static_cast<const char*>(packed), packed_bytes);
  ucp_rkey_buffer_release(packed);
  auto framed = Frame(FrameKind::kMemoryKey, body);
  if (!framed.ok()) {
    ucp_mem_unmap(worker_->context, memh);
    return framed.status();
  }
  return std::unique_ptr<UcxMemoryRegion>(
      new UcxMemoryRegion(worker_, memh, address, bytes, kind, *std::move(framed)));
}

absl::StatusOr<std::unique_ptr<UcxPeer>> UcxTransport::Connect(std::string_view worker_address,
                                                               std::string peer_name) {
  CPFILL_ASSIGN_OR_RETURN(const std::string address,
                          Unframe(worker_address, FrameKind::kWorkerAddress,
                                  absl::StrCat("of peer '", peer_name, "'")));
  auto peer = std::unique_ptr<UcxPeer>(new UcxPeer(worker_, std::move(peer_name)));
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(address.data());
  // Peer mode: a peer that dies fails this endpoint's requests (and calls OnEndpointError).
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = OnEndpointError;
  params.err_handler.arg = &peer->endpoint_error_;
  ucp_ep_h endpoint = nullptr;
  ucs_status_t status = ucp_ep_create(worker_->worker, &params, &endpoint);
  // Unreachable in peer mode may only mean that the transports that reach the peer cannot
  // detect its failure (shared memory in UCX 1.13; UCX logs which): retry without detection.
  peer->detects_peer_failure_ = status == UCS_OK;
  if (status == UCS_ERR_UNREACHABLE && !worker_->require_peer_failure_detection) {
    params.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    status = ucp_ep_create(worker_->worker, &params, &endpoint);
  }
  if (status != UCS_OK) return UcxError(status, peer->Describe("ucp_ep_create"));
  peer->endpoint_ = endpoint;
  return peer;
}

bool UcxTransport::Progress() { return ucp_worker_progress(worker_->worker) != 0; }

std::vector<UcxMessage> UcxTransport::PollMessages() {
  std::lock_guard<std::mutex> lock(worker_->messages_mutex);
  std::vector<UcxMessage> messages(std::make_move_iterator(worker_->messages.begin()),
                                   std::make_move_iterator(worker_->messages.end()));
  worker_->messages.clear();
  return messages;
}

uint64_t UcxTransport::dropped_messages() const { return worker_->dropped_messages.load(); }

// ---- UcxMemoryRegion ---------------------------------------------------------------------------

UcxMemoryRegion::UcxMemoryRegion(std::shared_ptr<UcxWorkerState> worker, void* memory_handle,
                                 void* address, uint64_t bytes, UcxMemoryKind kind,
                                 std::string packed_key)
    : worker_(std::move(worker)),
      memory_handle_(memory_handle),
      address_(address),
      bytes_(bytes),
      kind_(kind),
      packed_key_(std::move(packed_key)) {}

UcxMemoryRegion::~UcxMemoryRegion() {
  ucp_mem_unmap(worker_->context, static_cast<ucp_mem_h>(memory_handle_));
}

// ---- UcxPeer -----------------------------------------------------------------------------------

UcxPeer::UcxPeer(std::shared_ptr<UcxWorkerState> worker, std::string name)
    : worker_(std::move(worker)), name_(std::move(name)) {}

UcxPeer::~UcxPeer() {
  // UCX's order: keys before their endpoint. Every get and send has completed or been cancelled
  // by the time its call returned, so nothing is in flight here.
  DestroyKeys();
  CloseEndpoint("peer destroyed", nullptr);
}

std::string UcxPeer::Describe(std::string_view operation) const {
  return absl::StrCat("UCX ", Sv(operation), " (worker '", worker_->name, "', peer '", name_, "')");
}

absl::Status UcxPeer::CheckOpen(std::string_view operation) {
  const auto error = static_cast<ucs_status_t>(endpoint_error_.load());
  if (endpoint_ != nullptr && error != UCS_OK) {
    absl::Status failed =
        UcxError(error, Describe(absl::StrCat(Sv(operation), ": endpoint failed")));
    CloseEndpoint(std::string(failed.message()), nullptr);
    return failed;
  }
  if (endpoint_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        Describe(operation), ": the endpoint was closed (", closed_reason_, "); connect again"));
  }
  return absl::OkStatus();
}

absl::StatusOr<const UcxRemoteKey*> UcxPeer::UnpackKey(std::string_view packed_key) {
  CPFILL_RETURN_IF_ERROR(CheckOpen("key unpack"));
  CPFILL_ASSIGN_OR_RETURN(const std::string body, Unframe(packed_key, FrameKind::kMemoryKey,
                                                          absl::StrCat("from peer '", name_, "'")));
  CPFILL_CHECK_ARG(body.size() > kMemoryKeyPrefixBytes, Describe("key unpack"), ": body of ",
                   body.size(), " bytes holds no packed key");
  auto key = std::make_unique<UcxRemoteKey>();
  key->owner_ = this;
  key->region_address_ = ReadLittleEndian<uint64_t>(body, 0);
  key->region_bytes_ = ReadLittleEndian<uint64_t>(body, 8);
  CPFILL_CHECK_ARG(
      key->region_bytes_ > 0 && key->region_address_ <= UINT64_MAX - key->region_bytes_,
      Describe("key unpack"), ": region [", key->region_address_, ", +", key->region_bytes_,
      ") is empty or wraps around");
  ucp_rkey_h rkey = nullptr;
  const ucs_status_t status = ucp_ep_rkey_unpack(static_cast<ucp_ep_h>(endpoint_),
                                                 body.data() + kMemoryKeyPrefixBytes, &rkey);
  if (status != UCS_OK) return UcxError(status, Describe("ucp_ep_rkey_unpack"));
  key->handle_ = rkey;
  keys_.push_back(std::move(key));
  return keys_.back().get();
}

absl::Status UcxPeer::ValidateRuns(std::span<const UcxGetRun> runs) const {
  // The message is built only for a refused run: a pull may have many thousands.
  auto refuse = [&](size_t i, std::string_view problem) {
    return absl::InvalidArgumentError(
        absl::StrCat(Describe("get"), ": run ", i, " of ", runs.size(), ": ", Sv(problem)));
  };
  for (size_t i = 0; i < runs.size(); ++i) {
    const UcxGetRun& run = runs[i];
    if (run.key == nullptr || run.key->owner_ != this) {
      return refuse(i, "its key was not unpacked on this peer");
    }
    if (run.local == nullptr || run.bytes == 0) return refuse(i, "empty or no destination");
    const UcxRemoteKey& key = *run.key;
    const bool inside = run.remote_address >= key.region_address_ &&
                        run.bytes <= key.region_bytes_ &&
                        run.remote_address - key.region_address_ <= key.region_bytes_ - run.bytes;
    if (!inside) {
      return refuse(i, absl::StrFormat("[%#x, +%d) lies outside its key's region [%#x, +%d)",
                                       run.remote_address, run.bytes, key.region_address_,
                                       key.region_bytes_));
    }
  }
  return absl::OkStatus();
}

absl::Status UcxPeer::Get(std::span<const UcxGetRun> runs, UcxDeadline deadline) {
  CPFILL_RETURN_IF_ERROR(CheckOpen("get"));
  CPFILL_RETURN_IF_ERROR(ValidateRuns(runs));
  uint64_t total_bytes = 0;
  for (const UcxGetRun& run : runs) total_bytes += run.bytes;
  uint64_t unissued_bytes = total_bytes;
  std::vector<UcxInFlightRequest> in_flight;
  in_flight.reserve(kMaxGetsInFlight);
  ucs_status_t first_error = UCS_OK;
  ucp_worker_h worker = worker_->worker;
  const ucp_request_param_t param{};  // no callback: requests are polled
  bool on_time = true;

  // Step 1: issue the runs in order, keeping at most kMaxGetsInFlight in flight; stop issuing at
  // the first error.
  size_t issued_runs = 0;
  for (; issued_runs < runs.size() && first_error == UCS_OK; ++issued_runs) {
    on_time = ProgressUntilAtMost(worker, in_flight, kMaxGetsInFlight - 1, deadline, first_error);
    if (!on_time || first_error != UCS_OK) break;
    const UcxGetRun& run = runs[issued_runs];
    TrackRequest(ucp_get_nbx(static_cast<ucp_ep_h>(endpoint_), run.local, run.bytes,
                             run.remote_address, static_cast<ucp_rkey_h>(run.key->handle_), &param),
                 run.bytes, in_flight, first_error);
    unissued_bytes -= run.bytes;
  }
  // Step 2: wait for the rest (also after an error, so no request outlives this call).
  on_time = on_time && ProgressUntilAtMost(worker, in_flight, 0, deadline, first_error);

  // Step 3: on a deadline, cancel what is outstanding by closing the endpoint.
  if (!on_time) {
    const uint64_t outstanding_bytes = unissued_bytes + InFlightBytes(in_flight);
    const std::string message = absl::StrCat(
        Describe("get"), ": deadline passed with ", outstanding_bytes, " of ", total_bytes,
        " bytes outstanding (", in_flight.size(), " gets in flight, ", runs.size() - issued_runs,
        " of ", runs.size(), " runs not issued); endpoint closed");
    CloseEndpoint(message, &in_flight);
    return absl::DeadlineExceededError(message);
  }
  if (first_error != UCS_OK) {
    absl::Status failed = UcxError(
        first_error,
        Describe(absl::StrCat("ucp_get_nbx of ", runs.size(), " runs, ", total_bytes, " bytes")));
    CloseEndpoint(std::string(failed.message()), nullptr);
    return failed;
  }
  return absl::OkStatus();
}

absl::Status UcxPeer::SendMessage(uint64_t id, std::string_view payload, UcxDeadline deadline) {
  CPFILL_RETURN_IF_ERROR(CheckOpen("message send"));
  CPFILL_CHECK_ARG(payload.size() <= worker_->max_message_payload_bytes, Describe("message send"),
                   ": payload of ", payload.size(), " bytes exceeds the limit of ",
                   worker_->max_message_payload_bytes);
  std::string header;
  AppendLittleEndian<uint64_t>(header, id);
  auto* endpoint = static_cast<ucp_ep_h>(endpoint_);
  std::vector<UcxInFlightRequest> in_flight;
  ucs_status_t first_error = UCS_OK;

  // Step 1: send eagerly (the receiver's handler takes the data in its callback, never as a
  // rendezvous descriptor). Step 2: flush, so the message has left this process when we return
  // and closing the endpoint right after cannot drop it.
  ucp_request_param_t send_param{};
  send_param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  send_param.flags = UCP_AM_SEND_FLAG_EAGER;
  TrackRequest(ucp_am_send_nbx(endpoint, kMessageAmId, header.data(), header.size(), payload.data(),
                               payload.size(), &send_param),
               payload.size(), in_flight, first_error);
  const ucp_request_param_t flush_param{};
  if (first_error == UCS_OK) {
    TrackRequest(ucp_ep_flush_nbx(endpoint, &flush_param), 0, in_flight, first_error);
  }
  const std::string what = absl::StrCat("message ", id, " of ", payload.size(), " bytes");
  if (!ProgressUntilAtMost(worker_->worker, in_flight, 0, deadline, first_error)) {
    const std::string message = absl::StrCat(Describe("message send"), ": deadline passed before ",
                                             what, " left this worker; endpoint closed");
    CloseEndpoint(message, &in_flight);  // the requests point at `header` and `payload`
    return absl::DeadlineExceededError(message);
  }
  if (first_error != UCS_OK) {
    absl::Status failed =
        UcxError(first_error, Describe(absl::StrCat("ucp_am_send_nbx of ", what)));
    CloseEndpoint(std::string(failed.message()), nullptr);
    return failed;
  }
  return absl::OkStatus();
}

void UcxPeer::CloseEndpoint(std::string reason, std::vector<UcxInFlightRequest>* in_flight) {
  if (endpoint_ == nullptr) return;
  closed_reason_ = std::move(reason);
  std::vector<UcxInFlightRequest> closing;
  if (in_flight != nullptr) closing = std::move(*in_flight);
  // A forced close needs no answer from the peer (which may be dead or stuck) and completes the
  // endpoint's outstanding requests with UCS_ERR_CANCELED. UCX allows it only where both sides
  // handle peer failure; without detection the close flushes, bounded by kCloseGrace below.
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = detects_peer_failure_ ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_t ignored = UCS_OK;
  TrackRequest(ucp_ep_close_nbx(static_cast<ucp_ep_h>(endpoint_), &param), 0, closing, ignored);
  endpoint_ = nullptr;
  ProgressUntilAtMost(worker_->worker, closing, 0, std::chrono::steady_clock::now() + kCloseGrace,
                      ignored);
  for (const UcxInFlightRequest& op : closing) ucp_request_free(op.request);  // freed when done
  // UCX asks for keys to go before their endpoint, but cancelled gets still used them until the
  // close above; a key is released through its own transports, not through the endpoint.
  DestroyKeys();
}

void UcxPeer::DestroyKeys() {
  for (const std::unique_ptr<UcxRemoteKey>& key : keys_) {
    if (key->handle_ != nullptr) ucp_rkey_destroy(static_cast<ucp_rkey_h>(key->handle_));
    key->handle_ = nullptr;
  }
}

}  // namespace cpfill::parallel
