"""Serve's autoscaling, with the front door's calls counted as the replicas' ongoing requests.

Each replica reports its front door's demand to Serve
(``record_autoscaling_stats``, as :data:`FRONTDOOR_ONGOING`): its calls running and
its calls waiting for a slot (as Serve counts the requests queued at its handles
with those its replicas run), averaged over the time since its previous report. Serve averages
them per replica over ``look_back_period_s``, as it does its own count of ongoing
requests. :func:`frontdoor_autoscaling_policy` is Serve's default policy
(ongoing requests per replica against ``target_ongoing_requests``) over both
counts together; Serve applies the deployment's bounds, factors and delays to
its answer, as for any policy. :func:`with_frontdoor_policy` names it in an
autoscaled deployment's options that name no policy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

FRONTDOOR_ONGOING = "frontdoor_ongoing"
"""The custom autoscaling metric each replica reports: its front door's calls running or waiting
for a slot."""


def frontdoor_autoscaling_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """The replicas an app needs for its ongoing requests, front-door calls included.

    Use it in a deployment's ``autoscaling_config``::

        policy: {policy_function: ray_triton_shm.serve:frontdoor_autoscaling_policy}

    Args:
        ctx: Serve's ``AutoscalingContext``.

    Returns:
        The desired number of replicas (Serve rounds it and applies the
        deployment's bounds and delays) and the policy's state (none).
    """
    current = ctx.current_num_replicas
    if current == 0:
        return ctx.target_num_replicas, {}
    door = (ctx.aggregated_metrics or {}).get(FRONTDOOR_ONGOING) or {}
    ongoing = float(ctx.total_num_requests) + sum(door.values())
    return current * ongoing / (ctx.config.get_target_ongoing_requests() * current), {}


FRONTDOOR_POLICY = "ray_triton_shm.serve:frontdoor_autoscaling_policy"
"""The policy as a deployment's ``autoscaling_config`` names it (``policy_function``)."""


def with_frontdoor_policy(options: Mapping[str, Any]) -> dict[str, Any]:
    """Deployment ``options`` whose autoscaling (if any, as a mapping) counts front-door calls.

    ``num_replicas: auto`` or an ``autoscaling_config`` mapping without a ``policy``
    gets :data:`FRONTDOOR_POLICY`; anything else is returned as it is.
    """
    chosen = dict(options)
    config = chosen.get("autoscaling_config")
    if chosen.get("num_replicas") != "auto" and not isinstance(config, Mapping):
        return chosen
    if config is not None and not isinstance(config, Mapping):
        return chosen  # an AutoscalingConfig object: the caller chose its policy
    config = dict(config or {})
    config.setdefault("policy", {"policy_function": FRONTDOOR_POLICY})
    chosen["autoscaling_config"] = config
    return chosen
