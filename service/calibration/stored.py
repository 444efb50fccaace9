"""A calibration, as the daemon stores it: the boundaries a probe placed (service/calibration/boundaries.py),
the medians they came from and the machine's fingerprint (service/calibration/fingerprint.py). One JSON file
per fingerprint in the state directory (and, for a job's private daemon, in the user's cache), so
that a restarted daemon reuses it without probing (service/calibration/probe.py measures a new one)."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import jsonschema

from nodecomm import trust
from nodecomm.errors import NodecommError
from nodecomm.service.calibration.fingerprint import fingerprint_key

log = logging.getLogger("nodecomm.calibration")

# How far ahead of this machine's clock a stored calibration's measured_at may be (a clock set back
# a little since it was written) before it is refused.
FUTURE_SLACK_SECONDS = 60.0

_BOUNDARY = {"type": ["integer", "null"], "minimum": 0, "maximum": 1 << 62}
_BOUNDARIES = {
    "type": "object",
    "properties": {name: _BOUNDARY for name in ("oneshot_max_bytes", "twoshot_max_bytes", "dma_min_bytes")},
    "additionalProperties": False,
}
# What a stored calibration must hold before the daemon applies it (a file that parses but holds
# other types, ranges or shapes is ignored, naming the file and the field).
CALIBRATION_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["key", "fingerprint", "boundaries", "medians", "measured_at"],
    "properties": {
        "key": {"type": "string", "pattern": "^[0-9a-f]{16}$"},
        "fingerprint": {
            "type": "object",
            "required": ["device_kind"],
            "properties": {"device_kind": {"enum": ["cpu", "cuda"]}},
        },
        "boundaries": _BOUNDARIES,
        "nccl_boundaries": {"anyOf": [{"type": "null"}, _BOUNDARIES]},
        "wire_boundaries": {
            "type": "object",
            "propertyNames": {"enum": ["int8", "fp8"]},
            "additionalProperties": _BOUNDARY,
        },
        "medians": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "propertyNames": {"pattern": "^[0-9]+$"},
                "additionalProperties": {"type": "number", "minimum": 0},
            },
        },
        "measured_at": {"type": "number"},
        "variants": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "propertyNames": {"pattern": "^[0-9]+$"},
                "additionalProperties": {"enum": ["push", "pull"]},
            },
        },
    },
}
_VALIDATOR = jsonschema.Draft202012Validator(CALIBRATION_SCHEMA)


class InvalidCalibrationError(ValueError):
    """A stored calibration that is not what the daemon writes: the message names the field."""


@dataclass(frozen=True)
class Calibration:
    key: str
    fingerprint: dict[str, object]
    boundaries: dict[str, int | None]
    # Slowest rank's median seconds per path and size, as measured.
    medians: dict[str, dict[int, float]]
    measured_at: float
    # CUDA, where the probe timed NCCL: the boundaries for groups whose fallback is NCCL.
    nccl_boundaries: dict[str, int | None] | None = None
    # How a path moved each size where it has several variants: CUDA oneshot's "push" or "pull".
    variants: dict[str, dict[int, str]] = field(default_factory=dict)
    # compressed_min_bytes per compressed wire the probe timed (None: it never won).
    wire_boundaries: dict[str, int | None] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        """Parse and validate (CALIBRATION_SCHEMA); InvalidCalibrationError names what is wrong."""
        try:
            raw = json.loads(text)
        except ValueError as error:
            raise InvalidCalibrationError(f"not JSON: {error}") from None
        problem = jsonschema.exceptions.best_match(_VALIDATOR.iter_errors(raw))
        if problem is not None:
            where = "".join(f"[{part!r}]" if isinstance(part, int) else f".{part}" for part in problem.absolute_path)
            raise InvalidCalibrationError(f"{where.lstrip('.') or 'the file'}: {problem.message}")
        medians = {
            path: {int(size): seconds for size, seconds in by_size.items()} for path, by_size in raw["medians"].items()
        }

        def whole(boundaries: dict | None) -> dict[str, int | None] | None:  # 5.0 is an integer to JSON Schema
            return None if boundaries is None else {k: None if v is None else int(v) for k, v in boundaries.items()}

        variants = {
            path: {int(size): variant for size, variant in by_size.items()}
            for path, by_size in raw.get("variants", {}).items()
        }
        return cls(
            raw["key"], raw["fingerprint"], whole(raw["boundaries"]), medians, raw["measured_at"],
            whole(raw.get("nccl_boundaries")), variants, whole(raw.get("wire_boundaries", {})),
        )  # fmt: skip


class CalibrationStore:
    """Calibrations on disk, one JSON file per fingerprint: <state_dir>/calibration-<key>.json.
    A calibration decides every new group's paths, so a file is read only where it and every
    directory on the way are root's or `owners'` (this uid's by default) and writable by no one
    else (nodecomm.trust.read_trusted_file), and one measured in the future is refused: it would
    outrank every real one. A store that is not writable (the node's state, to a job's private
    daemon) reads them and saves nothing. A `private` one (a user's cache) is a directory of the
    user's alone, made 0700 on the first save and checked as the runtime directory is before
    every read or write: one that fails the checks is neither."""

    def __init__(
        self, state_dir: str, writable: bool = True, private: bool = False, owners: frozenset[int] | None = None
    ):
        self.directory = Path(state_dir)
        self.writable = writable
        self.private = private
        self.owners = owners if owners is not None else frozenset({os.geteuid()})

    def _trusted(self, create: bool) -> bool:
        """For a private store: whether its directory is the user's alone (made so if `create`)."""
        if not create and not self.directory.exists():
            return False
        try:
            if create:
                os.makedirs(self.directory.parent, mode=0o700, exist_ok=True)
            trust.make_private_directory(str(self.directory))
        except (OSError, NodecommError) as error:
            log.warning(
                f"not using the calibration cache {self.directory}: {error}", extra={"path": str(self.directory)}
            )
            return False
        return True

    def path_for(self, key: str) -> Path:
        return self.directory / f"calibration-{key}.json"

    def load(self, fingerprint: dict[str, object]) -> Calibration | None:
        """The calibration stored for this fingerprint; None (logged, naming the file and what is
        wrong with it) where the file is unreadable, invalid, or another machine's."""
        key = fingerprint_key(fingerprint)
        path = self.path_for(key)
        if self.private and not self._trusted(create=False):
            return None
        try:
            calibration = Calibration.from_json(
                trust.read_trusted_file(str(path), self.owners, trust.CALIBRATION_STAKES)
            )
        except FileNotFoundError:
            return None
        except (OSError, ValueError, NodecommError) as error:
            problem = str(error)
        else:
            differs = sorted(
                name for name in fingerprint.keys() | calibration.fingerprint.keys()
                if fingerprint.get(name) != calibration.fingerprint.get(name)
            )  # fmt: skip
            ahead = calibration.measured_at - time.time()
            if ahead > FUTURE_SLACK_SECONDS:
                problem = (
                    f"it says it was measured {ahead:.0f} s from now (measured_at {calibration.measured_at}), which "
                    "would outrank every calibration measured until then; a calibration from the future is refused"
                )
            elif calibration.key == key and not differs:
                return calibration
            else:
                problem = f"its fingerprint is not this machine's (it differs in {', '.join(differs) or 'key'})"
        log.warning(
            f"ignoring the calibration in {path}: {problem}; the built-in boundaries stay in force",
            extra={"path": str(path), "error": problem},
        )
        return None

    def save(self, calibration: Calibration) -> Path | None:
        """Write atomically: a crash leaves the old file or the new one, never half of one. None:
        this store writes nothing."""
        if not self.writable:
            return None
        if self.private:
            if not self._trusted(create=True):
                raise PermissionError(f"{self.directory} is not a directory of this user's alone (see the log)")
        else:
            self.directory.mkdir(parents=True, exist_ok=True)
            try:
                trust.trusted_directory(str(self.directory), self.owners, trust.CALIBRATION_STAKES)
            except NodecommError as error:
                raise PermissionError(f"not saving the calibration in {self.directory}: {error}") from None
        path = self.path_for(calibration.key)
        with tempfile.NamedTemporaryFile("w", dir=self.directory, delete=False, suffix=".tmp") as handle:
            handle.write(calibration.to_json())
        os.replace(handle.name, path)
        return path
