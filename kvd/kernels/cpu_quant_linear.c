// Linears of 4-, 5- and 8-bit weights: GGUF's blocks of 32 along K (KVD_QBLOCK), 4-bit (Q4_1's layout), 5-bit
// (Q5_1's: the 4-bit layout and a fifth bit per code) or 8-bit (Q8_0's), in groups of KVD_GROUP_ROWS rows (kvd_weight), against activations quantized per block to int8:
// exact integer block sums (integer SIMD, AVX-512 VNNI or AMX int8 tiles), then one float chain, so each output
// is computed in one order whatever the number of rows (batch invariance). And the weights' dequantization, for
// the float GEMMs of prefill.
#include "cpu_internal.h"

// ---- activation quantization ------------------------------------------------------------------------------

// x [M, K] -> q int8 [M, K], dx [M, K/32] (the block's scale) and sx [M, K/32] (scale x the sum of its codes).
static void quantize_rows(const void* x, int x_bf16, int64_t M, int64_t K, int8_t* q, float* dx, float* sx,
                          int nthreads) {
    const int64_t nb = K / KVD_QBLOCK;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M > 1)
    for (int64_t r = 0; r < M; r++) {
        for (int64_t b = 0; b < nb; b++) {
            int8_t* out = q + r * K + b * KVD_QBLOCK;
            float d;
            int sum = 0;
#if KVD_AVX512
            // The AVX2 steps 16 lanes at a time: the largest magnitude passes over NaN lanes as there (each max
            // keeps its second operand when the first is NaN), the codes' low bytes are kept (vpmovdb), and the
            // integer sum wraps as any order of int32 adds does.
            const char* p = (const char*)x + (r * K + b * KVD_QBLOCK) * (x_bf16 ? 2 : 4);
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
            const char* p = (const char*)x + (r * K + b * KVD_QBLOCK) * (x_bf16 ? 2 : 4);
            __m256 v[KVD_QBLOCK / 8], amax8 = _mm256_setzero_ps();
            for (int i = 0; i < KVD_QBLOCK / 8; i++) {
                v[i] = load8(p + i * 8 * (x_bf16 ? 2 : 4), x_bf16);
                amax8 = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), v[i]), amax8);
            }
            amax8 = _mm256_max_ps(amax8, _mm256_permute2f128_ps(amax8, amax8, 1));
            amax8 = _mm256_max_ps(amax8, _mm256_permute_ps(amax8, 0x4e));
            amax8 = _mm256_max_ps(amax8, _mm256_permute_ps(amax8, 0xb1));
            d = _mm256_cvtss_f32(amax8) / 127.f;
            const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
            __m256i sum8 = _mm256_setzero_si256();
            for (int i = 0; i < KVD_QBLOCK / 8; i++) {
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
            float v[KVD_QBLOCK];
            float amax = 0.f;
            for (int i = 0; i < KVD_QBLOCK; i++) {
                v[i] = load_f(x, r * K + b * KVD_QBLOCK + i, x_bf16);
                float a = fabsf(v[i]);
                amax = a > amax ? a : amax;
            }
            d = amax / 127.f;
            const float inv = d > 0.f ? 1.f / d : 0.f;
            for (int i = 0; i < KVD_QBLOCK; i++) {
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

// 32 bytes, byte i = 16 where bit i of m is set, else 0: the fifth bits of 32 5-bit codes, in place.
static inline __m256i fifth_bytes(uint32_t m) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_maskz_set1_epi8(m, 16);
#else
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)m),
                                               _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2,
                                                                2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
#endif
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

#endif

// ---- quantized linears: exact block sums, then one float order ------------------------------------------------
//
// For activation row m and output n: acc = 0; for each block b in order, acc = fma(isum, d[n,b] x dx[m,b], acc)
// and, for 4- and 5-bit weights, acc = fma(mn[n,b], sx[m,b], acc); y = acc + bias. isum, the block's sum of code x
// activation products, is an exact integer however it is computed (integer SIMD, VNNI, AMX tiles), and the float
// steps are the same in every path: each output is the same whatever the row count, the path taken or the CPU
// (batch invariance). Small batches run weight rows eight at a time, one float lane each (up to ROW_TILE
// activation rows a pass over a group's blocks, each pair unpacked once); from VNNI_MIN_ROWS on a CPU with
// AVX-512 VNNI, VNNI outer products; 8-bit weights from AMX_MIN_ROWS rows on a CPU with AMX, tiles of 16
// weight rows x 16 activation rows.

typedef struct {
    const int8_t* q;  // [M, K] int8 codes (then zero rows up to a whole AMX tile)
    const float* dx;  // [M, nb] block scales
    const float* sx;  // [M, nb] dx x the block's sum of codes
    int64_t M;
} quantized_rows;

// KVD_GROUP_ROWS (cpu_kernels.h): weight rows per group, of the block layout and of the SIMD path, whose
// group_rows holds a group's outputs in one register of eight float lanes.
_Static_assert(KVD_GROUP_ROWS == 8, "a group of weight rows is one 8-lane register of outputs");

// 4- and 5-bit blocks keep 16 bytes of nibbles (and a 5-bit one its word in qh), with a minimum term; 8-bit ones 32 codes.
static inline int64_t block_bytes(const kvd_weight* w) { return w->bits == 8 ? KVD_QBLOCK : KVD_QBLOCK / 2; }

// Bytes from one row's block b to the next row's in a group: a pair of blocks, or the odd last block alone.
static inline int64_t row_stride(const kvd_weight* w, int64_t b) {
    return ((b | 1) < w->k / KVD_QBLOCK ? 2 : 1) * block_bytes(w);
}

// Where block b of weight row n lies in the group layout (see kvd_weight).
static inline const uint8_t* block_at(const kvd_weight* w, int64_t n, int64_t b) {
    const int64_t bb = block_bytes(w), nb = w->k / KVD_QBLOCK;
    return (const uint8_t*)w->qs + (n / KVD_GROUP_ROWS) * KVD_GROUP_ROWS * nb * bb + (b & ~(int64_t)1) * KVD_GROUP_ROWS * bb + (n % KVD_GROUP_ROWS) * row_stride(w, b) +
           (b & 1) * bb;
}

// The index of row n's block b in the scales (and minimums) [groups][nb][8].
static inline int64_t scale_at(const kvd_weight* w, int64_t n, int64_t b) {
    return ((n / KVD_GROUP_ROWS) * (w->k / KVD_QBLOCK) + b) * KVD_GROUP_ROWS + n % KVD_GROUP_ROWS;
}

static inline void store_output(const kvd_weight* w, int64_t n, int64_t m, float acc, void* y, int y_bf16) {
    store_f(y, m * w->n + n, acc + (w->bias ? w->bias[n] : 0.f), y_bf16);
}

#if !KVD_AVX2
// The exact sum of one weight block's codes (bytes at p, fifth bits qh) times one activation block (plain C).
static inline int32_t block_isum(int bits, const uint8_t* p, uint32_t qh, const int8_t* a) {
    int32_t sum = 0;
    if (bits != 8) {
        for (int i = 0; i < KVD_QBLOCK / 2; i++) {
            const int lo = (p[i] & 15) | ((qh >> i) & 1) << 4, hi = (p[i] >> 4) | ((qh >> (i + 16)) & 1) << 4;
            sum += lo * a[i] + hi * a[i + KVD_QBLOCK / 2];
        }
    } else {
        for (int i = 0; i < KVD_QBLOCK; i++) sum += ((const int8_t*)p)[i] * a[i];
    }
    return sum;
}

// Output n for activation row m, one block at a time (plain C).
static float row_dot(const kvd_weight* w, int64_t n, const quantized_rows* x, int64_t m) {
    const int64_t K = w->k, nb = K / KVD_QBLOCK;
    const float* dx = x->dx + m * nb;
    const float* sx = x->sx + m * nb;
    float acc = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        const float scale = f16_to_f32(w->d[scale_at(w, n, b)]) * dx[b];
        const uint32_t qh = w->bits == 5 ? w->qh[scale_at(w, n, b)] : 0;
        acc = fmaf((float)block_isum(w->bits, block_at(w, n, b), qh, x->q + m * K + b * KVD_QBLOCK), scale, acc);
        if (w->bits != 8) acc = fmaf(f16_to_f32(w->mn[scale_at(w, n, b)]), sx[b], acc);
    }
    return acc;
}

#endif

#if KVD_AVX2
// dot_u8_i8(dot_u8_i8(0, lo, a_lo), hi, a_hi): without VNNI the two halves' int16 pair sums are added before they
// are widened, one vpmaddwd fewer (a pair sum is at most 2 x 31 x 128 = 7936 for 4- and 5-bit codes, two of them
// 15872: no saturation, the same integers).
static inline __m256i dot2_u8_i8(__m256i lo, __m256i a_lo, __m256i hi, __m256i a_hi) {
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
    return dot_u8_i8(dot_u8_i8(_mm256_setzero_si256(), lo, a_lo), hi, a_hi);
#else
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, a_lo), _mm256_maddubs_epi16(hi, a_hi));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

// The eight int32 lane sums of one weight block (bytes at p, fifth bits qh) against the activation block a.
static inline __attribute__((always_inline)) __m256i block_lanes(int bits, const uint8_t* p, uint32_t qh, __m256i a) {
    if (bits == 5) return dot_u8_i8(_mm256_setzero_si256(), _mm256_or_si256(unpack_q4(p), fifth_bytes(qh)), a);
    if (bits == 4) return dot_u8_i8(_mm256_setzero_si256(), unpack_q4(p), a);
    const __m256i w = _mm256_loadu_si256((const __m256i*)p);
    return dot_u8_i8(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
}

// One row's pair of 4-bit blocks (32 bytes at p) as *lo (codes 0-15 of both blocks) and *hi (codes 16-31), to meet
// the activations' a_lo and a_hi (dot2_u8_i8: lanes 0-3 sum the first block, lanes 4-7 the second). No lane
// crossing, unlike unpack_q4. 5-bit blocks: q0, q1 the pair's fifth bits.
static inline __attribute__((always_inline)) void pair_codes(int bits, const uint8_t* p, uint32_t q0, uint32_t q1,
                                                            __m256i* lo, __m256i* hi) {
    const __m256i w = _mm256_loadu_si256((const __m256i*)p), low = _mm256_set1_epi8(0x0f);
    *lo = _mm256_and_si256(w, low), *hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
    if (bits == 5) {
        *lo = _mm256_or_si256(*lo, fifth_bytes((q0 & 0xffff) | q1 << 16));
        *hi = _mm256_or_si256(*hi, fifth_bytes(q0 >> 16 | (q1 & 0xffff0000u)));
    }
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
    const __m256 scale = _mm256_mul_ps(load_f16x8(d + b * KVD_GROUP_ROWS), _mm256_set1_ps(x->dx[i]));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc);
    return bits != 8 ? _mm256_fmadd_ps(load_f16x8(mn + b * KVD_GROUP_ROWS), _mm256_set1_ps(x->sx[i]), acc) : acc;
}

// Activation rows a group's pass takes at once (each pair of 4- or 5-bit weight blocks is unpacked once for all).
#define ROW_TILE 4

#if KVD_VNNI512 && defined(__AVX512BW__) && defined(__AVX512VL__)
// AVX-512 VNNI: a pair of blocks of every row of a group in 512-bit steps (two rows of 4- or 5-bit blocks a step,
// one row of 8-bit ones), their lane sums reduced together: about half the instructions of the 256-bit steps, the
// same integers. *first = the eight rows' sums of block 2p, *second = of block 2p + 1.
#define PAIRS512 1

// Lane j of *first = the sum of lanes 4 (2 (j % 2)) + r .. of v[j / 2]'s 128-bit lane 2 (j % 2), of *second = of
// lane 2 (j % 2) + 1: each v[r] holds rows 2 r and 2 r + 1's blocks 2p and 2p + 1 as four lanes each, in that order.
static inline void sums_of_row_pairs(const __m512i* v, __m256i* first, __m256i* second) {
    const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(v[0], v[1]), _mm512_unpackhi_epi32(v[0], v[1]));
    const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2], v[3]), _mm512_unpackhi_epi32(v[2], v[3]));
    // 128-bit lane L: v[0..3]'s sums of their lane L, in order.
    const __m512i t = _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
    const __m512i out = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15), t);
    *first = _mm512_castsi512_si256(out), *second = _mm512_extracti64x4_epi64(out, 1);
}

// The same for v[j] holding row j's blocks 2p (lanes 0-7) and 2p + 1 (lanes 8-15).
static inline void sums_of_rows(const __m512i* v, __m256i* first, __m256i* second) {
    __m512i s[4], t[2];
    for (int i = 0; i < 4; i++)
        s[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++)  // 128-bit lane L: rows 4 i .. 4 i + 3's sums of their lane L
        t[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(s[2 * i], s[2 * i + 1]), _mm512_unpackhi_epi64(s[2 * i], s[2 * i + 1]));
    const __m512i z = _mm512_add_epi32(_mm512_shuffle_i32x4(t[0], t[1], 0x88), _mm512_shuffle_i32x4(t[0], t[1], 0xdd));
    const __m512i out = _mm512_shuffle_i32x4(z, z, 0xd8);  // rows 0-3, 4-7 of block 2p, then of 2p + 1
    *first = _mm512_castsi512_si256(out), *second = _mm512_extracti64x4_epi64(out, 1);
}

// p: the group's blocks b and b + 1 (8 rows); a0[i], a1[i]: activation row i's blocks, for R rows (R <= ROW_TILE);
// qh: the group's fifth-bit words [nb][8] (5-bit). The weight codes are unpacked once for all R rows.
static inline __attribute__((always_inline)) void pair_sums512(int bits, int R, const uint8_t* p, const uint32_t* qh,
                                                              int64_t b, const __m256i* a0, const __m256i* a1,
                                                              __m256i* first, __m256i* second) {
    __m512i v[ROW_TILE][KVD_GROUP_ROWS];
    if (bits == 8) {  // |w| x a with w's signs moved to a, as block_lanes
        const __m512i zero = _mm512_setzero_si512();
        for (int j = 0; j < KVD_GROUP_ROWS; j++) {
            const __m512i w = _mm512_loadu_si512(p + 64 * j), wabs = _mm512_abs_epi8(w);
            const __mmask64 neg = _mm512_movepi8_mask(w);
            for (int i = 0; i < R; i++) {
                const __m512i a = _mm512_inserti64x4(_mm512_castsi256_si512(a0[i]), a1[i], 1);
                v[i][j] = _mm512_dpbusd_epi32(zero, wabs, _mm512_mask_sub_epi8(a, neg, zero, a));
            }
        }
        for (int i = 0; i < R; i++) sums_of_rows(v[i], first + i, second + i);
        return;
    }
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512i a_lo[ROW_TILE], a_hi[ROW_TILE];
    for (int i = 0; i < R; i++) {
        a_lo[i] = _mm512_broadcast_i64x4(_mm256_permute2x128_si256(a0[i], a1[i], 0x20));
        a_hi[i] = _mm512_broadcast_i64x4(_mm256_permute2x128_si256(a0[i], a1[i], 0x31));
    }
    for (int r = 0; r < KVD_GROUP_ROWS / 2; r++) {  // rows 2 r and 2 r + 1, 32 bytes each
        const __m512i w = _mm512_loadu_si512(p + 64 * r);
        __m512i lo = _mm512_and_si512(w, low), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
        if (bits == 5) {  // as pair_lanes: codes 0-15 of both blocks take their words' low halves, 16-31 the high
            uint64_t w0, w1;  // rows 2 r and 2 r + 1's words of blocks b and b + 1
            memcpy(&w0, qh + b * KVD_GROUP_ROWS + 2 * r, 8);
            memcpy(&w1, qh + (b + 1) * KVD_GROUP_ROWS + 2 * r, 8);
            const uint64_t half = 0x0000ffff0000ffffull;
            const __m512i sixteen = _mm512_set1_epi8(16);
            lo = _mm512_or_si512(lo, _mm512_maskz_mov_epi8((w0 & half) | (w1 & half) << 16, sixteen));
            hi = _mm512_or_si512(hi, _mm512_maskz_mov_epi8((w0 >> 16 & half) | (w1 & ~half), sixteen));
        }
        for (int i = 0; i < R; i++)
            v[i][r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, a_lo[i]), hi, a_hi[i]);
    }
    for (int i = 0; i < R; i++) sums_of_row_pairs(v[i], first + i, second + i);
}
#else
#define PAIRS512 0
#endif

// Bytes ahead of the 4-bit pass that it prefetches (the next groups; a thread's groups are consecutive): the
// hardware prefetcher alone left 2 cores at 9-10 of their 14-15 GB/s on a decode step's weights (Xeon). The
// 8-bit pass gained nothing from it (int8 logits, 2.8-2.9 ms either way).
#define WEIGHT_AHEAD 4096

// Outputs n0 .. n0 + rows - 1 (one group) for activation rows m0 .. m0 + R - 1: the group's blocks read in one
// stream, a pair of 4-bit blocks per load, each row's float steps in block order (the same bits for any R).
static inline __attribute__((always_inline)) void group_tile(int bits, int R, const kvd_weight* w, int64_t n0,
                                                            int64_t rows, const quantized_rows* x, int64_t m0,
                                                            void* y, int y_bf16) {
    const int64_t K = w->k, nb = K / KVD_QBLOCK, pairs = bits != 8 || PAIRS512 ? nb / 2 : 0;
    const uint16_t* d = w->d + scale_at(w, n0, 0);
    const uint16_t* mn = bits != 8 ? w->mn + scale_at(w, n0, 0) : NULL;
    const uint32_t* qh = bits == 5 ? w->qh + scale_at(w, n0, 0) : NULL;  // [nb][8], as d
    __m256 acc[ROW_TILE];
    for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
    __m256i lanes[KVD_GROUP_ROWS], first[ROW_TILE], second[ROW_TILE], a0[ROW_TILE], a1[ROW_TILE];
    for (int64_t b = 0; b < 2 * pairs; b += 2) {
        for (int i = 0; i < R; i++) {
            a0[i] = _mm256_loadu_si256((const __m256i*)(x->q + (m0 + i) * K + b * KVD_QBLOCK));
            a1[i] = _mm256_loadu_si256((const __m256i*)(x->q + (m0 + i) * K + b * KVD_QBLOCK + KVD_QBLOCK));
        }
        const uint8_t* p = block_at(w, n0, b);
        for (int j = 0; j < (bits == 8 ? 8 : 4); j++) _mm_prefetch((const char*)p + WEIGHT_AHEAD + 64 * j, _MM_HINT_T0);
#if PAIRS512
        pair_sums512(bits, R, p, qh, b, a0, a1, first, second);
#else
        // Each row's pair unpacked once for the R activation rows.
        __m256i a_lo[ROW_TILE], a_hi[ROW_TILE], tile[ROW_TILE][KVD_GROUP_ROWS];
        for (int i = 0; i < R; i++) {
            a_lo[i] = _mm256_permute2x128_si256(a0[i], a1[i], 0x20);
            a_hi[i] = _mm256_permute2x128_si256(a0[i], a1[i], 0x31);
        }
        for (int j = 0; j < KVD_GROUP_ROWS; j++) {
            __m256i lo, hi;
            pair_codes(bits, p + j * KVD_QBLOCK, qh ? qh[b * KVD_GROUP_ROWS + j] : 0,
                       qh ? qh[(b + 1) * KVD_GROUP_ROWS + j] : 0, &lo, &hi);
            for (int i = 0; i < R; i++) tile[i][j] = dot2_u8_i8(lo, a_lo[i], hi, a_hi[i]);
        }
        for (int i = 0; i < R; i++) hsum8x8_halves(tile[i], first + i, second + i);
#endif
        for (int i = 0; i < R; i++) {
            acc[i] = block_step(bits, acc[i], first[i], d, mn, b, x, (m0 + i) * nb + b);
            acc[i] = block_step(bits, acc[i], second[i], d, mn, b + 1, x, (m0 + i) * nb + b + 1);
        }
    }
    for (int64_t b = 2 * pairs; b < nb; b++) {  // 8-bit blocks, and an odd last 4-bit one
        const uint8_t* p = block_at(w, n0, b);
        const int64_t stride = row_stride(w, b);
        for (int i = 0; i < R; i++) {
            const __m256i av = _mm256_loadu_si256((const __m256i*)(x->q + (m0 + i) * K + b * KVD_QBLOCK));
            for (int j = 0; j < KVD_GROUP_ROWS; j++)
                lanes[j] = block_lanes(bits, p + j * stride, qh ? qh[b * KVD_GROUP_ROWS + j] : 0, av);
            hsum8x8_halves(lanes, first + i, second + i);
            acc[i] = block_step(bits, acc[i], _mm256_add_epi32(first[i], second[i]), d, mn, b, x, (m0 + i) * nb + b);
        }
    }
    for (int i = 0; i < R; i++) {
        float out[KVD_GROUP_ROWS];
        _mm256_storeu_ps(out, acc[i]);
        for (int j = 0; j < rows; j++) store_output(w, n0 + j, m0 + i, out[j], y, y_bf16);
    }
}

// Outputs n0 .. n0 + rows - 1 (one group) for every activation row, ROW_TILE rows a pass: each pair of 4- or
// 5-bit blocks unpacked once for them.
static inline __attribute__((always_inline)) void group_rows(int bits, const kvd_weight* w, int64_t n0, int64_t rows,
                                                            const quantized_rows* x, void* y, int y_bf16) {
    int64_t m = 0;
    for (; m + ROW_TILE <= x->M; m += ROW_TILE) group_tile(bits, ROW_TILE, w, n0, rows, x, m, y, y_bf16);
    if (x->M - m == 3) group_tile(bits, 3, w, n0, rows, x, m, y, y_bf16), m += 3;
    if (x->M - m == 2) group_tile(bits, 2, w, n0, rows, x, m, y, y_bf16), m += 2;
    for (; m < x->M; m++) group_tile(bits, 1, w, n0, rows, x, m, y, y_bf16);
}
#endif

// Outputs [first, n) for every activation row (first a multiple of KVD_GROUP_ROWS), a group of KVD_GROUP_ROWS weight rows at a time.
static void simd_rows(const kvd_weight* w, int64_t first, const quantized_rows* x, void* y, int y_bf16,
                      int nthreads) {
    const int64_t groups = (w->n - first + KVD_GROUP_ROWS - 1) / KVD_GROUP_ROWS;
    if (groups <= 0) return;  // no parallel region to fork and join for nothing (the usual case after the tiles)
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t n0 = first + g * KVD_GROUP_ROWS, rows = w->n - n0 < KVD_GROUP_ROWS ? w->n - n0 : KVD_GROUP_ROWS;
#if KVD_AVX2
        if (w->bits == 4)
            group_rows(4, w, n0, rows, x, y, y_bf16);
        else if (w->bits == 5)
            group_rows(5, w, n0, rows, x, y, y_bf16);
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
    if (row_stride(w, b) == KVD_QBLOCK / 2) {
        *lo = _mm512_loadu_si512(p), *hi = _mm512_loadu_si512(p + 64);
        return;
    }
    p -= (b & 1) * (KVD_QBLOCK / 2);
    // Lane 4 j + r from load j / 2 (a pair of rows) at dword 8 (j % 2) + 4 (b % 2) + r.
    const __m512i at = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27),
                                        _mm512_set1_epi32(4 * (int)(b & 1)));
    *lo = _mm512_permutex2var_epi32(_mm512_loadu_si512(p), at, _mm512_loadu_si512(p + 64));
    *hi = _mm512_permutex2var_epi32(_mm512_loadu_si512(p + 128), at, _mm512_loadu_si512(p + 192));
}

// Lane j: bits at .. at + 3 of qh's lane j, each as 16 in its own byte (the fifth bits of four codes): the four bits
// times 0x00204081 land at bits 0, 8, 16 and 24 with no carries between them.
static inline __m512i fifth_dword(__m512i qh, int at) {
    const __m512i four = _mm512_and_si512(_mm512_srli_epi32(qh, (unsigned)at), _mm512_set1_epi32(15));
    const __m512i spread = _mm512_mullo_epi32(four, _mm512_set1_epi32(0x00204081));
    return _mm512_slli_epi32(_mm512_and_si512(spread, _mm512_set1_epi32(0x01010101)), 4);
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
    const int64_t nb = w->k / KVD_QBLOCK;
    const __m512i low = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8(flip8);
    // Lane 8 h + j: row j's dword h from rows 0-3 (lane 4 j + h of lo) or 4-7 (of hi).
    const __m512i pair_rows = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
    for (int64_t b = 0; b < nb; b++) {
        if (stream && b % 2 == 0)  // the groups' next block pairs (one pair of blocks: 8 rows x 2 blocks)
            for (int g = 0; g < 2; g++) {
                const char* ahead = (const char*)block_at(w, n0 + g * KVD_GROUP_ROWS, b) + UNPACK_AHEAD;
                for (int64_t i = 0; i < KVD_GROUP_ROWS * 2 * block_bytes(w); i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
            }
        __m512i* dst = (__m512i*)(out + b * OUT16 * KVD_QBLOCK);
        if (w->bits != 8) {
            // Dword r of the 16 rows (lane j: row j) by two transposes of the groups' 8 x 4 dwords, not gathers.
            __m512i lo[2], hi[2], pairs[2][2];
            for (int g = 0; g < 2; g++) {
                group_block_dwords(w, n0 + g * KVD_GROUP_ROWS, b, &lo[g], &hi[g]);
                for (int h = 0; h < 2; h++)  // lanes 0-7: dword 2 h of rows 0-7, lanes 8-15: dword 2 h + 1
                    pairs[g][h] = _mm512_permutex2var_epi32(lo[g], _mm512_add_epi32(pair_rows, _mm512_set1_epi32(2 * h)), hi[g]);
            }
            // 5-bit: lane j = row j's fifth bits of the block (the two groups' words, as their scales lie).
            const __m512i qh = w->bits == 5 ? _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(w->qh + scale_at(w, n0, b)))),
                                                                 _mm256_loadu_si256((const __m256i*)(w->qh + scale_at(w, n0 + KVD_GROUP_ROWS, b))), 1)
                                            : _mm512_setzero_si512();
            for (int r = 0; r < 4; r++) {
                const __m512i v = r % 2 ? _mm512_shuffle_i64x2(pairs[0][r / 2], pairs[1][r / 2], 0xee)
                                        : _mm512_shuffle_i64x2(pairs[0][r / 2], pairs[1][r / 2], 0x44);
                _mm512_storeu_si512(dst + r, _mm512_or_si512(_mm512_and_si512(v, low), fifth_dword(qh, 4 * r)));
                _mm512_storeu_si512(dst + r + 4, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low),
                                                                  fifth_dword(qh, 16 + 4 * r)));
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
            const int64_t at = scale_at(w, n0 + g * KVD_GROUP_ROWS, b);
            _mm256_storeu_ps(wd + b * stride + g * KVD_GROUP_ROWS, load_f16x8(w->d + at));
            _mm256_storeu_ps(wm + b * stride + g * KVD_GROUP_ROWS, w->bits != 8 ? load_f16x8(w->mn + at) : _mm256_setzero_ps());
        }
    }
}

// Weight rows n0 .. n0 + 15 (two whole groups, their scales and minimums) on their way to the cache: the loads of
// unpack_rows16 would otherwise wait on memory one block after another.
static void prefetch_rows16(const kvd_weight* w, int64_t n0) {
    const int64_t nb = w->k / KVD_QBLOCK, group_bytes = KVD_GROUP_ROWS * nb * block_bytes(w), scale_bytes = 2 * KVD_GROUP_ROWS * nb * 2;
    const char* codes = (const char*)block_at(w, n0, 0);
    for (int64_t i = 0; i < 2 * group_bytes; i += 64) _mm_prefetch(codes + i, _MM_HINT_T0);
    for (int64_t i = 0; i < scale_bytes; i += 64) {
        _mm_prefetch((const char*)(w->d + scale_at(w, n0, 0)) + i, _MM_HINT_T0);
        if (w->bits != 8) _mm_prefetch((const char*)(w->mn + scale_at(w, n0, 0)) + i, _MM_HINT_T0);
        if (w->bits == 5) _mm_prefetch((const char*)(w->qh + scale_at(w, n0, 0)) + 2 * i, _MM_HINT_T0);
    }
}

// A work item's pair of weight groups (n0 .. n0 + ng x 16) unpacked into wt [ng][nb][8][16][4] (8-bit codes xor
// flip8), their scales wd and minimums wm [nb][32]; then the thread's next pair prefetched (with a static
// schedule, its next item, whose unpack follows this item's products). Inlined into each caller, so that flip8
// is a constant there: inlined, 8-bit VNNI linears at 4 rows run 12-23 % faster than when it was shared (Xeon).
static inline __attribute__((always_inline)) void unpack_pair(const kvd_weight* w, int64_t n0, int ng, int64_t groups,
                                                              int8_t* wt, float* wd, float* wm, char flip8,
                                                              int stream) {
    const int64_t nb = w->k / KVD_QBLOCK;
    for (int j = 0; j < ng; j++)
        unpack_rows16(w, n0 + j * OUT16, wt + j * nb * OUT16 * KVD_QBLOCK, wd + j * OUT16, wm + j * OUT16, 2 * OUT16,
                      flip8, stream);
    for (int64_t n = n0 + 2 * OUT16; n < n0 + 4 * OUT16 && n + OUT16 <= groups * OUT16; n += OUT16) prefetch_rows16(w, n);
}

#endif

// ---- quantized linears by AVX-512 VNNI outer products (4-bit weights, 8-bit ones below AMX_MIN_ROWS) ----------
//
// For several activation rows, each work item unpacks 32 weight rows once (unpack_rows16) and multiplies them by
// every row of its chunk: VPDPBUSD adds 4 code products into each output's int32 lane, so a block's 8 of them
// give the same exact integer sums as the other paths, then the same float steps in the same order.

#if KVD_VNNI512

#define VNNI_MIN_ROWS 7  // from here, unpacking once per item beats a group pass of four rows at a time (2 cores)
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
    const int64_t K = w->k, nb = K / KVD_QBLOCK;
    __m512 acc[VNNI_ROWS][2];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < ng; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i isum[VNNI_ROWS][2];
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < ng; j++)
                isum[r][j] = bits != 8 ? _mm512_setzero_si512() : _mm512_set1_epi32(base[(m + r) * nb + b]);
        for (int qd = 0; qd < KVD_QBLOCK / 4; qd++) {
            __m512i wv[2];
            for (int j = 0; j < ng; j++) wv[j] = _mm512_loadu_si512(wt + ((j * nb + b) * 8 + qd) * 64);
            for (int r = 0; r < rows; r++) {
                int32_t codes;
                memcpy(&codes, x->q + (m + r) * K + b * KVD_QBLOCK + 4 * qd, 4);
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
                if (bits != 8) acc[r][j] = _mm512_fmadd_ps(mn, _mm512_set1_ps(x->sx[i]), acc[r][j]);
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
    const int64_t nb = w->k / KVD_QBLOCK, groups = w->n / OUT16, pairs = (groups + 1) / 2;
    const int64_t chunks = (x->M + VNNI_CHUNK - 1) / VNNI_CHUNK;
    int32_t* base = w->bits == 8 ? malloc(sizeof(int32_t) * (size_t)(x->M * nb)) : NULL;
    int failed = w->bits == 8 && !base;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < (base ? x->M * nb : 0); i++) {
            int32_t sum = 0;
            for (int t = 0; t < KVD_QBLOCK; t++) sum += x->q[i * KVD_QBLOCK + t];
            base[i] = -128 * sum;
        }
        int8_t* wt = malloc((size_t)(nb * 2 * OUT16 * KVD_QBLOCK));
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
            if (w->bits != 8)  // 5-bit codes unpack to bytes as 4-bit ones do, then run alike
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
#endif

#if KVD_AMX

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
    for (int t = 4; t < 6; t++) cfg.rows[t] = AMX_ROWS, cfg.colsb[t] = KVD_QBLOCK;
    for (int t = 6; t < 8; t++) cfg.rows[t] = KVD_QBLOCK / 4, cfg.colsb[t] = 64;
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
    const int64_t K = w->k, nb = K / KVD_QBLOCK, M = x->M, tile_bytes = AMX_ROWS * KVD_QBLOCK;
    memset(acc, 0, sizeof(float) * (size_t)(mtiles * AMX_ROWS * 2 * AMX_ROWS));
    int32_t c_tiles[2][4 * AMX_ROWS * AMX_ROWS];
    int64_t prev_m = -1, prev_b = 0;
    int prev_mc = 0, half = 0;
    for (int64_t mt = 0; mt < mtiles; mt += 2) {
        const int mc = mtiles - mt < 2 ? 1 : 2;
        const int8_t* a = xt + (t0 + mt) * nb * tile_bytes;
        for (int64_t b = 0; b < nb; b++) {
            _tile_loadd(4, a + b * tile_bytes, KVD_QBLOCK);
            _tile_loadd(6, wtiles + b * tile_bytes, 64);
            if (ng > 1) _tile_loadd(7, wtiles + (nb + b) * tile_bytes, 64);
            if (mc > 1) _tile_loadd(5, a + (nb + b) * tile_bytes, KVD_QBLOCK);
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
    const int64_t nb = w->k / KVD_QBLOCK, tiles = (x->M + AMX_ROWS - 1) / AMX_ROWS, groups = w->n / AMX_ROWS;
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
                    memcpy(xt + ((t * nb + b) * AMX_ROWS + r) * KVD_QBLOCK, x->q + (t * AMX_ROWS + r) * w->k + b * KVD_QBLOCK,
                           KVD_QBLOCK);
        const size_t tile_bytes = (size_t)(nb * 2 * AMX_ROWS * KVD_QBLOCK);
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

// kvd_linear for a 4- or 8-bit weight: the activation rows quantized per block, then multiplied.
int quantized_weight_linear(const kvd_weight* w, const void* x, int x_bf16, int64_t M, void* y, int y_bf16,
                            int nthreads) {
    const int64_t K = w->k, nb = K / KVD_QBLOCK, padded = (M + 15) / 16 * 16;
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

// ---- dequantization ---------------------------------------------------------------------------------------------

// For the matmuls of many rows (prefill), where a float GEMM on the dequantized weight beats the integer dot
// products.
int kvd_dequantize(const kvd_weight* w, int64_t first, int64_t count, void* out, int out_bf16, int nthreads) {
    if (first < 0 || count < 0 || first + count > w->n) return KVD_BAD_INDEX;
    if (w->bits == 16 || w->bits == 32) return KVD_UNSUPPORTED;  // a float weight: its rows are its values
    if (w->ggml) {
        super_dequantize(w, first, count, out, out_bf16, nthreads);
        return KVD_OK;
    }
    const int64_t K = w->k, nb = K / KVD_QBLOCK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = first; n < first + count; n++) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t* p = block_at(w, n, b);
            const float d = f16_to_f32(w->d[scale_at(w, n, b)]);
            const float m = w->bits != 8 ? f16_to_f32(w->mn[scale_at(w, n, b)]) : 0.f;
            const uint32_t qh = w->bits == 5 ? w->qh[scale_at(w, n, b)] : 0;
#if KVD_AVX2
            if (!out_bf16) {  // 8 values at a time: bytes widened to int32, converted, scaled
                const __m256i codes = w->bits != 8 ? _mm256_or_si256(unpack_q4(p), fifth_bytes(qh))
                                                   : _mm256_loadu_si256((const __m256i*)p);
                const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
                float* dst = (float*)out + (n - first) * K + b * KVD_QBLOCK;
                for (int j = 0; j < 4; j++) {
                    const __m128i part = _mm_loadl_epi64((const __m128i*)((const int8_t*)&codes + 8 * j));
                    const __m256i wide = w->bits != 8 ? _mm256_cvtepu8_epi32(part) : _mm256_cvtepi8_epi32(part);
                    _mm256_storeu_ps(dst + 8 * j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(wide), dv, mv));
                }
                continue;
            }
#endif
            float v[KVD_QBLOCK];
            if (w->bits != 8) {
                for (int i = 0; i < KVD_QBLOCK / 2; i++) {
                    v[i] = (float)((p[i] & 15) | ((qh >> i) & 1) << 4) * d + m;
                    v[i + KVD_QBLOCK / 2] = (float)((p[i] >> 4) | ((qh >> (i + 16)) & 1) << 4) * d + m;
                }
            } else {
                for (int i = 0; i < KVD_QBLOCK; i++) v[i] = (float)((const int8_t*)p)[i] * d;
            }
            for (int i = 0; i < KVD_QBLOCK; i++) store_f(out, (n - first) * K + b * KVD_QBLOCK + i, v[i], out_bf16);
        }
    }
    return KVD_OK;
}
