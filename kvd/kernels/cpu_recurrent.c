// Gated DeltaNet (linear attention with a recurrent state; Qwen3.5, Qwen3-Next): the causal convolution over q, k
// and v, then the gated delta rule, token after token, for each sequence of a step from its own state slot.
//
// Every value is computed by one thread in a fixed order (a channel's window in order, a head's state row after
// row), in plain C expressions that the ISO C build never contracts into FMAs: a sequence's rows get the same
// bits alone or in any batch, in one step or in chunks, and on every build.
#include "cpu_internal.h"

static inline float round_dtype(float v, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

static inline float sigmoidf(float x) { return 1.f / (1.f + expf(-x)); }

// torch's softplus: log(1 + e^x), x itself above 20.
static inline float softplusf(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// Channel c of sequence s: out = silu(sum_j w[j] x[t - K + 1 + j]) rounded to the dtype (as a convolution in the
// dtype and its SiLU round), the inputs before the sequence's rows read from its window (zeros when fresh), and
// the window then holding the last K - 1 inputs.
static void conv_channel(const void* qkv, int64_t C, int64_t c, const float* w, int64_t K, void* window, int fresh,
                         int64_t first, int64_t rows, float* mixed, int bf16) {
    float past[16];  // K - 1 inputs before the row being computed, oldest first (K <= 17, checked by the caller)
    for (int64_t j = 0; j < K - 1; j++)
        past[j] = fresh ? 0.f : load_f(window, j * C + c, bf16);
    for (int64_t t = 0; t < rows; t++) {
        const float x = load_f(qkv, (first + t) * C + c, bf16);
        float acc = 0.f;
        for (int64_t j = 0; j < K - 1; j++)
            acc += w[j] * past[j];
        acc += w[K - 1] * x;
        const float v = round_dtype(acc, bf16);
        mixed[(first + t) * C + c] = round_dtype(v / (1.f + expf(-v)), bf16);
        for (int64_t j = 0; j + 1 < K - 1; j++)
            past[j] = past[j + 1];
        if (K > 1)
            past[K - 2] = x;
    }
    for (int64_t j = 0; j < K - 1; j++)
        store_f(window, j * C + c, past[j], bf16);
}

// 1 / sqrt(sum x^2 + 1e-6) over n values, in order (transformers' l2norm: x times the inverse root).
static inline float inverse_norm(const float* x, int64_t n) {
    float ss = 0.f;
    for (int64_t i = 0; i < n; i++)
        ss += x[i] * x[i];
    return 1.f / sqrtf(ss + 1e-6f);
}

// Value head h of sequence s through its rows: the state S [dk, dv] decays by e^g, meets k's prediction of v
// (S^T k), takes beta of the difference along k, and answers q (S^T q), row after row of S.
static void delta_head(const float* mixed, int64_t C, int64_t key_dim, int64_t kh, int64_t h, int64_t dk,
                       int64_t dv, const void* a, const void* b, int64_t Hv, float A, float dt_bias, float* S,
                       int fresh, int64_t first, int64_t rows, void* out, int bf16, float* scratch) {
    float* q = scratch;
    float* k = q + dk;
    float* mem = k + dk;
    float* delta = mem + dv;
    if (fresh)
        memset(S, 0, (size_t)(dk * dv) * sizeof(float));
    const float scale = 1.f / sqrtf((float)dk);
    for (int64_t t = first; t < first + rows; t++) {
        const float* row = mixed + t * C;
        const float* qs = row + kh * dk;
        const float* ks = row + key_dim + kh * dk;
        const float* v = row + 2 * key_dim + h * dv;
        const float qn = inverse_norm(qs, dk), kn = inverse_norm(ks, dk);
        for (int64_t i = 0; i < dk; i++) {
            q[i] = qs[i] * qn * scale;
            k[i] = ks[i] * kn;
        }
        const float decay = expf(-A * softplusf(load_f(a, t * Hv + h, bf16) + dt_bias));
        const float beta = round_dtype(sigmoidf(load_f(b, t * Hv + h, bf16)), bf16);
        for (int64_t j = 0; j < dv; j++)
            mem[j] = 0.f;
        for (int64_t i = 0; i < dk; i++) {
            float* Si = S + i * dv;
            for (int64_t j = 0; j < dv; j++) {
                Si[j] = Si[j] * decay;
                mem[j] += Si[j] * k[i];
            }
        }
        for (int64_t j = 0; j < dv; j++) {
            delta[j] = (v[j] - mem[j]) * beta;
            mem[j] = 0.f;  // now the output's sums
        }
        for (int64_t i = 0; i < dk; i++) {
            float* Si = S + i * dv;
            for (int64_t j = 0; j < dv; j++) {
                Si[j] = Si[j] + k[i] * delta[j];
                mem[j] += Si[j] * q[i];
            }
        }
        for (int64_t j = 0; j < dv; j++)
            store_f(out, t * Hv * dv + h * dv + j, mem[j], bf16);
    }
}

int kvd_gated_delta(const void* qkv, const void* a, const void* b, const float* conv_weight, const float* A_log,
                    const float* dt_bias, void* conv_state, float* state, int64_t num_slots, const int64_t* starts,
                    const int64_t* slots, const int32_t* fresh, int64_t S, int64_t Hk, int64_t Hv, int64_t dk,
                    int64_t dv, int64_t K, int bf16, void* out, int nthreads) {
    if (K < 1 || K > 17 || Hk < 1 || Hv % Hk || starts[0] != 0)
        return KVD_BAD_INDEX;
    for (int64_t s = 0; s < S; s++) {
        if (starts[s + 1] < starts[s] || slots[s] < 0 || slots[s] >= num_slots)
            return KVD_BAD_INDEX;
        for (int64_t r = 0; r < s; r++)
            if (slots[r] == slots[s])  // two sequences would race on one state
                return KVD_BAD_INDEX;
    }
    const int64_t T = starts[S], key_dim = Hk * dk, C = 2 * key_dim + Hv * dv, elem = bf16 ? 2 : 4;
    float* mixed = malloc((size_t)(T * C) * sizeof(float) + 1);
    if (!mixed)
        return KVD_OUT_OF_MEMORY;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t sc = 0; sc < S * C; sc++) {
            const int64_t s = sc / C, c = sc % C;
            char* window = (char*)conv_state + slots[s] * (K - 1) * C * elem;
            conv_channel(qkv, C, c, conv_weight + c * K, K, window, fresh[s], starts[s], starts[s + 1] - starts[s],
                         mixed, bf16);
        }
        float* scratch = malloc((size_t)(2 * dk + 2 * dv) * sizeof(float));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t sh = 0; sh < S * Hv; sh++) {
            if (!scratch)
                continue;
            const int64_t s = sh / Hv, h = sh % Hv;
            float* Sm = state + (slots[s] * Hv + h) * dk * dv;
            delta_head(mixed, C, key_dim, h / (Hv / Hk), h, dk, dv, a, b, Hv, expf(A_log[h]), dt_bias[h], Sm,
                       fresh[s], starts[s], starts[s + 1] - starts[s], out, bf16, scratch);
        }
        free(scratch);
    }
    free(mixed);
    return failed ? KVD_OUT_OF_MEMORY : KVD_OK;
}
