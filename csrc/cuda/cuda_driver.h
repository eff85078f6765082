// The few CUDA driver API types and entry points the CUDA backend uses,
// declared here so that pyalloc builds without the CUDA toolkit, and the
// table that loads them from libcuda.so.1 at run time.
//
// Every entry point is fetched by the exact ABI name it has had since the
// version noted beside it (the `_v2` names where the driver kept an older
// ABI under the plain name), so a newer driver keeps serving this table.
// Streams are taken with the legacy default-stream semantics, as PyTorch
// uses them: stream 0 is the legacy default stream.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace pyalloc {
namespace drv {

enum CUresult : int {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_DEINITIALIZED = 4,
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_ALREADY_MAPPED = 208,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_NOT_READY = 600,
  CUDA_ERROR_NOT_PERMITTED = 800,
  CUDA_ERROR_NOT_SUPPORTED = 801,
  CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
  CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906,
  CUDA_ERROR_CAPTURED_EVENT = 907,
  CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD = 908,
};

/// The errors of stream capture (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED ..
/// CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD): a call was refused because of a
/// capture, which says nothing about the work it asked about.
inline bool is_capture_error(CUresult r) {
  return r >= CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED && r <= CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD;
}

enum CUstreamCaptureStatus : int {
  CU_STREAM_CAPTURE_STATUS_NONE = 0,
  CU_STREAM_CAPTURE_STATUS_ACTIVE = 1,
  CU_STREAM_CAPTURE_STATUS_INVALIDATED = 2,
};

enum CUstreamCaptureMode : int {
  CU_STREAM_CAPTURE_MODE_GLOBAL = 0,
  CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1,
  CU_STREAM_CAPTURE_MODE_RELAXED = 2,
};

constexpr unsigned int CU_EVENT_DISABLE_TIMING = 0x2;

// Virtual memory management (cuda.h: CUmemAllocationProp_v1 and friends).
constexpr int CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102;
constexpr int CU_MEM_ALLOCATION_TYPE_PINNED = 1;
constexpr int CU_MEM_HANDLE_TYPE_NONE = 0;
constexpr int CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1;
constexpr int CU_MEM_LOCATION_TYPE_DEVICE = 1;
constexpr int CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3;
constexpr int CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0;
using CUmemGenericAllocationHandle = unsigned long long;

struct CUmemLocation {
  int type;
  int id;
};

struct CUmemAllocationProp {
  int type;
  int requestedHandleTypes;
  CUmemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
};

struct CUmemAccessDesc {
  CUmemLocation location;
  int flags;
};

// Legacy IPC (cuda.h: CUipcMemHandle): 64 opaque bytes naming one
// cuMemAlloc allocation, the same bytes as the runtime's cudaIpcMemHandle_t.
constexpr size_t CU_IPC_HANDLE_SIZE = 64;
struct CUipcMemHandle {
  char reserved[CU_IPC_HANDLE_SIZE];
};
constexpr unsigned int CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1;

using CUdevice = int;
using CUdeviceptr = unsigned long long;
using cuuint64_t = uint64_t;
struct CUctx_st;
struct CUstream_st;
struct CUevent_st;
using CUcontext = CUctx_st*;
using CUstream = CUstream_st*;
using CUevent = CUevent_st*;

/// The entry points, by the driver's symbol names.
struct Driver {
  CUresult (*Init)(unsigned int flags);                                  // cuInit
  CUresult (*DriverGetVersion)(int* version);                            // cuDriverGetVersion
  CUresult (*DeviceGet)(CUdevice* device, int ordinal);                  // cuDeviceGet
  CUresult (*DeviceGetCount)(int* count);                                // cuDeviceGetCount
  CUresult (*DevicePrimaryCtxRetain)(CUcontext* ctx, CUdevice device);   // cuDevicePrimaryCtxRetain
  CUresult (*CtxGetCurrent)(CUcontext* ctx);                             // cuCtxGetCurrent
  CUresult (*CtxSetCurrent)(CUcontext ctx);                              // cuCtxSetCurrent
  /// Waits for all work of the current context, that of streams since
  /// destroyed included.
  CUresult (*CtxSynchronize)();                                          // cuCtxSynchronize
  CUresult (*MemAlloc)(CUdeviceptr* ptr, size_t bytes);                  // cuMemAlloc_v2
  CUresult (*MemFree)(CUdeviceptr ptr);                                  // cuMemFree_v2
  CUresult (*MemGetInfo)(size_t* free_bytes, size_t* total_bytes);       // cuMemGetInfo_v2
  CUresult (*EventCreate)(CUevent* event, unsigned int flags);           // cuEventCreate
  CUresult (*EventRecord)(CUevent event, CUstream stream);               // cuEventRecord
  CUresult (*EventQuery)(CUevent event);                                 // cuEventQuery
  CUresult (*EventSynchronize)(CUevent event);                           // cuEventSynchronize
  CUresult (*EventDestroy)(CUevent event);                               // cuEventDestroy_v2
  CUresult (*StreamIsCapturing)(CUstream stream, CUstreamCaptureStatus* status);  // cuStreamIsCapturing
  /// Optional (null if absent): the CUDA 11.3 ABI (`_v2`, six arguments;
  /// CUDA 13's headers map the plain name to the seven-argument `_v3`), which
  /// also gives the capture sequence's id. The last three may be null.
  CUresult (*StreamGetCaptureInfo)(CUstream stream, CUstreamCaptureStatus* status, cuuint64_t* id,
                                   void** graph, const void** deps,
                                   size_t* num_deps);                     // cuStreamGetCaptureInfo_v2
  /// Optional (null if absent): the context a stream belongs to.
  CUresult (*StreamGetCtx)(CUstream stream, CUcontext* ctx);              // cuStreamGetCtx
  /// Optional (null if absent): whether `device` can access `peer`'s memory.
  CUresult (*DeviceCanAccessPeer)(int* can, CUdevice device, CUdevice peer);  // cuDeviceCanAccessPeer
  /// Optional (null if absent): for `pyalloc doctor`, which needs no context.
  CUresult (*DeviceTotalMem)(size_t* bytes, CUdevice device);            // cuDeviceTotalMem_v2
  CUresult (*DeviceGetName)(char* name, int len, CUdevice device);       // cuDeviceGetName
  CUresult (*GetErrorName)(CUresult error, const char** name);           // cuGetErrorName
  /// Optional (null if absent): the calling thread's capture mode, swapped
  /// (CUDA 10.1), so that memory can be allocated during a capture.
  CUresult (*ThreadExchangeStreamCaptureMode)(CUstreamCaptureMode* mode);  // cuThreadExchangeStreamCaptureMode
  /// Optional (all null if any is absent): virtual memory management.
  CUresult (*DeviceGetAttribute)(int* value, int attribute, CUdevice device);  // cuDeviceGetAttribute
  CUresult (*MemAddressReserve)(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                unsigned long long flags);                      // cuMemAddressReserve
  CUresult (*MemAddressFree)(CUdeviceptr ptr, size_t size);                    // cuMemAddressFree
  CUresult (*MemCreate)(CUmemGenericAllocationHandle* handle, size_t size,
                        const CUmemAllocationProp* prop, unsigned long long flags);  // cuMemCreate
  CUresult (*MemRelease)(CUmemGenericAllocationHandle handle);                 // cuMemRelease
  CUresult (*MemMap)(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                     unsigned long long flags);                                // cuMemMap
  CUresult (*MemUnmap)(CUdeviceptr ptr, size_t size);                          // cuMemUnmap
  CUresult (*MemSetAccess)(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc,
                           size_t count);                                      // cuMemSetAccess
  CUresult (*MemGetAllocationGranularity)(size_t* granularity, const CUmemAllocationProp* prop,
                                          int option);  // cuMemGetAllocationGranularity
  /// Optional (all null if any is absent): sharing memory with other processes.
  /// Legacy IPC of cuMemAlloc allocations (what PyTorch's cudaMalloc
  /// segments use), and the shareable handles of cuMemCreate allocations.
  CUresult (*IpcGetMemHandle)(CUipcMemHandle* handle, CUdeviceptr ptr);          // cuIpcGetMemHandle
  CUresult (*IpcOpenMemHandle)(CUdeviceptr* ptr, CUipcMemHandle handle,
                               unsigned int flags);                              // cuIpcOpenMemHandle_v2
  CUresult (*IpcCloseMemHandle)(CUdeviceptr ptr);                                // cuIpcCloseMemHandle
  CUresult (*MemExportToShareableHandle)(void* shareable, CUmemGenericAllocationHandle handle,
                                         int type, unsigned long long flags);  // cuMemExportToShareableHandle
  CUresult (*MemImportFromShareableHandle)(CUmemGenericAllocationHandle* handle, void* shareable,
                                           int type);  // cuMemImportFromShareableHandle
  bool has_vmm() const { return MemMap != nullptr; }
  bool has_legacy_ipc() const { return IpcOpenMemHandle != nullptr; }
  bool has_shareable_handles() const { return MemImportFromShareableHandle != nullptr; }
  /// When !has_vmm(): the virtual memory entry points the library lacks.
  std::string vmm_missing;
  int version = 0;  // cuDriverGetVersion, e.g. 13000
};

/// The driver could not be loaded or initialised, or a call failed in a way
/// the caller cannot absorb. The message says which call and why.
class DriverError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Loads libcuda.so.1 and runs cuInit once; throws DriverError (every time)
/// if that failed, with the reason and what to do about it.
const Driver& driver();

/// "CUDA_ERROR_OUT_OF_MEMORY (2)"; safe when the driver is not loaded.
std::string error_name(CUresult r);

/// Throws DriverError "<what> failed: <error name>" unless r is CUDA_SUCCESS.
void check(CUresult r, const char* what);

/// The primary context of device `index`, retained once for the process's
/// life and shared by every user of the device (its pools, events on its
/// streams, memory opened from another process). Throws DriverError.
CUcontext primary_context(const Driver& d, int index);

/// Makes ctx current for the scope, and then what the thread had current
/// before: another context, or none (a thread pyalloc runs on is left as it
/// found it). Costs one cuCtxGetCurrent when ctx is already current.
class ContextGuard {
 public:
  ContextGuard(const Driver& d, CUcontext ctx) : d_(d) {
    CUcontext prev = nullptr;
    if (d_.CtxGetCurrent(&prev) != CUDA_SUCCESS) prev = nullptr;
    if (prev != ctx) {
      check(d_.CtxSetCurrent(ctx), "cuCtxSetCurrent");
      prev_ = prev;
      restore_ = true;
    }
  }
  ~ContextGuard() {
    if (restore_) d_.CtxSetCurrent(prev_);  // nullptr: no context current, as before
  }
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;

 private:
  const Driver& d_;
  CUcontext prev_ = nullptr;
  bool restore_ = false;
};

}  // namespace drv
}  // namespace pyalloc
