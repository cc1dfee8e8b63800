# Only here because cffi's API-mode build hooks into setuptools through `cffi_modules`;
# all metadata lives in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["native/build_shim.py:ffibuilder"])
