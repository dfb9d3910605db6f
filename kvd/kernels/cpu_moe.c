// A mixture of experts in one call (kvd_moe_forward, cpu_kernels.h): the router's logits, each token's top k and
// their weights, then expert by expert its tokens gathered into one block of rows (the expert's weights read once for
// all of them, as llama.cpp's MUL_MAT_ID reads them), and each token's outputs summed in ascending expert order.
#include "cpu_internal.h"

// Each token's experts in ascending order and their float32 weights ([M, top_k] each) from its logits [M, E].
static void route(const kvd_moe* moe, const float* logits, int64_t M, int32_t* ids, float* weights) {
    const int64_t E = moe->num_experts, K = moe->top_k;
    for (int64_t t = 0; t < M; t++) {
        const float* l = logits + t * E;
        int32_t* id = ids + t * K;
        float* w = weights + t * K;
        // The top k by repeated maximum over the experts not yet taken (k is small): the lowest index wins a tie
        // (a NaN logit compares false: it is kept where it came first, never taken over a number after it).
        for (int64_t j = 0; j < K; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t i = 0; i < j; i++) taken |= id[i] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            id[j] = (int32_t)best;
        }
        // Ascending expert order (insertion sort of k values): the order of the sum below.
        for (int64_t j = 1; j < K; j++)
            for (int64_t i = j; i > 0 && id[i] < id[i - 1]; i--) {
                const int32_t tmp = id[i];
                id[i] = id[i - 1], id[i - 1] = tmp;
            }
        float top = -INFINITY, sum = 0.f;
        if (moe->scoring == KVD_SOFTMAX_TOPK) {  // probabilities over every expert, then the chosen ones
            for (int64_t e = 0; e < E; e++) top = l[e] > top ? l[e] : top;
            for (int64_t e = 0; e < E; e++) sum += expf(l[e] - top);
            float kept = 0.f;
            for (int64_t j = 0; j < K; j++) kept += (w[j] = expf(l[id[j]] - top) / sum);
            if (moe->normalize)
                for (int64_t j = 0; j < K; j++) w[j] /= kept;
        } else {  // a softmax over the chosen logits alone
            for (int64_t j = 0; j < K; j++) top = l[id[j]] > top ? l[id[j]] : top;
            for (int64_t j = 0; j < K; j++) sum += (w[j] = expf(l[id[j]] - top));
            for (int64_t j = 0; j < K; j++) w[j] /= sum;
        }
    }
}

static inline float round_to(float v, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

// 1 / (1 + e^-z), with e^-|z| so the exponential never overflows.
static inline float sigmoid(float z) {
    const float e = expf(-fabsf(z));
    return z >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
}

// gpt-oss's: g sigmoid(alpha g) (u + 1), g = min(gate, limit), u = up within +-limit; each step rounded in the
// dtype as torch's ops round it (the alpha product, the sigmoid, the products, u + 1).
static void clamped_swiglu(const char* gate_up, int64_t I, void* out, int64_t T, int bf16, float alpha, float limit) {
    const size_t elem = bf16 ? 2 : 4;
    for (int64_t t = 0; t < T; t++) {
        const char* g = gate_up + t * 2 * I * elem;
        const char* u = g + I * elem;
        char* o = (char*)out + t * I * elem;
        for (int64_t i = 0; i < I; i++) {
            float gi = load_f(g, i, bf16), ui = load_f(u, i, bf16);
            gi = gi > limit ? limit : gi;
            ui = ui > limit ? limit : (ui < -limit ? -limit : ui);
            const float sig = round_to(sigmoid(round_to(gi * alpha, bf16)), bf16);
            store_f(o, i, round_to(gi * sig, bf16) * round_to(ui + 1.f, bf16), bf16);
        }
    }
}

// One expert's gated MLP on `count` rows x [count, H] -> y [count, H] (in the dtype), through the caller's buffers.
static int expert_rows(const kvd_moe* moe, const kvd_weight* w, int64_t I, const char* x, int64_t count, char* y,
                       char* gate_up, char* act, char* scratch, int bf16, int nthreads) {
    const size_t elem = bf16 ? 2 : 4;
    const int status = parts_linear(w, x, bf16, count, gate_up, scratch, nthreads);
    if (status != KVD_OK) return status;
    if (moe->act == KVD_ACT_CLAMPED_SWIGLU)
        clamped_swiglu(gate_up, I, act, count, bf16, moe->alpha, moe->limit);
    else
        gated_mul(gate_up, gate_up + I * elem, 2 * I, act, count, I, bf16, moe->act == KVD_ACT_GELU_TANH, nthreads);
    return kvd_linear(w + KVD_MAX_PARTS, act, bf16, count, y, bf16, nthreads);
}

// Expert e on its `count` rows (row r reading token r / top_k of x), the outputs into their (token, slot) rows of
// `outputs`; bufs: gathered rows [count, H], gate/up [count, 2I], the activation [count, I], scratch.
static int run_expert(const kvd_moe* moe, int64_t e, const void* x, const int64_t* rows, int64_t count, char** bufs,
                      char* outputs, int bf16, int nthreads) {
    const int64_t K = moe->top_k, H = moe->hidden;
    const size_t elem = bf16 ? 2 : 4;
    for (int64_t i = 0; i < count; i++)
        memcpy(bufs[0] + i * H * elem, (const char*)x + rows[i] / K * H * elem, H * elem);
    const int status = expert_rows(moe, moe->experts + e * KVD_EXPERT_WEIGHTS, moe->intermediate, bufs[0], count,
                                   bufs[0], bufs[1], bufs[2], bufs[3], bf16, nthreads);
    for (int64_t i = 0; i < count; i++) memcpy(outputs + rows[i] * H * elem, bufs[0] + i * H * elem, H * elem);
    return status;
}

// out += sigmoid(shared_gate . x) x shared(x), row by row, each step rounded in the dtype (as torch's ops round).
static int add_shared_expert(const kvd_moe* moe, const void* x, int64_t M, void* out, int bf16, int nthreads) {
    const int64_t H = moe->hidden, S = moe->shared_size;
    const size_t elem = bf16 ? 2 : 4;
    const int64_t widest = widest_part(moe->shared);
    char* gate = malloc(elem * (size_t)M);
    char* y = malloc(elem * (size_t)(M * H));
    char* gate_up = malloc(elem * (size_t)(M * 2 * S));
    char* act = malloc(elem * (size_t)(M * S));
    char* scratch = malloc(elem * (size_t)(M * (widest ? widest : 1)));
    int status = !gate || !y || !gate_up || !act || !scratch ? KVD_OUT_OF_MEMORY : KVD_OK;
    if (status == KVD_OK) status = kvd_linear(&moe->shared_gate, x, bf16, M, gate, bf16, nthreads);
    if (status == KVD_OK) status = expert_rows(moe, moe->shared, S, x, M, y, gate_up, act, scratch, bf16, nthreads);
    if (status == KVD_OK)
        for (int64_t t = 0; t < M; t++) {
            const float sig = round_to(sigmoid(load_f(gate, t, bf16)), bf16);
            for (int64_t i = 0; i < H; i++) {
                const float scaled = round_to(sig * load_f(y, t * H + i, bf16), bf16);
                store_f(out, t * H + i, load_f(out, t * H + i, bf16) + scaled, bf16);
            }
        }
    free(gate);
    free(y);
    free(gate_up);
    free(act);
    free(scratch);
    return status;
}

int kvd_moe_forward(const kvd_moe* moe, const void* x, int bf16, int64_t M, void* out, int nthreads) {
    const int64_t E = moe->num_experts, K = moe->top_k, H = moe->hidden, I = moe->intermediate;
    if (K < 1 || K > E) return KVD_BAD_INDEX;
    const size_t elem = bf16 ? 2 : 4;
    int64_t widest = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t n = widest_part(moe->experts + e * KVD_EXPERT_WEIGHTS);
        widest = n > widest ? n : widest;
    }
    float* logits = malloc(sizeof(float) * (size_t)(M * E));
    int32_t* ids = malloc(sizeof(int32_t) * (size_t)(M * K));
    float* weights = malloc(sizeof(float) * (size_t)(M * K));
    int64_t* rows = malloc(sizeof(int64_t) * (size_t)(M * K));  // (token, slot) of each row, grouped by expert
    int64_t* starts = calloc((size_t)(E + 1), sizeof(int64_t));  // expert e's rows: starts[e] .. starts[e + 1]
    int64_t* filled = calloc((size_t)E, sizeof(int64_t));
    char* gathered = malloc(elem * (size_t)(M * H));
    char* gate_up = malloc(elem * (size_t)(M * 2 * I));
    char* act = malloc(elem * (size_t)(M * I));
    char* scratch = malloc(elem * (size_t)(M * (widest ? widest : 1)));
    char* outputs = malloc(elem * (size_t)(M * K * H));  // each (token, slot)'s expert output
    const int missing = !logits || !ids || !weights || !rows || !starts || !filled || !gathered || !gate_up || !act ||
                        !scratch || !outputs;
    int status = missing ? KVD_OUT_OF_MEMORY : kvd_linear(&moe->router, x, bf16, M, logits, 0, nthreads);
    if (status == KVD_OK) {
        route(moe, logits, M, ids, weights);
        for (int64_t r = 0; r < M * K; r++) starts[ids[r] + 1]++;
        for (int64_t e = 0; e < E; e++) starts[e + 1] += starts[e];
        for (int64_t r = 0; r < M * K; r++) rows[starts[ids[r]] + filled[ids[r]]++] = r;  // in token order
    }
    for (int64_t e = 0; e < E && status == KVD_OK; e++) {
        const int64_t count = starts[e + 1] - starts[e];
        if (count == 0) continue;
        char* bufs[4] = {gathered, gate_up, act, scratch};
        status = run_expert(moe, e, x, rows + starts[e], count, bufs, outputs, bf16, nthreads);
    }
    if (status == KVD_OK)
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * H >= 65536)
        for (int64_t t = 0; t < M; t++)
            for (int64_t i = 0; i < H; i++) {
                float sum = 0.f;
                for (int64_t j = 0; j < K; j++) sum += load_f(outputs + (t * K + j) * H * elem, i, bf16) * weights[t * K + j];
                store_f(out, t * H + i, sum, bf16);
            }
    free(logits);
    free(ids);
    free(weights);
    free(rows);
    free(starts);
    free(filled);
    free(gathered);
    free(gate_up);
    free(act);
    free(scratch);
    free(outputs);
    if (status == KVD_OK && moe->shared_size) status = add_shared_expert(moe, x, M, out, bf16, nthreads);
    return status;
}
