// Parsing and validating the allocator configuration: see config.h.
#include "config.h"

#include <cctype>
#include <cmath>
#include <cstdint>
#include <stdexcept>

#include "common.h"

namespace pyalloc {
namespace {

struct Key {
  const char* name;
  size_t Config::*field;  // null: a key with its own parser (strategy)
};

const Key kKeys[] = {
    {"strategy", nullptr},
    {"pool_size", &Config::pool_size},
    {"max_pool_size", &Config::max_pool_size},
    {"segment_size", &Config::segment_size},
    {"small_size", &Config::small_size},
    {"small_chunk_size", &Config::small_chunk_size},
    {"max_split_size", &Config::max_split_size},
};

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) b++;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) e--;
  return s.substr(b, e - b);
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string valid_keys_text() {
  std::string out;
  for (const std::string& k : config_keys()) out += (out.empty() ? "" : ", ") + k;
  return out;
}

Strategy parse_strategy(const std::string& value) {
  std::string v = lower(value);
  if (v == "bestfit") return Strategy::kBestFit;
  if (v == "vmm") return Strategy::kVmm;
  throw std::invalid_argument("'" + value + "' is not a strategy (use bestfit or vmm)");
}

}  // namespace

const char* strategy_name(Strategy s) { return s == Strategy::kVmm ? "vmm" : "bestfit"; }

const std::vector<std::string>& config_keys() {
  static const std::vector<std::string> keys = [] {
    std::vector<std::string> k;
    for (const Key& key : kKeys) k.push_back(key.name);
    return k;
  }();
  return keys;
}

size_t parse_size(const std::string& raw) {
  std::string text = trim(raw);
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.'))
    i++;
  std::string number = text.substr(0, i);
  std::string unit = lower(trim(text.substr(i)));
  if (number.empty() || number == "." || number.find('.') != number.rfind('.'))
    throw std::invalid_argument("'" + raw + "' is not a size (expected e.g. 4096, 512MiB, 2GiB)");
  double shift = 0;
  if (unit.empty() || unit == "b") shift = 0;
  else if (unit == "k" || unit == "kb" || unit == "kib") shift = 10;
  else if (unit == "m" || unit == "mb" || unit == "mib") shift = 20;
  else if (unit == "g" || unit == "gb" || unit == "gib") shift = 30;
  else if (unit == "t" || unit == "tb" || unit == "tib") shift = 40;
  else
    throw std::invalid_argument("'" + raw + "' has an unknown unit '" + unit +
                                "' (use B, KiB, MiB, GiB or TiB)");
  double value = std::stod(number) * std::ldexp(1.0, static_cast<int>(shift));
  if (!(value < std::ldexp(1.0, 60)))
    throw std::invalid_argument("'" + raw + "' is too large a size");
  if (value != std::floor(value))
    throw std::invalid_argument("'" + raw + "' is not a whole number of bytes");
  return static_cast<size_t>(value);
}

Config parse_config(const std::string& text, Config base) {
  Config cfg = base;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    if (comma == std::string::npos) comma = text.size();
    std::string item = trim(text.substr(pos, comma - pos));
    pos = comma + 1;
    if (item.empty()) continue;
    size_t colon = item.find(':');
    if (colon == std::string::npos)
      throw std::invalid_argument("config item '" + item +
                                  "' is not of the form key:value; valid keys: " +
                                  valid_keys_text());
    std::string key = trim(item.substr(0, colon));
    std::string value = trim(item.substr(colon + 1));
    const Key* found = nullptr;
    for (const Key& k : kKeys)
      if (key == k.name) found = &k;
    if (found == nullptr)
      throw std::invalid_argument("unknown config key '" + key + "'; valid keys: " +
                                  valid_keys_text());
    try {
      if (found->field == nullptr) cfg.strategy = parse_strategy(value);
      else cfg.*(found->field) = parse_size(value);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument("bad value for config key '" + key + "': " + e.what());
    }
  }
  cfg.validate();
  return cfg;
}

void Config::validate() const {
  auto fail = [](const std::string& why) { throw std::invalid_argument("bad config: " + why); };
  if (max_pool_size != 0 && pool_size > max_pool_size)
    fail("pool_size (" + format_bytes(pool_size) + ") is larger than max_pool_size (" +
         format_bytes(max_pool_size) + ")");
  if (small_chunk_size < kGranularity || small_chunk_size % kGranularity != 0)
    fail("small_chunk_size must be a positive multiple of 512 bytes");
  if (small_size % kGranularity != 0)
    fail("small_size must be a multiple of 512 bytes (0: no small pool)");
  if (small_size > small_chunk_size)
    fail("small_size (" + format_bytes(small_size) + ") must not exceed small_chunk_size (" +
         format_bytes(small_chunk_size) + ")");
  if (segment_size == 0) fail("segment_size must be positive");
  if (max_split_size != 0 && max_split_size <= small_size)
    fail("max_split_size must be larger than small_size (" + format_bytes(small_size) + ")");
}

std::string Config::to_string() const {
  std::string out;
  for (const Key& k : kKeys)
    out += (out.empty() ? "" : ",") + std::string(k.name) + ":" +
           (k.field == nullptr ? std::string(strategy_name(strategy)) : std::to_string(this->*(k.field)));
  return out;
}

}  // namespace pyalloc
