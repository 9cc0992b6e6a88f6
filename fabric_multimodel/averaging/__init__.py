"""The driver: :class:`~fabric_multimodel.Averager`, its configuration and the checks of its arguments, the
rounds it builds, the pace and period it agrees, its side of a live membership's epochs, and the one-off
averages and checks of replicas.
"""
