// Batched page copies in one launch. Each warp takes work chunks of KVTOOL_CHUNK_BYTES: every lane
// issues KVTOOL_UNROLL independent 16-byte streaming loads before its stores, so enough bytes are
// in flight to cover PCIe latency with few SMs. Grid size is chosen by the host from the bytes it
// wants in flight, not from the number of pages.
#include "copy_pages.cuh"

// chunks_per_desc != 0: every descriptor has that many chunks, so the owner of a chunk is one
// division away (a dependent binary search per 4 KB task is what limits GPU-to-GPU gathers).
extern "C" __global__ void copy_pages_vec16(const CopyDesc* __restrict__ descs,
                                            const uint64_t* __restrict__ chunk_start,
                                            int num_descs, uint64_t num_chunks, uint64_t chunks_per_desc) {
    const uint64_t lane = threadIdx.x % KVTOOL_WARP;
    const uint64_t warp = (blockIdx.x * (uint64_t)blockDim.x + threadIdx.x) / KVTOOL_WARP;
    const uint64_t num_warps = (gridDim.x * (uint64_t)blockDim.x) / KVTOOL_WARP;
    for (uint64_t chunk = warp; chunk < num_chunks; chunk += num_warps) {
        const KvtoolTask task = kvtool_task(descs, chunk_start, num_descs, chunk, chunks_per_desc);
        const uint4* src = reinterpret_cast<const uint4*>(task.src);
        uint4* dst = reinterpret_cast<uint4*>(task.dst);
        const uint64_t n16 = task.bytes / 16;
        uint4 regs[KVTOOL_UNROLL];
#pragma unroll
        for (int k = 0; k < KVTOOL_UNROLL; ++k) {
            const uint64_t i = k * KVTOOL_WARP + lane;
            if (i < n16) regs[k] = kvtool_load16(src + i);
        }
#pragma unroll
        for (int k = 0; k < KVTOOL_UNROLL; ++k) {
            const uint64_t i = k * KVTOOL_WARP + lane;
            if (i < n16) kvtool_store16(dst + i, regs[k]);
        }
    }
}

// Fallback for descriptors whose addresses or size are not 16-byte aligned: byte copies, with the
// lanes of a warp on consecutive bytes so the accesses stay coalesced.
extern "C" __global__ void copy_pages_bytes(const CopyDesc* __restrict__ descs,
                                            const uint64_t* __restrict__ chunk_start,
                                            int num_descs, uint64_t num_chunks, uint64_t chunks_per_desc) {
    const uint64_t lane = threadIdx.x % KVTOOL_WARP;
    const uint64_t warp = (blockIdx.x * (uint64_t)blockDim.x + threadIdx.x) / KVTOOL_WARP;
    const uint64_t num_warps = (gridDim.x * (uint64_t)blockDim.x) / KVTOOL_WARP;
    for (uint64_t chunk = warp; chunk < num_chunks; chunk += num_warps) {
        const KvtoolTask task = kvtool_task(descs, chunk_start, num_descs, chunk, chunks_per_desc);
        for (uint64_t i = lane; i < task.bytes; i += KVTOOL_WARP) task.dst[i] = task.src[i];
    }
}
