"""Only the C hot path of the recorder lives here; everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("recorder._hotpath", ["recorder/_hotpath.c", "recorder/_shared.c"], optional=True,
                             depends=["recorder/_shared.h"],
                             extra_compile_args=["-O2"])])
