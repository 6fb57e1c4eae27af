"""The worker side of the cross-rank check, on torch's side: the registration of the checked gloo group as
the c10d backend ``dstest_gloo``, and the hook that makes every gloo group of a worker one.

The group class itself (``CheckedGroup``, made from the checking core's c10d table) is in
:mod:`dstest.worlds.process.checked_group`, which imports torch; this module imports it only when the class
is first needed, in a worker.

torch-internal (through :func:`dstest.worlds.torch_internals.install_checked_gloo`): registers a backend on
the C++ group and wraps ``distributed_c10d._new_process_group_helper`` (see :func:`install_checking`).
"""

from __future__ import annotations

from typing import Any

from dstest.worlds.process.checker import Checker

_CHECKED_BACKEND = "dstest_gloo"


_CHECKER: Checker | None = None  # this worker's checker (set once in worker_main, gloo pools only)


def install_checking(checker: Checker) -> None:
    """Make every gloo group this worker creates a ``_CheckedGroup`` that still reports itself as gloo.

    torch-internal: registers the backend and wraps ``distributed_c10d._new_process_group_helper`` (the
    one function every group creation goes through: init_process_group, new_group, new_subgroups,
    DeviceMesh) so that a request for "gloo" builds the checked backend, and then puts "gloo" back as the
    group's backend name, so that ``dist.get_backend()`` and code that branches on it see gloo.
    """
    global _CHECKER
    from dstest.worlds.torch_internals import install_checked_gloo

    _CHECKER = checker
    install_checked_gloo(_CHECKED_BACKEND, _create_checked_group, lambda pg: isinstance(pg, _checked_group_class()))


def _create_checked_group(opts: Any, pg_options: Any) -> Any:
    from dstest.worlds.torch_internals import gloo_group

    inner = gloo_group(opts.store, opts.group_rank, opts.group_size, opts.timeout, numbered=True)  # as torch's own
    assert _CHECKER is not None
    members = tuple(opts.global_ranks_in_group) or tuple(range(opts.group_size))
    return _checked_group_class()(inner, opts.group_rank, opts.group_size, members, str(opts.group_id), _CHECKER)


class _LazyCheckedGroup:
    """``isinstance(x, _CheckedGroup)`` before the class exists (torch not imported yet) is simply False."""

    cls: type | None = None


def _checked_group_class() -> type:
    if _LazyCheckedGroup.cls is None:
        from dstest.worlds.process.checked_group import CheckedGroup  # imports torch: only in a worker

        _LazyCheckedGroup.cls = CheckedGroup
    return _LazyCheckedGroup.cls
