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

// Channels c0 .. c0 + width - 1 (width <= CONV_BLOCK) of a sequence's rows first .. first + rows - 1, row after
// row: out = silu(sum_j w[j] x[t - K + 1 + j]) rounded to the dtype (as a convolution in the dtype and its SiLU
// round), the inputs before the first row read from `from` (zeros when NULL), and `window` then holding the last
// K - 1 inputs; after row first + snap_rows[i] (ascending, i < nsnaps), the window as it was then is copied into
// slot snap_slots[i] of `base` (slots of window_bytes). Each channel's sum in order of j, whatever the block:
// blocks of channels read whole rows of qkv.
enum { CONV_BLOCK = 64 };

static void conv_block(const void* qkv, int64_t C, int64_t c0, int64_t width, const float* weight, int64_t K,
                       const void* from, void* window, int64_t first, int64_t rows, const int64_t* snap_rows,
                       const int64_t* snap_slots, int64_t nsnaps, char* base, int64_t window_bytes, float* mixed,
                       int bf16) {
    float past[16][CONV_BLOCK];  // a ring of the last K - 1 inputs, the oldest at row `oldest` (K <= 17)
    float w[17][CONV_BLOCK];     // the block's filters, tap by tap
    float acc[CONV_BLOCK];
    const int64_t taps = K - 1;
    for (int64_t c = 0; c < width; c++)
        for (int64_t j = 0; j < K; j++) w[j][c] = weight[(c0 + c) * K + j];
    for (int64_t j = 0; j < taps; j++)
        for (int64_t c = 0; c < width; c++) past[j][c] = from ? load_f(from, j * C + c0 + c, bf16) : 0.f;
    int64_t oldest = 0, next = 0;
    for (int64_t t = 0; t < rows; t++) {
        const int64_t row = (first + t) * C + c0;
        for (int64_t c = 0; c < width; c++) acc[c] = 0.f;
        for (int64_t j = 0; j < taps; j++) {
            const float* p = past[(oldest + j) % taps];
            for (int64_t c = 0; c < width; c++) acc[c] += w[j][c] * p[c];
        }
        for (int64_t c = 0; c < width; c++) {
            const float v = round_dtype(acc[c] + w[K - 1][c] * load_f(qkv, row + c, bf16), bf16);
            mixed[row + c] = round_dtype(v / (1.f + expf(-v)), bf16);
        }
        if (taps) {  // this row's inputs replace the oldest
            for (int64_t c = 0; c < width; c++) past[oldest][c] = load_f(qkv, row + c, bf16);
            oldest = (oldest + 1) % taps;
        }
        for (; next < nsnaps && snap_rows[next] == t; next++) {
            void* snap = base + snap_slots[next] * window_bytes;
            for (int64_t j = 0; j < taps; j++)
                for (int64_t c = 0; c < width; c++) store_f(snap, j * C + c0 + c, past[(oldest + j) % taps][c], bf16);
        }
    }
    for (int64_t j = 0; j < taps; j++)
        for (int64_t c = 0; c < width; c++) store_f(window, j * C + c0 + c, past[(oldest + j) % taps][c], bf16);
}

// 1 / sqrt(sum x^2 + 1e-6) over n values, in order (transformers' l2norm: x times the inverse root).
static inline float inverse_norm(const float* x, int64_t n) {
    float ss = 0.f;
    for (int64_t i = 0; i < n; i++)
        ss += x[i] * x[i];
    return 1.f / sqrtf(ss + 1e-6f);
}

// Columns j .. j + width - 1 of a head's state S [dk, dv] (at S) through one token: decay and k's prediction of v,
// the update, then the answer to q (into out[0 .. width)). Each column's arithmetic, in order of the rows i, is the
// whole matrix's, so tiles of columns (TILE, which stay in registers between the two passes) give the same bits.
enum { TILE = 32 };

// m and dl: width floats of scratch each. The decayed state is computed in both passes rather than stored by the
// first: the same products, one store fewer.
static inline __attribute__((always_inline)) void delta_tile(float* restrict S, int64_t dk, int64_t dv, int64_t width,
                                                             float decay, float beta, const float* restrict k,
                                                             const float* restrict q, const float* restrict v,
                                                             float* restrict out, float* restrict m,
                                                             float* restrict dl) {
    for (int64_t j = 0; j < width; j++) m[j] = 0.f;
    for (int64_t i = 0; i < dk; i++) {
        const float* restrict Si = S + i * dv;
        const float ki = k[i];
        for (int64_t j = 0; j < width; j++) m[j] += (Si[j] * decay) * ki;
    }
    for (int64_t j = 0; j < width; j++) {
        dl[j] = (v[j] - m[j]) * beta;
        out[j] = 0.f;
    }
    for (int64_t i = 0; i < dk; i++) {
        float* restrict Si = S + i * dv;
        const float ki = k[i], qi = q[i];
        for (int64_t j = 0; j < width; j++) {
            Si[j] = Si[j] * decay + ki * dl[j];
            out[j] += Si[j] * qi;
        }
    }
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
// first + snap_rows[i] (ascending, i < nsnaps), S as it was then is copied to snaps + snap_slots[i] * snap_stride.
static void delta_head(const head_inputs* in, float* S, int64_t first, int64_t rows, const int64_t* snap_rows,
                       const int64_t* snap_slots, int64_t nsnaps, float* snaps, int64_t snap_stride, void* out,
                       float* scratch) {
    const int64_t dk = in->dk, dv = in->dv;
    float* q = scratch;
    float* k = q + dk;
    float* mem = k + dk;  // the head's output row
    float* delta = mem + dv;  // 2 dv: the untiled pass's scratch
    const float scale = 1.f / sqrtf((float)dk);
    int64_t next = 0;
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
        if (dv % TILE == 0) {
            for (int64_t j0 = 0; j0 < dv; j0 += TILE) {
                float m[TILE], dl[TILE];  // a constant width: the compiler keeps them in registers
                delta_tile(S + j0, dk, dv, TILE, decay, beta, k, q, v + j0, mem + j0, m, dl);
            }
        } else {
            delta_tile(S, dk, dv, dv, decay, beta, k, q, v, mem, delta, delta + dv);
        }
        for (int64_t j = 0; j < dv; j++)
            store_f(out, t * in->Hv * dv + in->h * dv + j, mem[j], in->bf16);
        for (; next < nsnaps && snap_rows[next] == t - first; next++)
            memcpy(snaps + snap_slots[next] * snap_stride, S, (size_t)(dk * dv) * sizeof(float));
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
// slot the step writes; starts and snapshot starts that never go back; each sequence's snapshot rows ascending
// within its rows.
static int check_step(int64_t num_slots, const int64_t* starts, const int64_t* slots, const int64_t* sources,
                      const int64_t* snap_starts, const int64_t* snap_rows, const int64_t* snap_slots, int64_t S) {
    if (snap_starts[0] != 0)
        return 0;
    const int64_t N = snap_starts[S];
    for (int64_t s = 0; s < S; s++) {
        const int64_t rows = starts[s + 1] - starts[s];
        if (rows < 0 || slots[s] < 0 || slots[s] >= num_slots || sources[s] < -1 || sources[s] >= num_slots)
            return 0;
        if (snap_starts[s + 1] < snap_starts[s] || snap_starts[s + 1] > N)
            return 0;
        for (int64_t i = snap_starts[s]; i < snap_starts[s + 1]; i++)
            if (snap_rows[i] < 0 || snap_rows[i] >= rows || (i > snap_starts[s] && snap_rows[i] < snap_rows[i - 1]))
                return 0;
        if (among(slots[s], slots, S, s) || among(slots[s], snap_slots, N, -1))
            return 0;
        if (sources[s] >= 0 && sources[s] != slots[s] &&
            (among(sources[s], slots, S, -1) || among(sources[s], snap_slots, N, -1)))
            return 0;
    }
    for (int64_t i = 0; i < N; i++)
        if (snap_slots[i] < 0 || snap_slots[i] >= num_slots || among(snap_slots[i], snap_slots, N, i))
            return 0;
    return 1;
}

// kvd_gated_delta's checks of its shape and step.
static int step_ok(int64_t num_slots, const int64_t* starts, const int64_t* slots, const int64_t* sources,
                   const int64_t* snap_starts, const int64_t* snap_rows, const int64_t* snap_slots, int64_t S,
                   int64_t Hk, int64_t Hv, int64_t K) {
    return K >= 1 && K <= 17 && Hk >= 1 && Hv % Hk == 0 && starts[0] == 0 &&
           check_step(num_slots, starts, slots, sources, snap_starts, snap_rows, snap_slots, S);
}

int kvd_gated_delta(const void* qkv, const void* a, const void* b, const float* conv_weight, const float* A_log,
                    const float* dt_bias, void* conv_state, float* state, int64_t num_slots, const int64_t* starts,
                    const int64_t* slots, const int64_t* sources, const int64_t* snap_starts,
                    const int64_t* snap_rows, const int64_t* snap_slots, int64_t S, int64_t Hk, int64_t Hv, int64_t dk,
                    int64_t dv, int64_t K, int tiled, int bf16, void* out, int nthreads) {
    if (!step_ok(num_slots, starts, slots, sources, snap_starts, snap_rows, snap_slots, S, Hk, Hv, K))
        return KVD_BAD_INDEX;
    const int64_t T = starts[S], key_dim = Hk * dk, C = 2 * key_dim + Hv * dv, elem = bf16 ? 2 : 4;
    const int64_t window_bytes = (K - 1) * C * elem, state_size = dk * dv;
    float* mixed = malloc((size_t)(T * C) * sizeof(float) + 1);
    if (!mixed)
        return KVD_OUT_OF_MEMORY;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t blocks = (C + CONV_BLOCK - 1) / CONV_BLOCK;
#pragma omp for schedule(static)
        for (int64_t sb = 0; sb < S * blocks; sb++) {
            const int64_t s = sb / blocks, c0 = sb % blocks * CONV_BLOCK, first_snap = snap_starts[s];
            char* base = (char*)conv_state;
            const void* from = sources[s] < 0 ? NULL : base + sources[s] * window_bytes;
            conv_block(qkv, C, c0, C - c0 < CONV_BLOCK ? C - c0 : CONV_BLOCK, conv_weight, K, from,
                       base + slots[s] * window_bytes, starts[s], starts[s + 1] - starts[s], snap_rows + first_snap,
                       snap_slots + first_snap, snap_starts[s + 1] - first_snap, base, window_bytes, mixed, bf16);
        }
        float* scratch = malloc((size_t)(2 * dk + 3 * dv) * sizeof(float));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t sh = 0; sh < S * Hv; sh++) {
            if (!scratch)
                continue;
            const int64_t s = sh / Hv, h = sh % Hv, first_snap = snap_starts[s];
            float* own = state + (slots[s] * Hv + h) * state_size;
            if (sources[s] < 0)
                memset(own, 0, (size_t)state_size * sizeof(float));
            else if (sources[s] != slots[s])
                memcpy(own, state + (sources[s] * Hv + h) * state_size, (size_t)state_size * sizeof(float));
            const int64_t kh = tiled ? h % Hk : h / (Hv / Hk);
            const head_inputs in = {mixed, a, b, C, key_dim, kh, h, Hv, dk, dv, expf(A_log[h]), dt_bias[h], bf16};
            delta_head(&in, own, starts[s], starts[s + 1] - starts[s], snap_rows + first_snap,
                       snap_slots + first_snap, snap_starts[s + 1] - first_snap, state + h * state_size,
                       Hv * state_size, out, scratch);
        }
        free(scratch);
    }
    free(mixed);
    return failed ? KVD_OUT_OF_MEMORY : KVD_OK;
}

// ---- the layer in the decode loop ---------------------------------------------------------------------------------

int recurrent_step_ok(const kvd_recurrent* R, const kvd_recurrent_step* step, int64_t S) {
    return step && step->sequences >= 0 &&
           step_ok(R->num_slots, step->starts, step->slots, step->sources, step->snap_starts, step->snap_rows,
                   step->snap_slots, step->sequences, R->key_heads, R->value_heads, R->conv_kernel) &&
           step->starts[step->sequences] == S;
}

int recurrent_sublayer(const kvd_recurrent* R, const kvd_recurrent_step* step, const void* x, int64_t S, float eps,
                       int bf16, void* out, char* scratch, int nthreads) {
    const size_t elem = bf16 ? 2 : 4;
    const int64_t Hv = R->value_heads, dv = R->value_dim, C = 2 * R->key_heads * R->key_dim + Hv * dv;
    char* qkv = malloc(elem * (size_t)(S * C));
    char* z = malloc(elem * (size_t)(S * Hv * dv));
    char* core = malloc(elem * (size_t)(S * Hv * dv));
    char* b = malloc(elem * (size_t)(S * Hv));
    char* a = malloc(elem * (size_t)(S * Hv));
    int status = qkv && z && core && b && a ? KVD_OK : KVD_OUT_OF_MEMORY;
    if (status == KVD_OK) status = parts_linear(R->qkv, x, bf16, S, qkv, scratch, nthreads);
    if (status == KVD_OK) status = parts_linear(R->z, x, bf16, S, z, scratch, nthreads);
    if (status == KVD_OK) status = parts_linear(R->b, x, bf16, S, b, scratch, nthreads);
    if (status == KVD_OK) status = parts_linear(R->a, x, bf16, S, a, scratch, nthreads);
    if (status == KVD_OK)
        status = kvd_gated_delta(qkv, a, b, R->conv_weight, R->A_log, R->dt_bias, R->conv_state, R->state,
                                 R->num_slots, step->starts, step->slots, step->sources, step->snap_starts,
                                 step->snap_rows, step->snap_slots, step->sequences, R->key_heads, Hv, R->key_dim, dv,
                                 R->conv_kernel, R->tiled, bf16, core, nthreads);
    if (status == KVD_OK) {
        kvd_gated_rms_norm(core, z, core, S, Hv, dv, R->norm, eps, bf16, nthreads);
        status = kvd_linear(&R->out, core, bf16, S, out, bf16, nthreads);
    }
    free(qkv);
    free(z);
    free(core);
    free(b);
    free(a);
    return status;
}
