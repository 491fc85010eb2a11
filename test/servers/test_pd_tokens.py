"""Real servers: greedy tokens through prefill + decode + router equal a colocated server's.

Stock SGLang servers (``sglang.launch_server``) with the plugin loaded by SGLang itself, on
this CPU; the model is ``tiny-model --with-weights`` (random weights, std 0.2: greedy output
follows the KV). Prompts go one at a time so every server computes the same batches.
The control (``test_a_corrupted_kv_page_changes_the_tokens``) shows the comparison sees the
transferred KV: one KV page with its signs flipped in flight changes the tokens.
"""

import pytest

import cpu_servers as cs


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("backend", ("mooncake-ext", "mooncake"))
def test_pd_tokens_equal_colocated(mooncake_pairs, backend):
    cs.check_tokens_equal(mooncake_pairs, mooncake_pairs.pairs[backend])


@pytest.mark.timeout(600)
def test_the_plugin_is_in_the_path(mooncake_pairs, policy):
    cs.check_plugin_in_path(mooncake_pairs.pairs["mooncake-ext"], policy)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ("mooncake-ext", "mooncake"))
def test_a_corrupted_kv_page_changes_the_tokens(mooncake_pairs, backend):
    """The control: the equality above can fail. One KV page of the request, its bf16 signs flipped
    while the engine reads it on prefill (restored after), and decode's tokens differ; the next
    request is equal again (prefill's own pool was never wrong)."""
    deployment = mooncake_pairs
    pair, faults = deployment.pairs[backend], deployment.fault_dirs[backend]
    prompt = cs.PROMPTS[2]
    cs.arm(faults, "corrupt-kv-page")
    got = cs.output_ids(pair.router_url, prompt)
    assert cs.fired(faults, "corrupt-kv-page"), "the fault did not fire: no KV write reached the engine"
    want = deployment.reference(prompt)
    assert got != want, f"{backend}: one corrupted KV page left every token equal: the comparison sees nothing"
    assert got[0] == want[0]  # the first token is prefill's own
    assert cs.output_ids(pair.router_url, prompt) == want
