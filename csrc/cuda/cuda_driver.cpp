// Loading the CUDA driver at run time: dlopen("libcuda.so.1"), dlsym of each
// entry point, cuInit. Done once per process; a failure is remembered and
// reported the same way to every caller.
#include "cuda_driver.h"

#include <dlfcn.h>

#include <map>
#include <mutex>

namespace pyalloc {
namespace drv {
namespace {

struct Loaded {
  Driver table;
  std::string error;  // empty when the table is usable
};

std::string name_with(const Driver& d, CUresult r) {
  std::string code = std::to_string(static_cast<int>(r));
  const char* name = nullptr;
  if (d.GetErrorName != nullptr && d.GetErrorName(r, &name) == CUDA_SUCCESS && name != nullptr)
    return std::string(name) + " (" + code + ")";
  return "CUDA driver error " + code;
}

template <class Fn>
bool fetch(void* lib, const char* symbol, Fn* out, std::string* missing) {
  void* p = dlsym(lib, symbol);
  *out = reinterpret_cast<Fn>(p);
  if (p == nullptr && missing != nullptr) *missing += std::string(missing->empty() ? "" : ", ") + symbol;
  return p != nullptr;
}

Loaded load() {
  Loaded out;
  const char* name = "libcuda.so.1";
  // RTLD_LOCAL: the driver's symbols stay out of the global namespace, as
  // they are for the CUDA runtime that PyTorch itself links.
  void* lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    out.error = std::string("pyalloc's CUDA backend cannot load the CUDA driver library ") + name +
                " (" + (why != nullptr ? why : "not found") +
                "). It comes with the NVIDIA GPU driver; on a machine without one, pyalloc can "
                "only run its host and virtual backends (pyalloc.Allocator).";
    return out;
  }
  Driver& d = out.table;
  std::string missing;
  fetch(lib, "cuInit", &d.Init, &missing);
  fetch(lib, "cuDriverGetVersion", &d.DriverGetVersion, &missing);
  fetch(lib, "cuDeviceGet", &d.DeviceGet, &missing);
  fetch(lib, "cuDeviceGetCount", &d.DeviceGetCount, &missing);
  fetch(lib, "cuDevicePrimaryCtxRetain", &d.DevicePrimaryCtxRetain, &missing);
  fetch(lib, "cuCtxGetCurrent", &d.CtxGetCurrent, &missing);
  fetch(lib, "cuCtxSetCurrent", &d.CtxSetCurrent, &missing);
  fetch(lib, "cuCtxSynchronize", &d.CtxSynchronize, &missing);
  fetch(lib, "cuMemAlloc_v2", &d.MemAlloc, &missing);
  fetch(lib, "cuMemFree_v2", &d.MemFree, &missing);
  fetch(lib, "cuMemGetInfo_v2", &d.MemGetInfo, &missing);
  fetch(lib, "cuEventCreate", &d.EventCreate, &missing);
  fetch(lib, "cuEventRecord", &d.EventRecord, &missing);
  fetch(lib, "cuEventQuery", &d.EventQuery, &missing);
  fetch(lib, "cuEventSynchronize", &d.EventSynchronize, &missing);
  fetch(lib, "cuEventDestroy_v2", &d.EventDestroy, &missing);
  fetch(lib, "cuStreamIsCapturing", &d.StreamIsCapturing, &missing);
  fetch(lib, "cuGetErrorName", &d.GetErrorName, &missing);
  fetch(lib, "cuStreamGetCaptureInfo_v2", &d.StreamGetCaptureInfo, nullptr);
  fetch(lib, "cuStreamGetCtx", &d.StreamGetCtx, nullptr);
  fetch(lib, "cuDeviceCanAccessPeer", &d.DeviceCanAccessPeer, nullptr);
  fetch(lib, "cuDeviceTotalMem_v2", &d.DeviceTotalMem, nullptr);
  fetch(lib, "cuDeviceGetName", &d.DeviceGetName, nullptr);
  fetch(lib, "cuThreadExchangeStreamCaptureMode", &d.ThreadExchangeStreamCaptureMode, nullptr);
  std::string no_vmm;
  fetch(lib, "cuDeviceGetAttribute", &d.DeviceGetAttribute, &no_vmm);
  fetch(lib, "cuMemAddressReserve", &d.MemAddressReserve, &no_vmm);
  fetch(lib, "cuMemAddressFree", &d.MemAddressFree, &no_vmm);
  fetch(lib, "cuMemCreate", &d.MemCreate, &no_vmm);
  fetch(lib, "cuMemRelease", &d.MemRelease, &no_vmm);
  fetch(lib, "cuMemMap", &d.MemMap, &no_vmm);
  fetch(lib, "cuMemUnmap", &d.MemUnmap, &no_vmm);
  fetch(lib, "cuMemSetAccess", &d.MemSetAccess, &no_vmm);
  fetch(lib, "cuMemGetAllocationGranularity", &d.MemGetAllocationGranularity, &no_vmm);
  std::string no_ipc;
  fetch(lib, "cuIpcGetMemHandle", &d.IpcGetMemHandle, &no_ipc);
  fetch(lib, "cuIpcOpenMemHandle_v2", &d.IpcOpenMemHandle, &no_ipc);
  fetch(lib, "cuIpcCloseMemHandle", &d.IpcCloseMemHandle, &no_ipc);
  if (!no_ipc.empty()) {  // has_legacy_ipc() false: all or none
    d.IpcGetMemHandle = nullptr;
    d.IpcOpenMemHandle = nullptr;
    d.IpcCloseMemHandle = nullptr;
  }
  std::string no_share;
  fetch(lib, "cuMemExportToShareableHandle", &d.MemExportToShareableHandle, &no_share);
  fetch(lib, "cuMemImportFromShareableHandle", &d.MemImportFromShareableHandle, &no_share);
  if (!no_share.empty()) {  // has_shareable_handles() false: both or none
    d.MemExportToShareableHandle = nullptr;
    d.MemImportFromShareableHandle = nullptr;
  }
  if (!no_vmm.empty()) {
    d.MemMap = nullptr;  // has_vmm() false: pools use plain segments
    d.vmm_missing = no_vmm;
  }
  if (!missing.empty()) {
    out.error = std::string("the CUDA driver library ") + name +
                " lacks entry points pyalloc needs (" + missing +
                "); the NVIDIA driver is too old or the library is not the real driver";
    return out;
  }
  CUresult r = d.Init(0);
  if (r != CUDA_SUCCESS) {
    out.error = "cuInit failed: " + name_with(d, r) +
                (r == CUDA_ERROR_NO_DEVICE ? " (no CUDA GPU is visible to this process)" : "");
    return out;
  }
  if (d.DriverGetVersion(&d.version) != CUDA_SUCCESS) d.version = 0;
  // The library stays loaded for the life of the process: the table points into it.
  return out;
}

const Loaded& loaded() {
  static const Loaded* instance = new Loaded(load());  // never destroyed: used until exit
  return *instance;
}

}  // namespace

const Driver& driver() {
  const Loaded& l = loaded();
  if (!l.error.empty()) throw DriverError(l.error);
  return l.table;
}

std::string error_name(CUresult r) {
  const Loaded& l = loaded();
  return name_with(l.error.empty() ? l.table : Driver{}, r);
}

void check(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS) throw DriverError(std::string(what) + " failed: " + error_name(r));
}

CUcontext primary_context(const Driver& d, int index) {
  static std::mutex mu;
  static std::map<int, CUcontext> contexts;
  std::lock_guard<std::mutex> g(mu);
  auto it = contexts.find(index);
  if (it != contexts.end()) return it->second;
  CUdevice dev = 0;
  check(d.DeviceGet(&dev, index), "cuDeviceGet");
  CUcontext ctx = nullptr;
  check(d.DevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  contexts.emplace(index, ctx);
  return ctx;
}

}  // namespace drv
}  // namespace pyalloc
