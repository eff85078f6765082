// CUDA IPC: pyalloc's memory shared with other processes, as PyTorch's
// allocator interface asks (CUDAAllocator::shareIpcHandle / getIpcDevPtr,
// used by torch.multiprocessing to send CUDA tensors).
//
// A handle is a byte string in PyTorch's layout: a version byte, a type
// byte, then the type's payload.
// - 'c' (a plain segment, strategy bestfit, graph pools, the buffer pool):
//   the driver's legacy IPC handle of the cuMemAlloc segment holding the
//   allocation, exactly as PyTorch's own allocator writes it, so that a
//   receiver running either allocator opens it; the receiver maps the whole
//   segment (the driver allows no less). The offset given with it is the
//   allocation's place in that segment.
// - 'P' (pages of strategy vmm): pyalloc's own. PyTorch's expandable
//   segments send their page handles as file descriptor numbers that the
//   receiver takes from the sender with pidfd_getfd, which containers
//   refuse. pyalloc instead serves the pages' POSIX file descriptors from a
//   Unix socket (same user only) in the sending process, passing them with
//   SCM_RIGHTS when the receiver asks. The socket is abstract, reachable in
//   one network namespace only, unless PYALLOC_IPC_DIR names a directory:
//   then it is a file there (mode 0600, removed at exit), which processes in
//   different network namespaces (containers sharing a GPU) reach through a
//   directory both see; the handle says which, and each side reads
//   PYALLOC_IPC_DIR for itself. The handles are exported once, at the first
//   share; the export keeps their descriptors (one per handle) until the
//   allocation's free and sends each receiver copies, as PyTorch's
//   ExpandableSegment::share keeps each handle's (shareable_handle). A free
//   of an allocation not exported takes no lock of the whole process. The receiver maps
//   only the handles under the allocation, in an address range of their
//   size. Only a pyalloc receiver opens such a handle.
// - 'e' (PyTorch's expandable segments) is refused with a clear error.
//
// Lifetime. PyTorch keeps a shared block allocated in the sender while any
// receiver holds it (CudaIPCSentData's reference count, freed through
// torch.cuda.ipc_collect()). An export of pages lives exactly as long as
// its allocation: the allocation's free ends it (forget()), and a receiver
// asking later is refused, never handed memory the sender has reused.
// Shared pages never move while shared: the vmm policy moves or unmaps only
// handles that are wholly free, and a handle under a live allocation never
// is; so pyalloc needs no pin of its own, and a page that would have to
// move while shared cannot exist.
//
// Receivers: opening the same handle again gives the same mapping, counted;
// close() drops one use, and the last unmaps it (cuIpcCloseMemHandle, or
// cuMemUnmap and cuMemRelease of the imported handles) once the device has
// finished the work queued on it (cuCtxSynchronize, as PyTorch synchronizes
// before it unmaps imported pages), after the capture if a CUDA graph
// capture is underway (those calls would break it). Opening runs in relaxed
// capture mode, legal while another thread captures.
//
// Fake devices (tests): a plain segment gives a 'c' handle whose payload
// names this process and the address; a receiver in the same process
// "opens" it at that address, with the same counting.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace pyalloc {

class DevicePools;

namespace ipc {

/// PyTorch's SHAREABLE_HANDLE_VERSION and handle types.
constexpr char kHandleVersion = 2;
constexpr char kSegmentHandle = 'c';
constexpr char kExpandableHandle = 'e';
constexpr char kPagesHandle = 'P';

/// The handle for the live allocation at ptr of `pools`' device, and
/// (*offset) where ptr lies in the memory the handle names. Sharing the same
/// allocation again gives the same handle. Throws std::invalid_argument if
/// ptr is no live allocation of the device, std::runtime_error if its
/// memory cannot be shared (saying why).
std::string share(DevicePools& pools, uintptr_t ptr, uint64_t* offset);

/// Maps the memory a handle names on `device` (the receiver's ordinal) and
/// returns where; one more use of that mapping. Throws std::invalid_argument
/// for a handle pyalloc cannot open (saying why), std::runtime_error if the
/// driver or the sender refuses.
uintptr_t open(int device, const std::string& handle);

/// One use less of the mapping open() returned at ptr; the last waits for the
/// device's queued work and unmaps it,
/// or, while a CUDA graph capture is underway, leaves it to unmap_deferred()
/// (unmapping then would break the capture). Throws std::invalid_argument if
/// ptr is no such mapping.
void close(uintptr_t ptr);

/// Unmaps the mappings closed during a capture, unless one is still
/// underway: after a capture ends (DevicePools), and on each open and close.
void unmap_deferred();

namespace detail {
extern std::atomic<size_t> exports;  // allocations whose pages are exported now
void forget(int device, uintptr_t ptr);
}  // namespace detail

/// The allocation at ptr on `device` is being freed: its export of pages,
/// if any, ends. On every free: one atomic load while nothing is exported.
inline void forget(int device, uintptr_t ptr) {
  if (detail::exports.load(std::memory_order_acquire) != 0) detail::forget(device, ptr);
}

/// Tests: the process id that the sending side writes into its 'P' handles
/// and its server's name, if called before its first export (0: the real
/// one); ids up to Linux's largest pid_max (4194304) where this machine's
/// are short.
void set_process_id_for_tests(uint32_t pid);

/// A fake device's token for the segment at base (FakeBackend::share_segment).
std::string fake_token(uintptr_t base);

/// For tests and the doctor.
struct Counts {
  uint64_t exports = 0;       // allocations whose pages are exported now
  uint64_t handles_exported = 0;  // handles of pages exported for those, ever (once each per share)
  uint64_t frees_locked = 0;  // frees that took the exports' lock: those of exported allocations
  uint64_t served = 0;        // requests for pages answered with their handles
  uint64_t refused = 0;       // requests refused (an export ended, unknown)
  uint64_t mappings = 0;      // handles opened by this process now
  uint64_t mapped_bytes = 0;  // the bytes those mappings hold
  uint64_t deferred_unmaps = 0;  // of those mappings, the ones closed during a capture, not yet unmapped
};
Counts counts();

}  // namespace ipc
}  // namespace pyalloc
