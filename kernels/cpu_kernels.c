// kvd's native CPU kernels, compiled on the host at first use (kernels/cpu_native.py) with -march=native.
//
// - Quantized linears: weights stay in 4-bit (asymmetric, GGUF Q4_1's block layout) or 8-bit (symmetric,
//   Q8_0's) blocks of 32 along K; activations are quantized per block of 32 to int8, and each block's dot
//   product runs in integer SIMD (AVX2: unsigned x signed byte multiply-add), scaled once per block.
// - Decode attention over the paged KV pool in place: no gather of each sequence's K/V into a workspace.
// - The residual add fused with RMSNorm.
// Activations and the KV pool are float32 or bfloat16. Without AVX2 the same arithmetic runs in portable C.
// Threads: OpenMP (torch's own runtime once torch has loaded it), the count passed in by the caller.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#define QBLOCK 32

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);  // NaN stays NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even, as torch does
    return (uint16_t)(bits >> 16);
}

static inline float load_f(const void* base, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t*)base)[i]) : ((const float*)base)[i];
}

static inline void store_f(void* base, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t*)base)[i] = f32_to_bf16(v);
    else
        ((float*)base)[i] = v;
}

int kvd_has_avx2(void) {
#ifdef __AVX2__
    return 1;
#else
    return 0;
#endif
}

// ---- activation quantization ------------------------------------------------------------------------------

// x [M, K] -> q int8 [M, K], dx [M, K/32] (the block's scale), sx [M, K/32] (scale x sum of its codes).
static void quantize_rows(const void* x, int x_bf16, int64_t M, int64_t K, int8_t* q, float* dx, float* sx) {
    const int64_t nb = K / QBLOCK;
    for (int64_t r = 0; r < M; r++) {
        for (int64_t b = 0; b < nb; b++) {
            float v[QBLOCK];
            float amax = 0.f;
            for (int i = 0; i < QBLOCK; i++) {
                v[i] = load_f(x, r * K + b * QBLOCK + i, x_bf16);
                float a = fabsf(v[i]);
                amax = a > amax ? a : amax;
            }
            const float d = amax / 127.f;
            const float inv = d > 0.f ? 1.f / d : 0.f;
            int sum = 0;
            int8_t* out = q + r * K + b * QBLOCK;
            for (int i = 0; i < QBLOCK; i++) {
                int c = (int)nearbyintf(v[i] * inv);
                out[i] = (int8_t)c;
                sum += c;
            }
            dx[r * nb + b] = d;
            sx[r * nb + b] = d * (float)sum;
        }
    }
}

// ---- block dot products: 32 weights x 32 int8 activations -> int32 sum -------------------------------------

#ifdef __AVX2__
static inline __m256i unpack_q4(const uint8_t* qs) {
    const __m128i bytes = _mm_loadu_si128((const __m128i*)qs);
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(bytes, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    return _mm256_set_m128i(hi, lo);  // element i of the block in byte i
}

// Eight int32 partial sums of unsigned w x signed a (w <= 15 or |w| folded into a's sign: no saturation).
static inline __m256 dot_u8_i8(__m256i w, __m256i a) {
    const __m256i pairs = _mm256_maddubs_epi16(w, a);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

static inline float f16_to_f32(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  // subnormal: normalize
        exp = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

// a . b over n floats.
static inline float dot_f32(const float* a, const float* b, int64_t n) {
    int64_t i = 0;
    float sum = 0.f;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    sum = hsum(acc);
#endif
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

#ifdef __AVX2__
// Block b of a weight row as 32 unsigned bytes (|w| for Q8, whose signs go to the activations), and the signs.
static inline __attribute__((always_inline)) __m256i load_weight_block(int bits, const uint8_t* qs, int64_t b,
                                                                        __m256i* wsign) {
    if (bits == 4) return unpack_q4(qs + b * (QBLOCK / 2));
    *wsign = _mm256_loadu_si256((const __m256i*)(qs + b * QBLOCK));
    return _mm256_sign_epi8(*wsign, *wsign);
}

// acc + (w . a block) x scale, as eight partial sums.
static inline __attribute__((always_inline)) __m256 block_fma(int bits, __m256i w, __m256i wsign, const int8_t* a,
                                                               __m256 scale, __m256 acc) {
    __m256i av = _mm256_loadu_si256((const __m256i*)a);
    if (bits == 8) av = _mm256_sign_epi8(av, wsign);
    return _mm256_fmadd_ps(dot_u8_i8(w, av), scale, acc);
}

#define ROWS 4  // activation rows per tile: each weight block is loaded once for all of them

// out[0..3] = weight row . activation rows 0..3 (q: 4 rows K apart; dx: 4 rows nb apart).
static inline __attribute__((always_inline)) void dot_4rows(int bits, const uint8_t* qs, const float* d,
                                                             const int8_t* q, const float* dx, int64_t K,
                                                             float* out) {
    const int64_t nb = K / QBLOCK;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    __m256i wsign = _mm256_setzero_si256();
    for (int64_t b = 0; b < nb; b++) {
        const __m256i w = load_weight_block(bits, qs, b, &wsign);
        const __m256 wd = _mm256_set1_ps(d[b]);
        const int8_t* a = q + b * QBLOCK;
        acc0 = block_fma(bits, w, wsign, a, _mm256_mul_ps(wd, _mm256_set1_ps(dx[b])), acc0);
        acc1 = block_fma(bits, w, wsign, a + K, _mm256_mul_ps(wd, _mm256_set1_ps(dx[nb + b])), acc1);
        acc2 = block_fma(bits, w, wsign, a + 2 * K, _mm256_mul_ps(wd, _mm256_set1_ps(dx[2 * nb + b])), acc2);
        acc3 = block_fma(bits, w, wsign, a + 3 * K, _mm256_mul_ps(wd, _mm256_set1_ps(dx[3 * nb + b])), acc3);
    }
    out[0] = hsum(acc0);
    out[1] = hsum(acc1);
    out[2] = hsum(acc2);
    out[3] = hsum(acc3);
}

// Weight row . one activation row; two accumulators hide the FMA latency.
static inline __attribute__((always_inline)) float dot_1row(int bits, const uint8_t* qs, const float* d,
                                                             const int8_t* q, const float* dx, int64_t K) {
    const int64_t nb = K / QBLOCK;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    __m256i wsign = _mm256_setzero_si256();
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        const __m256i w0 = load_weight_block(bits, qs, b, &wsign);
        acc0 = block_fma(bits, w0, wsign, q + b * QBLOCK, _mm256_set1_ps(d[b] * dx[b]), acc0);
        const __m256i w1 = load_weight_block(bits, qs, b + 1, &wsign);
        acc1 = block_fma(bits, w1, wsign, q + (b + 1) * QBLOCK, _mm256_set1_ps(d[b + 1] * dx[b + 1]),
                         acc1);
    }
    if (b < nb) {
        const __m256i w = load_weight_block(bits, qs, b, &wsign);
        acc0 = block_fma(bits, w, wsign, q + b * QBLOCK, _mm256_set1_ps(d[b] * dx[b]), acc0);
    }
    return hsum(_mm256_add_ps(acc0, acc1));
}
#else
static inline float dot_1row(int bits, const uint8_t* qs, const float* d, const int8_t* q, const float* dx,
                             int64_t K) {
    float acc = 0.f;
    for (int64_t b = 0; b < K / QBLOCK; b++) {
        const int8_t* a = q + b * QBLOCK;
        int sum = 0;
        if (bits == 4) {
            const uint8_t* w = qs + b * (QBLOCK / 2);
            for (int i = 0; i < QBLOCK / 2; i++) sum += (w[i] & 15) * a[i] + (w[i] >> 4) * a[i + QBLOCK / 2];
        } else {
            const int8_t* w = (const int8_t*)qs + b * QBLOCK;
            for (int i = 0; i < QBLOCK; i++) sum += w[i] * a[i];
        }
        acc += (float)sum * d[b] * dx[b];
    }
    return acc;
}
#endif

// One weight row against activation rows [0, mr): out[m]. bits is a constant in each expansion.
static inline __attribute__((always_inline)) void dot_rows(int bits, const uint8_t* qs, const float* d,
                                                            const float* mn, const int8_t* q, const float* dx,
                                                            const float* sx, int64_t K, int64_t mr, float* out) {
    const int64_t nb = K / QBLOCK;
    int64_t m = 0;
#ifdef __AVX2__
    for (; m + ROWS <= mr; m += ROWS) dot_4rows(bits, qs, d, q + m * K, dx + m * nb, K, out + m);
#endif
    for (; m < mr; m++) out[m] = dot_1row(bits, qs, d, q + m * K, dx + m * nb, K);
    if (bits == 4)
        for (m = 0; m < mr; m++) out[m] += dot_f32(mn, sx + m * nb, nb);  // the blocks' minimums
}

#define TILE 64

// y [M, N] = x [M, K] @ W^T for a Q4 (bits 4: qs [N, K/2], d and mn fp16 [N, K/32]) or Q8 (bits 8: qs int8
// [N, K], d fp16 [N, K/32], mn unused) weight. K must be a multiple of 32. Returns 0, or -1 when out of memory.
int kvd_quantized_linear(int bits, const void* x, int x_bf16, int64_t M, int64_t K, const void* qs,
                         const uint16_t* d, const uint16_t* mn, int64_t N, void* y, int y_bf16, int nthreads) {
    const int64_t nb = K / QBLOCK;
    int8_t* q = malloc((size_t)(M * K));
    float* dx = malloc(sizeof(float) * (size_t)(M * nb));
    float* sx = malloc(sizeof(float) * (size_t)(M * nb));
    if (!q || !dx || !sx) {
        free(q);
        free(dx);
        free(sx);
        return -1;
    }
    quantize_rows(x, x_bf16, M, K, q, dx, sx);
    // Threads split the weight rows: each reads its own share of the weights once, for every activation row.
    const int64_t row_bytes = bits == 4 ? K / 2 : K;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t* wq = (const uint8_t*)qs + n * row_bytes;
        // The row's fp16 scales (and minimums) as float32, converted once for all activation rows.
        float wd[nb], wm[bits == 4 ? nb : 1];
        for (int64_t b = 0; b < nb; b++) wd[b] = f16_to_f32(d[n * nb + b]);
        if (bits == 4)
            for (int64_t b = 0; b < nb; b++) wm[b] = f16_to_f32(mn[n * nb + b]);
        // A tile of activation rows at a time, small enough for their results to stay on the stack.
        for (int64_t m0 = 0; m0 < M; m0 += TILE) {
            const int64_t mr = M - m0 < TILE ? M - m0 : TILE;
            float out[TILE];
            if (bits == 4)
                dot_rows(4, wq, wd, wm, q + m0 * K, dx + m0 * nb, sx + m0 * nb, K, mr, out);
            else
                dot_rows(8, wq, wd, wm, q + m0 * K, dx + m0 * nb, sx + m0 * nb, K, mr, out);
            for (int64_t m = 0; m < mr; m++) store_f(y, (m0 + m) * N + n, out[m], y_bf16);
        }
    }
    free(q);
    free(dx);
    free(sx);
    return 0;
}

// ---- paged decode attention --------------------------------------------------------------------------------

static float dot_f(const float* a, const void* b, int bf16, int64_t n) {
#ifdef __AVX2__
    if (n % 8 == 0) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i += 8) {
            __m256 bv;
            if (bf16) {
                const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)b + i));
                bv = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
            } else {
                bv = _mm256_loadu_ps((const float*)b + i);
            }
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), bv, acc);
        }
        return hsum(acc);
    }
#endif
    float s = 0.f;
    for (int64_t i = 0; i < n; i++) s += a[i] * load_f(b, i, bf16);
    return s;
}

// acc[i] += p * v[i]
static void axpy_f(float* acc, float p, const void* v, int bf16, int64_t n) {
    for (int64_t i = 0; i < n; i++) acc[i] += p * load_f(v, i, bf16);
}

// out [S, H, D] = softmax(q K^T * scale) V (q: sequence s at s x q_stride) for each sequence s over its context_lens[s] cached tokens, read
// from the pool [2, num_blocks, block_size, kv_heads, D] through block_tables [S, table_width]. Query heads
// h share kv head h / (H / kv_heads). q, out and the pool share one dtype. Returns -1 when out of memory.
int kvd_paged_decode_attention(const void* q, int64_t q_stride, void* out, const void* pool, int bf16, int64_t num_blocks,
                               int64_t block_size, int64_t kv_heads, int64_t D, int64_t S, int64_t H,
                               const int32_t* block_tables, int64_t table_width, const int32_t* context_lens,
                               float scale, int nthreads) {
    const int64_t group = H / kv_heads;
    const int64_t slot_stride = kv_heads * D;
    const int64_t v_offset = num_blocks * block_size * slot_stride;
    const int elem = bf16 ? 2 : 4;
    int failed = 0;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) collapse(2)
    for (int64_t s = 0; s < S; s++) {
        for (int64_t kvh = 0; kvh < kv_heads; kvh++) {
            const int64_t ctx = context_lens[s];
            float* work = malloc(sizeof(float) * (size_t)(group * (ctx + 2 * D)));
            if (!work) {
                failed = 1;
                continue;
            }
            float* scores = work;                 // [group, ctx]
            float* qf = work + group * ctx;       // [group, D]
            float* acc = qf + group * D;          // [group, D]
            for (int64_t g = 0; g < group; g++)
                for (int64_t i = 0; i < D; i++) qf[g * D + i] = load_f(q, s * q_stride + (kvh * group + g) * D + i, bf16);
            const int32_t* table = block_tables + s * table_width;
            for (int64_t t = 0; t < ctx; t++) {
                const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
                const char* k = (const char*)pool + (slot * slot_stride + kvh * D) * elem;
                for (int64_t g = 0; g < group; g++) scores[g * ctx + t] = dot_f(qf + g * D, k, bf16, D) * scale;
            }
            memset(acc, 0, sizeof(float) * (size_t)(group * D));
            for (int64_t g = 0; g < group; g++) {
                float* sc = scores + g * ctx;
                float mx = -INFINITY;
                for (int64_t t = 0; t < ctx; t++) mx = sc[t] > mx ? sc[t] : mx;
                float sum = 0.f;
                for (int64_t t = 0; t < ctx; t++) {
                    sc[t] = expf(sc[t] - mx);
                    sum += sc[t];
                }
                const float inv = 1.f / sum;
                for (int64_t t = 0; t < ctx; t++) {
                    const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
                    const char* v = (const char*)pool + (v_offset + slot * slot_stride + kvh * D) * elem;
                    axpy_f(acc + g * D, sc[t] * inv, v, bf16, D);
                }
                for (int64_t i = 0; i < D; i++) store_f(out, (s * H + kvh * group + g) * D + i, acc[g * D + i], bf16);
            }
            free(work);
        }
    }
    return failed ? -1 : 0;
}

// ---- residual add + RMSNorm ----------------------------------------------------------------------------------

// residual [M, H] += x; out = residual / rms(residual) * weight, in float32.
void kvd_add_rms_norm(const float* x, float* residual, const float* weight, float* out, int64_t M, int64_t H,
                      float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * H >= 65536)
    for (int64_t r = 0; r < M; r++) {
        float* res = residual + r * H;
        float ss = 0.f;
        for (int64_t i = 0; i < H; i++) {
            res[i] += x[r * H + i];
            ss += res[i] * res[i];
        }
        const float inv = 1.f / sqrtf(ss / (float)H + eps);
        for (int64_t i = 0; i < H; i++) out[r * H + i] = res[i] * inv * weight[i];
    }
}

// ---- K/V store and rotary embedding --------------------------------------------------------------------------

// The pool's K and V rows at slots[t] = k[t], v[t] (row = kv_heads x D values; token t at t x k_stride in k,
// t x v_stride in v); slot -1 is skipped.
void kvd_store_kv(const void* k, int64_t k_stride, const void* v, int64_t v_stride, void* pool, int bf16,
                  int64_t num_slots, int64_t row, const int64_t* slots, int64_t T) {
    const int elem = bf16 ? 2 : 4;
    const size_t bytes = (size_t)(row * elem);
    char* keys = pool;
    char* values = keys + num_slots * (int64_t)bytes;
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        memcpy(keys + slots[t] * (int64_t)bytes, (const char*)k + t * k_stride * elem, bytes);
        memcpy(values + slots[t] * (int64_t)bytes, (const char*)v + t * v_stride * elem, bytes);
    }
}

// Rotate x [T, heads, D] (token t at t x stride) in place by the rows of cos_sin [positions, 2 * D] (cos |
// signed sin, full width): x * cos + roll(x, D / 2) * sin, each product and the sum rounded in x's dtype as
// torch computes them.
void kvd_rotary(void* x, int64_t stride, int bf16, int64_t T, int64_t heads, int64_t D, const void* cos_sin,
                const int64_t* positions) {
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const int64_t row = positions[t] * 2 * D;
        for (int64_t h = 0; h < heads; h++) {
            const int64_t base = t * stride + h * D;
            float rotated[D];
            for (int64_t i = 0; i < D; i++) {
                const float c = load_f(cos_sin, row + i, bf16), s = load_f(cos_sin, row + D + i, bf16);
                float a = load_f(x, base + i, bf16) * c;
                float b = load_f(x, base + (i + half) % D, bf16) * s;
                if (bf16) {
                    a = bf16_to_f32(f32_to_bf16(a));
                    b = bf16_to_f32(f32_to_bf16(b));
                }
                rotated[i] = a + b;
            }
            for (int64_t i = 0; i < D; i++) store_f(x, base + i, rotated[i], bf16);
        }
    }
}
