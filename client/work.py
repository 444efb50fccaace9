"""Work: what an asynchronous collective returns."""

from __future__ import annotations

import grpc

from nodecomm.errors import DaemonUnavailableError, InternalError, NodecommError, from_rpc_error


class Work:
    """What a collective called with async_op=True returns, whatever its path: wait() returns its
    result (the output tensor, or the owner table's (idx, scores)) once it has run, or raises its
    error. Only the service path runs in the background (the daemon runs it; on a CUDA group, wait()
    makes the current stream wait for it); every other path's Work is complete when returned."""

    def __init__(self, future: grpc.Future | None, on_done, where: dict, timeout: float, result=None):
        self._future = future
        self._on_done = on_done
        self._where = where
        self._timeout = timeout
        self._result = result
        self._error: NodecommError | None = None
        self._finished = future is None

    @classmethod
    def completed(cls, result) -> Work:
        """The work of a call that finished before it returned."""
        return cls(None, lambda reply: None, {}, 0.0, result)

    def done(self) -> bool:
        return self._finished or self._future.done()

    def wait(self):
        if not self._finished:
            reply = None
            try:
                reply = self._future.result(timeout=self._timeout)
            except grpc.RpcError as error:
                self._error = from_rpc_error(error, **self._where)
            except grpc.FutureTimeoutError:
                self._future.cancel()
                self._error = DaemonUnavailableError(
                    f"the daemon did not answer a submit within {self._timeout:.1f} s", **self._where
                )
            finally:
                self._finished = True
                try:
                    self._on_done(reply)
                except NodecommError as error:
                    self._error = self._error or error
                except Exception as error:  # e.g. torch failing to open the done event
                    self._error = self._error or InternalError(
                        f"finishing a service collective failed: {error}", **self._where
                    )
        if self._error is not None:
            raise self._error
        return self._result
