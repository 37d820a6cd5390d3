"""Package discovery; everything else is in pyproject.toml.

Every package under mgrpo/, kernels/ and launchers/ is found, under its import name: kernels/ and launchers/
are mgrpo_kernels and mgrpo_launchers ([tool.setuptools.package-dir]), which pyproject.toml's
[tool.setuptools.packages.find] cannot express (it names a package after its folder).
"""

from setuptools import find_packages, setup

FOLDERS = {"mgrpo": "mgrpo", "mgrpo_kernels": "kernels", "mgrpo_launchers": "launchers"}
"""Import name -> folder (the same mapping as pyproject.toml's package-dir)."""

setup(packages=[name + sub for name, folder in FOLDERS.items()
                for sub in ["", *(f".{p}" for p in find_packages(folder))]])
