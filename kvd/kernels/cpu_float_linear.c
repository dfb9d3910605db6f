// Linears of float weights, each output computed in one order whatever the number of rows (batch invariance):
// float32 weights in panels of 16 outputs (one FMA chain each) or in rows; bf16 weights in AMX tiles, by AVX-512
// BF16 pair products, or in rows (widened to float32); fp16 weights in rows (widened to float32).
#include "cpu_internal.h"

// ---- float32, bf16 and fp16 weights in rows ---------------------------------------------------------------------

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

// fp16 values to float32 (exact on every path).
static inline void widen_f16(const uint16_t* h, float* out, int64_t n) {
    int64_t i = 0;
#ifdef __F16C__
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + i))));
#endif
    for (; i < n; i++) out[i] = f16_to_f32(h[i]);
}

// y [M, n] = x [M, k] @ W^T (+ bias) for a float32, bf16 or fp16 weight, x float32 (a bf16 x is widened first):
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
        // A bf16 or fp16 weight row is widened once for all activation rows.
        float* row = w->bits == 16 ? malloc(sizeof(float) * (size_t)K) : NULL;
        failed |= w->bits == 16 && !row;
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const float* wr = (const float*)w->qs + n * K;
            if (w->bits == 16) {
                if (!row) continue;
                const uint16_t* half = (const uint16_t*)w->qs + n * K;
                if (w->ggml == KVD_GGML_F16)
                    widen_f16(half, row, K);
                else
                    for (int64_t i = 0; i < K; i++) row[i] = bf16_to_f32(half[i]);
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

#if KVD_AMX_BF16

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

// kvd_linear for a float weight (float32 or bf16) in rows or in its kernel's packed order (tiles), and for any
// other weight in tile order, which no kernel takes.
int float_weight_linear(const kvd_weight* w, const void* x, int x_bf16, int64_t M, void* y, int y_bf16,
                        int nthreads) {
    if (w->tiles && w->bits == 32) {
        if (x_bf16 || y_bf16) return KVD_UNSUPPORTED;
        panel_linear(w, x, M, y, nthreads);
        return KVD_OK;
    }
    if (w->tiles) {
        if (w->bits != 16 || w->ggml || !x_bf16) return KVD_UNSUPPORTED;
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
    return float_linear(w, x, x_bf16, M, y, y_bf16, nthreads) ? KVD_OUT_OF_MEMORY : KVD_OK;
}
