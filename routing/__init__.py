"""Pure routing decisions: given candidate replicas and what is known about a request, pick one.

Every policy implements `choose(candidates, request) -> decision` (a decision has `.replica`
and `.as_log()`); the gateway knows nothing else. `make_policy(name, params, state)` builds
one by its config name; `state` (RoutingState: prefix tables + load tracker) outlives policies."""
from routing.policy import POLICY_FACTORIES, RouteRequest, RoutingDecision, RoutingState, make_policy
from routing.round_robin import RoundRobin
import routing.policies  # noqa: E402,F401  (registers every policy in POLICY_FACTORIES)

POLICIES = POLICY_FACTORIES  # config name -> factory(params, state); gateway/config validates names against it

__all__ = ["RoundRobin", "RouteRequest", "RoutingDecision", "RoutingState",
           "POLICIES", "POLICY_FACTORIES", "make_policy"]
