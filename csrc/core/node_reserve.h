// Nodes made ahead for a node-based standard container (std::map,
// std::multiset), so that an operation of the allocator that has begun to
// change its state never allocates to list something: it takes a node made
// before (C++17 node handles) and, erasing, keeps the node for the next one.
// Host memory running out then fails the operation while nothing has changed
// yet (reserve(), at its start), never halfway.
#pragma once

#include <cstddef>
#include <iterator>
#include <utility>
#include <vector>

namespace pyalloc {

template <typename C>
class NodeReserve {
 public:
  using Node = typename C::node_type;

  /// At least n nodes ready; throws std::bad_alloc with none lost.
  void reserve(size_t n) {
    if (nodes_.size() >= n) return;
    nodes_.reserve(n);
    C scratch;
    while (nodes_.size() < n) {
      scratch.emplace();
      nodes_.push_back(scratch.extract(scratch.begin()));
    }
  }
  size_t ready() const { return nodes_.size(); }

  /// c[key] = value (std::map) in a node made ahead if there is one.
  template <typename K, typename V>
  void put(C& c, const K& key, const V& value) {
    if (auto it = c.find(key); it != c.end()) {
      it->second = value;
      return;
    }
    if (nodes_.empty()) {  // not reserved for: may throw, nothing changed
      c.emplace(key, value);
      return;
    }
    Node n = std::move(nodes_.back());
    nodes_.pop_back();
    n.key() = key;
    n.mapped() = value;
    c.insert(std::move(n));
  }
  /// Inserts value (std::multiset) in a node made ahead if there is one.
  template <typename K>
  void add(C& c, const K& value) {
    if (nodes_.empty()) {
      c.insert(value);
      return;
    }
    Node n = std::move(nodes_.back());
    nodes_.pop_back();
    n.value() = value;
    c.insert(std::move(n));
  }
  /// erase() of key's entry, if any.
  template <typename K>
  void erase_key(C& c, const K& key) {
    if (auto it = c.find(key); it != c.end()) erase(c, it);
  }
  /// Erases it, keeping its node while there is room made for it; the next.
  typename C::iterator erase(C& c, typename C::iterator it) {
    auto next = std::next(it);
    if (nodes_.size() < nodes_.capacity()) nodes_.push_back(c.extract(it));
    else c.erase(it);
    return next;
  }

 private:
  std::vector<Node> nodes_;
};

}  // namespace pyalloc
