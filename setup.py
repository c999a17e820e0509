"""The optional compiled replay (vramwidget/allocator/creplay.c).

Everything else about the package is in pyproject.toml.  The extension is optional: where it
cannot be built (no C compiler), setuptools says so and the package installs without it, and
vramwidget.allocator.caching replays in pure Python (the reference the compiled replay is
tested against, tests/test_creplay.py).  Wheels for Linux, macOS and Windows are built by
.github/workflows/wheels.yml (cibuildwheel).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "vramwidget.allocator.creplay",
            ["vramwidget/allocator/creplay.c"],
            optional=True,
        )
    ]
)
