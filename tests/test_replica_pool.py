"""The pool's candidates for a model (the replicas a request may be routed to) follow every change
that decides them, though they are kept between changes: health (ejected, drained, back), a
tokenizer lost or loaded, the models a replica serves (and their context length, which the proxy
keeps with them), and the replica list on reload."""
from __future__ import annotations

from gateway.config import parse_config
from gateway.upstream import ReplicaPool

YAML = """
replicas:
  - {name: a, url: 'http://127.0.0.1:9001', model: m}
  - {name: b, url: 'http://127.0.0.1:9002', model: m}
  - {name: c, url: 'http://127.0.0.1:9003', model: other}
"""


def names(pool: ReplicaPool, model: str) -> list[str]:
    return [replica.name for replica in pool.candidates(model)]


def test_candidates_follow_health_tokenizers_models_and_reloads():
    pool = ReplicaPool(parse_config(YAML))
    assert names(pool, "m") == []  # starting, no tokenizer yet
    for replica in pool.replicas:
        replica.tokenizer = object()
        pool._transition(replica, replica.health.on_probe(True, 0.0))
    assert names(pool, "m") == ["a", "b"] and names(pool, "other") == ["c"]
    assert pool.candidates("m") is pool.candidates("m")  # kept while nothing changes

    pool.report(pool.by_name["a"], ok=False, reason="refused", fatal=True)  # ejected at once
    assert names(pool, "m") == ["b"]
    assert pool.drain("b") and names(pool, "m") == []
    assert pool.undrain("b") and names(pool, "m") == ["b"]

    pool.by_name["b"].tokenizer = None
    assert names(pool, "m") == []
    pool.by_name["b"].tokenizer = object()
    pool.by_name["c"].models = ["other", "m"]  # its server also serves m
    assert names(pool, "m") == ["b", "c"]
    kept = pool.candidates("m")
    pool.by_name["c"].max_model_len = 2048  # the proxy keeps the context limit with the tuple
    assert pool.candidates("m") is not kept and names(pool, "m") == ["b", "c"]

    pool.apply(parse_config(YAML.replace("  - {name: b, url: 'http://127.0.0.1:9002', model: m}\n", "")))
    assert names(pool, "m") == ["c"]  # b left with the reload; a is still ejected


def test_model_names_nobody_serves_leave_nothing_behind():
    """The proxy asks for a request's model's candidates before it knows the model is served: a
    client that sends a new made-up name every time must not grow what the pool keeps."""
    pool = ReplicaPool(parse_config(YAML))
    for replica in pool.replicas:
        replica.tokenizer = object()
        pool._transition(replica, replica.health.on_probe(True, 0.0))
    assert names(pool, "m") == ["a", "b"]
    kept = len(pool._candidates)
    for n in range(1000):
        assert pool.candidates(f"made-up-{n}") == ()
    assert len(pool._candidates) == kept and names(pool, "m") == ["a", "b"]
