"""The two Lightning package families, accepted alike: ``lightning`` and the standalone packages.

``pip install lightning`` gives ``lightning.fabric`` and ``lightning.pytorch``; ``pip install
lightning-fabric pytorch-lightning`` gives ``lightning_fabric`` and ``pytorch_lightning``. The
two hold the same code under different names, so a ``lightning.fabric.Fabric`` is no
``lightning_fabric.Fabric``. The library needs neither: it checks an object against the classes of
every family that is already imported (an object of a family means that family is imported), and
imports one only to build a Fabric itself (:func:`fabric_package`).

Example::

    if not is_instance(fabric, "Fabric"):
        raise TypeError("a Fabric, please")
    DDPStrategy = classes("strategies.DDPStrategy")  # one class per family imported so far
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any

#: The Fabric package of each family; the standalone one first, since ``import lightning`` also imports its Trainer.
FABRIC_PACKAGES = ("lightning_fabric", "lightning.fabric")
INSTALL_HINT = "pip install lightning (or pip install lightning-fabric)"


def classes(path: str) -> tuple[type, ...]:
    """The class at ``path`` (``"Fabric"``, ``"wrappers._FabricModule"``) in every Fabric package imported so far.

    Example::

        isinstance(module, classes("wrappers._FabricModule"))
    """
    module_name, _, name = path.rpartition(".")
    found = []
    for package in FABRIC_PACKAGES:
        if sys.modules.get(package) is None:
            continue
        module = importlib.import_module(f"{package}.{module_name}" if module_name else package)
        found.append(getattr(module, name))
    return tuple(found)


def is_instance(value: object, path: str) -> bool:
    """Whether ``value`` is an instance of the class at ``path`` of any imported family.

    Example::

        is_instance(fabric.strategy, "strategies.DDPStrategy")
    """
    return isinstance(value, classes(path))


def family_class(value: object, path: str) -> type[Any] | None:
    """The class at ``path`` of the family ``value`` belongs to (its own or a base class), or None.

    Example::

        DDPStrategy = family_class(fabric.strategy, "strategies.DDPStrategy")
    """
    return next((cls for cls in classes(path) if isinstance(value, cls)), None)


def fabric_package() -> ModuleType:
    """A Fabric package to build Fabrics with: one already imported, else the first installed.

    Raises ``ImportError`` naming what to install when neither family is there.

    Example::

        Fabric = fabric_package().Fabric
    """
    name = fabric_package_name()
    if name is None:
        raise ImportError(f"fabric_multimodel needs Lightning Fabric: {INSTALL_HINT}")
    return importlib.import_module(name)


def fabric_package_name() -> str | None:
    """The name of the package :func:`fabric_package` returns, found without importing it; None when neither family
    is installed.

    Example::

        fabric_package_name()  # "lightning_fabric" where the standalone package is installed
    """
    for package in FABRIC_PACKAGES:
        if sys.modules.get(package) is not None:
            return package
    for package in FABRIC_PACKAGES:
        if importlib.util.find_spec(package.split(".")[0]) is not None:
            return package
    return None
