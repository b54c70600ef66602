"""statistic.csv's columns, as MindSpore writes them: the fixed ten, then one per statistic category.

Torch-free: the writers and the pure reader share it.  The categories and their column names are the
dump config's vocabulary (:data:`obs.settings.dump_config.CATEGORY_COLUMNS`).
"""

from __future__ import annotations

from collections.abc import Sequence

from obs.settings.dump_config import CATEGORY_COLUMNS

__all__ = ["CATEGORY_COLUMNS", "FIXED_COLUMNS", "csv_header"]

#: statistic.csv's fixed columns, byte for byte as MindSpore writes them
FIXED_COLUMNS = ("Op Type", "Op Name", "Task ID", "Stream ID", "Timestamp", "IO", "Slot", "Data Size", "Data Type",
                 "Shape")


def csv_header(categories: Sequence[str]) -> str:
    """The header line (without newline): the 10 fixed columns, then one per category in the user's order."""
    return ",".join(FIXED_COLUMNS + tuple(CATEGORY_COLUMNS[c] for c in categories))
