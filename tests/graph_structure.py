"""Reading a traced step's structure: its ops, the functions it calls, and their bodies."""

from __future__ import annotations

import tensorflow as tf

CALL_OPS = ("PartitionedCall", "StatefulPartitionedCall")


def function_library(graph: tf.Graph) -> dict[str, object]:
    """Function name -> FunctionDef for every function the graph (transitively) calls."""
    return {f.signature.name: f for f in graph.as_graph_def().library.function}


def called_function(op: tf.Operation) -> str:
    return op.get_attr("f").name


def call_ops(graph: tf.Graph, prefix: str = "") -> list[tf.Operation]:
    """The function-call ops of the graph whose name starts with `prefix`."""
    return [op for op in graph.get_operations()
            if op.type in CALL_OPS and op.name.startswith(prefix)]


def total_op_count(graph: tf.Graph) -> int:
    """Ops of the graph plus the nodes of every function body in its library."""
    graph_def = graph.as_graph_def()
    return len(graph_def.node) + sum(len(f.node_def) for f in graph_def.library.function)


def body_node_names(graph: tf.Graph, function_name: str) -> list[str]:
    return [n.name for n in function_library(graph)[function_name].node_def]


def ancestors(op: tf.Operation) -> set:
    """Every op that `op` waits for, through data and control edges."""
    seen, stack = set(), [op]
    while stack:
        current = stack.pop()
        for parent in [x.op for x in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen
