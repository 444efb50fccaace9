"""Reliability: property-based fuzzing of the daemon's control plane and garbage on its sockets.

A package, so that its conftest (the fuzz daemon and the figures line) does not shadow
tests/conftest.py, which these modules import as `conftest` like every other test.
"""
