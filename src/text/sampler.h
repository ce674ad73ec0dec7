/* text/sampler: next-token choice from a row of logits.
 *
 * Owns: one sequence's sampling state -- its parameters (temperature, top-k,
 * top-p, min-p, OpenAI presence/frequency penalties, HF repetition penalty,
 * OpenAI logit_bias, logprob reporting), its PRNG (xoshiro256** seeded through
 * splitmix64; no global state) and the token history the penalties need -- plus
 * every scratch buffer, all sized from the vocabulary at init.  After
 * dsv4_sampler_init nothing here allocates: reset, add_prompt, accept and
 * sample only touch memory the sampler already owns (docs/SAMPLING.md).
 * Memory: 16 bytes per vocabulary entry (~2.1 MB for 129,280) + ~48 KB
 * (logit_bias slots, top-p buckets).
 *
 * Order of operations (like HF transformers / vLLM; docs/SAMPLING.md):
 *   repetition penalty -> presence/frequency penalties -> logit_bias
 *   -> temperature (0 = greedy) -> top-k -> top-p -> min-p -> draw.
 * Greedy picks the highest processed logit, ties to the lowest token id.
 * Reproducibility: the same seed, parameters, history and logits give the same
 * tokens on every machine (integer PRNG, own exp(), fixed summation order).
 *
 * Thread safety: a sampler belongs to one thread at a time; distinct samplers
 * are independent.  Errors: functions return 0 or -1 and fill `err`.
 */
#ifndef DSV4_TEXT_SAMPLER_H
#define DSV4_TEXT_SAMPLER_H

#include <stddef.h>
#include <stdint.h>

#include "util/err.h"

#define DSV4_SAMPLER_MAX_TOP_LOGPROBS 20 /* OpenAI's top_logprobs limit */
#define DSV4_SAMPLER_MAX_LOGIT_BIAS 4096 /* logit_bias entries per request */

typedef enum {
    /* log-softmax of the model's logits exactly as given (OpenAI-like; default) */
    DSV4_LOGPROBS_RAW = 0,
    /* log-softmax of the distribution actually sampled from: after penalties,
     * logit_bias and temperature, with tokens cut by top-k/top-p/min-p at -inf.
     * With temperature 0 (greedy): after penalties and bias, no temperature,
     * no truncation. */
    DSV4_LOGPROBS_PROCESSED = 1,
} dsv4_logprobs_mode;

typedef struct dsv4_sampling_params {
    float temperature;        /* >= 0; 0 = greedy.  Default 1 */
    int top_k;                /* keep the k best; 0 or -1 = off; >= vocab = off */
    float top_p;              /* [0, 1]; smallest top set with mass >= top_p; 1 = off, 0 keeps one */
    float min_p;              /* [0, 1]; drop tokens with p < min_p * p_max; 0 = off */
    float presence_penalty;   /* OpenAI: logit -= presence * (count > 0), generated tokens */
    float frequency_penalty;  /* OpenAI: logit -= frequency * count, generated tokens */
    float repetition_penalty; /* HF/CTRL: > 0; over prompt+generated: l > 0 ? l / r : l * r; 1 = off */
    int has_seed;             /* 0: seed from the clock; read it back with dsv4_sampler_seed */
    uint64_t seed;
    int logprobs;     /* 1: report the chosen token's logprob */
    int top_logprobs; /* 0..DSV4_SAMPLER_MAX_TOP_LOGPROBS alternatives (implies logprobs) */
    dsv4_logprobs_mode logprobs_mode;
    /* OpenAI logit_bias: added to the logits of these token ids (each id at most
     * once, at most DSV4_SAMPLER_MAX_LOGIT_BIAS entries, finite values).  Copied
     * by init/reset; the arrays need not outlive the call. */
    int n_logit_bias;
    const int32_t *logit_bias_ids;
    const float *logit_bias_values;
} dsv4_sampling_params;

/* One draw.  logprob fields are filled only when requested (else 0 / n_top 0).
 * top_* are sorted by logprob descending, ties to the lower id; a logprob of
 * -INFINITY means the token was impossible in the reported distribution. */
typedef struct dsv4_sample {
    int32_t token;
    float logprob;
    int n_top;
    int32_t top_ids[DSV4_SAMPLER_MAX_TOP_LOGPROBS];
    float top_logprobs[DSV4_SAMPLER_MAX_TOP_LOGPROBS];
} dsv4_sample;

typedef struct dsv4_sampler dsv4_sampler;

/* The defaults: temperature 1, every filter and penalty off, no seed, no logprobs. */
void dsv4_sampling_params_default(dsv4_sampling_params *p);

/* Checks every field; on failure names the parameter and the allowed range. */
int dsv4_sampling_params_check(const dsv4_sampling_params *p, int vocab_size, dsv4_err *err);

/* Creates a sampler for a vocabulary of vocab_size (>= 1) and resets it with p
 * (NULL = defaults).  All memory is allocated here.  *out = NULL on failure. */
int dsv4_sampler_init(dsv4_sampler **out, int vocab_size, const dsv4_sampling_params *p, dsv4_err *err);
void dsv4_sampler_free(dsv4_sampler *s);

/* Starts a new sequence: validates p (NULL = defaults), clears the history,
 * reseeds.  On failure the sampler refuses to sample until a reset succeeds. */
int dsv4_sampler_reset(dsv4_sampler *s, const dsv4_sampling_params *p, dsv4_err *err);

/* The seed in use (the given one, or the one drawn from the clock). */
uint64_t dsv4_sampler_seed(const dsv4_sampler *s);

/* Records prompt tokens (they count for the repetition penalty only). */
int dsv4_sampler_add_prompt(dsv4_sampler *s, const int32_t *ids, size_t n, dsv4_err *err);

/* Records a generated token (counts for all penalties).  sample() does not do
 * this itself, so the caller may also force tokens that were not sampled. */
int dsv4_sampler_accept(dsv4_sampler *s, int32_t id, dsv4_err *err);

/* Chooses the next token from logits[vocab_size] (not modified).  A NaN or +inf
 * logit is an error naming the token id; -inf marks an impossible token. */
int dsv4_sampler_sample(dsv4_sampler *s, const float *logits, dsv4_sample *out, dsv4_err *err);

#endif
