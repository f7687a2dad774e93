/* The CPU share of an expert store's step, in one call: every (token, expert) pair routed to the
 * CPU experts of one MoE layer, read packed from host memory (int4, int4_sym, MXFP4), with the
 * GLU between the two projections and the weighted sum over each token's pairs.
 *
 * Built and bound by cpu_experts.py (which documents the layouts and the reasons). The work of a
 * call runs in four phases on a pool of persistent threads (the caller is one of them): inputs
 * permuted to the codes' order; gate_up rows and the GLU, tiles of (expert, 16 columns); down rows,
 * tiles of (expert, 32 rows); the weighted sum per token, tiles of 256 outputs. Tiles are taken
 * from an atomic counter, so a thread that is late (or never scheduled) only leaves its share to
 * the others; a phase starts once every tile of the previous one is done. Results do not depend
 * on the number of threads or on who takes which tile.
 */
#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define MF_AVX512 1
#define MF_AVX2 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define MF_AVX2 1
#endif

enum { FMT_INT4 = 0, FMT_INT4_SYM = 1, FMT_MXFP4 = 2 };
enum { ACT_SILU = 1, ACT_CLAMPED_SWIGLU = 2 };
enum { GROUP = 32, GROUP_BYTES = 16, COLS_PER_TILE = 16, ROWS_PER_TILE = 32, SUM_PER_TILE = 256, PAIR_CHUNK = 4, MAX_GROUPS = 1024, PREFETCH_ROWS = 4 };

typedef struct {
    const uint8_t *codes;  /* [E, N, K/2] */
    const void *scales;    /* [E, N, K/32]: fp16 (int4) or E8M0 bytes (MXFP4) */
    const uint8_t *zeros;  /* [E, N, K/32]: one zero point per byte (int4), else NULL */
    const float *bias;     /* [E, N] or NULL */
    int64_t rows, cols;    /* N, K */
} mf_bank;

typedef struct {
    int32_t format, act, nibble_major, threads;
    float alpha, limit;
    mf_bank gate_up, down; /* gate_up: N = 2I, K = H ([gate; up] rows); down: N = H, K = I */
    /* the step, from the caller */
    int32_t experts, tokens, top_k, chosen_count;
    int32_t x_dtype, weight_dtype, out_dtype; /* DT_* */
    const void *x;               /* [T, H] */
    const int64_t *index;        /* [T, k] the step's routing */
    const void *weight;          /* [T, k] */
    const int32_t *chosen;       /* [C] the experts computed here (the others' pairs are skipped) */
    void *out;                   /* [T, H]: each row's weighted sum over its chosen pairs */
    /* built by mf_moe */
    int32_t pairs, used;
    int32_t *expert;             /* [U] expert ids, ascending */
    int32_t *pair_start;         /* [U + 1]: the pairs of expert[u] are pair_start[u] .. pair_start[u + 1] - 1 */
    int32_t *pair_row;           /* [P] the token row of each pair (ascending within an expert) */
    float *pair_weight;          /* [P] */
    int32_t *row_start;          /* [T + 1]: the pairs of token t are row_pair[row_start[t] .. row_start[t + 1] - 1] */
    int32_t *row_pair;           /* [P] (in the routing's order within a token) */
    float *xp;                   /* [T, H]: x in the codes' order */
    float *act_buf;              /* [P, I]: GLU outputs in the codes' order of down */
    float *y;                    /* [P, H] */
} mf_moe_args;

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

/* ---- decode tables ------------------------------------------------------------------------ */

/* a code's value before scale and zero point: int4 q itself; MXFP4 twice its E2M1 value (integers) */
static const int8_t INT4_VALUES[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
static const int8_t E2M1_TWICE[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static float E8M0_HALF[256]; /* 2^(e - 127) / 2: undoes E2M1_TWICE's doubling */
/* POSITION[major][r]: where input r of a group sits in the code order: byte j's low nibble is
 * position j, its high nibble 16 + j */
static int POSITION[2][GROUP];

static void init_tables(void) {
    for (int e = 0; e < 256; e++) E8M0_HALF[e] = ldexpf(1.0f, e - 128);
    for (int j = 0; j < GROUP_BYTES; j++) {
        POSITION[0][2 * j] = j; /* ours: byte j holds inputs 2j (low) and 2j + 1 (high) */
        POSITION[0][2 * j + 1] = 16 + j;
        int t = j / 4, m = j % 4; /* nibble-major: nibble i of word t holds input 4i + t */
        POSITION[1][8 * m + t] = j;
        POSITION[1][8 * m + 4 + t] = 16 + j;
    }
}

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

static inline float half_to_float(uint16_t h);

static inline float load_value(const void *base, int64_t i, int dtype) {
    if (dtype == DT_BF16) return bf16_to_float(((const uint16_t *)base)[i]);
    if (dtype == DT_F16) return half_to_float(((const uint16_t *)base)[i]);
    return ((const float *)base)[i];
}

static inline float half_to_float(uint16_t h) {
#ifdef MF_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(mant & 0x400)) { mant <<= 1; exp--; }
        bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* ---- one weight row against up to PAIR_CHUNK inputs ----------------------------------------- */

/* The row's per-group scale s and -z * s (w = code * s - z * s), decoded once per row. */
static void row_scales(const mf_moe_args *a, const mf_bank *b, int64_t row, int64_t groups, float *s, float *nzs) {
    if (a->format == FMT_MXFP4) {
        const uint8_t *exps = (const uint8_t *)b->scales + row * groups;
        int64_t g = 0;
#if defined(MF_AVX512)
        /* 2^(e - 128) from its bits: (e - 1) << 23 for e >= 2; 0x200000 << e (subnormal) below */
        const __m512i one = _mm512_set1_epi32(1), two = _mm512_set1_epi32(2), tiny = _mm512_set1_epi32(0x200000);
        for (; g + 16 <= groups; g += 16) {
            const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(exps + g)));
            const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, one), 23);
            const __m512i bits = _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(e, two), normal, _mm512_sllv_epi32(tiny, e));
            _mm512_storeu_ps(s + g, _mm512_castsi512_ps(bits));
            _mm512_storeu_ps(nzs + g, _mm512_setzero_ps());
        }
#endif
        for (; g < groups; g++) s[g] = E8M0_HALF[exps[g]], nzs[g] = 0.0f;
        return;
    }
    const uint16_t *halves = (const uint16_t *)b->scales + row * groups;
    const uint8_t *zeros = b->zeros ? b->zeros + row * groups : NULL;
    int64_t g = 0;
#if defined(MF_AVX512)
    for (; g + 16 <= groups; g += 16) {
        const __m512 vs = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(halves + g)));
        const __m512 vz = zeros ? _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(zeros + g))))
                                : _mm512_set1_ps(8.0f);
        _mm512_storeu_ps(s + g, vs);
        _mm512_storeu_ps(nzs + g, _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), vz), vs));
    }
#elif defined(MF_AVX2)
    for (; g + 8 <= groups; g += 8) {
        const __m256 vs = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(halves + g)));
        const __m256 vz = zeros ? _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(zeros + g))))
                                : _mm256_set1_ps(8.0f);
        _mm256_storeu_ps(s + g, vs);
        _mm256_storeu_ps(nzs + g, _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), vz), vs));
    }
#endif
    for (; g < groups; g++) {
        s[g] = half_to_float(halves[g]);
        nzs[g] = -(zeros ? (float)zeros[g] : 8.0f) * s[g];
    }
}

/* res[p] = sum over the row's K inputs of w * xs[p] (xs in the codes' order); always inlined with
 * a constant np (dot_row below), so the accumulators stay in registers */
static inline __attribute__((always_inline)) void dot_row_n(const mf_moe_args *a, const mf_bank *b, int64_t e,
                                                              int64_t n, const int np, const float *const *xs,
                                                              float *res) {
    const int64_t groups = b->cols / GROUP, row = e * b->rows + n;
    const uint8_t *codes = b->codes + row * (b->cols / 2);
    const int8_t *table = a->format == FMT_MXFP4 ? E2M1_TWICE : INT4_VALUES;
    float s[MAX_GROUPS], nzs[MAX_GROUPS];
    row_scales(a, b, row, groups, s, nzs);
#if defined(MF_AVX2)
    /* a few rows ahead, asked for while this one is computed: one core's stream of codes is bound
     * by memory latency, not bandwidth, without it (3.3 vs 7.3 GB/s a core here) */
    const uint8_t *ahead = codes + PREFETCH_ROWS * (b->cols / 2);
#endif
#if defined(MF_AVX512)
    const __m128i lut = _mm_loadu_si128((const __m128i *)table), low = _mm_set1_epi8(0x0F);
    __m512 acc[PAIR_CHUNK][2];
    for (int p = 0; p < np; p++) acc[p][0] = acc[p][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        if ((g & 3) == 0) _mm_prefetch((const char *)(ahead + g * GROUP_BYTES), _MM_HINT_T0);
        const __m512 vs = _mm512_set1_ps(s[g]), vzs = _mm512_set1_ps(nzs[g]);
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(codes + g * GROUP_BYTES));
        const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(bytes, low));
        const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(bytes, 4), low));
        const __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), vs, vzs);
        const __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)), vs, vzs);
        for (int p = 0; p < np; p++) {
            const float *x = xs[p] + g * GROUP;
            acc[p][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x), acc[p][0]);
            acc[p][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + 16), acc[p][1]);
        }
    }
    for (int p = 0; p < np; p++) res[p] = _mm512_reduce_add_ps(_mm512_add_ps(acc[p][0], acc[p][1]));
#elif defined(MF_AVX2)
    const __m128i lut = _mm_loadu_si128((const __m128i *)table), low = _mm_set1_epi8(0x0F);
    __m256 acc[PAIR_CHUNK][2];
    for (int p = 0; p < np; p++) acc[p][0] = acc[p][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        if ((g & 3) == 0) _mm_prefetch((const char *)(ahead + g * GROUP_BYTES), _MM_HINT_T0);
        const __m256 vs = _mm256_set1_ps(s[g]), vzs = _mm256_set1_ps(nzs[g]);
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(codes + g * GROUP_BYTES));
        const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(bytes, low));
        const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(bytes, 4), low));
        const __m256 w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), vs, vzs);
        const __m256 w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), vs, vzs);
        const __m256 w2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), vs, vzs);
        const __m256 w3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), vs, vzs);
        for (int p = 0; p < np; p++) {
            const float *x = xs[p] + g * GROUP;
            acc[p][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), acc[p][0]);
            acc[p][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), acc[p][1]);
            acc[p][0] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x + 16), acc[p][0]);
            acc[p][1] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x + 24), acc[p][1]);
        }
    }
    for (int p = 0; p < np; p++) {
        const __m256 v = _mm256_add_ps(acc[p][0], acc[p][1]);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        res[p] = _mm_cvtss_f32(h);
    }
#else
    float w[GROUP];
    for (int p = 0; p < np; p++) res[p] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *bytes = codes + g * GROUP_BYTES;
        for (int j = 0; j < GROUP_BYTES; j++) {
            w[j] = (float)table[bytes[j] & 0x0F] * s[g] + nzs[g];
            w[16 + j] = (float)table[bytes[j] >> 4] * s[g] + nzs[g];
        }
        for (int p = 0; p < np; p++) {
            const float *x = xs[p] + g * GROUP;
            float sum = 0.0f;
            for (int j = 0; j < GROUP; j++) sum += w[j] * x[j];
            res[p] += sum;
        }
    }
#endif
}

static void dot_row(const mf_moe_args *a, const mf_bank *b, int64_t e, int64_t n, int np, const float *const *xs,
                    float *res) {
    switch (np) {
    case 1: dot_row_n(a, b, e, n, 1, xs, res); break;
    case 2: dot_row_n(a, b, e, n, 2, xs, res); break;
    case 3: dot_row_n(a, b, e, n, 3, xs, res); break;
    default: dot_row_n(a, b, e, n, 4, xs, res); break;
    }
}

static inline float glu(const mf_moe_args *a, float gate, float up) {
    if (a->act == ACT_CLAMPED_SWIGLU) {
        gate = fminf(gate, a->limit);
        up = fminf(fmaxf(up, -a->limit), a->limit);
        return (up + 1.0f) * (gate / (1.0f + expf(-a->alpha * gate)));
    }
    return gate / (1.0f + expf(-gate)) * up;
}

/* ---- the phases --------------------------------------------------------------------------- */

static void permute_row(const mf_moe_args *a, int64_t t) {
    const int64_t h = a->gate_up.cols;
    const int *position = POSITION[a->nibble_major != 0];
    float *xp = a->xp + t * h;
    for (int64_t g = 0; g < h; g += GROUP)
        for (int r = 0; r < GROUP; r++) xp[g + position[r]] = load_value(a->x, t * h + g + r, a->x_dtype);
}

static int64_t col_tiles(const mf_moe_args *a) { return (a->down.cols + COLS_PER_TILE - 1) / COLS_PER_TILE; }
static int64_t row_tiles(const mf_moe_args *a) { return (a->down.rows + ROWS_PER_TILE - 1) / ROWS_PER_TILE; }

static void gate_up_tile(const mf_moe_args *a, int64_t tile) {
    const int64_t per_expert = col_tiles(a), inner = a->down.cols, hidden = a->gate_up.cols;
    const int64_t u = tile / per_expert, j0 = (tile % per_expert) * COLS_PER_TILE;
    const int64_t j1 = j0 + COLS_PER_TILE < inner ? j0 + COLS_PER_TILE : inner;
    const int64_t e = a->expert[u];
    const int *position = POSITION[a->nibble_major != 0];
    const float *bias = a->gate_up.bias ? a->gate_up.bias + e * a->gate_up.rows : NULL;
    for (int32_t p0 = a->pair_start[u]; p0 < a->pair_start[u + 1]; p0 += PAIR_CHUNK) {
        const int np = a->pair_start[u + 1] - p0 < PAIR_CHUNK ? a->pair_start[u + 1] - p0 : PAIR_CHUNK;
        const float *xs[PAIR_CHUNK];
        for (int p = 0; p < np; p++) xs[p] = a->xp + (int64_t)a->pair_row[p0 + p] * hidden;
        for (int64_t j = j0; j < j1; j++) {
            float gate[PAIR_CHUNK], up[PAIR_CHUNK];
            dot_row(a, &a->gate_up, e, j, np, xs, gate);
            dot_row(a, &a->gate_up, e, inner + j, np, xs, up);
            const int64_t at = (j / GROUP) * GROUP + position[j % GROUP];
            for (int p = 0; p < np; p++) {
                const float g = bias ? gate[p] + bias[j] : gate[p], v = bias ? up[p] + bias[inner + j] : up[p];
                a->act_buf[(int64_t)(p0 + p) * inner + at] = glu(a, g, v);
            }
        }
    }
}

static void down_tile(const mf_moe_args *a, int64_t tile) {
    const int64_t per_expert = row_tiles(a), hidden = a->down.rows, inner = a->down.cols;
    const int64_t u = tile / per_expert, n0 = (tile % per_expert) * ROWS_PER_TILE;
    const int64_t n1 = n0 + ROWS_PER_TILE < hidden ? n0 + ROWS_PER_TILE : hidden;
    const int64_t e = a->expert[u];
    const float *bias = a->down.bias ? a->down.bias + e * hidden : NULL;
    for (int32_t p0 = a->pair_start[u]; p0 < a->pair_start[u + 1]; p0 += PAIR_CHUNK) {
        const int np = a->pair_start[u + 1] - p0 < PAIR_CHUNK ? a->pair_start[u + 1] - p0 : PAIR_CHUNK;
        const float *xs[PAIR_CHUNK];
        for (int p = 0; p < np; p++) xs[p] = a->act_buf + (int64_t)(p0 + p) * inner;
        for (int64_t n = n0; n < n1; n++) {
            float y[PAIR_CHUNK];
            dot_row(a, &a->down, e, n, np, xs, y);
            for (int p = 0; p < np; p++) a->y[(int64_t)(p0 + p) * hidden + n] = bias ? y[p] + bias[n] : y[p];
        }
    }
}

static void sum_tile(const mf_moe_args *a, int64_t tile) {
    const int64_t hidden = a->down.rows, n0 = tile * SUM_PER_TILE;
    const int64_t n1 = n0 + SUM_PER_TILE < hidden ? n0 + SUM_PER_TILE : hidden;
    float sum[SUM_PER_TILE];
    for (int64_t t = 0; t < a->tokens; t++) {
        for (int64_t n = n0; n < n1; n++) sum[n - n0] = 0.0f;
        for (int32_t i = a->row_start[t]; i < a->row_start[t + 1]; i++) {
            const int32_t p = a->row_pair[i];
            const float w = a->pair_weight[p], *y = a->y + (int64_t)p * hidden;
            for (int64_t n = n0; n < n1; n++) sum[n - n0] += w * y[n];
        }
        if (a->out_dtype == DT_BF16) {
            uint16_t *out = (uint16_t *)a->out + t * hidden;
            for (int64_t n = n0; n < n1; n++) out[n] = float_to_bf16(sum[n - n0]);
        } else {
            float *out = (float *)a->out + t * hidden;
            for (int64_t n = n0; n < n1; n++) out[n] = sum[n - n0];
        }
    }
}

/* ---- the pool ----------------------------------------------------------------------------- */

enum { PHASES = 4 };

typedef struct {
    const mf_moe_args *args;
    int64_t tiles[PHASES];
    _Atomic int64_t next[PHASES], done[PHASES];
} mf_job;

static struct {
    pthread_mutex_t lock; /* serialises calls and the pool's growth */
    int workers;          /* threads besides callers */
    _Atomic unsigned generation;
    mf_job *_Atomic job;
    _Atomic int active, sleepers;
    long spin_ns;
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .spin_ns = 5000000}; /* > a decode step's gap between layers */

static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void run_tile(const mf_moe_args *a, int phase, int64_t tile) {
    switch (phase) {
    case 0: permute_row(a, tile); break;
    case 1: gate_up_tile(a, tile); break;
    case 2: down_tile(a, tile); break;
    default: sum_tile(a, tile); break;
    }
}

static void work_on(mf_job *job) {
    for (int phase = 0; phase < PHASES; phase++) {
        if (phase > 0) { /* wait for the previous phase's last tile (spin, then yield the core) */
            long spins = 0;
            while (atomic_load(&job->done[phase - 1]) < job->tiles[phase - 1])
                if (++spins < 4096) relax(); else sched_yield();
        }
        int64_t tile;
        while ((tile = atomic_fetch_add(&job->next[phase], 1)) < job->tiles[phase]) {
            run_tile(job->args, phase, tile);
            atomic_fetch_add(&job->done[phase], 1);
        }
    }
}

static void *worker_main(void *arg) {
    const int index = (int)(intptr_t)arg;
    unsigned seen = atomic_load(&pool.generation);
    for (;;) {
        unsigned g = atomic_load(&pool.generation);
        if (g == seen) { /* spin a while for the next call, then sleep until one comes */
            long start = now_ns(), spins = 0;
            while ((g = atomic_load(&pool.generation)) == seen) {
                relax();
                if ((++spins & 255) == 0 && now_ns() - start > pool.spin_ns) break;
            }
            if (g == seen) {
                atomic_fetch_add(&pool.sleepers, 1);
                syscall(SYS_futex, &pool.generation, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                atomic_fetch_sub(&pool.sleepers, 1);
                continue;
            }
        }
        seen = g;
        atomic_fetch_add(&pool.active, 1);
        mf_job *job = atomic_load(&pool.job);
        if (job != NULL && atomic_load(&pool.generation) == g && index < job->args->threads - 1) work_on(job);
        atomic_fetch_sub(&pool.active, 1);
    }
    return NULL;
}

/* A child of fork() has none of the parent's workers: it grows its own pool on its first call. */
static void forget_workers(void) {
    pthread_mutex_init(&pool.lock, NULL); /* a thread of the parent may have held it */
    pool.workers = 0;
    atomic_store(&pool.active, 0);
    atomic_store(&pool.sleepers, 0);
    atomic_store(&pool.job, (mf_job *)NULL);
}

static void init_process(void) {
    init_tables();
    pthread_atfork(NULL, NULL, forget_workers);
}

/* Grow the pool to ``threads`` - 1 workers (the caller is the last); returns the workers running. */
static int ensure_workers(int threads) {
    while (pool.workers < threads - 1) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attr, worker_main, (void *)(intptr_t)pool.workers);
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.workers++;
    }
    return pool.workers;
}

/* ---- entry points ------------------------------------------------------------------------- */

/* Group the step's chosen pairs by expert (ascending; tokens ascending within one) and by token
 * (the routing's order), into one allocation; returns it, or NULL when out of memory. */
static void *build_pairs(mf_moe_args *a) {
    const int64_t hidden = a->gate_up.cols, inner = a->down.cols, slots = (int64_t)a->tokens * a->top_k;
    int32_t *count = calloc((size_t)a->experts + 1, sizeof *count);
    uint8_t *mine = calloc((size_t)a->experts, 1);
    if (!count || !mine) return free(count), free(mine), NULL;
    for (int32_t c = 0; c < a->chosen_count; c++)
        if (a->chosen[c] >= 0 && a->chosen[c] < a->experts) mine[a->chosen[c]] = 1;
    int64_t pairs = 0;
    for (int64_t i = 0; i < slots; i++) {
        const int64_t e = a->index[i];
        if (e >= 0 && e < a->experts && mine[e]) count[e]++, pairs++;
    }
    const int64_t p1 = pairs > 0 ? pairs : 1;
    size_t ints = (size_t)(a->experts + (a->experts + 1) + p1 + (a->tokens + 1) + p1), floats = (size_t)(p1 + a->tokens * hidden + p1 * inner + p1 * hidden);
    char *block = malloc(ints * sizeof(int32_t) + floats * sizeof(float) + 64);
    if (!block) return free(count), free(mine), NULL;
    int32_t *ip = (int32_t *)block;
    a->expert = ip, ip += a->experts;
    a->pair_start = ip, ip += a->experts + 1;
    a->pair_row = ip, ip += p1;
    a->row_start = ip, ip += a->tokens + 1;
    a->row_pair = ip, ip += p1;
    float *fp = (float *)(((uintptr_t)ip + 63) & ~(uintptr_t)63);
    a->pair_weight = fp, fp += p1;
    a->xp = fp, fp += a->tokens * hidden;
    a->act_buf = fp, fp += p1 * inner;
    a->y = fp;
    /* experts in ascending order; next[e]: where e's next pair goes */
    int32_t used = 0, at = 0;
    for (int32_t e = 0; e < a->experts; e++) {
        if (!count[e]) continue;
        a->expert[used] = e;
        a->pair_start[used++] = at;
        const int32_t n = count[e];
        count[e] = at; /* reused as the cursor */
        at += n;
    }
    a->pair_start[used] = at;
    a->used = used, a->pairs = (int32_t)pairs;
    int32_t r = 0;
    for (int32_t t = 0; t < a->tokens; t++) {
        a->row_start[t] = r;
        for (int32_t j = 0; j < a->top_k; j++) {
            const int64_t i = (int64_t)t * a->top_k + j, e = a->index[i];
            if (e < 0 || e >= a->experts || !mine[e]) continue;
            const int32_t p = count[e]++;
            a->pair_row[p] = t;
            a->pair_weight[p] = load_value(a->weight, i, a->weight_dtype);
            a->row_pair[r++] = p;
        }
    }
    a->row_start[a->tokens] = r;
    free(count), free(mine);
    return block;
}

/* Compute args->out for the step; returns 0, -1 for arguments this kernel does not take, -2 when
 * out of memory. */
int mf_moe(mf_moe_args *args) {
    if (args->format < FMT_INT4 || args->format > FMT_MXFP4 || args->gate_up.cols % GROUP || args->down.cols % GROUP ||
        args->gate_up.rows != 2 * args->down.cols || args->down.rows != args->gate_up.cols || args->threads < 1 ||
        args->gate_up.cols / GROUP > MAX_GROUPS || args->down.cols / GROUP > MAX_GROUPS || args->experts < 1 ||
        args->tokens < 0 || args->top_k < 0)
        return -1;
    pthread_once(&tables_once, init_process);
    void *scratch = build_pairs(args);
    if (scratch == NULL) return -2;
    mf_job job = {.args = args};
    job.tiles[0] = args->tokens;
    job.tiles[1] = (int64_t)args->used * col_tiles(args);
    job.tiles[2] = (int64_t)args->used * row_tiles(args);
    job.tiles[3] = (args->down.rows + SUM_PER_TILE - 1) / SUM_PER_TILE;
    for (int i = 0; i < PHASES; i++) atomic_init(&job.next[i], 0), atomic_init(&job.done[i], 0);
    pthread_mutex_lock(&pool.lock);
    if (args->threads > 1 && ensure_workers(args->threads) > 0) {
        atomic_store(&pool.job, &job);
        atomic_fetch_add(&pool.generation, 1);
        if (atomic_load(&pool.sleepers) > 0)
            syscall(SYS_futex, &pool.generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    }
    work_on(&job);
    long spins = 0;
    while (atomic_load(&job.done[PHASES - 1]) < job.tiles[PHASES - 1])
        if (++spins < 4096) relax(); else sched_yield();
    atomic_store(&pool.job, (mf_job *)NULL); /* late workers find no job; then wait out those inside */
    while (atomic_load(&pool.active) > 0) relax();
    pthread_mutex_unlock(&pool.lock);
    free(scratch);
    return 0;
}

/* How long idle workers spin for the next call before they sleep (nanoseconds). */
void mf_set_spin(long nanoseconds) { pool.spin_ns = nanoseconds < 0 ? 0 : nanoseconds; }

/* 2 when built with the AVX-512 path, 1 with the AVX2/FMA/F16C one, else 0 (portable C). */
int mf_vectorized(void) {
#if defined(MF_AVX512)
    return 2;
#elif defined(MF_AVX2)
    return 1;
#else
    return 0;
#endif
}
