"""User-facing errors and the exit codes every twinrun command shares."""

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager

EXIT_OK = 0  # every validity check and gate passed
EXIT_GATE = 1  # a validity check or a no-op gate failed: the instrument is broken, effects withheld
EXIT_USAGE = 2  # bad config, bad input, damaged store: nothing was computed from it
EXIT_REFUSED = 3  # an absolute comparison across kernel paths, refused
EXIT_MODEL = 4  # the model (or other user code) raised mid-run: recorded in run.json, earlier bins kept
EXIT_DEVICE = 5  # the job's node lacks the device asked for (no GPU, cuda:N beyond the visible GPUs)
EXIT_DEVICE_MEMORY = 6  # the run does not fit the device's memory (estimated before the first unit, or OOM)
# What a failure recorded in run.json (its `error` field) means for the process that waits on the job.
FAILURE_EXIT_CODES = {"device": EXIT_DEVICE, "device_memory": EXIT_DEVICE_MEMORY, "determinism": EXIT_USAGE}
EXIT_INTERRUPTED = 130  # SIGINT (Ctrl-C): recorded in run.json as "interrupted"; resume continues
EXIT_TERMINATED = 143  # SIGTERM (scancel, kill): recorded as "interrupted"; resume continues
EXIT_PIPE_CLOSED = 141  # stdout's reader left early (`| head`): 128 + SIGPIPE, as coreutils' commands end


class TwinrunError(Exception):
    """A user mistake or unusable input: printed as one line, never as a traceback.

    Never made out of a signal: one made while a signal's Interrupted unwinds (see `signal_in`) raises
    that Interrupted instead, so no `except TwinrunError` that records a failure in run.json, or goes on
    past one point's error to the next, can swallow a signal or give it another exit code."""

    exit_code = EXIT_USAGE

    def __init__(self, *args):
        raise_signal_in(sys.exc_info()[1])
        super().__init__(*args)


class ModelError(TwinrunError):
    """The model or other user code raised inside a measurement; the message names arm, bin and cause."""

    exit_code = EXIT_MODEL


class DeviceError(TwinrunError):
    """The node a job runs on lacks the device the run asks for: found in the job, before any unit."""

    exit_code = EXIT_DEVICE

    @property
    def record(self) -> dict:
        """run.json's failure fields (the waiting launcher then reports exit 5)."""
        return {"error": "device"}


class DeviceMemoryError(TwinrunError):
    """The run does not fit the device's memory: the estimate over the free memory before the first
    unit, or the device ran out of memory during one; the message names the estimate and the knobs."""

    exit_code = EXIT_DEVICE_MEMORY

    @property
    def record(self) -> dict:
        """run.json's failure fields (the waiting launcher then reports exit 6)."""
        return {"error": "device_memory"}


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived: run.json records "interrupted"; resuming continues from the finished
    bins.

    A BaseException, like KeyboardInterrupt, not a TwinrunError: the broad `except Exception` around user
    code (a builder, the trial, a model) and every `except TwinrunError` that turns a point's error into
    its exit code must let it through, or a signal would be swallowed or become exit 2 or 4."""

    def __init__(self, exit_code: int, detail: str = "finished units (bins, segments) are kept: resume with "
                 "`python -m twinrun.resume RUN_DIR`"):
        name = "SIGINT" if exit_code == EXIT_INTERRUPTED else "SIGTERM"
        super().__init__(f"interrupted by {name}; {detail}")
        self.exit_code, self.detail = exit_code, detail


def signal_in(err: BaseException | None) -> Interrupted | None:
    """The Interrupted a signal raised, if `err` is what its unwinding turned into; else None.

    Python raises a signal's Interrupted at whatever bytecode the main thread is on, inside a library
    too. A library's cleanup (a `finally`, an `__exit__`) may then fail on its half-done state and raise
    its own error in the Interrupted's place: OmegaConf does in about 5% of signals that land inside a
    merge (an AttributeError from a half-set flag, an UnboundLocalError), and then wraps it in one of its
    own errors. What happened is the signal, so every handler that records, converts or carries on past
    an error asks this first. Python keeps the replaced exception as `__context__` (`raise ... from None`
    only hides it from tracebacks), so the chain says it."""
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        if isinstance(e, Interrupted):
            return e
        seen.add(id(e))
        todo += [e.__context__, e.__cause__]
    return None


def raise_signal_in(err: BaseException | None) -> None:
    """Raise (a copy of) the Interrupted that `err` unwound from, if any (`signal_in`)."""
    found = signal_in(err)
    if found is not None:
        raise Interrupted(found.exit_code, found.detail) from None


@contextmanager
def signal_first():
    """Around a command's work: an error that a signal's unwinding turned into leaves as that signal
    (exit 130 / 143, run.json "interrupted"), never as a traceback or another exit code."""
    try:
        yield
    except Exception as err:
        raise_signal_in(err)
        raise


SIGNAL_EXIT = {signal.SIGINT: EXIT_INTERRUPTED, signal.SIGTERM: EXIT_TERMINATED}


def raise_on_signals() -> None:
    """In an entry point's main thread: SIGINT and SIGTERM raise Interrupted (exit 130 / 143) wherever the
    main thread is. Python runs the handler at its next bytecode, so the wait is the C call it is in (one
    probe chunk, one read of the reducer's pass); docs/exit-codes.md gives the measured bound."""

    def _raise(signum, frame):
        raise Interrupted(SIGNAL_EXIT[signum])

    if threading.current_thread() is threading.main_thread():
        for signum in SIGNAL_EXIT:
            signal.signal(signum, _raise)
        if not isinstance(sys.unraisablehook, _Redeliver):
            sys.unraisablehook = _Redeliver(sys.unraisablehook)


class _Redeliver:
    """sys.unraisablehook: a signal's Interrupted raised where Python cannot propagate it (a finalizer, a
    gc callback, as hypothesis installs: "Exception ignored in ...") is sent to the main thread again, so its
    handler raises it once the finalizer is done; without this the signal would be lost and the run would
    go on until SLURM's SIGKILL. Any other unraisable goes to the hook that was there before."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, unraisable) -> None:
        found = signal_in(unraisable.exc_value)
        if found is None:
            self.previous(unraisable)
            return
        signum = next(s for s, code in SIGNAL_EXIT.items() if code == found.exit_code)
        # Sent from another thread a moment later, not raised here: the handler runs at the main thread's
        # next bytecode, which inside this hook would be one more place Python swallows it. If it lands in
        # a finalizer again, this hook sends it again.
        main = threading.main_thread().ident
        try:
            threading.Thread(target=_send_later, args=(main, signum), daemon=True).start()
        except RuntimeError:  # the interpreter is shutting down: it ends anyway, and says why
            self.previous(unraisable)


def _send_later(thread_id: int, signum: int) -> None:
    time.sleep(REDELIVER_DELAY_S)
    signal.pthread_kill(thread_id, signum)


REDELIVER_DELAY_S = 0.005  # past the hook's return (microseconds); far below any SLURM grace period


@contextmanager
def signals_held(unfinished: str):
    """SIGINT and SIGTERM wait until the block ends, then act as the handlers before it say: for the few
    milliseconds that write a run's plan (its arm configs, then run.json), so a signal leaves either no
    run or a planned one that resumes, never arm configs without their run.json (seen once in 20
    planning-phase SIGINTs). Handlers, not a signal mask: the kernel hands a process's signal to any
    thread not masking it, and torch's threads do not.

    The first signal acts (a second one is the same request). If the block itself fails while a signal
    waits, the signal still ends the process (Interrupted, never swallowed by a sweep that goes on past a
    point's error) and its line says `unfinished` and the error. Once the block ends the holding handlers
    hand any signal straight to the handlers before them, so one that lands while they are put back is
    acted on, not lost."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught, holding, previous = [], [True], {}

    def hold(signum, frame):
        if holding[0]:
            caught.append(signum)
        else:
            _deliver(signum, previous[signum], frame)

    for signum in SIGNAL_EXIT:
        previous[signum] = signal.signal(signum, hold)
    try:
        yield
    except BaseException as err:
        holding[0] = False
        _restore(previous)
        if caught and not isinstance(err, Interrupted):
            raise Interrupted(SIGNAL_EXIT[caught[0]], f"{unfinished} ({type(err).__name__}: {err})") from err
        raise
    holding[0] = False
    _restore(previous)
    if caught:
        signal.raise_signal(caught[0])  # the handler before the block acts now (raises Interrupted, or ends)


def _deliver(signum: int, handler, frame) -> None:
    """Hand a signal to the handler that was in place before signals_held."""
    if callable(handler):
        handler(signum, frame)
    else:  # SIG_DFL or SIG_IGN: put it back and let the signal do what it does
        signal.signal(signum, handler)
        signal.raise_signal(signum)


def _restore(previous: dict) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def exit_on_signals() -> None:
    """Before an entry point's heavy imports (torch, Hydra: seconds): a signal then ends the process at
    once, one line and exit 130 / 143, not a KeyboardInterrupt traceback from inside an import. The
    entry point replaces these with `raise_on_signals` once it runs.

    os._exit, not SystemExit: an exception raised inside an import leaves that module half-initialised,
    and the interpreter's shutdown then touched half-imported numpy and died in a RecursionError traceback
    with exit 1 (seen once in 40 SIGTERMs at start-up). Nothing was written yet, so nothing needs cleanup."""

    def _exit(signum, frame):
        print(f"twinrun: error: {Interrupted(SIGNAL_EXIT[signum], 'nothing was started')}", file=sys.stderr)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said there
                pass
        os._exit(SIGNAL_EXIT[signum])

    if threading.current_thread() is threading.main_thread():
        for signum in SIGNAL_EXIT:
            signal.signal(signum, _exit)


def exit_as_command(main) -> None:
    """Run a read-only command's `main` as the process. A reader that closes the pipe early
    (`python -m twinrun.compare A B | head`) ends the command quietly with 141, as `cat` and `ls` end,
    not in a BrokenPipeError traceback: what was printed reached the reader that wanted it, and these
    commands write nothing a run reads, so nothing is left half-done."""
    try:
        try:
            with signal_first():
                code = main()
        except Interrupted as err:  # an error a signal's unwinding became, left past main's own handlers
            fail(err)
        finally:  # argparse's --help ends in SystemExit: its buffered text still has to reach the pipe
            sys.stdout.flush()  # the last lines may still be buffered: their write is where the pipe breaks
    except BrokenPipeError:
        # Python flushes stdout once more at exit; pointed at /dev/null that flush cannot raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(EXIT_PIPE_CLOSED)
    sys.exit(code)


class ConfigError(TwinrunError):
    """A config value is out of range or inconsistent; the message names the key, value and fix."""

    def __init__(self, key: str, value, fix: str):
        super().__init__(f"{key}={value!r}: {fix}")
        self.key, self.value, self.fix = key, value, fix


class DeterminismError(ConfigError):
    """An op has no deterministic implementation (or cuBLAS lacks its workspace setting) while
    deterministic algorithms are on: the op and the knob are named, never the model's fault (exit 2)."""

    @property
    def record(self) -> dict:
        """run.json's failure fields (the waiting launcher then reports exit 2)."""
        return {"error": "determinism"}


class KernelPathRefused(TwinrunError):
    """Twins or comparisons must not straddle kernel paths (exit 3)."""

    exit_code = EXIT_REFUSED

    @property
    def record(self) -> dict:
        """run.json's failure fields when a job refuses (the launcher then reports exit 3)."""
        return {"refused": "kernel_path"}


class StoreError(TwinrunError):
    """A store or run directory is missing, damaged, or foreign; the message names the path."""

    def __init__(self, path, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = path


def fail(err: TwinrunError | Interrupted) -> "NoReturn":  # noqa: F821
    """Print the one-line error and exit with its code."""
    print(f"twinrun: error: {err}", file=sys.stderr)
    raise SystemExit(err.exit_code)
