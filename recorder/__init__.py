"""Running Data Recorder: crash-consistent ring, fault triggers, bundles, readers (see the RDR issue)."""

__all__: list[str] = []
