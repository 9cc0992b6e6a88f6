"""Neither Lightning package family is required: the core imports none, and a missing one is explained."""

from __future__ import annotations

import subprocess
import sys

# One interpreter for every check (each start imports torch). `None` in sys.modules makes an
# import fail as if the package were not installed.
SCRIPT = """
import sys, fabric_multimodel, fabric_multimodel.run.launch, fabric_multimodel.ring, fabric_multimodel.checkpoints.files
print([m for m in sys.modules if m.split('.')[0] in ('lightning', 'lightning_fabric', 'pytorch_lightning')])
for package in ('lightning', 'lightning.pytorch', 'lightning.fabric', 'lightning_fabric', 'pytorch_lightning'):
    sys.modules[package] = None
for adapter in ('fabric_multimodel.lightning', 'fabric_multimodel.pytorch_lightning'):
    try:
        __import__(adapter)
    except ImportError as error:
        print(error)
from fabric_multimodel.ddp.families import fabric_package
try:
    fabric_package()
except ImportError as error:
    print(error)
"""


def test_no_lightning_package_is_required():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    loaded, for_lightning, for_standalone, for_fabric = proc.stdout.strip().splitlines()
    assert loaded == "[]"  # `import fabric_multimodel` imported no Fabric, no Trainer, no adapter
    assert "pip install lightning." in for_lightning and "fabric_multimodel.pytorch_lightning" in for_lightning
    assert "pip install pytorch-lightning." in for_standalone and "fabric_multimodel.lightning " in for_standalone
    assert "pip install lightning (or pip install lightning-fabric)" in for_fabric
