"""Package discovery for the three source roots; the package list cannot drift from the tree."""

from setuptools import find_packages, setup


def _mapped(root: str, name: str) -> list[str]:
    return [name] + [f"{name}.{pkg}" for pkg in find_packages(root)]


setup(packages=find_packages("src") + _mapped("cli", "freetoken.cli") + _mapped("converters", "freetoken.converters"))
