"""Time the warp-specialised fused-backward skeletons (fused_bwd_ws.py, fused_bwd_ws2.py) at B8 T4096 H16 HV32 in
their variants, and print the per-phase clock profile of the profiled one."""
import sys, torch, tilelang, triton
sys.path.insert(0, 'benchmarks/experiments'); sys.path.insert(0, '.')
import fused_bwd_ws as fw
import fused_bwd_ws2 as fw2
from kernels.build import pass_configs, TARGET
dev = torch.device("cuda")
print(torch.cuda.get_device_name())
# (name, build options); "v2": fused_bwd_ws2's build.  The profile printed is the last profiled variant's.
variants = [("ws", dict(nreg=(184, 144, 160, 24))),
            ("nt", dict(nreg=(184, 144, 160, 24), nt=True)),
            ("nt, no yv / sd dots", dict(nreg=(176, 168, 144, 24), yv=False, sdd=False, nt=True)),
            ("nt, no dots, q k dUl kept", dict(nreg=(176, 168, 144, 24), yv=False, sdd=False, nt=True, reload_qk=False)),
            ("ws2", dict(v2=1)),
            ("ws2 local 192/168/128", dict(v2=1, local=True, nreg=(192, 168, 128, 24))),
            ("ws2 late 192/168/128", dict(v2=1, local=True, late=True, nreg=(192, 168, 128, 24))),
            ("ws2 late early_p 192/168/128", dict(v2=1, local=True, late=True, early_p=True, nreg=(192, 168, 128, 24))),
            ("ws2 late rect 192/168/128", dict(v2=1, local=True, late=True, rect=True, nreg=(192, 168, 128, 24))),
            ("ws2 late, profiled", dict(v2=1, local=True, late=True, profile=True, nreg=(192, 168, 128, 24)))]
N, T_, H, HV = 8, 4096, 16, 32
Ttot, NC, D, BT = N * T_, N * T_ // 64, 128, 64
r = lambda *s, dt=torch.float16: (torch.randn(*s, device=dev) * 0.1).to(dt)
q, k = r(Ttot, H, D), r(Ttot, H, D)
v, do = r(Ttot, HV, D), r(Ttot, HV, D)
S, U, Th = r(HV, NC, D, D), r(HV, NC, BT, D), r(HV, NC, BT, BT)
Fb = torch.rand(HV, NC, 8, BT, device=dev)
dUl = r(HV, NC, D, BT, dt=torch.float32)
dq, dk = torch.empty(Ttot, HV, D, device=dev), torch.empty(Ttot, HV, D, device=dev)
dv = torch.empty(Ttot, HV, D, device=dev, dtype=torch.float16)
rows = torch.empty(6, HV, NC, BT, device=dev)
sd = torch.empty(HV, NC, D, device=dev)
cu = torch.arange(0, N + 1, device=dev, dtype=torch.int32) * T_
prof = torch.zeros(4, 64, 8, device=dev, dtype=torch.int64)
res = []
for name, kw in variants:
    try:
        v2 = kw.pop('v2', 0)
        kern = tilelang.compile((fw2 if v2 else fw).build(**kw), target=TARGET, pass_configs=pass_configs())
        dU = dUl.view(HV, NC, BT, D) if v2 or kw.get("nt") else dUl
        f = lambda: kern(q, k, v, do, S, U, Th, Fb, dU, dq, dk, dv, rows, sd, cu, prof)
        f(); torch.cuda.synchronize()
        res.append((name, triton.testing.do_bench(f, warmup=5, rep=50), bool(torch.isfinite(dq).all() and torch.isfinite(dk).all())))
    except Exception as e:
        res.append((name, float("nan"), repr(e)[:300]))
    print(res[-1], flush=True)
p = prof.cpu().double()
st = p[:, :, :4]
ends = torch.cat([st[:, :, 1:], torch.cat([st[:, 1:, :1], st[:, -1:, :1]], 1)], 2)   # the next phase start
dur = (ends - st)[:, 4:60, :]
work = (p[:, :, 4:] - st)[:, 4:60, :]
tot = (p[0, 60, 0] - p[0, 4, 0]) / 56
print(f"cycles a chunk (WG0 P1 to P1): {tot:.0f}")
for w in range(3):
    print(f"WG{w} phase / to its arrive, cycles (median, chunks 4..59): " + "  ".join(f"P{j + 1} {dur[w, :, j].median():.0f}/{work[w, :, j].median():.0f}" for j in range(4)))
ctas = HV * N
for name, ms, fin in res:
    print(f"{name:28s} B{N} T{T_} HV{HV}: {ms:.3f} ms  {ms * 1e3 / (NC // N) / -(-ctas // 132):.2f} us a chunk a CTA  finite={fin}")
