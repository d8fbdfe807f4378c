"""errors.signals_held, with real signals sent to this process: a held signal acts once the block ends,
the first of two acts, one that comes while the block fails still ends the process with its own code and
says what was not done, and the handlers before the block are back afterwards."""

import os
import signal

import pytest

from twinrun.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, Interrupted, raise_on_signals, signals_held


@pytest.fixture(autouse=True)
def entry_point_handlers():
    """As an entry point has them (raise_on_signals); pytest's own handlers back afterwards."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    raise_on_signals()
    yield
    for s, handler in before.items():
        signal.signal(s, handler)


def test_a_held_signal_acts_when_the_block_ends_and_not_before():
    done = []
    with pytest.raises(Interrupted) as err, signals_held("nothing done"):
        os.kill(os.getpid(), signal.SIGTERM)
        done.append("after the signal")  # still inside the block: the signal waits
    assert done == ["after the signal"] and err.value.exit_code == EXIT_TERMINATED


def test_of_two_signals_the_first_one_acts():
    with pytest.raises(Interrupted) as err, signals_held("nothing done"):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
    assert err.value.exit_code == EXIT_INTERRUPTED


def test_a_block_that_fails_while_a_signal_waits_ends_with_the_signal_and_says_why():
    unfinished = "the plan was not written, so there is nothing to resume"
    with pytest.raises(Interrupted) as err, signals_held(unfinished):
        os.kill(os.getpid(), signal.SIGINT)
        raise OSError(28, "No space left on device")
    assert err.value.exit_code == EXIT_INTERRUPTED
    assert "the plan was not written, so there is nothing to resume (OSError: [Errno 28]" in str(err.value)
    assert isinstance(err.value.__cause__, OSError)


def test_a_block_that_fails_alone_raises_its_own_error_and_the_handlers_are_back():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(ValueError), signals_held("nothing done"):
        raise ValueError("bad")
    assert {s: signal.getsignal(s) for s in before} == before
    with signals_held("nothing done"):
        pass
    assert {s: signal.getsignal(s) for s in before} == before
    with pytest.raises(Interrupted):  # and they act as before
        signal.raise_signal(signal.SIGTERM)
