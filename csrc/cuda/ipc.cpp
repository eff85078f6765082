// CUDA IPC of pyalloc's memory: see ipc.h.
#include "ipc.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <random>
#include <stdexcept>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "capture.h"
#include "cuda_driver.h"
#include "registry.h"

namespace pyalloc {
namespace ipc {
namespace {

using namespace drv;

// ---------------------------------------------------------------------------
// Bytes on the wire: native byte order (both ends run on one machine).

void put(std::string* s, const void* p, size_t n) { s->append(static_cast<const char*>(p), n); }
template <class T>
void put(std::string* s, T v) {
  put(s, &v, sizeof(v));
}

// Reads a handle's payload in order; every read past its end throws.
class Reader {
 public:
  Reader(const std::string& s, size_t at) : s_(s), at_(at) {}
  template <class T>
  T get() {
    T v;
    take(&v, sizeof(v));
    return v;
  }
  std::string bytes(size_t n) {
    std::string out(n, '\0');
    take(&out[0], n);
    return out;
  }
  bool done() const { return at_ == s_.size(); }

 private:
  void take(void* out, size_t n) {
    if (n > s_.size() - at_) throw std::invalid_argument("pyalloc: a CUDA IPC handle is cut short");
    std::memcpy(out, s_.data() + at_, n);
    at_ += n;
  }
  const std::string& s_;
  size_t at_;
};

// A file descriptor, closed when it goes unless released: on every path.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = o.release();
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
};

// What DevicePools::share() hands over: the shared memory, whose file
// descriptors the caller owns (core/backend.h), even where the share failed
// or threw half way. Closes them when it goes, on every path, each as an Fd
// closes its own (the one holder of a descriptor's close).
struct SharedMems {
  std::vector<SharedMemory> v;
  SharedMems() = default;
  SharedMems(const SharedMems&) = delete;
  SharedMems& operator=(const SharedMems&) = delete;
  ~SharedMems() { close(); }
  void close() {
    for (SharedMemory& m : v) Fd(m.fd).reset();
    v.clear();
  }
};

// ---------------------------------------------------------------------------
// The sending side: exports of pages and the socket that serves them.

// A 'P' handle's payload after its two type bytes.
struct PagesHandle {
  uint32_t pid = 0;
  uint64_t id = 0;        // the export's id: random, so that it cannot be guessed
  uint64_t bytes = 0;     // the handles' bytes together
  uint32_t handles = 0;
  uint8_t format = 0;     // kPagesFormat or kPagesFormatFile: where the server listens
  std::string socket;     // the server's name: abstract (without its leading NUL), or its file's
};
constexpr uint8_t kPagesFormat = 1;      // an abstract socket: one network namespace
constexpr uint8_t kPagesFormatFile = 2;  // a socket file in PYALLOC_IPC_DIR: one directory seen

// The directory of socket files (PYALLOC_IPC_DIR), read by each side for
// itself: a sender's container and a receiver's may mount it at different
// paths. Empty: unset.
std::string ipc_dir() {
  const char* dir = std::getenv("PYALLOC_IPC_DIR");
  return dir != nullptr ? dir : "";
}

std::atomic<uint32_t> pid_for_tests{0};
uint32_t process_id() {
  uint32_t pid = pid_for_tests.load(std::memory_order_relaxed);
  return pid != 0 ? pid : static_cast<uint32_t>(::getpid());
}

// The sending server's socket name (abstract, or its file's): the process's id in ten digits
// (all a uint32_t takes), so that every 'P' handle has one length,
// kPagesHandleSize. Its length must never be CU_IPC_HANDLE_SIZE: PyTorch and
// open() read a handle of exactly 64 bytes as the driver's legacy handle
// sent alone (PyTorch before 2.2), whatever its first bytes; with the id
// written as it came, a process of id 1000000 or more made a 64-byte 'P'
// handle that receivers took for a segment's.
std::string server_name(uint32_t pid, uint64_t nonce) {
  char name[64];
  std::snprintf(name, sizeof(name), "pyalloc-ipc.%010u.%016llx", pid, static_cast<unsigned long long>(nonce));
  return name;
}
constexpr size_t kServerNameSize = 12 + 10 + 1 + 16;
// The version and type bytes, the format, pid, id, bytes, handles, the name's length and the name.
constexpr size_t kPagesHandleSize = 2 + 1 + 4 + 8 + 8 + 4 + 1 + kServerNameSize;
static_assert(kPagesHandleSize != CU_IPC_HANDLE_SIZE, "a 'P' handle would read as a legacy one");

std::string encode(const PagesHandle& h) {
  std::string s;
  s.push_back(kHandleVersion);
  s.push_back(kPagesHandle);
  put<uint8_t>(&s, h.format);
  put(&s, h.pid);
  put(&s, h.id);
  put(&s, h.bytes);
  put(&s, h.handles);
  put<uint8_t>(&s, static_cast<uint8_t>(h.socket.size()));
  put(&s, h.socket.data(), h.socket.size());
  if (s.size() != kPagesHandleSize)
    throw std::logic_error("pyalloc: a CUDA IPC handle of pages of " + std::to_string(s.size()) +
                           " bytes, not " + std::to_string(kPagesHandleSize));
  return s;
}

PagesHandle decode_pages(const std::string& s) {
  Reader r(s, 2);
  PagesHandle h;
  h.format = r.get<uint8_t>();
  if (h.format != kPagesFormat && h.format != kPagesFormatFile)
    throw std::invalid_argument("pyalloc: a CUDA IPC handle of pages from another version of pyalloc");
  h.pid = r.get<uint32_t>();
  h.id = r.get<uint64_t>();
  h.bytes = r.get<uint64_t>();
  h.handles = r.get<uint32_t>();
  h.socket = r.bytes(r.get<uint8_t>());
  if (!r.done() || h.handles == 0 || h.socket.empty())
    throw std::invalid_argument("pyalloc: a malformed CUDA IPC handle of pages");
  return h;
}

// What the server answers: a status, then the handles' sizes (ok) or a
// message (refused); the file descriptors follow in batches.
constexpr int32_t kServed = 0;
constexpr int32_t kRefused = 1;
constexpr size_t kFdsPerMessage = 64;  // well under the kernel's SCM_MAX_FD
constexpr int kSocketTimeoutSeconds = 30;

bool send_all(int fd, const std::string& data) {
  size_t sent = 0;
  while (sent < data.size()) {
    ssize_t n = ::send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return true;
}

bool recv_all(int fd, void* out, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = ::recv(fd, static_cast<char*>(out) + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    got += static_cast<size_t>(r);
  }
  return true;
}

// One message of one byte, with room for n descriptors beside it (SCM_RIGHTS).
struct FdMessage {
  char byte = 0;
  iovec iov{&byte, 1};
  std::vector<char> control;
  msghdr msg{};

  explicit FdMessage(size_t n) : control(CMSG_SPACE(sizeof(int) * n)) {
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
  }
  FdMessage(const FdMessage&) = delete;
  FdMessage& operator=(const FdMessage&) = delete;
};

bool send_fds(int sock, const int* fds, size_t n) {
  FdMessage m(n);
  cmsghdr* c = CMSG_FIRSTHDR(&m.msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int) * n);
  std::memcpy(CMSG_DATA(c), fds, sizeof(int) * n);
  ssize_t r;
  do {
    r = ::sendmsg(sock, &m.msg, MSG_NOSIGNAL);
  } while (r < 0 && errno == EINTR);
  return r == 1;
}

// Up to `want` descriptors of one message, appended to *out.
bool recv_fds(int sock, size_t want, std::vector<int>* out) {
  FdMessage m(want);
  msghdr& msg = m.msg;
  ssize_t r;
  do {
    r = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  } while (r < 0 && errno == EINTR);
  if (r != 1) return false;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const int* fds = reinterpret_cast<const int*>(CMSG_DATA(c));
    out->insert(out->end(), fds, fds + n);
  }
  return (msg.msg_flags & MSG_CTRUNC) == 0;
}

sockaddr_un abstract_address(const std::string& name, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  if (name.size() + 1 > sizeof(a.sun_path))
    throw std::invalid_argument("pyalloc: an IPC socket name too long");
  std::memcpy(a.sun_path + 1, name.data(), name.size());  // sun_path[0] == 0: the abstract namespace
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return a;
}

// The address of socket file `name` in directory `dir`.
sockaddr_un file_address(const std::string& dir, const std::string& name, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::string path = dir + "/" + name;
  if (path.size() + 1 > sizeof(a.sun_path))
    throw std::runtime_error("pyalloc: PYALLOC_IPC_DIR (" + dir + ") is too long for a socket's path (" +
                             std::to_string(sizeof(a.sun_path) - 2 - name.size()) +
                             " bytes at most): choose a shorter path to it");
  std::memcpy(a.sun_path, path.data(), path.size());
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + path.size() + 1);
  return a;
}

// The server's socket file, removed when the process exits normally (one
// killed leaves it; its random name never collides with another's).
std::string served_file;
void remove_served_file() {
  if (!served_file.empty()) ::unlink(served_file.c_str());
}

void set_timeouts(int fd) {
  timeval t{kSocketTimeoutSeconds, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &t, sizeof(t));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &t, sizeof(t));
}

class Exports {
 public:
  static Exports& instance() {
    static Exports* e = new Exports();  // never destroyed: its thread serves until exit
    return *e;
  }

  // The handle of the pages under the live allocation at ptr of `pools`,
  // and (*offset) where ptr lies in them. Exported once, on the first share:
  // the export keeps its handles' descriptors, which each receiver is sent,
  // until the allocation's free. Under the lock of ptr's shard throughout,
  // so that its free (forget()) comes before or after it whole; the
  // exports' lock only to record it, not while the pools export.
  std::string share(DevicePools& pools, uintptr_t ptr, uint64_t* offset) {
    Shard& shard = shard_of(ptr);
    std::lock_guard<std::mutex> s(shard.mu);
    auto key = std::make_pair(pools.index(), ptr);
    auto known = shard.by_block.find(key);
    if (known != shard.by_block.end()) {
      std::lock_guard<std::mutex> g(mu_);
      const Export& e = by_id_.at(known->second);
      *offset = e.offset;
      return e.handle;
    }
    SharedMems mems;  // closed on every path but the one that keeps them
    std::string why;
    if (!pools.share(ptr, &mems.v, &why)) {
      if (mems.v.empty()) throw std::invalid_argument("pyalloc cannot share " + format_ptr(ptr) + ": " + why);
      throw std::runtime_error("pyalloc cannot share the CUDA memory at " + format_ptr(ptr) +
                               " with another process: " + why);
    }
    *offset = ptr - mems.v.front().addr;
    if (mems.v.front().fd < 0) {  // a segment: the driver's token
      std::string handle{kHandleVersion, kSegmentHandle};
      return handle + mems.v.front().token;
    }
    std::lock_guard<std::mutex> g(mu_);
    start_locked();
    exports_made_ += mems.v.size();
    PagesHandle h;
    h.pid = static_cast<uint32_t>(process_id());
    h.format = format_;
    h.socket = name_;
    h.handles = static_cast<uint32_t>(mems.v.size());
    for (const SharedMemory& m : mems.v) h.bytes += m.size;
    do h.id = rng_(); while (h.id == 0 || by_id_.count(h.id) != 0);
    Export& e = by_id_[h.id];
    e.device = pools.index();
    e.offset = *offset;
    e.handle = encode(h);
    e.mems.v.swap(mems.v);
    shard.by_block.emplace(key, h.id);
    detail::exports.store(by_id_.size(), std::memory_order_release);
    return e.handle;
  }

  // A free: the lock of ptr's shard alone, unless ptr's pages are exported.
  void forget(int device, uintptr_t ptr) {
    Shard& shard = shard_of(ptr);
    std::lock_guard<std::mutex> s(shard.mu);
    auto it = shard.by_block.find(std::make_pair(device, ptr));
    if (it == shard.by_block.end()) return;
    {
      std::lock_guard<std::mutex> g(mu_);  // waits for a request's descriptors being copied
      frees_locked_++;
      by_id_.erase(it->second);  // closes its descriptors
      detail::exports.store(by_id_.size(), std::memory_order_release);
    }
    shard.by_block.erase(it);
  }

  void count(Counts* c) {
    std::lock_guard<std::mutex> g(mu_);
    c->exports = by_id_.size();
    c->handles_exported = exports_made_;
    c->frees_locked = frees_locked_;
    c->served = served_;
    c->refused = refused_;
  }

 private:
  struct Export {
    int device = 0;
    uint64_t offset = 0;  // the allocation's place in its pages
    std::string handle;
    SharedMems mems;  // the handles' descriptors, from the share to the free
  };

  Exports() : rng_(std::random_device{}()) {}

  void start_locked() {
    if (fd_ >= 0) return;
    // Of one length whatever the process's id (server_name()).
    std::string name = server_name(static_cast<uint32_t>(process_id()), rng_());
    Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (fd.get() < 0)
      throw std::runtime_error(std::string("pyalloc: socket() for CUDA IPC failed: ") + std::strerror(errno));
    // PYALLOC_IPC_DIR: a socket file there, which a receiver in another
    // network namespace (another container) reaches through the directory;
    // else an abstract socket, which needs no file but one namespace.
    std::string dir = ipc_dir();
    socklen_t len = 0;
    sockaddr_un a = dir.empty() ? abstract_address(name, &len) : file_address(dir, name, &len);
    if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), len) != 0)
      throw std::runtime_error("pyalloc: the CUDA IPC socket could not be made" +
                               (dir.empty() ? std::string() : " in PYALLOC_IPC_DIR (" + dir + ")") + ": " +
                               std::strerror(errno));
    if (!dir.empty()) {
      served_file = a.sun_path;
      std::atexit(remove_served_file);
      // Its owner alone may connect (the server checks the peer's user too).
      if (::chmod(a.sun_path, 0600) != 0) {
        remove_served_file();
        throw std::runtime_error(std::string("pyalloc: the CUDA IPC socket's mode could not be set: ") +
                                 std::strerror(errno));
      }
    }
    if (::listen(fd.get(), 64) != 0)
      throw std::runtime_error(std::string("pyalloc: the CUDA IPC socket could not listen: ") +
                               std::strerror(errno));
    fd_ = fd.release();
    name_ = name;
    format_ = dir.empty() ? kPagesFormat : kPagesFormatFile;
    std::thread([this] { serve_forever(); }).detach();
  }

  void serve_forever() {
    for (;;) {
      Fd c(::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC));
      if (c.get() < 0) {
        if (errno != EINTR && errno != ECONNABORTED) ::usleep(10000);
        continue;
      }
      try {
        serve(c.get());
      } catch (const std::exception& e) {
        std::fprintf(stderr, "pyalloc: serving a CUDA IPC request failed: %s\n", e.what());
      } catch (...) {
        std::fprintf(stderr, "pyalloc: serving a CUDA IPC request failed\n");
      }
    }
  }

  // One request: an export's id; the answer: its handles' descriptors.
  // The exports' lock is held to find the export and take its handles'
  // descriptors, never while talking to the peer: every free in the process
  // waits for that lock (forget()) while anything is exported, and a slow
  // or stopped receiver must not stall them.
  void serve(int c) {
    set_timeouts(c);
    ucred peer{};
    socklen_t len = sizeof(peer);
    if (getsockopt(c, SOL_SOCKET, SO_PEERCRED, &peer, &len) != 0 || peer.uid != ::getuid()) return;
    uint64_t id = 0;
    if (!recv_all(c, &id, sizeof(id))) return;
    SharedMems mems;
    std::string refusal = take_handles(id, &mems);
    if (!refusal.empty()) {
      refuse(c, refusal);
      return;
    }
    // The allocation may be freed from here on: as if right after the answer,
    // which the receiver imports only later anyway. PyTorch's senders keep a
    // shared block until its receivers are done with it.
    std::string head;
    put(&head, kServed);
    put(&head, static_cast<uint32_t>(mems.v.size()));
    for (const SharedMemory& m : mems.v) put(&head, static_cast<uint64_t>(m.size));
    bool sent = send_all(c, head);
    std::vector<int> fds;
    for (const SharedMemory& m : mems.v) fds.push_back(m.fd);
    for (size_t i = 0; sent && i < fds.size(); i += kFdsPerMessage)
      sent = send_fds(c, fds.data() + i, std::min(kFdsPerMessage, fds.size() - i));
    mems.close();  // the receiver holds its own copies now
    if (sent) {
      std::lock_guard<std::mutex> g(mu_);
      served_++;
    }
  }

  // Under the exports' lock, so that the allocation's free waits (forget()):
  // copies of the descriptors of the handles under export `id` into *mems,
  // which closes them; or why it is refused (counted). No export, no pool's
  // lock: the handles were exported once, at the share.
  std::string take_handles(uint64_t id, SharedMems* mems) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = by_id_.find(id);
    if (it == by_id_.end()) {
      refused_++;
      return "the CUDA memory shared as export " + std::to_string(id) + " of process " +
             std::to_string(process_id()) +
             " is no longer shared: its allocation was freed there before this process "
             "opened it (its memory may hold other data now)";
    }
    for (const SharedMemory& m : it->second.mems.v) {
      SharedMemory copy = m;
      copy.fd = ::fcntl(m.fd, F_DUPFD_CLOEXEC, 0);
      if (copy.fd < 0) {
        std::string why = std::strerror(errno);
        mems->close();
        refused_++;
        return "the CUDA memory shared as export " + std::to_string(id) + " of process " +
               std::to_string(process_id()) + " cannot be served: its descriptors could not be copied (" +
               why + ")";
      }
      mems->v.push_back(copy);
    }
    return "";
  }

  void refuse(int c, const std::string& message) {
    std::string head;
    put(&head, kRefused);
    put(&head, static_cast<uint32_t>(message.size()));
    head += message;
    send_all(c, head);
  }

  // The exported allocations by (device, pointer), in shards by the pointer:
  // a free looks in its own shard, so frees of allocations not exported take
  // no lock of the whole process. Lock order: a shard's, then mu_.
  struct Shard {
    std::mutex mu;
    std::map<std::pair<int, uintptr_t>, uint64_t> by_block;  // the export's id
  };
  static constexpr size_t kShards = 64;
  Shard& shard_of(uintptr_t ptr) { return shards_[((ptr >> 9) ^ (ptr >> 21)) % kShards]; }
  std::array<Shard, kShards> shards_;

  std::mutex mu_;  // the exports (by_id_), the server, the counts
  std::mt19937_64 rng_;
  int fd_ = -1;
  std::string name_;
  uint8_t format_ = kPagesFormat;
  uint64_t exports_made_ = 0;  // handles exported for receivers, ever
  uint64_t frees_locked_ = 0;  // frees that took mu_: those of exported allocations
  std::unordered_map<uint64_t, Export> by_id_;
  uint64_t served_ = 0;
  uint64_t refused_ = 0;
};

// ---------------------------------------------------------------------------
// The receiving side: mappings of handles, shared by every open of one handle.

struct Mapping {
  int device = 0;
  int uses = 0;  // 0: closed during a capture, its unmap deferred (unmap_deferred())
  bool unmapping = false;  // uses == 0: a thread unmaps it, without mappings_mu
  bool legacy = false;  // cuIpcOpenMemHandle; else imported pages (or a fake device's)
  bool fake = false;
  uintptr_t base = 0;
  size_t bytes = 0;  // pages: the range reserved; legacy: unknown (0)
  std::vector<std::pair<CUmemGenericAllocationHandle, size_t>> pages;
};

std::mutex mappings_mu;
std::condition_variable unmapping_done;  // an unmap without mappings_mu has finished
std::map<std::string, Mapping>& by_handle() {
  static auto* m = new std::map<std::string, Mapping>();
  return *m;
}
std::map<uintptr_t, std::string>& by_base() {
  static auto* m = new std::map<uintptr_t, std::string>();
  return *m;
}

// A fake device's token (fake_token()): its magic, the process, the address.
constexpr char kFakeMagic[] = "pyalloc-fake-ipc";

void open_fake(Mapping* m, const std::string& token) {
  Reader r(token, 0);
  if (r.bytes(sizeof(kFakeMagic)) != std::string(kFakeMagic, sizeof(kFakeMagic)))
    throw std::invalid_argument("pyalloc: fake devices open only the handles of fake devices");
  uint32_t pid = r.get<uint32_t>();
  uint64_t base = r.get<uint64_t>();
  if (pid != static_cast<uint32_t>(::getpid()))
    throw std::invalid_argument("pyalloc: a fake device's memory opens only in the process that shared it");
  m->base = static_cast<uintptr_t>(base);
  m->fake = true;
}

void open_legacy(Mapping* m, const std::string& token) {
  const Driver& d = driver();
  if (!d.has_legacy_ipc())
    throw std::runtime_error(
        "pyalloc: the CUDA driver lacks the legacy IPC entry points (cuIpcOpenMemHandle)");
  CUipcMemHandle h{};
  std::memcpy(h.reserved, token.data(), sizeof(h.reserved));
  RelaxedCaptureMode relaxed(d);  // as map_pages()
  ContextGuard g(d, primary_context(driver(), m->device));
  CUdeviceptr p = 0;
  CUresult r = d.IpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  if (r != CUDA_SUCCESS)
    throw std::runtime_error("pyalloc: opening a CUDA IPC handle failed: cuIpcOpenMemHandle: " +
                             error_name(r));
  m->base = static_cast<uintptr_t>(p);
  m->legacy = true;
}

// Unmaps the first `mapped` of m's pages, releases every one of them and
// frees the range: undoes map_pages().
void unmap_pages(const Driver& d, Mapping* m, size_t mapped) {
  uintptr_t at = m->base;
  for (size_t i = 0; i < mapped; ++i) {
    d.MemUnmap(static_cast<CUdeviceptr>(at), m->pages[i].second);
    at += m->pages[i].second;
  }
  for (auto& page : m->pages) d.MemRelease(page.first);
  if (m->base != 0) d.MemAddressFree(static_cast<CUdeviceptr>(m->base), m->bytes);
  m->pages.clear();
  m->base = 0;
}

// What a sender's server answered: the handles' sizes and descriptors.
struct Served {
  std::vector<uint64_t> sizes;
  std::vector<Fd> fds;
  uint64_t total = 0;
};

// Asks the sender's server for the pages' descriptors. Socket I/O only, with
// no lock held: a slow or stopped sender (each step may wait
// kSocketTimeoutSeconds) must not stall this process's other opens and
// closes, which PyTorch makes from tensors' deleters on any thread.
Served fetch_pages(const PagesHandle& h) {
  Fd sock(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (sock.get() < 0) throw std::runtime_error(std::string("pyalloc: socket() failed: ") + std::strerror(errno));
  Served out;
  auto fail = [&](const std::string& why) {
    throw std::runtime_error("pyalloc: opening CUDA memory shared by process " + std::to_string(h.pid) +
                             " failed: " + why);
  };
  set_timeouts(sock.get());
  socklen_t len = 0;
  std::string dir = ipc_dir();
  if (h.format == kPagesFormatFile && dir.empty())
    fail("it serves its pages from a socket file in its PYALLOC_IPC_DIR; set PYALLOC_IPC_DIR in this "
         "process too, to the same directory as this process sees it");
  sockaddr_un a = h.format == kPagesFormatFile ? file_address(dir, h.socket, &len)
                                                : abstract_address(h.socket, &len);
  if (::connect(sock.get(), reinterpret_cast<sockaddr*>(&a), len) != 0) {
    std::string why = std::string("its pyalloc does not answer (") + std::strerror(errno) + "): ";
    if (h.format == kPagesFormatFile)
      fail(why + "the process has exited, or its PYALLOC_IPC_DIR is not the directory " + dir +
           " of this process");
    fail(why + "the process has exited, or runs in another network namespace (another container), "
               "whose abstract sockets this one cannot reach: set PYALLOC_IPC_DIR, in both processes, "
               "to a directory both see (a shared volume or /dev/shm), to share through a socket file there");
  }
  if (!send_all(sock.get(), std::string(reinterpret_cast<const char*>(&h.id), sizeof(h.id))))
    fail("the request could not be sent");
  int32_t status = 0;
  uint32_t n = 0;
  if (!recv_all(sock.get(), &status, sizeof(status)) || !recv_all(sock.get(), &n, sizeof(n))) fail("no answer");
  if (status != kServed) {
    std::string message(n, '\0');
    if (n > 0 && !recv_all(sock.get(), &message[0], n)) message = "refused";
    fail(message);
  }
  if (n != h.handles) fail("it answered with another number of handles");
  out.sizes.resize(n);
  if (!recv_all(sock.get(), out.sizes.data(), sizeof(uint64_t) * n)) fail("the answer was cut short");
  std::vector<int> fds;
  bool arrived = true;
  while (arrived && fds.size() < n)
    arrived = recv_fds(sock.get(), std::min<size_t>(kFdsPerMessage, n - fds.size()), &fds);
  for (int fd : fds) out.fds.emplace_back(fd);  // owned, closed on every path from here
  if (!arrived) fail("its descriptors did not arrive");
  for (uint64_t size : out.sizes) out.total += size;
  if (out.fds.size() != n || out.total != h.bytes)
    throw std::runtime_error("pyalloc: the pages served for a CUDA IPC handle do not match it");
  return out;
}

// Imports the pages served, maps them side by side in a range of their
// size, and makes it accessible. In relaxed capture mode: a consumer thread
// may open tensors while another captures a graph, and retaining a context,
// importing, reserving and mapping in the default global mode would
// invalidate that capture (as pyalloc's pools grow during one: capture.h).
void map_pages(Mapping* m, Served& pages) {
  const Driver& d = driver();
  RelaxedCaptureMode relaxed(d);
  ContextGuard g(d, primary_context(driver(), m->device));
  size_t n = pages.fds.size();
  m->bytes = pages.total;
  CUresult r = CUDA_SUCCESS;
  const char* step = "cuMemImportFromShareableHandle";
  for (size_t i = 0; i < n && r == CUDA_SUCCESS; ++i) {
    CUmemGenericAllocationHandle ph = 0;
    r = d.MemImportFromShareableHandle(&ph, reinterpret_cast<void*>(static_cast<intptr_t>(pages.fds[i].get())),
                                       CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (r == CUDA_SUCCESS) m->pages.emplace_back(ph, pages.sizes[i]);
  }
  pages.fds.clear();  // closed: the imported handles keep the memory
  uint64_t total = pages.total;
  size_t mapped = 0;
  if (r == CUDA_SUCCESS) {
    step = "cuMemAddressReserve";
    CUdeviceptr va = 0;
    r = d.MemAddressReserve(&va, total, 0, 0, 0);
    m->base = r == CUDA_SUCCESS ? static_cast<uintptr_t>(va) : 0;
  }
  for (uintptr_t at = m->base; r == CUDA_SUCCESS && mapped < m->pages.size(); ++mapped) {
    step = "cuMemMap";
    r = d.MemMap(static_cast<CUdeviceptr>(at), m->pages[mapped].second, 0, m->pages[mapped].first, 0);
    if (r != CUDA_SUCCESS) break;
    at += m->pages[mapped].second;
  }
  if (r == CUDA_SUCCESS) {
    step = "cuMemSetAccess";
    CUdevice dev = 0;
    r = d.DeviceGet(&dev, m->device);
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = dev;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (r == CUDA_SUCCESS) r = d.MemSetAccess(static_cast<CUdeviceptr>(m->base), total, &access, 1);
  }
  if (r != CUDA_SUCCESS) {
    unmap_pages(d, m, mapped);
    throw std::runtime_error(std::string("pyalloc: opening shared CUDA pages failed: ") + step + ": " +
                             error_name(r));
  }
}

// Unmaps m once the device is done with it. The receiver's kernels may still
// use the memory when its last tensor dies (`y = model(t); del t`), and
// cuMemUnmap and cuMemRelease do not wait for them in all cases: PyTorch
// synchronizes the device before it unmaps imported pages (ExpandableSegment::
// unmapHandles, with no stream of its own). cuIpcCloseMemHandle is documented
// to wait no more, so a legacy handle waits too (PyTorch's closes at once):
// closing unmaps the range from this process, and a kernel of the receiver's
// still reading it would fault (an illegal address, sticky for the context).
// A failed wait leaves m mapped: the memory may still be in use. It runs
// without mappings_mu (unmap_closed()): other opens and closes do not wait
// behind the device's work.
void unmap(Mapping* m) {
  if (m->fake) return;
  const Driver& d = driver();
  ContextGuard g(d, primary_context(driver(), m->device));
  CUresult done = d.CtxSynchronize();
  if (done != CUDA_SUCCESS)
    throw std::runtime_error(
        "pyalloc: waiting for the device before unmapping CUDA memory opened from another process "
        "failed: cuCtxSynchronize: " + error_name(done) + "; the memory stays mapped");
  if (m->legacy) {
    CUresult r = d.IpcCloseMemHandle(static_cast<CUdeviceptr>(m->base));
    if (r != CUDA_SUCCESS)
      throw std::runtime_error("pyalloc: closing a CUDA IPC handle failed: cuIpcCloseMemHandle: " +
                               error_name(r));
    return;
  }
  unmap_pages(d, m, m->pages.size());
}

// Unmaps m, unless a CUDA graph capture is underway in the process: then
// false, and m stays mapped until unmap_deferred() after the capture, since
// cuIpcCloseMemHandle, cuMemUnmap and cuMemRelease during one break it in
// CUDA's default (global) capture mode, from any thread. The pools' capture
// trackers say (a CUDA device's is the process's); a process without pools
// has neither declared nor seen one. The wait for the device runs inside the
// tracker's check too: cuCtxSynchronize during another thread's capture breaks
// it as well, so a capture's declaration waits for it (DevicePools::quiesce).
bool unmap_unless_capturing(Mapping* m) {
  std::vector<DevicePools*> all = PoolRegistry::instance().all();
  if (all.empty()) {
    unmap(m);
    return true;
  }
  for (DevicePools* p : all)
    if (p->capture_underway()) return false;
  return all.front()->unless_capture_underway([&] { unmap(m); });
}

size_t deferred_unmaps = 0;  // mappings closed (uses == 0), not yet unmapped; under mappings_mu

using MappingIt = std::map<std::string, Mapping>::iterator;

// Unmaps the mappings closed (uses == 0) that no other thread is unmapping,
// with mappings_mu released during the unmaps: each waits for the whole device
// first (unmap()), and every open and close of the process takes mappings_mu.
// Marked `unmapping`, they stay in the tables meanwhile, so an open of one of
// them waits for its end (find_settled()) rather than map its handle twice.
// They are unmapped unless a capture is underway (then they all wait for
// unmap_deferred()), and erased once unmapped, or once their unmap failed:
// own's failure is thrown, another's said on stderr (its memory is not
// reachable through pyalloc any more either way).
void unmap_closed(std::unique_lock<std::mutex>& lock, MappingIt own) {
  if (deferred_unmaps == 0) return;
  std::vector<MappingIt> closed;
  for (auto it = by_handle().begin(); it != by_handle().end(); ++it)
    if (it->second.uses == 0 && !it->second.unmapping) closed.push_back(it);
  if (closed.empty()) return;
  for (MappingIt it : closed) it->second.unmapping = true;
  std::vector<uintptr_t> bases;  // unmap() clears them
  for (MappingIt it : closed) bases.push_back(it->second.base);
  std::vector<bool> gone(closed.size(), false);
  std::exception_ptr own_failure;
  lock.unlock();
  for (size_t i = 0; i < closed.size(); ++i) {
    try {
      if (!unmap_unless_capturing(&closed[i]->second)) break;  // still capturing: all of them wait
    } catch (const std::exception& e) {
      if (closed[i] == own) own_failure = std::current_exception();
      else
        std::fprintf(stderr, "pyalloc: unmapping CUDA memory opened from another process failed: %s\n",
                     e.what());
    } catch (...) {  // the tables must be put right whatever was thrown
      if (closed[i] == own) own_failure = std::current_exception();
    }
    gone[i] = true;
  }
  lock.lock();
  for (size_t i = 0; i < closed.size(); ++i) {
    closed[i]->second.unmapping = false;
    if (!gone[i]) continue;
    deferred_unmaps--;
    by_base().erase(bases[i]);
    by_handle().erase(closed[i]);
  }
  unmapping_done.notify_all();
  if (own_failure) std::rethrow_exception(own_failure);
}

// Under mappings_mu: the mapping of handle (or end()), once no thread is
// unmapping it.
MappingIt find_settled(std::unique_lock<std::mutex>& lock, const std::string& handle) {
  for (;;) {
    auto it = by_handle().find(handle);
    if (it == by_handle().end() || !it->second.unmapping) return it;
    unmapping_done.wait(lock);
  }
}

}  // namespace

std::string fake_token(uintptr_t base) {
  std::string t(kFakeMagic, sizeof(kFakeMagic));
  put(&t, static_cast<uint32_t>(::getpid()));
  put(&t, static_cast<uint64_t>(base));
  t.resize(CU_IPC_HANDLE_SIZE, '\0');
  return t;
}

std::string share(DevicePools& pools, uintptr_t ptr, uint64_t* offset) {
  return Exports::instance().share(pools, ptr, offset);
}

uintptr_t open(int device, const std::string& handle) {
  if (handle.size() < 2)
    throw std::invalid_argument("pyalloc: an empty or truncated CUDA IPC handle (" +
                                std::to_string(handle.size()) + " bytes)");
  // One more use of a mapping already made.
  auto known_use = [&](std::unique_lock<std::mutex>& lock) -> uintptr_t {
    auto known = find_settled(lock, handle);
    if (known == by_handle().end()) return 0;
    if (known->second.uses++ == 0) deferred_unmaps--;  // closed during a capture: kept, used again
    return known->second.base;
  };
  {
    std::unique_lock<std::mutex> lock(mappings_mu);
    unmap_closed(lock, by_handle().end());
    if (uintptr_t base = known_use(lock)) return base;
  }
  // PyTorch before 2.2 sent the driver's 64 bytes alone; PyTorch reads any
  // handle of that length so, and no 'P' handle has it (kPagesHandleSize).
  bool raw = handle.size() == CU_IPC_HANDLE_SIZE;
  char type = raw ? kSegmentHandle : handle[1];
  // A newer version may change any kind's payload (PyTorch's own reader
  // refuses it too): say which version and kind came, and what is read.
  if (!raw && handle[0] > kHandleVersion)
    throw std::invalid_argument(
        "pyalloc: a CUDA IPC handle of a newer layout: version " + std::to_string(int(handle[0])) +
        " of kind '" + std::string(1, type) + "', where pyalloc reads versions up to " +
        std::to_string(int(kHandleVersion)) +
        ". The process that shared it runs a newer PyTorch or pyalloc than this pyalloc knows; "
        "share it from a process whose PyTorch writes version " + std::to_string(int(kHandleVersion)) +
        " handles, or update pyalloc");
  std::string token = raw ? handle : handle.substr(2);
  Served pages;
  if (type == kSegmentHandle) {
    if (token.size() != CU_IPC_HANDLE_SIZE)
      throw std::invalid_argument("pyalloc: a CUDA IPC handle of a segment must hold 64 bytes, not " +
                                  std::to_string(token.size()));
  } else if (type == kPagesHandle) {
    PagesHandle h = decode_pages(handle);
    const Driver& d = driver();
    if (!d.has_vmm() || !d.has_shareable_handles())
      throw std::runtime_error(
          "pyalloc: the CUDA driver cannot import shared pages (no cuMemImportFromShareableHandle)");
    pages = fetch_pages(h);  // no lock held: it talks to the sender
  } else if (type == kExpandableHandle) {
    throw std::invalid_argument(
        "pyalloc cannot open this CUDA tensor: it was shared by a process whose PyTorch allocator "
        "uses expandable segments, whose handles only PyTorch's own allocator opens (with "
        "pidfd_getfd). Share it from a process running pyalloc, or with expandable_segments:False");
  } else {
    throw std::invalid_argument(std::string("pyalloc: an unknown kind of CUDA IPC handle ('") + type + "')");
  }
  std::unique_lock<std::mutex> lock(mappings_mu);
  // Opened by another thread meanwhile: its mapping (the pages fetched are closed).
  if (uintptr_t base = known_use(lock)) return base;
  Mapping m;
  m.device = device;
  if (type == kPagesHandle) map_pages(&m, pages);
  else if (PoolRegistry::instance().fake()) open_fake(&m, token);
  else open_legacy(&m, token);
  m.uses = 1;
  uintptr_t base = m.base;
  by_base()[base] = handle;
  by_handle().emplace(handle, std::move(m));
  return base;
}

void close(uintptr_t ptr) {
  std::unique_lock<std::mutex> lock(mappings_mu);
  auto b = by_base().find(ptr);
  auto it = b == by_base().end() ? by_handle().end() : by_handle().find(b->second);
  if (it == by_handle().end() || it->second.uses == 0)
    throw std::invalid_argument("pyalloc: " + format_ptr(ptr) +
                                " is no CUDA memory opened from another process");
  if (--it->second.uses > 0) return;
  // Unmapped now with the others closed, unless a capture is underway: then
  // they wait, closed, for its end (unmap_deferred()).
  deferred_unmaps++;
  unmap_closed(lock, it);
}

void unmap_deferred() {
  std::unique_lock<std::mutex> lock(mappings_mu);
  unmap_closed(lock, by_handle().end());
}

void set_process_id_for_tests(uint32_t pid) { pid_for_tests.store(pid, std::memory_order_relaxed); }

namespace detail {
std::atomic<size_t> exports{0};
void forget(int device, uintptr_t ptr) { Exports::instance().forget(device, ptr); }
}  // namespace detail

Counts counts() {
  Counts c;
  Exports::instance().count(&c);
  std::lock_guard<std::mutex> g(mappings_mu);
  for (const auto& [handle, m] : by_handle()) {
    c.mappings++;
    c.mapped_bytes += m.bytes;
  }
  c.deferred_unmaps = deferred_unmaps;
  return c;
}

}  // namespace ipc
}  // namespace pyalloc
