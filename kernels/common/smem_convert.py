"""bf16 tiles converted to fp16 in shared memory, in place: what lets a kernel on fp16 operands take the caller's
bf16 inputs by TMA without fp16 copies of them in global memory.  A kernel that converts calls
``T.import_source(CONVERT_TILE)`` once, then ``convert_tile`` on each tile once its TMA load has landed."""

import tilelang.language as T

# the threads that convert in a warp-specialised kernel: its 128-thread producer warpgroup less the warp that loads
PRODUCER_SPARE_THREADS = 128 - 32

# bf16 pairs to fp16 pairs in place, 16 bytes a step: rd(x s), round to nearest even (as ``gdn_bwd_convert``: exact
# for bf16 values x s within fp16's normal range; fast math flushes subnormal inputs)
CONVERT_TILE = r"""
__device__ __forceinline__ void gdn_bf16_to_f16_tile(void* p, int n, float s, int t, int nt) {
  uint4* a = reinterpret_cast<uint4*>(p);
  for (int i = t; i < n; i += nt) {
    uint4 w = a[i];
    unsigned int* u = reinterpret_cast<unsigned int*>(&w);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float lo = __uint_as_float(u[j] << 16) * s, hi = __uint_as_float(u[j] & 0xffff0000u) * s;
      asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(u[j]) : "f"(hi), "f"(lo));
    }
    a[i] = w;
  }
}
"""


@T.macro
def convert_tile(tile, n, s, t, nt):
    """The ``n`` elements of the shared tile (or stage) ``tile`` (fp16, holding bf16 values as TMA stored them) as
    fp16 ``rd(x s)`` in place, by thread ``t`` of ``nt`` (an elementwise pass over its bytes, 16 at a time: the
    tile's swizzle does not matter), then fenced for the wgmma that read it."""
    T.call_extern("handle", "gdn_bf16_to_f16_tile", T.access_ptr(tile, "rw"), n // 8, s, t, nt)
    T.fence_proxy_async()
