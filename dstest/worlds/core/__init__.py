"""The checking core both simulated worlds share: torch-free, so it imports and tests without torch.

- :mod:`~dstest.worlds.core.matching`: how collectives are matched across ranks (by group and sequence
  number), what a rank that left the run does to the others, when the waits are a deadlock, and the texts
  of these errors. The threaded world's rendezvous and the process world's referee both drive it; each keeps
  its own transport (locks and in-place delivery; pipes and verdict messages).
- :mod:`~dstest.worlds.core.rank_states`: where each rank stands (running, waiting in a call, gone: finished,
  failed or killed by a fault), how a call that needs a gone rank fails, and the deadlock rule over them:
  the one state machine both worlds follow.
- :mod:`~dstest.worlds.core.faults`: which call an injected fault fires at (contract G5), and its texts.
- :mod:`~dstest.worlds.core.c10d`: the table from c10d's process group methods to collectives, from which
  both the threaded world's ``Group`` and the process world's ``CheckedGroup`` are made.

What one rank's side of one collective must satisfy (sizes, dtypes, roots, pairings) lives in the
``Call`` classes of :mod:`dstest.worlds.collectives`, which both worlds build from the same table entry.
"""

from __future__ import annotations

from dstest.worlds.core import c10d, matching, rank_states

__all__ = ["c10d", "matching", "rank_states"]
