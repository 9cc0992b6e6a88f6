"""The run around a user's loop: :class:`~fabric_multimodel.Loop`, the launch in whatever world a script was
started into, the SIGTERM stop, progress, the final report, and the command-line flags of the averaging.
"""
