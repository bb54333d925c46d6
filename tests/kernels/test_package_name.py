"""Our top-level package is called `kernels` (DESIGN.md fixes the layout) and so is Hugging Face's
kernel-download distribution, which transformers 5.25 made a hard requirement. With both installed,
whichever comes first on sys.path wins: the console script can import theirs and the tests ours.
These tests fail loudly if that distribution creeps back in through a dependency."""

import importlib.metadata
from pathlib import Path

import pytest

import kernels

REPO = Path(__file__).resolve().parents[2]


def test_the_kernels_package_imported_is_ours():
    assert Path(kernels.__file__).resolve().parent == REPO / "kernels", kernels.__file__


def test_hugging_faces_kernels_distribution_is_not_installed():
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        dist = importlib.metadata.distribution("kernels")
        pytest.fail(
            f"Hugging Face's `kernels` {dist.version} is installed (transformers>=5.25 requires "
            "it); its top-level package shadows ours: keep transformers<5.25 in pyproject.toml"
        )
