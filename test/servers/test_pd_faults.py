"""Real servers under faults, stock ``mooncake`` and ``mooncake-ext`` side by side.

A stream of concurrent requests (bounded count, every request bounded in time) meets one fault:
the decode server killed and restarted mid-stream, or one engine write that fails. Every request
must end with an answer or an HTTP error within the bound, no server the fault did not target may
exit, and after the fault new requests are served with tokens equal to the colocated server's.
Where stock and ``-ext`` differ, each is held to what it does (``README``'s table).
"""

import os
import signal
import threading
import time

import pytest

import cpu_servers as cs

# Per request: SGLang's router tries a request up to six times, and a try whose prefill waits for a
# decode that is gone ends at SGLang's bootstrap timeout (cpu_servers.TIMEOUT_S).
BOUND_S = 6 * cs.TIMEOUT_S + 30.0
STREAM = [cs.PROMPTS[i % len(cs.PROMPTS)] for i in range(12)]


def _outcomes(results):
    ok = [r for r in results if r[0] == 200]
    errors = [r for r in results if r[0] != 200]
    return ok, errors


def _assert_bounded(results):
    for status, body, seconds in results:
        assert seconds < BOUND_S, f"a request took {seconds:.0f} s"
        assert status != 0 or "timed out" not in str(body), body  # the client never gave up


def _assert_answers_equal(deployment, results, prompts):
    for (status, body, _), prompt in zip(results, prompts):
        if status == 200:
            assert body["output_ids"] == deployment.reference(prompt), prompt[:24]


# SGLang's router opens a worker's circuit after repeated failures and tries it again only after its
# cool-down: after a fault the router, not the servers, may answer 503 "all circuits open" for a while.
ROUTER_COOLDOWN_S = 120.0


def _assert_serves(deployment, pair):
    """New requests are served with colocated's tokens once the router lets them through."""
    deadline = time.monotonic() + ROUTER_COOLDOWN_S
    for prompt in cs.PROMPTS[:2]:
        while True:
            status, body = cs.generate(pair.router_url, prompt, 120.0)
            if status == 503 and "circuits open" in str(body) and time.monotonic() < deadline:
                time.sleep(2.0)
                continue
            assert status == 200 and isinstance(body, dict), (status, body, pair.log_tails())
            assert list(body["output_ids"]) == deployment.reference(prompt), pair.log_tails()
            break


def _failed(pair, name):
    return cs.total(cs.get_text(pair.url(name) + "/metrics"), "sglang_disagg_ext_transfers_total", outcome="failed")


def _assert_errors_have_reasons(results):
    for status, body, _ in results:
        if status != 200:
            assert status >= 400 and str(body).strip(), (status, body)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ("mooncake", "mooncake-ext"))
def test_one_failed_engine_write(mooncake_pairs, backend):
    """One KV write the engine fails (it returns -1, as for a dropped link), in a stream of 12
    requests, 3 in flight. ``-ext``: that one request ends Failed on prefill and on decode (decode
    told by prefill, the reason naming the failed chunk), SGLang's router retries it, and every
    client gets an answer equal to colocated. Stock: prefill blacklists decode's whole Mooncake
    session after the one failure (F6), so valid requests behind it fail too ("remote mooncake
    session ... is not alive") until its probe loop lifts the blacklist (0.5.23: about 2 s here)
    or for good (0.5.11: the router's retries fail too and reach the clients as HTTP errors)."""
    deployment = mooncake_pairs
    pair, faults = deployment.pairs[backend], deployment.fault_dirs[backend]
    for prompt in STREAM:
        deployment.reference(prompt)
    failed_before = {n: _failed(pair, n) for n in ("prefill", "decode")} if backend.endswith("-ext") else None
    log_before = len(pair.log("prefill"))
    cs.arm(faults, "fail-write")
    results = cs.stream(pair.router_url, STREAM, concurrency=3, timeout=BOUND_S)
    assert cs.fired(faults, "fail-write")
    _assert_bounded(results)
    _assert_answers_equal(deployment, results, STREAM)
    _assert_errors_have_reasons(results)
    ok, errors = _outcomes(results)
    print(f"{backend}: {len(ok)} answered, {len(errors)} failed: {[(s, str(b)[:160]) for s, b, _ in errors]}")
    assert all(pair.alive(name) for name in ("prefill", "decode", "router")), pair.log_tails()
    # Stock's own line for every request its prefill fails.
    failed_transfers = pair.log("prefill")[log_before:].count("Prefill transfer failed for request")
    print(f"{backend}: prefill failed {failed_transfers} transfers for one failed engine write")
    if backend.endswith("-ext"):
        assert failed_transfers == 1
        time.sleep(1.0)
        assert {n: _failed(pair, n) - failed_before[n] for n in ("prefill", "decode")} == {"prefill": 1, "decode": 1}
        assert "Failed to send kv chunk of " in pair.log("decode")  # decode was told prefill's reason
        assert not errors, errors
        _assert_serves(deployment, pair)
    else:
        assert failed_transfers > 1, "stock: only the faulted transfer failed"
        assert "is not alive" in pair.log("prefill")[log_before:]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ("mooncake", "mooncake-ext"))
def test_decode_killed_and_restarted_mid_stream(mooncake_pairs, backend):
    deployment = mooncake_pairs
    pair = deployment.pairs[backend]
    prompts = STREAM[:6]
    for prompt in prompts:
        deployment.reference(prompt)
    results = []
    thread = threading.Thread(target=lambda: results.extend(
        cs.stream(pair.router_url, prompts, concurrency=3, timeout=BOUND_S)))
    thread.start()
    time.sleep(1.0)
    os.killpg(pair.pid("decode"), signal.SIGKILL)
    thread.join(timeout=BOUND_S * len(prompts))
    assert not thread.is_alive(), "the stream did not end"
    _assert_bounded(results)
    _assert_answers_equal(deployment, results, prompts)
    _assert_errors_have_reasons(results)
    ok, errors = _outcomes(results)
    print(f"{backend}: decode killed: {len(ok)} answered, {len(errors)} failed: "
          f"{sorted({str(b)[:120] for s, b, _ in errors})}")
    assert pair.alive("prefill") and pair.alive("router"), pair.log_tails()
    pair.restart("decode")
    pair.wait_routed()
    _assert_serves(deployment, pair)
    assert pair.alive("prefill") and pair.alive("router")


# A request through the router while decode waits on a prefill address that never answers: its
# few tokens take well under a second on these servers; stock's scheduler thread waits 5 s a try.
FEW_TOKENS = 4
STOCK_LOOKUP_S = 5.0  # requests.get(url, timeout=5) in every wheel's lookup of a prefill's parallel info


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ("mooncake", "mooncake-ext"))
def test_a_prefill_address_that_never_answers(mooncake_pairs, policy, backend):
    """A request sent to decode names a bootstrap address that takes the connection and never
    answers (a loopback socket that listens and never accepts, as behind a link that drops
    packets), while the router serves another request. Stock (every release 0.5.10.post1-0.5.23,
    F20): decode's scheduler thread waits out the 5 s HTTP timeout of each try of its lookup, so
    the other request's few tokens take 5 s or more. ``-ext``: the lookup runs off the scheduler
    thread and the other request is served as fast as ever, tokens equal to colocated. Then the
    address is closed (each try is refused at once): the waiting request ends with an HTTP error
    after stock's 15 tries on both, and every server stays up."""
    import socket

    if backend.endswith("-ext") and not policy.is_live("F20"):
        pytest.skip(f"F20 is {policy.fixes['F20'].value} on SGLang {policy.version}")
    deployment = mooncake_pairs
    pair = deployment.pairs[backend]
    prompt = cs.PROMPTS[1]
    expected = deployment.reference(prompt)[:FEW_TOKENS]
    status, body = cs.generate(pair.router_url, prompt, 120.0, max_new_tokens=FEW_TOKENS)  # warm
    assert status == 200 and list(body["output_ids"]) == expected, (status, body)
    hole = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    hole.bind(("127.0.0.1", 0))
    hole.listen(128)
    stuck = []
    to_hole = {"text": cs.PROMPTS[0], "sampling_params": {"temperature": 0, "max_new_tokens": FEW_TOKENS},
               "bootstrap_host": "127.0.0.1", "bootstrap_port": hole.getsockname()[1], "bootstrap_room": 4242}
    thread = threading.Thread(target=lambda: stuck.append(cs.post(pair.url("decode") + "/generate", to_hole, 300.0)))
    try:
        t0 = time.monotonic()
        thread.start()
        time.sleep(1.5)  # decode has the request and its first try is under way
        t_other = time.monotonic()
        status, answer = cs.generate(pair.router_url, prompt, 120.0, max_new_tokens=FEW_TOKENS)
        other_s = time.monotonic() - t_other
    finally:
        hole.close()  # from here each try is refused at once: the waiting request ends in 15 tries
    thread.join(timeout=STOCK_LOOKUP_S * 15 + 60)
    assert not thread.is_alive(), "the request to the unanswering address did not end"
    stuck_status, stuck_body = stuck[0]
    stuck_s = time.monotonic() - t0
    print(f"{backend}: other request {other_s:.2f} s; unanswered request {stuck_status} after {stuck_s:.0f} s: "
          f"{str(stuck_body)[:160]}")
    assert status == 200 and list(answer["output_ids"]) == expected, (status, answer)
    assert stuck_status != 200 or "abort" in str(stuck_body).lower(), (stuck_status, stuck_body)
    assert "Error fetching prefill server info from bootstrap" in pair.log("decode")
    assert all(pair.alive(name) for name in ("prefill", "decode", "router")), pair.log_tails()
    if backend.endswith("-ext"):
        assert other_s < STOCK_LOOKUP_S, f"a decode step waited {other_s:.1f} s"
    else:
        assert other_s >= STOCK_LOOKUP_S - 0.5, f"stock served the other request in {other_s:.1f} s"
    _assert_serves(deployment, pair)


@pytest.fixture(scope="module")
def mismatched_prefill(mooncake_pairs, policy, tmp_path_factory):
    """One prefill server with twice the page size, for both pairs' routers (stock ``mooncake``:
    decode's pairing check runs before any transfer, so its backend does not matter there)."""
    if not policy.is_live("F14"):
        pytest.skip(f"F14 is {policy.fixes['F14'].value} on SGLang {policy.version}: no -ext run to compare here")
    if cs.page_size() == 1:
        pytest.skip(f"n/a on SGLang {policy.version}: its CPU server cannot start a prefill with page size 2 (its "
                    "paged allocator runs Triton); F14 is proven there by test/integration/test_decode_pairing_check.py")
    pair = mooncake_pairs.pairs["mooncake"]
    launcher, url, bootstrap = cs.start_extra_prefill(pair, tmp_path_factory.mktemp("prefill-2"), cs.page_size() * 2)
    try:
        launcher.wait_healthy(["prefill"], timeout=600)
        yield url, bootstrap
    finally:
        launcher.stop_all(grace=10)


@pytest.mark.timeout(900)
# -ext first: stock's decode does not survive its run, and this is the stage's last test.
@pytest.mark.parametrize("backend", ("mooncake-ext", "mooncake"))
def test_a_prefill_with_another_page_size_joins_the_pool(mooncake_pairs, mismatched_prefill, backend):
    """A second prefill with twice the page size registered in the router's pool. Stock (every
    release 0.5.10.post1-0.5.23: decode's pairing check raises on its scheduler thread, F14): the
    first request routed to it ends the decode process ("Page size mismatch"), and with it every
    request it was serving. ``-ext``: decode refuses that prefill (one ERROR naming both page
    sizes), that prefill's requests end Failed with the reason (the router retries them on the good
    prefill), decode keeps serving, and tokens stay equal to colocated."""
    deployment = mooncake_pairs
    pair = deployment.pairs[backend]
    url, bootstrap = mismatched_prefill
    prompts = STREAM[:4]
    for prompt in prompts:
        deployment.reference(prompt)
    worker = cs.router_add_prefill(pair.router_url, url, bootstrap)
    results = cs.stream(pair.router_url, prompts, concurrency=2, timeout=BOUND_S)
    # The router picks a prefill per request: go on (one at a time, at most 12 more) until one was
    # routed to the mismatched prefill, so both backends are judged on a request that met it.
    extra = 0
    while "Page size mismatch" not in pair.log("decode") and pair.alive("decode") and extra < 12:
        prompt = STREAM[extra % len(STREAM)]
        deployment.reference(prompt)
        results += cs.stream(pair.router_url, [prompt], concurrency=1, timeout=BOUND_S)
        prompts = prompts + [prompt]
        extra += 1
    _assert_bounded(results)
    _assert_answers_equal(deployment, results, prompts)
    _assert_errors_have_reasons(results)
    ok, errors = _outcomes(results)
    print(f"{backend}: mismatched prefill in the pool: {len(ok)} answered, {len(errors)} failed: "
          f"{sorted({str(b)[:120] for s, b, _ in errors})}")
    decode_log = pair.log("decode")
    assert "Page size mismatch: prefill server has page_size=" in decode_log
    if backend.endswith("-ext"):
        assert pair.alive("decode") and pair.alive("prefill") and pair.alive("router"), pair.log_tails()
        assert decode_log.count("(decode keeps serving every other prefill") == 1, "one ERROR per prefill"
        metrics = cs.get_text(pair.url("decode") + "/metrics")
        assert cs.total(metrics, "sglang_disagg_ext_requests_refused_total", fix="F14") >= 1
        cs.router_remove_worker(pair.router_url, worker)
        _assert_serves(deployment, pair)
    else:
        deadline = time.monotonic() + 60
        while pair.alive("decode") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not pair.alive("decode"), "stock decode survived a prefill with another page size"
        assert "Scheduler hit an exception" in decode_log
        assert pair.alive("prefill") and pair.alive("router")
