// A fixed-partition parallel loop for the host code. Each index is handled by exactly
// one thread, so results never depend on the thread count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace mok::detail {

template <typename Body>  // Body(std::int64_t index)
void parallel_for(std::int64_t count, Body body) {
  const std::int64_t hw = std::max(1u, std::thread::hardware_concurrency());
  const std::int64_t workers = std::min<std::int64_t>(hw, count);
  if (workers <= 1) {
    for (std::int64_t i = 0; i < count; ++i) body(i);
    return;
  }
  std::exception_ptr error;
  std::mutex error_mutex;
  std::vector<std::thread> threads;
  threads.reserve(workers);
  for (std::int64_t w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      try {
        for (std::int64_t i = w; i < count; i += workers) body(i);  // interleaved: balances skew
      } catch (...) {
        std::lock_guard lock(error_mutex);
        if (!error) error = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace mok::detail
