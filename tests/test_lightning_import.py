"""The `lightning` extra stays optional: the core package never imports it, and its absence is explained."""

from __future__ import annotations

import subprocess
import sys

# One interpreter for both checks (each start imports torch). `None` in sys.modules makes
# `import pytorch_lightning` fail as if it were not installed.
SCRIPT = """
import sys, fabric_multimodel, fabric_multimodel.launch, fabric_multimodel.ring
print([m for m in ('pytorch_lightning', 'fabric_multimodel.lightning') if m in sys.modules])
sys.modules['pytorch_lightning'] = None
try:
    import fabric_multimodel.lightning
except ImportError as error:
    print(error)
"""


def test_lightning_extra_is_optional():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    loaded, error = proc.stdout.strip().splitlines()
    assert loaded == "[]"  # `import fabric_multimodel` imported neither the Trainer nor the adapter
    assert "pip install 'fabric-multimodel[lightning]'" in error
