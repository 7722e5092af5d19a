"""OptimizerCalls: optimizer.step() and zero_grad() through public calls only, and no
private PyTorch name anywhere in stoker/train."""

from __future__ import annotations

import io
import tokenize
import types
from pathlib import Path

import pytest
import torch
from torch import nn

import stoker.train
from stoker.train.optim_calls import OptimizerCalls
from stoker.train.precision import Precision

CPU = torch.device("cpu")
FP32 = Precision("fp32", CPU)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(16, 6, generator=generator), torch.randint(0, 3, (16,), generator=generator)


def _train(model: nn.Module, step, zero_grad, steps: int = 5) -> None:
    for index in range(steps):
        x, y = _batch(index)
        nn.functional.cross_entropy(model(x), y).backward()
        step()
        zero_grad()


@pytest.mark.parametrize("fused", [True, False])
def test_the_update_is_bitwise_optimizer_step(fused: bool) -> None:
    plain_model, called_model = _model(), _model()
    plain = torch.optim.Adam(plain_model.parameters(), lr=0.01, fused=fused)
    called = torch.optim.Adam(called_model.parameters(), lr=0.01, fused=fused)
    calls = OptimizerCalls(called, FP32)
    _train(plain_model, plain.step, plain.zero_grad)
    _train(called_model, calls.step, calls.zero_grad)
    for p, q in zip(plain_model.parameters(), called_model.parameters(), strict=True):
        assert torch.equal(p, q) and q.grad is None
        for key in plain.state[p]:
            assert torch.equal(plain.state[p][key], called.state[q][key])


def test_hooks_and_a_later_wrapper_of_step_run() -> None:
    """Step hooks and a step wrapper installed after OptimizerCalls was built are called."""
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    calls = OptimizerCalls(optimizer, FP32)
    seen: list[str] = []
    optimizer.register_step_pre_hook(lambda *args: seen.append("hook"))
    class_step = type(optimizer).step

    def wrapped(self, *args, **kwargs):
        seen.append("wrapper")
        return class_step(self, *args, **kwargs)

    optimizer.step = types.MethodType(wrapped, optimizer)  # type: ignore[method-assign]
    _train(model, calls.step, calls.zero_grad, steps=2)
    assert seen == ["wrapper", "hook", "wrapper", "hook"]


def test_an_optimizer_with_its_own_zero_grad_gets_it_called() -> None:
    class Counting(torch.optim.SGD):
        calls = 0

        def zero_grad(self, set_to_none: bool = True) -> None:
            Counting.calls += 1
            super().zero_grad(set_to_none)

    model = _model()
    calls = OptimizerCalls(Counting(model.parameters(), lr=0.1), FP32)
    _train(model, calls.step, calls.zero_grad, steps=3)
    assert Counting.calls == 3
    assert all(p.grad is None for p in model.parameters())


def test_scaled_loss_steps_through_the_scaler() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precision = Precision("fp16", CPU)
    calls = OptimizerCalls(optimizer, precision)
    x, y = _batch(0)
    precision.backward(nn.functional.cross_entropy(model(x), y))
    precision.unscale_(optimizer)
    calls.step()
    assert precision.scaler.get_scale() == pytest.approx(65536.0)  # update() ran: no overflow


def _code_tokens(source: str) -> list[str]:
    """The names and operators of ``source``, without its comments and docstrings."""
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    kept: list[str] = []
    for index, token in enumerate(tokens):
        if token.type == tokenize.COMMENT:
            continue
        if token.type == tokenize.STRING:
            before = [t for t in tokens[:index] if t.type not in (tokenize.NL, tokenize.COMMENT)]
            # A string alone on its line is a docstring; any other string is kept.
            if not before or before[-1].type in (tokenize.NEWLINE, tokenize.INDENT):
                continue
        kept.append(token.string)
    return kept


#: What a private PyTorch name looks like in code (tokens joined without spaces).
_PRIVATE = ("torch._", 'getattr(torch,"_', "._optimizer_step", "_global_optimizer", "._foreach_")


def test_no_private_torch_name_in_the_training_path() -> None:
    """DESIGN.md principle 8: ``torch._*`` and private optimizer attributes stay out of
    stoker/train (a docstring or comment may still name them, to say why not)."""
    offenders: list[str] = []
    for path in sorted(Path(stoker.train.__file__).parent.glob("*.py")):
        tokens = _code_tokens(path.read_text())
        code = "".join(tokens).replace("'", '"')
        for marker in _PRIVATE:
            if marker in code:
                offenders.append(f"{path.name}: {marker}")
    assert not offenders, offenders


def test_the_private_name_check_sees_code_but_not_docstrings() -> None:
    source = '"""torch._fused_adam_ is named here."""\n# torch._foo\nx = 1\n'
    assert "torch._" not in "".join(_code_tokens(source))
    assert "torch._" in "".join(_code_tokens("y = torch._foreach_norm(x)\n"))
    assert 'getattr(torch,"_' in "".join(_code_tokens('f = getattr(torch, "_amp")\n'))
