"""Per-model DDP: :func:`~fabric_multimodel.setup_models`, :func:`~fabric_multimodel.frozen`, and the two
Lightning package families (``lightning`` and the standalone ``lightning_fabric``/``pytorch_lightning``).
"""
