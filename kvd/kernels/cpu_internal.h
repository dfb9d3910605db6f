// What the files of kvd's native CPU kernels share, included first by each of them: not an ABI (cpu_kernels.h
// is the one ABI). Which SIMD paths this build takes, float32 / bf16 conversions and loads in SIMD lanes, the SIMD
// exponential, the AMX tile layout, and the few functions one file defines for another (hidden: the library
// exports cpu_kernels.h's functions alone). The helpers are static inline here, so every file's inner loops
// inline them as they did when the kernels were one file.
//
// The kernels are compiled together into one library on the host at first use (native_build.py), with
// -march=native. Activations and the KV pool are float32 or bfloat16. Without AVX2 the same arithmetic runs in
// portable C. Threads: OpenMP (torch's own runtime once torch has loaded it), the count passed in by the caller.
#ifndef KVD_CPU_INTERNAL_H
#define KVD_CPU_INTERNAL_H

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
// AVX-512 VNNI (with AVX-512): quantized linears by VNNI outer products, 8-bit pool scores by VPDPBUSD.
#if KVD_AVX512 && defined(__AVX512VNNI__)
#define KVD_VNNI512 1
#else
#define KVD_VNNI512 0
#endif
// AMX int8 tiles: 8-bit linears of many rows, and attention over the 8-bit pool (and a bf16 one with AMX-BF16).
#if KVD_AVX2 && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
#define KVD_AMX 1
#else
#define KVD_AMX 0
#endif
// AMX bf16 tiles: bf16 linears in tile order, and a bf16 pool's scores and weighted values.
#if KVD_AVX2 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define KVD_AMX_BF16 1
#else
#define KVD_AMX_BF16 0
#endif

// A function one file defines for another: kept out of the library's exported symbols.
#define KVD_HIDDEN __attribute__((visibility("hidden")))

// A KV pool's element kind where the attention reads it: 0 float32, 1 bf16 (the model's dtype), or KV_INT8:
// 8-bit rows (kvd_paged_attention). Values that pass it as `bf16` read 8-bit codes as signed integers.
#define KV_INT8 2

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

// An IEEE half (GGUF's block scales) as float32.
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

static inline void store_f(void* base, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t*)base)[i] = f32_to_bf16(v);
    else
        ((float*)base)[i] = v;
}

#if KVD_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

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
#define AMX_ROWS 16  // rows of a tile: weight rows, activation rows, output rows

// Whether Linux lends this process the tile registers (asked once; kvd_isa says which paths run).
KVD_HIDDEN int amx_permitted(void);

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

#endif

#if KVD_AVX2
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

// Whether every slot lies in [-1, num_slots) and every position in [0, num_positions).
static inline int indices_in_range(const int64_t* idx, int64_t T, int64_t low, int64_t end) {
    for (int64_t t = 0; t < T; t++)
        if (idx[t] < low || idx[t] >= end) return 0;
    return 1;
}

// Linears of float weights (float32 or bf16, in rows or their kernel's packed order; cpu_float_linear.c) and
// of 4- and 8-bit ones (cpu_quant_linear.c), which kvd_linear picks between (cpu_dispatch.c): kvd_linear's
// arguments and status.
KVD_HIDDEN int float_weight_linear(const kvd_weight* w, const void* x, int x_bf16, int64_t M, void* y, int y_bf16,
                                   int nthreads);
KVD_HIDDEN int quantized_weight_linear(const kvd_weight* w, const void* x, int x_bf16, int64_t M, void* y,
                                       int y_bf16, int nthreads);
// And of GGUF super-block weights (cpu_super_linear.c), with kvd_dequantize's part for them.
KVD_HIDDEN int super_weight_linear(const kvd_weight* w, const void* x, int x_bf16, int64_t M, void* y, int y_bf16,
                                   int nthreads);
KVD_HIDDEN void super_dequantize(const kvd_weight* w, int64_t first, int64_t count, void* out, int out_bf16,
                                 int nthreads);

// The longest of the S contexts, or -1 when a context length or a block table entry it covers is out of range
// (cpu_attention.c; the layer loop checks its indices with it before any layer writes).
// cpu_layers.c's, for the experts of cpu_moe.c: a projection of several stacked parts, and act(gate) x up.
KVD_HIDDEN int parts_linear(const kvd_weight* parts, const void* x, int bf16, int64_t S, char* y, char* scratch,
                            int nthreads);
KVD_HIDDEN int64_t widest_part(const kvd_weight* parts);
KVD_HIDDEN void gated_mul(const void* gate, const void* up, int64_t stride, void* out, int64_t T, int64_t I, int bf16,
                          int gelu, int nthreads);
// cpu_recurrent.c's, for the layer loop: whether a step's S rows pass kvd_gated_delta's checks for layer R, and a
// Gated DeltaNet layer's output [S, hidden] from its normed input x [S, hidden] (scratch as parts_linear's).
KVD_HIDDEN int recurrent_step_ok(const kvd_recurrent* R, const kvd_recurrent_step* step, int64_t S);
KVD_HIDDEN int recurrent_sublayer(const kvd_recurrent* R, const kvd_recurrent_step* step, const void* x, int64_t S,
                                  float eps, int bf16, void* out, char* scratch, int nthreads);
KVD_HIDDEN int64_t checked_max_context(const int32_t* tables, int64_t table_width, const int32_t* lens, int64_t S,
                                      int64_t num_blocks, int64_t block_size);

#endif
