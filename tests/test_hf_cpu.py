"""fdpp.integrations.hf on the CPU (fdpp's NumPy emulator): skipped without torch and transformers
(CI has neither); the GPU version is tests/test_gpu_hf.py."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_decode import decode, small_llama  # noqa: E402

import fdpp.integrations.hf as fdpp_hf  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:fdpp. no GPU found:RuntimeWarning")


@pytest.mark.parametrize("padded", [False, True])
def test_fdpp_decoding_matches_sdpa_on_cpu(padded):
    fdpp_hf.register()
    ref = small_llama(torch, transformers, "sdpa", torch.float32, "cpu", layers=2, heads=4, head_dim=64)
    fd = small_llama(torch, transformers, "fdpp", torch.float32, "cpu", layers=2, heads=4, head_dim=64)
    assert fd.config._attn_implementation == "fdpp" and ref.config._attn_implementation == "sdpa"
    calls = []
    orig = fdpp_hf._call

    def spy(fn, *a, **kw):
        calls.append(fn.__name__)
        return orig(fn, *a, **kw)

    prompt = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = None
    if padded:
        mask = torch.ones(2, 9, dtype=torch.long)
        mask[1, :4] = 0  # left padding of row 1
    with torch.no_grad():
        want, toks = decode(torch, ref, prompt, 6, mask)
        fdpp_hf._call = spy
        try:
            got, _ = decode(torch, fd, prompt, 6, mask, tokens=toks)
        finally:
            fdpp_hf._call = orig
    assert calls == ["paged_decode_attention" if padded else "decode_attention"] * (6 * 2)  # decode steps only
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if padded:  # the mask matters: row 1 without it is another sequence
        with torch.no_grad():
            unmasked, _ = decode(torch, fd, prompt, 1, None, tokens=toks)
        assert float((unmasked[1, 1] - want[1, 1]).abs().max()) > 1e-2


def test_use_fdpp_switches_a_built_model():
    ref = small_llama(torch, transformers, "sdpa", torch.float32, "cpu", layers=1, heads=4, head_dim=64)
    assert fdpp_hf.use_fdpp(ref) is ref and ref.config._attn_implementation == "fdpp"


def test_decode_inputs_fdpp_cannot_serve():
    import types

    mod = types.SimpleNamespace(training=True)
    q, k = torch.zeros(1, 4, 1, 64), torch.zeros(1, 2, 8, 64)
    with pytest.raises(ValueError, match="dropout"):
        fdpp_hf.fdpp_attention_forward(mod, q, k, k, None, dropout=0.1)
    with pytest.raises(ValueError, match="softcap"):
        fdpp_hf.fdpp_attention_forward(types.SimpleNamespace(training=False), q, k, k, None, softcap=30.0)
    with pytest.raises(ValueError, match="all heads"):
        fdpp_hf.fdpp_attention_forward(mod, q, k, k, torch.ones(1, 4, 1, 8, dtype=torch.bool))
