# This file exists only to build the CUDA extension in kernels/ later (setuptools' ext_modules need a
# setup.py). All metadata lives in pyproject.toml; do not duplicate it here.
from setuptools import setup

setup()
