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
#include <string>

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

// Open MPI's mpirun passes a Ctrl-C or SIGTERM on to the ranks as SIGTERM odls_base_sigkill_timeout
// seconds later (1 by default) and sends SIGKILL as long again after that, so a rank has that timeout to
// finish its step and write the checkpoint (measured with Open MPI 4.1: a gpt2-124m rank whose step takes
// longer was killed before it saved; with 60 s it saved and exited). Given the timeout as the ranks see
// it (OMPI_MCA_odls_base_sigkill_timeout, which both `--mca` and an exported variable set; null when
// neither did), the warning to log before training, or "" when it leaves kStopGraceSeconds.
constexpr int kStopGraceSeconds = 60;
std::string mpirun_stop_warning(const char* sigkill_timeout);

}  // namespace coda
