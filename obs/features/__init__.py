"""The features, one room each: its applier (what the settings turn on) and its subscriptions to the bus.

Features sit above the runtime adapters and below the wiring (``obs/__init__.py``): they read the
settings and the bus, publish demands in ``obs._core`` for the adapters to meet, and return data
that the CLI renders.  docs/architecture.md lists them.
"""
