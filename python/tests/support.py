"""Helpers the suite's modules share."""

import os


def scaled(seconds: float) -> float:
    """A bound on wall-clock time, times FORKPOOL_TEST_TIME_SCALE (1 unless set): meson.build's
    test setups set it with their timeout multiplier, as for the C++ tests."""
    return seconds * max(1.0, float(os.environ.get("FORKPOOL_TEST_TIME_SCALE", "1")))
