"""Plan a run before it starts: the cost model of a round, and ``python -m fabric_multimodel.plan``. No torch
import (a check holds it), so it answers at once on any machine.
"""
