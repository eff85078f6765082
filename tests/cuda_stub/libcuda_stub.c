/* A stand-in for libcuda.so.1, so that CI without a GPU can run pyalloc's CUDA
 * backend (csrc/cuda/cuda_backend.cpp) against the driver API it uses.
 *
 * Memory is host memory. Contexts are per device and current per thread.
 * Every call that takes or gives back memory is counted (refusals too), so
 * tests can bound what pyalloc asks the driver for.
 * Streams are opaque numbers; the test marks one as capturing and counts every
 * call that CUDA's global capture mode forbids, or that pyalloc promises not to
 * make, while a capture is underway (allocating, freeing, reserving or
 * freeing address ranges, retaining a context, asking for free memory or the
 * mapping granularity, opening or closing shared memory, synchronizing,
 * recording, querying or waiting on events). As the driver does, such a call
 * in global mode fails with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and
 * invalidates the capture (its stream then reports the capture invalidated
 * until it ends). Events
 * complete at once unless the test holds them pending or makes them fail.
 *
 * Streams are numbers; a stream's device is its bits 32 and up (0x1_0000_2000
 * is a stream of device 1), stream 0 is the current context's. As in the real
 * driver, an event may be recorded only on a stream of its own context. The
 * test can also let the devices be peers (or have the driver refuse peer
 * mappings), make virtual memory calls fail as in a sandbox, and mark a
 * stream destroyed (capture queries and event records on it fail; until the
 * context is synchronized, its last work may still run).
 *
 * Memory is shared memory (memfd), so that other processes can map it: legacy
 * IPC handles name a segment by this process's id and the segment's file
 * descriptor (the receiver opens /proc/PID/fd/N); pages made with a POSIX
 * file descriptor handle type export and import that descriptor. Each
 * segment and shareable handle holds one descriptor while it lives.
 *
 * Capture modes are per thread, as in CUDA: in relaxed mode
 * (cuThreadExchangeStreamCaptureMode) allocating, mapping and reserving or
 * freeing address ranges are legal during a capture and counted apart;
 * freeing memory, unmapping and events stay counted as forbidden (pyalloc
 * promises not to make them then), though the driver lets them through in
 * relaxed mode.
 *
 * Virtual memory is checked as the driver checks it: cuMemAddressReserve
 * gives ranges aligned to the page; cuMemMap maps a whole handle at offset 0
 * at a page-aligned address inside one reserved range, never over a live
 * mapping; cuMemUnmap takes only whole mappings, cuMemAddressFree only a
 * whole reservation with nothing mapped in it; cuMemRelease of a handle still
 * mapped frees its memory only once it is unmapped. Each refusal is counted
 * (vmm_refused) besides its error.
 *
 * Work queued on a device is the test's to declare (work_queued): until a
 * cuCtxSynchronize, unmapping or closing memory opened from another process
 * is counted (unmapped_under_work), as it may pull pages from under kernels.
 * Built with -DSTUB_NO_RELAXED it lacks that entry point, like a driver
 * older than CUDA 10.1.
 *
 * test_cuda_backend_stub.py compiles it as libcuda.so.1 and reads `stub` through
 * ctypes. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/stat.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

enum { MODE_GLOBAL = 0, MODE_RELAXED = 2 };

typedef int CUresult;
typedef struct Ctx { int device; } *CUcontext;
typedef struct Event { int flags; int recorded; CUcontext ctx; } *CUevent;
typedef void* CUstream;

enum { SUCCESS = 0, OUT_OF_MEMORY = 2, INVALID_VALUE = 1, INVALID_DEVICE = 101,
       INVALID_CONTEXT = 201, ALREADY_MAPPED = 208, INVALID_HANDLE = 400, NOT_READY = 600, ILLEGAL_ADDRESS = 700,
       NOT_PERMITTED = 800, NOT_SUPPORTED = 801, CAPTURE_UNSUPPORTED = 900, STUB_FAILURE = 999 };

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
  int event_error;           /* cuEventQuery answers this (after recording) when nonzero */
  int sync_error;            /* cuEventSynchronize and cuCtxSynchronize answer this when nonzero */
  int peer_access;           /* cuDeviceCanAccessPeer: the devices are peers */
  int refuse_peers;          /* cuMemSetAccess for more than one device fails */
  int vmm_refuse;            /* cuMemCreate answers NOT_PERMITTED, as in a sandbox */
  int64_t ctx_set, event_record_errors, stream_get_ctx, capture_info_v1;
  int64_t access_count, access_mask; /* the last cuMemSetAccess: devices, bit per device */
  uint64_t destroyed_stream; /* capture queries and event records on it answer INVALID_HANDLE */
  int64_t destroyed_queries;
  int64_t mode_exchanges, relaxed_during_capture;
  int64_t mem_get_info;                        /* cuMemGetInfo calls */
  int64_t mem_alloc_refused, mem_create_refused; /* cuMemAlloc / cuMemCreate answered OUT_OF_MEMORY */
  int64_t mem_set_access, mem_address_reserve;  /* cuMemSetAccess / cuMemAddressReserve calls */
  int set_access_oom;        /* cuMemSetAccess answers OUT_OF_MEMORY (after its checks) */
  int64_t bad_handle;        /* cuMemMap or cuMemRelease of a handle released already */
  int fail_remap;            /* cuMemMap of a handle mapped before answers STUB_FAILURE */
  volatile int pause_mem_free; /* the next cuMemFree sets paused and waits until the test clears it */
  volatile int paused;
  volatile int pause_mem_get_info; /* the same for the next cuMemGetInfo */
  int64_t fail_create_size;  /* cuMemCreate of exactly this size fails with STUB_FAILURE */
  int map_oom;               /* cuMemMap answers OUT_OF_MEMORY (after its checks) */
  int64_t mem_map_refused;   /* cuMemMap answered OUT_OF_MEMORY */
  int set_access_fail;       /* cuMemSetAccess fails with STUB_FAILURE (after its checks) */
  int64_t mem_failed;        /* cuMemAlloc / cuMemCreate / cuMemMap calls failing otherwise */
  /* Sharing with other processes. */
  int64_t ipc_get, ipc_open, ipc_close, ipc_opened; /* legacy IPC calls; handles open now */
  int64_t exports, imports, imported;  /* shareable handles exported, imported; imported live */
  int refuse_fd_handles;     /* cuMemCreate asked for a POSIX fd handle answers NOT_SUPPORTED */
  int64_t fd_handles;        /* handles made with a POSIX fd handle type, live */
  int fail_ctx_set_in;       /* > 0: the cuCtxSetCurrent that brings it to 0 fails with STUB_FAILURE */
  int refuse_fd_handles_with; /* what cuMemCreate answers under refuse_fd_handles (0: NOT_SUPPORTED) */
  int64_t capture_invalidated; /* captures a forbidden call invalidated */
  int64_t vmm_refused;       /* virtual memory calls refused for their ranges (see above) */
  int64_t ctx_synchronize;   /* cuCtxSynchronize calls */
  int work_queued;           /* kernels may still use memory: until a cuCtxSynchronize */
  int64_t unmapped_under_work; /* memory opened from another process unmapped while work_queued */
  int64_t mem_address_free;  /* cuMemAddressFree calls that freed a range */
  volatile int pause_ctx_synchronize; /* the next cuCtxSynchronize pauses, as pause_mem_free */
};
struct Stub stub = {.capacity = 256 << 20};

static struct Ctx contexts[DEVICES] = {{0}, {1}};
static __thread CUcontext current = 0;
static struct { uintptr_t ptr; int64_t size; int device; int fd; uint64_t serial; } blocks[MAX_BLOCKS];
static uint64_t next_serial = 1;

static __thread int mode = MODE_GLOBAL;
static int64_t records_on[DEVICES];

/* Calls that take or give back memory come from several threads (the stress
 * checks): one at a time, as the driver keeps its own books consistent. */
static pthread_mutex_t stub_mu = PTHREAD_MUTEX_INITIALIZER;
static void stub_unlock(int* unused) { (void)unused; pthread_mutex_unlock(&stub_mu); }
#define ONE_AT_A_TIME                                                         \
  pthread_mutex_lock(&stub_mu);                                               \
  int one_at_a_time __attribute__((cleanup(stub_unlock))) = 0;                \
  (void)one_at_a_time

/* Inside a driver call, until the test clears stub.paused. */
static void wait_while_paused(void) {
  stub.paused = 1;
  while (stub.paused) usleep(1000);
}

/* The capture a forbidden call invalidated (its stream and id): its stream
 * reports it so until it ends. */
static uint64_t invalidated_stream, invalidated_id;
static int invalidated(void) {
  return stub.capturing_stream != 0 && stub.capturing_stream == invalidated_stream &&
         stub.capture_id == invalidated_id;
}
static int invalidate(void) {
  stub.forbidden_during_capture++;
  if (!invalidated()) stub.capture_invalidated++;
  invalidated_stream = stub.capturing_stream;
  invalidated_id = stub.capture_id;
  return CAPTURE_UNSUPPORTED;
}
/* Freeing, unmapping and events: forbidden during a capture, whatever the
 * mode (pyalloc's promise); the driver refuses them in global mode only.
 * SUCCESS when the call may go on. */
static int during_capture(void) {
  if (stub.capturing_stream == 0) return SUCCESS;
  if (mode == MODE_RELAXED) {
    stub.forbidden_during_capture++;
    return SUCCESS;
  }
  return invalidate();
}
/* Allocating and mapping: legal during a capture in relaxed mode only. */
static int allocating(void) {
  if (stub.capturing_stream == 0) return SUCCESS;
  if (mode != MODE_RELAXED) return invalidate();
  stub.relaxed_during_capture++;
  return SUCCESS;
}
#define CAPTURE_CHECK(call)        \
  do {                             \
    int refused_ = (call);         \
    if (refused_) return refused_; \
  } while (0)

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
CUresult cuDevicePrimaryCtxRetain(CUcontext* c, int d) {
  CAPTURE_CHECK(allocating());
  if (d < 0 || d >= DEVICES) return INVALID_DEVICE;
  *c = &contexts[d];
  return SUCCESS;
}
/* Waits for the current context's work: none is left queued. */
CUresult cuCtxSynchronize(void) {
  CAPTURE_CHECK(during_capture());
  if (current == 0) { stub.wrong_context++; return INVALID_CONTEXT; }
  stub.ctx_synchronize++;
  if (stub.pause_ctx_synchronize) {
    stub.pause_ctx_synchronize = 0;
    wait_while_paused();
  }
  if (stub.sync_error) return stub.sync_error;
  stub.work_queued = 0;
  return SUCCESS;
}
CUresult cuCtxGetCurrent(CUcontext* c) { *c = current; return SUCCESS; }
CUresult cuCtxSetCurrent(CUcontext c) {
  if (stub.fail_ctx_set_in > 0 && --stub.fail_ctx_set_in == 0) return STUB_FAILURE;
  current = c;
  stub.ctx_set++;
  return SUCCESS;
}

static int stream_device(CUstream s) {
  uint64_t d = (uint64_t)(uintptr_t)s >> 32;
  if (s == 0) return current != 0 ? current->device : -1;
  return d < DEVICES ? (int)d : -1;
}
CUresult cuStreamGetCtx(CUstream s, CUcontext* c) {
  stub.stream_get_ctx++;
  int d = stream_device(s);
  if (d < 0) return INVALID_HANDLE;
  *c = &contexts[d];
  return SUCCESS;
}
CUresult cuDeviceCanAccessPeer(int* can, int device, int peer) {
  if (device < 0 || device >= DEVICES || peer < 0 || peer >= DEVICES) return INVALID_DEVICE;
  *can = device != peer && stub.peer_access;
  return SUCCESS;
}
CUresult cuDeviceTotalMem_v2(size_t* bytes, int device) {
  if (device < 0 || device >= DEVICES) return INVALID_DEVICE;
  *bytes = (size_t)stub.capacity;
  return SUCCESS;
}
CUresult cuDeviceGetName(char* name, int len, int device) {
  if (device < 0 || device >= DEVICES || len < 1) return INVALID_VALUE;
  strncpy(name, "pyalloc stand-in device", (size_t)len - 1);
  name[len - 1] = 0;
  return SUCCESS;
}

CUresult cuMemAlloc_v2(unsigned long long* p, size_t size) {
  ONE_AT_A_TIME;
  CAPTURE_CHECK(allocating());
  if (current == 0) { stub.wrong_context++; return INVALID_CONTEXT; }
  if ((int64_t)size == stub.fail_alloc_size) { stub.mem_failed++; return STUB_FAILURE; }
  int d = current->device;
  if (stub.used[d] + (int64_t)size > stub.capacity) { stub.mem_alloc_refused++; return OUT_OF_MEMORY; }
  for (int i = 0; i < MAX_BLOCKS; ++i) {
    if (blocks[i].ptr != 0) continue;
    int fd = memfd_create("stub-segment", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) { if (fd >= 0) close(fd); return OUT_OF_MEMORY; }
    void* m = mmap(0, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) { close(fd); return OUT_OF_MEMORY; }
    blocks[i].fd = fd;
    blocks[i].serial = next_serial++;
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
  if (stub.pause_mem_free) {
    stub.pause_mem_free = 0;
    wait_while_paused();
  }
  ONE_AT_A_TIME;
  CAPTURE_CHECK(during_capture());
  for (int i = 0; i < MAX_BLOCKS; ++i) {
    if (blocks[i].ptr != (uintptr_t)p) continue;
    if (current == 0 || current->device != blocks[i].device) stub.wrong_context++;
    stub.used[blocks[i].device] -= blocks[i].size;
    munmap((void*)blocks[i].ptr, (size_t)blocks[i].size);
    close(blocks[i].fd);
    blocks[i].ptr = 0;
    stub.mem_free++;
    return SUCCESS;
  }
  return INVALID_VALUE;
}

CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
  if (stub.pause_mem_get_info) {
    stub.pause_mem_get_info = 0;
    wait_while_paused();
  }
  ONE_AT_A_TIME;
  CAPTURE_CHECK(during_capture());
  stub.mem_get_info++;
  if (current == 0) { stub.wrong_context++; return INVALID_CONTEXT; }
  *total = (size_t)stub.capacity;
  *free_bytes = (size_t)(stub.capacity - stub.used[current->device]);
  return SUCCESS;
}

CUresult cuEventCreate(CUevent* e, unsigned int flags) {
  if (current == 0) { stub.wrong_context++; return INVALID_CONTEXT; }
  *e = calloc(1, sizeof(struct Event));
  (*e)->flags = (int)flags;
  (*e)->ctx = current;
  stub.event_create++;
  return SUCCESS;
}
CUresult cuEventRecord(CUevent e, CUstream s) {
  CAPTURE_CHECK(during_capture());
  if (stub.destroyed_stream != 0 && (uint64_t)(uintptr_t)s == stub.destroyed_stream) {
    stub.event_record_errors++;
    return INVALID_HANDLE;
  }
  int d = stream_device(s);
  if (d < 0 || &contexts[d] != e->ctx) { stub.event_record_errors++; return INVALID_HANDLE; }
  e->recorded = 1;
  stub.event_record++;
  records_on[d]++;
  return SUCCESS;
}
/* Events recorded on device's streams, for the checks of the device an event goes to. */
int64_t stub_event_records_on(int device) { return records_on[device]; }
CUresult cuEventQuery(CUevent e) {
  CAPTURE_CHECK(during_capture());
  stub.event_query++;
  if (!e->recorded) return INVALID_VALUE;
  if (stub.event_error) return stub.event_error;
  return stub.events_pending ? NOT_READY : SUCCESS;
}
CUresult cuEventSynchronize(CUevent e) {
  CAPTURE_CHECK(during_capture());
  stub.event_sync++;
  if (stub.sync_error) return stub.sync_error;
  return e->recorded ? SUCCESS : INVALID_VALUE;
}
CUresult cuEventDestroy_v2(CUevent e) { free(e); stub.event_destroy++; return SUCCESS; }

/* The CUDA 11.3 ABI, which pyalloc uses; CUDA 13's headers map the plain
 * name to a seven-argument _v3. */
CUresult cuStreamGetCaptureInfo_v2(CUstream s, int* status, uint64_t* id, void** graph,
                                   const void** deps, size_t* num_deps) {
  stub.capture_queries++;
  if (stub.destroyed_stream != 0 && (uint64_t)(uintptr_t)s == stub.destroyed_stream) {
    stub.destroyed_queries++;
    return INVALID_HANDLE;
  }
  int capturing = stub.capturing_stream != 0 && (uint64_t)(uintptr_t)s == stub.capturing_stream;
  *status = capturing && invalidated() ? 2 : capturing ? 1 : 0;
  if (id != 0) *id = capturing ? stub.capture_id : 0;
  if (graph != 0) *graph = 0;
  if (deps != 0) *deps = 0;
  if (num_deps != 0) *num_deps = 0;
  return SUCCESS;
}
/* The CUDA 10.1 ABI under the plain name: counted, so that a test sees it unused. */
CUresult cuStreamGetCaptureInfo(CUstream s, int* status, uint64_t* id) {
  stub.capture_info_v1++;
  return cuStreamGetCaptureInfo_v2(s, status, id, 0, 0, 0);
}
CUresult cuStreamIsCapturing(CUstream s, int* status) {
  return cuStreamGetCaptureInfo_v2(s, status, 0, 0, 0, 0);
}

CUresult cuGetErrorName(CUresult r, const char** name) {
  *name = r == OUT_OF_MEMORY ? "CUDA_ERROR_OUT_OF_MEMORY"
          : r == STUB_FAILURE ? "CUDA_ERROR_STUB_FAILURE"
          : r == INVALID_HANDLE ? "CUDA_ERROR_INVALID_HANDLE"
          : r == ILLEGAL_ADDRESS ? "CUDA_ERROR_ILLEGAL_ADDRESS"
          : r == NOT_PERMITTED ? "CUDA_ERROR_NOT_PERMITTED"
          : r == NOT_SUPPORTED ? "CUDA_ERROR_NOT_SUPPORTED"
          : r == CAPTURE_UNSUPPORTED ? "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED" : "CUDA_ERROR_OTHER";
  return SUCCESS;
}

/* Virtual memory management: reserved ranges are PROT_NONE host mappings,
 * a handle is a piece of a device's capacity (a multiple of the page), and
 * mapping makes the range read-write (contents are not kept across remaps). */
#define PAGE (2u << 20)
static int64_t handle_device[1 << 16], handle_size[1 << 16];
/* Where each handle is mapped (0: nowhere): the stand-in maps a handle once at a time. */
static unsigned long long handle_at[1 << 16];
static char handle_released[1 << 16], handle_was_mapped[1 << 16];
/* A handle made shareable (or imported): its memfd, else -1 (set at creation). */
static int handle_fd[1 << 16];
static char handle_imported[1 << 16];
static char handle_accessible[1 << 16]; /* cuMemSetAccess covered it since it was mapped */
static int next_handle = 1;
/* The ranges cuMemAddressReserve gave (size 0: a free slot). */
#define MAX_RESERVED 4096
static struct { unsigned long long ptr; size_t size; } reserved[MAX_RESERVED];

static int vmm_refuse(int r) {
  stub.vmm_refused++;
  return r;
}
/* The reservation holding [p, p + size) whole, or -1. */
static int reservation_of(unsigned long long p, size_t size) {
  for (int i = 0; i < MAX_RESERVED; ++i)
    if (reserved[i].size != 0 && p >= reserved[i].ptr && p + size <= reserved[i].ptr + reserved[i].size) return i;
  return -1;
}
/* Whether some handle is mapped over any byte of [p, p + size). */
static int mapped_over(unsigned long long p, size_t size) {
  for (int h = 1; h < next_handle; ++h)
    if (handle_at[h] != 0 && handle_at[h] < p + size && handle_at[h] + (unsigned long long)handle_size[h] > p)
      return 1;
  return 0;
}
/* A handle's memory goes back: at cuMemRelease, or at its unmap if released mapped. */
static void free_handle(unsigned long long h) {
  if (handle_fd[h] >= 0) {
    close(handle_fd[h]);
    handle_fd[h] = -1;
    if (!handle_imported[h]) stub.fd_handles--;
  }
  if (handle_imported[h]) stub.imported--;
  else stub.used[handle_device[h]] -= handle_size[h];
}

CUresult cuDeviceGetAttribute(int* value, int attribute, int device) {
  (void)device;
  *value = attribute == 102 ? stub.vmm : 0;
  return SUCCESS;
}
CUresult cuMemGetAllocationGranularity(size_t* g, const void* prop, int option) {
  (void)prop; (void)option;
  CAPTURE_CHECK(allocating());
  *g = PAGE;
  return SUCCESS;
}
CUresult cuMemAddressReserve(unsigned long long* p, size_t size, size_t align, unsigned long long addr,
                             unsigned long long flags) {
  ONE_AT_A_TIME;
  (void)align; (void)addr; (void)flags;
  CAPTURE_CHECK(allocating());
  stub.mem_address_reserve++;
  if (size == 0 || size % PAGE != 0) return vmm_refuse(INVALID_VALUE);
  int slot = -1;
  for (int i = 0; i < MAX_RESERVED && slot < 0; ++i)
    if (reserved[i].size == 0) slot = i;
  if (slot < 0) return OUT_OF_MEMORY;
  /* Aligned to the page, as the driver's: a page more, trimmed at both ends. */
  char* m = mmap(0, size + PAGE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return OUT_OF_MEMORY;
  uintptr_t base = ((uintptr_t)m + PAGE - 1) & ~(uintptr_t)(PAGE - 1);
  if (base > (uintptr_t)m) munmap(m, base - (uintptr_t)m);
  if ((uintptr_t)m + size + PAGE > base + size) munmap((void*)(base + size), (uintptr_t)m + size + PAGE - base - size);
  reserved[slot].ptr = base;
  reserved[slot].size = size;
  *p = (unsigned long long)base;
  return SUCCESS;
}
CUresult cuMemAddressFree(unsigned long long p, size_t size) {
  ONE_AT_A_TIME;
  CAPTURE_CHECK(allocating());
  /* Only a whole reservation, with nothing mapped in it. */
  int i = reservation_of(p, size);
  if (i < 0 || reserved[i].ptr != p || reserved[i].size != size) return vmm_refuse(INVALID_VALUE);
  if (mapped_over(p, size)) return vmm_refuse(INVALID_VALUE);
  munmap((void*)(uintptr_t)p, size);
  reserved[i].size = 0;
  stub.mem_address_free++;
  return SUCCESS;
}
struct AllocationProp { int type; int requested_handle_types; };
CUresult cuMemCreate(unsigned long long* h, size_t size, const void* prop, unsigned long long flags) {
  ONE_AT_A_TIME;
  (void)flags;
  int want_fd = (((const struct AllocationProp*)prop)->requested_handle_types & 1) != 0;
  CAPTURE_CHECK(allocating());
  if (current == 0) { stub.wrong_context++; return INVALID_CONTEXT; }
  if (stub.vmm_refuse) { stub.mem_failed++; return NOT_PERMITTED; }
  int d = current->device;
  if (size == 0 || size % PAGE != 0) { stub.mem_failed++; return INVALID_VALUE; }
  if ((int64_t)size == stub.fail_create_size) { stub.mem_failed++; return STUB_FAILURE; }
  if (stub.used[d] + (int64_t)size > stub.capacity) { stub.mem_create_refused++; return OUT_OF_MEMORY; }
  if (want_fd && stub.refuse_fd_handles) {
    stub.mem_failed++;
    return stub.refuse_fd_handles_with != 0 ? stub.refuse_fd_handles_with : NOT_SUPPORTED;
  }
  if (next_handle >= (1 << 16)) return OUT_OF_MEMORY;
  handle_fd[next_handle] = -1;
  if (want_fd) {
    int fd = memfd_create("stub-pages", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) { if (fd >= 0) close(fd); return OUT_OF_MEMORY; }
    handle_fd[next_handle] = fd;
    stub.fd_handles++;
  }
  stub.used[d] += (int64_t)size;
  handle_device[next_handle] = d;
  handle_size[next_handle] = (int64_t)size;
  *h = (unsigned long long)next_handle++;
  stub.mem_create++;
  return SUCCESS;
}
CUresult cuMemRelease(unsigned long long h) {
  ONE_AT_A_TIME;
  CAPTURE_CHECK(during_capture());
  if (h == 0 || h >= (unsigned long long)next_handle || handle_released[h]) { stub.bad_handle++; return INVALID_VALUE; }
  handle_released[h] = 1;
  /* Mapped still: the memory goes back when it is unmapped, as the driver does it. */
  if (handle_at[h] == 0) free_handle(h);
  stub.mem_release++;
  return SUCCESS;
}
CUresult cuMemMap(unsigned long long p, size_t size, size_t offset, unsigned long long h,
                  unsigned long long flags) {
  ONE_AT_A_TIME;
  (void)flags;
  CAPTURE_CHECK(allocating());
  if (current == 0) { stub.wrong_context++; return INVALID_CONTEXT; }
  if (h == 0 || h >= (unsigned long long)next_handle || (int64_t)size != handle_size[h]) {
    stub.mem_failed++;
    return INVALID_VALUE;
  }
  if (handle_released[h]) { stub.bad_handle++; return INVALID_HANDLE; }
  /* A whole handle, at a page inside one reservation, over nothing mapped. */
  if (offset != 0 || p % PAGE != 0 || reservation_of(p, size) < 0 || mapped_over(p, size))
    return vmm_refuse(INVALID_VALUE);
  if (handle_at[h] != 0) return vmm_refuse(STUB_FAILURE); /* mapped elsewhere: not modelled */
  if (stub.fail_remap && handle_was_mapped[h]) { stub.mem_failed++; return STUB_FAILURE; }
  if (stub.map_oom) { stub.mem_map_refused++; return OUT_OF_MEMORY; }
  /* No access until cuMemSetAccess, as on a device. */
  void* m = handle_fd[h] >= 0
                ? mmap((void*)(uintptr_t)p, size, PROT_NONE, MAP_SHARED | MAP_FIXED, handle_fd[h], 0)
                : mmap((void*)(uintptr_t)p, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  if (m == MAP_FAILED) return INVALID_VALUE;
  handle_at[h] = p;
  handle_was_mapped[h] = 1;
  if (!handle_imported[h]) stub.mapped[handle_device[h]] += (int64_t)size;
  stub.mem_map++;
  return SUCCESS;
}
CUresult cuMemUnmap(unsigned long long p, size_t size) {
  ONE_AT_A_TIME;
  CAPTURE_CHECK(during_capture());
  if (current == 0) stub.wrong_context++;
  /* Whole mappings only, covering the range with no gap. */
  int64_t covered = 0;
  for (int h = 1; h < next_handle; ++h) {
    if (handle_at[h] == 0 || handle_at[h] >= p + size || handle_at[h] + (unsigned long long)handle_size[h] <= p)
      continue;
    if (handle_at[h] < p || handle_at[h] + (unsigned long long)handle_size[h] > p + size)
      return vmm_refuse(INVALID_VALUE);
    covered += handle_size[h];
  }
  if (size == 0 || covered != (int64_t)size) return vmm_refuse(INVALID_VALUE);
  mmap((void*)(uintptr_t)p, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
       -1, 0);
  stub.mem_unmap++;
  for (int h = 1; h < next_handle; ++h) {
    if (handle_at[h] < p || handle_at[h] >= p + size) continue;
    if (handle_imported[h] && stub.work_queued) stub.unmapped_under_work++;
    if (!handle_imported[h]) stub.mapped[handle_device[h]] -= handle_size[h];
    handle_at[h] = 0;
    handle_accessible[h] = 0;
    if (handle_released[h]) free_handle(h);
  }
  return SUCCESS;
}
struct AccessDesc { int type; int id; int flags; };
CUresult cuMemSetAccess(unsigned long long p, size_t size, const void* desc, size_t count) {
  ONE_AT_A_TIME;
  CAPTURE_CHECK(allocating());
  stub.mem_set_access++;
  /* The range must be mapped whole, by handles lying inside it. */
  int64_t covered = 0;
  for (int h = 1; h < next_handle; ++h) {
    if (handle_at[h] == 0 || handle_at[h] + (unsigned long long)handle_size[h] <= p ||
        handle_at[h] >= p + size)
      continue;
    if (handle_at[h] < p || handle_at[h] + (unsigned long long)handle_size[h] > p + size) return INVALID_VALUE;
    covered += handle_size[h];
  }
  if (size == 0 || covered != (int64_t)size) return INVALID_VALUE;
  const struct AccessDesc* a = desc;
  if (count < 1 || count > DEVICES) return INVALID_VALUE;
  if (count > 1 && stub.refuse_peers) return NOT_SUPPORTED;
  int64_t mask = 0;
  for (size_t i = 0; i < count; ++i) {
    if (a[i].type != 1 || a[i].id < 0 || a[i].id >= DEVICES || a[i].flags != 3) return INVALID_VALUE;
    if (a[i].id != a[0].id && !stub.peer_access) return INVALID_VALUE;
    mask |= (int64_t)1 << a[i].id;
  }
  if (stub.set_access_oom) return OUT_OF_MEMORY;
  if (stub.set_access_fail) return STUB_FAILURE;
  stub.access_count = (int64_t)count;
  stub.access_mask = mask;
  for (int h = 1; h < next_handle; ++h)
    if (handle_at[h] >= p && handle_at[h] < p + size) handle_accessible[h] = 1;
  mprotect((void*)(uintptr_t)p, size, PROT_READ | PROT_WRITE);
  return SUCCESS;
}

/* Shareable handles: a handle's memfd, duplicated. */
CUresult cuMemExportToShareableHandle(void* out, unsigned long long h, int type, unsigned long long flags) {
  ONE_AT_A_TIME;
  (void)flags;
  if (type != 1 || h == 0 || h >= (unsigned long long)next_handle || handle_released[h]) return INVALID_VALUE;
  if (handle_fd[h] < 0) return NOT_PERMITTED; /* not made with a POSIX fd handle type */
  int fd = fcntl(handle_fd[h], F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return OUT_OF_MEMORY;
  *(int*)out = fd;
  stub.exports++;
  return SUCCESS;
}
CUresult cuMemImportFromShareableHandle(unsigned long long* h, void* shareable, int type) {
  ONE_AT_A_TIME;
  CAPTURE_CHECK(allocating());
  if (type != 1) return INVALID_VALUE;
  if (current == 0) { stub.wrong_context++; return INVALID_CONTEXT; }
  int given = (int)(intptr_t)shareable;
  struct stat st;
  if (fstat(given, &st) != 0) return INVALID_VALUE;
  if (next_handle >= (1 << 16)) return OUT_OF_MEMORY;
  int fd = fcntl(given, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return OUT_OF_MEMORY;
  handle_fd[next_handle] = fd;
  handle_imported[next_handle] = 1;
  handle_device[next_handle] = current->device;
  handle_size[next_handle] = (int64_t)st.st_size;
  *h = (unsigned long long)next_handle++;
  stub.imports++;
  stub.imported++;
  return SUCCESS;
}

/* Legacy IPC: a segment named by its process, its descriptor and a serial
 * (a new segment at the same address has a new handle, as in CUDA). */
struct IpcHandle { char magic[8]; int32_t pid; int32_t fd; int64_t size; uint64_t serial; char pad[32]; };
typedef struct { char reserved[64]; } CUipcMemHandle;
#define MAX_OPENED 256
static struct { uintptr_t ptr; int64_t size; int32_t pid; uint64_t serial; } opened[MAX_OPENED];

CUresult cuIpcGetMemHandle(CUipcMemHandle* out, unsigned long long p) {
  ONE_AT_A_TIME;
  stub.ipc_get++;
  for (int i = 0; i < MAX_BLOCKS; ++i) {
    if (blocks[i].ptr != (uintptr_t)p) continue;
    struct IpcHandle h;
    memset(&h, 0, sizeof(h));
    memcpy(h.magic, "STUBIPC1", 8);
    h.pid = (int32_t)getpid();
    h.fd = blocks[i].fd;
    h.size = blocks[i].size;
    h.serial = blocks[i].serial;
    memcpy(out, &h, sizeof(h));
    return SUCCESS;
  }
  return INVALID_VALUE; /* not the base of a cuMemAlloc allocation */
}
CUresult cuIpcOpenMemHandle_v2(unsigned long long* p, CUipcMemHandle handle, unsigned int flags) {
  ONE_AT_A_TIME;
  CAPTURE_CHECK(allocating());
  struct IpcHandle h;
  memcpy(&h, &handle, sizeof(h));
  if (current == 0) { stub.wrong_context++; return INVALID_CONTEXT; }
  if (memcmp(h.magic, "STUBIPC1", 8) != 0 || flags != 1) return INVALID_VALUE;
  if (h.pid == (int32_t)getpid()) return INVALID_CONTEXT; /* never in the exporting process */
  int slot = -1;
  for (int i = 0; i < MAX_OPENED; ++i) {
    if (opened[i].ptr != 0 && opened[i].pid == h.pid && opened[i].serial == h.serial) return ALREADY_MAPPED;
    if (opened[i].ptr == 0 && slot < 0) slot = i;
  }
  if (slot < 0) return OUT_OF_MEMORY;
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/fd/%d", h.pid, h.fd);
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) return INVALID_VALUE;
  void* m = mmap(0, (size_t)h.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED) return INVALID_VALUE;
  opened[slot].ptr = (uintptr_t)m;
  opened[slot].size = h.size;
  opened[slot].pid = h.pid;
  opened[slot].serial = h.serial;
  *p = (unsigned long long)(uintptr_t)m;
  stub.ipc_open++;
  stub.ipc_opened++;
  return SUCCESS;
}
CUresult cuIpcCloseMemHandle(unsigned long long p) {
  ONE_AT_A_TIME;
  CAPTURE_CHECK(during_capture());
  for (int i = 0; i < MAX_OPENED; ++i) {
    if (opened[i].ptr != (uintptr_t)p) continue;
    if (stub.work_queued) stub.unmapped_under_work++;
    munmap((void*)opened[i].ptr, (size_t)opened[i].size);
    opened[i].ptr = 0;
    stub.ipc_close++;
    stub.ipc_opened--;
    return SUCCESS;
  }
  return INVALID_VALUE;
}

/* For the test: whether [p, p + size) is a live cuMemAlloc segment, or one
 * handle mapped there and made accessible. */
int stub_usable(unsigned long long p, size_t size) {
  ONE_AT_A_TIME;
  for (int i = 0; i < MAX_BLOCKS; ++i)
    if (blocks[i].ptr == (uintptr_t)p) return blocks[i].size == (int64_t)size;
  for (int h = 1; h < next_handle; ++h)
    if (handle_at[h] == p) return handle_size[h] == (int64_t)size && handle_accessible[h];
  return 0;
}

/* For the test: the primary context of a device, to make it current by hand. */
void* stub_context(int device) { return &contexts[device]; }
void* stub_current(void) { return current; }
