"""What engine ranks import: connect() and the Communicator it returns.

Imported lazily, so that the `nodecomm` command (nodecomm.client.cli) and the bench's parent
process start without torch or the native module; only the rank processes load them.
"""

__all__ = ["Communicator", "connect"]


def __getattr__(name: str):
    if name == "connect":
        from .connect import connect

        return connect
    if name == "Communicator":
        from .communicator import Communicator

        return Communicator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
