"""`python -m twinrun +experiment=pin_sigma`: a seed-twin run on the embedded default."""

from twinrun.errors import exit_on_signals

exit_on_signals()  # before the seconds of importing torch and Hydra: a signal there is one line too

from twinrun.app import main

main()
