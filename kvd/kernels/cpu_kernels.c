// kvd's native CPU kernels, compiled on the host at first use (native_build.py) with -march=native.
//
// - Linears, each output computed in one order whatever the number of rows (batch invariance): quantized weights
//   in GGUF's blocks of 32 along K, 4-bit (Q4_1's layout) or 8-bit (Q8_0's), against activations quantized per
//   block to int8 (exact integer block sums by SIMD, VNNI or AMX int8 tiles, then one float chain); float32
//   weights in panels of 16 outputs (one FMA chain each) or rows; bf16 weights in AMX tiles, AVX-512 BF16 pairs or rows.
//   Dequantization for the float GEMMs of prefill without batch invariance.
// - Attention over the paged KV pool in place, one query per row: no gather of K/V into a workspace; on AMX, scores
//   in tiles (a bf16 pool's every row, a prompt's rows in chunks of 16 over the 8-bit pool).
// - K/V store, rotary embedding, RMSNorm (with the residual add fused), SiLU-and-multiply, and a decode step
//   through every layer (the same kernels in the same order as the model's Python layer loop).
// Activations and the KV pool are float32 or bfloat16. Without AVX2 the
// same arithmetic runs in portable C. Threads: OpenMP (torch's own runtime once torch has loaded it), the count
// passed in by the caller. Indices into the KV pool and the rotary table are checked before anything is written
// (KVD_BAD_INDEX). The ABI is declared in cpu_kernels.h.

// syscall() (AMX permission) is a GNU extension under -std=c11.
#define _GNU_SOURCE
#include "cpu_kernels.h"

#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// The SIMD paths use AVX2 integer ops and FMA together; a CPU (or build) with one but not the other runs the
// portable C. F16C has its own guard.
#if defined(__AVX2__) && defined(__FMA__)
#define KVD_AVX2 1
#else
#define KVD_AVX2 0
#endif
#if KVD_AVX2 || defined(__F16C__)
#include <immintrin.h>
#endif
// AVX-512 paths of attention: 16-lane value sums (float32 and bf16) and bf16 dot products for the scores.
#if KVD_AVX2 && defined(__AVX512F__)
#define KVD_AVX512 1
#else
#define KVD_AVX512 0
#endif
#if KVD_AVX512 && defined(__AVX512BF16__)
#define KVD_AVX512_BF16 1
#else
#define KVD_AVX512_BF16 0
#endif

#define QBLOCK 32

// A KV pool's element kind where the attention reads it: 0 float32, 1 bf16 (the model's dtype), or KV_INT8:
// 8-bit rows (kvd_paged_attention). Values that pass it as `bf16` read 8-bit codes as signed integers.
#define KV_INT8 2
static inline int kv_elem(int kind) { return kind == KV_INT8 ? 1 : kind ? 2 : 4; }

#if KVD_AVX2 && (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)))
#define KVD_ISA_VNNI "+vnni"
#else
#define KVD_ISA_VNNI ""
#endif
#if KVD_AVX2 && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
#define KVD_ISA_AMX "+amx-int8"
#else
#define KVD_ISA_AMX ""
#endif
#if KVD_AVX2 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define KVD_ISA_AMX_BF16 "+amx-bf16"
#else
#define KVD_ISA_AMX_BF16 ""
#endif
#if KVD_AVX512_BF16
#define KVD_ISA_AVX512 "+avx512-bf16"
#elif KVD_AVX512
#define KVD_ISA_AVX512 "+avx512"
#else
#define KVD_ISA_AVX512 ""
#endif
#define KVD_ISA_NO_AMX (KVD_AVX2 ? "avx2+fma" KVD_ISA_AVX512 KVD_ISA_VNNI : "portable")
#define KVD_ISA (KVD_AVX2 ? "avx2+fma" KVD_ISA_AVX512 KVD_ISA_VNNI KVD_ISA_AMX KVD_ISA_AMX_BF16 : "portable")

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

#if KVD_AVX2
// v rounded to bf16 as f32_to_bf16 rounds each lane, left in the high 16 bits (the low 16 zero).
static inline __m256i bf16_bits8(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000));  // NaN stays NaN
    return _mm256_and_si256(_mm256_blendv_epi8(rounded, quiet, nan), _mm256_set1_epi32((int)0xffff0000));
}

// The eight bf16 of v (rounded as above) at dst.
static inline void store_bf16x8(void* dst, __m256 v) {
    const __m256i p = _mm256_srli_epi32(bf16_bits8(v), 16);
    _mm_storeu_si128((__m128i*)dst, _mm_packus_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1)));
}

// Eight float32, bf16 or (KV_INT8) signed 8-bit values at p, as float32.
static inline __m256 load8(const char* p, int bf16) {
    if (bf16 == KV_INT8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
    if (bf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
    return _mm256_loadu_ps((const float*)p);
}
#endif

#if KVD_AVX512
// Each lane of v rounded to bf16 as f32_to_bf16 rounds it, as float32 bits (the low half zero).
static inline __m512i bf16_bits16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i out = _mm512_mask_or_epi32(rounded, nan, bits, _mm512_set1_epi32(0x00400000));  // NaN stays NaN
    return _mm512_and_si512(out, _mm512_set1_epi32((int)0xffff0000));
}

// The sixteen bf16 of v (rounded as above) at dst.
static inline void store_bf16x16(void* dst, __m512 v) {
    _mm256_storeu_si256((__m256i*)dst, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits16(v), 16)));
}

// Lane j = j x slot_bytes: the byte offsets of 16 consecutive slots' rows, for gathers of their scales.
static inline __m512i slot_offsets16(int64_t slot_bytes) {
    return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                              _mm512_set1_epi32((int)slot_bytes));
}

// load8's sixteen.
static inline __m512 load16(const char* p, int bf16) {
    if (bf16 == KV_INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
    if (bf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
    return _mm512_loadu_ps((const float*)p);
}
#endif

static inline float load_f(const void* base, int64_t i, int bf16) {
    if (bf16 == KV_INT8) return (float)((const int8_t*)base)[i];
    return bf16 ? bf16_to_f32(((const uint16_t*)base)[i]) : ((const float*)base)[i];
}

static inline void store_f(void* base, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t*)base)[i] = f32_to_bf16(v);
    else
        ((float*)base)[i] = v;
}

// ---- activation quantization ------------------------------------------------------------------------------

// x [M, K] -> q int8 [M, K], dx [M, K/32] (the block's scale) and sx [M, K/32] (scale x the sum of its codes).
static void quantize_rows(const void* x, int x_bf16, int64_t M, int64_t K, int8_t* q, float* dx, float* sx,
                          int nthreads) {
    const int64_t nb = K / QBLOCK;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M > 1)
    for (int64_t r = 0; r < M; r++) {
        for (int64_t b = 0; b < nb; b++) {
            int8_t* out = q + r * K + b * QBLOCK;
            float d;
            int sum = 0;
#if KVD_AVX512
            // The AVX2 steps 16 lanes at a time: the largest magnitude passes over NaN lanes as there (each max
            // keeps its second operand when the first is NaN), the codes' low bytes are kept (vpmovdb), and the
            // integer sum wraps as any order of int32 adds does.
            const char* p = (const char*)x + (r * K + b * QBLOCK) * (x_bf16 ? 2 : 4);
            const __m512 sign = _mm512_set1_ps(-0.f);
            const __m512 v0 = load16(p, x_bf16), v1 = load16(p + 16 * (x_bf16 ? 2 : 4), x_bf16);
            const __m512 amax = _mm512_max_ps(_mm512_andnot_ps(sign, v1),
                                              _mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_setzero_ps()));
            d = _mm512_reduce_max_ps(amax) / 127.f;
            const __m512 inv = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
            const __m512i c0 = _mm512_cvtps_epi32(
                _mm512_roundscale_ps(_mm512_mul_ps(v0, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            const __m512i c1 = _mm512_cvtps_epi32(
                _mm512_roundscale_ps(_mm512_mul_ps(v1, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            _mm_storeu_si128((__m128i*)out, _mm512_cvtepi32_epi8(c0));
            _mm_storeu_si128((__m128i*)(out + 16), _mm512_cvtepi32_epi8(c1));
            sum = _mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
#elif KVD_AVX2
            // The same values as the loop below: a maximum is one whatever the order (and max_ps, like the
            // comparison there, passes over NaN), and the rounding is the same nearest-even.
            const char* p = (const char*)x + (r * K + b * QBLOCK) * (x_bf16 ? 2 : 4);
            __m256 v[QBLOCK / 8], amax8 = _mm256_setzero_ps();
            for (int i = 0; i < QBLOCK / 8; i++) {
                v[i] = load8(p + i * 8 * (x_bf16 ? 2 : 4), x_bf16);
                amax8 = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), v[i]), amax8);
            }
            amax8 = _mm256_max_ps(amax8, _mm256_permute2f128_ps(amax8, amax8, 1));
            amax8 = _mm256_max_ps(amax8, _mm256_permute_ps(amax8, 0x4e));
            amax8 = _mm256_max_ps(amax8, _mm256_permute_ps(amax8, 0xb1));
            d = _mm256_cvtss_f32(amax8) / 127.f;
            const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
            __m256i sum8 = _mm256_setzero_si256();
            for (int i = 0; i < QBLOCK / 8; i++) {
                const __m256i c = _mm256_cvtps_epi32(
                    _mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                sum8 = _mm256_add_epi32(sum8, c);
                // Each code's low byte, as the (int8_t) conversion below keeps it.
                const __m256i bytes = _mm256_shuffle_epi8(c, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                              -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1,
                                                                              -1, -1, -1, -1, -1, -1, -1, -1, -1));
                const int32_t lo = _mm256_extract_epi32(bytes, 0), hi = _mm256_extract_epi32(bytes, 4);
                memcpy(out + i * 8, &lo, 4);
                memcpy(out + i * 8 + 4, &hi, 4);
            }
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
            sum = _mm_cvtsi128_si32(s4);
#else
            float v[QBLOCK];
            float amax = 0.f;
            for (int i = 0; i < QBLOCK; i++) {
                v[i] = load_f(x, r * K + b * QBLOCK + i, x_bf16);
                float a = fabsf(v[i]);
                amax = a > amax ? a : amax;
            }
            d = amax / 127.f;
            const float inv = d > 0.f ? 1.f / d : 0.f;
            for (int i = 0; i < QBLOCK; i++) {
                int c = (int)nearbyintf(v[i] * inv);
                out[i] = (int8_t)c;
                sum += c;
            }
#endif
            dx[r * nb + b] = d;
            sx[r * nb + b] = d * (float)sum;
        }
    }
}

// ---- block dot products: 32 weights x 32 int8 activations -> int32 sum -------------------------------------

#if KVD_AVX2
static inline __m256i unpack_q4(const uint8_t* qs) {
    const __m128i bytes = _mm_loadu_si128((const __m128i*)qs);
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(bytes, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    return _mm256_set_m128i(hi, lo);  // element i of the block in byte i
}

// acc + eight int32 sums of unsigned w x signed a, lane l = products 4l .. 4l + 3 (w <= 15, or |w| with w's signs
// moved to a: no saturation, so the sums are exact). VNNI's dot product gives the same integers in one instruction.
static inline __m256i dot_u8_i8(__m256i acc, __m256i w, __m256i a) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, w, a);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, w, a);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1)));
#endif
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
#if KVD_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    sum = hsum(acc);
#endif
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

#define TILE 64

// Float32 weight rows against activation rows [0, mr) (float32, K apart): out[m]. Four rows share each load of
// the weight; every row, in a group of four or alone, sums in one order (two accumulators, 16 values a step),
// so its result does not depend on how many rows share the call.
static void float_dot_rows(const float* w, const float* x, int64_t K, int64_t mr, float* out) {
    int64_t m = 0;
#if KVD_AVX2
    if (K % 16 == 0) {
        for (; m + 4 <= mr; m += 4) {
            const float* a = x + m * K;
            __m256 acc[8];
            for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
            for (int64_t i = 0; i < K; i += 16) {
                const __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
                for (int r = 0; r < 4; r++) {
                    acc[2 * r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(a + r * K + i), acc[2 * r]);
                    acc[2 * r + 1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(a + r * K + i + 8), acc[2 * r + 1]);
                }
            }
            for (int r = 0; r < 4; r++) out[m + r] = hsum(_mm256_add_ps(acc[2 * r], acc[2 * r + 1]));
        }
        for (; m < mr; m++) {
            const float* a = x + m * K;
            __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
            for (int64_t i = 0; i < K; i += 16) {
                acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(a + i), acc0);
                acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(a + i + 8), acc1);
            }
            out[m] = hsum(_mm256_add_ps(acc0, acc1));
        }
    }
#endif
    for (; m < mr; m++) out[m] = dot_f32(w, x + m * K, K);
}

// y [M, n] = x [M, k] @ W^T (+ bias) for a float32 or bf16 weight, x float32 (a bf16 x is widened first):
// every product and sum in float32, each output in one order whatever M is. Returns 1 when out of memory.
static int float_linear(const kvd_weight* w, const void* x, int x_bf16, int64_t M, void* y, int y_bf16,
                        int nthreads) {
    const int64_t K = w->k, N = w->n;
    float* wide = NULL;
    if (x_bf16) {
        wide = malloc(sizeof(float) * (size_t)(M * K));
        if (!wide) return 1;
        for (int64_t i = 0; i < M * K; i++) wide[i] = bf16_to_f32(((const uint16_t*)x)[i]);
    }
    const float* xf = x_bf16 ? wide : x;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        // A bf16 weight row is widened once for all activation rows.
        float* row = w->bits == 16 ? malloc(sizeof(float) * (size_t)K) : NULL;
        failed |= w->bits == 16 && !row;
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const float* wr = (const float*)w->qs + n * K;
            if (w->bits == 16) {
                if (!row) continue;
                for (int64_t i = 0; i < K; i++) row[i] = bf16_to_f32(((const uint16_t*)w->qs)[n * K + i]);
                wr = row;
            }
            const float bias = w->bias ? w->bias[n] : 0.f;
            for (int64_t m0 = 0; m0 < M; m0 += TILE) {
                const int64_t mr = M - m0 < TILE ? M - m0 : TILE;
                float out[TILE];
                float_dot_rows(wr, xf + m0 * K, K, mr, out);
                for (int64_t m = 0; m < mr; m++) store_f(y, (m0 + m) * N + n, out[m] + bias, y_bf16);
            }
        }
        free(row);
    }
    free(wide);
    return failed;
}

#if KVD_AVX512
// y[m, n .. n + 15] = v + bias (+ 0 without one, as store_output adds it: -0 becomes +0 in every path).
static inline void store_outputs16(const kvd_weight* w, int64_t m, int64_t n, __m512 v, void* y, int y_bf16) {
    v = _mm512_add_ps(v, w->bias ? _mm512_loadu_ps(w->bias + n) : _mm512_setzero_ps());
    if (y_bf16)
        store_bf16x16((uint16_t*)y + m * w->n + n, v);
    else
        _mm512_storeu_ps((float*)y + m * w->n + n, v);
}
#endif
#if KVD_AVX512_BF16
static inline __m512bh load_bh(const void* p) { return (__m512bh)_mm512_loadu_si512(p); }
#endif

// ---- AMX tiles --------------------------------------------------------------------------------------------

#if KVD_AVX2 && defined(__AMX_TILE__) && defined(__AVX512F__)
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ROWS 16  // rows of a tile: weight rows, activation rows, output rows

// Linux lends the tile registers to a process that asks once (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
static int amx_permitted(void) {
    static int state;  // 0 unknown, 1 yes, -1 no
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    return state > 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

#endif

// ---- quantized linears: exact block sums, then one float order ------------------------------------------------
//
// For activation row m and output n: acc = 0; for each block b in order, acc = fma(isum, d[n,b] x dx[m,b], acc)
// and, for 4-bit weights, acc = fma(mn[n,b], sx[m,b], acc); y = acc + bias. isum, the block's sum of code x
// activation products, is an exact integer however it is computed (integer SIMD, VNNI, AMX tiles), and the float
// steps are the same in every path: each output is the same whatever the row count, the path taken or the CPU
// (batch invariance). Small batches run weight rows eight at a time, one float lane each; from VNNI_MIN_ROWS on a
// CPU with AVX-512 VNNI, VNNI outer products; 8-bit weights from AMX_MIN_ROWS rows on a CPU with AMX, tiles of 16
// weight rows x 16 activation rows.

typedef struct {
    const int8_t* q;  // [M, K] int8 codes (then zero rows up to a whole AMX tile)
    const float* dx;  // [M, nb] block scales
    const float* sx;  // [M, nb] dx x the block's sum of codes
    int64_t M;
} quantized_rows;

#define NR 8  // weight rows per group: of the block layout (kvd_weight) and of the SIMD path

static inline int64_t block_bytes(const kvd_weight* w) { return w->bits == 4 ? QBLOCK / 2 : QBLOCK; }

// Bytes from one row's block b to the next row's in a group: a pair of blocks, or the odd last block alone.
static inline int64_t row_stride(const kvd_weight* w, int64_t b) {
    return ((b | 1) < w->k / QBLOCK ? 2 : 1) * block_bytes(w);
}

// Where block b of weight row n lies in the group layout (see kvd_weight).
static inline const uint8_t* block_at(const kvd_weight* w, int64_t n, int64_t b) {
    const int64_t bb = block_bytes(w), nb = w->k / QBLOCK;
    return (const uint8_t*)w->qs + (n / NR) * NR * nb * bb + (b & ~(int64_t)1) * NR * bb + (n % NR) * row_stride(w, b) +
           (b & 1) * bb;
}

// The index of row n's block b in the scales (and minimums) [groups][nb][8].
static inline int64_t scale_at(const kvd_weight* w, int64_t n, int64_t b) {
    return ((n / NR) * (w->k / QBLOCK) + b) * NR + n % NR;
}

static inline void store_output(const kvd_weight* w, int64_t n, int64_t m, float acc, void* y, int y_bf16) {
    store_f(y, m * w->n + n, acc + (w->bias ? w->bias[n] : 0.f), y_bf16);
}

#if !KVD_AVX2
// The exact sum of one weight block's codes (bytes at p) times one activation block (plain C).
static inline int32_t block_isum(int bits, const uint8_t* p, const int8_t* a) {
    int32_t sum = 0;
    if (bits == 4) {
        for (int i = 0; i < QBLOCK / 2; i++) sum += (p[i] & 15) * a[i] + (p[i] >> 4) * a[i + QBLOCK / 2];
    } else {
        for (int i = 0; i < QBLOCK; i++) sum += ((const int8_t*)p)[i] * a[i];
    }
    return sum;
}

// Output n for activation row m, one block at a time (plain C).
static float row_dot(const kvd_weight* w, int64_t n, const quantized_rows* x, int64_t m) {
    const int64_t K = w->k, nb = K / QBLOCK;
    const float* dx = x->dx + m * nb;
    const float* sx = x->sx + m * nb;
    float acc = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        const float scale = f16_to_f32(w->d[scale_at(w, n, b)]) * dx[b];
        acc = fmaf((float)block_isum(w->bits, block_at(w, n, b), x->q + m * K + b * QBLOCK), scale, acc);
        if (w->bits == 4) acc = fmaf(f16_to_f32(w->mn[scale_at(w, n, b)]), sx[b], acc);
    }
    return acc;
}
#endif

#if KVD_AVX2
// The eight int32 lane sums of one weight block (bytes at p) against the activation block a.
static inline __attribute__((always_inline)) __m256i block_lanes(int bits, const uint8_t* p, __m256i a) {
    if (bits == 4) return dot_u8_i8(_mm256_setzero_si256(), unpack_q4(p), a);
    const __m256i w = _mm256_loadu_si256((const __m256i*)p);
    return dot_u8_i8(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
}

// One row's pair of 4-bit blocks (32 bytes at p) against a_lo (codes 0-15 of both activation blocks) and a_hi
// (codes 16-31): lanes 0-3 sum the first block, lanes 4-7 the second. No lane crossing, unlike unpack_q4.
static inline __attribute__((always_inline)) __m256i pair_lanes(const uint8_t* p, __m256i a_lo, __m256i a_hi) {
    const __m256i w = _mm256_loadu_si256((const __m256i*)p), low = _mm256_set1_epi8(0x0f);
    const __m256i lo = _mm256_and_si256(w, low), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
    return dot_u8_i8(dot_u8_i8(_mm256_setzero_si256(), lo, a_lo), hi, a_hi);
}

// Lane j of *first = the sum of v[j]'s lanes 0-3, of *second = the sum of its lanes 4-7 (exact integers).
static inline void hsum8x8_halves(const __m256i* v, __m256i* first, __m256i* second) {
    const __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i cd = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    *first = _mm256_permute2x128_si256(ab, cd, 0x20);
    *second = _mm256_permute2x128_si256(ab, cd, 0x31);
}

static inline __m256 load_f16x8(const uint16_t* p) {
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
    float v[8];
    for (int i = 0; i < 8; i++) v[i] = f16_to_f32(p[i]);
    return _mm256_loadu_ps(v);
#endif
}

// The float steps of block b for the group's eight outputs (the group's scales from d, mn) and the activation
// row whose block b is block i of x.
static inline __attribute__((always_inline)) __m256 block_step(int bits, __m256 acc, __m256i isum, const uint16_t* d,
                                                              const uint16_t* mn, int64_t b, const quantized_rows* x,
                                                              int64_t i) {
    const __m256 scale = _mm256_mul_ps(load_f16x8(d + b * NR), _mm256_set1_ps(x->dx[i]));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc);
    return bits == 4 ? _mm256_fmadd_ps(load_f16x8(mn + b * NR), _mm256_set1_ps(x->sx[i]), acc) : acc;
}

// Bytes ahead of the 4-bit pass that it prefetches (the next groups; a thread's groups are consecutive): the
// hardware prefetcher alone left 2 cores at 9-10 of their 14-15 GB/s on a decode step's weights (Xeon). The
// 8-bit pass gained nothing from it (int8 logits, 2.8-2.9 ms either way).
#define WEIGHT_AHEAD 4096

// Outputs n0 .. n0 + rows - 1 (one group) for every activation row: the group's blocks read in one stream, a
// pair of 4-bit blocks per load.
static inline __attribute__((always_inline)) void group_rows(int bits, const kvd_weight* w, int64_t n0, int64_t rows,
                                                            const quantized_rows* x, void* y, int y_bf16) {
    const int64_t K = w->k, nb = K / QBLOCK, pairs = bits == 4 ? nb / 2 : 0;
    const uint16_t* d = w->d + scale_at(w, n0, 0);
    const uint16_t* mn = bits == 4 ? w->mn + scale_at(w, n0, 0) : NULL;
    for (int64_t m = 0; m < x->M; m++) {
        const int8_t* a = x->q + m * K;
        __m256 acc = _mm256_setzero_ps();
        __m256i lanes[NR], first, second;
        for (int64_t b = 0; b < 2 * pairs; b += 2) {
            const __m256i a0 = _mm256_loadu_si256((const __m256i*)(a + b * QBLOCK));
            const __m256i a1 = _mm256_loadu_si256((const __m256i*)(a + b * QBLOCK + QBLOCK));
            const __m256i a_lo = _mm256_permute2x128_si256(a0, a1, 0x20), a_hi = _mm256_permute2x128_si256(a0, a1, 0x31);
            const uint8_t* p = block_at(w, n0, b);
            for (int i = 0; i < 4; i++) _mm_prefetch((const char*)p + WEIGHT_AHEAD + 64 * i, _MM_HINT_T0);
            for (int j = 0; j < NR; j++) lanes[j] = pair_lanes(p + j * QBLOCK, a_lo, a_hi);
            hsum8x8_halves(lanes, &first, &second);
            acc = block_step(bits, acc, first, d, mn, b, x, m * nb + b);
            acc = block_step(bits, acc, second, d, mn, b + 1, x, m * nb + b + 1);
        }
        for (int64_t b = 2 * pairs; b < nb; b++) {  // 8-bit blocks, and an odd last 4-bit one
            const __m256i av = _mm256_loadu_si256((const __m256i*)(a + b * QBLOCK));
            const uint8_t* p = block_at(w, n0, b);
            const int64_t stride = row_stride(w, b);
            for (int j = 0; j < NR; j++) lanes[j] = block_lanes(bits, p + j * stride, av);
            hsum8x8_halves(lanes, &first, &second);
            acc = block_step(bits, acc, _mm256_add_epi32(first, second), d, mn, b, x, m * nb + b);
        }
        float out[NR];
        _mm256_storeu_ps(out, acc);
        for (int j = 0; j < rows; j++) store_output(w, n0 + j, m, out[j], y, y_bf16);
    }
}
#endif

// Outputs [first, n) for every activation row (first a multiple of NR), a group of NR weight rows at a time.
static void simd_rows(const kvd_weight* w, int64_t first, const quantized_rows* x, void* y, int y_bf16,
                      int nthreads) {
    const int64_t groups = (w->n - first + NR - 1) / NR;
    if (groups <= 0) return;  // no parallel region to fork and join for nothing (the usual case after the tiles)
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t n0 = first + g * NR, rows = w->n - n0 < NR ? w->n - n0 : NR;
#if KVD_AVX2
        if (w->bits == 4)
            group_rows(4, w, n0, rows, x, y, y_bf16);
        else
            group_rows(8, w, n0, rows, x, y, y_bf16);
#else
        for (int64_t m = 0; m < x->M; m++)
            for (int64_t j = 0; j < rows; j++) store_output(w, n0 + j, m, row_dot(w, n0 + j, x, m), y, y_bf16);
#endif
    }
}

#if KVD_AVX512 && (defined(__AVX512VNNI__) || (defined(__AMX_TILE__) && defined(__AMX_INT8__)))
// ---- quantized weights unpacked 16 rows at a time (AMX tiles, AVX-512 VNNI) ------------------------------------

#define OUT16 16  // outputs of an unpacked weight block: an AMX B tile's, a zmm's int32 lanes

// Dwords 0-3 of block b of one group's 8 rows of 4-bit codes, row j's dword r at lane 4 j + r (rows 0-3 in *lo,
// 4-7 in *hi): rows of a block pair lie 32 bytes apart, their blocks side by side, an odd last block 16 apart.
static inline void group_block_dwords(const kvd_weight* w, int64_t n, int64_t b, __m512i* lo, __m512i* hi) {
    const uint8_t* p = block_at(w, n, b);
    if (row_stride(w, b) == QBLOCK / 2) {
        *lo = _mm512_loadu_si512(p), *hi = _mm512_loadu_si512(p + 64);
        return;
    }
    p -= (b & 1) * (QBLOCK / 2);
    // Lane 4 j + r from load j / 2 (a pair of rows) at dword 8 (j % 2) + 4 (b % 2) + r.
    const __m512i at = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27),
                                        _mm512_set1_epi32(4 * (int)(b & 1)));
    *lo = _mm512_permutex2var_epi32(_mm512_loadu_si512(p), at, _mm512_loadu_si512(p + 64));
    *hi = _mm512_permutex2var_epi32(_mm512_loadu_si512(p + 128), at, _mm512_loadu_si512(p + 192));
}

// Bytes ahead of the unpack that each of its two groups' streams asks for while it unpacks, when the linear has
// few activation rows (past the weight's end a prefetch is a no-op, never a fault). With few rows the products
// between unpacks are short, so the burst for the next pair (prefetch_rows16) arrives late; on Zen 4 8 KiB ahead
// made the 8-bit output projection 1.10-1.16x faster at 4 and 16 rows and the 16 and 64-request workloads 1.05x
// and 1.07x; streaming at every row count, the 64-request workload was 0.98x.
#define UNPACK_AHEAD 8192
#define UNPACK_STREAM_ROWS 32  // activation rows up to which the unpack streams ahead

// Weight rows n0 .. n0 + 15 unpacked to out [nb][8][16][4] (code k of output j at (k / 4) x 64 + 4 j + k % 4: AMX
// B tiles, and for VNNI one zmm per 4 codes of the 16 outputs): unsigned 4-bit codes (byte i of a 4-bit block holds
// code i in its low nibble, code i + 16 in its high one) or 8-bit ones, signed, or xor flip8 (0x80: shifted to
// unsigned, for VNNI). Their scales (and 4-bit minimums) as float32 wd, wm [nb][stride], outputs side by side.
static inline __attribute__((always_inline)) void unpack_rows16(const kvd_weight* w, int64_t n0, int8_t* out,
                                                                float* wd, float* wm, int64_t stride, char flip8,
                                                                int stream) {
    const int64_t nb = w->k / QBLOCK;
    const __m512i low = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8(flip8);
    // Lane 8 h + j: row j's dword h from rows 0-3 (lane 4 j + h of lo) or 4-7 (of hi).
    const __m512i pair_rows = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
    for (int64_t b = 0; b < nb; b++) {
        if (stream && b % 2 == 0)  // the groups' next block pairs (one pair of blocks: 8 rows x 2 blocks)
            for (int g = 0; g < 2; g++) {
                const char* ahead = (const char*)block_at(w, n0 + g * NR, b) + UNPACK_AHEAD;
                for (int64_t i = 0; i < NR * 2 * block_bytes(w); i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
            }
        __m512i* dst = (__m512i*)(out + b * OUT16 * QBLOCK);
        if (w->bits == 4) {
            // Dword r of the 16 rows (lane j: row j) by two transposes of the groups' 8 x 4 dwords, not gathers.
            __m512i lo[2], hi[2], pairs[2][2];
            for (int g = 0; g < 2; g++) {
                group_block_dwords(w, n0 + g * NR, b, &lo[g], &hi[g]);
                for (int h = 0; h < 2; h++)  // lanes 0-7: dword 2 h of rows 0-7, lanes 8-15: dword 2 h + 1
                    pairs[g][h] = _mm512_permutex2var_epi32(lo[g], _mm512_add_epi32(pair_rows, _mm512_set1_epi32(2 * h)), hi[g]);
            }
            for (int r = 0; r < 4; r++) {
                const __m512i v = r % 2 ? _mm512_shuffle_i64x2(pairs[0][r / 2], pairs[1][r / 2], 0xee)
                                        : _mm512_shuffle_i64x2(pairs[0][r / 2], pairs[1][r / 2], 0x44);
                _mm512_storeu_si512(dst + r, _mm512_and_si512(v, low));
                _mm512_storeu_si512(dst + r + 4, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
            }
        } else {
            // Four dwords of rows 4 l + r in 128-bit lane l of p[r], then a 4 x 4 transpose in every lane: lane l of
            // dword d's vector holds rows 4 l .. 4 l + 3 (gathers were slower).
            const uint8_t* rows[OUT16];
            for (int j = 0; j < OUT16; j++) rows[j] = block_at(w, n0 + j, b);
            for (int q = 0; q < 2; q++) {
                __m512i p[4];
                for (int r = 0; r < 4; r++) {
                    p[r] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(rows[r] + 16 * q)));
                    for (int l = 1; l < 4; l++)
                        p[r] = _mm512_inserti32x4(p[r], _mm_loadu_si128((const __m128i*)(rows[4 * l + r] + 16 * q)), l);
                }
                const __m512i t0 = _mm512_unpacklo_epi32(p[0], p[1]), t1 = _mm512_unpackhi_epi32(p[0], p[1]);
                const __m512i t2 = _mm512_unpacklo_epi32(p[2], p[3]), t3 = _mm512_unpackhi_epi32(p[2], p[3]);
                _mm512_storeu_si512(dst + 4 * q, _mm512_xor_si512(_mm512_unpacklo_epi64(t0, t2), flip));
                _mm512_storeu_si512(dst + 4 * q + 1, _mm512_xor_si512(_mm512_unpackhi_epi64(t0, t2), flip));
                _mm512_storeu_si512(dst + 4 * q + 2, _mm512_xor_si512(_mm512_unpacklo_epi64(t1, t3), flip));
                _mm512_storeu_si512(dst + 4 * q + 3, _mm512_xor_si512(_mm512_unpackhi_epi64(t1, t3), flip));
            }
        }
        // A group's eight scales of a block lie side by side: two groups, two conversions.
        for (int g = 0; g < 2; g++) {
            const int64_t at = scale_at(w, n0 + g * NR, b);
            _mm256_storeu_ps(wd + b * stride + g * NR, load_f16x8(w->d + at));
            _mm256_storeu_ps(wm + b * stride + g * NR, w->bits == 4 ? load_f16x8(w->mn + at) : _mm256_setzero_ps());
        }
    }
}

// Weight rows n0 .. n0 + 15 (two whole groups, their scales and minimums) on their way to the cache: the loads of
// unpack_rows16 would otherwise wait on memory one block after another.
static void prefetch_rows16(const kvd_weight* w, int64_t n0) {
    const int64_t nb = w->k / QBLOCK, group_bytes = NR * nb * block_bytes(w), scale_bytes = 2 * NR * nb * 2;
    const char* codes = (const char*)block_at(w, n0, 0);
    for (int64_t i = 0; i < 2 * group_bytes; i += 64) _mm_prefetch(codes + i, _MM_HINT_T0);
    for (int64_t i = 0; i < scale_bytes; i += 64) {
        _mm_prefetch((const char*)(w->d + scale_at(w, n0, 0)) + i, _MM_HINT_T0);
        if (w->bits == 4) _mm_prefetch((const char*)(w->mn + scale_at(w, n0, 0)) + i, _MM_HINT_T0);
    }
}

// A work item's pair of weight groups (n0 .. n0 + ng x 16) unpacked into wt [ng][nb][8][16][4] (8-bit codes xor
// flip8), their scales wd and minimums wm [nb][32]; then the thread's next pair prefetched (with a static
// schedule, its next item, whose unpack follows this item's products). Inlined into each caller, so that flip8
// is a constant there: inlined, 8-bit VNNI linears at 4 rows run 12-23 % faster than when it was shared (Xeon).
static inline __attribute__((always_inline)) void unpack_pair(const kvd_weight* w, int64_t n0, int ng, int64_t groups,
                                                              int8_t* wt, float* wd, float* wm, char flip8,
                                                              int stream) {
    const int64_t nb = w->k / QBLOCK;
    for (int j = 0; j < ng; j++)
        unpack_rows16(w, n0 + j * OUT16, wt + j * nb * OUT16 * QBLOCK, wd + j * OUT16, wm + j * OUT16, 2 * OUT16,
                      flip8, stream);
    for (int64_t n = n0 + 2 * OUT16; n < n0 + 4 * OUT16 && n + OUT16 <= groups * OUT16; n += OUT16) prefetch_rows16(w, n);
}

#endif

// ---- quantized linears by AVX-512 VNNI outer products (4-bit weights, 8-bit ones below AMX_MIN_ROWS) ----------
//
// For several activation rows, each work item unpacks 32 weight rows once (unpack_rows16) and multiplies them by
// every row of its chunk: VPDPBUSD adds 4 code products into each output's int32 lane, so a block's 8 of them
// give the same exact integer sums as the other paths, then the same float steps in the same order.

#if KVD_AVX512 && defined(__AVX512VNNI__)
#define KVD_VNNI512 1

#define VNNI_MIN_ROWS 3  // from here, unpacking once per item beats eight weight rows at a time (2 cores)
#define VNNI_ROWS 4      // activation rows a pass: 8 int32 sums and 8 float32 ones in registers
#define VNNI_CHUNK 64    // activation rows a work item: its unpacked weights serve all of them

// Activation rows m .. m + rows x the item's ng unpacked groups (outputs n0 ..): every block's integer sums, then
// fma(isum, d x dx, acc) (and the 4-bit minimum term) block by block, as block_step and amx_scale do. VPDPBUSD
// multiplies unsigned by signed bytes: 4-bit codes are unsigned; 8-bit ones go in shifted (w + 128, the sign bit
// flipped), so each block's sum starts from base = -128 x the sum of the activation row's codes in the block.
static inline __attribute__((always_inline)) void vnni_pass(int bits, int rows, int ng, const kvd_weight* w,
                                                           const quantized_rows* x, int64_t m, int64_t n0,
                                                           const int8_t* wt, const float* wd, const float* wm,
                                                           const int32_t* base, void* y, int y_bf16) {
    const int64_t K = w->k, nb = K / QBLOCK;
    __m512 acc[VNNI_ROWS][2];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < ng; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i isum[VNNI_ROWS][2];
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < ng; j++)
                isum[r][j] = bits == 4 ? _mm512_setzero_si512() : _mm512_set1_epi32(base[(m + r) * nb + b]);
        for (int qd = 0; qd < QBLOCK / 4; qd++) {
            __m512i wv[2];
            for (int j = 0; j < ng; j++) wv[j] = _mm512_loadu_si512(wt + ((j * nb + b) * 8 + qd) * 64);
            for (int r = 0; r < rows; r++) {
                int32_t codes;
                memcpy(&codes, x->q + (m + r) * K + b * QBLOCK + 4 * qd, 4);
                const __m512i xb = _mm512_set1_epi32(codes);
                for (int j = 0; j < ng; j++) isum[r][j] = _mm512_dpbusd_epi32(isum[r][j], wv[j], xb);
            }
        }
        for (int j = 0; j < ng; j++) {
            const __m512 d = _mm512_loadu_ps(wd + b * 2 * OUT16 + j * OUT16);
            const __m512 mn = _mm512_loadu_ps(wm + b * 2 * OUT16 + j * OUT16);
            for (int r = 0; r < rows; r++) {
                const int64_t i = (m + r) * nb + b;
                acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][j]), _mm512_mul_ps(d, _mm512_set1_ps(x->dx[i])),
                                            acc[r][j]);
                if (bits == 4) acc[r][j] = _mm512_fmadd_ps(mn, _mm512_set1_ps(x->sx[i]), acc[r][j]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < ng; j++) store_outputs16(w, m + r, n0 + j * OUT16, acc[r][j], y, y_bf16);
}

// Rows [m0, m1) in passes, each with its row and group counts as constants (sums in registers, loops unrolled).
static inline __attribute__((always_inline)) void vnni_item(int bits, const kvd_weight* w, const quantized_rows* x,
                                                           int64_t m0, int64_t m1, int64_t n0, int ng, const int8_t* wt,
                                                           const float* wd, const float* wm, const int32_t* base,
                                                           void* y, int y_bf16) {
    int64_t m = m0;
    if (ng == 1) {
        for (; m < m1; m++) vnni_pass(bits, 1, 1, w, x, m, n0, wt, wd, wm, base, y, y_bf16);
        return;
    }
    for (; m + VNNI_ROWS <= m1; m += VNNI_ROWS) vnni_pass(bits, VNNI_ROWS, 2, w, x, m, n0, wt, wd, wm, base, y, y_bf16);
    if (m1 - m == 3) vnni_pass(bits, 3, 2, w, x, m, n0, wt, wd, wm, base, y, y_bf16);
    if (m1 - m == 2) vnni_pass(bits, 2, 2, w, x, m, n0, wt, wd, wm, base, y, y_bf16);
    if (m1 - m == 1) vnni_pass(bits, 1, 2, w, x, m, n0, wt, wd, wm, base, y, y_bf16);
}

// Outputs [0, groups x 16) in work items of up to VNNI_CHUNK activation rows x two groups of 16 (pair-major: a
// thread's items share one pair's unpacked weights), the rest by simd_rows. Returns 1 when out of memory.
static int vnni_linear(const kvd_weight* w, const quantized_rows* x, void* y, int y_bf16, int nthreads) {
    const int64_t nb = w->k / QBLOCK, groups = w->n / OUT16, pairs = (groups + 1) / 2;
    const int64_t chunks = (x->M + VNNI_CHUNK - 1) / VNNI_CHUNK;
    int32_t* base = w->bits == 8 ? malloc(sizeof(int32_t) * (size_t)(x->M * nb)) : NULL;
    int failed = w->bits == 8 && !base;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < (base ? x->M * nb : 0); i++) {
            int32_t sum = 0;
            for (int t = 0; t < QBLOCK; t++) sum += x->q[i * QBLOCK + t];
            base[i] = -128 * sum;
        }
        int8_t* wt = malloc((size_t)(nb * 2 * OUT16 * QBLOCK));
        float* wd = malloc(sizeof(float) * (size_t)(4 * nb * OUT16));
        failed |= !wt || !wd;
        int64_t unpacked = -1;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < chunks * pairs; item++) {
            if (!wt || !wd || (w->bits == 8 && !base)) continue;
            const int64_t pair = item / chunks, m0 = item % chunks * VNNI_CHUNK, n0 = pair * 2 * OUT16;
            const int64_t m1 = m0 + VNNI_CHUNK < x->M ? m0 + VNNI_CHUNK : x->M;
            const int ng = groups - pair * 2 > 1 ? 2 : 1;
            float* wm = wd + 2 * nb * OUT16;
            if (unpacked != pair) {
                unpack_pair(w, n0, ng, groups, wt, wd, wm, (char)0x80, x->M <= UNPACK_STREAM_ROWS);
                unpacked = pair;
            }
            if (w->bits == 4)
                vnni_item(4, w, x, m0, m1, n0, ng, wt, wd, wm, base, y, y_bf16);
            else
                vnni_item(8, w, x, m0, m1, n0, ng, wt, wd, wm, base, y, y_bf16);
        }
        free(wt);
        free(wd);
    }
    free(base);
    if (!failed) simd_rows(w, groups * OUT16, x, y, y_bf16, nthreads);
    return failed;
}
#else
#define KVD_VNNI512 0
#endif

#if KVD_AVX2 && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
#define KVD_AMX 1

// 8-bit weights only: a 4-bit block's minimum term adds to the float steps that each tile's block sums wait for,
// which bound the tiles, so VNNI (on every CPU with AMX) runs 4-bit ones faster (3072 x 576 int4 on a Xeon, 4-2048
// rows: 1.3-1.7x). Below a full tile VNNI runs 8-bit ones faster too (3072 x 576 at 4-12 rows: 150-214 against
// 216-259 us). docs/benchmarks.md, "Native kernel paths".
#define AMX_MIN_ROWS 16
#define AMX_CHUNK 16  // activation tiles per work item: they share the item's unpacked weight tiles

// Tiles: 0-3 = C (16 activation rows x 16 outputs of int32 block sums; activation tile i and weight group j of
// the pass at 2 i + j), 4-5 = A (16 activation rows x one block of 32 int8 codes, read in place), 6-7 = B (one
// block of 16 weight rows: 8 rows of 4 codes x 16 outputs).
static void amx_configure(void) {
    tile_config cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) cfg.rows[t] = AMX_ROWS, cfg.colsb[t] = 64;
    for (int t = 4; t < 6; t++) cfg.rows[t] = AMX_ROWS, cfg.colsb[t] = QBLOCK;
    for (int t = 6; t < 8; t++) cfg.rows[t] = QBLOCK / 4, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

// The float steps of block b for one C tile of a pass (activation tile i from row m0 of the pass, weight group
// j): acc [rows][32] = fma(isum, d x dx, acc), in the one order every path uses.
static inline void amx_scale(const int32_t* c, int i, int j, int64_t m0, int64_t M, int64_t b, const float* wd,
                             const quantized_rows* x, int64_t nb, float* acc) {
    // Held in registers: the stores to acc could otherwise alias x's fields and the weight scales.
    const float* dxs = x->dx + b;
    const __m512 d = _mm512_loadu_ps(wd + b * 2 * AMX_ROWS + j * AMX_ROWS);
    for (int r = 0; r < AMX_ROWS; r++) {
        const int64_t m = m0 + i * AMX_ROWS + r;
        if (m >= M) return;
        const __m512 isum = _mm512_cvtepi32_ps(_mm512_loadu_si512(c + (2 * i + j) * 256 + r * AMX_ROWS));
        float* a = acc + (i * AMX_ROWS + r) * 2 * AMX_ROWS + j * AMX_ROWS;
        _mm512_storeu_ps(a, _mm512_fmadd_ps(isum, _mm512_mul_ps(d, _mm512_set1_ps(dxs[m * nb])), _mm512_loadu_ps(a)));
    }
}

// C tile t of a pass (activation tile a x weight tile b, all three literal tile numbers): zeroed, the block's
// signed x signed products, stored to c.
#define AMX_TILE_PASS(t, a, b, c)             \
    do {                                      \
        _tile_zero(t);                        \
        _tile_dpbssd(t, a, b);                \
        _tile_stored(t, (c) + (t) * 256, 64); \
    } while (0)

// One work item: activation tiles [t0, t0 + mtiles) x weight groups n0 .. n0 + ng x 16, every block in order. The
// products of a pass run while the previous pass's results are scaled (stored in the other half of c_tiles):
// each tile's products, then one tile's float steps of the previous pass, so the tile unit always has work
// queued behind the vector instructions.
static void amx_item(const kvd_weight* w, const quantized_rows* x, const int8_t* xt, int64_t t0, int64_t mtiles,
                     int64_t n0, int ng, const int8_t* wtiles, const float* wd, float* acc, void* y, int y_bf16) {
    const int64_t K = w->k, nb = K / QBLOCK, M = x->M, tile_bytes = AMX_ROWS * QBLOCK;
    memset(acc, 0, sizeof(float) * (size_t)(mtiles * AMX_ROWS * 2 * AMX_ROWS));
    int32_t c_tiles[2][4 * AMX_ROWS * AMX_ROWS];
    int64_t prev_m = -1, prev_b = 0;
    int prev_mc = 0, half = 0;
    for (int64_t mt = 0; mt < mtiles; mt += 2) {
        const int mc = mtiles - mt < 2 ? 1 : 2;
        const int8_t* a = xt + (t0 + mt) * nb * tile_bytes;
        for (int64_t b = 0; b < nb; b++) {
            _tile_loadd(4, a + b * tile_bytes, QBLOCK);
            _tile_loadd(6, wtiles + b * tile_bytes, 64);
            if (ng > 1) _tile_loadd(7, wtiles + (nb + b) * tile_bytes, 64);
            if (mc > 1) _tile_loadd(5, a + (nb + b) * tile_bytes, QBLOCK);
            int32_t *c = c_tiles[half], *prev = c_tiles[half ^ 1];
            float* prev_acc = prev_m >= 0 ? acc + prev_m * AMX_ROWS * 2 * AMX_ROWS : acc;
            const int64_t prev_m0 = (t0 + prev_m) * AMX_ROWS;
            // The previous pass's tiles in the order of the new pass's: (0, 0), (0, 1), (1, 0), (1, 1).
#define AMX_SCALE_PREV(i, j)                                                                                     \
    if (prev_m >= 0 && (i) < prev_mc && (j) < ng)                                                                \
    amx_scale(prev, i, j, prev_m0, M, prev_b, wd, x, nb, prev_acc)
            AMX_TILE_PASS(0, 4, 6, c);
            AMX_SCALE_PREV(0, 0);
            if (ng > 1) AMX_TILE_PASS(1, 4, 7, c);
            AMX_SCALE_PREV(0, 1);
            if (mc > 1) AMX_TILE_PASS(2, 5, 6, c);
            AMX_SCALE_PREV(1, 0);
            if (mc > 1 && ng > 1) AMX_TILE_PASS(3, 5, 7, c);
            AMX_SCALE_PREV(1, 1);
#undef AMX_SCALE_PREV
            prev_m = mt, prev_b = b, prev_mc = mc, half ^= 1;
        }
    }
    for (int i = 0; i < prev_mc; i++)
        for (int j = 0; j < ng; j++)
            amx_scale(c_tiles[half ^ 1], i, j, (t0 + prev_m) * AMX_ROWS, M, prev_b, wd, x, nb,
                      acc + prev_m * AMX_ROWS * 2 * AMX_ROWS);
    const int64_t rows = M - t0 * AMX_ROWS < mtiles * AMX_ROWS ? M - t0 * AMX_ROWS : mtiles * AMX_ROWS;
    for (int64_t r = 0; r < rows; r++)
        for (int j = 0; j < ng; j++)
            store_outputs16(w, t0 * AMX_ROWS + r, n0 + j * AMX_ROWS,
                            _mm512_loadu_ps(acc + r * 2 * AMX_ROWS + j * AMX_ROWS), y, y_bf16);
}

// Outputs [0, groups x 16) for activation rows x (q padded with zero rows to whole tiles): work items of up to
// AMX_CHUNK activation tiles x two weight groups, each item's weights unpacked once into B tiles. Returns 1
// when out of memory.
static int amx_linear(const kvd_weight* w, const quantized_rows* x, void* y, int y_bf16, int nthreads) {
    const int64_t nb = w->k / QBLOCK, tiles = (x->M + AMX_ROWS - 1) / AMX_ROWS, groups = w->n / AMX_ROWS;
    const int64_t chunks = (tiles + AMX_CHUNK - 1) / AMX_CHUNK, pairs = (groups + 1) / 2;
    // The activation codes as A tiles [tiles][nb][16 rows][32]: a tile's rows side by side, not K apart.
    int8_t* xt = malloc((size_t)(tiles * AMX_ROWS * w->k));
    int failed = !xt;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++)
            for (int64_t b = 0; xt && b < nb; b++)
                for (int r = 0; r < AMX_ROWS; r++)
                    memcpy(xt + ((t * nb + b) * AMX_ROWS + r) * QBLOCK, x->q + (t * AMX_ROWS + r) * w->k + b * QBLOCK,
                           QBLOCK);
        const size_t tile_bytes = (size_t)(nb * 2 * AMX_ROWS * QBLOCK);
        int8_t* wtiles = malloc(tile_bytes);
        float* wd = malloc(sizeof(float) * (size_t)(4 * nb * AMX_ROWS + AMX_CHUNK * AMX_ROWS * 2 * AMX_ROWS));
        failed |= !wtiles || !wd;
        if (!failed) amx_configure();
        int64_t unpacked = -1;  // the pair whose weights wtiles holds
#pragma omp for schedule(static)
        for (int64_t item = 0; item < chunks * pairs; item++) {
            if (!xt || !wtiles || !wd) continue;
            // Pair-major: a thread's items share one pair's unpacked weights while they last.
            const int64_t pair = item / chunks, chunk = item % chunks;
            const int64_t n0 = pair * 2 * AMX_ROWS, t0 = chunk * AMX_CHUNK;
            const int ng = groups - pair * 2 > 1 ? 2 : 1;
            float *wm = wd + 2 * nb * AMX_ROWS, *acc = wm + 2 * nb * AMX_ROWS;
            if (unpacked != pair) {
                unpack_pair(w, n0, ng, groups, wtiles, wd, wm, 0, 0);  // streaming ahead: measured without AMX only
                unpacked = pair;
            }
            const int64_t mtiles = tiles - t0 < AMX_CHUNK ? tiles - t0 : AMX_CHUNK;
            amx_item(w, x, xt, t0, mtiles, n0, ng, wtiles, wd, acc, y, y_bf16);
        }
        if (wtiles && wd) _tile_release();
        free(wtiles);
        free(wd);
    }
    free(xt);
    if (!failed) simd_rows(w, groups * AMX_ROWS, x, y, y_bf16, nthreads);
    return failed;
}
#else
#define KVD_AMX 0
#endif

// y [M, n] = the quantized activation rows @ W^T (+ bias). Returns 1 when out of memory.
static int quantized_linear(const kvd_weight* w, const quantized_rows* x, void* y, int y_bf16, int nthreads) {
#if KVD_AMX
    if (w->bits == 8 && x->M >= AMX_MIN_ROWS && w->n >= AMX_ROWS && amx_permitted())
        return amx_linear(w, x, y, y_bf16, nthreads);
#endif
#if KVD_VNNI512
    if (x->M >= VNNI_MIN_ROWS && w->n >= OUT16) return vnni_linear(w, x, y, y_bf16, nthreads);
#endif
    simd_rows(w, 0, x, y, y_bf16, nthreads);
    return 0;
}

// ---- float32 linears in panel order ---------------------------------------------------------------------------
//
// A float32 weight in panel order ([n/16][k][16]: each k's 16 outputs side by side) is multiplied with the outputs
// in SIMD lanes: every output is one fused multiply-add chain over k in order, whatever the row count, the SIMD
// width or the CPU, so results are batch invariant (and equal on every CPU). Four activation rows share each
// load of the weight.

#define PANEL 16

#if KVD_AVX2
static inline __attribute__((always_inline)) void panel_rows(const float* p, const float* x, int64_t K, int rows,
                                                              const float* bias, float* y, int64_t N) {
    __m256 acc[4][2];
    for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m256 w0 = _mm256_loadu_ps(p + k * PANEL), w1 = _mm256_loadu_ps(p + k * PANEL + 8);
        for (int r = 0; r < rows; r++) {
            const __m256 xb = _mm256_set1_ps(x[r * K + k]);
            acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(y + r * N, _mm256_add_ps(acc[r][0], _mm256_loadu_ps(bias)));
        _mm256_storeu_ps(y + r * N + 8, _mm256_add_ps(acc[r][1], _mm256_loadu_ps(bias + 8)));
    }
}
#endif

#if KVD_AVX2 && defined(__AVX512F__)
// The same sums 16 lanes wide, eight activation rows a pass.
static inline __attribute__((always_inline)) void panel_rows16(const float* p, const float* x, int64_t K, int rows,
                                                                const float* bias, float* y, int64_t N) {
    __m512 acc[8];
    for (int r = 0; r < 8; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m512 wv = _mm512_loadu_ps(p + k * PANEL);
        for (int r = 0; r < rows; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), wv, acc[r]);
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(y + r * N, _mm512_add_ps(acc[r], _mm512_loadu_ps(bias)));
}
#endif

static void panel_linear(const kvd_weight* w, const float* x, int64_t M, float* y, int nthreads) {
    const int64_t K = w->k, N = w->n;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t np = 0; np < N / PANEL; np++) {
        const float* p = (const float*)w->qs + np * PANEL * K;
        float bias[PANEL];
        for (int j = 0; j < PANEL; j++) bias[j] = w->bias ? w->bias[np * PANEL + j] : 0.f;
        int64_t m = 0;
#if KVD_AVX2 && defined(__AVX512F__)
        for (; m + 8 <= M; m += 8) panel_rows16(p, x + m * K, K, 8, bias, y + m * N + np * PANEL, N);
#endif
#if KVD_AVX2
        for (; m + 4 <= M; m += 4) panel_rows(p, x + m * K, K, 4, bias, y + m * N + np * PANEL, N);
        // The last rows with their count as a constant, so that the sums stay in registers.
        if (M - m == 3) panel_rows(p, x + m * K, K, 3, bias, y + m * N + np * PANEL, N);
        if (M - m == 2) panel_rows(p, x + m * K, K, 2, bias, y + m * N + np * PANEL, N);
        if (M - m == 1) panel_rows(p, x + m * K, K, 1, bias, y + m * N + np * PANEL, N);
        m = M;
#endif
        for (; m < M; m++)
            for (int j = 0; j < PANEL; j++) {
                float acc = 0.f;
                for (int64_t k = 0; k < K; k++) acc = fmaf(x[m * K + k], p[k * PANEL + j], acc);
                y[m * N + np * PANEL + j] = acc + bias[j];
            }
    }
}


// ---- bf16 linears in AMX tiles ----------------------------------------------------------------------------------
//
// A weight in tile order is multiplied by TDPBF16PS for every row count (a decode row is padded to a tile): each
// output sums its products in the order the tile instruction has, whatever M is, so results are batch invariant.

#if KVD_AVX2 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define KVD_AMX_BF16 1

#define AMX_BF16_CHUNK 16  // activation tiles per work item: they stay in L2 while the weight tiles stream past

// Tiles: 0 and 3 = C (16 activation rows x 16 float32 outputs of two weight groups), 1 = A (16 activation rows x
// 32 bf16 of k), 2 = B (16 pairs of k x 16 outputs x 2 bf16).
static void amx_bf16_configure(void) {
    tile_config cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) cfg.rows[t] = AMX_ROWS, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

// Work items of two groups of 16 outputs x up to AMX_BF16_CHUNK activation tiles, chunk-major: a thread's items
// share one chunk of activations (in L2) while the weights stream. Each A tile serves both groups' products, and
// a row's 32 outputs fill a whole 64-byte line of bf16 at once (one group an item wrote each line in two halves
// at different times): 5-23 % faster than one group on a Xeon at 64-2048 rows; four groups an item were no
// faster than two. Each output is still one tile accumulation over k in order. Returns 1 when out of memory.
static int amx_bf16_linear(const kvd_weight* w, const uint16_t* x, int64_t M, void* y, int y_bf16, int nthreads) {
    const int64_t K = w->k, kb = K / 32, tiles = (M + AMX_ROWS - 1) / AMX_ROWS, groups = w->n / AMX_ROWS;
    const int64_t chunks = (tiles + AMX_BF16_CHUNK - 1) / AMX_BF16_CHUNK, pairs = (groups + 1) / 2;
    const uint16_t* packed = w->qs;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        // The last tile of activation rows, zero-padded; and the two tiles of outputs, row by row.
        uint16_t* tail = calloc((size_t)(AMX_ROWS * K), sizeof(uint16_t));
        float c[AMX_ROWS * 2 * AMX_ROWS];
        failed |= !tail;
        if (tail) {
            amx_bf16_configure();
            const int64_t last = (tiles - 1) * AMX_ROWS;
            memcpy(tail, x + last * K, sizeof(uint16_t) * (size_t)((M - last) * K));
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < chunks * pairs; item++) {
            if (!tail) continue;
            const int64_t nt = item % pairs * 2, t0 = item / pairs * AMX_BF16_CHUNK;
            const int64_t t1 = t0 + AMX_BF16_CHUNK < tiles ? t0 + AMX_BF16_CHUNK : tiles;
            const int two = nt + 1 < groups;  // a last group alone where there is an odd number
            const uint16_t *b0 = packed + nt * kb * 512, *b1 = b0 + kb * 512;
            // The next item's weight tiles come in during the first pass (a tile load that misses waits for its
            // 16 lines one after another); the later passes find them cached.
            const uint16_t* next = packed + (nt + 2) % groups * kb * 512;
            for (int64_t t = t0; t < t1; t++) {
                const uint16_t* a = t == tiles - 1 ? tail : x + t * AMX_ROWS * K;
                _tile_zero(0);
                _tile_zero(3);
                for (int64_t k = 0; k < kb; k++) {
                    for (int j = 0; t == t0 && j < 2; j++)  // past the weight's end for a lone last group: harmless
                        for (int l = 0; l < 16; l++) _mm_prefetch((const char*)(next + (j * kb + k) * 512 + l * 32), _MM_HINT_T0);
                    _tile_loadd(1, a + k * 32, K * 2);
                    _tile_loadd(2, b0 + k * 512, 64);
                    _tile_dpbf16ps(0, 1, 2);
                    if (two) {
                        _tile_loadd(2, b1 + k * 512, 64);
                        _tile_dpbf16ps(3, 1, 2);
                    }
                }
                // Both groups' outputs of a row side by side, so a row's line of bf16 outputs is written in one go.
                _tile_stored(0, c, 2 * 64);
                _tile_stored(3, c + AMX_ROWS, 2 * 64);
                const int64_t rows = M - t * AMX_ROWS < AMX_ROWS ? M - t * AMX_ROWS : AMX_ROWS;
                for (int64_t r = 0; r < rows; r++)
                    for (int j = 0; j < 1 + two; j++)
                        store_outputs16(w, t * AMX_ROWS + r, (nt + j) * AMX_ROWS,
                                        _mm512_loadu_ps(c + (2 * r + j) * AMX_ROWS), y, y_bf16);
            }
        }
        if (tail) _tile_release();
        free(tail);
    }
    return failed;
}
#else
#define KVD_AMX_BF16 0
#endif

// ---- bf16 linears by AVX-512 BF16 pair products (CPUs without AMX tiles) ---------------------------------------
//
// Read panel by panel, the tile order above is [n/16][k/2][16 outputs][2]: the 16 outputs' weights for a pair of k
// in one 64-byte line, which VDPBF16PS multiplies by the pair of activations broadcast. Each output sums its pair
// products in float32 in k order from zero, whatever the row count (batch invariance).

#if KVD_AVX512_BF16
#define PAIR_ROWS 6    // activation rows a pass
#define PAIR_PANELS 4  // panels of 16 outputs a pass: 24 sums in registers
#define PAIR_CHUNK 96  // activation rows a work item: they stay in L2 while the item's panels are read per pass

// Rows m0 .. m0 + rows and panels np .. np + panels; constant counts unroll into registers.
static inline __attribute__((always_inline)) void pair_pass(const kvd_weight* w, const uint16_t* x, int64_t m0,
                                                            int rows, int64_t np, int panels, void* y, int y_bf16) {
    const int64_t K = w->k;
    const uint16_t* p = (const uint16_t*)w->qs + np * PANEL * K;
    __m512 acc[PAIR_ROWS][PAIR_PANELS];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < panels; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < K; i += 2) {
        __m512bh wv[PAIR_PANELS];
        for (int j = 0; j < panels; j++) wv[j] = load_bh(p + j * PANEL * K + i * PANEL);
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, x + (m0 + r) * K + i, 4);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < panels; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xb, wv[j]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < panels; j++) store_outputs16(w, m0 + r, (np + j) * PANEL, acc[r][j], y, y_bf16);
}

static void pair_linear(const kvd_weight* w, const uint16_t* x, int64_t M, void* y, int y_bf16, int nthreads) {
    const int64_t panels = w->n / PANEL, groups = (panels + PAIR_PANELS - 1) / PAIR_PANELS;
    const int64_t chunks = (M + PAIR_CHUNK - 1) / PAIR_CHUNK;
    // Chunk-major, as for the tiles: a thread's items share one chunk of activations.
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t item = 0; item < chunks * groups; item++) {
        const int64_t np = item % groups * PAIR_PANELS, m1 = item / groups * PAIR_CHUNK + PAIR_CHUNK;
        const int np_count = panels - np < PAIR_PANELS ? (int)(panels - np) : PAIR_PANELS;
        for (int64_t m = item / groups * PAIR_CHUNK; m < M && m < m1; m += PAIR_ROWS) {
            const int rows = M - m < PAIR_ROWS ? (int)(M - m) : PAIR_ROWS;
            if (np_count != PAIR_PANELS)
                pair_pass(w, x, m, rows, np, np_count, y, y_bf16);  // a last part group: not unrolled
            else if (rows == PAIR_ROWS)
                pair_pass(w, x, m, PAIR_ROWS, np, PAIR_PANELS, y, y_bf16);
            else if (rows == 1)
                pair_pass(w, x, m, 1, np, PAIR_PANELS, y, y_bf16);
            else if (rows == 2)
                pair_pass(w, x, m, 2, np, PAIR_PANELS, y, y_bf16);
            else if (rows == 3)
                pair_pass(w, x, m, 3, np, PAIR_PANELS, y, y_bf16);
            else if (rows == 4)
                pair_pass(w, x, m, 4, np, PAIR_PANELS, y, y_bf16);
            else
                pair_pass(w, x, m, 5, np, PAIR_PANELS, y, y_bf16);
        }
    }
}
#endif

const char* kvd_isa(void) {
#if KVD_AMX || KVD_AMX_BF16
    if (!amx_permitted()) return KVD_ISA_NO_AMX;  // Linux refused the tiles: the other paths run
#endif
    return KVD_ISA;
}

int kvd_bf16_kernel_order(void) {
#if KVD_AMX_BF16
    if (amx_permitted()) return 1;
#endif
    return KVD_AVX512_BF16;
}


int kvd_linear(const kvd_weight* w, const void* x, int x_bf16, int64_t M, void* y, int y_bf16, int nthreads) {
    if (w->tiles && w->bits == 32) {
        if (x_bf16 || y_bf16) return KVD_UNSUPPORTED;
        panel_linear(w, x, M, y, nthreads);
        return KVD_OK;
    }
    if (w->tiles) {
        if (w->bits != 16 || !x_bf16) return KVD_UNSUPPORTED;
#if KVD_AMX_BF16
        if (amx_permitted()) return amx_bf16_linear(w, x, M, y, y_bf16, nthreads) ? KVD_OUT_OF_MEMORY : KVD_OK;
#endif
#if KVD_AVX512_BF16
        pair_linear(w, x, M, y, y_bf16, nthreads);
        return KVD_OK;
#else
        return KVD_UNSUPPORTED;
#endif
    }
    if (w->bits == 32 || w->bits == 16)
        return float_linear(w, x, x_bf16, M, y, y_bf16, nthreads) ? KVD_OUT_OF_MEMORY : KVD_OK;
    const int64_t K = w->k, nb = K / QBLOCK, padded = (M + 15) / 16 * 16;
    int8_t* q = malloc((size_t)(padded * K));
    float* dx = malloc(sizeof(float) * (size_t)(2 * M * nb));
    int failed = !q || !dx;
    if (!failed) {
        memset(q + M * K, 0, (size_t)((padded - M) * K));  // AMX reads whole tiles of rows
        quantize_rows(x, x_bf16, M, K, q, dx, dx + M * nb, nthreads);
        const quantized_rows rows = {q, dx, dx + M * nb, M};
        failed = quantized_linear(w, &rows, y, y_bf16, nthreads);
    }
    free(q);
    free(dx);
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

// ---- paged decode attention --------------------------------------------------------------------------------

// Block t0 / block_size + 1's rows (row_bytes from `rows` in each slot) on their way to the cache while block
// t0 is read: blocks sit anywhere in the pool, so the hardware prefetcher cannot see where the next one starts.
static inline void prefetch_next_block(const char* rows, const int32_t* table, int64_t t0, int64_t ctx,
                                       int64_t block_size, int64_t slot_bytes, int64_t row_bytes) {
    if (t0 + block_size >= ctx) return;
    const char* next = rows + (int64_t)table[t0 / block_size + 1] * block_size * slot_bytes;
    for (int64_t t = 0; t < block_size; t++)
        for (int64_t i = 0; i < row_bytes; i += 64) __builtin_prefetch(next + t * slot_bytes + i);
}

// The next sequence a thread attends to, streamed into L2 a slice per block of the current one: a decode step's
// pool is far larger than the caches, and one sequence's blocks alone keep too few misses in flight to use the
// memory bandwidth. Prefetches only, so the arithmetic is the same with or without a stream.
typedef struct {
    const char* region;  // the pool's keys or values
    const int32_t* table;
    int64_t block_bytes, blocks;  // the next sequence's blocks
    int64_t block, offset;        // how far the stream is: a block index and a byte offset in that block
    int64_t quantum;              // bytes per step
} kv_stream;

static inline void kv_stream_step(kv_stream* st) {
    if (!st) return;
    int64_t block = st->block, offset = st->offset;
    for (int64_t left = st->quantum; left > 0 && block < st->blocks;) {
        const char* base = st->region + (int64_t)st->table[block] * st->block_bytes;
        const int64_t end = offset + left < st->block_bytes ? offset + left : st->block_bytes;
        left -= end - offset;
        for (; offset < end; offset += 64) __builtin_prefetch(base + offset, 0, 2);
        if (offset >= st->block_bytes) offset = 0, block++;
    }
    st->block = block, st->offset = offset;
}

// Steps of a stream per block read: at the block's start and half-way through it. A step's prefetches hold line
// fill buffers until DRAM answers, and a burst of them stalls the loads behind it; two smaller bursts a block let
// the reads of the current block in between (decode over 64 sequences 6-7 % faster than one step, Xeon).
#define STREAM_STEPS 2

// Streams for the keys and values of sequence `next` (its table and context length) while one of `blocks`
// blocks is read per kv head and phase: spread over the whole of the current sequence, so its lines are in L2
// when it starts and the misses in flight stay even (finishing by half-way was 10-25 % slower on a Xeon and on
// a Zen 5 EPYC).
static inline void kv_streams(kv_stream st[2], const char* keys, const char* values, const int32_t* next,
                              int64_t next_ctx, int64_t blocks, int64_t kv_heads, int64_t block_size,
                              int64_t block_bytes) {
    const int64_t nb = (next_ctx + block_size - 1) / block_size, steps = kv_heads * blocks * STREAM_STEPS;
    const int64_t quantum = (nb * block_bytes + steps - 1) / steps;
    st[0] = (kv_stream){keys, next, block_bytes, nb, 0, 0, quantum};
    st[1] = (kv_stream){values, next, block_bytes, nb, 0, 0, quantum};
}

#if KVD_AVX2
static inline __m256 round8(__m256 v, int bf16) { return bf16 ? _mm256_castsi256_ps(bf16_bits8(v)) : v; }

static inline void store8(char* p, __m256 v, int bf16) {
    if (bf16)
        store_bf16x8(p, v);
    else
        _mm256_storeu_ps((float*)p, v);
}
#endif

// a . b for a float32 row and a pool row (float32 or bf16) of D values.
static inline __attribute__((always_inline)) float dot_row(const float* a, const char* b, int bf16, int64_t D) {
    int64_t i = 0;
    float sum = 0.f;
#if KVD_AVX2
    const int elem = bf16 ? 2 : 4;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    for (; i + 16 <= D; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i * elem, bf16), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load8(b + (i + 8) * elem, bf16), acc1);
    }
    for (; i + 8 <= D; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i * elem, bf16), acc0);
    sum = hsum(_mm256_add_ps(acc0, acc1));
#endif
    for (; i < D; i++) sum += a[i] * load_f(b, i, bf16);
    return sum;
}

#if KVD_AVX2
// Lane j = the sum of v[j]'s eight lanes, in one fixed tree whatever the caller.
static inline __m256 hsum8x8_ps(const __m256* v) {
    const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// The scores of eight consecutive pool rows against one query row: an 8-lane fma chain over D per row, then
// hsum8x8_ps (one reduction for eight scores, where dot_row spends one per score).
static inline __attribute__((always_inline)) __m256 dot_rows8(const float* q, const char* k, int64_t slot_bytes,
                                                              int bf16, const int64_t D) {
    const int elem = bf16 ? 2 : 4;
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qv, load8(k + j * slot_bytes + i * elem, bf16), acc[j]);
    }
    return hsum8x8_ps(acc);
}

// e^(x - n ln2) for |x - n ln2| <= ln2 / 2 into y: ln2 in two parts, then a degree-6 polynomial. One definition
// for the 8- and 16-lane versions (P: _mm256 or _mm512), so they take the same steps.
#define EXP_REDUCED(P, x, n, y)                                                  \
    do {                                                                         \
        __typeof__(x) r_ = P##_fnmadd_ps(n, P##_set1_ps(0.693359375f), x);       \
        r_ = P##_fnmadd_ps(n, P##_set1_ps(-2.12194440e-4f), r_);                 \
        y = P##_set1_ps(1.9875691500e-4f);                                       \
        y = P##_fmadd_ps(y, r_, P##_set1_ps(1.3981999507e-3f));                  \
        y = P##_fmadd_ps(y, r_, P##_set1_ps(8.3334519073e-3f));                  \
        y = P##_fmadd_ps(y, r_, P##_set1_ps(4.1665795894e-2f));                  \
        y = P##_fmadd_ps(y, r_, P##_set1_ps(1.6666665459e-1f));                  \
        y = P##_fmadd_ps(y, r_, P##_set1_ps(5.0000001201e-1f));                  \
        y = P##_fmadd_ps(y, P##_mul_ps(r_, r_), P##_add_ps(r_, P##_set1_ps(1.0f))); \
    } while (0)

// e^x for x <= 0 (a softmax's shifted scores): Cody-Waite reduction to [-ln2/2, ln2/2], a degree-6 polynomial,
// the power of two put into the exponent; within 2 ulp of expf, 0 below -87.
static inline __m256 exp_nonpositive(__m256 x) {
    const __m256 floor_x = _mm256_set1_ps(-87.0f);
    const __m256 under = _mm256_cmp_ps(x, floor_x, _CMP_LT_OQ);
    x = _mm256_max_ps(x, floor_x);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 y;
    EXP_REDUCED(_mm256, x, n, y);
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(bits)));
}
#endif

#if KVD_AVX512
// exp_nonpositive in 16 lanes: the same steps, so the same bits lane for lane.
static inline __m512 exp_nonpositive16(__m512 x) {
    const __m512 floor_x = _mm512_set1_ps(-87.0f);
    const __mmask16 under = _mm512_cmp_ps_mask(x, floor_x, _CMP_LT_OQ);
    x = _mm512_max_ps(x, floor_x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 y;
    EXP_REDUCED(_mm512, x, n, y);
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(~under, y, _mm512_castsi512_ps(bits));
}
#endif

// scores[t] = exp(scores[t] - max) for t < n; returns their sum. Eight at a time where SIMD runs: the order of
// the sum depends on n alone, so a query's softmax is the same whatever else the call holds.
static inline float softmax_numerators(float* sc, int64_t n) {
    float mx = -INFINITY, sum = 0.f;
    int64_t t = 0;
#if KVD_AVX2
    __m256 m8 = _mm256_set1_ps(-INFINITY);
#if KVD_AVX512
    // The largest score in four independent chains of 16 lanes (one chain waits on each max): the same maximum.
    __m512 m16[4];
    for (int j = 0; j < 4; j++) m16[j] = _mm512_set1_ps(-INFINITY);
    for (; t + 64 <= n; t += 64)
        for (int j = 0; j < 4; j++) m16[j] = _mm512_max_ps(m16[j], _mm512_loadu_ps(sc + t + 16 * j));
    const __m512 m4 = _mm512_max_ps(_mm512_max_ps(m16[0], m16[1]), _mm512_max_ps(m16[2], m16[3]));
    m8 = _mm256_max_ps(_mm512_castps512_ps256(m4), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(m4), 1)));
#endif
    for (; t + 8 <= n; t += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(sc + t));
    float lanes[8];
    _mm256_storeu_ps(lanes, m8);
    for (int j = 0; j < 8; j++) mx = lanes[j] > mx ? lanes[j] : mx;
#endif
    for (; t < n; t++) mx = sc[t] > mx ? sc[t] : mx;
    t = 0;
#if KVD_AVX2
    const __m256 mv = _mm256_set1_ps(mx);
    __m256 s8 = _mm256_setzero_ps();
#if KVD_AVX512
    for (; t + 16 <= n; t += 16) {  // the exponentials 16 at a time, summed eight at a time as below
        const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(sc + t), _mm512_set1_ps(mx)));
        _mm512_storeu_ps(sc + t, e);
        s8 = _mm256_add_ps(_mm256_add_ps(s8, _mm512_castps512_ps256(e)), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
#endif
    for (; t + 8 <= n; t += 8) {
        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sc + t), mv));
        _mm256_storeu_ps(sc + t, e);
        s8 = _mm256_add_ps(s8, e);
    }
    sum = hsum(s8);
#endif
    for (; t < n; t++) {
        sc[t] = expf(sc[t] - mx);
        sum += sc[t];
    }
    return sum;
}

// acc += p x a pool row of D values.
static inline __attribute__((always_inline)) void add_scaled_row(float* acc, float p, const char* v, int bf16, int64_t D) {
    int64_t i = 0;
#if KVD_AVX2
    const int elem = kv_elem(bf16);
    const __m256 pv = _mm256_set1_ps(p);
    for (; i + 8 <= D; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, load8(v + i * elem, bf16), _mm256_loadu_ps(acc + i)));
#endif
    for (; i < D; i++) acc[i] += p * load_f(v, i, bf16);
}

// a[0..D) = sum over the context, in order, of p[t] x value row t. For the common head sizes (D a constant
// multiple of 8 up to 128) the sums stay in registers across the context; the arithmetic is the same either way.
static inline __attribute__((always_inline)) void weighted_values(float* a, const float* p, const char* values,
                                                                   const int32_t* table, int64_t ctx,
                                                                   int64_t block_size, int64_t slot_bytes,
                                                                   int64_t head, int bf16, const int64_t D) {
#if KVD_AVX2
    if (D % 8 == 0 && D <= 128) {
        const int elem = kv_elem(bf16);
        __m256 acc[16];
        for (int64_t i = 0; i < D / 8; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
            const char* v = values + (int64_t)table[t0 / block_size] * block_size * slot_bytes + head;
            const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
            for (int64_t t = 0; t < n; t++) {
                const __m256 pv = _mm256_set1_ps(p[t0 + t]);
                for (int64_t i = 0; i < D / 8; i++)
                    acc[i] = _mm256_fmadd_ps(pv, load8(v + t * slot_bytes + i * 8 * elem, bf16), acc[i]);
            }
        }
        for (int64_t i = 0; i < D / 8; i++) _mm256_storeu_ps(a + i * 8, acc[i]);
        return;
    }
#endif
    memset(a, 0, sizeof(float) * (size_t)D);
    for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
        const char* v = values + (int64_t)table[t0 / block_size] * block_size * slot_bytes + head;
        const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
        for (int64_t t = 0; t < n; t++) add_scaled_row(a, p[t0 + t], v + t * slot_bytes, bf16, D);
    }
}

#if KVD_AVX2
// a[g][i0 .. i0 + 32) for GN heads at once: each value row is read once for all of them, and every output
// element is still one fma chain over the context in order, as in weighted_values.
static inline __attribute__((always_inline)) void values_tile(float* a, const float* p, const char* values,
                                                              const int32_t* table, int64_t ctx, int64_t block_size,
                                                              int64_t slot_bytes, int64_t head, int bf16, int64_t D,
                                                              int64_t i0, const int GN, kv_stream* st) {
    const int elem = kv_elem(bf16);
    __m256 acc[3][4];
    for (int g = 0; g < GN; g++)
        for (int i = 0; i < 4; i++) acc[g][i] = _mm256_setzero_ps();
    for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
        const char* v = values + (int64_t)table[t0 / block_size] * block_size * slot_bytes + head + i0 * elem;
        const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
        prefetch_next_block(values + head + i0 * elem, table, t0, ctx, block_size, slot_bytes, 32 * elem);
        kv_stream_step(st);
        for (int64_t t = 0; t < n; t++) {
            if (t == n / 2) kv_stream_step(st);
            const char* row = v + t * slot_bytes;
            const __m256 v0 = load8(row, bf16), v1 = load8(row + 8 * elem, bf16);
            const __m256 v2 = load8(row + 16 * elem, bf16), v3 = load8(row + 24 * elem, bf16);
            for (int g = 0; g < GN; g++) {
                const __m256 pv = _mm256_set1_ps(p[g * ctx + t0 + t]);
                acc[g][0] = _mm256_fmadd_ps(pv, v0, acc[g][0]);
                acc[g][1] = _mm256_fmadd_ps(pv, v1, acc[g][1]);
                acc[g][2] = _mm256_fmadd_ps(pv, v2, acc[g][2]);
                acc[g][3] = _mm256_fmadd_ps(pv, v3, acc[g][3]);
            }
        }
    }
    for (int g = 0; g < GN; g++)
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(a + g * D + i0 + i * 8, acc[g][i]);
}
#endif

#if KVD_AVX512
// Columns 0-31 of a row back in order from the sums of its bf16 values as unpacklo / unpackhi_epi16 interleave them
// (x: columns 0-3, 8-11, 16-19, 24-27; y: 4-7, 12-15, ...): 128-bit quarters alternate between the two.
static inline void unpacked_order(__m512* x, __m512* y) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const __m512 a = *x, b = *y;
    *x = _mm512_permutex2var_ps(a, first, b);
    *y = _mm512_permutex2var_ps(a, second, b);
}

// The lanes of 16 keys from key u of a block of n that are in it.
static inline __mmask16 live_keys(int64_t n, int64_t u) {
    return n - u >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - u)) - 1);
}

// values_tile with 64 columns in four 16-lane sums: the same fma chain per element, so the same results.
static inline __attribute__((always_inline)) void values_tile64(float* a, const float* p, const char* values,
                                                                const int32_t* table, int64_t ctx, int64_t block_size,
                                                                int64_t slot_bytes, int64_t head, int bf16, int64_t D,
                                                                int64_t i0, const int GN, kv_stream* st) {
    const int elem = kv_elem(bf16);
    __m512 acc[3][4];
    for (int g = 0; g < GN; g++)
        for (int i = 0; i < 4; i++) acc[g][i] = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
        const char* v = values + (int64_t)table[t0 / block_size] * block_size * slot_bytes + head + i0 * elem;
        const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
        prefetch_next_block(values + head + i0 * elem, table, t0, ctx, block_size, slot_bytes, 64 * elem);
        kv_stream_step(st);
        for (int64_t t = 0; t < n; t++) {
            if (t == n / 2) kv_stream_step(st);
            const char* row = v + t * slot_bytes;
            __m512 v0, v1, v2, v3;
            if (bf16 == 1) {
                // bf16 to float32 by interleaving with zeros, no shifts: v0 holds columns 0-3, 8-11, 16-19, 24-27,
                // v1 4-7, 12-15, ..., v2 and v3 the same of 32-63 (put back in order below).
                const __m512i lo = _mm512_loadu_si512(row), hi = _mm512_loadu_si512(row + 64), zero = _mm512_setzero_si512();
                v0 = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, lo));
                v1 = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, lo));
                v2 = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, hi));
                v3 = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, hi));
            } else {
                v0 = load16(row, bf16), v1 = load16(row + 16 * elem, bf16);
                v2 = load16(row + 32 * elem, bf16), v3 = load16(row + 48 * elem, bf16);
            }
            for (int g = 0; g < GN; g++) {
                const __m512 pv = _mm512_set1_ps(p[g * ctx + t0 + t]);
                acc[g][0] = _mm512_fmadd_ps(pv, v0, acc[g][0]);
                acc[g][1] = _mm512_fmadd_ps(pv, v1, acc[g][1]);
                acc[g][2] = _mm512_fmadd_ps(pv, v2, acc[g][2]);
                acc[g][3] = _mm512_fmadd_ps(pv, v3, acc[g][3]);
            }
        }
    }
    if (bf16 == 1)
        for (int g = 0; g < GN; g++)
            for (int h = 0; h < 4; h += 2) unpacked_order(&acc[g][h], &acc[g][h + 1]);
    for (int g = 0; g < GN; g++)
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(a + g * D + i0 + i * 16, acc[g][i]);
}
#endif

#if KVD_AVX512_BF16
// Lane j = the sum of v[j]'s sixteen lanes, in one fixed tree: pairs within 128-bit lanes, then 64-bit halves,
// then the 128-bit lanes.
static inline __m512 hsum16x16(const __m512* v) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xdd));
    const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xdd));
}

// sc[t] = scale x (q . key t) for the n keys of one block (bf16 q row and pool rows, D a multiple of 32 up to
// 128): bf16 pair products summed in float32 lanes (vdpbf16ps), sixteen keys per hsum16x16; a key past the
// last whole sixteen of its block takes one reduction of its own. Either way a key's score depends only on
// the query, the key and where the context ends, whatever else the call holds.
static inline __attribute__((always_inline)) void bf16_scores(const uint16_t* q, const char* k, int64_t slot_bytes,
                                                              int64_t n, const int64_t D, float scale, float* sc) {
    __m512bh qv[4];
    for (int64_t i = 0; i < D / 32; i++) qv[i] = load_bh(q + i * 32);
    const __m512 sv = _mm512_set1_ps(scale);
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
        __m512 acc[16];
        for (int j = 0; j < 16; j++) {
            acc[j] = _mm512_setzero_ps();
            for (int64_t i = 0; i < D / 32; i++)
                acc[j] = _mm512_dpbf16_ps(acc[j], qv[i], load_bh(k + (t + j) * slot_bytes + i * 64));
        }
        _mm512_storeu_ps(sc + t, _mm512_mul_ps(hsum16x16(acc), sv));
    }
    for (; t < n; t++) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < D / 32; i++) acc = _mm512_dpbf16_ps(acc, qv[i], load_bh(k + t * slot_bytes + i * 64));
        sc[t] = _mm512_reduce_add_ps(acc) * scale;
    }
}

// Numerators p[0 .. n) rounded to bf16 in place: the bf16 of p[t] at ((uint16_t*)p)[t] (each store lands on floats
// already read).
static inline void numerators_bf16(float* p, int64_t n) {
    uint16_t* h = (uint16_t*)p;
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 live = live_keys(n, t);
        _mm256_mask_storeu_epi16(h + t, live, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(live, p + t)));
    }
}

// values_tile64 over a bf16 pool by pair products: keys t and t + 1 of a block interleaved column by column (as
// the AMX path's value tiles hold them), their weights rounded to bf16 (pb: numerators_bf16 of each head's row,
// heads ctx floats apart), one vdpbf16ps per 16 columns and pair. A block's odd last key pairs with zeros. Half
// the multiply-adds of the float32 sums; a row's sums depend only on its own weights and keys.
static inline __attribute__((always_inline)) void values_pairs64(float* a, const uint16_t* pb, const char* values,
                                                                 const int32_t* table, int64_t ctx,
                                                                 int64_t block_size, int64_t slot_bytes, int64_t head,
                                                                 int64_t D, int64_t i0, const int GN, kv_stream* st) {
    __m512 acc[3][4];
    for (int g = 0; g < GN; g++)
        for (int i = 0; i < 4; i++) acc[g][i] = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
        const char* v = values + (int64_t)table[t0 / block_size] * block_size * slot_bytes + head + i0 * 2;
        const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
        prefetch_next_block(values + head + i0 * 2, table, t0, ctx, block_size, slot_bytes, 128);
        kv_stream_step(st);
        for (int64_t t = 0; t < n; t += 2) {
            if (t == n / 4 * 2) kv_stream_step(st);
            const char* row = v + t * slot_bytes;
            const int two = t + 1 < n;
            const __m512i zero = _mm512_setzero_si512();
            const __m512i lo0 = _mm512_loadu_si512(row), hi0 = _mm512_loadu_si512(row + 64);
            const __m512i lo1 = two ? _mm512_loadu_si512(row + slot_bytes) : zero;
            const __m512i hi1 = two ? _mm512_loadu_si512(row + slot_bytes + 64) : zero;
            // Columns 0-3, 8-11, ... (x) and 4-7, 12-15, ... (y) of 0-31, then of 32-63: unpacked_order's.
            const __m512bh v0 = (__m512bh)_mm512_unpacklo_epi16(lo0, lo1), v1 = (__m512bh)_mm512_unpackhi_epi16(lo0, lo1);
            const __m512bh v2 = (__m512bh)_mm512_unpacklo_epi16(hi0, hi1), v3 = (__m512bh)_mm512_unpackhi_epi16(hi0, hi1);
            for (int g = 0; g < GN; g++) {
                const uint16_t* w = pb + 2 * g * ctx + t0 + t;
                const __m512bh pw = (__m512bh)_mm512_set1_epi32(two ? (int)(w[0] | (uint32_t)w[1] << 16) : w[0]);
                acc[g][0] = _mm512_dpbf16_ps(acc[g][0], pw, v0);
                acc[g][1] = _mm512_dpbf16_ps(acc[g][1], pw, v1);
                acc[g][2] = _mm512_dpbf16_ps(acc[g][2], pw, v2);
                acc[g][3] = _mm512_dpbf16_ps(acc[g][3], pw, v3);
            }
        }
    }
    for (int g = 0; g < GN; g++)
        for (int h = 0; h < 4; h += 2) unpacked_order(&acc[g][h], &acc[g][h + 1]);
    for (int g = 0; g < GN; g++)
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(a + g * D + i0 + i * 16, acc[g][i]);
}
#endif

#if KVD_AVX512
// values_tile64, or over a bf16 pool with AVX-512 BF16 values_pairs64 (p already rounded by numerators_bf16).
static inline __attribute__((always_inline)) void values64(float* a, const float* p, const char* values,
                                                           const int32_t* table, int64_t ctx, int64_t block_size,
                                                           int64_t slot_bytes, int64_t head, int bf16, int64_t D,
                                                           int64_t i0, const int GN, kv_stream* st) {
#if KVD_AVX512_BF16
    if (bf16 == 1) {
        values_pairs64(a, (const uint16_t*)p, values, table, ctx, block_size, slot_bytes, head, D, i0, GN, st);
        return;
    }
#endif
    values_tile64(a, p, values, table, ctx, block_size, slot_bytes, head, bf16, D, i0, GN, st);
}
#endif

// a[g] = the weighted value sum of head g, for the group's heads: three heads per pass over the values where
// SIMD runs and D is a multiple of 32 (the same arithmetic as weighted_values, head by head, otherwise); over a
// bf16 pool with AVX-512 BF16, by bf16 pair products (the weights p rounded in place).
static inline __attribute__((always_inline)) void group_values(float* a, float* p, const char* values,
                                                                const int32_t* table, int64_t ctx,
                                                                int64_t block_size, int64_t slot_bytes, int64_t head,
                                                                int bf16, int64_t group, const int64_t D,
                                                                kv_stream* st) {
#if KVD_AVX512
    if (D % 64 == 0) {
#if KVD_AVX512_BF16
        if (bf16 == 1)
            for (int64_t g = 0; g < group; g++) numerators_bf16(p + g * ctx, ctx);
#endif
        for (int64_t g = 0; g < group; g += 3)
            for (int64_t i0 = 0; i0 < D; i0 += 64) {
                float* ag = a + g * D;
                const float* pg = p + g * ctx;
                kv_stream* first = g == 0 && i0 == 0 ? st : NULL;  // one stream step per block of the context
                if (group - g >= 3)
                    values64(ag, pg, values, table, ctx, block_size, slot_bytes, head, bf16, D, i0, 3, first);
                else if (group - g == 2)
                    values64(ag, pg, values, table, ctx, block_size, slot_bytes, head, bf16, D, i0, 2, first);
                else
                    values64(ag, pg, values, table, ctx, block_size, slot_bytes, head, bf16, D, i0, 1, first);
            }
        return;
    }
#endif
#if KVD_AVX2
    if (D % 32 == 0) {
        for (int64_t g = 0; g < group; g += 3)
            for (int64_t i0 = 0; i0 < D; i0 += 32) {
                float* ag = a + g * D;
                const float* pg = p + g * ctx;
                kv_stream* first = g == 0 && i0 == 0 ? st : NULL;  // one stream step per block of the context
                if (group - g >= 3)
                    values_tile(ag, pg, values, table, ctx, block_size, slot_bytes, head, bf16, D, i0, 3, first);
                else if (group - g == 2)
                    values_tile(ag, pg, values, table, ctx, block_size, slot_bytes, head, bf16, D, i0, 2, first);
                else
                    values_tile(ag, pg, values, table, ctx, block_size, slot_bytes, head, bf16, D, i0, 1, first);
            }
        return;
    }
#endif
    (void)st;  // head sizes without SIMD value tiles read their values without the stream
    for (int64_t g = 0; g < group; g++)
        weighted_values(a + g * D, p + g * ctx, values, table, ctx, block_size, slot_bytes, head, bf16, D);
}

// One sequence's query heads that share kv head `kvh`: scores over its context, softmax, weighted values.
// work: group x (ctx + 2 D + 1) floats. D is a constant where it is expanded for the common head sizes, so a
// head's query and accumulator rows stay in registers across the context.
static inline __attribute__((always_inline)) void attend_group(
    const void* q, void* out, const char* keys, const char* values, int bf16, int64_t s, int64_t kvh,
    int64_t group, const int64_t D, int64_t q_stride, int64_t H, int64_t block_size, int64_t slot_bytes,
    const int32_t* table, int64_t ctx, float scale, float* work, kv_stream* st) {
    float* scores = work;            // [group, ctx]
    float* qf = work + group * ctx;  // [group, D], pre-scaled
    float* acc = qf + group * D;     // [group, D], then the softmax sums [group]
    const int elem = bf16 ? 2 : 4;
    const int64_t head = kvh * D * elem;
#if KVD_AVX512_BF16
    const int bf16_dots = bf16 && D % 32 == 0 && D <= 128;  // scores from the bf16 q itself (bf16_scores)
#else
    const int bf16_dots = 0;
#endif
    for (int64_t g = 0; g < group && !bf16_dots; g++)
        for (int64_t i = 0; i < D; i++)
            qf[g * D + i] = load_f(q, s * q_stride + (kvh * group + g) * D + i, bf16) * scale;
    // Block by block (the slots of a block are consecutive rows of the pool), every head of the group against
    // a block while its keys are in L1.
#if KVD_AVX512_BF16
    for (int64_t t0 = 0; t0 < ctx && bf16_dots; t0 += block_size) {
        const char* k = keys + (int64_t)table[t0 / block_size] * block_size * slot_bytes + head;
        const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
        const uint16_t* qh = (const uint16_t*)q + s * q_stride + kvh * group * D;
        prefetch_next_block(keys + head, table, t0, ctx, block_size, slot_bytes, D * 2);
        kv_stream_step(st);
        for (int64_t g = 0; g < group; g++) {
            if (g == group / 2) kv_stream_step(st);
            bf16_scores(qh + g * D, k, slot_bytes, n, D, scale, scores + g * ctx + t0);
        }
    }
#endif
    for (int64_t t0 = 0; t0 < ctx && !bf16_dots; t0 += block_size) {
        const char* k = keys + (int64_t)table[t0 / block_size] * block_size * slot_bytes + head;
        const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
        prefetch_next_block(keys + head, table, t0, ctx, block_size, slot_bytes, D * elem);
        kv_stream_step(st);
        for (int64_t g = 0; g < group; g++) {
            if (g == group / 2) kv_stream_step(st);
            float* sc = scores + g * ctx + t0;
            int64_t t = 0;
#if KVD_AVX2
            if (D % 8 == 0)
                for (; t + 8 <= n; t += 8)
                    _mm256_storeu_ps(sc + t, dot_rows8(qf + g * D, k + t * slot_bytes, slot_bytes, bf16, D));
#endif
            for (; t < n; t++) sc[t] = dot_row(qf + g * D, k + t * slot_bytes, bf16, D);
        }
    }
    float* sums = acc + group * D;  // [group]
    for (int64_t g = 0; g < group; g++) sums[g] = softmax_numerators(scores + g * ctx, ctx);
    group_values(acc, scores, values, table, ctx, block_size, slot_bytes, head, bf16, group, D, st ? st + 1 : NULL);
    for (int64_t g = 0; g < group; g++) {
        const float inv = 1.f / sums[g];
        for (int64_t i = 0; i < D; i++) store_f(out, (s * H + kvh * group + g) * D + i, acc[g * D + i] * inv, bf16);
    }
}

// ---- the 8-bit KV pool --------------------------------------------------------------------------------------
//
// Each (slot, kv head) row holds D codes, then the row's float32 scale (its largest magnitude / 127): a value is
// code x scale. Keys hold code + 128 (unsigned, the operand VPDPBUSD takes unsigned), values the signed code. A
// query head is quantized the same way when it attends, so a score is one exact integer dot times two scales,
// and every path (VNNI or plain C) gives the same bits for it.

// codes = x / scale rounded half to even (x x 127 / its largest magnitude); returns the scale (0 for a row of
// zeros, NaN for a row with a NaN, so that it reaches the output as in a float pool).
static float quantize_row8(const void* x, int bf16, int64_t D, int8_t* codes) {
    float mx = 0.f;
    int nan = 0;
#if KVD_AVX512
    if (D % 16 == 0) {  // the same steps 16 at a time (the largest magnitude is the same in any order)
        const int elem = bf16 ? 2 : 4;
        const __m512 sign = _mm512_set1_ps(-0.f);
        __m512 m16 = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 16) {
            const __m512 a = _mm512_andnot_ps(sign, load16((const char*)x + i * elem, bf16));
            nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) != 0;
            m16 = _mm512_max_ps(m16, a);
        }
        mx = _mm512_reduce_max_ps(m16);
        const __m512 inv = _mm512_set1_ps(mx > 0.f && !nan ? 127.f / mx : 0.f);
        const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
        for (int64_t i = 0; i < D; i += 16) {
            const __m512 c = _mm512_roundscale_ps(_mm512_mul_ps(load16((const char*)x + i * elem, bf16), inv),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __mmask16 number = _mm512_cmp_ps_mask(c, c, _CMP_ORD_Q);
            const __m512 clamped = _mm512_maskz_mov_ps(number, _mm512_min_ps(_mm512_max_ps(c, lo), hi));
            _mm_storeu_si128((__m128i*)(codes + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(clamped)));
        }
        return nan ? NAN : mx / 127.f;
    }
#endif
    for (int64_t i = 0; i < D; i++) {
        const float a = fabsf(load_f(x, i, bf16));
        nan |= a != a;
        mx = a > mx ? a : mx;
    }
    const float inv = mx > 0.f && !nan ? 127.f / mx : 0.f;
    for (int64_t i = 0; i < D; i++) {
        const float c = nearbyintf(load_f(x, i, bf16) * inv);
        codes[i] = c != c ? 0 : (int8_t)(c > 127.f ? 127.f : c < -127.f ? -127.f : c);  // NaN (x inf x 0): 0
    }
    return nan ? NAN : mx / 127.f;
}

#if KVD_VNNI512
// Lane j = the sum of v[j]'s sixteen int32 lanes (hsum16x16's steps in integers).
static inline __m512i hsum16x16_epi32(const __m512i* v) {
    __m512i a[8], b[4];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        b[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_epi64(a[2 * i], a[2 * i + 1]));
    const __m512i e0 = _mm512_add_epi32(_mm512_shuffle_i32x4(b[0], b[1], 0x88), _mm512_shuffle_i32x4(b[0], b[1], 0xdd));
    const __m512i e1 = _mm512_add_epi32(_mm512_shuffle_i32x4(b[2], b[3], 0x88), _mm512_shuffle_i32x4(b[2], b[3], 0xdd));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(e0, e1, 0x88), _mm512_shuffle_i32x4(e0, e1, 0xdd));
}
#endif

// sc[t] = (q . key t) x qs x the key's scale for the n keys of one block; q: a query head's codes, qsum their
// sum (the keys' + 128 comes back off as 128 x qsum). The integer sums are below 2^24, so their float32 lanes
// (hsum16x16) are exact.
static inline __attribute__((always_inline)) void int8_scores(const int8_t* q, float qs, int32_t qsum, const char* k,
                                                              int64_t slot_bytes, int64_t n, const int64_t D,
                                                              float* sc) {
    int64_t t = 0;
#if KVD_VNNI512
    if (D % 64 == 0 && D <= 256) {
        __m512i qv[4];
        for (int64_t i = 0; i < D / 64; i++) qv[i] = _mm512_loadu_si512(q + i * 64);
        const __m512 off = _mm512_set1_ps(128.f * (float)qsum), qsv = _mm512_set1_ps(qs);
        const __m512i at = slot_offsets16(slot_bytes);
        for (; t + 16 <= n; t += 16) {
            __m512i acc[16];
            for (int j = 0; j < 16; j++) {
                acc[j] = _mm512_setzero_si512();
                for (int64_t i = 0; i < D / 64; i++)
                    acc[j] = _mm512_dpbusd_epi32(acc[j], _mm512_loadu_si512(k + (t + j) * slot_bytes + i * 64), qv[i]);
            }
            const __m512 scales = _mm512_i32gather_ps(at, k + t * slot_bytes + D, 1);
            const __m512 dots = _mm512_cvtepi32_ps(hsum16x16_epi32(acc));
            _mm512_storeu_ps(sc + t, _mm512_mul_ps(_mm512_sub_ps(dots, off), _mm512_mul_ps(qsv, scales)));
        }
    }
#endif
    for (; t < n; t++) {
        const uint8_t* row = (const uint8_t*)k + t * slot_bytes;
        int32_t dot = 0;
        for (int64_t i = 0; i < D; i++) dot += (int32_t)row[i] * q[i];
        float ks;
        memcpy(&ks, row + D, sizeof ks);
        sc[t] = (float)(dot - 128 * qsum) * (qs * ks);
    }
}

// A query head's codes (quantize_row8), their sum in *qsum; returns its scale times the attention's.
static inline float quantize_query8(const void* qh, int q_bf16, int64_t D, float scale, int8_t* codes, int32_t* qsum) {
    const float qs = quantize_row8(qh, q_bf16, D, codes) * scale;
    int32_t sum = 0;
    for (int64_t i = 0; i < D; i++) sum += codes[i];
    *qsum = sum;
    return qs;
}

// Each softmax weight p[h][t] (nv heads, rows `stride` apart, t < ctx) times value row t's scale (at `scales` in
// its slot, the pool's values + the kv head's row + D).
static inline void value_scales8(float* p, int64_t stride, int64_t nv, const char* scales, const int32_t* table,
                                 int64_t ctx, int64_t block_size, int64_t slot_bytes) {
    for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
        const char* v = scales + (int64_t)table[t0 / block_size] * block_size * slot_bytes;
        const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
        int64_t t = 0;
#if KVD_AVX512
        const __m512i at = slot_offsets16(slot_bytes);
        for (; t + 16 <= n; t += 16) {
            const __m512 vs = _mm512_i32gather_ps(at, v + t * slot_bytes, 1);
            for (int64_t h = 0; h < nv; h++) {
                float* ph = p + h * stride + t0 + t;
                _mm512_storeu_ps(ph, _mm512_mul_ps(_mm512_loadu_ps(ph), vs));
            }
        }
#endif
        for (; t < n; t++) {
            float vs;
            memcpy(&vs, v + t * slot_bytes, sizeof vs);
            for (int64_t h = 0; h < nv; h++) p[h * stride + t0 + t] *= vs;
        }
    }
}

// attend_group over an 8-bit pool (q and out in the model's dtype, q_bf16): quantized query heads, integer
// scores, the softmax, then each weight times its value row's scale before the same weighted sums as a float
// pool's (8-bit codes read as floats).
static inline __attribute__((always_inline)) void attend_group8(
    const void* q, void* out, const char* keys, const char* values, int q_bf16, int64_t s, int64_t kvh,
    int64_t group, const int64_t D, int64_t q_stride, int64_t H, int64_t block_size, int64_t slot_bytes,
    const int32_t* table, int64_t ctx, float scale, float* work, kv_stream* st) {
    float* scores = work;            // [group, ctx]
    float* qf = work + group * ctx;  // [group, D] floats' room: the query codes, their scales and sums
    float* acc = qf + group * D;     // [group, D], then the softmax sums [group]
    int8_t* qc = (int8_t*)qf;
    float* qs = qf + (group * D + 3) / 4;
    int32_t* qsum = (int32_t*)(qs + group);
    const int64_t row = D + KVD_KV8_SCALE_BYTES, head = kvh * row;
    for (int64_t g = 0; g < group; g++) {
        const char* qh = (const char*)q + (s * q_stride + (kvh * group + g) * D) * (q_bf16 ? 2 : 4);
        qs[g] = quantize_query8(qh, q_bf16, D, scale, qc + g * D, &qsum[g]);
    }
    for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
        const char* k = keys + (int64_t)table[t0 / block_size] * block_size * slot_bytes + head;
        const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
        prefetch_next_block(keys + head, table, t0, ctx, block_size, slot_bytes, row);
        kv_stream_step(st);
        for (int64_t g = 0; g < group; g++) {
            if (g == group / 2) kv_stream_step(st);
            int8_scores(qc + g * D, qs[g], qsum[g], k, slot_bytes, n, D, scores + g * ctx + t0);
        }
    }
    float* sums = acc + group * D;  // [group]
    for (int64_t g = 0; g < group; g++) sums[g] = softmax_numerators(scores + g * ctx, ctx);
    value_scales8(scores, ctx, group, values + head + D, table, ctx, block_size, slot_bytes);
    group_values(acc, scores, values, table, ctx, block_size, slot_bytes, head, KV_INT8, group, D, st ? st + 1 : NULL);
    for (int64_t g = 0; g < group; g++) {
        const float inv = 1.f / sums[g];
        for (int64_t i = 0; i < D; i++)
            store_f(out, (s * H + kvh * group + g) * D + i, acc[g * D + i] * inv, q_bf16);
    }
}

#if KVD_AMX
// ---- attention in AMX tiles ------------------------------------------------------------------------------------
//
// Rows of one prompt (one table, contexts c, c + 1, ...) attend in chunks of up to CHUNK_ROWS, every query head of
// the chunk (head v = row x group + its head in the group) against 16 keys at a time in tiles. Over the 8-bit pool
// the tiles' dots are exact integers that then take int8_scores' float steps, and a single row (decode) keeps
// attend_group8; over a bf16 pool every row's scores come from bf16 tiles (decode too, so the same dot whatever
// the chunk). A row's softmax and value sums are those of a row alone, with a block's values widened to floats
// once for the whole chunk: a row's output has the same bits in a chunk as alone.

#define CHUNK_ROWS 16

// Tiles: 0 = A, 1 = B, 2-4 = C (up to three sets of 16 query heads at a time), all 16 rows of 64 bytes. 8-bit
// pool: A = 16 query heads' codes, B = 16 keys' codes in groups of 4; bf16 pool: A = 16 keys in place, B = 16
// query heads in pairs.
static void chunk_tiles_configure(void) {
    tile_config cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 5; t++) cfg.rows[t] = AMX_ROWS, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

// out[d][j] = the d-th 4 bytes of row j of 16 rows `stride` apart (64 bytes each): a 16 x 16 transpose of 32-bit
// words (interleaves of 32 and 64 bits, then 128-bit lanes twice), the layout of a B tile.
static inline void transpose16(const char* rows, int64_t stride, int32_t* out) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(rows + i * stride);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  // r[i + c]: rows i .. i + 3 at word 4 x lane + c
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i v = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), w = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xdd);
        const __m512i v2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
        const __m512i w2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xdd);
        _mm512_storeu_si512(out + c * 16, _mm512_shuffle_i32x4(v, v2, 0x88));
        _mm512_storeu_si512(out + (8 + c) * 16, _mm512_shuffle_i32x4(v, v2, 0xdd));
        _mm512_storeu_si512(out + (4 + c) * 16, _mm512_shuffle_i32x4(w, w2, 0x88));
        _mm512_storeu_si512(out + (12 + c) * 16, _mm512_shuffle_i32x4(w, w2, 0xdd));
    }
}

// a[g] += sum over t < n of p[g][t] x vf[t] (columns i0 .. i0 + 63 of D) for GN heads whose weights lie
// `stride` apart: values_tile64's fma chain per element, carried in a between blocks.
static inline __attribute__((always_inline)) void chunk_values64(float* a, const float* p, int64_t stride,
                                                                 const float* vf, int64_t n, const int64_t D,
                                                                 int64_t i0, const int GN) {
    __m512 acc[3][4];
    for (int g = 0; g < GN; g++)
        for (int i = 0; i < 4; i++) acc[g][i] = _mm512_loadu_ps(a + g * D + i0 + i * 16);
    for (int64_t t = 0; t < n; t++) {
        const float* row = vf + t * D + i0;
        const __m512 v0 = _mm512_loadu_ps(row), v1 = _mm512_loadu_ps(row + 16);
        const __m512 v2 = _mm512_loadu_ps(row + 32), v3 = _mm512_loadu_ps(row + 48);
        for (int g = 0; g < GN; g++) {
            const __m512 pv = _mm512_set1_ps(p[g * stride + t]);
            acc[g][0] = _mm512_fmadd_ps(pv, v0, acc[g][0]);
            acc[g][1] = _mm512_fmadd_ps(pv, v1, acc[g][1]);
            acc[g][2] = _mm512_fmadd_ps(pv, v2, acc[g][2]);
            acc[g][3] = _mm512_fmadd_ps(pv, v3, acc[g][3]);
        }
    }
    for (int g = 0; g < GN; g++)
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(a + g * D + i0 + i * 16, acc[g][i]);
}

// The 8-bit pool's scores of nv query heads (codes qc [sets x 16][D], zero rows past nv; scales qs, offsets qoff =
// 128 x their codes' sum) over keys t < ctx, into scores [nv][ctx]: int8 tiles of 16 query heads x 16 keys (B
// from bt, transposed keys), then (dot - qoff) x (qs x the key's scale) as int8_scores.
static inline __attribute__((always_inline)) void chunk_scores8(const int8_t* qc, const float* qs, const float* qoff,
                                                                int64_t nv, const char* keys, int64_t head,
                                                                const int32_t* table, int64_t ctx, int64_t block_size,
                                                                int64_t slot_bytes, const int64_t D, float* scores,
                                                                int64_t stride, int32_t* ct, int32_t* bt) {
    const int64_t sets = (nv + AMX_ROWS - 1) / AMX_ROWS;
    const __m512i at = slot_offsets16(slot_bytes);
    for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
        const char* k = keys + (int64_t)table[t0 / block_size] * block_size * slot_bytes + head;
        const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
        prefetch_next_block(keys + head, table, t0, ctx, block_size, slot_bytes, D + KVD_KV8_SCALE_BYTES);
        for (int64_t u = 0; u < n; u += 16) {  // the keys of a block past n are read, never stored
            const char* ku = k + u * slot_bytes;
            for (int64_t kk = 0; kk < D / 64; kk++) transpose16(ku + kk * 64, slot_bytes, bt + kk * 256);
            const __m512 ks = _mm512_i32gather_ps(at, ku + D, 1);
            const __mmask16 live = live_keys(n, u);
            for (int64_t j0 = 0; j0 < sets; j0 += 3) {
                const int64_t js = sets - j0 < 3 ? sets - j0 : 3;
                const int8_t* a = qc + j0 * AMX_ROWS * D;
                _tile_zero(2);
                if (js > 1) _tile_zero(3);
                if (js > 2) _tile_zero(4);
                for (int64_t kk = 0; kk < D / 64; kk++) {
                    _tile_loadd(1, bt + kk * 256, 64);
                    _tile_loadd(0, a + kk * 64, D);
                    _tile_dpbsud(2, 0, 1);
                    if (js > 1) {
                        _tile_loadd(0, a + AMX_ROWS * D + kk * 64, D);
                        _tile_dpbsud(3, 0, 1);
                    }
                    if (js > 2) {
                        _tile_loadd(0, a + 2 * AMX_ROWS * D + kk * 64, D);
                        _tile_dpbsud(4, 0, 1);
                    }
                }
                _tile_stored(2, ct, 64);
                if (js > 1) _tile_stored(3, ct + 256, 64);
                if (js > 2) _tile_stored(4, ct + 512, 64);
                const int64_t end = (j0 + js) * AMX_ROWS < nv ? (j0 + js) * AMX_ROWS : nv;
                for (int64_t v = j0 * AMX_ROWS; v < end; v++) {
                    const __m512 dots = _mm512_cvtepi32_ps(_mm512_loadu_si512(ct + (v - j0 * AMX_ROWS) * 16));
                    const __m512 sc = _mm512_mul_ps(_mm512_sub_ps(dots, _mm512_set1_ps(qoff[v])),
                                                    _mm512_mul_ps(_mm512_set1_ps(qs[v]), ks));
                    _mm512_mask_storeu_ps(scores + v * stride + t0 + u, live, sc);
                }
            }
        }
    }
}

#if KVD_AMX_BF16
// A bf16 pool's scores: scale x (query head v . key t) for nv query heads (bq: B tiles [sets][D / 32] of 16 heads'
// pairs) over keys t < ctx, into scores [nv][stride]. A tile product of 16 keys (A, in place in the pool) x 16 heads,
// D / 32 of them summed in the tile in order, then turned to [head][key]: a query's dot with a key depends on
// the two alone.
static inline __attribute__((always_inline)) void chunk_scores16(const int32_t* bq, int64_t nv, const char* keys,
                                                                 int64_t head, const int32_t* table, int64_t ctx,
                                                                 int64_t block_size, int64_t slot_bytes,
                                                                 const int64_t D, float scale, float* scores,
                                                                 int64_t stride, int32_t* ct, kv_stream* st) {
    const int64_t sets = (nv + AMX_ROWS - 1) / AMX_ROWS, ksteps = D / 32;
    const __m512 sv = _mm512_set1_ps(scale);
    int32_t* tr = ct + 3 * 256;
    for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
        const char* k = keys + (int64_t)table[t0 / block_size] * block_size * slot_bytes + head;
        const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
        prefetch_next_block(keys + head, table, t0, ctx, block_size, slot_bytes, D * 2);
        kv_stream_step(st);
        for (int64_t u = 0; u < n; u += 16) {
            const __mmask16 live = live_keys(n, u);
            for (int64_t j0 = 0; j0 < sets; j0 += 3) {
                const int64_t js = sets - j0 < 3 ? sets - j0 : 3;
                _tile_zero(2);
                if (js > 1) _tile_zero(3);
                if (js > 2) _tile_zero(4);
                for (int64_t kk = 0; kk < ksteps; kk++) {
                    _tile_loadd(0, k + u * slot_bytes + kk * 64, slot_bytes);
                    _tile_loadd(1, bq + (j0 * ksteps + kk) * 256, 64);
                    _tile_dpbf16ps(2, 0, 1);
                    if (js > 1) {
                        _tile_loadd(1, bq + ((j0 + 1) * ksteps + kk) * 256, 64);
                        _tile_dpbf16ps(3, 0, 1);
                    }
                    if (js > 2) {
                        _tile_loadd(1, bq + ((j0 + 2) * ksteps + kk) * 256, 64);
                        _tile_dpbf16ps(4, 0, 1);
                    }
                }
                if (u == 0 && j0 == 0) kv_stream_step(st);
                _tile_stored(2, ct, 64);
                if (js > 1) _tile_stored(3, ct + 256, 64);
                if (js > 2) _tile_stored(4, ct + 512, 64);
                for (int64_t j = 0; j < js; j++) {
                    transpose16((const char*)(ct + j * 256), 64, tr);
                    const int64_t v0 = (j0 + j) * AMX_ROWS, lanes = nv - v0 < AMX_ROWS ? nv - v0 : AMX_ROWS;
                    for (int64_t i = 0; i < lanes; i++)
                        _mm512_mask_storeu_ps(scores + (v0 + i) * stride + t0 + u, live,
                                              _mm512_mul_ps(_mm512_castsi512_ps(_mm512_loadu_si512(tr + i * 16)), sv));
                }
            }
        }
    }
}
#endif

#define KVD_TILE_VALUES (KVD_AMX_BF16 && KVD_AVX512_BF16)
#if KVD_TILE_VALUES
// acc [nv][D] = P x V over a bf16 pool in tiles, for nv query heads (row v's context ctx0 + v / group, weights
// p [nv][stride] for its keys, the rest ignored): A = 16 heads' weights rounded to bf16 (pa [sets x 16][lp], zero
// past each context), B = 32 keys x 16 columns in pairs (vb [lp / 32][D / 16][512], zero past ctx), each sum one
// tile accumulation over the keys in order, whatever the other rows (batch invariance). A decode row alone takes
// this path too, so a key's weight is rounded the same way in every chunk.
static inline __attribute__((always_inline)) void chunk_values16(float* acc, const float* p, int64_t stride,
                                                                 int64_t nv, int64_t group, int64_t ctx0,
                                                                 const char* values, int64_t head,
                                                                 const int32_t* table, int64_t ctx,
                                                                 int64_t block_size, int64_t slot_bytes,
                                                                 const int64_t D, uint16_t* pa, uint16_t* vb,
                                                                 float* ct, kv_stream* st) {
    const int64_t sets = (nv + AMX_ROWS - 1) / AMX_ROWS, lp = (ctx + 31) / 32 * 32, slices = D / 16;
    for (int64_t v = 0; v < sets * AMX_ROWS; v++) {
        const int64_t n = v < nv ? ctx0 + v / group : 0;
        for (int64_t t = 0; t < lp; t += 16) {
            const __mmask16 live = t >= n ? 0 : live_keys(n, t);
            _mm256_storeu_si256((__m256i*)(pa + v * lp + t), (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(live, p + v * stride + t)));
        }
    }
    // A pair of keys' rows interleaved, 32 columns at a time: unpacklo gives slice 2 z, unpackhi slice 2 z + 1.
    for (int64_t t0 = 0; t0 < lp; t0 += block_size) {
        const char* vblock = values + (int64_t)table[t0 / block_size < (ctx + block_size - 1) / block_size ? t0 / block_size : 0] * block_size * slot_bytes + head;
        prefetch_next_block(values + head, table, t0, ctx, block_size, slot_bytes, D * 2);
        kv_stream_step(st);
        for (int64_t t = t0; t < t0 + block_size && t < lp; t += 2) {
            if (t == t0 + block_size / 2) kv_stream_step(st);
            uint16_t* row = vb + (t / 32 * slices * 16 + t % 32 / 2) * 32;
            for (int64_t z = 0; z < D / 32; z++) {
                const __m512i a = t < ctx ? _mm512_loadu_si512(vblock + (t - t0) * slot_bytes + z * 64) : _mm512_setzero_si512();
                const __m512i b = t + 1 < ctx ? _mm512_loadu_si512(vblock + (t + 1 - t0) * slot_bytes + z * 64) : _mm512_setzero_si512();
                _mm512_storeu_si512(row + 2 * z * 512, _mm512_unpacklo_epi16(a, b));
                _mm512_storeu_si512(row + (2 * z + 1) * 512, _mm512_unpackhi_epi16(a, b));
            }
        }
    }
    for (int64_t c = 0; c < slices; c++)
        for (int64_t j0 = 0; j0 < sets; j0 += 3) {
            const int64_t js = sets - j0 < 3 ? sets - j0 : 3;
            _tile_zero(2);
            if (js > 1) _tile_zero(3);
            if (js > 2) _tile_zero(4);
            for (int64_t kt = 0; kt < lp / 32; kt++) {
                _tile_loadd(1, vb + (kt * slices + c) * 512, 64);
                _tile_loadd(0, pa + j0 * AMX_ROWS * lp + kt * 32, lp * 2);
                _tile_dpbf16ps(2, 0, 1);
                if (js > 1) {
                    _tile_loadd(0, pa + (j0 + 1) * AMX_ROWS * lp + kt * 32, lp * 2);
                    _tile_dpbf16ps(3, 0, 1);
                }
                if (js > 2) {
                    _tile_loadd(0, pa + (j0 + 2) * AMX_ROWS * lp + kt * 32, lp * 2);
                    _tile_dpbf16ps(4, 0, 1);
                }
            }
            _tile_stored(2, ct, 64);
            if (js > 1) _tile_stored(3, ct + 256, 64);
            if (js > 2) _tile_stored(4, ct + 512, 64);
            for (int64_t j = 0; j < js; j++)
                for (int64_t r = 0; r < AMX_ROWS && (j0 + j) * AMX_ROWS + r < nv; r++)
                    memcpy(acc + ((j0 + j) * AMX_ROWS + r) * D + c * 16, ct + j * 256 + r * 16, 64);
        }
    for (int64_t v = 0; v < nv; v++)
        for (int64_t i0 = 0; i0 < D; i0 += 32) {
            __m512 x = _mm512_loadu_ps(acc + v * D + i0), y = _mm512_loadu_ps(acc + v * D + i0 + 16);
            unpacked_order(&x, &y);
            _mm512_storeu_ps(acc + v * D + i0, x);
            _mm512_storeu_ps(acc + v * D + i0 + 16, y);
        }
}

// Whether the bf16 values of keys [from, to) (one kv head) are all finite: a chunk's rows share value tiles, and a
// row's zero weight times a later row's infinite value would be NaN where the row alone never reads that key.
static inline int values_finite(const char* values, int64_t head, const int32_t* table, int64_t from, int64_t to,
                                int64_t block_size, int64_t slot_bytes, const int64_t D) {
    const __m512i exponent = _mm512_set1_epi16(0x7f80);  // all ones: infinity or NaN
    __mmask32 bad = 0;
    for (int64_t t = from; t < to; t++) {
        const char* row = values + ((int64_t)table[t / block_size] * block_size + t % block_size) * slot_bytes + head;
        for (int64_t i = 0; i < D; i += 32)
            bad |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(_mm512_loadu_si512(row + i * 2), exponent), exponent);
    }
    return !bad;
}
#endif

// Bytes of chunk work for contexts up to `longest`.
static int64_t chunk_work_bytes(int64_t group, int64_t D, int64_t longest, int64_t block_size) {
    const int64_t nv = CHUNK_ROWS * group, sets = (nv + AMX_ROWS - 1) / AMX_ROWS, lp = (longest + 31) / 32 * 32;
    const int64_t floats = nv * (longest + 15 + D + 3) + block_size * D;  // scores, sums, scales, a block's values
    const int64_t tiles = sets * AMX_ROWS * lp * 2 + lp * D * 2;          // P and V in bf16 tiles
    return 4 * floats + sets * AMX_ROWS * D * 2 + (sets * D / 32 + 4) * 1024 + tiles + 128;
}

// attend_group (kind 1: bf16 q and pool) or attend_group8 (KV_INT8, q in q_bf16's dtype) for `rows` consecutive
// rows from s0 (contexts ctx0, ctx0 + 1, ...) of one table and kv head kvh.
static inline __attribute__((always_inline)) void attend_chunk(
    const void* q, void* out, const char* keys, const char* values, int kind, int q_bf16, int64_t s0, int64_t rows,
    int64_t kvh, int64_t group, const int64_t D, int64_t q_stride, int64_t H, int64_t block_size,
    int64_t slot_bytes, const int32_t* table, int64_t ctx0, float scale, char* work, kv_stream* st) {
    const int64_t nv = rows * group, sets = (nv + AMX_ROWS - 1) / AMX_ROWS, ctx = ctx0 + rows - 1;
    const int64_t row = kind == KV_INT8 ? D + KVD_KV8_SCALE_BYTES : D * 2, head = kvh * row;
    const int64_t L = rows == 1 ? ctx : (ctx + 15) / 16 * 16;  // from one head's scores to the next
    int32_t* ct = (int32_t*)(((uintptr_t)work + 63) & ~(uintptr_t)63);  // [4][16][16]: C tiles, a transpose
    int32_t* bt = ct + 4 * 256;                                           // B tiles: [sets][D / 32][16][16]
    float* scores = (float*)(bt + sets * D / 32 * 256);                   // [nv][L]
    float* acc = scores + nv * L;                                         // [nv][D]
    float *qs = acc + nv * D, *qoff = qs + nv, *sums = qoff + nv;         // [nv] each
    float* vf = sums + nv;                                                // [block_size][D]: a block's values
    char* qc = (char*)(vf + block_size * D);                              // [sets x 16][D]: query heads
    const int64_t q_elem = q_bf16 ? 2 : 4, code_bytes = kind == KV_INT8 ? 1 : 2;
    memset(qc + nv * D * code_bytes, 0, (size_t)((sets * AMX_ROWS - nv) * D * code_bytes));
    for (int64_t v = 0; v < nv; v++) {
        const char* qh = (const char*)q + ((s0 + v / group) * q_stride + (kvh * group + v % group) * D) * q_elem;
        if (kind != KV_INT8) {
            memcpy(qc + v * D * 2, qh, (size_t)(D * 2));
            continue;
        }
        int32_t qsum;
        qs[v] = quantize_query8(qh, q_bf16, D, scale, (int8_t*)qc + v * D, &qsum);
        qoff[v] = 128.f * (float)qsum;
    }
    if (kind == KV_INT8) chunk_scores8((const int8_t*)qc, qs, qoff, nv, keys, head, table, ctx, block_size,
                                       slot_bytes, D, scores, L, ct, bt);
#if KVD_AMX_BF16
    else {
        for (int64_t j = 0; j < sets; j++)
            for (int64_t kk = 0; kk < D / 32; kk++)
                transpose16(qc + (j * AMX_ROWS * D + kk * 32) * 2, D * 2, bt + (j * D / 32 + kk) * 256);
        chunk_scores16(bt, nv, keys, head, table, ctx, block_size, slot_bytes, D, scale, scores, L, ct, st);
    }
#endif
    for (int64_t v = 0; v < nv; v++) sums[v] = softmax_numerators(scores + v * L, ctx0 + v / group);
    if (kind == KV_INT8) value_scales8(scores, L, nv, values + head + D, table, ctx, block_size, slot_bytes);
#if KVD_TILE_VALUES
    if (kind != KV_INT8) {
        uint16_t* pa = (uint16_t*)(((uintptr_t)(qc + sets * AMX_ROWS * D * 2) + 63) & ~(uintptr_t)63);
        uint16_t* vb = pa + sets * AMX_ROWS * ((ctx + 31) / 32 * 32);
        if (values_finite(values, head, table, ctx0, ctx, block_size, slot_bytes, D))
            chunk_values16(acc, scores, L, nv, group, ctx0, values, head, table, ctx, block_size, slot_bytes, D, pa,
                           vb, (float*)ct, st ? st + 1 : NULL);
        else  // row by row, as each would be alone
            for (int64_t r = 0; r < rows; r++)
                chunk_values16(acc + r * group * D, scores + r * group * L, L, group, group, ctx0 + r, values, head,
                               table, ctx0 + r, block_size, slot_bytes, D, pa, vb, (float*)ct, NULL);
    } else
#endif
    if (rows == 1) {  // a row alone: attend_group's pass over the values, streaming the next sequence
        group_values(acc, scores, values, table, ctx, block_size, slot_bytes, head, kind, group, D, st ? st + 1 : NULL);
    } else {
        memset(acc, 0, sizeof(float) * (size_t)(nv * D));
        for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
            const char* vb = values + (int64_t)table[t0 / block_size] * block_size * slot_bytes + head;
            const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
            prefetch_next_block(values + head, table, t0, ctx, block_size, slot_bytes, row);
            for (int64_t t = 0; t < n; t++)
                for (int64_t i = 0; i < D; i += 16)
                    _mm512_storeu_ps(vf + t * D + i, load16(vb + t * slot_bytes + i * code_bytes, kind));
            for (int64_t r = 0; r < rows; r++) {
                const int64_t m = ctx0 + r - t0 < n ? ctx0 + r - t0 : n;  // the row's keys in this block
                for (int64_t g = 0; g < group && m > 0; g += 3)
                    for (int64_t i0 = 0; i0 < D; i0 += 64) {
                        float* a = acc + (r * group + g) * D;
                        const float* p = scores + (r * group + g) * L + t0;
                        if (group - g >= 3)
                            chunk_values64(a, p, L, vf, m, D, i0, 3);
                        else if (group - g == 2)
                            chunk_values64(a, p, L, vf, m, D, i0, 2);
                        else
                            chunk_values64(a, p, L, vf, m, D, i0, 1);
                    }
            }
        }
    }
    for (int64_t v = 0; v < nv; v++) {
        const float inv = 1.f / sums[v];
        const int64_t s = s0 + v / group, g = v % group;
        for (int64_t i = 0; i < D; i++) store_f(out, (s * H + kvh * group + g) * D + i, acc[v * D + i] * inv, q_bf16);
    }
}
#endif

// The longest of the S contexts, or -1 when a context length or a block table entry it covers is out of range
// (lengths in [1, table_width x block_size], entries in [0, num_blocks)).
static int64_t checked_max_context(const int32_t* tables, int64_t table_width, const int32_t* lens, int64_t S,
                                   int64_t num_blocks, int64_t block_size) {
    int64_t longest = 0;
    for (int64_t s = 0; s < S; s++) {
        const int64_t ctx = lens[s];
        if (ctx < 1 || ctx > table_width * block_size) return -1;
        for (int64_t b = 0; b < (ctx + block_size - 1) / block_size; b++) {
            const int32_t block = tables[s * table_width + b];
            if (block < 0 || block >= num_blocks) return -1;
        }
        longest = ctx > longest ? ctx : longest;
    }
    return longest;
}

// Rows that attend together: runs of up to `most` consecutive rows of one prompt (the same blocks, contexts c,
// c + 1, ...), run u from row first[u], count[u] rows. Returns the number of runs.
static int64_t row_runs(const int32_t* tables, int64_t width, const int32_t* lens, int64_t S, int64_t block_size,
                        int64_t most, int64_t* first, int64_t* count) {
    int64_t runs = 0;
    for (int64_t s = 0; s < S; s++) {
        if (runs && count[runs - 1] < most && lens[s] == lens[s - 1] + 1 &&
            !memcmp(tables + s * width, tables + first[runs - 1] * width,
                    sizeof(int32_t) * (size_t)((lens[s] + block_size - 1) / block_size))) {
            count[runs - 1]++;
            continue;
        }
        first[runs] = s, count[runs] = 1, runs++;
    }
    return runs;
}

int kvd_paged_attention(const void* q, int64_t q_stride, void* out, const void* pool, int bf16, int kv8,
                               int64_t num_blocks, int64_t block_size, int64_t kv_heads, int64_t D, int64_t S,
                               int64_t H, const int32_t* block_tables, int64_t table_width,
                               const int32_t* context_lens, float scale, int nthreads) {
    const int64_t longest = checked_max_context(block_tables, table_width, context_lens, S, num_blocks, block_size);
    if (longest < 0) return KVD_BAD_INDEX;
    const int64_t group = H / kv_heads;
    const int64_t slot_bytes = kv_heads * (kv8 ? D + KVD_KV8_SCALE_BYTES : D * (bf16 ? 2 : 4));
    const char* keys = pool;
    const char* values = keys + num_blocks * block_size * slot_bytes;
    int64_t* first = malloc(sizeof(int64_t) * (size_t)(2 * S + 1));  // + 1: never malloc(0)
    if (!first) return KVD_OUT_OF_MEMORY;
    int64_t *count = first + S, most = 1;
    // Tiles (attend_chunk): over the 8-bit pool for chunks of a prompt's rows, over a bf16 pool for every row.
    int tiles = 0;
#if KVD_AMX
    tiles = D % 64 == 0 && block_size % 16 == 0 && (kv8 ? D <= 256 : bf16 && KVD_AMX_BF16) && amx_permitted();
    if (tiles) most = CHUNK_ROWS;
#endif
    const int64_t units = row_runs(block_tables, table_width, context_lens, S, block_size, most, first, count);
    tiles &= units < S || !kv8;
    size_t work_bytes = sizeof(float) * (size_t)(group * (longest + 2 * D + 1));
#if KVD_AMX
    if (tiles && (size_t)chunk_work_bytes(group, D, longest, block_size) > work_bytes)
        work_bytes = (size_t)chunk_work_bytes(group, D, longest, block_size);
#endif
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        // One work area per thread, for the longest context: no allocation per (sequence, head).
        float* work = malloc(work_bytes);
        failed |= !work;
#if KVD_AMX
        if (tiles) chunk_tiles_configure();
#endif
        // A unit's kv heads in one item, so one thread reads its blocks (each slot holds every kv head) while
        // they are in its cache; a head to an item where there are too few units to keep every thread busy.
        // Round robin: a prompt's rows have contexts 1, 2, ..., so contiguous halves would split the work 1:3.
        const int64_t per_item = units >= 4 * nthreads ? kv_heads : 1;
#ifdef _OPENMP
        const int64_t team = omp_get_num_threads();
#else
        const int64_t team = 1;
#endif
#pragma omp for schedule(static, 1)
        for (int64_t item = 0; item < units * kv_heads / per_item; item++) {
            // A thread's next item is `team` on (schedule static, 1). Rows of one prompt (prefill) share their
            // first block, and those blocks are in the cache already.
            kv_stream streams[2], *st = NULL;
            if (per_item == kv_heads && item + team < units && count[item] == 1) {
                const int32_t *now = block_tables + first[item] * table_width;
                const int32_t* next = block_tables + first[item + team] * table_width;
                if (next[0] != now[0]) {
                    kv_streams(streams, keys, values, next,
                               context_lens[first[item + team] + count[item + team] - 1],
                               (context_lens[first[item]] + block_size - 1) / block_size, kv_heads, block_size,
                               block_size * slot_bytes);
                    st = streams;
                }
            }
            for (int64_t j = item * per_item; j < (item + 1) * per_item; j++) {
                const int64_t u = j / kv_heads, s = first[u], kvh = j % kv_heads;
                if (!work) continue;
                const int32_t* table = block_tables + s * table_width;
                // Head size and dtype as constants for the common cases, so the inner loops keep no branches.
#define ATTEND(HEAD_DIM, BF16)                                                                                   \
    attend_group(q, out, keys, values, BF16, s, kvh, group, HEAD_DIM, q_stride, H, block_size, slot_bytes, table, \
                 context_lens[s], scale, work, st)
#define ATTEND8(HEAD_DIM, BF16)                                                                        \
    attend_group8(q, out, keys, values, BF16, s, kvh, group, HEAD_DIM, q_stride, H, block_size, slot_bytes,  \
                  table, context_lens[s], scale, work, st)
#define ATTEND_CHUNK(HEAD_DIM, KIND, Q_BF16)                                                                  \
    attend_chunk(q, out, keys, values, KIND, Q_BF16, s, count[u], kvh, group, HEAD_DIM, q_stride, H, block_size, \
                 slot_bytes, table, context_lens[s], scale, (char*)work, st)
#if KVD_AMX
                if (tiles && !kv8 && D == 64)
                    ATTEND_CHUNK(64, 1, 1);
                else if (tiles && !kv8 && D == 128)
                    ATTEND_CHUNK(128, 1, 1);
                else if (tiles && !kv8)
                    ATTEND_CHUNK(D, 1, 1);
                else if (tiles && count[u] > 1 && D == 64)
                    bf16 ? ATTEND_CHUNK(64, KV_INT8, 1) : ATTEND_CHUNK(64, KV_INT8, 0);
                else if (tiles && count[u] > 1 && D == 128)
                    bf16 ? ATTEND_CHUNK(128, KV_INT8, 1) : ATTEND_CHUNK(128, KV_INT8, 0);
                else if (tiles && count[u] > 1)
                    ATTEND_CHUNK(D, KV_INT8, bf16);
                else
#endif
                if (kv8 && D == 64)
                    bf16 ? ATTEND8(64, 1) : ATTEND8(64, 0);
                else if (kv8 && D == 128)
                    bf16 ? ATTEND8(128, 1) : ATTEND8(128, 0);
                else if (kv8)
                    ATTEND8(D, bf16);
                else if (D == 64)
                    bf16 ? ATTEND(64, 1) : ATTEND(64, 0);
                else if (D == 128)
                    bf16 ? ATTEND(128, 1) : ATTEND(128, 0);
                else
                    ATTEND(D, bf16);
#undef ATTEND
#undef ATTEND8
#undef ATTEND_CHUNK
            }
        }
#if KVD_AMX
        if (tiles) _tile_release();
#endif
        free(work);
    }
    free(first);
    return failed ? KVD_OUT_OF_MEMORY : KVD_OK;
}

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

void kvd_silu_mul(const void* gate, const void* up, int64_t stride, void* out, int64_t T, int64_t I, int bf16,
                  int nthreads) {
    const int elem = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * I >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const char* g = (const char*)gate + t * stride * elem;
        const char* u = (const char*)up + t * stride * elem;
        char* o = (char*)out + t * I * elem;
        int64_t i = 0;
#if KVD_AVX512
        for (; i + 16 <= I; i += 16) {
            __m512 s = silu16(load16(g + i * elem, bf16));
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
            const __m256 s = round8(silu8(load8(g + i * elem, bf16)), bf16);
            store8(o + i * elem, _mm256_mul_ps(s, load8(u + i * elem, bf16)), bf16);
        }
#endif
        for (; i < I; i++) {
            const float sj = silu(load_f(g, i, bf16));
            store_f(o, i, (bf16 ? bf16_to_f32(f32_to_bf16(sj)) : sj) * load_f(u, i, bf16), bf16);
        }
    }
}

// ---- K/V store and rotary embedding --------------------------------------------------------------------------

// Whether every slot lies in [-1, num_slots) and every position in [0, num_positions).
static int indices_in_range(const int64_t* idx, int64_t T, int64_t low, int64_t end) {
    for (int64_t t = 0; t < T; t++)
        if (idx[t] < low || idx[t] >= end) return 0;
    return 1;
}

int kvd_store_kv(const void* k, int64_t k_stride, const void* v, int64_t v_stride, void* pool, int bf16, int kv8,
                 int64_t num_slots, int64_t kv_heads, int64_t D, const int64_t* slots, int64_t T) {
    if (!indices_in_range(slots, T, -1, num_slots)) return KVD_BAD_INDEX;
    const int elem = bf16 ? 2 : 4;
    const int64_t bytes = kv_heads * (kv8 ? D + KVD_KV8_SCALE_BYTES : D * elem);
    char* keys = pool;
    char* values = keys + num_slots * bytes;
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        const char *kt = (const char*)k + t * k_stride * elem, *vt = (const char*)v + t * v_stride * elem;
        char *kd = keys + slots[t] * bytes, *vd = values + slots[t] * bytes;
        if (!kv8) {
            memcpy(kd, kt, (size_t)bytes);
            memcpy(vd, vt, (size_t)bytes);
            continue;
        }
        for (int64_t h = 0; h < kv_heads; h++) {
            int8_t* kc = (int8_t*)kd + h * (D + KVD_KV8_SCALE_BYTES);
            int8_t* vc = (int8_t*)vd + h * (D + KVD_KV8_SCALE_BYTES);
            const float ks = quantize_row8(kt + h * D * elem, bf16, D, kc);
            const float vs = quantize_row8(vt + h * D * elem, bf16, D, vc);
            for (int64_t i = 0; i < D; i++) ((uint8_t*)kc)[i] = (uint8_t)(kc[i] + 128);  // unsigned (int8_scores)
            memcpy(kc + D, &ks, sizeof ks);
            memcpy(vc + D, &vs, sizeof vs);
        }
    }
    return KVD_OK;
}

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

// x * cos + roll(x, D / 2) * sin, each product and the sum rounded in x's dtype as torch computes them. Element
// i and i + D / 2 read each other, so each pair is rotated together, in place.
int kvd_rotary(void* x, int64_t stride, int bf16, int64_t T, int64_t heads, int64_t D, const void* cos_sin,
               int64_t num_positions, const int64_t* positions, int nthreads) {
    if (!indices_in_range(positions, T, 0, num_positions)) return KVD_BAD_INDEX;
    const int64_t half = D / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 1)
    for (int64_t t = 0; t < T; t++) {
        const int64_t row = positions[t] * 2 * D;
        for (int64_t h = 0; h < heads; h++) {
            const int64_t base = t * stride + h * D;
            int64_t i = 0;
#if KVD_AVX2
            const int elem = bf16 ? 2 : 4;
            for (; i + 8 <= half; i += 8)
                rotate8((char*)x + (base + i) * elem, (const char*)cos_sin + (row + i) * elem, bf16, D, half);
#endif
            for (; i < half; i++) {
                const float lo = load_f(x, base + i, bf16), hi = load_f(x, base + i + half, bf16);
                float prod[4] = {lo * load_f(cos_sin, row + i, bf16), hi * load_f(cos_sin, row + D + i, bf16),
                                 hi * load_f(cos_sin, row + i + half, bf16),
                                 lo * load_f(cos_sin, row + D + i + half, bf16)};
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

// The indices are checked once, before layer 0 writes anything; after that only memory can run out.
int kvd_decode_layers(const kvd_shape* m, const kvd_layer* layers, int64_t num_layers, void* hidden,
                      void* residual, int64_t S, const void* cos_sin, const int64_t* positions,
                      const int64_t* slots, const int32_t* tables, int64_t table_width, const int32_t* lens,
                      int nthreads) {
    const int64_t num_slots = m->num_blocks * m->block_size;
    if (checked_max_context(tables, table_width, lens, S, m->num_blocks, m->block_size) < 0 ||
        !indices_in_range(slots, S, -1, num_slots) || !indices_in_range(positions, S, 0, m->num_positions))
        return KVD_BAD_INDEX;
    const int bf16 = m->bf16;
    const size_t elem = bf16 ? 2 : 4;
    const int64_t D = m->head_dim, q_size = m->heads * D, kv_size = m->kv_heads * D;
    const int64_t qkv_size = q_size + 2 * kv_size, I = m->intermediate;
    char* x = malloc(elem * (size_t)(S * m->hidden));
    char* qkv = malloc(elem * (size_t)(S * qkv_size));
    char* att = malloc(elem * (size_t)(S * q_size));
    char* gate_up = malloc(elem * (size_t)(S * 2 * I));
    char* act = malloc(elem * (size_t)(S * I));
    int failed = !x || !qkv || !att || !gate_up || !act;
    for (int64_t l = 0; l < num_layers && !failed; l++) {
        const kvd_layer* L = layers + l;
        kvd_add_rms_norm(hidden, residual, L->input_norm, x, S, m->hidden, m->eps, bf16, nthreads);
        failed |= kvd_linear(&L->qkv, x, bf16, S, qkv, bf16, nthreads) != KVD_OK;
        char *q = qkv, *k = qkv + q_size * elem, *v = k + kv_size * elem;
        if (L->q_norm) {
            kvd_rms_norm(q, qkv_size, q, qkv_size, S, m->heads, D, L->q_norm, m->eps, bf16);
            kvd_rms_norm(k, qkv_size, k, qkv_size, S, m->kv_heads, D, L->k_norm, m->eps, bf16);
        }
        // The k heads follow the q heads in a qkv row: one pass rotates both.
        kvd_rotary(q, qkv_size, bf16, S, m->heads + m->kv_heads, D, cos_sin, m->num_positions, positions, nthreads);
        kvd_store_kv(k, qkv_size, v, qkv_size, L->kv_cache, bf16, m->kv8, num_slots, m->kv_heads, D, slots, S);
        failed |= kvd_paged_attention(q, qkv_size, att, L->kv_cache, bf16, m->kv8, m->num_blocks, m->block_size,
                                      m->kv_heads, D, S, m->heads, tables, table_width, lens, m->scale,
                                      nthreads) != KVD_OK;
        failed |= kvd_linear(&L->o, att, bf16, S, hidden, bf16, nthreads) != KVD_OK;
        kvd_add_rms_norm(hidden, residual, L->post_attention_norm, x, S, m->hidden, m->eps, bf16, nthreads);
        failed |= kvd_linear(&L->gate_up, x, bf16, S, gate_up, bf16, nthreads) != KVD_OK;
        kvd_silu_mul(gate_up, gate_up + I * elem, 2 * I, act, S, I, bf16, nthreads);
        failed |= kvd_linear(&L->down, act, bf16, S, hidden, bf16, nthreads) != KVD_OK;
    }
    free(x);
    free(qkv);
    free(att);
    free(gate_up);
    free(act);
    return failed ? KVD_OUT_OF_MEMORY : KVD_OK;
}

// ---- dequantization ---------------------------------------------------------------------------------------------

// For the matmuls of many rows (prefill), where a float GEMM on the dequantized weight beats the integer dot
// products.
int kvd_dequantize(const kvd_weight* w, int64_t first, int64_t count, void* out, int out_bf16, int nthreads) {
    if (first < 0 || count < 0 || first + count > w->n) return KVD_BAD_INDEX;
    const int64_t K = w->k, nb = K / QBLOCK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = first; n < first + count; n++) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t* p = block_at(w, n, b);
            const float d = f16_to_f32(w->d[scale_at(w, n, b)]);
            const float m = w->bits == 4 ? f16_to_f32(w->mn[scale_at(w, n, b)]) : 0.f;
#if KVD_AVX2
            if (!out_bf16) {  // 8 values at a time: bytes widened to int32, converted, scaled
                const __m256i codes = w->bits == 4 ? unpack_q4(p)
                                                   : _mm256_loadu_si256((const __m256i*)p);
                const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
                float* dst = (float*)out + (n - first) * K + b * QBLOCK;
                for (int j = 0; j < 4; j++) {
                    const __m128i part = _mm_loadl_epi64((const __m128i*)((const int8_t*)&codes + 8 * j));
                    const __m256i wide = w->bits == 4 ? _mm256_cvtepu8_epi32(part) : _mm256_cvtepi8_epi32(part);
                    _mm256_storeu_ps(dst + 8 * j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(wide), dv, mv));
                }
                continue;
            }
#endif
            float v[QBLOCK];
            if (w->bits == 4) {
                for (int i = 0; i < QBLOCK / 2; i++) {
                    v[i] = (float)(p[i] & 15) * d + m;
                    v[i + QBLOCK / 2] = (float)(p[i] >> 4) * d + m;
                }
            } else {
                for (int i = 0; i < QBLOCK; i++) v[i] = (float)((const int8_t*)p)[i] * d;
            }
            for (int i = 0; i < QBLOCK; i++) store_f(out, (n - first) * K + b * QBLOCK + i, v[i], out_bf16);
        }
    }
    return KVD_OK;
}
