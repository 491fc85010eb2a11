"""Release policy table, checked against facts read from each release's wheel."""

import pytest

from sglang_disagg_ext.releases import FIXES, FixStatus, StateLayout, Support, UnsupportedSGLangRelease, policy_for

L, U, N = FixStatus.LIVE, FixStatus.UPSTREAM, FixStatus.NA

X = FixStatus.UNCOVERED

# (release, support, layout, F1..F14) — from shared/notes/sglang-releases.md, except F4/F5 on
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
# decode exits, -ext's serves on) by the real-server stage on 0.5.23 only: elsewhere not covered yet.
# 0.5.12 (no pin file, so no venv and no recorded probe values): no CI leg proves its code,
# so every fix live there is "live, not covered" (releases.policy_for, ci_matrix).
EXPECTED = [
    ("0.5.10.post1", Support.ACTIVE, StateLayout.FLAT, (L, L, N, L, L, L, L, L, L, L, N, L, N, X)),
    ("0.5.11", Support.ACTIVE, StateLayout.FLAT, (U, L, N, L, L, L, L, L, L, L, N, L, N, X)),
    ("0.5.12", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, X, X, X, X, X, X, X, X, N, X, N, X)),
    ("0.5.12.post1", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, L, L, L, L, L, L, L, L, N, L, N, X)),
    ("0.5.13", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, U, U, U, L, L, L, L, L, N, L, L, X)),
    ("0.5.13.post1", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, U, U, U, L, L, L, L, L, N, L, L, X)),
    ("0.5.14", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, U, U, U, L, L, L, L, L, N, L, L, X)),
    ("0.5.15", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, U, U, U, L, L, L, L, L, N, L, L, X)),
    ("0.5.15.post1", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, U, U, U, L, L, L, L, L, N, L, L, X)),
    ("0.5.16", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, U, U, U, L, L, L, L, L, N, L, L, X)),
    ("0.5.17", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, U, U, U, L, L, L, L, L, N, L, L, X)),
    ("0.5.18", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, U, U, U, L, L, L, L, L, N, L, L, X)),
    ("0.5.19", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, U, U, U, L, L, L, L, L, N, L, L, X)),
    ("0.5.20", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, U, U, U, L, L, L, L, L, N, L, L, X)),
    ("0.5.21", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, U, U, U, L, L, L, L, L, N, L, L, X)),
    ("0.5.22", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, U, U, U, L, L, L, L, L, L, L, U, X)),
    ("0.5.23", Support.ACTIVE, StateLayout.PER_COMPONENT, (U, U, U, U, U, L, L, L, L, L, L, L, U, L)),
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
@pytest.mark.parametrize("version", ["0.5.24", "0.5.30.post2", "0.6.0", "1.0.0"])
def test_newer_release_than_known_is_pass_through_with_a_warning(version):
    """An upgrade of SGLang past 0.5.23 never stops a server started with an -ext name."""
    p = policy_for(version)
    assert p.support is Support.PASS_THROUGH and not p.known
    assert tuple(p.fixes[f] for f in ("F1", "F2", "F3", "F4", "F5")) == (U, U, U, U, U)
    p.check_supported()
    assert p.support_text == "unknown release: pass-through"
    warning = p.unknown_release_warning()
    assert f"SGLang {version} is newer than the newest release sglang-disagg-ext knows (0.5.23;" in warning
    assert "0.5.10.post1" in warning


@pytest.mark.timeout(10)
# Every published release 0.5.13-0.5.23 has its own row now; a post-release the table does
# not list (in the known range) still passes through without the unknown-release warning.
@pytest.mark.parametrize("version", ["0.5.13.post2", "0.5.21.post1", "0.5.23.post3"])
def test_known_pass_through_releases_give_no_warning(version):
    p = policy_for(version)
    assert p.known and p.unknown_release_warning() is None and p.support_text == "pass-through"
