"""SystemMonitor: worker CPU without listing every process when there are no workers."""

from __future__ import annotations

import torch

from stoker.observe.system import SystemMonitor


def test_without_workers_the_children_are_not_listed(monkeypatch) -> None:
    monitor = SystemMonitor(torch.device("cpu"))
    listed = []
    real = monitor._process.children
    monkeypatch.setattr(monitor._process, "children", lambda **k: listed.append(k) or real(**k))
    record = monitor.sample(num_workers=0)
    assert listed == []
    assert record["system/workers_cpu_pct"] == 0.0
    monitor.sample(num_workers=2)
    assert listed == [{"recursive": True}]
