"""Build onebit's fused CPU kernels with the package (everything else is in pyproject.toml).

The kernels are an *optional* extension: a machine without a C compiler, or one that is not
x86-64, still installs onebit, which then runs the numpy/torch kernels (same bits, slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "onebit._kernels",
            ["src/onebit/_kernels.c"],
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math"],
            optional=True,
        )
    ]
)
