"""The operator's view of a live run: what its store says (:mod:`.snapshot`), as a page and JSON (:mod:`.page`),
served beside the coordinator (:mod:`.server`, ``python -m fabric_multimodel.coordinator --status-port``)."""
