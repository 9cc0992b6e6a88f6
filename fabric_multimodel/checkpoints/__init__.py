"""Checkpoints: the files (written atomically, validated on load), per-rank and sharded (FSDP2), the resume of
the newest global model a run holds, and :class:`~fabric_multimodel.Checkpointer`, which a loop calls.
"""
