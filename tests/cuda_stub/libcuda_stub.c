/* A stand-in for libcuda.so.1, so that CI without a GPU can run pyalloc's CUDA
 * backend (csrc/cuda/cuda_backend.cpp) against the driver API it uses.
 *
 * Memory is host memory. Contexts are per device and current per thread.
 * Streams are opaque numbers; the test marks one as capturing and counts every
 * call that CUDA's global capture mode forbids, or that pyalloc promises not to
 * make, while a capture is underway (allocating, freeing, asking for free
 * memory, recording, querying or waiting on events). Events
 * complete at once unless the test holds them pending.
 *
 * Capture modes are per thread, as in CUDA: in relaxed mode
 * (cuThreadExchangeStreamCaptureMode) allocating and mapping are legal during
 * a capture and counted apart; freeing, unmapping and events stay forbidden.
 * Built with -DSTUB_NO_RELAXED it lacks that entry point, like a driver
 * older than CUDA 10.1.
 *
 * test_cuda_backend_stub.py compiles it as libcuda.so.1 and reads `stub` through
 * ctypes. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

enum { MODE_GLOBAL = 0, MODE_RELAXED = 2 };

typedef int CUresult;
typedef struct Ctx { int device; } *CUcontext;
typedef struct Event { int flags; int recorded; } *CUevent;
typedef void* CUstream;

enum { SUCCESS = 0, OUT_OF_MEMORY = 2, INVALID_VALUE = 1, INVALID_DEVICE = 101,
       INVALID_CONTEXT = 201, NOT_READY = 600, STUB_FAILURE = 999 };

#define DEVICES 2
#define MAX_BLOCKS 4096

struct Stub {
  int64_t capacity;          /* per device */
  int64_t used[DEVICES];
  int64_t fail_alloc_size;   /* cuMemAlloc of exactly this size fails with STUB_FAILURE */
  int events_pending;        /* cuEventQuery answers NOT_READY while set */
  uint64_t capturing_stream; /* 0: no capture */
  uint64_t capture_id;
  int64_t mem_alloc, mem_free, event_create, event_record, event_query, event_sync,
      event_destroy, capture_queries, forbidden_during_capture, wrong_context;
  int vmm;                   /* the device reports virtual memory management */
  int64_t mem_create, mem_release, mem_map, mem_unmap, mapped[DEVICES];
  int64_t mode_exchanges, relaxed_during_capture;
};
struct Stub stub = {.capacity = 256 << 20};

static struct Ctx contexts[DEVICES] = {{0}, {1}};
static __thread CUcontext current = 0;
static struct { uintptr_t ptr; int64_t size; int device; } blocks[MAX_BLOCKS];

static __thread int mode = MODE_GLOBAL;

static void during_capture(void) {
  if (stub.capturing_stream != 0) stub.forbidden_during_capture++;
}
/* Allocating and mapping: legal during a capture in relaxed mode only. */
static void allocating(void) {
  if (stub.capturing_stream == 0) return;
  if (mode == MODE_RELAXED) stub.relaxed_during_capture++;
  else stub.forbidden_during_capture++;
}

#ifndef STUB_NO_RELAXED
CUresult cuThreadExchangeStreamCaptureMode(int* m) {
  if (*m < 0 || *m > 2) return INVALID_VALUE;
  int prev = mode;
  mode = *m;
  *m = prev;
  stub.mode_exchanges++;
  return SUCCESS;
}
#endif
/* For the test: the calling thread's capture mode. */
int stub_thread_mode(void) { return mode; }

CUresult cuInit(unsigned int flags) { return flags == 0 ? SUCCESS : INVALID_VALUE; }
CUresult cuDriverGetVersion(int* v) { *v = 13000; return SUCCESS; }
CUresult cuDeviceGetCount(int* n) { *n = DEVICES; return SUCCESS; }
CUresult cuDeviceGet(int* d, int ordinal) {
  if (ordinal < 0 || ordinal >= DEVICES) return INVALID_DEVICE;
  *d = ordinal;
  return SUCCESS;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext* c, int d) { *c = &contexts[d]; return SUCCESS; }
CUresult cuCtxGetCurrent(CUcontext* c) { *c = current; return SUCCESS; }
CUresult cuCtxSetCurrent(CUcontext c) { current = c; return SUCCESS; }

CUresult cuMemAlloc_v2(unsigned long long* p, size_t size) {
  allocating();
  if (current == 0) { stub.wrong_context++; return INVALID_CONTEXT; }
  if ((int64_t)size == stub.fail_alloc_size) return STUB_FAILURE;
  int d = current->device;
  if (stub.used[d] + (int64_t)size > stub.capacity) return OUT_OF_MEMORY;
  for (int i = 0; i < MAX_BLOCKS; ++i) {
    if (blocks[i].ptr != 0) continue;
    void* m = aligned_alloc(4096, size);
    if (m == 0) return OUT_OF_MEMORY;
    blocks[i].ptr = (uintptr_t)m;
    blocks[i].size = (int64_t)size;
    blocks[i].device = d;
    stub.used[d] += (int64_t)size;
    stub.mem_alloc++;
    *p = (unsigned long long)(uintptr_t)m;
    return SUCCESS;
  }
  return OUT_OF_MEMORY;
}

CUresult cuMemFree_v2(unsigned long long p) {
  during_capture();
  for (int i = 0; i < MAX_BLOCKS; ++i) {
    if (blocks[i].ptr != (uintptr_t)p) continue;
    if (current == 0 || current->device != blocks[i].device) stub.wrong_context++;
    stub.used[blocks[i].device] -= blocks[i].size;
    free((void*)blocks[i].ptr);
    blocks[i].ptr = 0;
    stub.mem_free++;
    return SUCCESS;
  }
  return INVALID_VALUE;
}

CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
  during_capture();
  if (current == 0) { stub.wrong_context++; return INVALID_CONTEXT; }
  *total = (size_t)stub.capacity;
  *free_bytes = (size_t)(stub.capacity - stub.used[current->device]);
  return SUCCESS;
}

CUresult cuEventCreate(CUevent* e, unsigned int flags) {
  if (current == 0) { stub.wrong_context++; return INVALID_CONTEXT; }
  *e = calloc(1, sizeof(struct Event));
  (*e)->flags = (int)flags;
  stub.event_create++;
  return SUCCESS;
}
CUresult cuEventRecord(CUevent e, CUstream s) {
  (void)s;
  during_capture();
  e->recorded = 1;
  stub.event_record++;
  return SUCCESS;
}
CUresult cuEventQuery(CUevent e) {
  during_capture();
  stub.event_query++;
  if (!e->recorded) return INVALID_VALUE;
  return stub.events_pending ? NOT_READY : SUCCESS;
}
CUresult cuEventSynchronize(CUevent e) {
  during_capture();
  stub.event_sync++;
  return e->recorded ? SUCCESS : INVALID_VALUE;
}
CUresult cuEventDestroy_v2(CUevent e) { free(e); stub.event_destroy++; return SUCCESS; }

CUresult cuStreamGetCaptureInfo(CUstream s, int* status, uint64_t* id) {
  stub.capture_queries++;
  int capturing = stub.capturing_stream != 0 && (uint64_t)(uintptr_t)s == stub.capturing_stream;
  *status = capturing ? 1 : 0;
  *id = capturing ? stub.capture_id : 0;
  return SUCCESS;
}
CUresult cuStreamIsCapturing(CUstream s, int* status) {
  uint64_t id;
  return cuStreamGetCaptureInfo(s, status, &id);
}

CUresult cuGetErrorName(CUresult r, const char** name) {
  *name = r == OUT_OF_MEMORY ? "CUDA_ERROR_OUT_OF_MEMORY"
          : r == STUB_FAILURE ? "CUDA_ERROR_STUB_FAILURE" : "CUDA_ERROR_OTHER";
  return SUCCESS;
}

/* Virtual memory management: reserved ranges are PROT_NONE host mappings,
 * a handle is a page-sized piece of a device's capacity, and mapping makes
 * the range read-write (contents are not kept across remaps). */
#define PAGE (2u << 20)
static int64_t handle_device[1 << 16];
static int next_handle = 1;

CUresult cuDeviceGetAttribute(int* value, int attribute, int device) {
  (void)device;
  *value = attribute == 102 ? stub.vmm : 0;
  return SUCCESS;
}
CUresult cuMemGetAllocationGranularity(size_t* g, const void* prop, int option) {
  (void)prop; (void)option;
  *g = PAGE;
  return SUCCESS;
}
CUresult cuMemAddressReserve(unsigned long long* p, size_t size, size_t align, unsigned long long addr,
                             unsigned long long flags) {
  (void)align; (void)addr; (void)flags;
  void* m = mmap(0, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return OUT_OF_MEMORY;
  *p = (unsigned long long)(uintptr_t)m;
  return SUCCESS;
}
CUresult cuMemAddressFree(unsigned long long p, size_t size) {
  munmap((void*)(uintptr_t)p, size);
  return SUCCESS;
}
CUresult cuMemCreate(unsigned long long* h, size_t size, const void* prop, unsigned long long flags) {
  (void)prop; (void)flags;
  allocating();
  if (current == 0) { stub.wrong_context++; return INVALID_CONTEXT; }
  int d = current->device;
  if (size != PAGE) return INVALID_VALUE;
  if (stub.used[d] + (int64_t)size > stub.capacity) return OUT_OF_MEMORY;
  if (next_handle >= (1 << 16)) return OUT_OF_MEMORY;
  stub.used[d] += (int64_t)size;
  handle_device[next_handle] = d;
  *h = (unsigned long long)next_handle++;
  stub.mem_create++;
  return SUCCESS;
}
CUresult cuMemRelease(unsigned long long h) {
  during_capture();
  stub.used[handle_device[h]] -= PAGE;
  stub.mem_release++;
  return SUCCESS;
}
CUresult cuMemMap(unsigned long long p, size_t size, size_t offset, unsigned long long h,
                  unsigned long long flags) {
  (void)offset; (void)flags;
  allocating();
  if (current == 0) { stub.wrong_context++; return INVALID_CONTEXT; }
  void* m = mmap((void*)(uintptr_t)p, size, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  if (m == MAP_FAILED) return INVALID_VALUE;
  stub.mapped[handle_device[h]] += (int64_t)size;
  stub.mem_map++;
  return SUCCESS;
}
CUresult cuMemUnmap(unsigned long long p, size_t size) {
  during_capture();
  if (current == 0) stub.wrong_context++;
  mmap((void*)(uintptr_t)p, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
       -1, 0);
  stub.mapped[current != 0 ? current->device : 0] -= (int64_t)size;
  stub.mem_unmap++;
  return SUCCESS;
}
CUresult cuMemSetAccess(unsigned long long p, size_t size, const void* desc, size_t count) {
  (void)p; (void)size; (void)desc;
  allocating();
  return count == 1 ? SUCCESS : INVALID_VALUE;
}

/* For the test: the primary context of a device, to make it current by hand. */
void* stub_context(int device) { return &contexts[device]; }
void* stub_current(void) { return current; }
