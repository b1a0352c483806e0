"""Session 10 follow-up: why the fused dqk kernel's group loop (commit 004ef1f, copied to .gpu/dqk_loop.py) is
slower than the per-head kernel.  --time: do_bench of the per-head kernel and of the loop kernel at one and two
value heads per CTA (B1 T32768 H16 HV32, random tables); --one NAME: three launches of one of them (for ncu)."""
import importlib.util
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
import tilelang  # noqa: E402

from benchmarks.ablate_bwd import tables  # noqa: E402
from kernels.gdn_bwd.build import BwdConfig, get_kernel  # noqa: E402
from kernels.gdn_fwd.build import TARGET, pass_configs  # noqa: E402

spec = importlib.util.spec_from_file_location("kernels.gdn_bwd.dqk_loop", ".gpu/dqk_loop.py")
m = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = m
spec.loader.exec_module(m)
pc = dict(pass_configs())
pc[tilelang.PassConfigKey.TL_ENABLE_AGGRESSIVE_SHARED_MEMORY_MERGE] = True
loopk = tilelang.compile(m.build_bwd_dqk_fused(128, 128, "bfloat16"), target=TARGET, pass_configs=pc)
perk = get_kernel(BwdConfig("dqk", "bfloat16"))
dev = torch.device("cuda")
B, T, H, HV = 1, 32768, 16, 32
a = tables(B, T, H, HV, dev, kernel="dqk")
g = list(a)                                   # HB = H: the group sums, fp32 (out32 = 1)
g[15] = torch.zeros(B * T, H, 128, device=dev)
g[16] = torch.zeros_like(g[15])
g[17] = torch.zeros(B * T, H, 128, device=dev, dtype=torch.bfloat16)
g[18] = torch.zeros_like(g[17])
runs = {"perhead": lambda: perk(*a), "loop1": lambda: loopk(*a), "loop2": lambda: loopk(*g)}
if sys.argv[1] == "--time":
    from triton.testing import do_bench
    for name, fn in runs.items():
        ms = do_bench(fn, warmup=3, rep=20, return_mode="median")
        print(f"{name:8s} {ms:.3f} ms", flush=True)
else:
    for _ in range(3):
        runs[sys.argv[2]]()
    torch.cuda.synchronize()
    print("done", sys.argv[2])
