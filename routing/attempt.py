"""One routed try of one request, from its decision to its end: the one place that tells the
load tracker about it and corrects the prefix table from what the replica reported.

    attempt = Attempt(state, decision, model, prompt_tokens, hashes)  # counted as routed
    attempt.first_token()                                              # prefilled: now decoding
    attempt.finish(cached_tokens, precise=False)                       # over: counted out

Each step happens at most once, whatever order the caller's error paths call them in, so a
request can never leave a replica's load counted twice or never counted out. Pure bookkeeping
(no I/O, no clock of its own): the gateway's Router wraps it with metrics and KV-event
expectations; tests and simulations drive it directly."""
from __future__ import annotations

from typing import Sequence

from routing.policy import Decision, RoutingState


class Attempt:
    __slots__ = ("state", "decision", "replica", "model", "prompt_tokens", "hashes",
                 "predicted_cached_tokens", "started_decoding", "done", "_ticket")

    def __init__(self, state: RoutingState, decision: Decision, model: str, prompt_tokens: int,
                 hashes: Sequence[int]) -> None:
        self.state = state              # the state it was routed with: a reload mid-request keeps it
        self.decision = decision
        self.replica = decision.replica
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.hashes = hashes
        self.predicted_cached_tokens = decision.predicted_cached_tokens
        self.started_decoding = False
        self.done = False
        self._ticket = state.tracker.on_routed(self.replica, prompt_tokens, self.predicted_cached_tokens, hashes)

    def first_token(self) -> bool:
        """The replica prefilled the prompt and produced a token; True the first time only."""
        if self.started_decoding or self.done:
            return False
        self.started_decoding = True
        if self.replica in self.state.model_of:
            self.state.tracker.on_first_token(self.replica, self.prompt_tokens, self.predicted_cached_tokens)
        return True

    def finish(self, cached_tokens: int | None, *, precise: bool) -> None:
        """The attempt is over (answered, failed or cancelled). `cached_tokens`: what the replica
        reported, if it did; `precise`: the replica's KV events are trusted (they are the truth
        about its cache, so nothing is corrected here)."""
        if self.done:
            return
        self.done = True
        state = self.state
        if self.replica not in state.model_of:
            return  # removed by a reload while this ran: nothing of it is tracked any more
        state.tracker.on_finished(self.replica, self.prompt_tokens, self.predicted_cached_tokens,
                                  started_decoding=self.started_decoding, ticket=self._ticket)
        if precise:
            return  # KV events keep the table right
        block = state.block_size
        predicted_blocks = self.predicted_cached_tokens // block
        if self.started_decoding and (cached_tokens is None or cached_tokens // block >= predicted_blocks):
            return  # the guess held (most tries): nothing to correct
        if not self.decision.matched_blocks:
            return  # not a prefix-table policy
        table = state.table(self.model)
        if not self.started_decoding:
            # The guess assumed the prompt would be cached there; it never got computed.
            table.correct(self.replica, self.hashes, predicted_blocks)
        else:
            # The replica had evicted part of what we believed it held. Drop those claims, then
            # record the prompt again: the replica has just recomputed it, so it holds it now
            # (as the newest entries of its ring, which is what LRU on the replica did too).
            table.correct(self.replica, self.hashes[:predicted_blocks], cached_tokens // block)
            table.insert(self.replica, self.hashes, guessed=True, now=state.clock())
