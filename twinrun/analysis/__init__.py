"""Reading a measured run: checks, gates, the estimator and effects, from the stores alone."""
