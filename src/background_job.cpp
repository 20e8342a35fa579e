// BackgroundJob (see background_job.hpp). error_ is written by the job's thread and read only after
// join(), which orders the two.
#include "background_job.hpp"

#include <utility>

namespace coda {

BackgroundJob::~BackgroundJob() {
  if (thread_.joinable()) thread_.join();
}

void BackgroundJob::start(std::function<void()> job) {
  wait();
  thread_ = std::thread([this, job = std::move(job)] {
    try {
      job();
    } catch (...) {
      error_ = std::current_exception();
    }
  });
}

void BackgroundJob::wait() {
  if (thread_.joinable()) thread_.join();
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

}  // namespace coda
