"""Packaging for petr_stability: the package, and its ``petr-stability`` command (the top-level module
``petr_stability_cli``, light enough that ``--help`` imports no torch).

torch, mmengine and mmcv are not hard requirements: users bring their own builds. The extras name what a fresh
environment needs; none installs mmcv: mmcv, mmcv-full and mmcv-lite are one package (``mmcv``) under three names,
and installing one over a user's own build (with its compiled ops) breaks it (docs/versions.md, "Installing").
The repository's test helpers (``petr_stability.testing``) are not shipped.
"""
import re

from setuptools import find_packages, setup


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


VERSION = re.search(r'^__version__ = "([^"]+)"', _read("petr_stability/__init__.py"), re.M).group(1)

setup(
    name="petr_stability",
    version=VERSION,
    description="Keeps long fp16 training runs of PETR-family 3D detectors alive under OpenMMLab runners.",
    long_description=_read("README.md"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["petr_stability", "petr_stability.*"],
                           exclude=["petr_stability.testing", "petr_stability.testing.*"]),
    py_modules=["petr_stability_cli"],
    python_requires=">=3.8",
    install_requires=[],
    extras_require={
        "torch": ["torch>=1.9"],  # the floor; your own torch build is expected (install it first)
        "mmengine": ["mmengine>=0.7"],  # the MMEngine hook and the example; the demo also needs mmcv's bricks
        "plot": ["matplotlib"],  # the report's PNG and the demo's plot
        "tests": ["pytest", "ruff==0.8.6", "vermin==1.9.2"],
    },
    entry_points={"console_scripts": ["petr-stability=petr_stability_cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
