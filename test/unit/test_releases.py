"""Release policy table, checked against facts read from each release's wheel."""

import pytest

from sglang_disagg_ext import releases
from sglang_disagg_ext.releases import FIXES, FixStatus, StateLayout, Support, UnsupportedSGLangRelease, policy_for

L, U, N = FixStatus.LIVE, FixStatus.UPSTREAM, FixStatus.NA

X = FixStatus.UNCOVERED

# (release, support, layout, F1..F24) — from shared/notes/sglang-releases.md, except F4/F5 on
# 0.5.12.x, read from the wheels: live, because NIXL still maps decode-side head replicas by
# modulo (0.5.12.post1 nixl/conn.py:1002-1004) and the NSA offload rejects the allocator's
# mamba_indices= keyword (memory_pool.py:2145 vs allocator.py:524). F6-F8 read in every
# wheel 0.5.10.post1-0.5.23: live in all (e.g. the session blacklisted after one failed KV
# send, 0.5.10.post1 mooncake/conn.py:1270-1271, 0.5.17 :1718-1719, 0.5.23 :2742-2745);
# 0.5.13-0.5.22: F7/F8 proven by scripts/release_sweep.sh on every release of that range
# (docs/release-sweep.md); F6 is
# live on every release: test_mooncake_isolation.py in CI (0.5.10.post1-0.5.12.post1, 0.5.23) and in the
# release sweep (0.5.13-0.5.22). F9/F10
# (metadata buffers paired by position; decode's metadata gate without a deadline) read in
# every wheel: live; F9 covered on every release (0.5.23 through check_peer_aux_buffer_count, before
# it where F6's pool-sizes frame is read: test_mooncake_registration.py's row-size case on every
# release, the count cases from 0.5.21), F10 on every release (the gate function
# utils._apply_metadata_gate exists from 0.5.13: 0.5.13 utils.py:78, 0.5.19 :180, 0.5.22 :244;
# before 0.5.13 the test sits in DecodeTransferQueue._commit_transfer_to_req after the TP
# all-reduce, 0.5.12.post1 decode.py:1412-1415, and the plugin installs 0.5.13's gate before it;
# on 0.5.10.post1 its decode module imports sgl_kernel, which the CPU test venv carries as a stand-in). F11 (NIXL's head-sliced SWA
# path and the asserting hetero-TP prep on the bootstrap thread) read in every wheel: absent up
# to 0.5.21 (n/a), present in 0.5.22 (nixl/conn.py:941, :2640; uncovered) and 0.5.23 (live).
# F12 (MoRI metadata rows on another socket than the status, rows of the wrong length dropped)
# read in every wheel 0.5.10.post1-0.5.23: present in all; live (covered) on every release (on
# 0.5.12.x through F3's classes, which carry the row checks).
# F13 (NIXL SWA state across attention TP sizes): stock maybe_send_extra raises for non-MLA SWA
# state across TP sizes in every wheel 0.5.10.post1-0.5.21 (0.5.13 nixl/conn.py:1616-1618, 0.5.21
# :2674-2676); n/a up to 0.5.12.x (F4's classes slice it), live 0.5.13-0.5.21, upstream from 0.5.22
# (_send_swa_state_slice, nixl/conn.py:2969 in 0.5.23).
# F14 (decode's pairing check raises on its scheduler thread): live in every wheel
# 0.5.10.post1-0.5.23 (CommonKVManager.try_ensure_parallel_info, 0.5.10.post1 common/conn.py:228 ...
# 0.5.23 :1321, called from DecodePreallocQueue._ensure_prefill_info with no handler); proven (stock's
# decode exits, -ext's serves on) by the real-server stage on 0.5.23, and on every CI release by the
# harness (the check raises into decode's scheduler; -ext refuses): covered everywhere but 0.5.12.
# F15 (NIXL prefill's bootstrap loop has no per-message handler: one foreign or malformed message
# ends the thread): live in every wheel 0.5.10.post1-0.5.23 (0.5.10.post1 nixl/conn.py:850-884 ...
# 0.5.23 :3355-3426; 0.5.21+ only log before the thread ends).
# F16 (a second live request with a bootstrap room already in use): admitted in every wheel
# 0.5.10.post1-0.5.23 under the default decode allocation policy (0.5.22 and 0.5.23 refuse it only
# under prefill_complete, and then fail the holder's room too); live everywhere.
# F17 (decode's metadata for a room prefill already dropped): stored for any room by every wheel's
# Mooncake bootstrap thread (0.5.23 mooncake/conn.py:3017), and the bootstrap timeout tells decode
# nothing: live everywhere; covered from 0.5.22 (the _handle_abort_notification hook).
# F18 (decode's KV pages addressed with prefill's item_len, never compared under equal attention TP):
# every wheel's _send_kvcache_generic (0.5.10.post1 mooncake/conn.py:648 ... 0.5.23 :1189): live and
# covered everywhere (the registration hook F6/F9 use).
# F19 (a newer prefill's bootstrap answer: PrefillServerInfo(**data) inside the lookup's catch-all,
# every wheel, 0.5.10.post1 common/conn.py:208 ... 0.5.23 :1309): live everywhere; covered on 0.5.11 and
# 0.5.22, whose decodes the mixed-release stage pairs with a 0.5.23 prefill.
# F20 (decode's lookup of a prefill's parallel info, requests.get(url, timeout=5), on its scheduler
# thread: every wheel, 0.5.10.post1 common/conn.py:205 ... 0.5.23 :1306, called from
# _ensure_prefill_info once a second, 15 tries): live everywhere.
# F21 (decode gives a failed request's pages back at the deferred release timeout without prefill's drain
# ack): DecodeTransferQueue.resolve_deferred_releases in 0.5.21-0.5.23 (0.5.23 decode.py:3046-3108,
# 0.5.21 :2806-2860 from 4-field entries); 0.5.19 and 0.5.20 release "anyway" too but never arm the
# drain-ack table, so no ack is ever counted there (live, not covered); no wheel up to 0.5.18 has a
# deferred release (n/a).
# F22 (a NIXL transfer worker's unbounded wait on a batch still PROC): NixlKVManager._await_handles in
# 0.5.20-0.5.23 (identical), inline in transfer_worker 0.5.12-0.5.19: live, covered on 0.5.20-0.5.23;
# up to 0.5.11 the sender polls its handles from the scheduler, no worker waits (n/a).
# F23 (NIXL prefill: a request opens a room decode already ended): the ABORT handler ignores a room with
# no status in 0.5.16-0.5.23 (NixlKVManager._handle_abort_notification, room_active False; 0.5.16
# nixl/conn.py:2360-2377): live, covered; 0.5.13-0.5.15.x decode sends the ABORT to a loop with no handler
# (live, not covered); up to 0.5.12.x decode sends none (n/a).
# F24 (F17 on NIXL): every wheel's NIXL bootstrap loop stores decode's metadata for any room (0.5.23
# nixl/conn.py:3392-3411): live everywhere; covered 0.5.20-0.5.23, where the loop offers each message to
# _handle_abort_notification and a NIXL decode reads prefill's Failed status (conclude_failure, 0.5.20+).
# 0.5.12 (no pin file, so no venv and no recorded probe values): no CI leg proves its code,
# so every fix live there is "live, not covered" (releases.policy_for, ci_matrix).
EXPECTED = [
    ("0.5.10.post1", Support.ACTIVE, StateLayout.FLAT, (L, L, N, L, L, L, L, L, L, L, N, L, N, L, L, L, X, L, X, L, N, N, N, X)),
    ("0.5.11", Support.ACTIVE, StateLayout.FLAT, (U, L, N, L, L, L, L, L, L, L, N, L, N, L, L, L, X, L, L, L, N, N, N, X)),
    ("0.5.12", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, X, X, X, X, X, X, X, X, N, X, N, X, X, X, X, X, X, X, N, X, N, X)),
    ("0.5.12.post1", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, L, L, L, L, L, L, L, L, N, L, N, L, L, L, X, L, X, L, N, X, N, X)),
    ("0.5.13", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, U, U, U, L, L, L, L, L, N, L, L, L, L, L, X, L, X, L, N, X, X, X)),
    ("0.5.13.post1", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, U, U, U, L, L, L, L, L, N, L, L, L, L, L, X, L, X, L, N, X, X, X)),
    ("0.5.14", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, U, U, U, L, L, L, L, L, N, L, L, L, L, L, X, L, X, L, N, X, X, X)),
    ("0.5.15", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, U, U, U, L, L, L, L, L, N, L, L, L, L, L, X, L, X, L, N, X, X, X)),
    ("0.5.15.post1", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, U, U, U, L, L, L, L, L, N, L, L, L, L, L, X, L, X, L, N, X, X, X)),
    ("0.5.16", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, U, U, U, L, L, L, L, L, N, L, L, L, L, L, X, L, X, L, N, X, L, X)),
    ("0.5.17", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, U, U, U, L, L, L, L, L, N, L, L, L, L, L, X, L, X, L, N, X, L, X)),
    ("0.5.18", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, U, U, U, L, L, L, L, L, N, L, L, L, L, L, X, L, X, L, N, X, L, X)),
    ("0.5.19", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, U, U, U, L, L, L, L, L, N, L, L, L, L, L, X, L, X, L, X, X, L, X)),
    ("0.5.20", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, U, U, U, L, L, L, L, L, N, L, L, L, L, L, X, L, X, L, X, L, L, L)),
    ("0.5.21", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, U, U, U, L, L, L, L, L, N, L, L, L, L, L, X, L, X, L, L, L, L, L)),
    ("0.5.22", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, U, U, U, L, L, L, L, L, L, L, U, L, L, L, L, L, L, L, L, L, L, L)),
    ("0.5.23", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, U, U, U, L, L, L, L, L, L, L, U, L, L, L, L, L, X, L, L, L, L, L)),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("version,support,layout,fixes", EXPECTED)
def test_policy_table(version, support, layout, fixes):
    p = policy_for(version)
    assert p.support is support
    assert p.layout is layout
    assert tuple(p.fixes[f] for f in FIXES) == fixes
    p.check_supported()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("version", ["0.5.9", "0.5.10", "0.5.11.post1", "0.5.23rc1", "0.6.0rc1", "garbage", None])
def test_unsupported_release_error_names_the_range(version):
    p = policy_for(version)
    assert p.support is Support.UNSUPPORTED
    with pytest.raises(UnsupportedSGLangRelease) as info:
        p.check_supported()
    message = str(info.value)
    assert "0.5.10.post1" in message and "0.5.23" in message
    assert str(version if version else "(not installed)") in message


@pytest.mark.timeout(10)
def test_plugin_framework_flag():
    assert not policy_for("0.5.10.post1").has_plugin_framework
    assert policy_for("0.5.11").has_plugin_framework
    assert policy_for("0.5.23").has_plugin_framework


@pytest.mark.timeout(10)
@pytest.mark.parametrize("version", ["0.5.24", "0.5.30.post2", "0.6.0", "1.0.0", "0.5.13.post2", "0.5.21.post1",
                                     "0.5.23.post3"])
def test_a_release_the_table_does_not_list_claims_nothing(version):
    """An upgrade of SGLang never stops a server started with an -ext name, and nothing unproven is
    claimed there: every fix "not covered here" (not upstream, not live), nothing active, a warning."""
    p = policy_for(version)
    assert p.support is Support.PASS_THROUGH and not p.known
    assert set(p.fixes.values()) == {FixStatus.UNCHECKED}
    assert p.active_fixes() == [] and not any(p.routes(b) for b in ("mooncake", "nixl", "mori"))
    p.check_supported()
    assert p.support_text == "not proven here: pass-through"
    warning = p.unknown_release_warning()
    assert warning.startswith(f"SGLang {version} is ") and "no fix is active" in warning
    newer = version.startswith(("0.5.24", "0.5.30", "0.6", "1."))
    assert ("newer than the newest release sglang-disagg-ext knows (0.5.23)" in warning) == newer


@pytest.mark.timeout(10)
@pytest.mark.parametrize("version,base", [("0.5.21.post1", "0.5.21"), ("0.5.13.post2", "0.5.13.post1"),
                                          ("0.5.23.post3", "0.5.23"), ("0.5.24", None), ("0.5.11.post1", "0.5.11")])
def test_a_post_release_belongs_to_its_newest_base_release(version, base):
    assert releases.base_release(version) == base


@pytest.mark.timeout(10)
def test_a_post_release_with_its_base_releases_probe_values_gets_its_fixes(monkeypatch):
    recorded = releases.recorded_facts()["0.5.21"]
    monkeypatch.setattr(releases, "probe_record", lambda feats=None: dict(recorded))
    p = releases.installed_policy("0.5.21.post1")
    assert p.version == "0.5.21.post1" and p.same_code_as == "0.5.21" and p.known
    assert p.fixes == policy_for("0.5.21").fixes and p.support is Support.ACTIVE
    assert p.support_text == "active (same code as 0.5.21)"
    # One probe that differs: not the same code, nothing claimed.
    monkeypatch.setattr(releases, "probe_record", lambda feats=None: {**recorded, "kv_status_codec": "other"})
    p = releases.installed_policy("0.5.21.post1")
    assert not p.known and set(p.fixes.values()) == {FixStatus.UNCHECKED}


def _manager(mode, served, extra, engine_rank, pp_rank, dp_rank):
    """A KV manager as SGLang builds one, by hand: only the attributes the labels are read from."""
    from types import SimpleNamespace

    return SimpleNamespace(
        server_args=SimpleNamespace(served_model_name=served, extra_metric_labels=extra),
        disaggregation_mode=SimpleNamespace(value=mode),
        kv_args=SimpleNamespace(engine_rank=engine_rank, pp_rank=pp_rank, system_dp_rank=dp_rank),
    )


@pytest.mark.timeout(10)
@pytest.mark.parametrize("manager,labels", [
    # A decode rank 3 of TP, no data parallelism (SGLang: dp_rank None, no label), two extra labels.
    (_manager("decode", "llama-8b", {"team": "kv", "zone": "b"}, 3, 0, None),
     {"model_name": "llama-8b", "engine_type": "decode", "tp_rank": "3", "pp_rank": "0", "team": "kv", "zone": "b"}),
    # A prefill with DP rank 1, pipeline stage 2, no extra labels.
    (_manager("prefill", "m", None, 0, 2, 1),
     {"model_name": "m", "engine_type": "prefill", "tp_rank": "0", "pp_rank": "2", "dp_rank": "1"}),
    # Not a PD manager's mode, no served name: left out, never guessed.
    (_manager("null", None, None, 0, 0, None), {"tp_rank": "0", "pp_rank": "0"}),
], ids=["decode-tp3-extra", "prefill-dp1-pp2", "nothing-to-guess"])
def test_sglang_metric_labels_are_read_from_the_manager(manager, labels):
    assert releases.sglang_metric_labels(manager) == labels
