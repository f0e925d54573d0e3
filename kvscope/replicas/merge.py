"""Gathering every replica's own `/stats` and `/metrics` into one answer.

Plain Python (no Ray): `/stats` sums the numeric figures and lists each replica's own
under `replicas`; `/metrics` is one Prometheus exposition whose every sample carries
a `replica` label.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.utils import floatToGoString


def merge_stats(per_replica: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The sum of every replica's numeric figures, and each replica's own under `replicas`."""
    total: dict[str, Any] = {}
    for stats in per_replica.values():
        for name, value in stats.items():
            if name == "pid":
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                total[name] = total.get(name, 0) + value
    return {**total, "replicas": per_replica}


def merge_metrics(per_replica: dict[str, str]) -> str:
    """Every replica's Prometheus text as one exposition, each sample labelled `replica`."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Any] = {}
    for replica, text in sorted(per_replica.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, family)
            if merged is not family:
                merged.samples.extend(_labelled(family.samples, replica))
            else:
                family.samples[:] = _labelled(family.samples, replica)
    lines: list[str] = []
    for family in families.values():
        name = family.name
        if family.type == "counter":
            name_total = name + "_total"
            lines.append(f"# HELP {name_total} {family.documentation}")
            lines.append(f"# TYPE {name_total} counter")
        else:
            lines.append(f"# HELP {name} {family.documentation}")
            lines.append(f"# TYPE {name} {family.type}")
        for sample in family.samples:
            labels = ",".join(f'{key}="{_escape(value)}"' for key, value in sample.labels.items())
            lines.append(f"{sample.name}{{{labels}}} {floatToGoString(sample.value)}")
    return "\n".join(lines) + "\n"


def _labelled(samples: list[Any], replica: str) -> list[Any]:
    return [s._replace(labels={"replica": replica, **s.labels}) for s in samples]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
