"""``@dstest.spec``: one test body that runs on every rank of every world it is expanded to.

.. code-block:: python

    @dstest.spec(world_size=[1, 2, 3, 4], contract="A4")
    def test_guard_skips_non_member(ctx):
        g = ctx.groups.excluding(0)   # rank 0 is not a member
        ...                           # runs on every rank; assert freely

The decorator returns an ordinary pytest test function: the plugin parametrizes it with one case per
(world, world size), ids like ``[threaded-ws3]``, each carrying the world's ``cpu`` or ``gpu`` marker.
``pytest.mark.parametrize`` arguments and ordinary fixtures reach every rank as keyword arguments.
Outside pytest, :func:`run` and :func:`run_spec` do the same work.

The package, one module per job: :mod:`~.info` (what a spec declares, the run's settings, the option checks),
:mod:`~.bodies` (the body as the ranks call it), :mod:`~.decorator` (``@dstest.spec``), :mod:`~.runs`
(:func:`run` and :func:`run_spec`), :mod:`~.skips` (a skip reported at the body's line), :mod:`~.judging`
(``--dstest-crosscheck`` and the process world's verdict where rank threads shared state, contract E14).

(The package is not called ``spec``: importing a submodule ``dstest.spec`` would replace the ``dstest.spec``
decorator with the module. For the same reason no submodule here is named after a function the package
exports, such as ``run`` or ``spec``.)
"""

from __future__ import annotations

from dstest.binding import TargetBinding
from dstest.specification.decorator import spec
from dstest.specification.info import (
    CASE_ARG,
    INSTANCE_ARG,
    SETTINGS_ARG,
    SKIP_LOCATION_ATTR,
    Case,
    Settings,
    SpecInfo,
    check_async_hazards,
    check_strict_shapes,
    spec_info,
)
from dstest.specification.judging import JUDGED_ON_PROCESSES, sampled
from dstest.specification.runs import run, run_spec

__all__ = [
    "CASE_ARG",
    "INSTANCE_ARG",
    "JUDGED_ON_PROCESSES",
    "SETTINGS_ARG",
    "SKIP_LOCATION_ATTR",
    "Case",
    "Settings",
    "SpecInfo",
    "TargetBinding",
    "check_async_hazards",
    "check_strict_shapes",
    "run",
    "run_spec",
    "sampled",
    "spec",
    "spec_info",
]
