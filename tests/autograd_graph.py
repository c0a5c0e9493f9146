"""The autograd graph behind a tensor, by node type: for tests that a loop's backward does not grow with its steps."""


def graph_ops(out) -> list[str]:
    """Every node reachable from out.grad_fn, once each, by its class name (e.g. 'SliceBackward0')."""
    seen, todo, names = set(), [out.grad_fn], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        todo.extend(n for n, _ in node.next_functions)
    return names
