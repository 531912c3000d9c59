/* cpfill.h — embedding cpfill as a prefill backend: the C API of libcpfill.so.
 *
 * cpfill is a distributed library: every rank of an MPI job (or of a communicator the program
 * passes) creates the engine together. Rank 0 takes requests; every other rank lends its GPUs or
 * cores by running the worker loop until rank 0 shuts down.
 *
 *   cpfill_engine* e;
 *   const char* args[] = {"--model", "/models/llama3-8b", "--tp", "8"};
 *   if (cpfill_engine_create(4, args, NULL, &e) != CPFILL_OK) { puts(cpfill_last_error()); ... }
 *   if (cpfill_engine_rank(e) == 0) {
 *     cpfill_request* r;
 *     cpfill_submit(e, tokens, n, "chat-1", &r);        // non-blocking
 *     cpfill_request_wait(r, -1);                        // or poll with cpfill_request_poll
 *     cpfill_result res;  cpfill_request_result(r, &res); // res.first_token, res.logits, ...
 *     cpfill_request_free(r);
 *     cpfill_generate_params g = {0};  g.max_tokens = 64;    // greedy; or temperature, top_p...
 *     cpfill_submit_generate(e, tokens, n, NULL, &g, &r);
 *     size_t got; int done = 0;                          // stream: poll the tokens so far
 *     while (!done) { cpfill_request_tokens(r, ids, 64, &got, &done); ... }
 *     cpfill_engine_shutdown(e);                         // drains; releases the other ranks
 *   } else {
 *     cpfill_engine_run(e);                              // returns after rank 0's shutdown
 *   }
 *   cpfill_engine_destroy(e);
 *
 * Every function returns a status code; on failure cpfill_last_error() holds a message naming the
 * problem (per thread, until the thread's next failing call). No C++ exception crosses this API.
 * The calls that take a request are thread-safe: submit from as many threads as you like.
 */
#ifndef CPFILL_H_
#define CPFILL_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum cpfill_status {
  CPFILL_OK = 0,
  CPFILL_INVALID_ARGUMENT = 1,   /* a bad flag, config, token id, empty prompt... */
  CPFILL_NOT_FOUND = 2,          /* a file or session that does not exist */
  CPFILL_RESOURCE_EXHAUSTED = 3, /* does not fit (the KV cache, memory) */
  CPFILL_UNAVAILABLE = 4,        /* the queue is full: retry later */
  CPFILL_FAILED_PRECONDITION = 5,/* the wrong rank, or the engine is shutting down */
  CPFILL_NOT_READY = 6,          /* poll: not finished; wait: the timeout passed first */
  CPFILL_INTERNAL = 7            /* a failure of the job (a rank died or stalled, ...) */
} cpfill_status;

typedef struct cpfill_engine cpfill_engine;
typedef struct cpfill_request cpfill_request;

/* What a finished request returns. Pointers stay valid until cpfill_request_free. */
typedef struct cpfill_result {
  int32_t first_token;     /* greedy: the argmax of the last position's logits */
  const float* logits;     /* [vocab_size] of the last position */
  int64_t vocab_size;
  int64_t prompt_tokens;   /* this turn's new tokens */
  int64_t cached_tokens;   /* the session's tokens whose KV was reused */
  int recomputed;          /* 1: the session had been evicted and its history was prefilled again */
  int batch_requests;      /* requests in the fused batch that answered this one */
  double queue_s;          /* from submit to the start of that batch */
  double prefill_s;        /* that batch's prefill, every rank together */
  const char* algorithm;   /* this request's ring algorithm: "pass-kv", "pass-q", ... */
} cpfill_result;

const char* cpfill_version(void);
/* The message of this thread's last failing call ("" if none). */
const char* cpfill_last_error(void);

/* Collective: every rank of the job, with the same arguments. `argv` holds `cpfill serve`'s
 * engine flags (no program name): --model (required), --tp, --ranks-per-node, --backend,
 * --max-batch-tokens, --max-queue, --kv-capacity-tokens, --kv-memory-fraction, --layers, --seed,
 * --timeout-s, --threads, the selector's (--algo, --rule, --fit ...). `mpi_comm` points at the
 * MPI_Comm whose ranks run the engine, or NULL for MPI_COMM_WORLD. MPI is started here if the
 * program has not; a program that started it must have asked for MPI_THREAD_MULTIPLE.
 * On rank 0 the engine's loop starts on a thread of its own. */
int cpfill_engine_create(int argc, const char* const* argv, const void* mpi_comm,
                         cpfill_engine** engine);
int cpfill_engine_rank(const cpfill_engine* engine);  /* in the engine's communicator */
int cpfill_engine_size(const cpfill_engine* engine);
int64_t cpfill_engine_vocab_size(const cpfill_engine* engine);

/* Ranks other than 0: lend this rank to the engine until rank 0 shuts it down. Returns OK after
 * a shutdown; CPFILL_INTERNAL (with the message) if the job failed. */
int cpfill_engine_run(cpfill_engine* engine);

/* Rank 0, any thread, non-blocking: queues `n` token ids as one request. `session` (NULL or ""
 * for none) continues and keeps a conversation's KV. CPFILL_INVALID_ARGUMENT for a request no
 * batch could run, CPFILL_UNAVAILABLE when the queue is full. */
int cpfill_submit(cpfill_engine* engine, const int32_t* tokens, size_t n, const char* session,
                  cpfill_request** request);
/* Generation. A zeroed struct asks for one greedy token (a prefill); set max_tokens for more.
 * temperature 0 is greedy; top_k 0 keeps every token; top_p 0 is taken as 1; seed makes sampling
 * repeat token for token; generation stops at the model's EOS ids (unless ignore_eos), at
 * stop_token_ids, at max_tokens, or at the model's last position. */
typedef struct cpfill_generate_params {
  int32_t max_tokens;             /* 1 .. 1048576 (0 is taken as 1) */
  double temperature;             /* 0 .. 100 */
  int32_t top_k;                  /* >= 0 */
  double top_p;                   /* 0 .. 1 */
  uint64_t seed;
  int ignore_eos;                 /* 1: generate past EOS */
  const int32_t* stop_token_ids;  /* may be NULL when num_stop_token_ids is 0 */
  size_t num_stop_token_ids;
} cpfill_generate_params;

/* Rank 0, any thread, non-blocking: as cpfill_submit, and generates up to params->max_tokens
 * tokens on the sharded KV cache (decode steps interleave with other requests' prefills). A
 * session keeps the generated tokens: its next turn sends only the new ones. NULL params: one
 * greedy token. CPFILL_INVALID_ARGUMENT naming the field for bad params. */
int cpfill_submit_generate(cpfill_engine* engine, const int32_t* tokens, size_t n,
                           const char* session, const cpfill_generate_params* params,
                           cpfill_request** request);
/* The tokens generated so far, while the request runs or after (the first token first): copies
 * up to `capacity` ids into `ids` (NULL with capacity 0 to ask for the count), sets *count to
 * how many there are and *finished to 1 once the last has come. Poll it to stream tokens. */
int cpfill_request_tokens(cpfill_request* request, int32_t* ids, size_t capacity, size_t* count,
                          int* finished);
/* Why a finished generation ended: "stop" (EOS or a stop id), "length" (max_tokens or the model's
 * positions) or "abort"; NULL until it finished or when it failed. Valid until the request is
 * freed. */
const char* cpfill_request_finish_reason(cpfill_request* request);

/* OK when the request has finished (successfully or not), CPFILL_NOT_READY otherwise. */
int cpfill_request_poll(cpfill_request* request);
/* Blocks until the request finishes (OK) or `timeout_s` passes (CPFILL_NOT_READY); a negative
 * timeout waits for ever. */
int cpfill_request_wait(cpfill_request* request, double timeout_s);
/* A finished request's result, or its own error (e.g. CPFILL_RESOURCE_EXHAUSTED: it does not fit
 * the KV cache even with every idle session evicted). CPFILL_NOT_READY if not finished. */
int cpfill_request_result(cpfill_request* request, cpfill_result* result);
/* Frees a request; one still running is answered and discarded. NULL is ignored. */
void cpfill_request_free(cpfill_request* request);

/* Rank 0: forgets a session and frees its KV (after the requests queued before this call).
 * CPFILL_NOT_FOUND for a session the engine does not hold. Blocks until done. */
int cpfill_session_end(cpfill_engine* engine, const char* session);

/* Rank 0: takes no more requests, finishes the queued ones, ends the loop on every rank. Returns
 * the loop's status. Other ranks return from cpfill_engine_run. */
int cpfill_engine_shutdown(cpfill_engine* engine);

/* Every rank, after shutdown (rank 0) or run (the others). Finalizes MPI if create started it.
 * NULL is ignored. */
void cpfill_engine_destroy(cpfill_engine* engine);

#ifdef __cplusplus
}
#endif

#endif /* CPFILL_H_ */
