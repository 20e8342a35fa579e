// Signal handlers of StopOnSignal (see stop_signal.hpp). The handler touches only a sig_atomic_t and
// calls async-signal-safe functions (write, sigaction, raise).
#include "stop_signal.hpp"

#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace coda {

namespace {

volatile std::sig_atomic_t g_pending = 0;

void write_stderr(const char* text) {
  const ssize_t ignored = ::write(STDERR_FILENO, text, std::strlen(text));
  (void)ignored;
}

void on_stop_signal(int signal) {
  if (g_pending != 0) {
    write_stderr("\nsecond stop signal: aborting now, without a checkpoint\n");
    struct sigaction action {};
    action.sa_handler = SIG_DFL;
    sigemptyset(&action.sa_mask);
    ::sigaction(signal, &action, nullptr);
    ::raise(signal);
    return;
  }
  g_pending = signal;
  write_stderr(signal == SIGINT ? "\nSIGINT: stopping after this step with a checkpoint (again to abort now)\n"
                                : "\nSIGTERM: stopping after this step with a checkpoint (again to abort now)\n");
}

}  // namespace

StopOnSignal::StopOnSignal() {
  g_pending = 0;
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // reads and writes in progress continue rather than fail with EINTR
  ::sigaction(SIGINT, &action, &previous_int_);
  ::sigaction(SIGTERM, &action, &previous_term_);
}

StopOnSignal::~StopOnSignal() {
  ::sigaction(SIGINT, &previous_int_, nullptr);
  ::sigaction(SIGTERM, &previous_term_, nullptr);
}

int StopOnSignal::pending() const { return g_pending; }

const char* stop_signal_name(int signal) {
  return signal == SIGINT ? "SIGINT" : signal == SIGTERM ? "SIGTERM" : "signal";
}

std::string mpirun_stop_warning(const char* sigkill_timeout) {
  char* end = nullptr;
  const long seconds = sigkill_timeout != nullptr ? std::strtol(sigkill_timeout, &end, 10) : 1;
  const bool parsed = sigkill_timeout == nullptr || (end != sigkill_timeout && *end == '\0');
  if (parsed && seconds >= kStopGraceSeconds) return "";
  return std::string("Open MPI's mpirun gives the ranks ") +
         (parsed ? std::to_string(seconds) + " s" : "an unreadable time (odls_base_sigkill_timeout = " +
                                                        std::string(sigkill_timeout) + ")") +
         " between passing on a Ctrl-C or SIGTERM and killing them, too little to finish the step and write a "
         "checkpoint: start it with `mpirun --mca odls_base_sigkill_timeout " + std::to_string(kStopGraceSeconds) +
         " ...` (or export OMPI_MCA_odls_base_sigkill_timeout=" + std::to_string(kStopGraceSeconds) +
         "), or stop the run by signalling the ranks (pkill -TERM -f 'coda train'), which stop at once";
}

}  // namespace coda
