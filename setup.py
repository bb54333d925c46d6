"""The package list for the mapping in pyproject.toml: every package under the repository's folders,
installed under `residency` (control/api/ -> residency.control.api, and so on)."""
from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

FOLDERS = ["control", "dataplane", "events", "kernels", "ledger", "migrations"]


class BuildPy(build_py):
    """`residency` maps to the repository root: of the root's own modules (this file) none ships."""

    def find_package_modules(self, package, package_dir):
        return [m for m in super().find_package_modules(package, package_dir) if m[0] != "residency"]


# migrations/versions/ holds Alembic's revision files, found by path: it has no __init__.py of its own.
PACKAGES = ["residency", "residency.migrations.versions"]
PACKAGES += [f"residency.{p}" for p in find_packages(include=[f"{f}*" for f in FOLDERS])]

setup(packages=PACKAGES,
      cmdclass={"build_py": BuildPy})
