# torch cannot be imported twice in one process, and pytester's in-process runs drop the modules they
# imported: import torch and the worlds here, before any inline run, so every run shares them.
import os
from collections.abc import Iterator
from pathlib import Path

import _forked_children
import pytest
import torch  # noqa: F401
from hypothesis import settings

import dstest.specification
import dstest.worlds.fake
import dstest.worlds.threaded  # noqa: F401

pytest_plugins = ["pytester"]

# The sessions a test starts share this session's build cache (the C call records, impl's native ops), as a
# user's runs do: pytester gives each child session a HOME of its own, where each would otherwise compile the
# records (0.3 s) and impl's CPU op (about 7 s) again. The path is the default one, so this session's own
# builds go where they did; a test of the cache itself sets its own DSTEST_EXT_DIR.
os.environ.setdefault("DSTEST_EXT_DIR", str(Path.home() / ".cache" / "dstest" / "ext"))

# CI and this project's machines have 2 shared cores: a wall-clock deadline per example only measures the
# neighbours. Tests that need other settings still set them with @settings.
settings.register_profile("dstest", deadline=None)
# The checkers' own properties (tests/test_checker_properties*.py) leave max_examples to the profile: the
# default profile runs hypothesis' usual 100 examples each in `pytest -m cpu`; `--hypothesis-profile=soak` runs
# 5,000 each (docs/checking-the-checkers.md).
settings.register_profile("soak", deadline=None, max_examples=5000)
settings.load_profile("dstest")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "hypothesis_in_children: the pytest sessions the test starts load hypothesis' pytest plugin"
    )
    config.addinivalue_line(
        "markers",
        "fresh_interpreter: the pytest sessions the test starts through pytester run in fresh interpreters, not "
        "forked from the suite's warm one (tests/_forked_children.py)",
    )
    if not getattr(pytest.Pytester.popen, "forks", False):  # once per process, however many sessions configure
        pytest.Pytester.popen = _forked_children.forking_popen(pytest.Pytester.popen)  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def _child_sessions_forked(request: pytest.FixtureRequest) -> Iterator[None]:
    """The pytest sessions a test starts through pytester are forked from a warm interpreter (torch and pytest
    imported once per test process), unless the test is marked ``fresh_interpreter``."""
    _forked_children.allowed = request.node.get_closest_marker("fresh_interpreter") is None
    yield
    _forked_children.allowed = True


@pytest.fixture(autouse=True)
def _child_sessions_without_hypothesis_plugin(request: pytest.FixtureRequest) -> Iterator[None]:
    """The pytest sessions a test starts (pytester, torchrun, the dstest command) do not load hypothesis' pytest
    plugin, unless the test is marked ``hypothesis_in_children``: the plugin imports all of hypothesis in every
    session's terminal summary (1.3 s a session on this project's machines) and no other child session uses it."""
    if request.node.get_closest_marker("hypothesis_in_children"):
        yield
        return
    if "pytester" in request.fixturenames:
        request.getfixturevalue("pytester")  # it clears PYTEST_ADDOPTS as it starts: set it after
    with pytest.MonkeyPatch.context() as patch:  # undone before pytester restores what it cleared
        addopts = os.environ.get("PYTEST_ADDOPTS", "")
        patch.setenv("PYTEST_ADDOPTS", f"{addopts} -p no:hypothesispytest".strip())
        yield
