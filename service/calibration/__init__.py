"""Where each path stops winning: stored calibrations, the probe, live thresholds from ranks' timings."""
