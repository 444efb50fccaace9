"""What a rank does when its group aborts while CUDA graphs hold its calls: the policy's names, as
the daemon's captured_abort and a job's NODECOMM_CAPTURED_ABORT spell them, and which one wins.

A replayed graph's kernels stop at once after an abort and leave their outputs as they were; no
nodecomm call runs to raise. Under "exit" (the default) the rank's watch (native/capture_watch.h)
writes one line on stderr naming the group, the rank and the reason, then ends the process with
exit status CAPTURED_ABORT_EXIT_STATUS, as torch's NCCL watchdog ends a process whose collective
failed; under "log" it writes the line only, and Communicator.check() and the next call raise.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from nodecomm import _native
from nodecomm.errors import InvalidArgumentError
from nodecomm.v1 import control_pb2 as pb

POLICIES = {"exit": pb.CAPTURED_ABORT_EXIT, "log": pb.CAPTURED_ABORT_LOG}
JOB_VARIABLE = "NODECOMM_CAPTURED_ABORT"
EXIT_STATUS = _native.CAPTURED_ABORT_EXIT_STATUS

_NATIVE = {
    pb.CAPTURED_ABORT_UNSPECIFIED: _native.CapturedAbortPolicy.EXIT,  # a daemon that does not say
    pb.CAPTURED_ABORT_EXIT: _native.CapturedAbortPolicy.EXIT,
    pb.CAPTURED_ABORT_LOG: _native.CapturedAbortPolicy.LOG,
}


def job_policy(environ: Mapping[str, str] | None = None) -> int | None:
    """The job's choice (pb.CapturedAbort) from NODECOMM_CAPTURED_ABORT; None where it makes none."""
    value = (os.environ if environ is None else environ).get(JOB_VARIABLE, "")
    if not value:
        return None
    if value not in POLICIES:
        raise InvalidArgumentError(f"{JOB_VARIABLE}={value!r}: expected 'exit' or 'log'")
    return POLICIES[value]


def policy_in_force(daemon_policy: int, job: int | None) -> _native.CapturedAbortPolicy:
    """The job's choice (job_policy) where it makes one, else the daemon's (its JoinReply's)."""
    return _NATIVE.get(daemon_policy if job is None else job, _native.CapturedAbortPolicy.EXIT)
