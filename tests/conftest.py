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


@pytest.fixture
def isolated_tuning(tmp_path, monkeypatch):
    """For the tuner tests (which need optuna): no shipped table, a user table dir of the test's own,
    fresh dispatch caches, optuna's log at WARNING."""
    import optuna

    from fdpp import dispatch, tables

    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(tables, "shipped_dir", lambda: shipped)
    monkeypatch.setenv(tables.ENV_DIR, str(tmp_path / "user"))
    dispatch.clear_cache()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    yield
    dispatch.clear_cache()
