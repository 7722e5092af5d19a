"""Tests for stoker.observe.explain and the `stoker explain` subcommand."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from torch import nn

from stoker.cli import explain as explain_cli
from stoker.errors import StokerError
from stoker.observe.explain import GraphEdge, explain

DIGITS = Path(__file__).parents[3] / "examples" / "digits.yaml"


def _seed_example() -> tuple[torch.Tensor, torch.Tensor]:
    """The seeds' first autograd example: z = x**2 + 5 at x = 3."""
    x = torch.tensor(3.0, requires_grad=True)
    y = x**2
    z = y + 5
    return x, z


def _linear_loss() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    outputs = model(torch.randn(5, 4))
    loss = nn.CrossEntropyLoss()(outputs, torch.tensor([0, 1, 2, 0, 1]))
    return model, loss


def test_seed_example_walks_add_pow_then_the_leaf() -> None:
    x, z = _seed_example()
    graph = explain(z, params={"x": x})

    assert [(n.id, n.kind, n.name) for n in graph.nodes] == [
        ("loss", "loss", "loss"),
        ("n1", "function", "AddBackward0"),
        ("n2", "function", "PowBackward0"),
        ("n3", "leaf", "x"),
    ]
    assert graph.edges == (
        GraphEdge("loss", "n1"),
        GraphEdge("n1", "n2"),
        GraphEdge("n2", "n3"),
    )
    root, _, _, leaf = graph.nodes
    assert (root.grad_fn, root.shapes, root.is_leaf, root.requires_grad) == (
        "AddBackward0",
        ((),),
        False,
        True,
    )
    assert (leaf.grad_fn, leaf.shapes, leaf.is_leaf, leaf.requires_grad, leaf.dtype) == (
        "AccumulateGrad",
        ((),),
        True,
        True,
        "float32",
    )
    # Explaining computes nothing: no gradient was written.
    assert x.grad is None


def test_leaves_without_a_name_are_numbered() -> None:
    _, z = _seed_example()
    assert [leaf.name for leaf in explain(z).leaves] == ["leaf1"]


def test_linear_cross_entropy_names_parameters_and_shapes() -> None:
    model, loss = _linear_loss()
    graph = explain(loss, params=dict(model.named_parameters()))

    assert {leaf.name: leaf.shapes[0] for leaf in graph.leaves} == {
        "0.weight": (3, 4),
        "0.bias": (3,),
    }
    names = [node.name for node in graph.nodes if node.kind == "function"]
    assert names[:3] == ["NllLossBackward0", "LogSoftmaxBackward0", "AddmmBackward0"]
    addmm = graph.node("n3")
    assert addmm.shapes == ((5, 3),)  # the forward output: batch x classes
    assert {child.name for child in graph.children("n3")} == {"0.bias", "TBackward0"}
    # Every edge joins nodes that exist, and every leaf is reached from the loss.
    ids = {node.id for node in graph.nodes}
    assert all(edge.source in ids and edge.target in ids for edge in graph.edges)
    assert graph.omitted == 0


def test_a_parameter_used_twice_is_one_node() -> None:
    w = torch.ones(2, requires_grad=True)
    loss = (w * w).sum()
    graph = explain(loss, params={"w": w})
    assert [leaf.name for leaf in graph.leaves] == ["w"]
    (leaf,) = graph.leaves
    assert [e for e in graph.edges if e.target == leaf.id] == [GraphEdge("n2", leaf.id)] * 2


def test_max_nodes_truncates_with_a_count() -> None:
    model, loss = _linear_loss()
    full = explain(loss, params=dict(model.named_parameters()))
    short = explain(loss, params=dict(model.named_parameters()), max_nodes=3)
    assert len(short.nodes) == 3
    assert short.omitted == len(full.nodes) - 3
    assert all(edge.target in {n.id for n in short.nodes} for edge in short.edges)
    assert f"{short.omitted} more autograd node(s) not shown" in short.to_text()
    assert "not shown" in short.to_mermaid()


def test_to_mermaid_is_a_flowchart_from_loss_to_leaves() -> None:
    x, z = _seed_example()
    mermaid = explain(z, params={"x": x}).to_mermaid()
    lines = [line.strip() for line in mermaid.splitlines()]
    assert lines[0] == "flowchart LR"
    assert 'loss(["loss<br/>() float32<br/>grad_fn=AddBackward0"])' in lines
    assert 'n1["AddBackward0<br/>out ()"]' in lines
    assert 'n3("x<br/>leaf () float32<br/>requires_grad=True")' in lines
    assert [line for line in lines if "-->" in line] == [
        "loss --> n1",
        "n1 --> n2",
        "n2 --> n3",
    ]
    assert "class n3 leafNode" in lines
    assert explain(z).to_mermaid(direction="BT").startswith("flowchart BT\n")


def test_to_text_is_an_indented_tree() -> None:
    x, z = _seed_example()
    assert explain(z, params={"x": x}).to_text() == (
        "loss  not a leaf  shape=()  dtype=float32  requires_grad=True  grad_fn=AddBackward0\n"
        "└─ AddBackward0  out=()\n"
        "   └─ PowBackward0  out=()\n"
        "      └─ x  leaf  shape=()  dtype=float32  requires_grad=True  grad_fn=AccumulateGrad\n"
    )


def test_to_text_marks_a_node_reached_twice() -> None:
    w = torch.ones(2, requires_grad=True)
    text = explain((w * w).sum(), params={"w": w}).to_text()
    assert text.count("w  leaf") == 1
    assert "w (shown above)" in text


def test_a_loss_without_a_graph_is_explained() -> None:
    with torch.no_grad():
        loss = torch.ones(3, requires_grad=True).sum()
    with pytest.raises(StokerError, match="requires_grad=False") as caught:
        explain(loss)
    assert "no_grad" in str(caught.value)


def _cli_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="stoker")
    explain_cli.add_parser(parser.add_subparsers(), parents=[])
    return parser.parse_args(["explain", *argv])


def test_cli_prints_the_digits_graph_as_text(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("sklearn", reason="the digits demo data comes with scikit-learn")
    args = _cli_args(str(DIGITS))
    assert args.run(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("loss  not a leaf  shape=()")
    # The demo MLP (64 -> 128 -> 64 -> 10) on a batch of 64.
    assert "LogSoftmaxBackward0  out=(64, 10)" in out
    for name, shape in [("0.weight", "(128, 64)"), ("2.weight", "(64, 128)"), ("4.bias", "(10,)")]:
        assert f"{name}  leaf  shape={shape}" in out


def test_cli_writes_mermaid_with_overrides(tmp_path: Path) -> None:
    pytest.importorskip("sklearn", reason="the digits demo data comes with scikit-learn")
    out = tmp_path / "graph.md"
    args = _cli_args(
        str(DIGITS),
        "model.args.hidden=[8]",
        "loader.batch_size=4",
        "--format",
        "mermaid",
        "--out",
        str(out),
        "--direction",
        "BT",
    )
    assert args.run(args) == 0
    text = out.read_text(encoding="utf-8")
    assert text.startswith("```mermaid\nflowchart BT\n")
    assert text.endswith("```\n")
    assert 'n2["LogSoftmaxBackward0<br/>out (4, 10)"]' in text
    assert "0.weight<br/>leaf (8, 64) float32" in text


def test_cli_rejects_a_node_limit_below_two() -> None:
    with pytest.raises(SystemExit):
        _cli_args(str(DIGITS), "--max-nodes", "1")
