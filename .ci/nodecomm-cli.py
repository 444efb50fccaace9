"""The `nodecomm` command of whichever tree is first on PYTHONPATH: nodecomm.tools.cli now,
nodecomm.client.cli in trees from before issue 40 moved it. The device scripts run earlier trees'
installs side by side, which have no console script of their own."""

import importlib
import importlib.util
import sys

if __name__ == "__main__":  # the bench spawns its ranks, which import this module again
    module = "nodecomm.tools.cli" if importlib.util.find_spec("nodecomm.tools") else "nodecomm.client.cli"
    sys.exit(importlib.import_module(module).main())
