"""Pure routing decisions: given candidate replicas and what is known about a request, pick one.

Every policy implements routing.policy.Policy: `choose(candidates, request) -> decision` (a
decision has `.replica` and `.as_log()`) and `commit(decision)`; the gateway knows nothing else.
`make_policy(name, params, state)` builds one by its config name (routing/registry.py, the one
table of names; routing/params.py, each policy's parameters); `state` (RoutingState: prefix
tables + load tracker) outlives policies; routing.attempt.Attempt is one routed try's bookkeeping."""
from routing.attempt import Attempt
from routing.policy import Decision, Policy, RouteRequest, RoutingDecision, RoutingState
from routing.registry import POLICIES, make_policy, policy_params
from routing.round_robin import RoundRobin

__all__ = ["Attempt", "Decision", "Policy", "RoundRobin", "RouteRequest", "RoutingDecision", "RoutingState",
           "POLICIES", "make_policy", "policy_params"]
