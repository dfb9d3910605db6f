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

// Channel c of a sequence's rows first .. first + rows - 1: out = silu(sum_j w[j] x[t - K + 1 + j]) rounded to
// the dtype (as a convolution in the dtype and its SiLU round), the inputs before the first row read from `from`
// (zeros when NULL), and `window` then holding the last K - 1 inputs; after row first + snap_row, `snap` holds the
// window as it was then.
static void conv_channel(const void* qkv, int64_t C, int64_t c, const float* w, int64_t K, const void* from,
                         void* window, int64_t first, int64_t rows, int64_t snap_row, void* snap, float* mixed,
                         int bf16) {
    float past[16];  // K - 1 inputs before the row being computed, oldest first (K <= 17, checked by the caller)
    for (int64_t j = 0; j < K - 1; j++)
        past[j] = from ? load_f(from, j * C + c, bf16) : 0.f;
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
        if (t == snap_row)
            for (int64_t j = 0; j < K - 1; j++)
                store_f(snap, j * C + c, past[j], bf16);
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

// A value head's shape and inputs: key head kh of its q and k, its v, decay and update gate.
typedef struct {
    const float* mixed;
    const void *a, *b;
    int64_t C, key_dim, kh, h, Hv, dk, dv;
    float A, dt_bias;
    int bf16;
} head_inputs;

// Value head h of a sequence through its rows: the state S [dk, dv] decays by e^g, meets k's prediction of v
// (S^T k), takes beta of the difference along k, and answers q (S^T q), row after row of S; after row
// first + snap_row, snap holds S as it was then.
static void delta_head(const head_inputs* in, float* S, int64_t first, int64_t rows, int64_t snap_row, float* snap,
                       void* out, float* scratch) {
    const int64_t dk = in->dk, dv = in->dv;
    float* q = scratch;
    float* k = q + dk;
    float* mem = k + dk;
    float* delta = mem + dv;
    const float scale = 1.f / sqrtf((float)dk);
    for (int64_t t = first; t < first + rows; t++) {
        const float* row = in->mixed + t * in->C;
        const float* qs = row + in->kh * dk;
        const float* ks = row + in->key_dim + in->kh * dk;
        const float* v = row + 2 * in->key_dim + in->h * dv;
        const float qn = inverse_norm(qs, dk), kn = inverse_norm(ks, dk);
        for (int64_t i = 0; i < dk; i++) {
            q[i] = qs[i] * qn * scale;
            k[i] = ks[i] * kn;
        }
        const float a = load_f(in->a, t * in->Hv + in->h, in->bf16);
        const float decay = expf(-in->A * softplusf(a + in->dt_bias));
        const float beta = round_dtype(sigmoidf(load_f(in->b, t * in->Hv + in->h, in->bf16)), in->bf16);
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
            store_f(out, t * in->Hv * dv + in->h * dv + j, mem[j], in->bf16);
        if (t - first == snap_row)
            memcpy(snap, S, (size_t)(dk * dv) * sizeof(float));
    }
}

// Whether slot x is one of n slots (skipping index `skip`).
static int among(int64_t x, const int64_t* slots, int64_t n, int64_t skip) {
    for (int64_t i = 0; i < n; i++)
        if (i != skip && slots[i] == x)
            return 1;
    return 0;
}

// Every slot in range; live and snapshot slots all distinct; a source that is not the sequence's own slot no
// slot the step writes; starts that never go back; snapshot rows within their sequence's rows.
static int check_step(int64_t num_slots, const int64_t* starts, const int64_t* slots, const int64_t* sources,
                      const int64_t* snap_rows, const int64_t* snap_slots, int64_t S) {
    for (int64_t s = 0; s < S; s++) {
        const int64_t rows = starts[s + 1] - starts[s];
        const int snaps = snap_rows[s] >= 0;
        if (rows < 0 || slots[s] < 0 || slots[s] >= num_slots || sources[s] < -1 || sources[s] >= num_slots)
            return 0;
        if (snap_rows[s] >= rows || (snaps && (snap_slots[s] < 0 || snap_slots[s] >= num_slots)))
            return 0;
        if (among(slots[s], slots, S, s) || among(slots[s], snap_slots, S, -1))
            return 0;
        if (snaps && (among(snap_slots[s], snap_slots, S, s) || among(snap_slots[s], slots, S, -1)))
            return 0;
        if (sources[s] >= 0 && sources[s] != slots[s] &&
            (among(sources[s], slots, S, -1) || among(sources[s], snap_slots, S, -1)))
            return 0;
    }
    return 1;
}

int kvd_gated_delta(const void* qkv, const void* a, const void* b, const float* conv_weight, const float* A_log,
                    const float* dt_bias, void* conv_state, float* state, int64_t num_slots, const int64_t* starts,
                    const int64_t* slots, const int64_t* sources, const int64_t* snap_rows,
                    const int64_t* snap_slots, int64_t S, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t K,
                    int tiled, int bf16, void* out, int nthreads) {
    if (K < 1 || K > 17 || Hk < 1 || Hv % Hk || starts[0] != 0 ||
        !check_step(num_slots, starts, slots, sources, snap_rows, snap_slots, S))
        return KVD_BAD_INDEX;
    const int64_t T = starts[S], key_dim = Hk * dk, C = 2 * key_dim + Hv * dv, elem = bf16 ? 2 : 4;
    const int64_t window_bytes = (K - 1) * C * elem, state_size = dk * dv;
    float* mixed = malloc((size_t)(T * C) * sizeof(float) + 1);
    if (!mixed)
        return KVD_OUT_OF_MEMORY;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t sc = 0; sc < S * C; sc++) {
            const int64_t s = sc / C, c = sc % C;
            char* base = (char*)conv_state;
            const void* from = sources[s] < 0 ? NULL : base + sources[s] * window_bytes;
            void* snap = snap_rows[s] < 0 ? NULL : base + snap_slots[s] * window_bytes;
            conv_channel(qkv, C, c, conv_weight + c * K, K, from, base + slots[s] * window_bytes, starts[s],
                         starts[s + 1] - starts[s], snap_rows[s], snap, mixed, bf16);
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
            float* own = state + (slots[s] * Hv + h) * state_size;
            if (sources[s] < 0)
                memset(own, 0, (size_t)state_size * sizeof(float));
            else if (sources[s] != slots[s])
                memcpy(own, state + (sources[s] * Hv + h) * state_size, (size_t)state_size * sizeof(float));
            const int64_t kh = tiled ? h % Hk : h / (Hv / Hk);
            const head_inputs in = {mixed, a, b, C, key_dim, kh, h, Hv, dk, dv, expf(A_log[h]), dt_bias[h], bf16};
            float* snap = snap_rows[s] < 0 ? NULL : state + (snap_slots[s] * Hv + h) * state_size;
            delta_head(&in, own, starts[s], starts[s + 1] - starts[s], snap_rows[s], snap, out, scratch);
        }
        free(scratch);
    }
    free(mixed);
    return failed ? KVD_OUT_OF_MEMORY : KVD_OK;
}
