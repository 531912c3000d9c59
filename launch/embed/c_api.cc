// The C API of libcpfill.so (cpfill.h) over the engine (runtime/engine.h), built the way
// `cpfill serve` builds it (launch/engine_host.h). Each entry point turns statuses into codes
// and catches every exception: nothing C++ crosses into the embedding program.
#include <algorithm>
#include <chrono>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "launch/embed/cpfill.h"
#include "launch/engine_host.h"
#include "launch/flags.h"
#include "launch/session.h"
#include "parallel/selector.h"

// Members end in reverse order: the engine and the model before the grid and MPI they use.
struct cpfill_engine {
  std::unique_ptr<cpfill::launch::Session> session;
  std::optional<cpfill::parallel::ProcessGrid> grid;
  std::unique_ptr<cpfill::launch::EngineHost> host;
  std::thread loop;  // rank 0's; joined by Shutdown before the engine is deleted
  absl::Status loop_status;
  bool shut_down = false;
};

// The tokens a generation has produced so far, written by the engine's thread (on_token) and
// read by the caller's; shared so a request freed while it runs leaves the engine a live log.
struct TokenLog {
  std::mutex mu;
  std::vector<int32_t> ids;
  bool finished = false;
};

struct cpfill_request {
  cpfill::runtime::Engine::Reply reply;
  std::optional<absl::StatusOr<cpfill::runtime::EngineResult>> done;
  std::string algorithm;
  std::shared_ptr<TokenLog> tokens = std::make_shared<TokenLog>();
};

namespace {

using cpfill::launch::EngineFlags;
using cpfill::launch::FlagSet;
using cpfill::launch::SessionFlags;

thread_local std::string last_error;

int Code(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return CPFILL_OK;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      return CPFILL_INVALID_ARGUMENT;
    case absl::StatusCode::kNotFound:
      return CPFILL_NOT_FOUND;
    case absl::StatusCode::kResourceExhausted:
      return CPFILL_RESOURCE_EXHAUSTED;
    case absl::StatusCode::kUnavailable:
      return CPFILL_UNAVAILABLE;
    case absl::StatusCode::kFailedPrecondition:
      return CPFILL_FAILED_PRECONDITION;
    case absl::StatusCode::kDeadlineExceeded:
      return CPFILL_NOT_READY;
    default:
      return CPFILL_INTERNAL;
  }
}

int Report(const absl::Status& status) {
  if (!status.ok()) last_error = std::string(status.message());
  return Code(status);
}

// Runs `body` (returning absl::Status) with every exception turned into CPFILL_INTERNAL.
template <typename Body>
int Guarded(Body body) {
  try {
    return Report(body());
  } catch (const std::exception& e) {
    return Report(absl::InternalError(std::string("cpfill: unexpected exception: ") + e.what()));
  } catch (...) {
    return Report(absl::InternalError("cpfill: unexpected exception"));
  }
}

absl::Status NeedRoot(const cpfill_engine* e, const char* what) {
  if (e == nullptr) return absl::InvalidArgumentError(std::string(what) + ": engine is NULL");
  if (e->session->is_root()) return absl::OkStatus();
  return absl::FailedPreconditionError(std::string(what) +
                                       " is for rank 0; the other ranks call cpfill_engine_run");
}

// Collective: MPI, the grid and the engine from `serve`'s flags.
absl::Status Create(int argc, const char* const* argv, const void* comm, cpfill_engine** out) {
  if (out == nullptr) return absl::InvalidArgumentError("engine: the out pointer is NULL");
  if (argc < 0 || (argc > 0 && argv == nullptr)) {
    return absl::InvalidArgumentError("argv is NULL but argc is not 0");
  }
  EngineFlags ef;
  SessionFlags sf;
  FlagSet flags("cpfill_engine_create", "the engine's flags");
  AddEngineFlags(flags, &ef);
  AddSessionFlags(flags, &sf);
  std::vector<char*> args;  // Parse takes char**; it does not write through them
  for (int i = 0; i < argc; ++i) args.push_back(const_cast<char*>(argv[i]));
  if (absl::Status parsed = flags.Parse(argc, args.data(), 0); !parsed.ok()) return parsed;
  auto e = std::make_unique<cpfill_engine>();
  auto session = cpfill::launch::Session::Embed(sf, comm);
  if (!session.ok()) return session.status();
  e->session = std::move(*session);
  auto grid = e->session->CreateGrid();
  if (!grid.ok()) return grid.status();
  e->grid = std::move(*grid);
  auto host = BuildEngineHost(ef, flags, *e->session, *e->grid, {});
  if (!host.ok()) return host.status();
  e->host = std::move(*host);
  if (e->session->is_root()) {
    cpfill_engine* raw = e.get();
    e->loop = std::thread([raw] { raw->loop_status = raw->host->engine->Run(); });
  }
  *out = e.release();
  return absl::OkStatus();
}

// The engine's generation fields from the C struct (NULL: one greedy token).
absl::Status ApplyParams(const cpfill_generate_params* p, cpfill::runtime::EngineRequest* q) {
  if (p == nullptr) return absl::OkStatus();
  const int64_t max_tokens = p->max_tokens == 0 ? 1 : p->max_tokens;
  if (max_tokens < 1 || max_tokens > (int64_t{1} << 20)) {
    return absl::InvalidArgumentError(absl::StrCat("cpfill_submit_generate: max_tokens is ",
                                                   p->max_tokens, ", must be in [1, 1048576]"));
  }
  if (p->stop_token_ids == nullptr && p->num_stop_token_ids > 0) {
    return absl::InvalidArgumentError(
        "cpfill_submit_generate: stop_token_ids is NULL with num_stop_token_ids > 0");
  }
  q->max_tokens = static_cast<int>(max_tokens);
  q->sampling = {.temperature = p->temperature,
                 .top_k = p->top_k,
                 .top_p = p->top_p == 0 ? 1.0 : p->top_p,
                 .seed = p->seed};
  q->ignore_eos = p->ignore_eos != 0;
  q->stop_ids.assign(p->stop_token_ids, p->stop_token_ids + p->num_stop_token_ids);
  return absl::OkStatus();  // the engine's Submit checks the sampling fields by name
}

absl::Status Submit(cpfill_engine* e, const int32_t* tokens, size_t n, const char* session,
                    const cpfill_generate_params* params, cpfill_request** out) {
  if (absl::Status s = NeedRoot(e, "cpfill_submit"); !s.ok()) return s;
  if (out == nullptr) return absl::InvalidArgumentError("cpfill_submit: request is NULL");
  if (tokens == nullptr && n > 0)
    return absl::InvalidArgumentError("cpfill_submit: tokens is NULL");
  cpfill::runtime::EngineRequest request{.tokens = std::vector<int32_t>(tokens, tokens + n),
                                         .session = session == nullptr ? "" : session};
  if (absl::Status s = ApplyParams(params, &request); !s.ok()) return s;
  auto r = std::make_unique<cpfill_request>();
  request.on_token = [log = r->tokens](const cpfill::runtime::GeneratedToken& t) {
    std::lock_guard lock(log->mu);
    log->ids.push_back(t.token.id);
    log->finished = !t.finish_reason.empty();
  };
  auto reply = e->host->engine->Submit(std::move(request));
  if (!reply.ok()) return reply.status();
  r->reply = std::move(*reply);
  *out = r.release();
  return absl::OkStatus();
}

// Collects the answer once it is there; DeadlineExceeded (NOT_READY) until then.
absl::Status Await(cpfill_request* r, std::optional<double> timeout_s) {
  if (r == nullptr) return absl::InvalidArgumentError("the request is NULL");
  if (r->done) return absl::OkStatus();
  if (!timeout_s) {
    r->reply.wait();
  } else if (r->reply.wait_for(std::chrono::duration<double>(*timeout_s)) !=
             std::future_status::ready) {
    return absl::DeadlineExceededError("the request has not finished");
  }
  r->done = r->reply.get();
  if (r->done->ok()) {
    r->algorithm = std::string(cpfill::parallel::RingAlgorithmName((*r->done)->algorithm));
  }
  return absl::OkStatus();
}

absl::Status Result(cpfill_request* r, cpfill_result* out) {
  if (out == nullptr) return absl::InvalidArgumentError("cpfill_request_result: result is NULL");
  if (absl::Status s = Await(r, 0.0); !s.ok()) return s;
  if (!r->done->ok()) return r->done->status();
  const cpfill::runtime::EngineResult& x = **r->done;
  *out = cpfill_result{.first_token = x.first_token,
                       .logits = x.logits.data(),
                       .vocab_size = static_cast<int64_t>(x.logits.size()),
                       .prompt_tokens = x.prompt_tokens,
                       .cached_tokens = x.cached_tokens,
                       .recomputed = x.recomputed ? 1 : 0,
                       .batch_requests = x.batch_requests,
                       .queue_s = x.queue_s,
                       .prefill_s = x.prefill_s,
                       .algorithm = r->algorithm.c_str()};
  return absl::OkStatus();
}

absl::Status Tokens(cpfill_request* r, int32_t* ids, size_t capacity, size_t* count,
                    int* finished) {
  if (r == nullptr || count == nullptr || finished == nullptr) {
    return absl::InvalidArgumentError("cpfill_request_tokens: request, count or finished is NULL");
  }
  if (ids == nullptr && capacity > 0) {
    return absl::InvalidArgumentError("cpfill_request_tokens: ids is NULL with capacity > 0");
  }
  // A request that failed gives no tokens; it is finished all the same.
  const bool failed = Await(r, 0.0).ok() && !r->done->ok();
  std::lock_guard lock(r->tokens->mu);
  const std::vector<int32_t>& have = r->tokens->ids;
  std::copy_n(have.begin(), std::min(capacity, have.size()), ids);
  *count = have.size();
  *finished = r->tokens->finished || failed ? 1 : 0;
  return absl::OkStatus();
}

absl::Status Shutdown(cpfill_engine* e) {
  if (absl::Status s = NeedRoot(e, "cpfill_engine_shutdown"); !s.ok()) return s;
  if (!e->shut_down) {
    e->host->engine->Shutdown();
    e->loop.join();
    e->shut_down = true;
  }
  return e->loop_status;
}

}  // namespace

extern "C" {

const char* cpfill_version(void) { return "0.1.0"; }
const char* cpfill_last_error(void) { return last_error.c_str(); }

int cpfill_engine_create(int argc, const char* const* argv, const void* mpi_comm,
                         cpfill_engine** engine) {
  return Guarded([&] { return Create(argc, argv, mpi_comm, engine); });
}

int cpfill_engine_rank(const cpfill_engine* e) { return e ? e->session->world_rank() : -1; }
int cpfill_engine_size(const cpfill_engine* e) { return e ? e->grid->world_size : -1; }
int64_t cpfill_engine_vocab_size(const cpfill_engine* e) {
  return e ? e->host->config.vocab_size : -1;
}

int cpfill_engine_run(cpfill_engine* e) {
  return Guarded([&] {
    if (e == nullptr) return absl::InvalidArgumentError("cpfill_engine_run: engine is NULL");
    if (e->session->is_root()) {
      return absl::FailedPreconditionError(
          "cpfill_engine_run is for ranks other than 0; rank 0 runs its loop inside the engine");
    }
    absl::Status s = e->host->engine->Run();
    e->shut_down = true;
    return s;
  });
}

int cpfill_submit(cpfill_engine* e, const int32_t* tokens, size_t n, const char* session,
                  cpfill_request** request) {
  return Guarded([&] { return Submit(e, tokens, n, session, nullptr, request); });
}

int cpfill_submit_generate(cpfill_engine* e, const int32_t* tokens, size_t n, const char* session,
                           const cpfill_generate_params* params, cpfill_request** request) {
  return Guarded([&] { return Submit(e, tokens, n, session, params, request); });
}

int cpfill_request_tokens(cpfill_request* r, int32_t* ids, size_t capacity, size_t* count,
                          int* finished) {
  return Guarded([&] { return Tokens(r, ids, capacity, count, finished); });
}

const char* cpfill_request_finish_reason(cpfill_request* r) {
  if (r == nullptr || !Await(r, 0.0).ok() || !r->done->ok()) return nullptr;
  return (*r->done)->finish_reason.c_str();
}

int cpfill_request_poll(cpfill_request* r) {
  return Guarded([&] { return Await(r, 0.0); });
}

int cpfill_request_wait(cpfill_request* r, double timeout_s) {
  return Guarded(
      [&] { return Await(r, timeout_s < 0 ? std::nullopt : std::optional<double>(timeout_s)); });
}

int cpfill_request_result(cpfill_request* r, cpfill_result* result) {
  return Guarded([&] { return Result(r, result); });
}

void cpfill_request_free(cpfill_request* r) { delete r; }

int cpfill_session_end(cpfill_engine* e, const char* session) {
  return Guarded([&] {
    if (absl::Status s = NeedRoot(e, "cpfill_session_end"); !s.ok()) return s;
    if (session == nullptr)
      return absl::InvalidArgumentError("cpfill_session_end: session is NULL");
    return e->host->engine->EndSession(session).get();
  });
}

int cpfill_engine_shutdown(cpfill_engine* e) {
  return Guarded([&] { return Shutdown(e); });
}

void cpfill_engine_destroy(cpfill_engine* e) {
  if (e == nullptr) return;
  try {
    if (e->session->is_root() && !e->shut_down) (void)Shutdown(e);
    delete e;
  } catch (...) {
    // Nothing may cross the boundary; the process is ending its use of cpfill either way.
  }
}

}  // extern "C"
