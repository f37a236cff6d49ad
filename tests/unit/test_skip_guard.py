"""tests/skip_guard.py fails a run that skips for a missing service, and only such a run."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ("pytester",)


def _run(pytester: pytest.Pytester, body: str) -> pytest.RunResult:
    pytester.makepyfile(body)
    return pytester.runpytest_inprocess("-p", "tests.skip_guard", "-p", "no:cacheprovider", "-p", "no:asyncio", "-rs")


def test_a_skip_for_a_missing_service_fails_the_run(pytester: pytest.Pytester) -> None:
    result = _run(
        pytester,
        """
import pytest
pytest.importorskip("no_such_module_here")
""",
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result = _run(
        pytester,
        """
import pytest
def test_db():
    pytest.skip("no PostgreSQL at 127.0.0.1:5432")
def test_ok():
    pass
""",
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*skips not allowed*", "*test_db: no PostgreSQL at 127.0.0.1:5432"])


def test_allowed_skips_and_xfails_pass(pytester: pytest.Pytester) -> None:
    result = _run(
        pytester,
        """
import pytest
@pytest.mark.skipif(True, reason="this machine has NVML (a GPU host)")
def test_gpu_host():
    pass
@pytest.mark.xfail(reason="known")
def test_known():
    assert False
""",
    )
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(skipped=1, xfailed=1)


def test_a_skip_on_an_xdist_worker_fails_the_run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """`make test` runs the suite on pytest-xdist workers: a skip there, at collection or in a test, reaches the
    controller's guard and fails the run as it does in one process."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))  # the child imports tests.skip_guard
    pytester.makepyfile(
        test_skip_at_import="""
import pytest
pytest.importorskip("no_such_module_here")
""",
        test_skip_in_test="""
import pytest
def test_db():
    pytest.skip("no Redis at 127.0.0.1:6379")
def test_ok():
    pass
""",
    )
    result = pytester.runpytest_subprocess("-p", "tests.skip_guard", "-p", "no:cacheprovider", "-n", "2", "-rs")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*skips not allowed*"])
    result.stdout.fnmatch_lines(["*no_such_module_here*"])
    result.stdout.fnmatch_lines(["*test_db: no Redis at 127.0.0.1:6379"])
