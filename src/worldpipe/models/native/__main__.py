"""Build the compiled extensions now (``make install`` runs this), so no run pays the compile on first use."""

import sys

from worldpipe.models.native import SOURCES, build

if __name__ == "__main__":
    for extension in SOURCES:
        print(f"built {extension}: {build(extension)}")
    sys.exit(0)
