"""The `nodecomm` command: its parser and main; the commands themselves in daemon_commands.py
(status, thresholds, calibrate), bench_command.py and topology.py."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence

import grpc

from nodecomm._native import MAX_RANKS
from nodecomm.errors import NodecommError, from_rpc_error
from nodecomm.thresholds import PEER_PATHS

from .arguments import byte_size, byte_sizes, positive_seconds, whole_number, whole_numbers
from .bench_command import cmd_bench
from .daemon_commands import cmd_calibrate, cmd_status, cmd_thresholds


def cmd_topo(args: argparse.Namespace) -> int:
    from nodecomm import _native
    from nodecomm.tools.topology import format_topology, node_topology, why_no_gpu

    devices = _native.cuda_devices() if _native.WITH_CUDA else []
    topology = node_topology(devices, _native.cuda_peer_links() if devices else [])
    reason = "" if devices else why_no_gpu(_native.WITH_CUDA)
    if args.json:
        print(json.dumps({**topology.to_json(), **({"no_gpu_reason": reason} if reason else {})}, indent=2))
    else:
        print(format_topology(topology, reason))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nodecomm", description="Inspect and measure the node's nodecomm daemon.")
    parser.add_argument(
        "--socket",
        help="daemon socket (default: $NODECOMM_SOCKET or the daemon's default path; bench starts a private "
        "daemon of its own unless --socket is given)",
    )
    parser.add_argument(
        "--timeout", type=positive_seconds, default=5.0, help="seconds to wait for the daemon (default: 5)"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    status = commands.add_parser("status", help="daemon health and its groups")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.set_defaults(run=cmd_status)

    thresholds = commands.add_parser("thresholds", help="the dispatch table in force")
    thresholds.add_argument("--group", help="a formed group's table (default: the table for new groups)")
    thresholds.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="new groups of this kind")
    thresholds.add_argument("--nccl", action="store_true", help="new CUDA groups whose ranks pass an NCCL group")
    thresholds.add_argument("--json", action="store_true", help="print JSON instead of a table")
    thresholds.set_defaults(run=cmd_thresholds)

    topo = commands.add_parser("topo", help="this node's GPUs, their links, and the paths each pair can use")
    topo.add_argument("--json", action="store_true", help="print JSON instead of a table")
    topo.set_defaults(run=cmd_topo)

    calibrate = commands.add_parser("calibrate", help="measure where each path stops winning; persist and use it")
    calibrate.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    calibrate.add_argument(
        "--world-size",
        type=whole_number(2, MAX_RANKS),
        default=0,
        help=f"probe ranks, 2 to {MAX_RANKS} (default: 2 on the CPU, one per GPU)",
    )
    calibrate.add_argument("--min-bytes", type=byte_size, default="4KiB", help="smallest size probed (default: 4KiB)")
    calibrate.add_argument(
        "--max-bytes", type=byte_size, help="largest size probed (default: 64MiB on the CPU, 256MiB on GPUs)"
    )
    calibrate.add_argument(
        "--probe-timeout", type=positive_seconds, default=3600.0, help="seconds to wait for the probe (default: 3600)"
    )
    calibrate.add_argument(
        "--wire",
        choices=("int8", "fp8", "int8,fp8", "fp8,int8"),
        metavar="WIRES",
        help="also time these compressed wires (int8, fp8 or both, comma-separated), placing compressed_min_bytes "
        "for the groups that ask for them",
    )
    calibrate.add_argument("--json", action="store_true", help="print the result as JSON")
    calibrate.add_argument("--plot", metavar="PNG", help="also draw latency against size per path (needs matplotlib)")
    calibrate.set_defaults(run=cmd_calibrate)

    bench = commands.add_parser(
        "bench", help="all-reduce latency and bandwidth per path, beside gloo (CPU) or NCCL (GPU)"
    )
    bench.add_argument(
        "--op",
        default="all_reduce",
        choices=("all_reduce", "topk", "topk-merge", "wire-error", "across-nodes", "convergence", "rms-norm"),
        help="wire-error: the compressed wires' error against the exact sum (docs/compressed-wires.md); "
        "convergence: the calls a fresh group's table needs to pick each size's fastest path; "
        "rms-norm: all_reduce_rms_norm against all_reduce and torch's add and RMSNorm",
    )
    bench.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    bench.add_argument(
        "--rows",
        type=whole_numbers(0),
        help="topk: rows per stage (default: 64,256,1024,2048); topk-merge: rows per merge (default: 1,16,256,2048,"
        "8192; CPU 1,16,64); rms-norm: tokens per call (default: 1,2,4,...,8192)",
    )
    bench.add_argument(
        "--hidden", type=whole_numbers(1), default="4096,8192", help="rms-norm: hidden sizes (default: 4096,8192)"
    )
    bench.add_argument(
        "--worlds", type=whole_numbers(1), default="2,4,8", help="wire-error: the world sizes, divisors of 8"
    )
    bench.add_argument(
        "--nodes", type=whole_numbers(1), default="2,2", help="across-nodes: ranks per stand-in node (a daemon each)"
    )
    bench.add_argument("--count", type=whole_number(1), default=1 << 18, help="wire-error: Gaussian elements per rank")
    bench.add_argument(
        "--topk", type=whole_number(1), default=2048, help="topk, topk-merge: candidates per row and rank"
    )
    bench.add_argument(
        "--iterations",
        type=whole_number(1),
        help="topk, topk-merge: timed calls per size (default: 10); rms-norm: calls (50)",
    )
    bench.add_argument(
        "--calls", type=whole_number(50), default=3000, help="convergence: default-dispatched calls per size"
    )
    bench.add_argument(
        "--explore-period",
        type=whole_number(0),
        help="convergence: the private daemon's explore_period (default: the daemon's own)",
    )
    bench.add_argument(
        "--table",
        choices=tuple(path.value for path in PEER_PATHS),
        help="convergence: start from a stored calibration that sends every size to this path (a wrong table)",
    )
    bench.add_argument(
        "--world-size", type=whole_number(1, MAX_RANKS), default=2, help=f"ranks, 1 to {MAX_RANKS} (default: 2)"
    )
    bench.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"], help="element type")
    bench.add_argument("--min-bytes", type=byte_size, default="1KiB", help="smallest size (default: 1KiB)")
    bench.add_argument("--max-bytes", type=byte_size, help="largest size (default: 64MiB on the CPU, 256MiB on GPUs)")
    bench.add_argument(
        "--sizes", type=byte_sizes, help="comma-separated sizes to measure instead of --min-bytes .. --max-bytes"
    )
    bench.add_argument(
        "--paths",
        help="comma-separated: oneshot, twoshot, service, dma (GPU), auto, torch (dist.all_reduce through the "
        "nodecomm backend), inplace (what torch runs underneath, called directly), gloo / nccl "
        "(default: every path and auto)",
    )
    bench.add_argument(
        "--wire",
        help="comma-separated compressed wires (int8, fp8) to time beside lossless on every path that carries "
        "them (rows 'oneshot+int8', ...; #wrong counts ranks whose bits differ from rank 0's)",
    )
    bench.add_argument(
        "--capacity",
        type=byte_size,
        default="8MiB",
        help="the group's slot capacity, at least 64 bytes (larger payloads are chunked; default: 8MiB)",
    )
    bench.add_argument("--graph", action="store_true", help="GPU: time calls captured in CUDA graphs")
    bench.add_argument("--no-baseline", action="store_true", help="skip the gloo / NCCL baseline")
    bench.add_argument(
        "--progress",
        action="store_true",
        help="also print each path's result as a JSON line the moment it is measured (table rows print per size)",
    )
    bench.add_argument("--json", metavar="FILE", help="also write the table as JSON (-: one line on stdout)")
    bench.set_defaults(run=cmd_bench)
    return parser


def _off_main_thread(run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """`run(args)` on a thread of its own while the main thread only waits for it. Ctrl-C raises
    KeyboardInterrupt in the main thread at whatever line it is on; raised inside gRPC's Python
    layer (a call being set up) it can leave a channel that never closes, and the command hangs.
    Here Ctrl-C ends the process at once instead: the daemon sees the connection close and cancels
    what it was doing for this command."""

    def interrupted(signum: int, frame: object) -> None:
        print(f"nodecomm {args.command}: interrupted", file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            sys.stdout.flush()
        os._exit(130)

    outcome: list[int | BaseException] = []
    done = threading.Event()

    def work() -> None:
        try:
            outcome.append(run(args))
        except BaseException as error:  # re-raised in the main thread, where main() reports it
            outcome.append(error)
        finally:
            done.set()

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        threading.Thread(target=work, name=f"nodecomm {args.command}", daemon=True).start()
        # In slices: the kernel may hand SIGINT to one of gRPC's threads, which does not wake a
        # main thread blocked on a lock; Python runs the handler when the main thread next wakes.
        while not done.wait(0.1):
            pass
    finally:
        signal.signal(signal.SIGINT, previous)
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


# Options whose value may be written negative: argparse takes "-4KiB" after them for an option,
# and says only "expected one argument"; joined as "--sizes=-4KiB", the value gets its own message.
_SIZE_OPTIONS = ("--sizes", "--min-bytes", "--max-bytes", "--capacity")


def _joined_sizes(argv: Sequence[str]) -> list[str]:
    joined, rest = [], list(argv)
    while rest:
        item = rest.pop(0)
        if item in _SIZE_OPTIONS and rest and rest[0][:1] == "-" and rest[0][1:2].isdigit():
            item = f"{item}={rest.pop(0)}"
        joined.append(item)
    return joined


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(_joined_sizes(sys.argv[1:] if argv is None else argv))
    try:
        # bench runs on the main thread: its own cleanup (ranks, private daemon) runs on Ctrl-C.
        status = args.run(args) if args.command == "bench" else _off_main_thread(args.run, args)
        sys.stdout.flush()  # inside the try: a closed pipe surfaces here, not at exit
        return status
    except BrokenPipeError:
        # The reader went away (`nodecomm status | head -1`): stop quietly, as other CLIs do. Python
        # would report the pipe again when it flushes stdout at exit, unless stdout goes nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"nodecomm {args.command}: interrupted", file=sys.stderr)
        return 130
    except grpc.RpcError as error:
        if error.code() == grpc.StatusCode.CANCELLED and isinstance(sys.exc_info()[1].__context__, KeyboardInterrupt):
            print(f"nodecomm {args.command}: interrupted", file=sys.stderr)
            return 130
        print(f"nodecomm {args.command}: {from_rpc_error(error)}", file=sys.stderr)
        return 1
    except (NodecommError, ValueError, RuntimeError, TimeoutError) as error:
        print(f"nodecomm {args.command}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
