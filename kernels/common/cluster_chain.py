"""Ordered hand-offs along a thread-block cluster: CTA r of a cluster waits until CTA r - 1 has stored its part of
a result in global memory, then reads it.  A counter (uint32 in the waiting CTA's shared memory, zeroed and then
cluster-synchronised before the first hand-off) counts the stores: every storing thread, once its own stores are
issued, fences (acq_rel, cluster scope) and adds 1 to the next CTA's counter, and every reading thread spins on its
CTA's counter with acquire loads at cluster scope, so its later loads see every store counted.  A CTA that
calls ``T.import_source(CLUSTER_CHAIN)`` once uses ``chain_signal`` and ``chain_wait``."""

import tilelang.language as T

CLUSTER_CHAIN = r"""
__device__ __forceinline__ void gdn_chain_signal(void* ctr, int rank) {
  unsigned int a = static_cast<unsigned int>(__cvta_generic_to_shared(ctr)), r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  asm volatile("fence.acq_rel.cluster;\n\tred.relaxed.cluster.shared::cluster.add.u32 [%0], 1;" :: "r"(r) : "memory");
}
__device__ __forceinline__ void gdn_chain_wait(void* ctr, int target) {
  unsigned int a = static_cast<unsigned int>(__cvta_generic_to_shared(ctr)), v;
  for (unsigned int n = 0;; ++n) {
    asm volatile("ld.acquire.cluster.shared::cta.u32 %0, [%1];" : "=r"(v) : "r"(a) : "memory");
    if (v >= static_cast<unsigned int>(target)) break;
    if (n == (1u << 25)) __trap();    // ~1 s and more: the hand-off never came; fail, not hang
    __nanosleep(32);
  }
}
"""


@T.macro
def chain_signal(ctr, rank):
    """One count on CTA ``rank``'s counter ``ctr`` (a [1] uint32 shared buffer, at the same offset in every CTA),
    after this thread's earlier stores (ordered before it by a fence at cluster scope)."""
    T.call_extern("handle", "gdn_chain_signal", T.access_ptr(ctr, "rw"), rank)


@T.macro
def chain_wait(ctr, target):
    """Spins until this CTA's counter ``ctr`` holds at least ``target`` (acquire, cluster scope); after 2^25 polls
    (a second or more) the kernel traps, so that a hand-off that never comes fails the launch instead of hanging."""
    T.call_extern("handle", "gdn_chain_wait", T.access_ptr(ctr, "rw"), target)
