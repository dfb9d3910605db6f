// Linears of GGUF's super-block weights (Q4_K, Q5_K, Q6_K, IQ4_XS: enum kvd_ggml), read in place in the file's
// own bytes. Activations are quantized to int8 per super-block of 256 values (one float32 scale each, and the sum of
// each 16 codes); each weight super-block is unpacked once per work item into codes 0..63, an integer scale and
// an integer minimum per 16 values and two float multipliers; then, for every activation row, exact integer sums
// and one float order:
//
//   sumi = sum over k of scale[k] x (the codes . the activation codes of the 16 values k)   (int32, exact)
//   summ = sum over k of min[k] x (the sum of those 16 activation codes)                   (int32, exact)
//   acc = fma(float(sumi), da x dx, acc), then acc = fma(float(-summ), db x dx, acc), super-block by super-block
//
// (da, db: Q4_K and Q5_K's d and dmin; Q6_K's d twice, its codes stored + 32, so min[k] = 32 x scale[k]; IQ4_XS's
// d twice, its codes its table's signed values -127..113, min[k] 0, except where outer products take them + 128:
// there min[k] = 128 x scale[k] and summ is taken from sumi before the float steps.) The integer sums are the same
// whichever path computes them (plain C, AVX2, AVX-512), so every output is the same bits whatever the row count,
// the path or the CPU: batch invariance for these types too.
#include "cpu_internal.h"

#define SB KVD_SUPER_BLOCK
#define SUBS (SB / 16)  // the sub-blocks of 16 values: the finest that any of the types scales (Q6_K)
#define ROW_CHUNK 64    // activation rows a work item: each unpacked weight super-block serves all of them
#define OUT16 16        // weight rows of a group: the outer products' lanes, and the rows a packed weight interleaves

_Static_assert(SB == 256, "the unpacking below is written for GGUF's 256-value super-blocks");
_Static_assert(OUT16 == KVD_SUPER_PACK_ROWS, "a packed group is the outer products' 16 rows");

// One weight super-block, ready for the dot products of every activation row.
typedef struct {
    _Alignas(64) uint8_t codes[SB];  // 0..63, in value order; IQ4_XS: int8 values
    _Alignas(32) int16_t scale[SUBS];
    _Alignas(32) int16_t min[SUBS];
    float da, db;
    int signed_codes;  // IQ4_XS
} unpacked;

static inline int64_t type_bytes(int32_t type) {
    return type == KVD_GGML_Q4_K ? 144 : type == KVD_GGML_Q5_K ? 176 : type == KVD_GGML_Q6_K ? 210 : 136;
}

// IQ4's sixteen values (GGUF's kvalues_iq4nl), which IQ4_XS's 4-bit codes index.
static const int8_t iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// IQ4_XS's eight 6-bit sub-block scales (32 values each, stored + 32), sub-block j in byte j: its low nibble is
// nibble j of scales_l, its high bits bits 2 j, 2 j + 1 of scales_h (spread by shifts: no pdep, slow on some CPUs).
static inline uint64_t scales_iq4xs(const uint8_t* b) {
    uint32_t l;
    memcpy(&l, b + 4, 4);
    uint64_t lo = l, hi = (uint64_t)b[2] | (uint64_t)b[3] << 32;
    lo = (lo | lo << 16) & 0x0000ffff0000ffffull;
    lo = (lo | lo << 8) & 0x00ff00ff00ff00ffull;
    lo = (lo | lo << 4) & 0x0f0f0f0f0f0f0f0full;
    hi = (hi | hi << 12) & 0x000f000f000f000full;
    hi = (hi | hi << 6) & 0x0303030303030303ull;
    return lo | hi << 4;
}

static inline float half_at(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_to_f32(h);
}

// ---- the packed layout (kvd_super_pack) --------------------------------------------------------------------------
//
// A packed weight's whole groups of 16 rows hold, for each super-block s in turn, the 16 rows' blocks s field by
// field (in the block's own field order): a 2-byte field (d, dmin) as the 16 rows' values side by side, any other
// field dword by dword, each dword of the field as 64 bytes with row j's in bytes 4 j .. 4 j + 3, so that one load
// gives the same dword of 16 rows, as the outer products take them. A field at byte o of a file block starts at
// byte 16 o of the packed one; a group takes the bytes its 16 rows took. Rows past the last whole group stay as
// the file stores them.

// A block's fields: their starts, then the block's size.
static const int* block_fields(int32_t type) {
    static const int k4[] = {0, 2, 4, 16, 144}, k5[] = {0, 2, 4, 16, 48, 176}, k6[] = {0, 128, 192, 208, 210};
    return type == KVD_GGML_Q4_K ? k4 : type == KVD_GGML_Q5_K ? k5 : k6;
}

// Row j's block moved between the file's form and its place in its group's packed block, field by field: from the
// file's block into the packed one (to_packed), or back.
static void move_block(int32_t type, int j, const uint8_t* from, uint8_t* to, int to_packed) {
    const int tb = (int)type_bytes(type);
    for (const int* f = block_fields(type); f[0] < tb; f++) {
        const int unit = f[1] - f[0] == 2 ? 2 : 4;  // d and dmin whole, every other field dword by dword
        for (int o = f[0]; o < f[1]; o += unit) {
            const int at = 16 * f[0] + (unit == 2 ? 2 * j : (o - f[0]) * 16 + 4 * j);
            memcpy(to + (to_packed ? at : o), from + (to_packed ? o : at), (size_t)unit);
        }
    }
}

// Super-block s of weight row n as the file stores it: in place, or gathered from its packed group into tmp.
static const uint8_t* file_block(const kvd_weight* w, int64_t n, int64_t s, uint8_t* tmp) {
    const int64_t nb = w->k / SB, tb = type_bytes(w->ggml);
    if (!w->tiles || n >= w->n / OUT16 * OUT16) return (const uint8_t*)w->qs + (n * nb + s) * tb;
    move_block(w->ggml, (int)(n % OUT16), (const uint8_t*)w->qs + (n / OUT16 * nb + s) * OUT16 * tb, tmp, 0);
    return tmp;
}

// Q4_K and Q5_K's 6-bit scale and minimum of their sub-block j (32 values) from the 12 bytes that pack them.
static inline void scale_min_k4(int j, const uint8_t* q, int16_t* sc, int16_t* m) {
    if (j < 4) {
        *sc = q[j] & 63, *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4), *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

static void unpack_scales(int32_t type, const uint8_t* b, unpacked* u) {
    u->signed_codes = type == KVD_GGML_IQ4_XS;
    if (type == KVD_GGML_IQ4_XS) {
        const uint64_t ls = scales_iq4xs(b);
        for (int k = 0; k < SUBS; k++) u->scale[k] = (int16_t)((ls >> (8 * (k / 2)) & 63) - 32), u->min[k] = 0;
        u->da = u->db = half_at(b);
        return;
    }
    if (type == KVD_GGML_Q6_K) {
        const int8_t* sc = (const int8_t*)(b + 192);
        for (int k = 0; k < SUBS; k++) u->scale[k] = sc[k], u->min[k] = (int16_t)(32 * sc[k]);
        u->da = u->db = half_at(b + 208);
        return;
    }
    for (int j = 0; j < 8; j++) {
        scale_min_k4(j, b + 4, &u->scale[2 * j], &u->min[2 * j]);
        u->scale[2 * j + 1] = u->scale[2 * j], u->min[2 * j + 1] = u->min[2 * j];
    }
    u->da = half_at(b), u->db = half_at(b + 2);
}

// The codes of super-block b in value order (GGUF's layouts: Q4_K's byte 32 j + l holds value 64 j + l in its
// low nibble and 64 j + 32 + l in its high one; Q5_K adds bit 2 j (value 64 j + l) and 2 j + 1 (64 j + 32 + l) of
// qh[l] as the fifth; Q6_K's halves h of 128 values take ql[64 h + l] and ql[64 h + 32 + l]'s nibbles for values
// 128 h + l, + 32, + 64, + 96, with bit pairs 0, 2, 4, 6 of qh[32 h + l] above them; IQ4_XS's byte 16 j + l holds
// the indices of values 32 j + l and 32 j + 16 + l in its low and high nibbles).
static void unpack_codes(int32_t type, const uint8_t* b, uint8_t* codes) {
#if KVD_AVX2
    if (type == KVD_GGML_IQ4_XS) {
        const __m128i table = _mm_loadu_si128((const __m128i*)iq4_values), m4 = _mm_set1_epi8(15);
        for (int j = 0; j < SB / 32; j++) {
            const __m128i q = _mm_loadu_si128((const __m128i*)(b + 8 + 16 * j));
            _mm_store_si128((__m128i*)(codes + 32 * j), _mm_shuffle_epi8(table, _mm_and_si128(q, m4)));
            _mm_store_si128((__m128i*)(codes + 32 * j + 16), _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), m4)));
        }
        return;
    }
    const __m256i m15 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3), m1 = _mm256_set1_epi8(1);
    if (type == KVD_GGML_Q6_K) {
        for (int h = 0; h < 2; h++) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i*)(b + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i*)(b + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h));
            // Two bits per byte shifted up by 4 stay inside their byte.
#define Q6_HIGH(shift) _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, shift), m3), 4)
            __m256i* out = (__m256i*)(codes + 128 * h);
            _mm256_store_si256(out, _mm256_or_si256(_mm256_and_si256(l0, m15), Q6_HIGH(0)));
            _mm256_store_si256(out + 1, _mm256_or_si256(_mm256_and_si256(l1, m15), Q6_HIGH(2)));
            _mm256_store_si256(out + 2, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m15), Q6_HIGH(4)));
            _mm256_store_si256(out + 3, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m15), Q6_HIGH(6)));
#undef Q6_HIGH
        }
        return;
    }
    const int five = type == KVD_GGML_Q5_K;
    const uint8_t* qs = b + (five ? 48 : 16);
    if (!five) {
        for (int j = 0; j < 4; j++) {
            const __m256i q = _mm256_loadu_si256((const __m256i*)(qs + 32 * j));
            _mm256_store_si256((__m256i*)(codes + 64 * j), _mm256_and_si256(q, m15));
            _mm256_store_si256((__m256i*)(codes + 64 * j + 32), _mm256_and_si256(_mm256_srli_epi16(q, 4), m15));
        }
        return;
    }
    const __m256i hb = _mm256_loadu_si256((const __m256i*)(b + 16));
    for (int j = 0; j < 4; j++) {
        const __m256i q = _mm256_loadu_si256((const __m256i*)(qs + 32 * j));
        const __m256i lo5 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * j)), m1), 4);
        const __m256i hi5 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * j + 1)), m1), 4);
        _mm256_store_si256((__m256i*)(codes + 64 * j), _mm256_or_si256(_mm256_and_si256(q, m15), lo5));
        _mm256_store_si256((__m256i*)(codes + 64 * j + 32),
                           _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), m15), hi5));
    }
#else
    if (type == KVD_GGML_IQ4_XS) {
        for (int j = 0; j < SB / 32; j++)
            for (int l = 0; l < 16; l++) {
                const uint8_t q = b[8 + 16 * j + l];
                codes[32 * j + l] = (uint8_t)iq4_values[q & 15], codes[32 * j + 16 + l] = (uint8_t)iq4_values[q >> 4];
            }
        return;
    }
    if (type == KVD_GGML_Q6_K) {
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l++) {
                const uint8_t l0 = b[64 * h + l], l1 = b[64 * h + 32 + l], hb = b[128 + 32 * h + l];
                uint8_t* out = codes + 128 * h + l;
                out[0] = (l0 & 15) | (hb & 3) << 4;
                out[32] = (l1 & 15) | ((hb >> 2) & 3) << 4;
                out[64] = (l0 >> 4) | ((hb >> 4) & 3) << 4;
                out[96] = (l1 >> 4) | ((hb >> 6) & 3) << 4;
            }
        return;
    }
    const int five = type == KVD_GGML_Q5_K;
    const uint8_t* qs = b + (five ? 48 : 16);
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 32; l++) {
            const uint8_t hb = five ? b[16 + l] : 0;
            codes[64 * j + l] = (qs[32 * j + l] & 15) | ((hb >> (2 * j)) & 1) << 4;
            codes[64 * j + 32 + l] = (qs[32 * j + l] >> 4) | ((hb >> (2 * j + 1)) & 1) << 4;
        }
#endif
}

// ---- activations: int8 per super-block -------------------------------------------------------------------------

// x [M, K] -> q int8 [M, K], dx [M, K / 256] (each super-block's scale: its largest magnitude / 127) and bsum
// [M, K / 256, 16] (each 16 codes' sum). Every path: the same maximum (NaN passed over), the same product and
// nearest-even rounding, codes saturated to int8 (a NaN's code is -128 in each; against IQ4_XS's negative codes the
// sign trick's -(-128) wraps, so an output of NaN activations may differ between paths: it means nothing anyway).
static void quantize_super(const void* x, int x_bf16, int64_t M, int64_t K, int8_t* q, float* dx, int16_t* bsum,
                           int nthreads) {
    const int64_t nb = K / SB;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M > 1)
    for (int64_t r = 0; r < M; r++) {
        for (int64_t s = 0; s < nb; s++) {
            const int64_t at = r * K + s * SB;
            int8_t* out = q + at;
            int16_t* sums = bsum + (r * nb + s) * SUBS;
#if KVD_AVX2
            const int64_t es = x_bf16 ? 2 : 4;
            const char* p = (const char*)x + at * es;
            __m256 amax = _mm256_setzero_ps();
            for (int i = 0; i < SB / 8; i++)
                amax = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), load8(p + i * 8 * es, x_bf16)), amax);
            amax = _mm256_max_ps(amax, _mm256_permute2f128_ps(amax, amax, 1));
            amax = _mm256_max_ps(amax, _mm256_permute_ps(amax, 0x4e));
            amax = _mm256_max_ps(amax, _mm256_permute_ps(amax, 0xb1));
            const float d = _mm256_cvtss_f32(amax) / 127.f;
            const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
            for (int k = 0; k < SUBS; k++) {
                __m256i c[2];
                for (int i = 0; i < 2; i++)
                    c[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(load8(p + (16 * k + 8 * i) * es, x_bf16), inv),
                                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                // Saturated to int16, then int8: lane 0's four codes in bytes 0-3, lane 1's in bytes 16-19.
                const __m256i w = _mm256_packs_epi32(c[0], c[1]), b8 = _mm256_packs_epi16(w, w);
                const int32_t parts[4] = {_mm256_extract_epi32(b8, 0), _mm256_extract_epi32(b8, 4),
                                          _mm256_extract_epi32(b8, 1), _mm256_extract_epi32(b8, 5)};
                memcpy(out + 16 * k, parts, 16);
                // The codes' sum from the int8 codes themselves (1 x code pairs, then pairs of those).
                const __m128i pairs = _mm_maddubs_epi16(_mm_set1_epi8(1), _mm_loadu_si128((const __m128i*)(out + 16 * k)));
                __m128i s32 = _mm_madd_epi16(pairs, _mm_set1_epi16(1));
                s32 = _mm_add_epi32(s32, _mm_shuffle_epi32(s32, 0x4e));
                s32 = _mm_add_epi32(s32, _mm_shuffle_epi32(s32, 0xb1));
                sums[k] = (int16_t)_mm_cvtsi128_si32(s32);
            }
#else
            float amax = 0.f;
            for (int i = 0; i < SB; i++) {
                const float a = fabsf(load_f(x, at + i, x_bf16));
                amax = a > amax ? a : amax;
            }
            const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
            for (int k = 0; k < SUBS; k++) {
                int sum = 0;
                for (int i = 16 * k; i < 16 * k + 16; i++) {
                    const float v = nearbyintf(load_f(x, at + i, x_bf16) * inv);
                    // cvtps's answer outside int32 (and for NaN) is INT32_MIN: saturated to -128 as packs does.
                    const int c = v >= -128.f && v <= 127.f ? (int)v : v > 127.f ? 127 : -128;
                    out[i] = (int8_t)c;
                    sum += c;
                }
                sums[k] = (int16_t)sum;
            }
#endif
            dx[r * nb + s] = d;
        }
    }
}

// ---- the integer sums of one super-block and one activation row ------------------------------------------------

#if KVD_AVX2
static inline int32_t hsum8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
#endif

#if KVD_AVX512 && defined(__AVX512BW__) && defined(__AVX512VL__)
// AVX-512: each weight super-block decoded straight into registers (no unpacked copy): four vectors of 64 codes,
// each with the int16 scale of every pair of products, and the minimums per 16 values. Q4_K and Q5_K's nibbles
// split into the values [0, 32) + [64, 96), [32, 64) + [96, 128), then the same of the second 128: the activation
// codes are laid out in that order once per call (permute_k4), so no code moves. Q6_K's come in value order.
#define DIRECT_SUPER 1

typedef struct {
    __m512i codes[4], sc[4];
    __m256i min16;  // each 16 values' minimum, in value order (against the activation codes' sums bsum)
    float da, db;
    int signed_codes;  // IQ4_XS: codes are int8 values, multiplied as |code| x (the activation code, signed alike)
} direct_block;

// Lanes 0-15 of x (int16) to every lane of a vector whose int16 lane l holds x[first + l / 16] (l < 16) or
// x[second + (l - 16) / 16]: a 32-value sub-block's scale over the halves of one code vector.
static inline __m512i halves16(__m512i x, int first, int second) {
    return _mm512_permutexvar_epi16(_mm512_inserti64x4(_mm512_set1_epi16((short)first), _mm256_set1_epi16((short)second), 1), x);
}

// Bits c0 (first half) and c1 (second half) of every byte of h, shifted up to bit 4 (width: 1 or 3 for two bits).
static inline __m512i high_bits(__m512i h, int c0, int c1, int width) {
    const __m512i count = _mm512_inserti64x4(_mm512_set1_epi16((short)c0), _mm256_set1_epi16((short)c1), 1);
    return _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, count), _mm512_set1_epi8((char)width)), 4);
}

static inline void decode_k4(const uint8_t* b, int five, direct_block* o) {
    const __m512i m15 = _mm512_set1_epi8(15);
    const uint8_t* qs = b + (five ? 48 : 16);
    const __m512i r0 = _mm512_loadu_si512(qs), r1 = _mm512_loadu_si512(qs + 64);
    o->codes[0] = _mm512_and_si512(r0, m15), o->codes[1] = _mm512_and_si512(_mm512_srli_epi16(r0, 4), m15);
    o->codes[2] = _mm512_and_si512(r1, m15), o->codes[3] = _mm512_and_si512(_mm512_srli_epi16(r1, 4), m15);
    if (five) {  // value 64 j + l's fifth bit is bit 2 j of qh[l], value 64 j + 32 + l's bit 2 j + 1
        const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(b + 16)));
        for (int v = 0; v < 4; v++) {
            const int bit = 4 * (v / 2) + v % 2;
            o->codes[v] = _mm512_or_si512(o->codes[v], high_bits(h, bit, bit + 2, 1));
        }
    }
    // The eight 6-bit scales and minimums (scale_min_k4), four a word at once.
    uint32_t u[3];
    memcpy(u, b + 4, 12);
    const uint64_t sc = (uint64_t)((u[2] & 0x0f0f0f0fu) | ((u[0] >> 2) & 0x30303030u)) << 32 | (u[0] & 0x3f3f3f3fu);
    const uint64_t mn = (uint64_t)(((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 2) & 0x30303030u)) << 32 | (u[1] & 0x3f3f3f3fu);
    const __m512i s16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
    for (int v = 0; v < 4; v++) {  // vector v holds sub-blocks 4 (v / 2) + v % 2 and that + 2
        const int first = 4 * (v / 2) + v % 2;
        o->sc[v] = halves16(s16, first, first + 2);
    }
    const __m256i m8 = _mm256_castsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mn)));
    o->min16 = _mm256_permutexvar_epi16(_mm256_setr_epi16(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), m8);
    o->da = half_at(b), o->db = half_at(b + 2);
    o->signed_codes = 0;
}

static inline void decode_q6k(const uint8_t* b, direct_block* o) {
    const __m512i m15 = _mm512_set1_epi8(15);
    for (int h = 0; h < 2; h++) {  // ql[64 h + i]: value 128 h + i in its low nibble, 128 h + 64 + i in its high one
        const __m512i l = _mm512_loadu_si512(b + 64 * h);
        const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h)));
        o->codes[2 * h] = _mm512_or_si512(_mm512_and_si512(l, m15), high_bits(q, 0, 2, 3));
        o->codes[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m15), high_bits(q, 4, 6, 3));
    }
    const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + 192)));
    for (int v = 0; v < 4; v++)  // int16 lane l of vector v: values 64 v + 2 l, + 1, of sub-block 4 v + l / 8
        o->sc[v] = _mm512_permutexvar_epi16(_mm512_add_epi16(_mm512_set1_epi16((short)(4 * v)),
                                                             _mm512_srli_epi16(_mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                                                                                                15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 3)),
                                            _mm512_castsi256_si512(s16));
    o->min16 = _mm256_slli_epi16(s16, 5);  // codes stored + 32
    o->da = o->db = half_at(b + 208);
    o->signed_codes = 0;
}

// IQ4_XS's 64 qs bytes of half h: byte i indexes value 32 (4 h + i / 16) + i % 16 in its low nibble and that + 16
// in its high one, so vector 2 h holds the first 16 values of sub-blocks 4 h .. 4 h + 3, vector 2 h + 1 their last.
static inline void decode_iq4xs(const uint8_t* b, direct_block* o) {
    const __m512i m4 = _mm512_set1_epi8(15), table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)iq4_values));
    for (int h = 0; h < 2; h++) {
        const __m512i q = _mm512_loadu_si512(b + 8 + 64 * h);
        o->codes[2 * h] = _mm512_shuffle_epi8(table, _mm512_and_si512(q, m4));
        o->codes[2 * h + 1] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(q, 4), m4));
    }
    const __m512i s16 = _mm512_castsi128_si512(
        _mm_sub_epi16(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)scales_iq4xs(b))), _mm_set1_epi16(32)));
    const __m512i lane = _mm512_srli_epi16(_mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                                                            15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 3);
    for (int v = 0; v < 4; v++)  // int16 lane l of vector v: sub-block 4 (v / 2) + l / 8
        o->sc[v] = _mm512_permutexvar_epi16(_mm512_add_epi16(_mm512_set1_epi16((short)(4 * (v / 2))), lane), s16);
    o->da = o->db = half_at(b);
    o->signed_codes = 1;  // no minimum term: min16 unread
}

static inline void decode_block(int32_t type, const uint8_t* b, direct_block* o) {
    if (type == KVD_GGML_Q6_K)
        decode_q6k(b, o);
    else if (type == KVD_GGML_IQ4_XS)
        decode_iq4xs(b, o);
    else
        decode_k4(b, type == KVD_GGML_Q5_K, o);
}

// Each super-block's activation codes in decode_k4's order: [32, 64) and [64, 96) swapped in each 128.
static void permute_k4(int8_t* q, int64_t M, int64_t K) {
    for (int64_t at = 0; at < M * K; at += 128) {
        int8_t t[32];
        memcpy(t, q + at + 32, 32);
        memcpy(q + at + 32, q + at + 64, 32);
        memcpy(q + at + 64, t, 32);
    }
}

// Each super-block's activation codes in decode_iq4xs's order: in each 128, the first 16 of each 32, then the last.
static void permute_iq4(int8_t* q, int64_t M, int64_t K) {
    for (int64_t at = 0; at < M * K; at += 128) {
        int8_t t[128];
        memcpy(t, q + at, 128);
        for (int c = 0; c < 4; c++) {
            memcpy(q + at + 16 * c, t + 32 * c, 16);
            memcpy(q + at + 64 + 16 * c, t + 32 * c + 16, 16);
        }
    }
}

// The integer sums of a decoded block against the activation codes a; `signed_codes` a constant at each call.
static inline __attribute__((always_inline)) void direct_sums(int signed_codes, const direct_block* o, const int8_t* a,
                                                             const int16_t* bs, int32_t* sumi, int32_t* summ) {
    __m512i tot = _mm512_setzero_si512();
    for (int v = 0; v < 4; v++) {
        // u8 codes <= 127 x int8 codes, two a lane: at most 32258, so the int16 pair sums never saturate.
        const __m512i x = _mm512_loadu_si512(a + 64 * v), c = o->codes[v];
        const __m512i p = signed_codes ? _mm512_maddubs_epi16(_mm512_abs_epi8(c), _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(c), _mm512_setzero_si512(), x))
                                       : _mm512_maddubs_epi16(c, x);
#if defined(__AVX512VNNI__)
        tot = _mm512_dpwssd_epi32(tot, p, o->sc[v]);
#else
        tot = _mm512_add_epi32(tot, _mm512_madd_epi16(p, o->sc[v]));
#endif
    }
    *sumi = _mm512_reduce_add_epi32(tot);
    // IQ4_XS has no minimum term.
    *summ = signed_codes ? 0 : hsum8(_mm256_madd_epi16(o->min16, _mm256_loadu_si256((const __m256i*)bs)));
}

static inline void direct_dot(const direct_block* o, const int8_t* a, const int16_t* bs, int32_t* sumi, int32_t* summ) {
    if (o->signed_codes)
        direct_sums(1, o, a, bs, sumi, summ);
    else
        direct_sums(0, o, a, bs, sumi, summ);
}
#elif KVD_AVX2
// The scale of each int16 pair of products (lane l: values 32 c + 2 l, + 1, scaled by scale[2 c + l / 8]).
typedef struct {
    __m256i sc[SB / 32];
} scale_lanes;

static inline void scale_vectors(const unpacked* u, scale_lanes* v) {
    for (int c = 0; c < SB / 32; c++)
        v->sc[c] = _mm256_set_m128i(_mm_set1_epi16(u->scale[2 * c + 1]), _mm_set1_epi16(u->scale[2 * c]));
}

static inline void super_dot(const unpacked* u, const scale_lanes* v, const int8_t* a, const int16_t* bs,
                             int32_t* sumi, int32_t* summ) {
    __m256i tot = _mm256_setzero_si256();
    for (int c = 0; c < SB / 32; c++) {
        const __m256i w = _mm256_load_si256((const __m256i*)(u->codes + 32 * c)), x = _mm256_loadu_si256((const __m256i*)(a + 32 * c));
        const __m256i p = u->signed_codes ? _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)) : _mm256_maddubs_epi16(w, x);
        tot = _mm256_add_epi32(tot, _mm256_madd_epi16(p, v->sc[c]));
    }
    *sumi = hsum8(tot);
    *summ = hsum8(_mm256_madd_epi16(_mm256_load_si256((const __m256i*)u->min), _mm256_loadu_si256((const __m256i*)bs)));
}
#else
typedef struct {
    int unused;
} scale_lanes;

static inline void scale_vectors(const unpacked* u, scale_lanes* v) {
    (void)u, (void)v;
}

static inline void super_dot(const unpacked* u, const scale_lanes* v, const int8_t* a, const int16_t* bs,
                             int32_t* sumi, int32_t* summ) {
    (void)v;
    int32_t si = 0, sm = 0;
    for (int k = 0; k < SUBS; k++) {
        int32_t s = 0;
        for (int i = 16 * k; i < 16 * k + 16; i++) s += (u->signed_codes ? (int8_t)u->codes[i] : u->codes[i]) * a[i];
        si += u->scale[k] * s;
        sm += u->min[k] * bs[k];
    }
    *sumi = si, *summ = sm;
}
#endif
#ifndef DIRECT_SUPER
#define DIRECT_SUPER 0  // AVX2 and plain C: super-blocks unpacked once per work item (row_outputs below)
#endif

// ---- the linear ---------------------------------------------------------------------------------------------------

// A super-block ready for the dot products of every activation row: decoded into registers (AVX-512BW), or
// unpacked into memory with its scales' lanes (AVX2, plain C).
#if DIRECT_SUPER
typedef direct_block prepared_block;

static inline void prepare_block(int32_t type, const uint8_t* b, prepared_block* p) { decode_block(type, b, p); }

static inline void block_dot(const prepared_block* p, const int8_t* a, const int16_t* bs, int32_t* sumi, int32_t* summ) {
    direct_dot(p, a, bs, sumi, summ);
}
#else
typedef struct {
    unpacked u;
    scale_lanes lanes;
    float da, db;
} prepared_block;

#if KVD_AVX2
// Q4_K and Q5_K's scales and minimums straight into their vectors: the twelve bytes as three words, sub-blocks
// 0-3's 6 bits masked out of the first two, 4-7's low 4 bits from the third and their top 2 from the first two's
// high bits (scale_min_k4's arithmetic, eight at once).
static inline void prepare_k4(int32_t type, const uint8_t* b, prepared_block* p) {
    uint32_t w[3];
    memcpy(w, b + 4, sizeof w);
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
    const uint64_t scales = (w[0] & low6) | (uint64_t)((w[2] & low4) | ((w[0] >> 6) & top2) << 4) << 32;
    const uint64_t mins = (w[1] & low6) | (uint64_t)(((w[2] >> 4) & low4) | ((w[1] >> 6) & top2) << 4) << 32;
    const __m128i m8 = _mm_cvtsi64_si128((int64_t)mins);
    _mm256_store_si256((__m256i*)p->u.min, _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8)));  // each for 2 x 16
    for (int c = 0; c < SB / 32; c++) p->lanes.sc[c] = _mm256_set1_epi16((int16_t)(scales >> (8 * c) & 0xff));
    unpack_codes(type, b, p->u.codes);
    p->u.signed_codes = 0;
    p->u.da = p->da = half_at(b), p->u.db = p->db = half_at(b + 2);
}
#endif

static inline void prepare_block(int32_t type, const uint8_t* b, prepared_block* p) {
#if KVD_AVX2
    if (type == KVD_GGML_Q4_K || type == KVD_GGML_Q5_K) {
        prepare_k4(type, b, p);
        return;
    }
#endif
    unpack_scales(type, b, &p->u);
    unpack_codes(type, b, p->u.codes);
    scale_vectors(&p->u, &p->lanes);
    p->da = p->u.da, p->db = p->u.db;
}

static inline void block_dot(const prepared_block* p, const int8_t* a, const int16_t* bs, int32_t* sumi, int32_t* summ) {
    super_dot(&p->u, &p->lanes, a, bs, sumi, summ);
}
#endif

// Output n for activation rows m0 .. m1 - 1 (at most ROW_CHUNK): each super-block of the row prepared once.
static void row_outputs(const kvd_weight* w, int64_t n, int64_t m0, int64_t m1, const int8_t* q, const float* dx,
                        const int16_t* bsum, void* y, int y_bf16) {
    const int64_t K = w->k, nb = K / SB, tb = type_bytes(w->ggml);
    const uint8_t* row = (const uint8_t*)w->qs + n * nb * tb;
    float acc[ROW_CHUNK] = {0};
    prepared_block p;
    for (int64_t s = 0; s < nb; s++) {
        prepare_block(w->ggml, row + s * tb, &p);
        for (int64_t m = m0; m < m1; m++) {
            int32_t sumi, summ;
            block_dot(&p, q + m * K + s * SB, bsum + (m * nb + s) * SUBS, &sumi, &summ);
            const float d = dx[m * nb + s];
            float a = fmaf((float)sumi, p.da * d, acc[m - m0]);
            acc[m - m0] = fmaf((float)-summ, p.db * d, a);
        }
    }
    for (int64_t m = m0; m < m1; m++) store_f(y, m * w->n + n, acc[m - m0] + (w->bias ? w->bias[n] : 0.f), y_bf16);
}

#if KVD_AVX2 && !DIRECT_SUPER
// ---- AVX2: eight weight rows at a time ---------------------------------------------------------------------------
//
// A work item unpacks a super-block of 8 weight rows together, loads each activation vector once for all 8, and
// reduces the 8 rows' integer sums together (a tree of horizontal adds) before the float steps, which run on the 8
// outputs side by side: the same exact integers and the same fma per output as row_outputs, so the same bits.
#define ROWS8 8

// Lane r = the sum of v[r]'s lanes (int32, exact in any order).
static inline __m256i reduce8(const __m256i* v) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// A super-block's float steps for the 8 outputs (row_outputs' two fmas each, the same bits).
static inline __m256 float_steps8(__m256 acc, __m256i sumi, __m256i summ, __m256 da8, __m256 db8, float dx) {
    const __m256 d = _mm256_set1_ps(dx);
    const __m256 part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_mul_ps(da8, d), acc);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_setzero_si256(), summ)), _mm256_mul_ps(db8, d),
                           part);
}

// Outputs n0 .. n0 + 7 of activation rows m0 .. m1 - 1 from their accumulators, the bias added.
static inline void store_outputs8(const kvd_weight* w, int64_t n0, int64_t m0, int64_t m1, const __m256* acc, void* y,
                                  int y_bf16) {
    for (int64_t m = m0; m < m1; m++) {
        _Alignas(32) float out[ROWS8];
        _mm256_store_ps(out, acc[m - m0]);
        for (int r = 0; r < ROWS8; r++)
            store_f(y, m * w->n + n0 + r, out[r] + (w->bias ? w->bias[n0 + r] : 0.f), y_bf16);
    }
}

// The 8 rows' sumi (as super_dot's) against activation codes a; `signed_codes` a constant at each call.
static inline __attribute__((always_inline)) __m256i sums8(int signed_codes, const prepared_block* p, const int8_t* a) {
    __m256i tot[ROWS8];
    for (int r = 0; r < ROWS8; r++) tot[r] = _mm256_setzero_si256();
    for (int c = 0; c < SB / 32; c++) {
        const __m256i x = _mm256_loadu_si256((const __m256i*)(a + 32 * c));
        for (int r = 0; r < ROWS8; r++) {
            const __m256i w = _mm256_load_si256((const __m256i*)(p[r].u.codes + 32 * c));
            const __m256i prod = signed_codes ? _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w))
                                              : _mm256_maddubs_epi16(w, x);
            tot[r] = _mm256_add_epi32(tot[r], _mm256_madd_epi16(prod, p[r].lanes.sc[c]));
        }
    }
    return reduce8(tot);
}

// Outputs n0 .. n0 + 7 for activation rows m0 .. m1 - 1 (at most ROW_CHUNK).
static void rows8_outputs(const kvd_weight* w, int64_t n0, int64_t m0, int64_t m1, const int8_t* q, const float* dx,
                          const int16_t* bsum, void* y, int y_bf16) {
    const int64_t K = w->k, nb = K / SB, tb = type_bytes(w->ggml);
    const uint8_t* rows = (const uint8_t*)w->qs + n0 * nb * tb;
    const int signed_codes = w->ggml == KVD_GGML_IQ4_XS;
    __m256 acc[ROW_CHUNK];
    prepared_block p[ROWS8];
    _Alignas(32) float da[ROWS8], db[ROWS8];
    for (int64_t m = m0; m < m1; m++) acc[m - m0] = _mm256_setzero_ps();
    const uint8_t* next = n0 + 2 * ROWS8 <= w->n ? rows + ROWS8 * nb * tb : NULL;  // the next group's rows
    for (int64_t s = 0; s < nb; s++) {
        for (int r = 0; r < ROWS8; r++) {
            if (next)  // its block s on its way while this one computes (decode is bound by memory's latency)
                for (int64_t line = 0; line < tb; line += 64) _mm_prefetch((const char*)next + (r * nb + s) * tb + line, _MM_HINT_T0);
            prepare_block(w->ggml, rows + (r * nb + s) * tb, &p[r]);
            da[r] = p[r].da, db[r] = p[r].db;
        }
        const __m256 da8 = _mm256_load_ps(da), db8 = _mm256_load_ps(db);
        for (int64_t m = m0; m < m1; m++) {
            const int8_t* a = q + m * K + s * SB;
            const __m256i sumi = signed_codes ? sums8(1, p, a) : sums8(0, p, a);
            const __m256i bs = _mm256_loadu_si256((const __m256i*)(bsum + (m * nb + s) * SUBS));
            __m256i mins[ROWS8];
            for (int r = 0; r < ROWS8; r++) mins[r] = _mm256_madd_epi16(_mm256_load_si256((const __m256i*)p[r].u.min), bs);
            const __m256i summ = reduce8(mins);
            acc[m - m0] = float_steps8(acc[m - m0], sumi, summ, da8, db8, dx[m * nb + s]);
        }
    }
    store_outputs8(w, n0, m0, m1, acc, y, y_bf16);
}

// ---- AVX2, few activation rows: Q4_K, Q5_K and Q6_K decoded straight into registers ----------------------------
//
// At one activation row (a single stream's decode step), unpacking a super-block into memory costs more than the
// dot products it serves: each 32 codes are decoded in registers and multiplied at once (1.3-1.6x on Zen 3 for a
// 4096 x 4096 Q4_K or Q6_K; at two rows the two ways tie). The integer sums are row_outputs' (exact), the float
// steps rows8_outputs': the same bits.
#define DIRECT_MAX_ROWS 1

// sumi's lanes (to be summed) for super-block b of type `type` (a constant at each call) and activation codes a.
static inline __attribute__((always_inline)) __m256i direct_sums8(int32_t type, const uint8_t* b, const int8_t* a) {
    const __m256i m15 = _mm256_set1_epi8(15);
    __m256i tot = _mm256_setzero_si256();
    if (type == KVD_GGML_Q6_K) {
        // Sub-block scales as int16 pairs (2 c, 2 c + 1) in dword c: chunk c's lanes take the first in their low
        // half and the second in their high half.
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + 192)));
        const __m256i halves = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3,
                                                2, 3, 2, 3, 2, 3, 2, 3);
        const __m256i m3 = _mm256_set1_epi8(3);
        for (int h = 0; h < 2; h++) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i*)(b + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i*)(b + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h));
            const __m256i codes[4] = {
                _mm256_or_si256(_mm256_and_si256(l0, m15), _mm256_slli_epi16(_mm256_and_si256(hb, m3), 4)),
                _mm256_or_si256(_mm256_and_si256(l1, m15), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m3), 4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m15), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m3), 4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m15), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m3), 4)),
            };
            for (int j = 0; j < 4; j++) {
                const int c = 4 * h + j;
                const __m256i sc = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(sc16, _mm256_set1_epi32(c)), halves);
                const __m256i p = _mm256_maddubs_epi16(codes[j], _mm256_loadu_si256((const __m256i*)(a + 32 * c)));
                tot = _mm256_add_epi32(tot, _mm256_madd_epi16(p, sc));
            }
        }
        return tot;
    }
    const int five = type == KVD_GGML_Q5_K;
    uint32_t w[3];
    memcpy(w, b + 4, sizeof w);
    const uint64_t scales = (w[0] & 0x3f3f3f3f) | (uint64_t)((w[2] & 0x0f0f0f0f) | ((w[0] >> 6) & 0x03030303) << 4) << 32;
    const uint8_t* qs = b + (five ? 48 : 16);
    const __m256i hb = five ? _mm256_loadu_si256((const __m256i*)(b + 16)) : _mm256_setzero_si256(), m1 = _mm256_set1_epi8(1);
    for (int j = 0; j < 4; j++) {
        const __m256i q = _mm256_loadu_si256((const __m256i*)(qs + 32 * j));
        __m256i lo = _mm256_and_si256(q, m15), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m15);
        if (five) {
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * j), m1), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * j + 1), m1), 4));
        }
        const __m256i p0 = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)(a + 64 * j)));
        const __m256i p1 = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(a + 64 * j + 32)));
        tot = _mm256_add_epi32(tot, _mm256_madd_epi16(p0, _mm256_set1_epi16((int16_t)(scales >> (16 * j) & 0xff))));
        tot = _mm256_add_epi32(tot, _mm256_madd_epi16(p1, _mm256_set1_epi16((int16_t)(scales >> (16 * j + 8) & 0xff))));
    }
    return tot;
}

// The minimums of super-block b's 16 sub-blocks (int16, as unpacked.min) and its two float multipliers.
static inline __attribute__((always_inline)) __m256i direct_mins(int32_t type, const uint8_t* b, float* da, float* db) {
    if (type == KVD_GGML_Q6_K) {
        *da = *db = half_at(b + 208);
        return _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + 192))), 5);
    }
    uint32_t w[3];
    memcpy(w, b + 4, sizeof w);
    const uint64_t mins = (w[1] & 0x3f3f3f3f) | (uint64_t)(((w[2] >> 4) & 0x0f0f0f0f) | ((w[1] >> 6) & 0x03030303) << 4) << 32;
    const __m128i m8 = _mm_cvtsi64_si128((int64_t)mins);
    *da = half_at(b), *db = half_at(b + 2);
    return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));  // each for 2 x 16 values
}

// rows8_outputs for at most DIRECT_MAX_ROWS activation rows of a Q4_K, Q5_K or Q6_K weight.
static inline __attribute__((always_inline)) void rows8_direct(int32_t type, const kvd_weight* w, int64_t n0,
                                                               int64_t m0, int64_t m1, const int8_t* q,
                                                               const float* dx, const int16_t* bsum, void* y,
                                                               int y_bf16) {
    const int64_t K = w->k, nb = K / SB, tb = type_bytes(type);
    const uint8_t* rows = (const uint8_t*)w->qs + n0 * nb * tb;
    __m256 acc[DIRECT_MAX_ROWS];
    for (int64_t m = m0; m < m1; m++) acc[m - m0] = _mm256_setzero_ps();
    _Alignas(32) float da[ROWS8], db[ROWS8];
    __m256i mins[ROWS8];
    const uint8_t* next = n0 + 2 * ROWS8 <= w->n ? rows + ROWS8 * nb * tb : NULL;  // the next group's rows
    for (int64_t s = 0; s < nb; s++) {
        for (int r = 0; r < ROWS8; r++) {
            if (next)
                for (int64_t line = 0; line < tb; line += 64) _mm_prefetch((const char*)next + (r * nb + s) * tb + line, _MM_HINT_T0);
            mins[r] = direct_mins(type, rows + (r * nb + s) * tb, da + r, db + r);
        }
        const __m256 da8 = _mm256_load_ps(da), db8 = _mm256_load_ps(db);
        for (int64_t m = m0; m < m1; m++) {
            const int8_t* a = q + m * K + s * SB;
            __m256i tot[ROWS8], mm[ROWS8];
            const __m256i bs = _mm256_loadu_si256((const __m256i*)(bsum + (m * nb + s) * SUBS));
            for (int r = 0; r < ROWS8; r++) {
                tot[r] = direct_sums8(type, rows + (r * nb + s) * tb, a);
                mm[r] = _mm256_madd_epi16(mins[r], bs);
            }
            const __m256i sumi = reduce8(tot), summ = reduce8(mm);
            acc[m - m0] = float_steps8(acc[m - m0], sumi, summ, da8, db8, dx[m * nb + s]);
        }
    }
    store_outputs8(w, n0, m0, m1, acc, y, y_bf16);
}

// The 8 rows' outputs by the fastest path for their type and row count.
static void rows8_any(const kvd_weight* w, int64_t n0, int64_t m0, int64_t m1, const int8_t* q, const float* dx,
                      const int16_t* bsum, void* y, int y_bf16) {
    if (m1 - m0 <= DIRECT_MAX_ROWS) {
        switch (w->ggml) {
            case KVD_GGML_Q4_K: return rows8_direct(KVD_GGML_Q4_K, w, n0, m0, m1, q, dx, bsum, y, y_bf16);
            case KVD_GGML_Q5_K: return rows8_direct(KVD_GGML_Q5_K, w, n0, m0, m1, q, dx, bsum, y, y_bf16);
            case KVD_GGML_Q6_K: return rows8_direct(KVD_GGML_Q6_K, w, n0, m0, m1, q, dx, bsum, y, y_bf16);
        }
    }
    rows8_outputs(w, n0, m0, m1, q, dx, bsum, y, y_bf16);
}
#endif

#if DIRECT_SUPER && defined(__AVX512VNNI__)
// ---- many activation rows: AVX-512 VNNI outer products over 16 weight rows ------------------------------------
//
// A work item decodes a group of 16 weight rows once, each super-block into the dwords of its codes with the 16
// rows in the lanes (a 16 x 16 dword transpose of decode_block's vectors), and multiplies them by each activation
// row of its chunk: VPDPBUSD adds 4 code products into each row's int32 lane, each run of codes under one scale
// is multiplied by that scale's lanes, the minimum term comes from int16 pairs (VPDPWSSD): the same exact integers
// as direct_dot, then the same float steps per output, so the outputs are the other paths' bits.
// From here, one decode of a group of the file's rows beats decoding each row per chunk (Xeon, 2 cores: 8 rows 1.3x,
// 4 rows 0.7x); packed weights take the outer products at every row count.
#define SUPER_VNNI_MIN_ROWS 6
#define PASS_ROWS 4  // activation rows a pass: their sums in registers

typedef struct {
    __m512i codes[SB / 4];  // dword q of the 16 rows' codes (IQ4_XS's + 128), in decode_block's value order
    __m512i scale[SUBS];    // int32 scale of each run of codes (Q4_K, Q5_K: 8 runs of 32; Q6_K, IQ4_XS: 16 of 16)
    __m512i mins[SUBS / 2]; // int16 pairs: the minimums of values 32 p .. 32 p + 15 and 32 p + 16 .. 32 p + 31
    __m512 da, db;
} group_block;

// Lane j of out[c] = dword c of in[j] (16 x 16 int32): pairs of rows interleaved, then pairs of pairs, then the
// 128-bit blocks.
static inline void transpose16(const __m512i* in, __m512i* out) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(in[2 * i], in[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(in[2 * i], in[2 * i + 1]);
    }
    for (int g = 0; g < 4; g++) {  // u[4 g + c], 128-bit block L: rows 4 g .. 4 g + 3 of column 4 L + c
        u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xee);
        const __m512i x2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44), x3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xee);
        out[c] = _mm512_shuffle_i32x4(x0, x2, 0x88), out[4 + c] = _mm512_shuffle_i32x4(x0, x2, 0xdd);
        out[8 + c] = _mm512_shuffle_i32x4(x1, x3, 0x88), out[12 + c] = _mm512_shuffle_i32x4(x1, x3, 0xdd);
    }
}

// Super-block s of weight rows n0 .. n0 + 15 into g.
static void decode_group(const kvd_weight* w, int64_t n0, int64_t s, group_block* g) {
    const int64_t nb = w->k / SB, tb = type_bytes(w->ggml);
    const int k4 = w->ggml == KVD_GGML_Q4_K || w->ggml == KVD_GGML_Q5_K, iq4 = w->ggml == KVD_GGML_IQ4_XS;
    _Alignas(64) int32_t sc[SUBS][OUT16], mn[SUBS / 2][OUT16];
    _Alignas(64) float da[OUT16], db[OUT16];
    __m512i rows[4][OUT16];  // [vector of decode_block][row]
    for (int j = 0; j < OUT16; j++) {
        const uint8_t* b = (const uint8_t*)w->qs + ((n0 + j) * nb + s) * tb;
        direct_block o;
        decode_block(w->ggml, b, &o);
        // IQ4_XS's values + 128 are unsigned codes for VPDPBUSD (without the int16 pairs that would saturate).
        for (int v = 0; v < 4; v++) rows[v][j] = iq4 ? _mm512_xor_si512(o.codes[v], _mm512_set1_epi8((char)0x80)) : o.codes[v];
        unpacked u;
        unpack_scales(w->ggml, b, &u);
        // Runs in decode order: Q4_K's vector v holds the 32 values of sub-block 4 (v / 2) + v % 2, then of that + 2;
        // IQ4_XS's vector v the 16 values of sub-blocks 4 (v / 2) .. 4 (v / 2) + 3 in turn.
        for (int r = 0; r < (k4 ? SUBS / 2 : SUBS); r++)
            sc[r][j] = k4 ? u.scale[2 * (4 * (r / 4) + (r / 2) % 2 + 2 * (r % 2))] : iq4 ? u.scale[2 * (4 * (r / 8) + r % 4)] : u.scale[r];
        int16_t min[SUBS];
        for (int k = 0; k < SUBS; k++) min[k] = iq4 ? (int16_t)(128 * u.scale[k]) : u.min[k];
        for (int p = 0; p < SUBS / 2; p++) mn[p][j] = (int32_t)((uint32_t)(uint16_t)min[2 * p] | (uint32_t)(uint16_t)min[2 * p + 1] << 16);
        da[j] = u.da, db[j] = u.db;
    }
    for (int v = 0; v < 4; v++) transpose16(rows[v], g->codes + 16 * v);
    for (int r = 0; r < (k4 ? SUBS / 2 : SUBS); r++) g->scale[r] = _mm512_load_si512(sc[r]);
    for (int p = 0; p < SUBS / 2; p++) g->mins[p] = _mm512_load_si512(mn[p]);
    g->da = _mm512_load_ps(da), g->db = _mm512_load_ps(db);
}

// Super-block s of a packed weight's group g into o: the same group_block as decode_group's of the file's rows,
// taken dword by dword from the packed fields (a nibble split and a shift where decode_group transposes).
static void unpack_group(const kvd_weight* w, int64_t g, int64_t s, group_block* o) {
    const int64_t nb = w->k / SB, tb = type_bytes(w->ggml);
    const uint8_t* b = (const uint8_t*)w->qs + (g * nb + s) * OUT16 * tb;
#define FIELD(start, q) _mm512_loadu_si512(b + 16 * (start) + 64 * (q))
    const __m512i m4 = _mm512_set1_epi8(15), byte = _mm512_set1_epi32(0xff);
    if (w->ggml == KVD_GGML_Q6_K) {  // ql at 0, qh at 128, the int8 scales at 192, d at 208
        const __m512i m3 = _mm512_set1_epi8(3);
        for (int h = 0; h < 2; h++)
            for (int c = 0; c < 16; c++) {  // decode_q6k's vectors 2 h and 2 h + 1, dword c
                const __m512i l = FIELD(0, 16 * h + c), q = FIELD(128, 8 * h + c % 8);
                const int shift = c < 8 ? 0 : 2;
                const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(q, shift), m3);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(q, shift + 4), m3);
                o->codes[32 * h + c] = _mm512_or_si512(_mm512_and_si512(l, m4), _mm512_slli_epi32(lo, 4));
                o->codes[32 * h + 16 + c] =
                    _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(l, 4), m4), _mm512_slli_epi32(hi, 4));
            }
        for (int r = 0; r < SUBS; r++)  // sign-extended byte r % 4 of dword r / 4
            o->scale[r] = _mm512_srai_epi32(_mm512_slli_epi32(FIELD(192, r / 4), 24 - 8 * (r % 4)), 24);
        for (int p = 0; p < SUBS / 2; p++)  // int16 pairs of 32 x the scales (codes stored + 32)
            o->mins[p] = _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi32(o->scale[2 * p], 5), _mm512_set1_epi32(0xffff)),
                                         _mm512_slli_epi32(o->scale[2 * p + 1], 21));
        o->da = o->db = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(b + 16 * 208)));
        return;
    }
    // Q4_K and Q5_K: d at 0, dmin at 2, the 12 scale bytes at 4, Q5_K's fifth bits at 16, the codes at 16 or 48.
    const int five = w->ggml == KVD_GGML_Q5_K;
    for (int x = 0; x < 32; x++) {  // code dword x: decode_k4's vector 2 (x / 16) (low nibbles) and + 1 (high)
        const __m512i q = FIELD(five ? 48 : 16, x);
        const int v = 2 * (x / 16), c = x % 16;
        __m512i lo = _mm512_and_si512(q, m4), hi = _mm512_and_si512(_mm512_srli_epi32(q, 4), m4);
        if (five) {  // vector v's fifth bit: bit 4 (v / 2) + v % 2 of qh, + 2 in its second half
            const __m512i h = FIELD(16, c % 8), one = _mm512_set1_epi8(1);
            const int bit = 4 * (v / 2) + 2 * (c / 8);
            lo = _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, bit), one), 4));
            hi = _mm512_or_si512(hi, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, bit + 1), one), 4));
        }
        o->codes[16 * v + c] = lo, o->codes[16 * (v + 1) + c] = hi;
    }
    // scale_min_k4 on 16 rows at once: sub-block j's scale and minimum in byte j % 4 of sc[j / 4] and mn[j / 4].
    const __m512i u0 = FIELD(4, 0), u1 = FIELD(4, 1), u2 = FIELD(4, 2), m6 = _mm512_set1_epi8(63);
    const __m512i top = _mm512_set1_epi8(0x30), m15 = _mm512_set1_epi8(15);
    const __m512i sc[2] = {_mm512_and_si512(u0, m6),
                           _mm512_or_si512(_mm512_and_si512(u2, m15), _mm512_and_si512(_mm512_srli_epi32(u0, 2), top))};
    const __m512i mn[2] = {_mm512_and_si512(u1, m6),
                           _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), m15),
                                           _mm512_and_si512(_mm512_srli_epi32(u1, 2), top))};
    for (int r = 0; r < SUBS / 2; r++) {  // run r: decode_group's sub-block 4 (r / 4) + (r / 2) % 2 + 2 (r % 2)
        const int j = 4 * (r / 4) + (r / 2) % 2 + 2 * (r % 2);
        o->scale[r] = _mm512_and_si512(_mm512_srli_epi32(sc[j / 4], 8 * (j % 4)), byte);
    }
    for (int p = 0; p < SUBS / 2; p++) {  // the minimum of sub-block p (32 values) in both halves of the pair
        const __m512i m = _mm512_and_si512(_mm512_srli_epi32(mn[p / 4], 8 * (p % 4)), byte);
        o->mins[p] = _mm512_or_si512(m, _mm512_slli_epi32(m, 16));
    }
    o->da = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)b));
    o->db = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(b + 32)));
#undef FIELD
}

// Activation rows m .. m + rows - 1 against the group's decoded super-blocks gb [nb]: outputs n0 .. n0 + 15. run:
// the dwords under one scale (8 or 4); fold: the minimum term taken from the sums in int32 (IQ4_XS, whose other
// paths have no minimum term), so the float steps meet the same integers.
static inline __attribute__((always_inline)) void group_pass(int run, int fold, int rows, const kvd_weight* w,
                                                            const group_block* gb, int64_t n0, int64_t m,
                                                            const int8_t* q, const float* dx, const int16_t* bsum,
                                                            void* y, int y_bf16) {
    const int64_t K = w->k, nb = K / SB;
    __m512 acc[PASS_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    group_block streamed;
    for (int64_t s = 0; s < nb; s++) {
        // gb NULL: a packed weight's super-blocks unpacked one at a time as the pass reaches them (one pass over the
        // group, so the loads of the next overlap this one's products).
        const group_block* g = gb ? gb + s : (unpack_group(w, n0 / OUT16, s, &streamed), &streamed);
        __m512i tot[PASS_ROWS], summ[PASS_ROWS];
        for (int r = 0; r < rows; r++) tot[r] = summ[r] = _mm512_setzero_si512();
        for (int c = 0; c < SB / 4; c += run) {
            __m512i part[PASS_ROWS];
            for (int r = 0; r < rows; r++) part[r] = _mm512_setzero_si512();
            for (int i = c; i < c + run; i++) {
                for (int r = 0; r < rows; r++) {
                    int32_t a;
                    memcpy(&a, q + (m + r) * K + s * SB + 4 * i, 4);
                    part[r] = _mm512_dpbusd_epi32(part[r], g->codes[i], _mm512_set1_epi32(a));
                }
            }
            for (int r = 0; r < rows; r++) tot[r] = _mm512_add_epi32(tot[r], _mm512_mullo_epi32(part[r], g->scale[c / run]));
        }
        for (int p = 0; p < SUBS / 2; p++)
            for (int r = 0; r < rows; r++) {
                int32_t pair;
                memcpy(&pair, bsum + ((m + r) * nb + s) * SUBS + 2 * p, 4);
                summ[r] = _mm512_dpwssd_epi32(summ[r], g->mins[p], _mm512_set1_epi32(pair));
            }
        for (int r = 0; r < rows; r++) {
            if (fold) tot[r] = _mm512_sub_epi32(tot[r], summ[r]), summ[r] = _mm512_setzero_si512();
            const __m512 d = _mm512_set1_ps(dx[(m + r) * nb + s]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot[r]), _mm512_mul_ps(g->da, d), acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_setzero_si512(), summ[r])),
                                     _mm512_mul_ps(g->db, d), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) store_outputs16(w, m + r, n0, acc[r], y, y_bf16);
}

static inline __attribute__((always_inline)) void group_rows16(int run, int fold, const kvd_weight* w,
                                                              const group_block* gb, int64_t n0, int64_t m0, int64_t m1,
                                                              const int8_t* q, const float* dx, const int16_t* bsum,
                                                              void* y, int y_bf16) {
    int64_t m = m0;
    for (; m + PASS_ROWS <= m1; m += PASS_ROWS) group_pass(run, fold, PASS_ROWS, w, gb, n0, m, q, dx, bsum, y, y_bf16);
    if (m1 - m == 3) group_pass(run, fold, 3, w, gb, n0, m, q, dx, bsum, y, y_bf16);
    if (m1 - m == 2) group_pass(run, fold, 2, w, gb, n0, m, q, dx, bsum, y, y_bf16);
    if (m1 - m == 1) group_pass(run, fold, 1, w, gb, n0, m, q, dx, bsum, y, y_bf16);
}

// Outputs of the whole groups of 16 weight rows, in items of one group x up to ROW_CHUNK activation rows (group
// major: a thread's consecutive items share its decoded group). Returns 1 when out of memory.
static int vnni_super(const kvd_weight* w, int64_t M, const int8_t* q, const float* dx, const int16_t* bsum, void* y,
                      int y_bf16, int nthreads) {
    const int64_t nb = w->k / SB, groups = w->n / OUT16, chunks = (M + ROW_CHUNK - 1) / ROW_CHUNK;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        // A packed weight's passes of at most PASS_ROWS rows unpack each super-block as they reach it: decode
        // steps need no group buffer.
        const int streams = w->tiles && M <= PASS_ROWS;
        group_block* gb = streams ? NULL : aligned_alloc(64, sizeof(group_block) * (size_t)nb);
        failed |= !streams && !gb;
        int64_t decoded = -1;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < groups * chunks; item++) {
            if (!streams && !gb) continue;
            const int64_t group = item / chunks, m0 = item % chunks * ROW_CHUNK, m1 = m0 + ROW_CHUNK < M ? m0 + ROW_CHUNK : M;
            const int stream = w->tiles && m1 - m0 <= PASS_ROWS;  // a single pass: unpacked as it goes
            if (!stream && decoded != group) {
                for (int64_t s = 0; s < nb; s++)
                    if (w->tiles)
                        unpack_group(w, group, s, gb + s);
                    else
                        decode_group(w, group * OUT16, s, gb + s);
                decoded = group;
            }
            const group_block* from = stream ? NULL : gb;
            if (w->ggml == KVD_GGML_Q6_K)
                group_rows16(4, 0, w, from, group * OUT16, m0, m1, q, dx, bsum, y, y_bf16);
            else if (w->ggml == KVD_GGML_IQ4_XS)
                group_rows16(4, 1, w, from, group * OUT16, m0, m1, q, dx, bsum, y, y_bf16);
            else
                group_rows16(8, 0, w, from, group * OUT16, m0, m1, q, dx, bsum, y, y_bf16);
        }
        free(gb);
    }
    return failed;
}
#endif

int super_weight_linear(const kvd_weight* w, const void* x, int x_bf16, int64_t M, void* y, int y_bf16,
                        int nthreads) {
#if DIRECT_SUPER && defined(__AVX512VNNI__)
    if (w->tiles && w->ggml == KVD_GGML_IQ4_XS) return KVD_UNSUPPORTED;  // kvd_super_pack leaves it as the file has it
#else
    if (w->tiles) return KVD_UNSUPPORTED;  // this build packs nothing, and reads no packed rows
#endif
    const int64_t K = w->k, nb = K / SB, chunks = (M + ROW_CHUNK - 1) / ROW_CHUNK;
    int8_t* q = malloc((size_t)(M * K));
    float* dx = malloc(sizeof(float) * (size_t)(M * nb));
    int16_t* bsum = malloc(sizeof(int16_t) * (size_t)(M * nb * SUBS));
    int failed = !q || !dx || !bsum;
    if (!failed) {
        quantize_super(x, x_bf16, M, K, q, dx, bsum, nthreads);
#if DIRECT_SUPER
        if (w->ggml == KVD_GGML_Q4_K || w->ggml == KVD_GGML_Q5_K) permute_k4(q, M, K);
        if (w->ggml == KVD_GGML_IQ4_XS) permute_iq4(q, M, K);
#endif
        int64_t first = 0;  // weight rows before it are done
#if DIRECT_SUPER && defined(__AVX512VNNI__)
        if ((M >= SUPER_VNNI_MIN_ROWS || w->tiles) && w->n >= OUT16) {
            failed = vnni_super(w, M, q, dx, bsum, y, y_bf16, nthreads);
            first = w->n / OUT16 * OUT16;
        }
#elif KVD_AVX2 && !DIRECT_SUPER
        first = w->n / ROWS8 * ROWS8;
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t item = 0; item < first / ROWS8 * chunks; item++) {
            const int64_t n0 = item / chunks * ROWS8, m0 = item % chunks * ROW_CHUNK;
            rows8_any(w, n0, m0, m0 + ROW_CHUNK < M ? m0 + ROW_CHUNK : M, q, dx, bsum, y, y_bf16);
        }
#endif
        // Row-major items: a thread's consecutive items read consecutive weight rows.
        if (!failed) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
            for (int64_t item = first * chunks; item < w->n * chunks; item++) {
                const int64_t n = item / chunks, m0 = item % chunks * ROW_CHUNK;
                row_outputs(w, n, m0, m0 + ROW_CHUNK < M ? m0 + ROW_CHUNK : M, q, dx, bsum, y, y_bf16);
            }
        }
    }
    free(q);
    free(dx);
    free(bsum);
    return failed ? KVD_OUT_OF_MEMORY : KVD_OK;
}

void super_dequantize(const kvd_weight* w, int64_t first, int64_t count, void* out, int out_bf16, int nthreads) {
    const int64_t K = w->k, nb = K / SB;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = first; n < first + count; n++) {
        unpacked u;
        uint8_t tmp[256];
        for (int64_t s = 0; s < nb; s++) {
            const uint8_t* b = file_block(w, n, s, tmp);
            unpack_scales(w->ggml, b, &u);
            unpack_codes(w->ggml, b, u.codes);
            for (int i = 0; i < SB; i++) {
                const int code = u.signed_codes ? (int8_t)u.codes[i] : u.codes[i];
                const float v = u.da * (float)(u.scale[i / 16] * code) - u.db * (float)u.min[i / 16];
                store_f(out, (n - first) * K + s * SB + i, v, out_bf16);
            }
        }
    }
}

int kvd_super_pack(int32_t ggml, const void* src, void* dst, int64_t n, int64_t k, int64_t row_bytes, int nthreads) {
    const int known = ggml == KVD_GGML_Q4_K || ggml == KVD_GGML_Q5_K || ggml == KVD_GGML_Q6_K || ggml == KVD_GGML_IQ4_XS;
    if (!known || n < 0 || k <= 0 || k % SB || row_bytes != k / SB * type_bytes(ggml)) return KVD_BAD_INDEX;
#if DIRECT_SUPER && defined(__AVX512VNNI__)
    const int64_t groups = ggml == KVD_GGML_IQ4_XS ? 0 : n / OUT16;
#else
    const int64_t groups = 0;
#endif
    const int64_t nb = k / SB, tb = row_bytes / nb, bytes = OUT16 * row_bytes;
    if (src != dst) memcpy((uint8_t*)dst + groups * bytes, (const uint8_t*)src + groups * bytes, (size_t)((n - groups * OUT16) * row_bytes));
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed) if (groups > 1)
    {
        uint8_t* rows = src == dst ? malloc((size_t)bytes) : NULL;  // in place: one group's rows as the file has them
        failed |= src == dst && !rows;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            uint8_t* to = (uint8_t*)dst + g * bytes;
            const uint8_t* from = (const uint8_t*)src + g * bytes;
            if (src == dst) {
                if (!rows) continue;
                from = memcpy(rows, to, (size_t)bytes);
            }
            for (int64_t s = 0; s < nb; s++)
                for (int j = 0; j < OUT16; j++) move_block(ggml, j, from + (j * nb + s) * tb, to + s * bytes / nb, 1);
        }
        free(rows);
    }
    return failed ? KVD_OUT_OF_MEMORY : groups > 0;
}
