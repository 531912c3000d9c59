/* A C99 program that embeds cpfill (libcpfill.so) as its prefill backend.
 *
 *   mpirun -np 4 build/examples/embed_example_c --model tiny --tp 2 --backend cpu
 *
 * Every rank creates the engine with the flags it was given; rank 0 submits a few prompts and a
 * two-turn session, waits for them, and prints one line per answer:
 *   prompt <i>: first_token <t> prompt_tokens <n> cached_tokens <c> ...
 * then generates 12 tokens after prompt 1, greedy and sampled, reading them as they come,
 * cancels a long generation, and has bad generation params refused:
 *   greedy: tokens <ids> finish length reads <k>
 *   sampled: tokens <ids> finish length reads <k>
 *   cancel: tokens <n> of 4000 finish abort
 *   bad params refused: <message naming the field>      (8 lines)
 * the other ranks lend themselves to the engine until rank 0 shuts it down. Prompt i has
 * kLens[i] tokens, token j being (i * 7919 + j * 31) % vocab, so a test can prefill the same
 * prompts one-shot and compare. Exits 0 when everything behaved as documented, 1 otherwise.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
  int ok =
      Check(cpfill_request_wait(r, -1.0), "wait") && Check(cpfill_request_result(r, &res), label);
  if (ok) {
    printf(
        "%s: first_token %d prompt_tokens %lld cached_tokens %lld batch_requests %d "
        "queue_ms %.2f prefill_ms %.2f algorithm %s\n",
        label, res.first_token, (long long)res.prompt_tokens, (long long)res.cached_tokens,
        res.batch_requests, res.queue_s * 1e3, res.prefill_s * 1e3, res.algorithm);
  }
  cpfill_request_free(r);
  return ok;
}

/* Generates kGenerated tokens after prompt 1, streamed: each wait returns when a new token has
 * come, and only the new ones are copied out. Prints
 *   <label>: tokens <ids> finish <reason> reads <k>
 * 1 on success. */
enum { kGenerated = 12 };
static int Stream(cpfill_engine* e, int64_t vocab, const char* label,
                  const cpfill_generate_params* g) {
  int32_t* prompt = Prompt(1, kLens[1], vocab);
  cpfill_request* r;
  int ok = Check(cpfill_submit_generate(e, prompt, (size_t)kLens[1], NULL, g, &r), label);
  free(prompt);
  if (!ok) return 0;
  int32_t ids[kGenerated];
  size_t have = 0, count = 0;
  int done = 0, reads = 0;
  while (ok && !done) {
    ok = Check(cpfill_request_wait_tokens(r, have + 1, 60.0), "wait tokens") &&
         Check(cpfill_request_tokens(r, have, ids + have, kGenerated - have, &count, &done),
               "tokens");
    have = count < kGenerated ? count : kGenerated;
    ++reads;
  }
  const char* reason = cpfill_request_finish_reason(r);
  if (ok) {
    printf("%s: tokens", label);
    for (size_t i = 0; i < have; ++i) printf(" %d", ids[i]);
    printf(" finish %s reads %d\n", reason ? reason : "(none)", reads);
  }
  cpfill_request_free(r);
  return ok;
}

/* Greedy, then sampled with a seed (which a test repeats with `cpfill generate`). */
static int Generate(cpfill_engine* e, int64_t vocab) {
  cpfill_generate_params g;
  cpfill_generate_params_init(&g);
  g.max_tokens = kGenerated;
  g.temperature = 0;
  g.ignore_eos = 1;
  int ok = Stream(e, vocab, "greedy", &g);
  g.temperature = 0.9;
  g.top_k = 50;
  g.top_p = 0.95;
  g.seed = 7;
  return Stream(e, vocab, "sampled", &g) && ok;
}

/* A long generation cancelled after its first tokens ends at once with finish reason "abort".
 * Prints "cancel: tokens <n> of <max> finish <reason>"; 1 on success. */
static int CancelLong(cpfill_engine* e) {
  const int32_t prompt[4] = {1, 2, 3, 4};
  cpfill_generate_params g;
  cpfill_generate_params_init(&g);
  g.max_tokens = 4000;
  g.ignore_eos = 1;
  g.seed = 5;
  cpfill_request* r;
  if (!Check(cpfill_submit_generate(e, prompt, 4, NULL, &g, &r), "generate")) return 0;
  size_t count = 0;
  int done = 0;
  /* More tokens than it will ever have: the wait times out while it runs, and returns at once
   * once it has ended. */
  const size_t never = (size_t)g.max_tokens + 1;
  int ok = Check(cpfill_request_wait_tokens(r, 3, 60.0), "wait tokens") &&
           cpfill_request_wait_tokens(r, never, 0.01) == CPFILL_NOT_READY &&
           Check(cpfill_request_cancel(r), "cancel") &&
           Check(cpfill_request_wait_tokens(r, never, -1.0), "wait tokens after the end") &&
           Check(cpfill_request_wait(r, 60.0), "wait") &&
           Check(cpfill_request_tokens(r, 0, NULL, 0, &count, &done), "tokens");
  const char* reason = cpfill_request_finish_reason(r);
  if (ok)
    printf("cancel: tokens %zu of %d finish %s\n", count, g.max_tokens, reason ? reason : "(none)");
  cpfill_request_free(r);
  return ok && done && reason != NULL;
}

/* Bad params are refused at once, each message naming its field. Prints one line each:
 *   bad params refused: <message>
 * 1 when every one was refused. */
enum { kBadParams = 11 };
static int RefuseBadParams(cpfill_engine* e) {
  const int32_t prompt[4] = {1, 2, 3, 4};
  cpfill_generate_params bad[kBadParams];
  for (int k = 0; k < kBadParams; ++k) cpfill_generate_params_init(&bad[k]);
  memset(&bad[0], 0, sizeof bad[0]); /* never initialized: struct_size 0 */
  bad[1].max_tokens = 0;
  bad[2].max_tokens = -1;
  bad[3].top_p = 1.5;
  bad[4].top_p = 0;
  bad[5].temperature = -1;
  bad[6].top_k = -1;
  bad[7].num_stop_token_ids = 2; /* with stop_token_ids NULL */
  bad[8].sparq_r = 65;           /* beyond the tiny preset's head_dim, 64 */
  bad[8].sparq_k = 16;
  bad[9].sparq_k = -1;
  bad[10].sparq_r = 8;
  bad[10].sparq_k = 16;
  bad[10].sparq_l = -1;
  int refused = 0;
  for (int k = 0; k < kBadParams; ++k) {
    cpfill_request* r = NULL;
    if (cpfill_submit_generate(e, prompt, 4, NULL, &bad[k], &r) == CPFILL_INVALID_ARGUMENT) {
      printf("bad params refused: %s\n", cpfill_last_error());
      ++refused;
    } else {
      fprintf(stderr, "example: bad generation params %d were not refused\n", k);
      cpfill_request_free(r);
    }
  }
  return refused == kBadParams;
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
  ok = Generate(e, vocab) && ok;
  ok = CancelLong(e) && ok;
  return RefuseBadParams(e) && ok;
}

int main(int argc, char** argv) {
  cpfill_engine* e = NULL;
  if (!Check(cpfill_engine_create(argc - 1, (const char* const*)(argv + 1), NULL, &e), "create")) {
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
