"""``python -m fabric_multimodel.sites``: see :mod:`fabric_multimodel.sites`."""

import sys

from fabric_multimodel.sites.cli import main

sys.exit(main())
