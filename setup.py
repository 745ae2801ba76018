"""The packages of the wheel, found in the tree: each folder of ROOTS is a hotswap.* package and
every package below it (a folder with an __init__.py) goes in with it, so a new subpackage needs
no list. The rest of the project's metadata is in pyproject.toml."""

from setuptools import find_packages, setup

ROOTS = {"hotswap.engine": "engine", "hotswap.fleet": "fleet", "hotswap.rollout": "rollout",
         "hotswap.trainers_adapters": "trainers_adapters", "hotswap.weight_sync": "weight_sync"}

setup(
    package_dir=ROOTS,
    packages=[*ROOTS, *(f"{name}.{sub}" for name, root in ROOTS.items()
                        for sub in find_packages(root))],
    # Read at run time from beside cpu_kernels.py: the kernels build from the installed copy.
    package_data={"hotswap.engine.layers": ["csrc/*.cpp", "csrc/*.h"]},
)
