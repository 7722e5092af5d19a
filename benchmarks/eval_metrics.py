"""What train.metrics cost a validation pass: none, four built-ins, a torchmetrics object.

One process, one thread, the contenders alternated round by round; prints the CPU time
of one pass over 20,000 samples (a small MLP, batches of 256) and the ratios to none.

    .venv/bin/python benchmarks/eval_metrics.py
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

from stoker.config import TrainConfig
from stoker.train.evaluate import evaluate
from stoker.train.metric_set import NO_METRICS, build_metrics
from stoker.train.precision import build_precision


def main(rounds: int = 15) -> None:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(20000, 64, generator=generator)
    labels = torch.randint(0, 10, (20000,), generator=generator)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    loader = DataLoader(TensorDataset(features, labels), batch_size=256)
    cpu = torch.device("cpu")
    precision = build_precision(TrainConfig(device="cpu"), cpu)
    contenders = {
        "none": NO_METRICS,
        "f1, precision, recall, top5_accuracy": build_metrics(
            ["f1", "precision", "recall", "top5_accuracy"]
        ),
    }
    try:
        import torchmetrics

        f1 = torchmetrics.classification.MulticlassF1Score(num_classes=10)
        contenders["torchmetrics MulticlassF1Score"] = build_metrics([], [(None, f1)])
    except ImportError:
        print("torchmetrics is not installed: pip install 'stoker[metrics]'")
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for round_ in range(rounds + 1):
        order = list(contenders.items())
        for name, metrics in order if round_ % 2 else reversed(order):
            started = time.process_time()
            evaluate(
                model,
                loader,
                torch.nn.functional.cross_entropy,
                device=cpu,
                precision=precision,
                task="classification",
                metrics=metrics,
            )
            if round_:  # the first round warms up
                times[name].append(time.process_time() - started)
    base = statistics.median(times["none"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:40s} {median * 1000:7.1f} ms CPU  x{median / base:.2f}")


if __name__ == "__main__":
    main()
