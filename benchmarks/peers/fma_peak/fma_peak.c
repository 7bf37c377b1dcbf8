/* The machine's floating-point peak, the ceiling any matmul runs under: every thread issues
 * independent fused multiply-adds on the widest vectors the compiler targets (built with
 * -march=native by benchmarks/bench_matmul.py), twelve chains per thread so that latency never
 * limits throughput (two FMA pipes times a four-cycle latency need eight). Returns GFLOP/s. */
#include <immintrin.h>
#include <pthread.h>
#include <time.h>

#if defined(__AVX512F__)
typedef __m512 vf;
typedef __m512d vd;
#define SET1F _mm512_set1_ps
#define SET1D _mm512_set1_pd
#define FMAF _mm512_fmadd_ps
#define FMAD _mm512_fmadd_pd
#define WIDTH 64
#elif defined(__FMA__)
typedef __m256 vf;
typedef __m256d vd;
#define SET1F _mm256_set1_ps
#define SET1D _mm256_set1_pd
#define FMAF _mm256_fmadd_ps
#define FMAD _mm256_fmadd_pd
#define WIDTH 32
#else
#error "needs FMA (x86-64-v3) or AVX-512"
#endif

struct job { long iterations; int f64; double sink; };

/* The empty asm keeps every chain alive and in a register each round: without it the compiler
 * may fold the loop away. */
#define CHAINS(T, SET1, FMA)                                                                   \
    T a0 = SET1(1), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,   \
      a9 = a0, a10 = a0, a11 = a0, m = SET1(0.999999), c = SET1(1e-7);                        \
    for (long i = 0; i < j->iterations; i++) {                                                 \
        a0 = FMA(a0, m, c); a1 = FMA(a1, m, c); a2 = FMA(a2, m, c); a3 = FMA(a3, m, c);        \
        a4 = FMA(a4, m, c); a5 = FMA(a5, m, c); a6 = FMA(a6, m, c); a7 = FMA(a7, m, c);        \
        a8 = FMA(a8, m, c); a9 = FMA(a9, m, c); a10 = FMA(a10, m, c); a11 = FMA(a11, m, c);    \
        __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5),      \
                         "+x"(a6), "+x"(a7), "+x"(a8), "+x"(a9), "+x"(a10), "+x"(a11));         \
    }                                                                                          \
    j->sink = ((double *)&a0)[0] + ((double *)&a11)[0];

static void *run(void *arg) {
    struct job *j = arg;
    if (j->f64) {
        CHAINS(vd, SET1D, FMAD)
    } else {
        CHAINS(vf, SET1F, FMAF)
    }
    return 0;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* GFLOP/s of `threads` threads, each running 12 * `iterations` FMAs; best of `rounds`. */
double fma_peak(int threads, int f64, long iterations, int rounds) {
    struct job jobs[256];
    pthread_t ids[256];
    if (threads < 1 || threads > 256) return -1;
    double best = 0;
    for (int r = 0; r < rounds; r++) {
        double t0 = now();
        for (int k = 0; k < threads; k++) {
            jobs[k] = (struct job){iterations, f64, 0};
            if (pthread_create(&ids[k], 0, run, &jobs[k]) != 0) return -1;
        }
        for (int k = 0; k < threads; k++) pthread_join(ids[k], 0);
        double dt = now() - t0;
        double lanes = WIDTH / (f64 ? 8.0 : 4.0);
        double gflops = threads * 12.0 * iterations * lanes * 2 / dt / 1e9;
        if (gflops > best) best = gflops;
    }
    return best;
}
