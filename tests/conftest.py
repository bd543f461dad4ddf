import os
import zlib

import numpy as np
import pytest

import fdpp


def pytest_collection_modifyitems(config, items):
    if fdpp.gpu_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU (CuPy sees no device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    # Fresh inputs per test, reproducible from the test's name: crc32, not hash(),
    # which Python salts per process. FDPP_TEST_SEED=<int> draws another set.
    base = int(os.environ.get("FDPP_TEST_SEED", "0"))
    return np.random.default_rng([base, zlib.crc32(request.node.nodeid.encode())])
