// common::ParallelTasks (attngrad/common/parallel_tasks.h): every part runs exactly once, also when
// several threads run jobs at once (the receiving threads' arrival copies share one set of
// helpers), and a run returns only when its parts are done.
#include "attngrad/common/parallel_tasks.h"

#include <atomic>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace attngrad::common {
namespace {

TEST(ParallelTasksTest, EveryPartRunsOnceBeforeRunReturns) {
  ParallelTasks tasks(4);
  std::vector<std::atomic<int>> runs(1000);
  tasks.Run(runs.size(), [&](std::size_t index) { runs[index].fetch_add(1); });
  for (std::size_t i = 0; i < runs.size(); ++i) EXPECT_EQ(runs[i].load(), 1) << "part " << i;
}

TEST(ParallelTasksTest, OneThreadRunsEverythingOnTheCaller) {
  ParallelTasks tasks(1);
  const std::thread::id caller = std::this_thread::get_id();
  int count = 0;
  tasks.Run(10, [&](std::size_t) {
    EXPECT_EQ(std::this_thread::get_id(), caller);
    ++count;
  });
  EXPECT_EQ(count, 10);
}

TEST(ParallelTasksTest, ConcurrentRunsEachGetExactlyTheirParts) {
  ParallelTasks tasks(3);
  constexpr int kCallers = 8;
  constexpr std::size_t kParts = 200;
  std::vector<std::vector<std::atomic<int>>> runs(kCallers);
  for (auto& parts : runs) parts = std::vector<std::atomic<int>>(kParts);
  std::vector<std::thread> callers;
  for (int caller = 0; caller < kCallers; ++caller) {
    callers.emplace_back([&, caller] {
      for (int round = 0; round < 20; ++round) {
        std::vector<std::atomic<int>>& parts = runs[static_cast<std::size_t>(caller)];
        tasks.Run(kParts, [&](std::size_t index) { parts[index].fetch_add(1); });
        // Returned: every part of this run is done (and none of another run was counted here).
        for (std::size_t i = 0; i < kParts; ++i) {
          ASSERT_EQ(parts[i].load(), round + 1) << "caller " << caller << " part " << i;
        }
      }
    });
  }
  for (std::thread& thread : callers) thread.join();
}

}  // namespace
}  // namespace attngrad::common
