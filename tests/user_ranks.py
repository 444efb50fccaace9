"""Rank programs of tests/ranks.py, run by another local user: `python user_ranks.py FUNCTION WORLD
ARGS`, where ARGS is a JSON list, runs ranks.FUNCTION(rank, WORLD, *ARGS) in WORLD processes of
this user and prints one JSON line: {"results": [each rank's return value]}, or {"errors": [each
failing rank's "Class: message"]}. tests/conftest.py's User.ranks runs it."""

from __future__ import annotations

import json
import multiprocessing as mp
import sys


def _entry(function: str, rank: int, world_size: int, args: list, results) -> None:
    import ranks

    try:
        results.put((rank, "ok", getattr(ranks, function)(rank, world_size, *args)))
    except BaseException as error:  # reported to the test, which decides
        results.put((rank, "error", f"{type(error).__name__}: {error}"))


def main() -> None:
    function, world_size, args = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=_entry, args=(function, r, world_size, args, results)) for r in range(world_size)
    ]
    for process in processes:
        process.start()
    answers = dict((rank, (status, value)) for rank, status, value in (results.get() for _ in processes))
    for process in processes:
        process.join()
    errors = [f"rank {r}: {value}" for r, (status, value) in sorted(answers.items()) if status != "ok"]
    print(json.dumps({"errors": errors} if errors else {"results": [answers[r][1] for r in range(world_size)]}))


if __name__ == "__main__":
    main()
