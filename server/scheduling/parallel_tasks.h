// A fixed set of threads that run the parts of one job at a time in parallel, the calling thread
// taking part. The GPU worker runs its host copies on them (received bytes into pinned staging,
// pinned answers into answer buffers): one thread copies at a few GB/s, several reach the memory
// bandwidth.
#ifndef ATTNGRAD_SERVER_PARALLEL_TASKS_H_
#define ATTNGRAD_SERVER_PARALLEL_TASKS_H_

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace attngrad::server {

class ParallelTasks {
 public:
  // `threads` in all, the caller included (at least 1: then everything runs on the caller).
  explicit ParallelTasks(int threads);
  ~ParallelTasks();
  ParallelTasks(const ParallelTasks&) = delete;
  ParallelTasks& operator=(const ParallelTasks&) = delete;

  // Runs part(0) .. part(count - 1), each once, on the threads; returns when every part is done.
  // One Run at a time (the owner's thread calls it).
  void Run(std::size_t count, const std::function<void(std::size_t)>& part);

 private:
  void Helper();
  // Takes parts of the current run until none is left; returns how many it ran.
  std::size_t TakeParts(std::unique_lock<std::mutex>& lock);

  std::mutex mutex_;
  std::condition_variable work_;
  std::condition_variable finished_;
  const std::function<void(std::size_t)>* part_ = nullptr;
  std::size_t count_ = 0;
  std::size_t next_ = 0;
  std::size_t done_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace attngrad::server

#endif  // ATTNGRAD_SERVER_PARALLEL_TASKS_H_
