"""Root conftest: load the project's pytest plugin (options, markers, fixtures)."""

import os

import pytest

pytest_plugins = ["bidir_kv.testing.plugin"]


def pytest_configure(config: pytest.Config) -> None:
    """mutmut's stats run (``make mutation``) marks its process with
    ``MUTANT_UNDER_TEST=stats`` and records which functions each test calls. A Python
    subprocess a test starts would inherit the mark and try to record its own calls,
    which fails outside mutmut's directory; only this process's calls are recorded, so
    the mark stays here (mutmut keeps it in-process too). A mutant's name, set while a
    mutant runs, is left for the subprocesses: they run the mutant as well."""
    del config
    if os.environ.get("MUTANT_UNDER_TEST") == "stats":
        del os.environ["MUTANT_UNDER_TEST"]
