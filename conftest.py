"""Root conftest: load the project's pytest plugin (options, markers, fixtures)."""

pytest_plugins = ["bidir_kv.testing.plugin"]
