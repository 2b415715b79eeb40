"""Every replica's /metrics as one Prometheus exposition, each sample labelled with its replica.

Concatenating the replicas' texts would repeat each metric family (a scraper may refuse the
second); here each family is written once, with every replica's samples under it.
"""

from __future__ import annotations

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


class _Families:
    def __init__(self, families):
        self.families = families

    def collect(self):
        return iter(self.families)


def labelled(texts: dict[str, str]) -> bytes:
    """`texts`: replica id -> its exposition."""
    merged: dict[str, Metric] = {}  # family name -> the first replica's family, every replica's samples
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            into = merged.setdefault(family.name, family)
            samples = [s._replace(labels={**s.labels, "replica": replica}) for s in family.samples]
            if into is family:
                family.samples = samples
            else:
                into.samples.extend(samples)
    return generate_latest(_Families(list(merged.values())))
