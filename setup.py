"""Packaging beyond what pyproject.toml says: the shipped models (``checkpoints/``, 19 MB) go
into the wheel as package data of ``jspec.models``, so an installed jspec runs
``python -m jspec demo`` from any directory (:mod:`jspec.shipped` finds them there)."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["jspec", "jspec.*", "pallas_kernels", "pallas_kernels.*"])
    + ["jspec.models"],
    package_dir={"jspec.models": "checkpoints"},
    package_data={"jspec.models": ["**/*"]},
    # SmolLM2's drafter in training and its data: kept in the repository so training resumes
    # across sessions (checkpoints/smollm2/README.md), not shipped to users.
    exclude_package_data={"jspec.models": ["smollm2/data/*", "smollm2/drafters/*"]},
)
