"""`python -m twinrun +experiment=pin_sigma` and the `twinrun` command: a seed-twin run on the embedded
default. The console script enters here too, not at twinrun.app, so that a signal while torch and Hydra
import is one line for both spellings (a Ctrl-C there was a KeyboardInterrupt traceback from `twinrun`)."""

from twinrun.errors import exit_on_signals

exit_on_signals()  # before the seconds of importing torch and Hydra: a signal there is one line too

from twinrun.app import main

if __name__ == "__main__":
    main()
