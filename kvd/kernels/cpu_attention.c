// Attention over the paged KV pool in place, one query per row (no gather of K/V into a workspace): a decode
// token per sequence or any row of a prompt, over a float32, bf16 or 8-bit pool; on AMX, scores in tiles (a bf16
// pool's every row, a prompt's rows in chunks of 16 over the 8-bit pool). And the K/V store, which writes (and
// for the 8-bit pool quantizes) the rows the attention reads. Indices into the pool are checked before anything
// is written (KVD_BAD_INDEX).
#include "cpu_internal.h"

// Bytes of one element of a pool's kind (KV_INT8, bf16 or float32).
static inline int kv_elem(int kind) { return kind == KV_INT8 ? 1 : kind ? 2 : 4; }

#if KVD_AVX512
// Lane j = j x slot_bytes: the byte offsets of 16 consecutive slots' rows, for gathers of their scales.
static inline __m512i slot_offsets16(int64_t slot_bytes) {
    return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                              _mm512_set1_epi32((int)slot_bytes));
}
#endif

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
#endif

// scores[t] = exp(scores[t] - max) for t < n; returns their sum. Eight at a time where SIMD runs: the order of
// the sum depends on n alone, so a query's softmax is the same whatever else the call holds. `sink`: a logit of
// its own in the denominator (an attention sink; -inf for none, which changes no bit): the max counts it, the sum
// ends with its exponential.
static inline float softmax_numerators(float* sc, int64_t n, float sink) {
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
    mx = sink > mx ? sink : mx;
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
    return sum + expf(sink - mx);
}

// The sink logit of query head h, or -inf without sinks.
static inline float head_sink(const float* sinks, int64_t h) { return sinks ? sinks[h] : -INFINITY; }

// A windowed query sees only the last `window` of its ctx tokens: the scores before them leave the softmax
// (exp_nonpositive and expf give exactly 0 for -inf). window 0: no window.
static inline void mask_before_window(float* scores, int64_t stride, int64_t heads, int64_t ctx, int64_t window) {
    for (int64_t g = 0; window && g < heads; g++)
        for (int64_t t = 0; t < ctx - window; t++) scores[g * stride + t] = -INFINITY;
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
    const int32_t* table, int64_t ctx, int64_t window, const float* sinks, float scale, float* work,
    kv_stream* st) {
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
    mask_before_window(scores, ctx, group, ctx, window);
    for (int64_t g = 0; g < group; g++)
        sums[g] = softmax_numerators(scores + g * ctx, ctx, head_sink(sinks, kvh * group + g));
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
    const int32_t* table, int64_t ctx, int64_t window, const float* sinks, float scale, float* work,
    kv_stream* st) {
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
    mask_before_window(scores, ctx, group, ctx, window);
    for (int64_t g = 0; g < group; g++)
        sums[g] = softmax_numerators(scores + g * ctx, ctx, head_sink(sinks, kvh * group + g));
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
    int64_t slot_bytes, const int32_t* table, int64_t ctx0, int64_t window, const float* sinks, float scale,
    char* work, kv_stream* st) {
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
    for (int64_t v = 0; v < nv; v++) {
        mask_before_window(scores + v * L, L, 1, ctx0 + v / group, window);
        sums[v] = softmax_numerators(scores + v * L, ctx0 + v / group, head_sink(sinks, kvh * group + v % group));
    }
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
int64_t checked_max_context(const int32_t* tables, int64_t table_width, const int32_t* lens, int64_t S,
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

// The whole blocks before a windowed query's first visible token (its context's last `window`); 0 without one.
static inline int64_t window_blocks(int64_t ctx, int64_t window, int64_t block_size) {
    return window && ctx > window ? (ctx - window) / block_size : 0;
}

// The dispatch's cases: head size and dtype as constants for the common ones, so the inner loops keep no
// branches. Each case is a function of its own: inlined into one body, their dozen copies of the loops made the
// compiler's register allocation superlinear (16 s for this file, against about 1 s for each of the others).
#define UNIT_PARAMS                                                                                               \
    const void *q, void *out, const char *keys, const char *values, int bf16, int64_t s, int64_t rows, int64_t kvh, \
        int64_t group, int64_t D, int64_t q_stride, int64_t H, int64_t block_size, int64_t slot_bytes,            \
        const int32_t *table, int64_t ctx, int64_t window, const float *sinks, float scale, float *work,          \
        kv_stream *st
#define UNIT_CASE(NAME, CALL)                                      \
    static __attribute__((noinline)) void NAME(UNIT_PARAMS) {      \
        (void)bf16, (void)rows, (void)D;                           \
        CALL;                                                      \
    }
#define GROUP_CASE(FN, HEAD_DIM, BF16)                                                                             \
    UNIT_CASE(FN##_##HEAD_DIM##_##BF16, FN(q, out, keys, values, BF16, s, kvh, group, HEAD_DIM, q_stride, H,     \
                                           block_size, slot_bytes, table, ctx, window, sinks, scale, work, st))
GROUP_CASE(attend_group, 64, 0)
GROUP_CASE(attend_group, 64, 1)
GROUP_CASE(attend_group, 128, 0)
GROUP_CASE(attend_group, 128, 1)
GROUP_CASE(attend_group, D, bf16)
GROUP_CASE(attend_group8, 64, 0)
GROUP_CASE(attend_group8, 64, 1)
GROUP_CASE(attend_group8, 128, 0)
GROUP_CASE(attend_group8, 128, 1)
GROUP_CASE(attend_group8, D, bf16)
#if KVD_AMX
#define CHUNK_CASE(HEAD_DIM, KIND, Q_BF16)                                                                     \
    UNIT_CASE(attend_chunk_##HEAD_DIM##_##KIND##_##Q_BF16,                                                     \
              attend_chunk(q, out, keys, values, KIND, Q_BF16, s, rows, kvh, group, HEAD_DIM, q_stride, H,     \
                           block_size, slot_bytes, table, ctx, window, sinks, scale, (char*)work, st))
CHUNK_CASE(64, 1, 1)
CHUNK_CASE(128, 1, 1)
CHUNK_CASE(D, 1, 1)
CHUNK_CASE(64, KV_INT8, 0)
CHUNK_CASE(64, KV_INT8, 1)
CHUNK_CASE(128, KV_INT8, 0)
CHUNK_CASE(128, KV_INT8, 1)
CHUNK_CASE(D, KV_INT8, bf16)
#undef CHUNK_CASE
#endif
#undef GROUP_CASE
#undef UNIT_CASE
#undef UNIT_PARAMS

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
                               const int32_t* context_lens, int64_t window, const float* sinks, float scale,
                               int nthreads) {
    if (window < 0) return KVD_BAD_INDEX;
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
                const int64_t skip = window_blocks(context_lens[first[item + team]], window, block_size);
                if (next[0] != now[0]) {
                    kv_streams(streams, keys, values, next + skip,
                               context_lens[first[item + team] + count[item + team] - 1] - skip * block_size,
                               (context_lens[first[item]] + block_size - 1) / block_size, kv_heads, block_size,
                               block_size * slot_bytes);
                    st = streams;
                }
            }
            for (int64_t j = item * per_item; j < (item + 1) * per_item; j++) {
                const int64_t u = j / kv_heads, s = first[u], kvh = j % kv_heads;
                if (!work) continue;
                // A windowed unit starts at the block of its first row's first visible token: blocks before it
                // are never read (a sliding layer may have given them back).
                const int64_t skip = window_blocks(context_lens[s], window, block_size);
                const int32_t* table = block_tables + s * table_width + skip;
                const int64_t ctx = context_lens[s] - skip * block_size;
#define UNIT_ARGS                                                                                             \
    q, out, keys, values, bf16, s, count[u], kvh, group, D, q_stride, H, block_size, slot_bytes, table, ctx, window, \
        sinks, scale, work, st
#define ATTEND(HEAD_DIM, BF16) attend_group_##HEAD_DIM##_##BF16(UNIT_ARGS)
#define ATTEND8(HEAD_DIM, BF16) attend_group8_##HEAD_DIM##_##BF16(UNIT_ARGS)
#define ATTEND_CHUNK(HEAD_DIM, KIND, Q_BF16) attend_chunk_##HEAD_DIM##_##KIND##_##Q_BF16(UNIT_ARGS)
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
#undef UNIT_ARGS
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

// ---- K/V store --------------------------------------------------------------------------------------------

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
