"""Which collected items a session keeps: contracts as ``-k`` keywords, ``--dstest-specs``, soak items.

Called from the plugin's ``pytest_collection_modifyitems`` (:mod:`dstest.pytest.plugin`).
"""

from __future__ import annotations

import pytest

from dstest.pytest.options import INI_DESELECT_SOAK, OPT_SPECS

__all__ = ["contracts_as_keywords", "deselect_soak"]


def deselect_soak(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Where the ini opts in (``dstest_deselect_soak = true``), leave ``soak`` items out unless ``-m`` names
    soak. Off by default: the plugin is active in every session of the environment it is installed in, and
    a project with its own soak marker must keep its tests."""
    import re

    if not config.getini(INI_DESELECT_SOAK) or re.search(r"\bsoak\b", config.getoption("markexpr", "") or ""):
        return
    soak = [item for item in items if item.get_closest_marker("soak") is not None]
    if soak:
        config.hook.pytest_deselected(items=soak)
        gone = {id(item) for item in soak}
        items[:] = [item for item in items if id(item) not in gone]


def contracts_as_keywords(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``-k B4`` selects contract B4's specs; ``--dstest-specs=GLOB`` keeps specs by name or contract."""
    import fnmatch

    from dstest.specification import spec_info

    pattern = config.getoption(OPT_SPECS)
    dropped = []
    for item in items:
        info = spec_info(getattr(item, "function", None))
        if info is None:
            continue
        if info.contract:
            item.extra_keyword_matches.add(info.contract)
        name = getattr(item, "originalname", item.name)
        if pattern is not None and not (
            fnmatch.fnmatch(name, pattern) or fnmatch.fnmatch(info.contract or "", pattern)
        ):
            dropped.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        gone = {id(item) for item in dropped}
        items[:] = [item for item in items if id(item) not in gone]
