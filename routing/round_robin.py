"""Round robin: the baseline policy. Each model's pool takes turns, whatever the prompt."""
from __future__ import annotations

from typing import Sequence

from routing.policy import RouteRequest, RoutingDecision


class RoundRobin:
    name = "round_robin"
    timed = False
    reads_prefixes = False  # the prompt's block hashes are not asked for
    learns = False

    def __init__(self) -> None:
        self._turn: dict[str, int] = {}  # per model: how many requests it has routed

    def choose(self, candidates: Sequence[str], request: RouteRequest) -> RoutingDecision:
        """Candidates are the healthy replicas serving the model, in config order. A candidate
        that drops out shifts the rotation but never stalls it."""
        if not candidates:
            raise ValueError("no candidates to choose from")
        turn = self._turn.get(request.model, 0)
        self._turn[request.model] = turn + 1
        chosen = candidates[turn % len(candidates)]
        return RoutingDecision(chosen, self.name, f"turn {turn % len(candidates) + 1} of {len(candidates)}",
                               tuple(candidates))

    def commit(self, decision: RoutingDecision) -> None:
        """Learns nothing from its own routing."""
