"""The exit codes every command uses (docs/cli.md): 0 success, 1 a check found a problem or a file of ours is
damaged, 2 bad input (usage, a missing file, a file that is not ours)."""

from __future__ import annotations

__all__ = ["EXIT_FAILURE", "EXIT_OK", "EXIT_USAGE"]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
