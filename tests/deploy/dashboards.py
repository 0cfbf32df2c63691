"""The PromQL of every Grafana dashboard panel under deploy/grafana/dashboards, with template variables filled in."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from tests.deploy.tools import DASHBOARDS

RATE_INTERVAL = "1m"  # what Grafana's $__rate_interval gives for a 15 s scrape interval


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    ref_id: str
    expr: str  # as written in the dashboard

    def promql(self, model_name: str) -> str:
        """The expression with Grafana's variables replaced by concrete values; fails on any variable it does not
        know."""
        values = {"__rate_interval": RATE_INTERVAL, "__interval": "15s", "__range": "5m", "model_name": model_name}
        expr = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values[m.group(1) or m.group(2)], self.expr)
        assert "$" not in expr, expr
        return expr

    def __str__(self) -> str:
        return f"{self.dashboard} / {self.panel} / {self.ref_id}: {self.expr}"


def panels(dashboard: dict) -> list[dict]:
    """Every panel, including those nested in collapsed rows."""
    found = []
    for panel in dashboard.get("panels", []):
        found.append(panel)
        found.extend(panels(panel))
    return found


def panel_queries(paths: list[Path] = DASHBOARDS) -> list[PanelQuery]:
    queries = []
    for path in paths:
        for panel in panels(json.loads(path.read_text())):
            for target in panel.get("targets", []):
                queries.append(PanelQuery(path.name, panel["title"], target["refId"], target["expr"]))
    return queries


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"specserve:[a-zA-Z0-9_:]+", expr))
