"""Runtime adapters: they publish events on the bus and import no subscriber."""
