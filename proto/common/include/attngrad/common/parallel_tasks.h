// A fixed set of threads that run the parts of jobs in parallel, each calling thread taking part in
// its own job. The server's host copies of the GPU path run on them (received bytes into
// page-locked staging, by the GPU worker or by the receiving threads on arrival), and so do the
// client's decodes of large answers: one thread copies at a few GB/s, several reach the memory
// bandwidth.
#ifndef ATTNGRAD_COMMON_PARALLEL_TASKS_H_
#define ATTNGRAD_COMMON_PARALLEL_TASKS_H_

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace attngrad::common {

class ParallelTasks {
 public:
  // `threads` in all, a caller included (at least 1: then everything runs on the caller).
  explicit ParallelTasks(int threads);
  ~ParallelTasks();
  ParallelTasks(const ParallelTasks&) = delete;
  ParallelTasks& operator=(const ParallelTasks&) = delete;

  // Runs part(0) .. part(count - 1), each once, on the threads and the calling thread; returns
  // when every part is done. Several threads may call Run at once: the helper threads take parts
  // of the runs in the order they began, and every caller works on its own run's parts until none
  // is left, so no run waits for another to finish.
  void Run(std::size_t count, const std::function<void(std::size_t)>& part);

  // Threads for host copies: up to 4 (several reach the memory bandwidth), no more than the cores.
  static int CopyThreads();
  // The size of a copy's parts (a 4x1024 fp32 activation tensor of the SPEC layer is 12 parts).
  static constexpr std::size_t kCopyPartBytes = std::size_t{4} << 20;

 private:
  struct Job {
    const std::function<void(std::size_t)>* part = nullptr;
    std::size_t count = 0;
    std::size_t next = 0;  // the next part to take
    std::size_t done = 0;
  };

  void Helper();
  // Takes the next part of `job` (job->next < job->count), forgetting the job once its last part
  // is taken; runs it without the lock and counts it done. Called with the lock held.
  void RunNextPart(Job* job, std::unique_lock<std::mutex>& lock);

  std::mutex mutex_;
  std::condition_variable work_;
  std::condition_variable finished_;
  std::deque<Job*> jobs_;  // runs with parts not yet taken, in the order they began
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace attngrad::common

#endif  // ATTNGRAD_COMMON_PARALLEL_TASKS_H_
