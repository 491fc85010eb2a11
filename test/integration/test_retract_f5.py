"""F5 retract/resume aliasing: stock vs ext on real SGLang classes, CPU tensors.

Differential: where F5 is live (0.5.10.post1, 0.5.11, 0.5.12, 0.5.12.post1)
ext must pass every scenario and stock must do what the shape of its code
says (``selftest_f5.stock_f5_shape``, checked against hand-read facts in
``STOCK_SHAPE_FACTS``): on 0.5.10.post1 / 0.5.11 stock fails all of them; on
0.5.12.x the release's own retract path raises TypeError (its NSA
``get_cpu_copy(self, indices)``, memory_pool.py:2145, is called with
``mamba_indices=`` by allocator.py:524) while ``get_buf`` and
``_clear_buffers`` already pass. Where the plugin passes through (0.5.13+),
the release's own code must pass.

Stock ``get_cpu_copy``/``load_cpu_copy`` call ``torch.cuda.synchronize()``
unconditionally; on this CPU-only torch that raises. For *stock* runs on a CPU
pool, that one function is replaced by a no-op (``stock_cuda_sync_neutralised``),
nothing else. Ext runs neutralise nothing.
"""

import gc
import os

import pytest

torch = pytest.importorskip("torch")

from sglang_disagg_ext import releases  # noqa: E402
from sglang_disagg_ext.core.page_chunks import chunk_bounds, n_pages, page_chunk_rows  # noqa: E402
from sglang_disagg_ext.backends.common import retract  # noqa: E402
from sglang_disagg_ext.selftest.scenarios import f5  # noqa: E402

POLICY = releases.current_policy()
LIVE = POLICY.is_live("F5")

try:
    # The index-key pool the release builds: NSATokenToKVPool up to 0.5.12.x,
    # DSATokenToKVPool on 0.5.13+ (releases.index_key_pool_class).
    HAS_NSA = releases.index_key_pool_class() is not None
    # The plugin's F5 pool hooks patch NSATokenToKVPool, where F5 is live.
    HAS_NSA_HOOK_TARGET = f5.nsa_pool_class() is not None
    NSA_IMPORT_ERROR = None
except ImportError as e:  # an environment problem, not a release difference: fail, do not skip
    HAS_NSA = HAS_NSA_HOOK_TARGET = True
    NSA_IMPORT_ERROR = f"{type(e).__name__}: {e}"

needs_nsa = pytest.mark.skipif(
    not HAS_NSA, reason=f"n/a: this release has none of {releases.INDEX_KEY_POOL_CLASS_NAMES} (no NSA/DSA models)"
)
# Tests of the plugin's own pool hooks: n/a where the release has no NSATokenToKVPool
# (0.5.13+: DSATokenToKVPool, F5 upstream, the plugin installs nothing there).
needs_nsa_hooks = pytest.mark.skipif(
    not HAS_NSA_HOOK_TARGET,
    reason="n/a: the plugin's F5 pool hooks target NSATokenToKVPool; this release has DSATokenToKVPool "
    "(F5 upstream, pass-through: its own retract path is tested instead)",
)


@pytest.fixture(autouse=True)
def _memory_pool_importable():
    if NSA_IMPORT_ERROR is not None:
        pytest.fail(f"sglang.srt.mem_cache.memory_pool does not import here: {NSA_IMPORT_ERROR}")

# SGLANG_DISAGG_EXT_RETRACT_CYCLES: the scheduler-path cycles (default 1,000) and, at most 200,
# the pool-path ones. `make test-patched` sets 100: there the same tests re-run on SGLang's
# patched sources, whose 0.5.10.post1 offload takes ~60 ms a cycle on CPU (the plugin's ~6 ms),
# after the test stage ran the full counts on the plugin and on stock.
CYCLES = int(os.environ.get("SGLANG_DISAGG_EXT_RETRACT_CYCLES", "1000"))
POOL_CYCLES = min(200, CYCLES)

# By hand from each wheel: (NSA pool defines its own get_cpu_copy, which accepts mamba_indices,
# allocator passes mamba_indices, NSA pool's own _clear_buffers frees index_k, get_buf clones).
STOCK_SHAPE_FACTS = {
    # memory_pool.py:1804 NSA inherits MLA's offload and _clear_buffers; allocator.py:515
    # get_cpu_copy(self, indices); disaggregation/utils.py:236 get_buf returns views.
    "0.5.10.post1": (False, False, False, False, False),
    # memory_pool.py:1862 inherits MLA's get_cpu_copy(self, indices, mamba_indices=None) (:975);
    # allocator.py:517 passes mamba_indices=; utils.py:244 views.
    "0.5.11": (False, True, True, False, False),
    # memory_pool.py:2145 get_cpu_copy(self, indices), :2067 _clear_buffers deletes
    # index_k_with_scale_buffer; allocator.py:524 passes mamba_indices=; utils.py:244 clones.
    "0.5.12": (True, False, True, True, True),
    "0.5.12.post1": (True, False, True, True, True),
}


@pytest.fixture(scope="module")
def shape():
    return f5.stock_f5_shape()


@pytest.fixture(autouse=True)
def _stock_between_tests():
    """Every test starts and ends with stock classes."""
    retract.uninstall_retract_fixes()
    yield
    retract.uninstall_retract_fixes()


def _assert_live_stock_failure(report, shape, path):
    """Stock failed with the live bug's signature (f5.stock_retract_signature), not any error."""
    assert not report.passed, "stock passed where F5 is live"
    why = f5.stock_retract_signature(report, shape, path)
    assert why is None, f"stock failed, but not as the live F5 bug does: {why}"


@needs_nsa
@pytest.mark.timeout(30)
def test_stock_shape_probe_matches_the_wheels(shape):
    if "F5" in POLICY.patched:
        pytest.skip("the F5 facts are of the unpatched wheel; these sources carry patches/ (test-patched run)")
    facts = STOCK_SHAPE_FACTS.get(POLICY.version)
    if facts is None:
        pytest.skip(f"no hand-read F5 facts for SGLang {POLICY.version} (only for releases where F5 is live)")
    got = (
        shape.nsa_offloads_index_k,
        shape.nsa_offload_takes_mamba_indices,
        shape.allocator_passes_mamba_indices,
        shape.nsa_clear_releases_index_k,
        shape.get_buf_copies,
    )
    assert got == facts, shape
    # Read the same with the hooks installed: the probe looks at SGLang's own methods.
    with retract.retract_fixes(True):
        assert f5.stock_f5_shape() == shape


# --------------------------------------------------------------------------
# Retract -> reuse -> resume, 1,000 random cycles
# --------------------------------------------------------------------------


@needs_nsa
@pytest.mark.timeout(120)
def test_retract_resume_scheduler_path_1000_cycles(shape):
    """Through SGLang's Req.offload_kv_cache / load_kv_cache and the paged allocator.

    Every cycle compares every page of the pool: the resumed request's KV rows and
    index-key pages against what was offloaded, every other byte (other requests'
    pages, free pages) against what it held before the offload/resume. On 0.5.13+
    the pool is DSATokenToKVPool and ext is the release's own code (pass-through):
    stock and ext both keep the index keys.
    """
    ext = f5.retract_scenario(True, cycles=CYCLES, seed=1)
    assert ext.passed, ext
    assert ext.cycles == CYCLES and ext.other_page_mismatch_cycles == 0

    stock = f5.retract_scenario(False, cycles=CYCLES, seed=1)
    if not LIVE:
        assert stock.passed, stock
        assert stock.cycles == CYCLES, stock
    elif shape.nsa_offloads_index_k:
        # 0.5.12.x: upstream's offload exists but its own allocator cannot call it;
        # the first retract ends in TypeError, which is what a user's server hits.
        assert shape.retract_stock("scheduler") == "fail"
        _assert_live_stock_failure(stock, shape, "scheduler")
        assert stock.cycles == 0 and "mamba_indices" in stock.error, stock
    else:
        _assert_live_stock_failure(stock, shape, "scheduler")
        assert stock.index_k_mismatch_cycles > CYCLES // 2, stock


@needs_nsa
@pytest.mark.timeout(120)
@pytest.mark.parametrize("chunk_tokens", [None, 64, 100, 150])
def test_retract_resume_pool_path_chunk_sizes(chunk_tokens, shape):
    """Calling the pool directly, with several chunk sizes (None: the pool's default 8192).

    64 -> 1 page per chunk, 100 -> 100-token KV chunks vs 1-page index chunks,
    150 -> 2-page index chunks whose boundaries differ from the KV chunks'.
    """
    ext = f5.retract_scenario(True, cycles=POOL_CYCLES, seed=2, chunk_tokens=chunk_tokens, path="pool")
    assert ext.passed, ext
    stock = f5.retract_scenario(False, cycles=POOL_CYCLES, seed=2, chunk_tokens=chunk_tokens, path="pool")
    if LIVE and shape.retract_stock("pool") == "fail":
        _assert_live_stock_failure(stock, shape, "pool")
    else:
        # Upstream's own offload (0.5.12+), called positionally as upstream's pools call it.
        assert stock.passed, stock


@needs_nsa_hooks
@pytest.mark.timeout(60)
def test_ext_runs_on_cpu_pool_without_any_cuda_call(monkeypatch):
    """Ext synchronises the pool's own device: nothing on CPU. Stock cannot run here."""
    calls = []

    def cuda_sync(*a, **k):
        calls.append(a)
        raise AssertionError("Torch not compiled with CUDA enabled (test stand-in)")

    monkeypatch.setattr(torch.cuda, "synchronize", cuda_sync)
    pool = f5.build_nsa_pool(layer_num=2, num_pages=4)
    indices = torch.arange(64, 64 + 150)
    with retract.retract_fixes(True):
        copy = pool.get_cpu_copy(indices)
        pool.load_cpu_copy(copy, indices)
    assert calls == []
    with retract.retract_fixes(False):
        with pytest.raises(AssertionError):
            pool.get_cpu_copy(indices)
    assert calls  # stock reached torch.cuda.synchronize


@pytest.mark.timeout(10)
def test_synchronize_device_dispatch(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: seen.append(device))
    retract.synchronize_device("cpu")
    retract.synchronize_device(torch.device("cpu"))
    assert seen == []
    retract.synchronize_device("cuda:1")
    assert seen == [torch.device("cuda:1")]


# --------------------------------------------------------------------------
# Return value: the base class's layout, plus the index keys
# --------------------------------------------------------------------------


@needs_nsa_hooks
@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunk_tokens,n_tokens", [(None, 150), (64, 150), (100, 257), (128, 64)])
def test_cpu_copy_keeps_base_layout(chunk_tokens, n_tokens):
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    pool = f5.build_nsa_pool(layer_num=2, num_pages=8, chunk_tokens=chunk_tokens)
    chunk = pool.cpu_offloading_chunk_size
    gen = torch.Generator().manual_seed(0)
    for layer in range(pool.layer_num):
        pool.kv_buffer[layer].view(torch.uint8).copy_(
            torch.randint(0, 256, pool.kv_buffer[layer].view(torch.uint8).shape, generator=gen, dtype=torch.uint8)
        )
        pool.index_k_with_scale_buffer[layer].copy_(
            torch.randint(0, 256, pool.index_k_with_scale_buffer[layer].shape, generator=gen, dtype=torch.uint8)
        )
    indices = torch.cat([torch.arange(p * 64, p * 64 + 64) for p in (5, 2, 7, 3, 1)])[:n_tokens].to(torch.int32)

    with retract.retract_fixes(True):
        copy = pool.get_cpu_copy(indices)
    with f5.stock_cuda_sync_neutralised(not torch.cuda.is_available()):
        base = MLATokenToKVPool.get_cpu_copy(pool, indices)

    # Same list-of-layers-of-chunks as the base class, byte for byte.
    assert isinstance(copy, list) and len(copy) == len(base) == pool.layer_num
    for ours, theirs in zip(copy, base):
        assert [t.shape for t in ours] == [t.shape for t in theirs]
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(ours, theirs))
    # Chunking follows the pool's own chunk size: tokens for KV, whole pages for index keys.
    kv_plan = chunk_bounds(n_tokens, chunk)
    ik_plan = chunk_bounds(n_pages(n_tokens, 64), page_chunk_rows(chunk, 64))
    assert [t.shape[0] for t in copy[0]] == [e - s for s, e in kv_plan]
    assert [t.shape[0] for t in copy.index_k[0]] == [e - s for s, e in ik_plan]
    pages = indices[::64].long() // 64
    for layer in range(pool.layer_num):
        assert torch.equal(torch.cat(copy.index_k[layer]), pool.index_k_with_scale_buffer[layer][pages])
    # Host copies, not views of the pool.
    for layer_chunks in copy.index_k:
        for t in layer_chunks:
            assert t.device.type == "cpu"
            assert t.untyped_storage().data_ptr() != pool.index_k_with_scale_buffer[0].untyped_storage().data_ptr()

    # The base class's own restore accepts the value (it is the base layout).
    with f5.stock_cuda_sync_neutralised(not torch.cuda.is_available()):
        MLATokenToKVPool.load_cpu_copy(pool, copy, indices)
    # And ext restore accepts upstream's dict layout too.
    with retract.retract_fixes(True):
        pool.load_cpu_copy({"kv": list(copy), "index_k": copy.index_k}, indices)


@needs_nsa_hooks
@pytest.mark.timeout(30)
def test_restore_rejects_copy_of_other_length():
    pool = f5.build_nsa_pool(layer_num=2, num_pages=4)
    with retract.retract_fixes(True):
        copy = pool.get_cpu_copy(torch.arange(64, 64 + 130))
        with pytest.raises(ValueError):
            pool.load_cpu_copy(copy, torch.arange(64, 64 + 100))


# --------------------------------------------------------------------------
# MetadataBuffers.get_buf
# --------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_metadata_get_buf_isolated_from_slot_reuse(shape):
    ext = f5.metadata_scenario(True)
    assert ext.passed, ext
    stock = f5.metadata_scenario(False)
    assert stock.own_data_read and stock.error is None
    if LIVE and shape.metadata_stock() == "fail":
        assert not stock.passed  # views: B's set_buf changed what A holds
    else:
        assert stock.passed  # get_buf clones (0.5.12+); the ext copy changes nothing


# --------------------------------------------------------------------------
# _clear_buffers
# --------------------------------------------------------------------------


@needs_nsa
@pytest.mark.timeout(30)
def test_clear_buffers_releases_index_k(shape):
    ext = f5.clear_buffers_scenario(True)
    assert ext.passed, ext
    assert ext.index_k_alive == 0
    stock = f5.clear_buffers_scenario(False)
    if LIVE and shape.clear_stock() == "fail":
        assert stock.index_k_alive > 0 and not stock.passed
    else:
        assert stock.passed, stock


# --------------------------------------------------------------------------
# Installation
# --------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_install_is_idempotent_and_uninstall_restores_stock():
    targets = retract._targets()
    assert targets, "nothing to patch: neither NSATokenToKVPool nor MetadataBuffers found"
    before = {(cls, name): cls.__dict__.get(name) for cls, name, _ in targets}

    first = retract.install_retract_fixes()
    second = retract.install_retract_fixes()
    assert first == second
    assert retract.retract_fixes_installed()
    for cls, name, fn in targets:
        assert cls.__dict__[name] is fn
    # Originals recorded once, not overwritten by the second install.
    assert {k: v for k, v in retract._originals.items()} == {
        k: (v if v is not None else retract._MISSING) for k, v in before.items()
    }

    retract.uninstall_retract_fixes()
    assert not retract.retract_fixes_installed()
    for (cls, name), original in before.items():
        assert cls.__dict__.get(name) is original


@needs_nsa_hooks
@pytest.mark.timeout(30)
def test_hook_reaches_subclasses_that_do_not_override():
    """A hook on the class: HiSparse (a subclass) keeps its own offload but gets _clear_buffers."""
    # Every supported wheel ships it (0.5.10.post1 - 0.5.23): an ImportError is a failure.
    from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseNSATokenToKVPool
    with retract.retract_fixes(True):
        assert "get_cpu_copy" in HiSparseNSATokenToKVPool.__dict__  # its own NotImplementedError
        assert HiSparseNSATokenToKVPool._clear_buffers is retract._nsa_clear_buffers


@pytest.mark.timeout(240)
def test_selftest_rows():
    rows = f5.f5_rows(cycles=50)
    assert [r["fix"] for r in rows] == ["F5"] * 3
    for r in rows:
        assert set(r) >= {"scenario", "fix", "backend", "stock", "ext", "verified", "seconds"}
        assert r["backend"] == "all"
        assert r["stock"] in ("pass", "fail", "n/a") and r["ext"] in ("pass", "fail", "n/a")
    if LIVE:
        assert all(r["ext"] == "pass" and r["stock"] == r["stock_expected"] and r["verified"] for r in rows), rows
        # Every release where F5 is live fails the retract row on stock (mismatch or TypeError).
        assert rows[0]["stock"] == "fail", rows[0]
    else:
        assert all(r["stock"] == "n/a" for r in rows)
    gc.collect()


@pytest.mark.timeout(60)
def test_selecting_an_ext_backend_installs_the_hooks_where_f5_is_live():
    """registration.activate (what an -ext name does in each SGLang process) installs F5 exactly where live."""
    from sglang_disagg_ext import registration

    try:
        registration.activate("mooncake-ext")
        assert retract.retract_fixes_installed() is (LIVE and POLICY.support is releases.Support.ACTIVE)
    finally:
        registration.deactivate()
    assert not retract.retract_fixes_installed()


# By hand from each wheel's mem_cache/memory_pool.py: the index-key pool class it builds.
INDEX_KEY_POOL_CLASS = {
    "0.5.10.post1": "NSATokenToKVPool",  # :1804
    "0.5.11": "NSATokenToKVPool",  # :1862
    "0.5.12": "NSATokenToKVPool",
    "0.5.12.post1": "NSATokenToKVPool",
    "0.5.23": "DSATokenToKVPool",  # :5279, no NSATokenToKVPool left
}


@pytest.mark.timeout(30)
def test_index_key_pool_class_per_release():
    want = INDEX_KEY_POOL_CLASS.get(POLICY.version)
    if want is None:
        pytest.skip(f"n/a: no hand-read pool class for SGLang {POLICY.version}")
    assert releases.index_key_pool_class().__name__ == want
    assert type(f5.build_nsa_pool(layer_num=1, num_pages=2)).__name__ == want


def _mismatches(component: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("sglang_disagg_ext_verify_mismatches_total",
                                     {"component": f"retract_{component}"}) or 0.0


@needs_nsa_hooks
@pytest.mark.timeout(120)
def test_verified_resume_names_a_byte_that_changed(monkeypatch, caplog):
    """Verified retract/resume, CPU pool, the plugin's F5 hooks: with SGLANG_DISAGG_EXT_VERIFY=1 the
    offload records digests of the request's KV rows and index-key pages and the resume checks the
    restored ones against them (each item placed by its position in the request). A round trip to
    other slots agrees; one byte changed in the host copy of index-key layer 1 between retract and
    resume (host memory going bad, or a copy read after reuse) is logged naming that component and
    layer and counted; without verification the same change passes silently. A resume cannot fail
    the request in SGLang (``load_cpu_copy`` has no failure path), so logging and counting is it."""
    from sglang_disagg_ext.verification import VERIFY_ENV

    pool = f5.build_nsa_pool(layer_num=2, num_pages=8)
    gen = torch.Generator().manual_seed(7)
    for layer in range(pool.layer_num):
        for buf in (pool.kv_buffer[layer], pool.index_k_with_scale_buffer[layer]):
            raw = buf.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
    first = torch.arange(64, 64 + 150)  # pages 1-3, the last one partly used
    second = torch.arange(320, 320 + 150)  # pages 5-7
    caplog.set_level("ERROR", logger="sglang_disagg_ext")
    with retract.retract_fixes(True):
        monkeypatch.setenv(VERIFY_ENV, "1")
        copy = pool.get_cpu_copy(first)
        assert set(copy.digests) == {("kv", 0), ("index_k", 0), ("kv", 1), ("index_k", 1)}
        pool.load_cpu_copy(copy, second)  # resumed into other slots: every byte in its place
        assert not [r for r in caplog.records if "verified retract" in r.getMessage()]

        before = _mismatches("index_k"), _mismatches("kv")
        copy = pool.get_cpu_copy(second)
        copy.index_k[1][0][2, 5] ^= 0x01  # index-key layer 1, the request's third page, byte 5
        pool.load_cpu_copy(copy, first)
        errors = [r.getMessage() for r in caplog.records if "verified retract" in r.getMessage()]
        assert len(errors) == 1 and "index_k layer 1 differs from what was offloaded" in errors[0], errors
        assert (_mismatches("index_k"), _mismatches("kv")) == (before[0] + 1, before[1])

        caplog.clear()
        monkeypatch.delenv(VERIFY_ENV)
        copy = pool.get_cpu_copy(first)
        assert copy.digests is None
        copy.index_k[1][0][2, 5] ^= 0x01
        pool.load_cpu_copy(copy, second)
        assert not [r for r in caplog.records if "verified retract" in r.getMessage()]
