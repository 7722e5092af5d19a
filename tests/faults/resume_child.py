"""A training run that can be killed (SIGKILL, no cleanup) at a chosen point.

Used by test_exact_resume.py:  python resume_child.py RUN_DIR WORKERS KILL_AT [--resume]
KILL_AT: never | step:N (as step N+1 starts, after step N's checkpoint) |
         epoch_end:E (as epoch E+1's first step starts) | after_last (before the export).
"""

from __future__ import annotations

import os
import signal
import sys

import torch

import stoker
import stoker.train.loop as loop_module
import stoker.train.session as session_module


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(96, 6, generator=generator)
    return features, (features[:, 0] + features[:, 1] > 0).long()


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    # Dropout draws from the global RNG: a resume that loses the RNG state differs.
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 2)
    )


def kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(kill_at: str) -> None:
    kind, _, value = kill_at.partition(":")
    if kind == "after_last":
        session_module.export_safetensors = lambda *a, **k: kill()
        return
    real_step, real_plain = loop_module.train_step, loop_module.plain_step
    steps_per_epoch = 6  # 96 samples / batch 16

    def kill_if_due(loop) -> None:
        done = loop.state.step
        if (kind == "step" and done == int(value)) or (
            kind == "epoch_end" and done == (int(value) + 1) * steps_per_epoch
        ):
            kill()

    def step(loop, *args, **kwargs):
        kill_if_due(loop)
        return real_step(loop, *args, **kwargs)

    def plain(loop, metrics):  # the common run's steps (plain_step), killed the same way
        inner = real_plain(loop, metrics)
        if inner is None:
            return None

        def killing_step(batches, window):
            kill_if_due(loop)
            return inner(batches, window)

        return killing_step

    loop_module.train_step, loop_module.plain_step = step, plain


def main() -> None:
    run_dir, workers, kill_at = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    resume = "--resume" in sys.argv
    if kill_at != "never" and not resume:
        arm(kill_at)
    x, y = data()
    stoker.fit(
        model(), (x, y), epochs=3, batch_size=16, lr=0.05, schedule="cosine", seed=5,
        num_workers=workers, every_steps=1 if kill_at.startswith("step") else None,
        keep_last=2, tensorboard=False, fingerprint="fast", progress="quiet",
        **({"resume": run_dir} if resume else {"run_dir": run_dir}),
    )  # fmt: skip


if __name__ == "__main__":
    main()
