"""Measurement kinds (the table is measures/registry.py). This package's modules import nothing heavy on
their own: fold_sums, modes and kind need torch alone, so a GPU check can import the probe's arithmetic
without Hydra."""
