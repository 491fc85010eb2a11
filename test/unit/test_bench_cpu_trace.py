"""bench.transfer_worker.CpuTracer and the CPU breakdown: exclusive per-frame CPU accounting (fake clock),
which methods are traced, engine-call normalisation (pure; no SGLang, no timing asserted)."""

import threading

import pytest

from bench.transfer import cpu_breakdown
from bench.transfer_worker import CpuTracer, buffer_bases, calls_digest, normalise, traced_methods


class FakeClock:
    def __init__(self):
        self.now = 0

    def __call__(self):
        return self.now

    def spend(self, ns):
        self.now += ns


@pytest.mark.timeout(10)
def test_nested_frames_charge_exclusive_time():
    clock = FakeClock()
    tracer = CpuTracer(clock=clock)

    def stock_part():
        clock.spend(700)

    def plugin_part():
        clock.spend(100)
        tracer.frame(("ext", "stock S.m"), stock_part)
        clock.spend(20)

    tracer.frame(("ext", "F6 M.m"), plugin_part)
    clock.spend(5000)  # outside every frame: not counted
    out = tracer.take()
    assert out["ns"] == {"ext|F6 M.m": 120, "ext|stock S.m": 700}
    assert out["frames"] == {"ext|F6 M.m": 1, "ext|stock S.m": 1}
    assert tracer.take()["ns"] == {}  # take() resets


@pytest.mark.timeout(10)
def test_patch_method_traces_only_known_objects_and_unpatches():
    clock = FakeClock()
    tracer = CpuTracer(clock=clock)

    class Stock:
        def send(self):
            clock.spend(50)
            return "stock"

    class Plugin(Stock):
        def send(self):
            clock.spend(3)
            return super().send()

    ours, other = Plugin(), Plugin()
    originals = (Stock.__dict__["send"], Plugin.__dict__["send"])
    variant_of = {id(ours): "ext"}.get
    tracer.patch_method(Plugin, "send", "F7 Plugin.send", lambda o: variant_of(id(o)))
    tracer.patch_method(Stock, "send", "stock Stock.send", lambda o: variant_of(id(o)))
    assert ours.send() == "stock" and other.send() == "stock"
    tracer.unpatch()
    assert (Stock.__dict__["send"], Plugin.__dict__["send"]) == originals
    assert tracer.take()["ns"] == {"ext|F7 Plugin.send": 3, "ext|stock Stock.send": 50}


@pytest.mark.timeout(10)
def test_each_thread_has_its_own_stack():
    tracer = CpuTracer()  # the real per-thread clock
    errors = []

    def work():
        try:
            for _ in range(200):
                tracer.frame(("ext", "F6 a"), lambda: tracer.frame(("ext", "stock b"), sum, range(50)))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = tracer.take()
    assert not errors
    assert out["frames"] == {"ext|F6 a": 800, "ext|stock b": 800}


@pytest.mark.timeout(10)
def test_patch_instance_records_calls_and_restores():
    tracer = CpuTracer()
    seen = []

    class Engine:
        def batch_transfer_sync(self, session, srcs, dsts, lens):
            return 0

    e = Engine()
    tracer.patch_instance(e, "batch_transfer_sync", "engine", lambda: "stock",
                          lambda v, args, kwargs: seen.append((v, args)))
    assert e.batch_transfer_sync("s", [1], [2], [3]) == 0
    tracer.unpatch()
    assert "batch_transfer_sync" not in vars(e)
    assert seen == [("stock", ("s", [1], [2], [3]))]
    assert list(tracer.take()["frames"]) == ["stock|engine"]


@pytest.mark.timeout(10)
def test_traced_methods_plugin_overrides_and_stock_callees():
    def define(name, bases, module, **methods):
        return type(name, bases, {"__module__": module, **methods})

    stock_base = define("CommonKVManager", (), "sglang.srt.disaggregation.common.conn",
                        get_mha_kv_ptrs_with_pp=lambda self: None, record_failure=lambda self: None)
    stock = define("MooncakeKVManager", (stock_base,), "sglang.srt.disaggregation.mooncake.conn",
                   add_transfer_request=lambda self: None, send_aux=lambda self: None,
                   transfer_worker=lambda self: None, _send_kvcache_generic=lambda self: None)
    mixin = define("Helper", (), "sglang_disagg_ext.backends.x", add_transfer_request=lambda self: None,
                   transfer_worker=lambda self: None, _private_helper=lambda self: None)
    ext = define("Ext", (mixin, stock), "sglang_disagg_ext.backends.mooncake.conn")
    m = traced_methods(ext)
    assert [lab for _, _, lab in m["plugin"]] == ["base Helper.add_transfer_request"]  # loops, helpers: not traced
    stock_labels = {lab for _, _, lab in m["stock"]}
    assert {"stock MooncakeKVManager.add_transfer_request", "stock MooncakeKVManager._send_kvcache_generic",
            "stock CommonKVManager.get_mha_kv_ptrs_with_pp"} <= stock_labels
    assert "stock MooncakeKVManager.transfer_worker" not in stock_labels


@pytest.mark.timeout(10)
def test_engine_calls_normalised_per_buffer_compare_across_pools():
    def calls(kv_base, state_base):
        src = buffer_bases({"kv": [kv_base, kv_base + 4096], "state": [[state_base]]})
        dst = buffer_bases({"kv": [10_000, 14_096]})
        return [("sess", (normalise(kv_base + 64, src) + normalise(10_064, dst) + (64,),
                          normalise(state_base, src) + normalise(14_100, dst) + (32,)))]

    a, b = calls(1_000_000, 2_000_000), calls(5_000_000, 3_000_000)  # two managers' own pools
    assert a == b
    assert a[0][1][0] == ("kv0", 64, "kv0", 64, 64)
    assert calls_digest(a) == calls_digest(b)
    assert calls_digest(a)["descriptors"] == 2 and calls_digest(a)["bytes"] == 96
    assert calls_digest(a + a)["sha256"] != calls_digest(a)["sha256"]


@pytest.mark.timeout(10)
def test_cpu_breakdown_splits_plugin_stock_engine_per_request():
    def trace(variant, plugin_ns, digest):
        ns = {f"{variant}|stock MooncakeKVManager.send_aux": 4000, f"{variant}|engine": 90000}
        frames = {k: 2 for k in ns}
        if plugin_ns:
            ns[f"{variant}|F6 RequestIsolationMixin.add_transfer_request"] = plugin_ns
            frames[f"{variant}|F6 RequestIsolationMixin.add_transfer_request"] = 2
        return {"ns": ns, "frames": frames, "engine": {"sha256": digest, "descriptors": 8},
                "labels": {"plugin": ["F6 RequestIsolationMixin.add_transfer_request"], "stock": []}}

    traces = {"stock": [trace("stock", 0, "d"), trace("stock", 0, "d")],
              "ext": [trace("ext", 6000, "d"), trace("ext", 8000, "d")]}
    cpu = cpu_breakdown(traces, concurrency=2)
    assert cpu["added_us"] == [3.0, 4.0]  # ns per batch / 2 requests / 1000
    assert cpu["by_fix_us"] == {"F6": [3.0, 4.0]}
    assert cpu["ext_stock_us"] == [2.0, 2.0] and cpu["stock_engine_us"] == [45.0, 45.0]
    assert cpu["stock_by_method_us"] == {"send_aux": [2.0, 2.0]}
    assert cpu["plugin_frames_per_request"] == [1.0, 1.0]
    assert cpu["engine_calls_identical"]
    traces["ext"][1]["engine"]["sha256"] = "other"
    assert not cpu_breakdown(traces, concurrency=2)["engine_calls_identical"]
