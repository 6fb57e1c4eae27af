"""``python -m dstest.pytest.warm``: the server's process and the ``--stop`` command (:mod:`.cli`).

PYTEST_DONT_REWRITE: the server imports this module before pytest does in the session it forks.
"""

import sys

from dstest.pytest.warm.cli import main

sys.exit(main(sys.argv[1:]))
