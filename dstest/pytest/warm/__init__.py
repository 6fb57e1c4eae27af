"""Warm sessions: ``pytest --dstest-warm`` hands the invocation to a server that has already imported what
the session needs, so that a developer rerunning one small file does not wait for torch, DeepSpeed and the
process world's fork server to import again.

How it works:

- **The first run is cold.** It runs as without the option, then starts a server in the background (one
  per Python, directory, environment and ``-p`` plugins). The server sets the ``sys.path`` and environment
  the session had once its conftests and plugins were configured, imports pytest and the modules the
  process world's fork server imported (torch, DeepSpeed for ``-p dstest.compat.deepspeed``...), and
  waits on a Unix socket in a directory only this user can read.
- **A later run is forked from it.** Before pytest loads any conftest, the run connects and sends its
  arguments, ``sys.argv``, directory, environment and its standard streams (the file descriptors
  themselves, so that colours, widths and a ``| tee`` behave as in the run's own process). The server forks
  a session process, which first forks the process world's fork server from itself (ready at once), then
  runs ``pytest.main`` with those arguments and that environment; the run's process waits, passes Ctrl-C
  on, and exits with the session's exit status.
- **Never stale code.** Before every fork, the server checks that the file of every module it has imported
  holds the bytes it imported, and that no directory of its ``sys.path`` now holds another copy of a
  top-level module it imported (:mod:`dstest.pytest.warm.sources`: stamps trusted only when they are older
  than the server's start, digests where a stamp changed). Then, in the session process once its conftests
  have run, ``sys.path`` and the environment are compared with those the server was started from. Any
  difference, and the run is cold again, saying why in its header; a server that found a changed file
  stops, and the cold run starts a fresh one. Modules the server did not import (the tests, the
  conftests, what they import) are imported by each session anew, as always.
- **What runs cold anyway:** a run with ``--pdb``, ``--trace`` or ``-s`` (the terminal is the run's
  own process's, not the server's) and ``pytest.main(plugins=[...])`` calls (objects cannot be handed
  over). Modules of pytest plugins installed by entry points are not imported by the server: pytest
  rewrites their assertions as it imports them, which it cannot do to a module already imported.

The ini setting ``dstest_warm = true`` makes every run of a project a warm one without the option
(``--dstest-no-warm`` runs one cold, starting nothing). A run with the cold run's arguments also starts the
process world's pools that run used as soon as its session is forked, so that they form while pytest starts.
The header of every warm run says which it was. The server exits after ``DSTEST_WARM_IDLE`` seconds without a
run (default 1800), and, checking every ``DSTEST_WARM_WATCH`` seconds (default 10) while no session runs, as
soon as a file it imported changed or its socket was removed; ``python -m dstest.pytest.warm --stop`` stops
this user's servers. Its files (socket, log) are under ``DSTEST_WARM_DIR`` (default
``$TMPDIR/dstest-warm-<uid>``).

The package, one module per job:

- :mod:`~dstest.pytest.warm.channel`: where the servers live, which server a run belongs to, the messages;
- :mod:`~dstest.pytest.warm.client`: the run's own process (hand-over, or a cold run that starts a server);
- :mod:`~dstest.pytest.warm.server`: the server's imports and its loop;
- :mod:`~dstest.pytest.warm.session`: a session process forked from the server for one run;
- :mod:`~dstest.pytest.warm.sources` and :mod:`~dstest.pytest.warm.staleness`: whether the server's imports
  still fit (files, copies of packages, ``sys.path``, the environment);
- :mod:`~dstest.pytest.warm.hooks`: the pytest hooks, which this package re-exports as the plugin
  ``dstest.pytest.warm``; :mod:`~dstest.pytest.warm.cli`: ``python -m dstest.pytest.warm``.

PYTEST_DONT_REWRITE: the server imports this package before pytest does in the session it forks (every module
of it carries the same line, so that a cold run imports them as the server does, unrewritten).
"""

from __future__ import annotations

from dstest.pytest.warm.hooks import (
    pytest_configure,
    pytest_load_initial_conftests,
    pytest_report_header,
    pytest_terminal_summary,
)

__all__ = ["pytest_configure", "pytest_load_initial_conftests", "pytest_report_header", "pytest_terminal_summary"]
