// The round-boundary condition of a device-exit burst; numpy twin in round_exit_ref.py.
//
// A module of its own, compiled only when a device-exit burst is asked for
// (graphburst/kernels/round_exit_cuda.py): it calls the device runtime's
// cudaGraphSetConditional, and a toolchain that cannot compile or load that must cost
// a clean refusal of device exit, never the fixed-M kernels in kernels.cu.
#include "common.cuh"

#define GB_EXIT_WORDS 4
#define GB_EXIT_ROUNDS 0
#define GB_EXIT_GO 1
#define GB_EXIT_ACK 2
#define GB_EXIT_REASON 3
#define GB_EXIT_RUNNING 0
#define GB_EXIT_BY_ROUNDS 1
#define GB_EXIT_BY_IDLE 2
#define GB_EXIT_BY_FLAG 3
#define GB_EXIT_THREADS 256

#if defined(__CUDACC_RTC__) && defined(GB_EXIT_RUNTIME_HEADER)
// The second way round_exit_cuda.py compiles this file: the toolkit's own declaration.
#include <cuda_device_runtime_api.h>
#elif defined(__CUDACC_RTC__)
// NVRTC has no declaration of the device runtime's builtin (nvcc gets it from
// cuda_device_runtime_api.h); the handle is a cudaGraphConditionalHandle.
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(unsigned long long handle, unsigned int value);
#endif

// Threads: one block of GB_EXIT_THREADS, striding over the batch.
// At a round boundary (begin = 1: before the first round, the count becomes 0; else after a
// round, the count grows by 1) the loop goes on only while the count is below m_max, some slot
// has budget left (budget > 0: a stop token or a spent budget set it to 0) and the host's stop
// count equals the one the device last answered. When the loop ends and hold is 0, the device
// answers every stop request made before this read (ack <- the count read); with hold, requests
// stay pending until the host enqueues their answer (a serving loop's admission), so every burst
// launched before it runs zero rounds. handle != 0: the WHILE node's conditional handle is set
// to the decision; 0 (an eager burst): the host reads state[GO].
extern "C" __global__ void spec_round_exit(int batch, int m_max, int begin, int hold,
                                           const int* __restrict__ budget,  // [B]
                                           int* __restrict__ state,         // [GB_EXIT_WORDS]
                                           const volatile int* stop_count,  // [1] mapped host word
                                           u64 handle) {
    int any = 0;
    for (int b = threadIdx.x; b < batch; b += blockDim.x) any |= budget[b] > 0;
    any = __syncthreads_or(any);
    if (threadIdx.x != 0) return;
    int rounds = begin ? 0 : state[GB_EXIT_ROUNDS] + 1;
    int requested = *stop_count;  // volatile: read from host memory at every boundary
    int reason = GB_EXIT_RUNNING;
    if (requested != state[GB_EXIT_ACK]) reason = GB_EXIT_BY_FLAG;
    else if (!any) reason = GB_EXIT_BY_IDLE;
    else if (rounds >= m_max) reason = GB_EXIT_BY_ROUNDS;
    int go = reason == GB_EXIT_RUNNING;
    state[GB_EXIT_ROUNDS] = rounds;
    state[GB_EXIT_GO] = go;
    state[GB_EXIT_REASON] = reason;
    if (!go && !hold) state[GB_EXIT_ACK] = requested;
    if (handle != 0) cudaGraphSetConditional(handle, (unsigned int)go);
}
