"""Whether a replica gets traffic: active probes and passive ejection, as one small state machine
per replica (pure logic over an injected clock; gateway/upstream.py feeds it).

States (what /admin/replicas and kvgate_replica_state show):
  starting   never answered a probe yet
  healthy    in rotation
  ejected    out of rotation: `unhealthy_threshold` probe failures in a row, or the circuit opened
             on requests (`eject_consecutive_failures` in a row, or an error rate over
             `eject_error_rate` in the last `error_window_s` with enough requests), or at once
             on a refused connection (nothing listens there: the process is gone)
  probing    (half-open) the ejection time is over: out of rotation until `healthy_threshold`
             probes in a row succeed, then healthy; one failure ejects it again
  draining   taken out by an operator (POST /admin/replicas/NAME/drain): no new requests, the
             ones it runs finish; /undrain brings it back
An ejection lasts `eject_base_s`, doubled each time the replica is ejected again within
`flap_window_s` of its last return (a flapping replica stays out longer), up to `eject_max_s`.

`gone`: the latest failure seen was a refused connection (nothing listens there), until a probe
or a request gets an answer or a failure of another kind. A replica out of rotation but not gone
(`may_answer`: ejected or probing after timeouts, errors, a slow /health) is what a gateway
whose every replica of a model is out of rotation still tries (`health.panic_routing`): when all
of them fail at once, the usual cause is load on every one (probes timing out), not that all died.
"""
from __future__ import annotations

from dataclasses import dataclass

from gateway.window_counts import WindowCounts

STARTING, HEALTHY, EJECTED, PROBING, DRAINING = "starting", "healthy", "ejected", "probing", "draining"
STATES = (STARTING, HEALTHY, EJECTED, PROBING, DRAINING)


@dataclass(frozen=True)
class HealthPolicy:
    healthy_threshold: int = 2           # probes in a row that bring an ejected replica back
    unhealthy_threshold: int = 2         # probe failures in a row that eject a healthy one
    eject_consecutive_failures: int = 3  # request failures in a row that open the circuit
    eject_error_rate: float = 0.5        # ... or this failure fraction over the window
    error_window_s: float = 10.0
    error_min_requests: int = 10         # the rate needs this many requests in the window
    eject_base_s: float = 2.0
    eject_max_s: float = 60.0
    flap_window_s: float = 60.0


# Bumped whenever any replica's health state changes (ReplicaPool.candidates is cached on it).
CHANGES = [0]


class ReplicaHealth:
    __slots__ = ("policy", "state", "reason", "since_s", "ejected_until_s", "ejections", "_eject_s",
                 "_returned_s", "_probe_ok", "_probe_fail", "_req_fail", "_outcomes", "_drained_from", "gone")

    def __init__(self, policy: HealthPolicy, now_s: float) -> None:
        self.policy = policy
        self.state = STARTING
        self.reason: str | None = None
        self.since_s = now_s
        self.ejected_until_s = 0.0
        self.ejections = 0
        self._eject_s = policy.eject_base_s
        self._returned_s = float("-inf")
        self._probe_ok = 0
        self._probe_fail = 0
        self._req_fail = 0
        self._outcomes = WindowCounts(policy.error_window_s)  # (requests, failures) in the error window
        self._drained_from: str | None = None
        self.gone = False

    @property
    def in_rotation(self) -> bool:
        return self.state == HEALTHY

    @property
    def may_answer(self) -> bool:
        """Out of rotation for failures that do not prove it gone: tried when nothing is in rotation."""
        return (self.state == EJECTED or self.state == PROBING) and not self.gone

    def _seen(self, gone: bool) -> None:
        if gone != self.gone:
            self.gone = gone
            CHANGES[0] += 1  # what may answer changed (ReplicaPool.candidates' panic set)

    def _set(self, state: str, now_s: float, reason: str | None = None) -> str | None:
        """Change state; returns the old state when it changed (the caller logs transitions)."""
        if state == self.state:
            return None
        old, self.state, self.since_s, self.reason = self.state, state, now_s, reason
        CHANGES[0] += 1
        return old

    # ---- active probes ----------------------------------------------------------------------
    def on_probe(self, ok: bool, now_s: float, reason: str | None = None, fatal: bool = False) -> str | None:
        self._seen(not ok and fatal)
        if self.state == DRAINING:
            self._drained_from = HEALTHY if ok else EJECTED
            return None
        if ok:
            self._probe_fail = 0
            self._probe_ok += 1
            if self.state == STARTING:
                return self._set(HEALTHY, now_s)
            if self.state == EJECTED and now_s >= self.ejected_until_s:
                self._set(PROBING, now_s, "ejection over; probing")
            if self.state == PROBING and self._probe_ok >= self.policy.healthy_threshold:
                self._returned_s = now_s
                self._req_fail = 0
                self._outcomes.clear()
                return self._set(HEALTHY, now_s)
            return None
        self._probe_ok = 0
        self._probe_fail += 1
        if self.state == PROBING or (self.state == HEALTHY and (
                fatal or self._probe_fail >= self.policy.unhealthy_threshold)):
            return self._eject(now_s, reason or "health probe failed")
        if self.state == STARTING:
            self.reason = reason
        return None

    # ---- passive: what real requests saw -------------------------------------------------------
    def on_request(self, ok: bool, now_s: float, reason: str | None = None, fatal: bool = False) -> str | None:
        """A request outcome that says something about the replica (connection failure, timeout,
        5xx; not a client's 4xx). `fatal`: a refused connection, which ejects at once."""
        if ok:
            self.succeeded(now_s)
            return None
        self._seen(fatal)
        self._outcomes.add(now_s, 1, 1)
        self._req_fail += 1
        if self.state not in (HEALTHY, PROBING):
            return None
        requests, failures = self._outcomes.totals(now_s)
        if fatal or self._req_fail >= self.policy.eject_consecutive_failures or (
                requests >= self.policy.error_min_requests
                and failures / requests >= self.policy.eject_error_rate):
            return self._eject(now_s, reason or "requests failing")
        return None

    def succeeded(self, now_s: float) -> None:
        """on_request for a success (every answered request): it is counted in the window and ends
        a run of failures; it changes no state."""
        if self.gone:
            self._seen(False)
        self._outcomes.add(now_s)
        self._req_fail = 0

    def _eject(self, now_s: float, reason: str) -> str | None:
        # Back again soon after its last return: it flaps; each such ejection lasts twice as long.
        if now_s - self._returned_s <= self.policy.flap_window_s and self.ejections:
            self._eject_s = min(self._eject_s * 2, self.policy.eject_max_s)
        else:
            self._eject_s = self.policy.eject_base_s
        self.ejections += 1
        self.ejected_until_s = now_s + self._eject_s
        self._probe_ok = 0
        return self._set(EJECTED, now_s, reason)

    # ---- operator ---------------------------------------------------------------------------
    def drain(self, now_s: float) -> str | None:
        if self.state != DRAINING:
            self._drained_from = self.state
        return self._set(DRAINING, now_s, "drained by an operator")

    def undrain(self, now_s: float) -> str | None:
        if self.state != DRAINING:
            return None
        # Back through the probes, unless it was healthy when drained and stayed so.
        return self._set(HEALTHY if self._drained_from == HEALTHY else PROBING, now_s)

    def describe(self, now_s: float) -> dict:
        out = {"state": self.state, "since_s": round(now_s - self.since_s, 3), "reason": self.reason,
               "ejections": self.ejections}
        if self.state == EJECTED:
            out["back_in_s"] = round(max(self.ejected_until_s - now_s, 0.0), 3)
        if self.gone:
            out["gone"] = True  # its port refused the last connection: no panic routing to it
        return out
