/* The memory-bandwidth reference of bench_bandwidth.py: out[i] = a[i] OP b[i] over float32, written
 * for the limit: AVX-512 loads, non-temporal (streaming) stores that skip the read-for-ownership
 * of the destination, every core (one POSIX thread per core, each on a contiguous 4 KiB-aligned
 * share). No opbridge code: compiled by the benchmark with the system compiler and called through
 * ctypes on the same arrays.
 *
 *   cc -O3 -march=native -shared -fPIC -pthread ref_add.c -o libref_add.so
 */
#include <immintrin.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    const float *a, *b;
    float *out;
    size_t n;
    int mul;
} share;

static void *run(void *arg) {
    const share *s = arg;
    size_t i = 0;
    /* scalar head up to a 64-byte aligned destination (streaming stores need it) */
    while (i < s->n && ((uintptr_t)(s->out + i) & 63)) {
        s->out[i] = s->mul ? s->a[i] * s->b[i] : s->a[i] + s->b[i];
        i++;
    }
#ifdef __AVX512F__
    for (; i + 32 <= s->n; i += 32) {
        __m512 a0 = _mm512_loadu_ps(s->a + i), a1 = _mm512_loadu_ps(s->a + i + 16);
        __m512 b0 = _mm512_loadu_ps(s->b + i), b1 = _mm512_loadu_ps(s->b + i + 16);
        __m512 r0 = s->mul ? _mm512_mul_ps(a0, b0) : _mm512_add_ps(a0, b0);
        __m512 r1 = s->mul ? _mm512_mul_ps(a1, b1) : _mm512_add_ps(a1, b1);
        _mm512_stream_ps(s->out + i, r0);
        _mm512_stream_ps(s->out + i + 16, r1);
    }
#else
    for (; i + 8 <= s->n; i += 8) {
        __m256 a0 = _mm256_loadu_ps(s->a + i), b0 = _mm256_loadu_ps(s->b + i);
        _mm256_stream_ps(s->out + i, s->mul ? _mm256_mul_ps(a0, b0) : _mm256_add_ps(a0, b0));
    }
#endif
    for (; i < s->n; i++) s->out[i] = s->mul ? s->a[i] * s->b[i] : s->a[i] + s->b[i];
    _mm_sfence();
    return NULL;
}

/* out = a + b (mul = 0) or a * b (mul = 1) on `threads` threads; 0 on success. */
int ref_binary(const float *a, const float *b, float *out, size_t n, int threads, int mul) {
    enum { MAX_THREADS = 256 };
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    share shares[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    size_t per = (n / (size_t)threads + 1023) & ~(size_t)1023, at = 0; /* 4 KiB of floats */
    int started = 0;
    for (int t = 0; t < threads && at < n; t++) {
        size_t len = n - at < per ? n - at : per;
        shares[t] = (share){a + at, b + at, out + at, len, mul};
        at += len;
        if (t == 0) continue; /* the calling thread takes the first share */
        if (pthread_create(&ids[t], NULL, run, &shares[t])) return 1;
        started = t;
    }
    run(&shares[0]);
    for (int t = 1; t <= started; t++) pthread_join(ids[t], NULL);
    return 0;
}
