"""What engine ranks import: connect() and the Communicator it returns; connect_across_nodes()
and the HierarchicalCommunicator for a group whose ranks sit on several nodes.

Imported lazily, so that the `nodecomm` command (nodecomm.tools.cli) and the bench's parent
process start without torch or the native module; only the rank processes load them.
"""

import contextlib
from collections.abc import Iterator

__all__ = ["Communicator", "HierarchicalCommunicator", "connect", "connect_across_nodes"]


def needs_torch(error: ImportError) -> ImportError:
    """The error of importing the client where torch, or nodecomm's module built against it, is
    missing (a daemon-only install): what to install; any other import error as it is."""
    if error.name == "torch":
        what = "torch is not installed in this environment"
    elif error.name == "nodecomm._c10d" or "cannot import name '_c10d'" in str(error):
        what = "this nodecomm was installed without torch (the daemon only), so nodecomm._c10d was not built"
    else:
        return error
    return ImportError(
        f"nodecomm's client needs torch: {what}; install torch, then nodecomm again so that it is built "
        "against it: python3 -m pip install torch (on a machine without a GPU, its CPU build: --index-url "
        "https://download.pytorch.org/whl/cpu), then, in nodecomm's source tree, python3 -m pip install "
        "--force-reinstall --no-deps --no-cache-dir . (NODECOMM_CPU_ONLY=1 in front skips the CUDA build)"
    )


@contextlib.contextmanager
def _saying_what_to_install() -> Iterator[None]:
    """An ImportError of a missing torch or nodecomm._c10d raised as needs_torch's; others as they are."""
    try:
        yield
    except ImportError as error:
        told = needs_torch(error)
        if told is error:
            raise
        raise told from error


def c10d_module():
    """nodecomm._c10d, or the ImportError that says what to install."""
    with _saying_what_to_install():
        from nodecomm import _c10d
    return _c10d


def __getattr__(name: str):
    with _saying_what_to_install():
        return _client_name(name)


def _client_name(name: str):
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
