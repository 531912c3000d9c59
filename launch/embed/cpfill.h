/* cpfill.h — embedding cpfill as a prefill and generation backend: the C API of libcpfill.so.
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
 *     cpfill_submit(e, tokens, n, "chat-1", &r);        // a prefill; non-blocking
 *     cpfill_request_wait(r, -1);                        // or poll with cpfill_request_poll
 *     cpfill_result res;  cpfill_request_result(r, &res); // res.first_token, res.logits, ...
 *     cpfill_request_free(r);
 *
 *     cpfill_generate_params g;
 *     cpfill_generate_params_init(&g);                    // the defaults, then what you need:
 *     g.max_tokens = 256;  g.temperature = 0;            // greedy
 *     cpfill_submit_generate(e, tokens, n, NULL, &g, &r);
 *     size_t have = 0, count = 0;  int done = 0;         // stream the tokens as they come:
 *     while (!done || have < count) {
 *       cpfill_request_wait_tokens(r, have + 1, 1.0);    // wakes on a new token or the end
 *       cpfill_request_tokens(r, have, buf, cap, &count, &done);   // ids from `have` on
 *       size_t got = count - have < cap ? count - have : cap;
 *       send(buf, got);  have += got;
 *     }
 *     const char* why = cpfill_request_finish_reason(r);  // "stop", "length" or "abort"
 *     cpfill_request_free(r);                            // (frees and cancels a running one)
 *     cpfill_engine_shutdown(e);                         // drains; releases the other ranks
 *   } else {
 *     cpfill_engine_run(e);                              // returns after rank 0's shutdown
 *   }
 *   cpfill_engine_destroy(e);
 *
 * Every function returns a status code; on failure cpfill_last_error() holds a message naming the
 * problem (per thread, until the thread's next failing call). No C++ exception crosses this API.
 * Submitting is thread-safe (submit from as many threads as you like), and so are the calls on
 * one request: one thread may stream its tokens while another waits for it or cancels it; only
 * cpfill_request_free must come last.
 *
 * Streaming generation is poll-based, into buffers the caller owns: the engine appends each token
 * to the request as it is chosen; cpfill_request_tokens copies any range of them out without
 * blocking (by index, so a caller keeps only its position), and cpfill_request_wait_tokens
 * blocks until there are more (or the request ended), so that a thread per stream need not spin;
 * a single poller thread serving many streams calls cpfill_request_tokens on each instead. A
 * generation ends at the model's EOS ids (unless ignore_eos), a stop token id, max_tokens, the
 * model's last position, or cpfill_request_cancel; its tokens stay readable until the request is
 * freed.
 *
 * ABI: symbols are versioned (libcpfill.map): CPFILL_0.1 the prefill API, CPFILL_0.2 generation,
 * CPFILL_0.3 the KV hand-off's decode side, CPFILL_0.4 cpfill_generate_params' SparQ fields.
 * cpfill_result never grows; cpfill_generate_params carries its own size (struct_size) and grows
 * only at its end, each growth with a new version of cpfill_generate_params_init (the old one
 * keeps writing the old size, so that programs built against an older header keep running).
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
  int32_t first_token;     /* the first token (cpfill_submit: greedy, the argmax of `logits`) */
  const float* logits;     /* [vocab_size] of the last position */
  int64_t vocab_size;
  int64_t prompt_tokens;   /* this turn's new tokens */
  int64_t cached_tokens;   /* tokens whose KV was reused: the session's, or a cached prefix's */
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
/* Generation. Fill the params with cpfill_generate_params_init (a zeroed struct is refused:
 * struct_size 0), then set what you need. Sampling is a pure function of (seed, step): a request
 * with temperature > 0 repeats token for token with the same seed, so give each request its own
 * seed (from a random source) unless it should repeat. */
typedef struct cpfill_generate_params {
  size_t struct_size;            /* sizeof(cpfill_generate_params), set by _init */
  int32_t max_tokens;            /* 1 .. 1048576; default 16. 1: a prefill and its first token */
  double temperature;            /* 0 .. 100; 0 is greedy; default 1 */
  int32_t top_k;                 /* >= 0; 0 keeps every token (the default) */
  double top_p;                  /* (0, 1]; default 1 */
  uint64_t seed;                 /* default 0 */
  int ignore_eos;                /* 1: generate past the model's EOS ids; default 0 */
  const int32_t* stop_token_ids; /* stop at these too; may be NULL when num_stop_token_ids is 0 */
  size_t num_stop_token_ids;     /* default 0 */
  /* Since CPFILL_0.4: decode with SparQ attention (CPU backend only; prefill stays dense):
   * positions ranked by sparq_r of head_dim query/key components, the top sparq_k attended, the
   * last sparq_l always among them (attention/sparq/README.md). sparq_k 0 is dense decode (the
   * default); else 1 <= sparq_r <= head_dim, sparq_k >= 1, sparq_l >= 0. */
  int32_t sparq_r;               /* default 0 */
  int32_t sparq_k;               /* default 0: dense */
  int32_t sparq_l;               /* default 0 */
} cpfill_generate_params;

/* The defaults above (OpenAI's and vLLM's), and struct_size. Versioned: a program built against
 * CPFILL_0.2's cpfill.h binds to the init of that version, which writes only the fields its
 * struct has (struct_size 72 on LP64, accepted by cpfill_submit_generate as dense decode); ctypes
 * and other dlsym callers get the newest and must declare every field above. */
void cpfill_generate_params_init(cpfill_generate_params* params);

/* Rank 0, any thread, non-blocking: as cpfill_submit, and generates up to params->max_tokens
 * tokens on the sharded KV cache (decode steps interleave with other requests' prefills). NULL
 * params: the defaults. A session keeps every generated token: its next turn sends only the new
 * ones. CPFILL_INVALID_ARGUMENT naming the field for bad params (max_tokens outside 1 .. 1048576,
 * temperature outside 0 .. 100, top_k < 0, top_p outside (0, 1], a stop token outside the
 * vocabulary, more tokens than the model's positions, an unknown struct_size). The tokens, the
 * finish reason and cpfill_request_result (first_token, logits of the prompt's last position,
 * timings) come on the request. */
int cpfill_submit_generate(cpfill_engine* engine, const int32_t* tokens, size_t n,
                           const char* session, const cpfill_generate_params* params,
                           cpfill_request** request);
/* The tokens generated so far, while the request runs or after: copies the ids from index `from`
 * on (the first token is 0), at most `capacity` of them, into `ids` (which may be NULL when
 * capacity is 0); sets *count to how many have been generated in all, and *finished to 1 once
 * the last has come or the request failed (then cpfill_request_result gives its error).
 * Non-blocking. A request of cpfill_submit has its one token here too. */
int cpfill_request_tokens(cpfill_request* request, size_t from, int32_t* ids, size_t capacity,
                          size_t* count, int* finished);
/* Blocks until at least `count` tokens have been generated or the request ended (OK), or until
 * `timeout_s` passes (CPFILL_NOT_READY); a negative timeout waits for ever. */
int cpfill_request_wait_tokens(cpfill_request* request, size_t count, double timeout_s);
/* Ends a generation at its next token (finish reason "abort") and frees its KV; the tokens so far
 * stay readable. A request still queued is prefilled first. OK also when it has already ended. */
int cpfill_request_cancel(cpfill_request* request);
/* Why a generation ended, once its last token has come: "stop" (EOS or a stop token id),
 * "length" (max_tokens or the model's last position) or "abort" (cancelled); NULL before that
 * and for a request that failed. Valid until the request is freed. */
const char* cpfill_request_finish_reason(cpfill_request* request);

/* OK when the request has finished (successfully or not), CPFILL_NOT_READY otherwise. */
int cpfill_request_poll(cpfill_request* request);
/* Blocks until the request finishes (OK) or `timeout_s` passes (CPFILL_NOT_READY); a negative
 * timeout waits for ever. */
int cpfill_request_wait(cpfill_request* request, double timeout_s);
/* A finished request's result, or its own error (e.g. CPFILL_RESOURCE_EXHAUSTED: it does not fit
 * the KV cache even with every idle session evicted). CPFILL_NOT_READY if not finished. */
int cpfill_request_result(cpfill_request* request, cpfill_result* result);
/* Frees a request; a generation still running is cancelled (as cpfill_request_cancel), a prefill
 * still running is answered and discarded. NULL is ignored. */
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

/* ---- KV hand-off, decode side (CPFILL_0.3) ------------------------------------------------------
 *
 * A decode worker pulls a request's KV from a prefill server (`cpfill serve --kv-handoff`) over
 * UCX: the server's completion answered with kv_transfer_params, the handle (README: "The KV
 * hand-off"); the worker parses it, pulls its decode TP rank's part into memory of its own layout,
 * and once every decode rank has pulled, one of them releases the lease. No MPI, no engine: these
 * calls stand alone. A puller is used by one thread at a time; handles are immutable.
 *
 *   cpfill_kv_handle* h;   cpfill_kv_handle_parse(json_text, json_len, &h);
 *   cpfill_kv_layout l;    cpfill_kv_handle_layout(h, &l);      // layers, heads, tokens, dtype
 *   cpfill_kv_puller* p;   cpfill_kv_puller_create("decode rank 0", &p);
 *   cpfill_kv_destination d;  cpfill_kv_destination_init(&d);
 *   d.base = buf;  d.bytes = 2 * k_bytes;  d.v_offset_bytes = k_bytes;   // contiguous, TP 1
 *   cpfill_kv_pull_stats st;
 *   if (cpfill_kv_pull(p, h, &d, 30.0, &st) != CPFILL_OK) puts(cpfill_last_error());
 *   cpfill_kv_release(p, h, 5.0);
 *   cpfill_kv_handle_free(h);  cpfill_kv_puller_destroy(p);
 */
typedef struct cpfill_kv_handle cpfill_kv_handle;
typedef struct cpfill_kv_puller cpfill_kv_puller;

/* A handle's geometry. */
typedef struct cpfill_kv_layout {
  int32_t num_layers, kv_heads, head_dim;
  int32_t dtype_bytes;                    /* 4: float32, 2: bfloat16 */
  int64_t tokens;                         /* the prompt's positions [0, tokens) */
  int32_t tp_size, cp_size, block_tokens; /* the prefill's */
} cpfill_kv_layout;

/* Parses kv_transfer_params (JSON text, `len` bytes) as untrusted input: CPFILL_INVALID_ARGUMENT
 * naming the field for anything malformed, forged, truncated or of another format version. */
int cpfill_kv_handle_parse(const char* json, size_t len, cpfill_kv_handle** handle);
int cpfill_kv_handle_layout(const cpfill_kv_handle* handle, cpfill_kv_layout* layout);
/* The request id the lease is known by (DELETE /v1/kv/{id}); valid while the handle lives. */
const char* cpfill_kv_handle_request_id(const cpfill_kv_handle* handle);
void cpfill_kv_handle_free(cpfill_kv_handle* handle); /* NULL is ignored */

/* One UCX worker (UCX_* environment variables apply). `name` labels it in errors; may be NULL. */
int cpfill_kv_puller_create(const char* name, cpfill_kv_puller** puller);
void cpfill_kv_puller_destroy(cpfill_kv_puller* puller); /* NULL is ignored */

/* Where one decode TP rank's part lands: [base, base + bytes), host memory (or GPU memory where
 * the loaded UCX has a CUDA transport). Elements are of the handle's dtype.
 *   contiguous (paged 0): K and V each [num_layers][capacity_tokens][kv_heads / tp_size]
 *     [head_dim], K at k_offset_bytes, V at v_offset_bytes;
 *   paged (paged 1): blocks of block_tokens rows; block b of layer l, kind k (0 K, 1 V) at
 *     (k ? v_offset_bytes : k_offset_bytes) + l * layer_stride_bytes + b * block_stride_bytes;
 *     position t in block block_table[t / block_tokens] at row t % block_tokens. */
typedef struct cpfill_kv_destination {
  size_t struct_size;       /* set by _init */
  int32_t tp_size, tp_rank; /* the decode worker's TP; default 1, 0 */
  int32_t paged;            /* default 0 */
  int64_t capacity_tokens;  /* contiguous: the token dimension; 0 (default): the handle's */
  int64_t k_offset_bytes, v_offset_bytes;
  int32_t block_tokens;                                       /* paged */
  int64_t num_blocks, block_stride_bytes, layer_stride_bytes; /* paged: the pool */
  const int32_t* block_table; /* paged: >= ceil(tokens / block_tokens) distinct ids */
  size_t block_table_len;
  void* base;
  size_t bytes;
} cpfill_kv_destination;
void cpfill_kv_destination_init(cpfill_kv_destination* destination);

typedef struct cpfill_kv_pull_stats {
  int64_t bytes;        /* KV bytes written */
  int64_t gets;         /* UCX gets issued */
  int32_t source_ranks; /* prefill ranks read */
  double seconds;
} cpfill_kv_pull_stats;

/* Pulls `destination`'s decode rank's part, waiting at most `timeout_s` (progress and every wait
 * bounded). CPFILL_INVALID_ARGUMENT for a destination that does not fit the handle (naming what);
 * CPFILL_FAILED_PRECONDITION when the lease no longer holds (released, expired, a stale handle:
 * the destination's contents are then void); CPFILL_UNAVAILABLE when a prefill rank cannot be
 * reached or fails; CPFILL_NOT_READY when the timeout passed. `stats` may be NULL. */
int cpfill_kv_pull(cpfill_kv_puller* puller, const cpfill_kv_handle* handle,
                   const cpfill_kv_destination* destination, double timeout_s,
                   cpfill_kv_pull_stats* stats);
/* Ends the lease (one message to the prefill's first rank; unacknowledged): call once, after every
 * decode rank has pulled. */
int cpfill_kv_release(cpfill_kv_puller* puller, const cpfill_kv_handle* handle, double timeout_s);

#ifdef __cplusplus
}
#endif

#endif /* CPFILL_H_ */
