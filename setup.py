"""Build hook: generate protobuf/gRPC code into the build tree, so `pip install .` ships it."""

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildWithProtos(build_py):
    def run(self):
        sys.path.insert(0, str(ROOT / "tools"))
        from genproto import generate

        generate(ROOT)  # into the source tree, so package discovery and package_data see the modules
        super().run()


setup(cmdclass={"build_py": BuildWithProtos})
