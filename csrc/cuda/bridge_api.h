/* pyalloc's C interface to its CUDA pools, for the bridge (csrc/torch_bridge/).
 *
 * The bridge is a C++ subclass of PyTorch's allocator interface, built later
 * against the installed torch, perhaps by another compiler with another C++
 * ABI. So the two libraries meet only here: plain C types and functions,
 * no exception crossing, no C++ object changing hands. The bridge finds this
 * table with dlsym(handle of pyalloc._C, "pyalloc_bridge_api_get") and calls it,
 * so there is still one set of pools per device in the process, shared with
 * pyalloc's Python API.
 *
 * Versioning: pyalloc_bridge_api(version) returns the table of that version
 * or NULL if this library does not offer it. A table starts with its version
 * and size; later versions only append members (to the table and to the
 * structs pyalloc fills), so a bridge built for an older version keeps
 * working with a newer pyalloc. Version 2 appended record_stream_owned,
 * block_context and pyalloc_oom_info.rejected.
 *
 * Errors: every function returning int returns PYALLOC_OK or an error code;
 * last_error() then gives the message, per thread, until the next call on
 * that thread. Functions the bridge calls from PyTorch's deleters and
 * destructors (free, end/release of graph pools) never fail silently: they
 * return the error for the bridge to report.
 *
 * Context tags: an opaque 64-bit value the bridge passes with malloc / free
 * (0: none). The pools keep it on the block and on history entries, and give
 * it back in snapshots and histories; the bridge maps it to PyTorch's
 * recorded stack traces, which never cross this interface. */
#ifndef PYALLOC_BRIDGE_API_H
#define PYALLOC_BRIDGE_API_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PYALLOC_BRIDGE_API_VERSION 2

enum pyalloc_status {
  PYALLOC_OK = 0,
  PYALLOC_OUT_OF_MEMORY = 1, /* the message begins "CUDA out of memory." */
  PYALLOC_INVALID = 2,       /* a bad pointer, device or argument */
  PYALLOC_ERROR = 3          /* anything else (the driver, a failed event) */
};

/* Figures for PyTorch's out-of-memory observers. */
typedef struct pyalloc_oom_info {
  uint64_t requested;    /* bytes asked for */
  uint64_t allocated;    /* bytes allocated on the device by pyalloc */
  uint64_t reserved;     /* bytes reserved on the device by pyalloc */
  uint64_t device_free;  /* the driver's free bytes (0 when unknown) */
  uint64_t device_total; /* the device's memory (0 when unknown) */
  /* Version 2: refused at once, before anything was tried, from figures
   * already known (the memory fraction's cap, the device's free memory, a
   * size no device holds): what PyTorch calls an OOM rejection, counted in
   * num_oom_rejections. */
  int rejected;
} pyalloc_oom_info;

/* What a PyTorch storage's deleter says of its memory (record_stream_owned). */
enum pyalloc_owner {
  PYALLOC_OWNER_POOLS = 0, /* the bridge's deleter: a block pyalloc handed out */
  PYALLOC_OWNER_NONE = 1,  /* it owns nothing (c10::detail::deleteNothing: the
                              outputs of CUDA-graph trees, from_blob) */
  PYALLOC_OWNER_OTHER = 2  /* another deleter (DLPack: pyalloc.reserve_buffer's
                              tensors, other libraries' memory) */
};

typedef struct pyalloc_stat {
  int64_t current, peak, allocated, freed;
} pyalloc_stat;

typedef struct pyalloc_stat_array {
  pyalloc_stat all, small_pool, large_pool;
} pyalloc_stat_array;

/* torch.cuda.memory_stats() of one device, every pool of it together. */
typedef struct pyalloc_device_stats {
  pyalloc_stat_array allocation, segment, active, inactive_split;
  pyalloc_stat_array allocated_bytes, reserved_bytes, active_bytes, inactive_split_bytes,
      requested_bytes;
  pyalloc_stat oversize_allocations, oversize_segments;
  int64_t num_alloc_retries, num_ooms, num_sync_all_streams, num_device_alloc,
      num_device_free, num_oom_rejections, max_split_size;
} pyalloc_device_stats;

/* One block of a snapshot segment; blocks tile their segment in order. */
typedef struct pyalloc_block_info {
  uint64_t size;
  uint64_t requested_size;
  int allocated; /* handed out and not freed */
  int active;    /* allocated, or freed but waiting on streams */
  uint64_t context;
} pyalloc_block_info;

typedef struct pyalloc_segment_info {
  int device;
  uint64_t address;
  uint64_t total_size;
  uint64_t allocated_size;
  uint64_t active_size;
  uint64_t requested_size;
  void* stream;
  int is_large;      /* 0: a chunk of the small pool */
  int is_expandable; /* a mapped run of a virtual range */
  uint64_t pool_id[2];
  /* Appended (read it only where segment_info_size covers it): PyTorch's
   * registration_counter, the order in which the process mapped the memory
   * the segment starts in (a segment; vmm: a handle of pages), which
   * ProcessGroupNCCL's registerMemPool sorts by; -1 if unknown. */
  int64_t registration_counter;
} pyalloc_segment_info;

enum pyalloc_trace_action {
  PYALLOC_TRACE_ALLOC = 0,
  PYALLOC_TRACE_FREE_REQUESTED = 1,
  PYALLOC_TRACE_FREE_COMPLETED = 2,
  PYALLOC_TRACE_SEGMENT_ALLOC = 3,
  PYALLOC_TRACE_SEGMENT_FREE = 4,
  PYALLOC_TRACE_SEGMENT_MAP = 5,
  PYALLOC_TRACE_SEGMENT_UNMAP = 6,
  PYALLOC_TRACE_OOM = 7 /* addr: the device's free bytes */
};

typedef struct pyalloc_trace_entry {
  int action;
  uint64_t addr;
  uint64_t size;
  void* stream;
  int64_t time_us; /* microseconds since the Unix epoch */
  uint64_t context;
  uint64_t pool_id[2];
} pyalloc_trace_entry;

/* What PyTorch's profiler hears of an allocation or a free
 * (c10::reportMemoryUsageToProfiler): memory_usage's answer. */
typedef struct pyalloc_memory_usage {
  int device;         /* the allocation's device, else the device asked about, else -1 */
  uint64_t size;      /* the live allocation's bytes as allocated_bytes counts them (0: none) */
  uint64_t allocated; /* the device's allocated_bytes.all.current */
  uint64_t reserved;  /* the device's reserved_bytes.all.current */
} pyalloc_memory_usage;

/* A live allocation of a private pool: a checkpoint is a list of these. */
typedef struct pyalloc_live_block {
  uint64_t ptr;
  uint64_t size; /* as requested */
  void* stream;
} pyalloc_live_block;

typedef void (*pyalloc_segment_fn)(void* user, const pyalloc_segment_info* segment,
                                   const pyalloc_block_info* blocks, size_t num_blocks);
typedef void (*pyalloc_trace_fn)(void* user, const pyalloc_trace_entry* entry);
typedef void (*pyalloc_value_fn)(void* user, uint64_t value);
typedef void (*pyalloc_live_block_fn)(void* user, const pyalloc_live_block* block);
typedef void (*pyalloc_pool_stat_fn)(void* user, uint64_t id0, uint64_t id1,
                                     const pyalloc_stat_array* reserved);
/* A unit of memory (a segment, a handle of pages) the driver mapped and
 * made usable (mapped 1), or is about to unmap (mapped 0): see
 * csrc/cuda/segment_watch.h. Called with a pool's lock held. */
typedef void (*pyalloc_segment_event_fn)(void* user, int device, int mapped, uint64_t addr,
                                         uint64_t size, const uint64_t* pool_id);
/* A MemPool's own allocator: PYALLOC_OK with *out its memory, or NULL when
 * out of memory; any other status is an error. free takes back what alloc
 * gave. Called with the pool's lock held, on the allocating thread. */
typedef int (*pyalloc_source_alloc_fn)(void* user, int device, uint64_t size, void** out);
typedef void (*pyalloc_source_free_fn)(void* user, int device, void* ptr, uint64_t size);
/* Returns nonzero if the stream's allocations go to the pool. */
typedef int (*pyalloc_stream_filter_fn)(void* user, void* stream);
/* Frees memory held outside pyalloc's pools: nonzero when it freed some. */
typedef int (*pyalloc_free_memory_fn)(void* user);

typedef struct pyalloc_bridge_api {
  uint32_t version; /* PYALLOC_BRIDGE_API_VERSION of this table */
  uint32_t size;    /* sizeof(pyalloc_bridge_api) of this table */
  const char* pyalloc_version;

  const char* (*last_error)(void);

  /* Allocation. malloc of size 0 gives NULL. On PYALLOC_OUT_OF_MEMORY,
   * *oom (if not NULL) is filled and the pools are as they were; a request
   * no device could hold (above 2^56 bytes) is out of memory too, as it is
   * for PyTorch's allocator. free finds the device from the pointer. */
  int (*malloc)(int device, uint64_t size, void* stream, uint64_t context, void** out,
                pyalloc_oom_info* oom);
  int (*free)(void* ptr, uint64_t context);
  int (*record_stream)(void* ptr, void* stream);
  /* PyTorch's getBaseAllocation: the driver's allocations the block holding
   * ptr lies in (strategy bestfit: its segment; vmm: the handles of pages
   * under the block, mapped while it is not free, where PyTorch refuses the
   * call for its expandable segments), or ptr itself and *size 0 if pyalloc
   * has none there (unmapped pages of a virtual range included). */
  void* (*base_alloc)(void* ptr, uint64_t* size);

  /* Cache and limits. device -1: every device whose pools exist. */
  int (*empty_cache)(int device);
  int (*set_memory_fraction)(int device, double fraction);
  int (*memory_fraction)(int device, double* out);
  /* The largest block the device could serve now: its largest free block,
   * or the free memory of the device within the pool's cap if larger. */
  int (*cache_info)(int device, uint64_t* largest);

  /* Statistics (zeros for a device without pools). */
  int (*device_stats)(int device, pyalloc_device_stats* out);
  int (*reset_peak_stats)(int device);
  int (*reset_accumulated_stats)(int device);
  /* fn for each private pool's reserved bytes (PyTorch's
   * reserved_bytes_by_private_pools): pools that exist, and those released
   * since the last reset of peaks (current 0). */
  int (*pool_reserved)(int device, pyalloc_pool_stat_fn fn, void* user);

  /* Snapshots: fn once per segment of the device's pools (device -1: every
   * device); with pool_id not NULL, only that pool's segments. */
  int (*snapshot)(int device, const uint64_t* pool_id, pyalloc_segment_fn fn, void* user);
  /* The device's recorded history, oldest first. */
  int (*history)(int device, pyalloc_trace_fn fn, void* user);
  /* Every pool, present and future: record the last max_entries events or
   * stop (enabled 0); clear forgets what was recorded. */
  int (*record_history)(int enabled, uint64_t max_entries, int clear);
  /* fn for each context tag a live block or a history entry still holds. */
  int (*contexts_in_use)(pyalloc_value_fn fn, void* user);

  /* PyTorch's private pools (CUDA graphs, torch.cuda.MemPool). As in
   * PyTorch's allocator, a pool has one route at a time: a begin into a pool
   * already being recorded to is PYALLOC_INVALID ("already recording to
   * mempool_id"), and an end ends the pool's route. Where several routes
   * accept a stream, the newest wins. The filter and its user pointer must
   * stay valid until end_allocate_to_pool; once a begin or end of a pool has
   * returned, the filters of the pool's earlier routes (a route of a failed
   * capture, healed and never ended) may be dropped. A device's pool that
   * does not exist makes pool_use_count and pool_live_blocks
   * PYALLOC_INVALID ("Could not find pool of id"), as PyTorch raises. */
  int (*begin_allocate_to_pool)(int device, uint64_t id0, uint64_t id1,
                                pyalloc_stream_filter_fn filter, void* user);
  int (*end_allocate_to_pool)(int device, uint64_t id0, uint64_t id1);
  int (*release_pool)(int device, uint64_t id0, uint64_t id1);
  int (*create_or_incref_pool)(int device, uint64_t id0, uint64_t id1);
  int (*pool_use_count)(int device, uint64_t id0, uint64_t id1, int* out);
  /* fn for the address of each live allocation of the pool. */
  int (*pool_live_blocks)(int device, uint64_t id0, uint64_t id1, pyalloc_value_fn fn,
                          void* user);
  /* Checkpoints (torch.compile's CUDA-graph trees): fn for each live
   * allocation of the pool; and making exactly `blocks` live again, the
   * others freed and the missing ones allocated at their addresses. As
   * PyTorch's allocator reports it, freed_fn is called for every allocation
   * live before and allocated_fn for every one of `blocks`: a block live
   * both before and after is in both (PyTorch then gives its storage a
   * deleter again). A restore that cannot be made (INVALID, with the reason:
   * a block's memory not free, or held by a block it drops that a stream
   * named by record_stream may still use) leaves every live block as it was. */
  int (*pool_checkpoint)(int device, uint64_t id0, uint64_t id1, pyalloc_live_block_fn fn,
                         void* user);
  int (*pool_restore)(int device, uint64_t id0, uint64_t id1, const pyalloc_live_block* blocks,
                      uint64_t num_blocks, pyalloc_value_fn freed_fn, pyalloc_value_fn allocated_fn,
                      void* user);

  /* PyTorch's init(device_count); the route now in use (0: none, 1: hooks,
   * 2: bridge), for is_installed() and the doctor. */
  int (*init)(int device_count);
  int (*set_route)(int route);
  /* The effective settings ("key:value,...", strategy as in use) into buf. */
  int (*settings)(char* buf, uint64_t len);

  /* ---- version 2 ---- */

  /* PyTorch's recordStream, acting only on memory pyalloc handed out, as
   * `owner` (enum pyalloc_owner) tells: POOLS, the live allocation at ptr
   * (PYALLOC_INVALID if there is none); NONE, nothing; OTHER, a live
   * allocation of the buffer pool at ptr, else nothing. A storage that owns
   * nothing may point at a live block of a CUDA graph's pool: an event
   * recorded for it would keep the block from being freed and re-allocated
   * when CUDA-graph trees restore a checkpoint. */
  int (*record_stream_owned)(void* ptr, void* stream, int owner);
  /* The context tag malloc was given for the live allocation at ptr (an
   * allocation's start, as PyTorch's getContextForPointer takes it); 0 if
   * there is none or it had no tag. */
  int (*block_context)(void* ptr, uint64_t* context);
  /* torch 2.13's markCaptureBegin (begin 1) / markCaptureEnd (begin 0): a
   * capture on the device counts as underway in between, as an open route
   * does. Appended: check size before calling. */
  int (*mark_capture)(int device, int begin);
  /* For PyTorch's profiler, which its own allocator tells of every malloc
   * and free (ptr, the block's bytes, the device's allocated and reserved
   * bytes after it): the live allocation at ptr, if any (NULL: none asked
   * about), and the allocated and reserved bytes of `device`, or of the
   * allocation's device when device is -1 (zeros for a device without
   * pools). Appended: check size before calling. */
  int (*memory_usage)(int device, void* ptr, pyalloc_memory_usage* out);
  /* CUDA IPC (csrc/cuda/ipc.h): PyTorch's shareIpcHandle and getIpcDevPtr.
   * ipc_share writes the handle of the live allocation at ptr into buf
   * (room for `capacity` bytes; *length its bytes, set even when it does
   * not fit, which is PYALLOC_INVALID) and *offset, where ptr lies in the
   * memory the handle names. ipc_open maps the memory a handle names on
   * `device` (*out: its start), one use more of that mapping; ipc_close
   * drops one use of what ipc_open returned, and the last unmaps it.
   * Appended: check size before calling. */
  int (*ipc_share)(void* ptr, char* buf, uint64_t capacity, uint64_t* length, uint64_t* offset);
  int (*ipc_open)(int device, const char* handle, uint64_t length, void** out);
  int (*ipc_close)(void* ptr);
  /* PyTorch's allocator trace trackers (NCCL registration): fn hears of
   * every unit of memory mapped and about to be unmapped, on every device
   * (NULL: no one); snapshot_units is snapshot's segments cut into those
   * units (each unit one segment, its blocks cut at its edges), the
   * segments a tracker has heard of. Appended: check size before calling. */
  int (*watch_segments)(pyalloc_segment_event_fn fn, void* user);
  int (*snapshot_units)(int device, const uint64_t* pool_id, pyalloc_segment_fn fn, void* user);
  /* create_or_incref_pool for a MemPool with an allocator of its own: the
   * pool's segments come from alloc and go back through free. Appended. */
  int (*create_or_incref_pool_with)(int device, uint64_t id0, uint64_t id1, pyalloc_source_alloc_fn alloc,
                                    pyalloc_source_free_fn free, void* user);
  /* PyTorch's free-memory callbacks (FreeCudaMemoryCallbacksRegistry): fn
   * runs on the out-of-memory path of a malloc, with no lock of pyalloc's
   * held, before the error; when it says it freed memory (whose frees came
   * back through free) the malloc tries once more. Never from inside fn on
   * the same thread. NULL: none. Appended: check size before calling. */
  int (*set_free_memory_hook)(pyalloc_free_memory_fn fn, void* user);
  /* marked 1: PyTorch marks each capture (torch 2.13+: mark_capture), and
   * routing a pool (use_mem_pool, NCCL registration, CUDA-graph trees'
   * warm-up) is no capture by itself: a route begun from then on counts as
   * a capture underway only until a mark begins on its thread (its capture
   * has begun), it serves a stream that is not capturing, or it ends, as
   * PyTorch's allocator defers its event processing for marked captures
   * alone. 0: every route counts as one until it ends (the default).
   * Appended: check size before calling. */
  int (*set_captures_marked)(int marked);
  /* record_stream_owned with the stream's device (PyTorch's c10::Stream
   * carries it; -1: the allocation's own): the event is recorded on that
   * device's stream, as PyTorch's insert_events records under a device
   * guard for the stream's device. A default stream's handle (NULL) names
   * every device's own; without the device, another device's default
   * stream would be taken for the allocation's. Appended: check size
   * before calling. */
  int (*record_stream_on)(void* ptr, void* stream, int device, int owner);
  /* sizeof(pyalloc_segment_info) as this pyalloc fills it: the members it
   * appended since are there only where this covers them. Appended. */
  uint64_t segment_info_size;
  /* torch.cuda.MemPool's options for pool (id0, id1), as PyTorch's
   * setUseOnOOM and setNoSplit: with use_on_oom 1, the pool's free blocks
   * serve the device's allocations routed to no pool that would otherwise
   * run out of memory (handed out from the pool, freed back into it); 0
   * turns that off (MemPool's destructor: never an error). no_split: the
   * pool never splits a block from now on. A pool that does not exist is
   * PYALLOC_INVALID ("Could not find pool of id"). Appended: check size
   * before calling. */
  int (*set_pool_use_on_oom)(int device, uint64_t id0, uint64_t id1, int use_on_oom);
  int (*set_pool_no_split)(int device, uint64_t id0, uint64_t id1);
} pyalloc_bridge_api;

/* The table of `version`, or NULL if this pyalloc does not offer it. */
const pyalloc_bridge_api* pyalloc_bridge_api_get(uint32_t version);
typedef const pyalloc_bridge_api* (*pyalloc_bridge_api_get_fn)(uint32_t version);
#define PYALLOC_BRIDGE_API_SYMBOL "pyalloc_bridge_api_get"

#ifdef __cplusplus
}
#endif

#endif /* PYALLOC_BRIDGE_API_H */
