"""Packaging for petr_stability (torch, mmcv and mmengine are not hard requirements: users bring their own)."""
from setuptools import find_packages, setup

with open("README.md", encoding="utf-8") as f:
    long_description = f.read()

setup(
    name="petr_stability",
    version="0.1.0",
    description="Keeps long fp16 training runs of PETR-family 3D detectors alive under OpenMMLab runners.",
    long_description=long_description,
    long_description_content_type="text/markdown",
    packages=find_packages(include=["petr_stability", "petr_stability.*"]),
    python_requires=">=3.8",
    install_requires=[],
    extras_require={
        # The user's own torch build is expected; these extras only name the tested floors.
        "torch": ["torch>=1.9"],
        "mmengine": ["mmengine>=0.7", "mmcv>=2.0.0rc4"],
        "mmcv1": ["mmcv-full>=1.4,<2.0"],
        "plot": ["matplotlib"],
        "tests": ["pytest", "ruff==0.8.6", "vermin==1.9.2"],
    },
    entry_points={"console_scripts": ["petr-stability=petr_stability.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Framework :: Pytest",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
