"""Shared scalar helpers of the mHC Sinkhorn-Knopp kernels (``kernels/mhc.py``).

Pure ``@triton.jit`` code, used by both layouts (``mhc_soa.py``,
``mhc_soa_implicit.py``, ``mhc_tile.py``): exact or approximate division
(``FAST``), the run-time eps of ``PARAMS``, one scaling step and the eps
term of its adjoint. Semantics: the docstring of ``kernels/mhc.py``.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _div(a, b, FAST: tl.constexpr):
    """a / b; FAST (GPU only): div.approx.ftz.f32."""
    if FAST:
        return tl.inline_asm_elementwise("div.approx.ftz.f32 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return a / b


@triton.jit
def _rcp(b, FAST: tl.constexpr):
    """1 / b; FAST (GPU only): rcp.approx.ftz.f32."""
    if FAST:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [b],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return 1.0 / b


@triton.jit
def _load_eps(PARAMS, HAS_EPS: tl.constexpr):
    """(eps, log eps); eps is the constant 0.0 unless HAS_EPS."""
    if HAS_EPS:
        eps = tl.load(PARAMS).to(tl.float32)
        log_eps = tl.where(eps > 0.0, tl.log(tl.where(eps > 0.0, eps, 1.0)), float("-inf"))
    else:
        eps = 0.0
        log_eps = float("-inf")
    return eps, log_eps


@triton.jit
def _scale_step(v, s, eps, HAS_EPS: tl.constexpr, FAST: tl.constexpr):
    """v / (v * s + eps), s = (K y) or (K^T x): one row or column step on a scaling."""
    if HAS_EPS:
        return _div(v, v * s + eps, FAST)
    else:
        return _rcp(s, FAST)


@triton.jit
def _damp(vb, vc, vp, eps, FAST: tl.constexpr):
    """Adjoint of v in v' = v / (v s + eps), given that of v': vb * eps * (v'/v)^2."""
    q = _div(vc, vp, FAST)
    return vb * (eps * q * q)
