"""The checks of a rendezvous's node range and run id that `RendezvousParameters`, the
settings and the dynamic handler share, with torch's exception types and sentences."""

from __future__ import annotations

from ..wording import given, torch_message

__all__ = ["check_node_counts", "check_run"]


def check_node_counts(
    min_nodes: object,
    max_nodes: object,
    *,
    from_flags: bool = False,
    nodes: str = "rendezvous nodes",
) -> None:
    """Check a round's size range with torch's exception types and sentences.

    Args:
        min_nodes, max_nodes: the range.
        from_flags: the range came from distcomm-run's --nnodes=MIN:MAX: the message names
            the flag (else the parameters min_nodes and max_nodes).
        nodes: what torch's sentence counts: "rendezvous nodes" (RendezvousParameters's
            check), "nodes" (its dynamic handler's).

    Raises:
        TypeError: a count is not an integer (torch fails comparing it).
        ValueError: MIN < 1 or MAX < MIN; torch's sentence, then the parameter or flag.
    """
    for name, value in (("min_nodes", min_nodes), ("max_nodes", max_nodes)):
        if isinstance(value, bool) or not isinstance(value, int):
            where = given(name, f"{min_nodes}:{max_nodes}" if from_flags else value, from_flags)
            raise TypeError(f"{where}: node counts must be integers, got {type(value).__name__}")
    assert isinstance(min_nodes, int) and isinstance(max_nodes, int)
    if from_flags:
        where = given("min_nodes", f"{min_nodes}:{max_nodes}", True)
        remedy = "give --nnodes=MIN[:MAX] with 1 <= MIN <= MAX"
    else:
        where = given("min_nodes", min_nodes)
        remedy = "give 1 <= min_nodes <= max_nodes"
    if min_nodes < 1:
        raise ValueError(
            torch_message(
                f"The minimum number of {nodes} ({min_nodes}) must be greater than zero.",
                where,
                remedy,
            )
        )
    if max_nodes < min_nodes:
        raise ValueError(
            torch_message(
                f"The maximum number of {nodes} ({max_nodes}) must be greater than or equal "
                f"to the minimum number of {nodes} ({min_nodes}).",
                where if from_flags else f"{where}, {given('max_nodes', max_nodes)}",
                remedy,
            )
        )


def check_run(
    run_id: object,
    min_nodes: object,
    max_nodes: object,
    *,
    from_flags: bool = False,
    nodes: str = "rendezvous nodes",
) -> None:
    """Check the run id and the node range, with torch's sentences (see `check_node_counts`
    for `from_flags` and `nodes`).

    Raises:
        ValueError: the run id is empty or not a string, or the node range is invalid.
        TypeError: a node count is not an integer.
    """
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(
            torch_message(
                "The run id must be a non-empty string.",
                given("run_id", run_id, from_flags),
                "give every node of the run the same non-empty id",
            )
        )
    check_node_counts(min_nodes, max_nodes, from_flags=from_flags, nodes=nodes)
