"""Only the C extensions live here (the recorder's hot path, the dump's statistics, the monitor's norms); everything
else is in pyproject.toml."""

from setuptools import Extension, setup

_STATS = "obs/features/dump/stats"  # the statistic dump's room: its C pass and the vendored ryu

setup(ext_modules=[Extension("recorder._hotpath",
                             ["recorder/_hotpath.c", "recorder/_shared.c", "recorder/_module_call.c"], optional=True,
                             depends=["recorder/_shared.h"],
                             extra_compile_args=["-O2"]),
                   Extension("obs.features.dump.stats._stats", [f"{_STATS}/_stats.c"], optional=True,
                             depends=[f"{_STATS}/{h}" for h in ("_stats_api.h", "ryu/d2d.h", "ryu/common.h",
                                                                 "ryu/d2s_intrinsics.h", "ryu/d2s_full_table.h")],
                             extra_compile_args=["-O3"]),
                   Extension("obs.features.monitor._norms", ["obs/features/monitor/_norms.c"], optional=True,
                             extra_compile_args=["-O3"]),
                   Extension("obs.features.monitor._robust", ["obs/features/monitor/_robust.c"], optional=True,
                             extra_compile_args=["-O2"])])
