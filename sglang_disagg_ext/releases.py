"""Release policy: the one place that knows how SGLang releases differ.

For each supported SGLang release this module says, per fix, whether the bug is
*live* (the plugin installs its fixed code), *upstream* (the release already has
the fix) or *n/a* (the code path does not exist), and which state layout the
release uses. Everything else in the plugin asks this module instead of
comparing version strings itself.

Facts come from reading each release's wheel (``shared/notes/sglang-releases.md``):

==============  ====  ====  ====  ====  ====  ======  ====  ====  ======  ======  ======  ======  =============
release          F1    F2    F3    F4    F5    F6      F7    F8    F9      F10     F11     F12     state layout
==============  ====  ====  ====  ====  ====  ======  ====  ====  ======  ======  ======  ======  =============
0.5.10.post1     live  live  n/a   live  live  live    live  live  live    live    n/a     live    flat
0.5.11           up    live  n/a   live  live  live    live  live  live    live    n/a     live    flat
0.5.12(.post1)   up    up    live  live  live  live    live  live  live    live    n/a     live    per-component
0.5.13 …         up    up    up    up    up    live    live  live  live    live    n/a     live    per-component
  0.5.19 [1]
0.5.20, 0.5.21   up    up    up    up    up    live    live  live  live    live    n/a     live    per-component
0.5.22           up    up    up    up    up    live    live  live  live    live    live    live    per-component
0.5.23           up    up    up    up    up    live    live  live  live    live    live    live    per-component
==============  ====  ====  ====  ====  ====  ======  ====  ====  ======  ======  ======  ======  =============

[1] each published release: 0.5.13, 0.5.13.post1, 0.5.14, 0.5.15, 0.5.15.post1,
0.5.16, 0.5.17, 0.5.18, 0.5.19. Every release 0.5.13-0.5.22 is
active with F6/F7/F8/F9/F10 live because a differential run on that release's wheel proved
them (stock fails with the bug's signature, ``-ext`` passes):
``scripts/release_sweep.sh``, recorded in ``docs/release-sweep.md``. A release of
that range without its own row (a later ``.postN``) passes through.

"uncov." (``FixStatus.UNCOVERED``): the bug is live in that release's wheel, but
this plugin version has no adapter proven against its code, so ``-ext`` passes
through there. (F6 and F9 on 0.5.10.post1-0.5.22 are live, not uncovered: the
registration is built inside the receiver and, up to 0.5.20, prefill's bootstrap
loop reads its socket directly, so ``-ext`` adds and reads the pool-sizes frame
through the receiver and the socket, see ``backends/mooncake/peers``.) F6-F9 facts per release (every wheel 0.5.10.post1-0.5.23 read):
F6 one failed KV send blacklists the decode session (0.5.10.post1
mooncake/conn.py:1270-1271 ... 0.5.23 :2742-2745), no release checks destination
indices against decode's pools, and no registration message carries them; F7
``CommonKVManager.get_mha_kv_ptrs_with_pp`` is the same code in every release
(0.5.23 common/conn.py:1718-1749) and guesses a draft model from the layer counts;
F8 ``transfer_worker`` re-raises (0.5.10.post1 :1339-1343 ... 0.5.23 :2878) and
the bootstrap/decode loops have no handler; F9 metadata buffers are paired by
position whatever their counts (0.5.22 mooncake/conn.py:1755; 0.5.23 only logs
the mismatch, common/conn.py:617-634), and every release addresses decode's rows
with prefill's row sizes (``send_aux``), so rows of another size (the hidden-state
buffer where one engine runs speculative decoding: sized by the draft model there,
16 elements without it, e.g. 0.5.13 managers/scheduler.py:1057-1068 and
:1110-1123, where decode sizes it for EAGLE only and prefill for EAGLE or
STANDALONE) land misplaced with Success; F10 decode holds a request whose metadata
row never shows its room forever (0.5.12 decode.py:1412-1415, 0.5.23
utils.py:245-260). F9's verdict is reached in 0.5.23's ``check_peer_aux_buffer_count``
and, before it, where F6's pool-sizes frame is read (the same registration
message, on the bootstrap thread); F10: from 0.5.13 the gate is
``utils._apply_metadata_gate`` (0.5.13 utils.py:78), replaced by the plugin as on
0.5.23; before, the same test sits in ``DecodeTransferQueue._commit_transfer_to_req``
after the TP all-reduce (a per-rank deadline there would desynchronise the ranks),
so the plugin installs 0.5.13's gate, with the deadline, before the all-reduce
(``backends/common/metadata_gate``; the opt-in staging path is not gated there). On
0.5.10.post1 the decode module imports ``sgl_kernel`` (decode.py:54 ->
managers/schedule_batch.py:71 -> mem_cache/radix_cache.py:65 -> hicache_storage.py:12
-> memory_pool_host.py:47), present wherever SGLang serves on a GPU; the CPU test
environments of that release carry an import-only stand-in for it
(``scripts/cpu_stubs/sgl_kernel``).
F11 (NIXL nixl/conn.py and common/conn.py of every wheel read): the head-sliced
SWA state path (``_send_swa_state_slice``, common ``_get_mha_head_slice_blocks``
raising "Head-sliced PD transfer page count mismatch") and the bare asserts of
``_init_hetero_tp_prep_handle`` on the bootstrap thread exist from 0.5.22
(nixl/conn.py:941, :2640; common/conn.py:1617) and in 0.5.23 (:1311, :2969;
:1802-1806; bootstrap thread logs and re-raises, :3415-3426); up to 0.5.21 there
is no head-sliced SWA path: n/a. (The neighbouring bug is live there and not
covered by any fix: a non-MLA SWA request across different TP sizes raises on
prefill's transfer worker, "PD Disaggregation does NOT support PD different TP sizes
for non-MLA SWA hybrid models yet" (0.5.13 nixl/conn.py:1616-1618 ... 0.5.21
:2674-2676); up to 0.5.19 decode is never told and waits out its waiting timeout,
from 0.5.20 ``conclude_failure`` tells it.) 0.5.22: live, 0.5.23's adapter applies (0.5.22's decode listener has
no CHUNK_READY message, and its NixlKVReceiver.poll also concludes Success from NIXL
notifications, so a dead listener loses prefill's Failed messages: the listener
case there is the failed-room one), proven by test_nixl_newest.py and the F11
selftest rows on the 0.5.22 wheel.
F12 (MoRI mori/conn.py of every wheel read): decode drops a row whose bytes
disagree with their declared length in every release (0.5.10.post1 :774 ... 0.5.23
:1980); metadata rows go out as ``AUX_DATA`` messages on another ZMQ socket than
the room's status on 0.5.10.post1/0.5.11 (a new socket per message, ``_connect``
:752 vs :417) and from 0.5.20 (per-thread ``_connect_threadsafe`` vs the common
``_send_multipart_locked``, 0.5.23 :837-857 / :1610-1624 vs common/conn.py:1709),
while 0.5.12.post1-0.5.19 send both from one thread on one ``_connect_threadsafe``
socket (ordered; the drop stays). 0.5.20 and 0.5.21 run 0.5.22's adapter; their
registration has 13 frames after the guard, not 17 (probe
``mori_registration_frames``), proven by test_mori_newest.py on both wheels. Proven (stand-in engine) on 0.5.23 and on
0.5.22, whose metadata path is 0.5.23's (send_aux_tcp :1556, _handle_aux_data :1932)
but whose decode registration has no manager hook (probe mori_registration_hook):
the receiver appends the row-size frame there. Up to 0.5.19 (probe
``mori_sender_notifies_status``: the sender's poll sends the status through
``notify_decode_status``, no ``conclude_failure``) the same class checks the rows
on both sides and leaves stock's channel: there the status did not overtake a row
(one socket from one thread from 0.5.12.post1; on 0.5.10.post1/0.5.11 not shown by
the harness's delay hook, 5 of 5 rooms in order with 300 ms delays), and the decode
worker handles statuses inline. Registration there: 11 frames after the guard on
0.5.10.post1/0.5.11, 13 on 0.5.12.post1-0.5.21. On 0.5.12.x F3's classes are
mori-ext's; they carry the same row checks (``backends/mori/aux_rows``) and their
registration the same row-size frame. Live on every release.

0.5.12.x fixes F4 and F5 only in part (0.5.12.post1 lines): NIXL maps decode-side
head replicas by modulo (nixl/conn.py:1002-1004), keys KV tags on the TP rank only
(:661-662) and registers KV/state as VRAM (:776, :802); the NSA offload
``get_cpu_copy(self, indices)`` (mem_cache/memory_pool.py:2145) is called with
``mamba_indices=`` by the allocator (allocator.py:524): TypeError on retract.

Patched sources: a team that applies ``patches/<release>/`` to its SGLang gets a
``sglang/srt/disaggregation/_disagg_ext_patches.py`` listing ``APPLIED_FIXES``.
:func:`current_policy` reads it and reports those fixes as ``upstream`` (listed in
``ReleasePolicy.patched``): the patched release has the fix, so the plugin installs
nothing for it and the differential tests expect stock to pass (docs/patches.md).

Feature probes: :func:`features` returns one :class:`SGLangFeatures` record
holding every other question the plugin and its self-test ask about the
installed SGLang's code (``resolve_once``, call signatures, ``runtime_context``,
whether a stock fix is in the source). Each probe imports SGLang lazily and is
cached; no other module of the package uses ``hasattr``/``inspect``/source text
on SGLang (``test/unit/test_layout.py`` checks).

F2 on the flat layout: no release has a ``"dsv4"`` state type, but a flat-layout
DSv4 component (what upstream main briefly had) is silently dropped by stock
``maybe_send_extra`` (``return 0``), so the plugin routes it: live there.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import importlib.util
import inspect
import os
import sys
from importlib import metadata
from typing import Dict, Optional, Tuple

from packaging.version import InvalidVersion, Version

from sglang_disagg_ext import backend_table

FIXES = ("F1", "F2", "F3", "F4", "F5", "F6", "F7", "F8", "F9", "F10", "F11", "F12", "F13", "F14", "F15", "F16", "F17", "F18", "F19", "F20", "F21", "F22", "F23", "F24")

FIX_TITLES = {
    "F1": "Mooncake SWA/NSA state-index alignment (trim both directions, request untouched)",
    "F2": "Mooncake DSv4 state routed through the generic page path",
    "F3": "MoRI per-component hybrid state (wire format, registration, dispatch)",
    "F4": "NIXL heterogeneous TP: total-head slice with GQA replication (KV and SWA state), per-rank notification key",
    "F5": "Retract/resume: metadata buffers copied, NSA index-key buffer offloaded and released",
    "F6": "Mooncake: a request with out-of-pool destination indices is refused before the engine; the peer session stays usable",
    "F7": "Mooncake: hybrid state buffers paired by layer (MTP/draft tail layers), refused where they cannot be paired",
    "F8": "Mooncake: transfer, bootstrap and decode threads survive an unexpected exception; the affected room ends Failed",
    "F9": "Mooncake: registration refuses a pair it cannot serve (metadata buffer counts or sizes differ), on both sides",
    "F10": "Decode's metadata gate has a deadline: a request whose metadata never lands ends Failed, with a reason",
    "F11": "NIXL (head-sliced path): an unsliceable decode is refused at registration, SWA page lists aligned as Mooncake, "
    "the bootstrap thread survives a failed registration and the decode listener a failed status message",
    "F12": "MoRI (TCP metadata path): each metadata row travels ahead of its room's status on one ordered channel; "
    "a row whose length does not match fails the room with a reason instead of being dropped; a status message "
    "whose handling raises fails its room on decode at once",
    "F13": "NIXL across attention TP sizes: SWA state sent as head slices (F4's layout) where stock refuses "
    "every request of a hybrid SWA model; up to 0.5.16 also the KV heads of a decode that replicates them; "
    "layouts that cannot be sliced and registrations that raise refused at registration; up to 0.5.19 decode "
    "told at once of a room prefill fails; up to 0.5.15 decode's ABORT no longer ends prefill's bootstrap thread",
    "F14": "Decode: a prefill it cannot pair with (page size, KV dtype, KV layout, TP/PP layout) fails its own "
    "requests with the reason; the decode server keeps serving every other prefill",
    "F15": "NIXL prefill: a foreign or malformed message on the bootstrap socket is dropped (one ERROR, counted; "
    "the room it names, if any, Failed with the reason) instead of ending the bootstrap thread",
    "F16": "A second live request with a bootstrap room already in use is refused on both sides with a reason; "
    "the request holding the room is untouched and no scheduler thread raises",
    "F17": "Mooncake prefill: decode's metadata for a room prefill already dropped (its bootstrap timeout or an "
    "abort) is answered with Failed and the reason at once, and for a room no request opened, after a lease of "
    "SGLang's bootstrap timeout, instead of decode holding the request's KV until its waiting timeout",
    "F18": "Mooncake: -ext peers exchange a compatibility record at registration; prefill refuses a decode whose KV "
    "pages are laid out otherwise (page size, head dim, KV dtype: another model configuration), naming every "
    "differing field, instead of writing its pages at the wrong offsets",
    "F19": "Decode reads the bootstrap answer of a prefill on a newer SGLang: served where the fields it does not "
    "know are at values that leave the transfer unchanged, refused at once naming each field otherwise, instead "
    "of failing to read it and losing every request to that prefill",
    "F20": "Decode asks a prefill for its parallel info off its scheduler thread: a prefill address that never "
    "answers no longer stops every decode step for 5 s a try; its waiting requests end Failed after stock's 15 tries",
    "F21": "Decode keeps a failed request's pages past SGLang's deferred release timeout until prefill confirms "
    "its writes stopped or its process is gone, instead of handing them to another request 'anyway'",
    "F22": "A NIXL transfer that never settles (a stalled decode) ends Failed at SGLang's waiting timeout instead of "
    "holding prefill's transfer worker, and every room queued behind it, for ever",
    "F23": "NIXL prefill: a request that opens a room decode already ended (decode's ABORT arrived first) ends "
    "Failed at once with the reason, instead of waiting out the bootstrap timeout (or for ever, 0.5.16/0.5.17)",
    "F24": "NIXL prefill: decode's metadata for a room prefill already dropped (its bootstrap timeout or an abort) "
    "is answered with Failed and the reason at once, and for a room no request opened, after a lease of SGLang's "
    "bootstrap timeout, instead of decode holding the request's KV until its waiting timeout (F17's NIXL twin)",
}

# Which backend each fix lives in ("all" = not tied to one transfer backend).
FIX_BACKEND = {
    "F1": "mooncake",
    "F2": "mooncake",
    "F3": "mori",
    "F4": "nixl",
    "F5": "all",
    "F6": "mooncake",
    "F7": "mooncake",
    "F8": "mooncake",
    "F9": "mooncake",
    "F10": "all",
    "F11": "nixl",
    "F12": "mori",
    "F13": "nixl",
    "F14": "all",
    "F15": "nixl",
    "F16": "all",
    "F17": "mooncake",
    "F18": "mooncake",
    "F19": "all",
    "F20": "all",
    "F21": "all",
    "F22": "nixl",
    "F23": "nixl",
    "F24": "nixl",
}

# -ext name -> base name, from the one backend table.
EXT_BACKENDS = backend_table.ext_to_base()

SUPPORTED_RANGE_TEXT = (
    "every release 0.5.10.post1 through 0.5.23 (what each fixes: `sglang-disagg-ext doctor --release X`); "
    "a release outside that table passes through to SGLang's own classes"
)


class FixStatus(str, enum.Enum):
    LIVE = "live"
    UPSTREAM = "upstream"
    NA = "n/a"
    # The bug is live in the release, but this plugin version has no adapter proven
    # against that release's code (no CI leg): the -ext name passes through there
    # and doctor says so, instead of installing code written for another release.
    UNCOVERED = "live, not covered"
    # A release this plugin has not proven (newer than every known release, or a post-release
    # whose code differs from its base): nothing about the fix was checked there, so nothing is
    # claimed, and the -ext name passes through to SGLang's own classes.
    UNCHECKED = "not covered here"


class StateLayout(str, enum.Enum):
    FLAT = "flat"  # kv_args.state_type: str; one state component
    PER_COMPONENT = "per-component"  # kv_args.state_types: List[StateType]


class Support(str, enum.Enum):
    ACTIVE = "active"  # live fixes are installed
    PASS_THROUGH = "pass-through"  # -ext names map to the stock classes
    UNSUPPORTED = "unsupported"


class UnsupportedSGLangRelease(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class ReleasePolicy:
    version: Optional[str]
    support: Support
    layout: Optional[StateLayout]
    fixes: Dict[str, FixStatus]
    has_plugin_framework: bool
    # Fixes the installed SGLang sources carry from this project's patches/
    # (their status is UPSTREAM: the plugin installs nothing for them).
    patched: Tuple[str, ...] = ()
    # False for a release this plugin has not proven (newer than the newest it knows, or a
    # post-release whose code differs from its base release): it runs as pass-through (the -ext
    # names keep working after an upgrade), with one warning naming the release.
    known: bool = True
    # A post-release not in the table whose probe values equal this table release's record:
    # it gets that release's fixes (current_policy).
    same_code_as: Optional[str] = None

    @property
    def support_text(self) -> str:
        """``support`` for people: "not proven here: pass-through" for a release the plugin has not proven."""
        if self.same_code_as:
            return f"{self.support.value} (same code as {self.same_code_as})"
        return self.support.value if self.known else f"not proven here: {self.support.value}"

    def unknown_release_warning(self) -> Optional[str]:
        """The one WARNING a server logs at start on a release the plugin has not proven."""
        if self.known:
            return None
        newer = self.version is not None and _parse(self.version) is not None and _parse(self.version) >= _PASS_THROUGH_END
        base = base_release(self.version) if self.version else None
        why = (f"is newer than the newest release sglang-disagg-ext knows ({NEWEST_KNOWN})" if newer else
               "is not in the release table sglang-disagg-ext has proven"
               + (f" (its code did not match SGLang {base}'s recorded probes)" if base else ""))
        return (
            f"SGLang {self.version} {why}: no fix is active, the -ext backends pass through to SGLang's own "
            f"classes (known: {SUPPORTED_RANGE_TEXT}). Run `sglang-disagg-ext selftest` on this node, and "
            "upgrade the plugin."
        )

    @property
    def supported(self) -> bool:
        return self.support is not Support.UNSUPPORTED

    @property
    def server_module(self) -> str:
        """Module that starts an SGLang server with the ``-ext`` backends loaded.

        Without a plugin framework SGLang never loads the entry point, so the
        plugin's launcher (same arguments as ``sglang.launch_server``) does it.
        """
        if self.has_plugin_framework:
            return "sglang.launch_server"
        return "sglang_disagg_ext.launch_server"

    def is_live(self, fix: str) -> bool:
        return self.fixes.get(fix) is FixStatus.LIVE

    def routes(self, backend: str) -> bool:
        """Whether the ``-ext`` name of ``backend`` ("mooncake", ...) runs plugin classes here.

        True where the release is active and one of that backend's own fixes is
        live, or carried by patched sources (there the plugin's classes keep
        running over them, and the differential tests check stock and ``-ext``
        both pass); otherwise the ``-ext`` name passes through to SGLang's
        classes for that backend (e.g. ``mori-ext`` on 0.5.23, where no
        MoRI fix is live).
        """
        return self.support is Support.ACTIVE and any(
            self.is_live(f) or f in self.patched for f in FIXES if FIX_BACKEND[f] == backend
        )

    def active_fixes(self):
        """Fixes whose fixed code the plugin installs in this release."""
        return [f for f in FIXES if self.is_live(f)]

    def check_supported(self) -> None:
        if not self.supported:
            raise UnsupportedSGLangRelease(
                f"sglang-disagg-ext does not support SGLang {self.version or '(not installed)'}; "
                f"supported releases: {SUPPORTED_RANGE_TEXT}. "
                "Use the stock backend name (mooncake, nixl, mori) or install a supported SGLang."
            )

    def summary_line(self) -> str:
        fixes = ", ".join(f"{f}={self.fixes[f].value}" for f in FIXES)
        patched = f" (patched sources: {', '.join(self.patched)})" if self.patched else ""
        return f"sglang-disagg-ext: SGLang {self.version} ({self.support_text}); {fixes}{patched}"


_L, _U, _N, _X = FixStatus.LIVE, FixStatus.UPSTREAM, FixStatus.NA, FixStatus.UNCOVERED

_ACTIVE_RELEASES = {
    "0.5.10.post1": (StateLayout.FLAT, {"F1": _L, "F2": _L, "F3": _N, "F4": _L, "F5": _L, "F6": _L, "F7": _L, "F8": _L, "F9": _L, "F10": _L, "F11": _N, "F12": _L, "F13": _N, "F14": _L, "F15": _L, "F16": _L, "F17": _X, "F18": _L, "F19": _X, "F20": _L, "F21": _N, "F22": _N, "F23": _N, "F24": _X}, False),
    "0.5.11": (StateLayout.FLAT, {"F1": _U, "F2": _L, "F3": _N, "F4": _L, "F5": _L, "F6": _L, "F7": _L, "F8": _L, "F9": _L, "F10": _L, "F11": _N, "F12": _L, "F13": _N, "F14": _L, "F15": _L, "F16": _L, "F17": _X, "F18": _L, "F19": _L, "F20": _L, "F21": _N, "F22": _N, "F23": _N, "F24": _X}, True),
    "0.5.12": (StateLayout.PER_COMPONENT, {"F1": _U, "F2": _U, "F3": _L, "F4": _L, "F5": _L, "F6": _L, "F7": _L, "F8": _L, "F9": _L, "F10": _L, "F11": _N, "F12": _L, "F13": _N, "F14": _L, "F15": _L, "F16": _L, "F17": _X, "F18": _L, "F19": _X, "F20": _L, "F21": _N, "F22": _X, "F23": _N, "F24": _X}, True),
    "0.5.12.post1": (StateLayout.PER_COMPONENT, {"F1": _U, "F2": _U, "F3": _L, "F4": _L, "F5": _L, "F6": _L, "F7": _L, "F8": _L, "F9": _L, "F10": _L, "F11": _N, "F12": _L, "F13": _N, "F14": _L, "F15": _L, "F16": _L, "F17": _X, "F18": _L, "F19": _X, "F20": _L, "F21": _N, "F22": _X, "F23": _N, "F24": _X}, True),
    "0.5.13": (StateLayout.PER_COMPONENT, {"F1": _U, "F2": _U, "F3": _U, "F4": _U, "F5": _U, "F6": _L, "F7": _L, "F8": _L, "F9": _L, "F10": _L, "F11": _N, "F12": _L, "F13": _L, "F14": _L, "F15": _L, "F16": _L, "F17": _X, "F18": _L, "F19": _X, "F20": _L, "F21": _N, "F22": _X, "F23": _X, "F24": _X}, True),
    "0.5.13.post1": (StateLayout.PER_COMPONENT, {"F1": _U, "F2": _U, "F3": _U, "F4": _U, "F5": _U, "F6": _L, "F7": _L, "F8": _L, "F9": _L, "F10": _L, "F11": _N, "F12": _L, "F13": _L, "F14": _L, "F15": _L, "F16": _L, "F17": _X, "F18": _L, "F19": _X, "F20": _L, "F21": _N, "F22": _X, "F23": _X, "F24": _X}, True),
    "0.5.14": (StateLayout.PER_COMPONENT, {"F1": _U, "F2": _U, "F3": _U, "F4": _U, "F5": _U, "F6": _L, "F7": _L, "F8": _L, "F9": _L, "F10": _L, "F11": _N, "F12": _L, "F13": _L, "F14": _L, "F15": _L, "F16": _L, "F17": _X, "F18": _L, "F19": _X, "F20": _L, "F21": _N, "F22": _X, "F23": _X, "F24": _X}, True),
    "0.5.15": (StateLayout.PER_COMPONENT, {"F1": _U, "F2": _U, "F3": _U, "F4": _U, "F5": _U, "F6": _L, "F7": _L, "F8": _L, "F9": _L, "F10": _L, "F11": _N, "F12": _L, "F13": _L, "F14": _L, "F15": _L, "F16": _L, "F17": _X, "F18": _L, "F19": _X, "F20": _L, "F21": _N, "F22": _X, "F23": _X, "F24": _X}, True),
    "0.5.15.post1": (StateLayout.PER_COMPONENT, {"F1": _U, "F2": _U, "F3": _U, "F4": _U, "F5": _U, "F6": _L, "F7": _L, "F8": _L, "F9": _L, "F10": _L, "F11": _N, "F12": _L, "F13": _L, "F14": _L, "F15": _L, "F16": _L, "F17": _X, "F18": _L, "F19": _X, "F20": _L, "F21": _N, "F22": _X, "F23": _X, "F24": _X}, True),
    "0.5.16": (StateLayout.PER_COMPONENT, {"F1": _U, "F2": _U, "F3": _U, "F4": _U, "F5": _U, "F6": _L, "F7": _L, "F8": _L, "F9": _L, "F10": _L, "F11": _N, "F12": _L, "F13": _L, "F14": _L, "F15": _L, "F16": _L, "F17": _X, "F18": _L, "F19": _X, "F20": _L, "F21": _N, "F22": _X, "F23": _L, "F24": _X}, True),
    "0.5.17": (StateLayout.PER_COMPONENT, {"F1": _U, "F2": _U, "F3": _U, "F4": _U, "F5": _U, "F6": _L, "F7": _L, "F8": _L, "F9": _L, "F10": _L, "F11": _N, "F12": _L, "F13": _L, "F14": _L, "F15": _L, "F16": _L, "F17": _X, "F18": _L, "F19": _X, "F20": _L, "F21": _N, "F22": _X, "F23": _L, "F24": _X}, True),
    "0.5.18": (StateLayout.PER_COMPONENT, {"F1": _U, "F2": _U, "F3": _U, "F4": _U, "F5": _U, "F6": _L, "F7": _L, "F8": _L, "F9": _L, "F10": _L, "F11": _N, "F12": _L, "F13": _L, "F14": _L, "F15": _L, "F16": _L, "F17": _X, "F18": _L, "F19": _X, "F20": _L, "F21": _N, "F22": _X, "F23": _L, "F24": _X}, True),
    "0.5.19": (StateLayout.PER_COMPONENT, {"F1": _U, "F2": _U, "F3": _U, "F4": _U, "F5": _U, "F6": _L, "F7": _L, "F8": _L, "F9": _L, "F10": _L, "F11": _N, "F12": _L, "F13": _L, "F14": _L, "F15": _L, "F16": _L, "F17": _X, "F18": _L, "F19": _X, "F20": _L, "F21": _X, "F22": _X, "F23": _L, "F24": _X}, True),
    "0.5.20": (StateLayout.PER_COMPONENT, {"F1": _U, "F2": _U, "F3": _U, "F4": _U, "F5": _U, "F6": _L, "F7": _L, "F8": _L, "F9": _L, "F10": _L, "F11": _N, "F12": _L, "F13": _L, "F14": _L, "F15": _L, "F16": _L, "F17": _X, "F18": _L, "F19": _X, "F20": _L, "F21": _X, "F22": _L, "F23": _L, "F24": _L}, True),
    "0.5.21": (StateLayout.PER_COMPONENT, {"F1": _U, "F2": _U, "F3": _U, "F4": _U, "F5": _U, "F6": _L, "F7": _L, "F8": _L, "F9": _L, "F10": _L, "F11": _N, "F12": _L, "F13": _L, "F14": _L, "F15": _L, "F16": _L, "F17": _X, "F18": _L, "F19": _X, "F20": _L, "F21": _L, "F22": _L, "F23": _L, "F24": _L}, True),
    "0.5.22": (StateLayout.PER_COMPONENT, {"F1": _U, "F2": _U, "F3": _U, "F4": _U, "F5": _U, "F6": _L, "F7": _L, "F8": _L, "F9": _L, "F10": _L, "F11": _L, "F12": _L, "F13": _U, "F14": _L, "F15": _L, "F16": _L, "F17": _L, "F18": _L, "F19": _L, "F20": _L, "F21": _L, "F22": _L, "F23": _L, "F24": _L}, True),
    "0.5.23": (StateLayout.PER_COMPONENT, {"F1": _U, "F2": _U, "F3": _U, "F4": _U, "F5": _U, "F6": _L, "F7": _L, "F8": _L, "F9": _L, "F10": _L, "F11": _L, "F12": _L, "F13": _U, "F14": _L, "F15": _L, "F16": _L, "F17": _L, "F18": _L, "F19": _X, "F20": _L, "F21": _L, "F22": _L, "F23": _L, "F24": _L}, True),
}

# Every published release 0.5.10.post1-0.5.23 has its row above, each fact read from its wheel (the
# module docstring); which CI leg proves each live fix where is derived from the recorded probe
# values (ci_matrix, proving_release). F13 (NIXL SWA state across attention TP sizes): stock
# maybe_send_extra raises for non-MLA SWA state whenever the TP sizes differ on every release
# 0.5.13-0.5.21 (0.5.13 nixl/conn.py:1616-1618, 0.5.21 :2674-2676); 0.5.22 added
# _send_swa_state_slice (features().stock_swa_head_slice_backends), so upstream from there; n/a up
# to 0.5.12.x, where F4's classes send SWA state as head slices. F4's decode-replica part reached
# stock NIXL's prepared slice lists only in 0.5.17 (features().stock_nixl_prep_serves_decode_replicas):
# on 0.5.13-0.5.16 F13's class slices those peers' KV itself (F4 stays "upstream" in this table:
# its own classes do not run on 0.5.13+). F15 (NIXL prefill's bootstrap loop has no per-message
# handler): live in every wheel 0.5.10.post1-0.5.23 (0.5.10.post1 nixl/conn.py:850-884 ... 0.5.23
# :3355-3426; 0.5.21+ wrap it in bootstrap_thread_guarded, which logs and re-raises); its family
# follows the loop (ABORT handled from 0.5.16), the stock outcome (sender bootstrap deadline from
# 0.5.18), how decode hears a Failed room (0.5.20) and which plugin class carries it (F4's up to
# 0.5.12.x, F13's, F11's from 0.5.22). F16 (a second live request with a bootstrap room already in
# use): no wheel 0.5.10.post1-0.5.23 refuses it under the default decode allocation policy
# (check_status indexes request_status[room] in every one; 0.5.22 and 0.5.23 refuse a duplicate
# receiver only under the prefill_complete allocation policy, common/conn.py:2500-2507 in 0.5.23, and then fail
# the holder's shared room too): live everywhere. F17 (decode's metadata for a room prefill already
# dropped): every wheel's Mooncake bootstrap thread stores decode's metadata for any room
# (``if room not in self.transfer_infos: self.transfer_infos[room] = {}``, 0.5.10.post1 ... 0.5.23
# mooncake/conn.py:3017), and a sender's bootstrap timeout sets Failed without telling decode
# (0.5.23 common/conn.py:2385-2407): live everywhere. The adapter hooks 0.5.22's
# ``_handle_abort_notification`` (called on every per-room decode message before it is stored) and
# answers through ``send_kv_status_message``; up to 0.5.21 neither exists: live, not covered.
# F18 (a decode whose KV pages are laid out otherwise): every wheel's Mooncake
# ``_send_kvcache_generic`` addresses decode's page as ``dst_ptr + int(decode_index[0]) * item_len``
# with prefill's ``item_len`` (0.5.10.post1 mooncake/conn.py:648 ... 0.5.23 :1189) and no wheel
# compares it with decode's under equal attention TP (0.5.23 checks it only on the unified-memory
# envelope path, ``_validate_envelope_kv_layout``): live everywhere, on the registration hook F6/F9 use.
# F14 (decode's pairing check raises on its scheduler thread): ``try_ensure_parallel_info`` raises
# "Page size mismatch" / "KV cache dtype mismatch" in every wheel (0.5.11 common/conn.py:231-253 ...
# 0.5.23 :1318-1422) and decode's ``_ensure_prefill_info`` calls it with no handler (0.5.11
# decode.py:631, 0.5.23 :1181-1222): live everywhere; covered on every CI release by the harness
# (test_decode_pairing_check.py: the check raises into decode's scheduler, -ext refuses) and on 0.5.23
# through real servers (test_pd_faults.py: stock's decode process exits; 0.5.11's CPU server cannot
# start with the page size > 1 that test gives the second prefill, its paged allocator runs Triton). F19 (a newer prefill's bootstrap answer): every wheel builds
# ``PrefillServerInfo(**data)`` inside the lookup's ``except Exception`` (0.5.10.post1
# common/conn.py:208, 0.5.11 :215, 0.5.23 :1309), so a field its class lacks fails the build each
# second until 15 tries abort the requests (fields added: 0.5.16 enable_dsa_cache_layer_split,
# prefill_http_port; 0.5.21 dsv41_spec_layout and 0.5.23 kv_layout, sent only when set; 0.5.22
# decode_allocation_policy; 0.5.23 enable_kv_cache_sharding): live everywhere (on 0.5.23 for a
# prefill newer than the newest release this plugin knows); covered on 0.5.11, whose decode the
# mixed-release stage pairs with a 0.5.23 prefill (test/mixed).
# F20 (decode's lookup of a prefill's parallel info blocks its scheduler thread): every wheel's lookup
# is ``requests.get(url, timeout=5)`` (0.5.10.post1 common/conn.py:205, 0.5.11 :212, 0.5.12.post1 :223,
# 0.5.22 :1170, 0.5.23 :1306), called from decode's ``_ensure_prefill_info`` on the scheduler thread once a
# second, 15 tries (0.5.10.post1 decode.py:573, 0.5.23 :1200): live everywhere; covered on every CI release
# by the harness (test_prefill_lookup.py: an address that never answers) and on 0.5.23 through real servers.
# F21 (decode gives a failed request's pages back "anyway" at the deferred release timeout): 0.5.22 and
# 0.5.23 ``DecodeTransferQueue.resolve_deferred_releases`` release a device destination at
# ``deadline`` without prefill's drain ack (0.5.23 decode.py:3046-3108, 0.5.22's without the all-reduce
# of the ready flags; ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT``, environ.py:777-778):
# live there, covered on 0.5.23's leg (test_held_pages.py, SGLang's own queue over a real manager's ack
# table) and by hand on 0.5.22. 0.5.21 has the same release "anyway" (decode.py:2806-2860, on by default:
# environ.py:722 ``EnvBool(True)``) from entries of another shape (no hold start: ``(decode_req,
# deadline, idx, acks)``, probe ``deferred_release_entry``) and acks with no generation, whose ABORT send
# re-arms the room's ack table (common/conn.py:2046-2049): live, covered on its own leg (the same test,
# plus the acks kept across a re-sent ABORT). 0.5.19 and 0.5.20 have the release "anyway" too (0.5.19
# decode.py:2405-2435; off by default, environ.py ``EnvBool(False)``), but no wheel of theirs ever arms
# the drain-ack table (``register_deferred_abort_room`` is defined and never called, so
# ``note_abort_ack`` drops every ack): every deferred release there ends at the timeout, acked or not,
# and holding for an ack would hold every aborted request's pages until its prefill restarts. Live, not
# covered (the fix there would arm the table itself). Up to 0.5.18 no wheel has a deferred release
# (decode frees a failed request's pages at once, no drain ack to wait for): n/a.
# F22 (a NIXL transfer worker waits without bound on a batch whose handles stay PROC): 0.5.20-0.5.23
# ``NixlKVManager._await_handles`` ("The wait is unbounded while every handle is still healthy", the same
# method byte for byte in the four wheels; 0.5.23 nixl/conn.py:1096-1133), 0.5.12-0.5.19 the same wait
# written inline in ``transfer_worker`` (``while handles: ... time.sleep(0)``, 0.5.12.post1
# nixl/conn.py:733-739): live; covered on 0.5.20-0.5.23 (the method is one, so the 0.5.23 leg's
# test_nixl_transfer_deadline.py, a real UCX write to a SIGSTOPped peer process, proves the four; by hand
# also on 0.5.20 and 0.5.22), not covered before. Up to 0.5.11 no worker waits (the sender polls its
# handles from the scheduler): n/a.
# F23 (NIXL prefill: a request opens a room decode already ended): stock's ABORT handler ignores a room
# it has no status for (``room_active`` False; 0.5.16 nixl/conn.py:2360-2377 ... 0.5.23 :3317-3335),
# and the sender that opens the room later waits for decode's metadata: out to the bootstrap timeout
# (0.5.18+, probe ``stock_nixl_sender_bootstrap_deadline``), for ever on 0.5.16/0.5.17. Live 0.5.16-0.5.23
# (probe ``nixl_bootstrap_handles_abort``), covered there through that handler and
# ``update_status(room, Bootstrapping)``; 0.5.13-0.5.15.x decode sends the ABORT (common/conn.py
# ``CommonKVReceiver.abort``) to a loop with no handler for it (F13 screens it): live, not covered;
# up to 0.5.12.x decode sends none: n/a.
# F24 (F17 on NIXL: decode's metadata for a room prefill dropped or never admitted): every wheel's NIXL
# bootstrap loop stores decode's metadata for any room (``if room not in self.transfer_infos``, 0.5.10.post1
# ... 0.5.23 nixl/conn.py:3392-3411) and the sender's failure in Bootstrapping tells decode nothing: live
# everywhere. Covered 0.5.20-0.5.23, where the loop offers every message to ``_handle_abort_notification``
# and decode reads a Failed status with its reason (``conclude_failure``/``send_kv_status_message``,
# probe ``nixl_conclude_failure``); before, a NIXL prefill has no message that tells decode a room failed:
# live, not covered.
# A release not in this table claims nothing (policy_for).

_PASS_THROUGH_MIN = Version("0.5.13")
_PASS_THROUGH_END = Version("0.5.24")  # exclusive: 0.5.23.postN is still in
NEWEST_KNOWN = "0.5.23"


def _parse(version: str) -> Optional[Version]:
    try:
        return Version(version)
    except InvalidVersion:
        return None


def base_release(version: str) -> Optional[str]:
    """The table release a post-release not in the table belongs to (same release number, the
    newest such at or below it: 0.5.21.post1 -> 0.5.21, 0.5.13.post2 -> 0.5.13.post1), or None."""
    parsed = _parse(version)
    if parsed is None or version in _ACTIVE_RELEASES:
        return None
    same = [v for v in _ACTIVE_RELEASES if Version(v).release == parsed.release and Version(v) <= parsed]
    return max(same, key=Version) if same else None


def policy_for(version: Optional[str]) -> ReleasePolicy:
    """The policy for an SGLang version string (``None``: SGLang not installed)."""
    if version in _ACTIVE_RELEASES:
        layout, fixes, has_plugins = _ACTIVE_RELEASES[version]
        fixes = dict(fixes)
        if version not in recorded_facts():
            # No probe record: no family, so no CI leg proves this release's code (ci_matrix).
            fixes = {f: (_X if status is _L else status) for f, status in fixes.items()}
        return ReleasePolicy(version, Support.ACTIVE, layout, fixes, has_plugins)
    parsed = None
    if version is not None:
        try:
            parsed = Version(version)
        except InvalidVersion:
            parsed = None
    if parsed is not None and not parsed.is_prerelease and not parsed.is_devrelease:
        if parsed >= _PASS_THROUGH_MIN:
            # A release the table does not list, from 0.5.13 on (a post-release, or newer than
            # every known one): pass-through, so an upgrade of SGLang never stops a server
            # started with an -ext name; nothing is claimed about any fix there (not checked).
            # current_policy() gives a post-release its base release's fixes where the installed
            # code's probe values equal that release's record. A post-release of an *active*
            # release before 0.5.13 stays unsupported.
            return ReleasePolicy(
                version,
                Support.PASS_THROUGH,
                StateLayout.PER_COMPONENT,
                {f: FixStatus.UNCHECKED for f in FIXES},
                True,
                known=False,
            )
    return ReleasePolicy(version, Support.UNSUPPORTED, None, {f: _N for f in FIXES}, False)


def installed_sglang_version() -> Optional[str]:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


_current: Optional[ReleasePolicy] = None


def current_policy() -> ReleasePolicy:
    """Policy of the SGLang installed in this interpreter (cached)."""
    global _current
    if _current is None:
        _current = with_patched_fixes(installed_policy(installed_sglang_version()), patched_fixes())
    return _current


def installed_policy(version: Optional[str]) -> ReleasePolicy:
    """``policy_for(version)``, except for a post-release the table does not list whose installed
    code has the probe values recorded for its base release (``base_release``): that release's
    fixes, proven by the same CI legs. Reads the probes (imports SGLang) only in that case."""
    policy = policy_for(version)
    unproven = not policy.known or not policy.supported  # a post-release of 0.5.10-0.5.12 is unsupported
    base = base_release(version) if version is not None and unproven else None
    if base is None or base not in recorded_facts():
        return policy
    if probe_record(SGLangFeatures()) != recorded_facts()[base]:
        return policy
    return dataclasses.replace(policy_for(base), version=version, same_code_as=base)


# Written by the last patch of each release in patches/ (scripts/apply_patches.py).
PATCH_MARKER_MODULE = "sglang.srt.disaggregation._disagg_ext_patches"


def patched_fixes(sglang_dir: Optional[str] = None) -> Tuple[str, ...]:
    """``APPLIED_FIXES`` of the SGLang sources that ``import sglang`` would load, or ``()``.

    Read from the marker file without importing SGLang (importing it costs
    seconds and must not happen as a side effect of asking for the policy);
    an already imported marker module is used as is. ``sglang_dir`` is the
    ``sglang`` package directory to look in (default: found on ``sys.path``).
    """
    module = sys.modules.get(PATCH_MARKER_MODULE)
    if module is not None and sglang_dir is None:
        fixes, where = getattr(module, "APPLIED_FIXES", ()), module.__name__
    else:
        if sglang_dir is None:
            spec = importlib.util.find_spec("sglang")
            if spec is None or not spec.submodule_search_locations:
                return ()
            sglang_dir = list(spec.submodule_search_locations)[0]
        where = os.path.join(sglang_dir, "srt", "disaggregation", "_disagg_ext_patches.py")
        if not os.path.isfile(where):
            return ()
        fixes = _read_applied_fixes(where)
    if not isinstance(fixes, (tuple, list)):
        raise ValueError(f"{where}: APPLIED_FIXES must be a tuple of fix names, got {fixes!r}")
    unknown = [f for f in fixes if f not in FIXES]
    if unknown:
        raise ValueError(f"{where}: APPLIED_FIXES has unknown fix names {unknown}; known: {FIXES}")
    return tuple(fixes)


def _read_applied_fixes(path: str) -> tuple:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "APPLIED_FIXES" for t in node.targets):
            try:
                return tuple(ast.literal_eval(node.value))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}: APPLIED_FIXES is not a literal tuple of fix names") from e
    raise ValueError(f"{path}: no APPLIED_FIXES assignment")


def with_patched_fixes(policy: ReleasePolicy, fixes) -> ReleasePolicy:
    """``policy`` with each live fix in ``fixes`` marked UPSTREAM and listed in ``patched``.

    Patched sources behave like a release that has the fix: the plugin installs
    nothing for it and stock must pass that fix's differential tests. Only
    live fixes change; a fix that is upstream or n/a here stays as it is.
    """
    changed = tuple(f for f in fixes if policy.fixes.get(f) is FixStatus.LIVE)
    if not changed:
        return policy
    statuses = dict(policy.fixes)
    for f in changed:
        statuses[f] = FixStatus.UPSTREAM
    return dataclasses.replace(policy, fixes=statuses, patched=changed)


# --------------------------------------------------------------------------
# Feature probes of the installed SGLang
# --------------------------------------------------------------------------
#
# Every question the plugin and its self-test ask about the installed SGLang's
# code (does a method exist, which keywords a call takes, whether a stock fix
# is present in the source) is answered here and nowhere else. Each probe
# imports SGLang lazily, only when first asked, and is cached for the process;
# none compares version strings. Stock facts (``stock_*``) describe SGLang's
# own code, whether or not the plugin's hooks are installed.


class SGLangFeatures:
    """The installed SGLang's features, one cached property per probe.

    Obtain the process-wide instance with :func:`features`. Reading a property
    imports the SGLang module it is about (once); constructing the record
    imports nothing.
    """

    # -- server arguments -------------------------------------------------------

    @functools.cached_property
    def server_args_resolution(self) -> str:
        """The ``ServerArgs`` method that runs SGLang's argument checks before the backend name is read.

        ``"__post_init__"`` up to 0.5.12 (dataclass); ``"resolve_once"`` where
        the record is sealed and resolved later (0.5.23; its ``__post_init__``
        is a no-op and, on a msgspec Struct, cannot be rebound).
        """
        from sglang.srt.server_args import ServerArgs

        return "resolve_once" if hasattr(ServerArgs, "resolve_once") else "__post_init__"

    @property
    def server_args_resolve_once(self) -> bool:
        """Whether ``ServerArgs`` must be resolved with ``resolve_once()`` after it is built."""
        return self.server_args_resolution == "resolve_once"

    @functools.cached_property
    def server_args_mooncake_ib_device(self) -> bool:
        """Whether ``ServerArgs`` has a ``mooncake_ib_device`` argument (fallback IB device for Mooncake)."""
        from sglang.srt.server_args import ServerArgs

        return hasattr(ServerArgs, "mooncake_ib_device")

    @functools.cached_property
    def server_args_decode_retraction_backup(self) -> bool:
        """Whether ``ServerArgs`` has ``--disaggregation-decode-retraction-backup`` (0.5.23).

        ``launch-pd --device cpu`` passes ``cpu_tensor`` there: the default backup pins host memory."""
        from sglang.srt.server_args import ServerArgs

        return "disaggregation_decode_retraction_backup" in declared_fields(ServerArgs)

    @functools.cached_property
    def paged_allocator_serves_cpu(self) -> bool:
        """Whether SGLang's paged KV allocator (page size > 1) has a path without Triton.

        0.5.23 falls back to ``alloc_extend_naive``/``alloc_decode_naive`` where Triton cannot run
        (``use_triton_kernels``, ``mem_cache/allocator/paged.py:245``); 0.5.11 launches its Triton
        kernels unconditionally (``mem_cache/allocator.py:429``, ``:469``), so a CPU server there
        serves page size 1 only. The real-server tests choose their page size by it."""
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

        return "use_triton_kernels" in inspect.getsource(PagedTokenToKVPoolAllocator.alloc_extend)

    @functools.cached_property
    def kv_status_codec(self) -> bool:
        """Whether Mooncake's status message goes through SGLang's common codec
        (``parse_kv_status_message`` / ``send_kv_status_message``, common/conn.py,
        0.5.20+), which reads frames by position and ignores trailing ones. Older
        decode loops unpack exactly three frames (0.5.12.post1 mooncake/conn.py)."""
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

        return all(hasattr(MooncakeKVManager, n) for n in ("parse_kv_status_message", "send_kv_status_message"))

    @functools.cached_property
    def mooncake_conclude_failure(self) -> bool:
        """Whether the managers have ``conclude_failure`` (record the reason, set Failed,
        tell every decode rank; 0.5.23 common/conn.py:906). Before, each failure
        path does those three steps itself (0.5.11 mooncake/conn.py:1188-1199)."""
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

        return hasattr(MooncakeKVManager, "conclude_failure")

    @functools.cached_property
    def mooncake_send_probe(self) -> bool:
        """Whether the Mooncake manager probes a failed session itself (``_send_probe``,
        0.5.23 mooncake/conn.py:3147, with a probe loop that lifts the mark). Before,
        a session marked failed stays marked until decode registers again (0.5.11
        :1407-1410), and SGLang's engine wrapper has no ``send_probe``."""
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

        return hasattr(MooncakeKVManager, "_send_probe")

    @functools.cached_property
    def stock_mooncake_checks_state_send(self) -> bool:
        """Whether stock ``transfer_worker`` acts on ``maybe_send_extra``'s result (0.5.23
        mooncake/conn.py:2761-2770: a failed state send fails the room). Up to
        0.5.12.x it is ignored (0.5.12.post1 :1343-1351): a state page the engine
        could not write still ends in Success on both sides."""
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

        return "= self.maybe_send_extra(" in inspect.getsource(stock_callable(MooncakeKVManager, "transfer_worker"))

    @functools.cached_property
    def mooncake_aux_count_check(self) -> bool:
        """Whether prefill checks a decode's metadata buffer count at registration
        (``check_peer_aux_buffer_count``, 0.5.23 common/conn.py:617-634, called by
        ``_publish_peer_registration``; it only logs a difference). Up to 0.5.22 no
        release compares anything there, and ``send_aux`` indexes prefill's row
        sizes with decode's buffer list (0.5.22 mooncake/conn.py:1755-1759)."""
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

        return hasattr(MooncakeKVManager, "check_peer_aux_buffer_count")

    @functools.cached_property
    def mooncake_registration_hooks(self) -> bool:
        """Whether Mooncake's decode registration and prefill's receive loop have manager
        hooks (``build_receiver_registration_message``, common/conn.py:636, sent by
        ``CommonKVReceiver._register_kv_args``; ``_make_worker_recv``, :1110, read by
        ``start_prefill_thread``; 0.5.23). Without them (0.5.10.post1-0.5.12.x) the
        receiver builds the message itself and sends it through
        ``_connect_to_bootstrap_server`` (0.5.11 mooncake/conn.py:1756-1817), and the
        prefill bootstrap thread reads ``self.server_socket.recv_multipart()`` directly
        (:1355); ``KVArgsRegisterInfo.from_zmq`` reads fixed positions up to the
        staging fields (:137-164) and never a trailing frame."""
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

        return all(hasattr(MooncakeKVManager, n) for n in ("build_receiver_registration_message", "_make_worker_recv"))

    @functools.cached_property
    def mori_status_codec(self) -> bool:
        """Whether MoRI concludes a room through SGLang's common status codec: prefill's
        ``conclude_transfer`` -> ``send_kv_status_message``, decode's worker ->
        ``parse_kv_status_message`` (0.5.20+, 0.5.23 mori/conn.py:658, :1022). Up to 0.5.19
        MoRI builds and reads its own status message (``notify_decode_status``)."""
        # Read, not imported: MoRI's module imports its engine at the top.
        text = _stock_disaggregation_source("mori/conn.py")
        called = {node.attr for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Attribute)} if text else set()
        return {"conclude_transfer", "parse_kv_status_message"} <= called

    @functools.cached_property
    def mori_unique_prefill_rank(self) -> bool:
        """Whether MoRI's status message names the prefill rank by
        ``_compute_prefill_unique_rank()`` (TP, PP and CP ranks) and goes out on the
        thread-local ``_connect_threadsafe`` socket (0.5.12.post1 mori/conn.py:530, :421, :553;
        0.5.19 :862). 0.5.10.post1-0.5.11 send ``attn_tp_rank * pp_size + pp_rank`` on the
        manager's ``_connect`` socket (0.5.11 mori/conn.py:411, :417). Read by
        ``backends/mori/verify``, which sends that message itself where it adds the digest."""
        return (_stock_method_ast("mori/conn.py", "MoriKVManager", "_compute_prefill_unique_rank") is not None
                and _stock_method_ast("mori/conn.py", "MoriKVManager", "_connect_threadsafe") is not None)

    @functools.cached_property
    def nixl_refuses_dsv4_state(self) -> bool:
        """Whether stock NIXL's state send has no DSv4 branch and so raises for a DSv4 state
        component ("PD Disaggregation via NIXL does NOT support {type} hybrid models yet"),
        failing the room on stock and ``nixl-ext`` alike: up to 0.5.12.x it dispatches mamba,
        swa and nsa only (0.5.11 nixl/conn.py:885-889, 0.5.12.post1 :1564-1567); 0.5.23 sends
        ``StateType.DSV4_REQUEST_STATE`` with the paged kinds (:3190)."""
        return "dsv4" not in _stock_disaggregation_source("nixl/conn.py").lower()

    @functools.cached_property
    def nixl_empty_transfer_is_dummy(self) -> bool:
        """Whether stock NIXL's ``TransferInfo.is_dummy`` takes a transfer with no decode KV
        pages (and no decode prefix) for a CP rank's dummy, so prefill sends nothing for it
        (0.5.11 nixl/conn.py:50-56, 0.5.16 :160-167); 0.5.23 has no such rule."""
        return "def is_dummy(" in _stock_disaggregation_source("nixl/conn.py")

    @functools.cached_property
    def nixl_empty_state_lists_wait(self) -> bool:
        """Whether a NIXL decode given per-component state lists that are all empty waits for
        a state notification prefill never sends: the receiver marks ``expects_state`` when its
        ``state_indices`` list is non-empty (a list of empty lists is; 0.5.19 nixl/conn.py:2980,
        0.5.20 :3235), prefill's ``maybe_send_extra`` skips empty components, and ``is_done``
        waits for the state notification, so the room waits out decode's timeout. SGLang
        lists at least one window page for a request with tokens. 0.5.23 concludes from the
        status message (:attr:`nixl_success_via_listener_only`)."""
        return "expects_state" in _stock_disaggregation_source("nixl/conn.py") and not self.nixl_success_via_listener_only

    @functools.cached_property
    def nixl_success_via_notifications_only(self) -> bool:
        """Whether a NIXL decode learns a room's Success only from NIXL notifications:
        ``NixlKVReceiver.poll`` concludes through ``check_transfer_done``, and NIXL's prefill
        never sends a Success status message. Up to 0.5.19 the manager has no status message
        at all (no ``send_kv_status_message``: SGLang's common status codec is 0.5.20+);
        0.5.20-0.5.22 have the codec, but ``nixl/conn.py`` sends only failures through it
        (``conclude_failure``, 0.5.20 :1481): its transfer worker sets Success on prefill alone
        (``update_status(room, KVPoll.Success)``, 0.5.20 :1438) and never calls the codec's
        Success path (``conclude_transfer``, which Mooncake and MoRI call) nor
        ``send_kv_status_message`` itself. 0.5.23 concludes from the message only
        (:attr:`nixl_success_via_listener_only`: its worker calls ``conclude_transfer``)."""
        from sglang.srt.disaggregation.nixl.conn import NixlKVManager

        if self.nixl_success_via_listener_only:
            return False
        if not hasattr(NixlKVManager, "send_kv_status_message"):
            return True
        source = _stock_disaggregation_source("nixl/conn.py")
        return bool(source) and "conclude_transfer(" not in source and "send_kv_status_message(" not in source

    @functools.cached_property
    def nixl_success_via_listener_only(self) -> bool:
        """Whether a NIXL decode learns a room's Success only from prefill's ``KV_STATUS``
        message on its listener thread (0.5.23: ``NixlKVReceiver.poll`` reads
        ``check_status`` alone, nixl/conn.py). Up to 0.5.22 ``poll`` also drains NIXL
        notifications and concludes Success itself (``check_transfer_done``, 0.5.22
        nixl/conn.py:3496-3520), so a dead listener loses only prefill's Failed messages."""
        from sglang.srt.disaggregation.nixl.conn import NixlKVReceiver

        return "check_transfer_done" not in inspect.getsource(stock_callable(NixlKVReceiver, "poll"))

    @functools.cached_property
    def mori_registration_hook(self) -> bool:
        """Whether MoRI's decode registration message is built by the manager hook
        ``build_receiver_registration_message`` (0.5.23 mori/conn.py:2076, sent by
        ``CommonKVReceiver._register_kv_args``). On 0.5.22 ``MoriKVReceiver._register_kv_args``
        builds and sends it itself (mori/conn.py:2165-2217)."""
        from sglang.srt.disaggregation.mori.conn import MoriKVManager

        return hasattr(MoriKVManager, "build_receiver_registration_message")

    @functools.cached_property
    def dcp_relayout_check(self) -> bool:
        """Whether the common KV manager has ``requires_dcp_relayout(dst_dcp_size, dst_dcp_rank)``
        (0.5.19 onwards, common/conn.py; 0.5.21 :336): where it says a decode context-parallel
        relayout is needed, stock sends whole pages, not head slices. Absent up to 0.5.18."""
        return _stock_method_ast("common/conn.py", "CommonKVManager", "requires_dcp_relayout") is not None

    @functools.cached_property
    def nixl_bootstrap_handles_abort(self) -> bool:
        """Whether NIXL prefill's bootstrap loop handles decode's ``ABORT`` message
        (``NixlKVManager._handle_abort_notification``, 0.5.16 nixl/conn.py:2350, called
        at :2413). Up to 0.5.15 it does not: the loop asserts that every message starts
        with its guard (0.5.13 nixl/conn.py:1849-1851, "Foreign traffic?"), while
        decode's ``CommonKVReceiver.abort`` sends ``[b"ABORT", room, ip, port]`` to that
        socket (0.5.13 common/conn.py:1114-1126): one aborted request ends the
        thread."""
        return _stock_method_ast("nixl/conn.py", "NixlKVManager", "_handle_abort_notification") is not None

    @functools.cached_property
    def mori_sender_notifies_status(self) -> bool:
        """Whether MoRI's prefill tells decode a room's status through
        ``MoriKVManager.notify_decode_status`` (0.5.10.post1 mori/conn.py:398, 0.5.16 :647,
        0.5.19 :849), after the room's metadata rows went out through stock's
        ``send_aux_tcp``: through the sender (its ``poll`` up to 0.5.12.x, ``_run_chunk`` on a
        transfer worker on 0.5.13-0.5.18) or, on 0.5.19, the transfer worker's
        ``_notify_decode_for_room``. There is no ``conclude_failure`` there.
        From 0.5.20 transfer workers conclude rooms through the common
        ``conclude_transfer`` / ``conclude_failure`` instead, and the method is gone."""
        return _stock_method_ast("mori/conn.py", "MoriKVManager", "notify_decode_status") is not None

    @functools.cached_property
    def mori_conclude_room_failure(self) -> bool:
        """Whether MoRI's prefill manager has ``_conclude_room_failure`` (0.5.19 mori/conn.py:567):
        there transfer workers send the room's status (``_notify_decode_for_room``) and the
        sender's ``poll`` only reads it, so a failure must be concluded through it to reach
        decode; 0.5.10.post1-0.5.18 send it from the sender's poll (``_finalize_failure``)."""
        return _stock_method_ast("mori/conn.py", "MoriKVManager", "_conclude_room_failure") is not None

    @functools.cached_property
    def mori_registration_frames(self) -> int:
        """How many frames follow MoRI's guard in a stock decode registration, as the
        prefill's ``KVArgsRegisterInfo.from_zmq`` reads them (the highest constant
        index into its payload, plus one; the room field "None" is frame 0): 11 on
        0.5.10.post1/0.5.11 (payload[1..10]), 13 on 0.5.12.post1-0.5.21 (reads
        payload[1..12]), 17 on 0.5.22 and 0.5.23. A
        frame after those is never parsed by a stock prefill."""
        # Read, not imported: MoRI's module imports its engine at the top.
        func = _stock_method_ast("mori/conn.py", "KVArgsRegisterInfo", "from_zmq")
        payload = [a.arg for a in func.args.args if a.arg not in ("cls", "self")][0]
        indices = [
            node.slice.value
            for node in ast.walk(func)
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == payload
            and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int)
        ]
        return max(indices) + 1

    # -- process setup ------------------------------------------------------------

    @functools.cached_property
    def runtime_context(self) -> bool:
        """Whether ``sglang.srt.runtime_context`` exists (0.5.2x: ranks published before process groups)."""
        try:
            import sglang.srt.runtime_context  # noqa: F401
        except ImportError:
            return False
        return True

    @functools.cached_property
    def runtime_context_publish(self) -> bool:
        """Whether ``runtime_context.publish`` exists (0.5.17+: the scheduler publishes its
        config through it). 0.5.14-0.5.16 have a ``runtime_context`` without it: their
        scheduler still calls ``set_global_server_args_for_scheduler`` (a shim onto
        ``get_context().set_server_args`` from 0.5.15)."""
        if not self.runtime_context:
            return False
        from sglang.srt import runtime_context

        return hasattr(runtime_context, "publish")

    @functools.cached_property
    def runtime_context_spawn_ranks(self) -> bool:
        """Whether ``runtime_context.publish`` takes the process's ranks (``spawn_world_rank``, 0.5.23).

        Releases with a ``runtime_context`` but without it (0.5.18) publish the
        config only and take the widths from ``initialize_model_parallel``'s arguments.
        """
        from sglang.srt import runtime_context

        return hasattr(runtime_context, "spawn_world_rank")

    @functools.cached_property
    def metadata_buffers_sampling_mask(self) -> bool:
        """Whether ``MetadataBuffers(...)`` takes ``max_sampling_mask_tokens`` (0.5.13+)."""
        from sglang.srt.disaggregation.utils import MetadataBuffers

        return "max_sampling_mask_tokens" in init_parameters(MetadataBuffers)

    @functools.cached_property
    def metadata_buffers_kv_checksum(self) -> bool:
        """Whether ``MetadataBuffers(...)`` takes ``kv_checksum_enabled`` (0.5.21+: one more
        metadata buffer, the last, what ``--disaggregation-enable-kv-checksum`` gives)."""
        from sglang.srt.disaggregation.utils import MetadataBuffers

        return "kv_checksum_enabled" in init_parameters(MetadataBuffers)

    @functools.cached_property
    def decode_status_handler(self) -> bool:
        """Whether decode handles prefill's status message in a manager method,
        ``apply_prefill_status`` (common/conn.py, 0.5.20+); before, inline in the
        Mooncake ``decode_thread`` socket loop (0.5.13 mooncake/conn.py:1511-1537)."""
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

        return hasattr(MooncakeKVManager, "apply_prefill_status")

    @functools.cached_property
    def decode_queue_release_request(self) -> bool:
        """Whether decode's ``DecodeTransferQueue`` frees a request's KV pages through
        its own ``_release_request`` (0.5.22+); before, it calls the decode module's
        ``release_kv_cache`` by name (0.5.13 decode.py:1643)."""
        from sglang.srt.disaggregation.decode import DecodeTransferQueue

        return hasattr(DecodeTransferQueue, "_release_request")

    @functools.cached_property
    def deferred_release_entry(self) -> Optional[str]:
        """What decode's ``DecodeTransferQueue._defer_release`` holds a failed request's pages as
        (what F21's hook rewrites): None where the queue has no deferred release (up to 0.5.18);
        ``"deadline"`` for ``(decode_req, deadline, metadata_idx, required_acks)`` (0.5.19-0.5.21);
        ``"held_since"`` for ``(decode_req, held_since, deadline, metadata_idx, required_acks)``
        (0.5.22+). Read by calling stock's method on a queue made without ``__init__`` and one
        device-destination request, and reading back the entry it appends."""
        import types

        from sglang.srt.disaggregation.decode import DecodeTransferQueue

        if not hasattr(DecodeTransferQueue, "_defer_release"):
            return None
        queue = object.__new__(DecodeTransferQueue)
        queue._deferred_releases = []
        queue.deferred_kv_release_timeout = 30.0
        queue.enable_host_receive = False
        receiver = types.SimpleNamespace(bootstrap_infos=[{}], abort_notified=True)
        decode_req = types.SimpleNamespace(kv_receiver=receiver, host_staged=False, metadata_buffer_index=7,
                                           req=types.SimpleNamespace(bootstrap_room=1))
        queue._defer_release(decode_req)
        (entry,) = queue._deferred_releases
        shapes = {4: "deadline", 5: "held_since"}
        if len(entry) not in shapes or entry[0] is not decode_req or entry[-2:] != (7, 1):
            raise ValueError(f"unknown deferred-release entry of {len(entry)} fields")
        return shapes[len(entry)]

    @functools.cached_property
    def metadata_gate_function(self) -> bool:
        """Whether decode gates a Success on its metadata row in ``utils._apply_metadata_gate``,
        before the polls' all-reduce (0.5.13+, 0.5.13 utils.py:78). Up to 0.5.12.x the
        same test runs in ``DecodeTransferQueue._commit_transfer_to_req``, after it
        (0.5.12.post1 decode.py:1412-1415)."""
        from sglang.srt.disaggregation import utils as dutils

        return hasattr(dutils, "_apply_metadata_gate")

    @functools.cached_property
    def metadata_gate_needs_server_args(self) -> bool:
        """Whether decode's metadata gate runs only when ``poll_and_all_reduce`` gets
        ``server_args`` (0.5.13-0.5.18: the gate's fake-transfer check reads the backend
        name from it; 0.5.19+ take no ``server_args`` and gate on ``decode_reqs`` and
        ``metadata_buffers`` alone)."""
        from sglang.srt.disaggregation import utils as dutils

        # Read on the caller, which nothing replaces (F10 replaces the gate function itself).
        caller = getattr(dutils, "poll_and_all_reduce", None)
        return (hasattr(dutils, "_apply_metadata_gate") and caller is not None
                and "server_args" in inspect.signature(caller).parameters)

    @functools.cached_property
    def pd_kv_layout(self) -> bool:
        """Whether ``disaggregation.utils.get_pd_kv_layout`` exists."""
        from sglang.srt.disaggregation import utils as dutils

        return hasattr(dutils, "get_pd_kv_layout")

    @functools.cached_property
    def kv_transfer_buf_infos(self) -> bool:
        """Whether ``disaggregation.utils.get_kv_transfer_buf_infos`` exists (else ``pool.get_contiguous_buf_infos``)."""
        from sglang.srt.disaggregation import utils as dutils

        return hasattr(dutils, "get_kv_transfer_buf_infos")

    @functools.cached_property
    def build_kv_layer_ids(self) -> bool:
        """Whether ``disaggregation.utils.build_kv_layer_ids`` exists."""
        from sglang.srt.disaggregation import utils as dutils

        return hasattr(dutils, "build_kv_layer_ids")

    # -- NIXL (F4): read from the installed nixl/conn.py source text ----------------

    @functools.cached_property
    def stock_nixl_slice_uses_total_heads(self) -> bool:
        """Whether stock ``send_kvcache_slice`` reads ``total_kv_head_num``.

        0.5.10.post1 uses the per-rank count instead, so a head replicated over
        decode ranks gives 0 heads per decode rank and a ZeroDivisionError
        (0.5.10.post1 nixl/conn.py:484, :489). True when the method is absent.
        """
        text = _stock_nixl_slice_source()
        return not text or "total_kv_head_num" in text

    @functools.cached_property
    def stock_nixl_slice_maps_decode_replicas_by_modulo(self) -> bool:
        """Whether stock picks a decode rank's heads as ``(rank * heads per decode rank) % heads per prefill rank``.

        Right while each decode rank holds distinct heads, wrong once a prefill
        rank holding several heads serves decode ranks that replicate them
        (0.5.11 nixl/conn.py:554-556, 0.5.12.post1 :1002-1004). Upstream later
        maps replicas by integer division (0.5.23 ``dst_replication``).
        """
        return "%src_heads_per_rank" in "".join(_stock_nixl_slice_source().split())

    @functools.cached_property
    def stock_nixl_kv_tag_sender_field(self) -> Optional[str]:
        """The ``kv_args`` field stock puts last in its KV notification tag, e.g. ``"pp_rank"``.

        ``<room>_kv_<chunk>_<last>_<field>``: 0.5.10.post1 (nixl/conn.py:751)
        and 0.5.11 (:923) use ``pp_rank``, so every TP rank of a prefill stage
        sends the same key and a decode rank fed by several of them never
        completes; 0.5.12.x uses ``engine_rank`` (0.5.12.post1 :661-662).
        ``None`` if the tag is not found where expected.
        """
        import itertools
        import re

        text = _stock_nixl_conn_source()
        for match in re.finditer(r"_kv_\{", text):
            # The tag may be one f-string or several adjacent ones on following lines.
            lines = text[match.start() :].split("\n")
            tag = [lines[0]] + [ln for ln in itertools.takewhile(lambda ln: ln.lstrip().startswith('f"'), lines[1:])]
            field = re.search(r"\{self\.kv_args\.(\w+)\}", "\n".join(tag))
            if field:
                return field.group(1)
        return None

    @functools.cached_property
    def stock_swa_head_slice_backends(self) -> frozenset:
        """Stock backends (of "mooncake", "nixl") that send SWA state across different attention TP sizes.

        Read from each installed ``disaggregation/<backend>/conn.py`` (imports
        nothing): a backend is in the set when its manager defines
        ``_send_swa_state_slice`` (0.5.23 mooncake/conn.py:2435, nixl/conn.py:2969,
        head slices of the window cache, as for KV). Up to 0.5.12.x neither
        does: each raises "PD Disaggregation does NOT support PD different TP
        sizes for non-MLA SWA hybrid models yet." per request at transfer time
        (0.5.12.post1 mooncake/conn.py:1051, nixl/conn.py:1546).
        """
        return frozenset(
            backend for backend in ("mooncake", "nixl")
            if "def _send_swa_state_slice(" in _stock_disaggregation_source(f"{backend}/conn.py")
        )

    @functools.cached_property
    def stock_nixl_prep_serves_decode_replicas(self) -> bool:
        """Whether stock NIXL's prepared head-slice lists serve a decode that replicates KV heads
        (decode TP size above the model's KV heads; read from the installed
        ``disaggregation/nixl/conn.py``, imports nothing). ``_init_hetero_tp_prep_handle`` lays out
        one group per *unique* head slice from 0.5.17 (``dst_replication``, 0.5.17 nixl/conn.py:842);
        up to 0.5.16 one per decode rank with heads picked by modulo (0.5.16 :771-776), which
        addresses past the registered KV region (``NIXL_ERR_NOT_FOUND`` on the bootstrap thread).
        True where the method is absent (nothing prepared: 0.5.10.post1-0.5.12.x)."""
        fn = _stock_method_ast("nixl/conn.py", "NixlKVManager", "_init_hetero_tp_prep_handle")
        return fn is None or any(isinstance(n, ast.Name) and n.id == "dst_replication" for n in ast.walk(fn))

    @functools.cached_property
    def nixl_is_dummy_method(self) -> bool:
        """Whether NIXL's ``TransferInfo.is_dummy`` is a method (up to 0.5.19: 0.5.13
        nixl/conn.py:76, 0.5.19 :171, which also reads ``is_dummy_rank``); from 0.5.20 it
        is a dataclass field (0.5.20 :175, 0.5.23 :297)."""
        from sglang.srt.disaggregation.nixl.conn import TransferInfo

        return callable(getattr(TransferInfo, "is_dummy", None))

    @functools.cached_property
    def stock_nixl_sender_bootstrap_deadline(self) -> bool:
        """Whether stock ``NixlKVSender.poll`` ends a room stuck in Bootstrapping by SGLang's
        bootstrap timeout (``_check_bootstrap_timeout``: 0.5.18-0.5.22 in NIXL's own ``poll``,
        0.5.19 nixl/conn.py:2819-2823; 0.5.23 in the inherited common ``_poll_with_status``,
        common/conn.py:2368-2371). Up to 0.5.17 NIXL's ``poll`` returns the manager's status
        as it is: a room whose decode infos never complete on prefill stays Bootstrapping."""
        from sglang.srt.disaggregation.nixl.conn import NixlKVSender

        sources = []
        for name in ("poll", "_poll_with_status"):
            if any(name in klass.__dict__ for klass in NixlKVSender.__mro__):
                sources.append(inspect.getsource(stock_callable(NixlKVSender, name)))
        return any("_check_bootstrap_timeout" in src for src in sources)

    @functools.cached_property
    def nixl_conclude_failure(self) -> bool:
        """Whether the NIXL manager has ``conclude_failure`` (record the reason, set Failed,
        send Failed with the reason to every decode rank of the room; common/conn.py, 0.5.20+).
        Before, a NIXL prefill has no message that tells decode a room failed: decode ends
        it by its waiting timeout."""
        from sglang.srt.disaggregation.nixl.conn import NixlKVManager

        return hasattr(NixlKVManager, "conclude_failure")

    @functools.cached_property
    def stock_nixl_worker_tells_decode(self) -> bool:
        """Whether stock NIXL's ``transfer_worker`` tells decode when a room fails in it (read from
        the installed ``disaggregation/nixl/conn.py``, imports nothing): it calls
        ``conclude_failure`` from 0.5.20 (nixl/conn.py:1481); up to 0.5.19 it only records the
        failure on prefill, and decode ends such a room by its waiting timeout."""
        fn = _stock_method_ast("nixl/conn.py", "NixlKVManager", "transfer_worker")
        return fn is not None and any(
            isinstance(node, ast.Attribute) and node.attr == "conclude_failure" for node in ast.walk(fn)
        )

    @functools.cached_property
    def stock_nixl_sender_poll_raises(self) -> bool:
        """Whether stock ``NixlKVSender.poll`` itself raises (read from the installed
        ``disaggregation/nixl/conn.py``, imports nothing).

        0.5.10.post1 and 0.5.11 poll every transfer handle in the sender and raise
        ``Exception("KVSender transfer encountered an error.")`` on an ERR handle
        (0.5.11 nixl/conn.py:1153), into the scheduler's ``poll_and_all_reduce``;
        0.5.12.x hands the handles to ``transfer_worker``, which fails the room."""
        fn = _stock_method_ast("nixl/conn.py", "NixlKVSender", "poll")
        if fn is not None:
            return any(isinstance(node, ast.Raise) for node in ast.walk(fn))
        return False

    # -- F5: the shape of the stock retract/resume code ------------------------------

    @functools.cached_property
    def nsa_pool(self) -> bool:
        """Whether ``mem_cache.memory_pool.NSATokenToKVPool`` exists."""
        return nsa_pool_class() is not None

    @functools.cached_property
    def stock_f5(self) -> "StockF5Facts":
        """Facts about stock F5 code (:func:`read_stock_f5`, cached)."""
        return read_stock_f5()


@dataclasses.dataclass(frozen=True)
class StockF5Facts:
    """The installed release's stock F5 code (see ``backends/common/retract.py``)."""

    nsa_pool: bool  # NSATokenToKVPool exists
    nsa_offloads_index_k: bool  # it defines its own get_cpu_copy (upstream's fix), not MLA's
    nsa_offload_takes_mamba_indices: bool  # ... which accepts the allocator's mamba_indices= keyword
    allocator_passes_mamba_indices: bool  # PagedTokenToKVPoolAllocator.get_cpu_copy has that keyword
    nsa_clear_releases_index_k: bool  # its own _clear_buffers deletes index_k_with_scale_buffer
    get_buf_copies: bool  # MetadataBuffers.get_buf clones its fields


_features: Optional[SGLangFeatures] = None


def features() -> SGLangFeatures:
    """The installed SGLang's feature probes (one cached record per process)."""
    global _features
    if _features is None:
        _features = SGLangFeatures()
    return _features


@functools.lru_cache(maxsize=None)
def init_parameters(cls) -> frozenset:
    """Names of the parameters ``cls(...)`` takes (its ``__init__``'s, ``self`` included)."""
    return frozenset(inspect.signature(cls.__init__).parameters)


def accepts_keyword(fn, name: str) -> bool:
    """Whether ``fn`` takes keyword ``name`` (by name or through ``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


@functools.lru_cache(maxsize=None)
def declared_fields(cls) -> frozenset:
    """Fields ``cls`` and its bases declare (annotations), e.g. which ``KVArgs`` fields a release has."""
    names = set()
    for klass in cls.__mro__:
        names.update(getattr(klass, "__annotations__", {}))
    return frozenset(names)


def stock_prefill_info_lookup():
    """``(CommonKVManager.try_ensure_parallel_info, PrefillServerInfo)``: decode's lookup of a
    prefill's parallel info and the class it builds the bootstrap answer into by that global name
    (F19 runs the lookup with the name bound to its reader). None where either is missing or the
    lookup does not name the class. Every table release has both (common/conn.py)."""
    from sglang.srt.disaggregation.common import conn

    lookup = getattr(conn.CommonKVManager, "try_ensure_parallel_info", None)
    info_class = getattr(conn, "PrefillServerInfo", None)
    if lookup is None or info_class is None or "PrefillServerInfo" not in lookup.__code__.co_names:
        return None
    return lookup, info_class


def prefill_takes_abort() -> bool:
    """Whether this release's prefills end a room on decode's ``ABORT`` message and announce it by
    the bootstrap answer's ``decode_allocation_policy`` field (``core.prefill_notice``): both come
    with 0.5.22 (``common/conn.py`` ``ABORT_TAG``, ``PrefillServerInfo.decode_allocation_policy``)."""
    from sglang.srt.disaggregation.common import conn

    from sglang_disagg_ext.core.prefill_notice import TAKES_ABORT_FIELD

    info_class = getattr(conn, "PrefillServerInfo", None)
    return (getattr(conn, "ABORT_TAG", None) == b"ABORT" and info_class is not None
            and TAKES_ABORT_FIELD in declared_fields(info_class))


def read_stock_f5() -> StockF5Facts:
    """Read :class:`StockF5Facts` from SGLang's own methods and their source (not cached).

    Reads the stock methods (``backends.common.retract.stock_callable``), so the
    answer is the same whether or not the plugin's F5 hooks are installed.
    """
    from sglang.srt.disaggregation.utils import MetadataBuffers
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    copies = ".clone()" in inspect.getsource(stock_callable(MetadataBuffers, "get_buf"))
    passes = accepts_keyword(PagedTokenToKVPoolAllocator.get_cpu_copy, "mamba_indices")
    nsa = nsa_pool_class()
    if nsa is None:
        return StockF5Facts(False, False, False, passes, False, copies)
    offload = stock_callable(nsa, "get_cpu_copy")
    clear = stock_callable(nsa, "_clear_buffers")
    return StockF5Facts(
        nsa_pool=True,
        nsa_offloads_index_k=_defined_on(offload, nsa),
        nsa_offload_takes_mamba_indices=accepts_keyword(offload, "mamba_indices"),
        allocator_passes_mamba_indices=passes,
        nsa_clear_releases_index_k=_defined_on(clear, nsa) and "index_k_with_scale_buffer" in inspect.getsource(clear),
        get_buf_copies=copies,
    )


def stock_bootstrap_reads_notices(cls: type) -> bool:
    """Whether a decode of manager class ``cls`` can send prefill a notice that prefill's
    bootstrap loop takes: SGLang's own part of ``cls`` offers every decode message to
    ``_handle_abort_notification`` first, which returns True for a message it consumed (NIXL
    0.5.16+ nixl/conn.py, 0.5.16 :2413, 0.5.23 :3376; Mooncake 0.5.22+, 0.5.23
    mooncake/conn.py:2976), and has the cached PUSH sockets a decode sends it on
    (``_send_multipart_locked``, common/conn.py from 0.5.19). The plugin's verified transfers
    take their decode's mismatch notice there; a class of the plugin defining either does
    not count."""
    stock = [klass for klass in cls.__mro__ if klass.__module__.startswith("sglang.")]
    return (any("_handle_abort_notification" in vars(klass) for klass in stock)
            and any("_send_multipart_locked" in vars(klass) for klass in stock))


def _sglang_config(bag: str, name: str):
    """``name`` from SGLang's runtime configuration bag ``bag`` (``get_serving()``,
    ``get_observability()`` of ``sglang.srt.runtime_context``), where the release has one and
    the process has set it up; None otherwise. On 0.5.23 SGLang's own metric labels read the
    resolved values there (metrics_collector.py:1383, 1393): ``server_args.served_model_name``
    stays None when SGLang resolved it from the model path."""
    try:
        from sglang.srt import runtime_context

        return getattr(getattr(runtime_context, f"get_{bag}")(), name, None)
    except Exception:  # noqa: BLE001 - no such module or bag here, or not set up in this process
        return None


def sglang_metric_labels(manager) -> Dict[str, str]:
    """The labels SGLang puts on its own scheduler series, as far as a KV manager holds them, so
    the plugin's series on the same ``/metrics`` join with SGLang's (the same values, by name).

    SGLang's scheduler labels (0.5.11 observability/scheduler_metrics_mixin.py:133-145, 0.5.23
    observability/metrics_collector.py:1383-1394): ``model_name`` (``served_model_name``),
    ``engine_type`` (``prefill``/``decode``; ``unified`` is never a manager's), ``tp_rank``,
    ``pp_rank``, ``dp_rank`` where SGLang has one, then ``--extra-metric-labels``. Every
    CI release's manager holds them the same way: ``server_args`` and ``disaggregation_mode`` on
    the manager, ``kv_args.engine_rank`` (= the scheduler's ``tp_rank``), ``kv_args.pp_rank``
    and ``kv_args.system_dp_rank`` (prefill.py/decode.py set them; 0.5.11 prefill.py:145-147,
    0.5.23 :260-262). ``moe_ep_rank`` is not on a manager and is left out; so is
    ``engine_type="dynamic"`` (``--enable-pd-role-switch``), which the plugin does not route.
    A value the manager lacks is left out, never guessed."""
    labels: Dict[str, str] = {}
    server_args = getattr(manager, "server_args", None)
    kv_args = getattr(manager, "kv_args", None)
    model = _sglang_config("serving", "served_model_name") or getattr(server_args, "served_model_name", None)
    if model:
        labels["model_name"] = str(model)
    mode = getattr(getattr(manager, "disaggregation_mode", None), "value", None)
    if mode in ("prefill", "decode"):
        labels["engine_type"] = mode
    for label, attr in (("tp_rank", "engine_rank"), ("pp_rank", "pp_rank"), ("dp_rank", "system_dp_rank")):
        value = getattr(kv_args, attr, None)
        if isinstance(value, int):
            labels[label] = str(value)
    extra = _sglang_config("observability", "extra_metric_labels") or getattr(server_args, "extra_metric_labels", None)
    if isinstance(extra, dict):
        labels.update({str(k): str(v) for k, v in extra.items()})
    return labels


def stock_callable(cls: type, name: str):
    """SGLang's own ``cls.name``, whether or not the plugin's F5 hooks are installed.

    The hooks can only be in place once ``backends.common.retract`` has been imported,
    so it is looked up in ``sys.modules`` rather than imported (no import edge
    from this module to the backends).
    """
    retract = sys.modules.get("sglang_disagg_ext.backends.common.retract")
    if retract is not None:
        return retract.stock_callable(cls, name)
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    raise AttributeError(f"{cls.__name__}.{name}")


def class_defines(cls: type, name: str) -> bool:
    """Whether SGLang's class ``cls`` (or a base) defines ``name``. Some schedulers call a
    per-request method only where it exists (0.5.11 prefill: ``clear`` under ``hasattr``;
    NIXL's sender has none there), so an override must not call a ``super()`` that is absent."""
    return any(name in klass.__dict__ for klass in cls.__mro__)


def nsa_pool_class() -> Optional[type]:
    """SGLang's ``NSATokenToKVPool`` class, or ``None`` where the release has none."""
    from sglang.srt.mem_cache import memory_pool

    return getattr(memory_pool, "NSATokenToKVPool", None)


def _defined_on(fn, cls) -> bool:
    return getattr(fn, "__qualname__", "").split(".")[0] == cls.__name__


def _stock_disaggregation_source(relpath: str) -> str:
    """Text of ``sglang/srt/disaggregation/<relpath>`` of the installed SGLang ("" if absent);
    imports only ``sglang.srt.disaggregation`` itself (not the backend package, which may
    import its engine)."""
    spec = importlib.util.find_spec("sglang.srt.disaggregation")
    if spec is None or not spec.submodule_search_locations:
        return ""
    path = os.path.join(list(spec.submodule_search_locations)[0], relpath)
    if not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8") as f:
        return f.read()


def _stock_method_ast(relpath: str, cls_name: str, fn_name: str) -> Optional[ast.FunctionDef]:
    """The syntax tree of method ``cls_name.fn_name`` in ``disaggregation/<relpath>`` (None if absent)."""
    text = _stock_disaggregation_source(relpath)
    for cls in ast.parse(text).body if text else ():
        if isinstance(cls, ast.ClassDef) and cls.name == cls_name:
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == fn_name:
                    return fn
    return None


def _stock_nixl_conn_source() -> str:
    """Text of the installed stock ``sglang.srt.disaggregation.nixl.conn`` ("" if absent); imports nothing."""
    return _stock_disaggregation_source("nixl/conn.py")


def _stock_nixl_slice_source() -> str:
    text = _stock_nixl_conn_source()
    start = text.find("def send_kvcache_slice")
    if start < 0:
        return ""
    end = text.find("\n    def ", start + 1)
    return text[start:end]


# Names of the pool class that holds the per-page sparse-attention index keys (DeepSeek
# NSA/DSA) in ``sglang.srt.mem_cache.memory_pool``: ``NSATokenToKVPool`` up to 0.5.12.x,
# renamed ``DSATokenToKVPool`` by 0.5.13 (0.5.23 memory_pool.py:5279, no NSA alias left).
INDEX_KEY_POOL_CLASS_NAMES = ("NSATokenToKVPool", "DSATokenToKVPool")


def index_key_pool_class() -> Optional[type]:
    """The installed release's index-key (NSA/DSA) KV pool class, or ``None`` where it has none.

    The one place that picks the class per release, by what the installed
    ``memory_pool`` module defines (the first of ``INDEX_KEY_POOL_CLASS_NAMES``).
    """
    from sglang.srt.mem_cache import memory_pool

    for name in INDEX_KEY_POOL_CLASS_NAMES:
        cls = getattr(memory_pool, name, None)
        if cls is not None:
            return cls
    return None


# --------------------------------------------------------------------------
# Probe values recorded per release, and the release families they define
# --------------------------------------------------------------------------
#
# ``release_facts.json`` holds, for every release in the policy table, the value of every
# probe above as read in that release's own environment (``scripts/record_release_facts.py``,
# run by ``make release-facts`` and checked on every CI leg by ``test_release_facts``: a
# recorded value that differs from the installed release's live one fails there). From the
# record and the policy table, releases fall into *families*: releases whose fix statuses and
# probe values are all equal run the plugin's same code against the same stock shapes, so one
# differential run of the family's representative proves the family. CI runs one
# representative of every family (``ci_matrix``); ``make release-sweep`` runs the rest.

FACTS_FILE = os.path.join(os.path.dirname(__file__), "release_facts.json")


def _jsonable(value):
    if dataclasses.is_dataclass(value):
        return {k: _jsonable(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, (frozenset, set)):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def probe_names() -> Tuple[str, ...]:
    """Every probe of :class:`SGLangFeatures`, in definition order."""
    return tuple(name for name, attr in vars(SGLangFeatures).items()
                 if isinstance(attr, (functools.cached_property, property)))


def probe_record(feats: Optional[SGLangFeatures] = None) -> Dict[str, object]:
    """Every probe's value in this environment (JSON-able); a probe that raises records its error."""
    feats = feats or features()
    out: Dict[str, object] = {}
    for name in probe_names():
        try:
            out[name] = _jsonable(getattr(feats, name))
        except Exception as exc:  # noqa: BLE001 - recorded, so a difference shows
            out[name] = f"error: {type(exc).__name__}"
    return out


@functools.lru_cache(maxsize=1)
def recorded_facts() -> Dict[str, Dict[str, object]]:
    """``release_facts.json``: release -> probe name -> value ({} where no record exists)."""
    import json

    try:
        with open(FACTS_FILE, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


# Which fixes' code (the plugin's, or the stock code its differential tests meet) changes with
# each probe's value; "activation" for how the -ext name is taken and routed (argument
# resolution, the plugin's launcher), proven on its own by test_registration; ()
# for a probe only the self-test rig, the deploy tools or verified transfers read (it does not
# separate fixes' families). test_release_facts checks that every probe has an entry.
PROBE_SCOPE: Dict[str, Tuple[str, ...]] = {
    "server_args_resolution": ("activation",), "server_args_resolve_once": ("activation",),
    "server_args_mooncake_ib_device": (), "server_args_decode_retraction_backup": (),
    "paged_allocator_serves_cpu": (),
    "kv_status_codec": ("F6", "F9", "F16", "F17"), "mooncake_conclude_failure": ("F6", "F8", "F9", "F16"),
    "mooncake_send_probe": ("F6",), "stock_mooncake_checks_state_send": ("F6",),
    "mooncake_aux_count_check": ("F9",), "mooncake_registration_hooks": ("F6", "F9", "F16", "F17", "F18"),
    "mori_status_codec": (), "mori_unique_prefill_rank": (),
    "nixl_refuses_dsv4_state": (), "nixl_empty_transfer_is_dummy": (), "nixl_empty_state_lists_wait": (),
    "nixl_success_via_notifications_only": ("F11", "F13"), "nixl_success_via_listener_only": ("F11",),
    "mori_registration_hook": ("F12",), "dcp_relayout_check": ("F11", "F13"),
    "nixl_bootstrap_handles_abort": ("F11", "F13", "F15", "F16", "F23", "F24"), "mori_sender_notifies_status": ("F3", "F12"),
    "mori_conclude_room_failure": ("F3", "F12"), "mori_registration_frames": ("F12",),
    "runtime_context": (), "runtime_context_publish": (), "runtime_context_spawn_ranks": (),
    "metadata_buffers_sampling_mask": ("F10",), "metadata_buffers_kv_checksum": ("F9",),
    "decode_status_handler": ("F10",), "decode_queue_release_request": ("F10",),
    "metadata_gate_function": ("F10",), "metadata_gate_needs_server_args": ("F10",),
    "pd_kv_layout": (), "kv_transfer_buf_infos": (), "build_kv_layer_ids": (),
    "stock_nixl_slice_uses_total_heads": ("F4", "F13"), "stock_nixl_slice_maps_decode_replicas_by_modulo": ("F4", "F13", "F15", "F16"),
    "stock_nixl_kv_tag_sender_field": ("F4", "F13"), "stock_swa_head_slice_backends": ("F11", "F13", "F15", "F16", "F23", "F24"),
    "stock_nixl_prep_serves_decode_replicas": ("F4", "F13"), "nixl_is_dummy_method": ("F11", "F13"),
    "stock_nixl_sender_bootstrap_deadline": ("F4", "F13", "F15", "F16", "F23", "F24"), "nixl_conclude_failure": ("F11", "F13", "F15", "F16", "F23", "F24"),
    "stock_nixl_worker_tells_decode": ("F4", "F13"), "stock_nixl_sender_poll_raises": ("F4", "F16"),
    "nsa_pool": ("F5",), "stock_f5": ("F5",), "deferred_release_entry": ("F21",),
}


# Proven like a fix: the -ext name taken and routed on every active release.
ACTIVATION = "activation"
PROVEN = FIXES + (ACTIVATION,)


# Cached like recorded_facts (a pure function of the table and the record): the CI-plan walk calls
# it ~150,000 times (8 s of one core in every CI leg's test_release_facts, uncached).
@functools.lru_cache(maxsize=None)
def fix_family_key(version: str, fix: str) -> Optional[tuple]:
    """What ``fix``'s code (or ``ACTIVATION``) meets on ``version``: its status, the state layout
    and the recorded value of every probe scoped to it (None: no table row or no record)."""
    facts = recorded_facts().get(version)
    if version not in _ACTIVE_RELEASES or facts is None:
        return None
    policy = policy_for(version)
    status = "live" if fix == ACTIVATION else policy.fixes[fix].value
    probes = tuple((n, repr(facts.get(n))) for n, scope in sorted(PROBE_SCOPE.items()) if fix in scope)
    return fix, status, policy.layout.value, probes


def _proves(version: str, fix: str) -> bool:
    return fix == ACTIVATION or policy_for(version).is_live(fix)


def family_key(version: str) -> Optional[tuple]:
    """A release's whole family: every fix's ``fix_family_key`` (None without a record)."""
    keys = tuple(fix_family_key(version, f) for f in PROVEN)
    return None if None in keys else keys


def families() -> Dict[str, Tuple[str, ...]]:
    """Representative release -> the releases whose every fix meets the same code (table order).

    The representative is the family's release with the most live fixes (the newest of those)."""
    groups: Dict[tuple, list] = {}
    for version in _ACTIVE_RELEASES:
        key = family_key(version)
        if key is not None:
            groups.setdefault(key, []).append(version)
    out = {}
    for members in groups.values():
        rep = max(members, key=lambda v: (len(policy_for(v).active_fixes()), Version(v)))
        out[rep] = tuple(members)
    return dict(sorted(out.items(), key=lambda item: Version(item[0])))


def family_of(version: str) -> Optional[str]:
    """The representative of ``version``'s family (None: no recorded family)."""
    for rep, members in families().items():
        if version in members:
            return rep
    return None


def covering_releases(start=()) -> Tuple[str, ...]:
    """Releases whose runs prove every live fix on every recorded release: ``start`` and, added
    one at a time, the release that covers the most (fix, fix family) pairs still uncovered (ties:
    more live fixes, then newer). A fix's run on one release proves it on every release where that
    fix meets the same code (``fix_family_key``); fixes not live somewhere need no run there."""
    def pairs(version):
        return {fix_family_key(version, f) for f in PROVEN if _proves(version, f)}

    recorded = [v for v in _ACTIVE_RELEASES if family_key(v) is not None]
    needed = set().union(*(pairs(v) for v in recorded)) if recorded else set()
    chosen = [v for v in start if v in recorded]
    for v in chosen:
        needed -= pairs(v)
    while needed:
        best = max(recorded, key=lambda v: (len(pairs(v) & needed), len(policy_for(v).active_fixes()), Version(v)))
        chosen.append(best)
        needed -= pairs(best)
    return tuple(sorted(set(chosen), key=Version))


# The release whose CI leg runs the whole suite (the newest: most fixes live, the real-server
# stage); every other leg runs the tests of what it proves. scripts/ci_plan.py checks it.
FULL_LEGS = (NEWEST_KNOWN,)


@functools.lru_cache(maxsize=1)
def ci_matrix() -> Tuple[str, ...]:
    """Every release CI runs: the full legs and the fewest family legs that prove the rest."""
    return covering_releases(FULL_LEGS)


@functools.lru_cache(maxsize=None)
def proved_on(leg: str) -> Tuple[str, ...]:
    """What ``leg``'s run must prove (``PROVEN`` ids): the fixes (and activation) for which some
    recorded release's proof is this leg. A full leg proves everything live there."""
    if leg in FULL_LEGS:
        return tuple(f for f in PROVEN if _proves(leg, f))
    ci = ci_matrix()
    out = set()
    for version in _ACTIVE_RELEASES:
        for fix in PROVEN:
            if _proves(version, fix) and proving_release(version, fix, ci) == leg:
                out.add(fix)
    return tuple(f for f in PROVEN if f in out)


def proving_release(version: str, fix: str, ci: Tuple[str, ...]) -> Optional[str]:
    """The release of ``ci`` whose run proves ``fix`` on ``version`` (None: none does)."""
    key = fix_family_key(version, fix)
    if key is None:
        return None
    same = [v for v in ci if _proves(v, fix) and fix_family_key(v, fix) == key]
    # A full leg first (it runs every test anyway), then the oldest CI release with that code: each
    # fix's tests run once per code family, not once per leg.
    for v in same:
        if v in FULL_LEGS:
            return v
    return same[0] if same else None


def probe_differences(a: str, b: str) -> Dict[str, Tuple[object, object]]:
    """Probe name -> (value on ``a``, value on ``b``) for every recorded probe that differs."""
    fa, fb = recorded_facts().get(a, {}), recorded_facts().get(b, {})
    return {n: (fa.get(n), fb.get(n)) for n in sorted(set(fa) | set(fb)) if fa.get(n) != fb.get(n)}
