#pragma once
// A map whose entries come and go one by one (blocks lent and come home, blocks received and let
// go of) keeps the node of the last entry it dropped and builds the next entry in it: no
// allocation per entry in the steady state.

#include <utility>

namespace forkpool::detail {

// Inserts (`key`, `value`), `key` being absent, into `map`, in `spare`'s node when it holds one.
template <class Map>
typename Map::iterator insert_reusing(Map& map, typename Map::node_type& spare, typename Map::key_type key,
                                      typename Map::mapped_type value) {
  if (spare.empty()) return map.emplace(std::move(key), std::move(value)).first;
  spare.key() = std::move(key);
  spare.mapped() = std::move(value);
  return map.insert(std::move(spare)).position;
}

}  // namespace forkpool::detail
