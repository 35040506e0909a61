"""torch_api.multiscale.anderson on the map it accelerates: the alternating Sinkhorn map on f in
float64 (small shifted Gaussian clouds at a small eps, where plain iterations crawl): Anderson
reaches the fixed point in far fewer steps, to the same potentials (up to the gauge)."""

import torch

from torch_api.multiscale.anderson import AndersonMixer, extrapolate, mixing


def _sinkhorn_map(n=40, eps=0.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g, dtype=torch.float64)
    y = torch.randn(n, 2, generator=g, dtype=torch.float64) + 0.5
    c = 0.5 * torch.cdist(x, y) ** 2
    lw = torch.full((n,), -torch.log(torch.tensor(float(n), dtype=torch.float64)))

    def softmin(cost, pot):
        return -eps * torch.logsumexp(lw[None] + (pot[None] - cost) / eps, 1)

    return lambda f: softmin(c, softmin(c.T, f))


def _steps(T, accelerate, tol=1e-5, cap=5000):
    f, mixer = torch.zeros(40, dtype=torch.float64), AndersonMixer(5)
    for k in range(cap):
        tf = T(f)
        r = tf - f
        if float((r - r.mean()).abs().max()) < tol:
            return k, f
        f = mixer.step(f, tf)[0] if accelerate else tf
    return cap, f


def test_anderson_reaches_the_same_fixed_point_in_far_fewer_steps():
    T = _sinkhorn_map()
    k_plain, f_plain = _steps(T, False)
    k_aa, f_aa = _steps(T, True)
    assert k_plain < 5000 and k_aa * 4 < k_plain  # measured: 4034 plain, 324 Anderson steps
    d = (f_aa - f_plain) - (f_aa - f_plain).mean()
    assert float(d.abs().max()) < 1e-3  # both stop at residual 1e-5; the slow modes leave ~1e-4 between them


def test_mixing_solves_the_least_squares_and_the_history_is_bounded():
    g = torch.Generator().manual_seed(1)
    res = torch.randn(30, 4, generator=g, dtype=torch.float64)
    gamma = mixing(res)
    dr = res[:, 1:] - res[:, :-1]
    ref = torch.linalg.lstsq(dr, res[:, -1:]).solution[:, 0]
    assert torch.allclose(gamma, ref, rtol=1e-6, atol=1e-9)
    tf = [torch.randn(30, generator=g, dtype=torch.float64) for _ in range(4)]
    assert torch.allclose(extrapolate(tf, gamma), tf[-1] - torch.stack([tf[i + 1] - tf[i] for i in range(3)], 1) @ gamma)
    mixer = AndersonMixer(3)
    for t in tf + tf:
        mixer.step(torch.zeros(30, dtype=torch.float64), t)
    assert len(mixer.tf) == 3 and len(mixer.res) == 3
