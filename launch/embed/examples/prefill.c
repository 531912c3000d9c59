/* A C99 program that embeds cpfill (libcpfill.so) as its prefill backend.
 *
 *   mpirun -np 4 build/examples/embed_example_c --model tiny --tp 2 --backend cpu
 *
 * Every rank creates the engine with the flags it was given; rank 0 submits a few prompts and a
 * two-turn session, waits for them, and prints one line per answer:
 *   prompt <i>: first_token <t> prompt_tokens <n> cached_tokens <c> ...
 * then generates 12 greedy tokens after prompt 1, reading them as they come:
 *   generate: tokens <ids> finish length reads <k>
 * the other ranks lend themselves to the engine until rank 0 shuts it down. Prompt i has
 * kLens[i] tokens, token j being (i * 7919 + j * 31) % vocab, so a test can prefill the same
 * prompts one-shot and compare. Exits 0 when everything behaved as documented, 1 otherwise.
 */
#include <stdio.h>
#include <stdlib.h>

#include "cpfill.h"

static const int kLens[] = {300, 77, 1000};
enum { kPrompts = 3, kTurn2 = 50 };

static int32_t* Prompt(int i, int n, int64_t vocab) {
  int32_t* ids = malloc(sizeof(int32_t) * (size_t)n);
  for (int j = 0; j < n; ++j) ids[j] = (int32_t)(((int64_t)i * 7919 + (int64_t)j * 31) % vocab);
  return ids;
}

static int Check(int status, const char* what) {
  if (status != CPFILL_OK) fprintf(stderr, "example: %s: %s\n", what, cpfill_last_error());
  return status == CPFILL_OK;
}

/* Waits for a request and prints its answer; 1 on success. */
static int Finish(cpfill_request* r, const char* label) {
  cpfill_result res;
  int ok = Check(cpfill_request_wait(r, -1.0), "wait") &&
           Check(cpfill_request_result(r, &res), label);
  if (ok) {
    printf("%s: first_token %d prompt_tokens %lld cached_tokens %lld batch_requests %d "
           "queue_ms %.2f prefill_ms %.2f algorithm %s\n",
           label, res.first_token, (long long)res.prompt_tokens, (long long)res.cached_tokens,
           res.batch_requests, res.queue_s * 1e3, res.prefill_s * 1e3, res.algorithm);
  }
  cpfill_request_free(r);
  return ok;
}

/* Greedy generation of kGenerated tokens after prompt 1, streamed: the tokens so far are read
 * while it runs. Prints "generate: tokens <ids> finish <reason> reads <k>"; then bad params are
 * refused by name. 1 on success. */
enum { kGenerated = 12 };
static int Generate(cpfill_engine* e, int64_t vocab) {
  int32_t* prompt = Prompt(1, kLens[1], vocab);
  cpfill_generate_params g = {0};
  g.max_tokens = kGenerated;
  g.ignore_eos = 1;
  cpfill_request* r;
  int ok = Check(cpfill_submit_generate(e, prompt, (size_t)kLens[1], NULL, &g, &r), "generate");
  if (!ok) {
    free(prompt);
    return 0;
  }
  int32_t ids[kGenerated];
  size_t count = 0;
  int done = 0, reads = 0;
  while (ok && !done) {
    cpfill_request_wait(r, 0.002); /* NOT_READY until the last token: only a pause */
    ok = Check(cpfill_request_tokens(r, ids, kGenerated, &count, &done), "tokens");
    ++reads;
  }
  ok = ok && Check(cpfill_request_wait(r, -1.0), "wait");
  const char* reason = cpfill_request_finish_reason(r);
  if (ok) {
    printf("generate: tokens");
    for (size_t i = 0; i < count && i < kGenerated; ++i) printf(" %d", ids[i]);
    printf(" finish %s reads %d\n", reason ? reason : "(none)", reads);
  }
  cpfill_request_free(r);
  /* A negative max_tokens and a top_p above 1 are refused, naming the field. */
  g.max_tokens = -1;
  int refused = cpfill_submit_generate(e, prompt, 4, NULL, &g, &r) == CPFILL_INVALID_ARGUMENT;
  if (refused) printf("bad params refused: %s\n", cpfill_last_error());
  g.max_tokens = 4;
  g.top_p = 1.5;
  refused = refused &&
            cpfill_submit_generate(e, prompt, 4, NULL, &g, &r) == CPFILL_INVALID_ARGUMENT;
  if (refused) printf("bad params refused: %s\n", cpfill_last_error());
  free(prompt);
  if (!refused) fprintf(stderr, "example: bad generation params were not refused\n");
  return ok && refused;
}

/* Rank 0: three prompts submitted together (one fused batch), then a session of two turns. */
static int Serve(cpfill_engine* e) {
  const int64_t vocab = cpfill_engine_vocab_size(e);
  cpfill_request* reqs[kPrompts];
  int ok = 1;
  for (int i = 0; i < kPrompts; ++i) {
    int32_t* ids = Prompt(i, kLens[i], vocab);
    ok = Check(cpfill_submit(e, ids, (size_t)kLens[i], NULL, &reqs[i]), "submit") && ok;
    free(ids);
    if (!ok) return 0;
  }
  for (int i = 0; i < kPrompts; ++i) {
    char label[32];
    snprintf(label, sizeof label, "prompt %d", i);
    ok = Finish(reqs[i], label) && ok;
  }
  /* The session: turn 1 is prompt 0 again; turn 2 adds kTurn2 tokens of prompt 1's formula. */
  int32_t* turn1 = Prompt(0, kLens[0], vocab);
  int32_t* turn2 = Prompt(1, kTurn2, vocab);
  cpfill_request* r;
  ok = ok && Check(cpfill_submit(e, turn1, (size_t)kLens[0], "chat", &r), "submit") &&
       Finish(r, "session turn 1");
  ok = ok && Check(cpfill_submit(e, turn2, kTurn2, "chat", &r), "submit") &&
       Finish(r, "session turn 2");
  free(turn1);
  free(turn2);
  /* A token outside the vocabulary is refused at once, naming the token. */
  int32_t bad[2] = {1, (int32_t)vocab};
  if (cpfill_submit(e, bad, 2, NULL, &r) != CPFILL_INVALID_ARGUMENT) {
    fprintf(stderr, "example: a token outside the vocabulary was not refused\n");
    ok = 0;
  } else {
    printf("refused as expected: %s\n", cpfill_last_error());
  }
  ok = Check(cpfill_session_end(e, "chat"), "session end") && ok;
  return Generate(e, vocab) && ok;
}

int main(int argc, char** argv) {
  cpfill_engine* e = NULL;
  if (!Check(cpfill_engine_create(argc - 1, (const char* const*)(argv + 1), NULL, &e),
             "create")) {
    return 2;
  }
  int ok;
  if (cpfill_engine_rank(e) == 0) {
    ok = Serve(e);
    ok = Check(cpfill_engine_shutdown(e), "shutdown") && ok;
  } else {
    ok = Check(cpfill_engine_run(e), "run");
  }
  cpfill_engine_destroy(e);
  return ok ? 0 : 1;
}
