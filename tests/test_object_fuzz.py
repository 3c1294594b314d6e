"""The fuzzer of object text and shape (tests/objectfuzz.py) in pytest: a bounded number of
clusters the API server accepts, and of clusters it would refuse, each through the agent into
the real libnftables, through ``render`` into ``nft -f`` and through the iptables variant, each
in a namespace of the test's: never a refused batch, never a traceback. The long run:
``tools/fuzz_objects.py``."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from . import objectfuzz
from .conftest import netns_factory

pytestmark = pytest.mark.kernel
FUZZ = settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def namespaces():
    """The nft namespace, and one per iptables loader (iptables-nft's rules would keep
    iptables-legacy from destroying a set)."""
    with netns_factory("fuzz") as make:
        yield make(), {loader: make() for loader in ("nft", "legacy")}


@FUZZ
@given(objects=objectfuzz.cluster(), loader=st.sampled_from(["nft", "legacy"]))
def test_what_the_api_server_accepts_loads_everywhere(namespaces, objects, loader):
    assert objectfuzz.trial(objects, namespaces[0], namespaces[1][loader], loader).refused == []


@FUZZ
@given(objects=objectfuzz.refused_by_the_api(), loader=st.sampled_from(["nft", "legacy"]))
def test_what_the_api_server_refuses_is_refused_by_our_validation_and_the_rest_loads(namespaces, objects, loader):
    assert objectfuzz.trial(objects, namespaces[0], namespaces[1][loader], loader).refused == []
