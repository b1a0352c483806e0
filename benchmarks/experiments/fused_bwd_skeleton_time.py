"""Time the fused-backward skeleton at B8 T4096 HV32 (one CTA per (value head, sequence), 64 chunks each)."""
import sys, torch, tilelang, triton
sys.path.insert(0, 'benchmarks/experiments'); sys.path.insert(0, '.')
import fused_bwd_skeleton as fp
from kernels.build import pass_configs
from kernels.build import TARGET
kern = tilelang.compile(fp.build(512), target=TARGET, pass_configs=pass_configs())
dev = torch.device("cuda")
for (N, T_, HV) in ((8, 4096, 32), (1, 32768, 32)):
    Ttot, NC, D, BT = N * T_, N * T_ // 64, 128, 64
    r = lambda *s, dt=torch.float16: (torch.randn(*s, device=dev) * 0.1).to(dt)
    q, k, do = r(Ttot, HV, D), r(Ttot, HV, D), r(Ttot, HV, D)
    S, U, Th = r(HV, NC, D, D), r(HV, NC, BT, D), r(HV, NC, BT, BT)
    Fb = torch.rand(HV, NC, 8, BT, device=dev)
    dUl = r(HV, NC, D, BT, dt=torch.float32)
    dq, dk = torch.empty(Ttot, HV, D, device=dev), torch.empty(Ttot, HV, D, device=dev)
    dv = torch.empty(Ttot, HV, D, device=dev, dtype=torch.float16)
    rows = torch.empty(4, HV, NC, BT, device=dev)
    cu = torch.arange(0, N + 1, device=dev, dtype=torch.int32) * T_
    f = lambda: kern(q, k, do, S, U, Th, Fb, dUl, dq, dk, dv, rows, cu)
    f(); torch.cuda.synchronize()
    ms = triton.testing.do_bench(f, warmup=5, rep=50)
    ctas = HV * N
    print(f"skeleton N{N} T{T_} HV{HV}: {ms:.3f} ms, {ctas} CTAs x {NC // N} chunks, "
          f"{ms * 1e3 / (NC // N) / max(1, -(-ctas // 132)):.2f} us a chunk a CTA, finite={bool(torch.isfinite(dq).all())}")
