// ParallelFor: runs fn(task) for task in [0, num_tasks) on up to num_threads threads (the calling
// thread included). Tasks are claimed dynamically, so each task must write only its own outputs;
// results then do not depend on the thread count.
#ifndef ATTNGRAD_KERNELS_CPU_PARALLEL_H_
#define ATTNGRAD_KERNELS_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

namespace attngrad::cpu {

inline int ResolveThreadCount(int requested) {
  if (requested > 0) return requested;
  const unsigned hardware = std::thread::hardware_concurrency();
  return hardware == 0 ? 1 : static_cast<int>(hardware);
}

template <typename Fn>
void ParallelFor(long long num_tasks, int num_threads, const Fn& fn) {
  if (num_tasks <= 0) return;
  const int workers = static_cast<int>(std::min<long long>(num_threads, num_tasks));
  std::atomic<long long> next{0};
  auto drain = [&] {
    for (long long task = next.fetch_add(1); task < num_tasks; task = next.fetch_add(1)) fn(task);
  };
  std::vector<std::thread> threads;
  threads.reserve(workers > 1 ? workers - 1 : 0);
  for (int i = 1; i < workers; ++i) threads.emplace_back(drain);
  drain();
  for (std::thread& thread : threads) thread.join();
}

}  // namespace attngrad::cpu

#endif  // ATTNGRAD_KERNELS_CPU_PARALLEL_H_
