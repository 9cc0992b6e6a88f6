"""The round kinds: what one averaging round does (a mean, an anchored delta, an outer optimizer's step), over
which fragment, and when (the schedule); the errors a round raises on every rank.

Below the driver (:mod:`fabric_multimodel.averaging`), above the wire (:mod:`fabric_multimodel.comm`).
"""
