"""``stoker explain CONFIG [key=value ...]``: print the autograd graph of one training loss."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from stoker.cli.options import add_config_and_overrides

if TYPE_CHECKING:
    from stoker.observe.explain import GraphExplanation


def add_parser(subparsers: argparse._SubParsersAction, *, parents: list) -> None:
    """Add ``stoker explain`` and its arguments to the CLI's subcommands."""
    parser = subparsers.add_parser(
        "explain",
        parents=parents,
        help="show the autograd graph of one training loss",
        description=(
            "Build the run's model, data and loss from a YAML run config, take the first "
            "training batch, compute the loss (no backward, no optimizer step) and print the "
            "graph backward() would walk: every grad_fn from the loss to the parameters, with "
            "shapes, requires_grad and which tensors are leaves."
        ),
    )
    add_config_and_overrides(parser, example="model.args.hidden=[32]")
    parser.add_argument(
        "--format",
        choices=("mermaid", "text"),
        default="text",
        help="a Mermaid flowchart, or an indented text tree (default)",
    )
    parser.add_argument(
        "--direction",
        choices=("LR", "RL", "TB", "BT"),
        default="LR",
        help="Mermaid only: where the loss goes (LR: loss on the left, leaves on the right)",
    )
    parser.add_argument(
        "--out",
        metavar="FILE",
        help="write the graph to FILE instead of printing it (a .md file gets a mermaid fence)",
    )
    parser.add_argument(
        "--max-nodes",
        type=_node_limit,
        default=200,
        metavar="N",
        help="show at most N nodes; the rest are counted (default: 200)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``stoker explain``: print the autograd graph of the first batch's loss."""
    # Imported here: building a pipeline imports the training stack, which `--help` skips.
    from stoker.config import load_config
    from stoker.observe.explain import explain_first_batch
    from stoker.train.pipeline import build_pipeline
    from stoker.train.state import seed_everything

    config = load_config(args.config, args.overrides)
    # The same seed as `stoker train`: the same initial weights and the same first batch.
    seed_everything(config.seed)
    graph = explain_first_batch(build_pipeline(config), max_nodes=args.max_nodes)
    text = render(graph, fmt=args.format, direction=args.direction, out=args.out)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"stoker: wrote the graph ({len(graph.nodes)} nodes) to {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def render(
    graph: GraphExplanation, *, fmt: str, direction: str = "LR", out: str | None = None
) -> str:
    """The graph as the CLI prints it; a Markdown file gets a fenced ``mermaid`` block.

    Args:
        graph: From :func:`~stoker.observe.explain.explain`.
        fmt: ``text`` or ``mermaid``.
        direction: Mermaid's flowchart direction.
        out: The file it goes to, if any (its suffix picks the fence).
    """
    if fmt == "text":
        return graph.to_text()
    mermaid = graph.to_mermaid(direction=direction)  # type: ignore[arg-type]
    if out is not None and Path(out).suffix.lower() in (".md", ".markdown"):
        return f"```mermaid\n{mermaid}```\n"
    return mermaid


def _node_limit(value: str) -> int:
    number = int(value)
    if number < 2:
        raise argparse.ArgumentTypeError(f"{value}: the loss and its grad_fn need at least 2")
    return number
