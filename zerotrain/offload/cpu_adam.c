/* zerotrain's CPU Adam(W) kernel: built and loaded by cpu_adam.py (see its docstring). */
#include <stdint.h>
#include <math.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

typedef struct {
    float multiplier, decay_factor, weight_decay, lerp_weight, beta2, sq_coeff, bc2_sqrt, eps, neg_step_size;
    int32_t decay_mode;  /* 0 none, 1 decoupled (AdamW), 2 L2 (Adam) */
    int32_t copy_kind;   /* 0 none, 1 fp32, 2 bf16, 3 fp16 */
} zt_adam_args;

static inline uint16_t zt_bf16(float x) {  /* round to nearest even, as torch */
    uint32_t u; memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* One element: reads p_in/m_in/v_in at i, writes p_out/m_out/v_out (the same arrays when in place). */
#define ZT_ELEMENT(p_in, m_in, v_in, p_out, m_out, v_out)                        \
    {                                                                             \
        float g = g_in[i] * a.multiplier;                                         \
        float pv = p_in[i];                                                       \
        if (decay_mode == 1) pv = pv * a.decay_factor;                            \
        if (decay_mode == 2) g = fmaf(pv, a.weight_decay, g);                     \
        float mv = m_in[i];                                                       \
        mv = fmaf(lerp_coeff, g - mv, lerp_small ? mv : g);                       \
        float vv = fmaf(a.sq_coeff * g, g, v_in[i] * a.beta2);                    \
        m_out[i] = mv;                                                            \
        v_out[i] = vv;                                                            \
        float denom = sqrtf(vv) / a.bc2_sqrt + a.eps;                             \
        pv = pv + a.neg_step_size * mv / denom;                                   \
        p_out[i] = pv;                                                            \
        if (copy_kind == 1) out32[i] = pv;                                        \
        if (copy_kind == 2) out16[i] = zt_bf16(pv);                               \
        if (copy_kind == 3) outh[i] = (_Float16)pv;                               \
    }

#define ZT_PROLOGUE                                                               \
    float *restrict out32 = (float *)out;                                         \
    uint16_t *restrict out16 = (uint16_t *)out;                                   \
    _Float16 *restrict outh = (_Float16 *)out;                                    \
    const int lerp_small = fabsf(a.lerp_weight) < 0.5f;                           \
    const float lerp_coeff = lerp_small ? a.lerp_weight : a.lerp_weight - 1.0f;

static inline __attribute__((always_inline)) void zt_body(
        float *restrict p, const float *restrict g_in, float *restrict m, float *restrict v,
        void *restrict out, int64_t n, const zt_adam_args a, const int decay_mode, const int copy_kind) {
    ZT_PROLOGUE
    for (int64_t i = 0; i < n; i++) ZT_ELEMENT(p, m, v, p, m, v)
}

/* Out of place: the inputs are left as they were (a speculative step that may be dropped). Each block is
   computed into L1-resident arrays and then streamed out with non-temporal stores: plain stores to
   lines not in cache would first read them (read-for-ownership), 12 more bytes per element. */
#define ZT_BLOCK 1024

static inline void zt_stream(float *restrict dst, const float *restrict src, int64_t n) {
#if defined(__AVX512F__)
    if (((uintptr_t)dst & 63) == 0 && n % 16 == 0) {
        for (int64_t i = 0; i < n; i += 16) _mm512_stream_ps(dst + i, _mm512_load_ps(src + i));
        return;
    }
#elif defined(__AVX__)
    if (((uintptr_t)dst & 31) == 0 && n % 8 == 0) {
        for (int64_t i = 0; i < n; i += 8) _mm256_stream_ps(dst + i, _mm256_load_ps(src + i));
        return;
    }
#endif
    memcpy(dst, src, (size_t)n * sizeof(float));
}

static inline __attribute__((always_inline)) void zt_body_to(
        const float *restrict p_all, const float *restrict g_all, const float *restrict m_all,
        const float *restrict v_all, float *restrict p_out, float *restrict m_out, float *restrict v_out,
        void *restrict out_all, int64_t n, const zt_adam_args a, const int decay_mode, const int copy_kind) {
    float tp[ZT_BLOCK] __attribute__((aligned(64)));
    float tm[ZT_BLOCK] __attribute__((aligned(64)));
    float tv[ZT_BLOCK] __attribute__((aligned(64)));
    const int64_t out_size = copy_kind == 1 ? 4 : 2;
    for (int64_t base = 0; base < n; base += ZT_BLOCK) {
        const int64_t len = n - base < ZT_BLOCK ? n - base : ZT_BLOCK;
        const float *restrict p = p_all + base, *restrict g_in = g_all + base;
        const float *restrict m = m_all + base, *restrict v = v_all + base;
        void *restrict out = copy_kind ? (void *)((char *)out_all + base * out_size) : out_all;
        ZT_PROLOGUE
        for (int64_t i = 0; i < len; i++) ZT_ELEMENT(p, m, v, tp, tm, tv)
        zt_stream(p_out + base, tp, len);
        zt_stream(m_out + base, tm, len);
        zt_stream(v_out + base, tv, len);
    }
#if defined(__SSE__)
    _mm_sfence();  /* the streamed stores are visible before the caller goes on */
#endif
}

/* decay_mode x copy_kind: each combination compiled as its own loop, without branches inside */
#define ZT_EVERY_CASE(X) X(0, 0) X(0, 1) X(0, 2) X(0, 3) X(1, 0) X(1, 1) X(1, 2) X(1, 3) \
                         X(2, 0) X(2, 1) X(2, 2) X(2, 3)
#define ZT_CASE(D, C) case (D) * 4 + (C): zt_body(p, g, m, v, out, n, a, D, C); break;
#define ZT_CASE_TO(D, C) case (D) * 4 + (C): zt_body_to(p, g, m, v, p_out, m_out, v_out, out, n, a, D, C); break;

/* n must be a multiple of 16 (the caller hands the rest to torch's scalar tail). */
void zt_adam_step(float *restrict p, const float *restrict g, float *restrict m, float *restrict v,
                  void *restrict out, int64_t n, const zt_adam_args *args) {
    const zt_adam_args a = *args;
    switch (a.decay_mode * 4 + a.copy_kind) {
        ZT_EVERY_CASE(ZT_CASE)
        default: break;
    }
}

void zt_adam_step_to(const float *restrict p, const float *restrict g, const float *restrict m,
                     const float *restrict v, float *restrict p_out, float *restrict m_out, float *restrict v_out,
                     void *restrict out, int64_t n, const zt_adam_args *args) {
    const zt_adam_args a = *args;
    switch (a.decay_mode * 4 + a.copy_kind) {
        ZT_EVERY_CASE(ZT_CASE_TO)
        default: break;
    }
}

/* Stochastic rounding of fp32 to bf16 (offload/stochastic_round.py): the 16 bits dropped are compared with a
   uniform 16-bit number from a counter-based hash of (seed, element index), so a value rounds up with the
   probability of its distance from the bf16 below it, and repeated small updates add up in expectation
   where round-to-nearest would drop every one of them. Deterministic in (seed, index). NaN stays NaN,
   +-inf stays +-inf. */
static inline uint32_t zt_mix(uint64_t x) {  /* splitmix64's finalizer */
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return (uint32_t)(x ^ (x >> 31));
}

void zt_round_bf16(const float *restrict src, uint16_t *restrict dst, int64_t n, uint64_t seed) {
    uint64_t base = seed * 0xd1342543de82ef95ull;
    for (int64_t i = 0; i < n; ++i) {
        uint32_t u; memcpy(&u, &src[i], 4);
        if ((u & 0x7f800000u) == 0x7f800000u) {  /* inf or NaN: no noise */
            dst[i] = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40u) : (uint16_t)(u >> 16);
        } else {
            dst[i] = (uint16_t)((u + (zt_mix(base + (uint64_t)i) & 0xffffu)) >> 16);
        }
    }
}
