// GGML's reference Q4_K and Q6_K quantizers on many generated blocks, as FNV-1a checksums.
//
// The test `k_quant_checksums_match_ggml` in crates/strix/src/quant/blocks.rs generates the
// same blocks (the same LCG and the same f32 arithmetic, written operation for operation
// alike on both sides) and compares strix's bytes against the two checksums this prints.
// It complements tests/fixtures/gguf/quant_vectors.safetensors with far more blocks than
// a fixture file should hold: enough that a change in the order of a candidate search's
// float sums or in its tie-breaking shows up.
//
// Build against GGML's sources (ggml/src/ggml-quants.c from llama.cpp or ggml; the
// llama-cpp-python sdist of scripts/README.md "GGUF fixtures" vendors them) with the flags
// make_gguf_fixtures.py uses, and run:
//
//     G=.../ggml
//     gcc -std=gnu11 -O2 -ffp-contract=off -DNDEBUG -D_GNU_SOURCE -I$G/include -I$G/src \
//         scripts/ggml_kquant_checksums.c $G/src/ggml-quants.c -lm -o /tmp/kquant_checksums
//     /tmp/kquant_checksums
//
// The checksums in the test came from ggml-org/ggml at d99724f2 (whose reference quantizers
// give the committed quant_vectors.safetensors byte for byte), the same at -O0 and -O2.

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void quantize_row_q4_K_ref(const float *x, void *y, int64_t k);
void quantize_row_q6_K_ref(const float *x, void *y, int64_t k);

// ggml-quants.c refers to these; the reference quantizers never call them.
void ggml_abort(const char *file, int line, const char *fmt, ...) {
    fprintf(stderr, "ggml_abort %s:%d %s\n", file, line, fmt);
    abort();
}
size_t ggml_row_size(int type, int64_t ne) { (void)type; (void)ne; abort(); }
const char *ggml_type_name(int type) { (void)type; abort(); }
size_t ggml_type_size(int type) { (void)type; abort(); }

#define BLOCKS 2048
#define QK_K 256

static uint64_t state;

static uint64_t next_u64(void) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return state;
}

// Uniform in [-1, 1): 24 random bits, every step exact.
static float uniform(void) { return (float)(next_u64() >> 40) / 16777216.0f * 2.0f - 1.0f; }

static float pow2(int e) {
    uint32_t bits = (uint32_t)(127 + e) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void generate(float *x) {
    state = 0x5eed;
    for (int b = 0; b < BLOCKS; ++b) {
        // Magnitudes from 2^-20 (scales in f16's subnormal range) to 2^12.
        int e = (int)(next_u64() >> 59) - 20;
        float mag = (1.5f + 0.5f * uniform()) * pow2(e);
        int shape = b % 6;
        for (int s = 0; s < QK_K / 16; ++s) {
            float coin = uniform();
            float spread = 1.0f + 0.75f * uniform();
            float sub = coin < -0.875f ? 0.0f : spread;
            for (int i = 0; i < 16; ++i) {
                float u = uniform();
                float v;
                switch (shape) {
                case 0: v = u; break;
                case 1: v = u * u * u; break;
                case 2: v = u + 0.75f; break;
                case 3: v = u * u - 0.25f; break;
                // On a grid of eighths: exact ties between candidates and in the rounding.
                case 4: v = (float)(next_u64() >> 60) * 0.125f - 1.0f; break;
                // Constant sub-blocks.
                default: v = 0.5f; break;
                }
                if ((next_u64() >> 58) == 0) v = v * 16.0f;
                x[QK_K * b + 16 * s + i] = v * sub * mag;
            }
        }
    }
}

static uint64_t fnv1a(const unsigned char *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < n; ++i) {
        h ^= p[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}

int main(void) {
    static float x[BLOCKS * QK_K];
    static unsigned char q4[BLOCKS * 144], q6[BLOCKS * 210];
    generate(x);
    quantize_row_q4_K_ref(x, q4, BLOCKS * QK_K);
    quantize_row_q6_K_ref(x, q6, BLOCKS * QK_K);
    printf("q4_K 0x%016llx\nq6_K 0x%016llx\n", (unsigned long long)fnv1a(q4, sizeof q4),
           (unsigned long long)fnv1a(q6, sizeof q6));
    return 0;
}
