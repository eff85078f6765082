// Allocator configuration: the keys, their defaults, and the one parser for
// "key:value,key:value" strings (the PYTORCH_CUDA_ALLOC_CONF style, also
// PYALLOC_CONF). Sizes take bytes or a unit: KiB, MiB, GiB, TiB (KB, MB, GB,
// TB and K, M, G, T mean the same binary units, as in PyTorch).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace pyalloc {

enum class Strategy {
  kBestFit,  // segments from the backend; best fit, split, coalesce
  kVmm,      // one virtual range; physical pages mapped and unmapped as needed
};

struct Config {
  /// Placement strategy. "vmm" needs a backend with virtual memory; where
  /// the backend has none, the allocator falls back to "bestfit".
  Strategy strategy = Strategy::kVmm;
  /// Reserved from the backend when the allocator is created (0: lazily).
  size_t pool_size = 0;
  /// Never reserve more than this in total (0: as much as the device has).
  size_t max_pool_size = 0;
  /// The pool grows by at least this much at a time.
  size_t segment_size = size_t(20) << 20;
  /// Requests of at most this many bytes (rounded) use the small pool (0:
  /// no small pool; every request is served from the large pool).
  /// (Replay of the benchmark traces, against PyTorch's 1 MiB in 2 MiB chunks:
  /// 256 KiB in 512 KiB chunks needs a smaller or equal budget on every trace
  /// but one (+0.02%) under both strategies, and reserves less on all but one.)
  size_t small_size = size_t(256) << 10;
  /// The small pool takes memory from the large pool in chunks of this size.
  size_t small_chunk_size = size_t(512) << 10;
  /// Blocks of this size or more are never split (0: no limit), as PyTorch's
  /// max_split_size_mb.
  size_t max_split_size = 0;
  /// Never split a block: each allocation holds a free block whole, and the
  /// pool grows by exactly what a request needs (in segment units), as
  /// torch.cuda.MemPool(no_split=True). Strategy bestfit only; no key of
  /// its own: a pool's owner sets it (Allocator::set_no_split).
  bool no_split = false;

  /// Raises std::invalid_argument naming the bad setting.
  void validate() const;
  std::string to_string() const;
};

/// The valid keys, in documentation order.
const std::vector<std::string>& config_keys();

/// Applies "key:value,..." on top of `base`; throws std::invalid_argument
/// naming the bad key or value and listing the valid keys.
Config parse_config(const std::string& text, Config base = Config());

/// "2GiB" -> 2147483648; throws std::invalid_argument on anything else.
size_t parse_size(const std::string& text);

const char* strategy_name(Strategy s);

}  // namespace pyalloc
