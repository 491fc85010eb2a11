"""Real servers over NIXL (UCX on loopback): ``nixl-ext`` tokens equal colocated, plugin in the path.

This pair runs first and alone (then it is stopped): SGLang's NIXL schedulers poll a core each
even when idle, which would slow every other server on two cores.
"""

import pytest

import cpu_servers as cs


@pytest.fixture(scope="module")
def nixl(deployment):
    deployment.ensure(["nixl-ext"])
    yield deployment
    deployment.stop_pair("nixl-ext")


@pytest.mark.timeout(1200)
def test_nixl_ext_tokens_equal_colocated(nixl):
    cs.check_tokens_equal(nixl, nixl.pairs["nixl-ext"])


@pytest.mark.timeout(600)
def test_nixl_ext_is_in_the_path(nixl, policy):
    cs.check_plugin_in_path(nixl.pairs["nixl-ext"], policy)
