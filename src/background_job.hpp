// One job at a time on a thread of its own: what lets the training loop go on while a checkpoint's files
// are written (train.cpp).
// start() first waits for the job before it, so jobs run one after another in the order they were
// started and at most one is in flight (and at most one set of the host copies it writes). An exception
// a job throws is kept and rethrown by the next wait() or start(), on the caller's thread, so a failed
// write stops the run as a synchronous one would, only up to a step later. The destructor waits for a
// job still running (its error is dropped then: the destructor runs while another exception unwinds, or
// after the owner chose not to wait).

#pragma once
#include <exception>
#include <functional>
#include <thread>

namespace coda {

class BackgroundJob {
 public:
  BackgroundJob() = default;
  ~BackgroundJob();
  BackgroundJob(const BackgroundJob&) = delete;
  BackgroundJob& operator=(const BackgroundJob&) = delete;

  // Waits for the previous job (rethrowing its error), then runs job on a new thread.
  void start(std::function<void()> job);
  // Returns when no job is running; rethrows the error of the last one, if it failed.
  void wait();

 private:
  std::thread thread_;
  std::exception_ptr error_;
};

}  // namespace coda
