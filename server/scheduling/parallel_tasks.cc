// ParallelTasks: parts handed out under a mutex (they are large: megabytes of copying each).
#include "scheduling/parallel_tasks.h"

#include <algorithm>

namespace attngrad::server {

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

std::size_t ParallelTasks::TakeParts(std::unique_lock<std::mutex>& lock) {
  std::size_t ran = 0;
  while (part_ != nullptr && next_ < count_) {
    const std::size_t index = next_++;
    const std::function<void(std::size_t)>* part = part_;
    lock.unlock();
    (*part)(index);
    lock.lock();
    ++ran;
    if (++done_ == count_) finished_.notify_all();
  }
  return ran;
}

void ParallelTasks::Run(std::size_t count, const std::function<void(std::size_t)>& part) {
  if (count == 0) return;
  std::unique_lock<std::mutex> lock(mutex_);
  part_ = &part;
  count_ = count;
  next_ = 0;
  done_ = 0;
  lock.unlock();
  work_.notify_all();
  lock.lock();
  TakeParts(lock);
  finished_.wait(lock, [this] { return done_ == count_; });
  part_ = nullptr;
}

void ParallelTasks::Helper() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    work_.wait(lock, [this] { return stopping_ || (part_ != nullptr && next_ < count_); });
    if (stopping_) return;
    TakeParts(lock);
  }
}

}  // namespace attngrad::server
