// The C functions PyTorch calls when pyalloc is its CUDA allocator.
//
// torch.cuda.memory.CUDAPluggableAllocator dlopens this library (the same
// file Python imports as pyalloc._C, so both see the same pools) and takes
// function addresses; the signatures are PyTorch's, from
// torch/csrc/cuda/CUDAPluggableAllocator.h and the setters bound in
// torch/csrc/cuda/Module.cpp:
//   alloc            void* (size_t size, int device, cudaStream_t stream)
//   free             void  (void* ptr, size_t size, int device, cudaStream_t stream)
//   set_init_fn      void  (int device_count)
//   set_reset_fn     void  ()                       torch.cuda.empty_cache()
//   set_memory_fraction_fn void (double fraction, int device)
//   set_base_alloc_fn void* (void* ptr, size_t* size)
//   set_record_stream_fn void (void* ptr, cudaStream_t stream)
// cudaStream_t is an opaque pointer, the same handle as the driver's
// CUstream; it is declared here as void* so that no CUDA header is needed.
// cudaStreamPerThread (0x2) is the calling thread's own stream (streams.h).
// record_stream is given no device: a default stream is the block's device's.
//
// The graph-pool hooks take C++ types by value, so they are C++ functions
// with C linkage (found by name), whose signatures must be exactly those of
// PyTorch's setters (MempoolId_t is std::pair<CaptureId_t, CaptureId_t>,
// CaptureId_t unsigned long long; cudaStream_t is `struct CUstream_st*`):
//   set_begin_allocate_to_pool   void (int device, MempoolId_t pool,
//                                      std::function<bool(cudaStream_t)> filter)
//   set_end_allocate_to_pool_fn  void (int device, MempoolId_t pool)
//   set_release_pool             void (int device, MempoolId_t pool)
// CUDAGraph::capture_begin calls the first (an exception reaches Python);
// capture_end and the graph's destructor the others, which never throw.
//
// PyTorch calls these from any thread, alloc outside its own lock. An
// exception thrown by alloc reaches Python as RuntimeError with its message;
// free runs inside deleters and must not throw. The library is built with
// -fvisibility=hidden, so each is exported explicitly.
#include <dlfcn.h>

#include <functional>
#include <string>
#include <utility>

#include "registry.h"
#include "streams.h"

#define PYALLOC_EXPORT extern "C" __attribute__((visibility("default")))

using pyalloc::Stream;

// The CUDA runtime's stream type, declared as the runtime declares it.
struct CUstream_st;
using cudaStream_t = CUstream_st*;
using MempoolId = std::pair<unsigned long long, unsigned long long>;

namespace {

// cudaStreamPerThread is the calling thread's own (streams.h).
Stream stream_of(void* s) { return pyalloc::streams::from_handle(reinterpret_cast<uintptr_t>(s)); }
uintptr_t addr(void* p) { return reinterpret_cast<uintptr_t>(p); }

}  // namespace

PYALLOC_EXPORT void* pyalloc_malloc(size_t size, int device, void* stream) {
  return reinterpret_cast<void*>(pyalloc::hooks::malloc(size, device, stream_of(stream)));
}

PYALLOC_EXPORT void pyalloc_free(void* ptr, size_t /*size*/, int device, void* /*stream*/) {
  // The size is not trusted (the pool knows each block's size), and the
  // stream is the one the block was allocated on, which the pool knows too.
  pyalloc::hooks::free(addr(ptr), device);
}

PYALLOC_EXPORT void pyalloc_init(int device_count) { pyalloc::hooks::init(device_count); }

PYALLOC_EXPORT void pyalloc_empty_cache() { pyalloc::hooks::empty_cache(); }

PYALLOC_EXPORT void pyalloc_set_memory_fraction(double fraction, int device) {
  pyalloc::hooks::set_memory_fraction(fraction, device);
}

PYALLOC_EXPORT void* pyalloc_base_alloc(void* ptr, size_t* size) {
  return reinterpret_cast<void*>(pyalloc::hooks::base_alloc(addr(ptr), size));
}

PYALLOC_EXPORT void pyalloc_record_stream(void* ptr, void* stream) {
  pyalloc::hooks::record_stream(addr(ptr), stream_of(stream));
}

PYALLOC_EXPORT void pyalloc_begin_allocate_to_pool(int device, MempoolId pool,
                                                   std::function<bool(cudaStream_t)> filter) {
  pyalloc::DevicePools::StreamFilter accepts;
  if (filter)
    accepts = [filter = std::move(filter)](Stream s) {
      return filter(reinterpret_cast<cudaStream_t>(pyalloc::streams::handle(s)));
    };
  pyalloc::hooks::begin_allocate_to_pool(device, {pool.first, pool.second}, std::move(accepts));
}

PYALLOC_EXPORT void pyalloc_end_allocate_to_pool(int device, MempoolId pool) {
  pyalloc::hooks::end_allocate_to_pool(device, {pool.first, pool.second});
}

PYALLOC_EXPORT void pyalloc_release_pool(int device, MempoolId pool) {
  pyalloc::hooks::release_pool(device, {pool.first, pool.second});
}

namespace pyalloc {

std::string library_path() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&pyalloc_malloc), &info) == 0 || info.dli_fname == nullptr)
    throw std::runtime_error("cannot find the path of the library holding pyalloc's hooks");
  return info.dli_fname;
}

}  // namespace pyalloc
