// The C API of libcpfill.so (cpfill.h) over the engine (runtime/serving/engine.h), built the way
// `cpfill serve` builds it (launch/job/engine_host.h). Each entry point turns statuses into codes
// and catches every exception: nothing C++ crosses into the embedding program.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <exception>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "launch/embed/c_api_status.h"
#include "launch/embed/cpfill.h"
#include "launch/job/engine_host.h"
#include "launch/job/flags.h"
#include "launch/job/job.h"
#include "parallel/selector.h"

// Members end in reverse order: the engine and the model before the grid and MPI they use.
struct cpfill_engine {
  std::unique_ptr<cpfill::launch::Job> job;
  std::optional<cpfill::parallel::ProcessGrid> grid;
  std::unique_ptr<cpfill::launch::EngineHost> host;
  std::thread loop;  // rank 0's; joined by Shutdown before the engine is deleted
  absl::Status loop_status;
  bool shut_down = false;
};

// The tokens a request has produced so far and, once the last has come, why it ended: written by
// the engine's thread (on_token), read by the caller's threads. Shared, so that a request freed
// while it runs leaves the engine a live log to write to.
struct TokenLog {
  std::mutex mu;
  std::condition_variable grew;  // a token came
  std::vector<int32_t> ids;
  std::string finish_reason;  // set once, with the last token; "" until then
};

// Calls on one request may come from several threads: after the request is handed out, the reply
// is only read (through the const, thread-safe shared_future), the token log under its mutex,
// `cancelled` atomically, and `algorithm` written once.
struct cpfill_request {
  std::shared_future<absl::StatusOr<cpfill::runtime::EngineResult>> reply;
  std::shared_ptr<TokenLog> tokens = std::make_shared<TokenLog>();
  std::shared_ptr<std::atomic<bool>> cancelled = std::make_shared<std::atomic<bool>>(false);
  bool generates = false;  // cpfill_submit_generate's: freeing it cancels it
  std::once_flag named;    // `algorithm` is written once, by the first cpfill_request_result
  std::string algorithm;
};

// The structs' layouts are ABI (cpfill.h): a change here breaks programs built against it.
static_assert(sizeof(void*) != 8 ||
                  (sizeof(cpfill_result) == 72 && offsetof(cpfill_result, algorithm) == 64),
              "cpfill_result's layout changed: it must never change");
static_assert(sizeof(void*) != 8 || (sizeof(cpfill_generate_params) == 88 &&
                                     offsetof(cpfill_generate_params, num_stop_token_ids) == 64 &&
                                     offsetof(cpfill_generate_params, sparq_r) == 72),
              "cpfill_generate_params changed: grow it only at the end, checking struct_size, "
              "with a new version of cpfill_generate_params_init (libcpfill.map)");
// CPFILL_0.2's cpfill_generate_params: every field before sparq_r (72 bytes on LP64).
constexpr size_t kGenerateParamsSize_0_2 = offsetof(cpfill_generate_params, sparq_r);

namespace {

using cpfill::launch::EngineFlags;
using cpfill::launch::FlagSet;
using cpfill::launch::JobFlags;

using cpfill::embed::Guarded;
using cpfill::embed::Report;

absl::Status NeedRoot(const cpfill_engine* e, const char* what) {
  if (e == nullptr) return absl::InvalidArgumentError(std::string(what) + ": engine is NULL");
  if (e->job->is_root()) return absl::OkStatus();
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
  JobFlags sf;
  FlagSet flags("cpfill_engine_create", "the engine's flags");
  AddEngineFlags(flags, &ef);
  AddJobFlags(flags, &sf);
  std::vector<char*> args;  // Parse takes char**; it does not write through them
  for (int i = 0; i < argc; ++i) args.push_back(const_cast<char*>(argv[i]));
  if (absl::Status parsed = flags.Parse(argc, args.data(), 0); !parsed.ok()) return parsed;
  if (absl::Status bad = cpfill::launch::CheckJobFlags(sf); !bad.ok()) return bad;
  ef.front_threads = 1;  // the embedding program's thread that runs the engine's loop
  auto e = std::make_unique<cpfill_engine>();
  auto job = cpfill::launch::Job::Embed(sf, comm);
  if (!job.ok()) return job.status();
  e->job = std::move(*job);
  auto grid = e->job->CreateGrid();
  if (!grid.ok()) return grid.status();
  e->grid = std::move(*grid);
  auto host = BuildEngineHost(ef, flags, *e->job, *e->grid, {});
  if (!host.ok()) return host.status();
  e->host = std::move(*host);
  if (e->job->is_root()) {
    cpfill_engine* raw = e.get();
    e->loop = std::thread([raw] { raw->loop_status = raw->host->engine->Run(); });
  }
  *out = e.release();
  return absl::OkStatus();
}

constexpr int64_t kMaxGenerateTokens = int64_t{1} << 20;

// The engine's generation fields from the C struct. The sampling fields are checked by the
// engine's Submit, which names them.
absl::Status ApplyParams(const cpfill_generate_params& p, const cpfill::launch::EngineHost& host,
                         cpfill::runtime::EngineRequest* request) {
  if (p.struct_size == 0) {
    return absl::InvalidArgumentError(
        "cpfill_submit_generate: params->struct_size is 0; fill the params with "
        "cpfill_generate_params_init first");
  }
  if (p.struct_size != sizeof(cpfill_generate_params) && p.struct_size != kGenerateParamsSize_0_2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cpfill_submit_generate: params->struct_size is ", p.struct_size, "; this libcpfill (",
        cpfill_version(), ") knows ", sizeof(cpfill_generate_params), " (CPFILL_0.4) and ",
        kGenerateParamsSize_0_2, " (CPFILL_0.2)",
        ": link the libcpfill whose cpfill.h the program was built with"));
  }
  if (p.max_tokens < 1 || p.max_tokens > kMaxGenerateTokens) {
    return absl::InvalidArgumentError(absl::StrCat("cpfill_submit_generate: max_tokens is ",
                                                   p.max_tokens, ", must be in [1, ",
                                                   kMaxGenerateTokens, "]"));
  }
  if (p.stop_token_ids == nullptr && p.num_stop_token_ids > 0) {
    return absl::InvalidArgumentError(
        "cpfill_submit_generate: stop_token_ids is NULL with num_stop_token_ids > 0");
  }
  request->max_tokens = p.max_tokens;
  request->sampling = {
      .temperature = p.temperature, .top_k = p.top_k, .top_p = p.top_p, .seed = p.seed};
  request->ignore_eos = p.ignore_eos != 0;
  if (p.num_stop_token_ids > 0) {
    request->stop_ids.assign(p.stop_token_ids, p.stop_token_ids + p.num_stop_token_ids);
  }
  // The SparQ fields exist only in a CPFILL_0.4 struct: a 0.2 one is never read past its size.
  if (p.struct_size == sizeof(cpfill_generate_params)) {
    if (p.sparq_k < 0) {
      return absl::InvalidArgumentError(absl::StrCat("cpfill_submit_generate: sparq_k is ",
                                                     p.sparq_k, ", must be >= 0 (0: dense)"));
    }
    if (p.sparq_k > 0) {
      if (p.sparq_r < 1 || p.sparq_r > host.config.head_dim) {
        return absl::InvalidArgumentError(absl::StrCat("cpfill_submit_generate: sparq_r is ",
                                                       p.sparq_r, ", must be in 1 .. ",
                                                       host.config.head_dim, " (the head dim)"));
      }
      if (p.sparq_l < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("cpfill_submit_generate: sparq_l is ", p.sparq_l, ", must be >= 0"));
      }
      if (host.backend != "cpu") {
        return absl::InvalidArgumentError(
            "cpfill_submit_generate: sparq_k > 0 needs the CPU backend for now");
      }
      request->sparq = cpfill::attention::sparq::SparqConfig{
          .r = p.sparq_r, .k = p.sparq_k, .local_window = p.sparq_l};
    }
  }
  return absl::OkStatus();
}

// Prefixes the engine's refusals (which name the field) with the call.
absl::Status Refused(const absl::Status& s, const char* what) {
  if (!absl::IsInvalidArgument(s)) return s;
  return absl::InvalidArgumentError(absl::StrCat(what, ": ", s.message()));
}

// A prefill (cpfill_submit: no params) or a generation.
absl::Status Submit(cpfill_engine* e, const int32_t* tokens, size_t n, const char* session,
                    const cpfill_generate_params* params, cpfill_request** out) {
  const char* what = params == nullptr ? "cpfill_submit" : "cpfill_submit_generate";
  if (absl::Status s = NeedRoot(e, what); !s.ok()) return s;
  if (out == nullptr) return absl::InvalidArgumentError(absl::StrCat(what, ": request is NULL"));
  if (tokens == nullptr && n > 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": tokens is NULL"));
  }
  cpfill::runtime::EngineRequest request{.tokens = std::vector<int32_t>(tokens, tokens + n),
                                         .session = session == nullptr ? "" : session,
                                         .return_logits = true};  // cpfill_result's
  auto r = std::make_unique<cpfill_request>();
  if (params != nullptr) {
    if (absl::Status s = ApplyParams(*params, *e->host, &request); !s.ok()) return s;
    r->generates = true;
  }
  request.on_token = [log = r->tokens](const cpfill::runtime::GeneratedToken& t) {
    std::lock_guard lock(log->mu);
    log->ids.push_back(t.token.id);
    if (!t.finish_reason.empty()) log->finish_reason = t.finish_reason;
    log->grew.notify_all();
  };
  request.cancelled = r->cancelled;
  auto reply = e->host->engine->Submit(std::move(request));
  if (!reply.ok()) return Refused(reply.status(), what);
  r->reply = reply->share();
  *out = r.release();
  return absl::OkStatus();
}

// OK once the answer is there; DeadlineExceeded (NOT_READY) until then.
absl::Status Await(const cpfill_request* r, std::optional<double> timeout_s) {
  if (r == nullptr) return absl::InvalidArgumentError("the request is NULL");
  if (!timeout_s) {
    r->reply.wait();
  } else if (r->reply.wait_for(std::chrono::duration<double>(*timeout_s)) !=
             std::future_status::ready) {
    return absl::DeadlineExceededError("the request has not finished");
  }
  return absl::OkStatus();
}

bool Failed(const cpfill_request* r) { return Await(r, 0.0).ok() && !r->reply.get().ok(); }

absl::Status Result(cpfill_request* r, cpfill_result* out) {
  if (out == nullptr) return absl::InvalidArgumentError("cpfill_request_result: result is NULL");
  if (absl::Status s = Await(r, 0.0); !s.ok()) return s;
  const absl::StatusOr<cpfill::runtime::EngineResult>& done = r->reply.get();
  if (!done.ok()) return done.status();
  const cpfill::runtime::EngineResult& x = *done;
  std::call_once(r->named, [&] {
    r->algorithm = std::string(cpfill::parallel::RingAlgorithmName(x.algorithm));
  });
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

absl::Status Tokens(const cpfill_request* r, size_t from, int32_t* ids, size_t capacity,
                    size_t* count, int* finished) {
  if (r == nullptr || count == nullptr || finished == nullptr) {
    return absl::InvalidArgumentError("cpfill_request_tokens: request, count or finished is NULL");
  }
  if (ids == nullptr && capacity > 0) {
    return absl::InvalidArgumentError("cpfill_request_tokens: ids is NULL with capacity > 0");
  }
  const bool failed = Failed(r);  // before the log: a failed request's log has no last token
  std::lock_guard lock(r->tokens->mu);
  const std::vector<int32_t>& have = r->tokens->ids;
  if (from < have.size()) {
    std::copy_n(have.begin() + static_cast<std::ptrdiff_t>(from),
                std::min(capacity, have.size() - from), ids);
  }
  *count = have.size();
  *finished = !r->tokens->finish_reason.empty() || failed ? 1 : 0;
  return absl::OkStatus();
}

// The engine wakes the waiter with each token. A request that fails sends none: the reply is
// checked every kFailureCheck, so a failure ends the wait that soon.
absl::Status WaitTokens(const cpfill_request* r, size_t count, std::optional<double> timeout_s) {
  if (r == nullptr) {
    return absl::InvalidArgumentError("cpfill_request_wait_tokens: request is NULL");
  }
  constexpr auto kFailureCheck = std::chrono::milliseconds(5);
  constexpr double kLongestWaitS = 1e7;  // longer (or NaN) waits as good as for ever
  const double wait_s = timeout_s && *timeout_s < kLongestWaitS ? *timeout_s : kLongestWaitS;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(wait_s));
  std::unique_lock lock(r->tokens->mu);
  for (;;) {
    if (r->tokens->ids.size() >= count || !r->tokens->finish_reason.empty()) {
      return absl::OkStatus();
    }
    lock.unlock();
    const bool failed = Failed(r);
    lock.lock();
    if (failed) return absl::OkStatus();
    const auto now = std::chrono::steady_clock::now();
    if (timeout_s && now >= deadline) {
      return absl::DeadlineExceededError("cpfill_request_wait_tokens: no new token yet");
    }
    const auto until = timeout_s ? std::min(deadline, now + kFailureCheck) : now + kFailureCheck;
    r->tokens->grew.wait_until(lock, until);
  }
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
const char* cpfill_last_error(void) { return cpfill::embed::last_error.c_str(); }

int cpfill_engine_create(int argc, const char* const* argv, const void* mpi_comm,
                         cpfill_engine** engine) {
  return Guarded([&] { return Create(argc, argv, mpi_comm, engine); });
}

int cpfill_engine_rank(const cpfill_engine* e) { return e ? e->job->world_rank() : -1; }
int cpfill_engine_size(const cpfill_engine* e) { return e ? e->grid->world_size : -1; }
int64_t cpfill_engine_vocab_size(const cpfill_engine* e) {
  return e ? e->host->config.vocab_size : -1;
}

int cpfill_engine_run(cpfill_engine* e) {
  return Guarded([&] {
    if (e == nullptr) return absl::InvalidArgumentError("cpfill_engine_run: engine is NULL");
    if (e->job->is_root()) {
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

// cpfill_generate_params_init has two versions (libcpfill.map): CPFILL_0.4's writes the whole
// struct; CPFILL_0.2's, which programs built against that header bind to, writes only the
// kGenerateParamsSize_0_2 bytes their struct has, and that struct_size.
extern "C" void cpfill_generate_params_init_0_4(cpfill_generate_params* p) {
  if (p == nullptr) return;
  *p = cpfill_generate_params{.struct_size = sizeof(cpfill_generate_params),
                              .max_tokens = 16,
                              .temperature = 1.0,
                              .top_k = 0,
                              .top_p = 1.0,
                              .seed = 0,
                              .ignore_eos = 0,
                              .stop_token_ids = nullptr,
                              .num_stop_token_ids = 0,
                              .sparq_r = 0,
                              .sparq_k = 0,
                              .sparq_l = 0};
}
extern "C" void cpfill_generate_params_init_0_2(cpfill_generate_params* p) {
  if (p == nullptr) return;
  cpfill_generate_params whole;
  cpfill_generate_params_init_0_4(&whole);
  whole.struct_size = kGenerateParamsSize_0_2;
  std::memcpy(static_cast<void*>(p), &whole, kGenerateParamsSize_0_2);
}
__asm__(".symver cpfill_generate_params_init_0_2, cpfill_generate_params_init@CPFILL_0.2");
__asm__(".symver cpfill_generate_params_init_0_4, cpfill_generate_params_init@@CPFILL_0.4");

int cpfill_submit_generate(cpfill_engine* e, const int32_t* tokens, size_t n, const char* session,
                           const cpfill_generate_params* params, cpfill_request** request) {
  return Guarded([&] {
    cpfill_generate_params defaults;
    cpfill_generate_params_init_0_4(&defaults);
    return Submit(e, tokens, n, session, params != nullptr ? params : &defaults, request);
  });
}

int cpfill_request_tokens(cpfill_request* r, size_t from, int32_t* ids, size_t capacity,
                          size_t* count, int* finished) {
  return Guarded([&] { return Tokens(r, from, ids, capacity, count, finished); });
}

int cpfill_request_wait_tokens(cpfill_request* r, size_t count, double timeout_s) {
  return Guarded([&] {
    return WaitTokens(r, count, timeout_s < 0 ? std::nullopt : std::optional<double>(timeout_s));
  });
}

int cpfill_request_cancel(cpfill_request* r) {
  return Guarded([&] {
    if (r == nullptr) return absl::InvalidArgumentError("cpfill_request_cancel: request is NULL");
    r->cancelled->store(true);
    return absl::OkStatus();
  });
}

const char* cpfill_request_finish_reason(cpfill_request* r) {
  if (r == nullptr) return nullptr;
  std::lock_guard lock(r->tokens->mu);
  // Written once with the last token and never again: the pointer stays valid.
  return r->tokens->finish_reason.empty() ? nullptr : r->tokens->finish_reason.c_str();
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

void cpfill_request_free(cpfill_request* r) {
  if (r != nullptr && r->generates) r->cancelled->store(true);
  delete r;
}

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
    if (e->job->is_root() && !e->shut_down) (void)Shutdown(e);
    delete e;
  } catch (...) {
    // Nothing may cross the boundary; the process is ending its use of cpfill either way.
  }
}

}  // extern "C"
