"""twinrun: experiment orchestration with seed-twin arms."""

__version__ = "0.1.0"
