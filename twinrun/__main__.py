"""`python -m twinrun +experiment=pin_sigma`: a seed-twin run on the embedded default."""

from twinrun.app import main

main()
