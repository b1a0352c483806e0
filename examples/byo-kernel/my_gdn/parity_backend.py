import torch

from cases.distributions import get_distribution
from parity.backends.base import Backend


class MyGDN(Backend):
    name = "my-gdn"  # equals the entry point's name
    description = "my_gdn: fp32 token-by-token recurrence"
    packages = ("my-gdn",)  # distributions whose versions a run records

    def available(self):  # (ok, reason); must not raise: import GPU packages inside methods only
        return True, ""

    def supports(self, case, device):  # (ok, reason): unsupported cells are skipped with the reason
        dist = get_distribution(case.dist)
        if case.layout != "dense" or case.state_v_first or dist.gate_in_kernel or dist.beta_sigmoid_in_kernel:
            return False, "dense [B, T] inputs, K-first state, gates and beta already transformed"
        return True, ""

    def _forward(self, x):  # x: parity GDNInputs; q, k [B,T,H,K], v [B,T,HV,V], g, beta [B,T,HV]
        q, k, v, g, beta = (t.float() for t in (x.q, x.k, x.v, x.g, x.beta))
        if x.use_qk_l2norm_in_kernel:
            q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
        rep = v.shape[2] // q.shape[2]  # GVA: value head j reads q/k head j // rep
        q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
        B, T, HV, V = v.shape
        S = q.new_zeros(B, HV, q.shape[-1], V) if x.initial_state is None else x.initial_state.float()
        o = torch.empty_like(v)
        for t in range(T):
            S = S * g[:, t].exp()[..., None, None]
            u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
            S = S + k[:, t, :, :, None] * u[:, :, None, :]
            o[:, t] = (x.scale or q.shape[-1] ** -0.5) * torch.einsum("bhkv,bhk->bhv", S, q[:, t])
        return o.to(x.v.dtype), S, "my_gdn/loop-fp32"  # (o, final state [N, HV, K, V], impl that ran)
