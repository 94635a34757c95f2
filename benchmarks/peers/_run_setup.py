"""Run FA3's setup.py (in the current directory) with the given arguments where
the `wheel` package is not installed.

FA3's setup.py imports `wheel.bdist_wheel` only to subclass it for its wheel
download command, which `build_ext` never runs; this gives that import a
stand-in and then runs setup.py unchanged. build_fa3.py uses it only when
`import wheel.bdist_wheel` fails.
"""

import runpy
import sys
import types

try:
    import wheel.bdist_wheel  # noqa: F401
except ImportError:
    from setuptools import Command

    class bdist_wheel(Command):
        user_options: list = []

        def initialize_options(self):
            pass

        def finalize_options(self):
            pass

        def run(self):
            raise SystemExit("bdist_wheel needs the 'wheel' package: pip install wheel")

    module = types.ModuleType("wheel.bdist_wheel")
    module.bdist_wheel = bdist_wheel
    package = types.ModuleType("wheel")
    package.__path__ = []
    package.bdist_wheel = module
    sys.modules.update({"wheel": package, "wheel.bdist_wheel": module})

sys.argv = ["setup.py", *sys.argv[1:]]
runpy.run_path("setup.py", run_name="__main__")
