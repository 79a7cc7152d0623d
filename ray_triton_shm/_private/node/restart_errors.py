"""The errors of a node client's calls cut short by a restart of Triton or of its node actor.

A request that reached a restarted Triton before the node registered its regions
there again (:func:`registering_again`), or whose connection the client replaced
while it ran (:func:`replaced_meanwhile`), fails with
:class:`~ray_triton_shm.errors.UnavailableError`: one to try again.
:func:`looks_down` tells whether a failed call failed as it does while Triton is
down, hung or restarting.
"""

from __future__ import annotations

from ray_triton_shm._private.node.node_config import NodeInfo
from ray_triton_shm._private.triton.call_errors import region_unknown
from ray_triton_shm.errors import PoolClosedError, TritonCallError, UnavailableError


def registering_again(error: TritonCallError, info: NodeInfo | None) -> UnavailableError:
    """The error for a request whose slot's region the node's Triton does not know.

    The node actor owns every region of its pools and registers all of them on each
    Triton it starts: a region unknown to Triton means the request reached a restarted
    Triton before the node had registered them there again. The request did not run;
    it is one to try again (UNAVAILABLE, 503 at the ingress), not a missing thing (NOT_FOUND,
    which a KServe caller reads as an unknown model).
    """
    node = info.node_id if info is not None else "this node"
    return UnavailableError(
        f"Triton on node {node} restarted and its shared-memory regions are being registered "
        f"again; try again ({error.message})",
        "UNAVAILABLE",
        error.model,
    )


def replaced_meanwhile(error: PoolClosedError, info: NodeInfo | None) -> UnavailableError:
    """The error for a request whose client was replaced while it ran (this NodeClient is open).

    After a failure that showed a new Triton or node actor, the NodeClient connects
    anew and closes the old connection, under requests of other threads still on it.
    """
    node = info.node_id if info is not None else "this node"
    return UnavailableError(
        f"the connection to the Triton of node {node} was replaced while this request ran "
        f"(Triton or its node actor restarted); try again ({error})",
        "UNAVAILABLE",
    )


def looks_down(error: TritonCallError) -> bool:
    """Whether a call failed as it does while Triton is down, hung or restarting."""
    return (
        isinstance(error, UnavailableError)
        or error.status in ("DEADLINE_EXCEEDED", "UNAVAILABLE")
        or region_unknown(error)
    )
