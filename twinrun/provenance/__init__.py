"""Where a number came from: the environment fingerprint, determinism, the kernel-path sentinel."""
