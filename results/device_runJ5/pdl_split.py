"""Diagnostic (run J5): the end-to-end step with PDL for a subset of the kernels. argv[1] in
{all, none, attention, gemm}; the rest are `fdpp.bench e2e` arguments. KernelCall's pdl flag is
overridden by the config's type (attention: DecodeConfig / CombineConfig; gemm: flat_gemm configs)."""
import sys

from fdpp import configs, launch

which = sys.argv.pop(1)
orig = launch.KernelCall.__init__


def init(self, config, *a, pdl=False, **kw):
    att = isinstance(config, (configs.DecodeConfig, configs.CombineConfig))
    want = {"all": pdl, "none": False, "attention": pdl and att, "gemm": pdl and not att}[which]
    orig(self, config, *a, pdl=want, **kw)


launch.KernelCall.__init__ = init
from fdpp import bench_e2e  # noqa: E402

sys.exit(bench_e2e.main(sys.argv[1:]))
