"""`sglang-disagg-ext doctor --json` tells the truth about the installed release."""

import json
import os
import subprocess
import sys

import pytest

# Per release, by hand from shared/notes/sglang-releases.md and the 0.5.12.post1 wheel:
# (supported, live fixes, entry point discovered). 0.5.12.post1 has F4 and F5 live: its NIXL
# slice maps decode-side head replicas by modulo (nixl/conn.py:1002-1004) and its NSA offload
# get_cpu_copy(self, indices) (memory_pool.py:2145) rejects the allocator's mamba_indices=
# (allocator.py:524). F6-F8 (Mooncake) read in each wheel: live in all four, e.g. one failed
# KV send blacklists the session (0.5.10.post1 mooncake/conn.py:1270-1271, 0.5.11 :1275-1276,
# 0.5.12.post1 :1323-1324, 0.5.23 :2742-2745).
# F9 (metadata buffers paired by position, addressed with prefill's row sizes: send_aux in every
# wheel) and F10 (decode's metadata gate without a deadline: utils._apply_metadata_gate from 0.5.13,
# DecodeTransferQueue._commit_transfer_to_req before) are live and covered on every release (F10 on
# 0.5.10.post1 with the import-only sgl_kernel stand-in its decode module needs on a CPU machine).
# 0.5.13-0.5.21 (the release sweep runs this file there): the Mooncake fixes F6-F10, and
# F12. F13 (NIXL SWA state across TP sizes) on 0.5.13-0.5.21.
# F11 (NIXL head-sliced path) exists from 0.5.22 only: n/a on the three older ones, live on 0.5.22
# (not in the CI matrix; the release sweep runs this file there) and 0.5.23.
TRUTH = {
    # F12 (MoRI rows of the wrong length dropped or overrun on decode: every wheel) live and covered
    # on every release (0.5.12.x through F3's classes, which carry the row checks).
    "0.5.10.post1": (True, {"F1", "F2", "F4", "F5", "F6", "F7", "F8", "F9", "F10", "F12", "F14", "F15", "F16", "F18", "F20"},
                     False),
    "0.5.11": (True, {"F2", "F4", "F5", "F6", "F7", "F8", "F9", "F10", "F12", "F14", "F15", "F16", "F18", "F19", "F20"}, True),
    "0.5.12.post1": (True, {"F3", "F4", "F5", "F6", "F7", "F8", "F9", "F10", "F12", "F14", "F15", "F16", "F18", "F20"}, True),
    **{r: (True, {"F6", "F7", "F8", "F9", "F10", "F12", "F13", "F14", "F15", "F16", "F18", "F20"}, True) for r in (
        "0.5.13", "0.5.13.post1", "0.5.14", "0.5.15", "0.5.15.post1")},
    # F23 (NIXL prefill ignores decode's ABORT for a room it has not opened) from 0.5.16, where the ABORT
    # handler appears.
    **{r: (True, {"F6", "F7", "F8", "F9", "F10", "F12", "F13", "F14", "F15", "F16", "F18", "F20", "F23"}, True)
       for r in ("0.5.16", "0.5.17", "0.5.18", "0.5.19")},
    # F22 (a NIXL worker's unbounded wait on a stalled decode) from 0.5.20, where _await_handles appears;
    # F24 (F17 on NIXL) from 0.5.20, where a NIXL decode reads prefill's Failed status.
    "0.5.20": (True, {"F6", "F7", "F8", "F9", "F10", "F12", "F13", "F14", "F15", "F16", "F18", "F20", "F22", "F23",
                      "F24"}, True),
    # F21 (pages given back "anyway") from 0.5.21, the first wheel that arms the drain-ack table.
    "0.5.21": (True, {"F6", "F7", "F8", "F9", "F10", "F12", "F13", "F14", "F15", "F16", "F18", "F20", "F21", "F22",
                      "F23", "F24"}, True),
    "0.5.22": (True, {"F6", "F7", "F8", "F9", "F10", "F11", "F12", "F14", "F15", "F16", "F17", "F18", "F19", "F20", "F21", "F22",
                      "F23", "F24"}, True),
    # F15 (NIXL prefill's bootstrap loop dies of one bad message: every wheel) live on every release,
    # and F16 (a second live request admitted into a room in use: every wheel).
    # F14 (decode's pairing check raising on its scheduler thread, try_ensure_parallel_info: every
    # wheel) is covered on every release with a CI leg (test_decode_pairing_check.py; on 0.5.23 also the
    # real-server stage). F19 (a newer prefill's bootstrap answer, every wheel) is covered on 0.5.11 and
    # 0.5.22, the decodes of the mixed-release stage. F17 (decode's
    # metadata for a room prefill dropped, stored by every wheel's Mooncake bootstrap thread) is
    # covered from 0.5.22 (its adapter's hook, _handle_abort_notification, exists from there). F18
    # (decode's KV pages addressed with prefill's item_len: every wheel) is live and covered everywhere.
    # F20 (decode's lookup of a prefill's parallel info on its scheduler thread: every wheel) is covered
    # on every release with a CI leg (test_prefill_lookup.py; on 0.5.23 also the real-server stage).
    # F21 (decode gives a failed request's pages back at the deferred release timeout) is covered on
    # 0.5.21-0.5.23 and F22 (a NIXL worker's unbounded wait on a stalled decode) on 0.5.20-0.5.23.
    # F23 and F24 (NIXL's orphan rooms) are covered on 0.5.16-0.5.23 and 0.5.20-0.5.23.
    "0.5.23": (True, {"F6", "F7", "F8", "F9", "F10", "F11", "F12", "F14", "F15", "F16", "F17", "F18", "F20", "F21", "F22",
                      "F23", "F24"}, True),
}


def _doctor(env_extra=None):
    env = dict(os.environ)
    env.update(env_extra or {})
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_disagg_ext.cli", "doctor", "--json"],
        capture_output=True, text=True, timeout=240, env=env,
    )
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.timeout(300)
def test_doctor_json_matches_release_facts(policy):
    code, report = _doctor()
    assert report["sglang_version"] == policy.version
    supported, live, discovered = TRUTH[policy.version]
    assert report["supported"] is supported
    assert {f for f, v in report["fixes"].items() if v["live"]} == live
    # Every release here is active: the plugin installs exactly the live fixes.
    assert {f for f, v in report["fixes"].items() if v["active"]} == live
    assert report["entry_point"] is discovered
    # The CPU test venvs have Mooncake and NIXL; MoRI is ROCm-only.
    assert report["engines"] == {"mooncake": True, "nixl": True, "mori": False}
    assert set(report) >= {"sglang_version", "supported", "fixes", "engines", "entry_point"}
    assert code == 0


@pytest.mark.timeout(300)
def test_doctor_fails_when_plugin_is_whitelisted_out(policy):
    code, report = _doctor({"SGLANG_PLUGINS": "some_other_plugin"})
    if policy.has_plugin_framework:
        assert report["entry_point"] is False
        assert code == 1
        assert any("SGLANG_PLUGINS" in p for p in report["problems"])
    else:
        # No plugin loader to whitelist against; the launcher path still works.
        assert code == 0 and report["entry_point"] is False


# Verified transfers, by hand from the wheels. Mooncake on every release where mooncake-ext
# routes: 0.5.20+ through SGLang's common status codec, which carries a trailing frame (common/conn.py
# parse_kv_status_message / send_kv_status_message); up to 0.5.19, whose decode loop unpacks exactly three
# status frames, through the fourth frame the -ext peers exchange (F6/F9, live on every one of them). NIXL
# where its decode learns Success from prefill's status message alone (0.5.23: NixlKVReceiver.poll reads
# check_status only), and where it learns Success from NIXL notifications alone (up to 0.5.22: poll concludes
# through check_transfer_done, and NIXL's prefill never sends a Success message: NixlKVManager has no
# send_kv_status_message before the common codec of 0.5.20, and 0.5.20-0.5.22's nixl/conn.py calls neither it
# nor conclude_transfer, only conclude_failure; update_transfer_status splits the aux tag on "_" and reads at
# most 4 fields before 0.5.20, at most 5 from 0.5.20 ("<room>_aux_nokv_<pp>_<expected>"), so the digest rides
# there as one more). MoRI where it concludes
# rooms through that codec (0.5.20+: conclude_transfer / parse_kv_status_message in mori/conn.py) or through
# its own status message (up to 0.5.19: MoriKVManager.notify_decode_status, whose decode worker reads guard,
# room, status, rank and reason by position, never a frame after: 0.5.11 mori/conn.py:398-420, :357-368).
VERIFY_AVAILABLE = {r: {"mooncake-ext", "nixl-ext", "mori-ext"} for r in (
    "0.5.10.post1", "0.5.11", "0.5.12", "0.5.12.post1", "0.5.13", "0.5.13.post1", "0.5.14", "0.5.15",
    "0.5.15.post1", "0.5.16", "0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")}


@pytest.mark.timeout(300)
def test_doctor_says_whether_and_where_transfers_are_verified(policy):
    code, report = _doctor({"SGLANG_DISAGG_EXT_VERIFY": "1"})
    verify = report["verified_transfers"]
    assert verify["enabled"] is True and verify["mode"] == "on" and verify["env"] == "SGLANG_DISAGG_EXT_VERIFY"
    assert set(verify["unavailable"]) == {"mooncake-ext", "nixl-ext", "mori-ext"}
    assert {ext for ext, why in verify["unavailable"].items() if not why} == VERIFY_AVAILABLE[policy.version]
    assert code == 0


@pytest.mark.timeout(300)
def test_doctor_refuses_a_held_pages_limit_it_cannot_read():
    # One doctor run (a subprocess on every leg): a value the plugin cannot read is a problem, and the
    # report says pages are held until confirmed. Reading a valid value: test_held_pages_rule.py.
    code, report = _doctor({"SGLANG_DISAGG_EXT_HELD_PAGES_LIMIT_S": "soon"})
    assert report["held_pages_limit"] == {"env": "SGLANG_DISAGG_EXT_HELD_PAGES_LIMIT_S", "seconds": None}
    assert any("SGLANG_DISAGG_EXT_HELD_PAGES_LIMIT_S='soon'" in p for p in report["problems"])
    assert code != 0
