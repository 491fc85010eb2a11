"""nixl-ext pieces that need SGLang's classes but no transfer engine.

* The installed release's *stock* decode parser (``NixlKVManager.update_transfer_status``)
  completes a P=2 -> D=1 room on the tags an ext prefill sends, and does not
  on tags where both ranks carry the same sender field (stock <= 0.5.11).
* The decode-side agent wrapper turns a prefill's failure tag into Failed.
* Impossible head layouts are refused with the numbers in the message.
"""

from collections import defaultdict
from types import SimpleNamespace

import pytest

# Plain imports: SGLang's nixl/conn.py imports NIXL only inside the manager, and the
# plugin's own module must import on every release; an ImportError here is a failure.
import sglang.srt.disaggregation.nixl.conn as conn  # noqa: E402
import sglang_disagg_ext.backends.nixl as nixl_ext  # noqa: E402

from sglang_disagg_ext.core.head_slice import HeadLayoutError  # noqa: E402
from sglang_disagg_ext.core.nixl_notif import failure_tag, with_sender_id  # noqa: E402

ROOM = 4242

from sglang_disagg_ext import releases  # noqa: E402

# The notification parser these tests drive is the one nixl-ext runs against:
# releases where F4's classes are nixl-ext's (0.5.13+ pass through; on 0.5.23
# nixl-ext is F11's class over stock, whose NIXL path no longer uses these tags).
_POLICY = releases.current_policy()
active_only = pytest.mark.skipif(
    not (_POLICY.is_live("F4") or "F4" in _POLICY.patched),
    reason=f"n/a on SGLang {_POLICY.version}: F4's classes are not nixl-ext's there (pass-through, or "
    "F11's class over stock on 0.5.23), so the plugin's notification parser is not in use",
)


class FakeAgent:
    def __init__(self, notifs):
        self.notifs = notifs

    def get_new_notifs(self):
        out, self.notifs = self.notifs, {}
        return out


def stock_decode(agent, required=2):
    """A stock NixlKVManager (decode side) with only what update_transfer_status reads."""
    mgr = object.__new__(conn.NixlKVManager)
    mgr.agent = agent
    mgr.transfer_statuses = defaultdict(conn.TransferStatus)
    mgr.required_prefill_response_num_table = {ROOM: required}
    mgr.enable_staging = False
    mgr._staging_handler = None
    return mgr


def prefill_tags(engine_rank, pp_rank=0, stock_field=0):
    """What one prefill rank emits for a 2-chunk room: stock tags, then ext's rewrite."""
    stock = [f"{ROOM}_kv_0_0_{stock_field}", f"{ROOM}_kv_1_1_{stock_field}", f"{ROOM}_aux"]
    return [with_sender_id(t, pp_rank, engine_rank).encode() for t in stock]


@active_only
def test_stock_decode_completes_on_ext_keys():
    agent = FakeAgent({"prefill-a": prefill_tags(0), "prefill-b": prefill_tags(1)})
    mgr = stock_decode(agent)
    mgr.update_transfer_status()
    assert mgr.check_transfer_done(ROOM)
    assert not mgr.transfer_statuses[ROOM].is_failed()


@active_only
def test_stock_decode_waits_when_ranks_share_a_key():
    same = [f"{ROOM}_kv_0_0_0".encode(), f"{ROOM}_kv_1_1_0".encode(), f"{ROOM}_aux".encode()]
    mgr = stock_decode(FakeAgent({"prefill-a": same, "prefill-b": list(same)}))
    mgr.update_transfer_status()
    assert not mgr.check_transfer_done(ROOM)


@active_only
def test_stock_decode_keeps_pipeline_stages_apart():
    # PP 2 x TP 1 prefill -> PP 1 decode: two responses, both TP rank 0.
    agent = FakeAgent({"a": prefill_tags(0, pp_rank=0), "b": prefill_tags(0, pp_rank=1)})
    mgr = stock_decode(agent)
    mgr.update_transfer_status()
    assert mgr.check_transfer_done(ROOM)


@active_only
def test_stock_decode_ignores_failure_tags():
    tag = failure_tag(ROOM, 0, 1, "boom").encode()
    mgr = stock_decode(FakeAgent({"a": [tag]}))
    mgr.update_transfer_status()  # no exception, nothing marked
    assert not mgr.check_transfer_done(ROOM)


@active_only
def test_ext_decode_turns_failure_tag_into_failed():
    recorded = {}
    mgr = object.__new__(nixl_ext.NixlExtKVManager)
    mgr._ext_is_prefill = False
    mgr.transfer_statuses = defaultdict(conn.TransferStatus)
    mgr.required_prefill_response_num_table = {ROOM: 2}
    mgr.enable_staging = False
    mgr._staging_handler = None
    mgr.failure_records = recorded
    mgr.failure_lock = __import__("threading").Lock()
    tags = {"a": prefill_tags(0)[:1] + [failure_tag(ROOM, 0, 1, "State index length mismatch").encode()]}
    mgr.agent = nixl_ext.ExtNixlAgent(FakeAgent(tags), mgr)
    mgr.update_transfer_status()
    assert mgr.check_transfer_done(ROOM)
    assert mgr.transfer_statuses[ROOM].is_failed()
    assert "State index length mismatch" in recorded[ROOM]


def prefill_mgr(tp, per_rank, total):
    mgr = object.__new__(nixl_ext.NixlExtKVManager)
    mgr.attn_tp_size = tp
    mgr.kv_args = SimpleNamespace(kv_head_num=per_rank, total_kv_head_num=total)
    mgr._ext_total_kv_heads = None
    mgr._ext_layouts = {}
    return mgr


@pytest.mark.parametrize(
    "tp,per_rank,total,message",
    [
        (2, 1, 3, "prefill TP size 2 does not divide the 3 KV heads"),
        (4, 1, 3, "3 KV heads cannot be replicated evenly over prefill TP size 4"),
        (2, 0, 0, "kv_head_num (per rank) must be positive, got 0"),
        (2, 2, 2, "prefill pool holds 2 KV heads per rank, but 2 total KV heads over attention TP size 2 means 1"),
    ],
)
def test_own_layout_refused(tp, per_rank, total, message):
    with pytest.raises(HeadLayoutError) as err:
        prefill_mgr(tp, per_rank, total)._ext_check_own_heads()
    assert message in str(err.value)


def test_peer_layout_refused_names_numbers():
    mgr = prefill_mgr(1, 3, 3)
    mgr._ext_check_own_heads()
    with pytest.raises(HeadLayoutError) as err:
        mgr._ext_layout(1, 2)
    assert "3 KV heads from prefill TP size 1 to decode TP size 2" in str(err.value)
    assert "decode TP size 2 does not divide the 3 KV heads" in str(err.value)


def test_ext_classes_by_support():
    from sglang_disagg_ext import releases

    active = releases.policy_for("0.5.11")
    assert set(nixl_ext.ext_classes(active)) == {"NixlKVManager", "NixlKVSender"}
    assert nixl_ext.ext_classes(releases.policy_for("0.5.20")) == {}
