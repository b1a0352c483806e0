"""Lowering check (sm_90a, no GPU): a bf16 ``T.view`` of an fp16 wgmma tile takes the TMA load of bf16 rows and is
converted in place to fp16 (times a power of two) before a wgmma reads it.  Prints the shared-memory offsets and the
TMA loads; the conversion loop reads and writes each thread's 8 elements at one swizzled address."""
import tilelang, re
import tilelang.language as T
from tilelang import tvm

BT, D = 64, 128

def build():
    Ttot = T.dynamic("Ttot")
    @T.prim_func
    def cvt(q: T.Tensor((Ttot, D), "bfloat16"), k: T.Tensor((Ttot, D), "float16"), o: T.Tensor((Ttot, BT), "float32")):
        with T.Kernel(Ttot // BT, threads=256) as (c,):
            q_s = T.alloc_shared((BT, D), "float16")
            k_s = T.alloc_shared((BT, D), "float16")
            qb = T.view(q_s, (BT, D), "bfloat16")
            acc = T.alloc_fragment((BT, BT), "float32")
            bar = T.alloc_barrier(arrive_count=32)
            cv = T.alloc_barrier(arrive_count=128)
            tx = T.get_thread_binding()
            if tx < 128:
                T.barrier_wait(bar, 0)
                for t, d in T.Parallel(BT, D):
                    q_s[t, d] = T.cast(T.cast(qb[t, d], "float32") * 0.5, "float16")
                T.fence_proxy_async()
                T.gemm(q_s, k_s, acc, transpose_B=True, clear_accum=True)
                T.copy(acc, o[c * BT:(c + 1) * BT, 0:BT])
            else:
                if tx < 160:
                    T.tma_copy(q[c * BT:(c + 1) * BT, 0:D], qb, barrier=bar)
                    T.tma_copy(k[c * BT:(c + 1) * BT, 0:D], k_s, barrier=bar)
                    T.barrier_arrive(bar)
    return cvt

target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
with tvm.transform.PassContext(opt_level=3, config={tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}), target:
    art = tilelang.lower(build(), target=target)
src = art.kernel_source

print(re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\);", src))
for l in src.splitlines():
    if 'tma_load' in l or 'CUtensorMap' in l[:60]:
        print(l.strip()[:200])
