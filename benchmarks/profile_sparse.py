"""One sparse MLA case launched a few times, for ``ncu`` (no timing here):

ncu --clock-control none -k regex:_sparse_mla_kernel -s 2 -c 1 python3 benchmarks/profile_sparse.py T H W
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_swa_kernels import BLOCK, DEV, SCALE, fill_cache, make_window_case  # noqa: E402

from fastdeploy.model_executor.ops.triton_ops.sparse_mla_kernel import (  # noqa: E402
    default_num_splits,
    launch_sparse_mla,
    tuned_config,
)
from fastdeploy.model_executor.ops.triton_ops.swa_indexer_kernel import launch_swa_indexer  # noqa: E402

T, H, W = (int(x) for x in sys.argv[1:4])
g = torch.Generator().manual_seed(0)
pos, bid, bt, nblocks = make_window_case(T, W, -1 if T <= 256 else 0, g)
idx = torch.empty(T, W, dtype=torch.int32, device=DEV)
launch_swa_indexer(pos, bid, bt, idx, BLOCK, W)
cache = fill_cache(nblocks, g)
q = torch.randn(T, H, 576, device=DEV).bfloat16()
out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=DEV)
lse = torch.empty(T, H, device=DEV)
cfg = tuned_config(T, H)
ns = default_num_splits(T, H, W, cfg["block_h"], cfg["block_n"])
part = torch.empty(T, ns, H, 512, device=DEV) if ns > 1 else None
part_l = torch.empty(T, ns, H, device=DEV) if ns > 1 else None
for _ in range(4):
    launch_sparse_mla(q, cache, idx, out, lse, SCALE, num_splits=ns, partial=part, partial_lse=part_l)
torch.cuda.synchronize()
print("profiled", T, H, W, cfg, "splits", ns)
