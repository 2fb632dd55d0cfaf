"""start_method="spawn": workers are fresh interpreters that find the parent's functions and data
as CPython's spawn rules say. Each case runs a script as a program's main module, as users do."""

import os
import subprocess
import sys
import textwrap

import pytest

# The program's main module, run with this interpreter and forkpool on its path.
def run_main(tmp_path, source: str, timeout: float = 120) -> subprocess.CompletedProcess:
    script = tmp_path / "main.py"
    script.write_text(textwrap.dedent(source))
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=timeout, env=os.environ.copy())


def test_workers_import_the_main_module_as_mp_main_and_see_its_data_as_defined(tmp_path):
    result = run_main(tmp_path, """
        import os
        import forkpool

        DEFINED = ["as the module defines it"]

        def describe(x):
            import __main__
            return (x + 1, __name__, __main__.__name__, DEFINED, os.getppid())

        def set_defined(value):
            DEFINED[:] = [value]

        if __name__ == "__main__":
            DEFINED.append("changed by the parent after import")  # not seen: fresh interpreters
            with forkpool.Pool(2, start_method="spawn") as pool:
                for value, name, main_name, defined, parent in pool.map(describe, range(4)):
                    assert (name, main_name) == ("__mp_main__", "__mp_main__"), (name, main_name)
                    assert defined == ["as the module defines it"], defined
                    assert parent == os.getpid()
                assert [v for v, *_ in pool.map(describe, range(4))] == [1, 2, 3, 4]
            with forkpool.Pool(1, start_method="spawn", initializer=set_defined, initargs=("initialized",)) as pool:
                assert pool.apply(describe, (0,))[3] == ["initialized"]
            print("ok")
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_a_pool_made_by_an_unguarded_main_module_fails_with_cpythons_error(tmp_path):
    # The spawned worker imports the main module again, which makes a pool again: CPython's error,
    # not workers spawned without end.
    result = run_main(tmp_path, """
        import forkpool

        def echo(x):
            return x

        pool = forkpool.Pool(1, start_method="spawn")
        pool.map(echo, [1])
    """)
    assert result.returncode != 0
    assert "bootstrapping phase" in result.stderr, result.stderr
    assert "InitializerError" in result.stderr, result.stderr


def test_a_function_the_main_module_does_not_define_at_import_fails_alone(tmp_path):
    # Defined under the guard: a spawned worker cannot find it by name (CPython's rule too); the
    # call fails with that error and the pool serves on.
    result = run_main(tmp_path, """
        import forkpool

        def echo(x):
            return x

        if __name__ == "__main__":
            def local_echo(x):
                return x
            globals()["late"] = local_echo
            local_echo.__qualname__ = "late"
            with forkpool.Pool(1, start_method="spawn") as pool:
                try:
                    pool.apply(local_echo, (1,))
                except AttributeError as error:
                    print("raised:", type(error).__name__)
                assert pool.apply(echo, (2,)) == 2
            print("served on")
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["raised: AttributeError", "served on"], result.stdout
