"""Compile the GPU launch plans' kernels for an H100 (sm_90) on a machine without a GPU.

    python tests/gpu_compile_check.py        (TRITON_INTERPRET must not be set)

The Triton interpreter runs the kernels' semantics on the CPU but never lowers them, so a
kernel that only the compiler rejects (loop-carried types, layouts, ptxas) would pass the CPU
suite. This builds each call description with its GPU plan (the tile sizes, warps and stages
a GPU launch uses), compiles it ahead of time through Triton's own pipeline down to a cubin
(ptxas ships with the triton wheel), and exits 1 naming every kernel that fails.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("gpu_compile_check.py: unset TRITON_INTERPRET (it must lower the kernels, not interpret them)")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ot_triton_jax.core import kernel_calls as kc, multiscale_calls as mc, multiscale_rules as rules, pair_plans  # noqa: E402

POINTER_TYPES = {"ranges": "*i32", "keep": "*i8"}  # every other array is float32, unless the call's dtypes say
DTYPE_POINTERS = {"float16": "*fp16", "float32": "*fp32", "int32": "*i32", "int8": "*i8", "int64": "*i64"}
TARGET = GPUTarget("cuda", 90, 32)


def compile_call(call: kc.KernelCall) -> int:
    """Compile one launch description; the cubin's size in bytes."""
    out_types = {o.name: DTYPE_POINTERS[o.dtype] for o in call.outputs}
    fn, values = call.kernel, iter(list(call.args) + [o.name for o in call.outputs])
    sig, consts = {}, {}
    for name, param in zip(fn.arg_names, fn.params):
        if param.is_constexpr:
            consts[name] = call.constexprs[name] if name in call.constexprs else param.default
            sig[name] = "constexpr"
        else:
            value = next(values)
            sig[name] = "i32" if isinstance(value, int) else (
                DTYPE_POINTERS[call.dtypes[value]] if value in call.dtypes else
                out_types.get(value) or POINTER_TYPES.get(value, "*fp32"))
    # pointers 16-byte aligned, as Triton's launcher specializes them (vector loads)
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*")}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=TARGET,
                            options={"num_warps": call.plan.num_warps, "num_stages": call.plan.num_stages})
    return len(kernel.asm["cubin"])


def sequences() -> dict[str, kc.CallSequence]:
    """One description per kernel path of the GPU plans (d: resident FMA-sized, 3, 64; both
    precisions; FOLD on and off; the symmetric pair; the block-sparse kernels at d <= 3)."""
    n = 8192
    seqs = {}
    for d in (3, 64):
        for prec in ("float32", "tf32"):
            for fold in (False, True):
                seqs[f"lse d={d} {prec} fold={fold}"] = kc.lse_update(n, n, d, prec, True, True, True, True, True, fold)
            seqs[f"apply d={d} {prec}"] = kc.apply_plan(n, n, d, 3 if d <= 8 else d, prec, True)
            seqs[f"weighted d={d} {prec}"] = kc.apply_weighted(n, n, d, d, 1, prec, True)
    for d in (3, 20, 64):  # the symmetric update's sweep and finishing kernels, both paths with a resident x
        for prec in ("float32", "tf32"):
            seqs[f"lse_pair d={d} {prec}"] = kc.lse_pair(n, n + 16, d, prec, True)
            seqs[f"lse_self d={d} {prec}"] = kc.lse_self(n, d, prec, True)
            mode, pair_plans.SELF_MODE = pair_plans.SELF_MODE, "triangle"  # the SELF sweep, default or not
            kc.lse_self.cache_clear()
            seqs[f"lse_self triangle d={d} {prec}"] = kc.lse_self(n, d, prec, True)
            pair_plans.SELF_MODE = mode
            kc.lse_self.cache_clear()
    seqs["exact_row_mass d=3"] = kc.exact_row_mass(n, n, 3, True)
    lab = (3, 4)  # the label cost (kernels/label_tiles.py) on every dense path
    for d in (3, 64):
        for prec in ("float32", "tf32"):
            for fold in (False, True):
                seqs[f"lse labels d={d} {prec} fold={fold}"] = kc.lse_update(n, n, d, prec, True, True, True, True, True,
                                                                            fold, labels=lab)
            seqs[f"apply labels d={d} {prec}"] = kc.apply_plan(n, n, d, 3 if d <= 8 else d, prec, True, labels=lab)
            seqs[f"weighted labels d={d} {prec}"] = kc.apply_weighted(n, n, d, d, 1, prec, True, labels=lab)
        seqs[f"lse labels paired d={d}"] = kc.lse_update(65536, 65536, d, "float32", True, True, False, True, False,
                                                         True, labels=lab)
        seqs[f"lse_pair labels d={d}"] = kc.lse_pair(n, n + 16, d, "float32", True, labels=lab)
        seqs[f"lse_self labels d={d}"] = kc.lse_self(n, d, "float32", True, labels=(3, 3))
    seqs["lse labels d=96"] = kc.lse_update(n, n, 96, "float32", True, True, True, True, True, False, labels=lab)
    for fold in (False, True):  # rows sorted by label (kernels/lse_update.py, GROUPED, d > 16)
        seqs[f"lse labels grouped d=64 fold={fold}"] = kc.lse_update(65536, 65536, 64, "float32", True, True, False,
                                                                     True, fold, fold, labels=lab, grouped=True)
    seqs["exact_row_mass labels d=3"] = kc.exact_row_mass(n, n, 3, True, labels=lab)
    seqs["split d=3"] = kc.split_centered(n, 3, True, 128)
    seqs["absmax d=64"] = kc.absmax(n, n, 64, True)
    seqs["split d=64 (fp16 parts)"] = kc.split_centered(n, 64, True, 128)
    for prec in ("float32", "tf32"):  # the looped path (d > 64) with FP16 parts
        seqs[f"lse d=96 {prec}"] = kc.lse_update(n, n, 96, prec, True, True, True, True, True, False)
        seqs[f"apply d=96 {prec}"] = kc.apply_plan(n, n, 96, 96, prec, True)
    for prec in ("float32", "tf32"):
        for fold in (False, True):
            seqs[f"lse_blocksparse d=3 {prec} fold={fold}"] = mc.lse_blocksparse(n, n, 3, 100, prec, True, True, True,
                                                                                  True, fold)
        for p in (0, 3, 16):
            seqs[f"apply_blocksparse d=3 {prec} p={p}"] = mc.apply_plan_blocksparse(n, n, 3, 100, p, prec, True)
        for d in (1, 3):  # the softmin mean on the tensor cores (TGT_MEAN)
            seqs[f"apply_blocksparse d={d} {prec} target_mean"] = mc.apply_plan_blocksparse(n, n, d, 100, d, prec, True,
                                                                                            True)
    for d in (1, 3):
        seqs[f"pair_keep d={d}"] = mc.pair_keep(2000, 1500, d, True, True)
        seqs[f"pair_fixup d={d}"] = mc.pair_fixup(2000, 1500, d, True, True)
        seqs[f"lift_gathered d={d}"] = mc.lift_gathered(n, 300, d, True)
        seqs[f"pair_dropped d={d}"] = mc.pair_dropped(2000, 1500, d, True)
    seqs["mask_row_counts"] = mc.mask_row_counts(2000, 1500, True)
    for rows in (False, True):
        seqs[f"mask_row_lists rows={rows}"] = mc.mask_row_lists(2000, 1500, True, rows)
    for d, p in ((d, p) for d in (1, 2, 3) for p in rules.TAYLOR_ORDERS):  # the Taylor pass (torch_api/multiscale/taylor.py)
        seqs[f"taylor_monomials d={d} p={p}"] = mc.taylor_monomials(n, d, True, p)
        seqs[f"taylor_moments d={d} p={p}"] = mc.taylor_moments(5000, 300, 2, d, True, p)
        seqs[f"taylor_evaluate d={d} p={p}"] = mc.taylor_evaluate(300, 2, d, True, p)
        seqs[f"taylor_evaluate mean d={d} p={p}"] = mc.taylor_evaluate(300, 2, d, True, p, True, 1000)
        seqs[f"taylor_monomials mean d={d} p={p}"] = mc.taylor_monomials(n, d, True, p, True, 1000)
    return seqs


def main() -> int:
    failed = []
    for label, seq in sequences().items():
        for call in seq.calls:
            try:
                size = compile_call(call)
                print(f"ok   {label}: {call.kernel.__name__} ({size} bytes)", flush=True)
            except Exception as exc:  # every failure is reported, the exit status says there was one
                failed.append(f"{label}: {call.kernel.__name__}")
                print(f"FAIL {label}: {call.kernel.__name__}: {type(exc).__name__}: {str(exc)[:800]}", flush=True)
    print(f"{len(failed)} failed" + (": " + "; ".join(failed) if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
