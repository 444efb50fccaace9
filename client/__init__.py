"""What engine ranks import: connect() and the Communicator it returns; connect_across_nodes()
and the HierarchicalCommunicator for a group whose ranks sit on several nodes.

Imported lazily, so that the `nodecomm` command (nodecomm.tools.cli) and the bench's parent
process start without torch or the native module; only the rank processes load them.
"""

__all__ = ["Communicator", "HierarchicalCommunicator", "connect", "connect_across_nodes"]


def __getattr__(name: str):
    if name in ("HierarchicalCommunicator", "connect_across_nodes"):
        from . import hierarchical

        return getattr(hierarchical, name)
    if name in __all__:
        from .communicator import Communicator
        from .connect import connect

        # Importing the submodule `connect` bound that name to the module; the function wins, as
        # it did when this package imported both eagerly.
        globals().update(Communicator=Communicator, connect=connect)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
