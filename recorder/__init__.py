"""Running Data Recorder: crash-consistent ring, fault triggers, bundles, readers (docs/rdr.md)."""

__all__: list[str] = []
