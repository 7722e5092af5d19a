"""The per-step finiteness check, the fault description and the guard's bookkeeping."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stoker.errors import ConfigError, TrainingError
from stoker.train.grads import FiniteCheck
from stoker.train.numerics import Fault, NumericsGuard, describe_fault


def _with_grads(*grads: torch.Tensor) -> list[nn.Parameter]:
    params = []
    for grad in grads:
        parameter = nn.Parameter(torch.zeros(grad.shape, dtype=grad.dtype))
        parameter.grad = grad.clone()
        params.append(parameter)
    return params


def test_finite_check_finds_nan_in_any_dtype_and_leaves_gradients_bitwise_alone() -> None:
    params = _with_grads(
        torch.tensor([1e-40, 3e38, -0.0]),  # subnormal, huge, negative zero: kept exactly
        torch.randn(4).bfloat16(),
        torch.randn(2).half(),
    )
    before = [p.grad.clone() for p in params]
    check = FiniteCheck(params)
    assert check(torch.tensor(0.5)) == (True, True)
    for old, p in zip(before, params, strict=True):
        assert torch.equal(old, p.grad) and old.dtype == p.grad.dtype
    params[1].grad[2] = float("nan")
    assert check(torch.tensor(0.5)) == (True, False)
    check.reset()  # the loop lowers the flag after a bad step
    params[1].grad[2] = 1.0
    assert check(torch.tensor(0.5)) == (True, True)
    assert check(torch.tensor(float("inf"))) == (False, True)


def test_finite_check_of_one_cpu_group_tells_the_loss_and_the_gradients_apart() -> None:
    params = _with_grads(torch.randn(3), torch.randn(2))  # one float32 group on the CPU
    check = FiniteCheck(params)
    before = [p.grad.clone() for p in params]
    assert check(torch.tensor(0.5)) == (True, True)
    assert all(torch.equal(old, p.grad) for old, p in zip(before, params, strict=True))
    assert check(torch.tensor(float("nan"))) == (False, True)
    assert check(torch.tensor(0.5)) == (True, True)
    params[0].grad[1] = float("inf")
    assert check(torch.tensor(0.5)) == (True, False)
    assert check(torch.tensor(float("inf"))) == (False, False)
    check.reset()
    params[0].grad[1] = 0.0
    assert check(torch.tensor(0.5)) == (True, True)


def test_finite_check_handles_sparse_gradients_and_parameters_without_one() -> None:
    embedding = nn.Embedding(10, 3, sparse=True)
    frozen = nn.Parameter(torch.zeros(2))  # never gets a gradient
    embedding(torch.tensor([1, 2])).sum().backward()
    check = FiniteCheck([*embedding.parameters(), frozen])
    assert check(torch.tensor(1.0)) == (True, True)
    embedding.weight.grad = torch.sparse_coo_tensor(
        torch.tensor([[4]]),
        torch.tensor([[float("inf"), 0.0, 0.0]]),
        (10, 3),
        check_invariants=True,
    )
    assert check(torch.tensor(1.0)) == (True, False)


def test_describe_fault_names_the_first_bad_parameter_without_the_compile_prefix() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    model(torch.ones(1, 2)).sum().backward()
    model[1].bias.grad[0] = float("nan")
    fault = describe_fault(model, torch.tensor(0.25), step=7, epoch=1, loss_ok=True)
    assert fault == Fault(7, 1, "gradient", 0.25, fault.grad_norm, "1.bias")
    assert str(fault).startswith(
        "non-finite gradient at step 7 (epoch 1): loss=0.25, grad norm=nan"
    )

    class Compiled(nn.Module):  # what torch.compile's wrapper looks like to named_parameters
        def __init__(self) -> None:
            super().__init__()
            self._orig_mod = model

    fault = describe_fault(Compiled(), torch.tensor(0.25), step=7, epoch=1, loss_ok=True)
    assert fault.parameter == "1.bias"


def _fault(step: int) -> Fault:
    return Fault(step, 0, "loss", float("nan"), float("nan"), None)


def test_guard_counts_skips_up_to_the_limit() -> None:
    guard = NumericsGuard("skip", max_skipped_steps=2)
    assert "skipped the step (1 of at most 2" in guard.count_skip(_fault(3))
    guard.count_skip(_fault(5))
    with pytest.raises(TrainingError, match=r"max_skipped_steps=2\): steps 3, 5"):
        guard.count_skip(_fault(9))
    assert guard.epoch_record(loss_scale=None) == {"numerics/skipped_steps": 2}


def test_guard_counts_rollbacks_up_to_the_limit() -> None:
    guard = NumericsGuard("rollback", max_rollbacks=1)
    guard.count_rollback(_fault(4))
    with pytest.raises(TrainingError, match=r"max_rollbacks=1\), at steps 4"):
        guard.count_rollback(_fault(4))


def test_guard_refuses_an_unknown_policy() -> None:
    with pytest.raises(ConfigError, match="train.on_nonfinite: 'ignore' is not one of"):
        NumericsGuard("ignore")  # type: ignore[arg-type]


def test_min_loss_scale_sets_where_the_scale_counts_as_collapsed() -> None:
    guard = NumericsGuard(min_loss_scale=1024)
    assert guard.overflowed(1, scale_before=4096.0, scale_after=2048.0) is None
    assert guard.overflowed(2, scale_before=2048.0, scale_after=1024.0) is None
    with pytest.raises(TrainingError) as info:
        guard.overflowed(3, scale_before=1024.0, scale_after=512.0)
    assert str(info.value).startswith(
        "fp16 loss scale collapsed from 4096 to 512 after 3 consecutive overflow steps (steps 1-3)"
    )
    guard.stepped()  # a good step ends a streak
    assert guard.overflowed(9, scale_before=4096.0, scale_after=2048.0) is None


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_check_on_cuda_reads_once_and_finds_each_kind(dtype) -> None:
    cuda = torch.device("cuda")
    params = [
        nn.Parameter(torch.zeros(1000, device=cuda, dtype=dtype)),
        nn.Parameter(torch.zeros(3, device=cuda)),
    ]
    for parameter in params:
        parameter.grad = torch.ones_like(parameter)
    check = FiniteCheck(params)
    assert check(torch.tensor(0.5, device=cuda)) == (True, True)
    params[0].grad[999] = float("nan")
    assert check(torch.tensor(0.5, device=cuda)) == (True, False)
    check.reset()
    params[0].grad[999] = 1.0
    assert check(torch.tensor(0.5, device=cuda)) == (True, True)
    assert check(torch.tensor(float("inf"), device=cuda)) == (False, True)
    assert torch.equal(params[0].grad, torch.ones_like(params[0].grad))


def test_finite_check_joins_matrices_and_vectors_of_one_group() -> None:
    params = _with_grads(torch.randn(3, 4), torch.randn(3), torch.randn(2, 3).t())  # strided
    check = FiniteCheck(params)
    assert check(torch.tensor(0.5)) == (True, True)
    params[2].grad[1, 0] = float("-inf")
    assert check(torch.tensor(0.5)) == (True, False)
    params[2].grad[1, 0] = 0.0
    params[0].grad[2, 3] = 3e38  # finite, but the sum overflows: looked at element-wise
    params[1].grad[0] = 3e38
    assert check(torch.tensor(0.5)) == (True, True)
