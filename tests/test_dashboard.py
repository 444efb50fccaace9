"""deploy/grafana's dashboard, checked against a live daemon: every PromQL query names only
metrics the daemon exports (with labels it has), and every panel uses the datasource variable."""

from __future__ import annotations

import json
import re

from nodecomm.service.metrics.families import DaemonMetrics
from test_deploy import DASHBOARD

PROMQL_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
}
TARGET_LABELS = {"instance", "job", "node", "namespace", "pod"}  # added by the scrape, not the daemon
RATE_FUNCTIONS = ("rate", "irate", "increase")


def promql_metrics(expr: str) -> list[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords, label
    names (inside {...} or by/without (...)), durations or numbers."""
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\$\{?\w+\}?", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = []
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        before = text[match.start() - 1] if match.start() else " "
        if before.isdigit() or before == ".":  # the exponent of 1e-3
            continue
        if text[match.end() :].lstrip().startswith("(") or match.group() in PROMQL_KEYWORDS:
            continue
        names.append(match.group())
    return names


def dashboard_queries(dashboard: dict) -> list[str]:
    exprs = []

    def walk(panels):
        for panel in panels:
            exprs.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            # label_values(metric, label) -> the metric, grouped by the label.
            metric, label = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query).groups()
            exprs.append(f"count by ({label}) ({metric})")
    return exprs


def exposed_series(metrics_text: str) -> dict[str, str]:
    """Series names a scrape of this /metrics yields, by their family's type (# TYPE lines, so
    labelled families with no children yet count too)."""
    series = {}
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", metrics_text, re.M):
        suffixes = ("_bucket", "_sum", "_count") if kind == "histogram" else ("",)
        series.update({name + suffix: kind for suffix in suffixes})
    return series


def daemon_labels() -> dict[str, set[str]]:
    """Label names per series name, from the daemon's metric objects (_labelnames: prometheus_client)."""
    labels = {}
    for metric in vars(DaemonMetrics()).values():
        names = getattr(metric, "_labelnames", None)
        if names is None:
            continue
        base = metric._name + ("_total" if metric._type == "counter" else "")
        for suffix in ("_bucket", "_sum", "_count") if metric._type == "histogram" else ("",):
            labels[base + suffix] = set(names) | ({"le"} if suffix == "_bucket" else set())
    return labels


def test_dashboard_queries_only_metrics_the_daemon_exports(daemon):
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    series = exposed_series(daemon.metrics_text())
    assert "nodecomm_ranks" in series, "the daemon's /metrics did not parse"
    labels = daemon_labels()
    exprs = dashboard_queries(dashboard)
    assert len(exprs) >= 10
    problems = []
    for expr in exprs:
        names = promql_metrics(expr)
        if not names:
            problems.append(f"no metric in {expr!r}")
        for name in names:
            if name not in series:
                problems.append(f"{name} is not in the daemon's /metrics ({expr!r})")
                continue
            if any(re.search(rf"\b{f}\(\s*{name}\b", expr) for f in RATE_FUNCTIONS) and series[name] == "gauge":
                problems.append(f"rate/increase over the gauge {name} ({expr!r})")
        for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
            known = set().union(*(labels.get(n, set()) for n in names)) | TARGET_LABELS
            unknown = {label.strip() for label in group.split(",")} - known
            if unknown:
                problems.append(f"labels {sorted(unknown)} are not on {names} ({expr!r})")
        if "histogram_quantile" in expr and not all(n.endswith("_bucket") for n in names):
            problems.append(f"histogram_quantile needs the _bucket series ({expr!r})")
    assert not problems, "\n".join(problems)


def test_dashboard_panels_use_the_datasource_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        sources = [panel["datasource"], *(t.get("datasource", panel["datasource"]) for t in panel["targets"])]
        assert all(s == {"type": "prometheus", "uid": "${datasource}"} for s in sources), panel["title"]
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys() and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24


def test_promql_metric_extraction():
    """The extraction the dashboard test relies on: it finds metric names and only those."""
    expr = 'histogram_quantile(0.99, sum by (method, le) (rate(nodecomm_rpc_seconds_bucket{instance=~"$instance", method="Join"}[$__rate_interval]))) / 1e-3 > bool up'
    assert promql_metrics(expr) == ["nodecomm_rpc_seconds_bucket", "up"]
    assert promql_metrics("sum(nodecomm_groups) and on (instance) nodecomm_ranks offset 5m") == [
        "nodecomm_groups",
        "nodecomm_ranks",
    ]
