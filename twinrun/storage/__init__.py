"""The run directory on disk: its files, stores, locks, documents and owners (RunDir, RunIndex, SweepDir)."""
