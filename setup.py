"""molds: DeepSpeed-backed, configuration-driven trainer for chemical language models.

Install with ``bash .ci/install`` (it puts a CPU build of torch on machines without a
GPU before anything asks for a bare ``torch``), or ``pip install -e .[dev]`` when torch
is already installed.
"""

from setuptools import find_packages, setup

# molds/ and its subpackages, and preprocessing/ installed as molds.preprocessing (a
# top-level "preprocessing" would shadow the PyPI package of that name)
PACKAGES = find_packages(include=["molds", "molds.*"]) + ["molds.preprocessing"]
#: the gpu extra (no wheels outside Linux, where every op takes its PyTorch path)
GPU = ["triton>=3.2; sys_platform == 'linux'", "liger-kernel>=0.5; sys_platform == 'linux'"]

setup(
    name="molds",
    version="0.1.0",
    description="Configuration-driven trainer for chemical language models (DeepSpeed, RDKit, Arrow)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=PACKAGES,
    package_dir={"molds": "molds", "molds.preprocessing": "preprocessing"},
    package_data={"molds": ["sample_data/*"]},
    install_requires=[
        "torch>=2.1",
        "deepspeed>=0.15",
        "transformers>=4.45",
        "tokenizers>=0.20",
        "datasets>=2.20",
        "rdkit>=2023.9",
        "pyarrow>=15",
        "numpy>=1.24",
        "fsspec>=2023.1",
        # ISA-L's inflate for .gz inputs (molds/data/inflate.py), ~4x zlib's speed
        "isal>=1.6",
        "xxhash>=3.0",
        # .zst inputs (molds/data/unzstd.py)
        "zstandard>=0.19",
        "jsonargparse[signatures]>=4.30",
        "tensorboard>=2.14",
        "safetensors>=0.4",
        "tqdm>=4.60",
        "psutil>=5.9",
        "scikit-learn>=1.3",
        "scipy>=1.10",
        "pillow>=9",
        # a property model's ROC curves and parity plots (molds-eval's report, TensorBoard)
        "matplotlib>=3.7",
        "fcd_torch>=1.0.7",
        # kernels.fp8_recipe rowwise / tensorwise: torchao's Float8Linear (emulated on a CPU)
        "torchao>=0.10; sys_platform == 'linux'",
    ],
    extras_require={
        # what only a GPU runs (1 GB of Triton a CPU install does without; .ci/install adds it where
        # it finds an NVIDIA GPU): Triton compiles molds' kernels (molds/kernels; on a CPU every op
        # takes its PyTorch path), Liger Kernel is kernels.fused_backend's faster choice there
        "gpu": GPU,
        "ray": ["ray[data]>=2.9"],
        # molecular representations beside SMILES (molds-preprocess --representation; asked for by name)
        "selfies": ["selfies>=2.1"],
        "safe": ["safe-mol>=0.2"],
        # the documentation site (mkdocs.yml; docs/gen_reference.py writes its reference pages)
        "docs": ["mkdocs>=1.6", "mkdocs-material>=9.5"],
        # pytest-xdist: .ci/run runs test files on two workers (a launch spends most of its start-up
        # importing on one core, while the other waits)
        # (the gpu extra too: the kernel tests run Triton's kernels in its interpreter, and
        # benchmarks/kernel_ops.py compares them with Liger Kernel's)
        "dev": ["pytest>=7", "pytest-timeout>=2.1", "pytest-xdist>=3.5", "ray[data]>=2.9", "accelerate>=1.1",
                "selfies>=2.1", "safe-mol>=0.2", "mkdocs>=1.6", "mkdocs-material>=9.5", *GPU],
    },
    entry_points={
        "console_scripts": [
            "molds-preprocess=molds.preprocessing.cli:main",
            "molds-train=molds.train:cli",
            "molds-export=molds.cli.export:main",
            "molds-average=molds.cli.average:main",
            "molds-schedule=molds.cli.schedule:main",
            "molds-sample=molds.cli.sample:main",
            "molds-predict=molds.cli.predict:main",
            "molds-eval=molds.cli.evaluate:main",
            "molds-score=molds.cli.score:main",
        ]
    },
)
