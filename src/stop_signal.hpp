// A graceful stop of the training loop on SIGINT (Ctrl-C) or SIGTERM (a scheduler's or kill's default).
//
// While a StopOnSignal lives, the first of these signals only records which one came (pending()) and
// says on stderr that the run stops after the current step; the loop polls pending() once per step,
// writes a checkpoint and returns, and the entry point exits with 128 + the signal (130, 143). A second
// signal cannot wait: the handler restores the default action and raises it again, so the process ends
// at once as an unhandled signal would. The destructor restores the handlers that were there before, so
// code that calls train() in-process (the tests) keeps its own behaviour outside the loop.
#pragma once
#include <csignal>

namespace coda {

class StopOnSignal {
 public:
  StopOnSignal();
  ~StopOnSignal();
  StopOnSignal(const StopOnSignal&) = delete;
  StopOnSignal& operator=(const StopOnSignal&) = delete;

  // The first signal received since construction (SIGINT or SIGTERM), 0 when none.
  int pending() const;

 private:
  struct sigaction previous_int_ {}, previous_term_ {};
};

// The name a user knows a stop signal by: "SIGINT", "SIGTERM".
const char* stop_signal_name(int signal);

}  // namespace coda
