"""The autograd graph behind a loss, as nodes and edges, a Mermaid flowchart or a text tree."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from stoker.errors import StokerError

if TYPE_CHECKING:
    from stoker.train.pipeline import Pipeline

__all__ = ["GraphEdge", "GraphExplanation", "GraphNode", "explain", "explain_first_batch"]

Shape = tuple[int, ...]
Direction = Literal["LR", "RL", "TB", "BT"]


@dataclass(frozen=True)
class GraphNode:
    """One node of the graph: the loss, an autograd function, or a leaf tensor.

    Attributes:
        id: Stable within one explanation: ``loss``, then ``n1``, ``n2``, ... in walk order.
        kind: ``loss`` (the root), ``function`` (a ``grad_fn``) or ``leaf``.
        name: ``loss``, the function's class (``MulBackward0``), or the leaf's name (from
            ``params``, e.g. ``0.weight``; ``leaf1``, ``leaf2``, ... when not given).
        grad_fn: The autograd node's class: the loss's ``grad_fn``, the function itself, or
            ``AccumulateGrad`` for a leaf (the node that adds into ``.grad``).
        shapes: The tensor's shape for the loss and leaves; for a function, the shape of
            each output of the forward operation (the gradients it receives). Empty when
            PyTorch does not expose them.
        requires_grad: Whether the tensor takes part in autograd (always, for functions).
        is_leaf: Whether the tensor is a leaf (a parameter or an input made by the user).
        dtype: The tensor's dtype (``float32``), for the loss and leaves.
    """

    id: str
    kind: Literal["loss", "function", "leaf"]
    name: str
    grad_fn: str | None
    shapes: tuple[Shape, ...]
    requires_grad: bool
    is_leaf: bool
    dtype: str | None = None


@dataclass(frozen=True)
class GraphEdge:
    """The gradient flows from ``source`` to ``target`` in ``backward()`` (loss towards leaves)."""

    source: str
    target: str


@dataclass(frozen=True)
class GraphExplanation:
    """The graph ``backward()`` walks: from the loss, through each ``grad_fn``, to the leaves.

    Attributes:
        nodes: The loss first, then every node in breadth-first order from it.
        edges: In the direction of the backward pass: ``loss -> ... -> leaf``.
        omitted: Nodes past ``max_nodes`` that were counted but not kept.
        max_nodes: The limit the graph was walked with.
    """

    nodes: tuple[GraphNode, ...]
    edges: tuple[GraphEdge, ...]
    omitted: int = 0
    max_nodes: int = 200

    def node(self, node_id: str) -> GraphNode:
        """The node with id ``node_id``."""
        for node in self.nodes:
            if node.id == node_id:
                return node
        raise KeyError(node_id)

    @property
    def leaves(self) -> tuple[GraphNode, ...]:
        """The leaf tensors: where ``backward()`` writes ``.grad``."""
        return tuple(node for node in self.nodes if node.kind == "leaf")

    def children(self, node_id: str) -> tuple[GraphNode, ...]:
        """The nodes the gradient flows to next from ``node_id``."""
        return tuple(self.node(edge.target) for edge in self.edges if edge.source == node_id)

    def note(self) -> str | None:
        """The truncation note, when nodes were left out."""
        if not self.omitted:
            return None
        return (
            f"{self.omitted} more autograd node(s) not shown (max_nodes={self.max_nodes}; "
            "raise it to see the whole graph)"
        )

    def to_mermaid(self, *, direction: Direction = "LR") -> str:
        """A Mermaid ``flowchart``: the loss at one end, the leaves at the other.

        Arrows follow ``backward()``: from the loss through each function to the leaves.
        Leaves are drawn with rounded corners and the loss as a stadium.

        Args:
            direction: ``LR`` puts the loss on the left; ``BT`` at the bottom, and so on.
        """
        lines = [
            f"flowchart {direction}",
            "    %% arrows follow backward(): from the loss through each grad_fn to the leaves",
        ]
        for node in self.nodes:
            label = "<br/>".join(_label_lines(node)).replace('"', "#quot;")
            opening, closing = {"loss": ('(["', '"])'), "leaf": ('("', '")')}.get(
                node.kind, ('["', '"]')
            )
            lines.append(f"    {node.id}{opening}{label}{closing}")
        lines.extend(f"    {edge.source} --> {edge.target}" for edge in self.edges)
        if self.omitted:
            lines.append(f'    more["… {self.note()}"]')
        lines.append("    classDef leafNode fill:#e8f5e9,stroke:#2e7d32")
        lines.append("    classDef lossNode fill:#fff3e0,stroke:#ef6c00")
        for kind in ("leaf", "loss"):
            ids = [node.id for node in self.nodes if node.kind == kind]
            if ids:
                lines.append(f"    class {','.join(ids)} {kind}Node")
        return "\n".join(lines) + "\n"

    def to_text(self) -> str:
        """An indented tree from the loss down to the leaves, one node per line.

        A node reached a second time (a parameter used twice, a residual branch) is printed
        once in full; later mentions say ``(shown above)``.
        """
        by_id = {node.id: node for node in self.nodes}
        children: dict[str, list[str]] = {}
        for edge in self.edges:
            children.setdefault(edge.source, []).append(edge.target)
        lines: list[str] = []
        shown: set[str] = set()
        # Iterative depth-first walk: deep graphs must not hit Python's recursion limit.
        stack: list[tuple[str, str, bool]] = [("loss", "", True)]
        while stack:
            node_id, prefix, last = stack.pop()
            node = by_id[node_id]
            branch = "" if node_id == "loss" else ("└─ " if last else "├─ ")
            if node_id in shown:
                lines.append(f"{prefix}{branch}{node.name} (shown above)")
                continue
            shown.add(node_id)
            lines.append(f"{prefix}{branch}{_text_line(node)}")
            child_prefix = "" if node_id == "loss" else prefix + ("   " if last else "│  ")
            below = children.get(node_id, [])
            for index in reversed(range(len(below))):
                stack.append((below[index], child_prefix, index == len(below) - 1))
        if self.omitted:
            lines.append(f"… {self.note()}")
        return "\n".join(lines) + "\n"


def explain(
    loss: torch.Tensor,
    *,
    params: Mapping[str, torch.Tensor] | None = None,
    max_nodes: int = 200,
) -> GraphExplanation:
    """Walks ``loss.grad_fn`` the way ``backward()`` will, and describes every node.

    Nothing is computed and no gradient is written: only the graph's metadata is read.

    Args:
        loss: The tensor ``backward()`` would be called on (usually a scalar).
        params: Names for leaf tensors, matched by identity, e.g.
            ``dict(model.named_parameters())`` or ``{"x": x}``.
        max_nodes: Keep at most this many nodes (the loss included); the rest are counted
            and noted.

    Returns:
        The graph, with ``to_mermaid()`` and ``to_text()``.

    Raises:
        StokerError: ``loss`` does not require grad (it has no graph to walk).
        ValueError: ``max_nodes`` is below 2.
    """
    if max_nodes < 2:
        raise ValueError(f"max_nodes={max_nodes}: the loss and its grad_fn need at least 2")
    if not loss.requires_grad:
        raise StokerError(
            f"the loss (shape {tuple(loss.shape)}) has no autograd graph: requires_grad=False",
            hint="compute it outside torch.no_grad()/torch.inference_mode(), from parameters "
            "or inputs with requires_grad=True, and without .detach()",
        )
    names = {id(tensor): name for name, tensor in (params or {}).items()}
    root_fn = loss.grad_fn
    nodes = [
        GraphNode(
            id="loss",
            kind="loss",
            name="loss",
            grad_fn=type(root_fn).__name__ if root_fn is not None else None,
            shapes=(tuple(loss.shape),),
            requires_grad=loss.requires_grad,
            is_leaf=loss.is_leaf,
            dtype=_dtype(loss),
        )
    ]
    if root_fn is None:  # the loss is itself a leaf: nothing to walk
        return GraphExplanation(nodes=tuple(nodes), edges=(), max_nodes=max_nodes)

    edges: list[GraphEdge] = [GraphEdge("loss", "n1")]
    # Keyed by id(): autograd nodes are neither hashable by value nor comparable. The graph
    # (held by `loss`) keeps every node alive while we walk, so ids are not reused.
    ids: dict[int, str] = {id(root_fn): "n1"}
    queue: deque[Any] = deque([root_fn])
    unnamed = (f"leaf{index}" for index in itertools.count(1))
    omitted = 0
    while queue:
        fn = queue.popleft()
        node_id = ids[id(fn)]
        kept = node_id != ""
        if kept:
            nodes.append(_describe(fn, node_id, names, unnamed))
        for next_fn, _ in getattr(fn, "next_functions", ()):
            if next_fn is None:  # an input that does not require grad
                continue
            target = ids.get(id(next_fn))
            if target is None:
                # Past the limit the walk goes on only to count what is left out.
                target = f"n{len(ids) + 1}" if len(ids) + 1 < max_nodes else ""
                omitted += target == ""
                ids[id(next_fn)] = target
                queue.append(next_fn)
            if kept and target:
                edges.append(GraphEdge(node_id, target))
    return GraphExplanation(
        nodes=tuple(nodes), edges=tuple(edges), omitted=omitted, max_nodes=max_nodes
    )


def explain_first_batch(pipeline: Pipeline, *, max_nodes: int = 200) -> GraphExplanation:
    """The graph of one training loss: the first batch, forward, loss; no backward.

    The batch goes through the model exactly as in training: moved to the pipeline's
    device, split into inputs and targets, forwarded in train mode and in the run's
    precision (so autocast's casts show up as nodes). Leaves are named after the model's
    parameters.

    Args:
        pipeline: From :func:`stoker.train.pipeline.build_pipeline`.
        max_nodes: Keep at most this many nodes.

    Raises:
        DataError: The training data yields no batch, or the output does not fit the loss.
    """
    # Imported here: the training package pulls in the loop, which observe must not need.
    from stoker.data.device import move_to_device
    from stoker.errors import DataError
    from stoker.train.batch import explain_loss_failure, forward, split_batch
    from stoker.train.precision import build_precision

    model = pipeline.model.to(pipeline.device).train()
    batches = iter(pipeline.train_loader)
    try:
        batch = next(batches)
    except StopIteration:
        raise DataError(
            "the training data yielded no batch", hint="check data.train and loader.drop_last"
        ) from None
    finally:
        del batches  # stops loader workers
    inputs, targets = split_batch(move_to_device(batch, pipeline.device))
    precision = build_precision(pipeline.config.train, pipeline.device)
    with precision.autocast():
        outputs = forward(model, inputs)
        try:
            loss = pipeline.loss_fn(outputs, targets)
        except (RuntimeError, ValueError, IndexError) as error:
            name = pipeline.config.loss.name
            raise explain_loss_failure(error, outputs, targets, loss_name=name) from error
    return explain(loss, params=dict(model.named_parameters()), max_nodes=max_nodes)


def _describe(fn: Any, node_id: str, names: Mapping[int, str], unnamed: Iterator[str]) -> GraphNode:
    fn_name = type(fn).__name__
    variable = getattr(fn, "variable", None)
    if isinstance(variable, torch.Tensor):  # AccumulateGrad: the leaf behind it
        return GraphNode(
            id=node_id,
            kind="leaf",
            name=names.get(id(variable)) or next(unnamed),
            grad_fn=fn_name,
            shapes=(tuple(variable.shape),),
            requires_grad=variable.requires_grad,
            is_leaf=variable.is_leaf,
            dtype=_dtype(variable),
        )
    return GraphNode(
        id=node_id,
        kind="function",
        name=fn_name,
        grad_fn=fn_name,
        shapes=_output_shapes(fn),
        requires_grad=True,
        is_leaf=False,
    )


def _output_shapes(fn: Any) -> tuple[Shape, ...]:
    """The shapes of a function's forward outputs, read from autograd's input metadata.

    ``_input_metadata`` is what autograd checks incoming gradients against; it is
    private, so any failure just leaves the shapes out.
    """
    try:
        return tuple(tuple(meta.shape) for meta in fn._input_metadata)
    except (AttributeError, RuntimeError, TypeError):
        return ()


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _shape_text(shapes: tuple[Shape, ...]) -> str:
    return ", ".join(str(shape) for shape in shapes) if shapes else "?"


def _label_lines(node: GraphNode) -> list[str]:
    if node.kind == "function":
        return [node.name, f"out {_shape_text(node.shapes)}"]
    flags = f"requires_grad={node.requires_grad}"
    if node.kind == "leaf":
        return [node.name, f"leaf {_shape_text(node.shapes)} {node.dtype}", flags]
    return [node.name, f"{_shape_text(node.shapes)} {node.dtype}", f"grad_fn={node.grad_fn}"]


def _text_line(node: GraphNode) -> str:
    shape = _shape_text(node.shapes)
    if node.kind == "function":
        return f"{node.name}  out={shape}"
    what = "leaf" if node.is_leaf else "not a leaf"
    return (
        f"{node.name}  {what}  shape={shape}  dtype={node.dtype}  "
        f"requires_grad={node.requires_grad}  grad_fn={node.grad_fn}"
    )
