"""F16 through real servers: two clients post, straight to the prefill and decode servers as
SGLang's mini load balancer does, requests that carry the same ``bootstrap_room`` (upstream
sgl-project/sglang#40125), both in flight at once.

``mooncake-ext``: the first's KV write is held (``server_faults.py``'s ``hold-write``) so that it is
in transfer on both servers when the second arrives at each; the second is refused by both servers
with the reason naming the room; the first is served with tokens equal to the colocated server's; both servers keep
serving (the same room is served again once the first ended, and requests through the router
are answered, tokens equal). Stock admits the second: a server exits (``KeyError`` on its scheduler thread), or
the first is lost, or an answer is computed over another request's KV, or the second hangs (seen
on 0.5.11 and 0.5.23: decode never answers it, past three times SGLang's waiting timeout); a server that exited is
restarted for the stages after this one. The engine-level test
(``test/integration/test_duplicate_rooms.py``) shows stock's signature on every release.
"""

import concurrent.futures
import time

import pytest

import cpu_servers as cs

ROOM = 777_000_001
BOUND_S = 120.0
HOLD_AFTER_SECOND_S = 2.0
# The second's bound: three times SGLang's own timeouts here; an answer later than that is a hang.
SECOND_BOUND_S = 3 * cs.TIMEOUT_S


def _bootstrap_port(pair) -> int:
    argv = next(s["argv"] for s in pair.record["servers"] if s["name"] == "prefill")
    return int(argv[argv.index("--disaggregation-bootstrap-port") + 1])


def _body(prompt: str, port: int, max_new_tokens: int) -> dict:
    return {"text": prompt, "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": ROOM,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ("mooncake-ext", "mooncake"))
def test_a_second_request_with_a_room_in_use(mooncake_pairs, backend):
    deployment = mooncake_pairs
    pair = deployment.pairs[backend]
    first, second = cs.PROMPTS[0], cs.PROMPTS[1]
    reference = deployment.reference(first)
    port = _bootstrap_port(pair)
    before = {n: cs.total(cs.get_text(pair.url(n) + "/metrics"), "sglang_disagg_ext_requests_refused_total",
                          fix="F16") for n in ("prefill", "decode")}
    faults = deployment.fault_dirs[backend]
    release = faults / "release-hold-write"
    release.unlink(missing_ok=True)
    cs.arm(faults, "hold-write")  # the first request's KV write waits for the test: it stays in transfer
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            a = [pool.submit(cs.post, pair.url(n) + "/generate", _body(first, port, cs.MAX_NEW_TOKENS), BOUND_S)
                 for n in ("prefill", "decode")]
            deadline = time.monotonic() + 60
            while not cs.fired(faults, "hold-write") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert cs.fired(faults, "hold-write"), pair.log_tails()
            # Both servers hold the first request's room now: the second arrives at each after it.
            b = [pool.submit(cs.post, pair.url(n) + "/generate", _body(second, port, cs.MAX_NEW_TOKENS),
                             SECOND_BOUND_S) for n in ("prefill", "decode")]
            # Long enough for both servers to admit or refuse it, well inside SGLang's waiting
            # timeout (cpu_servers.TIMEOUT_S) for the first.
            time.sleep(HOLD_AFTER_SECOND_S)
            release.write_text("")
            b_prefill, b_decode = [f.result() for f in b]
            a_prefill, a_decode = [f.result() for f in a]
    finally:
        release.write_text("")  # never leave the server's transfer thread waiting
        (faults / "hold-write").unlink(missing_ok=True)
    print(f"{backend}: first: prefill {a_prefill[0]}, decode {a_decode[0]}; second: prefill {b_prefill[0]} "
          f"{str(b_prefill[1])[:200]}, decode {b_decode[0]} {str(b_decode[1])[:200]}")
    if backend.endswith("-ext"):
        _assert_ext(deployment, pair, port, first, second, (a_decode, b_prefill, b_decode), before)
    else:
        _assert_stock(deployment, pair, first, second, (a_decode, b_prefill, b_decode))


def _refused(name, body) -> bool:
    return f"bootstrap_room {ROOM} is already in use by a live request on this {name}" in str(body)


def _assert_ext(deployment, pair, port, first, second, answers, before):
    a_decode, b_prefill, b_decode = answers
    assert a_decode[0] == 200 and list(a_decode[1]["output_ids"]) == deployment.reference(first), (
        a_decode, pair.log_tails())
    for name, (status, body) in (("prefill", b_prefill), ("decode", b_decode)):
        assert status >= 400 and _refused(name, body), (name, status, body, pair.log_tails())
    assert all(pair.alive(n) for n in ("prefill", "decode", "router")), pair.log_tails()
    after = {n: cs.total(cs.get_text(pair.url(n) + "/metrics"), "sglang_disagg_ext_requests_refused_total",
                         fix="F16") for n in ("prefill", "decode")}
    assert {n: after[n] - before[n] for n in after} == {"prefill": 1, "decode": 1}
    # The room is free again once the first request ended: the second prompt under it is served now.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        again = [pool.submit(cs.post, pair.url(n) + "/generate", _body(second, port, cs.MAX_NEW_TOKENS), BOUND_S)
                 for n in ("prefill", "decode")]
        _, (status, body) = [f.result() for f in again]
    assert status == 200 and list(body["output_ids"]) == deployment.reference(second), (status, body)
    for prompt in cs.PROMPTS[:2]:  # and through the router
        status, body = cs.generate(pair.router_url, prompt, BOUND_S)
        assert status == 200 and list(body["output_ids"]) == deployment.reference(prompt), (status, body)


def _assert_stock(deployment, pair, first, second, answers):
    """Stock admits the second: it is not refused, and a server exits, or the first is lost, or an
    answer is computed over another request's KV, or the second is never answered (0.5.11 and 0.5.23 here:
    decode holds it past three times SGLang's waiting timeout)."""
    a_decode, b_prefill, b_decode = answers
    assert not any(_refused(n, body) for n, (_, body) in (("prefill", b_prefill), ("decode", b_decode)))
    dead = [n for n in ("prefill", "decode") if not pair.alive(n)]
    wrong = [label for label, (status, body), prompt in (("first", a_decode, first), ("second", b_decode, second))
             if status == 200 and list(body["output_ids"]) != deployment.reference(prompt)]
    first_lost = a_decode[0] != 200
    hung = [n for n, (status, body) in (("prefill", b_prefill), ("decode", b_decode))
            if status == 0 and "timed out" in str(body)]
    print(f"stock: servers exited: {dead}; the first request lost: {first_lost}; answered over another "
          f"request's KV: {wrong}; the second unanswered after {SECOND_BOUND_S:g} s by: {hung}")
    try:
        assert dead or first_lost or wrong or hung, (a_decode, b_prefill, b_decode, pair.log_tails())
    finally:
        for name in dead:  # the stages after this one use the stock pair
            pair.restart(name)
        if dead:
            pair.wait_routed()
