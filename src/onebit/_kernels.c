/* onebit's fused CPU kernels (AVX2 + FMA), built with the package by setup.py as the optional
   extension onebit._kernels and loaded with ctypes by onebit/_native.py, which documents them.
   Built with -O3 -ffp-contract=off -fno-fast-math: the kernels reproduce the torch formulation
   bit for bit, so the compiler must not fuse or reorder float operations. */
#include <stdint.h>
#include <immintrin.h>

#define KERNEL __attribute__((target("avx2,fma")))
#define BLOCK 4096

int ob_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* b = b + e; out[i/8] bit i%8 = (b[i] >= 0); returns the sum of b*b (or of |b| if mean_abs).
   n is a multiple of 8. */
KERNEL double ob_compress(float *b, const float *e, uint8_t *out, int64_t n, int mean_abs) {
    const __m256 zero = _mm256_setzero_ps();
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    double total = 0.0;
    for (int64_t start = 0; start < n; start += BLOCK) {
        int64_t end = start + BLOCK < n ? start + BLOCK : n;
        __m256 acc0 = zero, acc1 = zero;
        int64_t i = start;
        for (; i + 16 <= end; i += 16) {
            __m256 y0 = _mm256_add_ps(_mm256_loadu_ps(b + i), _mm256_loadu_ps(e + i));
            __m256 y1 = _mm256_add_ps(_mm256_loadu_ps(b + i + 8), _mm256_loadu_ps(e + i + 8));
            _mm256_storeu_ps(b + i, y0);
            _mm256_storeu_ps(b + i + 8, y1);
            if (mean_abs) {
                acc0 = _mm256_add_ps(acc0, _mm256_and_ps(y0, absmask));
                acc1 = _mm256_add_ps(acc1, _mm256_and_ps(y1, absmask));
            } else {
                acc0 = _mm256_fmadd_ps(y0, y0, acc0);
                acc1 = _mm256_fmadd_ps(y1, y1, acc1);
            }
            out[i / 8] = (uint8_t)_mm256_movemask_ps(_mm256_cmp_ps(y0, zero, _CMP_GE_OQ));
            out[i / 8 + 1] = (uint8_t)_mm256_movemask_ps(_mm256_cmp_ps(y1, zero, _CMP_GE_OQ));
        }
        for (; i < end; i += 8) {
            __m256 y0 = _mm256_add_ps(_mm256_loadu_ps(b + i), _mm256_loadu_ps(e + i));
            _mm256_storeu_ps(b + i, y0);
            if (mean_abs) acc0 = _mm256_add_ps(acc0, _mm256_and_ps(y0, absmask));
            else acc0 = _mm256_fmadd_ps(y0, y0, acc0);
            out[i / 8] = (uint8_t)_mm256_movemask_ps(_mm256_cmp_ps(y0, zero, _CMP_GE_OQ));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, _mm256_add_ps(acc0, acc1));
        for (int j = 0; j < 8; j++) total += lanes[j];
    }
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

/* Segments [bounds[q], bounds[q+1]), q < nseg: totals[q] = the sum of y*y (or of |y|) over the
   segment, in fp32 partial sums of BLOCK elements added in fp64, as ob_compress. */
KERNEL void ob_sums(const float *y, const int64_t *bounds, int64_t nseg, int mean_abs,
                    double *totals) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t q = 0; q < nseg; q++) {
        double total = 0.0;
        for (int64_t start = bounds[q]; start < bounds[q + 1]; start += BLOCK) {
            int64_t end = start + BLOCK < bounds[q + 1] ? start + BLOCK : bounds[q + 1];
            __m256 acc = _mm256_setzero_ps();
            int64_t i = start;
            for (; i + 8 <= end; i += 8) {
                __m256 v = _mm256_loadu_ps(y + i);
                acc = mean_abs ? _mm256_add_ps(acc, _mm256_and_ps(v, absmask))
                               : _mm256_fmadd_ps(v, v, acc);
            }
            float lanes[8], rest = 0.0f;
            _mm256_storeu_ps(lanes, acc);
            for (; i < end; i++) rest += mean_abs ? (y[i] < 0 ? -y[i] : y[i]) : y[i] * y[i];
            for (int j = 0; j < 8; j++) total += lanes[j];
            total += rest;
        }
        totals[q] = total;
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
