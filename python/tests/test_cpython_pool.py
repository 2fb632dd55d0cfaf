"""CPython's own Pool tests (Debian's libpython3.11-testsuite: test/_test_multiprocessing.py),
run against forkpool.Pool. The classes _TestPool, _TestPoolWorkerErrors and
_TestPoolWorkerLifetime run as CPython runs them for the 'processes' type, with Pool replaced;
the tests that differ on purpose are listed in EXPECTED_DIFFERENCES (and in docs/python.md),
each with why."""

import unittest

import pytest

tm = pytest.importorskip("test._test_multiprocessing", reason="needs libpython3.11-testsuite")

import forkpool  # noqa: E402

# test name -> why forkpool differs (a test of a private attribute, or of a CPython-only detail).
EXPECTED_DIFFERENCES = {
    "test_make_pool": "reads the private Pool._pool (CPython's list of Process objects); forkpool's workers "
                      "are not Process objects (Pool.worker_pids() gives their pids)",
}


class ForkpoolMixin(tm.ProcessesMixin):
    Pool = staticmethod(forkpool.Pool)


for _base in (tm._TestPool, tm._TestPoolWorkerErrors, tm._TestPoolWorkerLifetime):
    _name = "TestForkpool" + _base.__name__[len("_Test"):]
    _cls = type(_name, (_base, ForkpoolMixin, unittest.TestCase), {"__module__": __name__})
    for _test, _why in EXPECTED_DIFFERENCES.items():
        if hasattr(_cls, _test):
            setattr(_cls, _test, unittest.skip(_why)(getattr(_cls, _test)))
    globals()[_name] = _cls
