"""The pytest layer: the plugin (``-p dstest.pytest.plugin``, loaded by its entry point), its fixtures, the hooks
plug-ins implement (``pytest_dstest_targets`` / ``pytest_dstest_worlds``), the ``--dstest-html`` hooks, and the
lockstep of a session run under a launcher. Nothing below this layer imports it (docs/architecture.md)."""
