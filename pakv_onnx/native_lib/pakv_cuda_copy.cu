/* The CUDA entries' copy kernel: one launch copies a list of (dst, src, bytes) runs, device to
 * device. pakv_device_cuda.c uses it for every call of more than one run where the driver can load PTX
 * (cuModuleLoadData): on an H200 (CUDA 13 driver, 2026-12-04) cuMemcpyBatchAsync cost what one
 * cuMemcpyDtoDAsync per run costs, 40x a memcpy of the same bytes at 262,144 tokens. The host splits
 * runs into pieces (64 KiB, more in a large call), so
 * one thread block copies one piece at a time. A list of up to PAKV_COPY_INLINE_RUNS pieces goes in
 * the launch's parameter (pakv_copy_runs_inline); a longer one is uploaded first (pakv_copy_runs).
 *
 * The library never compiles this file: it embeds the PTX below as a C string
 * (pakv_cuda_copy_ptx.h), JIT-compiled by the driver for whatever GPU runs it (target sm_75:
 * Turing and newer). The PTX ISA version nvcc writes is its own (9.5 for CUDA 13.5), which a driver
 * older than that toolkit cannot load, and this path is for old drivers: the code uses nothing newer
 * than ISA 7.0 (CUDA 11.0), so the header states 7.0. Regenerate after a change (nvcc from the
 * nvidia-cuda-nvcc, nvidia-nvvm, nvidia-cuda-crt and nvidia-cuda-runtime wheels; ptxas checks it),
 * in this folder, the commands below. */
// nvcc -ptx -arch=compute_75 -O3 -o pakv_cuda_copy.ptx pakv_cuda_copy.cu
// sed -i 's/^[.]version [0-9.]*$/.version 7.0/' pakv_cuda_copy.ptx
// ptxas -arch=sm_75 -o /dev/null pakv_cuda_copy.ptx && ptxas -arch=sm_90 -o /dev/null pakv_cuda_copy.ptx
// (echo '// Generated from pakv_cuda_copy.cu (the commands there); do not edit.'
//  echo 'static const char PAKV_CUDA_COPY_PTX[] ='; sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' -e 's/^.*$/  "&\\n"/' \
//  pakv_cuda_copy.ptx; echo '  ;') > pakv_cuda_copy_ptx.h && rm pakv_cuda_copy.ptx

struct pakv_copy_run {
  unsigned long long dst, src, bytes; /* device addresses; bytes: at most a piece (pakv_device_cuda.c) */
};

/* A short list passed by value as the launch's parameter (no device memory, no upload): 8 + 160 x 24
 * = 3,848 bytes, under the 4 KiB of parameters every PTX ISA allows. pakv_device_cuda.c mirrors it. */
#define PAKV_COPY_INLINE_RUNS 160
struct pakv_copy_inline {
  unsigned long long count;
  pakv_copy_run runs[PAKV_COPY_INLINE_RUNS];
};

#define PAKV_COPY_UNROLL 4

/* One piece by one thread block: 16-byte words where the piece's addresses and size allow, each thread
 * with PAKV_COPY_UNROLL loads in flight before its stores (one load each leaves the copy latency-bound
 * at about half of a device memcpy's bandwidth on an H200); else bytes. */
__device__ __forceinline__ void copy_piece(const pakv_copy_run run) {
  if (((run.dst | run.src | run.bytes) & 15ull) == 0) {
    uint4* __restrict__ dst = reinterpret_cast<uint4*>(run.dst);
    const uint4* __restrict__ src = reinterpret_cast<const uint4*>(run.src);
    const unsigned long long words = run.bytes / 16, step = blockDim.x;
    unsigned long long i = threadIdx.x;
    for (; i + (PAKV_COPY_UNROLL - 1) * step < words; i += PAKV_COPY_UNROLL * step) {
      uint4 w[PAKV_COPY_UNROLL];
#pragma unroll
      for (int u = 0; u < PAKV_COPY_UNROLL; u++) w[u] = src[i + u * step];
#pragma unroll
      for (int u = 0; u < PAKV_COPY_UNROLL; u++) dst[i + u * step] = w[u];
    }
    for (; i < words; i += step) dst[i] = src[i];
  } else {
    unsigned char* dst = reinterpret_cast<unsigned char*>(run.dst);
    const unsigned char* src = reinterpret_cast<const unsigned char*>(run.src);
    for (unsigned long long i = threadIdx.x; i < run.bytes; i += blockDim.x) dst[i] = src[i];
  }
}

/* A long list, uploaded into device memory. */
extern "C" __global__ void pakv_copy_runs(const pakv_copy_run* runs, unsigned long long count) {
  for (unsigned long long r = blockIdx.x; r < count; r += gridDim.x) copy_piece(runs[r]);
}

/* A short list, in the parameter itself. */
extern "C" __global__ void pakv_copy_runs_inline(const pakv_copy_inline list) {
  for (unsigned long long r = blockIdx.x; r < list.count && r < PAKV_COPY_INLINE_RUNS; r += gridDim.x)
    copy_piece(list.runs[r]);
}
