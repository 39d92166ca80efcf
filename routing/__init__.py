"""Pure routing decisions: given candidate replicas and what is known about a request, pick one.

Every policy implements `choose(candidates, request) -> Decision`; the gateway knows nothing else."""
from routing.round_robin import Decision, RequestInfo, RoundRobin

POLICIES = {"round_robin": RoundRobin}


def make_policy(name: str):
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r} (expected one of: {', '.join(POLICIES)})") from None


__all__ = ["Decision", "RequestInfo", "RoundRobin", "POLICIES", "make_policy"]
