"""The first module the process world's fork server imports: it puts in place the ``sys.path`` of the process
that started the server, before the server imports anything else.

multiprocessing's fork server imports its preload modules with the interpreter's default ``sys.path``
(CPython 3.11 ignores the path it is given), not the session's. Where a conftest put a checkout in front of an
installed copy of the same package (DeepSpeed's puts its checkout on ``sys.path``), the workers would then run
the installed copy while the test, and a fresh process of the suite's own harness, run the checkout.
:func:`dstest.worlds.process.launch.start_fork_server` passes the path in an environment variable, which this
module removes again.
"""

import json
import os
import sys

ENV_VAR = "DSTEST_FORK_SERVER_SYS_PATH"

_value = os.environ.pop(ENV_VAR, None)
if _value is not None:
    sys.path[:] = json.loads(_value)
