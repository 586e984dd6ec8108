"""Write the .pth file that lets torchvision import beside a CPU-only torch in this environment
(see omni_mesh/torchvision_cpu.py); `make install` runs it. Harmless where torchvision's
native ops load: the hook then changes nothing."""

import sysconfig
from pathlib import Path

# A .pth line that starts with "import" is run by every interpreter of the environment; an
# omni_mesh without the hook (another checkout first on PYTHONPATH) must not break start-up.
LINE = (
    'import contextlib; exec("with contextlib.suppress(ImportError):\\n'
    ' import omni_mesh.torchvision_cpu as m; m.install()")\n'
)

path = Path(sysconfig.get_paths()["purelib"], "omni_mesh_torchvision_cpu.pth")
path.write_text(LINE)
