// random.h: counter-based random numbers, the only generator of the project: any draw is a pure
// function of (seed, stream, index), so a draw needs no state but its counter. train_unet.cu (data
// order, flips, initialisation, noise, dropout), generate.c (sampling noise) and the bundled
// dataset (data/shapes.c) draw from it. Plain C11; in CUDA code also device functions.
#ifndef RANDOM_H
#define RANDOM_H

#include <stdint.h>

#ifdef __CUDACC__
#define HOST_DEVICE __host__ __device__
#else
#define HOST_DEVICE
#endif

// splitmix64's finaliser: a bijective mix of 64 bits.
HOST_DEVICE static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// A random 64-bit value for draw `index` of stream `stream` under `seed`, in two halves: the stream's
// key, then the draw from it (a loop over one stream's draws computes the key once).
HOST_DEVICE static inline uint64_t random_key(uint64_t seed, uint64_t stream) {
    return mix64(seed ^ mix64(stream + 0x9e3779b97f4a7c15ull));
}
HOST_DEVICE static inline uint64_t random_draw(uint64_t key, uint64_t index) { return mix64(key + index); }
HOST_DEVICE static inline uint64_t random_u64(uint64_t seed, uint64_t stream, uint64_t index) {
    return random_draw(random_key(seed, stream), index);
}

// A uniform integer in [0, n) without modulo bias (Lemire's multiply-shift, with rejection).
static inline uint64_t random_below(uint64_t seed, uint64_t stream, uint64_t *counter, uint64_t n) {
    for (;;) {
        uint64_t x = random_u64(seed, stream, (*counter)++);
        __uint128_t m = (__uint128_t)x * n;
        uint64_t low = (uint64_t)m;
        if (low >= n || low >= (0 - n) % n) return (uint64_t)(m >> 64);
    }
}

#endif  // RANDOM_H
