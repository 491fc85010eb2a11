"""F4 memory kinds: which NIXL segment a buffer is registered and addressed in."""

import pytest

from sglang_disagg_ext.core.mem_kind import (
    DRAM,
    VRAM,
    MemKindError,
    classify,
    device_id,
    kind_for_device,
    single_kind,
)


@pytest.mark.parametrize(
    "device,kind",
    [("cpu", DRAM), ("CPU", DRAM), ("cuda", VRAM), ("cuda:3", VRAM), ("npu", VRAM), (None, VRAM)],
)
def test_kind_for_device(device, kind):
    assert kind_for_device(device) == kind


def test_cpu_device_never_probes():
    def probe(ptr):
        raise AssertionError("probed on a host device")

    assert classify([0x1000, 0x2000], "cpu", probe) == [DRAM, DRAM]


def test_probe_answers_win_on_an_accelerator_device():
    answers = {0x1000: True, 0x2000: False, 0x3000: None}
    assert classify([0x1000, 0x2000, 0x3000], "cuda", answers.get) == [VRAM, DRAM, VRAM]


def test_broken_probe_falls_back_to_the_device():
    def probe(ptr):
        raise OSError("driver gone")

    assert classify([0x1000], "cuda", probe) == [VRAM]
    assert classify([0x1000], "cuda", None) == [VRAM]


def test_device_id():
    assert device_id(VRAM, 3) == 3
    assert device_id(DRAM, 3) == 0
    with pytest.raises(MemKindError):
        device_id("HBM", 0)


def test_single_kind():
    kinds = {1: DRAM, 2: DRAM, 3: VRAM}
    assert single_kind([1, 2], kinds, "kv") == DRAM
    with pytest.raises(MemKindError, match="different memory kinds"):
        single_kind([1, 3], kinds, "kv")
    with pytest.raises(MemKindError, match="0x9 was not registered"):
        single_kind([9], kinds, "kv")
    with pytest.raises(MemKindError, match="no buffers"):
        single_kind([], kinds, "kv")
