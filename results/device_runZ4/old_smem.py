import runpy
import sys

sys.path.insert(0, ".")  # run from scripts/: probe_pipeline imports probe_cluster beside it
from fdpp import configs
from fdpp.configs import ELEMENT_TYPES, INT4_FORMATS

_orig = configs.DecodeConfig.smem_bytes
def smem_old(self):  # 3eef859's layout: every 8-bit V row padded by 16 bytes
    n = _orig(self)
    if self.mma and ELEMENT_TYPES[self.kv_dtype].itemsize == 1 and self.kv_dtype not in INT4_FORMATS and self.head_dim >= 128:
        n = max(n, self.num_stages * self.tile_tokens * (2 * self.head_dim + 16))
    return n
configs.DecodeConfig.smem_bytes = smem_old
sys.argv = ["probe_pipeline.py", *sys.argv[1:]]
runpy.run_path("probe_pipeline.py", run_name="__main__")
