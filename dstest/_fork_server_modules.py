"""Imported by the process world's fork server after its other preloads.

- Where a session named more modules for it (:func:`dstest.worlds.process.launch.restart_fork_server`), the
  environment variable ``DSTEST_FORK_SERVER_MODULES`` (a JSON list of module names, removed again) names
  them, in the order the session imported them. A module that fails to import here (any error: the server
  must not die of a module that expects a rank's environment) is passed over; the test that needs it
  imports it on its rank, and reports what fails, as before.
- Where ``DSTEST_FORK_SERVER_REPORT`` names a file (removed again), the names of every module the server
  has imported are written there once it is done, so that the session can tell what its collection imported
  that the server has not.
"""

import importlib
import json
import os
import sys

MODULES_VAR = "DSTEST_FORK_SERVER_MODULES"
REPORT_VAR = "DSTEST_FORK_SERVER_REPORT"

_value = os.environ.pop(MODULES_VAR, None)
for _name in json.loads(_value) if _value else ():
    try:
        importlib.import_module(_name)
    except (Exception, SystemExit):
        continue
_report = os.environ.pop(REPORT_VAR, None)
if _report:
    try:
        with open(_report + ".tmp", "w", encoding="utf-8") as _f:
            json.dump(sorted(sys.modules), _f)
        os.replace(_report + ".tmp", _report)
    except OSError:
        pass
