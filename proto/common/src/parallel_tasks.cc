// ParallelTasks: parts handed out under a mutex (they are large: megabytes of copying each).
#include "attngrad/common/parallel_tasks.h"

#include <algorithm>

namespace attngrad::common {

ParallelTasks::ParallelTasks(int threads) {
  for (int i = 1; i < std::max(1, threads); ++i)
    threads_.emplace_back(&ParallelTasks::Helper, this);
}

ParallelTasks::~ParallelTasks() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_.notify_all();
  for (std::thread& thread : threads_) thread.join();
}

int ParallelTasks::CopyThreads() {
  return static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 4u));
}

void ParallelTasks::RunNextPart(Job* job, std::unique_lock<std::mutex>& lock) {
  const std::size_t index = job->next++;
  if (job->next == job->count) jobs_.erase(std::find(jobs_.begin(), jobs_.end(), job));
  const std::function<void(std::size_t)>* part = job->part;
  lock.unlock();
  (*part)(index);
  lock.lock();
  // The job's caller may return (and the job end) as soon as the lock is released after this.
  if (++job->done == job->count) finished_.notify_all();
}

void ParallelTasks::Run(std::size_t count, const std::function<void(std::size_t)>& part) {
  if (count == 0) return;
  Job job;
  job.part = &part;
  job.count = count;
  std::unique_lock<std::mutex> lock(mutex_);
  jobs_.push_back(&job);
  if (count > 1) {
    lock.unlock();
    work_.notify_all();
    lock.lock();
  }
  while (job.next < job.count) RunNextPart(&job, lock);
  finished_.wait(lock, [&job] { return job.done == job.count; });
}

void ParallelTasks::Helper() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    work_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
    if (stopping_) return;
    RunNextPart(jobs_.front(), lock);
  }
}

}  // namespace attngrad::common
