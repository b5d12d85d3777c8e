"""Map the three source roots into the one `loraplane` namespace (see docs/architecture.md).

pyproject.toml holds all metadata; setuptools' `packages.find` cannot map one namespace
over several roots, so the package list is computed here.
"""

from setuptools import find_namespace_packages, setup

ROOTS = ("worker/src", "controlplane/src", "operator/src")

packages: list[str] = []
package_dir: dict[str, str] = {}
for root in ROOTS:
    for pkg in find_namespace_packages(root, include=["loraplane", "loraplane.*"]):
        if pkg not in package_dir:
            packages.append(pkg)
        # `loraplane` itself (cli.py, demo.py) lives in the operator root, the top layer.
        if pkg != "loraplane" or root == "operator/src":
            package_dir[pkg] = f"{root}/{pkg.replace('.', '/')}"

setup(packages=packages, package_dir=package_dir)
