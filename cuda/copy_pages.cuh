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
#ifndef KVTOOL_LOAD_HINT
#define KVTOOL_LOAD_HINT 0         // 0: streaming (ld.global.cs); 1: non-coherent with a 256 B L2 prefetch;
#endif                             // 2: non-coherent (ld.global.nc); 3: plain ld.global
#ifndef KVTOOL_STORE_HINT
#define KVTOOL_STORE_HINT 0        // 0: streaming (st.global.cs); 1: plain st.global
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

__device__ __forceinline__ int kvtool_owner(const uint64_t* chunk_start, int num_descs, uint64_t chunk,
                                            uint64_t chunks_per_desc) {
    return chunks_per_desc ? (int)(chunk / chunks_per_desc) : kvtool_find_desc(chunk_start, num_descs, chunk);
}

// One 16-byte load. The 256-byte L2 prefetch variant makes each miss fetch a larger span, which
// matters when the source is host memory read over PCIe.
__device__ __forceinline__ uint4 kvtool_load16(const uint4* p) {
#if KVTOOL_LOAD_HINT == 1
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#elif KVTOOL_LOAD_HINT == 2
    return __ldg(p);
#elif KVTOOL_LOAD_HINT == 3
    return *p;
#else
    return __ldcs(p);
#endif
}

__device__ __forceinline__ void kvtool_store16(uint4* p, uint4 v) {
#if KVTOOL_STORE_HINT == 1
    *p = v;
#else
    __stcs(p, v);
#endif
}

// The bytes of work chunk `chunk`: where they are, where they go, how many (at most a chunk).
struct KvtoolTask {
    const unsigned char* src;
    unsigned char* dst;
    uint64_t bytes;
};

__device__ __forceinline__ KvtoolTask kvtool_task(const CopyDesc* descs, const uint64_t* chunk_start, int num_descs,
                                                  uint64_t chunk, uint64_t chunks_per_desc) {
    const int d = kvtool_owner(chunk_start, num_descs, chunk, chunks_per_desc);
    const CopyDesc desc = descs[d];
    const uint64_t offset = (chunk - chunk_start[d]) * KVTOOL_CHUNK_BYTES;
    const uint64_t remaining = desc.nbytes - offset;
    KvtoolTask task;
    task.src = reinterpret_cast<const unsigned char*>(desc.src + offset);
    task.dst = reinterpret_cast<unsigned char*>(desc.dst + offset);
    task.bytes = remaining < KVTOOL_CHUNK_BYTES ? remaining : KVTOOL_CHUNK_BYTES;
    return task;
}
