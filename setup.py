"""Package layout that pyproject.toml cannot express: ``recipes/`` ships as the package ``toolkit.recipes``."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["toolkit", "toolkit.*", "eval", "eval.*", "toolkit_cli", "toolkit_cli.*"])
    + ["toolkit.recipes"],
    package_dir={"toolkit.recipes": "recipes"},
    package_data={"toolkit.recipes": ["*.yaml", "prompts/*.yaml", "search/*.yaml", "found/*.yaml"],
                  "eval": ["*.json"],
                  # the HF evaluate metric modules: scripts loaded by path (toolkit.metrics.load), not packages
                  "toolkit.metrics": ["*/*.py"],
                  "toolkit": ["heads/*/*.json", "heads/*/*.safetensors", "heads/*/*.md", "heads/*/*.png"]},
)
