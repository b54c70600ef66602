"""The folder ``obs run`` puts first on ``PYTHONPATH``: its ``sitecustomize`` runs a process that re-runs the script
under obs too (see :func:`obs.cli._run.pass_on`)."""
