/* onebit's fused CPU kernels (AVX2 + FMA), built with the package by setup.py as the optional
   extension onebit._kernels and loaded with ctypes by onebit/_native.py, which documents them.
   Built with -O3 -ffp-contract=off -fno-fast-math: the kernels reproduce the torch formulation
   bit for bit, so the compiler must not fuse or reorder float operations. */
#include <stdint.h>
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#define KERNEL __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))
#define BLOCK 4096

/* SELECT[b]: lane i all ones where bit i of b is set, else zeros (a blend mask per byte). */
static int32_t SELECT[256][8] __attribute__((aligned(32)));

__attribute__((constructor)) static void fill_select(void) {
    for (int b = 0; b < 256; b++)
        for (int i = 0; i < 8; i++) SELECT[b][i] = (b >> i) & 1 ? -1 : 0;
}

int ob_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
}

KERNEL INLINE __m256 sum_step(__m256 acc, __m256 v, int mean_abs) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    return mean_abs ? _mm256_add_ps(acc, _mm256_and_ps(v, absmask)) : _mm256_fmadd_ps(v, v, acc);
}

KERNEL INLINE uint8_t signs_of(__m256 v) {
    return (uint8_t)_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GE_OQ));
}

/* The loop of a compress without segments over [0, n), n a multiple of 8: VALUE(i) is the __m256
   of y at i. Byte i / 8 of bits gets its signs, and `total` the sum of y*y (|y| if mean_abs) in
   a fixed order: per BLOCK, two fp32 accumulators take the 8-groups in turn, then the lanes of
   their sum are added to the fp64 total. */
#define PAIRED_SIGNS(VALUE)                                                                \
    for (int64_t start = 0; start < n; start += BLOCK) {                                   \
        int64_t end = start + BLOCK < n ? start + BLOCK : n, i = start;                    \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                     \
        for (; i + 16 <= end; i += 16) {                                                   \
            __m256 v0 = VALUE(i), v1 = VALUE(i + 8);                                       \
            acc0 = sum_step(acc0, v0, mean_abs);                                           \
            acc1 = sum_step(acc1, v1, mean_abs);                                           \
            bits[i / 8] = signs_of(v0);                                                    \
            bits[i / 8 + 1] = signs_of(v1);                                                \
        }                                                                                  \
        for (; i < end; i += 8) {                                                          \
            __m256 v0 = VALUE(i);                                                          \
            acc0 = sum_step(acc0, v0, mean_abs);                                           \
            bits[i / 8] = signs_of(v0);                                                    \
        }                                                                                  \
        float lanes[8];                                                                    \
        _mm256_storeu_ps(lanes, _mm256_add_ps(acc0, acc1));                                \
        for (int j = 0; j < 8; j++) total += lanes[j];                                     \
    }

KERNEL INLINE __m256 stored(float *p, __m256 v) {
    _mm256_storeu_ps(p, v);
    return v;
}

/* b = b + e; bits[i/8] bit i%8 = (b[i] >= 0); returns the sum of b*b (or of |b| if mean_abs).
   n is a multiple of 8. */
KERNEL double ob_compress(float *b, const float *e, uint8_t *bits, int64_t n, int mean_abs) {
    double total = 0.0;
#define Y(i) stored(b + (i), _mm256_add_ps(_mm256_loadu_ps(b + (i)), _mm256_loadu_ps(e + (i))))
    PAIRED_SIGNS(Y)
#undef Y
    return total;
}

/* out = y >= 0 ? y - s : y - (-1 * s), for any n; out may be y. */
KERNEL void ob_commit(const float *y, float s, float *out, int64_t n) {
    const float ns = s * -1.0f;
    const __m256 zero = _mm256_setzero_ps(), vs = _mm256_set1_ps(s), vns = _mm256_set1_ps(ns);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(y + i);
        __m256 t = _mm256_blendv_ps(vns, vs, _mm256_cmp_ps(v, zero, _CMP_GE_OQ));
        _mm256_storeu_ps(out + i, _mm256_sub_ps(v, t));
    }
    for (; i < n; i++) out[i] = y[i] >= 0.0f ? y[i] - s : y[i] - ns;
}

/* out[0..count) = bit ? s : -1 * s for the bits of p (bit i of byte q = element 8q + i). */
KERNEL static void signed_row(const uint8_t *p, float s, float *out, int64_t count, int add) {
    const float ns = s * -1.0f;
    const __m256 vs = _mm256_set1_ps(s), vns = _mm256_set1_ps(ns);
    const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    int64_t whole = count / 8;
    for (int64_t q = 0; q < whole; q++) {
        __m256i v = _mm256_and_si256(_mm256_set1_epi32(p[q]), bits);
        __m256 t = _mm256_blendv_ps(vns, vs, _mm256_castsi256_ps(_mm256_cmpeq_epi32(v, bits)));
        if (add) t = _mm256_add_ps(_mm256_loadu_ps(out + 8 * q), t);
        _mm256_storeu_ps(out + 8 * q, t);
    }
    for (int64_t i = 8 * whole; i < count; i++) {
        float t = (p[whole] >> (i % 8)) & 1 ? s : ns;
        out[i] = add ? out[i] + t : t;
    }
}

/* out[start..end) = bit ? s : -1 * s for bits start..end of p (or added to out), any bounds. */
KERNEL static void signed_range(const uint8_t *p, float s, float *out, int64_t start, int64_t end,
                                int add) {
    const float ns = s * -1.0f;
    int64_t i = start;
    for (; i < end && (i & 7); i++) {
        float t = (p[i >> 3] >> (i & 7)) & 1 ? s : ns;
        out[i] = add ? out[i] + t : t;
    }
    int64_t whole = (end - i) / 8;
    if (whole > 0) {
        signed_row(p + (i >> 3), s, out + i, 8 * whole, add);
        i += 8 * whole;
    }
    for (; i < end; i++) {
        float t = (p[i >> 3] >> (i & 7)) & 1 ? s : ns;
        out[i] = add ? out[i] + t : t;
    }
}

/* k rows of m bytes (row j at packed + j * stride) times scales[j], concatenated, first numel. */
KERNEL void ob_decompress(const uint8_t *packed, int64_t stride, const float *scales, int64_t k,
                          int64_t m, float *out, int64_t numel) {
    for (int64_t j = 0; j < k; j++) {
        int64_t base = 8 * m * j;
        if (base >= numel) break;
        int64_t count = numel - base < 8 * m ? numel - base : 8 * m;
        signed_row(packed + j * stride, scales[j], out + base, count, 0);
    }
}

/* out[0..8m) = (sum over rows j in order of scales[j] * sign_j) / k, a block at a time. */
KERNEL void ob_average(const uint8_t *packed, int64_t stride, const float *scales, int64_t k,
                       int64_t m, float *out) {
    const __m256 vk = _mm256_set1_ps((float)k);
    for (int64_t b0 = 0; b0 < m; b0 += BLOCK / 8) {
        int64_t bytes = m - b0 < BLOCK / 8 ? m - b0 : BLOCK / 8;
        float *z = out + 8 * b0;
        for (int64_t j = 0; j < k; j++)
            signed_row(packed + j * stride + b0, scales[j], z, 8 * bytes, j > 0);
        if (k > 1)
            for (int64_t i = 0; i < 8 * bytes; i += 8)
                _mm256_storeu_ps(z + i, _mm256_div_ps(_mm256_loadu_ps(z + i), vk));
    }
}

/* Per-segment sums in a fixed order that depends only on absolute positions, so that a fused
   pass walking a segment in several runs gets the same bits: 8-lane fp32 partial sums over whole
   8-element groups (aligned to multiples of 8) and a scalar fp32 sum of the elements of partial
   groups, both flushed into an fp64 total at every BLOCK boundary (aligned to multiples of BLOCK)
   and at the segment's end. */
typedef struct {
    __m256 acc;
    float rest;
    int64_t block;
    double total;
} Sum;

KERNEL static void sum_flush(Sum *s) {
    float lanes[8];
    _mm256_storeu_ps(lanes, s->acc);
    for (int j = 0; j < 8; j++) s->total += lanes[j];
    s->total += s->rest;
    s->acc = _mm256_setzero_ps();
    s->rest = 0.0f;
}

KERNEL static void sum_start(Sum *s) {
    s->acc = _mm256_setzero_ps();
    s->rest = 0.0f;
    s->block = -1;
    s->total = 0.0;
}

KERNEL static inline void sum_vec(Sum *s, int64_t i, __m256 v, int mean_abs) {
    if (i / BLOCK != s->block) {
        sum_flush(s);
        s->block = i / BLOCK;
    }
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    s->acc = mean_abs ? _mm256_add_ps(s->acc, _mm256_and_ps(v, absmask))
                      : _mm256_fmadd_ps(v, v, s->acc);
}

KERNEL static inline void sum_one(Sum *s, int64_t i, float v, int mean_abs) {
    if (i / BLOCK != s->block) {
        sum_flush(s);
        s->block = i / BLOCK;
    }
    s->rest += mean_abs ? (v < 0 ? -v : v) : v * v;
}

/* Segments [bounds[q], bounds[q+1]), q < nseg: totals[q] = the sum of y*y (or of |y|) over the
   segment, in the order of Sum. */
KERNEL void ob_sums(const float *y, const int64_t *bounds, int64_t nseg, int mean_abs,
                    double *totals) {
    for (int64_t q = 0; q < nseg; q++) {
        Sum s;
        sum_start(&s);
        int64_t i = bounds[q], end = bounds[q + 1];
        for (; i < end && (i & 7); i++) sum_one(&s, i, y[i], mean_abs);
        for (; i + 8 <= end; i += 8) sum_vec(&s, i, _mm256_loadu_ps(y + i), mean_abs);
        for (; i < end; i++) sum_one(&s, i, y[i], mean_abs);
        sum_flush(&s);
        totals[q] = s.total;
    }
}

/* ob_commit on each segment [bounds[q], bounds[q+1]) with its own scale scales[q]. */
KERNEL void ob_commit_segments(const float *y, const float *scales, const int64_t *bounds,
                               int64_t nseg, float *out) {
    for (int64_t q = 0; q < nseg; q++)
        ob_commit(y + bounds[q], scales[q], out + bounds[q], bounds[q + 1] - bounds[q]);
}

/* ob_average with a scale per piece: pieces[3p..3p+2] = start, end, column c, and row j's term
   for the piece is scales[j * ncols + c] * sign_j. Elements outside the pieces are untouched. */
KERNEL void ob_average_pieces(const uint8_t *packed, int64_t stride, const float *scales,
                              int64_t ncols, int64_t k, const int64_t *pieces, int64_t npieces,
                              float *out) {
    for (int64_t p = 0; p < npieces; p++) {
        int64_t a = pieces[3 * p], b = pieces[3 * p + 1], c = pieces[3 * p + 2];
        for (int64_t b0 = a; b0 < b; b0 += BLOCK) {
            int64_t e = b0 + BLOCK < b ? b0 + BLOCK : b;
            for (int64_t j = 0; j < k; j++)
                signed_range(packed + j * stride, scales[j * ncols + c], out, b0, e, j > 0);
            if (k > 1)
                for (int64_t i = b0; i < e; i++) out[i] = out[i] / (float)k;
        }
    }
}

/* Decompress pieces[4p..4p+3] = row j, start, end, column c (start and end within row j's
   8m elements): out[j * 8m + i] = scales[j * ncols + c] * sign for i in [start, end), as far as
   out's numel elements go. */
KERNEL void ob_decompress_pieces(const uint8_t *packed, int64_t stride, const float *scales,
                                 int64_t ncols, int64_t m, const int64_t *pieces,
                                 int64_t npieces, float *out, int64_t numel) {
    for (int64_t p = 0; p < npieces; p++) {
        int64_t j = pieces[4 * p], c = pieces[4 * p + 3], base = 8 * m * j;
        int64_t end = pieces[4 * p + 2] < numel - base ? pieces[4 * p + 2] : numel - base;
        signed_range(packed + j * stride, scales[j * ncols + c], out + base, pieces[4 * p + 1],
                     end, 0);
    }
}

/* The element types of the tensors the fused passes read and update in place (gradients,
   parameters): dtype F32, BF16 or F16. Loads are exact; a value stored is rounded to nearest,
   ties to even, as torch rounds a float it stores (a bf16 NaN as torch's scalar 0x7FC0). */
enum { F32 = 0, BF16 = 1, F16 = 2 };

KERNEL INLINE float load_one(const void *p, int64_t k, int dtype) {
    if (dtype == F32) return ((const float *)p)[k];
    uint16_t h = ((const uint16_t *)p)[k];
    if (dtype == F16) return _cvtsh_ss(h);
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

KERNEL INLINE __m256 load_vec(const void *p, int64_t k, int dtype) {
    if (dtype == F32) return _mm256_loadu_ps((const float *)p + k);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + k));
    if (dtype == F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

KERNEL INLINE uint16_t bf16_one(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return f != f ? 0x7FC0 : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* 8 fp32 as bf16 bits, in the low halves of the 32-bit lanes. */
KERNEL INLINE __m256i bf16_vec(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, lsb),
                                                   _mm256_set1_epi32(0x7FFF)), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}

/* f rounded to dtype, as fp32. */
KERNEL INLINE float round_one(float f, int dtype) {
    if (dtype == F32) return f;
    if (dtype == F16) return _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
    uint32_t u = (uint32_t)bf16_one(f) << 16;
    memcpy(&f, &u, sizeof f);
    return f;
}

KERNEL INLINE __m256 round_vec(__m256 v, int dtype) {
    if (dtype == F32) return v;
    if (dtype == F16) return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_vec(v), 16));
}

KERNEL INLINE void store_one(void *p, int64_t k, float f, int dtype) {
    if (dtype == F32)
        ((float *)p)[k] = f;
    else
        ((uint16_t *)p)[k] = dtype == F16 ? _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT) : bf16_one(f);
}

KERNEL INLINE void store_vec(void *p, int64_t k, __m256 v, int dtype) {
    if (dtype == F32) {
        _mm256_storeu_ps((float *)p + k, v);
        return;
    }
    __m128i h;
    if (dtype == F16) {
        h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
    } else {
        __m256i b = bf16_vec(v);
        h = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    }
    _mm_storeu_si128((__m128i *)((uint16_t *)p + k), h);
}

/* The fused passes of a 1-bit Adam compression step (onebit/fused.py). A bucket is walked in
   runs, in order: runs[4r..4r+3] = start, end (bucket positions), segment q, momentum column c;
   grads[r] is the address of the gradient element at `start` (0: no gradient, zeros), of type
   dtype (the parameters'). Element i of a run computes, as torch does (torch.lerp is an FMA):
       g = grad * inv (if use_inv) or grad
       m = dense[i] if dense, else +-mscales[c] from bit i of the packed momentum (row i / chunk
           of mbits, rows stride bytes apart), times the mask where masks[r] is the address of
           the run's 0/1 byte mask at `start` (masks NULL or masks[r] 0: none)
       y = lerp(m, g, w) * post[r] + e[i]   (post = NULL: * 1.0f, which changes nothing; e = NULL:
                                         + 0.0f)
   A run with c < 0 is padding: y = 0.0f + e[i]. */
typedef struct {
    const void *g;      /* the run's gradient, from its start (of type dtype), or NULL */
    int dtype;
    const float *dense; /* fp32 momentum, or NULL */
    const uint8_t *row; /* packed: the sign of element i is bit i % 8 of row[i / 8] */
    const uint8_t *mask; /* packed: the run's 0/1 mask (exp_avg_mask), from its start, or NULL */
    float s, ns;        /* packed: the momentum's scale and -1 * it */
    float post;         /* the run's factor after the lerp (1-bit LAMB's momentum scaling) */
    int pad;
} Source;

KERNEL INLINE Source run_source(const int64_t *runs, int64_t r, const int64_t *grads,
                                const float *dense, const uint8_t *mbits, int64_t stride,
                                int64_t chunk, const float *mscales, const int64_t *masks,
                                const float *post, int dtype) {
    Source x = {(const void *)(intptr_t)grads[r], dtype, dense, NULL, NULL, 0.0f, 0.0f,
                post ? post[r] : 1.0f, runs[4 * r + 3] < 0};
    if (!dense && !x.pad) {
        int64_t j = runs[4 * r] / chunk;
        x.row = mbits + j * stride - j * (chunk / 8);
        x.mask = masks ? (const uint8_t *)(intptr_t)masks[r] : NULL;
        x.s = mscales[runs[4 * r + 3]];
        x.ns = x.s * -1.0f;
    }
    return x;
}

KERNEL INLINE float lerp_one(float m, float g, float w) {
    return __builtin_fabsf(w) < 0.5f ? __builtin_fmaf(w, g - m, m)
                                      : __builtin_fmaf(w - 1.0f, g - m, g);
}

KERNEL INLINE float y_one(const Source *x, int64_t i, int64_t k, float inv, int use_inv, float w,
                          const void *e, int edtype) {
    float ei = e ? load_one(e, i, edtype) : 0.0f;
    if (x->pad) return 0.0f + ei;
    float g = x->g ? load_one(x->g, k, x->dtype) : 0.0f;
    if (x->g && use_inv) g = g * inv;
    float m = x->dense ? x->dense[i] : ((x->row[i >> 3] >> (i & 7)) & 1 ? x->s : x->ns);
    if (x->mask) m = m * (float)x->mask[k];
    return lerp_one(m, g, w) * x->post + ei;
}

KERNEL INLINE __m256 signed_byte(uint8_t byte, __m256 vs, __m256 vns) {
    return _mm256_blendv_ps(vns, vs, _mm256_load_ps((const float *)&SELECT[byte]));
}

/* 8 bytes of a 0/1 mask as floats. */
KERNEL INLINE __m256 mask_vec(const uint8_t *mask) {
    __m128i bytes = _mm_loadl_epi64((const __m128i *)mask);
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
}

KERNEL INLINE __m256 y_vec(const Source *x, int64_t i, int64_t k, float inv, int use_inv, float w,
                           const void *e, int edtype) {
    __m256 ev = e ? load_vec(e, i, edtype) : _mm256_setzero_ps();
    if (x->pad) return _mm256_add_ps(_mm256_setzero_ps(), ev);
    __m256 g = _mm256_setzero_ps();
    if (x->g) {
        g = load_vec(x->g, k, x->dtype);
        if (use_inv) g = _mm256_mul_ps(g, _mm256_set1_ps(inv));
    }
    __m256 m = x->dense ? _mm256_loadu_ps(x->dense + i)
                        : signed_byte(x->row[i >> 3], _mm256_set1_ps(x->s), _mm256_set1_ps(x->ns));
    if (x->mask) m = _mm256_mul_ps(m, mask_vec(x->mask + k));
    int small = __builtin_fabsf(w) < 0.5f;
    __m256 coeff = _mm256_set1_ps(small ? w : w - 1.0f);
    __m256 y = _mm256_fmadd_ps(coeff, _mm256_sub_ps(g, m), small ? m : g);
    return _mm256_add_ps(_mm256_mul_ps(y, _mm256_set1_ps(x->post)), ev);
}

/* y_vec for the common run, with its constants in registers: an fp32 gradient, the packed
   momentum and an error (fp32 or bf16). g * 1.0f is g, so the gradient is always multiplied.
   SMALL is |w| < 0.5; E16: the error is bf16. */
typedef struct {
    const float *g;
    const void *e;
    const uint8_t *row;
    __m256 inv, s, ns, coeff, post;
} Fast;

KERNEL INLINE int fast_run(const Source *x, const void *e) {
    return !x->pad && x->g && x->dtype == F32 && x->row && !x->mask && e;
}

KERNEL INLINE Fast fast_of(const Source *x, int64_t start, float inv, int use_inv, float w,
                           const void *e) {
    Fast f = {(const float *)x->g - start, e, x->row, _mm256_set1_ps(use_inv ? inv : 1.0f),
              _mm256_set1_ps(x->s), _mm256_set1_ps(x->ns), _mm256_set1_ps(__builtin_fabsf(w) < 0.5f ? w : w - 1.0f),
              _mm256_set1_ps(x->post)};
    return f;
}

/* Prefetch 4 KiB ahead of p: a pass reading one or two model-sized streams runs about 15% faster
   than with the hardware prefetcher alone. */
KERNEL INLINE void ahead(const float *p) {
    _mm_prefetch((const char *)(p + 1024), _MM_HINT_T0);
}

/* ahead() of element i of p, of type dtype. */
KERNEL INLINE void ahead_at(const void *p, int64_t i, int dtype) {
    ahead(dtype == F32 ? (const float *)p + i : (const float *)((const uint16_t *)p + i));
}

KERNEL INLINE __m256 y_fast(const Fast *f, int64_t i, int small, int e16) {
    ahead(f->g + i);
    ahead_at(f->e, i, e16 ? BF16 : F32);
    __m256 g = _mm256_mul_ps(_mm256_loadu_ps(f->g + i), f->inv);
    __m256 m = signed_byte(f->row[i >> 3], f->s, f->ns);
    __m256 y = _mm256_fmadd_ps(f->coeff, _mm256_sub_ps(g, m), small ? m : g);
    return _mm256_add_ps(_mm256_mul_ps(y, f->post), load_vec(f->e, i, e16 ? BF16 : F32));
}

#define Y_SMALL(i) y_fast(&f, i, 1, 0)
#define Y_LARGE(i) y_fast(&f, i, 0, 0)
#define Y_SMALL16(i) y_fast(&f, i, 1, 1)
#define Y_LARGE16(i) y_fast(&f, i, 0, 1)
#define Y_ANY(i) y_vec(&x, i, i - start, inv, use_inv, w, e, edtype)

/* BODY(Y) with Y the fastest y of the run (x; the variables of y_vec in scope). */
#define WITH_Y(BODY)                                                                       \
    if (fast_run(&x, e)) {                                                                 \
        const Fast f = fast_of(&x, start, inv, use_inv, w, e);                             \
        int small = __builtin_fabsf(w) < 0.5f;                                             \
        if (edtype == BF16) {                                                              \
            if (small) {                                                                   \
                BODY(Y_SMALL16)                                                            \
            } else {                                                                       \
                BODY(Y_LARGE16)                                                            \
            }                                                                              \
        } else if (small) {                                                                \
            BODY(Y_SMALL)                                                                  \
        } else {                                                                           \
            BODY(Y_LARGE)                                                                  \
        }                                                                                  \
    } else {                                                                               \
        BODY(Y_ANY)                                                                        \
    }

KERNEL INLINE void set_bit(uint8_t *bits, int64_t i, float v) {
    uint8_t bit = (uint8_t)((v >= 0.0f) << (i & 7));
    bits[i >> 3] = (i & 7) ? bits[i >> 3] | bit : bit;
}

/* The vector body shared by the signs passes: whole 8-groups of [*i, end), summed into `sum`
   block by block (the order of Sum), signs into bits. VALUE(i) gives the __m256 at i. */
#define SIGNS_LOOP(VALUE, MEAN_ABS)                                                        \
    while (i + 8 <= end) {                                                                 \
        int64_t stop = (i / BLOCK + 1) * BLOCK;                                            \
        stop = stop < end ? stop : end;                                                    \
        if (i / BLOCK != sum.block) {                                                      \
            sum_flush(&sum);                                                               \
            sum.block = i / BLOCK;                                                         \
        }                                                                                  \
        __m256 acc = sum.acc;                                                              \
        for (; i + 8 <= stop; i += 8) {                                                    \
            __m256 v = VALUE(i);                                                           \
            acc = sum_step(acc, v, MEAN_ABS);                                              \
            bits[i >> 3] = (uint8_t)_mm256_movemask_ps(_mm256_cmp_ps(v, zero, _CMP_GE_OQ)); \
        }                                                                                  \
        sum.acc = acc;                                                                     \
    }
#define SIGNS_BODY(VALUE)                                                                  \
    if (mean_abs) {                                                                        \
        SIGNS_LOOP(VALUE, 1)                                                               \
    } else {                                                                               \
        SIGNS_LOOP(VALUE, 0)                                                               \
    }

/* Pass 1: the signs of y, packed into bits (bit i of byte i / 8), and totals[q] = the sum of
   y*y (|y| if mean_abs) over each of the nseg segments, in the order of Sum. Writes no floats.
   The error e is of type edtype (F32 or BF16). */
KERNEL void ob_fused_signs(const int64_t *runs, int64_t nruns, const int64_t *grads, float inv,
                           int use_inv, const float *dense, const uint8_t *mbits, int64_t stride,
                           int64_t chunk, const float *mscales, const int64_t *masks, float w,
                           const float *post, const void *e, uint8_t *restrict bits,
                           int mean_abs, double *totals, int64_t nseg, int dtype, int edtype) {
    const __m256 zero = _mm256_setzero_ps();
    for (int64_t q = 0; q < nseg; q++) totals[q] = 0.0;
    Sum sum;
    sum_start(&sum);
    int64_t current = -1;
    for (int64_t r = 0; r < nruns; r++) {
        int64_t start = runs[4 * r], end = runs[4 * r + 1], q = runs[4 * r + 2];
        Source x = run_source(runs, r, grads, dense, mbits, stride, chunk, mscales, masks, post,
                              dtype);
        if (q != current) {
            if (current >= 0) {
                sum_flush(&sum);
                totals[current] = sum.total;
            }
            sum_start(&sum);
            current = q;
        }
        int64_t i = start;
        for (; i < end && ((i & 7) || i + 8 > end); i++) {
            float y = y_one(&x, i, i - start, inv, use_inv, w, e, edtype);
            sum_one(&sum, i, y, mean_abs);
            set_bit(bits, i, y);
        }
        WITH_Y(SIGNS_BODY)
        for (; i < end; i++) {
            float y = y_one(&x, i, i - start, inv, use_inv, w, e, edtype);
            sum_one(&sum, i, y, mean_abs);
            set_bit(bits, i, y);
        }
    }
    if (current >= 0) {
        sum_flush(&sum);
        totals[current] = sum.total;
    }
}

/* Pass 2, once every rank's scales are known finite: e_out[i] = y - (y >= 0 ? s_q : -1 * s_q)
   with s_q = scales[q], y recomputed as in pass 1, stored as odtype (F32 or BF16, rounded).
   e_out may be e or dense. */
KERNEL void ob_fused_commit(const int64_t *runs, int64_t nruns, const int64_t *grads, float inv,
                            int use_inv, const float *dense, const uint8_t *mbits,
                            int64_t stride, int64_t chunk, const float *mscales,
                            const int64_t *masks, float w, const float *post, const void *e,
                            const float *scales, void *e_out, int dtype, int edtype,
                            int odtype) {
    const __m256 zero = _mm256_setzero_ps();
    for (int64_t r = 0; r < nruns; r++) {
        int64_t start = runs[4 * r], end = runs[4 * r + 1], q = runs[4 * r + 2];
        Source x = run_source(runs, r, grads, dense, mbits, stride, chunk, mscales, masks, post,
                              dtype);
        const float sq = scales[q], nsq = sq * -1.0f;
        const __m256 vs = _mm256_set1_ps(sq), vns = _mm256_set1_ps(nsq);
        int64_t i = start;
        for (; i < end && ((i & 7) || i + 8 > end); i++) {
            float y = y_one(&x, i, i - start, inv, use_inv, w, e, edtype);
            store_one(e_out, i, y >= 0.0f ? y - sq : y - nsq, odtype);
        }
#define COMMIT_BODY(Y)                                                                     \
    for (; i + 8 <= end; i += 8) {                                                         \
        __m256 y = Y(i);                                                                   \
        __m256 t = _mm256_blendv_ps(vns, vs, _mm256_cmp_ps(y, zero, _CMP_GE_OQ));          \
        store_vec(e_out, i, _mm256_sub_ps(y, t), odtype);                                  \
    }
        WITH_Y(COMMIT_BODY)
#undef COMMIT_BODY
        for (; i < end; i++) {
            float y = y_one(&x, i, i - start, inv, use_inv, w, e, edtype);
            store_one(e_out, i, y >= 0.0f ? y - sq : y - nsq, odtype);
        }
    }
}

/* Pass 3, AdamW's update from the new packed momentum: per run r (parameter element at address
   params[r], of type dtype), p = p * decay[r] (skipped when it is 1) then
   p = p + (value[r] * m) / denom[i], as torch._foreach_mul_ and _foreach_addcdiv_ compute it:
   in fp32, each result rounded to dtype. m is masked as in pass 1; padding runs (c < 0) are
   skipped. */
KERNEL void ob_fused_update(const int64_t *runs, int64_t nruns, const int64_t *params,
                            const uint8_t *mbits, int64_t stride, int64_t chunk,
                            const float *mscales, const int64_t *masks, const float *denom,
                            const float *decay, const float *value, int dtype) {
    for (int64_t r = 0; r < nruns; r++) {
        int64_t start = runs[4 * r], end = runs[4 * r + 1];
        Source x = run_source(runs, r, params, NULL, mbits, stride, chunk, mscales, masks, NULL,
                              dtype);
        if (x.pad) continue;
        const uint8_t *mask = x.mask;
        char *p = (char *)(intptr_t)params[r];
        const int64_t size = dtype == F32 ? 4 : 2;
        const float d = decay[r], v = value[r];
        const __m256 vs = _mm256_set1_ps(x.s), vns = _mm256_set1_ps(x.ns);
        const __m256 vd = _mm256_set1_ps(d), vv = _mm256_set1_ps(v);
        int64_t i = start;
#define UPDATE_ONE(i)                                                                      \
    {                                                                                      \
        float t = load_one(p, (i) - start, dtype);                                         \
        if (d != 1.0f) t = round_one(t * d, dtype);                                        \
        float m = (x.row[(i) >> 3] >> ((i) & 7)) & 1 ? x.s : x.ns;                         \
        if (mask) m = m * (float)mask[(i) - start];                                        \
        store_one(p, (i) - start, t + (v * m) / denom[i], dtype);                          \
    }
        for (; i < end && ((i & 7) || i + 8 > end); i++) UPDATE_ONE(i)
        for (; i + 8 <= end; i += 8) {
            ahead((const float *)(p + (i - start) * size));
            ahead(denom + i);
            __m256 t = load_vec(p, i - start, dtype);
            if (d != 1.0f) t = round_vec(_mm256_mul_ps(t, vd), dtype);
            __m256 m = signed_byte(x.row[i >> 3], vs, vns);
            if (mask) m = _mm256_mul_ps(m, mask_vec(mask + i - start));
            __m256 u = _mm256_div_ps(_mm256_mul_ps(vv, m), _mm256_loadu_ps(denom + i));
            store_vec(p, i - start, _mm256_add_ps(t, u), dtype);
        }
        for (; i < end; i++) UPDATE_ONE(i)
#undef UPDATE_ONE
    }
}

/* The server's share of a chunk with a scale per piece, fused: pieces[3p..3p+2] = start, end,
   column c (chunk coordinates). Element i of piece p is
       z = (sum over rows j in order of +-scales[j * ncols + c] from bit i of row j) / k + e[i]
   (no division when k is 1), exactly as ob_average_pieces then ob_compress compute it. */
KERNEL INLINE float z_one(const uint8_t *packed, int64_t stride, const float *scales,
                          int64_t ncols, int64_t k, int64_t c, int64_t i, float e) {
    float z = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        float s = scales[j * ncols + c];
        float t = (packed[j * stride + (i >> 3)] >> (i & 7)) & 1 ? s : s * -1.0f;
        z = j ? z + t : t;
    }
    if (k > 1) z = z / (float)k;
    return z + e;
}

KERNEL INLINE __m256 z_vec(const uint8_t *packed, int64_t stride, const __m256 *vs,
                           const __m256 *vns, int64_t k, int64_t i, __m256 e) {
    __m256 z = signed_byte(packed[i >> 3], vs[0], vns[0]);
    for (int64_t j = 1; j < k; j++)
        z = _mm256_add_ps(z, signed_byte(packed[j * stride + (i >> 3)], vs[j], vns[j]));
    if (k > 1) z = _mm256_div_ps(z, _mm256_set1_ps((float)k));
    return _mm256_add_ps(z, e);
}

/* The k rows' scales of column c, broadcast: vs[j] = scales[j * ncols + c], vns[j] = -1 * it.
   Returns NULL if out of memory. */
KERNEL static __m256 *row_scales(const float *scales, int64_t ncols, int64_t k, int64_t c) {
    __m256 *v = aligned_alloc(32, 2 * k * sizeof(__m256));
    if (!v) return NULL;
    for (int64_t j = 0; j < k; j++) {
        v[j] = _mm256_set1_ps(scales[j * ncols + c]);
        v[k + j] = _mm256_set1_ps(scales[j * ncols + c] * -1.0f);
    }
    return v;
}

/* The error a server keeps as its last z and that z's scale s: z - (z >= 0 ? s : -1 * s), as
   ob_serve_commit would have stored it. With s = 0.0f it is z itself, bit for bit. */
KERNEL INLINE float error_one(float z, float s) {
    return z >= 0.0f ? z - s : z - s * -1.0f;
}

KERNEL INLINE __m256 error_vec(__m256 z, __m256 s, __m256 ns) {
    return _mm256_sub_ps(z, _mm256_blendv_ps(ns, s, _mm256_cmp_ps(z, _mm256_setzero_ps(),
                                                                  _CMP_GE_OQ)));
}

/* v stored at p[i] as dtype (rounded); returns v. */
KERNEL INLINE float kept_one(void *p, int64_t i, float v, int dtype) {
    store_one(p, i, v, dtype);
    return v;
}

KERNEL INLINE __m256 kept_vec(void *p, int64_t i, __m256 v, int dtype) {
    store_vec(p, i, v, dtype);
    return v;
}

/* The server's share with a scale per piece in one pass, its error kept as the last z: store
   (of type sdtype, F32 or BF16) holds the error, or with `last` (non-NULL) the last call's z,
   whose error is error_one(z, last[p]) on piece p. z = (the rows' average, as z_one) + that
   error is written over store (rounded to sdtype), its signs into bits, and totals[p] = the sum
   of z*z (|z|) per piece, both of z as computed. */
KERNEL int ob_serve_store(const uint8_t *packed, int64_t stride, const float *scales,
                          int64_t ncols, int64_t k, const int64_t *pieces, int64_t npieces,
                          void *store, const float *last, uint8_t *restrict bits, int mean_abs,
                          double *totals, int sdtype) {
    const __m256 zero = _mm256_setzero_ps();
    for (int64_t p = 0; p < npieces; p++) {
        int64_t start = pieces[3 * p], end = pieces[3 * p + 1], c = pieces[3 * p + 2];
        const float ls = last ? last[p] : 0.0f;
        const __m256 vls = _mm256_set1_ps(ls), vnls = _mm256_set1_ps(ls * -1.0f);
        Sum sum;
        sum_start(&sum);
        int64_t i = start;
#define Z_ONE(i)                                                                           \
    kept_one(store, i,                                                                     \
             z_one(packed, stride, scales, ncols, k, c, i,                                 \
                   error_one(load_one(store, i, sdtype), ls)),                             \
             sdtype)
        for (; i < end && ((i & 7) || i + 8 > end); i++) {
            float z = Z_ONE(i);
            sum_one(&sum, i, z, mean_abs);
            set_bit(bits, i, z);
        }
        __m256 *rows = row_scales(scales, ncols, k, c);
        if (!rows) return -1;
        const __m256 s0 = rows[0], ns0 = rows[k];
#define ERR(i, T) (ahead_at(store, i, T), error_vec(load_vec(store, i, T), vls, vnls))
#define Z1(i, T)                                                                           \
    kept_vec(store, i, _mm256_add_ps(signed_byte(packed[(i) >> 3], s0, ns0), ERR(i, T)), T)
#define Z(i, T) kept_vec(store, i, z_vec(packed, stride, rows, rows + k, k, i, ERR(i, T)), T)
#define Z1_F32(i) Z1(i, F32)
#define Z1_BF16(i) Z1(i, BF16)
#define Z_F32(i) Z(i, F32)
#define Z_BF16(i) Z(i, BF16)
        if (k == 1 && sdtype == BF16) {
            SIGNS_BODY(Z1_BF16)
        } else if (k == 1) {
            SIGNS_BODY(Z1_F32)
        } else if (sdtype == BF16) {
            SIGNS_BODY(Z_BF16)
        } else {
            SIGNS_BODY(Z_F32)
        }
#undef Z_BF16
#undef Z_F32
#undef Z1_BF16
#undef Z1_F32
#undef Z
#undef Z1
#undef ERR
        free(rows);
        for (; i < end; i++) {
            float z = Z_ONE(i);
            sum_one(&sum, i, z, mean_abs);
            set_bit(bits, i, z);
        }
#undef Z_ONE
        sum_flush(&sum);
        totals[p] = sum.total;
    }
    return 0;
}

/* Server pass 2: e[i] = z - (z >= 0 ? sigma[p] : -1 * sigma[p]), z recomputed. */
KERNEL int ob_serve_commit(const uint8_t *packed, int64_t stride, const float *scales,
                            int64_t ncols, int64_t k, const int64_t *pieces, int64_t npieces,
                            const float *sigma, float *e) {
    const __m256 zero = _mm256_setzero_ps();
    for (int64_t p = 0; p < npieces; p++) {
        int64_t start = pieces[3 * p], end = pieces[3 * p + 1], c = pieces[3 * p + 2];
        const float s = sigma[p], ns = s * -1.0f;
        const __m256 vs = _mm256_set1_ps(s), vns = _mm256_set1_ps(ns);
        int64_t i = start;
        for (; i < end && ((i & 7) || i + 8 > end); i++) {
            float z = z_one(packed, stride, scales, ncols, k, c, i, e[i]);
            e[i] = z >= 0.0f ? z - s : z - ns;
        }
        __m256 *rows = row_scales(scales, ncols, k, c);
        if (!rows) return -1;
        const __m256 s0 = rows[0], ns0 = rows[k];
#define Z1(i) _mm256_add_ps(signed_byte(packed[(i) >> 3], s0, ns0), _mm256_loadu_ps(e + (i)))
#define Z(i) z_vec(packed, stride, rows, rows + k, k, i, _mm256_loadu_ps(e + (i)))
#define COMMIT(Z)                                                                          \
    for (; i + 8 <= end; i += 8) {                                                         \
        __m256 z = Z(i);                                                                   \
        __m256 t = _mm256_blendv_ps(vns, vs, _mm256_cmp_ps(z, zero, _CMP_GE_OQ));          \
        _mm256_storeu_ps(e + i, _mm256_sub_ps(z, t));                                      \
    }
        if (k == 1) {
            COMMIT(Z1)
        } else {
            COMMIT(Z)
        }
#undef COMMIT
#undef Z
#undef Z1
        for (; i < end; i++) {
            float z = z_one(packed, stride, scales, ncols, k, c, i, e[i]);
            e[i] = z >= 0.0f ? z - s : z - ns;
        }
        free(rows);
    }
    return 0;
}

/* The public call's passes (onebit.compress.compress_input, commit_input_, serve_chunk_): the
   worker's y = x + e and the server's z are never stored. x has nx <= n elements and is read as
   zeros past them (the padding); each kernel gives the bits of its stored-y counterpart. */
KERNEL INLINE __m256 load_or_zero(const float *x, int64_t nx, int64_t i) {
    if (__builtin_expect(i + 8 <= nx, 1)) return _mm256_loadu_ps(x + i);
    float t[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t j = i; j < nx; j++) t[j - i] = x[j];
    return _mm256_loadu_ps(t);
}

KERNEL INLINE float add_one(const float *x, int64_t nx, const float *e, int64_t i) {
    return (i < nx ? x[i] : 0.0f) + e[i];
}

#define ADD_VEC(i) _mm256_add_ps(load_or_zero(x, nx, i), _mm256_loadu_ps(e + (i)))

/* ob_compress of b = x + e, without storing it: signs into bits, returns the sum. */
KERNEL double ob_add_signs(const float *x, int64_t nx, const float *e, uint8_t *bits, int64_t n,
                           int mean_abs) {
    double total = 0.0;
    PAIRED_SIGNS(ADD_VEC)
    return total;
}

/* The signs of y = x + e into bits, and totals[q] = the sum of y*y (|y|) over each segment
   [bounds[q], bounds[q+1]) in the order of Sum: ob_sums of the y it does not store. */
KERNEL void ob_add_signs_segments(const float *x, int64_t nx, const float *e,
                                  const int64_t *bounds, int64_t nseg, uint8_t *bits,
                                  int mean_abs, double *totals) {
    const __m256 zero = _mm256_setzero_ps();
    for (int64_t q = 0; q < nseg; q++) {
        Sum sum;
        sum_start(&sum);
        int64_t i = bounds[q], end = bounds[q + 1];
        for (; i < end && ((i & 7) || i + 8 > end); i++) {
            float y = add_one(x, nx, e, i);
            sum_one(&sum, i, y, mean_abs);
            set_bit(bits, i, y);
        }
        SIGNS_BODY(ADD_VEC)
        for (; i < end; i++) {
            float y = add_one(x, nx, e, i);
            sum_one(&sum, i, y, mean_abs);
            set_bit(bits, i, y);
        }
        sum_flush(&sum);
        totals[q] = sum.total;
    }
}

/* e_out = y - (y >= 0 ? s_q : -1 * s_q) with y = x + e recomputed, s_q = scales[q] on segment
   [bounds[q], bounds[q+1]) (one segment [0, n) without segments): ob_commit_segments of that y.
   e_out may be e. */
KERNEL void ob_add_commit(const float *x, int64_t nx, const float *e, const float *scales,
                          const int64_t *bounds, int64_t nseg, float *e_out) {
    const __m256 zero = _mm256_setzero_ps();
    for (int64_t q = 0; q < nseg; q++) {
        const float s = scales[q], ns = s * -1.0f;
        const __m256 vs = _mm256_set1_ps(s), vns = _mm256_set1_ps(ns);
        int64_t i = bounds[q], end = bounds[q + 1];
        for (; i + 8 <= end; i += 8) {
            __m256 y = ADD_VEC(i);
            __m256 t = _mm256_blendv_ps(vns, vs, _mm256_cmp_ps(y, zero, _CMP_GE_OQ));
            _mm256_storeu_ps(e_out + i, _mm256_sub_ps(y, t));
        }
        for (; i < end; i++) {
            float y = add_one(x, nx, e, i);
            e_out[i] = y >= 0.0f ? y - s : y - ns;
        }
    }
}
#undef ADD_VEC

/* Server pass 1 without segments: the signs of z = (the k rows' average, as ob_average) + e over
   the n elements of a chunk, and *total = the sum of z*z (|z|) in the order of ob_compress.
   Pass 2 is ob_serve_commit with the one piece [0, n). Returns -1 if out of memory. */
KERNEL int ob_serve_chunk_signs(const uint8_t *packed, int64_t stride, const float *scales,
                                int64_t k, const float *e, uint8_t *bits, int64_t n,
                                int mean_abs, double *result) {
    __m256 *rows = row_scales(scales, 1, k, 0);
    if (!rows) return -1;
    double total = 0.0;
#define Z(i) z_vec(packed, stride, rows, rows + k, k, i, _mm256_loadu_ps(e + (i)))
    PAIRED_SIGNS(Z)
#undef Z
    free(rows);
    *result = total;
    return 0;
}

/* The public call at world size 1 without segments, passes 2 and 3 (pass 1 is ob_add_signs):
   the only row the server averages is the worker's own, so z = (y >= 0 ? s : -1 * s) + se.
   Pass 2: the worker error e = y - that, and the signs and sum of z (as ob_serve_chunk_signs). */
KERNEL INLINE __m256 solo_z(const float *x, int64_t nx, float *e, const float *se, __m256 vs,
                            __m256 vns, int64_t i) {
    __m256 y = _mm256_add_ps(load_or_zero(x, nx, i), _mm256_loadu_ps(e + i));
    __m256 t = _mm256_blendv_ps(vns, vs, _mm256_cmp_ps(y, _mm256_setzero_ps(), _CMP_GE_OQ));
    _mm256_storeu_ps(e + i, _mm256_sub_ps(y, t));
    return _mm256_add_ps(t, _mm256_loadu_ps(se + i));
}

KERNEL double ob_solo_commit_signs(const float *x, int64_t nx, float *e, float s, const float *se,
                                   uint8_t *bits, int64_t n, int mean_abs) {
    const __m256 vs = _mm256_set1_ps(s), vns = _mm256_set1_ps(s * -1.0f);
    double total = 0.0;
#define Z(i) solo_z(x, nx, e, se, vs, vns, i)
    PAIRED_SIGNS(Z)
#undef Z
    return total;
}

/* Pass 3: z again from the worker's signs ybits, se = z - (z >= 0 ? sigma : -1 * sigma) (as
   ob_serve_commit), and the result, that same +-sigma, into out[0..numel) (as ob_decompress). */
KERNEL void ob_solo_serve_commit(const uint8_t *ybits, float s, float *se, float sigma, float *out,
                                 int64_t numel, int64_t n) {
    const __m256 zero = _mm256_setzero_ps();
    const __m256 vs = _mm256_set1_ps(s), vns = _mm256_set1_ps(s * -1.0f);
    const __m256 vsig = _mm256_set1_ps(sigma), vnsig = _mm256_set1_ps(sigma * -1.0f);
    for (int64_t i = 0; i < n; i += 8) {
        __m256 z = _mm256_add_ps(signed_byte(ybits[i >> 3], vs, vns), _mm256_loadu_ps(se + i));
        __m256 t = _mm256_blendv_ps(vnsig, vsig, _mm256_cmp_ps(z, zero, _CMP_GE_OQ));
        _mm256_storeu_ps(se + i, _mm256_sub_ps(z, t));
        if (__builtin_expect(i + 8 <= numel, 1)) {
            _mm256_storeu_ps(out + i, t);
        } else {
            float lanes[8];
            _mm256_storeu_ps(lanes, t);
            for (int64_t j = i; j < numel; j++) out[j] = lanes[j - i];
        }
    }
}
