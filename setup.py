"""Only the C extensions live here (the recorder's hot path, the dump's statistics); everything else is in
pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("recorder._hotpath",
                             ["recorder/_hotpath.c", "recorder/_shared.c", "recorder/_module_call.c"], optional=True,
                             depends=["recorder/_shared.h"],
                             extra_compile_args=["-O2"]),
                   Extension("obs.features.dump._stats", ["obs/features/dump/_stats.c"], optional=True,
                             depends=["obs/features/dump/_stats_api.h", "obs/features/dump/ryu/d2d.h",
                                      "obs/features/dump/ryu/common.h", "obs/features/dump/ryu/d2s_intrinsics.h",
                                      "obs/features/dump/ryu/d2s_full_table.h"],
                             extra_compile_args=["-O3"])])
