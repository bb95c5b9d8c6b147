// Descriptor of one page copy (or one sub-slot chunk of a page): plain addresses, so the same
// kernel moves GPU->pinned host, pinned host->GPU (through UVA) and GPU->GPU.
#pragma once
#include <stdint.h>

struct CopyDesc {
    uint64_t src;
    uint64_t dst;
    uint64_t nbytes;
};

#ifndef KVTOOL_UNROLL
#define KVTOOL_UNROLL 8            // independent 16-byte loads in flight per lane
#endif
#define KVTOOL_WARP 32
#define KVTOOL_CHUNK_BYTES (KVTOOL_WARP * 16 * KVTOOL_UNROLL)   // bytes one warp moves per task

// The descriptor holding work chunk `chunk`: the last d with chunk_start[d] <= chunk.
__device__ __forceinline__ int kvtool_find_desc(const uint64_t* chunk_start, int num_descs, uint64_t chunk) {
    int lo = 0, hi = num_descs - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (chunk_start[mid] <= chunk) lo = mid; else hi = mid - 1;
    }
    return lo;
}
