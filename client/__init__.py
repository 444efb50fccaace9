"""What engine ranks import: connect() and the Communicator it returns."""

from .communicator import Communicator
from .connect import connect

__all__ = ["Communicator", "connect"]
