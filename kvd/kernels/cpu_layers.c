// The rest of a decoder layer and the layer loop: RMSNorm (with the residual add fused), SiLU-and-multiply and
// the rotary embedding, then a decode step through every layer (kvd_decode_layers: the same kernels in the same
// order as the model's Python layer loop); and the argmax over the logits (greedy sampling).
#include "cpu_internal.h"

#if KVD_AVX2
// v rounded to bf16 where the dtype is (kept in float32 lanes), and eight values stored in the dtype.
static inline __m256 round8(__m256 v, int bf16) { return bf16 ? _mm256_castsi256_ps(bf16_bits8(v)) : v; }

static inline void store8(char* p, __m256 v, int bf16) {
    if (bf16)
        store_bf16x8(p, v);
    else
        _mm256_storeu_ps((float*)p, v);
}
#endif

// ---- residual add + RMSNorm, SiLU-and-multiply ----------------------------------------------------------------

// x . x over D values: value i in lane i % 8 up to the last whole eight, a fixed tree over the lanes, then the
// rest in order; plain C takes the same steps, so every build gives the same bits.
static float sum_squares(const void* x, int64_t D, int bf16) {
    float lanes[8] = {0.f};
    int64_t i = 0;
#if KVD_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= D; i += 8) {
        const __m256 v = load8((const char*)x + i * (bf16 ? 2 : 4), bf16);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    _mm256_storeu_ps(lanes, acc);
#endif
    for (; i + 8 <= D; i += 8)
        for (int j = 0; j < 8; j++) {
            const float v = load_f(x, i + j, bf16);
            lanes[j] += v * v;
        }
    float ss = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
    for (; i < D; i++) {
        const float v = load_f(x, i, bf16);
        ss += v * v;
    }
    return ss;
}

// out[0..D) = x / rms(x) * weight (out may be x). float32: one product chain per value; bf16: normalized in
// float32 and rounded, then scaled and rounded, as transformers computes it.
static void norm_row(const void* x, void* out, int64_t D, const void* weight, float eps, int bf16) {
    const float inv = 1.f / sqrtf(sum_squares(x, D, bf16) / (float)D + eps);
    int64_t i = 0;
#if KVD_AVX2
    const int elem = bf16 ? 2 : 4;
    for (; i + 8 <= D; i += 8) {
        const __m256 v = round8(_mm256_mul_ps(load8((const char*)x + i * elem, bf16), _mm256_set1_ps(inv)), bf16);
        store8((char*)out + i * elem, _mm256_mul_ps(v, load8((const char*)weight + i * elem, bf16)), bf16);
    }
#endif
    for (; i < D; i++) {
        const float v = load_f(x, i, bf16) * inv;
        store_f(out, i, (bf16 ? bf16_to_f32(f32_to_bf16(v)) : v) * load_f(weight, i, bf16), bf16);
    }
}

// RMSNorm over each head's D values of x [tokens, heads, D] (token t at t x stride, out at t x out_stride; out
// may be x): single heads (Qwen3's q/k norms) or, with one head, whole rows.
void kvd_rms_norm(const void* x, int64_t stride, void* out, int64_t out_stride, int64_t tokens, int64_t heads,
                  int64_t D, const void* weight, float eps, int bf16) {
    const int elem = bf16 ? 2 : 4;
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++)
            norm_row((const char*)x + (t * stride + h * D) * elem, (char*)out + (t * out_stride + h * D) * elem, D,
                     weight, eps, bf16);
}

void kvd_add_rms_norm(const void* x, void* residual, const void* weight, void* out, int64_t M, int64_t H,
                      float eps, int bf16, int nthreads) {
    const int elem = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * H >= 65536)
    for (int64_t r = 0; r < M; r++) {
        char* res = (char*)residual + r * H * elem;
        const char* xr = (const char*)x + r * H * elem;
        for (int64_t i = 0; i < H; i++) store_f(res, i, load_f(res, i, bf16) + load_f(xr, i, bf16), bf16);
        norm_row(res, (char*)out + r * H * elem, H, weight, eps, bf16);
    }
}

// silu(g) = g / (1 + e^-g), with e = e^-|g| <= 1 so the exponential never overflows: g / (1 + e) for g >= 0,
// g e / (1 + e) below.
static inline float silu(float g) {
    const float e = expf(-fabsf(g));
    return (g >= 0.f ? g : g * e) / (1.f + e);
}

#if KVD_AVX2
static inline __m256 silu8(__m256 g) {
    const __m256 e = exp_nonpositive(_mm256_or_ps(g, _mm256_set1_ps(-0.f)));
    const __m256 negative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 num = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), negative);
    return _mm256_div_ps(num, _mm256_add_ps(e, _mm256_set1_ps(1.f)));
}
#endif

#if KVD_AVX512
static inline __m512 silu16(__m512 g) {
    const __m512 e = exp_nonpositive16(_mm512_or_ps(g, _mm512_set1_ps(-0.f)));
    const __m512 num = _mm512_mask_mul_ps(g, _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), g, e);
    return _mm512_div_ps(num, _mm512_add_ps(e, _mm512_set1_ps(1.f)));
}
#endif

// gelu(x), tanh approximation, as x x sigmoid(z) with z = 2 sqrt(2 / pi) (x + 0.044715 x^3): silu's steps on z.
#define GELU_C1 1.5957691216057308f  // 2 sqrt(2 / pi)
#define GELU_C3 0.0713548162726009f  // 2 sqrt(2 / pi) x 0.044715

static inline float gelu_tanh(float x) {
    const float z = x * (GELU_C1 + GELU_C3 * x * x), e = expf(-fabsf(z));
    return (z >= 0.f ? x : x * e) / (1.f + e);
}

#if KVD_AVX2
static inline __m256 gelu_tanh8(__m256 x) {
    const __m256 z = _mm256_mul_ps(x, _mm256_fmadd_ps(_mm256_set1_ps(GELU_C3), _mm256_mul_ps(x, x), _mm256_set1_ps(GELU_C1)));
    const __m256 e = exp_nonpositive(_mm256_or_ps(z, _mm256_set1_ps(-0.f)));
    const __m256 num = _mm256_blendv_ps(x, _mm256_mul_ps(x, e), _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_LT_OQ));
    return _mm256_div_ps(num, _mm256_add_ps(e, _mm256_set1_ps(1.f)));
}
#endif

#if KVD_AVX512
static inline __m512 gelu_tanh16(__m512 x) {
    const __m512 z = _mm512_mul_ps(x, _mm512_fmadd_ps(_mm512_set1_ps(GELU_C3), _mm512_mul_ps(x, x), _mm512_set1_ps(GELU_C1)));
    const __m512 e = exp_nonpositive16(_mm512_or_ps(z, _mm512_set1_ps(-0.f)));
    const __m512 num = _mm512_mask_mul_ps(x, _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_LT_OQ), x, e);
    return _mm512_div_ps(num, _mm512_add_ps(e, _mm512_set1_ps(1.f)));
}
#endif

// out = act(gate) x up, act rounded to the dtype first (as torch's act then mul_ round): SiLU or, with gelu, GELU.
void gated_mul(const void* gate, const void* up, int64_t stride, void* out, int64_t T, int64_t I, int bf16,
                      int gelu, int nthreads) {
    const int elem = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * I >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const char* g = (const char*)gate + t * stride * elem;
        const char* u = (const char*)up + t * stride * elem;
        char* o = (char*)out + t * I * elem;
        int64_t i = 0;
#if KVD_AVX512
        for (; i + 16 <= I; i += 16) {
            const __m512 gi = load16(g + i * elem, bf16);
            __m512 s = gelu ? gelu_tanh16(gi) : silu16(gi);
            if (bf16) s = _mm512_castsi512_ps(bf16_bits16(s));
            const __m512 v = _mm512_mul_ps(s, load16(u + i * elem, bf16));
            if (bf16)
                store_bf16x16(o + i * elem, v);
            else
                _mm512_storeu_ps((float*)(o + i * elem), v);
        }
#endif
#if KVD_AVX2
        for (; i + 8 <= I; i += 8) {
            const __m256 gi = load8(g + i * elem, bf16);
            const __m256 s = round8(gelu ? gelu_tanh8(gi) : silu8(gi), bf16);
            store8(o + i * elem, _mm256_mul_ps(s, load8(u + i * elem, bf16)), bf16);
        }
#endif
        for (; i < I; i++) {
            const float gj = load_f(g, i, bf16), sj = gelu ? gelu_tanh(gj) : silu(gj);
            store_f(o, i, (bf16 ? bf16_to_f32(f32_to_bf16(sj)) : sj) * load_f(u, i, bf16), bf16);
        }
    }
}

void kvd_silu_mul(const void* gate, const void* up, int64_t stride, void* out, int64_t T, int64_t I, int bf16,
                  int nthreads) {
    gated_mul(gate, up, stride, out, T, I, bf16, 0, nthreads);
}

void kvd_gelu_tanh_mul(const void* gate, const void* up, int64_t stride, void* out, int64_t T, int64_t I,
                       int bf16, int nthreads) {
    gated_mul(gate, up, stride, out, T, I, bf16, 1, nthreads);
}

// ---- gates: sigmoid(gate) x x, RMSNorm x silu(gate) -----------------------------------------------------------

// sigmoid(g) with e = e^-|g| <= 1 (never overflows): 1 / (1 + e) for g >= 0, e / (1 + e) below.
static inline float sigmoid(float g) {
    const float e = expf(-fabsf(g));
    return (g >= 0.f ? 1.f : e) / (1.f + e);
}

#if KVD_AVX2
static inline __m256 sigmoid8(__m256 g) {
    const __m256 e = exp_nonpositive(_mm256_or_ps(g, _mm256_set1_ps(-0.f)));
    const __m256 num = _mm256_blendv_ps(_mm256_set1_ps(1.f), e, _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ));
    const __m256 s = _mm256_div_ps(num, _mm256_add_ps(e, _mm256_set1_ps(1.f)));
    return _mm256_blendv_ps(s, g, _mm256_cmp_ps(g, g, _CMP_UNORD_Q));  // a NaN gate stays NaN (exp's clamp hides it)
}
#endif

void kvd_sigmoid_mul(const void* x, const void* gate, void* out, int64_t T, int64_t n, int bf16, int nthreads) {
    const int elem = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * n >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const char* xr = (const char*)x + t * n * elem;
        const char* g = (const char*)gate + t * n * elem;
        char* o = (char*)out + t * n * elem;
        int64_t i = 0;
#if KVD_AVX2
        for (; i + 8 <= n; i += 8) {
            const __m256 s = round8(sigmoid8(load8(g + i * elem, bf16)), bf16);
            store8(o + i * elem, _mm256_mul_ps(load8(xr + i * elem, bf16), s), bf16);
        }
#endif
        for (; i < n; i++) {
            const float s = sigmoid(load_f(g, i, bf16));
            store_f(o, i, load_f(xr, i, bf16) * (bf16 ? bf16_to_f32(f32_to_bf16(s)) : s), bf16);
        }
    }
}

void kvd_gated_rms_norm(const void* x, const void* gate, void* out, int64_t T, int64_t H, int64_t D,
                        const void* weight, float eps, int bf16, int nthreads) {
    const int elem = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * H * D >= 65536)
    for (int64_t r = 0; r < T * H; r++) {
        const char* g = (const char*)gate + r * D * elem;
        char* o = (char*)out + r * D * elem;
        norm_row((const char*)x + r * D * elem, o, D, weight, eps, bf16);
        int64_t i = 0;
#if KVD_AVX2
        for (; i + 8 <= D; i += 8)
            store8(o + i * elem, _mm256_mul_ps(load8(o + i * elem, bf16), silu8(load8(g + i * elem, bf16))), bf16);
#endif
        for (; i < D; i++) store_f(o, i, load_f(o, i, bf16) * silu(load_f(g, i, bf16)), bf16);
    }
}

// ---- rotary embedding ---------------------------------------------------------------------------------------

#if KVD_AVX2
// Eight pairs (x[i], x[i + half]) of kvd_rotary's loop at once, with its roundings; cs = the cos row at i.
static inline void rotate8(char* x, const char* cs, int bf16, int64_t D, int64_t half) {
    const int elem = bf16 ? 2 : 4;
    const __m256 lo = load8(x, bf16), hi = load8(x + half * elem, bf16);
    const __m256 p0 = round8(_mm256_mul_ps(lo, load8(cs, bf16)), bf16);
    const __m256 p1 = round8(_mm256_mul_ps(hi, load8(cs + D * elem, bf16)), bf16);
    const __m256 p2 = round8(_mm256_mul_ps(hi, load8(cs + half * elem, bf16)), bf16);
    const __m256 p3 = round8(_mm256_mul_ps(lo, load8(cs + (D + half) * elem, bf16)), bf16);
    store8(x, _mm256_add_ps(p0, p1), bf16);
    store8(x + half * elem, _mm256_add_ps(p2, p3), bf16);
}
#endif

// x * cos + roll(x, R / 2) * sin over a head's first R values, each product and the sum rounded in x's dtype as
// torch computes them. Element i and i + R / 2 read each other, so each pair is rotated together, in place.
int kvd_rotary(void* x, int64_t stride, int bf16, int64_t T, int64_t heads, int64_t D, int64_t R,
               const void* cos_sin, int64_t num_positions, const int64_t* positions, int nthreads) {
    if (!indices_in_range(positions, T, 0, num_positions)) return KVD_BAD_INDEX;
    const int64_t half = R / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 1)
    for (int64_t t = 0; t < T; t++) {
        const int64_t row = positions[t] * 2 * R;
        for (int64_t h = 0; h < heads; h++) {
            const int64_t base = t * stride + h * D;
            int64_t i = 0;
#if KVD_AVX2
            const int elem = bf16 ? 2 : 4;
            for (; i + 8 <= half; i += 8)
                rotate8((char*)x + (base + i) * elem, (const char*)cos_sin + (row + i) * elem, bf16, R, half);
#endif
            for (; i < half; i++) {
                const float lo = load_f(x, base + i, bf16), hi = load_f(x, base + i + half, bf16);
                float prod[4] = {lo * load_f(cos_sin, row + i, bf16), hi * load_f(cos_sin, row + R + i, bf16),
                                 hi * load_f(cos_sin, row + i + half, bf16),
                                 lo * load_f(cos_sin, row + R + i + half, bf16)};
                if (bf16)
                    for (int j = 0; j < 4; j++) prod[j] = bf16_to_f32(f32_to_bf16(prod[j]));
                store_f(x, base + i, prod[0] + prod[1], bf16);
                store_f(x, base + i + half, prod[2] + prod[3], bf16);
            }
        }
    }
    return KVD_OK;
}

// ---- a decode step through every decoder layer ----------------------------------------------------------------

// y [S, the parts' n summed] = x [S, k] @ the parts' rows stacked: one part writes y itself; more write their
// columns through scratch [S, the widest part's n] (a copy of S rows, little beside the products).
int parts_linear(const kvd_weight* parts, const void* x, int bf16, int64_t S, char* y, char* scratch,
                        int nthreads) {
    const size_t elem = bf16 ? 2 : 4;
    if (parts[1].n == 0) return kvd_linear(parts, x, bf16, S, y, bf16, nthreads);
    int64_t width = 0, col = 0;
    for (int p = 0; p < KVD_MAX_PARTS; p++) width += parts[p].n;
    for (int p = 0; p < KVD_MAX_PARTS && parts[p].n; col += parts[p].n, p++) {
        const int status = kvd_linear(parts + p, x, bf16, S, scratch, bf16, nthreads);
        if (status != KVD_OK) return status;
        for (int64_t s = 0; s < S; s++)
            memcpy(y + (s * width + col) * elem, scratch + s * parts[p].n * elem, parts[p].n * elem);
    }
    return KVD_OK;
}

// The widest part of a projection of several parts (the scratch rows parts_linear needs), 0 for one part.
int64_t widest_part(const kvd_weight* parts) {
    int64_t n = 0;
    for (int p = 0; p < KVD_MAX_PARTS && parts[1].n; p++) n = parts[p].n > n ? parts[p].n : n;
    return n;
}

// Layer L's attention sublayer: hidden [S, hidden] = its output for the normed x (qkv, q, gate, att: scratch as
// kvd_decode_layers lays it out).
static int attention_sublayer(const kvd_shape* m, const kvd_layer* L, const kvd_kv_group* G, const char* x, int64_t S,
                              const int64_t* positions, const int32_t* lens, char* qkv, char* qh, char* gate,
                              char* att, char* scratch, void* hidden, int nthreads) {
    const int bf16 = m->bf16;
    const size_t elem = bf16 ? 2 : 4;
    const int64_t D = m->head_dim, q_size = m->heads * D, kv_size = m->kv_heads * D;
    const int64_t q_width = (m->output_gate ? 2 : 1) * q_size, qkv_size = q_width + 2 * kv_size;
    const int64_t num_slots = m->num_blocks * m->block_size;
    if (parts_linear(L->qkv, x, bf16, S, qkv, scratch, nthreads) != KVD_OK) return KVD_OUT_OF_MEMORY;
    char *q = qkv, *k = qkv + q_width * elem, *v = k + kv_size * elem;
    int64_t q_stride = qkv_size;
    if (m->output_gate)  // each head's query, then its gate: the queries and the gates apart
        for (int64_t s = 0; s < S; s++)
            for (int64_t h = 0; h < m->heads; h++) {
                const char* head = qkv + (s * qkv_size + 2 * h * D) * elem;
                memcpy(qh + (s * q_size + h * D) * elem, head, D * elem);
                memcpy(gate + (s * q_size + h * D) * elem, head + D * elem, D * elem);
            }
    if (m->output_gate) q = qh, q_stride = q_size;
    if (L->q_norm) {
        kvd_rms_norm(q, q_stride, q, q_stride, S, m->heads, D, L->q_norm, m->eps, bf16);
        kvd_rms_norm(k, qkv_size, k, qkv_size, S, m->kv_heads, D, L->k_norm, m->eps, bf16);
    }
    if (m->output_gate) {
        kvd_rotary(q, q_stride, bf16, S, m->heads, D, m->rotary_dim, L->cos_sin, m->num_positions, positions, nthreads);
        kvd_rotary(k, qkv_size, bf16, S, m->kv_heads, D, m->rotary_dim, L->cos_sin, m->num_positions, positions,
                   nthreads);
    } else {  // the k heads follow the q heads in a qkv row: one pass rotates both
        kvd_rotary(q, qkv_size, bf16, S, m->heads + m->kv_heads, D, m->rotary_dim, L->cos_sin, m->num_positions,
                   positions, nthreads);
    }
    kvd_store_kv(k, qkv_size, v, qkv_size, L->kv_cache, bf16, m->kv8, num_slots, m->kv_heads, D, G->slots, S);
    if (kvd_paged_attention(q, q_stride, att, L->kv_cache, bf16, m->kv8, m->num_blocks, m->block_size, m->kv_heads, D,
                            S, m->heads, G->tables, G->table_width, lens, L->window, L->sinks, m->scale,
                            nthreads) != KVD_OK)
        return KVD_OUT_OF_MEMORY;
    if (m->output_gate) kvd_sigmoid_mul(att, gate, att, S, q_size, bf16, nthreads);
    return kvd_linear(&L->o, att, bf16, S, hidden, bf16, nthreads);
}

// The indices are checked once, before layer 0 writes anything; after that only memory can run out.
int kvd_decode_layers(const kvd_shape* m, const kvd_layer* layers, int64_t num_layers, void* hidden,
                      void* residual, int64_t S, const int64_t* positions, const kvd_kv_group* groups,
                      int64_t num_groups, const int32_t* lens, const kvd_recurrent_step* recurrent, int nthreads) {
    const int64_t num_slots = m->num_blocks * m->block_size;
    if (!indices_in_range(positions, S, 0, m->num_positions)) return KVD_BAD_INDEX;
    for (int64_t g = 0; g < num_groups; g++)
        if (checked_max_context(groups[g].tables, groups[g].table_width, lens, S, m->num_blocks, m->block_size) < 0 ||
            !indices_in_range(groups[g].slots, S, -1, num_slots))
            return KVD_BAD_INDEX;
    for (int64_t l = 0; l < num_layers; l++)
        if (layers[l].kv_group < 0 || layers[l].kv_group >= num_groups ||
            (layers[l].recurrent && !recurrent_step_ok(layers[l].recurrent, recurrent, S)))
            return KVD_BAD_INDEX;
    const int bf16 = m->bf16;
    const size_t elem = bf16 ? 2 : 4;
    const int64_t q_size = m->heads * m->head_dim, kv_size = m->kv_heads * m->head_dim;
    const int64_t qkv_size = (m->output_gate ? 2 : 1) * q_size + 2 * kv_size, I = m->intermediate;
    char* x = malloc(elem * (size_t)(S * m->hidden));
    char* qkv = malloc(elem * (size_t)(S * qkv_size));
    const int64_t gated = m->output_gate ? S * q_size : 1;  // with output_gate: the queries, then the gates
    char* qh = malloc(elem * (size_t)gated);
    char* gate = malloc(elem * (size_t)gated);
    char* att = malloc(elem * (size_t)(S * q_size));
    char* gate_up = malloc(elem * (size_t)(S * 2 * I));
    char* act = malloc(elem * (size_t)(S * I));
    int64_t widest = 0;
    for (int64_t l = 0; l < num_layers; l++) {
        const kvd_recurrent* R = layers[l].recurrent;
        const kvd_weight* projections[6] = {layers[l].qkv, layers[l].gate_up, R ? R->qkv : NULL, R ? R->z : NULL,
                                            R ? R->b : NULL, R ? R->a : NULL};
        for (int j = 0; j < 6; j++) {
            const int64_t n = projections[j] ? widest_part(projections[j]) : 0;
            widest = n > widest ? n : widest;
        }
    }
    char* scratch = malloc(elem * (size_t)(S * (widest ? widest : 1)));  // not NULL when no layer needs it
    int failed = !x || !qkv || !qh || !gate || !att || !gate_up || !act || !scratch;
    for (int64_t l = 0; l < num_layers && !failed; l++) {
        const kvd_layer* L = layers + l;
        kvd_add_rms_norm(hidden, residual, L->input_norm, x, S, m->hidden, m->eps, bf16, nthreads);
        if (L->recurrent)
            failed |= recurrent_sublayer(L->recurrent, recurrent, x, S, m->eps, bf16, hidden, scratch, nthreads) != KVD_OK;
        else
            failed |= attention_sublayer(m, L, groups + L->kv_group, x, S, positions, lens, qkv, qh, gate, att, scratch,
                                         hidden, nthreads) != KVD_OK;
        if (L->attn_output_norm)
            kvd_rms_norm(hidden, m->hidden, hidden, m->hidden, S, 1, m->hidden, L->attn_output_norm, m->eps, bf16);
        kvd_add_rms_norm(hidden, residual, L->post_attention_norm, x, S, m->hidden, m->eps, bf16, nthreads);
        if (L->moe) {
            failed |= kvd_moe_forward(L->moe, x, bf16, S, hidden, nthreads) != KVD_OK;
        } else {
            failed |= parts_linear(L->gate_up, x, bf16, S, gate_up, scratch, nthreads) != KVD_OK;
            gated_mul(gate_up, gate_up + I * elem, 2 * I, act, S, I, bf16, L->gelu, nthreads);
            failed |= kvd_linear(&L->down, act, bf16, S, hidden, bf16, nthreads) != KVD_OK;
        }
        if (L->mlp_output_norm)
            kvd_rms_norm(hidden, m->hidden, hidden, m->hidden, S, 1, m->hidden, L->mlp_output_norm, m->eps, bf16);
    }
    free(x);
    free(qkv);
    free(qh);
    free(gate);
    free(att);
    free(gate_up);
    free(act);
    free(scratch);
    return failed ? KVD_OUT_OF_MEMORY : KVD_OK;
}

// ---- argmax over logits rows ---------------------------------------------------------------------------------

static int64_t first_nan(const float* x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (x[i] != x[i]) return i;
    return -1;
}

// Row x's argmax: eight lanes keep their first largest value (strictly greater replaces), then the largest of the
// lanes with the lowest index among equals, then the tail in order; a NaN anywhere wins at its first place.
static int64_t argmax_row(const float* x, int64_t n) {
    int64_t i = 0, best = 0;
    float top = x[0];
#if KVD_AVX2
    if (n >= 16 && n <= INT32_MAX) {  // int32 lanes count the indices
        __m256 vtop = _mm256_loadu_ps(x), nan = _mm256_cmp_ps(vtop, vtop, _CMP_UNORD_Q);
        __m256i vbest = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), at = vbest;
        for (i = 8; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_loadu_ps(x + i);
            at = _mm256_add_epi32(at, _mm256_set1_epi32(8));
            const __m256 gt = _mm256_cmp_ps(v, vtop, _CMP_GT_OQ);
            vtop = _mm256_blendv_ps(vtop, v, gt);
            vbest = _mm256_blendv_epi8(vbest, at, _mm256_castps_si256(gt));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        if (_mm256_movemask_ps(nan)) return first_nan(x, n);
        float tops[8];
        int32_t bests[8];
        _mm256_storeu_ps(tops, vtop);
        _mm256_storeu_si256((__m256i*)bests, vbest);
        top = tops[0], best = bests[0];
        for (int l = 1; l < 8; l++)
            if (tops[l] > top || (tops[l] == top && bests[l] < best)) top = tops[l], best = bests[l];
    }
#endif
    for (; i < n; i++) {
        if (x[i] != x[i]) return first_nan(x, n);
        if (x[i] > top) top = x[i], best = i;
    }
    return best;
}

void kvd_argmax(const float* x, int64_t rows, int64_t n, int64_t* out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * n, n);
}
