/* The CUDA entries' copy kernel: one launch copies a list of (dst, src, bytes) runs, device to
 * device. Used by pakv_device.c when the driver has no batched copy (cuMemcpyBatchAsync, CUDA >= 12.8)
 * and can load PTX (cuModuleLoadData): every run of a gather or a scatter in one launch instead of
 * one cuMemcpyDtoDAsync each. The host splits runs into pieces of at most PAKV_COPY_PIECE_BYTES, so
 * one thread block copies one piece at a time, 16 bytes per thread per step where the piece's
 * addresses and size allow it.
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
  unsigned long long dst, src, bytes; /* device addresses; bytes <= PAKV_COPY_PIECE_BYTES */
};

extern "C" __global__ void pakv_copy_runs(const pakv_copy_run* runs, unsigned long long count) {
  for (unsigned long long r = blockIdx.x; r < count; r += gridDim.x) {
    const pakv_copy_run run = runs[r];
    if (((run.dst | run.src | run.bytes) & 15ull) == 0) {
      uint4* dst = reinterpret_cast<uint4*>(run.dst);
      const uint4* src = reinterpret_cast<const uint4*>(run.src);
      for (unsigned long long i = threadIdx.x; i < run.bytes / 16; i += blockDim.x) dst[i] = src[i];
    } else {
      unsigned char* dst = reinterpret_cast<unsigned char*>(run.dst);
      const unsigned char* src = reinterpret_cast<const unsigned char*>(run.src);
      for (unsigned long long i = threadIdx.x; i < run.bytes; i += blockDim.x) dst[i] = src[i];
    }
  }
}
