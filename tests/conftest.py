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
    # fresh inputs per test, reproducible from the test's name
    return np.random.default_rng(abs(hash(request.node.nodeid)) % (2**32))
