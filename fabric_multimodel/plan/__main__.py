"""``python -m fabric_multimodel.plan``: see :mod:`fabric_multimodel.plan.planner`."""

import sys

from fabric_multimodel.plan.planner import main

sys.exit(main())
