"""Build hook: generate protobuf/gRPC code before setuptools lists packages, so `pip install .` ships it."""

import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))
from genproto import generate

if (ROOT / "proto").is_dir():  # building from a source tree (an sdist built from it carries the modules too)
    generate(ROOT)

setup()
